//! Every kernel against ember_ops::reference on random shapes (odd sizes, one token and many),
//! fresh random data (never zeros), outputs poisoned with NaN before the run; the matmuls in
//! tests/matmul.rs.
//!
//! With no NVIDIA driver every test prints why and passes (CI has no GPU). On a GPU:
//! `cargo test -p ember-cuda --release --test gpu -- --test-threads=1`; the timings:
//! `... -- --ignored --nocapture bench`.
//!
//! Tolerances: `|got − ref| <= atol + rtol·scale`, where scale is |ref| for elementwise ops and
//! Σ_j |w_j·x_j| for dot products (an f32 sum of k terms is off by ~√k·ε·Σ|terms|, whatever the
//! cancellation in the result). Each states the largest error measured on the H200.

use ember_cuda::Error;
use ember_cuda::ops::{
    Act, AttnPrepIn, AttnPrepKv, AttnPrepShape, DeltaIn, DeltaPrepIn, DeltaPrepOut, DeltaPrepShape, DeltaShape, DownForm, GateUpForm,
    KV_PAGE, KvPages, MoeExperts, MoeRouting,
};
use ember_gguf::GgmlType;
use ember_ops::{ExpertView, Mat, MoeSlot, WeightId, WeightView, reference};
use ember_testkit::Rng;

mod common;
use common::{check, gpu, ms_per_call, poisoned, quantised};

fn check_rel(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    check(what, got, want, want, atol, rtol)
}

const MATMUL_TYPES: [GgmlType; 8] =
    [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::IQ4XS];

// Dequantisation alone: the reference is bit-exact ggml order without FMA; the kernel may fuse
// d·q − m, so allow 1e-6 relative (measured: bit-exact, 0, for all 8 types).
#[test]
fn get_rows_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in MATMUL_TYPES {
        let block = ty.block_size();
        let k = if block == 1 { 37 + rng.below(300) } else { block * (1 + rng.below(4)) };
        let n_rows = 3 + rng.below(100);
        let bytes = quantised(ty, &mut rng, k, n_rows);
        let view = WeightView { ty, k, n_rows, data: &bytes };
        let ids: Vec<u32> = (0..1 + rng.below(40)).map(|_| rng.below(n_rows) as u32).collect();
        let want = reference::get_rows(&view, &ids);
        let dw = g.upload_weight(ty, k, n_rows, &bytes).unwrap();
        let idb = g.upload(&ids).unwrap();
        let mut out = poisoned(g, ids.len() * k);
        g.get_rows(&dw, &idb, ids.len(), &mut out).unwrap();
        let got = g.download(&out).unwrap();
        let worst = check_rel(&format!("get_rows {}", ty.name()), &got, &want.data, 1e-30, 1e-6);
        println!("get_rows {}: max rel err {worst:.2e}", ty.name());
    }
    // An id past the end gives NaN, not a read past the weight.
    let bytes = quantised(GgmlType::Q8_0, &mut rng, 64, 4);
    let dw = g.upload_weight(GgmlType::Q8_0, 64, 4, &bytes).unwrap();
    let mut out = g.zeros::<f32>(64).unwrap();
    g.get_rows(&dw, &g.upload(&[4u32]).unwrap(), 1, &mut out).unwrap();
    assert!(g.download(&out).unwrap().iter().all(|v| v.is_nan()));
}

// f32 sum of squares against the reference's f64: rtol 1e-5 (measured: at most 2.8e-7).
#[test]
fn rms_norm_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n, gw, m) in [(1, 2048, 1), (7, 128, 3), (3, 37, 5), (33, 256, 2), (1, 128, 32)] {
        let d = gw * m;
        let x = Mat::from_vec(n, d, rng.vec(n * d, -3.0, 3.0));
        let w = rng.vec(gw, 0.5, 1.5);
        let want = reference::rms_norm(&x, &w, 1e-6);
        let mut out = poisoned(g, n * d);
        g.rms_norm(&g.upload(&x.data).unwrap(), n, d, &g.upload(&w).unwrap(), 1e-6, &mut out).unwrap();
        let worst = check_rel(&format!("rms_norm n={n} d={d} g={gw}"), &g.download(&out).unwrap(), &want.data, 1e-6, 1e-5);
        println!("rms_norm n={n} d={d} g={gw}: max rel err {worst:.2e}");
    }
}

// add is exact; gate's expf is within 2 ulp of Rust's exp: rtol 1e-6 (measured: add and
// select_rows exact, gate at most 3.0e-7).
#[test]
fn add_gate_select_rows_match_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n, d) in [(1, 2048), (5, 37), (17, 513)] {
        let h = Mat::from_vec(n, d, rng.vec(n * d, -4.0, 4.0));
        let x = Mat::from_vec(n, d, rng.vec(n * d, -4.0, 4.0));
        let mut want = h.clone();
        reference::add(&mut want, &x);
        let mut hb = g.upload(&h.data).unwrap();
        g.add(&mut hb, &g.upload(&x.data).unwrap(), n * d).unwrap();
        check_rel("add", &g.download(&hb).unwrap(), &want.data, 0.0, 0.0);

        for (act, gate) in [(Act::Silu, ember_ops::Gate::Silu), (Act::Sigmoid, ember_ops::Gate::Sigmoid)] {
            let gm = Mat::from_vec(n, d, rng.vec(n * d, -12.0, 12.0));
            let mut want = h.clone();
            reference::gate(&mut want, &gm, gate);
            let mut yb = g.upload(&h.data).unwrap();
            g.gate(&mut yb, &g.upload(&gm.data).unwrap(), n * d, act).unwrap();
            let worst = check_rel(&format!("gate {act:?}"), &g.download(&yb).unwrap(), &want.data, 1e-30, 1e-6);
            println!("gate {act:?} {n}x{d}: max rel err {worst:.2e}");
        }

        let rows: Vec<usize> = (0..1 + rng.below(2 * n)).map(|_| rng.below(n)).collect();
        let want = reference::select_rows(&h, &rows);
        let rows32: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let mut out = poisoned(g, rows.len() * d);
        g.select_rows(&g.upload(&h.data).unwrap(), n, d, &g.upload(&rows32).unwrap(), rows.len(), &mut out).unwrap();
        check_rel("select_rows", &g.download(&out).unwrap(), &want.data, 0.0, 0.0);
    }
}

