//! The fused MoE of the fast path: every routed expert and the shared one in three parallel
//! regions per layer (gate/up, SwiGLU + quantisation, down), prompt-sized slots through panels.

use ember_ops::{Mat, MoeSlot};

use super::{Acts, CpuOps, ROW_TILE, grouped_for, panel_min_tokens, panel_rows, prefetch_rows, tile, use_panel};
use crate::kernels::{self, ActRow};
use crate::pool::{MAX_PARTS, even_bounds, parts_for, tapered_bounds, tapered_share};
use crate::simd::{self, Kernels};

/// Most slots of one MoE call (256 experts + the shared one, with room to spare).
pub(super) const MAX_SLOTS: usize = 1024;
/// Widest expert hidden layer the fused MoE handles on the stack.
pub(super) const MAX_FF: usize = 8192;

impl CpuOps {
    /// The fused MoE: (1) every slot's gate and up rows in one region, (2) SwiGLU and
    /// quantisation of the hidden rows, (3) every output row's sum over slots in one region.
    pub(super) fn moe_fast<K: Kernels>(&self, k: K, slots: &[MoeSlot], x: &Mat) -> Mat {
        let d = slots[0].expert.down.n_rows;
        let mut guard = self.scratch();
        let s = &mut *guard;
        let grouped_in = grouped_for(k, slots.iter().flat_map(|sl| [sl.expert.gate.ty, sl.expert.up.ty]));
        let grouped_h = grouped_for(k, slots.iter().map(|sl| sl.expert.down.ty));
        self.quantize_rows(k, x, &mut s.acts, grouped_in);
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
                let block = &mut out[o..o + m * nt]; // [row][token]
                tile(k, w, next, r, m, &src, sl.tokens, nt, inv, &mut |i, j, v| {
                    for (jj, v) in v.iter().enumerate() {
                        block[(j + jj) * nt + i] = *v;
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
        let ordered = k.wants_k4_order() && (inv || n_h < 8);
        let fill = |i: usize, a: &mut ActRow| {
            let si = hoffs[..=slots.len()].partition_point(|&o| o <= i) - 1;
            let (nt, n_ff) = (slots[si].tokens.len(), slots[si].expert.gate.n_rows);
            let j = i - hoffs[si];
            let g = &gu[offs[si]..offs[si] + n_ff * nt];
            let u = &gu[offs[si] + n_ff * nt..offs[si + 1]];
            let mut h = [0f32; MAX_FF];
            for (r, v) in h[..n_ff].iter_mut().enumerate() {
                *v = g[r * nt + j];
            }
            k.silu(&mut h[..n_ff]);
            for (r, v) in h[..n_ff].iter_mut().enumerate() {
                *v *= u[r * nt + j];
            }
            if grouped_h {
                k.quantize_grouped(&h[..n_ff], a);
            } else {
                k.quantize(&h[..n_ff], a);
            }
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
        let mut y = self.zeros(n, d);
        let parts = tapered_bounds(d, parts_for(self.n_threads()), ROW_TILE, &mut b);
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
                let prefetch = |r: usize| {
                    let ra = r + ahead;
                    if ra < r1 {
                        simd::prefetch(dw.row(ra));
                    } else if let Some(nw) = next.filter(|nw| r0 + ra - r1 < r1.min(nw.n_rows)) {
                        simd::prefetch(nw.row(r0 + ra - r1));
                    }
                };
                if !inv && h.len() == 1 && kernels::supported(dw.ty) {
                    // Decode: rows in runs through one kernel call each (with k = 512 a Q6_K
                    // row is two blocks, so the per-row call and dispatch were a large share).
                    let (t, w) = sl.tokens[0];
                    let rb = dw.row_bytes();
                    let mut v = [0f32; DOWN_RUN];
                    for c0 in (r0..r1).step_by(DOWN_RUN) {
                        let m = DOWN_RUN.min(r1 - c0);
                        k.dot_rows(dw.ty, &dw.data[c0 * rb..(c0 + m) * rb], rb, &h[0], &mut v[..m], |j| prefetch(c0 + j));
                        for (o, v) in out.run(t, c0, m).iter_mut().zip(&v[..m]) {
                            *o += w * v;
                        }
                    }
                    continue;
                }
                for r in r0..r1 {
                    prefetch(r);
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
}

/// Rows of an expert's down matrix per single-token kernel call.
const DOWN_RUN: usize = 64;

/// Boundaries (in elements of `gu`) splitting the MoE gate/up items by work into tapered parts
/// ([`tapered_bounds`]), each on an item (row) boundary.
fn item_bounds(slots: &[MoeSlot], offs: &[usize], n_threads: usize, b: &mut [usize; MAX_PARTS + 1]) -> usize {
    let total = offs[slots.len()];
    let parts = n_threads.clamp(1, MAX_PARTS);
    b[0] = 0;
    for p in 1..parts {
        let target = total * tapered_share(p, parts) / tapered_share(parts, parts);
        // Round to the start of the row containing `target`.
        let si = offs[..=slots.len()].partition_point(|&o| o <= target).saturating_sub(1).min(slots.len() - 1);
        let nt = slots[si].tokens.len().max(1);
        let e = offs[si] + (target - offs[si]) / nt * nt;
        b[p] = e.max(b[p - 1]).min(total);
    }
    b[parts] = total;
    parts
}
