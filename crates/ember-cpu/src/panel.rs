//! Weight panels for prompt-sized matrix products: 16 weight rows unpacked once into 8-bit codes
//! laid out so that one 512-bit vector holds four consecutive weights of each of the 16 rows.
//!
//! A GEMV (decode) reads each weight once and is bound by memory; a prompt GEMM reuses every
//! weight for hundreds of tokens and is bound by the multiply-adds. There, the per-block
//! decoding of the quantised formats and the horizontal sums of a row-major dot product cost
//! more than the products themselves. A panel pays the decoding once per 16 rows, and its
//! row-interleaved layout lets `vpdpbusd` put the 16 rows in the 16 lanes of one register: each
//! lane accumulates its row's products over a whole group of `G` weights in integers, and the
//! group's float scale is applied once per group, token and 16 rows.
//!
//! Meaning of a panel, for row `r` and weight `j` in group `g = j / G`:
//! `W[r][j] = sc[g][r] · q[j][r] + off[g][r]` with signed 8-bit `q`. The activations enter as
//! unsigned bytes `qa + 128` ([`ActRow::fill_unsigned`]) because `vpdpbusd` multiplies unsigned
//! by signed bytes; `corr[g][r] = −128 · Σ_{j∈g} q[j][r]` removes the +128 exactly, in integers.
//!
//! This file holds the layout, the scalar unpacker and the scalar product (the reference the
//! AVX-512 kernels in [`crate::simd::avx512`] are tested against, bit for bit for the unpacking).

use ember_gguf::GgmlType;

use crate::kernels::{self, ActRow};

/// Rows per panel: the lanes of a 512-bit vector of i32.
pub const ROWS: usize = 16;

/// 16 values, aligned to a cache line (one 512-bit load).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[repr(C, align(64))]
pub struct Lanes<T: Copy>(pub [T; ROWS]);

/// Up to 16 weight rows over the whole row length, unpacked (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Panel {
    pub ty: Option<GgmlType>,
    /// Weights per row.
    pub k: usize,
    /// Weights per scale group: 16 or 32 ([`group`]).
    pub g: usize,
    /// Rows that are real (the others repeat the last real row and are ignored).
    pub m: usize,
    /// `q[j / 4]` holds weights `j..j + 4` of each row: lane r = 4 bytes of row r.
    pub q: Vec<Lanes<i32>>,
    pub sc: Vec<Lanes<f32>>,
    pub off: Vec<Lanes<f32>>,
    pub corr: Vec<Lanes<i32>>,
    /// Whether any `off` is non-zero (K-quants with mins); the kernels skip the term otherwise.
    pub has_off: bool,
}

/// Weights per scale group in a panel of `ty`: 16 where the format has a scale per 16 weights.
pub fn group(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::Q2K => 16,
        _ => 32,
    }
}

/// Whether a panel can hold weights of `ty` (every format with integer codes).
pub fn supported(ty: GgmlType) -> bool {
    kernels::supported(ty)
}

/// Whether `ty` has non-zero group offsets (mins).
fn has_off(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_1 | Q5_1 | Q4K | Q5K | Q2K)
}

impl Panel {
    /// Sizes the buffers for `k` weights of `ty` (no allocation once they are large enough).
    pub fn reset(&mut self, ty: GgmlType, k: usize, m: usize) {
        let g = group(ty);
        assert!(k.is_multiple_of(ty.block_size()) && k.is_multiple_of(g), "panel: {k} weights are not whole blocks of {ty}");
        assert!((1..=ROWS).contains(&m), "panel: {m} rows");
        self.ty = Some(ty);
        self.k = k;
        self.g = g;
        self.m = m;
        self.has_off = has_off(ty);
        self.q.resize(k / 4, Lanes::default());
        self.sc.resize(k / g, Lanes::default());
        self.off.resize(k / g, Lanes::default());
        self.corr.resize(k / g, Lanes::default());
    }

    /// Unpacks rows `rows` (1..=16 rows of `ty`, `k` weights each) with the scalar decoder.
    pub fn unpack_scalar(&mut self, ty: GgmlType, k: usize, rows: &[&[u8]]) {
        self.reset(ty, k, rows.len());
        let g = self.g;
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let mut w = vec![0i8; k];
        let mut s16 = vec![0f32; k / 16];
        let mut o16 = vec![0f32; k / 16];
        for r in 0..ROWS {
            let row = rows[r.min(rows.len() - 1)];
            for (bi, block) in row[..k / bs * ts].chunks_exact(ts).enumerate() {
                let n = kernels::unpack_block(ty, block, &mut w[bi * bs..], &mut s16[bi * bs / 16..], &mut o16[bi * bs / 16..]);
                debug_assert_eq!(n, bs);
            }
            for j4 in 0..k / 4 {
                let b = [w[4 * j4], w[4 * j4 + 1], w[4 * j4 + 2], w[4 * j4 + 3]];
                self.q[j4].0[r] = i32::from_le_bytes(b.map(|v| v as u8));
            }
            for gi in 0..k / g {
                // A group of 32 has the scale and offset of its first 16 (the formats with
                // G = 32 repeat them for the second half).
                self.sc[gi].0[r] = s16[gi * g / 16];
                self.off[gi].0[r] = o16[gi * g / 16];
                let sum: i32 = w[gi * g..(gi + 1) * g].iter().map(|&v| v as i32).sum();
                self.corr[gi].0[r] = -128 * sum;
            }
        }
    }

    /// The 16 row dots with one activation row, in the kernels' order of operations: per
    /// group, the exact integer `Σ q·(qa + 128) + corr = Σ q·qa`, then
    /// `acc += (sc · d_a) · isum + off · (d_a · Σ qa)`.
    pub fn dot_scalar(&self, a: &ActRow) -> [f32; ROWS] {
        let mut out = [0f32; ROWS];
        let g = self.g;
        for (r, o) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for gi in 0..self.k / g {
                let mut isum = self.corr[gi].0[r];
                for j in gi * g..(gi + 1) * g {
                    let w = self.q[j / 4].0[r].to_le_bytes()[j % 4] as i8;
                    isum += w as i32 * (a.q[j] as i32 + 128);
                }
                let da = a.d[gi * g / 32];
                let ds = if g == 32 { a.ds32[gi] } else { a.ds16[gi] };
                acc += (self.sc[gi].0[r] * da) * isum as f32 + self.off[gi].0[r] * ds;
            }
            *o = acc;
        }
        out
    }
}