// ids must equal the reference's; a different id is accepted only where the two probabilities
// tie to 1e-6 (expf vs exp). Weights: rtol 1e-5 (measured: ids always equal, weights at most
// 2.4e-7).
#[test]
fn route_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n_tok, n_expert, k) in [(1, 256, 8), (5, 64, 1), (33, 7, 7), (3, 100, 10), (2, 512, 8)] {
        let logits = Mat::from_vec(n_tok, n_expert, rng.vec(n_tok * n_expert, -6.0, 6.0));
        let want = reference::route(&logits, k);
        let mut ids = g.upload(&vec![u32::MAX; n_tok * k]).unwrap();
        let mut w = poisoned(g, n_tok * k);
        g.route(&g.upload(&logits.data).unwrap(), n_tok, n_expert, k, &mut ids, &mut w).unwrap();
        let (got_ids, got_w) = (g.download(&ids).unwrap(), g.download(&w).unwrap());
        let mut p = vec![0f32; n_expert];
        for t in 0..n_tok {
            reference::softmax(logits.row(t), &mut p);
            for j in 0..k {
                let (a, b) = (got_ids[t * k + j] as usize, want.ids[t * k + j].0 as usize);
                assert!(a == b || (p[a] - p[b]).abs() <= 1e-6 * p[b], "route t={t} j={j}: id {a}, want {b}");
            }
        }
        let worst = check_rel(&format!("route weights {n_tok}x{n_expert} k={k}"), &got_w, &want.weights, 1e-30, 1e-5);
        println!("route {n_tok}x{n_expert} k={k}: max rel err {worst:.2e}");
    }
}

// RMSNorm (f32 vs f64 sums) then RoPE with the same f64 angles: atol 1e-5 + rtol 1e-5 on
// O(1) values (measured: relative error at most 7.6e-5, only on entries with |ref| << 1, which
// the atol covers; the gate copy is exact).
#[test]
fn attn_prep_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n_tok, n_head, n_head_kv, head_dim, n_rot) in [(1, 16, 2, 256, 64), (7, 3, 1, 64, 64), (2, 2, 2, 128, 16), (13, 4, 2, 96, 32)] {
        let s = ember_ops::AttnPrep {
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_base: 10_000_000.0,
            eps: 1e-6,
            q_norm: WeightId(0),
            k_norm: WeightId(1),
        };
        let qg = Mat::from_vec(n_tok, n_head * 2 * head_dim, rng.vec(n_tok * n_head * 2 * head_dim, -3.0, 3.0));
        let k = Mat::from_vec(n_tok, n_head_kv * head_dim, rng.vec(n_tok * n_head_kv * head_dim, -3.0, 3.0));
        let (qn, kn) = (rng.vec(head_dim, 0.5, 1.5), rng.vec(head_dim, 0.5, 1.5));
        let pos: Vec<u32> = (0..n_tok).map(|_| rng.below(200_000) as u32).collect();
        let want = reference::attn_prep(&s, &qn, &kn, &qg, &k, &pos);
        let (mut q, mut gate, mut ko) =
            (poisoned(g, n_tok * n_head * head_dim), poisoned(g, n_tok * n_head * head_dim), poisoned(g, n_tok * n_head_kv * head_dim));
        let shape = AttnPrepShape { n_tok, n_head, n_head_kv, head_dim, n_rot, eps: s.eps, rope_base: s.rope_base };
        let (qgb, kb, qnb, knb, posb) = (
            g.upload(&qg.data).unwrap(),
            g.upload(&k.data).unwrap(),
            g.upload(&qn).unwrap(),
            g.upload(&kn).unwrap(),
            g.upload(&pos).unwrap(),
        );
        let inputs = AttnPrepIn { qg: &qgb, k: &kb, q_norm: &qnb, k_norm: &knb, pos: &posb };
        g.attn_prep(shape, inputs, &mut q, &mut gate, &mut ko).unwrap();
        let what = format!("attn_prep t={n_tok} h={n_head}/{n_head_kv} hd={head_dim} rot={n_rot}");
        let e1 = check_rel(&format!("{what} q"), &g.download(&q).unwrap(), &want.q.data, 1e-5, 1e-5);
        check_rel(&format!("{what} gate"), &g.download(&gate).unwrap(), &want.gate.data, 0.0, 0.0);
        let e2 = check_rel(&format!("{what} k"), &g.download(&ko).unwrap(), &want.k.data, 1e-5, 1e-5);
        println!("{what}: max rel err q {e1:.2e} k {e2:.2e}");
    }
}

