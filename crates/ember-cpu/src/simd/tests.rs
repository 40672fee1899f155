//! Every instruction set's kernels against the scalar references.

use super::*;
use proptest::prelude::*;

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Random valid weight bytes of `t` (scales small normal f16 values, other bytes random).
pub(crate) fn random_row(t: GgmlType, n: usize, seed: &mut u64) -> Vec<u8> {
    let mut w: Vec<u8> = (0..t.row_bytes(n).unwrap()).map(|_| lcg(seed) as u8).collect();
    match t {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&((lcg(seed) % 2001) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
            return w;
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32((lcg(seed) % 2001) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
            return w;
        }
        GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32((lcg(seed) % 2001) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
            return w;
        }
        _ => {}
    }
    let offs: &[usize] = match t {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::Q3K => &[108],
        GgmlType::Q2K => &[80, 82],
        _ => &[],
    };
    for block in w.chunks_exact_mut(t.type_size()) {
        for &o in offs {
            let v = half::f16::from_f32(0.001 + (lcg(seed) % 1000) as f32 * 1e-5);
            block[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    w
}

/// Activations with a few large outliers and exact zeros, like real hidden states.
pub(crate) fn random_acts(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|i| match lcg(seed) % 50 {
            0 => 0.0,
            1 => (lcg(seed) % 2001) as f32 / 10.0 - 100.0,
            _ => (lcg(seed) % 2001) as f32 / 1000.0 - 1.0 + (i % 7) as f32 * 1e-3,
        })
        .collect()
}

fn quant_types() -> Vec<GgmlType> {
    GgmlType::all().filter(|t| kernels::supported(*t)).collect()
}

/// |got − want| ≤ 1e-5 · Σ|w_j·a_j| (the integer sums are exact; only the f32 scaling order
/// differs, measured < 1e-6). With `grouped` rows the single-token K-quant kernels may take
/// their integer path (scaled once per 256).
fn check_q<K: Kernels>(k: K, t: GgmlType, n_blocks: usize, grouped: bool, seed: &mut u64) {
    let n = n_blocks * t.block_size();
    let w = random_row(t, n, seed);
    let rows: Vec<ActRow> = (0..4)
        .map(|_| {
            let mut a = ActRow::default();
            if grouped {
                ActRow::quantize_grouped(&random_acts(n, seed), &mut a);
            } else {
                ActRow::quantize(&random_acts(n, seed), &mut a);
            }
            a
        })
        .collect();
    let mut wf = vec![0f32; n];
    ember_gguf::quant::dequantize(t, &w, &mut wf).unwrap();
    let norm = |a: &ActRow| -> f64 { (0..n).map(|i| (wf[i] as f64 * a.d[i / 32] as f64 * a.q[i] as f64).abs()).sum() };
    let got1 = k.dot_q::<1>(t, &w, [&rows[0]]);
    let got4 = k.dot_q::<4>(t, &w, [&rows[0], &rows[1], &rows[2], &rows[3]]);
    for (i, a) in rows.iter().enumerate() {
        let want = kernels::dot(t, &w, a) as f64;
        let tol = 1e-5 * norm(a).max(1e-20);
        assert!((got4[i] as f64 - want).abs() <= tol, "{t} n={n} token {i}/4: got {} want {want}", got4[i]);
    }
    let want = kernels::dot(t, &w, &rows[0]) as f64;
    assert!((got1[0] as f64 - want).abs() <= 1e-5 * norm(&rows[0]).max(1e-20), "{t} n={n}: got {} want {want}", got1[0]);
    // The same row with the activations also in Q4_K nibble order (decode ops fill it).
    let mut ordered = rows[0].clone();
    ordered.fill_k4_order();
    let got_k = k.dot_q::<1>(t, &w, [&ordered]);
    assert!((got_k[0] as f64 - want).abs() <= 1e-5 * norm(&rows[0]).max(1e-20), "{t} n={n} (ordered): got {} want {want}", got_k[0]);
    // Several rows in one call: each row's value exactly the single-row kernel's, and the
    // prefetch hook called once per row, in order, before it.
    let rb = w.len();
    let mut many = w.clone();
    for _ in 0..2 {
        many.extend(random_row(t, n, seed));
    }
    for a in [&rows[0], &ordered] {
        let mut out = [0f32; 3];
        let mut seen = Vec::new();
        k.dot_rows(t, &many, rb, a, &mut out, |j| seen.push(j));
        assert_eq!(seen, [0, 1, 2], "{t} n={n}: prefetch hook order");
        for (j, row) in many.chunks_exact(rb).enumerate() {
            assert_eq!(out[j].to_bits(), k.dot_q::<1>(t, row, [a])[0].to_bits(), "{t} n={n}: dot_rows row {j}");
        }
    }
}

fn check_float<K: Kernels>(k: K, t: GgmlType, n: usize, seed: &mut u64) {
    let w = random_row(t, n, seed);
    let xs: Vec<Vec<f32>> = (0..4).map(|_| random_acts(n, seed)).collect();
    let got1 = k.dot_float::<1>(t, &w, [&xs[0]]);
    let got4 = k.dot_float::<4>(t, &w, [&xs[0], &xs[1], &xs[2], &xs[3]]);
    for (i, x) in xs.iter().enumerate() {
        let want: f64 = (0..n).map(|j| float_at(t, &w, j) as f64 * x[j] as f64).sum();
        let norm: f64 = (0..n).map(|j| (float_at(t, &w, j) as f64 * x[j] as f64).abs()).sum();
        let tol = 1e-5 * norm.max(1e-20);
        assert!((got4[i] as f64 - want).abs() <= tol, "{t} n={n} token {i}: got {} want {want}", got4[i]);
        if i == 0 {
            assert!((got1[0] as f64 - want).abs() <= tol, "{t} n={n}: got {} want {want}", got1[0]);
        }
    }
    let a = &xs[0];
    let b = &xs[1];
    let want: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum();
    assert!((k.dot_f32(a, b) as f64 - want).abs() <= 1e-5 * norm.max(1e-20), "dot_f32 n={n}");
}

fn check_quantize<K: Kernels>(k: K, n_blocks: usize, seed: &mut u64) {
    let x = random_acts(n_blocks * 32, seed);
    let (mut want, mut got) = (ActRow::default(), ActRow::default());
    ActRow::quantize(&x, &mut want);
    k.quantize(&x, &mut got);
    assert_eq!(got.q, want.q);
    assert_eq!(got.d, want.d);
    assert_eq!(got.sum16, want.sum16);
    assert_eq!(got.ds16, want.ds16);
    assert_eq!(got.ds32, want.ds32);
    assert!(!got.is_grouped());
    // Grouped scales: bit-exact too, and what they promise: d = d256·m, codes within ±127,
    // every value within half a step of its code.
    ActRow::quantize_grouped(&x, &mut want);
    k.quantize_grouped(&x, &mut got);
    assert_eq!(got.q, want.q);
    assert_eq!(got.d, want.d);
    assert_eq!(got.d256, want.d256);
    assert_eq!(got.m32, want.m32);
    assert_eq!(got.m16, want.m16);
    assert_eq!(got.s16, want.s16);
    assert!(got.s16.iter().zip(&got.sum16).all(|(&a, &b)| a as i32 == b));
    assert_eq!(got.ds16, want.ds16);
    assert_eq!(got.ds32, want.ds32);
    assert!(got.is_grouped());
    for (b, &d) in got.d.iter().enumerate() {
        let m = got.m32[b];
        assert!((0..=kernels::MAX_MULT).contains(&m) && got.m16[2 * b] == m && got.m16[2 * b + 1] == m);
        assert_eq!(d, got.d256[b / 8] * m as f32);
        for i in 32 * b..32 * b + 32 {
            assert!(got.q[i] != -128);
            assert!((x[i] - d * got.q[i] as f32).abs() <= 0.5 * d * 1.0001 + 1e-30, "value {i}: {} vs {}·{}", x[i], d, got.q[i]);
        }
    }
}

/// The integer K-quant kernels at the bounds their i32 sums are sized for: the largest weight
/// codes and scales (Q6_K: −128) against activations at ±127 with the largest multiple.
#[test]
fn integer_kquant_sums_do_not_overflow() {
    let n = 1024;
    // One sign throughout: every i16 pair sum and i32 lane at its largest magnitude (and no
    // cancellation, so the tolerance can be relative to the result).
    let x = vec![1.0f32; n];
    let mut a = ActRow::default();
    ActRow::quantize_grouped(&x, &mut a);
    assert!(a.m32.iter().all(|&m| m == kernels::MAX_MULT));
    for t in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let mut w = vec![0xFFu8; t.row_bytes(n).unwrap()];
        for block in w.chunks_exact_mut(t.type_size()) {
            let d = half::f16::from_f32(0.01).to_le_bytes();
            match t {
                GgmlType::Q6K => {
                    block[192..208].fill(0x80); // scales −128
                    block[208..210].copy_from_slice(&d);
                }
                _ => {
                    block[0..2].copy_from_slice(&d);
                    block[2..4].copy_from_slice(&half::f16::from_f32(0.0).to_le_bytes());
                }
            }
        }
        let want = kernels::dot(t, &w, &a) as f64;
        for_each_isa(|isa| {
            let got = with_kernels!(isa, |k| k.dot_q::<1>(t, &w, [&a])[0]) as f64;
            assert!((got - want).abs() <= 1e-5 * want.abs(), "{t} {isa:?}: got {got} want {want}");
        });
    }
}

fn check_vector_ops<K: Kernels>(k: K, n: usize, seed: &mut u64) {
    let x = random_acts(n, seed);
    let mut y = random_acts(n, seed);
    let mut want = y.clone();
    k.axpy(0.37, &x, &mut y);
    Scalar.axpy(0.37, &x, &mut want);
    for (i, (g, w)) in y.iter().zip(&want).enumerate() {
        // As mul_add below: the SIMD forms fuse the multiply-add (one rounding, the scalar form
        // two), so they may differ by an ulp of a·x, which cancellation can leave larger than
        // the sum (seen on an AVX-512 host: n = 663).
        assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs() + (0.37 * x[i]).abs()), "axpy n={n}: {g} vs {w}");
    }
    let a = random_acts(n, seed);
    k.mul_add(&a, &x, &mut y);
    Scalar.mul_add(&a, &x, &mut want);
    for (i, (g, w)) in y.iter().zip(&want).enumerate() {
        // A fused multiply-add rounds once, the scalar form twice: one ulp of a·x apart.
        assert!((g - w).abs() <= 1e-6 * (1.0 + w.abs() + (a[i] * x[i]).abs()), "mul_add n={n}: {g} vs {w}");
    }
    // exp over the range softmax uses (x − max ≤ 0), down to underflow.
    let mut e: Vec<f32> = (0..n).map(|i| -((lcg(seed) % 100_000) as f32) / 1000.0 - (i % 3) as f32).collect();
    let want: Vec<f32> = e.iter().map(|v| (v - 0.5).exp()).collect();
    let sum = k.exp_sum(&mut e, 0.5);
    for (g, w) in e.iter().zip(&want) {
        assert!((g - w).abs() <= 4e-7 * w.abs() + 1e-37, "exp n={n}: {g} vs {w}");
    }
    let ws: f64 = want.iter().map(|v| *v as f64).sum();
    assert!((sum as f64 - ws).abs() <= 1e-5 * ws.abs() + 1e-30, "exp sum");
    let mut sx: Vec<f32> = x.iter().map(|v| v * 30.0).collect();
    let want: Vec<f32> = sx.iter().map(|v| ember_ops::reference::silu(*v)).collect();
    k.silu(&mut sx);
    for (g, w) in sx.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs() + 1e-30, "silu n={n}: {g} vs {w}");
    }
    let h: Vec<u8> = x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
    let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
    k.f16_to_f32(&h, &mut got);
    Scalar.f16_to_f32(&h, &mut want);
    assert_eq!(got, want);
    // Q8_0 blocks (every int8 value, scales of both signs): bit for bit with the file's
    // dequantisation.
    let nb = n.div_ceil(32) + 8;
    let q8: Vec<u8> = (0..nb)
        .flat_map(|b| {
            let mut blk = half::f16::from_f32(x[b % n] * 0.01).to_le_bytes().to_vec();
            blk.extend((0..32).map(|i| ((b * 32 + i) * 37 % 256) as u8));
            blk
        })
        .collect();
    let (mut got, mut want) = (vec![0f32; 32 * nb], vec![0f32; 32 * nb]);
    k.q8_0_to_f32(&q8, &mut got);
    ember_gguf::quant::dequantize(ember_gguf::GgmlType::Q8_0, &q8, &mut want).unwrap();
    assert_eq!(got, want, "q8_0_to_f32 n={n}");
}

