//! [`Hybrid`]: one GPU runs the model with only some routed experts in its memory; the CPU
//! computes the others when they are routed, and the expert tier moves experts by heat.
//!
//! * The trunk (every layer's projections, norms, router, shared expert, KV and DeltaNet state,
//!   the head) is on the GPU: [`Hybrid`] is every op of [`CudaOps`] except `moe`.
//! * `moe` of a layer that holds all its experts is the GPU's. For a layer that holds only some
//!   and a decode-sized batch (x up to [`X_WITH_ROUTING_BYTES`]), nothing waits: `moe_post`
//!   copies the routing into the layer's [`Mailbox`] (host memory the GPU writes), and x too
//!   when some pair's expert is not resident; the GPU computes the resident pairs and the
//!   shared expert; `moe_wait_add` adds the host's sum of the misses, and waits for it only
//!   when there are some. The host serves the step's mailboxes, in layer order, before the
//!   first call that waits for the stream (the logits' `read`, a KV page's table write, the
//!   next step): it records each routing for the heat and, for a layer with misses, computes
//!   them on CPU threads from the file's bytes (`CpuOps::moe_slots`, the CPU backend's kernels)
//!   and writes their sum. A step whose every pair is resident never waits on the host
//!   (docs/backend.md). Larger batches (and `EMBER_TIER_MAILBOX=0`, and the per-launch
//!   profile) bring the routing down instead: its (token, expert) pairs split into hits and
//!   misses; the GPU computes the hits and the shared expert while the CPU threads compute the
//!   misses; their sum goes up, queued behind the layer's kernels without a wait, and is
//!   added. Placement changes which side computes a pair, never what it computes: the results
//!   differ from the all-GPU run by the order of a sum and the kernels' rounding, and the two
//!   forms give the same results bit for bit.
//! * A prompt batch may instead bring the experts it routes to but lacks up for the layer
//!   ([`CudaOps::moe_streamed`]): a miss costs the CPU about its expert's bytes read once plus
//!   its tokens' arithmetic, an upload about its bytes over PCIe, so batches with many tokens per
//!   expert go up and single tokens stay on the CPU. The choice is per layer and batch, by a
//!   cost model measured at `register` ([`CostModel`]) and corrected by every timed run.
//! * At the end of each step the routing heat ages by the step's tokens and at most
//!   `max_uploads` experts move in: per layer, the hottest missing expert replaces the coldest
//!   resident one when it is hotter by the margin (the layer's slot count is fixed by the plan,
//!   so no layer can crowd out another). The copies go on a copy stream from pinned memory and
//!   nothing waits for them: the evicted expert leaves the slot table at once, the incoming one
//!   enters it at the first step end that sees its copies done, and runs on the CPU until then.
//! * The heat is saved to the heat file (see [`crate::tier::default_heat_path`]) every
//!   [`SAVE_EVERY`] and when the backend is dropped; the next run's plan starts from it.
//! * As one part of a layer split over several GPUs ([`crate::split::Split`], which gives each
//!   part its own layers' weights through [`Ops::keep_weights`]), a Hybrid owns the layers whose
//!   experts it was given: the tier moves, evicts and regrows only those, its heat counts only
//!   their routing, and it saves its rows into the heat file beside the other parts' (see
//!   [`resident_lists_on`]). Memory pressure on its GPU evicts there only.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_cpu::CpuOps;
use ember_cuda::ops::MOE_MISS;
use ember_cuda::{CudaOps, Mailbox};
use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, DeviceId, ExpertId, ExpertStats, Gate, LayerIdx, Mark,
    Mat, MoeSlot, OpError, OpResult, Ops, Registry, RouteTable, Routing, SeqStore, Slot, Snapshot, StateLayout, StoreStats, Tensor,
    WeightId, WeightSet,
};

use crate::tier::HeatMap;
use crate::{Home, Plan};

mod posted;
mod pressure;