/// attn_prep writing the step's K and V rows into the caches itself (`attn_prep_kv`) against
/// attn_prep then kv_append: the same outputs and the same cache bytes (every page of both
/// caches), for each cache type, rows of several slots at scattered positions, one row whose
/// slot is out of range (skipped by both).
#[test]
fn attn_prep_writes_the_rows_kv_append_writes() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0] {
        for (n_tok, n_head, n_head_kv, head_dim, n_rot) in [(1, 16, 2, 256, 64), (7, 4, 2, 64, 32), (3, 2, 1, 128, 16)] {
            if !g.attn_prep_writes_kv(head_dim) {
                continue;
            }
            let width = n_head_kv * head_dim;
            let (n_slots, stride) = (3usize, 4usize);
            let n_pages = n_slots * 2 * stride; // one layer: every (slot, K/V) page row its own pages
            let rb = ty.row_bytes(width).unwrap();
            let table: Vec<u32> = (0..n_pages as u32).rev().collect();
            let shape = AttnPrepShape { n_tok, n_head, n_head_kv, head_dim, n_rot, eps: 1e-6, rope_base: 10_000_000.0 };
            let (qg, k, v) = (
                g.upload(&rng.vec(n_tok * n_head * 2 * head_dim, -3.0, 3.0)).unwrap(),
                g.upload(&rng.vec(n_tok * width, -3.0, 3.0)).unwrap(),
                g.upload(&rng.vec(n_tok * width, -3.0, 3.0)).unwrap(),
            );
            let (qn, kn) = (g.upload(&rng.vec(head_dim, 0.5, 1.5)).unwrap(), g.upload(&rng.vec(head_dim, 0.5, 1.5)).unwrap());
            let pos: Vec<u32> = (0..n_tok).map(|_| rng.below(stride * KV_PAGE) as u32).collect();
            let mut slots: Vec<u32> = (0..n_tok).map(|i| (i % n_slots) as u32).collect();
            if n_tok > 2 {
                slots[1] = n_slots as u32 + 4; // out of range: no row written
            }
            let (posb, slotb, tableb) = (g.upload(&pos).unwrap(), g.upload(&slots).unwrap(), g.upload(&table).unwrap());
            let run = |fused: bool| {
                let pool = g.upload(&vec![0x5au8; n_pages * KV_PAGE * rb]).unwrap();
                let pages = KvPages { pool: &pool, table: &tableb, ty, width, n_pages, stride, n_kv: 1, n_slots, layer: 0 };
                let (mut q, mut gate, mut ko) =
                    (poisoned(g, n_tok * n_head * head_dim), poisoned(g, n_tok * n_head * head_dim), poisoned(g, n_tok * width));
                let inputs = AttnPrepIn { qg: &qg, k: &k, q_norm: &qn, k_norm: &kn, pos: &posb };
                if fused {
                    let kv = AttnPrepKv { pages: &pages, v: &v, row_slot: &slotb, pos: &posb };
                    g.attn_prep_kv(shape, inputs, &mut q, &mut gate, &mut ko, Some(kv)).unwrap();
                } else {
                    g.attn_prep(shape, inputs, &mut q, &mut gate, &mut ko).unwrap();
                    g.kv_append(&pages, &ko, &v, n_tok, &slotb, &posb).unwrap();
                }
                let bits = |b: &ember_cuda::Buf<f32>| g.download(b).unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&q), bits(&gate), bits(&ko), g.download(&pool).unwrap())
            };
            let (two, one) = (run(false), run(true));
            let what = format!("{} t={n_tok} h={n_head}/{n_head_kv} hd={head_dim}", ty.name());
            assert!(one.0 == two.0 && one.1 == two.1 && one.2 == two.2, "{what}: q, gate or k differ");
            assert!(one.3 == two.3, "{what}: the caches differ");
            println!("attn_prep with the KV rows {what}: the two ops' outputs and cache bytes");
        }
    }
}

// L2 norms (f32 vs f64 sums), sigmoid and softplus (expf/log1pf vs Rust): rtol 1e-5
// (measured: at most 2.4e-7).
#[test]
fn delta_prep_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n_tok, n_k_head, d_k, n_v_head, d_v) in [(1, 16, 128, 32, 128), (5, 1, 32, 2, 48), (9, 2, 64, 4, 33)] {
        let s = ember_ops::DeltaPrep { n_k_head, n_v_head, d_k, d_v, eps: 1e-6, a: WeightId(0), dt_bias: WeightId(1) };
        let w = 2 * n_k_head * d_k + n_v_head * d_v;
        let cu = Mat::from_vec(n_tok, w, rng.vec(n_tok * w, -2.0, 2.0));
        let b = Mat::from_vec(n_tok, n_v_head, rng.vec(n_tok * n_v_head, -6.0, 6.0));
        // alpha + dt_bias spans softplus' threshold 20 on both sides.
        let alpha = Mat::from_vec(n_tok, n_v_head, rng.vec(n_tok * n_v_head, -25.0, 25.0));
        let a = rng.vec(n_v_head, -8.0, -0.1);
        let dt_bias = rng.vec(n_v_head, -2.0, 2.0);
        let want = reference::delta_prep(&s, &a, &dt_bias, &cu, &b, &alpha);
        let nkd = n_tok * n_k_head * d_k;
        let (mut q, mut k, mut v, mut gg, mut beta) = (
            poisoned(g, nkd),
            poisoned(g, nkd),
            poisoned(g, n_tok * n_v_head * d_v),
            poisoned(g, n_tok * n_v_head),
            poisoned(g, n_tok * n_v_head),
        );
        let (cub, bb, alb, ab, dtb) = (
            g.upload(&cu.data).unwrap(),
            g.upload(&b.data).unwrap(),
            g.upload(&alpha.data).unwrap(),
            g.upload(&a).unwrap(),
            g.upload(&dt_bias).unwrap(),
        );
        let shape = DeltaPrepShape { n_tok, n_k_head, d_k, n_v_head, d_v, eps: s.eps };
        let i = DeltaPrepIn { cu: &cub, b: &bb, alpha: &alb, a: &ab, dt_bias: &dtb };
        g.delta_prep(shape, i, DeltaPrepOut { q: &mut q, k: &mut k, v: &mut v, g: &mut gg, beta: &mut beta }).unwrap();
        let what = format!("delta_prep t={n_tok} k {n_k_head}x{d_k} v {n_v_head}x{d_v}");
        let mut worst = 0f32;
        for (name, got, want) in
            [("q", &q, &want.q), ("k", &k, &want.k), ("v", &v, &want.v), ("g", &gg, &want.g), ("beta", &beta, &want.beta)]
        {
            worst = worst.max(check_rel(&format!("{what} {name}"), &g.download(got).unwrap(), &want.data, 1e-7, 1e-5));
        }
        println!("{what}: max rel err {worst:.2e}");
    }
}

