//! The op set every backend implements, the types it works on, and [`HostOps`], the scalar
//! reference backend (the spec in code, one thread).
//!
//! Model code (`ember-model`) is written only against the [`Ops`] trait and does no arithmetic
//! of its own: residual adds, the attention prep (q|gate split, q/k norms, RoPE), the DeltaNet
//! prep (L2 norms, β, decay), routing and the choice of logit rows are ops. Ops take and return
//! handles the backend owns ([`Tensor`], [`Routing`]), from a per-step arena; a step's token
//! ids, positions, sequences and logit rows are written once ([`Batch`], [`Ops::begin_step`]).
//! Per-sequence state lives in the backend's [`SeqStore`]: fixed DeltaNet slots, KV rows in
//! pages from a bounded pool, snapshots that share pages. Weights are registered once
//! ([`WeightSet`]) and named by [`WeightId`]; the MoE op gets the layer, the routing handle and
//! the shared-expert gate, so a backend sees every `(layer, expert)` pair used. Every op returns
//! [`OpResult`]; there are no default bodies, so a backend cannot silently fall back to the
//! reference.
//!
//! Host backends are one generic [`HostBackend`] (arena of [`Mat`]s + [`HostStore`]) over
//! [`HostKernels`], the op set on host matrices: the reference kernels ([`RefKernels`]) make
//! [`HostOps`], the CPU's SIMD kernels make the CPU backend.

#![forbid(unsafe_code)]

mod backend;
pub mod check;
pub mod conformance;
mod error;
pub mod host;
mod ids;
mod ops;
pub mod reference;
pub mod store;
pub mod top;
mod weights;

use ember_gguf::GgmlType;

pub use backend::HostBackend;
pub use error::{OpError, OpResult};
pub use host::{HostOps, RefKernels};
pub use ids::{DeviceId, ExpertId, LayerIdx, WeightId};
pub use ops::{HostKernels, Ops, add_norm_route_ops};
pub use store::{HostStore, KvPage, PagePool, SeqStore, Slot, SlotId, SnapInfo, Snapshot, StateKind, StateLayout, StoreStats};
pub use top::{TopRead, TopRow};
/// An expert tier's counters since the backend started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertStats {
    /// Routed (token, expert) pairs computed where the experts were resident / elsewhere (the
    /// CPU, from host memory).
    pub hits: u64,
    pub misses: u64,
    /// Experts moved into the device's memory.
    pub uploads: u64,
    /// Experts sent back to host memory because the device's free memory fell below its reserve.
    pub evictions: u64,
    /// Wall time spent on misses (the CPU's part, overlapped with the device's).
    pub miss_secs: f64,
    /// Bytes of expert weights read from host memory for misses computed on the CPU.
    pub miss_bytes: u64,
    /// Misses of prompt batches computed on the device after uploading their experts for the
    /// batch (part of `misses`), and the bytes uploaded so.
    pub streamed_pairs: u64,
    pub streamed_bytes: u64,
    /// Tokens the model ran.
    pub tokens: u64,
}

impl ExpertStats {
    /// Hits over all routed pairs (1 with none yet).
    pub fn hit_rate(&self) -> f64 {
        let all = self.hits + self.misses;
        if all == 0 { 1.0 } else { self.hits as f64 / all as f64 }
    }
}

pub use weights::{ExpertView, GateUp, MoeWeights, Registry, WeightInfo, WeightSet};

/// A row-major matrix of activations: `n` rows (usually tokens) of `d` values.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Mat {
    pub n: usize,
    pub d: usize,
    pub data: Vec<f32>,
}

/// A handle's rows offered to another backend, to copy on its own queue without the host
/// ([`Ops::export_rows`]; a layer split's hidden state crossing from one GPU to the next).
#[derive(Clone)]
pub struct DeviceRows {
    /// Where the rows are: the device and the address there.
    pub device: DeviceId,
    pub ptr: u64,
    pub n: usize,
    pub d: usize,
    /// When they are ready, in the exporting backend's terms (a backend of another kind
    /// cannot read it and does not import).
    pub ready: QueueMark,
}

/// A point in a backend's queue of work (an event after it), for another backend to order its
/// own work after ([`Ops::wait_mark`]).
pub type QueueMark = std::sync::Arc<dyn std::any::Any + Send + Sync>;

