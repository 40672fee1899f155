//! [`CudaOps`]: ember's op trait ([`Ops`] + [`SeqStore`]) on one GPU.
//!
//! * Weights are uploaded once at [`Ops::register`] ([`weights`]).
//! * Activations are handles into a per-step arena of device buffers ([`arena`]): the same
//!   allocations in the same order give the same handles and addresses step after step.
//! * [`Ops::begin_step`] checks the batch as [`ember_ops::HostBackend`] does and writes it to the
//!   device once: token ids, positions, each row's slot, the logit rows, and per sequence its
//!   first row, length and slot. The sequence ops read those buffers: every sequence of a step
//!   in one launch.
//! * State lives in a device [`SeqStore`] ([`store`]): DeltaNet slots and a paged KV pool.
//! * Every op runs the shape checks of [`ember_ops::check`] (so errors match every backend's)
//!   before touching the GPU; routing stays on the device; `read`/`read_routing` (and
//!   [`CudaOps::read_routing_with`], both in one wait) are the only downloads.
//!
//! The delta rule: one token (decode) is always the recurrent scan; a prompt span is the
//! chunked form under [`DeltaMode::Chunked`], and under `Auto` from
//! [`crate::ops::DELTA_AUTO_CHUNKED_FROM`] tokens on (where it was measured faster).

mod arena;
mod delta;
mod experts;
mod ops;
mod read;
mod routing;
mod step_times;
mod store;
mod weights;

use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeviceId, Gate, KvRows, LayerIdx, Mat, OpError, OpResult, SeqSpan, SeqStore, Slot, SlotId,
    Snapshot, StateKind, StateLayout, StoreStats, Tensor, WeightInfo, check,
};

use crate::ops::{Act, AttentionShape, AttnPrepIn, AttnPrepKv, AttnPrepShape, Precision, SeqRows, StateAt};
use crate::{Buf, Gpu};

use arena::{Arena, Routes};
use experts::StreamScratch;
use read::TopBufs;
use store::DevStore;
use weights::DevWeights;

/// The batch of the current step on the device.
struct StepBufs {
    tokens: Buf<u32>,
    pos: Buf<u32>,
    row_slot: Buf<u32>,
    logit_rows: Buf<u32>,
    seq_row0: Buf<u32>,
    seq_n: Buf<u32>,
    seq_slot: Buf<u32>,
    /// Per-call positions for a `kv_append` whose caches are not at the sequences' pos0.
    kv_pos: Buf<u32>,
    /// One u32: the step's generation ([`CudaOps::generation`]), for the mailbox kernels.
    generation: Buf<u32>,
}

/// ember's ops on one CUDA GPU.
pub struct CudaOps {
    gpu: Gpu,
    dev: DeviceId,
    precision: Precision,
    weights: DevWeights,
    arena: Arena,
    routes: Routes,
    batch: Batch,
    spans: Vec<SeqSpan>,
    slots: Vec<SlotId>,
    pos: Vec<u32>,
    stepping: bool,
    step: StepBufs,
    store: DevStore,
    /// Per layer, the routed experts to hold when not all ([`CudaOps::set_resident_experts`]).
    resident: Vec<Option<Vec<u16>>>,
    /// Which weights the next register uploads, by id (None: all): a layer split's part keeps
    /// its own layers' ([`CudaOps::set_weights_kept`]).
    kept: Option<Vec<bool>>,
    /// The experts of the last [`CudaOps::moe_streamed`] batch.
    stream: Option<StreamScratch>,
    /// The tensor whose int8 copy the GPU's int8 scratch holds, and that write's generation
    /// ([`Gpu::q8_generation`]): a norm's output the GEMVs after it read without quantising it
    /// again.
    q8_x: Option<(u32, u64)>,
    /// Bumped by every `begin_step` (never 0, which a fresh mailbox holds).
    generation: u32,
    /// `read_top`'s device buffers (grown on demand).
    top: Option<TopBufs>,
    /// Where one-row steps' host time goes, when `EMBER_CUDA_STEP_TIMES` is set.
    times: Option<step_times::StepTimes>,
    /// The mapped memory deferred steps take their tokens from (made at the first).
    feed: Option<crate::Feed>,
    /// The generation of the deferred step begun last, until it is fed.
    unfed: Option<u32>,
    /// The last generation whose feed wait gave up that was reported.
    feed_timeouts_seen: u32,
}

