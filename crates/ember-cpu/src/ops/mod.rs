use std::sync::{Mutex, MutexGuard};

use ember_gguf::{GgmlType, quant};
use std::sync::Arc;

use ember_ops::host::{self, delta_rows, kv_append_each, moe_via, per_span};
use ember_ops::{
    AttnHeads, AttnMats, AttnPrep, AttnShape, DeltaHeads, DeltaMats, DeltaMode, DeltaPrep, DeltaShape, DeviceId, Gate, HostKernels,
    KvCache, KvRows, LayerIdx, Mat, MoeSlot, OpResult, PagePool, Registry, RouteTable, SeqSpan, WeightId, WeightSet, WeightView, check,
    reference,
};

use crate::kernels::{self, ActRow};
use crate::panel::{self, Panel};
use crate::pool::{MAX_PARTS, Pool, even_bounds, parts_for, tapered_bounds};
use crate::simd::{self, Isa, Kernels, with_kernels};

mod attention;
mod moe;
mod prep;
mod sequence;

use moe::{MAX_FF, MAX_SLOTS};

/// How matmuls treat activations (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Weights dequantised exactly, f32 activations and sums.
    Exact,
    /// Activations quantised to 8 bits once per op, integer block dot products (over a q8_0
    /// KV cache also attention's Q·Kᵀ, with the queries quantised).
    Fast,
    /// [`Precision::Fast`] numerics with every token computed by the same single-token kernels
    /// whatever the batch: a request's results do not depend on what it was batched with or on
    /// how much of its prompt came from the cache (bit for bit). Fast precision instead runs
    /// prompt-sized batches through panels, the column-block delta rule and tiled attention, whose float
    /// summation order differs (~1e-6 relative; enough to flip a near-tie, e.g. an MoE routing
    /// choice). Prompts are several times slower; decode is unchanged.
    BatchInvariant,
}

/// Buffers reused by every op, so the per-token path does not allocate once warm (only the
/// returned matrices are new).
#[derive(Default)]
struct Scratch {
    acts: Vec<ActRow>,
    acts2: Vec<ActRow>,
    gu: Vec<f32>,
}

pub struct CpuOps {
    precision: Precision,
    isa: Isa,
    pool: Pool,
    scratch: Mutex<Scratch>,
    weights: Registry,
}

impl std::fmt::Debug for CpuOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuOps")
            .field("precision", &self.precision)
            .field("isa", &self.isa)
            .field("n_threads", &self.pool.n_threads())
            .finish()
    }
}

/// How far ahead of the row being computed a GEMV prefetches weights (into L2). Measured on the
/// 248320 x 2048 Q6_K head, 2 threads, loaded machine, best / median of 6 interleaved runs:
/// no prefetch 23.3 / 55.2 ms, 13 KiB into L1 43.5 / 50.6, 13 KiB into L2 17.0 / 39.8, 32 KiB
/// into L2 19.0 / 44.4.
const PREFETCH_BYTES: usize = 13 * 1024;

/// Rows ahead to prefetch for rows of `row_bytes`.
#[inline]
fn prefetch_rows(row_bytes: usize) -> usize {
    let pb = *simd::PF_BYTES.get_or_init(|| std::env::var("EMBER_PF_BYTES").ok().and_then(|s| s.parse().ok()).unwrap_or(PREFETCH_BYTES));
    (pb / row_bytes.max(1)).max(1)
}

/// Fewest values for which [`Ops::gate`] and `rms_norm` split across the workers.
const GATE_PARALLEL_MIN: usize = 16 * 1024;

/// Prefetches row `r` of `w`, or past its end row `r − w.n_rows` of `next` (the matrix read
/// next: another expert's, or the next projection), or nothing beyond both.
#[inline]
fn prefetch_row(w: &WeightView, next: Option<&WeightView>, r: usize) {
    if r < w.n_rows {
        simd::prefetch(w.row(r));
    } else if let Some(nw) = next.filter(|nw| r - w.n_rows < nw.n_rows) {
        simd::prefetch(nw.row(r - w.n_rows));
    }
}

