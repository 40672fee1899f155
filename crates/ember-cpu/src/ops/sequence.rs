//! The sequence ops of the fast path: the gated delta rule (DeltaNet layers) and attention over
//! the KV cache, each split across workers by heads.

use ember_gguf::GgmlType;
use ember_ops::reference;
use ember_ops::{AttnShape, DeltaShape, KV_PAGE, KvRows, KvType, Mat};

use std::sync::Mutex;

use super::attention::{kv_bytes, kv_row};
use super::{CpuOps, Precision, lock};
use crate::kernels::ActRow;
use crate::pool::{MAX_PARTS, even_bounds, parts_for};
use crate::simd::{self, AttnIo, DeltaIo, Gemm, Kernels};

impl CpuOps {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_rule_par(
        &self,
        s: DeltaShape,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        g: &Mat,
        beta: &Mat,
        state: &mut [f32],
        chunked: bool,
    ) -> Mat {
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
        let mut out = self.zeros(s.n_tok, s.n_v_head * s.d_v);
        for (h, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, h, s.d_v, o);
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn delta_fast<K: Kernels>(
        &self,
        kn: K,
        s: DeltaShape,
        q: &Mat,
        k: &Mat,
        v: &Mat,
        g: &Mat,
        beta: &Mat,
        state: &mut [f32],
    ) -> Mat {
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
                    simd::delta_stepwise(kn, sth, &io, oh); // as in decode, for every batch size
                } else {
                    kn.delta_seq(sth, &io, oh);
                }
            }
        });
        let mut out = self.zeros(s.n_tok, s.n_v_head * dv);
        for (h, o) in heads.chunks_exact(per).enumerate() {
            reference::scatter_head(&mut out, h, dv, o);
        }
        out
    }

    /// Attention with each K and V row of a KV head converted to f32 once per query token and
    /// used by all the query heads that share it (GQA); softmax with a vectorised exp. Work
    /// items are (token, range of positions) over all KV heads, split across workers by their
    /// number of positions. With fewer tokens than workers (decode), each token's positions
    /// are cut into ranges of at least [`SPLIT_MIN`] so that every worker reads a share of the
    /// cache; the ranges' results merge by their score maxima and sums (flash-decoding). With
    /// one range per token the arithmetic is as it was without ranges. f16 and q8_0 caches go
    /// to the kernels of `Kernels::attn_f16` / `attn_q8` where the instruction set has them
    /// (all KV heads in one call: a row's heads are read together). Otherwise, KV head by KV
    /// head: with a q8_0 key cache the scores are integer dots (`Kernels::dot_q`, as a Q8_0
    /// weight row's) with the scaled query heads quantised to 8 bits per 32 values, as in the
    /// tiled prompt kernel (`attention.rs`).
    pub(super) fn attention_fast<K: Kernels>(&self, kn: K, s: AttnShape, q: &Mat, kc: &KvRows, vc: &KvRows) -> Mat {
        let hd = s.head_dim;
        let g = s.n_head / s.n_head_kv;
        let gw = g * hd;
        let max_pos = s.pos0 + s.n_tok;
        let threads = self.n_threads();
        // Batch-invariant precision computes a token the same way in a prompt and alone: no split.
        let split = s.n_tok < threads && self.precision == Precision::Fast;
        let n_split = if split { threads.div_ceil(s.n_tok).min(max_pos / SPLIT_MIN).max(1) } else { 1 };
        let n_items = s.n_tok * n_split;
        // Per item: every head's hd outputs, then (largest score, Σ exp(score − largest)) per head.
        let slot = s.n_head * (hd + 2);
        let mut ob = vec![0f32; n_items * slot]; // [token][range][slot]
        // Positions p0..p1 of item i: range c of its token's 0..=pos, in whole KV pages (the
        // kernels read a range through the pages from p0 / KV_PAGE on).
        let range = |i: usize| {
            let (t, c) = (i / n_split, i % n_split);
            let npos = s.pos0 + t + 1;
            let len = npos.div_ceil(n_split).next_multiple_of(KV_PAGE);
            ((c * len).min(npos), ((c + 1) * len).min(npos))
        };
        // Split items by cost (positions + a constant), on item boundaries.
        let cost = |i: usize| {
            let (p0, p1) = range(i);
            p1 - p0 + 16
        };
        let total: usize = (0..n_items).map(cost).sum();
        let longest = (0..n_items).map(|i| range(i).1 - range(i).0).max().unwrap_or(0);
        let parts = parts_for(threads).min(n_items);
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
        b.iter_mut().for_each(|e| *e *= slot);
        let kernel = kc.ty == vc.ty && matches!(kc.ty, KvType::F16 | KvType::Q8_0);
        self.pool.split_mut(&mut ob, &b[..=parts], |pi, out| {
            let mut scores = vec![0f32; s.n_head * longest];
            for (j, o) in out.chunks_exact_mut(slot).enumerate() {
                let item = ib[pi] + j;
                let t = item / n_split;
                let (p0, p1) = range(item);
                let n = p1 - p0;
                let (o, ml) = o.split_at_mut(s.n_head * hd);
                if n == 0 {
                    // An empty range (a short token): weight zero in the merge.
                    ml.chunks_exact_mut(2).for_each(|x| x.copy_from_slice(&[f32::NEG_INFINITY, 0.0]));
                    continue;
                }
                if kernel {
                    let (k, v) = (&kc.pages()[p0 / KV_PAGE..], &vc.pages()[p0 / KV_PAGE..]);
                    let io = AttnIo { q: q.row(t), k, v, rb: kc.row_bytes(), off: 0, npos: n, hd, scale: s.scale, n_kv: s.n_head_kv };
                    let done =
                        if kc.ty == KvType::F16 { kn.attn_f16(&io, &mut scores, o, ml) } else { kn.attn_q8(&io, &mut scores, o, ml) };
                    if done {
                        continue;
                    }
                }
                for m in 0..s.n_head_kv {
                    let (om, mm) = (&mut o[m * gw..(m + 1) * gw], &mut ml[2 * m * g..2 * (m + 1) * g]);
                    self.attention_kv_head(kn, (&s, kc, vc), (q.row(t), m), (p0, p1), &mut scores, om, mm);
                }
            }
        });
        let mut out = self.zeros(s.n_tok, s.n_head * hd);
        for (t, items) in ob.chunks_exact(n_split * slot).enumerate() {
            let dst = out.row_mut(t);
            if n_split == 1 {
                dst.copy_from_slice(&items[..s.n_head * hd]);
                continue;
            }
            // Each range's normalised output weighted by its share of the softmax mass.
            let ohd = s.n_head * hd;
            for h in 0..s.n_head {
                let ml = |c: usize| (items[c * slot + ohd + 2 * h], items[c * slot + ohd + 2 * h + 1]);
                let mx = (0..n_split).map(|c| ml(c).0).fold(f32::NEG_INFINITY, f32::max);
                let d = &mut dst[h * hd..(h + 1) * hd];
                let mut mass = 0f32;
                for c in 0..n_split {
                    let (mc, lc) = ml(c);
                    if lc == 0.0 {
                        continue;
                    }
                    let w = lc * (mc - mx).exp();
                    mass += w;
                    d.iter_mut().zip(&items[c * slot + h * hd..c * slot + (h + 1) * hd]).for_each(|(x, y)| *x += w * y);
                }
                d.iter_mut().for_each(|x| *x /= mass);
            }
        }
        out
    }

    /// The generic form of one KV head `m` of [`CpuOps::attention_fast`] over positions p0..p1
    /// of token row `qt`: its g heads' outputs into `o`, (largest score, sum) per head into `ml`.
    #[allow(clippy::too_many_arguments)]
    fn attention_kv_head<K: Kernels>(
        &self,
        kn: K,
        (s, kc, vc): (&AttnShape, &KvRows, &KvRows),
        (qt, m): (&[f32], usize),
        (p0, p1): (usize, usize),
        scores: &mut [f32],
        o: &mut [f32],
        ml: &mut [f32],
    ) {
        let hd = s.head_dim;
        let g = s.n_head / s.n_head_kv;
        let gw = g * hd;
        let n = p1 - p0;
        let int_k = kc.ty == KvType::Q8_0 && hd.is_multiple_of(32);
        let hb = hd / 32 * 34; // bytes of one head's keys in a q8_0 row
        // Shapes the SIMD `gemm_f32` tiles take whole (AVX2: 4 rows × 16 columns).
        let pv_tiles = g.is_multiple_of(4) && hd.is_multiple_of(16);
        let mut row = vec![0f32; hd];
        let mut inv = vec![0f32; g];
        let mut qa = vec![ActRow::default(); if int_k { g } else { 0 }];
        let mut vrows = vec![0f32; if pv_tiles { PV_CHUNK * hd } else { 0 }];
        let qs = &qt[m * gw..(m + 1) * gw]; // the g query heads of KV head m
        // Head h's scores at scores[h·n + p − p0].
        if int_k {
            for (h, a) in qa.iter_mut().enumerate() {
                row.iter_mut().zip(&qs[h * hd..(h + 1) * hd]).for_each(|(d, x)| *d = x * s.scale);
                kn.quantize(&row, a);
            }
            for p in p0..p1 {
                let kr = &kc.row(p)[m * hb..(m + 1) * hb];
                if p + KV_PF_ROWS < p1
                    && let Some(b) = kv_bytes(kc, p + KV_PF_ROWS, m * hd, hd)
                {
                    simd::prefetch(b);
                }
                let at = |h: usize| h * n + p - p0;
                let mut h = 0;
                // Eight heads (or four, or one) per pass over the key row.
                while h < g {
                    match g - h {
                        8.. => {
                            let d = kn.dot_q::<8>(GgmlType::Q8_0, kr, std::array::from_fn(|i| &qa[h + i]));
                            d.iter().enumerate().for_each(|(i, x)| scores[at(h + i)] = *x);
                            h += 8;
                        }
                        4.. => {
                            let d = kn.dot_q::<4>(GgmlType::Q8_0, kr, std::array::from_fn(|i| &qa[h + i]));
                            d.iter().enumerate().for_each(|(i, x)| scores[at(h + i)] = *x);
                            h += 4;
                        }
                        _ => {
                            scores[at(h)] = kn.dot_q::<1>(GgmlType::Q8_0, kr, [&qa[h]])[0];
                            h += 1;
                        }
                    }
                }
            }
        } else {
            for p in p0..p1 {
                kv_row(kn, kc, p, m * hd, &mut row);
                for h in 0..g {
                    scores[h * n + p - p0] = kn.dot_f32(&qs[h * hd..(h + 1) * hd], &row) * s.scale;
                }
            }
        }
        for h in 0..g {
            let sc = &mut scores[h * n..(h + 1) * n];
            let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum = kn.exp_sum(sc, mx);
            (ml[2 * h], ml[2 * h + 1]) = (mx, sum);
            inv[h] = 1.0 / sum;
        }
        o.fill(0.0);
        if pv_tiles {
            // P·V as register-tiled products over chunks of converted rows: the axpy per
            // (position, head) loaded and stored all of o[h] for each position.
            let mut c0 = p0;
            while c0 < p1 {
                let nc = PV_CHUNK.min(p1 - c0);
                for (j, r) in vrows.chunks_exact_mut(hd).take(nc).enumerate() {
                    kv_row(kn, vc, c0 + j, m * hd, r);
                    // The next chunk's row j, while this chunk converts and multiplies.
                    if c0 + nc + j < p1
                        && let Some(b) = kv_bytes(vc, c0 + nc + j, m * hd, hd)
                    {
                        simd::prefetch(b);
                    }
                }
                let a = &scores[c0 - p0..];
                kn.gemm_f32(&Gemm { a, lda: n, b: &vrows, ldb: hd, ldc: hd, m: g, n: hd, kd: nc, acc: true }, o);
                c0 += nc;
            }
        } else {
            for p in p0..p1 {
                kv_row(kn, vc, p, m * hd, &mut row);
                for h in 0..g {
                    kn.axpy(scores[h * n + p - p0], &row, &mut o[h * hd..(h + 1) * hd]);
                }
            }
        }
        for h in 0..g {
            o[h * hd..(h + 1) * hd].iter_mut().for_each(|x| *x *= inv[h]);
        }
    }
}

/// Value rows converted per P·V product in decode (64 KiB of f32 at head size 256: in L2).
const PV_CHUNK: usize = 64;

/// Cache rows the decode loops ask for ahead of the one they read: a KV head's slice of a row
/// is 512 bytes (f16, head size 256) in rows 1 KiB apart, which the hardware prefetchers
/// left waiting on DRAM (measured with attn_bench at depth 32768: the f16 kernel 12.3 → ~5.5
/// ms a call on 2 threads with its own prefetch).
const KV_PF_ROWS: usize = 16;

/// Fewest positions in one range of a split attention: below this a range's fixed costs (a
/// merge, a scratch row) outweigh another worker's share of the reads.
const SPLIT_MIN: usize = 256;
