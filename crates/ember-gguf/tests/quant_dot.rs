//! `vec_dot` and `vec_dot_f32` against an f64 reference.
//!
//! `vec_dot(w, x)` is checked against `Σ_i (f64) dequant(w)_i · (f64) dequant(x)_i`: the same
//! math, so the only differences are f32 roundings (block scale products, per-block float
//! accumulation, and the dequantiser's own rounding of `d·sc·q − dmin·mn`). The error is
//! measured relative to `Σ_i |w_i·x_i|` (a cancellation-free scale; the dot itself can be ~0)
//! and must stay ≤ 1e-5. Measured maximum (printed with `-- --nocapture`): 7.8e-8 over all
//! types and lengths (F32 7.8e-8, Q4_K 5.2e-8, Q6_K 2.6e-8, Q8_0 4.2e-8), i.e. a few f32 ulps.
//! Q4_1/Q5_1 use the Q8_1 block's stored f16 `s` for the offset term; the reference does too
//! (see `q8_1_s_correction`), otherwise the f16 rounding of `s` alone gives ~1e-4.
//!
//! Weights are random bytes with random finite scales (every bit pattern of the quants) and,
//! separately, real quantisations of Gaussian data; activations are Gaussian data quantised
//! to `t.vec_dot_type()` with ember's quantiser.

use ember_gguf::GgmlType;
use ember_gguf::quant::{dequantize, quantize, vec_dot, vec_dot_f32};

mod common;
use common::Rng;

/// Byte offsets of the f16 scale fields inside one block.
fn f16_fields(t: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match t {
        Q4_0 | Q5_0 | Q8_0 | IQ4NL | IQ4XS => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
        F32 | F16 | BF16 | Q8K => &[],
    }
}

/// A row of `n` weights of type `t` with random quants and finite random scales.
fn random_row(rng: &mut Rng, t: GgmlType, n: usize) -> Vec<u8> {
    match t {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let mut b = vec![0u8; t.row_bytes(n).unwrap()];
            quantize(t, &x, &mut b).unwrap();
            return b;
        }
        _ => {}
    }
    let mut b: Vec<u8> = (0..t.row_bytes(n).unwrap()).map(|_| rng.next() as u8).collect();
    for blk in b.chunks_mut(t.type_size()) {
        for &off in f16_fields(t) {
            let v = half::f16::from_f32(rng.scale(-12.0, -4.0));
            blk[off..off + 2].copy_from_slice(&v.to_le_bytes());
        }
        if t == GgmlType::Q8K {
            blk[0..4].copy_from_slice(&rng.scale(-10.0, -5.0).to_le_bytes());
        }
    }
    b
}

fn deq(t: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize(t, b, &mut y).unwrap();
    y
}

const ALL: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
];

fn lengths(t: GgmlType) -> &'static [usize] {
    match t.block_size() {
        1 => &[1, 7, 33, 300, 2048],
        32 => &[32, 96, 160, 2080, 4096],
        _ => &[256, 768, 2048, 4096],
    }
}

/// Q4_1/Q5_1 · Q8_1 use the activation block's stored `s = f16(d·Σq)` for the offset term
/// `m_w·s_x` (gguf-format.md §7.3), and `s` is rounded to f16, so it is not exactly
/// `Σ dequant(x)`. This is part of the format's math, not an error of ours: add
/// `Σ_b m_b·(s_b − d_b·Σ q_b)` to the reference so that it computes the same thing.
fn q8_1_s_correction(t: GgmlType, w: &[u8], x: &[u8]) -> f64 {
    let f16 = |b: &[u8], o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32() as f64;
    w.chunks(t.type_size())
        .zip(x.chunks(36))
        .map(|(wb, xb)| {
            let sum_q: f64 = xb[4..36].iter().map(|&q| q as i8 as f64).sum();
            f16(wb, 2) * (f16(xb, 2) - f16(xb, 0) * sum_q)
        })
        .sum()
}

/// Returns the largest error relative to Σ|w·x| over `n_trials` random rows per length.
fn max_rel_err(t: GgmlType, n_trials: usize, real_weights: bool) -> f64 {
    let mut rng = Rng(t.id() as u64 * 1000 + real_weights as u64);
    let xt = t.vec_dot_type();
    let mut worst = 0f64;
    for &n in lengths(t) {
        for _ in 0..n_trials {
            let w = if real_weights {
                let v: Vec<f32> = (0..n).map(|_| rng.normal() * 0.02).collect();
                let mut b = vec![0u8; t.row_bytes(n).unwrap()];
                quantize(t, &v, &mut b).unwrap();
                b
            } else {
                random_row(&mut rng, t, n)
            };
            let xf: Vec<f32> = (0..n).map(|_| rng.normal() * rng.uniform() * 4.0).collect();
            let mut x = vec![0u8; xt.row_bytes(n).unwrap()];
            quantize(xt, &xf, &mut x).unwrap();

            let (wd, xd) = (deq(t, &w, n), deq(xt, &x, n));
            let mut exact: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b as f64).sum();
            if matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1) {
                exact += q8_1_s_correction(t, &w, &x);
            }
            let mag: f64 = wd.iter().zip(&xd).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = vec_dot(t, n, &w, &x) as f64;
            let rel = if mag > 0.0 { (got - exact).abs() / mag } else { got.abs() };
            assert!(rel <= 1e-5, "{t} n={n}: vec_dot {got} vs f64 {exact} (Σ|wx| {mag}): rel {rel:e}");
            worst = worst.max(rel);

            // vec_dot_f32 against the f32 activations themselves.
            let exact: f64 = wd.iter().zip(&xf).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = wd.iter().zip(&xf).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = vec_dot_f32(t, n, &w, &xf) as f64;
            let rel = if mag > 0.0 { (got - exact).abs() / mag } else { got.abs() };
            assert!(rel <= 1e-5, "{t} n={n}: vec_dot_f32 {got} vs f64 {exact} (Σ|wx| {mag}): rel {rel:e}");
            worst = worst.max(rel);
        }
    }
    worst
}

#[test]
fn vec_dot_matches_f64_reference_random_bytes() {
    for &t in ALL {
        let e = max_rel_err(t, 4, false);
        println!("{t:7} random blocks: max |err|/Σ|wx| = {e:.2e}");
    }
}

#[test]
fn vec_dot_matches_f64_reference_quantised_gaussian() {
    for &t in ALL {
        let e = max_rel_err(t, 2, true);
        println!("{t:7} quantised N(0,0.02): max |err|/Σ|wx| = {e:.2e}");
    }
}

#[test]
fn vec_dot_of_empty_rows_is_zero() {
    for &t in ALL {
        assert_eq!(vec_dot(t, 0, &[], &[]), 0.0, "{t}");
        assert_eq!(vec_dot_f32(t, 0, &[], &[]), 0.0, "{t}");
    }
}
