//! Matmul timings at realistic qwen35moe shapes, through the public `Ops` API, so the same
//! harness measures every version of the backend. Random weights with valid block scales.
//!
//! `cargo run --release -p ember-cpu --example matmul_bench [-- filter] [threads]`
//! Prints the median of several repetitions: µs per call, GB/s of weight bytes read, and for
//! multi-token shapes GFLOP/s (2·n·k·rows).

use std::time::Instant;

use ember_cpu::{CpuOps, Precision};
use ember_gguf::GgmlType;
use ember_ops::{HostKernels, Mat, WeightView};

mod common;
use common::{lcg, random_weights};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filter = args.first().cloned().unwrap_or_default();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let ops = CpuOps::new(Precision::Fast, threads);
    println!("backend {} isa {:?} threads {}", ops.name(), ops.isa(), ops.n_threads());
    let mut seed = 1u64;
    // (name, type, rows, k, tokens)
    let cases: &[(&str, GgmlType, usize, usize, usize)] = &[
        ("expert_gate_q4k", GgmlType::Q4K, 512, 2048, 1),
        ("expert_down_q4k", GgmlType::Q4K, 2048, 512, 1),
        ("expert_down_q6k", GgmlType::Q6K, 2048, 512, 1),
        ("qkv_q4k", GgmlType::Q4K, 8192, 2048, 1),
        ("qkv_q5k", GgmlType::Q5K, 8192, 2048, 1),
        ("qkv_q6k", GgmlType::Q6K, 8192, 2048, 1),
        ("qkv_q8_0", GgmlType::Q8_0, 8192, 2048, 1),
        ("qkv_iq4xs", GgmlType::IQ4XS, 8192, 2048, 1),
        ("qkv_bf16", GgmlType::BF16, 8192, 2048, 1),
        ("qkv_f16", GgmlType::F16, 8192, 2048, 1),
        ("router_f32", GgmlType::F32, 256, 2048, 1),
        ("head_q6k", GgmlType::Q6K, 248320, 2048, 1),
        // The same 0.4-0.5 GB streamed from DRAM in the other decode formats.
        ("head_q8_0", GgmlType::Q8_0, 131072, 2048, 1),
        ("head_q4k", GgmlType::Q4K, 262144, 2048, 1),
        // Small enough to stay in L2 between calls: the kernels' compute rate without DRAM.
        ("l2_q4k", GgmlType::Q4K, 128, 2048, 1),
        ("l2_q6k", GgmlType::Q6K, 128, 2048, 1),
        ("l2_q8_0", GgmlType::Q8_0, 128, 2048, 1),
        ("l2_k1024_q4k", GgmlType::Q4K, 256, 1024, 1),
        ("l2_k512_q4k", GgmlType::Q4K, 512, 512, 1),
        ("l2_k1024_q6k", GgmlType::Q6K, 256, 1024, 1),
        ("l2_k1024_q8_0", GgmlType::Q8_0, 256, 1024, 1),
        ("pp_qkv_q4k", GgmlType::Q4K, 8192, 2048, 512),
        ("pp_qkv_q8_0", GgmlType::Q8_0, 8192, 2048, 512),
        ("pp_qkv_q6k", GgmlType::Q6K, 8192, 2048, 512),
        ("pp_expert_q4k", GgmlType::Q4K, 512, 2048, 16),
    ];
    for &(name, ty, rows, k, n) in cases {
        if !name.contains(&filter) {
            continue;
        }
        let data = random_weights(ty, k, rows, &mut seed);
        let w = WeightView { ty, k, n_rows: rows, data: &data };
        let x = Mat::from_vec(n, k, (0..n * k).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect());
        let bytes = data.len() as f64;
        let flops = 2.0 * (n * k * rows) as f64;
        // Repeat until ~0.3 s of work (at least 5 calls), then median.
        let t0 = Instant::now();
        std::hint::black_box(ops.matmul_view(&w, &x));
        let once = t0.elapsed().as_secs_f64();
        let reps = ((0.3 / once) as usize).clamp(5, 2000);
        let mut ts = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t = Instant::now();
            std::hint::black_box(ops.matmul_view(&w, &x));
            ts.push(t.elapsed().as_secs_f64());
        }
        let m = median(ts);
        println!(
            "{name:18} {ty:>6} {rows:>6}x{k:<5} n={n:<4} {:>10.1} us {:>7.2} GB/s {:>8.1} GFLOP/s",
            m * 1e6,
            bytes / m / 1e9,
            flops / m / 1e9
        );
        if std::env::var("READ_SAME").is_ok() && name.starts_with("head") {
            // The same buffer read by a plain sum loop, two halves on two threads.
            let mut ts = Vec::new();
            for _ in 0..5 {
                let t = Instant::now();
                std::thread::scope(|sc| {
                    for half in data.chunks(data.len().div_ceil(2)) {
                        sc.spawn(move || {
                            let mut acc = [0u64; 8];
                            for c in half.chunks_exact(64) {
                                for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
                                    *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                                }
                            }
                            std::hint::black_box(acc);
                        });
                    }
                });
                ts.push(t.elapsed().as_secs_f64());
            }
            let m = median(ts);
            println!("{:18} plain read of the same bytes: {:>7.2} GB/s", "", bytes / m / 1e9);
        }
    }

    // One decode-sized GEMV after another over distinct matrices (~300 MB in all, so each comes
    // from DRAM as in a decode step): what a whole op streams, start-up and tail included,
    // against the one long matrix of `head_*`.
    for &(name, ty, rows, k) in &[
        ("ops_ssm_out_q8_0", GgmlType::Q8_0, 1024usize, 4096usize),
        ("ops_2048_q8_0", GgmlType::Q8_0, 2048, 2048),
        ("ops_16k_q8_0", GgmlType::Q8_0, 16384, 2048),
        ("ops_ssm_out_q4k", GgmlType::Q4K, 1024, 4096),
        ("ops_expert_q8_0", GgmlType::Q8_0, 512, 1024),
        ("ops_expert_q4k", GgmlType::Q4K, 512, 1024),
    ] {
        if !name.contains(&filter) || filter.is_empty() {
            continue;
        }
        let one = ty.row_bytes(k).unwrap() * rows;
        let copies = (300 << 20) / one;
        let ws: Vec<Vec<u8>> = (0..copies).map(|_| random_weights(ty, k, rows, &mut seed)).collect();
        let x = Mat::from_vec(1, k, (0..k).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect());
        let mut ts = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for data in &ws {
                let w = WeightView { ty, k, n_rows: rows, data };
                std::hint::black_box(ops.matmul_view(&w, &x));
            }
            ts.push(t.elapsed().as_secs_f64());
        }
        let m = median(ts);
        println!(
            "{name:18} {ty:>6} {rows:>6}x{k:<5} x{copies}: {:>8.1} us per op {:>7.2} GB/s",
            m * 1e6 / copies as f64,
            (one * copies) as f64 / m / 1e9
        );
    }

    // A decode-step-like sequence: 1000 small parallel regions (expert-sized GEMVs over 40
    // distinct weights, ~24 MB), with 2 µs of serial work between regions.
    if "regions".contains(&filter) || filter.is_empty() {
        let ws: Vec<Vec<u8>> = (0..40).map(|_| random_weights(GgmlType::Q4K, 2048, 512, &mut seed)).collect();
        let x = Mat::from_vec(1, 2048, (0..2048).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect());
        let mut ts = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            for i in 0..1000 {
                let w = WeightView { ty: GgmlType::Q4K, k: 2048, n_rows: 512, data: &ws[i % 40] };
                std::hint::black_box(ops.matmul_view(&w, &x));
                let s = Instant::now();
                while s.elapsed().as_nanos() < 2000 {
                    std::hint::spin_loop();
                }
            }
            ts.push(t.elapsed().as_secs_f64());
        }
        let m = median(ts);
        println!("regions: 1000 x (512x2048 Q4_K gemv + 2 us serial): {:.2} ms, {:.2} us per region", m * 1e3, m * 1e3);
    }
}
