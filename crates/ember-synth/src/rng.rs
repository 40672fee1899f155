//! A small, fast, seedable PRNG (xoshiro256++, Blackman & Vigna 2019) and an approximate normal.
//!
//! No dependency: the generator must produce the same file for the same seed on every machine
//! and every version of every crate, so the algorithm is written out here.

/// SplitMix64 step: turns any u64 (seed, tensor index, chunk index) into a well-mixed state word.
pub fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mixes several words into one seed (order matters).
pub fn mix(words: &[u64]) -> u64 {
    let mut s = 0x243F_6A88_85A3_08D3u64;
    for &w in words {
        s ^= w;
        s = splitmix64(&mut s);
    }
    s
}

#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Rng { s: [splitmix64(&mut x), splitmix64(&mut x), splitmix64(&mut x), splitmix64(&mut x)] }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Approximately N(0, 1): the Irwin-Hall sum of four 16-bit uniforms, centred and scaled to
    /// unit variance. Bounded to ±3.46 (a true normal exceeds that once in ~2000 draws), which
    /// is harmless for random weights and ~10× cheaper than Box-Muller.
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        // mean of the sum: 4 · 32767.5; std: sqrt(4 · (65536² − 1) / 12)
        const MEAN: f32 = 131_070.0;
        const INV_STD: f32 = 1.0 / 37_837.23;
        (s as f32 - MEAN) * INV_STD
    }

    /// Fills `out` with N(0, std²) draws.
    pub fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        out.iter_mut().for_each(|x| *x = self.normal() * std);
    }

    /// A uniformly random permutation of 0..n (Fisher-Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            p.swap(i, j);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_moments() {
        let mut r = Rng::new(7);
        let n = 1_000_000;
        let (mut s1, mut s2) = (0f64, 0f64);
        for _ in 0..n {
            let x = r.normal() as f64;
            s1 += x;
            s2 += x * x;
        }
        let mean = s1 / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.005, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
    }

    #[test]
    fn permutation_is_a_permutation() {
        let mut p = Rng::new(3).permutation(256);
        p.sort();
        assert_eq!(p, (0..256).collect::<Vec<_>>());
    }
}
