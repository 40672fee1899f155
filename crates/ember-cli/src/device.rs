//! `--device auto|cpu|cuda|cuda:N`: which backend runs the model, and the GPUs `inspect` lists.

use anyhow::{Context, Result, bail};
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

/// `--gpu-mem` / `--reserve`: how much of each GPU the model may use. No per-layer flags: the
/// planner places the trunk and as many routed experts as fit, by heat.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PlaceArgs {
    /// Budget per GPU, e.g. `0=12GiB` (default: the GPU's free memory less --reserve). A model
    /// that does not fit keeps its trunk and the hottest routed experts on the GPU and computes
    /// the other experts on the CPU.
    #[arg(long)]
    pub gpu_mem: Option<String>,
    /// Memory left free on the GPU when the budget comes from its free memory.
    #[arg(long, default_value = "1GiB")]
    pub reserve: String,
}

/// What the planner needs to know about the run besides the model file.
pub struct Placement<'a> {
    pub file: &'a ember_gguf::GgufFile,
    pub args: &'a PlaceArgs,
    /// Context per sequence and sequences at once (the KV and DeltaNet state to budget).
    pub n_ctx: usize,
    pub parallel: usize,
    pub kv_type: ember_ops::KvType,
    /// The most tokens one forward step holds (the server's --batch, a benchmark's largest
    /// prompt): the activation memory a partial placement keeps free on the GPU.
    pub step_tokens: usize,
}

/// The GPU memory a partial placement keeps for a step's activations and scratch:
/// [`ember_plan::step_bytes`] for `step_tokens` (`EMBER_COMPUTE_RESERVE=fixed`: the fixed
/// [`ember_cuda::ACT_RESERVE`] kept before steps freed each layer's handles, for A/B runs).
pub fn step_reserve(cfg: &ember_model::Config, step_tokens: usize) -> u64 {
    if std::env::var("EMBER_COMPUTE_RESERVE").is_ok_and(|v| v == "fixed") {
        return ember_cuda::ACT_RESERVE as u64;
    }
    ember_plan::step_bytes(cfg, step_tokens)
}

