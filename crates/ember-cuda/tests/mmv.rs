//! The small-batch tensor-core matmul (`matmul_mmv` in kernels/matmul.cu: 2 to
//! `MMA_MIN_TOKENS` tokens under Precision::Fast) against ember_ops::reference, and its
//! several-weight launch against one launch per weight.
//!
//! With no NVIDIA driver (or a GPU before sm_80) every test prints why and passes (CI has no
//! GPU). On a GPU: `cargo test -p ember-cuda --release --test mmv -- --test-threads=1`; the
//! timings: `... -- --ignored --nocapture bench`.

use std::sync::OnceLock;

use ember_cuda::ops::{DeviceWeight, MMA_MIN_TOKENS, MatmulKernel, Precision};
use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_ops::{Mat, WeightView, reference};
use ember_testkit::Rng;

fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    let g = GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) if g.has_mma() => Some(g),
        Ok(g) => {
            println!("skipped: sm_{} has no tensor-core matmul", g.info().sm());
            None
        }
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    });
    g.as_ref()
}

const TYPES: [GgmlType; 8] =
    [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::IQ4XS];

fn quantised(ty: GgmlType, rng: &mut Rng, k: usize, n_rows: usize) -> Vec<u8> {
    let w = rng.vec(k * n_rows, -1.0, 1.0);
    let mut bytes = vec![0u8; ty.row_bytes(k).unwrap() * n_rows];
    ember_gguf::quant::quantize(ty, &w, &mut bytes).unwrap();
    bytes
}

fn poisoned(g: &Gpu, n: usize) -> Buf<f32> {
    g.upload(&vec![f32::NAN; n]).unwrap()
}

fn run(g: &Gpu, w: &DeviceWeight, x: &Buf<f32>, n_tok: usize, kernel: Option<MatmulKernel>) -> Vec<f32> {
    let mut y = poisoned(g, n_tok * w.n_rows);
    match kernel {
        Some(kr) => g.matmul_kernel(w.all(), x, n_tok, &mut y, kr).unwrap(),
        None => g.matmul_prec(w.all(), x, n_tok, &mut y, Precision::Fast).unwrap(),
    }
    g.download(&y).unwrap()
}

/// Weights and activations rounded to f16 (relative error at most u = 2^-11 each), f32 sums:
/// |err| <= (2u + u²)·Σ|w·x| + the f32 sum's error, so 1e-3 of Σ|w·x| bounds it for any data
/// (atol 1e-6 for f16 subnormals near zero), as for the prompt tiles (tests/gpu.rs MMA_RTOL).
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
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in TYPES {
        let unit = 256.max(ty.block_size());
        let mut worst = 0f32;
        for (case, n_tok) in [2, 7, 8, 9, 16, 17, 33, MMA_MIN_TOKENS].into_iter().enumerate() {
            let k =
                if ty.block_size() == 1 || ty == GgmlType::Q8_0 { [64, 192, 2048, 4608][case % 4] } else { unit * [1, 3, 12, 2][case % 4] };
            let n_rows = [1, 31, 33, 257][case % 4];
            let bytes = quantised(ty, &mut rng, k, n_rows);
            let view = WeightView { ty, k, n_rows, data: &bytes };
            let x = Mat::from_vec(n_tok, k, rng.vec(n_tok * k, -2.0, 2.0));
            let want = reference::matmul(&view, &x).data;
            let mut wr = vec![0f32; k];
            let mut scale = vec![0f32; n_tok * n_rows];
            for r in 0..n_rows {
                ember_gguf::quant::dequantize(ty, view.row(r), &mut wr).unwrap();
                for t in 0..n_tok {
                    scale[t * n_rows + r] = wr.iter().zip(x.row(t)).map(|(a, b)| (a * b).abs()).sum();
                }
            }
            let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
            let xb = g.upload(&x.data).unwrap();
            let got = run(g, &dw, &xb, n_tok, Some(MatmulKernel::Mmv));
            let what = format!("mmv {} k={k} n_rows={n_rows} n_tok={n_tok}", ty.name());
            for (i, ((gv, wv), s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                let err = (gv - wv).abs();
                assert!(err <= 1e-6 + MMV_RTOL * s, "{what}: [{i}] got {gv}, want {wv} (err {err:e}, Σ|w·x| {s})");
                worst = worst.max(err / s.max(1e-30));
            }
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
    let Some(g) = gpu() else { return };
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

/// Several weights of one type in one launch (`matmul_multi_prec`, what `matmul_many` runs for
/// a layer's projections) give exactly what one Mmv launch per weight gives.
#[test]
fn multi_weight_mmv_equals_one_launch_per_weight() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in TYPES {
        let k = 512;
        for (n_w, n_tok) in [(1, 2), (2, 8), (3, 11), (4, 40)] {
            let rows = [96usize, 33, 257, 8];
            let ws: Vec<_> = (0..n_w).map(|i| g.upload_weight(ty, k, rows[i], &quantised(ty, &mut rng, k, rows[i])).unwrap()).collect();
            let xb = g.upload(&rng.vec(n_tok * k, -2.0, 2.0)).unwrap();
            let one: Vec<Vec<f32>> = ws.iter().map(|w| run(g, w, &xb, n_tok, Some(MatmulKernel::Mmv))).collect();
            let mut ys: Vec<Buf<f32>> = ws.iter().map(|w| poisoned(g, n_tok * w.n_rows)).collect();
            let refs: Vec<_> = ws.iter().map(|w| w.all()).collect();
            let mut ys_mut: Vec<&mut Buf<f32>> = ys.iter_mut().collect();
            g.matmul_multi_prec(&refs, &xb, n_tok, &mut ys_mut, Precision::Fast).unwrap();
            for (i, y) in ys.iter().enumerate() {
                assert_eq!(g.download(y).unwrap(), one[i], "{} weight {i} of {n_w}, {n_tok} tokens", ty.name());
            }
        }
    }
}

/// The 35B-A3B's decode weights at batch sizes 2 to 40: the f32 GEMV (what ran before), this
/// kernel and the 32-token tensor-core tiles, us a call and GB/s of weight bytes. Copies of the
/// weight are rotated so that each call reads from memory, not from a warm L2. Run it again
/// with `EMBER_MMV_STAGED=0` for the lanes' own loads where the staged path applies.
#[test]
#[ignore]
fn bench_mmv() {
    let Some(g) = gpu() else { return };
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
                let ms = g
                    .time_ms(|| {
                        for _ in 0..iters {
                            call()?;
                        }
                        Ok(())
                    })
                    .unwrap()
                    / iters as f32;
                line += &format!("  {name} {:7.1} us {:5.0} GB/s", ms * 1e3, bytes.len() as f64 / (ms as f64 * 1e-3) / 1e9);
            }
            println!("{line}");
        }
    }
}
