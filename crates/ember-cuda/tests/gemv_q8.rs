//! The int8-activation decode GEMV (kernels/gemv_q8.cu) against a host reference that
//! quantises x the same way, and against the exact product within the quantisation's bound.
//!
//! With no NVIDIA driver every test prints why and passes (CI has no GPU). On a GPU:
//! `cargo test -p ember-cuda --release --test gemv_q8 -- --test-threads=1`; the timings:
//! `... -- --ignored --nocapture bench`.

use std::sync::OnceLock;

use ember_cuda::ops::{Act, GEMV_Q8_MULTI, MoeExperts, MoeRouting, MoeSharedQ8, Precision, SharedWeights};
use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_ops::{Mat, WeightView, reference};
use ember_testkit::Rng;

mod common;
use common::{ms_per_call, q8_round_trip};

fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Option<Gpu>> = OnceLock::new();
    let g = GPU.get_or_init(|| match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    });
    g.as_ref()
}

fn quantised(ty: GgmlType, rng: &mut Rng, k: usize, n_rows: usize) -> Vec<u8> {
    let w = rng.vec(k * n_rows, -1.0, 1.0);
    common::quantise_rows(ty, &w, k)
}

/// The test weights quantised on many threads are the bytes one `quantize` call makes (host
/// only: runs without a GPU).
#[test]
fn quantise_rows_is_one_quantize_call() {
    let mut rng = Rng::new();
    for (ty, k, n_rows) in [(GgmlType::Q4K, 512, 37), (GgmlType::Q6K, 256, 5), (GgmlType::Q8_0, 96, 1), (GgmlType::Q4K, 2048, 64)] {
        let w = rng.vec(k * n_rows, -1.0, 1.0);
        let mut one = vec![0u8; ty.row_bytes(k).unwrap() * n_rows];
        ember_gguf::quant::quantize(ty, &w, &mut one).unwrap();
        assert_eq!(common::quantise_rows(ty, &w, k), one, "{ty:?} k={k} rows={n_rows}");
    }
}

struct Case {
    got: Vec<f32>,
    /// The product of the weight with the quantised x, in f64.
    want_q: Vec<f64>,
    /// Σ_j |w_j·xq_j| per row: the scale of the f32 sums' rounding.
    scale_q: Vec<f64>,
    /// The exact product (reference::matmul on the f32 x).
    want: Vec<f32>,
    /// Σ_j |w_j|·d_b(j)/2 per row: what rounding x to int8 can move a row's sum at most.
    bound: Vec<f64>,
}

fn run_case(g: &Gpu, rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize) -> Case {
    let bytes = quantised(ty, rng, k, n_rows);
    let view = WeightView { ty, k, n_rows, data: &bytes };
    let x = rng.vec(k, -2.0, 2.0);
    let xq = q8_round_trip(&x);
    let want = reference::matmul(&view, &Mat::from_vec(1, k, x.clone())).data;
    let mut w = vec![0f32; k];
    let (mut want_q, mut scale_q, mut bound) = (vec![0f64; n_rows], vec![0f64; n_rows], vec![0f64; n_rows]);
    let half_d: Vec<f64> = x.chunks(32).map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0 / 2.0).collect();
    for r in 0..n_rows {
        ember_gguf::quant::dequantize(ty, view.row(r), &mut w).unwrap();
        for j in 0..k {
            let p = w[j] as f64 * xq[j] as f64;
            want_q[r] += p;
            scale_q[r] += p.abs();
            bound[r] += (w[j] as f64).abs() * half_d[j / 32];
        }
    }
    let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
    let xb = g.upload(&x).unwrap();
    let mut y = g.upload(&vec![f32::NAN; n_rows]).unwrap();
    g.matmul_prec(dw.all(), &xb, 1, &mut y, Precision::Fast).unwrap();
    let got = g.download(&y).unwrap();

    // A row range (an expert of a stacked tensor) gives the same rows bit for bit.
    if n_rows > 2 {
        let (r0, nr) = (1, n_rows - 2);
        let mut y2: Buf<f32> = g.upload(&vec![f32::NAN; nr]).unwrap();
        g.matmul_prec(dw.rows(r0, nr).unwrap(), &xb, 1, &mut y2, Precision::Fast).unwrap();
        assert_eq!(g.download(&y2).unwrap(), &got[r0..r0 + nr], "{} k={k} rows {r0}..", ty.name());
    }
    Case { got, want_q, scale_q, want, bound }
}

/// Shapes of the 35B-A3B decode (k 2048 / 4096 / 512; 512 to 8192 rows), ragged ones (a
/// single row, odd row counts, k of one block, Q8_0 k of an odd number of blocks) and large
/// ones; every launch shape the launcher picks (rows spread over 1 to 16 workers, a row over
/// several warps, the row kernel of large weights).
const CASES: &[(GgmlType, usize, usize)] = &[
    (GgmlType::Q4K, 2048, 4096),
    (GgmlType::Q4K, 4096, 2048),
    (GgmlType::Q4K, 2048, 512),
    (GgmlType::Q4K, 512, 2048),
    (GgmlType::Q4K, 256, 7),
    (GgmlType::Q4K, 768, 1),
    (GgmlType::Q6K, 2048, 8192),
    (GgmlType::Q6K, 512, 2048),
    (GgmlType::Q6K, 2048, 33_001),
    (GgmlType::Q6K, 256, 5),
    (GgmlType::Q8_0, 2048, 8192),
    (GgmlType::Q8_0, 4096, 2048),
    (GgmlType::Q8_0, 512, 2048),
    (GgmlType::Q8_0, 96, 3),
    // Over 64 MiB (the output head's size): gemv_q8_rows, rows staged in shared memory, the
    // last warp's rows partial.
    (GgmlType::Q6K, 2048, 40_001),
    (GgmlType::Q8_0, 2048, 31_001),
];