fn check_delta<K: Kernels>(k: K, dk: usize, dv: usize, seed: &mut u64) {
    let mut st: Vec<f32> = random_acts(dk * dv, seed).iter().map(|v| v * 0.1).collect();
    let mut want_st = st.clone();
    let unit = |seed: &mut u64| {
        let mut v = random_acts(dk, seed);
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        v.iter_mut().for_each(|x| *x /= n);
        v
    };
    for _ in 0..3 {
        let (q, kk) = (unit(seed), unit(seed));
        let v = random_acts(dv, seed);
        let (mut o, mut want_o) = (vec![0f32; dv], vec![0f32; dv]);
        k.delta_step(&mut st, &q, &kk, &v, 0.93, 0.6, &mut o);
        delta_step_scalar(&mut want_st, &q, &kk, &v, 0.93, 0.6, &mut want_o);
        for (g, w) in o.iter().zip(&want_o).chain(st.iter().zip(&want_st)) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "delta dk={dk}: {g} vs {w}");
        }
    }
}

/// A panel of `m` random rows: the instruction set's unpacker equals the scalar one bit for
/// bit, and its products equal [`kernels::dot`] row by row for `nt` tokens.
fn check_panel<K: Kernels>(k: K, t: GgmlType, n_blocks: usize, m: usize, nt: usize, seed: &mut u64) {
    let n = n_blocks * t.block_size().max(panel::group(t));
    let rows: Vec<Vec<u8>> = (0..m).map(|_| random_row(t, n, seed)).collect();
    let flat: Vec<u8> = rows.concat();
    let mut got = Panel::default();
    k.panel_unpack(t, n, &flat, m, &mut got);
    let mut want_p = Panel::default();
    want_p.unpack_scalar(t, n, &rows.iter().map(|r| r.as_slice()).collect::<Vec<_>>());
    assert_eq!(got.q, want_p.q, "{t} m={m}: codes");
    assert_eq!(got.corr, want_p.corr, "{t} m={m}: corrections");
    assert_eq!(got.sc, want_p.sc, "{t} m={m}: scales");
    assert_eq!(got.off, want_p.off, "{t} m={m}: offsets");
    let acts: Vec<ActRow> = (0..nt)
        .map(|_| {
            let mut a = ActRow::default();
            ActRow::quantize(&random_acts(n, seed), &mut a);
            a.fill_unsigned();
            a
        })
        .collect();
    let refs: Vec<&ActRow> = acts.iter().collect();
    let mut out = vec![[0f32; panel::ROWS]; nt];
    k.panel_dot(&got, &refs, &mut out);
    let mut wf = vec![0f32; n];
    for (r, row) in rows.iter().enumerate() {
        ember_gguf::quant::dequantize(t, row, &mut wf).unwrap();
        for (i, a) in acts.iter().enumerate() {
            let want = kernels::dot(t, row, a) as f64;
            let norm: f64 = (0..n).map(|j| (wf[j] as f64 * a.d[j / 32] as f64 * a.q[j] as f64).abs()).sum();
            let scalar = want_p.dot_scalar(a)[r] as f64;
            let tol = 1e-5 * norm.max(1e-20);
            assert!((out[i][r] as f64 - want).abs() <= tol, "{t} n={n} row {r}/{m} token {i}/{nt}: got {} want {want}", out[i][r]);
            assert!((scalar - want).abs() <= tol, "{t} scalar panel row {r} token {i}: got {scalar} want {want}");
        }
    }
}

