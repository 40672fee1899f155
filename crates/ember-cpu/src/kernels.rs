//! Integer dot products of quantised weight rows with 8-bit activations in blocks of 32.
//!
//! llama.cpp quantises activations for K-quant weights to Q8_K: one scale per 256 values. We use
//! one f32 scale per 32 values ([`ActRow`]) for every weight type instead. For the integer
//! K-quant decode kernels ([`ActRow::quantize_grouped`]) each block's scale is an integer
//! multiple of a unit per 256, `d256·m32[b]` with `m32[b]` in 0..=32, the smallest that holds
//! its largest value: a block at a tenth of its group's maximum still gets codes about eight
//! times finer than Q8_K gives it, and the kernels can sum a whole 256-block in integers (the
//! weight's sub-block scale times `m32` is an integer) and scale once per 256 weights, as
//! llama.cpp does. Ops without K-quant weights keep each block's own best scale.
//!
//! Every weight block is viewed as groups of 16 weights `y = s·q + o` with integer `q`
//! ([`Groups`]); a group's contribution is `dx · (s·Σq·a + o·Σa)`. The per-type unpackers follow
//! shared/spec/gguf-format.md §4–5. This file is the scalar reference; the SIMD kernels in [`crate::simd`] are tested against it.

use ember_gguf::GgmlType;

/// One activation row quantised to 8 bits in blocks of 32, with per-16 sums.
#[derive(Debug, Clone, Default)]
pub struct ActRow {
    /// The scale of each block of 32: `d[b] = d256[b / 8] · m32[b]` (in f32).
    pub d: Vec<f32>,
    pub q: Vec<i8>,
    /// The unit scale of each group of 256 values (8 blocks; the last group may be shorter):
    /// its largest |x| / 127 / [`MAX_MULT`].
    pub d256: Vec<f32>,
    /// Each block's scale in units of its group's `d256` (0..=[`MAX_MULT`]).
    pub m32: Vec<i16>,
    /// `m32` per group of 16 (each block's value twice), for the Q6_K kernels.
    pub m16: Vec<i16>,
    /// `sum16` as i16 (|Σq| ≤ 16·127), with grouped scales only.
    pub s16: Vec<i16>,
    /// Σq over each group of 16 (two per block).
    pub sum16: Vec<i32>,
    /// `d·Σq` over each group of 16, and over each block of 32: the activation sums that
    /// weight offsets (K-quant mins, Q6_K's −32) multiply, pre-scaled for the SIMD kernels.
    pub ds16: Vec<f32>,
    pub ds32: Vec<f32>,
    /// `q + 128` as unsigned bytes, for panel products ([`crate::panel`]); filled only by
    /// [`ActRow::fill_unsigned`].
    pub qu: Vec<u8>,
    /// The codes in Q4_K nibble order ([`ActRow::fill_k4_order`]): per 256, the 32-blocks
    /// 0, 2, 1, 3, 4, 6, 5, 7, so that the low nibbles of two neighbouring 32-byte Q4_K chunks
    /// meet their activations in one 64-byte load. Empty unless filled.
    pub qk: Vec<i8>,
}

impl ActRow {
    /// Quantises `x` (length a multiple of 32): `d = max|x| / 127`, `q = round(x / d)` (half away
    /// from zero), d kept in f32.
    pub fn quantize(x: &[f32], out: &mut ActRow) {
        let nb = x.len() / 32;
        out.resize(nb, false);
        for b in 0..nb {
            let xs = &x[b * 32..(b + 1) * 32];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let qs = &mut out.q[b * 32..(b + 1) * 32];
            for (q, v) in qs.iter_mut().zip(xs) {
                *q = (v * id).round().clamp(-127.0, 127.0) as i8;
            }
            let s0 = qs[..16].iter().map(|&v| v as i32).sum();
            let s1 = qs[16..].iter().map(|&v| v as i32).sum();
            out.set_block(b, d, s0, s1);
        }
    }