/// Against the same product on the quantised x: only the f32 sums' order differs, so
/// |err| <= 1e-5·Σ|w·xq| (measured on the H200: see GEMV_Q8_ERR). Against the exact product:
/// within the int8 rounding's bound Σ|w|·d/2 (plus the same 1e-5), a bound no data can exceed.
#[test]
fn gemv_q8_matches_quantised_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let mut worst = 0f64;
    let mut worst_exact = 0f64;
    for &(ty, k, n_rows) in CASES {
        let c = run_case(g, &mut rng, ty, k, n_rows);
        for r in 0..n_rows {
            let got = c.got[r] as f64;
            let err = (got - c.want_q[r]).abs();
            assert!(
                err <= 1e-5 * c.scale_q[r],
                "{} k={k} rows={n_rows}: [{r}] got {got}, want {} (err {err:e}, scale {:e})",
                ty.name(),
                c.want_q[r],
                c.scale_q[r]
            );
            worst = worst.max(err / c.scale_q[r]);
            let err_exact = (got - c.want[r] as f64).abs();
            assert!(
                err_exact <= c.bound[r] + 1e-5 * c.scale_q[r],
                "{} k={k} rows={n_rows}: [{r}] got {got}, exact {} (err {err_exact:e}, int8 bound {:e})",
                ty.name(),
                c.want[r],
                c.bound[r]
            );
            worst_exact = worst_exact.max(err_exact / c.scale_q[r]);
        }
    }
    println!("gemv_q8: max |err| / Σ|w·xq| = {worst:e} (against the quantised x), {worst_exact:e} (against the exact product)");
}

/// Several weights in one launch give each weight's outputs bit for bit.
#[test]
fn gemv_q8_multi_equals_one_launch_per_weight() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
        let k = 2048;
        let rows = [8192, 4096, 32, 32];
        assert_eq!(rows.len(), GEMV_Q8_MULTI);
        let ws: Vec<_> = rows.iter().map(|&n| g.upload_weight(ty, k, n, &quantised(ty, &mut rng, k, n)).unwrap()).collect();
        let x = g.upload(&rng.vec(k, -2.0, 2.0)).unwrap();
        let mut ys: Vec<Buf<f32>> = rows.iter().map(|&n| g.upload(&vec![f32::NAN; n]).unwrap()).collect();
        let refs: Vec<_> = ws.iter().map(|w| w.all()).collect();
        let mut ys_mut: Vec<&mut Buf<f32>> = ys.iter_mut().collect();
        g.gemv_q8(&refs, &x, &mut ys_mut).unwrap();
        for (i, w) in ws.iter().enumerate() {
            let mut one = g.upload(&vec![f32::NAN; rows[i]]).unwrap();
            g.gemv_q8(&[w.all()], &x, &mut [&mut one]).unwrap();
            assert_eq!(g.download(&ys[i]).unwrap(), g.download(&one).unwrap(), "{} weight {i}", ty.name());
        }
    }
    // Weights of several types in one launch (gemv_q8_mixed: DeltaNet's Q6_K qkv with its Q4_K
    // gate, a and b), each against its type's own launch.
    let k = 2048;
    let mixed = [(GgmlType::Q6K, 8192), (GgmlType::Q4K, 4096), (GgmlType::Q8_0, 32), (GgmlType::Q4K, 32)];
    let ws: Vec<_> = mixed.iter().map(|&(ty, n)| g.upload_weight(ty, k, n, &quantised(ty, &mut rng, k, n)).unwrap()).collect();
    let x = g.upload(&rng.vec(k, -2.0, 2.0)).unwrap();
    let mut ys: Vec<Buf<f32>> = mixed.iter().map(|&(_, n)| g.upload(&vec![f32::NAN; n]).unwrap()).collect();
    let refs: Vec<_> = ws.iter().map(|w| w.all()).collect();
    let mut ys_mut: Vec<&mut Buf<f32>> = ys.iter_mut().collect();
    g.gemv_q8(&refs, &x, &mut ys_mut).unwrap();
    for (i, w) in ws.iter().enumerate() {
        let mut one = g.upload(&vec![f32::NAN; mixed[i].1]).unwrap();
        g.gemv_q8(&[w.all()], &x, &mut [&mut one]).unwrap();
        assert_eq!(g.download(&ys[i]).unwrap(), g.download(&one).unwrap(), "mixed launch: {} weight {i}", mixed[i].0.name());
    }
}

/// rms_norm_q8 writes what rms_norm writes, and an int8 copy the GEMV reads as it reads
/// quantize_q8's of that output: the products equal bit for bit.
#[test]
fn rms_norm_q8_leaves_the_int8_copy_of_its_output() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for d in [2048, 4096, 96] {
        let x = g.upload(&rng.vec(d, -3.0, 3.0)).unwrap();
        let w = g.upload(&rng.vec(d, 0.5, 1.5)).unwrap();
        let (mut a, mut b) = (g.upload(&vec![f32::NAN; d]).unwrap(), g.upload(&vec![f32::NAN; d]).unwrap());
        g.rms_norm(&x, 1, d, &w, 1e-6, &mut a).unwrap();
        let before = g.q8_generation();
        let generation = g.rms_norm_q8(&x, 1, d, &w, 1e-6, &mut b).unwrap();
        assert!(generation > before && g.q8_generation() == generation);
        assert_eq!(g.download(&a).unwrap(), g.download(&b).unwrap(), "d={d}: rms_norm_q8's output");
        let ty = GgmlType::Q8_0;
        let wt = g.upload_weight(ty, d, 33, &quantised(ty, &mut rng, d, 33)).unwrap();
        let (mut y1, mut y2) = (g.upload(&[f32::NAN; 33]).unwrap(), g.upload(&[f32::NAN; 33]).unwrap());
        g.gemv_q8_quantized(&[wt.all()], d, &mut [&mut y1]).unwrap();
        g.gemv_q8(&[wt.all()], &b, &mut [&mut y2]).unwrap();
        assert_eq!(g.download(&y1).unwrap(), g.download(&y2).unwrap(), "d={d}: the GEMV on the norm's int8 copy");
    }
}