/// `delta_seq` over n tokens equals `delta_step_scalar` token by token.
fn check_delta_seq<K: Kernels>(k: K, dk: usize, dv: usize, n: usize, seed: &mut u64) {
    let st0: Vec<f32> = random_acts(dk * dv, seed).iter().map(|v| v * 0.1).collect();
    let unit = |seed: &mut u64| {
        let mut v = random_acts(dk, seed);
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        v.iter_mut().for_each(|x| *x /= n);
        v
    };
    let (sqk, sv) = (dk + 3, dv + 5); // rows of a wider matrix, as in the model
    let mut q = vec![0f32; n * sqk];
    let mut kk = vec![0f32; n * sqk];
    for t in 0..n {
        q[t * sqk..t * sqk + dk].copy_from_slice(&unit(seed));
        kk[t * sqk..t * sqk + dk].copy_from_slice(&unit(seed));
    }
    let v = random_acts(n * sv, seed);
    let decay: Vec<f32> = (0..n).map(|t| 0.8 + 0.2 * ((t * 7) % 10) as f32 / 10.0).collect();
    let beta: Vec<f32> = (0..n).map(|t| 0.1 + 0.8 * ((t * 3) % 10) as f32 / 10.0).collect();
    let io = DeltaIo { q: &q, k: &kk, v: &v, sqk, sv, decay: &decay, beta: &beta, n, dk, dv };
    let (mut st, mut want_st) = (st0.clone(), st0);
    let (mut o, mut want_o) = (vec![0f32; n * dv], vec![0f32; n * dv]);
    k.delta_seq(&mut st, &io, &mut o);
    for t in 0..n {
        let (qt, kt, vt) = io.token(t);
        delta_step_scalar(&mut want_st, qt, kt, vt, decay[t], beta[t], &mut want_o[t * dv..(t + 1) * dv]);
    }
    for (g, w) in o.iter().zip(&want_o).chain(st.iter().zip(&want_st)) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "delta_seq dk={dk} dv={dv} n={n}: {g} vs {w}");
    }
}

