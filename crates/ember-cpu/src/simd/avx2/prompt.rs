//! The AVX2 prompt kernels: panels (see [`crate::panel`]), the column-block delta rule and
//! grouped attention over the f16 KV cache, the 256-bit forms of the AVX-512 ones. The
//! `Kernels` methods that call them are in the parent module.

use std::cell::RefCell;

use super::*;
use crate::panel::Lanes;

/// Rows of C per register tile of [`gemm_f32`] (with 16 columns: 8 accumulators of 16
/// registers, leaving room for B's two vectors and A's broadcast).
pub(super) const GEMM_ROWS: usize = 4;

/// `Kernels::gemm_f32`, the AVX2 form of the AVX-512 one: register tiles of 4 rows × 16
/// columns of C; per step along kd, two 8-float loads of B's row and 4 broadcasts feed 8 FMAs.
/// SAFETY (caller): `g.check(c)` passed; `g.m` is a multiple of [`GEMM_ROWS`], `g.n` of 16.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemm_f32(g: &super::super::Gemm<'_>, c: &mut [f32]) {
    let (ap, bp, cp) = (g.a.as_ptr(), g.b.as_ptr(), c.as_mut_ptr());
    for i0 in (0..g.m).step_by(GEMM_ROWS) {
        for j0 in (0..g.n).step_by(16) {
            // Every pointer below addresses an element of rows i0..i0 + 4, columns j0..j0 + 16
            // of C, rows i0..i0 + 4 of A or row k < kd, columns j0..j0 + 16 of B: inside the
            // buffers by `check` (caller).
            let mut acc = [[_mm256_setzero_ps(); 2]; GEMM_ROWS];
            if g.acc {
                for (r, a) in acc.iter_mut().enumerate() {
                    for (v, x) in a.iter_mut().enumerate() {
                        // SAFETY: see above.
                        *x = unsafe { _mm256_loadu_ps(cp.add((i0 + r) * g.ldc + j0 + 8 * v)) };
                    }
                }
            }
            for k in 0..g.kd {
                // SAFETY: see above.
                let bv = unsafe { [_mm256_loadu_ps(bp.add(k * g.ldb + j0)), _mm256_loadu_ps(bp.add(k * g.ldb + j0 + 8))] };
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: see above.
                    let av = _mm256_set1_ps(unsafe { *ap.add((i0 + r) * g.lda + k) });
                    a[0] = _mm256_fmadd_ps(av, bv[0], a[0]);
                    a[1] = _mm256_fmadd_ps(av, bv[1], a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (v, x) in a.iter().enumerate() {
                    // SAFETY: see above.
                    unsafe { _mm256_storeu_ps(cp.add((i0 + r) * g.ldc + j0 + 8 * v), *x) };
                }
            }
        }
    }
}

/// Positions per block of the P·V pass: their V rows stay in L2 while every 8-value column
/// strip of the output is accumulated over them.
const ATTN_BLOCK: usize = 512;
/// Key rows asked for ahead of the one being scored (as the AVX-512 decode kernels' `PF_ROWS`).
const ATTN_PF_ROWS: usize = 16;

