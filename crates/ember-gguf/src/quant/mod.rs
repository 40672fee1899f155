//! ggml block formats: scalar reference dequantisation, quantisation and dot products.
//!
//! API contract (used by ember-cpu and ember-model; keep these signatures):
//! * [`dequantize`]: `src` holds a whole number of blocks of `t`; writes `dst.len()` weights.
//! * [`quantize`]: the reverse, for activation types (Q8_0, Q8_1, Q8_K) and weight types.
//! * [`vec_dot`]: dot product of one weight row of type `t` with an activation row already
//!   quantised to `t.vec_dot_type()`, with llama.cpp's integer block math (gguf-format.md §7.3).
//! * [`vec_dot_f32`]: dot product of one weight row with f32 activations (the "exact" path).
//!
//! Layouts and formulas: `shared/spec/gguf-format.md` §3-§5 (from ggml-quants.c). One file per
//! format family: [`float`] (F32/F16/BF16), [`legacy`] (32-weight blocks), [`k_quants`]
//! (256-weight super-blocks), [`iq4`] (non-linear 4-bit), [`fit`] (scale search for the weight
//! quantisers).
//!
//! Numerics of [`vec_dot`]: integer inner sums are exact; each block then adds
//! `(d_w·d_x)·isum` (K-quants: `(d·dx)·isum − (dmin·dx)·msum`) to one f32 accumulator. ggml's
//! generic K-quant code keeps 8 lane partial sums and its SIMD kernels other orders, so results
//! agree with llama.cpp to f32 rounding (a few ulps), not bit for bit (gguf-format.md §7.3).
//! F32/F16/BF16 rows sum f32 products in f64, as ggml's generic `ggml_vec_dot_*` do.
//!
//! The decision a reader may question: every dot product first unpacks a block's quants into a
//! small stack array and then runs one plain integer loop per (sub-)block. That costs a copy
//! but gives a single, obviously correct inner loop per activation type that the compiler
//! vectorises, and the integer sums are exact, so only the per-block float scaling rounds.

#![allow(clippy::needless_range_loop)] // block layouts are index arithmetic; indices read best

mod fit;
mod float;
mod iq4;
mod k_quants;
mod legacy;

use crate::{Error, GgmlType, Result};

pub use float::f32_to_bf16;

/// Dequantises `dst.len()` weights of type `t` from `src`.
///
/// Bit-exact with ggml's `dequantize_row_*` (same f32 operation order, no fused multiply-add).
pub fn dequantize(t: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len(t, src.len(), dst.len())?;
    use GgmlType::*;
    match t {
        F32 => float::dequant_f32(src, dst),
        F16 => float::dequant_f16(src, dst),
        BF16 => float::dequant_bf16(src, dst),
        Q4_0 => legacy::dequant_q4_0(src, dst),
        Q4_1 => legacy::dequant_q4_1(src, dst),
        Q5_0 => legacy::dequant_q5_0(src, dst),
        Q5_1 => legacy::dequant_q5_1(src, dst),
        Q8_0 => legacy::dequant_q8_0(src, dst),
        Q8_1 => legacy::dequant_q8_1(src, dst),
        Q2K => k_quants::dequant_q2k(src, dst),
        Q3K => k_quants::dequant_q3k(src, dst),
        Q4K => k_quants::dequant_q4k(src, dst),
        Q5K => k_quants::dequant_q5k(src, dst),
        Q6K => k_quants::dequant_q6k(src, dst),
        Q8K => k_quants::dequant_q8k(src, dst),
        IQ4NL => iq4::dequant_iq4nl(src, dst),
        IQ4XS => iq4::dequant_iq4xs(src, dst),
    }
    Ok(())
}

/// Quantises `src` (a whole number of blocks) into `dst` as type `t`.
///
/// * Activation types Q8_0, Q8_1, Q8_K: bit-exact ports of ggml's `quantize_row_*_ref`
///   (gguf-format.md §7.2). Q8_0 doubles as the Q8_0 weight quantiser.
/// * Q4_0, Q4_1, Q5_0, Q5_1: bit-exact ports of ggml's simple `quantize_row_*_ref`.
/// * F16 (round to nearest even), BF16 (ggml's rounding with NaN quieting, spec §3), F32.
/// * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS: ember's own least-squares scale search
///   (see [`fit`]); not bit-identical to llama-quantize, but round-trip error is pinned by
///   `tests/quant_roundtrip.rs`.
pub fn quantize(t: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_len(t, dst.len(), src.len())?;
    use GgmlType::*;
    match t {
        F32 => float::quant_f32(src, dst),
        F16 => float::quant_f16(src, dst),
        BF16 => float::quant_bf16(src, dst),
        Q4_0 => legacy::quant_q4_0(src, dst),
        Q4_1 => legacy::quant_q4_1(src, dst),
        Q5_0 => legacy::quant_q5_0(src, dst),
        Q5_1 => legacy::quant_q5_1(src, dst),
        Q8_0 => legacy::quant_q8_0(src, dst),
        Q8_1 => legacy::quant_q8_1(src, dst),
        Q2K => k_quants::quant_q2k(src, dst),
        Q3K => k_quants::quant_q3k(src, dst),
        Q4K => k_quants::quant_q4k(src, dst),
        Q5K => k_quants::quant_q5k(src, dst),
        Q6K => k_quants::quant_q6k(src, dst),
        Q8K => k_quants::quant_q8k(src, dst),
        IQ4NL => iq4::quant_iq4nl(src, dst),
        IQ4XS => iq4::quant_iq4xs(src, dst),
    }
    Ok(())
}

