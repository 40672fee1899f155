//! Shared by the quant_* test files: a small deterministic RNG (no dependency).
#![allow(dead_code)]

/// splitmix64 with uniform, normal and signed power-of-two draws.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// ±2^[lo, hi) as f32.
    pub fn scale(&mut self, lo: f32, hi: f32) -> f32 {
        let s = (lo + (hi - lo) * self.uniform()).exp2();
        if self.next() & 1 == 1 { -s } else { s }
    }
}