/// Whether activations for weights of these types are quantised with grouped scales
/// ([`ActRow::quantize_grouped`]): where the instruction set's single-token K-quant kernels
/// sum in integers with them. Other rows keep each block's own best scale (Q8_0 files, for
/// one, round exactly as before). Depends on the types only, never on the token count, so
/// batch-invariant mode stays invariant.
fn grouped_for<K: Kernels>(k: K, types: impl IntoIterator<Item = GgmlType>) -> bool {
    k.wants_grouped() && types.into_iter().any(|t| matches!(t, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K))
}

/// Weight rows per unit of work: a tile of rows is read from memory once for all tokens.
const ROW_TILE: usize = 16;

impl CpuOps {
    /// `n_threads = 0` means one per physical core.
    pub fn new(precision: Precision, n_threads: usize) -> Self {
        Self::with_isa(precision, n_threads, Isa::detect())
    }

    /// As [`CpuOps::new`] with a given instruction set (one of [`Isa::available`]).
    pub fn with_isa(precision: Precision, n_threads: usize, isa: Isa) -> Self {
        let n_threads = if n_threads == 0 { crate::physical_cores() } else { n_threads };
        crate::alloc::keep_freed_memory();
        let isa = if Isa::available().contains(&isa) { isa } else { Isa::Scalar };
        CpuOps { precision, isa, pool: Pool::new(n_threads), scratch: Mutex::new(Scratch::default()), weights: Registry::new(DEV) }
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    fn invariant(&self) -> bool {
        self.precision == Precision::BatchInvariant
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The shared scratch, or a fresh one if another thread is using this backend right now.
    fn scratch(&self) -> ScratchGuard<'_> {
        match self.scratch.try_lock() {
            Ok(g) => ScratchGuard::Shared(g),
            Err(_) => ScratchGuard::Own(Box::default()),
        }
    }

    /// Quantises every row of `x` into `acts[..x.n]` (in parallel for many rows), with grouped
    /// scales when `grouped` ([`grouped_for`]).
    fn quantize_rows<K: Kernels>(&self, k: K, x: &Mat, acts: &mut Vec<ActRow>, grouped: bool) {
        if acts.len() < x.n {
            acts.resize_with(x.n, ActRow::default);
        }
        let acts = &mut acts[..x.n];
        // Rows feed panels when some weight may see enough tokens (a MoE slot, a prompt).
        let inv = self.invariant();
        let unsigned = !inv && k.has_panels() && x.n >= panel_min_tokens();
        // The single-token Q4_K kernel reads the nibble-ordered copy (batch-invariant mode runs
        // every token through it).
        let ordered = k.wants_k4_order() && (inv || x.n < 8);
        let fill = |t: usize, a: &mut ActRow| {
            if grouped {
                k.quantize_grouped(x.row(t), a);
            } else {
                k.quantize(x.row(t), a);
            }
            if unsigned {
                a.fill_unsigned();
            } else if ordered {
                a.fill_k4_order();
            }
        };
        if x.n < 8 {
            for (t, a) in acts.iter_mut().enumerate() {
                fill(t, a);
            }
            return;
        }
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(x.n, parts_for(self.n_threads()), 1, &mut b);
        self.pool.split_mut(acts, &b[..=parts], |p, part| {
            for (i, a) in part.iter_mut().enumerate() {
                fill(b[p] + i, a);
            }
        });
    }

    /// `W_i·x` for every weight ([n][rows] each); one parallel region split by weight rows,
    /// each part writing its own columns of the outputs.
    fn gemm<K: Kernels>(&self, k: K, ws: &[WeightView], x: &Mat, acts: &[ActRow]) -> Vec<Mat> {
        let n = x.n;
        let total: usize = ws.iter().map(|w| w.n_rows).sum();
        let mut ys: Vec<Mat> = ws.iter().map(|w| self.zeros(n, w.n_rows)).collect();
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = tapered_bounds(total, parts_for(self.n_threads()), ROW_TILE, &mut b);
        let src = Acts { x, q: acts };
        let inv = self.invariant();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y.data[..]).collect();
        self.pool.split_cols(&mut outs, n, &b[..=parts], |p, out| {
            let (mut g, end) = (b[p], b[p + 1]); // global rows of this part
            let mut out = out;
            while g < end {
                let (wi, r) = locate(ws, g);
                let m = (ws[wi].n_rows - r).min(end - g).min(ROW_TILE);
                tile(k, &ws[wi], ws.get(wi + 1), r, m, &src, &ALL_TOKENS[..0], n, inv, &mut |t, j, v| {
                    copy_small(out.run(t, g + j, v.len()), v)
                });
                g += m;
            }
        });
        ys
    }

