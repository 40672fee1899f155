//! F32, F16 and BF16 rows (gguf-format.md §3).
//!
//! The dot products follow ggml's generic `ggml_vec_dot_{f32,f16,bf16}`: each product is
//! formed in f32 (exact for f16·f16 and bf16·bf16) and summed in f64.

use super::{f16_at, f32_at};

pub(super) fn dequant_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32_at(s, 0);
    }
}

pub(super) fn dequant_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_at(s, 0);
    }
}

#[inline]
fn bf16_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits((u16::from_le_bytes([lo, hi]) as u32) << 16)
}

pub(super) fn dequant_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(s[0], s[1]);
    }
}

pub(super) fn quant_f32(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(super) fn quant_f16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&half::f16::from_f32(*s).to_le_bytes());
    }
}

/// f32 → bf16 as ggml-impl.h `ggml_compute_fp32_to_bf16`: NaN keeps its sign and top payload
/// bits and is forced quiet; everything else rounds to nearest even (overflow gives ±Inf).
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    // No overflow: the largest finite input 0x7f7fffff + 0x8000 stays below 2^32.
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

pub(super) fn quant_bf16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*s).to_le_bytes());
    }
}

pub(super) fn dot_f32(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(4).zip(x.chunks_exact(4)) {
        sum += (f32_at(a, 0) * f32_at(b, 0)) as f64;
    }
    sum as f32
}

pub(super) fn dot_f16(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        sum += (f16_at(a, 0) * f16_at(b, 0)) as f64;
    }
    sum as f32
}

pub(super) fn dot_bf16(w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        sum += (bf16_to_f32(a[0], a[1]) * bf16_to_f32(b[0], b[1])) as f64;
    }
    sum as f32
}