/// The fused launches that leave an int8 copy (the gated norm of a DeltaNet layer, the gate of an
/// attention layer, the residual add with its norm) write what the unfused ops write, and an
/// int8 copy the GEMV reads as it reads quantize_q8's of that output: bit for bit.
#[test]
fn fused_q8_launches_match_the_unfused_ops() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let ty = GgmlType::Q8_0;
    // The GEMV on the int8 scratch as it stands, and on quantize_q8 of `y`.
    let gemv_pair = |g: &Gpu, wt: &ember_cuda::ops::DeviceWeight, y: &Buf<f32>, what: &str| {
        let (mut y1, mut y2) = (g.upload(&[f32::NAN; 33]).unwrap(), g.upload(&[f32::NAN; 33]).unwrap());
        g.gemv_q8_quantized(&[wt.all()], wt.k, &mut [&mut y1]).unwrap();
        g.gemv_q8(&[wt.all()], y, &mut [&mut y2]).unwrap();
        assert_eq!(g.download(&y1).unwrap(), g.download(&y2).unwrap(), "{what}: the GEMV on the int8 copy");
    };
    for (d, gw) in [(4096, 128), (2048, 2048), (96, 32)] {
        let wt = g.upload_weight(ty, d, 33, &quantised(ty, &mut rng, d, 33)).unwrap();
        let x = g.upload(&rng.vec(d, -3.0, 3.0)).unwrap();
        let z = g.upload(&rng.vec(d, -6.0, 6.0)).unwrap();
        let w = g.upload(&rng.vec(gw, 0.5, 1.5)).unwrap();
        for act in [Act::Silu, Act::Sigmoid] {
            // rms_norm_gate(_q8) against rms_norm then gate.
            let (mut a, mut b, mut c) = (g.upload(&vec![f32::NAN; d]).unwrap(), g.alloc::<f32>(d).unwrap(), g.alloc::<f32>(d).unwrap());
            g.rms_norm(&x, 1, d, &w, 1e-6, &mut a).unwrap();
            g.gate(&mut a, &z, d, act).unwrap();
            g.rms_norm_gate(&x, 1, d, &w, 1e-6, &z, act, &mut b).unwrap();
            g.rms_norm_gate_q8(&x, 1, d, &w, 1e-6, &z, act, &mut c).unwrap();
            let want = g.download(&a).unwrap();
            let what = format!("rms_norm_gate d={d} g={gw} {act:?}");
            assert_eq!(g.download(&b).unwrap(), want, "{what}");
            assert_eq!(g.download(&c).unwrap(), want, "{what} (q8)");
            gemv_pair(g, &wt, &c, &what);
            // gate_q8 against gate.
            let (mut y1, mut y2) = (g.upload(&want).unwrap(), g.upload(&want).unwrap());
            g.gate(&mut y1, &z, d, act).unwrap();
            g.gate_q8(&mut y2, &z, d, act).unwrap();
            let what = format!("gate_q8 d={d} {act:?}");
            assert_eq!(g.download(&y1).unwrap(), g.download(&y2).unwrap(), "{what}");
            gemv_pair(g, &wt, &y2, &what);
        }
        if gw == d {
            // add_rms_norm(_q8) against add then rms_norm.
            let a = g.upload(&rng.vec(d, -1.0, 1.0)).unwrap();
            let h0 = rng.vec(d, -3.0, 3.0);
            let (mut h1, mut h2, mut h3) = (g.upload(&h0).unwrap(), g.upload(&h0).unwrap(), g.upload(&h0).unwrap());
            let (mut o1, mut o2, mut o3) = (g.alloc::<f32>(d).unwrap(), g.alloc::<f32>(d).unwrap(), g.alloc::<f32>(d).unwrap());
            g.add(&mut h1, &a, d).unwrap();
            g.rms_norm(&h1, 1, d, &w, 1e-6, &mut o1).unwrap();
            g.add_rms_norm(&mut h2, &a, 1, d, &w, 1e-6, &mut o2).unwrap();
            g.add_rms_norm_q8(&mut h3, &a, 1, d, &w, 1e-6, &mut o3).unwrap();
            let (hw, ow) = (g.download(&h1).unwrap(), g.download(&o1).unwrap());
            for (h, o, what) in [(&h2, &o2, "add_rms_norm"), (&h3, &o3, "add_rms_norm_q8")] {
                assert_eq!(g.download(h).unwrap(), hw, "{what} d={d}: h");
                assert_eq!(g.download(o).unwrap(), ow, "{what} d={d}: out");
            }
            gemv_pair(g, &wt, &o3, "add_rms_norm_q8");
        }
    }
}

