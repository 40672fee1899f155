//! ggml block formats: scalar reference dequantisation, quantisation and dot products.
//!
//! API contract (used by ember-cpu and ember-model; keep these signatures):
//! * [`dequantize`]: `src` holds a whole number of blocks of `t`; writes `dst.len()` weights.
//! * [`quantize`]: the reverse, for activation types (Q8_0, Q8_1, Q8_K) and weight types.
//! * [`vec_dot`]: dot product of one weight row of type `t` with an activation row already
//!   quantised to `t.vec_dot_type()`, exactly as llama.cpp's generic CPU code computes it.

use crate::{Error, GgmlType, Result};

/// Dequantises `dst.len()` weights of type `t` from `src`.
pub fn dequantize(t: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len(t, src.len(), dst.len())?;
    match t {
        GgmlType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        GgmlType::F16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
            }
        }
        _ => return Err(Error::Quant(format!("dequantize: {t} not implemented yet"))),
    }
    Ok(())
}

/// Quantises `src` (a whole number of blocks) into `dst` as type `t`.
pub fn quantize(t: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_len(t, dst.len(), src.len())?;
    Err(Error::Quant(format!("quantize: {t} not implemented yet")))
}

/// Dot product of `n` weights of type `t` (bytes `w`) with `n` activations quantised to
/// `t.vec_dot_type()` (bytes `x`).
pub fn vec_dot(t: GgmlType, n: usize, w: &[u8], x: &[u8]) -> f32 {
    let _ = (t, n, w, x);
    f32::NAN
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
