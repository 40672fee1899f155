use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ember_cpu::Precision;
use ember_engine::{Backend, Logits, ModelBackend};
use ember_ops::KvType;

use crate::{device, load};

#[derive(clap::Args)]
pub struct Args {
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Comma-separated token ids.
    #[arg(long, required = true, value_delimiter = ',')]
    tokens: Vec<String>,
    /// The first N tokens go through the prompt path as one batch, the rest one at a time
    /// through the decode path (default: all tokens as one batch).
    #[arg(long)]
    prefill: Option<usize>,
    /// Reference path: weights dequantised exactly, f32 compute, f32 KV cache.
    #[arg(long)]
    exact: bool,
    /// KV cache type: f16 (default), q8_0, or f32 (default with --exact).
    #[arg(long, value_parser = load::parse_kv_type)]
    kv_type: Option<KvType>,
    /// Where the model runs: auto (the GPU when the whole model fits, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, value_parser = device::parse_device, default_value = "auto")]
    device: device::Device,
    #[command(flatten)]
    place: device::PlaceArgs,
    /// Threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Output file (safetensors with one f32 tensor `logits` [T, n_vocab]).
    #[arg(short, long)]
    output: PathBuf,
}

pub fn main(a: Args) -> Result<()> {
    let model = load::open_model(a.model.as_ref())?;
    let mut ids = Vec::with_capacity(a.tokens.len());
    for s in a.tokens.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        ids.push(s.parse::<u32>().with_context(|| format!("--tokens: '{s}' is not a token id"))?);
    }
    if ids.is_empty() {
        bail!("--tokens is empty");
    }
    let prefill = a.prefill.unwrap_or(ids.len());
    if prefill > ids.len() {
        bail!("--prefill {prefill} is larger than the {} tokens given", ids.len());
    }
    let (precision, default_kv) = if a.exact { (Precision::Exact, KvType::F32) } else { (Precision::Fast, KvType::F16) };
    let kv_type = a.kv_type.unwrap_or(default_kv);
    let n_vocab = model.config.n_vocab;
    // The engine's forward path (ModelBackend::forward).
    let ops = device::backend(
        a.device,
        precision,
        a.threads,
        &device::Placement { file: model.file(), args: &a.place, n_ctx: ids.len(), parallel: 1, kv_type, step_tokens: ids.len() },
    )?;
    let mut backend = ModelBackend::new(model, ops, kv_type)?;
    backend.configure(1, ids.len(), 0)?;
    let mut st = backend.new_state(ids.len())?;
    let mut logits = Vec::with_capacity(ids.len() * n_vocab);
    if prefill > 0 {
        logits.extend_from_slice(&backend.run(&mut st, &ids[..prefill], Logits::All)?);
    }
    for &id in &ids[prefill..] {
        let l = backend.run(&mut st, &[id], Logits::All)?;
        logits.extend_from_slice(&l);
    }
    write_safetensors(&a.output, "logits", &[ids.len(), n_vocab], &logits).with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!("wrote {} x {} logits to {}", ids.len(), n_vocab, a.output.display());
    Ok(())
}

/// Writes one f32 tensor in the safetensors format (8-byte header length, JSON header padded
/// with spaces to 8 bytes, raw little-endian data).
fn write_safetensors(path: &std::path::Path, name: &str, shape: &[usize], data: &[f32]) -> Result<()> {
    let n_bytes = data.len() * 4;
    let mut header = serde_json::json!({ name: { "dtype": "F32", "shape": shape, "data_offsets": [0, n_bytes] } }).to_string();
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(&(header.len() as u64).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}
