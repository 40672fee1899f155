//! The AVX-512 prompt kernels: the register tiles of `Kernels::gemm_f32` and `gemm_bf16`
//! (the tiled prompt attention's products) and `f32_to_bf16`. The `Kernels` methods that call
//! them are in the parent module (as `avx2/prompt.rs` is to `avx2.rs`); decode attention is in
//! `decode.rs`.

use super::*;

/// C's rows are taken in register tiles of 6 (then 4, 2); [`Kernels::gemm_f32`] here needs
/// them to be a multiple of this.
pub(super) const GEMM_ROWS: usize = 2;

/// Values of kd per pass: a pass's B strip (at most this many rows of 64 floats, 32 KiB) stays
/// in L1 while every row tile reads it.
const GEMM_KC: usize = 64;

/// Walks an m×n product in register tiles: strips of 64 (or 32, 16) columns, each in tiles of
/// 6 (or 4, 2) rows (m even, n a multiple of 16), calling `$tile::<R, NV>($g, $c, i, j, ..)` for
/// the tile of rows i..i + R and columns j..j + 16·NV. Used inside `unsafe`: the caller
/// answers for every tile lying inside the product.
macro_rules! tile_walk {
    ($m:expr, $n:expr, $tile:ident($g:expr, $c:expr $(; $($a:expr),*)?)) => {{
        let (m, n) = ($m, $n);
        let mut j = 0;
        while j < n {
            let nv = ((n - j) / 16).min(4);
            let nv = if nv == 3 { 2 } else { nv };
            let mut i = 0;
            while i < m {
                let r = (m - i).min(6);
                let r = if r == 5 { 4 } else { r };
                match (r, nv) {
                    (6, 4) => $tile::<6, 4>($g, $c, i, j $($(, $a)*)?),
                    (6, 2) => $tile::<6, 2>($g, $c, i, j $($(, $a)*)?),
                    (6, _) => $tile::<6, 1>($g, $c, i, j $($(, $a)*)?),
                    (4, 4) => $tile::<4, 4>($g, $c, i, j $($(, $a)*)?),
                    (4, 2) => $tile::<4, 2>($g, $c, i, j $($(, $a)*)?),
                    (4, _) => $tile::<4, 1>($g, $c, i, j $($(, $a)*)?),
                    (_, 4) => $tile::<2, 4>($g, $c, i, j $($(, $a)*)?),
                    (_, 2) => $tile::<2, 2>($g, $c, i, j $($(, $a)*)?),
                    _ => $tile::<2, 1>($g, $c, i, j $($(, $a)*)?),
                }
                i += r;
            }
            j += 16 * nv;
        }
    }};
}

/// [`Kernels::gemm_f32`] in register tiles of up to 6 rows × 64 columns of C (24 accumulators):
/// per step along kd, four 16-float loads of B's row and 6 broadcasts of A's column feed 24
/// FMAs. kd is cut into passes of [`GEMM_KC`] (C accumulates across them in memory), each pass
/// into strips of 64 (or 32, 16) columns, each strip into row tiles (`tile_walk!`).
/// SAFETY (caller): `g.check(c)` passed; `g.m` is a multiple of [`GEMM_ROWS`], `g.n` of 16.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_f32(g: &super::super::Gemm<'_>, c: &mut [f32]) {
    let mut k0 = 0;
    while k0 < g.kd {
        let k1 = (k0 + GEMM_KC).min(g.kd);
        let acc = g.acc || k0 > 0;
        // SAFETY: every tile's rows, columns and kd k0..k1 lie inside the product (caller):
        // r is 6, 4 or 2 (m is even), nv 4, 2 or 1 (n a multiple of 16).
        unsafe { tile_walk!(g.m, g.n, gemm_tile(g, c; k0, k1, acc)) };
        k0 = k1;
    }
}