use posted::Posted;
use pressure::Pressure;

const GIB: f64 = (1u64 << 30) as f64;

/// A batch whose `x` is at most this large brings it down with the routing, in the same wait,
/// since a miss needs it on the host: one token of the 35B-A3B is 8 KiB, 32 tokens (batched
/// decode) 256 KiB, ~10 µs over PCIe, less than a second wait, and with 8 experts a token such
/// a batch likely has a miss. A larger one (a prompt) reads it only when its misses run on the
/// CPU. Not measured yet against fetching it with one token only.
pub const X_WITH_ROUTING_BYTES: usize = 256 << 10;

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
    /// Where a prompt batch's misses run (`EMBER_TIER_PROMPT_MISSES=cpu|upload`, default auto).
    pub prompt_misses: MissPath,
    /// Whether decode-sized batches (x up to [`X_WITH_ROUTING_BYTES`]) hand their routing to
    /// the host through mailboxes instead of a download and a wait per partial layer (see the
    /// module docs); `EMBER_TIER_MAILBOX=0` turns it off.
    pub mailbox: bool,
    /// Whether the tier's uploads run behind the next steps (on the copy stream) instead of
    /// being waited for at the step's end; `EMBER_TIER_ASYNC_UPLOADS=0` waits (A/B).
    pub async_uploads: bool,
}

/// Where the misses of a prompt batch (more than one token) run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissPath {
    /// Whichever the cost model says is faster.
    #[default]
    Auto,
    /// Always on the CPU.
    Cpu,
    /// Always uploaded for the batch.
    Upload,
}

impl Default for TierOptions {
    /// Margin 25 % and half-life 1024 tokens: routing reuse is short-range (45 % of selections
    /// repeat at the next token, 80 % within 8: shared/GPU.md §4), so heat should follow the
    /// text of the last few hundred tokens, and a candidate must beat a resident clearly.
    /// Two uploads a step: an expert of the 35B-A3B is ~1.7 MB, a few hundred µs over PCIe.
    fn default() -> Self {
        TierOptions { margin: 0.25, max_uploads: 2, half_life: 1024.0, prompt_misses: MissPath::Auto, mailbox: true, async_uploads: true }
    }
}

impl TierOptions {
    /// The defaults with the A/B switches of the environment: `EMBER_TIER_MAILBOX=0`,
    /// `EMBER_TIER_ASYNC_UPLOADS=0`, `EMBER_TIER_PROMPT_MISSES=cpu|upload`.
    pub fn from_env() -> Self {
        let off = |var: &str| matches!(std::env::var(var).as_deref(), Ok("0" | "off" | "false"));
        let prompt_misses = match std::env::var("EMBER_TIER_PROMPT_MISSES").as_deref() {
            Ok("cpu") => MissPath::Cpu,
            Ok("upload") => MissPath::Upload,
            _ => MissPath::Auto,
        };
        TierOptions {
            prompt_misses,
            mailbox: !off("EMBER_TIER_MAILBOX"),
            async_uploads: !off("EMBER_TIER_ASYNC_UPLOADS"),
            ..Default::default()
        }
    }
}

/// What a layer's misses cost each way, in seconds: measured at `register` and scaled by
/// what each later run actually took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// CPU: per expert read (its bytes from RAM) and per (token, expert) pair computed.
    pub cpu_per_expert: f64,
    pub cpu_per_pair: f64,
    /// Upload: seconds per byte through the pinned staging buffers, and per batch.
    pub up_per_byte: f64,
    pub up_fixed: f64,
}

impl CostModel {
    pub fn cpu(&self, experts: usize, pairs: usize) -> f64 {
        experts as f64 * self.cpu_per_expert + pairs as f64 * self.cpu_per_pair
    }

