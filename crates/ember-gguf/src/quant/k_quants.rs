//! 256-weight super-block ("K") formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K
//! (gguf-format.md §5).
//!
//! Every format is handled as "unpack the block's integer quants into a [u8; 256] / [i8; 256]
//! in weight order, plus per-sub-block scales", so dequantisation, the dot product and the
//! packing in the quantiser share one description of the bit layout. Useful fact: in Q2_K,
//! Q3_K and Q6_K the 16-weight sub-block of weight `i` is simply `i / 16`, and in Q4_K/Q5_K
//! the 32-weight sub-block is `i / 32`.

use super::fit::{fit_asym, fit_sym, signed_absmax};
use super::{f16_at, f32_at, idot, put_f16};

const QK_K: usize = 256;
const TS_Q2K: usize = 84;
const TS_Q3K: usize = 110;
const TS_Q4K: usize = 144;
const TS_Q5K: usize = 176;
const TS_Q6K: usize = 210;
const TS_Q8K: usize = 292;

/// Q8_K activation block: (d, qs as raw bytes, bsums).
#[inline]
fn q8k_parts(xb: &[u8]) -> (f32, &[u8], [i32; 16]) {
    let mut bsums = [0i32; 16];
    for (g, s) in bsums.iter_mut().enumerate() {
        *s = i16::from_le_bytes([xb[260 + 2 * g], xb[261 + 2 * g]]) as i32;
    }
    (f32_at(xb, 0), &xb[4..260], bsums)
}

/// Σ_i u_i·x_i for unsigned quants `u` against i8 activations in raw bytes.
#[inline]
fn udot(u: &[u8], x: &[u8]) -> i32 {
    u.iter().zip(x).map(|(&p, &q)| p as i32 * q as i8 as i32).sum()
}

// ================================ Q4_K / Q5_K =================================

/// The 8 six-bit scales and mins of Q4_K/Q5_K (`get_scale_min_k4`).
fn scales_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, mn)
}

fn pack_scales_k4(sc: &[u8], mn: &[u8], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
    }
}

/// Q4_K quants: weight 64p+l = low nibble of qs[32p+l], weight 64p+32+l = high nibble.
fn unpack_q4k(qs: &[u8], q: &mut [u8; QK_K]) {
    for p in 0..4 {
        for l in 0..32 {
            let b = qs[32 * p + l];
            q[64 * p + l] = b & 0xF;
            q[64 * p + 32 + l] = b >> 4;
        }
    }
}

/// Q5_K quants: Q4_K nibbles plus bit 2p (resp. 2p+1) of qh[l] as bit 4.
fn unpack_q5k(qh: &[u8], qs: &[u8], q: &mut [u8; QK_K]) {
    unpack_q4k(qs, q);
    for p in 0..4 {
        for l in 0..32 {
            q[64 * p + l] |= ((qh[l] >> (2 * p)) & 1) << 4;
            q[64 * p + 32 + l] |= ((qh[l] >> (2 * p + 1)) & 1) << 4;
        }
    }
}

/// y = (d·sc_b)·q − dmin·mn_b over 8 sub-blocks of 32 (`dequantize_row_q4_K` order).
fn dequant_scale_min(d: f32, dmin: f32, sc: &[u8; 8], mn: &[u8; 8], q: &[u8; QK_K], y: &mut [f32]) {
    for b in 0..8 {
        let d1 = d * sc[b] as f32;
        let m1 = dmin * mn[b] as f32;
        for i in 32 * b..32 * b + 32 {
            y[i] = d1 * q[i] as f32 - m1;
        }
    }
}

pub(super) fn dequant_q4k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK_K];
    for (b, y) in src.chunks_exact(TS_Q4K).zip(dst.chunks_exact_mut(QK_K)) {
        let (sc, mn) = scales_k4(&b[4..16]);
        unpack_q4k(&b[16..144], &mut q);
        dequant_scale_min(f16_at(b, 0), f16_at(b, 2), &sc, &mn, &q, y);
    }
}