// The same f32 sums in the same order (FMA contraction aside), expf in SiLU: rtol 1e-5;
// the state is copied, exact. Two calls in a row check that the state carries. Measured:
// relative error up to 2.3e-4 on outputs near zero (|ref| ~ 1e-3), inside atol 1e-6.
#[test]
fn conv1d_silu_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (c, kernel, toks) in [(8192, 4, [1, 1]), (37, 4, [5, 2]), (300, 2, [1, 7]), (65, 1, [3, 1]), (19, 4, [2, 1])] {
        let w = rng.vec(c * kernel, -1.0, 1.0);
        let mut state = rng.vec((kernel - 1) * c, -2.0, 2.0);
        let (wb, mut sb) = (g.upload(&w).unwrap(), g.upload(&state).unwrap());
        let mut worst = 0f32;
        for n_tok in toks {
            let x = Mat::from_vec(n_tok, c, rng.vec(n_tok * c, -2.0, 2.0));
            let want = reference::conv1d_silu(&x, &w, &mut state);
            let mut out = poisoned(g, n_tok * c);
            g.conv1d_silu(&g.upload(&x.data).unwrap(), n_tok, c, &wb, kernel, &mut sb, &mut out).unwrap();
            worst = worst.max(check_rel(
                &format!("conv1d_silu c={c} k={kernel} t={n_tok}"),
                &g.download(&out).unwrap(),
                &want.data,
                1e-6,
                1e-5,
            ));
            check_rel("conv1d_silu state", &g.download(&sb).unwrap(), &state, 0.0, 0.0);
        }
        println!("conv1d_silu c={c} k={kernel}: max rel err {worst:.2e}");
    }
}

// f32 warp sums against f64 dots, repeated over tokens with the state carried: the output is
// compared with atol 1e-4 + rtol 1e-4 (values O(1)), the state likewise. Measured: relative
// error up to 9.5e-4 (output) and 1.4e-2 (state) on entries near zero, inside the atol.
#[test]
fn delta_rule_recurrent_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for (n_tok, n_k_head, d_k, n_v_head, d_v) in [(1, 16, 128, 32, 128), (7, 2, 64, 4, 33), (3, 1, 32, 3, 5), (20, 2, 256, 2, 16)] {
        let s = ember_ops::DeltaShape { n_tok, n_k_head, n_v_head, d_k, d_v };
        let unit = |rng: &mut Rng, n: usize| -> Mat {
            // L2-normalised rows of d_k per head, as delta_prep makes them.
            let mut m = Mat::from_vec(n, n_k_head * d_k, rng.vec(n * n_k_head * d_k, -1.0, 1.0));
            m.data.chunks_exact_mut(d_k).for_each(|h| reference::l2_norm(h, 1e-6));
            m
        };
        let (q, k) = (unit(&mut rng, n_tok), unit(&mut rng, n_tok));
        let v = Mat::from_vec(n_tok, n_v_head * d_v, rng.vec(n_tok * n_v_head * d_v, -2.0, 2.0));
        let gm = Mat::from_vec(n_tok, n_v_head, rng.vec(n_tok * n_v_head, -3.0, -0.01));
        let beta = Mat::from_vec(n_tok, n_v_head, rng.vec(n_tok * n_v_head, 0.01, 1.0));
        let mut state = rng.vec(n_v_head * d_v * d_k, -1.0, 1.0);
        let mut sb = g.upload(&state).unwrap();
        let want = reference::delta_rule_recurrent(s, &q, &k, &v, &gm, &beta, &mut state);
        let (qb, kb, vb, gb, bb) = (
            g.upload(&q.data).unwrap(),
            g.upload(&k.data).unwrap(),
            g.upload(&v.data).unwrap(),
            g.upload(&gm.data).unwrap(),
            g.upload(&beta.data).unwrap(),
        );
        let mut out = poisoned(g, n_tok * n_v_head * d_v);
        let shape = DeltaShape { n_tok, n_k_head, d_k, n_v_head, d_v };
        g.delta_rule_recurrent(shape, DeltaIn { q: &qb, k: &kb, v: &vb, g: &gb, beta: &bb }, &mut sb, &mut out).unwrap();
        let what = format!("delta_rule t={n_tok} k {n_k_head}x{d_k} v {n_v_head}x{d_v}");
        let e1 = check_rel(&format!("{what} out"), &g.download(&out).unwrap(), &want.data, 1e-4, 1e-4);
        let e2 = check_rel(&format!("{what} state"), &g.download(&sb).unwrap(), &state, 1e-4, 1e-4);
        println!("{what}: max rel err out {e1:.2e} state {e2:.2e}");
    }
}

