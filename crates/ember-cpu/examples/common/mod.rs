//! Random weights with valid block scales, shared by the kernel benchmarks (`mod common;`).

use ember_gguf::GgmlType;

pub fn lcg(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *seed >> 33
}

/// Random bytes with every block's f16 scales set to small normal values.
pub fn random_weights(t: GgmlType, k: usize, n_rows: usize, seed: &mut u64) -> Vec<u8> {
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
