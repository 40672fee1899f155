use std::sync::{Mutex, MutexGuard};

use ember_gguf::{GgmlType, quant};
use ember_ops::reference::{self, silu};
use ember_ops::{AttnShape, DeltaShape, KvRows, KvType, Mat, MoeSlot, Ops, WeightView};

use crate::kernels::{self, ActRow};
use crate::panel::{self, Panel};
use crate::pool::{MAX_PARTS, Pool, even_bounds, parts_for};
use crate::simd::{self, DeltaIo, Isa, Kernels, with_kernels};

/// How matmuls treat activations (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Weights dequantised exactly, f32 activations and sums.
    Exact,
    /// Activations quantised to 8 bits once per op, integer block dot products.
    Fast,
    /// [`Precision::Fast`] numerics with every token computed by the same single-token kernels
    /// whatever the batch: a request's results do not depend on what it was batched with or on
    /// how much of its prompt came from the cache (bit for bit). Fast precision instead runs
    /// prompt-sized batches through panels and the column-block delta rule, whose float
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
        CpuOps { precision, isa, pool: Pool::new(n_threads), scratch: Mutex::new(Scratch::default()) }
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

    /// Quantises every row of `x` into `acts[..x.n]` (in parallel for many rows).
    fn quantize_rows<K: Kernels>(&self, k: K, x: &Mat, acts: &mut Vec<ActRow>) {
        if acts.len() < x.n {
            acts.resize_with(x.n, ActRow::default);
        }
        let acts = &mut acts[..x.n];
        // Rows feed panels when some weight may see enough tokens (a MoE slot, a prompt).
        let inv = self.invariant();
        let unsigned = !inv && k.has_panels() && x.n >= panel_min_tokens();
        // The single-token Q4_K kernel reads the nibble-ordered copy (batch-invariant mode runs
        // every token through it).
        let ordered = k.has_panels() && (inv || x.n < 8);
        let fill = |t: usize, a: &mut ActRow| {
            k.quantize(x.row(t), a);
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
        let mut ys: Vec<Mat> = ws.iter().map(|w| Mat::zeros(n, w.n_rows)).collect();
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(total, parts_for(self.n_threads()), ROW_TILE, &mut b);
        let src = Acts { x, q: acts };
        let inv = self.invariant();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y.data[..]).collect();
        self.pool.split_cols(&mut outs, n, &b[..=parts], |p, out| {
            let (mut g, end) = (b[p], b[p + 1]); // global rows of this part
            let out = std::cell::RefCell::new(out);
            while g < end {
                let (wi, r) = locate(ws, g);
                let m = (ws[wi].n_rows - r).min(end - g).min(ROW_TILE);
                tile(
                    k,
                    &ws[wi],
                    ws.get(wi + 1),
                    r,
                    m,
                    &src,
                    &ALL_TOKENS[..0],
                    n,
                    inv,
                    &mut |t, j, v| *out.borrow_mut().at(t, g + j) = v,
                    &mut |t, v| copy_small(out.borrow_mut().run(t, g, v.len()), v),
                );
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
            self.quantize_rows(k, x, &mut s.acts);
        }
        self.gemm(k, ws, x, &s.acts)
    }

    /// The fused MoE: (1) every slot's gate and up rows in one region, (2) SwiGLU and
    /// quantisation of the hidden rows, (3) every output row's sum over slots in one region.
    fn moe_fast<K: Kernels>(&self, k: K, slots: &[MoeSlot], x: &Mat) -> Mat {
        let d = slots[0].expert.down.n_rows;
        let mut guard = self.scratch();
        let s = &mut *guard;
        self.quantize_rows(k, x, &mut s.acts);
        let src = Acts { x, q: &s.acts };

        let inv = self.invariant();
        // (1) gate/up: items are (slot, gate|up, row), each writing the slot's token count.
        let mut offs = [0usize; MAX_SLOTS + 1]; // start of each slot in gu
        for (i, sl) in slots.iter().enumerate() {
            offs[i + 1] = offs[i] + 2 * sl.expert.gate.n_rows * sl.tokens.len();
        }
        let total = offs[slots.len()];
        s.gu.resize(total, 0.0);
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = item_bounds(slots, &offs, parts_for(self.n_threads()), &mut b);
        self.pool.split_mut(&mut s.gu[..total], &b[..=parts], |p, out| {
            let mut e = b[p];
            let end = b[p + 1];
            while e < end {
                let si = offs[..=slots.len()].partition_point(|&o| o <= e) - 1;
                let sl = &slots[si];
                let nt = sl.tokens.len();
                let n_ff = sl.expert.gate.n_rows;
                let item = (e - offs[si]) / nt; // 0..2·n_ff
                let (w, r) = if item < n_ff { (&sl.expert.gate, item) } else { (&sl.expert.up, item - n_ff) };
                let next = if item < n_ff { Some(&sl.expert.up) } else { slots.get(si + 1).map(|s| &s.expert.gate) };
                let m = (n_ff - r).min((end - e) / nt).min(ROW_TILE);
                let o = e - b[p];
                let block = std::cell::RefCell::new(&mut out[o..o + m * nt]);
                tile(k, w, next, r, m, &src, sl.tokens, nt, inv, &mut |i, j, v| block.borrow_mut()[j * nt + i] = v, &mut |i, v| {
                    let mut b = block.borrow_mut();
                    for (j, v) in v.iter().enumerate() {
                        b[j * nt + i] = *v;
                    }
                });
                e += m * nt;
            }
        });

        // (2) h = silu(gate)·up per (slot, token), quantised: entry i of acts2.
        let mut hoffs = [0usize; MAX_SLOTS + 1];
        for (i, sl) in slots.iter().enumerate() {
            hoffs[i + 1] = hoffs[i] + sl.tokens.len();
        }
        let n_h = hoffs[slots.len()];
        if s.acts2.len() < n_h {
            s.acts2.resize_with(n_h, ActRow::default);
        }
        let gu = &s.gu;
        let unsigned = !inv && k.has_panels() && slots.iter().any(|sl| sl.tokens.len() >= panel_min_tokens());
        let ordered = k.has_panels() && (inv || n_h < 8);
        let fill = |i: usize, a: &mut ActRow| {
            let si = hoffs[..=slots.len()].partition_point(|&o| o <= i) - 1;
            let (nt, n_ff) = (slots[si].tokens.len(), slots[si].expert.gate.n_rows);
            let j = i - hoffs[si];
            let g = &gu[offs[si]..offs[si] + n_ff * nt];
            let u = &gu[offs[si] + n_ff * nt..offs[si + 1]];
            let mut h = [0f32; MAX_FF];
            for (r, v) in h[..n_ff].iter_mut().enumerate() {
                *v = silu(g[r * nt + j]) * u[r * nt + j];
            }
            k.quantize(&h[..n_ff], a);
            if unsigned {
                a.fill_unsigned();
            } else if ordered {
                a.fill_k4_order();
            }
        };
        if n_h < 8 {
            for (i, a) in s.acts2[..n_h].iter_mut().enumerate() {
                fill(i, a);
            }
        } else {
            let parts = even_bounds(n_h, parts_for(self.n_threads()), 1, &mut b);
            self.pool.split_mut(&mut s.acts2[..n_h], &b[..=parts], |p, part| {
                for (i, a) in part.iter_mut().enumerate() {
                    fill(b[p] + i, a);
                }
            });
        }

        // (3) down: output row r of token t = Σ_slots ω·(down_s row r · h_{s,t}).
        let n = x.n;
        let mut y = Mat::zeros(n, d);
        let parts = even_bounds(d, parts_for(self.n_threads()), ROW_TILE, &mut b);
        let acts2 = &s.acts2;
        self.pool.split_cols(&mut [&mut y.data[..]], n, &b[..=parts], |p, mut out| {
            let (r0, r1) = (b[p], b[p + 1]);
            // Slot by slot, so each expert's rows r0..r1 stream in order; the prefetch runs on
            // into the next slot's rows near the end of each.
            for (si, sl) in slots.iter().enumerate() {
                let h = &acts2[hoffs[si]..hoffs[si + 1]];
                let dw = &sl.expert.down;
                if !inv && use_panel(k, dw.ty, h.len()) {
                    for rt in (r0..r1).step_by(ROW_TILE) {
                        let m = ROW_TILE.min(r1 - rt);
                        panel_rows(
                            k,
                            dw,
                            rt,
                            m,
                            h.len(),
                            |i| &h[i],
                            |i, v| {
                                let (t, w) = sl.tokens[i];
                                for (o, v) in out.run(t, rt, v.len()).iter_mut().zip(v) {
                                    *o += w * v;
                                }
                            },
                        );
                    }
                    continue;
                }
                let next = slots.get(si + 1).map(|s| &s.expert.down);
                let ahead = prefetch_rows(dw.row_bytes());
                for r in r0..r1 {
                    let ra = r + ahead;
                    if ra < r1 {
                        simd::prefetch(dw.row(ra));
                    } else if let Some(nw) = next.filter(|nw| r0 + ra - r1 < r1.min(nw.n_rows)) {
                        simd::prefetch(nw.row(r0 + ra - r1));
                    }
                    let row = dw.row(r);
                    let mut i = 0;
                    while !inv && i + 4 <= h.len() {
                        let v = k.dot_q::<4>(dw.ty, row, [&h[i], &h[i + 1], &h[i + 2], &h[i + 3]]);
                        for (l, v) in v.iter().enumerate() {
                            let (t, w) = sl.tokens[i + l];
                            *out.at(t, r) += w * v;
                        }
                        i += 4;
                    }
                    for (i, a) in h.iter().enumerate().skip(i) {
                        let (t, w) = sl.tokens[i];
                        *out.at(t, r) += w * k.dot_q::<1>(dw.ty, row, [a])[0];
                    }
                }
            }
        });
        y
    }

    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_par(&self, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32], chunked: bool) -> Mat {
        let hs = s.d_v * s.d_k;
        let mut heads = vec![0f32; s.n_v_head * s.n_tok * s.d_v];
        let per = s.n_tok * s.d_v;
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(s.n_v_head, parts_for(self.n_threads()), 1, &mut b);
        let hb = b;
        b.iter_mut().for_each(|e| *e *= hs);
        // Heads are independent: worker p takes heads hb[p]..hb[p+1] (state and output).
        let outs = Mutex::new(&mut heads[..]);
        self.pool.split_mut(state, &b[..=parts], |p, st| {
            for (i, sth) in st.chunks_exact_mut(hs).enumerate() {
                let h = hb[p] + i;
                let o = reference::delta_rule_head(s, h, q, k, v, g, beta, sth, chunked);
                lock(&outs)[h * per..(h + 1) * per].copy_from_slice(&o);
            }
        });
        let mut out = Mat::zeros(s.n_tok, s.n_v_head * s.d_v);
        for (h, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, h, s.d_v, o);
        }
        out
    }
}

