//! The small per-token ops of a layer split across the workers: the DeltaNet's q/k/v split and
//! norms (`delta_prep`), attention's q/gate split and RoPE (`attn_prep`), the routing, the
//! residual add. Each token's values are computed exactly as the reference computes them (the
//! same scalar functions in the same order), so the split changes no bit; the reference runs
//! them on one thread, which a 512-token prompt on the 2-core VM measured at 73 ms a step for
//! `delta_prep` alone (`small`, 12 DeltaNet layers) at one thread and at two.

use ember_ops::reference::{self, ROUTE_SUM_MIN};
use ember_ops::{AttnMats, AttnPrep, DeltaMats, DeltaPrep, ExpertId, Mat, RouteTable};

use super::{CpuOps, GATE_PARALLEL_MIN};
use crate::pool::{MAX_PARTS, even_bounds, parts_for};

/// Fewest values for which [`CpuOps::zeros`] zeroes across the workers (1 MiB of f32).
const ZERO_PARALLEL_MIN: usize = 256 * 1024;

/// Whether [`CpuOps::zeros`] zeroes large outputs across the workers (`EMBER_CPU_PAR_ZEROS=0`:
/// on the caller's thread, as before). Even on the 2-core VM (`ember bench` 294.6 against 294.7
/// t/s); on a 16-core host (docs/perf.md v20, two rounds alternating) pp512 283.3 / 267.0
/// against 227.4 / 264.6 t/s at 16 threads and 201.7 / 189.8 against 170.6 / 146.2 at 8.
fn parallel_zeros() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EMBER_CPU_PAR_ZEROS").map_or(true, |v| v != "0"))
}

impl CpuOps {
    /// A zeroed `n` x `d` matrix; with [`parallel_zeros`] the zeroing is split across the
    /// workers from [`ZERO_PARALLEL_MIN`] values: a prompt step's outputs are tens of MB a
    /// layer, and `Mat::zeros` (calloc) clears memory it reuses on the caller's thread alone
    /// (a 512-token conv output, 16 MB: 1.4 ms on the 2-core VM; memset of fresh outputs was
    /// 3.6 % of a 2-thread pp512's samples, all on the caller's thread, while the other waits).
    pub fn zeros(&self, n: usize, d: usize) -> Mat {
        let len = n * d;
        if len < ZERO_PARALLEL_MIN || self.n_threads() == 1 || !parallel_zeros() {
            return Mat::zeros(n, d);
        }
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = even_bounds(len, parts_for(self.n_threads()), 1024, &mut b);
        Mat::from_vec(n, d, self.pool.zeroed(len, &b[..=parts]))
    }

    /// Row bounds (in values of `width` a row) splitting `n` rows across the workers, one part
    /// below [`GATE_PARALLEL_MIN`] values; returns the part count.
    fn row_bounds(&self, n: usize, width: usize, b: &mut [usize; MAX_PARTS + 1]) -> usize {
        let parts = if n * width < GATE_PARALLEL_MIN { 1 } else { parts_for(self.n_threads()) };
        let parts = even_bounds(n, parts, 1, b);
        b.iter_mut().for_each(|e| *e *= width);
        parts
    }

    /// `out` [n, w] ← columns c0..c0 + w of `x`, then `f` on each row of it, split across the
    /// workers by rows.
    fn cols_par(&self, x: &Mat, c0: usize, w: usize, f: impl Fn(&mut [f32]) + Sync) -> Mat {
        let mut out = self.zeros(x.n, w);
        if w == 0 {
            return out;
        }
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = self.row_bounds(x.n, w, &mut b);
        self.pool.split_mut(&mut out.data, &b[..=parts], |p, rows| {
            for (i, row) in rows.chunks_exact_mut(w).enumerate() {
                row.copy_from_slice(&x.row(b[p] / w + i)[c0..c0 + w]);
                f(row);
            }
        });
        out
    }

    /// [`reference::delta_prep`], split across the workers by tokens.
    pub fn delta_prep_mats(&self, s: &DeltaPrep, a: &[f32], dt_bias: &[f32], cu: &Mat, b: &Mat, alpha: &Mat) -> DeltaMats {
        let (nk, dk, eps) = (s.n_k_head, s.d_k, s.eps);
        let q_scale = 1.0 / (dk as f32).sqrt();
        let q = self.cols_par(cu, 0, nk * dk, |row| {
            for head in row.chunks_exact_mut(dk) {
                reference::l2_norm(head, eps);
                head.iter_mut().for_each(|x| *x *= q_scale);
            }
        });
        let k = self.cols_par(cu, nk * dk, nk * dk, |row| row.chunks_exact_mut(dk).for_each(|head| reference::l2_norm(head, eps)));
        let v = self.cols_par(cu, 2 * nk * dk, s.n_v_head * s.d_v, |_| {});
        // β and g are n_v_head values a token: one thread.
        let mut beta = b.clone();
        beta.data.iter_mut().for_each(|x| *x = reference::sigmoid(*x));
        let mut g = alpha.clone();
        for t in 0..g.n {
            for (h, x) in g.row_mut(t).iter_mut().enumerate() {
                *x = a[h] * reference::softplus(*x + dt_bias[h]);
            }
        }
        DeltaMats { q, k, v, g, beta }
    }