impl Mat {
    pub fn zeros(n: usize, d: usize) -> Self {
        Mat { n, d, data: vec![0.0; n * d] }
    }

    pub fn from_vec(n: usize, d: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), n * d, "Mat::from_vec: {} values for {n}x{d}", data.len());
        Mat { n, d, data }
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.d..(i + 1) * self.d]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.d..(i + 1) * self.d]
    }

    /// Rows `start..start + n`, as a new matrix.
    pub fn rows(&self, start: usize, n: usize) -> Mat {
        Mat::from_vec(n, self.d, self.data[start * self.d..(start + n) * self.d].to_vec())
    }

    /// Overwrites rows `start..start + src.n` with `src`.
    pub fn set_rows(&mut self, start: usize, src: &Mat) {
        assert_eq!(src.d, self.d, "set_rows: width {} into {}", src.d, self.d);
        self.data[start * self.d..(start + src.n) * self.d].copy_from_slice(&src.data);
    }

    /// Columns `start..start + width` of every row, as a new matrix.
    pub fn cols(&self, start: usize, width: usize) -> Mat {
        let mut data = Vec::with_capacity(self.n * width);
        for i in 0..self.n {
            data.extend_from_slice(&self.row(i)[start..start + width]);
        }
        Mat::from_vec(self.n, width, data)
    }
}

/// A 2-D weight in its file format: `n_rows` rows of `k` weights of type `ty`, borrowed from
/// the memory-mapped file. `y = W·x` means `y[r] = Σ_j W[r][j]·x[j]` (torch Linear).
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub ty: GgmlType,
    pub k: usize,
    pub n_rows: usize,
    pub data: &'a [u8],
}

impl<'a> WeightView<'a> {
    #[inline]
    pub fn row_bytes(&self) -> usize {
        // unwrap: views are built only from validated tensors whose k is a block multiple.
        self.ty.row_bytes(self.k).unwrap()
    }

    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// Rows `start..start + n` as a view (e.g. one expert of a stacked expert tensor).
    pub fn rows(&self, start: usize, n: usize) -> WeightView<'a> {
        let b = self.row_bytes();
        WeightView { data: &self.data[start * b..(start + n) * b], n_rows: n, ..*self }
    }
}

/// How a KV cache stores K and V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
    Q8_0,
}

impl KvType {
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F32 => GgmlType::F32,
            KvType::F16 => GgmlType::F16,
            KvType::Q8_0 => GgmlType::Q8_0,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvType::F32),
            "f16" => Some(KvType::F16),
            "q8_0" => Some(KvType::Q8_0),
            _ => None,
        }
    }
}

/// Positions per KV page. Small enough that a snapshot's copy of the last, partial page
/// (copy-on-write) stays small next to the DeltaNet state it copies anyway (at 35B: 20 K/V
/// layer caches x 64 KiB at f16 against ~60 MiB), large enough that a page lookup per position
/// costs nothing.
pub const KV_PAGE: usize = 64;

/// The K or V rows of one attention layer of one sequence, stored in `ty` blocks: row `p` is
/// position `p`, holding `n_head_kv * head_dim` values. Rows live in pages of [`KV_PAGE`]
/// positions (the page table is `pages`); a clone (a snapshot) shares every page, and a write
/// into a shared page copies it first (only ever the last one: rows are append-only).
#[derive(Debug, Clone)]
pub struct KvRows {
    pub ty: KvType,
    pub width: usize,
    pub len: usize,
    pages: Vec<KvPage>,
}

impl KvRows {
    pub fn new(ty: KvType, width: usize) -> Self {
        KvRows { ty, width, len: 0, pages: Vec::new() }
    }

    #[inline]
    pub fn row_bytes(&self) -> usize {
        // unwrap: width is a multiple of 32 (checked by the model loader for q8_0).
        self.ty.ggml().row_bytes(self.width).unwrap()
    }

    /// The page table: page i holds positions i·KV_PAGE.. (every page is allocated whole).
    pub fn pages(&self) -> &[KvPage] {
        &self.pages
    }

