//! Non-linear 4-bit formats IQ4_NL (32-weight blocks) and IQ4_XS (256-weight super-blocks)
//! (gguf-format.md §4, §5). Each nibble indexes the table `KVALUES`; dot products use the
//! table value as the integer weight, so the inner sums stay exact.

use super::fit::{fit_table, nearest_index, signed_absmax};
use super::{f16_at, f32_at, idot, put_f16};

/// ggml-common.h `kvalues_iq4nl`.
pub(crate) const KVALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

const QK: usize = 32;
const QK_K: usize = 256;
const TS_IQ4NL: usize = 18;
const TS_IQ4XS: usize = 136;
const TS_Q8_0: usize = 34;
const TS_Q8K: usize = 292;
/// Index of the table entry closest to zero (value 1): what an all-zero block stores.
const ZERO_INDEX: u8 = 8;

/// 32 weights from 16 bytes: low nibble = weight j, high nibble = weight j+16.
#[inline]
fn unpack32(qs: &[u8], q: &mut [i8]) {
    for j in 0..16 {
        q[j] = KVALUES[(qs[j] & 0xF) as usize];
        q[j + 16] = KVALUES[(qs[j] >> 4) as usize];
    }
}

#[inline]
fn pack32(idx: &[u8], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = idx[j] | (idx[j + 16] << 4);
    }
}

/// The 8 six-bit IQ4_XS sub-block scales, minus 32.
fn scales_iq4xs(b: &[u8]) -> [i32; 8] {
    let h = u16::from_le_bytes([b[2], b[3]]);
    let mut ls = [0i32; 8];
    for (i, l) in ls.iter_mut().enumerate() {
        let low = (b[4 + i / 2] >> (4 * (i % 2))) & 0xF;
        let high = ((h >> (2 * i)) & 3) as u8;
        *l = (low | (high << 4)) as i32 - 32;
    }
    ls
}

pub(super) fn dequant_iq4nl(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK];
    for (b, y) in src.chunks_exact(TS_IQ4NL).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        unpack32(&b[2..18], &mut q);
        for j in 0..QK {
            y[j] = d * q[j] as f32;
        }
    }
}

pub(super) fn dequant_iq4xs(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK];
    for (b, y) in src.chunks_exact(TS_IQ4XS).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let ls = scales_iq4xs(b);
        for s in 0..8 {
            let dl = d * ls[s] as f32;
            unpack32(&b[8 + 16 * s..24 + 16 * s], &mut q);
            for j in 0..QK {
                y[32 * s + j] = dl * q[j] as f32;
            }
        }
    }
}

/// IQ4_NL · Q8_0: Σ_blocks d_w·d_x·Σ K[q]·qx.
pub(super) fn dot_iq4nl(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0i8; QK];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_IQ4NL).zip(x.chunks_exact(TS_Q8_0)) {
        unpack32(&wb[2..18], &mut q);
        sum += idot(&q, &xb[2..34]) as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    sum
}

/// IQ4_XS · Q8_K: Σ_superblocks d_w·d_x·Σ_s (ls_s − 32)·Σ K[q]·qx.
pub(super) fn dot_iq4xs(w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0i8; QK];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(TS_IQ4XS).zip(x.chunks_exact(TS_Q8K)) {
        let ls = scales_iq4xs(wb);
        let mut isum = 0i32;
        for s in 0..8 {
            unpack32(&wb[8 + 16 * s..24 + 16 * s], &mut q);
            isum += ls[s] * idot(&q, &xb[4 + 32 * s..36 + 32 * s]);
        }
        sum += (f16_at(wb, 0) * f32_at(xb, 0)) * isum as f32;
    }
    sum
}

/// Nearest-table-entry indices of `x / d` (`d` = the scale the dequantiser will use).
fn indices(x: &[f32], d: f32, idx: &mut [u8]) {
    if d == 0.0 {
        idx.fill(ZERO_INDEX);
        return;
    }
    let id = 1.0 / d;
    for (i, &v) in idx.iter_mut().zip(x) {
        *i = nearest_index(&KVALUES, v * id) as u8;
    }
}

/// One scale per 32 weights, found by [`fit_table`], stored as f16.
pub(super) fn quant_iq4nl(src: &[f32], dst: &mut [u8]) {
    let mut idx = [0u8; QK];
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(TS_IQ4NL)) {
        let d = put_f16(b, 0, fit_table(x, &KVALUES));
        indices(x, d, &mut idx);
        pack32(&idx, &mut b[2..18]);
    }
}

/// Sub-block scales from [`fit_table`], quantised to six signed bits (−32..31) against an f16
/// super-scale chosen so the largest-magnitude sub-scale lands on −32.
pub(super) fn quant_iq4xs(src: &[f32], dst: &mut [u8]) {
    let mut idx = [0u8; QK];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_IQ4XS)) {
        let mut scale = [0f32; 8];
        for s in 0..8 {
            scale[s] = fit_table(&x[32 * s..32 * s + 32], &KVALUES);
        }
        let m = signed_absmax(&scale);
        let d = put_f16(b, 0, m / -32.0);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut h, mut l) = (0u16, [0u8; 4]);
        for s in 0..8 {
            let ls = (((scale[s] * id).round() as i32).clamp(-32, 31) + 32) as u8;
            l[s / 2] |= (ls & 0xF) << (4 * (s % 2));
            h |= ((ls >> 4) as u16) << (2 * s);
            indices(&x[32 * s..32 * s + 32], d * (ls as i32 - 32) as f32, &mut idx);
            pack32(&idx, &mut b[8 + 16 * s..24 + 16 * s]);
        }
        b[2..4].copy_from_slice(&h.to_le_bytes());
        b[4..8].copy_from_slice(&l);
    }
}
