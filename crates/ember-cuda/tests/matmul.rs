//! Every matmul kernel against ember_ops::reference: the GEMV (few tokens, Exact), the f32 FMA
//! tiles, the tensor-core tiles (prompt batches under Fast), `matmul_mmv` (2 to MMA_MIN_TOKENS
//! tokens under Fast: tensor cores in the GEMV's shape), several weights in one launch against
//! one launch per weight; and their timings. Random shapes (odd sizes, ragged tokens), fresh
//! random data, outputs poisoned with NaN before the run.
//!
//! With no NVIDIA driver every test prints why and passes (CI has no GPU); the tensor-core ones
//! also on a GPU before sm_80. On a GPU: `cargo test -p ember-cuda --release --test matmul --
//! --test-threads=1`; the timings: `... -- --ignored --nocapture bench`.
//!
//! Tolerances: `|got − ref| <= atol + rtol·Σ_j |w_j·x_j|` (an f32 sum of k terms is off by
//! ~√k·ε·Σ|terms|, whatever the cancellation in the result). Each states the largest error
//! measured.

use ember_cuda::ops::{DeviceWeight, MMA_MIN_TOKENS, MMV_PROMPT_MAX_ROWS, MatmulKernel, Precision};
use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_ops::{Mat, WeightView, reference};
use ember_testkit::Rng;

mod common;
use common::{check, gpu, ms_per_call, poisoned, quantised};

/// The GPU where it has the tensor-core kernels (sm_80+), else None after saying why.
fn mma_gpu() -> Option<&'static Gpu> {
    let g = gpu()?;
    if !g.has_mma() {
        println!("skipped: sm_{} has no tensor-core matmul", g.info().sm());
        return None;
    }
    Some(g)
}

const MATMUL_TYPES: [GgmlType; 8] =
    [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::IQ4XS];

/// A random weight, activations, the reference output and each output's Σ_j |w_j·x_j|.
struct MatmulData {
    bytes: Vec<u8>,
    x: Mat,
    want: Vec<f32>,
    scale: Vec<f32>,
}

fn matmul_data(rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize, n_tok: usize) -> MatmulData {
    let bytes = quantised(ty, rng, k, n_rows);
    let view = WeightView { ty, k, n_rows, data: &bytes };
    let x = Mat::from_vec(n_tok, k, rng.vec(n_tok * k, -2.0, 2.0));
    let want = reference::matmul(&view, &x).data;
    // scale[t][r] = Σ_j |W[r][j]·x[t][j]|
    let mut wr = vec![0f32; k];
    let mut scale = vec![0f32; n_tok * n_rows];
    for r in 0..n_rows {
        ember_gguf::quant::dequantize(ty, view.row(r), &mut wr).unwrap();
        for t in 0..n_tok {
            scale[t * n_rows + r] = wr.iter().zip(x.row(t)).map(|(a, b)| (a * b).abs()).sum();
        }
    }
    MatmulData { bytes, x, want, scale }
}