    /// The bytes of row `p` (`p < len`).
    #[inline]
    pub fn row(&self, p: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.pages[p / KV_PAGE][(p % KV_PAGE) * rb..(p % KV_PAGE + 1) * rb]
    }

    /// Appends rows (quantised to the cache type), taking new pages from `pool`; an error when
    /// the pool has none left (rows appended before that stay).
    pub fn push(&mut self, rows: &Mat, pool: &PagePool) -> Result<(), String> {
        let rb = self.row_bytes();
        let full = || format!("the KV page pool is full ({} pages)", pool.cap());
        for i in 0..rows.n {
            let (pg, at) = (self.len / KV_PAGE, self.len % KV_PAGE);
            if pg == self.pages.len() {
                self.pages.push(pool.page(KV_PAGE * rb).ok_or_else(full)?);
            }
            // A page shared with a snapshot is copied before the write.
            if std::sync::Arc::get_mut(&mut self.pages[pg]).is_none() {
                let mut copy = pool.page(KV_PAGE * rb).ok_or_else(full)?;
                // unwrap: a page just drawn has no other holder.
                std::sync::Arc::get_mut(&mut copy).unwrap().copy_from_slice(&self.pages[pg]);
                self.pages[pg] = copy;
            }
            // unwrap: the page is now held by this cache alone.
            let dst = &mut std::sync::Arc::get_mut(&mut self.pages[pg]).unwrap()[at * rb..(at + 1) * rb];
            match self.ty {
                KvType::F32 => {
                    for (d, x) in dst.chunks_exact_mut(4).zip(rows.row(i)) {
                        d.copy_from_slice(&x.to_le_bytes());
                    }
                }
                KvType::F16 => {
                    for (d, x) in dst.chunks_exact_mut(2).zip(rows.row(i)) {
                        d.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes());
                    }
                }
                KvType::Q8_0 => ember_gguf::quant::quantize(self.ty.ggml(), rows.row(i), dst).map_err(|e| e.to_string())?,
            }
            self.len += 1;
        }
        Ok(())
    }

    /// Drops every row from `len` on.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.pages.truncate(len.div_ceil(KV_PAGE));
        }
    }

    /// Bytes of the pages held (whole pages; shared ones included).
    pub fn bytes(&self) -> usize {
        self.pages.len() * KV_PAGE * self.row_bytes()
    }

    /// Values `start..start + out.len()` of row `p`, as f32.
    pub fn read(&self, p: usize, start: usize, out: &mut [f32]) {
        let row = self.row(p);
        match self.ty {
            KvType::F32 => {
                for (o, b) in out.iter_mut().zip(row[start * 4..].chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
                return;
            }
            KvType::F16 => {
                for (o, b) in out.iter_mut().zip(row[start * 2..].chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
                return;
            }
            KvType::Q8_0 => {}
        }
        let ty = self.ty.ggml();
        let bs = ty.block_size();
        // head slices start on block boundaries (head_dim is a multiple of 32).
        let b0 = start / bs * ty.type_size();
        let b1 = (start + out.len()) / bs * ty.type_size();
        // unwrap: the slice is a whole number of blocks matching out.len().
        ember_gguf::quant::dequantize(ty, &row[b0..b1], out).unwrap();
    }
}

/// An expert and the tokens routed to it: `(row of x, weight)`, rows in increasing order
/// (host backends build these from a [`RouteTable`]).
#[derive(Debug, Clone, Copy)]
pub struct MoeSlot<'a> {
    pub expert: ExpertView<'a>,
    pub tokens: &'a [(usize, f32)],
}

/// Shape of the gated delta rule over one sequence's tokens (DeltaNet, qwen35moe.md §6.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub n_tok: usize,
    /// key/query heads (16 in the 35B model)
    pub n_k_head: usize,
    /// value heads (32); value head h uses key head h % n_k_head (GGUF tiled order)
    pub n_v_head: usize,
    pub d_k: usize,
    pub d_v: usize,
}

/// The DeltaNet prep of [`Ops::delta_prep`]: head counts and sizes, the eps of the L2 norms,
/// and the per-value-head decay parameters `a` (= −exp(A_log)) and `dt_bias`.
#[derive(Debug, Clone, Copy)]
pub struct DeltaPrep {
    pub n_k_head: usize,
    pub n_v_head: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub eps: f32,
    pub a: WeightId,
    pub dt_bias: WeightId,
}

