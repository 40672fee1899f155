//! `ember bench`: in-process prompt (pp) and generation (tg) throughput at context depths, in
//! the manner of llama-bench so the two can be compared on the same file: the same test names
//! (`pp512`, `tg128`, `pp512@d8192`), a warm-up run before timing, the depth filled untimed
//! once and restored for every repetition, mean and standard deviation over repetitions.
//!
//! Beyond llama-bench: `--prompts real` feeds rotating real text (bench/corpus) instead of
//! random ids, since random ids route to experts unlike text; each tg row reports the weight
//! bytes one generated token reads and the bandwidth that achieves; and `--n-seq 16` runs each
//! test on 16 sequences at once (each restored from the depth, one forward pass per step for
//! all of them: a prompt each, or a token each), reporting the aggregate tokens/s, as
//! llama-batched-bench's S_PP and S_TG (`pp512x16`, `tg128x16@d4096`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use ember_cpu::Precision;
use ember_engine::{Backend, Logits, ModelBackend, Step};
use ember_model::{Model, TensorGroup};
use ember_ops::KvType;
use ember_synth::rng::Rng;
use serde_json::json;

use crate::{device, load};

/// The bundled real-text corpus (see bench/corpus/README.md).
pub const CORPUS: &str = include_str!("../../../bench/corpus/corpus.txt");

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Prompts {
    /// Uniformly random token ids, as llama-bench uses.
    Synthetic,
    /// Rotating real text from the bundled corpus.
    Real,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Md,
    Json,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF.
    #[arg(short, long)]
    model: PathBuf,
    /// Prompt sizes (comma-separated; 0 skips the pp tests).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Generation lengths (comma-separated; 0 skips the tg tests).
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Context depths: tokens already in the context before timing (comma-separated).
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',', default_value = "0")]
    n_depth: Vec<usize>,
    /// Context the placement budgets KV and state for, as a server with `-c` would (default:
    /// what the tests need). Only matters when the model does not fit on the GPU.
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 3)]
    reps: usize,
    /// Where the model runs: auto (the GPU when the whole model fits, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, value_parser = device::parse_device, default_value = "auto")]
    device: device::Device,
    #[command(flatten)]
    place: device::PlaceArgs,
    /// Threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Token source for prompts, depth and generation.
    #[arg(long, value_enum, default_value = "synthetic")]
    prompts: Prompts,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "md")]
    output: Format,
    /// Prompt tokens per forward call when filling the depth (llama-bench's n_ubatch).
    #[arg(long, default_value_t = 512)]
    ubatch: usize,
    #[arg(long, value_parser = load::parse_kv_type, default_value = "f16")]
    kv_type: KvType,
    /// Skip the warm-up run.
    #[arg(long)]
    no_warmup: bool,
    /// Sequences per test (comma-separated): each test also runs on this many sequences at
    /// once, one forward pass per step for all of them (aggregate tokens/s).
    #[arg(long = "n-seq", value_delimiter = ',', default_value = "1")]
    n_seq: Vec<usize>,
}

/// The llama-bench name of a test: `pp512`, `tg128`, with `@d<depth>` when the depth is not 0
/// (llama-bench's markdown writes the same with spaces: `pp512 @ d8192`), and `x<n>` after the
/// sizes when n sequences run at once (`tg128x16@d4096`).
pub fn test_name(n_prompt: usize, n_gen: usize, n_depth: usize, n_seq: usize) -> String {
    let mut base = match (n_prompt, n_gen) {
        (p, 0) => format!("pp{p}"),
        (0, g) => format!("tg{g}"),
        (p, g) => format!("pp{p}+tg{g}"),
    };
    if n_seq > 1 {
        base += &format!("x{n_seq}");
    }
    if n_depth > 0 { format!("{base}@d{n_depth}") } else { base }
}

/// Where test tokens come from: random ids or a cursor rotating through the corpus.
struct TokenSource {
    kind: Prompts,
    rng: Rng,
    n_vocab: u32,
    corpus: Vec<u32>,
    at: usize,
}

impl TokenSource {
    fn take(&mut self, n: usize) -> Vec<u32> {
        match self.kind {
            Prompts::Synthetic => (0..n).map(|_| (self.rng.next_u64() % self.n_vocab as u64) as u32).collect(),
            Prompts::Real => (0..n)
                .map(|_| {
                    let t = self.corpus[self.at % self.corpus.len()];
                    self.at += 1;
                    t
                })
                .collect(),
        }
    }
}