/// The MoE on int8 activations (`Gpu::moe_q8`) against a host model of it: x quantised per
/// token, h = silu(gate·xq) ⊙ up·xq, h quantised, out = Σ_j w_j·down_j·hq_j, in f64; with a
/// shared expert in the same kernels, out also gets sigmoid(gs)·down_s·hq_s. Only the GPU's f32
/// sums differ, and where one moves an h value across a rounding boundary, one int8 step of h:
/// |err| <= 2e-4·Σ_j |w_j|·Σ_m |down_j[m]·hq_j[m]| (measured on the H200: see the printed line).
#[test]
fn moe_q8_matches_quantised_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    // (gate/up type, down type, d, n_ff, experts, k, tokens, shared expert (gate/up, down, n_ff)):
    // the 35B Q4_K_M shape with its shared expert, mixed unit widths both ways (a Q8_0 shared
    // expert beside K-quant experts, K-quant beside Q8_0), and routed experts alone.
    type Case = (GgmlType, GgmlType, usize, usize, usize, usize, usize, Option<(GgmlType, GgmlType, usize)>);
    let cases: [Case; 6] = [
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, 8, 1, None),
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, 8, 1, Some((GgmlType::Q4K, GgmlType::Q6K, 512))),
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 6, 3, 5, None),
        (GgmlType::Q8_0, GgmlType::Q8_0, 96, 64, 5, 5, 3, None),
        (GgmlType::Q6K, GgmlType::Q8_0, 256, 512, 4, 2, 2, Some((GgmlType::Q8_0, GgmlType::Q8_0, 64))),
        (GgmlType::Q8_0, GgmlType::Q8_0, 256, 64, 5, 2, 1, Some((GgmlType::Q4K, GgmlType::Q6K, 256))),
    ];
    let deq = |ty: GgmlType, bytes: &[u8], k: usize, n: usize| {
        let mut all = vec![0f32; k * n];
        let rb = ty.row_bytes(k).unwrap();
        for r in 0..n {
            ember_gguf::quant::dequantize(ty, &bytes[r * rb..(r + 1) * rb], &mut all[r * k..(r + 1) * k]).unwrap();
        }
        all
    };
    let dot = |w: &[f32], x: &[f32]| w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
    // silu(gate_r·xq) ⊙ up_r·xq for rows r0.. of n_ff, quantised as the kernels quantise h.
    let hidden = |gf: &[f32], uf: &[f32], r0: usize, n_ff: usize, xq: &[f32]| {
        let d = xq.len();
        let h: Vec<f32> = (r0..r0 + n_ff)
            .map(|r| {
                let gv = dot(&gf[r * d..(r + 1) * d], xq) as f32;
                gv / (1.0 + (-gv).exp()) * dot(&uf[r * d..(r + 1) * d], xq) as f32
            })
            .collect();
        q8_round_trip(&h)
    };
    let mut worst = 0f64;
    for (ty_gu, ty_dn, d, n_ff, n_expert, k, n_tok, shared) in cases {
        let gate = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let up = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let down = quantised(ty_dn, &mut rng, n_ff, n_expert * d);
        let (gf, uf, df) =
            (deq(ty_gu, &gate, d, n_expert * n_ff), deq(ty_gu, &up, d, n_expert * n_ff), deq(ty_dn, &down, n_ff, n_expert * d));
        let sh = shared.map(|(ty_s, ty_sd, n_ff_s)| {
            let (sg, su, sd) =
                (quantised(ty_s, &mut rng, d, n_ff_s), quantised(ty_s, &mut rng, d, n_ff_s), quantised(ty_sd, &mut rng, n_ff_s, d));
            let f = (deq(ty_s, &sg, d, n_ff_s), deq(ty_s, &su, d, n_ff_s), deq(ty_sd, &sd, n_ff_s, d));
            let w = (
                g.upload_weight(ty_s, d, n_ff_s, &sg).unwrap(),
                g.upload_weight(ty_s, d, n_ff_s, &su).unwrap(),
                g.upload_weight(ty_sd, n_ff_s, d, &sd).unwrap(),
            );
            (n_ff_s, f, w, rng.vec(n_tok, -2.0, 2.0))
        });
        let x = rng.vec(n_tok * d, -1.0, 1.0);
        let logits = Mat::from_vec(n_tok, n_expert, rng.vec(n_tok * n_expert, -3.0, 3.0));
        let routing = reference::route(&logits, k);
        let (mut want, mut scale) = (vec![0f64; n_tok * d], vec![0f64; n_tok * d]);
        let mut add = |t: usize, wt: f64, hq: &[f32], rows: &dyn Fn(usize) -> std::ops::Range<usize>, df: &[f32]| {
            for i in 0..d {
                let row = &df[rows(i)];
                want[t * d + i] += wt * dot(row, hq);
                scale[t * d + i] += wt.abs() * row.iter().zip(hq).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>();
            }
        };
        for t in 0..n_tok {
            let xq = q8_round_trip(&x[t * d..(t + 1) * d]);
            for j in 0..k {
                let (e, wt) = (routing.ids[t * k + j].0 as usize, routing.weights[t * k + j] as f64);
                let hq = hidden(&gf, &uf, e * n_ff, n_ff, &xq);
                add(t, wt, &hq, &|i| (e * d + i) * n_ff..(e * d + i + 1) * n_ff, &df);
            }
            if let Some((n_ff_s, (sgf, suf, sdf), _, gs)) = &sh {
                let hq = hidden(sgf, suf, 0, *n_ff_s, &xq);
                let wt = 1.0 / (1.0 + (-gs[t] as f64).exp());
                add(t, wt, &hq, &|i| i * n_ff_s..(i + 1) * n_ff_s, sdf);
            }
        }
        let (gw, uw, dw) = (
            g.upload_weight(ty_gu, d, n_expert * n_ff, &gate).unwrap(),
            g.upload_weight(ty_gu, d, n_expert * n_ff, &up).unwrap(),
            g.upload_weight(ty_dn, n_ff, n_expert * d, &down).unwrap(),
        );
        let ids: Vec<u32> = routing.ids.iter().map(|e| e.0 as u32).collect();
        let (idb, wb) = (g.upload(&ids).unwrap(), g.upload(&routing.weights).unwrap());
        let n_ff_s = sh.as_ref().map_or(0, |s| s.0);
        let mut h = g.upload(&vec![f32::NAN; n_tok * (k * n_ff + n_ff_s)]).unwrap();
        let mut out = g.upload(&vec![f32::NAN; n_tok * d]).unwrap();
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        assert!(g.moe_uses_q8(experts, Precision::Fast));
        let gsb = sh.as_ref().map(|s| g.upload(&s.3).unwrap());
        let shared =
            sh.as_ref().zip(gsb.as_ref()).map(|((_, _, (sg, su, sd), _), gs)| MoeSharedQ8 { gate: sg, up: su, down: sd, gate_logit: gs });
        assert!(shared.is_none_or(|s| s.fits(experts, d)));
        let r = MoeRouting { ids: &idb, weights: &wb, k };
        g.moe_q8(experts, shared, &g.upload(&x).unwrap(), n_tok, r, &mut h, &mut out, false).unwrap();
        let got = g.download(&out).unwrap();
        let what = format!(
            "moe_q8 {}/{} d={d} n_ff={n_ff} experts={n_expert} k={k} t={n_tok} shared={:?}",
            ty_gu.name(),
            ty_dn.name(),
            shared.map(|s| (s.gate.ty.name(), s.down.ty.name(), n_ff_s))
        );
        for i in 0..n_tok * d {
            let err = (got[i] as f64 - want[i]).abs();
            assert!(err <= 2e-4 * scale[i], "{what}: [{i}] got {}, want {} (err {err:e}, scale {:e})", got[i], want[i], scale[i]);
            worst = worst.max(err / scale[i]);
        }
    }
    println!("moe_q8: max |err| / scale = {worst:e}");
}