/// `gemm_f32` (overwrite and accumulate, with row strides wider than the rows) against
/// [`gemm_f32_scalar`] summed in f64: |got − want| ≤ 1e-5·Σ|a·b| (f32 sums of `kd` products).
fn check_gemm<K: Kernels>(k: K, m: usize, n: usize, kd: usize, seed: &mut u64) {
    let (lda, ldb, ldc) = (kd + 3, n + 16, n + 5);
    let a = random_acts(m * lda, seed);
    let b = random_acts(kd * ldb, seed);
    let c0 = random_acts(m * ldc, seed);
    for acc in [false, true] {
        let g = Gemm { a: &a, lda, b: &b, ldb, ldc, m, n, kd, acc };
        let mut c = c0.clone();
        k.gemm_f32(&g, &mut c);
        let mut scalar = c0.clone();
        gemm_f32_scalar(&g, &mut scalar);
        for i in 0..m {
            for j in 0..ldc {
                let (got, sc) = (c[i * ldc + j], scalar[i * ldc + j]);
                if j >= n {
                    assert_eq!(got, c0[i * ldc + j], "gemm wrote outside C: row {i} column {j}");
                    continue;
                }
                let terms = (0..kd).map(|l| a[i * lda + l] as f64 * b[l * ldb + j] as f64);
                let base = if acc { c0[i * ldc + j] as f64 } else { 0.0 };
                let want = base + terms.clone().sum::<f64>();
                let tol = 1e-5 * (base.abs() + terms.map(f64::abs).sum::<f64>()).max(1e-20);
                assert!((got as f64 - want).abs() <= tol, "gemm {m}x{kd}x{n} acc={acc} ({i},{j}): {got} vs {want}");
                assert!((sc as f64 - want).abs() <= tol, "scalar gemm ({i},{j}): {sc} vs {want}");
            }
        }
    }
}

