//! [`Hybrid`]: one GPU runs the model with only some routed experts in its memory; the CPU
//! computes the others when they are routed, and the expert tier moves experts by heat.
//!
//! * The trunk (every layer's projections, norms, router, shared expert, KV and DeltaNet state,
//!   the head) is on the GPU: [`Hybrid`] is every op of [`CudaOps`] except `moe`.
//! * `moe` of a layer that holds all its experts is the GPU's. Otherwise the routing comes down
//!   (the only sync per layer), its (token, expert) pairs split into hits and misses; the GPU
//!   computes the hits and the shared expert while the CPU threads compute the misses from the
//!   file's bytes (`CpuOps::moe_slots`, the CPU backend's kernels); their sum goes up and is
//!   added. Placement changes which side computes a pair, never what it computes: the results
//!   differ from the all-GPU run by the order of a sum and the kernels' rounding.
//! * At the end of each step the routing heat ages by the step's tokens and at most
//!   `max_uploads` experts move in: per layer, the hottest missing expert replaces the coldest
//!   resident one when it is hotter by the margin (the layer's slot count is fixed by the plan,
//!   so no layer can crowd out another).
//! * The heat is saved to the heat file (see [`crate::tier::default_heat_path`]) every
//!   [`SAVE_EVERY`] and when the backend is dropped; the next run's plan starts from it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_cpu::CpuOps;
use ember_cuda::CudaOps;
use ember_cuda::ops::MOE_MISS;
use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, DeviceId, ExpertId, ExpertStats, Gate, LayerIdx, Mat,
    MoeSlot, OpError, OpResult, Ops, Registry, RouteTable, Routing, SeqStore, Slot, Snapshot, StateLayout, StoreStats, Tensor, WeightId,
    WeightSet,
};

use crate::tier::HeatMap;
use crate::{Home, Plan};

/// How often the heat file is written while serving.
pub const SAVE_EVERY: Duration = Duration::from_secs(60);

/// The tier's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierOptions {
    /// A missing expert replaces a resident one when its heat exceeds the resident's × (1 +
    /// margin).
    pub margin: f64,
    /// Experts moved onto the GPU per step at most.
    pub max_uploads: usize,
    /// Tokens after which a routing counts half.
    pub half_life: f64,
}

impl Default for TierOptions {
    /// Margin 25 % and half-life 1024 tokens: routing reuse is short-range (45 % of selections
    /// repeat at the next token, 80 % within 8: shared/GPU.md §4), so heat should follow the
    /// text of the last few hundred tokens, and a candidate must beat a resident clearly.
    /// Two uploads a step: an expert of the 35B-A3B is ~1.7 MB, a few hundred µs over PCIe.
    fn default() -> Self {
        TierOptions { margin: 0.25, max_uploads: 2, half_life: 1024.0 }
    }
}

/// Where the heat is kept between runs.
#[derive(Debug, Clone)]
pub struct HeatFile {
    pub path: PathBuf,
    pub model_key: String,
}

/// One GPU with some routed experts, the CPU for the rest (see the module docs).
pub struct Hybrid {
    gpu: CudaOps,
    cpu: CpuOps,
    host: Registry,
    heat: HeatMap,
    file: Option<HeatFile>,
    saved: Instant,
    opts: TierOptions,
    stats: ExpertStats,
    /// The step's tokens, for the heat's age.
    step_tokens: usize,
    /// Layers that hold only some of their experts (the ones the tier manages).
    partial: Vec<bool>,
    /// The most bytes the sequence state (KV pages and DeltaNet slots) may take: the plan's.
    state_cap: Option<u64>,
}

/// Per layer, the experts a plan puts on device 0 (None: all of them): what
/// [`CudaOps::set_resident_experts`] takes. An error when a layer's trunk is not on device 0:
/// one GPU runs the whole trunk.
pub fn resident_lists(plan: &Plan) -> Result<Vec<Option<Vec<u16>>>, String> {
    if let Some(l) = plan.layer_home.iter().position(|h| *h != Home::Device(0)) {
        return Err(format!(
            "the plan keeps layer {l}'s trunk off the GPU ({} of {} layers fit): give the GPU more memory or run on the CPU",
            plan.layer_home.iter().filter(|h| **h == Home::Device(0)).count(),
            plan.layer_home.len()
        ));
    }
    Ok(plan
        .expert_home
        .iter()
        .map(|row| {
            let on: Vec<u16> = (0..row.len()).filter(|&e| row[e] == Home::Device(0)).map(|e| e as u16).collect();
            if on.len() == row.len() { None } else { Some(on) }
        })
        .collect())
}