/// The device's Q6_K repack (kernels/q6_repack.cu), run by the upload itself, gives
/// `q6k_repack_row`'s bytes, row by row, for rows of whole 16-byte chunks (k = 2048) and not
/// (k = 512, an expert's down); rows written later into part of the weight (`write_rows_parts`,
/// as the expert tier does) are repacked and the rest left as they were.
#[test]
fn q6k_repack_matches_the_host_layout() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (k, n) in [(2048, 37), (512, 300)] {
        let bytes = quantised(GgmlType::Q6K, &mut rng, k, n);
        let mut w = g.upload_weight(GgmlType::Q6K, k, n, &bytes).unwrap();
        let rb = w.row_bytes;
        let repacked = |b: &[u8]| -> Vec<u8> { b.chunks(rb).flat_map(ember_cuda::ops::q6k_repack_row).collect() };
        let mut want = repacked(&bytes);
        assert_eq!(w.download(g).unwrap(), want, "k = {k}");
        let (row0, m) = (5, 9);
        let new = quantised(GgmlType::Q6K, &mut rng, k, m);
        let (a, b) = new.split_at(4 * rb);
        w.write_rows_parts(g, row0, &[a, b]).unwrap();
        want[row0 * rb..(row0 + m) * rb].copy_from_slice(&repacked(&new));
        assert_eq!(w.download(g).unwrap(), want, "k = {k}, rows {row0}..{}", row0 + m);
    }
}

/// Time per call of the int8 GEMV and the f32 GEMV (Exact) at the 35B-A3B decode shapes, as
/// GB/s of weight bytes (the H200 copies ~4,300 GB/s).
#[test]
#[ignore]
fn bench_gemv_q8() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let cases: &[(&str, GgmlType, usize, usize)] = &[
        ("output head", GgmlType::Q6K, 2048, 248_320),
        ("deltanet qkv", GgmlType::Q6K, 2048, 8192),
        ("deltanet gate", GgmlType::Q4K, 2048, 4096),
        ("deltanet out", GgmlType::Q4K, 4096, 2048),
        ("shared gate", GgmlType::Q4K, 2048, 512),
        ("shared down", GgmlType::Q6K, 512, 2048),
        ("ud qkv", GgmlType::Q8_0, 2048, 8192),
        ("ud out", GgmlType::Q8_0, 4096, 2048),
        ("ud shared down", GgmlType::Q8_0, 512, 2048),
    ];
    for &(what, ty, k, n_rows) in cases {
        let tile_rows = 256.min(n_rows);
        let tile = quantised(ty, &mut rng, k, tile_rows);
        let bytes: Vec<u8> = tile.iter().copied().cycle().take(tile.len() * n_rows / tile_rows).collect();
        let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
        let x = g.upload(&rng.vec(k, -1.0, 1.0)).unwrap();
        let mut y = g.alloc::<f32>(n_rows).unwrap();
        let mut line = format!("bench gemv {:5} {what:15} k={k:5} rows={n_rows:6}:", ty.name());
        for prec in [Precision::Exact, Precision::Fast] {
            g.matmul_prec(dw.all(), &x, 1, &mut y, prec).unwrap();
            let iters = if bytes.len() < 10 << 20 { 500 } else { 50 };
            let ms = ms_per_call(g, iters, || g.matmul_prec(dw.all(), &x, 1, &mut y, prec));
            let gbs = bytes.len() as f64 / (ms as f64 * 1e-3) / 1e9;
            line += &format!("  {prec:?} {:7.2} us {gbs:6.0} GB/s", ms * 1e3);
        }
        println!("{line}");
    }
}

