//! What the GPU test binaries share: the GPU (or why there is none), NaN-poisoned outputs, the
//! tolerance check and random quantised weights. Each test binary uses part of it.
#![allow(dead_code)]

use std::sync::OnceLock;

use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_testkit::Rng;

/// GPU 0, opened once per test binary; None (after saying why) without a driver, so every test
/// passes on a machine with no GPU (CI).
pub fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    let g = GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) => {
            let i = g.info();
            println!("GPU 0: {} sm_{} driver {} NVRTC {:?}", i.name, i.sm(), g.driver_version(), g.nvrtc().map(|n| n.version()));
            Some(g)
        }
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    });
    g.as_ref()
}

pub fn poisoned(g: &Gpu, n: usize) -> Buf<f32> {
    g.upload(&vec![f32::NAN; n]).unwrap()
}

/// Checks `|got − want| <= atol + rtol·scale[i]` everywhere; returns the largest
/// |got − want| / scale[i] (the "relative error" quoted in the tolerance comments).
pub fn check(what: &str, got: &[f32], want: &[f32], scale: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        let err = (g - w).abs();
        assert!(err <= atol + rtol * s.abs(), "{what}: [{i}] got {g}, want {w} (err {err:e}, scale {s}, atol {atol:e}, rtol {rtol:e})");
        worst = worst.max(err / s.abs().max(1e-30));
    }
    worst
}

/// Rows of uniform random weights in [-1, 1), quantised to `ty` as the file would hold them.
pub fn quantised(ty: GgmlType, rng: &mut Rng, k: usize, n_rows: usize) -> Vec<u8> {
    let w = rng.vec(k * n_rows, -1.0, 1.0);
    quantise_rows(ty, &w, k)
}

/// `w` (rows of k values) quantised to `ty`, rows spread over the host's threads: the same bytes
/// as one `quantize` call (rows are quantised independently), in a fraction of the time (the
/// 35B-shaped MoE cases quantise ~50 M weights: ~16 s on one core, most of a GPU test run).
pub fn quantise_rows(ty: GgmlType, w: &[f32], k: usize) -> Vec<u8> {
    let (n_rows, rb) = (w.len() / k, ty.row_bytes(k).unwrap());
    let mut bytes = vec![0u8; rb * n_rows];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 32);
    let per = n_rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (wc, bc) in w.chunks(per * k).zip(bytes.chunks_mut(per * rb)) {
            s.spawn(move || ember_gguf::quant::quantize(ty, wc, bc).unwrap());
        }
    });
    bytes
}

/// Milliseconds a call of `call` takes on the GPU: `iters` calls between two events (the
/// benchmarks' timing; the caller runs a first call before, for compiling and warming).
pub fn ms_per_call(g: &Gpu, iters: usize, mut call: impl FnMut() -> ember_cuda::Result<()>) -> f32 {
    g.time_ms(|| {
        for _ in 0..iters {
            call()?;
        }
        Ok(())
    })
    .unwrap()
        / iters as f32
}

/// x quantised as quantize_q8 does: per block of 32, d = max|x| / 127, q = x / d rounded to
/// nearest even; returns the dequantised values d·q.
pub fn q8_round_trip(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            b.iter().map(move |&v| if amax > 0.0 { (v / d).round_ties_even() * d } else { 0.0 }).collect::<Vec<_>>()
        })
        .collect()
}
