//! Times one attention call of a prompt batch at depth (the CPU fast path), e.g.
//! `cargo run --release -p ember-cpu --example attn_bench -- 512 4096 2 f16`:
//! tokens, depth, threads, KV type (f16, q8_0, f32); the 35B-A3B head shape (16 query heads,
//! 2 KV heads, 256; `KVH=n` makes it n KV heads of 8 query heads each; `LAYERS=n` n caches
//! read in turn, to time them from memory rather than L3). One token is a decode
//! step. After one untimed call it repeats the call for at least a second (at least 3 times)
//! and prints each time, then the fastest and the median (the machine is shared: the fastest
//! is the kernel, the median what it got).

use ember_cpu::{CpuOps, Precision};
use ember_ops::{AttnShape, KvRows, KvType, Mat, PagePool};

fn main() {
    if std::env::var("EMBER_GEMM_PROBE").is_ok() {
        return probe();
    }
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (n_tok, depth, threads) = (arg(1, 512), arg(2, 4096), arg(3, 2));
    let ty = a.get(4).and_then(|s| KvType::parse(s)).unwrap_or(KvType::F16);
    let kvh: usize = std::env::var("KVH").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let (n_head, n_head_kv, hd) = (8 * kvh, kvh, 256);
    let mut seed = 1u64;
    let mut rnd = |n: usize, d: usize| {
        Mat::from_vec(
            n,
            d,
            (0..n * d)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                })
                .collect(),
        )
    };
    let pool = PagePool::unbounded();
    // `LAYERS=n` makes n caches, a call each in turn (n large enough to leave the L3 cache
    // behind, as a model's layers do).
    let layers: usize = std::env::var("LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let caches: Vec<(KvRows, KvRows)> = (0..layers)
        .map(|_| {
            let (mut kc, mut vc) = (KvRows::new(ty, n_head_kv * hd), KvRows::new(ty, n_head_kv * hd));
            kc.push(&rnd(depth + n_tok, n_head_kv * hd), &pool).unwrap();
            vc.push(&rnd(depth + n_tok, n_head_kv * hd), &pool).unwrap();
            (kc, vc)
        })
        .collect();
    let mut layer = 0;
    let mut next = || {
        layer = (layer + 1) % layers;
        &caches[layer]
    };
    let q = rnd(n_tok, n_head * hd);
    let s = AttnShape { n_tok, n_head, n_head_kv, head_dim: hd, pos0: depth, scale: 1.0 / (hd as f32).sqrt() };
    let ops = CpuOps::new(Precision::Fast, threads);
    let flop = 4.0 * (n_head * hd) as f64 * (0..n_tok).map(|t| (depth + t + 1) as f64).sum::<f64>();
    // CPU time of this thread (the pool runs a 1-thread call inline): on a shared machine it
    // says what the kernel costs when the wall clock does not.
    let cpu_ns = || -> f64 {
        let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
        s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    for _ in 0..layers {
        let (kc, vc) = next();
        std::hint::black_box(ops.attention_rows(s, &q, kc, vc));
    }
    let (mut walls, mut cpus) = (Vec::new(), Vec::new());
    let start = std::time::Instant::now();
    while walls.len() < 3 || (start.elapsed().as_secs_f64() < 1.0 && walls.len() < 1000) {
        let (kc, vc) = next();
        let (t, c) = (std::time::Instant::now(), cpu_ns());
        std::hint::black_box(ops.attention_rows(s, &q, kc, vc));
        let (dt, dc) = (t.elapsed().as_secs_f64(), (cpu_ns() - c) / 1e9);
        if walls.len() < 8 {
            println!(
                "n_tok {n_tok} depth {depth} {ty:?} threads {threads}: {:.2} ms, {:.1} GFLOP/s (this thread's CPU {:.2} ms: {:.1} GFLOP/s)",
                dt * 1e3,
                flop / dt / 1e9,
                dc * 1e3,
                flop / dc / 1e9
            );
        }
        walls.push(dt);
        cpus.push(dc);
    }
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let (walls, cpus) = (sorted(walls), sorted(cpus));
    let n = walls.len();
    println!(
        "summary n_tok {n_tok} depth {depth} {ty:?} threads {threads}: {n} calls, wall min {:.3} ms median {:.3} ms; this thread's CPU median {:.3} ms",
        walls[0] * 1e3,
        walls[n / 2] * 1e3,
        cpus[n / 2] * 1e3
    );
}

/// The two products of a tile alone (operands in cache), `EMBER_GEMM_PROBE=1`.
#[allow(dead_code)]
fn probe() {
    use ember_cpu::simd::{Gemm, Kernels};
    let isa = ember_cpu::Isa::detect();
    ember_cpu::simd::with_kernels!(isa, |kn| {
        for (name, m, n, kd, lda, ldb, ldc) in [("qk", 64, 64, 256, 272, 64, 64), ("pv", 64, 64, 64, 64, 64, 256)] {
            let a = vec![0.5f32; m * lda];
            let b = vec![0.25f32; kd * ldb];
            let mut c = vec![0f32; m * ldc];
            let g = Gemm { a: &a, lda, b: &b, ldb, ldc, m, n, kd, acc: true };
            let reps = 20000;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                kn.gemm_f32(&g, &mut c);
            }
            let dt = t.elapsed().as_secs_f64();
            println!("{name}: {:.1} GFLOP/s", 2.0 * (m * n * kd * reps) as f64 / dt / 1e9);
        }
    });
}