/// `gemm_bf16` (row strides wider than the rows) against [`gemm_bf16_scalar`] and against
/// the f64 sum of the same bf16 products: |got − want| ≤ 1e-5·(|C| + Σ|a·b|), as for
/// `gemm_f32` (the inputs are exact in bf16, so only the f32 sums round).
fn check_gemm_bf16<K: Kernels>(k: K, m: usize, n: usize, kp: usize, seed: &mut u64) {
    let (lda, ldb, ldc) = (2 * kp + 6, 2 * n + 32, n + 5);
    let bits = |v: Vec<f32>| -> Vec<u16> { v.into_iter().map(bf16_of).collect() };
    let a = bits(random_acts(m * lda, seed));
    let b = bits(random_acts(kp * ldb, seed));
    let c0 = random_acts(m * ldc, seed);
    let g = GemmBf16 { a: &a, lda, b: &b, ldb, ldc, m, n, kp };
    let mut c = c0.clone();
    k.gemm_bf16(&g, &mut c);
    let mut scalar = c0.clone();
    gemm_bf16_scalar(&g, &mut scalar);
    for i in 0..m {
        for j in 0..ldc {
            let (got, sc) = (c[i * ldc + j], scalar[i * ldc + j]);
            if j >= n {
                assert_eq!(got, c0[i * ldc + j], "gemm_bf16 wrote outside C: row {i} column {j}");
                continue;
            }
            let terms = (0..2 * kp).map(|l| f32_of_bf16(a[i * lda + l]) as f64 * f32_of_bf16(b[l / 2 * ldb + 2 * j + l % 2]) as f64);
            let base = c0[i * ldc + j] as f64;
            let want = base + terms.clone().sum::<f64>();
            let tol = 1e-5 * (base.abs() + terms.map(f64::abs).sum::<f64>()).max(1e-20);
            assert!((got as f64 - want).abs() <= tol, "gemm_bf16 {m}x{kp}x{n} ({i},{j}): {got} vs {want}");
            assert!((sc as f64 - want).abs() <= tol, "scalar gemm_bf16 ({i},{j}): {sc} vs {want}");
        }
    }
}