    /// The exact path: each weight row dequantised, f32 dots.
    fn matmul_exact(&self, w: &WeightView, x: &Mat) -> Mat {
        let (n, k, n_rows) = (x.n, w.k, w.n_rows);
        let mut yt = vec![0f32; n_rows * n];
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(n_rows, parts_for(self.n_threads()), ROW_TILE, &mut b);
        let rb = b;
        b.iter_mut().for_each(|e| *e *= n);
        self.pool.split_mut(&mut yt, &b[..=parts], |p, out| {
            let mut row = vec![0f32; k];
            for (j, yr) in out.chunks_exact_mut(n).enumerate() {
                // unwrap: the view's rows are whole blocks of its type.
                quant::dequantize(w.ty, w.row(rb[p] + j), &mut row).unwrap();
                for (t, y) in yr.iter_mut().enumerate() {
                    *y = simd::dot_f32_scalar(&row, x.row(t));
                }
            }
        });
        transpose_into(&yt, n, n_rows)
    }

    fn matmul_many_fast<K: Kernels>(&self, k: K, ws: &[WeightView], x: &Mat) -> Vec<Mat> {
        let mut s = self.scratch();
        let s = &mut *s;
        if ws.iter().any(|w| kernels::supported(w.ty)) {
            self.quantize_rows(k, x, &mut s.acts, grouped_for(k, ws.iter().map(|w| w.ty)));
        }
        self.gemm(k, ws, x, &s.acts)
    }
}

enum ScratchGuard<'a> {
    Shared(MutexGuard<'a, Scratch>),
    Own(Box<Scratch>),
}

impl std::ops::Deref for ScratchGuard<'_> {
    type Target = Scratch;
    fn deref(&self) -> &Scratch {
        match self {
            ScratchGuard::Shared(g) => g,
            ScratchGuard::Own(b) => b,
        }
    }
}

impl std::ops::DerefMut for ScratchGuard<'_> {
    fn deref_mut(&mut self) -> &mut Scratch {
        match self {
            ScratchGuard::Shared(g) => &mut *g,
            ScratchGuard::Own(b) => &mut *b,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An empty token list means "tokens 0..n in order".
const ALL_TOKENS: [(usize, f32); 0] = [];

/// The activations of one op: f32 rows, and their 8-bit form when a weight is quantised.
struct Acts<'a> {
    x: &'a Mat,
    q: &'a [ActRow],
}

/// One weight row against the activation rows `toks`.
#[inline]
/// `row` is one row of `w` (the caller slices it, computing the row size once per tile).
fn dot_row<K: Kernels, const NT: usize>(k: K, w: &WeightView, row: &[u8], src: &Acts, toks: [usize; NT]) -> [f32; NT] {
    if kernels::supported(w.ty) {
        k.dot_q::<NT>(w.ty, row, toks.map(|t| &src.q[t]))
    } else if matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        k.dot_float::<NT>(w.ty, row, toks.map(|t| src.x.row(t)))
    } else {
        // Other types (none in qwen35moe files): dequantise the row.
        let mut f = vec![0f32; w.k];
        // unwrap: the view's rows are whole blocks of its type.
        quant::dequantize(w.ty, row, &mut f).unwrap();
        toks.map(|t| simd::dot_f32_scalar(&f, src.x.row(t)))
    }
}