/// Rows of a deferred step at most (the feed's room; a decode step has one row a sequence).
pub const FEED_ROWS: usize = 256;

impl Drop for CudaOps {
    fn drop(&mut self) {
        // A deferred step nobody fed: the device must not wait for it (the feed's own drop,
        // after this, waits for the stream).
        self.release_feed();
        if let Some(line) = self.times.as_ref().and_then(|t| t.report()) {
            eprintln!("{line}");
        }
    }
}

fn act_of(g: Gate) -> Act {
    match g {
        Gate::Silu => Act::Silu,
        Gate::Sigmoid => Act::Sigmoid,
    }
}

/// A host matrix with the shape of `t` and no data, for the shared shape checks.
fn shape_of(t: Tensor) -> Mat {
    Mat { n: t.n, d: t.d, data: Vec::new() }
}

fn cuda(op: &'static str, dev: DeviceId) -> impl Fn(crate::Error) -> OpError {
    move |e| OpError::new(op, dev, "", e.to_string())
}

/// [`check::matmul`] on a handle (that check also compares the host data's length, which a
/// handle has none of): the same message.
fn check_matmul(op: &'static str, dev: DeviceId, w: &WeightInfo, x: Tensor) -> OpResult<()> {
    if x.d != w.k {
        return Err(OpError::new(
            op,
            dev,
            format!("x {}x{}, w {}", x.n, x.d, w.describe()),
            format!("x has {} columns, weight rows have {}", x.d, w.k),
        ));
    }
    Ok(())
}

/// Writes each item's data to the start of its buffer (growing it first if needed), without
/// waiting for the stream ([`Gpu::write_each`]).
fn put_all(gpu: &Gpu, items: &mut [(&mut Buf<u32>, &[u32])]) -> crate::Result<()> {
    for (buf, data) in items.iter_mut() {
        if buf.len() < data.len() {
            **buf = gpu.alloc(data.len().next_power_of_two())?;
        }
    }
    gpu.write_each(items)?;
    // `EMBER_STEP_UPLOAD_WAIT=1`: wait for the copies as before (an A/B switch).
    static WAIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *WAIT.get_or_init(|| std::env::var_os("EMBER_STEP_UPLOAD_WAIT").is_some_and(|v| v == "1")) {
        gpu.sync()?;
    }
    Ok(())
}

/// Writes `data` to the start of `buf`, growing it first if needed.
fn put(gpu: &Gpu, buf: &mut Buf<u32>, data: &[u32]) -> crate::Result<()> {
    if buf.len() < data.len() {
        *buf = gpu.alloc(data.len().next_power_of_two())?;
    }
    if data.is_empty() { Ok(()) } else { gpu.write(buf, data) }
}

impl CudaOps {
    /// Opens GPU `device_index` (kernels compile on first use) at [`Precision::Fast`].
    pub fn new(device_index: usize) -> crate::Result<Self> {
        Self::with_precision(device_index, Precision::Fast)
    }

    /// Opens GPU `device_index` at `precision`: [`Precision::Exact`] keeps f32 activations and
    /// sums for every op (what the tests compare with float64 references at 1e-4);
    /// [`Precision::Fast`] runs prompt-sized matmuls on tensor cores.
    pub fn with_precision(device_index: usize, precision: Precision) -> crate::Result<Self> {
        let gpu = Gpu::new(device_index)?;
        let dev = DeviceId::Gpu(u16::try_from(device_index).unwrap_or(u16::MAX));
        let one = || gpu.zeros::<u32>(1);
        let step = StepBufs {
            tokens: one()?,
            pos: one()?,
            row_slot: one()?,
            logit_rows: one()?,
            seq_row0: one()?,
            seq_n: one()?,
            seq_slot: one()?,
            kv_pos: one()?,
            generation: one()?,
        };
        Ok(CudaOps {
            dev,
            precision,
            weights: DevWeights::empty(dev),
            arena: Arena::new(dev),
            routes: Routes::new(dev),
            batch: Batch::default(),
            spans: Vec::new(),
            slots: Vec::new(),
            pos: Vec::new(),
            stepping: false,
            step,
            store: DevStore::new(dev),
            resident: Vec::new(),
            kept: None,
            stream: None,
            q8_x: None,
            generation: 0,
            top: None,
            times: step_times::from_env(),
            feed: None,
            unfed: None,
            feed_timeouts_seen: 0,
            gpu,
        })
    }