impl CpuOps {
    #[allow(clippy::too_many_arguments)]
    fn delta_fast<K: Kernels>(&self, kn: K, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32]) -> Mat {
        let (dk, dv) = (s.d_k, s.d_v);
        let inv = self.invariant();
        assert_eq!(q.d, k.d, "gated_delta_rule: q and k rows differ in width");
        let hs = dv * dk;
        let per = s.n_tok * dv;
        let mut heads = vec![0f32; s.n_v_head * per]; // [head][token][dv]
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(s.n_v_head, parts_for(self.n_threads()), 1, &mut b);
        let (mut bs, mut bo) = ([0usize; MAX_PARTS + 1], [0usize; MAX_PARTS + 1]);
        for p in 0..=parts {
            bs[p] = b[p] * hs;
            bo[p] = b[p] * per;
        }
        self.pool.split_mut2(state, &bs[..=parts], &mut heads, &bo[..=parts], |p, st, out| {
            let (mut decay, mut beta_h) = (vec![0f32; s.n_tok], vec![0f32; s.n_tok]);
            for (i, (sth, oh)) in st.chunks_exact_mut(hs).zip(out.chunks_exact_mut(per)).enumerate() {
                let h = b[p] + i;
                let kh = h % s.n_k_head;
                for t in 0..s.n_tok {
                    decay[t] = g.row(t)[h].exp();
                    beta_h[t] = beta.row(t)[h];
                }
                let io = DeltaIo {
                    q: &q.data[kh * dk..],
                    k: &k.data[kh * dk..],
                    v: &v.data[h * dv..],
                    sqk: q.d,
                    sv: v.d,
                    decay: &decay,
                    beta: &beta_h,
                    n: s.n_tok,
                    dk,
                    dv,
                };
                if inv {
                    // The single-token step for every token, as in decode.
                    for t in 0..io.n {
                        let (qt, kt, vt) = io.token(t);
                        kn.delta_step(sth, qt, kt, vt, io.decay[t], io.beta[t], &mut oh[t * dv..(t + 1) * dv]);
                    }
                } else {
                    kn.delta_seq(sth, &io, oh);
                }
            }
        });
        let mut out = Mat::zeros(s.n_tok, s.n_v_head * dv);
        for (h, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, h, dv, o);
        }
        out
    }

    /// Attention with each K and V row of a KV head converted to f32 once per query token and
    /// used by all the query heads that share it (GQA); softmax with a vectorised exp. Work
    /// items are (KV head, token), split across workers by their number of positions.
    fn attention_fast<K: Kernels>(&self, kn: K, s: AttnShape, q: &Mat, kc: &KvRows, vc: &KvRows) -> Mat {
        let hd = s.head_dim;
        let g = s.n_head / s.n_head_kv;
        let gw = g * hd;
        let n_items = s.n_head_kv * s.n_tok;
        let mut ob = vec![0f32; n_items * gw]; // [kv head][token][g·hd]
        // Split items by cost (positions + a constant), on item boundaries.
        let cost = |i: usize| s.pos0 + i % s.n_tok + 1 + 16;
        let total: usize = (0..n_items).map(cost).sum();
        let parts = parts_for(self.n_threads()).min(n_items);
        let mut b = [0usize; MAX_PARTS + 1];
        let (mut acc, mut p) = (0usize, 1usize);
        for i in 0..n_items {
            if p < parts && acc >= total * p / parts {
                b[p] = i;
                p += 1;
            }
            acc += cost(i);
        }
        for e in b.iter_mut().take(parts).skip(p) {
            *e = n_items;
        }
        b[parts] = n_items;
        let ib = b;
        b.iter_mut().for_each(|e| *e *= gw);
        let max_pos = s.pos0 + s.n_tok;
        self.pool.split_mut(&mut ob, &b[..=parts], |pi, out| {
            let mut scores = vec![0f32; g * max_pos];
            let mut row = vec![0f32; hd];
            let mut inv = vec![0f32; g];
            for (j, o) in out.chunks_exact_mut(gw).enumerate() {
                let item = ib[pi] + j;
                let (m, t) = (item / s.n_tok, item % s.n_tok);
                let npos = s.pos0 + t + 1;
                let qs = &q.row(t)[m * gw..(m + 1) * gw]; // the g query heads of KV head m
                if kc.ty == KvType::F16 && vc.ty == KvType::F16 {
                    let rb = kc.row_bytes();
                    if kn.attn_f16(qs, &kc.bytes, &vc.bytes, rb, m * hd, npos, hd, s.scale, &mut scores, o) {
                        continue;
                    }
                }
                for p in 0..npos {
                    kv_row(kn, kc, p, m * hd, &mut row);
                    for n in 0..g {
                        scores[n * max_pos + p] = kn.dot_f32(&qs[n * hd..(n + 1) * hd], &row) * s.scale;
                    }
                }
                for n in 0..g {
                    let sc = &mut scores[n * max_pos..n * max_pos + npos];
                    let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    inv[n] = 1.0 / kn.exp_sum(sc, mx);
                }
                o.fill(0.0);
                for p in 0..npos {
                    kv_row(kn, vc, p, m * hd, &mut row);
                    for n in 0..g {
                        kn.axpy(scores[n * max_pos + p], &row, &mut o[n * hd..(n + 1) * hd]);
                    }
                }
                for n in 0..g {
                    o[n * hd..(n + 1) * hd].iter_mut().for_each(|x| *x *= inv[n]);
                }
            }
        });
        let mut out = Mat::zeros(s.n_tok, s.n_head * hd);
        for (item, o) in ob.chunks_exact(gw).enumerate() {
            let (m, t) = (item / s.n_tok, item % s.n_tok);
            out.row_mut(t)[m * gw..(m + 1) * gw].copy_from_slice(o);
        }
        out
    }
}