/// Rows `r0..r0 + m` of `w` against `nt` tokens (`toks`, or 0..nt when empty); `put(i, j, v)`
/// receives token i's dots with rows r0 + j, r0 + j + 1, … (`v.len()` of them). Prompt-sized tiles go through a [`Panel`]; others
/// take tokens in groups of 4 so each unpacked weight block serves four of them, while the `m`
/// rows (a few KiB) stay in L1.
#[allow(clippy::too_many_arguments)]
#[inline]
fn tile<K: Kernels>(
    k: K,
    w: &WeightView,
    next: Option<&WeightView>,
    r0: usize,
    m: usize,
    src: &Acts,
    toks: &[(usize, f32)],
    nt: usize,
    inv: bool,
    put: &mut impl FnMut(usize, usize, &[f32]),
) {
    let tok = |i: usize| if toks.is_empty() { i } else { toks[i].0 };
    if !inv && use_panel(k, w.ty, nt) {
        return panel_rows(k, w, r0, m, nt, |i| &src.q[tok(i)], |i, v| put(i, 0, v));
    }
    let rb = w.row_bytes();
    let rows = &w.data[r0 * rb..(r0 + m) * rb];
    if nt == 1 && !inv && kernels::supported(w.ty) {
        // Decode: the whole tile in one kernel call, prefetching `ahead` rows in front (into the
        // start of the matrix read next once past this one's end).
        let ahead = prefetch_rows(rb);
        let mut out = [0f32; ROW_TILE];
        k.dot_rows(w.ty, rows, rb, &src.q[tok(0)], &mut out[..m], |j| prefetch_row(w, next, r0 + j + ahead));
        put(0, 0, &out[..m]);
        return;
    }
    if nt == 1 || inv {
        // One token at a time through the single-token kernel: decode, and every batch in
        // batch-invariant precision. Prefetch only pays when one token is all the work.
        let ahead = (nt == 1).then(|| prefetch_rows(rb));
        for t in 0..nt {
            for (j, row) in rows.chunks_exact(rb).enumerate() {
                if let Some(ahead) = ahead {
                    prefetch_row(w, next, r0 + j + ahead);
                }
                put(t, j, &dot_row::<K, 1>(k, w, row, src, [tok(t)]));
            }
        }
        return;
    }
    let mut t = 0;
    while t + 4 <= nt {
        let ids = [tok(t), tok(t + 1), tok(t + 2), tok(t + 3)];
        for (j, row) in rows.chunks_exact(rb).enumerate() {
            let v = dot_row::<K, 4>(k, w, row, src, ids);
            for (l, v) in v.iter().enumerate() {
                put(t + l, j, std::slice::from_ref(v));
            }
        }
        t += 4;
    }
    for t in t..nt {
        for (j, row) in rows.chunks_exact(rb).enumerate() {
            put(t, j, &dot_row::<K, 1>(k, w, row, src, [tok(t)]));
        }
    }
}

/// Fewest tokens for which a weight tile goes through a [`Panel`] (`EMBER_PANEL_MIN`
/// overrides; read once). Below it, unpacking 16 rows costs more than it saves.
fn panel_min_tokens() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| std::env::var("EMBER_PANEL_MIN").ok().and_then(|s| s.parse().ok()).unwrap_or(PANEL_MIN_TOKENS))
}

const PANEL_MIN_TOKENS: usize = 8;

#[inline]
fn use_panel<K: Kernels>(k: K, ty: GgmlType, nt: usize) -> bool {
    k.has_panels() && nt >= panel_min_tokens() && panel::supported(ty)
}

thread_local! {
    /// Each worker's panel buffer (the pool's threads live as long as the backend).
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
}

/// Rows `r0..r0 + m` (m ≤ 16) of `w` against `nt` activation rows (`act(i)`, with
/// [`ActRow::qu`] filled) through one panel; `put(i, v)` receives token i's dots with rows
/// r0..r0 + m.
#[inline]
fn panel_rows<'a, K: Kernels>(
    k: K,
    w: &WeightView,
    r0: usize,
    m: usize,
    nt: usize,
    act: impl Fn(usize) -> &'a ActRow,
    mut put: impl FnMut(usize, &[f32]),
) {
    let rb = w.row_bytes();
    PANEL.with_borrow_mut(|p| {
        k.panel_unpack(w.ty, w.k, &w.data[r0 * rb..(r0 + m) * rb], m, p);
        let mut buf = [[0f32; panel::ROWS]; 8];
        let mut t = 0;
        while t < nt {
            let c = (nt - t).min(8);
            let a: [&ActRow; 8] = std::array::from_fn(|i| act(t + i.min(c - 1)));
            k.panel_dot(p, &a[..c], &mut buf[..c]);
            for (i, v) in buf[..c].iter().enumerate() {
                put(t + i, &v[..m]);
            }
            t += c;
        }
    });
}

/// `dst.copy_from_slice(src)` for the ≤ 16 values of a panel row, without a call to memmove.
#[inline]
fn copy_small(dst: &mut [f32], src: &[f32]) {
    if let (Ok(d), Ok(s)) = (<&mut [f32; panel::ROWS]>::try_from(&mut *dst), <&[f32; panel::ROWS]>::try_from(src)) {
        *d = *s;
    } else {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
    }
}

