//! The wgmma building blocks (kernels/wgmma.cuh; step 0 of docs/attention-wgmma.md) on an sm_90
//! GPU: S = Q·Kᵀ [64 x 64] over 256 dims by shared-memory wgmmas (128-byte-swizzled tiles, K-major
//! descriptors) and O = P·V [64 x 256] by register-A wgmmas with V as stored (the transposed-B
//! descriptor), against the same sums on the host. The products of f16 values are exact in f32;
//! only the order of the f32 sums differs, so the bound is 1e-5 of the largest |value| (256 or 64
//! terms of |x| <= 1: a few ulp of the sum).
//!
//! With no NVIDIA driver, or a GPU other than compute capability 9.0, it prints why and passes.

use ember_cuda::Gpu;
use half::f16;

fn f16s(n: usize, seed: u64) -> Vec<f16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            f16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

fn max_err(got: &[f32], want: &[f64]) -> (f64, f64) {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let err = got.iter().zip(want).fold(0f64, |m, (g, w)| if g.is_nan() { f64::INFINITY } else { m.max((f64::from(*g) - w).abs()) });
    (err, scale)
}

#[test]
fn wgmma_products_match_the_host() {
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    if !gpu.has_wgmma() {
        println!("skipped: compute capability {} has no wgmma", gpu.info().sm());
        return;
    }
    let (q, k, v, p) = (f16s(64 * 256, 1), f16s(64 * 256, 2), f16s(64 * 256, 3), f16s(64 * 64, 4));
    let bits = |x: &[f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
    let up = |x: &[f16]| gpu.upload(&bits(x)).unwrap();
    let (qb, kb, vb, pb) = (up(&q), up(&k), up(&v), up(&p));
    let x = |h: f16| f64::from(h.to_f32());
    let want_s: Vec<f64> = (0..64 * 64).map(|ij| (0..256).map(|d| x(q[ij / 64 * 256 + d]) * x(k[ij % 64 * 256 + d])).sum()).collect();
    let want_o: Vec<f64> =
        (0..64 * 256).map(|in_| (0..64).map(|key| x(p[in_ / 256 * 64 + key]) * x(v[key * 256 + in_ % 256])).sum()).collect();
    // V's descriptor offsets as attention uses them first, then the pair swapped, so that a
    // failure says which way the hardware reads V.
    let mut results = Vec::new();
    for v_offsets in [(8192, 1024), (1024, 8192)] {
        let mut s = gpu.zeros::<f32>(64 * 64).unwrap();
        let mut o = gpu.zeros::<f32>(64 * 256).unwrap();
        gpu.wgmma_check(&qb, &kb, &vb, &pb, &mut s, &mut o, v_offsets).unwrap();
        let (s, o) = (gpu.download(&s).unwrap(), gpu.download(&o).unwrap());
        let (es, ss) = max_err(&s, &want_s);
        let (eo, so) = max_err(&o, &want_o);
        println!("V offsets {v_offsets:?}: S = Q·Kᵀ max error {es:.3e} of max |S| {ss:.3}; O = P·V max error {eo:.3e} of max |O| {so:.3}");
        println!("  S[0..4] {:?} want {:?}; O[0..4] {:?} want {:?}", &s[..4], &want_s[..4], &o[..4], &want_o[..4]);
        results.push((es <= 1e-5 * ss, eo <= 1e-5 * so));
    }
    assert!(results[0].0, "S = Q·Kᵀ by wgmma differs from the host (above)");
    assert!(results[0].1, "O = P·V with V offsets (8192, 1024) differs from the host; with (1024, 8192) it matches: {}", results[1].1);
}
