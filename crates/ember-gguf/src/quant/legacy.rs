//! 32-weight block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 (gguf-format.md §4).
//!
//! Quantisers are the simple ggml reference ones (`quantize_row_*_ref` in ggml-quants.c),
//! so the bytes match gguf-py and llama.cpp exactly; they compute the quants with the f32
//! scale although the block stores it as f16.

use super::fit::signed_absmax;
use super::{f16_at, idot, put_f16};

const QK: usize = 32;
const TS_Q4_0: usize = 18;
const TS_Q4_1: usize = 20;
const TS_Q5_0: usize = 22;
const TS_Q5_1: usize = 24;
const TS_Q8_0: usize = 34;
const TS_Q8_1: usize = 36;

// ---- unpacking: one block → its 32 integer quants (offset already applied) ----

/// 4-bit quants: low nibble = weight j, high nibble = weight j+16.
#[inline]
fn nibbles(qs: &[u8], q: &mut [u8; QK]) {
    for j in 0..16 {
        q[j] = qs[j] & 0xF;
        q[j + 16] = qs[j] >> 4;
    }
}

/// 5-bit quants: nibbles plus bit j of the little-endian u32 `qh` as bit 4 of weight j.
#[inline]
fn nibbles5(qh: &[u8], qs: &[u8], q: &mut [u8; QK]) {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    nibbles(qs, q);
    for j in 0..QK {
        q[j] |= (((h >> j) & 1) as u8) << 4;
    }
}

fn unpack_q4_0(b: &[u8], q: &mut [i8; QK]) -> f32 {
    let mut u = [0u8; QK];
    nibbles(&b[2..18], &mut u);
    for j in 0..QK {
        q[j] = u[j] as i8 - 8;
    }
    f16_at(b, 0)
}

fn unpack_q5_0(b: &[u8], q: &mut [i8; QK]) -> f32 {
    let mut u = [0u8; QK];
    nibbles5(&b[2..6], &b[6..22], &mut u);
    for j in 0..QK {
        q[j] = u[j] as i8 - 16;
    }
    f16_at(b, 0)
}

/// Returns (d, m).
fn unpack_q4_1(b: &[u8], q: &mut [i8; QK]) -> (f32, f32) {
    let mut u = [0u8; QK];
    nibbles(&b[4..20], &mut u);
    for j in 0..QK {
        q[j] = u[j] as i8;
    }
    (f16_at(b, 0), f16_at(b, 2))
}

fn unpack_q5_1(b: &[u8], q: &mut [i8; QK]) -> (f32, f32) {
    let mut u = [0u8; QK];
    nibbles5(&b[4..8], &b[8..24], &mut u);
    for j in 0..QK {
        q[j] = u[j] as i8;
    }
    (f16_at(b, 0), f16_at(b, 2))
}

fn unpack_q8(qs: &[u8], q: &mut [i8; QK]) {
    for j in 0..QK {
        q[j] = qs[j] as i8;
    }
}

// ---- dequantisation: y = q·d (+ m) ----

fn dequant_sym(src: &[u8], dst: &mut [f32], ts: usize, unpack: impl Fn(&[u8], &mut [i8; QK]) -> f32) {
    let mut q = [0i8; QK];
    for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(QK)) {
        let d = unpack(b, &mut q);
        for j in 0..QK {
            y[j] = q[j] as f32 * d;
        }
    }
}

fn dequant_min(src: &[u8], dst: &mut [f32], ts: usize, unpack: impl Fn(&[u8], &mut [i8; QK]) -> (f32, f32)) {
    let mut q = [0i8; QK];
    for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = unpack(b, &mut q);
        for j in 0..QK {
            y[j] = q[j] as f32 * d + m;
        }
    }
}

pub(super) fn dequant_q4_0(src: &[u8], dst: &mut [f32]) {
    dequant_sym(src, dst, TS_Q4_0, unpack_q4_0);
}

pub(super) fn dequant_q5_0(src: &[u8], dst: &mut [f32]) {
    dequant_sym(src, dst, TS_Q5_0, unpack_q5_0);
}

pub(super) fn dequant_q8_0(src: &[u8], dst: &mut [f32]) {
    dequant_sym(src, dst, TS_Q8_0, |b, q| {
        unpack_q8(&b[2..34], q);
        f16_at(b, 0)
    });
}

pub(super) fn dequant_q8_1(src: &[u8], dst: &mut [f32]) {
    dequant_sym(src, dst, TS_Q8_1, |b, q| {
        unpack_q8(&b[4..36], q);
        f16_at(b, 0)
    });
}

pub(super) fn dequant_q4_1(src: &[u8], dst: &mut [f32]) {
    dequant_min(src, dst, TS_Q4_1, unpack_q4_1);
}

pub(super) fn dequant_q5_1(src: &[u8], dst: &mut [f32]) {
    dequant_min(src, dst, TS_Q5_1, unpack_q5_1);
}

// ---- dot products with Q8_0 / Q8_1 activations (gguf-format.md §7.3) ----

/// Σ_blocks d_w·d_x·Σ_j qw_j·qx_j against Q8_0 activations.
fn dot_with_q8_0(w: &[u8], x: &[u8], ts: usize, unpack: impl Fn(&[u8], &mut [i8; QK]) -> f32) -> f32 {
    let mut q = [0i8; QK];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(ts).zip(x.chunks_exact(TS_Q8_0)) {
        let dw = unpack(wb, &mut q);
        sum += idot(&q, &xb[2..34]) as f32 * (dw * f16_at(xb, 0));
    }
    sum
}