/// (weight index, row) of global row `g` of the concatenation of `ws`.
fn locate(ws: &[WeightView], mut g: usize) -> (usize, usize) {
    for (i, w) in ws.iter().enumerate() {
        if g < w.n_rows {
            return (i, g);
        }
        g -= w.n_rows;
    }
    unreachable!("row beyond the weights (bounds come from their total)")
}

/// `yt` ([rows][n]) as a [n, rows] matrix.
fn transpose_into(yt: &[f32], n: usize, rows: usize) -> Mat {
    if n == 1 {
        return Mat::from_vec(1, rows, yt.to_vec());
    }
    let mut y = Mat::zeros(n, rows);
    for (r, col) in yt.chunks_exact(n).enumerate() {
        for (t, v) in col.iter().enumerate() {
            y.data[t * rows + r] = *v;
        }
    }
    y
}

/// The host-side API: ops on weight views and plain slices, for benches, tests and the CPU
/// half of a split (hybrid) backend. The [`Ops`] impl below resolves ids and calls these.
impl CpuOps {
    /// `y[t] = W·x[t]` (shapes checked by the caller).
    pub fn matmul_view(&self, w: &WeightView, x: &Mat) -> Mat {
        assert_eq!(x.d, w.k, "matmul: x has {} columns, weight rows have {}", x.d, w.k);
        if x.n == 0 || w.n_rows == 0 {
            return Mat::zeros(x.n, w.n_rows);
        }
        if self.precision == Precision::Exact {
            return self.matmul_exact(w, x);
        }
        with_kernels!(self.isa, |k| self.matmul_many_fast(k, std::slice::from_ref(w), x).pop().expect("one weight, one output"))
    }

    /// `[W_i·x]`, `x` quantised once.
    pub fn matmul_views(&self, ws: &[WeightView], x: &Mat) -> Vec<Mat> {
        for w in ws {
            assert_eq!(x.d, w.k, "matmul_many: x has {} columns, weight rows have {}", x.d, w.k);
        }
        if self.precision == Precision::Exact || x.n == 0 {
            return ws.iter().map(|w| self.matmul_view(w, x)).collect();
        }
        with_kernels!(self.isa, |k| self.matmul_many_fast(k, ws, x))
    }

    /// The MoE over routed slots (see [`ember_ops::reference::moe`]).
    pub fn moe_slots(&self, slots: &[MoeSlot], x: &Mat) -> Mat {
        let fusable = self.precision != Precision::Exact
            && !slots.is_empty()
            && slots.len() <= MAX_SLOTS
            && slots.iter().all(|s| {
                let e = &s.expert;
                [e.gate.ty, e.up.ty, e.down.ty].iter().all(|t| kernels::supported(*t))
                    && e.gate.n_rows == e.up.n_rows
                    && e.gate.n_rows <= MAX_FF
                    && e.down.k == e.gate.n_rows
                    && e.gate.k == x.d
                    && e.down.n_rows == slots[0].expert.down.n_rows
                    && !s.tokens.is_empty()
            });
        if !fusable || x.n == 0 {
            return reference::moe(|w, x| self.matmul_view(w, x), slots, x);
        }
        with_kernels!(self.isa, |k| self.moe_fast(k, slots, x))
    }

    /// Fast precision runs the recurrent form for every batch (one SIMD pass over each state row
    /// per token): on the CPU it costs about what the chunked form does (~49k vs ~67k
    /// multiply-adds per head and token at d = 128, C = 64) without its O(C²) temporaries; the
    /// two forms differ only by rounding (qwen35moe.md §6.5). Exact precision honours `chunked`.
    pub fn rms_norm_vec(&self, x: &Mat, weight: &[f32], eps: f32) -> Mat {
        if self.precision == Precision::Exact {
            return reference::rms_norm(x, weight, eps);
        }
        let g = weight.len();
        assert_eq!(x.d % g, 0, "rms_norm: width {} is not a multiple of the weight length {g}", x.d);
        let mut out = self.zeros(x.n, x.d);
        // Split by groups across the workers for prompts (each group is computed alone, so the
        // split does not change results); one thread below a few thousand values.
        let n_groups = x.data.len() / g.max(1);
        let parts = if x.data.len() < GATE_PARALLEL_MIN { 1 } else { parts_for(self.n_threads()) };
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(n_groups, parts, 1, &mut b);
        b.iter_mut().for_each(|e| *e *= g);
        with_kernels!(self.isa, |kn| {
            self.pool.split_mut(&mut out.data, &b[..=parts], |p, part| {
                let src = &x.data[b[p]..b[p] + part.len()];
                for (src, dst) in src.chunks_exact(g).zip(part.chunks_exact_mut(g)) {
                    let scale = 1.0 / (kn.dot_f32(src, src) / g as f32 + eps).sqrt();
                    dst.iter_mut().zip(src).zip(weight).for_each(|((o, v), w)| *o = v * scale * w);
                }
            });
        });
        out
    }