impl Hybrid {
    /// Wraps `gpu` (not registered yet): `resident` as for [`CudaOps::set_resident_experts`],
    /// `cpu` computes the misses, `heat` is the tier's starting heat (from the heat file, or
    /// zeros), `file` where it is saved.
    pub fn new(
        mut gpu: CudaOps,
        cpu: CpuOps,
        resident: Vec<Option<Vec<u16>>>,
        heat: HeatMap,
        file: Option<HeatFile>,
        opts: TierOptions,
    ) -> Hybrid {
        let partial = resident.iter().map(Option::is_some).collect();
        gpu.set_resident_experts(resident);
        let host = Registry::new(DeviceId::Host);
        Hybrid {
            gpu,
            cpu,
            host,
            heat,
            file,
            saved: Instant::now(),
            opts,
            stats: ExpertStats::default(),
            step_tokens: 0,
            partial,
            state_cap: None,
        }
    }

    /// Keeps the KV pool the engine sizes ([`SeqStore::kv_pages_that_fit`]) within `bytes` of
    /// sequence state (KV and DeltaNet slots), the plan's share, rather than all free memory.
    pub fn cap_kv_bytes(&mut self, bytes: u64) {
        self.state_cap = Some(bytes);
    }

    pub fn gpu(&self) -> &CudaOps {
        &self.gpu
    }

    pub fn stats(&self) -> ExpertStats {
        self.stats
    }

    pub fn heat(&self) -> &HeatMap {
        &self.heat
    }

    /// Experts of `layer` on the GPU now (all of them for a full layer).
    pub fn resident(&self, layer: LayerIdx) -> Option<Vec<u16>> {
        self.gpu.slot_experts(layer).map(<[u16]>::to_vec)
    }

    /// Writes the heat file now (no-op without one).
    pub fn save_heat(&mut self) -> Result<(), String> {
        self.saved = Instant::now();
        match &self.file {
            Some(f) => self.heat.save(&f.path, &f.model_key).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    /// Moves the hottest missing experts in, at most `max_uploads`, each replacing the coldest
    /// resident of its layer when hotter by the margin.
    fn rebalance(&mut self) -> OpResult<()> {
        let mut swaps = Vec::new();
        for (l, _) in self.partial.iter().enumerate().filter(|(_, p)| **p) {
            let layer = LayerIdx(l as u16);
            let (Some(slots), Some(experts)) = (self.gpu.expert_slots(layer), self.gpu.slot_experts(layer)) else { continue };
            let mut cands: Vec<(f64, usize)> =
                (0..slots.len()).filter(|&e| slots[e] == MOE_MISS).map(|e| (self.heat.get(l, e), e)).filter(|c| c.0 > 0.0).collect();
            if cands.is_empty() || experts.is_empty() {
                continue;
            }
            let mut res: Vec<(f64, usize)> = experts.iter().enumerate().map(|(s, &e)| (self.heat.get(l, e as usize), s)).collect();
            cands.sort_by(|a, b| b.0.total_cmp(&a.0));
            res.sort_by(|a, b| a.0.total_cmp(&b.0));
            for ((hot, e), (cold, s)) in cands.into_iter().zip(res).take(self.opts.max_uploads) {
                if hot <= cold * (1.0 + self.opts.margin) {
                    break;
                }
                swaps.push((hot, layer, s, e));
            }
        }
        swaps.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, layer, s, e) in swaps.into_iter().take(self.opts.max_uploads) {
            self.gpu.place_expert(layer, s, ExpertId(e as u16))?;
            self.stats.uploads += 1;
        }
        Ok(())
    }
}

impl Drop for Hybrid {
    fn drop(&mut self) {
        if let Err(e) = self.save_heat() {
            eprintln!("expert tier: could not save the heat: {e}");
        }
    }
}

impl SeqStore for Hybrid {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.gpu.configure(layout, slots, kv_pages)
    }
    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.gpu.alloc_slot()
    }
    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.gpu.clear_slot(slot)
    }
    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.gpu.slot_len(slot)
    }
    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.gpu.snapshot(slot)
    }
    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.gpu.restore(slot, snap)
    }
    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.gpu.read_delta(slot, layer)
    }
    fn store_stats(&mut self) -> StoreStats {
        self.gpu.store_stats()
    }
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        let free = SeqStore::kv_pages_that_fit(&mut self.gpu, layout, slots)?;
        let Some(cap) = self.state_cap else { return Ok(free) };
        let delta = (slots * layout.delta_bytes()) as u64;
        let capped = (cap.saturating_sub(delta) / layout.page_bytes().max(1) as u64) as usize;
        Ok(Some(free.map_or(capped, |f| f.min(capped))))
    }
}