pub(super) fn dequant_q5k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK_K];
    for (b, y) in src.chunks_exact(TS_Q5K).zip(dst.chunks_exact_mut(QK_K)) {
        let (sc, mn) = scales_k4(&b[4..16]);
        unpack_q5k(&b[16..48], &b[48..176], &mut q);
        dequant_scale_min(f16_at(b, 0), f16_at(b, 2), &sc, &mn, &q, y);
    }
}

/// d·dx·Σ_b sc_b·Σ q·qx − dmin·dx·Σ_b mn_b·bsum_b for one Q4_K/Q5_K super-block.
fn dot_scale_min(d: f32, dmin: f32, sc: &[u8; 8], mn: &[u8; 8], q: &[u8; QK_K], xb: &[u8]) -> f32 {
    let (dx, xq, bsums) = q8k_parts(xb);
    let mut isum = 0i32;
    let mut msum = 0i32;
    for b in 0..8 {
        isum += sc[b] as i32 * udot(&q[32 * b..32 * b + 32], &xq[32 * b..32 * b + 32]);
        msum += mn[b] as i32 * (bsums[2 * b] + bsums[2 * b + 1]);
    }
    (d * dx) * isum as f32 - (dmin * dx) * msum as f32
}

pub(super) fn dot_q4k(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK_K];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q4K).zip(x.chunks_exact(TS_Q8K)) {
        let (sc, mn) = scales_k4(&wb[4..16]);
        unpack_q4k(&wb[16..144], &mut q);
        sum += dot_scale_min(f16_at(wb, 0), f16_at(wb, 2), &sc, &mn, &q, xb);
    }
    sum
}

pub(super) fn dot_q5k(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK_K];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q5K).zip(x.chunks_exact(TS_Q8K)) {
        let (sc, mn) = scales_k4(&wb[4..16]);
        unpack_q5k(&wb[16..48], &wb[48..176], &mut q);
        sum += dot_scale_min(f16_at(wb, 0), f16_at(wb, 2), &sc, &mn, &q, xb);
    }
    sum
}

/// Integer sub-block scales and mins of one super-block (the first `n_sub` are used).
struct ScaleMin {
    sc: [u8; 16],
    mn: [u8; 16],
}

/// Quantises one super-block with `n_sub` sub-blocks of `QK_K/n_sub` weights as
/// `x ≈ (d·sc_b)·q − dmin·mn_b`, `q ∈ [0, nmax]`, `sc_b, mn_b ∈ [0, smax]`.
/// Writes the quants to `q`; `store` stores (d, dmin) and returns the stored (f16) values.
fn quant_scale_min(
    x: &[f32],
    n_sub: usize,
    nmax: i32,
    smax: u8,
    q: &mut [u8; QK_K],
    store: impl FnOnce(f32, f32) -> (f32, f32),
) -> ScaleMin {
    let len = QK_K / n_sub;
    let (mut scale, mut min) = ([0f32; 16], [0f32; 16]);
    for b in 0..n_sub {
        (scale[b], min[b]) = fit_asym(&x[len * b..len * b + len], nmax);
    }
    let max_scale = scale[..n_sub].iter().fold(0f32, |a, &v| a.max(v));
    let max_min = min[..n_sub].iter().fold(0f32, |a, &v| a.max(v));
    let inv_scale = if max_scale > 0.0 { smax as f32 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { smax as f32 / max_min } else { 0.0 };
    let mut out = ScaleMin { sc: [0; 16], mn: [0; 16] };
    for b in 0..n_sub {
        out.sc[b] = (inv_scale * scale[b]).round().clamp(0.0, smax as f32) as u8;
        out.mn[b] = (inv_min * min[b]).round().clamp(0.0, smax as f32) as u8;
    }
    let (d, dmin) = store(max_scale / smax as f32, max_min / smax as f32);
    // Re-round every weight against the scales the dequantiser will actually use.
    for b in 0..n_sub {
        let s = d * out.sc[b] as f32;
        let m = dmin * out.mn[b] as f32;
        let is = if s > 0.0 { 1.0 / s } else { 0.0 };
        for i in len * b..len * b + len {
            q[i] = (((x[i] + m) * is).round() as i32).clamp(0, nmax) as u8;
        }
    }
    out
}

pub(super) fn quant_q4k(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q4K)) {
        let (head, qs) = b.split_at_mut(16);
        let s = quant_scale_min(x, 8, 15, 63, &mut q, |d, dmin| (put_f16(head, 0, d), put_f16(head, 2, dmin)));
        pack_scales_k4(&s.sc, &s.mn, &mut head[4..16]);
        for p in 0..4 {
            for l in 0..32 {
                qs[32 * p + l] = q[64 * p + l] | (q[64 * p + 32 + l] << 4);
            }
        }
    }
}