    /// Split across the workers for prompts, with the vectorised exp (a prompt's gates were
    /// ~2 % of its time on one thread through libm).
    pub fn gate_mat(&self, y: &mut Mat, g: &Mat, act: Gate) {
        if self.precision == Precision::Exact {
            return reference::gate(y, g, act);
        }
        assert_eq!((y.n, y.d), (g.n, g.d), "gate: {}x{} gated by {}x{}", y.n, y.d, g.n, g.d);
        let mut b = [0usize; MAX_PARTS + 1];
        // Below a few thousand values (decode) a parallel region costs more than it saves.
        let parts = if y.data.len() < GATE_PARALLEL_MIN { 1 } else { parts_for(self.n_threads()) };
        let parts = even_bounds(y.data.len(), parts, 64, &mut b);
        let gd = &g.data;
        with_kernels!(self.isa, |kn| {
            self.pool.split_mut(&mut y.data, &b[..=parts], |p, part| {
                let src = &gd[b[p]..b[p] + part.len()];
                let mut buf = [0f32; 256];
                for (yc, gc) in part.chunks_mut(256).zip(src.chunks(256)) {
                    let e = &mut buf[..gc.len()];
                    match act {
                        Gate::Silu => {
                            e.copy_from_slice(gc);
                            kn.silu(e);
                            yc.iter_mut().zip(e.iter()).for_each(|(v, s)| *v *= s);
                        }
                        Gate::Sigmoid => {
                            e.iter_mut().zip(gc).for_each(|(e, g)| *e = -g);
                            kn.exp_sum(e, 0.0);
                            yc.iter_mut().zip(e.iter()).for_each(|(v, x)| *v /= 1.0 + x);
                        }
                    }
                }
            });
        });
    }

