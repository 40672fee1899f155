//! The kernels' compile-time switches that promise the plain kernels' bits (`EMBER_KERNEL_DEFINES`
//! = `EMBER_NORM_W_EARLY`, `EMBER_GEMV_W_EARLY`, `EMBER_MOE_DOWN_W_EARLY`: reads moved before
//! `pdl_enter`, the same arithmetic in the same order): the same ops on two GPU handles, the
//! second opened after the variable names the switches (so its kernels compile with them), give
//! the same bits, NaNs of out-of-range experts included.
//!
//! One test alone in its binary: it sets an environment variable, which no other thread of this
//! process reads meanwhile. With no NVIDIA driver it prints why and passes (CI has no GPU).

use ember_cuda::ops::{Act, MOE_MISS, MoeExperts, MoeRouting, MoeSharedQ8, MoeSlots, Precision};
use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_testkit::Rng;

mod common;
use common::quantised;

const SWITCHES: &str = "EMBER_NORM_W_EARLY,EMBER_GEMV_W_EARLY,EMBER_MOE_DOWN_W_EARLY";

/// A MoE case: (gate/up type, down type, d, n_ff, experts, slots (None: every expert at its own
/// index), k, tokens, shared expert (gate/up type, down type, n_ff)).
type MoeCase = (GgmlType, GgmlType, usize, usize, usize, Option<Vec<u32>>, usize, usize, Option<(GgmlType, GgmlType, usize)>);

/// A GEMV: weight type, k, rows, the weight's bytes, x.
type GemvInputs = (GgmlType, usize, usize, Vec<u8>, Vec<f32>);

/// The shared expert's gate, up and down bytes and its gate logit per token.
type SharedInputs = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<f32>);

struct MoeInputs {
    case: MoeCase,
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
    shared: Option<SharedInputs>,
    x: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
}

/// Every input, made once on the host so both handles see the same values.
struct Inputs {
    x: Vec<f32>,
    a: Vec<f32>,
    z: Vec<f32>,
    big: Vec<f32>,
    w_norm: Vec<f32>,
    w_head: Vec<f32>,
    w_big: Vec<f32>,
    /// K-quant GEMV weights (type, k, rows, bytes) and their x: the 35B's shapes, k of 17
    /// super-blocks over enough rows that each row gets one worker (units past the 8 a thread
    /// reads early) and over few (16 workers a row), and a ragged one; Q4_K and Q6_K.
    gemvs: Vec<GemvInputs>,
    moes: Vec<MoeInputs>,
}

fn inputs(rng: &mut Rng) -> Inputs {
    let shapes = [(2048, 4096), (4096, 2048), (17 * 256, 9000), (17 * 256, 64), (256, 7), (512, 2048)];
    let gemvs = [GgmlType::Q4K, GgmlType::Q6K]
        .into_iter()
        .flat_map(|ty| shapes.map(|(k, rows)| (ty, k, rows)))
        .map(|(ty, k, rows)| (ty, k, rows, quantised(ty, rng, k, rows), rng.vec(k, -2.0, 2.0)))
        .collect();
    let miss = MOE_MISS;
    let cases: Vec<MoeCase> = vec![
        // The 35B Q4_K_M decode MoE with its shared expert; one token routed to an expert out of
        // range (NaN out); a partial residency with misses; a Q4_K down over several tokens.
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, None, 8, 1, Some((GgmlType::Q4K, GgmlType::Q6K, 512))),
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, None, 8, 2, None),
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 8, Some(vec![0, miss, 1, 2, miss, 3, miss, 4]), 3, 4, None),
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 6, None, 3, 5, None),
    ];
    let moes = cases
        .into_iter()
        .enumerate()
        .map(|(ci, case)| {
            let (ty_gu, ty_dn, d, n_ff, n_expert, ref slots, k, n_tok, shared) = case;
            let ns = slots.as_ref().map_or(n_expert, |s| s.iter().filter(|&&v| v != MOE_MISS).count());
            let mut ids = Vec::with_capacity(n_tok * k);
            for t in 0..n_tok {
                let mut taken = Vec::new();
                while taken.len() < k {
                    let e = rng.below(n_expert) as u32;
                    if !taken.contains(&e) {
                        taken.push(e);
                    }
                }
                if ci == 1 && t == 1 {
                    taken[2] = n_expert as u32 + 3;
                }
                ids.extend(taken);
            }
            MoeInputs {
                gate: quantised(ty_gu, rng, d, ns * n_ff),
                up: quantised(ty_gu, rng, d, ns * n_ff),
                down: quantised(ty_dn, rng, n_ff, ns * d),
                shared: shared.map(|(ty_s, ty_sd, n_ff_s)| {
                    (
                        quantised(ty_s, rng, d, n_ff_s),
                        quantised(ty_s, rng, d, n_ff_s),
                        quantised(ty_sd, rng, n_ff_s, d),
                        rng.vec(n_tok, -2.0, 2.0),
                    )
                }),
                x: rng.vec(n_tok * d, -1.0, 1.0),
                ids,
                weights: rng.vec(n_tok * k, 0.05, 0.5),
                case,
            }
        })
        .collect();
    Inputs {
        x: rng.vec(3 * 4096, -2.0, 2.0),
        a: rng.vec(3 * 4096, -1.0, 1.0),
        z: rng.vec(3 * 4096, -3.0, 3.0),
        big: rng.vec(8192, -2.0, 2.0),
        w_norm: rng.vec(2048, 0.5, 1.5),
        w_head: rng.vec(128, 0.5, 1.5),
        w_big: rng.vec(8192, 0.5, 1.5),
        gemvs,
        moes,
    }
}