    /// Gives a deferred step that was never fed token 0 in every row, so that the device does
    /// not wait on it (its results are garbage and nobody reads them); true when one waited.
    fn release_feed(&mut self) -> bool {
        let Some(generation) = self.unfed.take() else { return false };
        if let Some(f) = &self.feed {
            let _ = f.write(generation, &vec![0; self.batch.n_rows().min(f.cap())]);
        }
        true
    }

    /// An error when the feed wait of a step that ran gave up on the host (once per such step).
    fn check_feed_timeouts(&mut self, op: &'static str) -> OpResult<()> {
        let Some(f) = &self.feed else { return Ok(()) };
        let t = f.timed_out();
        if t == 0 || t == self.feed_timeouts_seen {
            return Ok(());
        }
        self.feed_timeouts_seen = t;
        Err(OpError::new(
            op,
            self.dev,
            "",
            format!("the GPU waited more than {:?} for a step's tokens", std::time::Duration::from_nanos(crate::FEED_TIMEOUT_NS)),
        ))
    }

    /// Whether a step over `batch`'s sequences can have its KV pages reserved and their table
    /// written before it is queued (the pool has them), and every cache ends at its sequence's
    /// first position: then its `kv_append`s write nothing from the host.
    fn kv_appends_stay_on_device(&self, batch: &Batch) -> bool {
        // (A slot not in use fails begin_step's checks; nothing is looked up for it here.)
        if batch.seqs.iter().any(|s| self.store.live_len("can_defer", s.slot).is_err()) {
            return false;
        }
        let slots: Vec<SlotId> = batch.seqs.iter().map(|s| s.slot).collect();
        let ns: Vec<usize> = batch.seqs.iter().map(|s| s.n).collect();
        self.store.can_reserve(&slots, &ns)
            && (0..self.store.n_kv()).all(|a| batch.seqs.iter().all(|s| self.store.cache(s.slot, a, 0).len == s.pos0))
    }

    /// The GPU (device info, timings).
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The most KV pages a store of `slots` slots of `layout` can have on this GPU now, keeping
    /// `reserve` bytes free for activations and scratch: (free memory − the slots' DeltaNet
    /// state − the current store's memory, which `configure` gives back first − `reserve`) over
    /// the page size. What an engine clamps its pool to before [`SeqStore::configure`].
    pub fn kv_pages_that_fit(&self, layout: &StateLayout, slots: usize, reserve: usize) -> OpResult<usize> {
        let (free, _) = self.gpu.mem_info().map_err(cuda("kv_pages_that_fit", self.dev))?;
        let held = self.store.pool.as_ref().map_or(0, |p| p.len()) + 4 * self.store.delta.as_ref().map_or(0, |d| d.len());
        let delta = slots.saturating_mul(layout.delta_bytes());
        let page = layout.page_bytes().max(1);
        Ok((free + held).saturating_sub(delta).saturating_sub(reserve) / page)
    }

    /// The device address of a handle of this step (what a captured CUDA graph bakes in: a
    /// step that allocates the same shapes in the same order gets the same addresses).
    pub fn device_ptr(&self, t: Tensor) -> OpResult<u64> {
        Ok(self.arena.buf("device_ptr", t)?.ptr())
    }

    /// Puts the launches recorded so far on the stream (the GPU starts on them): what a caller
    /// does before host work meant to overlap them.
    pub fn flush(&self) -> OpResult<()> {
        self.gpu.flush().map_err(cuda("flush", self.dev))
    }

    /// Device bytes the step arena holds (every handle's buffer and the spares kept for later
    /// handles): about one layer's activations for a step of the model, which frees each
    /// layer's intermediates ([`ember_ops::Ops::free_since`]).
    pub fn arena_bytes(&self) -> usize {
        self.arena.bytes()
    }