/// Dot product of `n` weights of type `t` (bytes `w`) with `n` activations quantised to
/// `t.vec_dot_type()` (bytes `x`).
///
/// Returns NaN if a length does not match `n` (the signature has no room for an error; use
/// [`try_vec_dot`] to get one). Never panics.
pub fn vec_dot(t: GgmlType, n: usize, w: &[u8], x: &[u8]) -> f32 {
    try_vec_dot(t, n, w, x).unwrap_or(f32::NAN)
}

/// [`vec_dot`] with length checking: `w` must be the row of `n` weights of type `t` and `x` the
/// row of `n` activations of type `t.vec_dot_type()`.
pub fn try_vec_dot(t: GgmlType, n: usize, w: &[u8], x: &[u8]) -> Result<f32> {
    check_len(t, w.len(), n)?;
    check_len(t.vec_dot_type(), x.len(), n)?;
    use GgmlType::*;
    Ok(match t {
        F32 => float::dot_f32(w, x),
        F16 => float::dot_f16(w, x),
        BF16 => float::dot_bf16(w, x),
        Q4_0 => legacy::dot_q4_0(w, x),
        Q4_1 => legacy::dot_q4_1(w, x),
        Q5_0 => legacy::dot_q5_0(w, x),
        Q5_1 => legacy::dot_q5_1(w, x),
        Q8_0 => legacy::dot_q8_0(w, x),
        Q8_1 => legacy::dot_q8_1(w, x),
        Q2K => k_quants::dot_q2k(w, x),
        Q3K => k_quants::dot_q3k(w, x),
        Q4K => k_quants::dot_q4k(w, x),
        Q5K => k_quants::dot_q5k(w, x),
        Q6K => k_quants::dot_q6k(w, x),
        Q8K => k_quants::dot_q8k(w, x),
        IQ4NL => iq4::dot_iq4nl(w, x),
        IQ4XS => iq4::dot_iq4xs(w, x),
    })
}

/// `Σ dequant(w)_i · x_i` over a row of `n` weights of type `t`, in f32, dequantising one chunk
/// of at most 256 weights at a time into a stack buffer (no allocation).
///
/// Returns NaN on a length mismatch; see [`try_vec_dot_f32`].
pub fn vec_dot_f32(t: GgmlType, n: usize, w: &[u8], x: &[f32]) -> f32 {
    try_vec_dot_f32(t, n, w, x).unwrap_or(f32::NAN)
}

/// [`vec_dot_f32`] with length checking.
pub fn try_vec_dot_f32(t: GgmlType, n: usize, w: &[u8], x: &[f32]) -> Result<f32> {
    check_len(t, w.len(), n)?;
    if x.len() != n {
        return Err(Error::Quant(format!("vec_dot_f32 {t}: {n} weights but {} activations", x.len())));
    }
    // 256 is a multiple of every block size, so chunks hold whole blocks; the last one may be
    // shorter (e.g. 3 blocks of 32) but is still whole blocks because n is.
    const CHUNK: usize = 256;
    let bytes_chunk = CHUNK / t.block_size() * t.type_size();
    let mut buf = [0f32; CHUNK];
    let mut sum = 0f32;
    for (wc, xc) in w.chunks(bytes_chunk).zip(x.chunks(CHUNK)) {
        let y = &mut buf[..xc.len()];
        dequantize(t, wc, y)?;
        // Eight lanes: shorter dependency chains and a smaller rounding error than one sum.
        let mut acc = [0f32; 8];
        let mut yi = y.chunks_exact(8);
        let mut xi = xc.chunks_exact(8);
        for (a, b) in (&mut yi).zip(&mut xi) {
            for l in 0..8 {
                acc[l] += a[l] * b[l];
            }
        }
        let mut part: f32 = yi.remainder().iter().zip(xi.remainder()).map(|(a, b)| a * b).sum();
        part += acc.iter().sum::<f32>();
        sum += part;
    }
    Ok(sum)
}

fn check_len(t: GgmlType, n_bytes: usize, n_values: usize) -> Result<()> {
    match t.row_bytes(n_values) {
        Some(b) if b == n_bytes => Ok(()),
        _ => Err(Error::Quant(format!(
            "{t}: {n_values} values need {} bytes in blocks of {}, got {n_bytes}",
            t.row_bytes(n_values).map_or("a multiple of the block size".to_string(), |b| b.to_string()),
            t.block_size()
        ))),
    }
}

/// The f16 at byte `off` of a block, as f32 (exact).
#[inline]
fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// Stores `v` as f16 (round to nearest even) at byte `off`; returns the stored value as f32,
/// which is what a dequantiser will see.
#[inline]
fn put_f16(b: &mut [u8], off: usize, v: f32) -> f32 {
    let h = half::f16::from_f32(v);
    b[off..off + 2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

#[inline]
fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Σ a_i·b_i over two equally long runs of quants; `b` holds i8 activations as raw bytes.
#[inline]
fn idot(a: &[i8], b: &[u8]) -> i32 {
    a.iter().zip(b).map(|(&p, &q)| p as i32 * q as i8 as i32).sum()
}