/// Every op the switches touch, each output's bits under a name.
fn run(g: &Gpu, inp: &Inputs) -> Vec<(String, Vec<u32>)> {
    let bits = |b: &Buf<f32>| g.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let nan = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
    let mut outs = Vec::new();
    let eps = 1e-6;
    let (wn, wh, wb) = (g.upload(&inp.w_norm).unwrap(), g.upload(&inp.w_head).unwrap(), g.upload(&inp.w_big).unwrap());
    // Int8 GEMVs that read each q8 norm's int8 copy from the scratch (k 2048 and 4096).
    let (_, k2, r2, b2, _) = &inp.gemvs[0];
    let (_, k4, r4, b4, _) = &inp.gemvs[1];
    let (w2, w4) = (g.upload_weight(GgmlType::Q4K, *k2, *r2, b2).unwrap(), g.upload_weight(GgmlType::Q4K, *k4, *r4, b4).unwrap());
    let read_q8 = |w: &ember_cuda::ops::DeviceWeight, k: usize, rows: usize| {
        let mut y = nan(rows);
        g.gemv_q8_quantized(&[w.all()], k, &mut [&mut y]).unwrap();
        bits(&y)
    };

    // Norms of the model's width, one row and three, plain and q8, with the residual add.
    for n in [1, 3] {
        let x = g.upload(&inp.x[..n * 2048]).unwrap();
        let mut out = nan(n * 2048);
        g.rms_norm(&x, n, 2048, &wn, eps, &mut out).unwrap();
        outs.push((format!("rms_norm n={n}"), bits(&out)));
        let mut out = nan(n * 2048);
        g.rms_norm_q8(&x, n, 2048, &wn, eps, &mut out).unwrap();
        outs.push((format!("rms_norm_q8 n={n}"), bits(&out)));
        if n == 1 {
            outs.push(("rms_norm_q8's int8 copy".into(), read_q8(&w2, 2048, *r2)));
        }
        let a = g.upload(&inp.a[..n * 2048]).unwrap();
        for q8 in [false, true] {
            let mut h = g.upload(&inp.x[..n * 2048]).unwrap();
            let mut out = nan(n * 2048);
            if q8 {
                g.add_rms_norm_q8(&mut h, &a, n, 2048, &wn, eps, &mut out).unwrap();
            } else {
                g.add_rms_norm(&mut h, &a, n, 2048, &wn, eps, &mut out).unwrap();
            }
            outs.push((format!("add_rms_norm q8={q8} n={n}: h"), bits(&h)));
            outs.push((format!("add_rms_norm q8={q8} n={n}: out"), bits(&out)));
            if q8 && n == 1 {
                outs.push(("add_rms_norm_q8's int8 copy".into(), read_q8(&w2, 2048, *r2)));
            }
        }
    }
    // Gated norms per 128-wide head (DeltaNet's: 32 heads of one row), both activations.
    let (x, z) = (g.upload(&inp.x[..4096]).unwrap(), g.upload(&inp.z[..4096]).unwrap());
    for act in [Act::Silu, Act::Sigmoid] {
        let mut out = nan(4096);
        g.rms_norm_gate(&x, 1, 4096, &wh, eps, &z, act, &mut out).unwrap();
        outs.push((format!("rms_norm_gate {act:?}"), bits(&out)));
        let mut out = nan(4096);
        g.rms_norm_gate_q8(&x, 1, 4096, &wh, eps, &z, act, &mut out).unwrap();
        outs.push((format!("rms_norm_gate_q8 {act:?}"), bits(&out)));
        outs.push((format!("rms_norm_gate_q8 {act:?}'s int8 copy"), read_q8(&w4, 4096, *r4)));
    }
    // A group wider than the registers hold (8,192 at 1,024 threads): the plain path.
    let xb = g.upload(&inp.big).unwrap();
    let mut out = nan(8192);
    g.rms_norm(&xb, 1, 8192, &wb, eps, &mut out).unwrap();
    outs.push(("rms_norm g=8192".into(), bits(&out)));

    // K-quant decode GEMVs.
    for (ty, k, rows, bytes, x) in &inp.gemvs {
        let w = g.upload_weight(*ty, *k, *rows, bytes).unwrap();
        let mut y = nan(*rows);
        g.matmul_prec(w.all(), &g.upload(x).unwrap(), 1, &mut y, Precision::Fast).unwrap();
        outs.push((format!("gemv {} k={k} rows={rows}", ty.name()), bits(&y)));
    }

    // Decode MoEs.
    for m in &inp.moes {
        let (ty_gu, ty_dn, d, n_ff, n_expert, ref slots, k, n_tok, shared) = m.case;
        let ns = slots.as_ref().map_or(n_expert, |s| s.iter().filter(|&&v| v != MOE_MISS).count());
        let (gw, uw, dw) = (
            g.upload_weight(ty_gu, d, ns * n_ff, &m.gate).unwrap(),
            g.upload_weight(ty_gu, d, ns * n_ff, &m.up).unwrap(),
            g.upload_weight(ty_dn, n_ff, ns * d, &m.down).unwrap(),
        );
        let slot_of = slots.as_ref().map(|s| g.upload(s).unwrap());
        let experts =
            MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: slot_of.as_ref().map(|s| MoeSlots { slot_of: s, n_slots: ns }) };
        let sh = shared.zip(m.shared.as_ref()).map(|((ty_s, ty_sd, n_ff_s), (sg, su, sd, gs))| {
            (
                n_ff_s,
                g.upload_weight(ty_s, d, n_ff_s, sg).unwrap(),
                g.upload_weight(ty_s, d, n_ff_s, su).unwrap(),
                g.upload_weight(ty_sd, n_ff_s, d, sd).unwrap(),
                g.upload(gs).unwrap(),
            )
        });
        let shared = sh.as_ref().map(|(_, sg, su, sd, gs)| MoeSharedQ8 { gate: sg, up: su, down: sd, gate_logit: gs });
        let n_ff_s = sh.as_ref().map_or(0, |s| s.0);
        let (idb, wtb) = (g.upload(&m.ids).unwrap(), g.upload(&m.weights).unwrap());
        let mut h = nan(n_tok * (k * n_ff + n_ff_s));
        let mut out = nan(n_tok * d);
        let r = MoeRouting { ids: &idb, weights: &wtb, k };
        g.moe_q8(experts, shared, &g.upload(&m.x).unwrap(), n_tok, r, &mut h, &mut out, false).unwrap();
        let what = format!("moe_q8 {}/{} d={d} n_ff={n_ff} experts={n_expert} slots={slots:?} k={k} t={n_tok}", ty_gu.name(), ty_dn.name());
        outs.push((what, bits(&out)));
    }
    outs
}