    /// Attention's preparation as [`reference::attn_prep`] but with the norms through
    /// [`CpuOps::rms_norm_vec`]: the split of q and its gate and RoPE across the workers by
    /// tokens.
    pub fn attn_prep_mats(&self, s: &AttnPrep, q_norm: &[f32], k_norm: &[f32], qg: &Mat, k: &Mat, pos: &[u32]) -> AttnMats {
        let (hd, nh) = (s.head_dim, s.n_head);
        let split = |half: usize| {
            let mut out = self.zeros(qg.n, nh * hd);
            if nh * hd == 0 {
                return out;
            }
            let mut b = [0usize; MAX_PARTS + 1];
            let parts = self.row_bounds(qg.n, nh * hd, &mut b);
            self.pool.split_mut(&mut out.data, &b[..=parts], |p, rows| {
                let t0 = b[p] / (nh * hd).max(1);
                for (i, row) in rows.chunks_exact_mut(nh * hd).enumerate() {
                    for (src, dst) in qg.row(t0 + i).chunks_exact(2 * hd).zip(row.chunks_exact_mut(hd)) {
                        dst.copy_from_slice(&src[half * hd..(half + 1) * hd]);
                    }
                }
            });
            out
        };
        let (q, gate) = (split(0), split(1));
        let mut q = self.rms_norm_vec(&q, q_norm, s.eps);
        let mut k = self.rms_norm_vec(k, k_norm, s.eps);
        self.rope_par(&mut q, hd, s.n_rot, pos, s.rope_base);
        self.rope_par(&mut k, hd, s.n_rot, pos, s.rope_base);
        AttnMats { q, gate, k }
    }

    /// [`reference::rope_at`], split across the workers by rows.
    fn rope_par(&self, x: &mut Mat, head_dim: usize, n_rot: usize, pos: &[u32], base: f32) {
        let (n, d) = (x.n.min(pos.len()), x.d);
        if n == 0 || d == 0 {
            return;
        }
        let inv_freq = reference::rope_inv_freq(n_rot, base);
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = self.row_bounds(n, d, &mut b);
        self.pool.split_mut(&mut x.data[..n * d], &b[..=parts], |p, rows| {
            let mut cs = vec![(0f32, 0f32); inv_freq.len()];
            for (i, row) in rows.chunks_exact_mut(d).enumerate() {
                reference::rope_row(row, head_dim, pos[b[p] / d + i], &inv_freq, &mut cs);
            }
        });
    }

    /// [`reference::route`], split across the workers by tokens.
    pub fn route_table(&self, logits: &Mat, k: usize) -> RouteTable {
        let k = k.min(logits.d);
        let n = logits.n;
        let mut ids = vec![ExpertId(0); n * k];
        let mut weights = vec![0f32; n * k];
        if n * k > 0 {
            let mut b = [0usize; MAX_PARTS + 1];
            // ~d operations a token (softmax, then the top k): split like d values a row.
            let parts = self.row_bounds(n, logits.d, &mut b);
            b.iter_mut().for_each(|e| *e = *e / logits.d * k);
            self.pool.split_mut2(&mut ids, &b[..=parts], &mut weights, &b[..=parts], |p, ids, ws| {
                let mut prob = vec![0f32; logits.d];
                let mut sel = vec![0usize; k];
                for (i, (ids, ws)) in ids.chunks_exact_mut(k).zip(ws.chunks_exact_mut(k)).enumerate() {
                    reference::softmax(logits.row(b[p] / k + i), &mut prob);
                    reference::top_k(&prob, &mut sel);
                    let sum: f32 = sel.iter().map(|&e| prob[e]).sum();
                    let norm = sum.max(ROUTE_SUM_MIN);
                    for ((id, w), &e) in ids.iter_mut().zip(ws.iter_mut()).zip(&sel) {
                        *id = ExpertId(e as u16);
                        *w = prob[e] / norm;
                    }
                }
            });
        }
        RouteTable { n_tok: n, k, ids, weights }
    }

    /// `h ← h + x` ([`reference::add`]), split across the workers.
    pub fn add_mat(&self, h: &mut Mat, x: &Mat) {
        assert_eq!((h.n, h.d), (x.n, x.d), "add: {}x{} + {}x{}", h.n, h.d, x.n, x.d);
        let mut b = [0usize; MAX_PARTS + 1];
        let parts = self.row_bounds(h.n, h.d, &mut b);
        self.pool.split_mut(&mut h.data, &b[..=parts], |p, part| {
            part.iter_mut().zip(&x.data[b[p]..]).for_each(|(a, v)| *a += v);
        });
    }
}
