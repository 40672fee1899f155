//! One-pass block quantisers for the two K-quant types the Q4_K_M recipes write in bulk.
//!
//! ember-gguf's weight quantisers search ~20 candidate scales per sub-block, which is right for
//! real weights but makes a 20 GiB synthetic file take half an hour on a few cores. Random
//! weights gain nothing from the search, so these take the plain min/max (Q4_K) and absmax
//! (Q6_K) scales: one pass to find them, one to round. The block layouts are ggml's
//! (gguf-format.md §5) and are checked by dequantising with ember-gguf in the tests.

use half::f16;

const QK_K: usize = 256;
pub const TS_Q4K: usize = 144;
pub const TS_Q6K: usize = 210;

fn put_f16(out: &mut [u8], v: f32) -> f32 {
    let h = f16::from_f32(v);
    out[..2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// Q4_K: `x ≈ d·sc_b·q − dmin·mn_b`, q ∈ [0, 15], 6-bit sc/mn per 32 weights.
pub fn quant_q4k(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK_K * TS_Q4K, dst.len());
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q4K)) {
        let (mut scale, mut min) = ([0f32; 8], [0f32; 8]);
        for s in 0..8 {
            let xs = &x[32 * s..32 * s + 32];
            let (mut lo, mut hi) = (0f32, f32::NEG_INFINITY);
            for &v in xs {
                lo = lo.min(v);
                hi = hi.max(v);
            }
            scale[s] = ((hi - lo) / 15.0).max(0.0);
            min[s] = -lo;
        }
        let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
        let max_min = min.iter().fold(0f32, |a, &v| a.max(v));
        let (head, qs) = b.split_at_mut(16);
        let d = put_f16(&mut head[0..2], max_scale / 63.0);
        let dmin = put_f16(&mut head[2..4], max_min / 63.0);
        let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
        for s in 0..8 {
            // Round the scale up so the largest weight of the sub-block still fits in 15 steps.
            sc[s] = if d > 0.0 { (scale[s] / d).ceil().clamp(0.0, 63.0) as u8 } else { 0 };
            mn[s] = if dmin > 0.0 { (min[s] / dmin).round().clamp(0.0, 63.0) as u8 } else { 0 };
            let step = d * sc[s] as f32;
            let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
            let m = dmin * mn[s] as f32;
            for i in 32 * s..32 * s + 32 {
                q[i] = ((x[i] + m) * inv).round().clamp(0.0, 15.0) as u8;
            }
        }
        pack_scales_k4(&sc, &mn, &mut head[4..16]);
        for p in 0..4 {
            for l in 0..32 {
                qs[32 * p + l] = q[64 * p + l] | (q[64 * p + 32 + l] << 4);
            }
        }
    }
}

/// ggml's 12-byte packing of eight 6-bit scales and mins (`get_scale_min_k4` reversed).
fn pack_scales_k4(sc: &[u8; 8], mn: &[u8; 8], s: &mut [u8]) {
    s.fill(0);
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = mn[j];
        } else {
            s[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
    }
}

/// Q6_K: `x ≈ d·sc_g·(q − 32)`, q − 32 ∈ [−32, 31], signed 8-bit sc per 16 weights.
pub fn quant_q6k(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK_K * TS_Q6K, dst.len());
    let mut q = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(TS_Q6K)) {
        let mut scale = [0f32; 16];
        for g in 0..16 {
            let amax = x[16 * g..16 * g + 16].iter().fold(0f32, |a, &v| a.max(v.abs()));
            scale[g] = amax / 31.0;
        }
        let max_scale = scale.iter().fold(0f32, |a, &v| a.max(v));
        let (ql, rest) = b.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        let (scales, dd) = rest.split_at_mut(16);
        let d = put_f16(dd, max_scale / 127.0);
        for g in 0..16 {
            let sc = if d > 0.0 { (scale[g] / d).ceil().clamp(0.0, 127.0) as i8 } else { 0 };
            scales[g] = sc as u8;
            let step = d * sc as f32;
            let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
            for i in 16 * g..16 * g + 16 {
                q[i] = ((x[i] * inv).round().clamp(-32.0, 31.0) as i32 + 32) as u8;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use ember_gguf::GgmlType;
    use ember_gguf::quant;

    fn nmse(t: GgmlType, x: &[f32], bytes: &[u8]) -> f64 {
        let mut y = vec![0f32; x.len()];
        quant::dequantize(t, bytes, &mut y).unwrap();
        let num: f64 = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
        num / den
    }

    /// The layouts are right if ember-gguf's dequantiser reads back what we meant, with an error
    /// close to ember-gguf's own (searching) quantiser on the same normal weights.
    #[test]
    fn round_trip_close_to_the_reference_quantiser() {
        let mut x = vec![0f32; 256 * 64];
        Rng::new(1).fill_normal(&mut x, 0.02);
        x[5] = 0.3; // an outlier
        for (t, f) in [(GgmlType::Q4K, quant_q4k as fn(&[f32], &mut [u8])), (GgmlType::Q6K, quant_q6k)] {
            let n = x.len() / 256 * t.type_size();
            let (mut fast, mut slow) = (vec![0u8; n], vec![0u8; n]);
            f(&x, &mut fast);
            quant::quantize(t, &x, &mut slow).unwrap();
            let (e_fast, e_slow) = (nmse(t, &x, &fast), nmse(t, &x, &slow));
            eprintln!("{t}: nmse fast {e_fast:.3e}, reference {e_slow:.3e}");
            let bound = if t == GgmlType::Q4K { 1.2e-2 } else { 8e-4 };
            assert!(e_fast < bound, "{t}: nmse {e_fast}");
            assert!(e_fast < 2.5 * e_slow, "{t}: {e_fast} vs {e_slow}");
        }
    }

    #[test]
    fn zeros_stay_zero() {
        let x = vec![0f32; 256];
        for (t, f) in [(GgmlType::Q4K, quant_q4k as fn(&[f32], &mut [u8])), (GgmlType::Q6K, quant_q6k)] {
            let mut b = vec![0u8; t.type_size()];
            f(&x, &mut b);
            assert_eq!(nmse(t, &[1.0; 256], &b), 1.0); // dequantises to exactly 0
        }
    }
}
