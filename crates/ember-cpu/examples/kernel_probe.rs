//! The single-token kernels alone (no op, pool or quantiser around them) on a matrix small
//! enough for L1 or L2: `kernel_probe [rows] [k]`, one thread. Prints ns per 256 weights.

use std::time::Instant;

use ember_cpu::kernels::ActRow;
use ember_cpu::simd::{Isa, Kernels, with_kernels};
use ember_gguf::GgmlType;

mod common;
use common::{lcg, random_weights};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rows: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(16);
    let k: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let mut seed = 1u64;
    let x: Vec<f32> = (0..k).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut a = ActRow::default();
    // Grouped scales, as ops quantise for K-quant weights (the Q8_0 kernel reads either).
    ActRow::quantize_grouped(&x, &mut a);
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
        let w = random_weights(ty, k, rows, &mut seed);
        let rb = w.len() / rows;
        let mut out = vec![0f32; rows];
        let best = with_kernels!(Isa::detect(), |kk| {
            let mut best = f64::MAX;
            for _ in 0..200 {
                let t = Instant::now();
                for _ in 0..20 {
                    kk.dot_rows(ty, &w, rb, &a, &mut out, |_| {});
                    std::hint::black_box(&mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / 20.0);
            }
            best
        });
        println!("{ty:>5} {rows}x{k}: {:6.2} ns per 256 weights", best * 1e9 / (rows * k / 256) as f64);
    }
}
