//! Activation quantisers Q8_0, Q8_1, Q8_K and the float conversions against the reference C
//! formulas of ggml-quants.c / ggml-impl.h (gguf-format.md §3, §7.2), written out again here
//! independently. Tolerance: none (bit-exact), including exact ties, which pin the rounding
//! modes: Q8_0/Q8_1 `roundf` (half away from zero), Q8_K `nearest_int` (half to even).

use ember_gguf::GgmlType;
use ember_gguf::quant::{dequantize, f32_to_bf16, quantize};

mod common;
use common::Rng;

/// quantize_row_q8_0_ref for one block: (d as f16 bits, qs).
fn ref_q8_0(x: &[f32]) -> (u16, Vec<i8>) {
    let amax = x.iter().fold(0f32, |a, v| if v.abs() > a { v.abs() } else { a });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let qs = x.iter().map(|&v| roundf(v * id)).collect();
    (half::f16::from_f32(d).to_bits(), qs)
}

/// C `roundf`: half away from zero (the fractional part `v − trunc(v)` is exact in f32).
fn roundf(v: f32) -> i8 {
    let t = v.trunc();
    if (v - t).abs() >= 0.5 { (t + v.signum()) as i8 } else { t as i8 }
}

/// nearest_int from ggml-quants.c, written via f64 round-half-even.
fn nearest_even(v: f32) -> i32 {
    let v = v as f64;
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 {
        // tie: pick the even neighbour
        let lo = v.floor();
        if lo % 2.0 == 0.0 { lo as i32 } else { (lo + 1.0) as i32 }
    } else {
        r as i32
    }
}

/// quantize_row_q8_K_ref for one block: (d, qs, bsums).
fn ref_q8_k(x: &[f32]) -> (f32, Vec<i8>, Vec<i16>) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return (0.0, vec![0; 256], vec![0; 16]);
    }
    let iscale = -127.0f32 / max;
    let qs: Vec<i8> = x.iter().map(|&v| nearest_even(iscale * v).min(127) as i8).collect();
    let bsums = qs.chunks(16).map(|c| c.iter().map(|&q| q as i16).sum()).collect();
    (1.0 / iscale, qs, bsums)
}

fn check_q8_0(x: &[f32]) {
    let mut got = vec![0u8; 34 * x.len() / 32];
    quantize(GgmlType::Q8_0, x, &mut got).unwrap();
    let mut got1 = vec![0u8; 36 * x.len() / 32];
    quantize(GgmlType::Q8_1, x, &mut got1).unwrap();
    for (b, xb) in x.chunks(32).enumerate() {
        let (d, qs) = ref_q8_0(xb);
        let blk = &got[34 * b..34 * b + 34];
        assert_eq!(u16::from_le_bytes([blk[0], blk[1]]), d, "Q8_0 block {b} d");
        let gq: Vec<i8> = blk[2..].iter().map(|&v| v as i8).collect();
        assert_eq!(gq, qs, "Q8_0 block {b} quants for {xb:?}");
        // Q8_1: same d and quants, plus s = f16(f32(d)·Σq).
        let blk1 = &got1[36 * b..36 * b + 36];
        assert_eq!(&blk1[0..2], &blk[0..2], "Q8_1 block {b} d");
        assert_eq!(&blk1[4..], &blk[2..], "Q8_1 block {b} quants");
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let s = qs.iter().map(|&q| q as i32).sum::<i32>() as f32 * (amax / 127.0);
        assert_eq!(u16::from_le_bytes([blk1[2], blk1[3]]), half::f16::from_f32(s).to_bits(), "Q8_1 block {b} s");
    }
}

