//! `ember synth`: writes a synthetic qwen35moe GGUF (random weights, real tokenizer).

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ember_gguf::GgufFile;
use ember_synth::{Plan, Recipe, Shape, SynthOptions};

#[derive(clap::Args)]
pub struct Args {
    /// Output GGUF file.
    #[arg(short, long)]
    output: PathBuf,
    /// Shape preset: tiny (seconds, tests), small (~1.3 GiB at q4_k_m), 35b-a3b (the real shape).
    #[arg(long, default_value = "tiny", conflicts_with = "config")]
    preset: String,
    /// Any other shape of the family: a JSON object (inline, or a path to a .json file) with any
    /// subset of the fields of `ember_synth::Shape`; the rest defaults to 35B-A3B.
    #[arg(long)]
    config: Option<String>,
    /// Quantisation recipe: f16, bf16, q8_0, q4_k_m, ud-q4_k_m.
    #[arg(short, long, default_value = "q4_k_m")]
    quant: String,
    /// Add the MTP block (blk.N with nextn.* tensors).
    #[arg(long)]
    mtp: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Router popularity skew: Zipf exponent over experts (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    skew: f32,
    /// A GGUF whose tokenizer.* keys are copied: a vocabulary-only file or any model of the
    /// family (default: the Qwen3.6 tokenizer carried inside this binary).
    #[arg(long, visible_alias = "tokenizer-from")]
    vocab: Option<PathBuf>,
    /// Threads (default: all).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Replace an existing output file.
    #[arg(short, long)]
    force: bool,
    /// Print the tensor types and sizes, write nothing.
    #[arg(long)]
    dry_run: bool,
}

pub fn main(a: Args) -> Result<()> {
    let (mut shape, preset) = match &a.config {
        Some(c) => {
            let text = if c.trim_start().starts_with('{') {
                c.clone()
            } else {
                std::fs::read_to_string(c).with_context(|| format!("reading --config {c}"))?
            };
            (Shape::from_json(&text)?, "custom".to_owned())
        }
        None => (
            Shape::preset(&a.preset)
                .with_context(|| format!("unknown preset '{}' (use one of {})", a.preset, ember_synth::PRESETS.join(", ")))?,
            a.preset.clone(),
        ),
    };
    if a.mtp {
        shape.n_layer_mtp = 1;
    }
    let recipe = Recipe::parse(&a.quant)?;
    let vocab = match &a.vocab {
        Some(p) => GgufFile::open(p).with_context(|| format!("opening the vocabulary {}", p.display()))?,
        None => ember_synth::bundled_vocab()?,
    };
    let plan = Plan::new(SynthOptions { shape, recipe, seed: a.seed, skew: a.skew, preset }, &vocab)?;

    if a.dry_run {
        print_plan(&plan);
        return Ok(());
    }
    if a.output.exists() && !a.force {
        bail!("{} exists (pass --force to replace it)", a.output.display());
    }
    let total = plan.data_bytes();
    if let Some(free) = free_bytes(&a.output)
        && free < total + (256 << 20)
    {
        bail!("{} needs {:.2} GiB but only {:.2} GiB are free there", a.output.display(), gib(total), gib(free));
    }
    eprintln!(
        "writing {}: {} tensors, {:.3} GiB of tensor data, vocab {} tokens",
        a.output.display(),
        plan.tensors.len(),
        gib(total),
        plan.n_vocab
    );
    for (t, n, b) in ember_synth::type_counts(&plan) {
        eprintln!("  {:<6} {n:>5} tensors {:>10.3} GiB", t.name(), gib(b));
    }

    let partial = a.output.with_extension("gguf.partial");
    let file = std::fs::File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}")
            // unwrap: the template is a constant known to parse.
            .unwrap(),
    );
    let t0 = Instant::now();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(a.threads).build()?;
    let res = pool.install(|| ember_synth::write(&plan, &mut out, &mut |done, _| bar.set_position(done)));
    bar.finish_and_clear();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&partial);
        return Err(e).context("writing the synthetic model");
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    std::fs::rename(&partial, &a.output)?;
    let s = t0.elapsed().as_secs_f64();
    let len = std::fs::metadata(&a.output)?.len();
    eprintln!("wrote {} ({len} bytes, {:.3} GiB) in {s:.1} s ({:.0} MiB/s)", a.output.display(), gib(len), len as f64 / s / 1048576.0);
    Ok(())
}

fn print_plan(plan: &Plan) {
    println!("{:<40} {:<6} {:>24} {:>14}", "tensor", "type", "shape", "bytes");
    for t in &plan.tensors {
        println!(
            "{:<40} {:<6} {:>24} {:>14}",
            t.spec.name,
            t.spec.ggml_type.name(),
            format!("{:?}", t.spec.ne),
            t.spec.n_bytes().unwrap_or(0)
        );
    }
    for (t, n, b) in ember_synth::type_counts(plan) {
        println!("{:<6} {n:>5} tensors {b:>14} B {:>10.3} GiB", t.name(), gib(b));
    }
    println!("total tensor data: {} B ({:.3} GiB)", plan.data_bytes(), gib(plan.data_bytes()));
}

fn gib(b: u64) -> f64 {
    b as f64 / 1073741824.0
}

/// Free bytes on the file system of `path` (via `df`; None if that fails).
fn free_bytes(path: &Path) -> Option<u64> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let out = std::process::Command::new("df").arg("-Pk").arg(dir).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let kib: u64 = text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib * 1024)
}