    pub fn upload(&self, bytes: u64) -> f64 {
        self.up_fixed + bytes as f64 * self.up_per_byte
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
    /// The most bytes the KV pool may take: the plan's (its DeltaNet slots are counted apart:
    /// the free memory [`CudaOps::kv_pages_that_fit`] sees holds them).
    kv_cap: Option<u64>,
    /// Misses on the CPU or uploaded, for prompt batches (None until `register` measured it).
    cost: Option<CostModel>,
    /// What `register` uploads (per layer, the experts in slots or None for all).
    resident: Vec<Option<Vec<u16>>>,
    pressure: Option<Pressure>,
    /// Per layer: routed pairs resident / not.
    per_layer: Vec<(u64, u64)>,
    /// Per layer, its mailbox (made on the layer's first decode step).
    boxes: Vec<Option<Mailbox>>,
    /// Mailboxes of this step the host has not served yet, in layer order.
    posted: Vec<Posted>,
    /// The newest generation whose timed-out waits have been reported.
    timeouts_seen: u32,
    /// Whether a mailbox was posted since the host last waited for the stream: a wait of this
    /// step may yet time out on the GPU (see `begin_step`).
    posted_unwaited: bool,
    /// Which weights the GPU keeps ([`Ops::keep_weights`]; None: all).
    kept: Option<Vec<bool>>,
    /// Per layer, whether its experts are this GPU's to place (set at `register` from `kept`:
    /// a layer whose MoE weights another part of a split keeps is not; empty: every layer is).
    owned: Vec<bool>,
}

/// One line on stderr: through the log when `serve` has set one up, else plainly.
fn say(msg: String) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!("{msg}");
    } else {
        eprintln!("{msg}");
    }
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