// Dot products as in matmul, then a sum over k experts in another order than the reference's
// (routing order against increasing id): rtol 1e-5 of Σ_j |w_j|·Σ_i |down_i·h_i| plus atol
// 1e-6 (silu·up then the down dot, both f32). Measured: at most 1.8e-7 of the scale.
#[test]
fn moe_matches_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let cases = [
        (GgmlType::Q4K, GgmlType::Q6K, 512, 256, 8, 4, 1),
        (GgmlType::Q4K, GgmlType::Q4K, 256, 512, 6, 3, 9),
        (GgmlType::Q8_0, GgmlType::Q8_0, 96, 64, 5, 5, 3),
        (GgmlType::IQ4XS, GgmlType::Q5K, 256, 256, 3, 1, 17),
    ];
    for (ty_gu, ty_dn, d, n_ff, n_expert, k, n_tok) in cases {
        let gate = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let up = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let down = quantised(ty_dn, &mut rng, n_ff, n_expert * d);
        let (gv, uv, dv) = (
            WeightView { ty: ty_gu, k: d, n_rows: n_expert * n_ff, data: &gate },
            WeightView { ty: ty_gu, k: d, n_rows: n_expert * n_ff, data: &up },
            WeightView { ty: ty_dn, k: n_ff, n_rows: n_expert * d, data: &down },
        );
        let x = Mat::from_vec(n_tok, d, rng.vec(n_tok * d, -1.0, 1.0));
        let logits = Mat::from_vec(n_tok, n_expert, rng.vec(n_tok * n_expert, -3.0, 3.0));
        let routing = reference::route(&logits, k);
        let per_expert = routing.per_expert(n_expert);
        let slots: Vec<MoeSlot> = per_expert
            .iter()
            .enumerate()
            .map(|(e, toks)| MoeSlot {
                expert: ExpertView { gate: gv.rows(e * n_ff, n_ff), up: uv.rows(e * n_ff, n_ff), down: dv.rows(e * d, d) },
                tokens: toks,
            })
            .collect();
        let want = reference::moe(reference::matmul, &slots, &x);
        // scale[t][i] = Σ_j |w_j| · Σ_m |down_e[i][m]·h_tj[m]| with the reference's h.
        let mut scale = vec![0f32; n_tok * d];
        let mut row = vec![0f32; n_ff];
        for t in 0..n_tok {
            for j in 0..k {
                let e = routing.ids[t * k + j].0 as usize;
                let xe = x.rows(t, 1);
                let mut h = reference::matmul(&gv.rows(e * n_ff, n_ff), &xe);
                let u = reference::matmul(&uv.rows(e * n_ff, n_ff), &xe);
                h.data.iter_mut().zip(&u.data).for_each(|(a, b)| *a = reference::silu(*a) * b);
                for i in 0..d {
                    ember_gguf::quant::dequantize(ty_dn, dv.row(e * d + i), &mut row).unwrap();
                    let s: f32 = row.iter().zip(&h.data).map(|(a, b)| (a * b).abs()).sum();
                    scale[t * d + i] += routing.weights[t * k + j].abs() * s;
                }
            }
        }
        let (gw, uw, dw) = (
            g.upload_weight(ty_gu, d, n_expert * n_ff, &gate).unwrap(),
            g.upload_weight(ty_gu, d, n_expert * n_ff, &up).unwrap(),
            g.upload_weight(ty_dn, n_ff, n_expert * d, &down).unwrap(),
        );
        let ids: Vec<u32> = routing.ids.iter().map(|e| e.0 as u32).collect();
        let (idb, wb) = (g.upload(&ids).unwrap(), g.upload(&routing.weights).unwrap());
        let mut h = poisoned(g, n_tok * k * n_ff);
        let mut out = poisoned(g, n_tok * d);
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        g.moe(experts, &g.upload(&x.data).unwrap(), n_tok, MoeRouting { ids: &idb, weights: &wb, k }, &mut h, &mut out).unwrap();
        let what = format!("moe {}/{} d={d} n_ff={n_ff} experts={n_expert} k={k} t={n_tok}", ty_gu.name(), ty_dn.name());
        let worst = check(&what, &g.download(&out).unwrap(), &want.data, &scale, 1e-6, 1e-5);
        println!("{what}: max err / scale {worst:.2e}");
    }
}

