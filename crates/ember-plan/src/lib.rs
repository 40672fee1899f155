//! Placement: where each part of a model lives when it need not, or cannot, all go on one
//! device (shared/DESIGN.md "Weights and placement", shared/GPU.md §4). A [`Plan`] is pure data,
//! built from the file's tensor sizes ([`ModelSizes`]), each device's budget, the context and the
//! KV type, and optionally the routing heat of every (layer, expert):
//! 1. the trunk first: every layer's projections, norms, router and shared expert, its KV or
//!    DeltaNet state, and the output head with the last layer, in contiguous layer ranges across
//!    the GPUs, each range sized by its device's share of the budgets; layers no GPU can hold
//!    stay in host memory (the CPU runs them);
//! 2. then routed experts, each on the device of its layer, hottest first (evenly by layer when
//!    there is no heat yet), until the device's budget is spent; the rest stay in host memory,
//!    where the CPU computes them when routed.
//!
//! The decision a reader may question: experts never leave their layer's device. A layer's trunk
//! and its resident experts share a device, so the hidden state crosses devices once per range
//! boundary, never per expert; the price is that a hot expert of a layer on a full card cannot
//! use another card's free memory.

pub mod hybrid;
pub mod split;
pub mod tier;

use std::fmt::Write as _;
use std::ops::Range;

use ember_gguf::GgufFile;
use ember_model::{Config, LayerKind, TensorGroup};
use ember_ops::KvType;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] ember_model::Error),
    #[error("heat has {got} layers x {got_experts} experts, the model {want} x {want_experts}")]
    HeatShape { got: usize, got_experts: usize, want: usize, want_experts: usize },
    #[error("device {0} has two budgets")]
    DuplicateDevice(usize),
    #[error("'{text}' is not {what}: {why}")]
    Parse { text: String, what: &'static str, why: String },
}

/// Bytes of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerSizes {
    /// Read for every token: projections, norms, router, shared expert.
    pub trunk: u64,
    /// One routed expert (its gate, up and down rows).
    pub expert: u64,
    /// KV cache of an attention layer for every sequence at the full context.
    pub kv: u64,
    /// Conv + recurrent state of a DeltaNet layer for every sequence.
    pub delta: u64,
}

/// What placement needs to know of a model file at a context, KV type and sequence count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSizes {
    pub layers: Vec<LayerSizes>,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Output norm and head: placed with the last layer.
    pub head: u64,
    /// Token embeddings (one row read per token): host memory.
    pub embeddings: u64,
    /// Tensors the main pass never reads (the MTP block): host memory, untouched.
    pub unused: u64,
}

impl ModelSizes {
    /// Sizes of `file` for `n_seq` sequences of `n_ctx` tokens with `kv_type` KV rows.
    pub fn of_file(file: &GgufFile, kv_type: KvType, n_ctx: usize, n_seq: usize) -> Result<ModelSizes, Error> {
        let cfg = Config::from_gguf(file)?;
        let layout = cfg.state_layout(kv_type)?;
        let n_seq = n_seq as u64;
        let kv = n_seq * (2 * n_ctx.div_ceil(ember_ops::KV_PAGE) * layout.page_bytes()) as u64;
        let delta = n_seq * (4 * (layout.conv + layout.rec)) as u64;
        let mut layers: Vec<LayerSizes> = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerSizes { kv, ..Default::default() },
                LayerKind::DeltaNet => LayerSizes { delta, ..Default::default() },
            })
            .collect();
        let (mut head, mut embeddings, mut unused) = (0, 0, 0);
        for t in file.tensors() {
            let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|s| s.parse::<usize>().ok());
            match (TensorGroup::of(&t.name, cfg.n_layer), layer) {
                (TensorGroup::Embeddings, _) => embeddings += t.n_bytes,
                (TensorGroup::Mtp, _) => unused += t.n_bytes,
                (TensorGroup::RoutedExperts, Some(l)) if l < layers.len() => layers[l].expert += t.n_bytes / cfg.n_expert.max(1) as u64,
                (_, Some(l)) if l < layers.len() => layers[l].trunk += t.n_bytes,
                _ => head += t.n_bytes,
            }
        }
        Ok(ModelSizes { layers, n_expert: cfg.n_expert, n_expert_used: cfg.n_expert_used, head, embeddings, unused })
    }

    /// Every byte of the model and its state.
    pub fn total(&self) -> u64 {
        self.layers.iter().map(|l| l.trunk + l.kv + l.delta + self.n_expert as u64 * l.expert).sum::<u64>() + self.head + self.embeddings
    }
}