/// One register tile of [`gemm_f32`]: rows i0..i0 + R, columns j0..j0 + 16·NV of C, the
/// products of kd k0..k1 added to C (`acc`) or written over it.
/// SAFETY (caller): `g.check(c)` passed and the tile lies inside the m×n×kd product, so every
/// pointer below stays inside `g.a`, `g.b` or `c`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemm_tile<const R: usize, const NV: usize>(
    g: &super::super::Gemm<'_>,
    c: &mut [f32],
    i0: usize,
    j0: usize,
    k0: usize,
    k1: usize,
    acc_c: bool,
) {
    let (ap, bp, cp) = (g.a.as_ptr(), g.b.as_ptr(), c.as_mut_ptr());
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    if acc_c {
        for (r, a) in acc.iter_mut().enumerate() {
            for (v, x) in a.iter_mut().enumerate() {
                // SAFETY: element (i0 + r, j0 + 16v..+16) of C is inside `c` (caller).
                *x = unsafe { _mm512_loadu_ps(cp.add((i0 + r) * g.ldc + j0 + 16 * v)) };
            }
        }
    }
    for k in k0..k1 {
        let mut bv = [_mm512_setzero_ps(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            // SAFETY: row k, columns j0 + 16v..+16 of B are inside `g.b` (caller).
            *x = unsafe { _mm512_loadu_ps(bp.add(k * g.ldb + j0 + 16 * v)) };
        }
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: element (i0 + r, k) of A is inside `g.a` (caller).
            let av = _mm512_set1_ps(unsafe { *ap.add((i0 + r) * g.lda + k) });
            for (x, b) in a.iter_mut().zip(&bv) {
                *x = _mm512_fmadd_ps(av, *b, *x);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        for (v, x) in a.iter().enumerate() {
            // SAFETY: as for the loads of C.
            unsafe { _mm512_storeu_ps(cp.add((i0 + r) * g.ldc + j0 + 16 * v), *x) };
        }
    }
}

/// [`Kernels::gemm_bf16`] in register tiles of up to 6 rows × 64 columns of C (24
/// accumulators, `tile_walk!`), as [`gemm_f32`]: per pair of kd, four 32-value loads of B's
/// pair row and 6 broadcasts of A's pair feed 24 `vdpbf16ps` (32 multiply-adds each, twice an
/// f32 FMA's).
/// SAFETY (caller): `g.check(c)` passed; the CPU has AVX-512 BF16; `g.m` is a multiple of
/// [`GEMM_ROWS`], `g.n` of 16.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
pub(super) unsafe fn gemm_bf16(g: &super::super::GemmBf16<'_>, c: &mut [f32]) {
    // SAFETY: every tile's rows and columns lie inside the product (caller): r is 6, 4 or 2
    // (m is even), nv 4, 2 or 1 (n a multiple of 16).
    unsafe { tile_walk!(g.m, g.n, bf16_tile(g, c)) };
}

/// One register tile of [`gemm_bf16`]: rows i0..i0 + R, columns j0..j0 + 16·NV of C, every
/// pair of kd added to C.
/// SAFETY (caller): `g.check(c)` passed, the CPU has AVX-512 BF16, and the tile lies inside
/// the product, so every pointer below stays inside `g.a`, `g.b` or `c`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
unsafe fn bf16_tile<const R: usize, const NV: usize>(g: &super::super::GemmBf16<'_>, c: &mut [f32], i0: usize, j0: usize) {
    let (ap, bp, cp) = (g.a.as_ptr(), g.b.as_ptr(), c.as_mut_ptr());
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    for (r, a) in acc.iter_mut().enumerate() {
        for (v, x) in a.iter_mut().enumerate() {
            // SAFETY: element (i0 + r, j0 + 16v..+16) of C is inside `c` (caller).
            *x = unsafe { _mm512_loadu_ps(cp.add((i0 + r) * g.ldc + j0 + 16 * v)) };
        }
    }
    for t in 0..g.kp {
        let mut bv = [_mm512_setzero_si512(); NV];
        for (v, x) in bv.iter_mut().enumerate() {
            // SAFETY: pair row t, columns j0 + 16v..+16 (32 values) of B are inside `g.b`.
            *x = unsafe { _mm512_loadu_si512(bp.add(t * g.ldb + 2 * (j0 + 16 * v)).cast()) };
        }
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: A's pair (i0 + r, 2t..2t + 2) is inside `g.a` (caller); the word is read
            // unaligned.
            let w = unsafe { ap.add((i0 + r) * g.lda + 2 * t).cast::<i32>().read_unaligned() };
            let av = bh(_mm512_set1_epi32(w));
            for (x, b) in a.iter_mut().zip(&bv) {
                *x = _mm512_dpbf16_ps(*x, av, bh(*b));
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        for (v, x) in a.iter().enumerate() {
            // SAFETY: as for the loads of C.
            unsafe { _mm512_storeu_ps(cp.add((i0 + r) * g.ldc + j0 + 16 * v), *x) };
        }
    }
}

/// 32 bf16 values from their bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain bits; every bit pattern is a valid value of either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

/// [`Kernels::f32_to_bf16`]: 32 values a step by `vcvtne2ps2bf16` (to nearest even), the tail
/// through [`super::super::bf16_of`].
/// SAFETY (caller): the CPU has AVX-512 BF16; `dst.len() >= src.len()`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")]
pub(super) unsafe fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    let n = src.len() / 32 * 32;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..n).step_by(32) {
        // SAFETY: i + 32 ≤ n ≤ src.len() ≤ dst.len() (caller).
        unsafe {
            let (lo, hi) = (_mm512_loadu_ps(sp.add(i)), _mm512_loadu_ps(sp.add(i + 16)));
            let h = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(dp.add(i).cast(), std::mem::transmute::<__m512bh, __m512i>(h));
        }
    }
    for (d, x) in dst[n..src.len()].iter_mut().zip(&src[n..]) {
        *d = super::super::bf16_of(*x);
    }
}