    /// (free, total) bytes of this GPU now.
    pub fn mem_info(&self) -> crate::Result<(usize, usize)> {
        self.gpu.mem_info()
    }

    /// Whether [`ember_ops::Ops::kv_append`] on `layer` in this step writes to the device and waits for
    /// the stream (a page table write, or positions for caches not at the step's): a caller
    /// whose host work the stream may be waiting on (a posted mailbox) serves it first. True
    /// when unsure.
    pub fn kv_append_waits(&self, layer: LayerIdx) -> bool {
        let Ok(a) = self.store.ordinal("kv_append", layer, StateKind::Kv) else { return true };
        if self.live_slots("kv_append").is_err() {
            return true;
        }
        let ns: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
        self.store.grow_writes_table(&self.slots, &ns, a) || !self.kv_at_pos0(a)
    }

    /// Whether every sequence's K cache of layer ordinal `a` ends at the step's first position.
    fn kv_at_pos0(&self, a: usize) -> bool {
        self.slots.iter().zip(&self.spans).all(|(s, sp)| self.store.cache(*s, a, 0).len == sp.pos0)
    }

    fn rows_check(&self, op: &'static str, t: Tensor) -> OpResult<()> {
        let n = self.batch.n_rows();
        if t.n != n {
            return Err(OpError::new(op, self.dev, format!("{}x{}", t.n, t.d), format!("the step's batch has {n} rows")));
        }
        Ok(())
    }

    /// Where DeltaNet layer ordinal `d` sits in every slot: (conv, rec).
    fn delta_at(&self, d: usize) -> (StateAt, StateAt) {
        let (c, r) = self.store.delta_at(d);
        let (per, n_slots) = (self.store.slot_floats(), self.store.n_slots());
        let l = &self.store.layout;
        (StateAt { slot_stride: per, offset: c, len: l.conv, n_slots }, StateAt { slot_stride: per, offset: r, len: l.rec, n_slots })
    }

    /// Checks the step's slots are still live and distinct (a store reconfigured since
    /// `begin_step` refuses them).
    fn live_slots(&self, op: &'static str) -> OpResult<()> {
        self.store.live_all(op, &self.slots)
    }

    /// `h ← f(h, x)` in place for an elementwise op; `x` may be `h` itself (then copied first).
    /// Whether the GPU's int8 scratch holds `x`'s int8 copy (a norm wrote it and nothing has
    /// written the scratch or x since).
    fn q8_holds(&self, x: Tensor) -> bool {
        self.q8_x == Some((x.id, self.gpu.q8_generation()))
    }