/// One matmul against the reference; returns max |err| / Σ_j |w_j·x_j|.
fn matmul_case(g: &Gpu, rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize, n_tok: usize) -> f32 {
    let MatmulData { bytes, x, want, scale } = matmul_data(rng, ty, k, n_rows, n_tok);
    let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
    let xb = g.upload(&x.data).unwrap();
    let mut y = poisoned(g, n_tok * n_rows);
    g.matmul(dw.all(), &xb, n_tok, &mut y).unwrap();
    let got = g.download(&y).unwrap();
    let what = format!("matmul {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
    let worst = check(&what, &got, &want, &scale, 0.0, 1e-5);

    rows_match_whole(g, &dw, n_tok, &got, &what, |w, y| g.matmul(w, &xb, n_tok, y));
    worst
}

/// A row range of the weight (rows 1..n_rows − 1: an expert of a stacked tensor) through `run`
/// gives exactly those rows of `whole`, the same call's output for all rows.
fn rows_match_whole(
    g: &Gpu,
    dw: &DeviceWeight,
    n_tok: usize,
    whole: &[f32],
    what: &str,
    run: impl Fn(ember_cuda::ops::WeightRef<'_>, &mut Buf<f32>) -> ember_cuda::Result<()>,
) {
    let n_rows = dw.n_rows;
    if n_rows <= 2 {
        return;
    }
    let (r0, nr) = (1, n_rows - 2);
    let mut y2 = poisoned(g, n_tok * nr);
    run(dw.rows(r0, nr).unwrap(), &mut y2).unwrap();
    let got2 = g.download(&y2).unwrap();
    for t in 0..n_tok {
        assert_eq!(&got2[t * nr..(t + 1) * nr], &whole[t * n_rows + r0..t * n_rows + r0 + nr], "{what}: rows {r0}..");
    }
}

/// The tensor-core matmul (every tile size, and the Fast pick) against the reference; returns
/// max |err| / Σ_j |w_j·x_j|. A row range (rows 1..) must equal the same rows of the whole.
fn matmul_mma_case(g: &Gpu, rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize, n_tok: usize) -> f32 {
    let MatmulData { bytes, x, want, scale } = matmul_data(rng, ty, k, n_rows, n_tok);
    let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
    let xb = g.upload(&x.data).unwrap();
    let mut worst = 0f32;
    for tile_tokens in [32, 64, 128] {
        let kernel = MatmulKernel::Mma { tile_tokens };
        let mut y = poisoned(g, n_tok * n_rows);
        g.matmul_kernel(dw.all(), &xb, n_tok, &mut y, kernel).unwrap();
        let got = g.download(&y).unwrap();
        let what = format!("matmul mma/{tile_tokens} {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
        worst = worst.max(check(&what, &got, &want, &scale, 1e-6, MMA_RTOL));
        rows_match_whole(g, &dw, n_tok, &got, &what, |w, y| g.matmul_kernel(w, &xb, n_tok, y, kernel));
    }
    // The int8 tiles (Q4_K, k % 256 == 0) against the reference on x's int8 round trip, which
    // is what they multiply: only the f32 sums' rounding is left.
    let int8 = ty == GgmlType::Q4K && k.is_multiple_of(256);
    let want_q = int8.then(|| {
        let view = WeightView { ty, k, n_rows, data: &bytes };
        reference::matmul(&view, &Mat::from_vec(n_tok, k, common::q8_round_trip(&x.data))).data
    });
    for tile_tokens in [32, 64] {
        let Some(want_q) = &want_q else { break };
        let kernel = MatmulKernel::Mma8 { tile_tokens };
        let mut y = poisoned(g, n_tok * n_rows);
        g.matmul_kernel(dw.all(), &xb, n_tok, &mut y, kernel).unwrap();
        let got = g.download(&y).unwrap();
        let what = format!("matmul mma8/{tile_tokens} {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
        let w8 = check(&what, &got, want_q, &scale, 1e-6, MMA8_RTOL);
        println!("MATMUL_MMA8_MEASURED {what}: max err / Σ|w·x| = {w8:.2e} (bound {MMA8_RTOL:e})");
        rows_match_whole(g, &dw, n_tok, &got, &what, |w, y| g.matmul_kernel(w, &xb, n_tok, y, kernel));
    }
    let mut y = poisoned(g, n_tok * n_rows);
    g.matmul_prec(dw.all(), &xb, n_tok, &mut y, Precision::Fast).unwrap();
    let what = format!("matmul Fast {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
    let got = g.download(&y).unwrap();
    match &want_q {
        Some(want_q) if g.uses_mma8(dw.all(), n_tok, Precision::Fast) => {
            check(&what, &got, want_q, &scale, 1e-6, MMA8_RTOL);
            worst
        }
        _ => worst.max(check(&what, &got, &want, &scale, 1e-6, MMA_RTOL)),
    }
}

/// The int8 tiles against the reference on the int8 round trip of x: the products are exact
/// integers, the per-block scales and the sums f32 (k <= 2048 here), so only f32 rounding is
/// left; 1e-5 of Σ|w·x| bounds it with room. Measured on the H100 (2026-12-06): 4.2e-8 (Q4_K
/// k = 1792, 61 rows, 17 tokens; the run stopped at the Fast pick's check, which then wrongly
/// expected the int8 tiles below MMA_MIN_TOKENS).
const MMA8_RTOL: f32 = 1e-5;

/// The tensor-core path rounds weights and activations to f16 (relative error at most
/// u = 2^-11 each) and sums in f32, so |err| <= (2u + u²)·Σ|w·x| + the f32 sum's error:
/// 1e-3 of Σ|w·x| bounds it (atol 1e-6 for f16 subnormals near zero). K-quant weights are
/// decoded in f16x2 (kernels/mma.cuh): the scale and minimum are rounded to f16 first, so a
/// weight d1·q − m1 errs by up to u·(|d1·q| + |m1| + |w|), more than u·|w| where the minimum
/// cancels much of d1·q; the K-quant figures below have 4x margin or more.
/// Measured on the H200 (2026-12-03, f32 decode): F32 7.4e-4 (uniform weights: many lose their
/// low bits), F16/BF16 4.2e-4, Q8_0 5.9e-5, Q4_K 8.0e-5, Q5_K 6.5e-5, Q6_K 9.0e-5, IQ4_XS
/// 5.2e-5; on the H100 with the f16x2 decode (2026-12-05): Q4_K 2.0e-4, Q5_K 2.5e-4, Q6_K
/// 9.0e-5.
const MMA_RTOL: f32 = 1e-3;

// Ragged shapes: n_tok not a multiple of any tile (17 .. 300), odd row counts (a partial
// 128-row tile), k any multiple of the block (float types: k odd, k % 8 != 0, and k % 4 != 0).
#[test]
fn matmul_mma_matches_reference() {
    let Some(g) = gpu() else { return };
    if !g.has_mma() {
        println!("skipped: sm_{} has no tensor-core matmul", g.info().sm());
        return;
    }
    let mut rng = Rng::new();
    for ty in MATMUL_TYPES {
        let block = ty.block_size();
        let mut worst = 0f32;
        for case in 0..5 {
            // k: the first two cases of the 256-wide types one and two super-blocks (fewer than
            // the int8 tiles' stages), the rest random.
            let k = match (block, case) {
                (1, _) => [37, 544, 1282, 3, 2048][case],
                (256, 0 | 1) => 256 * (1 + case),
                _ => block * (1 + rng.below(2048 / block)),
            };
            let n_rows = 1 + 2 * rng.below(200);
            let n_tok = [17, 33, 100, 129, 300][case];
            worst = worst.max(matmul_mma_case(g, &mut rng, ty, k, n_rows, n_tok));
        }
        println!("MATMUL_MMA_MEASURED {}: max err / Σ|w·x| = {worst:.2e} (bound {MMA_RTOL:e})", ty.name());
    }
}

// Dot products: rtol 1e-5 of Σ|w·x| (f32 sums of up to 16,384 terms against the f64
// reference). Measured on the H200 (2026-12-03, 3 runs): at most 2.6e-7 over the 8 types.
#[test]
fn matmul_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in MATMUL_TYPES {
        let block = ty.block_size();
        let mut worst = 0f32;
        for case in 0..8 {
            // k: a whole number of blocks; float types also get k not a multiple of 8 (tiled path).
            let k = if block == 1 { [37, 544, 1280, 3][case % 4] } else { block * (1 + rng.below(1280 / block)) };
            let n_rows = 1 + 2 * rng.below(150);
            let n_tok = [1, 3, 8, 9, 16, 17, 67, 1][case];
            worst = worst.max(matmul_case(g, &mut rng, ty, k, n_rows, n_tok));
        }
        println!("MATMUL_MEASURED {}: max err / Σ|w·x| = {worst:.2e}", ty.name());
    }
}

// Measured: at most 6.7e-8 of Σ|w·x|. The GEMV's block shapes: many rows per warp (n_rows over 4 blocks per SM), several token
// blocks (k = 4096 stages 3 tokens), one token per block (k = 12288), none (k = 16384: tiled).
#[test]
fn matmul_block_shapes_match_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (ty, k, n_rows, n_tok) in [
        (GgmlType::Q4K, 256, 20_001, 3),
        (GgmlType::Q6K, 4096, 37, 7),
        (GgmlType::F16, 12_288, 5, 2),
        (GgmlType::F32, 16_384, 3, 1),
        (GgmlType::Q8_0, 96, 70_001, 1),
    ] {
        let worst = matmul_case(g, &mut rng, ty, k, n_rows, n_tok);
        println!("MATMUL_MEASURED {} k={k} n_rows={n_rows} n_tok={n_tok}: max err / Σ|w·x| = {worst:.2e}", ty.name());
    }
}

fn run(g: &Gpu, w: &DeviceWeight, x: &Buf<f32>, n_tok: usize, kernel: Option<MatmulKernel>) -> Vec<f32> {
    let mut y = poisoned(g, n_tok * w.n_rows);
    match kernel {
        Some(kr) => g.matmul_kernel(w.all(), x, n_tok, &mut y, kr).unwrap(),
        None => g.matmul_prec(w.all(), x, n_tok, &mut y, Precision::Fast).unwrap(),
    }
    g.download(&y).unwrap()
}

/// Prompt-sized batches of small weights (the router, the shared expert's gate, alpha and beta)
/// take this kernel under Fast, passes of 16 tokens side by side: within MMV_RTOL of the
/// reference and the same bits as asking for the kernel; larger weights keep the tiles.
#[test]
fn mmv_takes_prompts_of_small_weights() {
    let Some(g) = mma_gpu() else { return };
    let mut rng = Rng::new();
    let k = 512;
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4K] {
        for (n_rows, n_tok) in [(1, 41), (32, 300), (256, 97), (MMV_PROMPT_MAX_ROWS, 64)] {
            let MatmulData { bytes, x, want, scale } = matmul_data(&mut rng, ty, k, n_rows, n_tok);
            let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
            let xb = g.upload(&x.data).unwrap();
            let what = format!("mmv prompt {} n_rows={n_rows} n_tok={n_tok}", ty.name());
            assert!(g.uses_mmv_prompt(k, n_rows, n_tok, Precision::Fast), "{what}: not picked");
            let got = run(g, &dw, &xb, n_tok, None);
            assert_eq!(got, run(g, &dw, &xb, n_tok, Some(MatmulKernel::Mmv)), "{what}: Fast pick");
            check(&what, &got, &want, &scale, 1e-6, MMV_RTOL);
        }
    }
    assert!(!g.uses_mmv_prompt(2048, MMV_PROMPT_MAX_ROWS + 1, 512, Precision::Fast));
    assert!(!g.uses_mmv_prompt(2048, 256, 512, Precision::Exact));
}

/// Several weights of one type in one launch (`matmul_multi_prec`, what `matmul_many` runs for
/// a layer's projections) give exactly what one launch per weight gives: the same kernel code
/// per row, so bit for bit. 1 to 4 weights of different row counts, every type: the GEMV
/// (Exact, 1 to 17 tokens) and, on sm_80+, `matmul_mmv` (Fast, 2 to 40 tokens); a mixed-type
/// or empty call is an error.
#[test]
fn multi_weight_launch_equals_one_launch_per_weight() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let mut forms = vec![(MatmulKernel::Gemv, Precision::Exact, [(1, 1), (2, 1), (3, 5), (4, 17)])];
    if g.has_mma() {
        forms.push((MatmulKernel::Mmv, Precision::Fast, [(1, 2), (2, 8), (3, 11), (4, 40)]));
    }
    for (kernel, precision, cases) in forms {
        for ty in MATMUL_TYPES {
            let k = 512;
            for (n_w, n_tok) in cases {
                let rows = [96usize, 33, 257, 8];
                let ws: Vec<_> = (0..n_w).map(|i| g.upload_weight(ty, k, rows[i], &quantised(ty, &mut rng, k, rows[i])).unwrap()).collect();
                let xb = g.upload(&rng.vec(n_tok * k, -2.0, 2.0)).unwrap();
                let one: Vec<Vec<f32>> = ws.iter().map(|w| run(g, w, &xb, n_tok, Some(kernel))).collect();
                let mut ys: Vec<Buf<f32>> = ws.iter().map(|w| poisoned(g, n_tok * w.n_rows)).collect();
                let refs: Vec<_> = ws.iter().map(|w| w.all()).collect();
                let mut ys_mut: Vec<&mut Buf<f32>> = ys.iter_mut().collect();
                g.matmul_multi_prec(&refs, &xb, n_tok, &mut ys_mut, precision).unwrap();
                for (i, y) in ys.iter().enumerate() {
                    assert_eq!(g.download(y).unwrap(), one[i], "{kernel:?} {} weight {i} of {n_w}, {n_tok} tokens", ty.name());
                }
            }
        }
    }
    let a = g.upload_weight(GgmlType::F32, 64, 4, &quantised(GgmlType::F32, &mut rng, 64, 4)).unwrap();
    let b = g.upload_weight(GgmlType::Q8_0, 64, 4, &quantised(GgmlType::Q8_0, &mut rng, 64, 4)).unwrap();
    let xb = g.upload(&rng.vec(64, -1.0, 1.0)).unwrap();
    let (mut y0, mut y1) = (poisoned(g, 4), poisoned(g, 4));
    assert!(g.matmul_multi(&[a.all(), b.all()], &xb, 1, &mut [&mut y0, &mut y1]).is_err(), "mixed types");
    assert!(g.matmul_multi(&[], &xb, 1, &mut []).is_err(), "no weights");
}

/// Weights and activations rounded to f16 (relative error at most u = 2^-11 each), f32 sums:
/// |err| <= (2u + u²)·Σ|w·x| + the f32 sum's error, so 1e-3 of Σ|w·x| bounds it for any data
/// (atol 1e-6 for f16 subnormals near zero), as for the prompt tiles (MMA_RTOL).
/// Measured on the H100 (2026-12-05): see MMV_MEASURED in the test's output.
const MMV_RTOL: f32 = 1e-3;

// Every type; k a multiple of 64 and of the block (one step per warp, fewer steps than warps,
// many steps); row counts that leave the last block of 32 partial (1, 31, 33, 257); token
// counts on both sides of each pass size (8 and 16) up to MMA_MIN_TOKENS. Both ways to the
// weights: the staged one where k % 256 == 0 and rows are whole 16-byte chunks (Q4_K, Q5_K
// always here; Q6_K, IQ4_XS and Q8_0 at some k; k = 3072 and 4608 stage in two and three
// rounds, the last partial), the lanes' loads elsewhere (float types, Q6_K at k = 256, ..).
#[test]
fn matmul_mmv_matches_reference() {
    let Some(g) = mma_gpu() else { return };
    let mut rng = Rng::new();
    for ty in MATMUL_TYPES {
        let unit = 256.max(ty.block_size());
        let mut worst = 0f32;
        for (case, n_tok) in [2, 7, 8, 9, 16, 17, 33, MMA_MIN_TOKENS].into_iter().enumerate() {
            let k =
                if ty.block_size() == 1 || ty == GgmlType::Q8_0 { [64, 192, 2048, 4608][case % 4] } else { unit * [1, 3, 12, 2][case % 4] };
            let n_rows = [1, 31, 33, 257][case % 4];
            let MatmulData { bytes, x, want, scale } = matmul_data(&mut rng, ty, k, n_rows, n_tok);
            let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
            let xb = g.upload(&x.data).unwrap();
            let got = run(g, &dw, &xb, n_tok, Some(MatmulKernel::Mmv));
            let what = format!("mmv {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
            worst = worst.max(check(&what, &got, &want, &scale, 1e-6, MMV_RTOL));
            // What Fast picks for this size is this kernel, bit for bit.
            assert!(g.uses_mmv(k, n_tok, Precision::Fast), "{what}: Fast does not pick mmv");
            assert_eq!(run(g, &dw, &xb, n_tok, None), got, "{what}: Fast pick");
            // A row range (an expert of a stacked tensor) gives the same rows bit for bit.
            if n_rows > 2 {
                let (r0, nr) = (1, n_rows - 2);
                let mut y2 = poisoned(g, n_tok * nr);
                g.matmul_kernel(dw.rows(r0, nr).unwrap(), &xb, n_tok, &mut y2, MatmulKernel::Mmv).unwrap();
                let got2 = g.download(&y2).unwrap();
                for t in 0..n_tok {
                    assert_eq!(&got2[t * nr..(t + 1) * nr], &got[t * n_rows + r0..t * n_rows + r0 + nr], "{what}: rows {r0}..");
                }
            }
        }
        println!("MMV_MEASURED {}: max err / Σ|w·x| = {worst:.2e} (bound {MMV_RTOL:e})", ty.name());
    }
}

/// One token is not this kernel's (the int8 GEMV's or the f32 GEMV's), nor is k off the
/// 64-weight step or a prompt-sized batch; asking for it where k does not fit is an error.
#[test]
fn mmv_applies_where_it_should() {
    let Some(g) = mma_gpu() else { return };
    assert!(!g.uses_mmv(2048, 1, Precision::Fast));
    assert!(!g.uses_mmv(2048, MMA_MIN_TOKENS + 1, Precision::Fast));
    assert!(!g.uses_mmv(2048, 16, Precision::Exact));
    assert!(!g.uses_mmv(96, 16, Precision::Fast));
    let mut rng = Rng::new();
    let dw = g.upload_weight(GgmlType::Q8_0, 96, 4, &quantised(GgmlType::Q8_0, &mut rng, 96, 4)).unwrap();
    let xb = g.upload(&rng.vec(2 * 96, -1.0, 1.0)).unwrap();
    let mut y = poisoned(g, 2 * 4);
    let err = g.matmul_kernel(dw.all(), &xb, 2, &mut y, MatmulKernel::Mmv).unwrap_err();
    assert!(err.to_string().contains("k % 64"), "{err}");
    // Fast at that k still runs (the GEMV) and matches the reference within MMV_RTOL.
    g.matmul_prec(dw.all(), &xb, 2, &mut y, Precision::Fast).unwrap();
    assert!(g.download(&y).unwrap().iter().all(|v| v.is_finite()));
}

/// GB/s of the matmul kernel on 35B-A3B-sized weights (weight bytes per call / time).
#[test]
#[ignore]
fn bench_matmul() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let cases: &[(&str, GgmlType, usize, usize)] = &[
        ("expert gate/up, one expert", GgmlType::Q4K, 2048, 512),
        ("expert gate/up, 256 experts stacked", GgmlType::Q4K, 2048, 512 * 256),
        ("expert down, 256 experts stacked", GgmlType::Q4K, 512, 2048 * 256),
        ("output head", GgmlType::Q6K, 2048, 248_320),
        ("2048 x 65536", GgmlType::Q5K, 2048, 65_536),
        ("2048 x 65536", GgmlType::Q8_0, 2048, 65_536),
        ("2048 x 65536", GgmlType::IQ4XS, 2048, 65_536),
        ("2048 x 65536", GgmlType::F16, 2048, 65_536),
        ("2048 x 65536", GgmlType::BF16, 2048, 65_536),
        ("2048 x 65536", GgmlType::F32, 2048, 65_536),
    ];
    for &(what, ty, k, n_rows) in cases {
        // Random bytes quantise slowly on the host for 500 MB; tile one quantised block of rows.
        let tile_rows = 256.min(n_rows);
        let tile = quantised(ty, &mut rng, k, tile_rows);
        let bytes: Vec<u8> = tile.iter().copied().cycle().take(tile.len() * n_rows / tile_rows).collect();
        let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
        for n_tok in [1, 8, 512] {
            if n_tok == 512 && n_rows > 65_536 {
                continue;
            }
            let x = g.upload(&rng.vec(n_tok * k, -1.0, 1.0)).unwrap();
            let mut y = g.alloc::<f32>(n_tok * n_rows).unwrap();
            g.matmul(dw.all(), &x, n_tok, &mut y).unwrap(); // warm-up (and compile)
            let iters = if bytes.len() < 10 << 20 { 200 } else { 20 };
            let ms = ms_per_call(g, iters, || g.matmul(dw.all(), &x, n_tok, &mut y));
            let gbs = bytes.len() as f64 / (ms as f64 * 1e-3) / 1e9;
            let tflops = 2.0 * (k * n_rows * n_tok) as f64 / (ms as f64 * 1e-3) / 1e12;
            println!(
                "bench matmul {:6} {what:38} k={k:5} rows={n_rows:6} tok={n_tok:3}: {:8.4} ms  {gbs:7.0} GB/s ({:4.1}% of 4300)  {tflops:6.2} TFLOP/s",
                ty.name(),
                ms,
                gbs / 43.0
            );
        }
    }
}

/// Prompt-sized matmuls at the 35B-A3B model's shapes: the f32 FMA tiles against the
/// tensor-core tiles (each tile size, and what Precision::Fast picks), 512 tokens; then the
/// GEMV against the tensor cores around the switch-over (MMA_MIN_TOKENS). TFLOP/s = 2·k·rows·tok
/// over GPU time (events around 10-50 back-to-back calls).
#[test]
#[ignore]
fn bench_matmul_prompt() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let weight = |rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize| {
        let tile_rows = 256.min(n_rows);
        let tile = quantised(ty, rng, k, tile_rows);
        let bytes: Vec<u8> = tile.iter().copied().cycle().take(tile.len() * n_rows / tile_rows).collect();
        g.upload_weight(ty, k, n_rows, &bytes).unwrap()
    };
    let time = |dw: &ember_cuda::ops::DeviceWeight, n_tok: usize, kernel: Option<MatmulKernel>| -> (f32, f64) {
        let x = g.upload(&vec![0.5f32; n_tok * dw.k]).unwrap();
        let mut y = g.alloc::<f32>(n_tok * dw.n_rows).unwrap();
        let mut call = || match kernel {
            Some(kr) => g.matmul_kernel(dw.all(), &x, n_tok, &mut y, kr),
            None => g.matmul_prec(dw.all(), &x, n_tok, &mut y, Precision::Fast),
        };
        call().unwrap(); // warm-up (and compile)
        let flop = 2.0 * (dw.k * dw.n_rows * n_tok) as f64;
        let iters = if flop > 1e11 { 5 } else { 30 };
        let ms = ms_per_call(g, iters, call);
        (ms, flop / (ms as f64 * 1e-3) / 1e12)
    };
    let cases: &[(&str, GgmlType, usize, usize)] = &[
        ("attn_qkv (DeltaNet)", GgmlType::Q4K, 2048, 8192),
        ("attn_gate", GgmlType::Q4K, 2048, 4096),
        ("ssm_out", GgmlType::Q4K, 4096, 2048),
        ("ssm_out", GgmlType::Q6K, 4096, 2048),
        ("shared expert gate", GgmlType::Q8_0, 2048, 512),
        ("2048 x 4096", GgmlType::Q5K, 2048, 4096),
        ("2048 x 4096", GgmlType::IQ4XS, 2048, 4096),
        ("2048 x 4096", GgmlType::F16, 2048, 4096),
        ("2048 x 4096", GgmlType::BF16, 2048, 4096),
        ("2048 x 4096", GgmlType::F32, 2048, 4096),
        ("output head", GgmlType::Q6K, 2048, 248_320),
    ];
    let n_tok = 512;
    for &(what, ty, k, n_rows) in cases {
        let dw = weight(&mut rng, ty, k, n_rows);
        let mut line = format!("bench prompt matmul {:6} {what:20} k={k:5} rows={n_rows:6} tok={n_tok}:", ty.name());
        let kernels = [
            ("tiled", Some(MatmulKernel::Tiled)),
            ("mma32", Some(MatmulKernel::Mma { tile_tokens: 32 })),
            ("mma64", Some(MatmulKernel::Mma { tile_tokens: 64 })),
            ("mma128", Some(MatmulKernel::Mma { tile_tokens: 128 })),
            ("mma8", (ty == GgmlType::Q4K).then_some(MatmulKernel::Mma8 { tile_tokens: 32 })),
            ("mma8/64", (ty == GgmlType::Q4K).then_some(MatmulKernel::Mma8 { tile_tokens: 64 })),
            ("fast", None),
        ];
        for (name, kr) in kernels {
            if name == "tiled" && n_rows > 65_536 {
                continue; // ~1 s a call
            }
            if name.starts_with("mma8") && kr.is_none() {
                continue; // Q4_K only
            }
            let (ms, tf) = time(&dw, n_tok, kr);
            line += &format!("  {name} {ms:.3} ms {tf:.1} TF");
        }
        println!("{line}");
    }
    // Q4_K's f16 tiles against the int8 ones (32 and 64 tokens a block) as prompts grow.
    for &(k, n_rows) in &[(2048, 8192), (4096, 2048)] {
        let dw = weight(&mut rng, GgmlType::Q4K, k, n_rows);
        for n_tok in [128, 512, 2048, 8192] {
            let mut line = format!("bench int8 tiles Q4_K k={k:5} rows={n_rows:5} tok={n_tok:5}:");
            for (name, kr) in [
                ("mma128", MatmulKernel::Mma { tile_tokens: 128 }),
                ("mma8", MatmulKernel::Mma8 { tile_tokens: 32 }),
                ("mma8/64", MatmulKernel::Mma8 { tile_tokens: 64 }),
            ] {
                let (ms, tf) = time(&dw, n_tok, Some(kr));
                line += &format!("  {name} {ms:.3} ms {tf:.1} TF");
            }
            println!("{line}");
        }
    }
    let dw = weight(&mut rng, GgmlType::Q4K, 2048, 4096);
    for n_tok in [8, 16, 17, 24, 32, 48, 64, 128] {
        let mut line = format!("bench switch-over Q4_K k=2048 rows=4096 tok={n_tok:3}:");
        // mmv, the f16 tiles and the int8 tiles beside the Fast pick: where one should hand
        // over to the next (MMA_MIN_TOKENS, 40, was set before the int8 tiles existed).
        for (name, kr) in [
            ("gemv", Some(MatmulKernel::Gemv)),
            ("tiled", Some(MatmulKernel::Tiled)),
            ("mmv", Some(MatmulKernel::Mmv)),
            ("mma32", Some(MatmulKernel::Mma { tile_tokens: 32 })),
            ("mma8", Some(MatmulKernel::Mma8 { tile_tokens: 32 })),
            ("fast", None),
        ] {
            let (ms, tf) = time(&dw, n_tok, kr);
            line += &format!("  {name} {:.1} us {tf:.2} TF", ms * 1e3);
        }
        println!("{line}");
    }
}