/// [`Kernels::attn_f16`] for NH (≤ 8) heads of one KV head, as the AVX-512 decode kernel's
/// f32 form: each K row converted once and dotted with all NH queries; softmax per head; the
/// output in strips of 8 values × NH heads held in registers across a block of positions.
/// SAFETY (caller): bounds as checked in `attn_f16`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attn_group<const NH: usize>(io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) {
    let AttnIo { q, npos, hd, scale, .. } = *io;
    // The loops below index q and scores through pointers (a bounds check per 8-float load
    // cost more than the FMA it guards): q holds NH·hd values, scores NH·npos.
    assert!(q.len() >= NH * hd && scores.len() >= NH * npos && hd.is_multiple_of(8));
    let f16x8 = |b: &[u8], at: usize| -> __m256 {
        debug_assert!(at + 16 <= b.len());
        // SAFETY: `b` is a k_row / v_row slice of exactly 2·hd bytes (its slicing is checked)
        // and every `at` is 16c (or 16c + …) for c < hd/8: 16 bytes from `at` lie inside it.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().add(at).cast()) })
    };
    let (qp, sp) = (q.as_ptr(), scores.as_mut_ptr());
    for p in 0..npos {
        let kr = io.k_row(p); // hd f16
        if p + ATTN_PF_ROWS < npos {
            crate::simd::prefetch(io.k_row(p + ATTN_PF_ROWS));
        }
        let mut acc = [_mm256_setzero_ps(); NH];
        for c in 0..hd / 8 {
            let kc = f16x8(kr, 16 * c);
            for (n, a) in acc.iter_mut().enumerate() {
                // SAFETY: n·hd + 8c + 8 ≤ NH·hd ≤ q.len() (asserted above).
                *a = _mm256_fmadd_ps(kc, unsafe { _mm256_loadu_ps(qp.add(n * hd + 8 * c)) }, *a);
            }
        }
        for (n, a) in acc.iter().enumerate() {
            // SAFETY: n·npos + p < NH·npos ≤ scores.len().
            unsafe { *sp.add(n * npos + p) = hsum(*a) * scale };
        }
    }
    let mut inv = [0f32; NH];
    for (n, iv) in inv.iter_mut().enumerate() {
        let sc = &mut scores[n * npos..(n + 1) * npos];
        let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum = exp_sum(sc, mx);
        (ml[2 * n], ml[2 * n + 1]) = (mx, sum);
        *iv = 1.0 / sum;
    }
    out[..NH * hd].fill(0.0);
    // Re-derived after the softmax's borrows of `scores`.
    let sp = scores.as_ptr();
    for b0 in (0..npos).step_by(ATTN_BLOCK) {
        let b1 = (b0 + ATTN_BLOCK).min(npos);
        // The block's V rows, looked up in the page table once.
        let mut vrows: [&[u8]; ATTN_BLOCK] = [&[]; ATTN_BLOCK];
        for p in b0..b1 {
            vrows[p - b0] = io.v_row(p);
        }
        let b2 = (b1 + ATTN_BLOCK).min(npos);
        for c in 0..hd / 8 {
            let mut acc = [_mm256_setzero_ps(); NH];
            for p in b0..b1 {
                let vv = f16x8(vrows[p - b0], 16 * c);
                // Line c / 4 of the next block's row p (each line of it once, as this one streams).
                if c % 4 == 0 && p + ATTN_BLOCK < b2 {
                    crate::simd::prefetch(&io.v_row(p + ATTN_BLOCK)[16 * c..16 * c + 64]);
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    // SAFETY: n·npos + p < NH·npos ≤ scores.len() (asserted above).
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(unsafe { *sp.add(n * npos + p) }), vv, *a);
                }
            }
            for (n, a) in acc.iter().enumerate() {
                let at = n * hd + 8 * c;
                stps(out, at, _mm256_add_ps(ldps(out, at), *a));
            }
        }
    }
    for (n, iv) in inv.iter().enumerate() {
        out[n * hd..(n + 1) * hd].iter_mut().for_each(|x| *x *= iv);
    }
}