// The grouped tensor-core MoE (Precision::Fast, prompt batches) against the reference. Bound:
// f16 operands give each gate/up dot an error <= 1e-3·G (G = Σ|gate·x|, U likewise), so
// |δh| <= 1e-3·(1.1·G·U + G·U) (|silu'| <= 1.1, |silu(g)| <= G, |u| <= U), and the down dot
// adds 1e-3·Σ|down·h| with |h| <= G·U: the error is at most 3.1e-3 of
// scale = Σ_j |w_j| · Σ_m |down_e[i][m]|·G_m·U_m. rtol 4e-3 of that, atol 1e-6.
// Measured on the H200 (2026-12-03): 2.2e-7 to 3.9e-6 of that scale (a worst case far above
// the typical error); two runs equal bit for bit.
#[test]
fn moe_mma_matches_reference() {
    let Some(g) = gpu() else { return };
    if !g.has_mma() {
        println!("skipped: sm_{} has no tensor-core MoE", g.info().sm());
        return;
    }
    let mut rng = Rng::new();
    let cases = [
        (GgmlType::Q4K, GgmlType::Q6K, 512, 256, 8, 4, 17),
        (GgmlType::Q4K, GgmlType::Q4K, 256, 512, 6, 3, 130),
        // 8 super-blocks of k (more than the staged int8 gate/up's 3 stages); the staged Q6_K down.
        (GgmlType::Q4K, GgmlType::Q6K, 2048, 512, 16, 8, 40),
        // The staged Q4_K down over one super-block of k (n_ff = 256).
        (GgmlType::Q4K, GgmlType::Q4K, 512, 256, 5, 2, 45),
        (GgmlType::Q8_0, GgmlType::Q8_0, 96, 64, 5, 5, 40),
        (GgmlType::IQ4XS, GgmlType::Q5K, 256, 256, 3, 1, 75),
        (GgmlType::F16, GgmlType::BF16, 136, 200, 7, 2, 33),
        (GgmlType::F32, GgmlType::F32, 64, 40, 4, 4, 20),
    ];
    for (ty_gu, ty_dn, d, n_ff, n_expert, k, n_tok) in cases {
        let gate = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let up = quantised(ty_gu, &mut rng, d, n_expert * n_ff);
        let down = quantised(ty_dn, &mut rng, n_ff, n_expert * d);
        let (gv, uv, dv) = (
            WeightView { ty: ty_gu, k: d, n_rows: n_expert * n_ff, data: &gate },
            WeightView { ty: ty_gu, k: d, n_rows: n_expert * n_ff, data: &up },
            WeightView { ty: ty_dn, k: n_ff, n_rows: n_expert * d, data: &down },
        );
        let x = Mat::from_vec(n_tok, d, rng.vec(n_tok * d, -1.0, 1.0));
        let logits = Mat::from_vec(n_tok, n_expert, rng.vec(n_tok * n_expert, -3.0, 3.0));
        let routing = reference::route(&logits, k);
        let per_expert = routing.per_expert(n_expert);
        let slots: Vec<MoeSlot> = per_expert
            .iter()
            .enumerate()
            .map(|(e, toks)| MoeSlot {
                expert: ExpertView { gate: gv.rows(e * n_ff, n_ff), up: uv.rows(e * n_ff, n_ff), down: dv.rows(e * d, d) },
                tokens: toks,
            })
            .collect();
        // The reference and the error scale for activations `x` (the f32 x, or its int8 round
        // trip for the int8 gate/up: then only the f32 sums and the down tile's f16 h differ),
        // with h rounded to int8 before down when `hq` (the int8 down).
        let down_bytes = down.as_ptr_range();
        let reference_of = |x: &Mat, hq: bool| -> (Mat, Vec<f32>) {
            let matmul = |w: &WeightView<'_>, a: &Mat| -> Mat {
                match hq && down_bytes.contains(&w.data.as_ptr()) {
                    true => reference::matmul(w, &Mat::from_vec(a.n, a.d, common::q8_round_trip(&a.data))),
                    false => reference::matmul(w, a),
                }
            };
            let want = reference::moe(matmul, &slots, x);
            // |gate_e|·|x_t| and |up_e|·|x_t| per hidden row: the reference matmul of |W| and |x|.
            let abs_view = |v: &WeightView<'_>, e: usize, rows: usize| -> Vec<f32> {
                let mut w = vec![0f32; rows * v.k];
                for r in 0..rows {
                    ember_gguf::quant::dequantize(v.ty, v.row(e * rows + r), &mut w[r * v.k..(r + 1) * v.k]).unwrap();
                }
                w.iter().map(|a| a.abs()).collect()
            };
            let mut scale = vec![0f32; n_tok * d];
            for t in 0..n_tok {
                let xa: Vec<f32> = x.row(t).iter().map(|a| a.abs()).collect();
                for j in 0..k {
                    let e = routing.ids[t * k + j].0 as usize;
                    let (ga, ua, da) = (abs_view(&gv, e, n_ff), abs_view(&uv, e, n_ff), abs_view(&dv, e, d));
                    let gu: Vec<f32> = (0..n_ff)
                        .map(|m| {
                            let gs: f32 = ga[m * d..(m + 1) * d].iter().zip(&xa).map(|(a, b)| a * b).sum();
                            let us: f32 = ua[m * d..(m + 1) * d].iter().zip(&xa).map(|(a, b)| a * b).sum();
                            gs * us
                        })
                        .collect();
                    for i in 0..d {
                        let s: f32 = da[i * n_ff..(i + 1) * n_ff].iter().zip(&gu).map(|(a, b)| a * b).sum();
                        scale[t * d + i] += routing.weights[t * k + j].abs() * s;
                    }
                }
            }
            (want, scale)
        };
        let (want, scale) = reference_of(&x, false);
        let (gw, uw, dw) = (
            g.upload_weight(ty_gu, d, n_expert * n_ff, &gate).unwrap(),
            g.upload_weight(ty_gu, d, n_expert * n_ff, &up).unwrap(),
            g.upload_weight(ty_dn, n_ff, n_expert * d, &down).unwrap(),
        );
        let ids: Vec<u32> = routing.ids.iter().map(|e| e.0 as u32).collect();
        let (idb, wb) = (g.upload(&ids).unwrap(), g.upload(&routing.weights).unwrap());
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        let r = MoeRouting { ids: &idb, weights: &wb, k };
        let xb = g.upload(&x.data).unwrap();
        let what = format!("moe mma {}/{} d={d} n_ff={n_ff} experts={n_expert} k={k} t={n_tok}", ty_gu.name(), ty_dn.name());
        // h and the parts poisoned for every run: a form that missed a write would otherwise
        // find the previous form's values there.
        let run = |form: GateUpForm, down: DownForm| {
            let mut h = poisoned(g, n_tok * k * n_ff);
            let mut scratch = poisoned(g, ember_cuda::ops::moe_scratch_len(n_tok, k, n_expert, d));
            let mut out = poisoned(g, n_tok * d);
            g.moe_mma_form(form, down, experts, &xb, n_tok, r, &mut h, &mut scratch, &mut out).unwrap();
            g.download(&out).unwrap()
        };
        let got = run(GateUpForm::Fused, DownForm::Tiles);
        let worst = check(&what, &got, &want.data, &scale, 1e-6, 4e-3);
        // Run-to-run: the same output bit for bit (the plan's list order varies, the sums not).
        assert_eq!(got, run(GateUpForm::Fused, DownForm::Tiles), "{what}: two runs differ");
        println!("MOE_MMA_MEASURED {what}: max err / scale {worst:.2e} (bound 4e-3)");
        // The int8 forms against the reference on the int8 round trips of what they quantise
        // (gate/up: x; down: h), with the same bound (f16 tiles' rounding, and h's int8
        // rounding falling the other way where the GPU's h and the reference's differ, stay
        // far below it): gate/up for Q4_K, d % 256 == 0, n_ff % 64 == 0; down for Q4_K or
        // Q6_K, n_ff % 256 == 0, d % 128 == 0.
        let xq = Mat::from_vec(n_tok, d, common::q8_round_trip(&x.data));
        let int8_gu = ty_gu == GgmlType::Q4K && d % 256 == 0 && n_ff % 64 == 0;
        let int8_dn = matches!(ty_dn, GgmlType::Q4K | GgmlType::Q6K) && n_ff % 256 == 0 && d % 128 == 0;
        for (form, down, on) in [
            (GateUpForm::Int8, DownForm::Tiles, int8_gu),
            (GateUpForm::Int8Staged, DownForm::Tiles, int8_gu),
            (GateUpForm::Fused, DownForm::Int8, int8_dn),
            (GateUpForm::Fused, DownForm::Int8Staged, int8_dn),
            (GateUpForm::Int8, DownForm::Int8, int8_gu && int8_dn),
            (GateUpForm::Int8Staged, DownForm::Int8Staged, int8_gu && int8_dn),
        ] {
            if !on {
                continue;
            }
            let (want_q, scale_q) = reference_of(if form == GateUpForm::Fused { &x } else { &xq }, down != DownForm::Tiles);
            let what8 = format!("{what} {form:?} gate/up, {down:?} down");
            let got8 = run(form, down);
            let worst8 = check(&what8, &got8, &want_q.data, &scale_q, 1e-6, 4e-3);
            assert_eq!(got8, run(form, down), "{what8}: two runs differ");
            println!("MOE_MMA_MEASURED {what8}: max err / scale {worst8:.2e} (bound 4e-3)");
            // The staged kernels read the same operands and sum them in the same order.
            let unstaged = |f| if f == GateUpForm::Int8Staged { GateUpForm::Int8 } else { f };
            let unstaged_down = if down == DownForm::Int8Staged { DownForm::Int8 } else { down };
            if (unstaged(form), unstaged_down) != (form, down) {
                assert_eq!(got8, run(unstaged(form), unstaged_down), "{what8}: differs from the unstaged int8 kernels");
            }
        }
    }
}