/// `moe_route` (one cluster launch: the residual add, the norm with its int8 copy, the router's
/// and the gate row's GEMV, the route) gives the bits of the three launches it replaces:
/// `add_rms_norm_q8`, the F32 GEMV of both weights in one launch, `route`. Shapes: the 35B's, a
/// half-size one, a tiny one (one value per lane of chunk, one warp a row) and experts that
/// leave blocks without rows.
#[test]
fn moe_route_matches_its_three_launches() {
    let Some(g) = gpu() else { return };
    g.set_moe_route(true); // off by default (docs/perf.md g33); this binary's other tests do not read it
    let mut rng = Rng::new();
    let f32_rows = |w: &[f32]| -> Vec<u8> { w.iter().flat_map(|v| v.to_le_bytes()).collect() };
    let ty = GgmlType::Q8_0;
    let mut ran = 0;
    for (d, n_expert, k) in [(2048, 256, 8), (1024, 128, 8), (96, 8, 2), (2048, 60, 4)] {
        if !g.uses_moe_route(d, n_expert, k) {
            println!("moe_route d={d} experts={n_expert} k={k}: not on this GPU (sm_{})", g.info().sm());
            continue;
        }
        ran += 1;
        let h0 = rng.vec(d, -3.0, 3.0);
        let m = g.upload(&rng.vec(d, -1.0, 1.0)).unwrap();
        let w = g.upload(&rng.vec(d, 0.5, 1.5)).unwrap();
        let router = g.upload_weight(GgmlType::F32, d, n_expert, &f32_rows(&rng.vec(d * n_expert, -0.1, 0.1))).unwrap();
        let gate = g.upload_weight(GgmlType::F32, d, 1, &f32_rows(&rng.vec(d, -0.1, 0.1))).unwrap();
        let wt = g.upload_weight(ty, d, 33, &quantised(ty, &mut rng, d, 33)).unwrap();
        let nan = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
        // The three launches.
        let (mut h1, mut f1, mut y1) = (g.upload(&h0).unwrap(), nan(d), nan(33));
        g.add_rms_norm_q8(&mut h1, &m, 1, d, &w, 1e-6, &mut f1).unwrap();
        g.gemv_q8_quantized(&[wt.all()], d, &mut [&mut y1]).unwrap();
        let (mut logits, mut gs1) = (nan(n_expert), nan(1));
        g.matmul_multi_prec(&[router.all(), gate.all()], &f1, 1, &mut [&mut logits, &mut gs1], Precision::Fast).unwrap();
        let (mut ids1, mut w1) = (g.upload(&vec![u32::MAX; k]).unwrap(), nan(k));
        g.route(&logits, 1, n_expert, k, &mut ids1, &mut w1).unwrap();
        // The one launch.
        let (mut h2, mut f2, mut y2, mut gs2, mut w2) = (g.upload(&h0).unwrap(), nan(d), nan(33), nan(1), nan(k));
        let mut ids2 = g.upload(&vec![u32::MAX; k]).unwrap();
        let before = g.q8_generation();
        let generation = g.moe_route(&mut h2, &m, &w, 1e-6, router.all(), gate.all(), k, &mut f2, &mut gs2, &mut ids2, &mut w2).unwrap();
        assert!(generation > before && g.q8_generation() == generation);
        g.gemv_q8_quantized(&[wt.all()], d, &mut [&mut y2]).unwrap();
        let what = format!("d={d} experts={n_expert} k={k}");
        assert_eq!(g.download(&h2).unwrap(), g.download(&h1).unwrap(), "{what}: h + m");
        assert_eq!(g.download(&f2).unwrap(), g.download(&f1).unwrap(), "{what}: the norm");
        assert_eq!(g.download(&y2).unwrap(), g.download(&y1).unwrap(), "{what}: the GEMV on the int8 copy");
        assert_eq!(g.download(&gs2).unwrap(), g.download(&gs1).unwrap(), "{what}: the gate row's dot");
        assert_eq!(g.download(&ids2).unwrap(), g.download(&ids1).unwrap(), "{what}: the experts");
        assert_eq!(g.download(&w2).unwrap(), g.download(&w1).unwrap(), "{what}: their weights");
        println!("moe_route {what}: the three launches' bits");
    }
    println!("moe_route: {ran} of 4 shapes ran");
}

