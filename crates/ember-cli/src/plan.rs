//! `ember plan`: where the model would live on this machine's GPUs (or on budgets given with
//! `--gpu-mem`, which needs no GPU), as a table per device or as JSON.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ember_ops::KvType;
use ember_plan::{Budget, ModelSizes, Options};

use crate::load;

/// Tokens after which a routing counts half in the heat (the tier's default, `TierOptions`).
const HEAT_HALF_LIFE: f64 = 1024.0;

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF (default: the bundled demo model).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Budget per GPU, e.g. `0=11GiB,1=9.5GiB` (default: each GPU's free memory less
    /// --reserve). With it, no GPU is needed.
    #[arg(long)]
    gpu_mem: Option<String>,
    /// Memory left free on each GPU when budgets come from its free memory.
    #[arg(long, default_value = "1GiB")]
    reserve: String,
    /// Context size of each sequence, in tokens (default: the training context, at most 4096).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[arg(long, value_parser = load::parse_kv_type, default_value = "f16")]
    kv_type: KvType,
    /// Sequences served at once (each gets its KV cache and DeltaNet state).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Tokens per forward step (`ember serve -b`): the activation memory kept on each GPU.
    #[arg(short = 'b', long, default_value_t = 512, value_parser = load::parse_at_least_one)]
    batch: usize,
    /// Routing heat file (default: the model's in ~/.cache/ember/heat when there is one; none:
    /// experts evenly by layer).
    #[arg(long)]
    heat: Option<PathBuf>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    if a.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let file = load::open_gguf(a.model.as_deref())?;
    let cfg = ember_model::Config::from_gguf(&file)?;
    let n_ctx = a.ctx.unwrap_or(cfg.n_ctx_train.min(4096));
    if n_ctx == 0 {
        bail!("-c must be at least 1");
    }
    let sizes = ModelSizes::of_file(&file, a.kv_type, n_ctx, a.parallel)?;
    let budgets = match &a.gpu_mem {
        Some(s) => ember_plan::parse_gpu_mem(s)
            .with_context(|| format!("--gpu-mem {s}"))?
            .into_iter()
            .map(|(device, bytes)| Budget { device, name: format!("--gpu-mem {device}"), bytes })
            .collect(),
        None => {
            let reserve = ember_plan::parse_bytes(&a.reserve).with_context(|| format!("--reserve {}", a.reserve))?;
            match ember_cuda::devices() {
                Ok(gpus) => gpus
                    .into_iter()
                    .map(|g| Budget { device: g.index, name: g.name, bytes: (g.bytes_free as u64).saturating_sub(reserve) })
                    .collect(),
                Err(e) => {
                    eprintln!("no usable GPU ({e}): everything stays in host memory; give --gpu-mem to plan for GPUs");
                    Vec::new()
                }
            }
        }
    };
    // A step's activations at --batch tokens, plus the scratch a prompt batch's uploaded experts
    // go into (every expert of the largest layer), as `ember serve` keeps them.
    let stream = sizes.layers.iter().map(|l| l.expert).max().unwrap_or(0) * sizes.n_expert as u64;
    let opts = Options { compute_bytes: crate::device::step_reserve(&cfg, a.batch) + stream };
    let key = ember_plan::tier::model_key(&file);
    let heat_path = a.heat.clone().or_else(|| ember_plan::tier::default_heat_path(&key).filter(|p| p.exists()));
    let heat = match &heat_path {
        Some(p) => Some(ember_plan::tier::HeatMap::load(p, &key, sizes.layers.len(), sizes.n_expert, HEAT_HALF_LIFE)?),
        None => None,
    };
    let heat_note = match (&heat_path, &heat) {
        (Some(p), Some(h)) => format!("heat from {} ({} tokens)", p.display(), h.tokens()),
        _ => "no heat file yet: routed experts evenly by layer".to_string(),
    };
    let plan = ember_plan::plan(&sizes, &budgets, heat.as_ref().map(|h| h.heat()).as_ref(), opts)?;
    if a.json {
        let mut j = plan.to_json();
        j["model"] = serde_json::json!({
            "n_ctx": n_ctx, "kv_type": format!("{:?}", a.kv_type).to_lowercase(), "parallel": a.parallel,
            "bytes": sizes.total(), "n_layer": sizes.layers.len(), "n_expert": sizes.n_expert,
        });
        j["heat"] = serde_json::json!(heat_path.as_ref().map(|p| p.display().to_string()));
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "{} layers, {} routed experts each ({} active); {} sequences of {n_ctx} tokens, {:?} KV; weights + state {:.2} GiB; {:.2} GiB kept per GPU for compute",
            sizes.layers.len(),
            sizes.n_expert,
            sizes.n_expert_used,
            a.parallel,
            a.kv_type,
            sizes.total() as f64 / (1u64 << 30) as f64,
            opts.compute_bytes as f64 / (1u64 << 30) as f64
        );
        print!("{}", plan.table());
        println!("{heat_note}");
    }
    Ok(())
}