/// Per layer, the experts a plan puts on `plan.devices[d]`, for that device's part of a layer
/// split ([`crate::split::Split`] of one Hybrid per GPU): for the device's own layers the list
/// of its experts there (None when all of them), for every other layer None (that part's
/// weights are not this one's: [`Ops::keep_weights`] leaves them out, and the Hybrid does not
/// place their experts). An error when `d` has no layers, or when a layer's trunk is on no GPU.
pub fn resident_lists_on(plan: &Plan, d: usize) -> Result<Vec<Option<Vec<u16>>>, String> {
    if let Some(l) = plan.layer_home.iter().position(|h| *h == Home::Host) {
        let on_gpus = plan.layer_home.iter().filter(|h| **h != Home::Host).count();
        return Err(format!(
            "the plan keeps layer {l}'s trunk off the GPUs ({on_gpus} of {} layers fit): give the GPUs more memory or run on the CPU",
            plan.layer_home.len()
        ));
    }
    let dev = plan.devices.get(d).ok_or_else(|| format!("the plan has no device {d}"))?;
    if dev.layers.is_empty() {
        return Err(format!("the plan gives {} (device {d}) no layers", dev.name));
    }
    Ok(plan
        .expert_home
        .iter()
        .enumerate()
        .map(|(l, row)| {
            if plan.layer_home[l] != Home::Device(d) {
                return None;
            }
            let on: Vec<u16> = (0..row.len()).filter(|&e| row[e] == Home::Device(d)).map(|e| e as u16).collect();
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
        gpu.set_resident_experts(resident.clone());
        let host = Registry::new(DeviceId::Host);
        Hybrid {
            resident,
            pressure: None,
            per_layer: Vec::new(),
            boxes: Vec::new(),
            posted: Vec::new(),
            timeouts_seen: 0,
            posted_unwaited: false,
            kept: None,
            owned: Vec::new(),
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
            kv_cap: None,
            cost: None,
        }
    }

    pub fn cost_model(&self) -> Option<CostModel> {
        self.cost
    }

    /// Times the two ways with the first partial layer's first expert: the CPU on 1 and on 64
    /// tokens (after a warm-up run), a staged upload of a few experts' bytes.
    fn measure_costs(&mut self) -> OpResult<Option<CostModel>> {
        const OP: &str = "register";
        let Some(l) = self.partial.iter().position(|p| *p) else { return Ok(None) };
        let layer = LayerIdx(l as u16);
        let e = self.host.expert(OP, layer, ExpertId(0))?;
        let bytes = (e.gate.data.len() + e.up.data.len() + e.down.data.len()) as u64;
        let d = e.gate.k;
        let time_cpu = |n: usize| {
            let x = Mat { n, d, data: (0..n * d).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect() };
            let toks: Vec<(usize, f32)> = (0..n).map(|t| (t, 1.0)).collect();
            let slot = [MoeSlot { expert: e, tokens: &toks }];
            let t0 = Instant::now();
            std::hint::black_box(self.cpu.moe_slots(&slot, &x));
            t0.elapsed().as_secs_f64()
        };
        time_cpu(64);
        let one = time_cpu(1);
        let many = time_cpu(64);
        let per_pair = ((many - one) / 63.0).max(0.0);
        let per_expert = (one - per_pair).max(1e-7);
        // The upload: eight experts' bytes (the staging buffers' fixed cost is in a layer's
        // every batch, so it is measured with them).
        let up = self
            .gpu
            .time_upload(&[e.gate.data, e.up.data, e.down.data], 8)
            .map_err(|err| OpError::new(OP, self.gpu.device(), "", err.to_string()))?;
        let (small, big) = up;
        let per_byte = ((big - small) / (7 * bytes) as f64).max(1e-13);
        let fixed = (small - bytes as f64 * per_byte).max(0.0);
        Ok(Some(CostModel { cpu_per_expert: per_expert, cpu_per_pair: per_pair, up_per_byte: per_byte, up_fixed: fixed }))
    }

    /// Keeps the KV pool the engine sizes ([`SeqStore::kv_pages_that_fit`]) within `bytes`, the
    /// plan's KV share, rather than all free memory.
    pub fn cap_kv_bytes(&mut self, bytes: u64) {
        self.kv_cap = Some(bytes);
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

    /// Whether layer `l`'s experts are this GPU's to place (see the module docs).
    fn owns(&self, l: usize) -> bool {
        self.owned.get(l).copied().unwrap_or(true)
    }

    /// Writes the heat file now (no-op without one, or before any routing was counted: a run
    /// that held every expert on the GPU learns nothing to keep). A part of a split writes its
    /// own layers' rows and keeps the file's rows of the others (the other parts').
    pub fn save_heat(&mut self) -> Result<(), String> {
        self.saved = Instant::now();
        if self.heat.tokens() == 0 || !self.partial.iter().any(|p| *p) {
            return Ok(());
        }
        let Some(f) = &self.file else { return Ok(()) };
        if self.owned.iter().all(|o| *o) {
            return self.heat.save(&f.path, &f.model_key).map_err(|e| e.to_string());
        }
        let (n_layer, n_expert) = (self.heat.n_layer(), self.heat.n_expert());
        let mut merged = self.heat.clone();
        if let Ok(theirs) = HeatMap::load(&f.path, &f.model_key, n_layer, n_expert, self.heat.half_life()) {
            merged.take_rows(&theirs, |l| !self.owns(l));
        }
        merged.save(&f.path, &f.model_key).map_err(|e| e.to_string())
    }

    /// Counts a layer's routed pairs for the stats: `n_miss` of `n` not resident.
    fn count(&mut self, layer: LayerIdx, n: usize, n_miss: usize) {
        self.stats.misses += n_miss as u64;
        self.stats.hits += (n - n_miss) as u64;
        if self.per_layer.len() <= layer.index() {
            self.per_layer.resize(layer.index() + 1, (0, 0));
        }
        let pl = &mut self.per_layer[layer.index()];
        pl.0 += (n - n_miss) as u64;
        pl.1 += n_miss as u64;
    }

    /// The misses of a routing, by expert: (token, weight) pairs of the experts `layer` does
    /// not hold. An id out of range is the GPU kernels' to report (NaN rows, as without a tier).
    fn misses(&self, layer: LayerIdx, ids: &[u32], weights: &[f32], k: usize) -> BTreeMap<u16, Vec<(usize, f32)>> {
        let slots = self.gpu.expert_slots(layer).unwrap_or_default();
        let mut misses: BTreeMap<u16, Vec<(usize, f32)>> = BTreeMap::new();
        for (p, (&e, &w)) in ids.iter().zip(weights).enumerate() {
            if slots.get(e as usize) == Some(&MOE_MISS) {
                misses.entry(e as u16).or_default().push((p / k.max(1), w));
            }
        }
        misses
    }

    /// The CPU's sum of `misses` over `x` (the time and bytes go to the stats).
    fn cpu_misses(&mut self, layer: LayerIdx, misses: &BTreeMap<u16, Vec<(usize, f32)>>, x: &Mat) -> OpResult<Mat> {
        let t0 = Instant::now();
        let mut views = Vec::with_capacity(misses.len());
        for (&e, toks) in misses {
            let expert = self.host.expert("moe", layer, ExpertId(e))?;
            self.stats.miss_bytes += (expert.gate.data.len() + expert.up.data.len() + expert.down.data.len()) as u64;
            views.push(MoeSlot { expert, tokens: toks });
        }
        let y = self.cpu.moe_slots(&views, x);
        self.stats.miss_secs += t0.elapsed().as_secs_f64();
        Ok(y)
    }

    /// Moves the hottest missing experts in, at most `max_uploads`, each replacing the coldest
    /// resident of its layer when hotter by the margin: the uploads go on the copy stream
    /// (`CudaOps::place_expert`) and nothing waits; an expert counts as resident from the first
    /// step end that sees its copies done.
    fn rebalance(&mut self) -> OpResult<()> {
        // Experts whose copies are done go into their slot tables (queued before the next
        // step's kernels); the others stay misses until a later step sees them done.
        self.gpu.finish_uploads(false)?;
        let mut swaps = Vec::new();
        for (l, _) in self.partial.iter().enumerate().filter(|(l, p)| **p && self.owns(*l)) {
            let layer = LayerIdx(l as u16);
            let (Some(slots), Some(experts)) = (self.gpu.expert_slots(layer), self.gpu.slot_experts(layer)) else { continue };
            // Slots and experts with an upload on its way are neither candidates nor evictable.
            let up = self.gpu.uploading(layer);
            let mut cands: Vec<(f64, usize)> = (0..slots.len())
                .filter(|&e| slots[e] == MOE_MISS && !up.iter().any(|u| u.1 as usize == e))
                .map(|e| (self.heat.get(l, e), e))
                .filter(|c| c.0 > 0.0)
                .collect();
            let mut res: Vec<(f64, usize)> = experts
                .iter()
                .enumerate()
                .filter(|(s, _)| !up.iter().any(|u| u.0 == *s))
                .map(|(s, &e)| (self.heat.get(l, e as usize), s))
                .collect();
            if cands.is_empty() || res.is_empty() {
                continue;
            }
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
        if !self.opts.async_uploads {
            self.gpu.finish_uploads(true)?;
        }
        Ok(())
    }
}

impl Drop for Hybrid {
    fn drop(&mut self) {
        // A step cut short may leave mailboxes posted: serve them, so nothing waits on them.
        if let Err(e) = self.drain() {
            eprintln!("expert tier: {e}");
        }
        if let Err(e) = self.save_heat() {
            eprintln!("expert tier: could not save the heat: {e}");
        }
    }
}

impl SeqStore for Hybrid {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.drain()?;
        self.gpu.configure(layout, slots, kv_pages)
    }
    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.drain()?;
        self.gpu.alloc_slot()
    }
    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.drain()?;
        self.gpu.clear_slot(slot)
    }
    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.drain()?;
        self.gpu.slot_len(slot)
    }
    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.drain()?;
        self.gpu.snapshot(slot)
    }
    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.drain()?;
        self.gpu.restore(slot, snap)
    }
    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.drain()?;
        self.gpu.read_delta(slot, layer)
    }
    fn store_stats(&mut self) -> StoreStats {
        self.gpu.store_stats()
    }
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        self.drain()?;
        let free = SeqStore::kv_pages_that_fit(&mut self.gpu, layout, slots)?;
        Ok(kv_pages_within(free, self.kv_cap, layout.page_bytes()))
    }
}