pub(super) fn quant_q5k(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q5K)) {
        let (head, rest) = b.split_at_mut(16);
        let (qh, qs) = rest.split_at_mut(32);
        let s = quant_scale_min(x, 8, 31, 63, &mut q, |d, dmin| (put_f16(head, 0, d), put_f16(head, 2, dmin)));
        pack_scales_k4(&s.sc, &s.mn, &mut head[4..16]);
        qh.fill(0);
        for p in 0..4 {
            for l in 0..32 {
                let (lo, hi) = (q[64 * p + l], q[64 * p + 32 + l]);
                qs[32 * p + l] = (lo & 0xF) | ((hi & 0xF) << 4);
                qh[l] |= ((lo >> 4) << (2 * p)) | ((hi >> 4) << (2 * p + 1));
            }
        }
    }
}

// =================================== Q6_K =====================================

/// Q6_K quants (0..63) in weight order; see the table in gguf-format.md §5.
fn unpack_q6k(ql: &[u8], qh: &[u8], q: &mut [u8; QK_K]) {
    for n in 0..2 {
        let (ql, qh, q) = (&ql[64 * n..], &qh[32 * n..], &mut q[128 * n..]);
        for l in 0..32 {
            q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

pub(super) fn dequant_q6k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK_K];
    for (b, y) in src.chunks_exact(TS_Q6K).zip(dst.chunks_exact_mut(QK_K)) {
        unpack_q6k(&b[0..128], &b[128..192], &mut q);
        let d = f16_at(b, 208);
        for g in 0..16 {
            let dl = d * (b[192 + g] as i8) as f32;
            for i in 16 * g..16 * g + 16 {
                y[i] = dl * (q[i] as i32 - 32) as f32;
            }
        }
    }
}

pub(super) fn dot_q6k(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK_K];
    let mut qs = [0i8; QK_K];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q6K).zip(x.chunks_exact(TS_Q8K)) {
        unpack_q6k(&wb[0..128], &wb[128..192], &mut q);
        for i in 0..QK_K {
            qs[i] = q[i] as i8 - 32;
        }
        let (dx, xq, _) = q8k_parts(xb);
        let mut isum = 0i32;
        for g in 0..16 {
            isum += (wb[192 + g] as i8) as i32 * idot(&qs[16 * g..16 * g + 16], &xq[16 * g..16 * g + 16]);
        }
        sum += (f16_at(wb, 208) * dx) * isum as f32;
    }
    sum
}

/// Symmetric super-block: 16 sub-blocks of 16, `x ≈ (d·sc_g)·q`, `q ∈ [qmin, qmax]`,
/// `sc_g ∈ [smin, smax]` (signed). The largest-magnitude sub-scale maps to `smin`.
/// Writes q − qmin (unsigned) to `q`; `store` stores d and returns the stored value.
fn quant_sym16(
    x: &[f32],
    (qmin, qmax): (i32, i32),
    (smin, smax): (i32, i32),
    q: &mut [u8; QK_K],
    store: impl FnOnce(f32) -> f32,
) -> [i8; 16] {
    let mut scale = [0f32; 16];
    for g in 0..16 {
        scale[g] = fit_sym(&x[16 * g..16 * g + 16], qmin, qmax);
    }
    let m = signed_absmax(&scale);
    let d_ideal = m / smin as f32;
    let inv = if d_ideal != 0.0 { 1.0 / d_ideal } else { 0.0 };
    let mut sc = [0i8; 16];
    for g in 0..16 {
        sc[g] = ((inv * scale[g]).round() as i32).clamp(smin, smax) as i8;
    }
    let d = store(d_ideal);
    for g in 0..16 {
        let s = d * sc[g] as f32;
        let is = if s != 0.0 { 1.0 / s } else { 0.0 };
        for i in 16 * g..16 * g + 16 {
            q[i] = (((x[i] * is).round() as i32).clamp(qmin, qmax) - qmin) as u8;
        }
    }
    sc
}

