//! The kernels' compile-time switches that promise the plain kernels' bits (`EMBER_KERNEL_DEFINES`
//! = `EMBER_ROUTE_REDUX`: the route's rounds by warp reductions; `EMBER_MOE_GU_UNROLL`: the
//! decode MoE's gate/up loop unrolled whole; `EMBER_MOE_SHARED_FIRST`: the decode MoE's gate/up
//! in two launches, the shared expert's first, which the handle reads when it opens): the same
//! arithmetic in the same order. The same ops on two GPU handles, the second opened after the
//! variable names the switches (so its kernels compile with them), give the same bits and ids:
//! ties, NaN logits, out-of-range experts and misses included.
//!
//! What this cannot see: whether a switch took effect (a misspelt define compiles the plain
//! kernel, and below sm_80 the route falls back to it; the A/B timings show it), and races of
//! the programmatic launches (these eager launches have no programmatic edges; the model tests
//! under CUDA graphs do).
//!
//! One test alone in its binary: it sets an environment variable, which no other thread of this
//! process reads meanwhile. With no NVIDIA driver it prints why and passes (CI has no GPU).

use ember_cuda::ops::{MOE_MISS, MoeExperts, MoeRouting, MoeSharedQ8, MoeSlots};
use ember_cuda::{Buf, Gpu};
use ember_gguf::GgmlType;
use ember_testkit::Rng;

mod common;
use common::quantised;

const SWITCHES: &str = "EMBER_ROUTE_REDUX,EMBER_MOE_GU_UNROLL,EMBER_MOE_SHARED_FIRST";

/// A MoE case: (gate/up type, down type, d, n_ff, experts, slots (None: every expert at its own
/// index), k, tokens, shared expert (gate/up type, down type, n_ff)).
type MoeCase = (GgmlType, GgmlType, usize, usize, usize, Option<Vec<u32>>, usize, usize, Option<(GgmlType, GgmlType, usize)>);

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
    /// Router logits (what, tokens, experts, k, values).
    routes: Vec<(&'static str, usize, usize, usize, Vec<f32>)>,
    moes: Vec<MoeInputs>,
}

fn inputs(rng: &mut Rng) -> Inputs {
    // The 35B's 256 experts, top 8: random logits over several tokens; a row of many equal
    // logits (ties to the lower id); a row with a NaN (every probability NaN); a narrower
    // router; logits spread over ±60 with every expert taken (probabilities down to zero and
    // through the denormals, ties among the zeros); k over more experts than the registers'
    // form holds (the shared-memory form).
    let mut tied = rng.vec(256, -4.0, 4.0);
    for e in (3..256).step_by(5) {
        tied[e] = 5.0; // above every other: the top 8 are all ties
    }
    let mut nan_row = rng.vec(256, -4.0, 4.0);
    nan_row[17] = f32::NAN;
    let routes = vec![
        ("random", 5, 256, 8, rng.vec(5 * 256, -6.0, 6.0)),
        ("tied", 1, 256, 8, tied),
        ("nan", 1, 256, 8, nan_row),
        ("random", 3, 100, 10, rng.vec(300, -6.0, 6.0)),
        ("spread", 2, 64, 64, rng.vec(128, -60.0, 60.0)),
        ("random", 2, 512, 8, rng.vec(1024, -6.0, 6.0)),
    ];
    let miss = MOE_MISS;
    let cases: Vec<MoeCase> = vec![
        // The 35B Q4_K_M decode MoE with its shared expert; one token routed to an expert out of
        // range (NaN out); a partial residency with misses; a Q4_K down over several tokens.
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, None, 8, 1, Some((GgmlType::Q4K, GgmlType::Q6K, 512))),
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, None, 8, 2, None),
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 8, Some(vec![0, miss, 1, 2, miss, 3, miss, 4]), 3, 4, None),
        (
            GgmlType::Q4K,
            GgmlType::Q6K,
            512,
            256,
            8,
            Some(vec![miss, 0, 1, miss, 2, 3, 4, miss]),
            3,
            3,
            Some((GgmlType::Q4K, GgmlType::Q6K, 256)),
        ),
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 6, None, 3, 5, None),
        // With a shared expert wider than the routed experts and an id out of range; Q6_K and
        // Q8_0 gate/up (the other unrolled entries), Q6_K at the 35B's width.
        (GgmlType::Q4K, GgmlType::Q6K, 512, 256, 8, None, 3, 3, Some((GgmlType::Q4K, GgmlType::Q6K, 512))),
        (GgmlType::Q6K, GgmlType::Q6K, 2048, 256, 6, None, 2, 2, Some((GgmlType::Q6K, GgmlType::Q6K, 256))),
        (GgmlType::Q8_0, GgmlType::Q8_0, 256, 64, 4, None, 2, 2, Some((GgmlType::Q8_0, GgmlType::Q8_0, 64))),
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
                if (ci == 1 || ci == 5) && t == 1 {
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
    Inputs { routes, moes }
}

/// Every op the switches touch, each output's bits under a name.
fn run(g: &Gpu, inp: &Inputs) -> Vec<(String, Vec<u32>)> {
    let bits = |b: &Buf<f32>| g.download(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let nan = |n: usize| g.upload(&vec![f32::NAN; n]).unwrap();
    let mut outs = Vec::new();

    // Routes: ids and weights.
    for (what, n_tok, n_expert, k, logits) in &inp.routes {
        let mut ids = g.upload(&vec![u32::MAX; n_tok * k]).unwrap();
        let mut w = nan(n_tok * k);
        g.route(&g.upload(logits).unwrap(), *n_tok, *n_expert, *k, &mut ids, &mut w).unwrap();
        outs.push((format!("route {what} {n_tok}x{n_expert} k={k}: ids"), g.download(&ids).unwrap()));
        outs.push((format!("route {what} {n_tok}x{n_expert} k={k}: weights"), bits(&w)));
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
    // After the GPU check: the K-quant cases take ~45 s to quantise on the CI's two cores.
    let mut rng = Rng::new();
    let inp = inputs(&mut rng);
    let want = run(&plain, &inp);
    drop(plain);
    // The cases do what they are for: the tied row's 8 are its tied experts in increasing id,
    // the NaN row's ids are the "none" id.
    let ids_of = |what: &str| &want.iter().find(|(w, _)| w.starts_with(what)).unwrap().1;
    assert_eq!(ids_of("route tied"), &(0..8).map(|i| 3 + 5 * i).collect::<Vec<u32>>());
    assert!(ids_of("route nan").iter().all(|&e| e == 0x7fff_ffff), "{:?}", ids_of("route nan"));
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
        if what.starts_with("moe") {
            nans += w.iter().filter(|b| f32::from_bits(**b).is_nan()).count();
        }
    }
    // The out-of-range expert's token must have come out NaN in both.
    assert!(nans > 0, "no NaN output: the out-of-range expert case did not flag");
    println!("{} outputs, bit for bit with {SWITCHES} ({nans} NaN values, from the out-of-range expert)", want.len());
}