fn for_each_isa(mut f: impl FnMut(Isa)) {
    for isa in Isa::available() {
        f(isa);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn quantised_dots_match_reference(n_blocks in 1usize..12, seed in any::<u64>()) {
        let mut seed = seed;
        for_each_isa(|isa| {
            for t in quant_types() {
                // 32-blocks: odd counts of blocks, also beyond one 256 super-block.
                let nb = if t.block_size() == 32 { 2 * n_blocks + 1 } else { n_blocks };
                with_kernels!(isa, |k| check_q(k, t, nb, false, &mut seed));
                with_kernels!(isa, |k| check_q(k, t, nb, true, &mut seed));
            }
        });
    }

    #[test]
    fn panels_match_reference(n_blocks in 1usize..5, m in 1usize..=16, nt in 1usize..12, seed in any::<u64>()) {
        let mut seed = seed;
        for_each_isa(|isa| {
            for t in quant_types() {
                with_kernels!(isa, |k| check_panel(k, t, n_blocks, m, nt, &mut seed));
            }
        });
    }

    #[test]
    fn float_dots_match_reference(n in 1usize..300, seed in any::<u64>()) {
        let mut seed = seed;
        for_each_isa(|isa| {
            for t in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
                with_kernels!(isa, |k| check_float(k, t, n, &mut seed));
            }
        });
    }

    #[test]
    fn vector_ops_match_reference(n in 1usize..700, seed in any::<u64>()) {
        let mut seed = seed;
        for_each_isa(|isa| with_kernels!(isa, |k| check_vector_ops(k, n, &mut seed)));
    }

    #[test]
    fn delta_step_matches_reference(dk in 1usize..20, dv in 1usize..40, seed in any::<u64>()) {
        let mut seed = seed;
        for dk in [dk, 8 * dk, 128] {
            for_each_isa(|isa| with_kernels!(isa, |k| check_delta(k, dk, dv, &mut seed)));
        }
    }

    #[test]
    fn delta_seq_matches_reference(dk in 1usize..20, dv in 1usize..3, n in 1usize..40, seed in any::<u64>()) {
        let mut seed = seed;
        for (dk, dv) in [(dk, 16 * dv), (4 * dk, 16 * dv), (8 * dk, 16 * dv + 1), (128, 128)] {
            for_each_isa(|isa| with_kernels!(isa, |k| check_delta_seq(k, dk, dv, n, &mut seed)));
        }
    }

    #[test]
    fn gemm_matches_reference(m in 1usize..5, n in 1usize..6, kd in 1usize..300, seed in any::<u64>()) {
        let mut seed = seed;
        // Shapes of the SIMD tiles (m a multiple of 8, n of 16) and others (the scalar fallback).
        for (m, n) in [(8 * m, 16 * n), (8 * m, 64), (4 * m, 16 * n), (m, n)] {
            for_each_isa(|isa| with_kernels!(isa, |k| check_gemm(k, m, n, kd, &mut seed)));
        }
    }

    #[test]
    fn gemm_bf16_matches_reference(m in 1usize..5, n in 1usize..6, kp in 1usize..80, seed in any::<u64>()) {
        let mut seed = seed;
        // Shapes of the SIMD tiles (m even, n a multiple of 16) and others (the scalar fallback).
        for (m, n) in [(8 * m, 16 * n), (2 * m, 64), (m, n)] {
            for_each_isa(|isa| with_kernels!(isa, |k| check_gemm_bf16(k, m, n, kp, &mut seed)));
        }
    }

    /// Every kernel rounds to bf16 as [`bf16_of`] does (to nearest, ties to even), tails too.
    #[test]
    fn bf16_rounding_matches_reference(n in 0usize..100, seed in any::<u64>()) {
        let mut seed = seed;
        let mut x = random_acts(n, &mut seed);
        // Ties: a value halfway between two bf16s, either way of even.
        for (i, v) in x.iter_mut().enumerate().take(8) {
            *v = f32::from_bits(0x3f80_8000 + ((i as u32) << 16));
        }
        let want: Vec<u16> = x.iter().map(|v| bf16_of(*v)).collect();
        for_each_isa(|isa| {
            let mut got = vec![0u16; n];
            with_kernels!(isa, |k| k.f32_to_bf16(&x, &mut got));
            assert_eq!(got, want, "{isa:?}");
        });
    }

    #[test]
    fn activation_quantiser_is_bit_exact(n_blocks in 1usize..20, seed in any::<u64>()) {
        let mut seed = seed;
        for_each_isa(|isa| with_kernels!(isa, |k| check_quantize(k, n_blocks, &mut seed)));
    }
}

/// Rounding ties go away from zero in every quantiser, as in the reference.
#[test]
fn quantiser_ties() {
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    for (i, v) in x.iter_mut().enumerate().skip(1) {
        *v = (i as f32 - 16.0) + 0.5; // d = 1: exact .5 ties
    }
    for_each_isa(|isa| {
        let (mut want, mut got) = (ActRow::default(), ActRow::default());
        ActRow::quantize(&x, &mut want);
        with_kernels!(isa, |k| k.quantize(&x, &mut got));
        assert_eq!(got.q, want.q, "{isa:?}");
    });
}

#[test]
fn detect_is_available() {
    assert!(Isa::available().contains(&Isa::detect()));
}