pub(super) fn quant_q6k(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q6K)) {
        let (ql, rest) = b.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        let (scales, d) = rest.split_at_mut(16);
        let sc = quant_sym16(x, (-32, 31), (-128, 127), &mut q, |v| put_f16(d, 0, v));
        for g in 0..16 {
            scales[g] = sc[g] as u8;
        }
        for n in 0..2 {
            let q = &q[128 * n..];
            for l in 0..32 {
                let (q1, q2, q3, q4) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
                ql[64 * n + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[64 * n + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[32 * n + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}

// =================================== Q3_K =====================================

/// The 16 signed six-bit scales of Q3_K.
fn scales_q3k(s: &[u8]) -> [i8; 16] {
    let mut sc = [0i8; 16];
    for i in 0..16 {
        let low4 = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (low4 | (high2 << 4)) as i8 - 32;
    }
    sc
}

fn pack_scales_q3k(sc: &[i8; 16], s: &mut [u8]) {
    s.fill(0);
    for i in 0..16 {
        let u = (sc[i] as i32 + 32) as u8 & 63;
        if i < 8 {
            s[i] |= u & 0xF;
        } else {
            s[i - 8] |= (u & 0xF) << 4;
        }
        s[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
    }
}

/// Q3_K quants as q + 4 ∈ [0, 7]: weight 128n+32j+l has 2 bits `(qs[32n+l] >> 2j) & 3` and
/// the high bit `(hmask[l] >> (4n+j)) & 1` (set ⇒ no −4 offset).
fn unpack_q3k(hmask: &[u8], qs: &[u8], q: &mut [u8; QK_K]) {
    for n in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                let lo = (qs[32 * n + l] >> (2 * j)) & 3;
                let hi = (hmask[l] >> (4 * n + j)) & 1;
                q[128 * n + 32 * j + l] = lo | (hi << 2);
            }
        }
    }
}

pub(super) fn dequant_q3k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK_K];
    for (b, y) in src.chunks_exact(TS_Q3K).zip(dst.chunks_exact_mut(QK_K)) {
        unpack_q3k(&b[0..32], &b[32..96], &mut q);
        let sc = scales_q3k(&b[96..108]);
        let d = f16_at(b, 108);
        for g in 0..16 {
            let dl = d * sc[g] as f32;
            for i in 16 * g..16 * g + 16 {
                y[i] = dl * (q[i] as i32 - 4) as f32;
            }
        }
    }
}

pub(super) fn dot_q3k(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK_K];
    let mut qs = [0i8; QK_K];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q3K).zip(x.chunks_exact(TS_Q8K)) {
        unpack_q3k(&wb[0..32], &wb[32..96], &mut q);
        for i in 0..QK_K {
            qs[i] = q[i] as i8 - 4;
        }
        let sc = scales_q3k(&wb[96..108]);
        let (dx, xq, _) = q8k_parts(xb);
        let mut isum = 0i32;
        for g in 0..16 {
            isum += sc[g] as i32 * idot(&qs[16 * g..16 * g + 16], &xq[16 * g..16 * g + 16]);
        }
        sum += (f16_at(wb, 108) * dx) * isum as f32;
    }
    sum
}

pub(super) fn quant_q3k(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q3K)) {
        let (hmask, rest) = b.split_at_mut(32);
        let (qs, rest) = rest.split_at_mut(64);
        let (scales, d) = rest.split_at_mut(12);
        let sc = quant_sym16(x, (-4, 3), (-32, 31), &mut q, |v| put_f16(d, 0, v));
        pack_scales_q3k(&sc, scales);
        hmask.fill(0);
        qs.fill(0);
        for n in 0..2 {
            for j in 0..4 {
                for l in 0..32 {
                    let u = q[128 * n + 32 * j + l];
                    qs[32 * n + l] |= (u & 3) << (2 * j);
                    hmask[l] |= (u >> 2) << (4 * n + j);
                }
            }
        }
    }
}