/// Values `start..start + out.len()` of cached row `p`, as f32.
#[inline]
fn kv_row<K: Kernels>(kn: K, c: &KvRows, p: usize, start: usize, out: &mut [f32]) {
    match c.ty {
        KvType::F16 => {
            let rb = c.row_bytes();
            kn.f16_to_f32(&c.bytes[p * rb + 2 * start..p * rb + 2 * (start + out.len())], out);
        }
        _ => c.read(p, start, out),
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

/// Most slots of one MoE call (256 experts + the shared one, with room to spare).
const MAX_SLOTS: usize = 1024;
/// Widest expert hidden layer the fused MoE handles on the stack.
const MAX_FF: usize = 8192;

/// An empty token list means "tokens 0..n in order".
const ALL_TOKENS: [(usize, f32); 0] = [];

/// The activations of one op: f32 rows, and their 8-bit form when a weight is quantised.
struct Acts<'a> {
    x: &'a Mat,
    q: &'a [ActRow],
}

/// One weight row against the activation rows `toks`.
#[inline]
fn dot_row<K: Kernels, const NT: usize>(k: K, w: &WeightView, r: usize, src: &Acts, toks: [usize; NT]) -> [f32; NT] {
    if kernels::supported(w.ty) {
        k.dot_q::<NT>(w.ty, w.row(r), toks.map(|t| &src.q[t]))
    } else if matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        k.dot_float::<NT>(w.ty, w.row(r), toks.map(|t| src.x.row(t)))
    } else {
        // Other types (none in qwen35moe files): dequantise the row.
        let mut row = vec![0f32; w.k];
        // unwrap: the view's rows are whole blocks of its type.
        quant::dequantize(w.ty, w.row(r), &mut row).unwrap();
        toks.map(|t| simd::dot_f32_scalar(&row, src.x.row(t)))
    }
}