/// Device memory a step of `tokens` tokens holds beyond weights and state: the activations of
/// one layer (the model frees each layer's handles, `ember_ops::Ops::free_since`) and the MoE's
/// scratch, plus a fixed part for routings, plans and the allocator.
///
/// Per token, in floats: the residual, the layer input and the mixer's and MoE's outputs (4·d);
/// the wider mixer (DeltaNet: its qkv, conv and prep outputs, 3·conv channels, and z, the rule's
/// output and the gated norm, 3·n_v·d_v; attention: q|gate, its split, the output, 5·n_h·h, and
/// k, v and k normed, 3·n_kv·h); the MoE's router logits, its k_top·d weighted parts and
/// k_top·n_ff hidden rows, and the shared expert's 3·n_ff_sh. That is 67,393 floats (0.26 MiB)
/// for the 35B-A3B; the H100 measured 0.38-0.41 MiB a token (peak device memory at 8192 and
/// 16384-token prompts less weights, context and KV: bench/results/20261205-1625-h100-arena-free),
/// the chunked delta rule's scratch and the arena's best-fit slack included, so the estimate is
/// taken 1.8 times (0.46 MiB).
pub fn step_bytes(cfg: &Config, tokens: usize) -> u64 {
    const FIXED: u64 = 256 << 20;
    let (d, h) = (cfg.n_embd, cfg.head_dim);
    let has = |k: LayerKind| cfg.layer_kinds.contains(&k);
    let conv = 2 * cfg.n_k_head * cfg.d_k + cfg.n_v_head * cfg.d_v;
    let delta = if has(LayerKind::DeltaNet) { 3 * conv + 3 * cfg.n_v_head * cfg.d_v + 2 * cfg.n_v_head } else { 0 };
    let attn = if has(LayerKind::Attention) { 5 * cfg.n_head * h + 3 * cfg.n_head_kv * h } else { 0 };
    let moe = cfg.n_expert + 1 + cfg.n_expert_used * (d + cfg.n_ff_exp) + 3 * cfg.n_ff_shexp;
    let floats = 4 * d + delta.max(attn) + moe;
    FIXED + (4 * floats as u64 * tokens as u64) * 9 / 5
}

/// What one GPU may hold: its free memory less the reserve, or what the user set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub device: usize,
    pub name: String,
    pub bytes: u64,
}

/// Routing heat: per layer, per expert, a decayed count of routings (any scale).
#[derive(Debug, Clone, PartialEq)]
pub struct Heat(pub Vec<Vec<f64>>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Kept on every device used for a step's activations and scratch.
    pub compute_bytes: u64,
}

/// Where something lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// `Plan::devices[i]`.
    Device(usize),
    Host,
}

/// One GPU's share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePlan {
    pub device: usize,
    pub name: String,
    pub budget_bytes: u64,
    /// Its layer range (empty when the device gets none).
    pub layers: Range<usize>,
    pub trunk_bytes: u64,
    pub kv_bytes: u64,
    pub delta_bytes: u64,
    pub compute_bytes: u64,
    pub experts: usize,
    pub expert_bytes: u64,
    /// Whether the output head is here.
    pub head: bool,
}

impl DevicePlan {
    pub fn used_bytes(&self) -> u64 {
        self.trunk_bytes + self.kv_bytes + self.delta_bytes + self.compute_bytes + self.expert_bytes
    }
}

/// What stays in host memory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostPlan {
    /// Layers whose trunk no GPU could hold.
    pub layers: Vec<usize>,
    pub trunk_bytes: u64,
    pub kv_bytes: u64,
    pub delta_bytes: u64,
    pub experts: usize,
    pub expert_bytes: u64,
    pub embeddings_bytes: u64,
    pub head: bool,
}