/// The backend for `device`: the whole model on the GPU when it fits the budget, the trunk and
/// the hottest routed experts there with the rest on the CPU ([`ember_plan::hybrid::Hybrid`])
/// when it does not, the CPU when there is no usable GPU (auto). Logs the choice.
pub fn backend(device: Device, precision: Precision, threads: usize, place: &Placement) -> Result<Box<dyn Ops>> {
    let weight_bytes: u64 = place.file.tensors().iter().map(|t| t.n_bytes).sum();
    let cpu = || -> Box<dyn Ops> {
        say(host_memory(threads, place, weight_bytes));
        Box::new(ember_cpu::backend(precision, threads))
    };
    let budget_of = |g: &ember_cuda::DeviceInfo| -> Result<u64> {
        match &place.args.gpu_mem {
            Some(s) => {
                let list = ember_plan::parse_gpu_mem(s).with_context(|| format!("--gpu-mem {s}"))?;
                match list.iter().find(|(d, _)| *d == g.index) {
                    Some(&(_, b)) if b > g.bytes_free as u64 => {
                        bail!("--gpu-mem gives GPU {} {}, it has {} free", g.index, gib(b), gib(g.bytes_free as u64))
                    }
                    Some(&(_, b)) => Ok(b),
                    None => Ok(0),
                }
            }
            None => Ok((g.bytes_free as u64).saturating_sub(reserve(place)?)),
        }
    };
    match device {
        Device::Cpu => match split_parts() {
            Some(n) => {
                say(host_memory(threads, place, weight_bytes));
                let cfg = ember_model::Config::from_gguf(place.file)?;
                let n = n.min(cfg.n_layer);
                let parts = (0..n).map(|_| Box::new(ember_cpu::backend(precision, threads)) as Box<dyn Ops>).collect();
                say(format!("device: EMBER_SPLIT_PARTS={n}: the layers in {n} ranges, one CPU backend each"));
                let layer_part = (0..cfg.n_layer).map(|l| l * n / cfg.n_layer).collect();
                Ok(Box::new(ember_plan::split::Split::new(parts, layer_part).map_err(|e| anyhow::anyhow!("{e}"))?))
            }
            None => Ok(cpu()),
        },
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
            let budget = budget_of(g)?;
            if let Some(n) = split_parts() {
                return one_gpu_as_many(g, budget, n, precision, threads, place);
            }
            if weight_bytes + GPU_HEADROOM <= budget {
                say(format!("device: cuda:{i} ({}, {} free, budget {})", g.name, gib(g.bytes_free as u64), gib(budget)));
                return whole(g, precision, threads, place);
            }
            hybrid(g, budget, precision, threads, place)
        }
        Device::Auto => match ember_cuda::devices() {
            Err(e) => {
                say(format!("device auto: no usable GPU ({e}); running on the CPU"));
                Ok(cpu())
            }
            Ok(gpus) => {
                let need = weight_bytes + GPU_HEADROOM;
                let budgets = gpus.iter().map(&budget_of).collect::<Result<Vec<u64>>>()?;
                if let (Some(n), Some(i)) = (split_parts(), (0..gpus.len()).max_by_key(|&i| budgets[i])) {
                    return one_gpu_as_many(&gpus[i], budgets[i], n, precision, threads, place);
                }
                if let Some(i) = budgets.iter().position(|&b| b >= need) {
                    say(format!(
                        "device auto: the whole model ({} with headroom) fits on GPU {i} ({}, budget {}): running there",
                        gib(need),
                        gpus[i].name,
                        gib(budgets[i])
                    ));
                    return whole(&gpus[i], precision, threads, place);
                }
                // Several GPUs with a budget: the layers split across them by budget.
                let usable: Vec<(&ember_cuda::DeviceInfo, u64)> =
                    gpus.iter().zip(&budgets).filter(|(_, b)| **b > 0).map(|(g, b)| (g, *b)).collect();
                if usable.len() >= 2 {
                    match multi(&usable, precision, threads, place) {
                        Ok(ops) => return Ok(ops),
                        Err(e) => say(format!(
                            "device auto: the layers do not split across the GPUs ({}); trying the largest alone",
                            crate::report(&e)
                        )),
                    }
                }
                // The GPU with the largest budget takes the trunk and what experts fit.
                let Some(i) = (0..gpus.len()).max_by_key(|&i| budgets[i]) else {
                    say("device auto: no GPU; running on the CPU".to_string());
                    return Ok(cpu());
                };
                match hybrid(&gpus[i], budgets[i], precision, threads, place) {
                    Ok(ops) => Ok(ops),
                    Err(e) => {
                        say(format!("device auto: {}; running on the CPU", crate::report(&e)));
                        Ok(cpu())
                    }
                }
            }
        },
    }
}

/// What a tiered placement starts from: the model's sizes, the tier's settings, the heat file
/// (and the heat in it, if any) and the planner's options.
struct TierInputs {
    sizes: ember_plan::ModelSizes,
    opts: ember_plan::hybrid::TierOptions,
    heat: Option<ember_plan::tier::HeatMap>,
    file: Option<ember_plan::hybrid::HeatFile>,
    popts: ember_plan::Options,
}

impl TierInputs {
    fn of(place: &Placement) -> Result<TierInputs> {
        use ember_plan::hybrid::{HeatFile, TierOptions};
        use ember_plan::tier::{HeatMap, default_heat_path, model_key};
        let sizes = ember_plan::ModelSizes::of_file(place.file, place.kv_type, place.n_ctx, place.parallel.max(1))?;
        let opts = TierOptions::from_env();
        let key = model_key(place.file);
        let path = default_heat_path(&key);
        let (n_layer, n_expert) = (sizes.layers.len(), sizes.n_expert);
        let heat = match path.as_ref().filter(|p| p.exists()) {
            Some(p) => match HeatMap::load(p, &key, n_layer, n_expert, opts.half_life) {
                Ok(h) => Some(h),
                Err(e) => {
                    say(format!("expert tier: ignoring the heat file: {e}"));
                    None
                }
            },
            None => None,
        };
        // Compute: a step's activations, plus the scratch a prompt batch's uploaded experts go
        // into (every expert of the largest layer).
        let stream = sizes.layers.iter().map(|l| l.expert).max().unwrap_or(0) * n_expert as u64;
        let cfg = ember_model::Config::from_gguf(place.file)?;
        let popts = ember_plan::Options { compute_bytes: step_reserve(&cfg, place.step_tokens) + stream };
        let file = path.map(|path| HeatFile { path, model_key: key });
        Ok(TierInputs { sizes, opts, heat, file, popts })
    }