    /// [`ember_ops::Ops::attention`], with `gate` (g, act) also `y ⊙= act(g)` and its int8
    /// copy (as the gate op leaves them) in the attention's launches where the GPU does that for
    /// this call (`EMBER_ATTN_GATE=1`, [`crate::Gpu::attention_gates`]); the bool says whether it did.
    fn attention_with(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, gate: Option<(Tensor, Gate)>) -> OpResult<(Tensor, bool)> {
        const OP: &str = "attention";
        let dev = self.dev;
        self.rows_check(OP, q)?;
        let a = self.store.ordinal(OP, layer, StateKind::Kv)?;
        self.arena.check(OP, q)?;
        if let Some((g, _)) = gate {
            self.arena.check(OP, g)?;
        }
        self.live_slots(OP)?;
        check::spans(OP, dev, &self.spans, q.n, self.spans.len())?;
        let (ty, width) = (self.store.layout.kv_type, self.store.layout.kv_width);
        for (sp, slot) in self.spans.iter().zip(&self.slots) {
            let rows = |kv| {
                let mut r = KvRows::new(ty, width);
                r.len = self.store.cache(*slot, a, kv).len;
                r
            };
            check::attention(OP, dev, &h.shape(sp), &Mat { n: sp.n, d: q.d, data: Vec::new() }, &rows(0), &rows(1))?;
        }
        self.store.sync_table(&self.gpu, OP)?;
        let max_keys = self.spans.iter().map(|s| s.pos0 + s.n).max().unwrap_or(0);
        let seq_rows: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
        let mut shape = AttentionShape::new(h.n_head, h.n_head_kv, h.head_dim, h.scale, &seq_rows, max_keys);
        shape.fast = self.precision == Precision::Fast;
        // The output, then the scratch of the split over the keys (always allocated, so the
        // handles that follow do not depend on the depth).
        let y = self.arena.alloc(&self.gpu, OP, q.n, q.d)?;
        self.arena.alloc(&self.gpu, OP, 1, self.gpu.attention_scratch(&shape).max(1))?;
        let pages = self.store.kv_pages(OP, dev, a)?;
        let (ins, mut outs) = self.arena.split(y.id);
        let [yb, sb, ..] = &mut outs[..] else { unreachable!("two buffers were just allocated") };
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let (row_slot, pos) = (&self.step.row_slot, &self.step.pos);
        let gated = gate.filter(|&(g, _)| {
            self.gpu.attention_gate_on() && g.id != y.id && (g.n, g.d) == (q.n, q.d) && self.gpu.attention_gates(&shape, pages.ty)
        });
        if let Some((g, act)) = gated {
            let q8 = self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, q.d, q.n, self.precision) && q.d.is_multiple_of(32);
            let act = act_of(act);
            let generation = self
                .gpu
                .attention_gated(&pages, shape, &ins[q.id as usize], &seqs, row_slot, pos, yb, sb, &ins[g.id as usize], act, q8)
                .map_err(cuda(OP, dev))?;
            if let Some(n) = generation {
                self.q8_x = Some((y.id, n));
            }
            return Ok((y, true));
        }
        self.gpu.attention(&pages, shape, &ins[q.id as usize], &seqs, row_slot, pos, yb, sb).map_err(cuda(OP, dev))?;
        Ok((y, false))
    }

    /// [`ember_ops::Ops::attn_prep`]; with `append` (layer, v), also the k it makes and v
    /// written into the layer's caches by the same launch (`attn_prep_append`: the caches grow
    /// after the prep's checks, so only for a call that then runs).
    fn attn_prep_with(&mut self, s: AttnPrep, qg: Tensor, k: Tensor, append: Option<(LayerIdx, Tensor)>) -> OpResult<AttnIn> {
        let op = if append.is_some() { "attn_prep_append" } else { "attn_prep" };
        self.rows_check(op, qg)?;
        self.arena.check(op, qg)?;
        self.arena.check(op, k)?;
        let lens = (self.weights.vector(op, s.q_norm)?.len(), self.weights.vector(op, s.k_norm)?.len());
        check::attn_prep(op, self.dev, &s, lens, &shape_of(qg), &shape_of(k), &self.pos)?;
        let kv = match append {
            Some((layer, v)) => Some((self.kv_prepare(op, layer, k, v)?, v)),
            None => None,
        };
        let (qn, kn) = (self.weights.vector(op, s.q_norm)?, self.weights.vector(op, s.k_norm)?);
        let pages = kv.map(|((a, _), _)| self.store.kv_pages(op, self.dev, a)).transpose()?;
        let (n, nh, nkv, hd) = (qg.n, s.n_head, s.n_head_kv, s.head_dim);
        let q = self.arena.alloc(&self.gpu, op, n, nh * hd)?;
        let gate = self.arena.alloc(&self.gpu, op, n, nh * hd)?;
        let ko = self.arena.alloc(&self.gpu, op, n, nkv * hd)?;
        let (ins, mut outs) = self.arena.split(q.id);
        let [qb, gb, kb, ..] = &mut outs[..] else { unreachable!("three outputs were just allocated") };
        let shape =
            AttnPrepShape { n_tok: n, n_head: nh, n_head_kv: nkv, head_dim: hd, n_rot: s.n_rot, eps: s.eps, rope_base: s.rope_base };
        let input = AttnPrepIn { qg: &ins[qg.id as usize], k: &ins[k.id as usize], q_norm: qn, k_norm: kn, pos: &self.step.pos };
        let to_kv = match (kv, &pages) {
            (Some(((_, at_pos0), v)), Some(pages)) => {
                let pos = if at_pos0 { &self.step.pos } else { &self.step.kv_pos };
                Some(AttnPrepKv { pages, v: &ins[v.id as usize], row_slot: &self.step.row_slot, pos })
            }
            _ => None,
        };
        self.gpu.attn_prep_kv(shape, input, qb, gb, kb, to_kv).map_err(cuda(op, self.dev))?;
        Ok(AttnIn { q, gate, k: ko })
    }

    /// kv_append's checks of the step's rows `k` and `v` for attention layer `layer`, and the
    /// caches grown to take them (pages in the table, the table on the device; the rows'
    /// positions uploaded when a cache is not at the step's positions): the layer's ordinal
    /// among the KV layers, and whether the rows go at the step's positions (else `kv_pos`).
    fn kv_prepare(&mut self, op: &'static str, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<(usize, bool)> {
        let dev = self.dev;
        self.rows_check(op, k)?;
        let a = self.store.ordinal(op, layer, StateKind::Kv)?;
        self.arena.check(op, k)?;
        self.arena.check(op, v)?;
        self.live_slots(op)?;
        check::spans(op, dev, &self.spans, k.n, self.spans.len())?;
        check::same(op, dev, &shape_of(k), &shape_of(v))?;
        let (ty, width) = (self.store.layout.kv_type, self.store.layout.kv_width);
        for sp in &self.spans {
            check::kv_append(op, dev, &KvRows::new(ty, width), &Mat { n: sp.n, d: k.d, data: Vec::new() })?;
        }
        let ns: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
        // The rows go at each cache's end: the step's positions unless a cache is elsewhere.
        let at_pos0 = self.kv_at_pos0(a);
        let before = self.store.grow(&self.gpu, op, &self.slots, &ns, a)?;
        self.store.sync_table(&self.gpu, op)?;
        if !at_pos0 {
            let pos: Vec<u32> = before.iter().zip(&self.spans).flat_map(|(b, s)| (*b..*b + s.n).map(|p| p as u32)).collect();
            put(&self.gpu, &mut self.step.kv_pos, &pos).map_err(cuda(op, dev))?;
        }
        Ok((a, at_pos0))
    }

    /// Sums a one-launch MoE's experts into its output `t` if they are pending (before
    /// anything but the residual add or norm reads it).
    fn settle(&mut self, op: &'static str, t: Tensor) -> OpResult<()> {
        if self.arena.pending(t).is_none() {
            return Ok(());
        }
        self.settle_any(op)
    }

    /// Sums the pending one-launch MoE's experts into its output, if one is pending.
    pub(super) fn settle_any(&mut self, op: &'static str) -> OpResult<()> {
        let Some(p) = self.arena.pending_any() else { return Ok(()) };
        self.arena.clear_pending();
        let (ob, pb) = self.arena.pair(p.out, p.parts);
        self.gpu.add_parts(ob, pb, p.n, p.len, true).map_err(cuda(op, self.dev))
    }

    /// Before `free_since(mark, keep)`: a pending MoE output that is kept is summed first (its
    /// rows go with the layer), and a deferred routing whose logits go is computed first.
    pub(super) fn settle_before_free(&mut self, mark: ember_ops::Mark, keep: &[Tensor]) -> OpResult<()> {
        const OP: &str = "free_since";
        if let Some(p) = self.arena.pending_any()
            && keep.iter().any(|t| t.id == p.out)
        {
            self.settle_any(OP)?;
        }
        if let Some((r, l)) = self.routes.pending_any()
            && l.id >= mark.0
            && !keep.iter().any(|t| t.id == l.id)
        {
            self.settle_route(OP, r)?;
        }
        Ok(())
    }

    /// `h ← h + Σ parts` and the norm of h with its int8 copy (as `add_rms_norm`), from a
    /// one-launch MoE's pending output `x`: its experts' rows read by the norm itself. None when
    /// the norm over parts does not take this row (the caller sums them first).
    fn add_rms_norm_parts(&mut self, h: Tensor, x: Tensor, p: arena::Parts, w: ember_ops::WeightId, eps: f32) -> OpResult<Option<Tensor>> {
        const OP: &str = "add_rms_norm";
        self.arena.check(OP, h)?;
        self.arena.check_live(OP, x)?;
        check::same(OP, self.dev, &shape_of(h), &shape_of(x))?;
        let wv = self.weights.vector(OP, w)?;
        check::rms_norm(OP, self.dev, &shape_of(h), wv.len())?;
        if !self.gpu.norm_parts_fit(h.d, wv.len()) {
            return Ok(None);
        }
        if self.q8_x.is_some_and(|(id, _)| id == h.id) {
            self.q8_x = None; // h changes: its int8 copy is stale
        }
        let y = self.arena.alloc(&self.gpu, OP, h.n, h.d)?;
        let q8 = self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, h.d, h.n, self.precision);
        let (hb, pb, yb) = self.arena.trio(h.id, p.parts, y.id);
        let generation = self.gpu.add_rms_norm_parts(hb, pb, p.n, h.n, h.d, wv, eps, yb, q8).map_err(cuda(OP, self.dev))?;
        if let Some(g) = generation {
            self.q8_x = Some((y.id, g));
        }
        Ok(Some(y))
    }

    fn in_place(
        &mut self,
        op: &'static str,
        h: Tensor,
        x: Tensor,
        f: impl FnOnce(&Gpu, &mut Buf<f32>, &Buf<f32>, usize) -> crate::Result<()>,
    ) -> OpResult<()> {
        self.arena.check(op, h)?;
        self.arena.check(op, x)?;
        check::same(op, self.dev, &shape_of(h), &shape_of(x))?;
        if self.q8_x.is_some_and(|(id, _)| id == h.id) {
            self.q8_x = None; // h changes: its int8 copy is stale
        }
        let src = if h.id == x.id {
            let tmp = self.arena.alloc(&self.gpu, op, x.n, x.d)?;
            let (dst, src) = self.arena.pair(tmp.id, x.id);
            self.gpu.copy(src, 0, dst, 0, x.n * x.d).map_err(cuda(op, self.dev))?;
            tmp
        } else {
            x
        };
        let (hb, xb) = self.arena.pair(h.id, src.id);
        f(&self.gpu, hb, xb, h.n * h.d).map_err(cuda(op, self.dev))
    }
}