/// The delta rule for value columns `8c..8c + 8` of one head over all tokens, the AVX2 form of
/// the AVX-512 `delta_columns` (which documents the method): those columns of the state held
/// key-major in `buf` (`buf[i][l]` = S[i][8c + l], 4 KiB at d_k = 128, in L1 for the whole
/// sequence); per token `δ = β(v − decay·r)`, `o = decay·u + δ·(k·q)`, and one pass
/// `S ← decay·S + kδᵀ` that also accumulates the next token's `r = Sᵀk` and `u = Sᵀq`.
/// SAFETY (caller): `st` holds d_k·d_v values, `o` n·d_v, `kq`/`decay`/`beta` n, and every
/// token's q, k, v are in bounds (checked by `delta_seq`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn delta_columns(st: &mut [f32], io: &DeltaIo<'_>, kq: &[f32], c: usize, buf: &mut [[f32; 8]], o: &mut [f32]) {
    let (dk, dv) = (io.dk, io.dv);
    let col0 = c * 8;
    for (i, b) in buf.iter_mut().enumerate() {
        for (l, v) in b.iter_mut().enumerate() {
            *v = st[(col0 + l) * dk + i];
        }
    }
    // SAFETY: b is 8 readable f32.
    let get = |b: &[f32; 8]| unsafe { _mm256_loadu_ps(b.as_ptr()) };
    let (q0, k0, _) = io.token(0);
    let (mut r, mut u) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
    for ((b, kc), qc) in buf.chunks_exact(4).zip(k0.chunks_exact(4)).zip(q0.chunks_exact(4)) {
        for j in 0..4 {
            let s = get(&b[j]);
            r[j] = _mm256_fmadd_ps(s, _mm256_set1_ps(kc[j]), r[j]);
            u[j] = _mm256_fmadd_ps(s, _mm256_set1_ps(qc[j]), u[j]);
        }
    }
    for t in 0..io.n {
        let (_, k, v) = io.token(t);
        let decay = _mm256_set1_ps(io.decay[t]);
        let rs = _mm256_add_ps(_mm256_add_ps(r[0], r[1]), _mm256_add_ps(r[2], r[3]));
        let us = _mm256_add_ps(_mm256_add_ps(u[0], u[1]), _mm256_add_ps(u[2], u[3]));
        let vv = ldps(v, col0);
        let delta = _mm256_mul_ps(_mm256_set1_ps(io.beta[t]), _mm256_fnmadd_ps(decay, rs, vv));
        let ot = _mm256_fmadd_ps(delta, _mm256_set1_ps(kq[t]), _mm256_mul_ps(decay, us));
        stps(o, t * dv + col0, ot);
        let (qn, kn, _) = io.token((t + 1).min(io.n - 1));
        r = [_mm256_setzero_ps(); 4];
        u = [_mm256_setzero_ps(); 4];
        for (((b, kc), knc), qnc) in buf.chunks_exact_mut(4).zip(k.chunks_exact(4)).zip(kn.chunks_exact(4)).zip(qn.chunks_exact(4)) {
            for j in 0..4 {
                let s = _mm256_fmadd_ps(get(&b[j]), decay, _mm256_mul_ps(_mm256_set1_ps(kc[j]), delta));
                // SAFETY: b[j] is 8 writable f32.
                unsafe { _mm256_storeu_ps(b[j].as_mut_ptr(), s) };
                // For the last token these sums are not used (kn, qn repeat it).
                r[j] = _mm256_fmadd_ps(s, _mm256_set1_ps(knc[j]), r[j]);
                u[j] = _mm256_fmadd_ps(s, _mm256_set1_ps(qnc[j]), u[j]);
            }
        }
    }
    for (i, b) in buf.iter().enumerate() {
        for (l, v) in b.iter().enumerate() {
            st[(col0 + l) * dk + i] = *v;
        }
    }
}

// ---- Panels (see crate::panel) on 256-bit vectors: the 16 rows of a panel are two halves of
// eight i32 lanes. `vpmaddubsw` multiplies u8 by i8 into saturating i16 pairs, so the product
// depends on the size of the weight codes:
// - small codes (|q| ≤ 32: the K-quants, Q4_0 … Q5_1) take the unsigned activations `qu`:
//   255·32·2 = 16320 per pair, two pairs summed in i16 still fit (32640), and the panel's
//   `corr` removes the +128 as in the AVX-512 kernel;
// - full-range codes (Q8_0, IQ4_NL, IQ4_XS: |q| ≤ 128) take |q| and the signed activations with
//   q's sign: 128·127·2 = 32512, one product per i16 pair, no correction.

/// Tokens per panel product call: 2·4 integer and 2·4 float accumulators, the two weight halves
/// and the broadcast activation fill the 16 vector registers.
pub(super) const PANEL_NT: usize = 4;

/// Whether a panel of this type takes the signed-activation product (full-range codes).
pub(super) fn signed_panel(p: &Panel) -> bool {
    matches!(p.ty, Some(GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS))
}

/// Row-major codes and per-16 scales/offsets of up to 16 rows, before the transposition into
/// a panel (per thread, reused).
#[derive(Default)]
pub(super) struct Unpacked {
    pub(super) codes: Vec<i8>,
    pub(super) s16: Vec<f32>,
    pub(super) o16: Vec<f32>,
}

thread_local! {
    pub(super) static UNPACKED: RefCell<Unpacked> = RefCell::new(Unpacked::default());
}