impl HostPlan {
    pub fn bytes(&self) -> u64 {
        self.trunk_bytes + self.kv_bytes + self.delta_bytes + self.expert_bytes + self.embeddings_bytes
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub devices: Vec<DevicePlan>,
    pub host: HostPlan,
    /// Per layer: where its trunk and state are.
    pub layer_home: Vec<Home>,
    /// Per layer, per expert: its one home.
    pub expert_home: Vec<Vec<Home>>,
    pub experts_total: usize,
    /// Expected bytes read from host memory per token: the routed experts at home there, times
    /// the chance a token routes to each (its heat share, or k / n_expert without heat), plus
    /// the trunk of layers on the host.
    pub host_bytes_per_token: f64,
}

/// Builds the plan (see the crate docs for the order).
pub fn plan(sizes: &ModelSizes, budgets: &[Budget], heat: Option<&Heat>, opts: Options) -> Result<Plan, Error> {
    let n_layer = sizes.layers.len();
    if let Some(h) = heat {
        let bad = h.0.len() != n_layer || h.0.iter().any(|l| l.len() != sizes.n_expert);
        if bad {
            let got_experts = h.0.first().map_or(0, Vec::len);
            return Err(Error::HeatShape { got: h.0.len(), got_experts, want: n_layer, want_experts: sizes.n_expert });
        }
    }
    for (i, b) in budgets.iter().enumerate() {
        if budgets[..i].iter().any(|c| c.device == b.device) {
            return Err(Error::DuplicateDevice(b.device));
        }
    }
    let n_expert = sizes.n_expert as u64;
    let fixed = |l: usize| {
        let s = &sizes.layers[l];
        s.trunk + s.kv + s.delta + if l + 1 == n_layer { sizes.head } else { 0 }
    };
    let full = |l: usize| fixed(l) + n_expert * sizes.layers[l].expert;
    // A device whose budget does not cover the compute buffers takes nothing.
    let caps: Vec<u64> = budgets.iter().map(|b| b.bytes.saturating_sub(opts.compute_bytes)).collect();
    let cap_total: u64 = caps.iter().sum();
    let full_total: u64 = (0..n_layer).map(full).sum();

    // 1. Layer ranges: device d's range ends where the cumulative full size passes its share of
    // the budgets, unless the devices after it could not hold the trunk that remains.
    let mut devices: Vec<DevicePlan> = Vec::with_capacity(budgets.len());
    let mut layer_home = vec![Home::Host; n_layer];
    let mut next = 0;
    let mut cap_before = 0u64;
    let mut full_before = 0u64;
    for (d, b) in budgets.iter().enumerate() {
        let cap = caps[d];
        let cap_after: u64 = caps[d + 1..].iter().sum();
        cap_before += cap;
        let target = if cap_total == 0 { 0 } else { (full_total as u128 * cap_before as u128 / cap_total as u128) as u64 };
        let start = next;
        let mut used = 0u64;
        while next < n_layer && used + fixed(next) <= cap {
            let fixed_after: u64 = (next..n_layer).map(fixed).sum();
            let mid = full_before + full(next) / 2;
            if mid > target && fixed_after <= cap_after {
                break;
            }
            used += fixed(next);
            full_before += full(next);
            layer_home[next] = Home::Device(d);
            next += 1;
        }
        let range = start..next;
        let sum = |f: &dyn Fn(&LayerSizes) -> u64| range.clone().map(|l| f(&sizes.layers[l])).sum::<u64>();
        let head = !range.is_empty() && range.end == n_layer;
        devices.push(DevicePlan {
            device: b.device,
            name: b.name.clone(),
            budget_bytes: b.bytes,
            trunk_bytes: sum(&|s| s.trunk) + if head { sizes.head } else { 0 },
            kv_bytes: sum(&|s| s.kv),
            delta_bytes: sum(&|s| s.delta),
            compute_bytes: if range.is_empty() { 0 } else { opts.compute_bytes },
            experts: 0,
            expert_bytes: 0,
            head,
            layers: range,
        });
    }

    // 2. Routed experts on their layer's device, hottest first; without heat, expert e of
    // every layer before expert e + 1 of any (evenly by layer).
    let mut expert_home = vec![vec![Home::Host; sizes.n_expert]; n_layer];
    for (d, dev) in devices.iter_mut().enumerate() {
        let mut free = caps[d].saturating_sub(dev.trunk_bytes + dev.kv_bytes + dev.delta_bytes);
        let mut cands: Vec<(usize, usize)> = dev.layers.clone().flat_map(|l| (0..sizes.n_expert).map(move |e| (l, e))).collect();
        match heat {
            Some(h) => cands.sort_by(|&(la, ea), &(lb, eb)| h.0[lb][eb].total_cmp(&h.0[la][ea]).then((la, ea).cmp(&(lb, eb)))),
            None => cands.sort_by_key(|&(l, e)| (e, l)),
        }
        for (l, e) in cands {
            let bytes = sizes.layers[l].expert;
            if bytes <= free {
                free -= bytes;
                expert_home[l][e] = Home::Device(d);
                dev.experts += 1;
                dev.expert_bytes += bytes;
            }
        }
    }

    // 3. The host: what is left, and what it costs per token.
    let mut host = HostPlan { embeddings_bytes: sizes.embeddings, ..Default::default() };
    let mut host_bytes_per_token = 0.0;
    let k = sizes.n_expert_used as f64;
    for l in 0..n_layer {
        let s = &sizes.layers[l];
        if layer_home[l] == Home::Host {
            host.layers.push(l);
            host.trunk_bytes += s.trunk;
            host.kv_bytes += s.kv;
            host.delta_bytes += s.delta;
            host_bytes_per_token += s.trunk as f64;
            if l + 1 == n_layer {
                host.head = true;
                host.trunk_bytes += sizes.head;
                host_bytes_per_token += sizes.head as f64;
            }
        }
        let sum_heat: f64 = heat.map_or(0.0, |h| h.0[l].iter().sum());
        for (e, home) in expert_home[l].iter().enumerate() {
            if *home == Home::Host {
                host.experts += 1;
                host.expert_bytes += s.expert;
                let p = match heat {
                    Some(h) if sum_heat > 0.0 => k * h.0[l][e] / sum_heat,
                    _ => k / sizes.n_expert as f64,
                };
                host_bytes_per_token += p * s.expert as f64;
            }
        }
    }
    Ok(Plan { devices, host, layer_home, expert_home, experts_total: n_layer * sizes.n_expert, host_bytes_per_token })
}

impl Plan {
    /// Routed experts resident on GPUs.
    pub fn experts_on_gpus(&self) -> usize {
        self.devices.iter().map(|d| d.experts).sum()
    }

