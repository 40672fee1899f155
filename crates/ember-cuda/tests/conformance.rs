//! ember's backend conformance suite (`ember_ops::conformance`) on [`CudaOps`]: every op, the
//! state store and the error paths against the reference backend (`HostOps`), through the public
//! `Ops` API only.
//!
//! With no NVIDIA driver the test prints why and passes (CI has no GPU). On a GPU:
//! `cargo test -p ember-cuda --release --test conformance -- --nocapture`.

use std::sync::{Arc, Mutex, MutexGuard};

use ember_cuda::{CudaOps, Gpu, Precision};
use ember_ops::conformance::{self, Tolerances};
use ember_ops::{AttnHeads, Batch, HostOps, KvType, LayerIdx, Mat, Ops, SeqStore, StateKind, StateLayout, Tensor, WeightSet};

/// Tolerances (the suite's measures: `rel` = largest |got − ref| over the largest |ref| of a
/// result; `quant_nmse` = pooled Σ(got − ref)² / Σref² of quantised matmuls and the MoE).
/// Measured on the H200 (2026-12-03; the suite's inputs are seeded, the kernels deterministic):
/// largest `rel` 7.45e-6 (the delta rule's chunked kernel against the reference's chunked form;
/// 4.9e-6 under `Auto`, the scan 3.5e-7 against the recurrent form), then F16 matmul
/// 1.9e-6 (f32 sums in another order), BF16/F32 matmul 8.5e-7, every other op below 3e-7,
/// embed, select_rows, add, the attn_prep gate and the conv state exact; quantised matmuls
/// NMSE up to 1.4e-13, the MoE 1.1e-13 (weights dequantised exactly, f32 sums). Bounds ~4-7x.
/// These are `Precision::Exact`'s.
const TOL: Tolerances = Tolerances { rel: 3e-5, quant_nmse: 1e-12 };

/// `Precision::Fast`: matmuls of more than 40 tokens (the suite's 70) and MoE batches of more
/// than 48 on tensor cores, weights and activations rounded to f16 (relative error <= 2^-11
/// each), f32 sums. Measured on the H200 (2026-12-03, tensor cores then at 33 and 70 tokens):
/// float matmuls `rel` 2.6e-4 (F16) to 3.2e-4 (F32); quantised matmuls NMSE 5.8e-8 to 6.6e-8,
/// the MoE 1.9e-7; every other op as under Exact. Bounds ~5-6x. One-token matmuls of Q4_K,
/// Q6_K and Q8_0 and MoE batches below the tensor-core size run on int8 activations (blocks of
/// 32, as the CPU's Fast): measured then (H200, 2026-12-04) quantised matmul_many NMSE
/// 1.2e-6 to 1.6e-6 (one token), the MoE 2.6e-5. Bound ~8x. Prompt attention on tensor cores
/// (f16 Q, K, V and weights; H200, 2026-12-04, in a build that sent the suite's chunks there):
/// `rel` 2.2e-4 (F16) to 4.0e-4 (F32), bound 5x; at the suite's sizes (rows x keys below
/// 65,536) attention now takes the f32 decode kernel (1.7e-7 to 1.9e-7).
const TOL_FAST: Tolerances = Tolerances { rel: 2e-3, quant_nmse: 2e-4 };

/// One GPU test of this file at a time: the pool test takes nearly all free device memory.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    GPU.lock().unwrap_or_else(|e| e.into_inner())
}

fn conform(precision: Precision, tol: Tolerances) {
    let _gpu = one_at_a_time();
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let report = conformance::run(
        &mut |w| {
            let mut o = CudaOps::with_precision(0, precision).unwrap_or_else(|e| panic!("CudaOps::new: {e}"));
            o.register(w).unwrap_or_else(|e| panic!("register: {e}"));
            Box::new(o)
        },
        tol,
    );
    println!("CudaOps {precision:?} conformance, largest error per check:\n{report}");
}

#[test]
fn cuda_ops_conform() {
    conform(Precision::Exact, TOL);
}

#[test]
fn cuda_ops_fast_conform() {
    conform(Precision::Fast, TOL_FAST);
}

/// A step that allocates the same shapes in the same order gets the same handles and the same
/// device addresses (what CUDA graph replay needs); a step of smaller shapes reuses the buffers.
#[test]
fn a_repeated_step_gets_the_same_device_addresses() {
    let _gpu = one_at_a_time();
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let mut set = WeightSet::new();
    let norm = set.add_vector("norm", vec![1.0; 64]);
    let mut o = CudaOps::new(0).unwrap();
    o.register(Arc::new(set)).unwrap();
    let step = |o: &mut CudaOps, n: usize| -> Vec<(Tensor, u64)> {
        o.begin_step(&Batch::default()).unwrap();
        let x = o.upload(&Mat::zeros(n, 64)).unwrap();
        let y = o.rms_norm(x, norm, 1e-6).unwrap();
        let z = o.upload(&Mat::zeros(2 * n, 64)).unwrap();
        o.add(x, y).unwrap();
        [x, y, z].into_iter().map(|t| (t, o.device_ptr(t).unwrap())).collect()
    };
    let a = step(&mut o, 8);
    let b = step(&mut o, 8);
    assert_eq!(a, b, "the same step must get the same handles and addresses");
    let c = step(&mut o, 3);
    let addr = |v: &[(Tensor, u64)]| v.iter().map(|x| x.1).collect::<Vec<_>>();
    assert_eq!(addr(&a), addr(&c), "a smaller step reuses the same buffers");
}