/// One row of `ty` into its codes (`codes[j]`) and per-16 scales and offsets, with the values
/// of [`kernels::unpack_block`] bit for bit (the formats the kernels decode with vectors; the
/// others go through it).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn decode_row(ty: GgmlType, row: &[u8], codes: &mut [i8], s16: &mut [f32], o16: &mut [f32]) {
    let m4 = _mm256_set1_epi8(0x0F);
    let st = |codes: &mut [i8], at: usize, v: __m256i| {
        let d = &mut codes[at..at + 32];
        // SAFETY: `d` is 32 writable bytes; storeu has no alignment requirement.
        unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), v) }
    };
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => {
            let q5 = ty == GgmlType::Q5K;
            let (bs, qs0) = if q5 { (176, 48) } else { (144, 16) };
            for (i, b) in row.chunks_exact(bs).enumerate() {
                // d·sc and dmin·mn as the scalar reference computes them (one f32 product each).
                let (sc, mn, d, dmin) = k4_header(b);
                let (mut sv, mut mv) = ([0f32; 8], [0f32; 8]);
                // SAFETY: sv, mv are 8 writable f32.
                unsafe {
                    _mm256_storeu_ps(sv.as_mut_ptr(), _mm256_mul_ps(d, sc));
                    _mm256_storeu_ps(mv.as_mut_ptr(), _mm256_mul_ps(dmin, mn));
                }
                for sub in 0..8 {
                    let (s, o) = (sv[sub], -mv[sub]);
                    s16[16 * i + 2 * sub..16 * i + 2 * sub + 2].fill(s);
                    o16[16 * i + 2 * sub..16 * i + 2 * sub + 2].fill(o);
                }
                let mut hb = if q5 { ld256(b, 16) } else { _mm256_setzero_si256() };
                for p in 0..4 {
                    let q = ld256(b, qs0 + 32 * p);
                    let mut lo = _mm256_and_si256(q, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                    if q5 {
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(hb, _mm256_set1_epi8(1))));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(hb, _mm256_set1_epi8(2))));
                        hb = _mm256_srli_epi16::<2>(hb);
                    }
                    st(codes, 256 * i + 64 * p, lo);
                    st(codes, 256 * i + 64 * p + 32, hi);
                }
            }
        }
        GgmlType::Q6K => {
            let c32 = _mm256_set1_epi8(32);
            for (i, b) in row.chunks_exact(210).enumerate() {
                let d = f16(b, 208);
                for grp in 0..16 {
                    let (n, r) = (grp / 8, grp % 8);
                    let (ii, s) = (r / 2, r % 2);
                    s16[16 * i + grp] = d * b[192 + 8 * n + s + 2 * ii] as i8 as f32;
                    o16[16 * i + grp] = 0.0;
                }
                for n in 0..2 {
                    let q = q6k_codes(b, n);
                    for (j, qj) in q.iter().enumerate() {
                        st(codes, 256 * i + 128 * n + 32 * j, _mm256_sub_epi8(*qj, c32));
                    }
                }
            }
        }
        GgmlType::Q8_0 => {
            for (i, b) in row.chunks_exact(34).enumerate() {
                let d = f16(b, 0);
                s16[2 * i..2 * i + 2].fill(d);
                o16[2 * i..2 * i + 2].fill(0.0);
                st(codes, 32 * i, ld256(b, 2));
            }
        }
        GgmlType::IQ4XS => {
            let table =
                _mm256_broadcastsi128_si256(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
            for (i, b) in row.chunks_exact(136).enumerate() {
                let d = f16(b, 0);
                let sh = u16::from_le_bytes([b[2], b[3]]);
                for sub in 0..8 {
                    let ls = ((b[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) as i32 | ((((sh >> (2 * sub)) & 3) as i32) << 4);
                    let dl = d * (ls - 32) as f32;
                    s16[16 * i + 2 * sub..16 * i + 2 * sub + 2].fill(dl);
                    o16[16 * i + 2 * sub..16 * i + 2 * sub + 2].fill(0.0);
                    let q = ld128(b, 8 + 16 * sub);
                    let idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4);
                    st(codes, 256 * i + 32 * sub, _mm256_shuffle_epi8(table, idx));
                }
            }
        }
        _ => {
            let (bs, ts) = (ty.block_size(), ty.type_size());
            for (bi, block) in row.chunks_exact(ts).enumerate() {
                kernels::unpack_block(ty, block, &mut codes[bi * bs..], &mut s16[bi * bs / 16..], &mut o16[bi * bs / 16..]);
            }
        }
    }
}