/// The 35B-A3B's decode weights at batch sizes 2 to 40: the f32 GEMV (what ran before), this
/// kernel and the 32-token tensor-core tiles, us a call and GB/s of weight bytes. Copies of the
/// weight are rotated so that each call reads from memory, not from a warm L2. Run it again
/// with `EMBER_MMV_STAGED=0` for the lanes' own loads where the staged path applies.
#[test]
#[ignore]
fn bench_mmv() {
    let Some(g) = mma_gpu() else { return };
    let mut rng = Rng::new();
    let cases: &[(&str, GgmlType, usize, usize)] = &[
        ("attn_qkv (DeltaNet)", GgmlType::Q4K, 2048, 8192),
        ("attn_gate (z)", GgmlType::Q4K, 2048, 4096),
        ("ssm_out", GgmlType::Q4K, 4096, 2048),
        ("ssm_out", GgmlType::Q6K, 4096, 2048),
        ("shared expert gate", GgmlType::Q4K, 2048, 512),
        ("shared expert down", GgmlType::Q6K, 512, 2048),
        ("2048 x 4096", GgmlType::Q8_0, 2048, 4096),
        ("output head", GgmlType::Q6K, 2048, 248_320),
    ];
    for &(what, ty, k, n_rows) in cases {
        let tile_rows = 256.min(n_rows);
        let tile = quantised(ty, &mut rng, k, tile_rows);
        let bytes: Vec<u8> = tile.iter().copied().cycle().take(tile.len() * n_rows / tile_rows).collect();
        let copies = (256usize << 20).div_ceil(bytes.len()).clamp(1, 64);
        let ws: Vec<DeviceWeight> = (0..copies).map(|_| g.upload_weight(ty, k, n_rows, &bytes).unwrap()).collect();
        for n_tok in [2, 4, 8, 16, 32, 40] {
            let x = g.upload(&rng.vec(n_tok * k, -1.0, 1.0)).unwrap();
            let mut y = g.alloc::<f32>(n_tok * n_rows).unwrap();
            let mut line = format!("bench mmv {:6} {what:20} k={k:5} rows={n_rows:6} tok={n_tok:2}:", ty.name());
            for (name, kr) in [("gemv", MatmulKernel::Gemv), ("mmv", MatmulKernel::Mmv), ("mma32", MatmulKernel::Mma { tile_tokens: 32 })] {
                let mut i = 0;
                let mut call = || {
                    i += 1;
                    g.matmul_kernel(ws[i % copies].all(), &x, n_tok, &mut y, kr)
                };
                call().unwrap();
                let iters = if bytes.len() > 100 << 20 { 10 } else { 200 };
                let ms = ms_per_call(g, iters, call);
                line += &format!("  {name} {:7.1} us {:5.0} GB/s", ms * 1e3, bytes.len() as f64 / (ms as f64 * 1e-3) / 1e9);
            }
            println!("{line}");
        }
    }
}