    /// SiLU with the vectorised exp; prompts with the taps transposed once per call and tokens
    /// split across workers, decode (and batch-invariant precision) with the stored taps.
    pub fn conv1d_silu_vec(&self, x: &Mat, w: &[f32], state: &mut [f32]) -> Mat {
        let c = x.d;
        let kernel = w.len() / c.max(1);
        if self.precision == Precision::Exact || kernel == 0 || state.len() != (kernel - 1) * c {
            return reference::conv1d_silu(x, w, state);
        }
        let hist = kernel - 1;
        // Input row i of [old state; x] (i < 0: the state's rows).
        let input = |i: isize| -> &[f32] { if i < 0 { &state[(hist as isize + i) as usize * c..][..c] } else { x.row(i as usize) } };
        let mut out = self.zeros(x.n, c);
        if x.n < 8 || self.invariant() {
            // Decode: the taps in their stored order ([ch][j]), no transposed copy.
            for t in 0..x.n {
                let o = out.row_mut(t);
                if kernel == 4 {
                    // qwen35moe's kernel: one pass over the channels, the four taps of a channel
                    // adjacent (the generic loop below strides through them four times). Same
                    // sum in the same order.
                    let s: [&[f32]; 4] = std::array::from_fn(|j| input(t as isize - hist as isize + j as isize));
                    for (ch, (o, w)) in o.iter_mut().zip(w.chunks_exact(4)).enumerate() {
                        *o = w[0] * s[0][ch] + w[1] * s[1][ch] + w[2] * s[2][ch] + w[3] * s[3][ch];
                    }
                } else {
                    for j in 0..kernel {
                        let src = input(t as isize - hist as isize + j as isize);
                        for ((o, v), w) in o.iter_mut().zip(src).zip(w.chunks_exact(kernel)) {
                            *o += w[j] * v;
                        }
                    }
                }
                with_kernels!(self.isa, |kn| kn.silu(o));
            }
        } else {
            // Prompts: taps transposed once per call so each step is a vector multiply-add over
            // all channels; tokens split across workers.
            let mut wt = vec![0f32; kernel * c]; // wt[j][ch]
            for ch in 0..c {
                for j in 0..kernel {
                    wt[j * c + ch] = w[ch * kernel + j];
                }
            }
            let mut b = [0usize; MAX_PARTS + 1];
            let parts = even_bounds(x.n, parts_for(self.n_threads()), 1, &mut b);
            let tb = b;
            b.iter_mut().for_each(|e| *e *= c);
            with_kernels!(self.isa, |kn| {
                self.pool.split_mut(&mut out.data, &b[..=parts], |p, rows| {
                    for (i, o) in rows.chunks_exact_mut(c).enumerate() {
                        let t = (tb[p] + i) as isize;
                        for j in 0..kernel {
                            kn.mul_add(&wt[j * c..(j + 1) * c], input(t - hist as isize + j as isize), o);
                        }
                        kn.silu(o);
                    }
                })
            });
        }
        // New state: the last `hist` inputs of [old state; x], shifted in place.
        let keep = hist.saturating_sub(x.n);
        state.copy_within((hist - keep) * c..hist * c, 0);
        for s in keep..hist {
            state[s * c..(s + 1) * c].copy_from_slice(x.row(x.n + s - hist));
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_mats(&self, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32], chunked: bool) -> Mat {
        if self.precision == Precision::Exact {
            return self.gated_delta_rule_par(s, q, k, v, g, beta, state, chunked);
        }
        with_kernels!(self.isa, |kn| self.delta_fast(kn, s, q, k, v, g, beta, state))
    }

    /// Prompts in fast precision go through the tiled kernel (`attention.rs`); decode, and
    /// every batch in batch-invariant precision, through the per-token one (`sequence.rs`).
    pub fn attention_rows(&self, s: AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> Mat {
        if self.precision == Precision::Fast && Self::tiled_attention_fits(&s) {
            return with_kernels!(self.isa, |kn| self.attention_tiled(kn, s, q, k, v));
        }
        if self.precision != Precision::Exact && s.n_head.is_multiple_of(s.n_head_kv) {
            return with_kernels!(self.isa, |kn| self.attention_fast(kn, s, q, k, v));
        }
        let per = s.n_tok * s.head_dim;
        let mut heads = vec![0f32; s.n_head * per];
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(s.n_head, parts_for(self.n_threads()), 1, &mut b);
        let hb = b;
        b.iter_mut().for_each(|e| *e *= per);
        self.pool.split_mut(&mut heads, &b[..=parts], |p, o| {
            for (i, oh) in o.chunks_exact_mut(per).enumerate() {
                oh.copy_from_slice(&reference::attention_head(s, hb[p] + i, q, k, v));
            }
        });
        let mut out = self.zeros(s.n_tok, s.n_head * s.head_dim);
        for (n, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, n, s.head_dim, o);
        }
        out
    }
}

const DEV: DeviceId = DeviceId::Host;

impl HostKernels for CpuOps {
    fn name(&self) -> &'static str {
        match self.precision {
            Precision::Exact => "cpu-exact",
            Precision::Fast => "cpu",
            Precision::BatchInvariant => "cpu-invariant",
        }
    }