/// The inputs of the delta rule for a batch of tokens: q (L2-normed, scaled by 1/√d_k) and k
/// (L2-normed) [T, n_k_head·d_k], v [T, n_v_head·d_v], log-decay g ≤ 0 and β [T, n_v_head].
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaMats {
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    pub g: Mat,
    pub beta: Mat,
}

impl DeltaMats {
    /// Rows `start..start + n` of every input (one sequence of a batch).
    pub fn rows(&self, start: usize, n: usize) -> DeltaMats {
        DeltaMats {
            q: self.q.rows(start, n),
            k: self.k.rows(start, n),
            v: self.v.rows(start, n),
            g: self.g.rows(start, n),
            beta: self.beta.rows(start, n),
        }
    }
}

/// The attention prep of [`Ops::attn_prep`] (qwen35moe.md §6.3 steps 1–4).
#[derive(Debug, Clone, Copy)]
pub struct AttnPrep {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates (NeoX pairing).
    pub n_rot: usize,
    pub rope_base: f32,
    pub eps: f32,
    pub q_norm: WeightId,
    pub k_norm: WeightId,
}

/// What [`Ops::attn_prep`] returns: q and its gate [T, n_head·head_dim], k [T, n_head_kv·head_dim]
/// normed and rotated.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnMats {
    pub q: Mat,
    pub gate: Mat,
    pub k: Mat,
}

/// Shape of attention over one sequence's KV cache (qwen35moe.md §6.3).
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_tok: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Position of the first query token; keys 0..=pos0+t are visible to token t.
    pub pos0: usize,
    pub scale: f32,
}

/// Where one sequence's tokens sit in a step's batch: rows `row0..row0 + n` of the activations,
/// at positions `pos0..pos0 + n`. The sequence ops take one span per sequence, spans in row
/// order covering every row, and cover all sequences of a step in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    pub row0: usize,
    pub n: usize,
    pub pos0: usize,
}

/// One sequence's K and V caches of one attention layer.
#[derive(Debug)]
pub struct KvCache<'a> {
    pub k: &'a mut KvRows,
    pub v: &'a mut KvRows,
}

/// The heads of an attention call ([`Ops::attention`]).
#[derive(Debug, Clone, Copy)]
pub struct AttnHeads {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl AttnHeads {
    /// The per-sequence shape of span `sp`.
    pub fn shape(&self, sp: &SeqSpan) -> AttnShape {
        AttnShape { n_tok: sp.n, n_head: self.n_head, n_head_kv: self.n_head_kv, head_dim: self.head_dim, pos0: sp.pos0, scale: self.scale }
    }
}

/// The heads of a delta rule call ([`Ops::gated_delta_rule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaHeads {
    pub n_k_head: usize,
    pub n_v_head: usize,
    pub d_k: usize,
    pub d_v: usize,
}

impl DeltaHeads {
    pub fn shape(&self, n_tok: usize) -> DeltaShape {
        DeltaShape { n_tok, n_k_head: self.n_k_head, n_v_head: self.n_v_head, d_k: self.d_k, d_v: self.d_v }
    }
}

/// Which form of the delta rule a sequence's tokens take (one token is always recurrent under
/// `Auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaMode {
    /// Chunked (qwen35moe.md §6.5) for spans of more than one token.
    #[default]
    Auto,
    Recurrent,
    Chunked,
}

impl DeltaMode {
    pub fn chunked(self, n_tok: usize) -> bool {
        match self {
            DeltaMode::Auto => n_tok > 1,
            DeltaMode::Recurrent => false,
            DeltaMode::Chunked => true,
        }
    }
}

/// The activation of an output gate ([`Ops::gate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    Sigmoid,
}

/// A gated RMSNorm of every `w`-wide group ([`Ops::rms_norm_gate`]'s weight, eps and the gate's
/// activation): what [`Ops::delta_rule_norm`] applies to the delta rule's output, per value head.
#[derive(Debug, Clone, Copy)]
pub struct GatedNorm {
    pub w: WeightId,
    pub eps: f32,
    pub act: Gate,
}