/// Weight bytes one decoded token reads: every trunk tensor (mixers, norms, router, shared
/// expert, LM head), the k routed experts of each layer, and one embedding row. A single token
/// always reads exactly k experts per layer, so this needs no routing statistics.
pub fn bytes_per_token(model: &Model) -> u64 {
    let c = &model.config;
    let mut total = 0u64;
    for t in model.file().tensors() {
        match TensorGroup::of(&t.name, c.n_layer) {
            TensorGroup::Trunk => total += t.n_bytes,
            TensorGroup::RoutedExperts => total += t.n_bytes / c.n_expert as u64 * c.n_expert_used as u64,
            TensorGroup::Embeddings => total += t.n_bytes / c.n_vocab.max(1) as u64,
            TensorGroup::Mtp => {}
        }
    }
    total
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

pub fn main(a: Args) -> Result<()> {
    if a.reps == 0 {
        bail!("-r must be at least 1");
    }
    if a.n_seq.is_empty() || a.n_seq.contains(&0) {
        bail!("--n-seq takes sequence counts of at least 1");
    }
    let max_seq = a.n_seq.iter().copied().max().unwrap_or(1);
    let model = load::open_model(Some(&a.model))?;
    let c = model.config.clone();
    // The largest context a depth's tests need (what the placement budgets state for).
    let longest = a.n_prompt.iter().chain(&a.n_gen).copied().max().unwrap_or(0);
    let bench_ctx = (a.n_depth.iter().copied().max().unwrap_or(0) + longest + 1).max(a.ctx.unwrap_or(0));
    // The largest step: a prompt test runs every sequence's prompt in one forward pass, the
    // depth fills in ubatch chunks, decode one token a sequence.
    let max_prompt = a.n_prompt.iter().copied().max().unwrap_or(0);
    let step_tokens = (max_prompt * max_seq).max(a.ubatch).max(max_seq);
    // One sequence's state, as llama-bench budgets (the snapshot slot the runs restore from
    // holds no KV pages of its own beyond the depth).
    let ops = device::backend(
        a.device,
        Precision::Fast,
        a.threads,
        &device::Placement { file: model.file(), args: &a.place, n_ctx: bench_ctx, parallel: max_seq, kv_type: a.kv_type, step_tokens },
    )?;
    let n_threads = device::threads(a.threads);
    let corpus = match a.prompts {
        Prompts::Real => {
            let tok = load::tokenizer(model.file())?;
            tok.encode(CORPUS, false)
        }
        Prompts::Synthetic => Vec::new(),
    };
    let mut src = TokenSource { kind: a.prompts, rng: Rng::new(1234), n_vocab: c.n_vocab as u32, corpus, at: 0 };

    let file = model.file();
    let model_size: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let n_params: u64 = file.tensors().iter().map(|t| t.n_elements()).sum();
    let model_type = file.get_str("general.name").unwrap_or("qwen35moe").to_owned();
    let bpt = bytes_per_token(&model);
    let cpu = cpu_name();
    let filename = a.model.display().to_string();
    // The engine's forward path (ModelBackend::forward), one sequence at a time.
    let mut backend = ModelBackend::new(model, ops, a.kv_type)?;

    let mut rows = Vec::new();
    for &d in &a.n_depth {
        let tests: Vec<(usize, usize)> =
            a.n_prompt.iter().filter(|&&p| p > 0).map(|&p| (p, 0)).chain(a.n_gen.iter().filter(|&&g| g > 0).map(|&g| (0, g))).collect();
        if tests.is_empty() {
            continue;
        }
        let n_ctx = d + tests.iter().map(|&(p, g)| p + g).max().unwrap_or(0) + 1;
        // The depth is filled once, untimed, and every run starts from a snapshot of it
        // (llama-bench restores a saved state the same way): slots for the base and a run's
        // sequences.
        backend.configure(1 + max_seq, n_ctx, 0)?;
        let mut base = backend.new_state(n_ctx)?;
        if d > 0 {
            let t0 = Instant::now();
            let toks = src.take(d);
            for chunk in toks.chunks(a.ubatch.max(1)) {
                backend.run(&mut base, chunk, Logits::None)?;
            }
            eprintln!("depth {d}: filled in {:.1} s", t0.elapsed().as_secs_f64());
        }
        for (p, g, n) in tests.iter().flat_map(|&(p, g)| a.n_seq.iter().map(move |&n| (p, g, n))) {
            let name = test_name(p, g, d, n);
            let snap = backend.snapshot(&base)?;
            // One run: n sequences restored from the depth, then the prompt (one forward pass
            // for all of them) or the tokens (one pass per step); `toks` holds each sequence's
            // share in turn.
            let run = |backend: &mut ModelBackend<Box<dyn ember_ops::Ops>>, toks: &[u32]| -> Result<f64> {
                let mut states = (0..n).map(|_| backend.restore(&snap, n_ctx)).collect::<std::result::Result<Vec<_>, _>>()?;
                let per = toks.len() / n;
                let t0 = Instant::now();
                if p > 0 {
                    let mut items: Vec<Step<'_, _>> = states
                        .iter_mut()
                        .zip(toks.chunks(per))
                        .map(|(st, t)| Step { tokens: t, state: st, logits: Logits::Last })
                        .collect();
                    backend.forward(&mut items)?;
                } else {
                    // What the engine reads of a decode step for a request with the default
                    // sampler (top-k 40: its 41 best entries) when the backend prefers rows'
                    // best entries to whole rows (a GPU; EMBER_TOP_READS); whole rows otherwise.
                    let top: Vec<Option<(usize, Vec<u32>)>> = if backend.prefers_top() {
                        let need = ember_engine::Sampler::new(ember_engine::SamplerConfig::default())?.top_needed();
                        vec![need.map(|k| (k, Vec::new())); n]
                    } else {
                        Vec::new()
                    };
                    let tops: Option<Vec<(usize, Vec<u32>)>> = top.iter().cloned().collect();
                    match tops.filter(|t| !t.is_empty() && backend.runs_ahead()) {
                        // As the engine decodes (engine/ahead.rs): step i + 1 queued before step
                        // i's entries are read, its tokens fed after.
                        Some(tops) => {
                            // One token slot a sequence; a deferred step does not read it (its tokens come by feed).
                            let fed_later = [0u32];
                            let mut items: Vec<Step<'_, _>> = states
                                .iter_mut()
                                .enumerate()
                                .map(|(j, st)| Step { tokens: &toks[j * per..j * per + 1], state: st, logits: Logits::Last })
                                .collect();
                            backend.submit(&mut items, &tops, false)?;
                            for i in 0..per {
                                let next: Vec<u32> = (0..n).filter(|_| i + 1 < per).map(|j| toks[j * per + i + 1]).collect();
                                let mut deferred = false;
                                if !next.is_empty() {
                                    let mut items: Vec<Step<'_, _>> =
                                        states.iter_mut().map(|st| Step { tokens: &fed_later, state: st, logits: Logits::Last }).collect();
                                    deferred = backend.submit(&mut items, &tops, true)?;
                                }
                                backend.collect()?;
                                if deferred {
                                    backend.feed(&next)?;
                                } else if !next.is_empty() {
                                    let mut items: Vec<Step<'_, _>> = states
                                        .iter_mut()
                                        .zip(&next)
                                        .map(|(st, t)| Step { tokens: std::slice::from_ref(t), state: st, logits: Logits::Last })
                                        .collect();
                                    backend.submit(&mut items, &tops, false)?;
                                }
                            }
                        }
                        None => {
                            for i in 0..per {
                                let mut items: Vec<Step<'_, _>> = states
                                    .iter_mut()
                                    .enumerate()
                                    .map(|(j, st)| Step { tokens: &toks[j * per + i..j * per + i + 1], state: st, logits: Logits::Last })
                                    .collect();
                                if top.is_empty() {
                                    backend.forward(&mut items)?;
                                } else {
                                    backend.forward_top(&mut items, &top, &mut || {})?;
                                }
                            }
                        }
                    }
                }
                Ok(t0.elapsed().as_nanos() as f64)
            };
            if !a.no_warmup {
                // llama-bench: the whole prompt for pp, one token for tg.
                let toks = src.take(n * if p > 0 { p } else { 1 });
                run(&mut backend, &toks)?;
            }
            let tier0 = backend.ops().expert_stats();
            let mut samples_ns = Vec::with_capacity(a.reps);
            for r in 0..a.reps {
                let toks = src.take(n * (p + g));
                let ns = run(&mut backend, &toks)?;
                eprintln!("{name}: run {}/{}: {:.2} tokens/s", r + 1, a.reps, (n * (p + g)) as f64 / (ns / 1e9));
                samples_ns.push(ns);
            }
            let samples_ts: Vec<f64> = samples_ns.iter().map(|ns| (n * (p + g)) as f64 / (ns / 1e9)).collect();
            let (avg_ns, stddev_ns) = mean_std(&samples_ns);
            let (avg_ts, stddev_ts) = mean_std(&samples_ts);
            // One sequence's figure: the weights a token reads (n sequences share theirs).
            let gbps = if g > 0 && n == 1 { Some(bpt as f64 * avg_ts / 1e9) } else { None };
            // The expert tier over the timed runs: where the routed pairs ran.
            let tier = match (tier0, backend.ops().expert_stats()) {
                // Every expert resident with nothing counted (the whole model on the GPU): no line.
                (Some(a0), Some(a1)) if a1.hits + a1.misses > a0.hits + a0.misses => {
                    let (hits, misses) = (a1.hits - a0.hits, a1.misses - a0.misses);
                    let toks = (a1.tokens - a0.tokens).max(1) as f64;
                    let rate = if hits + misses == 0 { 1.0 } else { hits as f64 / (hits + misses) as f64 };
                    let streamed = a1.streamed_pairs - a0.streamed_pairs;
                    eprintln!(
                        "{name}: expert hit rate {:.3} ({hits} pairs resident on the GPU, {misses} not: {} on the CPU, {streamed} on the GPU after a batch upload of {:.1} MiB per token), {} tier uploads, {:.1} MiB of experts read by the CPU per token",
                        rate,
                        misses - streamed,
                        (a1.streamed_bytes - a0.streamed_bytes) as f64 / toks / 1048576.0,
                        a1.uploads - a0.uploads,
                        (a1.miss_bytes - a0.miss_bytes) as f64 / toks / 1048576.0
                    );
                    json!({ "hit_rate": rate, "hits": hits, "misses": misses, "uploads": a1.uploads - a0.uploads,
                            "miss_bytes_per_token": (a1.miss_bytes - a0.miss_bytes) as f64 / toks,
                            "streamed_pairs": streamed, "streamed_bytes_per_token": (a1.streamed_bytes - a0.streamed_bytes) as f64 / toks,
                            "miss_secs_per_token": (a1.miss_secs - a0.miss_secs) / toks })
                }
                _ => json!(null),
            };
            rows.push(json!({
                "name": name, "engine": "ember", "model_filename": filename, "model_type": model_type,
                "model_size": model_size, "model_n_params": n_params, "cpu_info": cpu, "n_threads": n_threads,
                "n_ubatch": a.ubatch, "type_k": format!("{:?}", a.kv_type).to_lowercase(), "prompts": format!("{:?}", a.prompts).to_lowercase(),
                "n_prompt": p, "n_gen": g, "n_depth": d, "n_seq": n, "reps": a.reps,
                "avg_ns": avg_ns as u64, "stddev_ns": stddev_ns as u64, "avg_ts": avg_ts, "stddev_ts": stddev_ts,
                "samples_ns": samples_ns.iter().map(|x| *x as u64).collect::<Vec<_>>(), "samples_ts": samples_ts,
                "bytes_per_token": if g > 0 && n == 1 { json!(bpt) } else { json!(null) },
                "gb_per_s": gbps, "experts": tier,
            }));
        }
    }
    match a.output {
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Format::Md => print_md(&rows),
    }
    Ok(())
}

fn print_md(rows: &[serde_json::Value]) {
    print_table(rows);
    for r in rows.iter().filter(|r| !r["experts"].is_null()) {
        let x = &r["experts"];
        println!(
            "{}: expert hit rate {:.3}, {} uploads, {:.1} MiB of experts read from RAM per token",
            r["name"].as_str().unwrap_or(""),
            x["hit_rate"].as_f64().unwrap_or(0.0),
            x["uploads"],
            x["miss_bytes_per_token"].as_f64().unwrap_or(0.0) / 1048576.0
        );
    }
}

fn print_table(rows: &[serde_json::Value]) {
    println!("| model | size | params | threads | prompts | test | t/s | B/token | GB/s |");
    println!("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in rows {
        let gib = r["model_size"].as_f64().unwrap_or(0.0) / 1073741824.0;
        let params = r["model_n_params"].as_f64().unwrap_or(0.0) / 1e9;
        let bpt = r["bytes_per_token"].as_u64().map_or(String::new(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
        let gbps = r["gb_per_s"].as_f64().map_or(String::new(), |g| format!("{g:.2}"));
        println!(
            "| {} | {gib:.2} GiB | {params:.2} B | {} | {} | {} | {:.2} ± {:.2} | {bpt} | {gbps} |",
            r["model_type"].as_str().unwrap_or(""),
            r["n_threads"],
            r["prompts"].as_str().unwrap_or(""),
            r["name"].as_str().unwrap_or(""),
            r["avg_ts"].as_f64().unwrap_or(0.0),
            r["stddev_ts"].as_f64().unwrap_or(0.0),
        );
    }
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_owned()))
        .unwrap_or_default()
}