    fn device(&self) -> DeviceId {
        DEV
    }

    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.weights.set(weights);
        Ok(())
    }

    fn get_rows(&self, w: WeightId, ids: &[u32]) -> OpResult<Mat> {
        host::get_rows(&self.weights, w, ids)
    }

    fn matmul(&self, w: WeightId, x: &Mat) -> OpResult<Mat> {
        let views = host::checked_views("matmul", &self.weights, &[w], x)?;
        Ok(self.matmul_view(&views[0], x))
    }

    fn matmul_many(&self, ws: &[WeightId], x: &Mat) -> OpResult<Vec<Mat>> {
        Ok(self.matmul_views(&host::checked_views("matmul_many", &self.weights, ws, x)?, x))
    }

    fn rms_norm(&self, x: &Mat, w: WeightId, eps: f32) -> OpResult<Mat> {
        const OP: &str = "rms_norm";
        let w = self.weights.vector(OP, w)?;
        check::rms_norm(OP, DEV, x, w.len())?;
        Ok(self.rms_norm_vec(x, w, eps))
    }

    fn add(&self, h: &mut Mat, x: &Mat) -> OpResult<()> {
        check::same("add", DEV, h, x)?;
        self.add_mat(h, x);
        Ok(())
    }

    /// The split and RoPE as in the reference; the norms through [`CpuOps::rms_norm_vec`].
    fn attn_prep(&self, s: AttnPrep, qg: &Mat, k: &Mat, pos: &[u32]) -> OpResult<AttnMats> {
        const OP: &str = "attn_prep";
        let (qn, kn) = (self.weights.vector(OP, s.q_norm)?, self.weights.vector(OP, s.k_norm)?);
        check::attn_prep(OP, DEV, &s, (qn.len(), kn.len()), qg, k, pos)?;
        Ok(self.attn_prep_mats(&s, qn, kn, qg, k, pos))
    }

    fn kv_append(&self, spans: &[SeqSpan], k: &Mat, v: &Mat, caches: &mut [KvCache<'_>], pool: &PagePool) -> OpResult<()> {
        kv_append_each(spans, k, v, caches, pool)
    }

    /// Sequence by sequence, each split across the workers by (KV head, token).
    fn attention(&self, h: AttnHeads, spans: &[SeqSpan], q: &Mat, caches: &[KvCache<'_>]) -> OpResult<Mat> {
        const OP: &str = "attention";
        check::spans(OP, DEV, spans, q.n, caches.len())?;
        per_span(spans, q, q.d, |i, sp, q| {
            let (s, c) = (h.shape(sp), &caches[i]);
            check::attention(OP, DEV, &s, q, c.k, c.v)?;
            Ok(self.attention_rows(s, q, c.k, c.v))
        })
    }

    fn conv1d_silu(&self, spans: &[SeqSpan], x: &Mat, w: WeightId, states: &mut [&mut [f32]]) -> OpResult<Mat> {
        const OP: &str = "conv1d_silu";
        let w = self.weights.vector(OP, w)?;
        check::spans(OP, DEV, spans, x.n, states.len())?;
        per_span(spans, x, x.d, |i, _, x| {
            check::conv(OP, DEV, x, w.len(), states[i].len())?;
            Ok(self.conv1d_silu_vec(x, w, states[i]))
        })
    }

    fn delta_prep(&self, s: DeltaPrep, cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<DeltaMats> {
        const OP: &str = "delta_prep";
        let (a, dt) = (self.weights.vector(OP, s.a)?, self.weights.vector(OP, s.dt_bias)?);
        check::delta_prep(OP, DEV, &s, (a.len(), dt.len()), cu, b, alpha)?;
        Ok(self.delta_prep_mats(&s, a, dt, cu, b, alpha))
    }

    fn gated_delta_rule(
        &self,
        h: DeltaHeads,
        spans: &[SeqSpan],
        x: &DeltaMats,
        states: &mut [&mut [f32]],
        mode: DeltaMode,
    ) -> OpResult<Mat> {
        const OP: &str = "gated_delta_rule";
        check::spans(OP, DEV, spans, x.q.n, states.len())?;
        per_span(spans, &x.q, h.n_v_head * h.d_v, |i, sp, _| {
            let (s, x) = (h.shape(sp.n), delta_rows(spans, x, sp));
            check::delta_rule(OP, DEV, &s, &x, states[i].len())?;
            Ok(self.delta_rule_mats(s, &x.q, &x.k, &x.v, &x.g, &x.beta, states[i], mode.chunked(sp.n)))
        })
    }

    fn gate(&self, y: &mut Mat, g: &Mat, act: Gate) -> OpResult<()> {
        check::gate("gate", DEV, y, g, act)?;
        self.gate_mat(y, g, act);
        Ok(())
    }

    fn route(&self, logits: &Mat, k: usize) -> OpResult<RouteTable> {
        check::route("route", DEV, logits, k)?;
        Ok(self.route_table(logits, k))
    }

    fn moe(&self, layer: LayerIdx, x: &Mat, routing: &RouteTable, shared_gate: &Mat) -> OpResult<Mat> {
        moe_via("moe", &self.weights, layer, x, routing, shared_gate, |slots, x| Ok(self.moe_slots(slots, x)))
    }

    fn select_rows(&self, x: &Mat, rows: &[usize]) -> OpResult<Mat> {
        host::select_rows(x, rows)
    }
}
