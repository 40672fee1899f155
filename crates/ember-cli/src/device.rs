//! `--device auto|cpu|cuda|cuda:N`: which backend runs the model, and the GPUs `inspect` lists.

use anyhow::{Result, bail};
use ember_cpu::Precision;
use ember_ops::Ops;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The GPU when the whole model fits in its free memory, else the CPU (saying why).
    Auto,
    Cpu,
    Cuda(usize),
}

pub fn parse_device(s: &str) -> Result<Device, String> {
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => Ok(Device::Cuda(0)),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Cuda(i)),
            _ => Err(format!("'{s}' is not a device: use auto, cpu, cuda or cuda:N")),
        },
    }
}

/// Memory a model needs on a GPU beyond its weights: the CUDA context (~0.5 GiB measured on the
/// H200), activations, sequence state and the prompt cache's share.
const GPU_HEADROOM: u64 = 1 << 30;

/// The backend for `device`; `weight_bytes` is what the model's tensors take. Logs the choice.
pub fn backend(device: Device, precision: Precision, threads: usize, weight_bytes: u64) -> Result<Box<dyn Ops>> {
    let cpu = || -> Box<dyn Ops> { Box::new(ember_cpu::backend(precision, threads)) };
    match device {
        Device::Cpu => Ok(cpu()),
        Device::Cuda(_) if precision == Precision::BatchInvariant => {
            bail!("--batch-invariant runs on the CPU only (the GPU kernels differ by batch size): use --device cpu")
        }
        Device::Auto if precision == Precision::BatchInvariant => {
            say("device auto: --batch-invariant runs on the CPU only; running on the CPU".to_string());
            Ok(cpu())
        }
        Device::Cuda(i) => {
            let gpus = ember_cuda::devices().map_err(|e| anyhow::anyhow!("--device cuda: {e}"))?;
            let Some(g) = gpus.get(i) else {
                bail!("--device cuda:{i}: there are {} CUDA devices (run `ember inspect` to list them)", gpus.len());
            };
            let need = weight_bytes + GPU_HEADROOM;
            if need > g.bytes_free as u64 {
                bail!(
                    "--device cuda:{i}: the model needs about {} of GPU memory, {} ({}) has {} free; use --device cpu",
                    gib(need),
                    g.name,
                    i,
                    gib(g.bytes_free as u64)
                );
            }
            say(format!("device: cuda:{i} ({}, {} free)", g.name, gib(g.bytes_free as u64)));
            gpu(i, precision)
        }
        Device::Auto => match ember_cuda::devices() {
            Err(e) => {
                say(format!("device auto: no usable GPU ({e}); running on the CPU"));
                Ok(cpu())
            }
            Ok(gpus) => {
                let need = weight_bytes + GPU_HEADROOM;
                match gpus.iter().position(|g| g.bytes_free as u64 >= need) {
                    Some(i) => {
                        say(format!(
                            "device auto: the whole model ({} with headroom) fits on GPU {i} ({}, {} free): running there",
                            gib(need),
                            gpus[i].name,
                            gib(gpus[i].bytes_free as u64)
                        ));
                        gpu(i, precision)
                    }
                    None => {
                        let most = gpus.iter().map(|g| g.bytes_free as u64).max().unwrap_or(0);
                        say(format!(
                            "device auto: the model needs about {} and no GPU has that free (most: {}); running on the CPU",
                            gib(need),
                            gib(most)
                        ));
                        Ok(cpu())
                    }
                }
            }
        },
    }
}

/// One line on stderr: through the log when `serve` has set one up, else plainly.
fn say(msg: String) {
    if tracing::dispatcher::has_been_set() {
        tracing::info!("{msg}");
    } else {
        eprintln!("{msg}");
    }
}

/// The GPU backend at `precision`: exact (f32 everywhere, `--exact`) or fast (tensor cores
/// for prompt-sized batches). The GPU kernels are not batch-invariant; `backend` keeps that
/// precision on the CPU.
fn gpu(i: usize, precision: Precision) -> Result<Box<dyn Ops>> {
    let p = if precision == Precision::Exact { ember_cuda::Precision::Exact } else { ember_cuda::Precision::Fast };
    let ops = ember_cuda::CudaOps::with_precision(i, p).map_err(|e| anyhow::anyhow!("opening CUDA device {i}: {e}"))?;
    Ok(Box::new(ops))
}

/// The CPU threads a `-t` value means (0: the physical cores).
pub fn threads(t: usize) -> usize {
    if t == 0 { ember_cpu::physical_cores() } else { t }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The GPUs this machine has, for `inspect`: one line each, or why there are none.
pub fn gpu_report() -> serde_json::Value {
    match ember_cuda::devices() {
        Ok(gpus) => serde_json::Value::Array(
            gpus.iter()
                .map(|g| {
                    serde_json::json!({
                        "index": g.index, "name": g.name, "compute_capability": format!("{}.{}", g.cc.0, g.cc.1),
                        "total_bytes": g.bytes_total, "free_bytes": g.bytes_free,
                    })
                })
                .collect(),
        ),
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}