/// The routing of a batch of tokens through one MoE layer: for token t, experts
/// `ids[t*k..(t+1)*k]` (largest weight first) with weights `weights[..]` summing to 1
/// (softmax over all experts, top-k, renormalised; qwen35moe.md §6.6 steps 1–3).
#[derive(Debug, Clone, PartialEq)]
pub struct RouteTable {
    pub n_tok: usize,
    pub k: usize,
    pub ids: Vec<ExpertId>,
    pub weights: Vec<f32>,
}

impl RouteTable {
    /// Per expert (index < n_expert): the tokens routed to it with their weights, tokens in
    /// increasing order.
    pub fn per_expert(&self, n_expert: usize) -> Vec<Vec<(usize, f32)>> {
        let mut out = vec![Vec::new(); n_expert];
        for t in 0..self.n_tok {
            for j in 0..self.k {
                let e = self.ids[t * self.k + j].index();
                if e < n_expert {
                    out[e].push((t, self.weights[t * self.k + j]));
                }
            }
        }
        out
    }
}

/// A backend-owned activation: `n` rows of `d` f32 values in slot `id` of the backend's
/// per-step arena. Handles are valid until the next [`Ops::begin_step`]; a step that allocates
/// in the same order gets the same ids (and, on a device, the same addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tensor {
    pub id: u32,
    pub n: usize,
    pub d: usize,
}

/// A point in a step's handles ([`Ops::mark`]): [`Ops::free_since`] frees those made after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mark(pub u32);

/// A backend-owned routing of `n_tok` tokens through one MoE layer, `k` experts each (ids and
/// weights stay where the backend computed them; [`Ops::read_routing`] downloads them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Routing {
    pub id: u32,
    pub n_tok: usize,
    pub k: usize,
}

/// What [`Ops::attn_prep`] returns: q and its gate [T, n_head·head_dim], k [T, n_head_kv·head_dim]
/// normed and rotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnIn {
    pub q: Tensor,
    pub gate: Tensor,
    pub k: Tensor,
}

/// What [`Ops::add_norm_route`] returns: the normed row the experts read [T, D], the shared
/// expert's gate logit [T, 1], and the routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeIn {
    pub x: Tensor,
    pub shared_gate: Tensor,
    pub routing: Routing,
}

/// The inputs of the delta rule ([`Ops::delta_prep`]): q, k [T, n_k_head·d_k], v
/// [T, n_v_head·d_v], g and β [T, n_v_head].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaIn {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
}

/// One sequence of a step: its slot, and `n` tokens at positions `pos0..pos0 + n` (`pos0` must
/// equal the slot's length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSeq {
    pub slot: SlotId,
    pub pos0: usize,
    pub n: usize,
}

/// A step's inputs, written to the backend once ([`Ops::begin_step`]): every sequence's token
/// ids in order, the sequences (their rows follow each other in that order), and the rows that
/// get logits ([`Ops::select_rows`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub seqs: Vec<BatchSeq>,
    pub logit_rows: Vec<u32>,
    /// The tokens are not known yet (`tokens` holds zeros): [`Ops::feed_tokens`] brings them
    /// once the step is queued ([`Ops::can_defer`]). A decode step queued while the one ahead
    /// of it runs, its tokens sampled from that one's rows.
    pub deferred: bool,
}

impl Batch {
    /// Adds a sequence's tokens (rows `tokens.len()` on from the current end).
    pub fn push(&mut self, slot: SlotId, pos0: usize, tokens: &[u32]) {
        self.seqs.push(BatchSeq { slot, pos0, n: tokens.len() });
        self.tokens.extend_from_slice(tokens);
    }

    /// Rows of the step.
    pub fn n_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }

    /// Each sequence's rows and positions.
    pub fn spans(&self) -> Vec<SeqSpan> {
        let mut row0 = 0;
        self.seqs
            .iter()
            .map(|s| {
                let sp = SeqSpan { row0, n: s.n, pos0: s.pos0 };
                row0 += s.n;
                sp
            })
            .collect()
    }

    /// Every row's position.
    pub fn positions(&self) -> Vec<u32> {
        self.seqs.iter().flat_map(|s| (s.pos0..s.pos0 + s.n).map(|p| p as u32)).collect()
    }
}