/// `free_since` gives the memory back to the step: eight "layers" of 1 MiB each, each freed
/// when the next begins, hold two layers' bytes, not eight, and reuse the same two buffers.
#[test]
fn freed_handles_memory_is_reused() {
    let _gpu = one_at_a_time();
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let mut o = CudaOps::new(0).unwrap();
    o.register(Arc::new(WeightSet::new())).unwrap();
    o.begin_step(&Batch::default()).unwrap();
    let h = o.upload(&Mat::from_vec(1, 64, vec![1.0; 64])).unwrap();
    let mark = o.mark();
    let mut addrs = Vec::new();
    let mut last = None;
    for l in 0..8 {
        let x = o.upload(&Mat::from_vec(1024, 256, vec![l as f32; 1024 * 256])).unwrap();
        addrs.push(o.device_ptr(x).unwrap());
        if let Some(prev) = last {
            // The layer before's output is still whole after this layer's upload.
            assert!(o.read(prev).unwrap().data.iter().all(|&v| v == (l - 1) as f32), "layer {l}: a kept handle changed");
        }
        o.free_since(mark, &[x]).unwrap();
        last = Some(x);
    }
    let bytes = o.arena_bytes();
    println!("arena after 8 layers of 1 MiB: {bytes} bytes; addresses {addrs:x?}");
    assert!(bytes <= 2 * (1 << 20) + 4096, "{bytes} bytes: freed layers must be reused");
    assert_eq!(addrs[2], addrs[0], "layer 2 reuses layer 0's buffer");
    assert_eq!(o.read(h).unwrap().data, vec![1.0; 64], "a handle made before the mark stays");
    assert!(o.device_ptr(last.unwrap()).is_ok());
}

/// The KV pool sized from free device memory fits; twice that is an error naming `configure`
/// (out of device memory is an `OpError`, never a panic), after which the store still works.
#[test]
fn kv_pool_sized_from_free_memory() {
    let _gpu = one_at_a_time();
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let layout =
        StateLayout { layers: vec![StateKind::Kv, StateKind::Delta], kv_type: KvType::F16, kv_width: 512, conv: 3 * 64, rec: 4 * 32 * 32 };
    let mut o = CudaOps::new(0).unwrap();
    let n = o.kv_pages_that_fit(&layout, 2, 2 << 30).unwrap();
    println!("{n} pages of {} bytes fit with 2 GiB kept free", layout.page_bytes());
    assert!(n > 0);
    let e = o.configure(layout.clone(), 2, 2 * n + 1).expect_err("a pool twice the free memory must be refused");
    assert_eq!(e.op, "configure", "{e}");
    println!("refused: {e}");
    o.configure(layout.clone(), 2, n).unwrap_or_else(|e| panic!("configure with the pages that fit: {e}"));
    let st = o.store_stats();
    assert_eq!((st.pages, st.pages_free, st.slots_free), (n, n, 2));
    let _slot = o.alloc_slot().unwrap();
    o.configure(layout, 1, 16).unwrap();
}

/// Milliseconds per call of `f`, `reps` calls between two stream synchronisations (a one-value
/// download), host time: launch overhead included.
fn timed(o: &mut CudaOps, reps: usize, mut f: impl FnMut(&mut CudaOps)) -> f64 {
    let s = o.upload(&Mat::zeros(1, 1)).unwrap();
    o.read(s).unwrap();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        f(o);
    }
    o.read(s).unwrap();
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}