/// The 8×8 transposition of 32-bit words: `out[j]` lane i = `v[i]` lane j.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    let t = [
        _mm256_unpacklo_epi32(v[0], v[1]),
        _mm256_unpackhi_epi32(v[0], v[1]),
        _mm256_unpacklo_epi32(v[2], v[3]),
        _mm256_unpackhi_epi32(v[2], v[3]),
        _mm256_unpacklo_epi32(v[4], v[5]),
        _mm256_unpackhi_epi32(v[4], v[5]),
        _mm256_unpacklo_epi32(v[6], v[7]),
        _mm256_unpackhi_epi32(v[6], v[7]),
    ];
    let u = [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
        _mm256_unpacklo_epi64(t[4], t[6]),
        _mm256_unpackhi_epi64(t[4], t[6]),
        _mm256_unpacklo_epi64(t[5], t[7]),
        _mm256_unpackhi_epi64(t[5], t[7]),
    ];
    [
        _mm256_permute2x128_si256::<0x20>(u[0], u[4]),
        _mm256_permute2x128_si256::<0x20>(u[1], u[5]),
        _mm256_permute2x128_si256::<0x20>(u[2], u[6]),
        _mm256_permute2x128_si256::<0x20>(u[3], u[7]),
        _mm256_permute2x128_si256::<0x31>(u[0], u[4]),
        _mm256_permute2x128_si256::<0x31>(u[1], u[5]),
        _mm256_permute2x128_si256::<0x31>(u[2], u[6]),
        _mm256_permute2x128_si256::<0x31>(u[3], u[7]),
    ]
}

/// Half `h` (8 lanes) of a panel lane vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn half_i(l: &Lanes<i32>, h: usize) -> __m256i {
    let s = &l.0[8 * h..8 * h + 8];
    // SAFETY: `s` is 8 readable i32; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn half_f(l: &Lanes<f32>, h: usize) -> __m256 {
    let s = &l.0[8 * h..8 * h + 8];
    // SAFETY: `s` is 8 readable f32; loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn put_half_i(l: &mut Lanes<i32>, h: usize, v: __m256i) {
    let s = &mut l.0[8 * h..8 * h + 8];
    // SAFETY: `s` is 8 writable i32; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), v) }
}

/// Writes the `m` decoded rows of `u` into `p` (already reset): the codes as words of four,
/// eight rows at a time through [`transpose8`], the corrections from the transposed words
/// (Σ of a group's codes per lane), the scales and offsets per group. Rows m..16 repeat row
/// m − 1, as in [`Panel::unpack_scalar`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn transpose_rows(u: &Unpacked, m: usize, p: &mut Panel) {
    let (k, g) = (p.k, p.g);
    let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
    for h in 0..2 {
        let row = |i: usize| (8 * h + i).min(m - 1);
        for c in 0..k / 32 {
            let v: [__m256i; 8] = std::array::from_fn(|i| ld256i(&u.codes, row(i) * k + 32 * c));
            let t = transpose8(v);
            let mut sums = [_mm256_setzero_si256(); 2];
            for (j, tj) in t.iter().enumerate() {
                put_half_i(&mut p.q[8 * c + j], h, *tj);
                let s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, *tj), ones16);
                sums[j / 4] = _mm256_add_epi32(sums[j / 4], s);
            }
            let neg128 = |s: __m256i| _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(s));
            if g == 32 {
                put_half_i(&mut p.corr[c], h, neg128(_mm256_add_epi32(sums[0], sums[1])));
            } else {
                put_half_i(&mut p.corr[2 * c], h, neg128(sums[0]));
                put_half_i(&mut p.corr[2 * c + 1], h, neg128(sums[1]));
            }
        }
        for i in 0..8 {
            let (r, src) = (8 * h + i, row(i));
            for gi in 0..k / g {
                p.sc[gi].0[r] = u.s16[src * k / 16 + gi * g / 16];
                p.off[gi].0[r] = u.o16[src * k / 16 + gi * g / 16];
            }
        }
    }
}