    /// Where the routed experts come from, for the log.
    fn heat_source(&self) -> String {
        match &self.heat {
            Some(h) => format!("experts by the heat of {} earlier tokens", h.tokens()),
            None => "no heat file yet: experts evenly by layer".into(),
        }
    }

    /// The starting heat (the file's, or zeros).
    fn start_heat(&self) -> ember_plan::tier::HeatMap {
        let s = &self.sizes;
        self.heat.clone().unwrap_or_else(|| ember_plan::tier::HeatMap::new(s.layers.len(), s.n_expert, self.opts.half_life))
    }
}

fn cuda_precision(precision: Precision) -> ember_cuda::Precision {
    if precision == Precision::Exact { ember_cuda::Precision::Exact } else { ember_cuda::Precision::Fast }
}

/// The trunk and the hottest routed experts that fit `budget` on GPU `g`, the rest on the CPU.
fn hybrid(g: &ember_cuda::DeviceInfo, budget: u64, precision: Precision, threads: usize, place: &Placement) -> Result<Box<dyn Ops>> {
    use ember_plan::hybrid::{Hybrid, resident_lists};
    let t = TierInputs::of(place)?;
    let budgets = [ember_plan::Budget { device: 0, name: g.name.clone(), bytes: budget }];
    let plan = ember_plan::plan(&t.sizes, &budgets, t.heat.as_ref().map(|h| h.heat()).as_ref(), t.popts)?;
    let resident = resident_lists(&plan).map_err(|e| anyhow::anyhow!("cuda:{}: {e}", g.index))?;
    let d = &plan.devices[0];
    say(format!(
        "device: cuda:{} ({}, budget {}): the model does not fit, so the trunk and {} of {} routed experts go on the GPU ({}, of which {} kept for steps of up to {} tokens), the rest stay in host memory and run on the CPU ({} threads); {}",
        g.index,
        g.name,
        gib(budget),
        d.experts,
        plan.experts_total,
        gib(d.used_bytes()),
        gib(t.popts.compute_bytes),
        place.step_tokens,
        self::threads(threads),
        t.heat_source()
    ));
    let ops = ember_cuda::CudaOps::with_precision(g.index, cuda_precision(precision))
        .map_err(|e| anyhow::anyhow!("opening CUDA device {}: {e}", g.index))?;
    let cpu = ember_cpu::CpuOps::new(precision, threads);
    let mut h = Hybrid::new(ops, cpu, resident, t.start_heat(), t.file.clone(), t.opts);
    h.cap_kv_bytes(d.kv_bytes);
    h.watch_memory(reserve(place)?);
    Ok(Box::new(h))
}