    /// Quantises `x` (length a multiple of 32) with grouped scales, for the integer K-quant
    /// kernels: per group of 8 blocks, with `top` its largest |x|, `d256 = top / 127 /
    /// MAX_MULT`; block b with largest |x| `amax` takes `m = ⌈MAX_MULT·amax / top⌉`,
    /// `d = d256·m` and `q = round(x / d)` (half away from zero).
    pub fn quantize_grouped(x: &[f32], out: &mut ActRow) {
        let nb = x.len() / 32;
        out.resize(nb, true);
        for g in 0..nb.div_ceil(8) {
            let blocks = 8 * g..(8 * g + 8).min(nb);
            let mut amax = [0f32; 8];
            for b in blocks.clone() {
                amax[b - 8 * g] = x[b * 32..(b + 1) * 32].iter().fold(0f32, |m, v| m.max(v.abs()));
            }
            let top = amax.iter().fold(0f32, |m, &v| m.max(v));
            let unit = top / 127.0 / MAX_MULT as f32;
            out.d256[g] = unit;
            for b in blocks {
                let m = block_mult(amax[b - 8 * g], top);
                let d = unit * m as f32;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                let qs = &mut out.q[b * 32..(b + 1) * 32];
                for (q, v) in qs.iter_mut().zip(&x[b * 32..(b + 1) * 32]) {
                    *q = (v * id).round().clamp(-127.0, 127.0) as i8;
                }
                let s0 = qs[..16].iter().map(|&v| v as i32).sum();
                let s1 = qs[16..].iter().map(|&v| v as i32).sum();
                out.set_block(b, d, s0, s1);
                out.set_mult(b, m);
            }
        }
    }

    /// Sizes the buffers for `nb` blocks (no allocation once they are large enough); the group
    /// scales only when `grouped` (kernels read their absence as "per-32 scales only").
    pub fn resize(&mut self, nb: usize, grouped: bool) {
        // The derived forms describe the old codes: drop them (kernels check their length).
        self.qu.clear();
        self.qk.clear();
        self.d.resize(nb, 0.0);
        self.q.resize(nb * 32, 0);
        self.sum16.resize(nb * 2, 0);
        self.ds16.resize(nb * 2, 0.0);
        self.ds32.resize(nb, 0.0);
        let ng = if grouped { nb } else { 0 };
        self.d256.resize(ng.div_ceil(8), 0.0);
        self.m32.resize(ng, 0);
        self.m16.resize(ng * 2, 0);
        self.s16.resize(ng * 2, 0);
    }

    /// Whether the row carries grouped scales ([`ActRow::quantize_grouped`]).
    pub fn is_grouped(&self) -> bool {
        !self.q.is_empty() && self.m32.len() * 32 == self.q.len()
    }

    /// Stores block `b`'s scale and the sums of its two halves.
    #[inline]
    pub fn set_block(&mut self, b: usize, d: f32, s0: i32, s1: i32) {
        self.d[b] = d;
        self.sum16[2 * b] = s0;
        self.sum16[2 * b + 1] = s1;
        self.ds16[2 * b] = d * s0 as f32;
        self.ds16[2 * b + 1] = d * s1 as f32;
        self.ds32[b] = d * (s0 + s1) as f32;
    }

    /// Stores block `b`'s multiple of its group's `d256`, and its sums as i16 (after
    /// [`ActRow::set_block`]).
    #[inline]
    pub fn set_mult(&mut self, b: usize, m: i16) {
        self.m32[b] = m;
        self.m16[2 * b] = m;
        self.m16[2 * b + 1] = m;
        self.s16[2 * b] = self.sum16[2 * b] as i16;
        self.s16[2 * b + 1] = self.sum16[2 * b + 1] as i16;
    }

    /// Fills [`ActRow::qk`] from `q` (when the length is a multiple of 256).
    pub fn fill_k4_order(&mut self) {
        self.qk.clear();
        if !self.q.len().is_multiple_of(256) {
            return;
        }
        for sb in self.q.chunks_exact(256) {
            for blk in [0, 2, 1, 3, 4, 6, 5, 7] {
                self.qk.extend_from_slice(&sb[32 * blk..32 * blk + 32]);
            }
        }
    }