/// Attention through `CudaOps` at the 35B model's shapes (16 query heads, 2 KV heads, head_dim
/// 256, F16 rows): one decode row at several depths, and a causal prefill of every row.
/// Timings only (`--ignored --nocapture bench`), host time around many calls: a baseline for the kernel, which scans keys
/// with one block per (head, row) and no split over the KV length yet.
#[test]
#[ignore]
fn bench_attention() {
    let _gpu = one_at_a_time();
    let Ok(_) = Gpu::new(0) else { return };
    let (nh, nkv, hd) = (16, 2, 256);
    let heads = AttnHeads { n_head: nh, n_head_kv: nkv, head_dim: hd, scale: 1.0 / 16.0 };
    let mut seed = 7u64;
    let mut mat = |n: usize, d: usize| {
        let data = (0..n * d)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Mat::from_vec(n, d, data)
    };
    let mut o = CudaOps::new(0).unwrap();
    o.register(Arc::new(WeightSet::new())).unwrap();
    for depth in [512, 4096, 32768] {
        let layout = StateLayout { layers: vec![StateKind::Kv], kv_type: KvType::F16, kv_width: nkv * hd, conv: 0, rec: 0 };
        o.configure(layout, 1, 2 * (depth / 64 + 2)).unwrap();
        let slot = o.alloc_slot().unwrap();
        let mut b = Batch::default();
        b.push(slot.id(), 0, &vec![0; depth]);
        o.begin_step(&b).unwrap();
        let (k, v) = (o.upload(&mat(depth, nkv * hd)).unwrap(), o.upload(&mat(depth, nkv * hd)).unwrap());
        o.kv_append(LayerIdx(0), k, v).unwrap();
        if depth <= 4096 {
            let q = o.upload(&mat(depth, nh * hd)).unwrap();
            o.attention(LayerIdx(0), heads, q).unwrap();
            let ms = timed(&mut o, 1, |o| {
                o.attention(LayerIdx(0), heads, q).unwrap();
            });
            let flop = 4.0 * nh as f64 * hd as f64 * (depth as f64 * (depth as f64 + 1.0) / 2.0);
            println!("bench attention prefill {depth:>6} rows: {ms:9.3} ms  {:7.2} TFLOP/s", flop / ms / 1e9);
        }
        o.end_step().unwrap();
        let mut b = Batch::default();
        b.push(slot.id(), depth, &[0]);
        o.begin_step(&b).unwrap();
        let (k, v, q) = (o.upload(&mat(1, nkv * hd)).unwrap(), o.upload(&mat(1, nkv * hd)).unwrap(), o.upload(&mat(1, nh * hd)).unwrap());
        o.kv_append(LayerIdx(0), k, v).unwrap();
        o.attention(LayerIdx(0), heads, q).unwrap();
        let ms = timed(&mut o, 50, |o| {
            o.attention(LayerIdx(0), heads, q).unwrap();
        });
        let bytes = 2.0 * (depth + 1) as f64 * (nkv * hd * 2) as f64;
        println!("bench attention decode at depth {depth:>6}: {:9.1} us  {:7.1} GB/s of K/V", ms * 1e3, bytes / ms / 1e6);
        o.end_step().unwrap();
    }
}

/// Attention with the keys split into ranges (decode rows over more than
/// `ATTENTION_SPLIT_KEYS` keys; the suite's sequences are shorter) against the reference
/// backend: two sequences prefilled in one step (one pass), then decode steps of both (split
/// into ranges), every KV type. Measured on the H200: see the printed errors (bound: the
/// suite's `rel`).
#[test]
fn split_attention_matches_the_reference() {
    let _gpu = one_at_a_time();
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let heads = AttnHeads { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125 };
    let mut rng = conformance::Rng::new(11);
    for kv_type in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let layout = StateLayout { layers: vec![StateKind::Kv], kv_type, kv_width: 128, conv: 0, rec: 0 };
        let mut g = CudaOps::with_precision(0, Precision::Exact).unwrap();
        g.register(Arc::new(WeightSet::new())).unwrap();
        let mut r = HostOps::with_weights(Arc::new(WeightSet::new()));
        let mut worst = 0f32;
        let backends: [&mut dyn Ops; 2] = [&mut g, &mut r];
        let mut slots = Vec::new();
        for o in backends {
            o.configure(layout.clone(), 2, 64).unwrap();
            slots.push([o.alloc_slot().unwrap(), o.alloc_slot().unwrap()]);
        }
        let mut lens = [0usize, 0];
        for step in [[600usize, 300], [1, 1], [1, 1], [2, 1]] {
            let n: usize = step.iter().sum();
            let (k, v, q) = (rng.mat(n, 128, 1.0), rng.mat(n, 128, 1.0), rng.mat(n, 512, 1.0));
            let mut outs = Vec::new();
            for (o, s) in [&mut g as &mut dyn Ops, &mut r].into_iter().zip(&slots) {
                let mut b = Batch::default();
                for i in 0..2 {
                    b.push(s[i].id(), lens[i], &vec![0; step[i]]);
                }
                o.begin_step(&b).unwrap();
                let (kt, vt, qt) = (o.upload(&k).unwrap(), o.upload(&v).unwrap(), o.upload(&q).unwrap());
                o.kv_append(LayerIdx(0), kt, vt).unwrap();
                let y = o.attention(LayerIdx(0), heads, qt).unwrap();
                outs.push(o.read(y).unwrap());
                o.end_step().unwrap();
            }
            worst = worst.max(conformance::max_rel(&outs[0].data, &outs[1].data));
            lens[0] += step[0];
            lens[1] += step[1];
        }
        println!("split attention {kv_type:?}: max rel {worst:.2e} against the reference");
        assert!(worst <= TOL.rel, "split attention {kv_type:?}: {worst:e}");
    }
}