#[test]
fn devices_lists_gpus_or_says_why_not() {
    match ember_cuda::devices() {
        Ok(list) => {
            assert!(!list.is_empty());
            for d in list {
                println!("{d:?}");
                assert!(d.bytes_free <= d.bytes_total && d.cc.0 >= 5);
            }
        }
        Err(e) => {
            let msg = e.to_string();
            println!("no GPU: {msg}");
            assert!(matches!(e, Error::NoDriver(_)) && msg.contains("libcuda.so.1"), "{msg}");
        }
    }
}

#[test]
fn allocation_failure_names_asked_and_free() {
    let Some(g) = gpu() else { return };
    let e = g.alloc::<f32>(1 << 40).unwrap_err();
    let msg = e.to_string();
    println!("{msg}");
    assert!(matches!(e, Error::OutOfMemory { bytes_asked, .. } if bytes_asked == 4 << 40), "{msg}");
    assert!(msg.contains("asked for") && msg.contains("free"), "{msg}");
}

/// One MoE layer of the 35B model at decode (256 experts, top-8, d 2048, n_ff 512, Q4_K
/// gate/up, Q6_K down): GB/s over the bytes of the 8 routed experts.
#[test]
#[ignore]
fn bench_moe() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let (d, n_ff, n_expert, k) = (2048, 512, 256, 8);
    let tiled = |ty: GgmlType, rng: &mut Rng, kk: usize, rows: usize| -> Vec<u8> {
        let tile = quantised(ty, rng, kk, 256);
        tile.iter().copied().cycle().take(tile.len() * rows / 256).collect()
    };
    let gw = g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &tiled(GgmlType::Q4K, &mut rng, d, n_expert * n_ff)).unwrap();
    let uw = g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &tiled(GgmlType::Q4K, &mut rng, d, n_expert * n_ff)).unwrap();
    let dw = g.upload_weight(GgmlType::Q6K, n_ff, n_expert * d, &tiled(GgmlType::Q6K, &mut rng, n_ff, n_expert * d)).unwrap();
    for n_tok in [1, 4] {
        let ids: Vec<u32> = (0..n_tok * k).map(|i| ((i * 37 + 11) % n_expert) as u32).collect();
        let (idb, wb) = (g.upload(&ids).unwrap(), g.upload(&rng.vec(n_tok * k, 0.0, 0.25)).unwrap());
        let x = g.upload(&rng.vec(n_tok * d, -1.0, 1.0)).unwrap();
        let mut h = g.alloc::<f32>(n_tok * k * n_ff).unwrap();
        let mut out = g.alloc::<f32>(n_tok * d).unwrap();
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        let r = MoeRouting { ids: &idb, weights: &wb, k };
        g.moe(experts, &x, n_tok, r, &mut h, &mut out).unwrap();
        let iters = 200;
        let ms = ms_per_call(g, iters, || g.moe(experts, &x, n_tok, r, &mut h, &mut out));
        let bytes = (n_tok * k) as f64 * (2 * n_ff * gw.row_bytes + d * dw.row_bytes) as f64;
        println!(
            "bench moe Q4_K/Q6_K tok={n_tok} (distinct experts {}): {ms:.4} ms  {:6.0} GB/s over the routed experts' bytes",
            n_tok * k,
            bytes / (ms as f64 * 1e-3) / 1e9
        );
    }
}

/// Per-call time of the small ops at the 35B model's decode shapes (one token), launches
/// included (200 back-to-back calls, no graph). delta_rule also as GB/s of state read + written.
#[test]
#[ignore]
fn bench_ops() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let mut buf = |n: usize| g.upload(&rng.vec(n, -1.0, 1.0)).unwrap();
    let time = |what: &str, f: &mut dyn FnMut() -> ember_cuda::Result<()>| {
        f().unwrap();
        let iters = 200;
        let ms = ms_per_call(g, iters, &mut *f);
        println!("bench op {what:44}: {:7.2} us", ms * 1e3);
        ms
    };
    let (x, w, mut out) = (buf(2048), buf(2048), buf(2048));
    time("rms_norm 1x2048", &mut || g.rms_norm(&x, 1, 2048, &w, 1e-6, &mut out));
    let (mut h, xa) = (buf(2048), buf(2048));
    time("add 2048", &mut || g.add(&mut h, &xa, 2048));
    let logits = buf(256);
    let (mut ids, mut wt) = (g.alloc::<u32>(8).unwrap(), buf(8));
    time("route 256 experts, k 8", &mut || g.route(&logits, 1, 256, 8, &mut ids, &mut wt));
    let (qg, k, qn, kn) = (buf(16 * 2 * 256), buf(2 * 256), buf(256), buf(256));
    let pos = g.upload(&[12345u32]).unwrap();
    let (mut q, mut gate, mut ko) = (buf(16 * 256), buf(16 * 256), buf(2 * 256));
    let s = AttnPrepShape { n_tok: 1, n_head: 16, n_head_kv: 2, head_dim: 256, n_rot: 64, eps: 1e-6, rope_base: 1e7 };
    time("attn_prep 16/2 heads x 256, rot 64", &mut || {
        g.attn_prep(s, AttnPrepIn { qg: &qg, k: &k, q_norm: &qn, k_norm: &kn, pos: &pos }, &mut q, &mut gate, &mut ko)
    });
    let (cx, cw, mut cs, mut co) = (buf(8192), buf(8192 * 4), buf(3 * 8192), buf(8192));
    time("conv1d_silu 8192 ch, kernel 4", &mut || g.conv1d_silu(&cx, 1, 8192, &cw, 4, &mut cs, &mut co));
    let (cu, b, al, a, dt) = (buf(8192), buf(32), buf(32), buf(32), buf(32));
    let (mut dq, mut dk, mut dv, mut dg, mut db) = (buf(2048), buf(2048), buf(4096), buf(32), buf(32));
    let ds = DeltaPrepShape { n_tok: 1, n_k_head: 16, d_k: 128, n_v_head: 32, d_v: 128, eps: 1e-6 };
    time("delta_prep k 16x128, v 32x128", &mut || {
        let o = DeltaPrepOut { q: &mut dq, k: &mut dk, v: &mut dv, g: &mut dg, beta: &mut db };
        g.delta_prep(ds, DeltaPrepIn { cu: &cu, b: &b, alpha: &al, a: &a, dt_bias: &dt }, o)
    });
    let (q1, k1, v1) = (buf(2048), buf(2048), buf(4096));
    let gl = g.upload(&[-0.1f32; 32]).unwrap();
    let be = g.upload(&[0.5f32; 32]).unwrap();
    let mut st = g.upload(&vec![0.01f32; 32 * 128 * 128]).unwrap();
    let mut o1 = buf(4096);
    let sh = DeltaShape { n_tok: 1, n_k_head: 16, d_k: 128, n_v_head: 32, d_v: 128 };
    let ms = time("delta_rule_recurrent 32 heads 128x128, 1 tok", &mut || {
        g.delta_rule_recurrent(sh, DeltaIn { q: &q1, k: &k1, v: &v1, g: &gl, beta: &be }, &mut st, &mut o1)
    });
    println!(
        "bench op delta_rule state traffic: {:.0} GB/s (2 MiB read + written)",
        2.0 * 32.0 * 128.0 * 128.0 * 4.0 / (ms as f64 * 1e-3) / 1e9
    );
}