fn check_q8_k(x: &[f32]) {
    let mut got = vec![0u8; 292 * x.len() / 256];
    quantize(GgmlType::Q8K, x, &mut got).unwrap();
    for (b, xb) in x.chunks(256).enumerate() {
        let (d, qs, bsums) = ref_q8_k(xb);
        let blk = &got[292 * b..292 * b + 292];
        assert_eq!(f32::from_le_bytes(blk[0..4].try_into().unwrap()).to_bits(), d.to_bits(), "Q8_K block {b} d");
        let gq: Vec<i8> = blk[4..260].iter().map(|&v| v as i8).collect();
        assert_eq!(gq, qs, "Q8_K block {b} quants");
        let gs: Vec<i16> = blk[260..].chunks(2).map(|c| i16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(gs, bsums, "Q8_K block {b} bsums");
    }
}

#[test]
fn q8_random_matches_reference_formulas() {
    let mut rng = Rng(1);
    for scale in [1e-3f32, 0.1, 1.0, 37.0, 3000.0] {
        let x: Vec<f32> = (0..256 * 8).map(|_| rng.normal() * scale).collect();
        check_q8_0(&x);
        check_q8_k(&x);
    }
    // Zero blocks, one-hot blocks, a block with an outlier.
    let mut x = vec![0f32; 512];
    x[300] = -2.0;
    x[301] = 1.0;
    check_q8_0(&x);
    check_q8_k(&x);
}

#[test]
fn q8_0_ties_round_half_away_from_zero() {
    // amax = 127 ⇒ d = 1, id = 1 exactly, so x·id is x and the ties are exact.
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    let ties = [0.5f32, -0.5, 1.5, -1.5, 2.5, -2.5, 100.5, -126.5];
    x[1..1 + ties.len()].copy_from_slice(&ties);
    let mut q = vec![0u8; 34];
    quantize(GgmlType::Q8_0, &x, &mut q).unwrap();
    let got: Vec<i8> = q[3..3 + ties.len()].iter().map(|&v| v as i8).collect();
    assert_eq!(got, [1, -1, 2, -2, 3, -3, 101, -127]);
    assert_eq!(half::f16::from_le_bytes([q[0], q[1]]).to_f32(), 1.0);
    check_q8_0(&x);
    let mut q1 = vec![0u8; 36];
    quantize(GgmlType::Q8_1, &x, &mut q1).unwrap();
    // s = d·Σq = 127 + (1−1+2−2+3−3+101−127) = 101
    assert_eq!(half::f16::from_le_bytes([q1[2], q1[3]]).to_f32(), 101.0);
}

#[test]
fn q8_k_ties_round_half_to_even() {
    // max = −127 ⇒ iscale = −127/−127 = 1 exactly.
    let mut x = vec![0f32; 256];
    x[0] = -127.0;
    let ties = [0.5f32, -0.5, 1.5, -1.5, 2.5, -2.5, 3.5, 100.5, -126.5];
    x[1..1 + ties.len()].copy_from_slice(&ties);
    let mut q = vec![0u8; 292];
    quantize(GgmlType::Q8K, &x, &mut q).unwrap();
    let got: Vec<i8> = q[5..5 + ties.len()].iter().map(|&v| v as i8).collect();
    assert_eq!(got, [0, 0, 2, -2, 2, -2, 4, 100, -126]);
    assert_eq!(f32::from_le_bytes(q[0..4].try_into().unwrap()), 1.0);
    // bsum of group 0: −127 + 0 + 0 + 2 − 2 + 2 − 2 + 4 + 100 − 126 = −149
    assert_eq!(i16::from_le_bytes([q[260], q[261]]), -149);
    check_q8_k(&x);

    // A positive max gives a negative iscale and d: max = 127 ⇒ iscale = −1, d = −1; the value
    // 127 itself quantises to −127 and dequantises back to 127.
    x[0] = 127.0;
    quantize(GgmlType::Q8K, &x, &mut q).unwrap();
    assert_eq!(f32::from_le_bytes(q[0..4].try_into().unwrap()), -1.0);
    assert_eq!(q[4] as i8, -127);
    assert_eq!(q[5] as i8, 0, "−0.5 rounds to even 0");
    assert_eq!(q[7] as i8, -2, "−1.5 rounds to even −2");
    let mut y = vec![0f32; 256];
    dequantize(GgmlType::Q8K, &q, &mut y).unwrap();
    assert_eq!(y[0], 127.0);
    check_q8_k(&x);
}

#[test]
fn q8_k_zero_block() {
    let x = vec![0f32; 256];
    let mut q = vec![0xAAu8; 292];
    quantize(GgmlType::Q8K, &x, &mut q).unwrap();
    assert!(q.iter().all(|&b| b == 0), "d = 0, quants and bsums zero");
}

#[test]
fn bf16_rounding_and_nan() {
    // round to nearest even at the halfway point, both directions
    assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
    assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
    assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
    assert_eq!(f32_to_bf16(f32::from_bits(0xBF80_7FFF)), 0xBF80);
    // overflow to infinity; infinities and zeros kept
    assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
    assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xFF80);
    assert_eq!(f32_to_bf16(-0.0), 0x8000);
    // NaN: forced quiet, sign and top payload bits kept
    assert_eq!(f32_to_bf16(f32::from_bits(0x7F80_0001)), 0x7FC0);
    assert_eq!(f32_to_bf16(f32::from_bits(0xFFA1_0000)), 0xFFE1);
    // quantize(BF16) is the same conversion
    let x = [1.0f32, f32::from_bits(0x3F81_8000), f32::NAN];
    let mut b = [0u8; 6];
    quantize(GgmlType::BF16, &x, &mut b).unwrap();
    assert_eq!(u16::from_le_bytes([b[2], b[3]]), 0x3F82);
    assert_eq!(u16::from_le_bytes([b[4], b[5]]) & 0x7FC0, 0x7FC0);
}

#[test]
fn f16_round_trip_is_exact_for_f16_values() {
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..1000).map(|_| half::f16::from_f32(rng.normal() * 100.0).to_f32()).collect();
    let mut b = vec![0u8; 2000];
    quantize(GgmlType::F16, &x, &mut b).unwrap();
    let mut y = vec![0f32; 1000];
    dequantize(GgmlType::F16, &b, &mut y).unwrap();
    assert_eq!(x, y);
}