/// The model across several GPUs, each given (its index, its budget): the planner cuts the
/// layers into one range per GPU by budget (a layer's trunk, state and resident experts on one
/// card), each GPU is a [`ember_plan::hybrid::Hybrid`] over its range (its own expert tier,
/// misses on the CPU, memory pressure watched on that card), and a
/// [`ember_plan::split::Split`] runs them in turn, the hidden state crossing once per range
/// boundary through host memory. The same GPU may be given more than once (EMBER_SPLIT_PARTS:
/// one card run as several, the two-GPU code path on one).
fn multi(gpus: &[(&ember_cuda::DeviceInfo, u64)], precision: Precision, threads: usize, place: &Placement) -> Result<Box<dyn Ops>> {
    // Each part keeps its card's reserve free; parts sharing a card share it (each watches the
    // same free memory, and each evicting the whole shortfall would evict it several times).
    let reserve_of = |g: &ember_cuda::DeviceInfo| -> Result<u64> {
        let sharing = gpus.iter().filter(|(h, _)| h.index == g.index).count().max(1) as u64;
        Ok(reserve(place)? / sharing)
    };
    use ember_plan::Home;
    use ember_plan::hybrid::{Hybrid, resident_lists_on};
    let t = TierInputs::of(place)?;
    let budgets: Vec<ember_plan::Budget> = gpus
        .iter()
        .enumerate()
        .map(|(i, (g, b))| ember_plan::Budget { device: i, name: format!("cuda:{} ({})", g.index, g.name), bytes: *b })
        .collect();
    let plan = ember_plan::plan(&t.sizes, &budgets, t.heat.as_ref().map(|h| h.heat()).as_ref(), t.popts)?;
    let mut parts: Vec<Box<dyn Ops>> = Vec::new();
    let mut part_of = vec![usize::MAX; plan.devices.len()];
    for (d, dev) in plan.devices.iter().enumerate().filter(|(_, dev)| !dev.layers.is_empty()) {
        let g = gpus[d].0;
        let resident = resident_lists_on(&plan, d).map_err(|e| anyhow::anyhow!("{}: {e}", dev.name))?;
        let n_experts = dev.layers.len() * t.sizes.n_expert;
        say(format!(
            "device: {} (budget {}): layers {}..{} of {}{}, {} of their {} routed experts ({}; KV and DeltaNet state {}, {} kept for steps of up to {} tokens)",
            dev.name,
            gib(dev.budget_bytes),
            dev.layers.start,
            dev.layers.end,
            plan.layer_home.len(),
            if dev.head { " and the output head" } else { "" },
            dev.experts,
            n_experts,
            gib(dev.used_bytes()),
            gib(dev.kv_bytes + dev.delta_bytes),
            gib(dev.compute_bytes),
            place.step_tokens
        ));
        let ops = ember_cuda::CudaOps::with_precision(g.index, cuda_precision(precision))
            .map_err(|e| anyhow::anyhow!("opening CUDA device {}: {e}", g.index))?;
        let cpu = ember_cpu::CpuOps::new(precision, threads);
        let mut h = Hybrid::new(ops, cpu, resident, t.start_heat(), t.file.clone(), t.opts);
        h.cap_kv_bytes(dev.kv_bytes);
        h.watch_memory(reserve_of(g)?);
        part_of[d] = parts.len();
        parts.push(Box::new(h));
    }
    if let Some(l) = plan.layer_home.iter().position(|h| *h == Home::Host) {
        // resident_lists_on refused it already when any device had layers; here none had.
        bail!("no GPU can hold layer {l}'s trunk within its budget: give the GPUs more memory (--gpu-mem) or run on the CPU");
    }
    let layer_part: Vec<usize> = plan.layer_home.iter().map(|h| if let Home::Device(d) = h { part_of[*d] } else { 0 }).collect();
    say(format!(
        "device: the layers split across {} GPUs; {} of {} routed experts on them, the rest in host memory run on the CPU ({} threads); {}",
        parts.len(),
        plan.experts_on_gpus(),
        plan.experts_total,
        self::threads(threads),
        t.heat_source()
    ));
    Ok(Box::new(ember_plan::split::Split::new(parts, layer_part).map_err(|e| anyhow::anyhow!("{e}"))?))
}

/// The whole model on GPU `g`, still behind the expert tier: when another process takes the
/// GPU's memory, the coldest experts move to the CPU instead of the next allocation failing.
fn whole(g: &ember_cuda::DeviceInfo, precision: Precision, threads: usize, place: &Placement) -> Result<Box<dyn Ops>> {
    use ember_plan::hybrid::{HeatFile, Hybrid, TierOptions};
    use ember_plan::tier::{HeatMap, default_heat_path, model_key};
    let ops = ember_cuda::CudaOps::with_precision(g.index, cuda_precision(precision))
        .map_err(|e| anyhow::anyhow!("opening CUDA device {}: {e}", g.index))?;
    let cfg = ember_model::Config::from_gguf(place.file)?;
    let opts = TierOptions::from_env();
    let key = model_key(place.file);
    let heat = HeatMap::new(cfg.n_layer, cfg.n_expert, opts.half_life);
    let file = default_heat_path(&key).map(|path| HeatFile { path, model_key: key });
    // The CPU backend is made only for misses, which there are none of until memory shrinks.
    let cpu = ember_cpu::CpuOps::new(precision, threads);
    let mut h = Hybrid::new(ops, cpu, vec![None; cfg.n_layer], heat, file, opts);
    h.watch_memory(reserve(place)?);
    Ok(Box::new(h))
}