impl SeqStore for CudaOps {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.store.configure(&self.gpu, layout, slots, kv_pages)
    }

    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.store.alloc_slot(&self.gpu)
    }

    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.store.clear_slot(&self.gpu, slot)
    }

    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.store.slot_len(slot)
    }

    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.store.snapshot(&self.gpu, slot)
    }

    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.store.restore(&self.gpu, slot, snap)
    }

    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.store.read_delta(&self.gpu, slot, layer)
    }

    fn store_stats(&mut self) -> StoreStats {
        self.store.store_stats()
    }

    /// Free device memory less [`ACT_RESERVE`] for the step's activations and scratch.
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        CudaOps::kv_pages_that_fit(self, layout, slots, ACT_RESERVE).map(Some)
    }
}

/// Steps of up to this many rows are recorded and replayed as CUDA graphs; larger ones (prompt
/// chunks, on the tensor cores) launch eagerly. Measured on the H200 (synthetic 35B-A3B
/// Q4_K_M, 2026-12-04, graphs off / on alternating): decode (1 row) 125.2 -> 137.5 t/s at
/// depth 0 and 115.5 -> 126.3 at depth 8192, but pp512 4,499 -> 4,332 t/s (deferring a
/// tensor-core prompt step's launches only delays them). 2 to 40 rows were not
/// measured; 40 is where the matmuls leave the GEMV ([`crate::ops::MMA_MIN_TOKENS`]).
pub const GRAPH_MAX_ROWS: usize = crate::ops::MMA_MIN_TOKENS;

/// Device memory kept free for a step's activations, routing and MoE scratch when the engine
/// sizes the KV pool: a 512-token prompt step of the 35B-A3B model holds ~0.4 GiB with each
/// layer's handles freed (H100, 2026-12-05: peak 21,107 MiB with 20,180 MiB of weights; 2.2
/// GiB before freeing), an 8192-token one ~3.5 GiB; 1.5 GiB leaves room for batches of up to
/// ~2,048 tokens and the allocator.
pub const ACT_RESERVE: usize = 3 << 29;