/// Prompt-sized batches (512 tokens) of the 35B's small weights: this kernel against the
/// tensor-core tiles (32 and 64 tokens x 128 rows a block), us a call (weights stay in L2).
#[test]
#[ignore]
fn bench_mmv_prompt() {
    let Some(g) = mma_gpu() else { return };
    let mut rng = Rng::new();
    let cases: &[(&str, GgmlType, usize, usize)] = &[
        ("router", GgmlType::F32, 2048, 256),
        ("alpha / beta", GgmlType::F32, 2048, 32),
        ("shared expert gate", GgmlType::F32, 2048, 1),
        ("shared expert gate/up", GgmlType::Q4K, 2048, 512),
        ("shared expert down", GgmlType::Q8_0, 512, 2048),
    ];
    for &(what, ty, k, n_rows) in cases {
        let dw = g.upload_weight(ty, k, n_rows, &quantised(ty, &mut rng, k, n_rows)).unwrap();
        for n_tok in [64, 512, 2048] {
            let x = g.upload(&rng.vec(n_tok * k, -1.0, 1.0)).unwrap();
            let mut y = g.alloc::<f32>(n_tok * n_rows).unwrap();
            let mut line = format!("bench mmv prompt {:6} {what:22} k={k:5} rows={n_rows:5} tok={n_tok:4}:", ty.name());
            for (name, kr) in [
                ("mmv", MatmulKernel::Mmv),
                ("mma32", MatmulKernel::Mma { tile_tokens: 32 }),
                ("mma64", MatmulKernel::Mma { tile_tokens: 64 }),
            ] {
                if kr == MatmulKernel::Mmv && !k.is_multiple_of(64) {
                    continue;
                }
                let mut call = || g.matmul_kernel(dw.all(), &x, n_tok, &mut y, kr);
                call().unwrap();
                let ms = ms_per_call(g, 50, call);
                line += &format!("  {name} {:7.1} us", ms * 1e3);
            }
            println!("{line}");
        }
    }
}