/// The KV pages a Hybrid offers: what the GPU's free memory allows (`free`, after the DeltaNet
/// slots the engine asks for), within the plan's KV bytes (`cap`) when set. The cap holds KV
/// only: `ember bench` configures one slot more than the sequences it plans (the snapshot it
/// restores from), and a cap that also held the plan's DeltaNet slots left no KV page once
/// that slot's state was taken out of it (an `EMBER_SPLIT_PARTS=2` bench on the H100,
/// 2026-12-06: "memory for 0 KV pages").
fn kv_pages_within(free: Option<usize>, cap: Option<u64>, page_bytes: usize) -> Option<usize> {
    let Some(cap) = cap else { return free };
    let capped = usize::try_from(cap / page_bytes.max(1) as u64).unwrap_or(usize::MAX);
    Some(free.map_or(capped, |f| f.min(capped)))
}

impl Ops for Hybrid {
    fn name(&self) -> &'static str {
        if self.partial.iter().any(|p| *p) { "cuda+cpu" } else { "cuda" }
    }
    fn device(&self) -> DeviceId {
        self.gpu.device()
    }
    fn keep_weights(&mut self, kept: Option<Vec<bool>>) {
        self.gpu.set_weights_kept(kept.clone());
        self.kept = kept;
    }
    /// Uploads the trunk and the resident experts, hottest first in each layer. When the GPU
    /// has less memory than the plan counted on (another process took some since), it starts
    /// smaller: each failed try keeps 3/4 of every layer's experts, the coldest going.
    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.drain()?;
        self.host.set(weights.clone());
        let n_layer = self.resident.len().max(self.heat.n_layer());
        self.owned = (0..n_layer)
            .map(|l| match (&self.kept, weights.moe(LayerIdx(l as u16))) {
                (Some(k), Some(m)) => k.get(m.down.index()).copied().unwrap_or(true),
                _ => true,
            })
            .collect();
        for (l, list) in self.resident.iter_mut().enumerate() {
            if let Some(list) = list {
                list.sort_by(|a, b| self.heat.get(l, *b as usize).total_cmp(&self.heat.get(l, *a as usize)).then(a.cmp(b)));
            }
        }
        let mut tries = 0;
        loop {
            self.gpu.set_resident_experts(self.resident.clone());
            match self.gpu.register(weights.clone()) {
                Ok(()) => break,
                Err(e) if tries < 4 && e.to_string().contains("out of memory") => {
                    tries += 1;
                    let owned = self.owned.clone();
                    for (l, list) in self.resident.iter_mut().enumerate().filter(|(l, _)| owned.get(*l).copied().unwrap_or(true)) {
                        let all = || -> Vec<u16> {
                            let n = weights.moe(LayerIdx(l as u16)).map_or(0, |m| m.n_expert);
                            let mut v: Vec<u16> = (0..n as u16).collect();
                            v.sort_by(|a, b| self.heat.get(l, *b as usize).total_cmp(&self.heat.get(l, *a as usize)).then(a.cmp(b)));
                            v
                        };
                        let v = list.get_or_insert_with(all);
                        v.truncate(v.len() * 3 / 4);
                        if let Some(p) = self.partial.get_mut(l) {
                            *p = true;
                        }
                    }
                    say(format!("expert tier: {e}; starting with fewer experts on the GPU (try {tries})"));
                }
                Err(e) => return Err(e),
            }
        }
        self.cost = self.measure_costs()?;
        Ok(())
    }
    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        self.drain()?;
        self.step_tokens = batch.tokens.len();
        // A step that posted mailboxes and read no rows (a prompt chunk without logits) was
        // never waited for: wait now, so a mailbox wait of it that timed out is reported here,
        // against this batch's predecessor, not some later step (begin_step itself queues the
        // batch's uploads without waiting).
        if std::mem::take(&mut self.posted_unwaited) {
            self.gpu.gpu().sync().map_err(|e| OpError::new("begin_step", self.gpu.device(), "", e.to_string()))?;
        }
        self.gpu.begin_step(batch)?;
        self.check_timeouts()
    }
    fn end_step(&mut self) -> OpResult<()> {
        self.drain()?;
        self.gpu.end_step()?;
        self.heat.advance(self.step_tokens);
        self.stats.tokens += self.step_tokens as u64;
        self.step_tokens = 0;
        self.rebalance()?;
        self.check_memory();
        if self.saved.elapsed() >= SAVE_EVERY
            && let Err(e) = self.save_heat()
        {
            eprintln!("expert tier: could not save the heat: {e}");
        }
        Ok(())
    }
    fn mark(&self) -> Mark {
        self.gpu.mark()
    }
    /// The host reads no handle's device buffer (misses read their own copies and post their
    /// sums through the mailbox, which a kernel in stream order adds): nothing to drain first.
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        self.gpu.free_since(mark, keep)
    }
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        self.drain()?;
        self.gpu.upload(x)
    }
    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        self.drain()?;
        let m = self.gpu.read(x)?;
        // A read of rows has waited for the stream (one of none has not; begin_step checks).
        if x.n * x.d > 0 {
            self.posted_unwaited = false;
            self.check_timeouts()?;
        }
        Ok(m)
    }
    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<ember_ops::TopRow>> {
        self.drain()?;
        let t = self.gpu.read_top(x, k, extra)?;
        // It waited for the stream when it brought entries down (none asked for: no wait).
        if x.n > 0 && (k.min(x.d) > 0 || extra.iter().flatten().any(|&i| (i as usize) < x.d)) {
            self.posted_unwaited = false;
            self.check_timeouts()?;
        }
        Ok(t)
    }
    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        self.drain()?;
        self.gpu.read_routing(r)
    }
    /// Serves the posted mailboxes first: the rows are ready only once the GPU has had the
    /// host's sums of the misses, and nothing else of this part waits for the stream before the
    /// next part's layers run.
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<ember_ops::DeviceRows>> {
        self.drain()?;
        self.gpu.export_rows(x)
    }
    fn import_rows(&mut self, rows: &ember_ops::DeviceRows) -> OpResult<Option<(Tensor, ember_ops::QueueMark)>> {
        self.drain()?;
        self.gpu.import_rows(rows)
    }
    fn wait_mark(&mut self, mark: &ember_ops::QueueMark) -> OpResult<()> {
        self.gpu.wait_mark(mark)
    }
    /// Also serves the posted mailboxes: the GPU would wait on them at the first layer with
    /// misses while the host did what comes after the submit.
    fn submit(&mut self) -> OpResult<()> {
        self.gpu.submit()?;
        self.drain()
    }
    fn overlaps(&self) -> bool {
        true
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
    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        self.gpu.add_rms_norm(h, x, w, eps)
    }
    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        self.gpu.rms_norm_gate(x, w, eps, g, act)
    }
    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        self.gpu.attn_prep(s, qg, k)
    }
    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        // A new KV page's table write waits for the stream, which may wait on a mailbox.
        if !self.posted.is_empty() && self.gpu.kv_append_waits(layer) {
            self.drain()?;
        }
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
        let small = x.n * x.d * std::mem::size_of::<f32>() <= X_WITH_ROUTING_BYTES;
        // Decode: the mailbox (no wait here), unless the host may wait for the stream mid-step
        // (timed launches or flushes, frees that are not stream-ordered: Gpu::host_waits_ok).
        if small && self.opts.mailbox && self.gpu.gpu().host_waits_ok() {
            return self.moe_posted(layer, x, routing, shared_gate);
        }
        self.drain()?;
        // Decode: x comes down with the routing (X_WITH_ROUTING_BYTES); a prompt's later, if
        // its misses run on the CPU.
        let (table, xh) = if routing.n_tok == 1 || small {
            let (table, xh) = self.gpu.read_routing_with(routing, x)?;
            (table, Some(xh))
        } else {
            (self.gpu.read_routing(routing)?, None)
        };
        let ids: Vec<u32> = table.ids.iter().map(|e| e.0 as u32).collect();
        self.heat.record(layer.index(), &ids).map_err(|e| OpError::new(OP, self.gpu.device(), format!("{layer}"), e.to_string()))?;
        let misses = self.misses(layer, &ids, &table.weights, table.k);
        let n_miss: usize = misses.values().map(Vec::len).sum();
        self.count(layer, ids.len(), n_miss);
        if misses.is_empty() {
            return self.gpu.moe(layer, x, routing, shared_gate);
        }
        // A prompt batch: up or to the CPU, whichever the cost model says is faster.
        if table.n_tok > 1
            && let Some(cost) = self.cost
        {
            let mut bytes = 0u64;
            for &e in misses.keys() {
                let v = self.host.expert(OP, layer, ExpertId(e))?;
                bytes += (v.gate.data.len() + v.up.data.len() + v.down.data.len()) as u64;
            }
            let (cpu, up) = (cost.cpu(misses.len(), n_miss), cost.upload(bytes));
            let go_up = match self.opts.prompt_misses {
                MissPath::Auto => up < cpu,
                MissPath::Cpu => false,
                MissPath::Upload => true,
            };
            if go_up {
                let mut touched: Vec<u16> = ids.iter().filter(|&&e| (e as usize) < n_expert).map(|&e| e as u16).collect();
                touched.sort_unstable();
                touched.dedup();
                let t0 = Instant::now();
                let out = self.gpu.moe_streamed(layer, x, routing, shared_gate, &touched)?;
                let took = t0.elapsed().as_secs_f64();
                // The upload's share of the model follows what it took (the layer's GPU work
                // is queued, not waited for, so this is the upload's time).
                if let Some(c) = self.cost.as_mut() {
                    c.up_per_byte *= (took / up).clamp(0.5, 2.0).powf(0.25);
                }
                self.stats.streamed_pairs += n_miss as u64;
                self.stats.streamed_bytes += bytes;
                return Ok(out);
            }
        }
        let xh = match xh {
            Some(xh) => xh,
            None => self.gpu.read(x)?,
        };
        // The GPU's launches are queued; the CPU computes the misses meanwhile.
        let out = self.gpu.moe(layer, x, routing, shared_gate)?;
        // Recorded launches (a graph-replayed step) go out now, so the GPU runs them while
        // the CPU computes.
        self.gpu.flush()?;
        let t0 = Instant::now();
        let y = self.cpu_misses(layer, &misses, &xh)?;
        let took = t0.elapsed().as_secs_f64();
        if table.n_tok > 1
            && let Some(c) = self.cost.as_mut()
        {
            let want = c.cpu(misses.len(), n_miss);
            let f = (took / want.max(1e-9)).clamp(0.5, 2.0).powf(0.25);
            c.cpu_per_expert *= f;
            c.cpu_per_pair *= f;
        }
        // Queued, not waited for (CudaOps::upload); the add runs after it on the stream.
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

    fn expert_layer_stats(&self) -> Vec<(LayerIdx, u64, u64)> {
        self.per_layer.iter().enumerate().filter(|(_, c)| c.0 + c.1 > 0).map(|(l, c)| (LayerIdx(l as u16), c.0, c.1)).collect()
    }
}

#[cfg(test)]
mod tests;