    /// Fills [`ActRow::qu`] from `q`.
    pub fn fill_unsigned(&mut self) {
        self.qu.clear();
        self.qu.extend(self.q.iter().map(|&v| (v as u8) ^ 0x80));
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// The largest multiple of its group's unit a block's scale can be (the group's largest
/// block). The K-quant kernels' integer sums are bounded with it (simd/x86_int.rs).
pub const MAX_MULT: i16 = 32;

/// The multiple of its group's unit for a block with largest |x| `amax` in a group with largest
/// |x| `top`: `⌈MAX_MULT·amax / top⌉` (0 for an all-zero block), so its codes fit in ±127.
#[inline]
pub fn block_mult(amax: f32, top: f32) -> i16 {
    if top > 0.0 { ((amax * MAX_MULT as f32 / top).ceil() as i16).clamp(0, MAX_MULT) } else { 0 }
}

/// Whether [`dot`] handles this weight type.
pub fn supported(t: GgmlType) -> bool {
    use GgmlType::*;
    matches!(t, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4NL | Q2K | Q3K | Q4K | Q5K | Q6K | IQ4XS)
}

/// A weight block unpacked into groups of 16: `y[16g + j] = s[g]·q[16g + j] + o[g]`.
struct Groups {
    q: [i8; 256],
    s: [f32; 16],
    o: [f32; 16],
}

impl Groups {
    fn new() -> Self {
        Groups { q: [0; 256], s: [0.0; 16], o: [0.0; 16] }
    }
}

const IQ4NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

fn f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (gguf-format.md §5).
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) }
}