/// One MoE layer of the 35B model at prompt sizes (256 experts, top-8, d 2048, n_ff 512, Q4_K
/// gate/up, Q6_K down): the per-pair kernels (`moe`, what Exact and small batches run) against
/// the grouped tensor-core path (`moe_mma`). TFLOP/s over the routed work, 2·n_tok·k·3·d·n_ff.
#[test]
#[ignore]
fn bench_moe_prompt() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let (d, n_ff, n_expert, k) = (2048, 512, 256, 8);
    let tiled = |ty: GgmlType, rng: &mut Rng, kk: usize, rows: usize| -> Vec<u8> {
        let tile = quantised(ty, rng, kk, 256);
        tile.iter().copied().cycle().take(tile.len() * rows / 256).collect()
    };
    let gw = g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &tiled(GgmlType::Q4K, &mut rng, d, n_expert * n_ff)).unwrap();
    let uw = g.upload_weight(GgmlType::Q4K, d, n_expert * n_ff, &tiled(GgmlType::Q4K, &mut rng, d, n_expert * n_ff)).unwrap();
    let dw = g.upload_weight(GgmlType::Q6K, n_ff, n_expert * d, &tiled(GgmlType::Q6K, &mut rng, n_ff, n_expert * d)).unwrap();
    for n_tok in [32, 128, 512, 2048, 8192] {
        // Routing: k distinct pseudo-random experts per token.
        let ids: Vec<u32> = (0..n_tok).flat_map(|t| (0..k).map(move |j| ((t * 97 + j * 31 + (t / 7) * 13) % n_expert) as u32)).collect();
        let (idb, wb) = (g.upload(&ids).unwrap(), g.upload(&rng.vec(n_tok * k, 0.0, 0.25)).unwrap());
        let x = g.upload(&rng.vec(n_tok * d, -1.0, 1.0)).unwrap();
        let mut h = g.alloc::<f32>(n_tok * k * n_ff).unwrap();
        let mut scratch = g.alloc::<f32>(ember_cuda::ops::moe_scratch_len(n_tok, k, n_expert, d)).unwrap();
        let mut out = g.alloc::<f32>(n_tok * d).unwrap();
        let experts = MoeExperts { gate: &gw, up: &uw, down: &dw, n_expert, slots: None };
        let r = MoeRouting { ids: &idb, weights: &wb, k };
        let flop = 2.0 * (n_tok * k) as f64 * 3.0 * (d * n_ff) as f64;
        let mut line = format!("bench moe prompt Q4_K/Q6_K tok={n_tok:4}:");
        // Per pair, then grouped by expert: f16 tiles, then the int8 forms.
        for (name, form) in [
            ("per-pair", None),
            ("grouped f16", Some((GateUpForm::Fused, DownForm::Tiles))),
            ("grouped int8 gate/up", Some((GateUpForm::Int8, DownForm::Tiles))),
            ("grouped int8 gate/up + down", Some((GateUpForm::Int8, DownForm::Int8))),
            ("staged int8 gate/up", Some((GateUpForm::Int8Staged, DownForm::Tiles))),
            ("staged int8 gate/up + down", Some((GateUpForm::Int8Staged, DownForm::Int8))),
            ("staged int8 gate/up + staged down", Some((GateUpForm::Int8Staged, DownForm::Int8Staged))),
        ] {
            let mut call = || match form {
                Some((form, down)) => g.moe_mma_form(form, down, experts, &x, n_tok, r, &mut h, &mut scratch, &mut out),
                None => g.moe(experts, &x, n_tok, r, &mut h, &mut out),
            };
            if form.is_none() && n_tok * k > 65_535 {
                line += &format!("  {name} (more than 65,535 pairs)");
                continue;
            }
            call().unwrap();
            let iters = if form.is_none() && n_tok >= 512 { 2 } else { 10 };
            let ms = ms_per_call(g, iters, &mut call);
            line += &format!("  {name} {ms:.3} ms {:.1} TF", flop / (ms as f64 * 1e-3) / 1e12);
        }
        println!("{line}");
    }
}