/// `EMBER_SPLIT_PARTS=N` (N >= 2): run the model as a layer split of N parts
/// (`ember_plan::split::Split`, each part its own backend with its layers' weights and state):
/// on the CPU, N CPU backends; on a GPU, the GPU's budget cut in N equal shares planned as N
/// cards, each share a `Hybrid` over its layers (the code path of N GPUs, run on one). For
/// testing and measuring the split.
fn split_parts() -> Option<usize> {
    std::env::var("EMBER_SPLIT_PARTS").ok()?.parse().ok().filter(|&n| n >= 2)
}

/// GPU `g` run as `n` cards of `budget / n` each (see [`split_parts`]).
fn one_gpu_as_many(
    g: &ember_cuda::DeviceInfo,
    budget: u64,
    n: usize,
    precision: Precision,
    threads: usize,
    place: &Placement,
) -> Result<Box<dyn Ops>> {
    // No more parts than layers (each part runs at least one).
    let n = n.min(ember_model::Config::from_gguf(place.file)?.n_layer).max(1);
    say(format!(
        "device: EMBER_SPLIT_PARTS={n}: cuda:{} ({}, budget {}) run as {n} cards of {} each",
        g.index,
        g.name,
        gib(budget),
        gib(budget / n as u64)
    ));
    multi(&vec![(g, budget / n as u64); n], precision, threads, place)
}

/// What a model on the CPU takes of host memory: the weights (`weights` bytes, mapped from the
/// file), the KV cache at the full context and the DeltaNet state, against the memory available
/// now. The KV pages come as the context fills, so a long context that cannot fit is a
/// warning, not an error.
fn host_memory(threads: usize, place: &Placement, weights: u64) -> String {
    let seqs = place.parallel.max(1);
    let sizes = match ember_plan::ModelSizes::of_file(place.file, place.kv_type, place.n_ctx, seqs) {
        Ok(s) => s,
        Err(e) => return format!("device: cpu ({} threads); state sizes unknown: {e}", self::threads(threads)),
    };
    let kv: u64 = sizes.layers.iter().map(|l| l.kv).sum();
    let delta: u64 = sizes.layers.iter().map(|l| l.delta).sum();
    let n_kv = sizes.layers.iter().filter(|l| l.kv > 0).count();
    let s = seqs as u64;
    let mut msg = format!(
        "device: cpu ({} threads): weights {} ({}); KV cache {} {} a sequence at {} tokens ({n_kv} attention layers), {} for {seqs}, taken as contexts fill; DeltaNet state {} a sequence",
        self::threads(threads),
        size(weights),
        if crate::load::no_mmap() { "read into memory" } else { "mapped from the file" },
        format!("{:?}", place.kv_type).to_lowercase(),
        size(kv / s),
        place.n_ctx,
        size(kv),
        size(delta / s),
    );
    if let Some(avail) = crate::load::mem_available() {
        let need = weights + kv + delta;
        msg += &format!("; {} for the model and full contexts, {} of host memory available", size(need), size(avail));
        if need > avail {
            let q8 = if place.kv_type == ember_ops::KvType::Q8_0 { "" } else { ", or use --kv-type q8_0" };
            msg += &format!(" (WARNING: full contexts would not fit: lower -c or --parallel{q8})");
        }
    }
    msg
}

/// The memory the tier keeps free on the GPU while serving (`--reserve`).
fn reserve(place: &Placement) -> Result<u64> {
    ember_plan::parse_bytes(&place.args.reserve).with_context(|| format!("--reserve {}", place.args.reserve))
}

/// One line on stderr: through the log when `serve` has set one up, else plainly.
fn say(msg: String) {
    if tracing::dispatcher::has_been_set() {
        tracing::info!("{msg}");
    } else {
        eprintln!("{msg}");
    }
}

/// The CPU threads a `-t` value means (0: the physical cores).
pub fn threads(t: usize) -> usize {
    if t == 0 { ember_cpu::physical_cores() } else { t }
}

/// `b` bytes in GiB, or in MiB below one GiB.
fn size(b: u64) -> String {
    if b < 1 << 30 { format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64) } else { gib(b) }
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