// =================================== Q2_K =====================================

/// Q2_K quants: weight 128n+32j+l = `(qs[32n+l] >> 2j) & 3`.
fn unpack_q2k(qs: &[u8], q: &mut [u8; QK_K]) {
    for n in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                q[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
            }
        }
    }
}

pub(super) fn dequant_q2k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK_K];
    for (b, y) in src.chunks_exact(TS_Q2K).zip(dst.chunks_exact_mut(QK_K)) {
        unpack_q2k(&b[16..80], &mut q);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for g in 0..16 {
            let dl = d * (b[g] & 0xF) as f32;
            let ml = dmin * (b[g] >> 4) as f32;
            for i in 16 * g..16 * g + 16 {
                y[i] = dl * q[i] as f32 - ml;
            }
        }
    }
}

pub(super) fn dot_q2k(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK_K];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q2K).zip(x.chunks_exact(TS_Q8K)) {
        unpack_q2k(&wb[16..80], &mut q);
        let (dx, xq, bsums) = q8k_parts(xb);
        let (mut isum, mut msum) = (0i32, 0i32);
        for g in 0..16 {
            isum += (wb[g] & 0xF) as i32 * udot(&q[16 * g..16 * g + 16], &xq[16 * g..16 * g + 16]);
            msum += (wb[g] >> 4) as i32 * bsums[g];
        }
        sum += (f16_at(wb, 80) * dx) * isum as f32 - (f16_at(wb, 82) * dx) * msum as f32;
    }
    sum
}

pub(super) fn quant_q2k(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q2K)) {
        let (scales, rest) = b.split_at_mut(16);
        let (qs, dd) = rest.split_at_mut(64);
        let s = quant_scale_min(x, 16, 3, 15, &mut q, |d, dmin| (put_f16(dd, 0, d), put_f16(dd, 2, dmin)));
        for g in 0..16 {
            scales[g] = s.sc[g] | (s.mn[g] << 4);
        }
        qs.fill(0);
        for n in 0..2 {
            for j in 0..4 {
                for l in 0..32 {
                    qs[32 * n + l] |= q[128 * n + 32 * j + l] << (2 * j);
                }
            }
        }
    }
}

// =================================== Q8_K =====================================

pub(super) fn dequant_q8k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(TS_Q8K).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32_at(b, 0);
        for i in 0..QK_K {
            y[i] = d * (b[4 + i] as i8) as f32;
        }
    }
}

/// Q8_K · Q8_K (not a ggml pair; provided so every type has a dot product).
pub(super) fn dot_q8k(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_Q8K).zip(x.chunks_exact(TS_Q8K)) {
        let isum: i32 = wb[4..260].iter().zip(&xb[4..260]).map(|(&a, &b)| a as i8 as i32 * b as i8 as i32).sum();
        sum += (f32_at(wb, 0) * f32_at(xb, 0)) * isum as f32;
    }
    sum
}

/// ggml's `nearest_int`: add 1.5·2^23 so the f32 adder rounds to an integer (half to even),
/// then read the integer back from the mantissa. Valid for |v| ≤ 2^22.
#[inline]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12582912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// `quantize_row_q8_K_ref`: max = the signed value of largest magnitude, iscale = −127/max,
/// q = min(127, nearest_int(iscale·x)), bsums per 16, d = 1/iscale (f32). An all-zero block
/// gets d = 0 and zero quants and bsums.
pub(super) fn quant_q8k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q8K)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        b.fill(0);
        if amax == 0.0 {
            continue;
        }
        let iscale = -127.0 / max;
        for g in 0..16 {
            let mut bsum = 0i32;
            for i in 16 * g..16 * g + 16 {
                // Normal inputs give |q| ≤ 127; the clamp only matters for Inf/NaN input.
                let q = nearest_int(iscale * x[i]).clamp(-128, 127);
                bsum += q;
                b[4 + i] = q as i8 as u8;
            }
            b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(bsum as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}