/// Dispatch on the panel's group size, offsets and product.
/// SAFETY (caller): the lengths checked in `panel_dot`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_dot_g<const NT: usize>(p: &Panel, a: &[&ActRow], out: &mut [[f32; ROWS]], signed: bool) {
    let a: [&ActRow; NT] = std::array::from_fn(|t| a[t]);
    // SAFETY: forwarded.
    let o = unsafe {
        match (p.g, p.has_off, signed) {
            (32, _, true) => panel_dot_nt::<NT, 32, false, true>(p, a),
            (32, false, false) => panel_dot_nt::<NT, 32, false, false>(p, a),
            (32, true, false) => panel_dot_nt::<NT, 32, true, false>(p, a),
            (16, false, false) => panel_dot_nt::<NT, 16, false, false>(p, a),
            (16, true, false) => panel_dot_nt::<NT, 16, true, false>(p, a),
            _ => unreachable!("panel groups are 16 or 32 weights; signed panels have groups of 32"),
        }
    };
    out[..NT].copy_from_slice(&o);
}

/// The panel product of Q4_K / Q5_K panels (codes 0..2^b − 1, b = 4 / 5) for NT ≤ 4 tokens.
/// The codes go into `maddubs` as the unsigned operand against the signed activations `q`
/// themselves, so no `corr` is needed, and `SUM` products are added in i16 before one widening
/// `madd`: a pair is at most 2·15·127 = 3810 (Q4_K, SUM = 8: 30480) or 2·31·127 = 7874 (Q5_K,
/// SUM = 4: 31496), under 32767. The integer sums are the general path's, and the float steps
/// the same in the same order, so the results are bit for bit [`panel_dot_nt`]'s. With the
/// float sums in memory the loop holds 2·NT i16 sums, the two weight halves and one broadcast:
/// NT ≤ 4 fits the 16 registers.
/// SAFETY (caller): every `a[t]` has ≥ k bytes in `q`, ≥ k/32 scales and sums; the panel's
/// buffers cover k, its groups are 32 (what `panel_dot` checks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_dot_small<const NT: usize, const SUM: usize>(p: &Panel, a: &[&ActRow], out: &mut [[f32; ROWS]]) {
    let aq: [*const u8; NT] = std::array::from_fn(|t| a[t].q.as_ptr().cast::<u8>());
    let ones16 = _mm256_set1_epi16(1);
    // SAFETY (all reads below): weight j < k of token t is at aq[t] + j.
    let bc = |t: usize, j: usize| _mm256_set1_epi32(unsafe { aq[t].add(j).cast::<i32>().read_unaligned() });
    let mut acc = [[0f32; ROWS]; NT];
    for gi in 0..p.k / 32 {
        let mut s16 = [[_mm256_setzero_si256(); 2]; NT];
        let mut s32 = [[_mm256_setzero_si256(); 2]; NT];
        for s0 in (0..8).step_by(SUM) {
            // A loop the compiler does not unroll: unrolled, it hoisted the loads of all eight
            // steps and spilled most of them.
            for s in s0..s0 + std::hint::black_box(SUM) {
                let qs = &p.q[8 * gi + s];
                let w = [half_i(qs, 0), half_i(qs, 1)];
                for t in 0..NT {
                    let av = bc(t, 32 * gi + 4 * s);
                    for h in 0..2 {
                        s16[t][h] = _mm256_add_epi16(s16[t][h], _mm256_maddubs_epi16(w[h], av));
                    }
                }
            }
            for t in 0..NT {
                for h in 0..2 {
                    s32[t][h] = _mm256_add_epi32(s32[t][h], _mm256_madd_epi16(s16[t][h], ones16));
                    s16[t][h] = _mm256_setzero_si256();
                }
            }
        }
        for h in 0..2 {
            let (sc, off) = (half_f(&p.sc[gi], h), half_f(&p.off[gi], h));
            for t in 0..NT {
                let (da, ds) = (_mm256_set1_ps(a[t].d[gi]), _mm256_set1_ps(a[t].ds32[gi]));
                let f = &mut acc[t][8 * h..8 * h + 8];
                // SAFETY: `f` is 8 f32, read and written unaligned.
                unsafe {
                    let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[t][h]), _mm256_mul_ps(sc, da), _mm256_loadu_ps(f.as_ptr()));
                    _mm256_storeu_ps(f.as_mut_ptr(), _mm256_fmadd_ps(off, ds, v));
                }
            }
        }
    }
    out[..NT].copy_from_slice(&acc);
}

