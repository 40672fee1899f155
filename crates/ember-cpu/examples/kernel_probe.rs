//! The single-token kernels alone (no op, pool or quantiser around them) on a matrix small
//! enough for L1 or L2: `kernel_probe [rows] [k]`, one thread. Prints ns per 256 weights.

use std::time::Instant;

use ember_cpu::kernels::ActRow;
use ember_cpu::simd::{Isa, Kernels, with_kernels};
use ember_gguf::GgmlType;

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Random bytes with every block's f16 scales set to small normal values.
fn random_weights(t: GgmlType, k: usize, n_rows: usize, seed: &mut u64) -> Vec<u8> {
    let rb = t.row_bytes(k).unwrap();
    let mut w: Vec<u8> = (0..rb * n_rows).map(|_| lcg(seed) as u8).collect();
    let offs: &[usize] = match t {
        GgmlType::Q8_0 | GgmlType::IQ4XS | GgmlType::Q4_0 => &[0],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    match t {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&((lcg(seed) % 2001) as f32 / 1e5 - 0.01).to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                let v = (lcg(seed) % 2001) as f32 / 1e5 - 0.01;
                let b = if t == GgmlType::F16 { half::f16::from_f32(v).to_le_bytes() } else { half::bf16::from_f32(v).to_le_bytes() };
                c.copy_from_slice(&b);
            }
        }
        _ => {
            for block in w.chunks_exact_mut(t.type_size()) {
                for &o in offs {
                    let v = half::f16::from_f32(0.001 + (lcg(seed) % 1000) as f32 * 1e-5);
                    block[o..o + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    w
}
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
