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
use std::time::{Duration, Instant};

use ember_cpu::CpuOps;
use ember_cuda::ops::MOE_MISS;
use ember_cuda::{CudaOps, Mailbox};
use ember_ops::{DeviceId, ExpertId, ExpertStats, LayerIdx, Mat, MoeSlot, OpError, OpResult, Ops, Registry};

use crate::tier::HeatMap;
use crate::{Home, Plan};

mod ops;
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
    /// A deferred step was begun and not fed yet ([`Ops::feed_tokens`]): nothing may wait for
    /// the stream, so `end_step`'s upkeep (uploads' bookkeeping, the memory watch, the heat's
    /// save) waits for the feed.
    unfed: bool,
    /// That upkeep is owed (done at the feed).
    upkeep_owed: bool,
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
            unfed: false,
            upkeep_owed: false,
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

    /// Keeps the KV pool the engine sizes ([`ember_ops::SeqStore::kv_pages_that_fit`]) within `bytes`, the
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

    /// What `end_step` does after the step's work is queued: uploads' bookkeeping and swaps
    /// (`rebalance`), the memory watch, the heat's save now and then.
    fn upkeep(&mut self) -> OpResult<()> {
        self.rebalance()?;
        self.check_memory();
        if self.saved.elapsed() >= SAVE_EVERY
            && let Err(e) = self.save_heat()
        {
            eprintln!("expert tier: could not save the heat: {e}");
        }
        Ok(())
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

#[cfg(test)]
mod tests;