    /// The plan as the table `ember plan` prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>15} {:>10} {:>10}",
            "device", "budget", "layers", "trunk", "kv", "deltanet", "compute", "experts", "expert", "used"
        );
        for d in &self.devices {
            let layers = if d.layers.is_empty() { "-".to_string() } else { format!("{}-{}", d.layers.start, d.layers.end - 1) };
            let pct = 100.0 * d.experts as f64 / self.experts_total.max(1) as f64;
            let _ = writeln!(
                out,
                "{:<10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>15} {:>10} {:>10}",
                format!("cuda:{}", d.device),
                gib(d.budget_bytes),
                layers,
                gib(d.trunk_bytes),
                gib(d.kv_bytes),
                gib(d.delta_bytes),
                gib(d.compute_bytes),
                format!("{} ({pct:.1}%)", d.experts),
                gib(d.expert_bytes),
                gib(d.used_bytes()),
            );
        }
        let h = &self.host;
        let layers = if h.layers.is_empty() { "-".to_string() } else { format!("{}", h.layers.len()) };
        let pct = 100.0 * h.experts as f64 / self.experts_total.max(1) as f64;
        let _ = writeln!(
            out,
            "{:<10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9} {:>15} {:>10} {:>10}",
            "host",
            "-",
            layers,
            gib(h.trunk_bytes),
            gib(h.kv_bytes),
            gib(h.delta_bytes),
            "-",
            format!("{} ({pct:.1}%)", h.experts),
            gib(h.expert_bytes),
            gib(h.bytes()),
        );
        let _ = writeln!(
            out,
            "routed experts on GPUs: {} of {}; embeddings in host memory: {}; expected bytes read from host memory per token: {:.1} MiB",
            self.experts_on_gpus(),
            self.experts_total,
            gib(h.embeddings_bytes),
            self.host_bytes_per_token / (1u64 << 20) as f64
        );
        out
    }

    pub fn to_json(&self) -> serde_json::Value {
        let devices: Vec<_> = self
            .devices
            .iter()
            .map(|d| {
                serde_json::json!({
                    "id": d.device, "name": d.name, "budget_bytes": d.budget_bytes, "used_bytes": d.used_bytes(),
                    "layers": if d.layers.is_empty() { serde_json::Value::Null } else { serde_json::json!([d.layers.start, d.layers.end - 1]) },
                    "trunk_bytes": d.trunk_bytes, "kv_bytes": d.kv_bytes, "deltanet_bytes": d.delta_bytes,
                    "compute_bytes": d.compute_bytes, "experts": d.experts, "expert_bytes": d.expert_bytes, "head": d.head,
                })
            })
            .collect();
        let h = &self.host;
        serde_json::json!({
            "devices": devices,
            "host": {
                "experts": h.experts, "bytes": h.bytes(), "expert_bytes": h.expert_bytes, "layers": h.layers,
                "trunk_bytes": h.trunk_bytes, "kv_bytes": h.kv_bytes, "deltanet_bytes": h.delta_bytes,
                "embeddings_bytes": h.embeddings_bytes, "head": h.head,
            },
            "experts_total": self.experts_total,
            "host_bytes_per_token": self.host_bytes_per_token.round() as u64,
        })
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// `11GiB`, `9.5GiB`, `800MiB`, `2GB`, `1048576` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, Error> {
    let err = |why: &str| Error::Parse { text: s.to_string(), what: "a size", why: why.to_string() };
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.trim().parse().map_err(|_| err("give a number and a unit, e.g. 11GiB or 800MiB"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => return Err(err("units are B, KiB, MiB, GiB, KB, MB, GB")),
    };
    if !(x.is_finite() && x >= 0.0) {
        return Err(err("a size is not negative"));
    }
    Ok((x * mul).round() as u64)
}

/// `0=11GiB,1=9.5GiB`: a budget per device index.
pub fn parse_gpu_mem(s: &str) -> Result<Vec<(usize, u64)>, Error> {
    let mut out: Vec<(usize, u64)> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((dev, size)) = part.split_once('=') else {
            return Err(Error::Parse { text: part.to_string(), what: "a device budget", why: "write DEVICE=SIZE, e.g. 0=11GiB".into() });
        };
        let dev: usize = dev.trim().trim_start_matches("cuda:").parse().map_err(|_| Error::Parse {
            text: part.to_string(),
            what: "a device budget",
            why: "the device is its index, e.g. 0".into(),
        })?;
        if out.iter().any(|&(d, _)| d == dev) {
            return Err(Error::DuplicateDevice(dev));
        }
        out.push((dev, parse_bytes(size)?));
    }
    if out.is_empty() {
        return Err(Error::Parse { text: s.to_string(), what: "a list of device budgets", why: "it is empty".into() });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    /// The 35B-A3B's shape in round numbers: 40 layers (every 4th attention), 256 experts of
    /// 1.69 MiB, ~40 MiB of trunk per layer, a 0.5 GiB head.
    fn sizes() -> ModelSizes {
        let layers = (0..40)
            .map(|l| LayerSizes {
                trunk: 40 * MIB,
                expert: 1730 * 1024,
                kv: if l % 4 == 3 { 136 * MIB } else { 0 },
                delta: if l % 4 == 3 { 0 } else { 2 * MIB },
            })
            .collect();
        ModelSizes { layers, n_expert: 256, n_expert_used: 8, head: 500 * MIB, embeddings: 500 * MIB, unused: 0 }
    }

    fn budgets(b: &[(usize, u64)]) -> Vec<Budget> {
        b.iter().map(|&(device, bytes)| Budget { device, name: format!("gpu{device}"), bytes }).collect()
    }

    const OPTS: Options = Options { compute_bytes: GIB / 2 };

    /// The 35B-A3B's shape: 0.46 MiB a token over 256 MiB (the H100 measured 0.38-0.41 MiB a
    /// token at 8192 and 16384 tokens), ~0.5 GiB at the server's 512-token steps where a fixed
    /// 1.5 GiB was kept before; more tokens, more bytes.
    #[test]
    fn step_bytes_of_the_35b() {
        let cfg = Config {
            arch: "qwen35moe".into(),
            n_vocab: 248_320,
            n_ctx_train: 262_144,
            n_embd: 2048,
            n_layer: 4,
            n_layer_mtp: 0,
            layer_kinds: vec![LayerKind::DeltaNet, LayerKind::DeltaNet, LayerKind::DeltaNet, LayerKind::Attention],
            rms_eps: 1e-6,
            n_head: 16,
            n_head_kv: 2,
            head_dim: 256,
            n_rot: 64,
            rope_base: 1e7,
            conv_kernel: 4,
            n_k_head: 16,
            n_v_head: 32,
            d_k: 128,
            d_v: 128,
            n_expert: 256,
            n_expert_used: 8,
            n_ff_exp: 512,
            n_ff_shexp: 512,
        };
        let per_token = (step_bytes(&cfg, 8192) - step_bytes(&cfg, 0)) as f64 / 8192.0 / MIB as f64;
        assert!((0.45..0.48).contains(&per_token), "{per_token} MiB a token");
        assert_eq!(step_bytes(&cfg, 0), 256 * MIB);
        let at_512 = step_bytes(&cfg, 512) as f64 / GIB as f64;
        assert!((0.45..0.5).contains(&at_512), "{at_512} GiB at 512 tokens");
    }

    fn check_invariants(s: &ModelSizes, p: &Plan) {
        for (d, dev) in p.devices.iter().enumerate() {
            assert!(dev.used_bytes() <= dev.budget_bytes, "device {d} overfilled: {} > {}", dev.used_bytes(), dev.budget_bytes);
            for l in dev.layers.clone() {
                assert_eq!(p.layer_home[l], Home::Device(d));
            }
        }
        // Ranges are contiguous and in device order; host layers are the tail.
        let order: Vec<usize> = p.layer_home.iter().map(|h| if let Home::Device(d) = h { *d } else { usize::MAX }).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
        // Each expert has one home, on its layer's device or the host.
        let mut on = 0;
        for (l, row) in p.expert_home.iter().enumerate() {
            for h in row {
                if let Home::Device(_) = h {
                    assert_eq!(*h, p.layer_home[l], "an expert of layer {l} away from its layer");
                    on += 1;
                }
            }
        }
        assert_eq!(on, p.experts_on_gpus());
        assert_eq!(on + p.host.experts, p.experts_total);
        assert_eq!(p.experts_total, s.layers.len() * s.n_expert);
    }

    #[test]
    fn everything_fits_on_a_big_card() {
        let s = sizes();
        let p = plan(&s, &budgets(&[(0, 139 * GIB)]), None, OPTS).unwrap();
        check_invariants(&s, &p);
        assert_eq!(p.devices[0].layers, 0..40);
        assert!(p.devices[0].head);
        assert_eq!(p.host.experts, 0);
        assert_eq!(p.host_bytes_per_token, 0.0);
    }

    #[test]
    fn a_small_card_takes_the_trunk_first_then_experts_evenly_by_layer() {
        let s = sizes();
        let p = plan(&s, &budgets(&[(0, 8 * GIB)]), None, OPTS).unwrap();
        check_invariants(&s, &p);
        let d = &p.devices[0];
        assert_eq!(d.layers, 0..40, "the whole trunk fits in 8 GiB");
        assert!(d.experts > 0 && d.experts < p.experts_total);
        // Evenly by layer: counts differ by at most one.
        let per_layer: Vec<usize> = p.expert_home.iter().map(|r| r.iter().filter(|h| **h != Home::Host).count()).collect();
        let (lo, hi) = (per_layer.iter().min().unwrap(), per_layer.iter().max().unwrap());
        assert!(hi - lo <= 1, "{per_layer:?}");
        // What is left is less than one expert.
        assert!(d.budget_bytes - d.used_bytes() < s.layers[0].expert + OPTS.compute_bytes);
        // Host bytes per token: 8 routed of 256, the non-resident share of them.
        let want: f64 = (0..40).map(|l| 8.0 * (256 - per_layer[l]) as f64 / 256.0 * s.layers[l].expert as f64).sum();
        assert!((p.host_bytes_per_token - want).abs() < 1.0);
    }

    #[test]
    fn heat_puts_the_hottest_experts_on_the_gpu() {
        let s = sizes();
        // Expert e of every layer has heat 1 / (e + 1) (skewed), reversed in odd layers.
        let heat = Heat((0..40).map(|l| (0..256).map(|e| 1.0 / (1 + if l % 2 == 0 { e } else { 255 - e }) as f64).collect()).collect());
        let p = plan(&s, &budgets(&[(0, 8 * GIB)]), Some(&heat), OPTS).unwrap();
        check_invariants(&s, &p);
        for (l, row) in p.expert_home.iter().enumerate() {
            let hottest = if l % 2 == 0 { 0 } else { 255 };
            assert_ne!(row[hottest], Home::Host, "layer {l}'s hottest expert is not resident");
        }
        // Every resident expert is at least as hot as every host expert.
        let mut min_on = f64::MAX;
        let mut max_off: f64 = 0.0;
        for l in 0..40 {
            for e in 0..256 {
                if p.expert_home[l][e] == Home::Host { max_off = max_off.max(heat.0[l][e]) } else { min_on = min_on.min(heat.0[l][e]) }
            }
        }
        assert!(min_on >= max_off);
        let no_heat = plan(&s, &budgets(&[(0, 8 * GIB)]), None, OPTS).unwrap();
        assert!(p.host_bytes_per_token < no_heat.host_bytes_per_token, "heat must cut the host reads");
    }

    #[test]
    fn two_unequal_cards_split_layers_by_budget_and_never_overfill_the_smaller() {
        let s = sizes();
        let p = plan(&s, &budgets(&[(0, 11 * GIB), (1, 19 * GIB / 2)]), None, OPTS).unwrap();
        check_invariants(&s, &p);
        let (a, b) = (&p.devices[0], &p.devices[1]);
        assert_eq!(a.layers.start, 0);
        assert_eq!(a.layers.end, b.layers.start);
        assert_eq!(b.layers.end, 40);
        assert!(b.head && !a.head);
        assert!(a.layers.len() > b.layers.len(), "the larger card takes more layers: {:?} {:?}", a.layers, b.layers);
        assert!(b.used_bytes() <= 19 * GIB / 2);
        // Both cards are nearly full.
        for d in [a, b] {
            assert!(d.budget_bytes - d.used_bytes() < 64 * MIB, "{} of {} used", d.used_bytes(), d.budget_bytes);
        }
    }

    #[test]
    fn a_trunk_too_big_for_the_cards_leaves_its_last_layers_on_the_host() {
        let s = sizes();
        let p = plan(&s, &budgets(&[(0, GIB)]), None, OPTS).unwrap();
        check_invariants(&s, &p);
        let d = &p.devices[0];
        assert!(!d.layers.is_empty() && d.layers.end < 40);
        assert_eq!(p.host.layers, (d.layers.end..40).collect::<Vec<_>>());
        assert!(p.host.head);
        assert!(p.host_bytes_per_token > s.head as f64);
        // A card below the compute buffers gets nothing.
        let p = plan(&s, &budgets(&[(0, GIB / 4)]), None, OPTS).unwrap();
        assert!(p.devices[0].layers.is_empty() && p.devices[0].used_bytes() == 0);
        assert_eq!(p.host.layers.len(), 40);
        // No GPU at all: everything on the host.
        let p = plan(&s, &[], None, OPTS).unwrap();
        assert_eq!(p.host.experts, p.experts_total);
    }

    #[test]
    fn bad_input_is_an_error() {
        let s = sizes();
        let e = plan(&s, &budgets(&[(0, GIB)]), Some(&Heat(vec![vec![1.0; 256]; 3])), OPTS).unwrap_err();
        assert!(e.to_string().contains("3 layers"), "{e}");
        assert!(matches!(plan(&s, &budgets(&[(0, GIB), (0, GIB)]), None, OPTS), Err(Error::DuplicateDevice(0))));
        assert_eq!(parse_bytes("11GiB").unwrap(), 11 * GIB);
        assert_eq!(parse_bytes("9.5 GiB").unwrap(), 19 * GIB / 2);
        assert_eq!(parse_bytes("800MiB").unwrap(), 800 * MIB);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "GiB", "-1GiB", "3 parsecs", "1.2.3G"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_gpu_mem("0=11GiB,1=9.5GiB").unwrap(), vec![(0, 11 * GIB), (1, 19 * GIB / 2)]);
        assert_eq!(parse_gpu_mem("cuda:1=8GiB").unwrap(), vec![(1, 8 * GIB)]);
        for bad in ["", "11GiB", "a=1GiB", "0=1GiB,0=2GiB", "0=lots"] {
            assert!(parse_gpu_mem(bad).is_err(), "{bad}");
        }
    }
}