/// Unpacks one block of `t` into `g`; returns the number of weights (32 or 256).
fn unpack(t: GgmlType, b: &[u8], g: &mut Groups) -> usize {
    use GgmlType::*;
    match t {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4NL => {
            let d = f16(b, 0);
            let (m, qh, qs): (f32, u32, &[u8]) = match t {
                Q4_0 | IQ4NL => (0.0, 0, &b[2..18]),
                Q4_1 => (f16(b, 2), 0, &b[4..20]),
                Q5_0 => (0.0, u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
                Q5_1 => (f16(b, 2), u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]),
                _ => (0.0, 0, &b[2..34]), // Q8_0
            };
            for j in 0..16 {
                let (lo, hi) = match t {
                    Q8_0 => (qs[j] as i8 as i32, qs[j + 16] as i8 as i32),
                    IQ4NL => (IQ4NL_VALUES[(qs[j] & 0xF) as usize] as i32, IQ4NL_VALUES[(qs[j] >> 4) as usize] as i32),
                    _ => {
                        let (l, h) = ((qs[j] & 0xF) as i32, (qs[j] >> 4) as i32);
                        let (l5, h5) = (l | (((qh >> j) & 1) << 4) as i32, h | (((qh >> (j + 16)) & 1) << 4) as i32);
                        match t {
                            Q4_0 => (l - 8, h - 8),
                            Q4_1 => (l, h),
                            Q5_0 => (l5 - 16, h5 - 16),
                            _ => (l5, h5), // Q5_1
                        }
                    }
                };
                g.q[j] = lo as i8;
                g.q[j + 16] = hi as i8;
            }
            g.s[..2].fill(d);
            g.o[..2].fill(m);
            32
        }
        Q4K | Q5K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if t == Q5K { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
            for p in 0..4 {
                for half in 0..2 {
                    let sub = 2 * p + half;
                    let (s, m) = scale_min_k4(sc, sub);
                    for l in 0..32 {
                        let nib = if half == 0 { qs[32 * p + l] & 0xF } else { qs[32 * p + l] >> 4 };
                        let hi = if t == Q5K { ((qh[l] >> sub) & 1) << 4 } else { 0 };
                        g.q[64 * p + 32 * half + l] = (nib | hi) as i8;
                    }
                    g.s[2 * sub] = d * s as f32;
                    g.s[2 * sub + 1] = d * s as f32;
                    g.o[2 * sub] = -dmin * m as f32;
                    g.o[2 * sub + 1] = -dmin * m as f32;
                }
            }
            256
        }
        Q6K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16(b, 208));
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                for l in 0..32 {
                    let q = [
                        (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                        (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                        (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                        (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                    ];
                    for (i, v) in q.iter().enumerate() {
                        g.q[128 * n + 32 * i + l] = *v as i8 - 32;
                    }
                }
            }
            // group g covers weights 16g..16g+16: half n = g / 8, in-half offset 16·(g % 8) =
            // 32·i + 16·s, so its scale is sc[8n + s + 2i].
            for grp in 0..16 {
                let (n, r) = (grp / 8, grp % 8);
                let (i, s) = (r / 2, r % 2);
                g.s[grp] = d * sc[8 * n + s + 2 * i] as i8 as f32;
                g.o[grp] = 0.0;
            }
            256
        }
        Q3K => {
            let (hm, qs, sc, d) = (&b[0..32], &b[32..96], &b[96..108], f16(b, 108));
            for i in 0..16 {
                let low4 = if i < 8 { sc[i] & 0xF } else { sc[i - 8] >> 4 };
                let high2 = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
                g.s[i] = d * ((low4 | (high2 << 4)) as i32 - 32) as f32;
                g.o[i] = 0.0;
            }
            for n in 0..2 {
                let q = &qs[32 * n..];
                for j in 0..4 {
                    let m = 4 * n + j;
                    for l in 0..32 {
                        let lo2 = (q[l] >> (2 * j)) & 3;
                        let sub = if (hm[l] >> m) & 1 == 1 { 0 } else { 4 };
                        g.q[128 * n + 32 * j + l] = lo2 as i8 - sub;
                    }
                }
            }
            256
        }
        Q2K => {
            let (sc, qs, d, dmin) = (&b[0..16], &b[16..80], f16(b, 80), f16(b, 82));
            for n in 0..2 {
                let q = &qs[32 * n..];
                for j in 0..4 {
                    for l in 0..32 {
                        g.q[128 * n + 32 * j + l] = ((q[l] >> (2 * j)) & 3) as i8;
                    }
                }
            }
            // group index = 16-weight group = 8n + 2j (+1 for the second 16) = scales index.
            for (i, s) in sc.iter().enumerate() {
                g.s[i] = d * (s & 0xF) as f32;
                g.o[i] = -dmin * (s >> 4) as f32;
            }
            256
        }
        IQ4XS => {
            let d = f16(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let (sl, qs) = (&b[4..8], &b[8..136]);
            for sub in 0..8 {
                let ls = ((sl[sub / 2] >> (4 * (sub % 2))) & 0xF) as i32 | ((((sh >> (2 * sub)) & 3) as i32) << 4);
                let dl = d * (ls - 32) as f32;
                for j in 0..16 {
                    let byte = qs[16 * sub + j];
                    g.q[32 * sub + j] = IQ4NL_VALUES[(byte & 0xF) as usize];
                    g.q[32 * sub + 16 + j] = IQ4NL_VALUES[(byte >> 4) as usize];
                }
                g.s[2 * sub] = dl;
                g.s[2 * sub + 1] = dl;
                g.o[2 * sub] = 0.0;
                g.o[2 * sub + 1] = 0.0;
            }
            256
        }
        F32 | F16 | BF16 | Q8_1 | Q8K => unreachable!("dot() is only called for types where supported() is true"),
    }
}

/// Unpacks one block of `t` ([`supported`]) into integer codes `q`, and a scale `s` and an
/// offset `o` per group of 16 (`y = s·q + o`); returns the number of weights.
pub fn unpack_block(t: GgmlType, block: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) -> usize {
    let mut g = Groups::new();
    let n = unpack(t, block, &mut g);
    q[..n].copy_from_slice(&g.q[..n]);
    s[..n / 16].copy_from_slice(&g.s[..n / 16]);
    o[..n / 16].copy_from_slice(&g.o[..n / 16]);
    n
}

/// Σ_j W[j]·x[j] for one weight row of type `t` and its activations `a` (same length).
pub fn dot(t: GgmlType, w: &[u8], a: &ActRow) -> f32 {
    let (bs, ts) = (t.block_size(), t.type_size());
    let mut g = Groups::new();
    let mut acc = 0f32;
    for (bi, block) in w.chunks_exact(ts).enumerate() {
        let n = unpack(t, block, &mut g);
        let g0 = bi * bs / 16; // first activation group of this block
        for grp in 0..n / 16 {
            let ag = g0 + grp;
            let qa = &a.q[ag * 16..ag * 16 + 16];
            let qw = &g.q[grp * 16..grp * 16 + 16];
            let isum: i32 = qw.iter().zip(qa).map(|(x, y)| *x as i32 * *y as i32).sum();
            acc += a.d[ag / 2] * (g.s[grp] * isum as f32 + g.o[grp] * a.sum16[ag] as f32);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes / floats (no dependency).
    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// A random but valid weight row: random bytes with the f16 scales set to small normal values.
    fn random_row(t: GgmlType, n: usize, seed: &mut u64) -> Vec<u8> {
        let mut w: Vec<u8> = (0..t.row_bytes(n).unwrap()).map(|_| lcg(seed) as u8).collect();
        let scale_offsets: &[usize] = match t {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            GgmlType::Q3K => &[108],
            GgmlType::Q2K => &[80, 82],
            _ => &[],
        };
        for block in w.chunks_exact_mut(t.type_size()) {
            for &o in scale_offsets {
                let v = half::f16::from_f32(0.001 + (lcg(seed) % 1000) as f32 * 1e-5);
                block[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// The integer kernel equals the f64 dot of the exactly dequantised weights with the
    /// dequantised activations, to f32 rounding (measured < 2e-6 relative).
    #[test]
    fn dot_matches_dequantised_reference() {
        let mut seed = 7u64;
        for t in GgmlType::all().filter(|t| supported(*t)) {
            for n_blocks in [1usize, 3, 8] {
                let n = n_blocks * t.block_size().max(32);
                let n = if t.block_size() == 32 { n_blocks * 32 * 3 } else { n };
                let w = random_row(t, n, &mut seed);
                let x: Vec<f32> = (0..n).map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0).collect();
                let mut a = ActRow::default();
                ActRow::quantize(&x, &mut a);
                let mut wf = vec![0f32; n];
                ember_gguf::quant::dequantize(t, &w, &mut wf).unwrap();
                let want: f64 = (0..n).map(|i| wf[i] as f64 * a.d[i / 32] as f64 * a.q[i] as f64).sum();
                let norm: f64 = (0..n).map(|i| (wf[i] as f64 * a.d[i / 32] as f64 * a.q[i] as f64).abs()).sum();
                let got = dot(t, &w, &a) as f64;
                assert!((got - want).abs() <= 1e-5 * norm.max(1e-12), "{t} n={n}: got {got}, want {want} (norm {norm})");
            }
        }
    }

    /// Activation rounding: half away from zero, error at most d/2 per value.
    #[test]
    fn activation_quantisation() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 10.0).collect();
        let mut a = ActRow::default();
        ActRow::quantize(&x, &mut a);
        for (i, v) in x.iter().enumerate() {
            let d = a.d[i / 32];
            assert!((a.q[i] as f32 * d - v).abs() <= d / 2.0 + 1e-6);
        }
        assert_eq!(a.sum16[0], a.q[..16].iter().map(|&v| v as i32).sum::<i32>());
        let mut z = ActRow::default();
        ActRow::quantize(&[0.0; 32], &mut z);
        assert_eq!(z.d[0], 0.0);
        assert!(z.q.iter().all(|&q| q == 0));
    }
}