impl Ops for Hybrid {
    fn name(&self) -> &'static str {
        "cuda+cpu"
    }
    fn device(&self) -> DeviceId {
        self.gpu.device()
    }
    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.host.set(weights.clone());
        self.gpu.register(weights)
    }
    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        self.step_tokens = batch.tokens.len();
        self.gpu.begin_step(batch)
    }
    fn end_step(&mut self) -> OpResult<()> {
        self.gpu.end_step()?;
        self.heat.advance(self.step_tokens);
        self.stats.tokens += self.step_tokens as u64;
        self.step_tokens = 0;
        self.rebalance()?;
        if self.saved.elapsed() >= SAVE_EVERY
            && let Err(e) = self.save_heat()
        {
            eprintln!("expert tier: could not save the heat: {e}");
        }
        Ok(())
    }
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        self.gpu.upload(x)
    }
    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        self.gpu.read(x)
    }
    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        self.gpu.read_routing(r)
    }
    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        self.gpu.embed(w)
    }
    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        self.gpu.matmul(w, x)
    }
    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        self.gpu.matmul_many(ws, x)
    }
    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        self.gpu.rms_norm(x, w, eps)
    }
    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        self.gpu.add(h, x)
    }
    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        self.gpu.attn_prep(s, qg, k)
    }
    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        self.gpu.kv_append(layer, k, v)
    }
    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        self.gpu.attention(layer, h, q)
    }
    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        self.gpu.conv1d_silu(layer, x, w)
    }
    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        self.gpu.delta_prep(s, cu, b, alpha)
    }
    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        self.gpu.gated_delta_rule(layer, h, x, mode)
    }
    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        self.gpu.gate(y, g, act)
    }
    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        self.gpu.route(logits, k)
    }

    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        const OP: &str = "moe";
        let Some(slots) = self.gpu.expert_slots(layer) else { return self.gpu.moe(layer, x, routing, shared_gate) };
        let n_expert = slots.len();
        let table = self.gpu.read_routing(routing)?;
        let ids: Vec<u32> = table.ids.iter().map(|e| e.0 as u32).collect();
        self.heat.record(layer.index(), &ids).map_err(|e| OpError::new(OP, self.gpu.device(), format!("{layer}"), e.to_string()))?;
        // The misses, by expert: (token, weight) pairs.
        let slots = self.gpu.expert_slots(layer).unwrap_or_default();
        let mut misses: BTreeMap<u16, Vec<(usize, f32)>> = BTreeMap::new();
        for (p, (&e, &w)) in ids.iter().zip(&table.weights).enumerate() {
            // An id out of range is the GPU kernels' to report (NaN rows, as without a tier).
            if (e as usize) < n_expert && slots[e as usize] == MOE_MISS {
                misses.entry(e as u16).or_default().push((p / table.k.max(1), w));
            }
        }
        let n_miss: usize = misses.values().map(Vec::len).sum();
        self.stats.misses += n_miss as u64;
        self.stats.hits += (ids.len() - n_miss) as u64;
        if misses.is_empty() {
            return self.gpu.moe(layer, x, routing, shared_gate);
        }
        let xh = self.gpu.read(x)?;
        // The GPU's launches are queued; the CPU computes the misses meanwhile.
        let out = self.gpu.moe(layer, x, routing, shared_gate)?;
        let t0 = Instant::now();
        let mut views = Vec::with_capacity(misses.len());
        for (&e, toks) in &misses {
            let expert = self.host.expert(OP, layer, ExpertId(e))?;
            self.stats.miss_bytes += (expert.gate.data.len() + expert.up.data.len() + expert.down.data.len()) as u64;
            views.push(MoeSlot { expert, tokens: toks });
        }
        let y = self.cpu.moe_slots(&views, &xh);
        self.stats.miss_secs += t0.elapsed().as_secs_f64();
        let yt = self.gpu.upload(&y)?;
        self.gpu.add(out, yt)?;
        Ok(out)
    }

    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        self.gpu.select_rows(x)
    }

    fn expert_stats(&self) -> Option<ExpertStats> {
        Some(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Budget, LayerSizes, ModelSizes, Options, plan};

    fn sizes() -> ModelSizes {
        let layers = (0..3).map(|_| LayerSizes { trunk: 100, expert: 10, kv: 0, delta: 0 }).collect();
        ModelSizes { layers, n_expert: 4, n_expert_used: 2, head: 0, embeddings: 0, unused: 0 }
    }

    #[test]
    fn resident_lists_follow_the_plan() {
        // Room for the trunk and 6 of the 12 experts: two per layer, evenly without heat.
        let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 360 }], None, Options { compute_bytes: 0 }).unwrap();
        let r = resident_lists(&p).unwrap();
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|l| l.as_ref().is_some_and(|v| v.len() == 2)), "{r:?}");
        // Everything fits: every layer holds all its experts (None).
        let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 1000 }], None, Options { compute_bytes: 0 }).unwrap();
        assert!(resident_lists(&p).unwrap().iter().all(Option::is_none));
        // A trunk that does not fit is an error naming the layers that do.
        let p = plan(&sizes(), &[Budget { device: 0, name: "g".into(), bytes: 250 }], None, Options { compute_bytes: 0 }).unwrap();
        let e = resident_lists(&p).unwrap_err();
        assert!(e.contains("layer") && e.contains("of 3 layers fit"), "{e}");
    }
}