#[test]
fn early_read_switches_give_the_plain_kernels_bits() {
    if std::env::var_os("EMBER_KERNEL_DEFINES").is_some() {
        println!("skipped: EMBER_KERNEL_DEFINES is set, so the first handle would not run the plain kernels");
        return;
    }
    let plain = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let mut rng = Rng::new();
    let inp = inputs(&mut rng);
    let want = run(&plain, &inp);
    drop(plain);
    // SAFETY: this binary's only test runs here, and nothing else in the process reads or
    // writes the environment meanwhile (the plain handle is gone; the switched one is opened
    // after this line).
    unsafe { std::env::set_var("EMBER_KERNEL_DEFINES", SWITCHES) };
    let switched = Gpu::new(0).unwrap();
    let got = run(&switched, &inp);
    assert_eq!(got.len(), want.len());
    let mut nans = 0;
    for ((what, w), (_, g)) in want.iter().zip(&got) {
        let first = w.iter().zip(g).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "{what} with {SWITCHES}: [{}] {:08x} against the plain {:08x}",
            first.unwrap(),
            g[first.unwrap()],
            w[first.unwrap()]
        );
        nans += w.iter().filter(|b| f32::from_bits(**b).is_nan()).count();
    }
    // The out-of-range expert's token must have come out NaN in both.
    assert!(nans > 0, "no NaN output: the out-of-range expert case did not flag");
    println!("{} outputs, bit for bit with {SWITCHES} ({nans} NaN values, from the out-of-range expert)", want.len());
}