/// Rows `r0..r0 + m` of `w` against `nt` tokens (`toks`, or 0..nt when empty); `put(i, j, v)`
/// receives token i's dot with row r0 + j. Prompt-sized tiles go through a [`Panel`]; others
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
    put: &mut impl FnMut(usize, usize, f32),
    put_run: &mut impl FnMut(usize, &[f32]),
) {
    let tok = |i: usize| if toks.is_empty() { i } else { toks[i].0 };
    if inv && nt > 1 {
        // Batch-invariant: each token through the single-token kernel, as in decode.
        for t in 0..nt {
            for j in 0..m {
                put(t, j, dot_row::<K, 1>(k, w, r0 + j, src, [tok(t)])[0]);
            }
        }
        return;
    }
    if use_panel(k, w.ty, nt) {
        return panel_rows(k, w, r0, m, nt, |i| &src.q[tok(i)], put_run);
    }
    if nt == 1 {
        let ahead = prefetch_rows(w.row_bytes());
        for j in 0..m {
            let r = r0 + j + ahead;
            if r < w.n_rows {
                simd::prefetch(w.row(r));
            } else if let Some(nw) = next.filter(|nw| r - w.n_rows < nw.n_rows) {
                // Past this matrix: the start of the one read next (another expert's rows).
                simd::prefetch(nw.row(r - w.n_rows));
            }
            put(0, j, dot_row::<K, 1>(k, w, r0 + j, src, [tok(0)])[0]);
        }
        return;
    }
    let mut t = 0;
    while t + 4 <= nt {
        let ids = [tok(t), tok(t + 1), tok(t + 2), tok(t + 3)];
        for j in 0..m {
            let v = dot_row::<K, 4>(k, w, r0 + j, src, ids);
            for (l, v) in v.iter().enumerate() {
                put(t + l, j, *v);
            }
        }
        t += 4;
    }
    for t in t..nt {
        for j in 0..m {
            put(t, j, dot_row::<K, 1>(k, w, r0 + j, src, [tok(t)])[0]);
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

/// Boundaries (in elements of `gu`) splitting the MoE gate/up items evenly by work, each on an
/// item (row) boundary.
fn item_bounds(slots: &[MoeSlot], offs: &[usize], n_threads: usize, b: &mut [usize; MAX_PARTS + 1]) -> usize {
    let total = offs[slots.len()];
    let parts = n_threads.clamp(1, MAX_PARTS);
    b[0] = 0;
    for p in 1..parts {
        let target = total * p / parts;
        // Round to the start of the row containing `target`.
        let si = offs[..=slots.len()].partition_point(|&o| o <= target).saturating_sub(1).min(slots.len() - 1);
        let nt = slots[si].tokens.len().max(1);
        let e = offs[si] + (target - offs[si]) / nt * nt;
        b[p] = e.max(b[p - 1]).min(total);
    }
    b[parts] = total;
    parts
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

impl Ops for CpuOps {
    fn name(&self) -> &'static str {
        match self.precision {
            Precision::Exact => "cpu-exact",
            Precision::Fast => "cpu",
            Precision::BatchInvariant => "cpu-invariant",
        }
    }

    fn matmul(&self, w: &WeightView, x: &Mat) -> Mat {
        assert_eq!(x.d, w.k, "matmul: x has {} columns, weight rows have {}", x.d, w.k);
        if x.n == 0 || w.n_rows == 0 {
            return Mat::zeros(x.n, w.n_rows);
        }
        if self.precision == Precision::Exact {
            return self.matmul_exact(w, x);
        }
        with_kernels!(self.isa, |k| self.matmul_many_fast(k, std::slice::from_ref(w), x).pop().expect("one weight, one output"))
    }

    fn matmul_many(&self, ws: &[WeightView], x: &Mat) -> Vec<Mat> {
        for w in ws {
            assert_eq!(x.d, w.k, "matmul_many: x has {} columns, weight rows have {}", x.d, w.k);
        }
        if self.precision == Precision::Exact || x.n == 0 {
            return ws.iter().map(|w| self.matmul(w, x)).collect();
        }
        with_kernels!(self.isa, |k| self.matmul_many_fast(k, ws, x))
    }

    fn moe(&self, slots: &[MoeSlot], x: &Mat) -> Mat {
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
            return reference::moe(|w, x| self.matmul(w, x), slots, x);
        }
        with_kernels!(self.isa, |k| self.moe_fast(k, slots, x))
    }

    /// Fast precision runs the recurrent form for every batch (one SIMD pass over each state row
    /// per token): on the CPU it costs about what the chunked form does (~49k vs ~67k
    /// multiply-adds per head and token at d = 128, C = 64) without its O(C²) temporaries; the
    /// two forms differ only by rounding (qwen35moe.md §6.5). Exact precision honours `chunked`.
    fn rms_norm(&self, x: &Mat, weight: &[f32], eps: f32) -> Mat {
        if self.precision == Precision::Exact {
            return reference::rms_norm(x, weight, eps);
        }
        let g = weight.len();
        assert_eq!(x.d % g, 0, "rms_norm: width {} is not a multiple of the weight length {g}", x.d);
        let mut out = Mat::zeros(x.n, x.d);
        with_kernels!(self.isa, |kn| {
            for (src, dst) in x.data.chunks_exact(g).zip(out.data.chunks_exact_mut(g)) {
                let scale = 1.0 / (kn.dot_f32(src, src) / g as f32 + eps).sqrt();
                dst.iter_mut().zip(src).zip(weight).for_each(|((o, v), w)| *o = v * scale * w);
            }
        });
        out
    }

    /// Taps transposed once per call so each step is a vector multiply-add over all channels;
    /// SiLU with the vectorised exp; tokens split across workers for prompts.
    fn conv1d_silu(&self, x: &Mat, w: &[f32], state: &mut [f32]) -> Mat {
        let c = x.d;
        let kernel = w.len() / c.max(1);
        if self.precision == Precision::Exact || kernel == 0 || state.len() != (kernel - 1) * c {
            return reference::conv1d_silu(x, w, state);
        }
        let hist = kernel - 1;
        if x.n < 8 || self.invariant() {
            // Decode: the taps in their stored order ([ch][j]), no transposed copy.
            let mut out = Mat::zeros(x.n, c);
            for t in 0..x.n {
                let o = out.row_mut(t);
                for j in 0..kernel {
                    let i = t as isize - hist as isize + j as isize;
                    let src = if i < 0 { &state[(hist as isize + i) as usize * c..][..c] } else { x.row(i as usize) };
                    for ((o, v), w) in o.iter_mut().zip(src).zip(w.chunks_exact(kernel)) {
                        *o += w[j] * v;
                    }
                }
                with_kernels!(self.isa, |kn| kn.silu(o));
            }
            // New state: the last `hist` inputs of [old state; x], shifted in place.
            let keep = hist.saturating_sub(x.n);
            state.copy_within((hist - keep) * c..hist * c, 0);
            for s in keep..hist {
                state[s * c..(s + 1) * c].copy_from_slice(x.row(x.n + s - hist));
            }
            return out;
        }
        let mut wt = vec![0f32; kernel * c]; // wt[j][ch]
        for ch in 0..c {
            for j in 0..kernel {
                wt[j * c + ch] = w[ch * kernel + j];
            }
        }
        let input = |i: isize| -> &[f32] { if i < 0 { &state[(hist as isize + i) as usize * c..][..c] } else { x.row(i as usize) } };
        let mut out = Mat::zeros(x.n, c);
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(x.n, if x.n >= 8 { parts_for(self.n_threads()) } else { 1 }, 1, &mut b);
        let tb = b;
        b.iter_mut().for_each(|e| *e *= c);
        with_kernels!(self.isa, |kn| {
            self.pool.split_mut(&mut out.data, &b[..=parts], |p, rows| {
                for (i, o) in rows.chunks_exact_mut(c).enumerate() {
                    let t = (tb[p] + i) as isize;
                    for j in 0..kernel {
                        let src = input(t - hist as isize + j as isize);
                        kn.mul_add(&wt[j * c..(j + 1) * c], src, o);
                    }
                    kn.silu(o);
                }
            })
        });
        let mut new_state = vec![0f32; hist * c];
        for s in 0..hist {
            new_state[s * c..(s + 1) * c].copy_from_slice(input(x.n as isize - hist as isize + s as isize));
        }
        state.copy_from_slice(&new_state);
        out
    }

    fn gated_delta_rule(&self, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32], chunked: bool) -> Mat {
        if self.precision == Precision::Exact {
            return self.gated_delta_rule_par(s, q, k, v, g, beta, state, chunked);
        }
        with_kernels!(self.isa, |kn| self.delta_fast(kn, s, q, k, v, g, beta, state))
    }

    fn attention(&self, s: AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> Mat {
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
        let mut out = Mat::zeros(s.n_tok, s.n_head * s.head_dim);
        for (n, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, n, s.head_dim, o);
        }
        out
    }
}