/// Σ_blocks (d_w·d_x·Σ qw·qx + m_w·s_x) against Q8_1 activations; `s_x = d_x·Σ qx`.
fn dot_with_q8_1(w: &[u8], x: &[u8], ts: usize, unpack: impl Fn(&[u8], &mut [i8; QK]) -> (f32, f32)) -> f32 {
    let mut q = [0i8; QK];
    let mut sum = 0f32;
    for (wb, xb) in w.chunks_exact(ts).zip(x.chunks_exact(TS_Q8_1)) {
        let (dw, mw) = unpack(wb, &mut q);
        sum += idot(&q, &xb[4..36]) as f32 * (dw * f16_at(xb, 0)) + mw * f16_at(xb, 2);
    }
    sum
}

pub(super) fn dot_q4_0(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_0(w, x, TS_Q4_0, unpack_q4_0)
}

pub(super) fn dot_q5_0(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_0(w, x, TS_Q5_0, unpack_q5_0)
}

pub(super) fn dot_q8_0(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_0(w, x, TS_Q8_0, |b, q| {
        unpack_q8(&b[2..34], q);
        f16_at(b, 0)
    })
}

pub(super) fn dot_q4_1(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_1(w, x, TS_Q4_1, unpack_q4_1)
}

pub(super) fn dot_q5_1(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_1(w, x, TS_Q5_1, unpack_q5_1)
}

/// Q8_1 · Q8_1 (not a ggml pair; provided so every type has a dot product): Σ d·d·Σ q·q.
pub(super) fn dot_q8_1(w: &[u8], x: &[u8]) -> f32 {
    dot_with_q8_1(w, x, TS_Q8_1, |b, q| {
        unpack_q8(&b[4..36], q);
        (f16_at(b, 0), 0.0)
    })
}

// ---- quantisation ----

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline]
fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// Packs 32 quants of ≤ 5 bits: nibbles into `qs`, bit 4 into the u32 `qh` (if given).
fn pack(q: &[u8; QK], qh: Option<&mut [u8]>, qs: &mut [u8]) {
    let mut h = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
    }
    for j in 0..QK {
        h |= ((q[j] as u32 >> 4) & 1) << j;
    }
    if let Some(qh) = qh {
        qh.copy_from_slice(&h.to_le_bytes());
    }
}

/// Symmetric 2^bits-level block: d = max/−2^(bits−1), q = min(qmax, trunc(x/d + 2^(bits−1) + 0.5)).
fn quant_sym(src: &[f32], dst: &mut [u8], ts: usize, bits: u32) {
    let half = (1u32 << (bits - 1)) as f32;
    let qmax = (1i32 << bits) - 1;
    let mut q = [0u8; QK];
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(ts)) {
        let d = signed_absmax(x) / -half;
        let id = inverse(d);
        for j in 0..QK {
            // `as i8` truncates toward zero like C's (int8_t) cast; the argument is in [0.5, 2·half+0.5].
            q[j] = ((x[j] * id + half + 0.5) as i8 as i32).clamp(0, qmax) as u8;
        }
        put_f16(b, 0, d);
        if bits == 5 {
            let (qh, qs) = b[2..].split_at_mut(4);
            pack(&q, Some(qh), qs);
        } else {
            pack(&q, None, &mut b[2..]);
        }
    }
}

/// Block with minimum: d = (max−min)/qmax, q = min(qmax, trunc((x−min)/d + 0.5)), m = min.
fn quant_min(src: &[f32], dst: &mut [u8], ts: usize, bits: u32) {
    let qmax = (1i32 << bits) - 1;
    let mut q = [0u8; QK];
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(ts)) {
        let (min, max) = min_max(x);
        let d = (max - min) / qmax as f32;
        let id = inverse(d);
        for j in 0..QK {
            q[j] = ((((x[j] - min) * id) + 0.5) as i8 as i32).clamp(0, qmax) as u8;
        }
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        if bits == 5 {
            let (qh, qs) = b[4..].split_at_mut(4);
            pack(&q, Some(qh), qs);
        } else {
            pack(&q, None, &mut b[4..]);
        }
    }
}

pub(super) fn quant_q4_0(src: &[f32], dst: &mut [u8]) {
    quant_sym(src, dst, TS_Q4_0, 4);
}

pub(super) fn quant_q5_0(src: &[f32], dst: &mut [u8]) {
    quant_sym(src, dst, TS_Q5_0, 5);
}

pub(super) fn quant_q4_1(src: &[f32], dst: &mut [u8]) {
    quant_min(src, dst, TS_Q4_1, 4);
}

pub(super) fn quant_q5_1(src: &[f32], dst: &mut [u8]) {
    quant_min(src, dst, TS_Q5_1, 5);
}

/// One Q8 block as `quantize_row_q8_0_ref`: d = amax/127, q = roundf(x/d) (half away from
/// zero, which is what `f32::round` does). Returns (f32 d, Σ q).
fn q8_block(x: &[f32], qs: &mut [u8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id).round() as i8; // |v·id| ≤ 127 (+1 ulp), `as` saturates anyway
        sum += r as i32;
        *q = r as u8;
    }
    (d, sum)
}

pub(super) fn quant_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(TS_Q8_0)) {
        let (d, _) = q8_block(x, &mut b[2..34]);
        put_f16(b, 0, d);
    }
}

/// `quantize_row_q8_1_ref`: Q8_0's d and q, plus s = f16(d·Σq) with the f32 d.
pub(super) fn quant_q8_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(TS_Q8_1)) {
        let (d, sum) = q8_block(x, &mut b[4..36]);
        put_f16(b, 0, d);
        put_f16(b, 2, sum as f32 * d);
    }
}