/// One token's MoE in one launch (`moe_fused_q8`, then the norm that adds its experts' rows)
/// against the two launches it replaces (`moe_q8`, then `add_rms_norm_q8`) and a host reference
/// that quantises x and h as the kernels do: the 35B's shape (d 2,048, 256 experts, k 8, n_ff
/// 512) with each down type the kernel has, a Q8_0 shared expert, a narrower d, and an expert id
/// out of range (NaN, as the two launches give). Both paths stay within moe_q8's bound of the
/// reference (2e-4 of Σ|w·h| a row; measured: see the printed worst), the residual and the norm
/// follow, the norm's int8 copy is what a GEMV then reads, and two runs give the same bits; with
/// the routing inside the launch, the route kernel's ids and weights and the same parts.
#[test]
fn moe_fused_matches_the_two_launches() {
    let Some(g) = gpu() else { return };
    g.set_moe_fused(true); // off by default until measured; this binary's other tests do not read it
    let mut rng = Rng::new();
    let deq = |ty: GgmlType, bytes: &[u8], k: usize, n: usize| {
        let mut all = vec![0f32; k * n];
        let rb = ty.row_bytes(k).unwrap();
        for r in 0..n {
            ember_gguf::quant::dequantize(ty, &bytes[r * rb..(r + 1) * rb], &mut all[r * k..(r + 1) * k]).unwrap();
        }
        all
    };
    let dot = |w: &[f32], x: &[f32]| w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
    let n_ff = 512;
    // (routed down type, shared gate/up and down types, d, experts, k, an id out of range)
    type Case = (GgmlType, GgmlType, GgmlType, usize, usize, usize, bool);
    let cases: [Case; 5] = [
        (GgmlType::Q6K, GgmlType::Q4K, GgmlType::Q6K, 2048, 256, 8, false),
        (GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K, 2048, 64, 8, false),
        (GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q8_0, 2048, 32, 8, false),
        (GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q4K, 1024, 16, 4, false),
        (GgmlType::Q6K, GgmlType::Q4K, GgmlType::Q6K, 2048, 64, 8, true),
    ];
    let (mut worst_fused, mut worst_two, mut ran) = (0f64, 0f64, 0);
    for (ty_dn, ty_s, ty_sd, d, n_expert, k, bad_id) in cases {
        let (gate, up) = (quantised(GgmlType::Q4K, &mut rng, d, n_expert * n_ff), quantised(GgmlType::Q4K, &mut rng, d, n_expert * n_ff));
        let down = quantised(ty_dn, &mut rng, n_ff, n_expert * d);
        let (sg, su, sd) = (quantised(ty_s, &mut rng, d, n_ff), quantised(ty_s, &mut rng, d, n_ff), quantised(ty_sd, &mut rng, n_ff, d));
        let (gw, uw, dw) = (
            g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &gate).unwrap(),
            g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &up).unwrap(),
            g.upload_weight(ty_dn, n_ff, n_expert * d, &down).unwrap(),
        );
        let (sgw, suw, sdw) = (
            g.upload_weight(ty_s, d, n_ff, &sg).unwrap(),
            g.upload_weight(ty_s, d, n_ff, &su).unwrap(),
            g.upload_weight(ty_sd, n_ff, d, &sd).unwrap(),
        );
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        let what =
            format!("down {}, shared {}/{}, d={d} experts={n_expert} k={k} bad id={bad_id}", ty_dn.name(), ty_s.name(), ty_sd.name());
        if !g.uses_moe_fused(experts, SharedWeights { gate: &sgw, up: &suw, down: &sdw }, d) {
            println!("moe_fused {what}: not on this GPU (sm_{})", g.info().sm());
            continue;
        }
        ran += 1;
        let x = rng.vec(d, -1.0, 1.0);
        let logits = Mat::from_vec(1, n_expert, rng.vec(n_expert, -3.0, 3.0));
        let routing = reference::route(&logits, k);
        let mut ids: Vec<u32> = routing.ids.iter().map(|e| e.0 as u32).collect();
        if bad_id {
            ids[3] = n_expert as u32 + 5;
        }
        let gs = rng.vec(1, -2.0, 2.0);
        let h0 = rng.vec(d, -3.0, 3.0);
        let nw = g.upload(&rng.vec(d, 0.5, 1.5)).unwrap();
        let probe = g.upload_weight(GgmlType::Q8_0, d, 33, &quantised(GgmlType::Q8_0, &mut rng, d, 33)).unwrap();
        let (idb, wb, gsb, xb) =
            (g.upload(&ids).unwrap(), g.upload(&routing.weights).unwrap(), g.upload(&gs).unwrap(), g.upload(&x).unwrap());
        let shared = MoeSharedQ8 { gate: &sgw, up: &suw, down: &sdw, gate_logit: &gsb };
        let r = MoeRouting { ids: &idb, weights: &wb, k };
        let nan = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
        let mut hs = nan(k * n_ff + n_ff);
        // The two launches, the norm after them, a GEMV on its int8 copy.
        let mut out = nan(d);
        g.moe_q8(experts, Some(shared), &xb, 1, r, &mut hs, &mut out, false).unwrap();
        let (mut h1, mut f1, mut y1) = (g.upload(&h0).unwrap(), nan(d), nan(33));
        g.add_rms_norm_q8(&mut h1, &out, 1, d, &nw, 1e-6, &mut f1).unwrap();
        g.gemv_q8_quantized(&[probe.all()], d, &mut [&mut y1]).unwrap();
        // The one launch, twice; the norm over its parts.
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut parts = nan((k + 1) * d);
            g.moe_fused_q8(experts, shared, &xb, r, None, &hs, &mut parts, false).unwrap();
            let (mut h2, mut f2, mut y2) = (g.upload(&h0).unwrap(), nan(d), nan(33));
            let before = g.q8_generation();
            let generation = g.add_rms_norm_parts(&mut h2, &parts, k + 1, 1, d, &nw, 1e-6, &mut f2, true).unwrap();
            assert!(generation.is_some_and(|n| n > before && g.q8_generation() == n), "{what}: the int8 copy's generation");
            g.gemv_q8_quantized(&[probe.all()], d, &mut [&mut y2]).unwrap();
            // The parts summed into an output as something reading the MoE's output gets it.
            let mut summed = nan(d);
            g.add_parts(&mut summed, &parts, k + 1, d, true).unwrap();
            let mut h3 = g.upload(&h0).unwrap();
            g.add_parts(&mut h3, &parts, k + 1, d, false).unwrap();
            runs.push((
                g.download(&parts).unwrap(),
                g.download(&h2).unwrap(),
                g.download(&f2).unwrap(),
                g.download(&y2).unwrap(),
                g.download(&summed).unwrap(),
                g.download(&h3).unwrap(),
            ));
        }
        assert!(runs[0] == runs[1] || bad_id, "{what}: two runs differ");
        let (parts, h2, f2, y2, summed, h3) = &runs[0];
        let (out, h1, f1, y1) = (g.download(&out).unwrap(), g.download(&h1).unwrap(), g.download(&f1).unwrap(), g.download(&y1).unwrap());
        // Σ parts in row order is what the norm added, what add_parts wrote and added.
        let psum: Vec<f32> = (0..d).map(|i| (1..=k).fold(parts[i], |s, j| s + parts[j * d + i])).collect();
        if bad_id {
            assert!(out.iter().all(|v| v.is_nan()) && psum.iter().all(|v| v.is_nan()) && h2.iter().all(|v| v.is_nan()), "{what}: NaN");
            assert!(summed.iter().all(|v| v.is_nan()) && h3.iter().all(|v| v.is_nan()), "{what}: NaN through add_parts");
            println!("moe_fused {what}: NaN as the two launches");
            continue;
        }
        for i in 0..d {
            assert_eq!(summed[i].to_bits(), psum[i].to_bits(), "{what}: add_parts set [{i}]");
            assert_eq!(h3[i].to_bits(), (h0[i] + psum[i]).to_bits(), "{what}: add_parts [{i}]");
            assert_eq!(h2[i].to_bits(), (h0[i] + psum[i]).to_bits(), "{what}: the norm's residual [{i}]");
        }
        // The reference: x and each expert's h quantised as the kernels do, sums in f64.
        let xq = q8_round_trip(&x);
        // Only the routed experts' rows (expert e's gate/up rows, then its down rows).
        let expert = |e: usize| {
            let (rg, rd) = (GgmlType::Q4K.row_bytes(d).unwrap() * n_ff, ty_dn.row_bytes(n_ff).unwrap() * d);
            (
                deq(GgmlType::Q4K, &gate[e * rg..(e + 1) * rg], d, n_ff),
                deq(GgmlType::Q4K, &up[e * rg..(e + 1) * rg], d, n_ff),
                deq(ty_dn, &down[e * rd..(e + 1) * rd], n_ff, d),
            )
        };
        let (sgf, suf, sdf) = (deq(ty_s, &sg, d, n_ff), deq(ty_s, &su, d, n_ff), deq(ty_sd, &sd, n_ff, d));
        let hidden = |gf: &[f32], uf: &[f32], r0: usize| {
            let h: Vec<f32> = (r0..r0 + n_ff)
                .map(|r| {
                    let gv = dot(&gf[r * d..(r + 1) * d], &xq) as f32;
                    gv / (1.0 + (-gv).exp()) * dot(&uf[r * d..(r + 1) * d], &xq) as f32
                })
                .collect();
            q8_round_trip(&h)
        };
        let (mut want, mut scale) = (vec![0f64; d], vec![0f64; d]);
        let mut add = |wt: f64, hq: &[f32], rows: &dyn Fn(usize) -> std::ops::Range<usize>, df: &[f32]| {
            for i in 0..d {
                let row = &df[rows(i)];
                want[i] += wt * dot(row, hq);
                scale[i] += wt.abs() * row.iter().zip(hq).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>();
            }
        };
        for (&e, &wt) in ids.iter().zip(&routing.weights) {
            let (gf, uf, df) = expert(e as usize);
            let hq = hidden(&gf, &uf, 0);
            add(wt as f64, &hq, &|i| i * n_ff..(i + 1) * n_ff, &df);
        }
        let hq = hidden(&sgf, &suf, 0);
        add(1.0 / (1.0 + (-gs[0] as f64).exp()), &hq, &|i| i * n_ff..(i + 1) * n_ff, &sdf);
        for i in 0..d {
            for (name, got, worst) in [("fused", psum[i], &mut worst_fused), ("two launches", out[i], &mut worst_two)] {
                let err = (got as f64 - want[i]).abs();
                assert!(err <= 2e-4 * scale[i], "{what}: {name} [{i}] got {got}, want {} (err {err:e}, scale {:e})", want[i], scale[i]);
                *worst = worst.max(err / scale[i]);
            }
        }
        // The routing inside the launch (EMBER_MOE_FUSED=2): the route kernel's ids and weights,
        // and the parts of the launch given them.
        g.set_moe_fused_route(true);
        if g.moe_fused_routes(n_expert, k) {
            let lb = g.upload(&logits.data).unwrap();
            let (mut ids_r, mut w_r) = (g.upload(&vec![u32::MAX; k]).unwrap(), nan(k));
            g.route(&lb, 1, n_expert, k, &mut ids_r, &mut w_r).unwrap();
            let (ids_in, w_in) = (g.upload(&vec![u32::MAX; k]).unwrap(), nan(k));
            let (mut parts_in, mut parts_ex) = (nan((k + 1) * d), nan((k + 1) * d));
            g.moe_fused_q8(experts, shared, &xb, MoeRouting { ids: &ids_in, weights: &w_in, k }, Some(&lb), &hs, &mut parts_in, false)
                .unwrap();
            g.moe_fused_q8(experts, shared, &xb, MoeRouting { ids: &ids_r, weights: &w_r, k }, None, &hs, &mut parts_ex, false).unwrap();
            assert_eq!(g.download(&ids_in).unwrap(), g.download(&ids_r).unwrap(), "{what}: the ids routed in the launch");
            let bits = |b: &Buf<f32>| g.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w_in), bits(&w_r), "{what}: the weights routed in the launch");
            assert_eq!(bits(&parts_in), bits(&parts_ex), "{what}: the parts with the routing in the launch");
        }
        g.set_moe_fused_route(false);
        // The norm of h and its int8 copy through a GEMV: what moe's output difference moves.
        let rel = |a: &[f32], b: &[f32]| {
            let m = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            a.iter().zip(b).fold(0f32, |e, (x, y)| e.max((x - y).abs())) / m
        };
        let (eh, ef, ey) = (rel(h2, &h1), rel(f2, &f1), rel(y2, &y1));
        assert!(eh <= 1e-5 && ef <= 1e-5 && ey <= 2e-2, "{what}: h {eh:e}, norm {ef:e}, GEMV on the int8 copy {ey:e}");
        println!("moe_fused {what}: h {eh:e}, norm {ef:e}, GEMV on its int8 copy {ey:e} of the two launches' (max abs / max)");
    }
    println!("moe_fused: {ran} of 5 cases ran; max |err| / scale: fused {worst_fused:e}, two launches {worst_two:e}");
}