/// The panel product for NT tokens, per group of G weights: integer accumulators per half
/// (starting at `corr`, or 0 for signed panels), one convert and one FMA with `sc · d_a` (and
/// one with `off · d_a·Σqa`), as in the AVX-512 kernel. Unsigned panels sum two `maddubs`
/// in i16 before widening (the bound above).
/// SAFETY (caller): every `a[t]` has ≥ k bytes in `qu` (unsigned) or `q` (signed), ≥ k/32
/// scales and ≥ k/16 sums; the panel's buffers cover k (what `panel_dot` checks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_dot_nt<const NT: usize, const G: usize, const OFF: bool, const SIGNED: bool>(
    p: &Panel,
    a: [&ActRow; NT],
) -> [[f32; ROWS]; NT] {
    let aq = a.map(|a| if SIGNED { a.q.as_ptr().cast::<u8>() } else { a.qu.as_ptr() });
    let ad = a.map(|a| a.d.as_ptr());
    let ads = a.map(|a| if G == 32 { a.ds32.as_ptr() } else { a.ds16.as_ptr() });
    let ones16 = _mm256_set1_epi16(1);
    // SAFETY (all reads below): weight j < k of token t is at aq[t] + j; k/32 scales; k/G sums.
    let bc = |t: usize, j: usize| _mm256_set1_epi32(unsafe { aq[t].add(j).cast::<i32>().read_unaligned() });
    let mut facc = [[_mm256_setzero_ps(); 2]; NT];
    for gi in 0..p.k / G {
        let mut iacc = [[_mm256_setzero_si256(); 2]; NT];
        if !SIGNED {
            let c = [half_i(&p.corr[gi], 0), half_i(&p.corr[gi], 1)];
            iacc = [c; NT];
        }
        if SIGNED {
            for s in 0..G / 4 {
                let w = [half_i(&p.q[gi * G / 4 + s], 0), half_i(&p.q[gi * G / 4 + s], 1)];
                let u = [_mm256_abs_epi8(w[0]), _mm256_abs_epi8(w[1])];
                for t in 0..NT {
                    let av = bc(t, gi * G + 4 * s);
                    for h in 0..2 {
                        let pr = _mm256_maddubs_epi16(u[h], _mm256_sign_epi8(av, w[h]));
                        iacc[t][h] = _mm256_add_epi32(iacc[t][h], _mm256_madd_epi16(pr, ones16));
                    }
                }
            }
        } else {
            for s in (0..G / 4).step_by(2) {
                let w0 = [half_i(&p.q[gi * G / 4 + s], 0), half_i(&p.q[gi * G / 4 + s], 1)];
                let w1 = [half_i(&p.q[gi * G / 4 + s + 1], 0), half_i(&p.q[gi * G / 4 + s + 1], 1)];
                for t in 0..NT {
                    let (a0, a1) = (bc(t, gi * G + 4 * s), bc(t, gi * G + 4 * s + 4));
                    for h in 0..2 {
                        let pr = _mm256_add_epi16(_mm256_maddubs_epi16(a0, w0[h]), _mm256_maddubs_epi16(a1, w1[h]));
                        iacc[t][h] = _mm256_add_epi32(iacc[t][h], _mm256_madd_epi16(pr, ones16));
                    }
                }
            }
        }
        let sc = [half_f(&p.sc[gi], 0), half_f(&p.sc[gi], 1)];
        for t in 0..NT {
            // SAFETY: gi·G/32 < k/32 ≤ d.len().
            let da = _mm256_set1_ps(unsafe { *ad[t].add(gi * G / 32) });
            for h in 0..2 {
                facc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t][h]), _mm256_mul_ps(sc[h], da), facc[t][h]);
            }
        }
        if OFF {
            let off = [half_f(&p.off[gi], 0), half_f(&p.off[gi], 1)];
            for t in 0..NT {
                // SAFETY: gi < k/G ≤ the length of ds32 (G = 32) or ds16 (G = 16).
                let ds = _mm256_set1_ps(unsafe { *ads[t].add(gi) });
                for h in 0..2 {
                    facc[t][h] = _mm256_fmadd_ps(off[h], ds, facc[t][h]);
                }
            }
        }
    }
    let mut out = [[0f32; ROWS]; NT];
    for t in 0..NT {
        for h in 0..2 {
            // SAFETY: out[t][8h..8h + 8] is 8 writable f32.
            unsafe { _mm256_storeu_ps(out[t][8 * h..].as_mut_ptr(), facc[t][h]) };
        }
    }
    out
}
