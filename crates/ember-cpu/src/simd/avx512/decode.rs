//! Decode attention over f16 and q8_0 KV caches: [`Kernels::attn_f16`] and
//! [`Kernels::attn_q8`], all the KV heads of one token and one range of positions in a call.
//!
//! Both passes walk the positions in blocks of [`BLOCK`] and take every KV head's query heads
//! in a block before the next, so each cache row (every KV head's values side by side) is read
//! from memory once and whole: per KV head in turn, the rows' halves 512 bytes apart left the
//! f16 kernel ~40 % slower per head than with one KV head (`attn_bench`, `KVH=1`).
//!
//! Q·Kᵀ: the heads against each key row as it is read. f16 keys in f32 FMAs, the sums of two
//! rows reduced at once ([`hsum16`]); q8_0 keys in integers, 64 products a `vpdpbusd` with
//! the queries quantised to 8 bits per 32 values, in lanes of (key block, head) that each sum
//! a whole block: no reduction across lanes.
//! P·V: over q8_0 values in 16-bit integers (`vpdpwssd`), pairs of positions interleaved, the
//! values sign-extended and their blocks' d folded into the probabilities, which are rounded
//! to 16 bits against each block's largest (bf16 `vdpbf16ps` before: as many products an
//! instruction on Zen 4, half as many a cycle on the Xeon the dev VM has now, the values
//! converted and 8 bits of each product kept); over f16 values in f32 FMAs. (bf16 for f16
//! values measured 4-10 % faster on the op, nothing end to end, for ~1e3 times the error: not
//! kept.) Softmax in 16 lanes ([`exp16`]).

use super::*;
use crate::simd::AttnIo;
use ember_ops::KV_PAGE;

/// Largest head size of the q8_0 kernel (a row's block scales are read as one vector of 8).
pub(super) const Q8_MAX_HD: usize = 256;

/// Positions per block of both passes (a block's rows, 64 KiB at 2 KV heads of 256 in f16,
/// stay in L2 from one KV head to the next).
const BLOCK: usize = 64;

/// Cache rows asked for ahead of the one read (the hardware prefetchers left each row's first
/// lines waiting on DRAM).
const PF_ROWS: usize = 16;

/// The cache type the kernel reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Cache {
    F16,
    Q8,
}

/// Calls `$f::<NH>(args)` for the run's head count `$nh` (1..=8), through a pointer the
/// optimiser cannot see through: inlined into [`attn_blocked`] (`#[inline(never)]` did not
/// keep them out) the f16 kernels' f32 P·V ran ~30 % slower (attn_bench, 2 threads, depth
/// 32768: 7.1–8.1 against 5.3–5.5 ms). One indirect call per block and run.
macro_rules! by_heads {
    ($nh:expr, $f:ident($($a:expr),*)) => {{
        let f = match $nh {
            8 => $f::<8> as unsafe fn(_, _, _, _, _),
            7 => $f::<7> as unsafe fn(_, _, _, _, _),
            6 => $f::<6> as unsafe fn(_, _, _, _, _),
            5 => $f::<5> as unsafe fn(_, _, _, _, _),
            4 => $f::<4> as unsafe fn(_, _, _, _, _),
            3 => $f::<3> as unsafe fn(_, _, _, _, _),
            2 => $f::<2> as unsafe fn(_, _, _, _, _),
            _ => $f::<1> as unsafe fn(_, _, _, _, _),
        };
        std::hint::black_box(f)($($a),*)
    }};
}

/// A run of at most 8 query heads of one KV head: its first head, head count, and inputs.
struct Run<'a> {
    h0: usize,
    nh: usize,
    io: AttnIo<'a>,
    /// The scaled queries quantised (q8_0 keys).
    qq: Option<Box<Quantised>>,
    /// The queries in chunks of 16 values, head after head in each: `[c][head][16]` (f16
    /// keys: a chunk's NH loads at fixed offsets from one pointer).
    qi: Vec<f32>,
}

/// Queries quantised for [`q8_scores`], laid out for lanes that are (block parity, head): per
/// pair of blocks j (blocks 2j, 2j + 1) and word i (values 4i..4i + 4 of a block), lane e·8 + n
/// holds head n's 4 values of block 2j + e (zero for heads past the run's); the −128·Σq that
/// cancels the keys' +128, and d, in the same lanes.
struct Quantised {
    qw: [[[i32; 16]; 8]; Q8_MAX_HD / 64],
    corr: [[i32; 16]; Q8_MAX_HD / 64],
    dq: [[f32; 16]; Q8_MAX_HD / 64],
}

/// The kernel: `out[h] = softmax(scale·q_h·Kᵀ)·V` for every query head of `io`, `ml` as in
/// [`Kernels::attn_f16`].
/// SAFETY (caller): `attn_check(io, cache is Q8, ..)` passed; for q8_0 the head size is a
/// multiple of 64, at most [`Q8_MAX_HD`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn attn_blocked(io: &AttnIo<'_>, cache: Cache, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) {
    let q8 = cache == Cache::Q8;
    let AttnIo { q, npos, hd, n_kv, .. } = *io;
    let heads = q.len() / hd;
    let g = heads / n_kv;
    let mut runs = Vec::new();
    for m in 0..n_kv {
        let km = io.kv_head(m);
        for h in (0..g).step_by(8) {
            let nh = (g - h).min(8);
            let rio = AttnIo { q: &km.q[h * hd..(h + nh) * hd], ..km };
            let qq = q8.then(|| quantise(&rio));
            let mut qi = vec![0f32; if q8 { 0 } else { nh * hd }];
            for (i, x) in qi.iter_mut().enumerate() {
                let (c, n, l) = (i / (16 * nh), i / 16 % nh, i % 16);
                *x = rio.q[n * hd + 16 * c + l];
            }
            runs.push(Run { h0: m * g + h, nh, io: rio, qq, qi });
        }
    }
    for p0 in (0..npos).step_by(BLOCK) {
        let p1 = (p0 + BLOCK).min(npos);
        for r in &runs {
            let sr = &mut scores[r.h0 * npos..(r.h0 + r.nh) * npos];
            // SAFETY: as this function's (caller); the run's slices as `attn_check` checked.
            unsafe {
                match &r.qq {
                    None => by_heads!(r.nh, f16_scores(&r.io, &r.qi[..], p0, p1, sr)),
                    Some(qq) => by_heads!(r.nh, q8_scores(&r.io, &**qq, p0, p1, sr)),
                }
            }
        }
    }
    let mut inv = vec![0f32; heads];
    for (h, iv) in inv.iter_mut().enumerate() {
        let sc = &mut scores[h * npos..(h + 1) * npos];
        let mx = max16(sc);
        let sum = exp_sum16(sc, mx);
        (ml[2 * h], ml[2 * h + 1]) = (mx, sum);
        *iv = 1.0 / sum;
    }
    out[..heads * hd].fill(0.0);
    // Per block and run, f16: the probabilities `[head][i]`, zero past the block's end. q8_0:
    // the value blocks' d's over their largest (`dv`, `[c][i]`), a head's probabilities over
    // theirs times 32767 (`pn`), their products rounded to 16 bits (`pw`, `[c][head][i]`,
    // pairs of positions in one word) and the scale that undoes both (`ps`, `[c][head]`).
    let strips = if q8 { hd / 32 } else { 1 };
    let mut pf = vec![0f32; if q8 { 0 } else { 8 * BLOCK }];
    let mut pw = vec![0i16; if q8 { strips * 8 * BLOCK } else { 0 }];
    let mut ps = vec![0f32; strips * 8];
    let mut dv = vec![0f32; strips * BLOCK];
    let mut pn = [0f32; BLOCK];
    for b0 in (0..npos).step_by(BLOCK) {
        let len = BLOCK.min(npos - b0);
        for r in &runs {
            let nh = r.nh;
            let prob = |h: usize| &scores[(r.h0 + h) * npos + b0..(r.h0 + h) * npos + b0 + len];
            let or = &mut out[r.h0 * hd..(r.h0 + nh) * hd];
            if q8 {
                let dmax = value_scales(&r.io, b0, len, strips, &mut dv);
                for h in 0..nh {
                    let pmax = scale_probs(prob(h), &mut pn);
                    for (c, dm) in dmax.iter().take(strips).enumerate() {
                        let at = (c * nh + h) * BLOCK;
                        quantise_probs(&pn, &dv[c * BLOCK..(c + 1) * BLOCK], &mut pw[at..at + BLOCK]);
                        ps[c * nh + h] = pmax * dm / 32767.0;
                    }
                }
                // SAFETY: as this function's (caller); `pw` and `ps` as `q8_pv` reads them.
                unsafe { by_heads!(nh, q8_pv(&r.io, b0, len, (&pw[..], &ps[..]), or)) };
            } else {
                for h in 0..nh {
                    let dst = &mut pf[h * BLOCK..(h + 1) * BLOCK];
                    dst[..len].copy_from_slice(prob(h));
                    dst[len..].fill(0.0);
                }
                // SAFETY: as this function's (caller).
                unsafe { by_heads!(nh, f16_pv_f32(&r.io, b0, len, &pf[..], or)) };
            }
        }
    }
    for (h, iv) in inv.iter().enumerate() {
        out[h * hd..(h + 1) * hd].iter_mut().for_each(|x| *x *= iv);
    }
}

/// The run's queries times the scale, quantised to 8 bits per 32 values (d = largest / 127,
/// rounded half away from zero, as q8_0), in the lanes of [`Quantised`].
fn quantise(io: &AttnIo<'_>) -> Box<Quantised> {
    let (hd, nh) = (io.hd, io.q.len() / io.hd);
    const NP: usize = Q8_MAX_HD / 64;
    let mut qq = Box::new(Quantised { qw: [[[0; 16]; 8]; NP], corr: [[0; 16]; NP], dq: [[0.0; 16]; NP] });
    let mut x = [0f32; 32];
    for n in 0..nh {
        for b in 0..hd / 32 {
            x.iter_mut().zip(&io.q[n * hd + 32 * b..n * hd + 32 * b + 32]).for_each(|(d, v)| *d = v * io.scale);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let q: [i8; 32] = std::array::from_fn(|i| (x[i] * id).round() as i8);
            let (j, lane) = (b / 2, 8 * (b % 2) + n);
            for i in 0..8 {
                qq.qw[j][i][lane] = i32::from_le_bytes([q[4 * i] as u8, q[4 * i + 1] as u8, q[4 * i + 2] as u8, q[4 * i + 3] as u8]);
            }
            qq.corr[j][lane] = -128 * q.iter().map(|&v| i32::from(v)).sum::<i32>();
            qq.dq[j][lane] = d;
        }
    }
    qq
}

/// Fills `dv[c·BLOCK + i]` with value block c's d at position b0 + i over the largest of
/// them (zero past `len`) and returns the largest |d| per block c (zero when all are). The
/// d's are gathered 16 positions at a time: the block's rows lie in one KV page ([`BLOCK`] is
/// [`KV_PAGE`] and b0 a multiple of it), `rb` bytes apart.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn value_scales(io: &AttnIo<'_>, b0: usize, len: usize, strips: usize, dv: &mut [f32]) -> [f32; 8] {
    const { assert!(BLOCK == KV_PAGE) };
    assert!(b0.is_multiple_of(KV_PAGE) && (1..=BLOCK).contains(&len) && strips <= 8 && dv.len() >= strips * BLOCK);
    let base = page_rows(io, b0, len);
    let rb = i32::try_from(io.rb).expect("KV row bytes fit i32");
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut dmax = [0f32; 8];
    for (c, dm) in dmax.iter_mut().enumerate().take(strips) {
        let mut m = _mm512_setzero_ps();
        let mut d = [_mm512_setzero_ps(); BLOCK / 16];
        for (k, dk) in d.iter_mut().enumerate() {
            let lanes = len.saturating_sub(16 * k).min(16);
            let mask = ((1u32 << lanes) - 1) as __mmask16;
            let at = _mm512_add_epi32(
                _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * k as i32), iota), _mm512_set1_epi32(rb)),
                _mm512_set1_epi32(34 * c as i32),
            );
            // SAFETY: lane i < len reads 4 bytes at base + (16k + i)·rb + 34c, bytes 34c..34c + 4
            // of row b0 + 16k + i's q8_0 blocks (34·strips bytes, `page_rows`); masked lanes
            // read nothing.
            let w = unsafe { _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, at, base.cast()) };
            *dk = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
            m = _mm512_max_ps(m, _mm512_abs_ps(*dk));
        }
        *dm = _mm512_reduce_max_ps(m);
        let inv = _mm512_set1_ps(if *dm > 0.0 { 1.0 / *dm } else { 0.0 });
        for (k, dk) in d.iter().enumerate() {
            // SAFETY: 16 f32 of dv at c·BLOCK + 16k, inside its strips·BLOCK (asserted).
            unsafe { _mm512_storeu_ps(dv.as_mut_ptr().add(c * BLOCK + 16 * k), _mm512_mul_ps(*dk, inv)) };
        }
    }
    dmax
}

/// The first byte of position b0's q8_0 value blocks (this KV head's), after checking that
/// positions b0..b0 + len lie in one KV page, `rb` bytes apart: row b0 + i's blocks are the
/// `hd / 32 · 34` bytes at `base + i·rb` for i < len.
#[inline]
fn page_rows(io: &AttnIo<'_>, b0: usize, len: usize) -> *const u8 {
    assert!(len >= 1 && b0 % KV_PAGE + len <= KV_PAGE);
    let base = io.v_q8(b0).as_ptr();
    // The last row's slice (bounds-checked) is where the stride puts it.
    assert_eq!(io.v_q8(b0 + len - 1).as_ptr() as usize, base as usize + (len - 1) * io.rb);
    base
}

/// Writes the probabilities `p` (at most [`BLOCK`], all ≥ 0) times 32767 over their largest
/// into `pn`, zero past `p`'s end, and returns the largest (zero when all are).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn scale_probs(p: &[f32], pn: &mut [f32; BLOCK]) -> f32 {
    assert!(p.len() <= BLOCK);
    pn[..p.len()].copy_from_slice(p);
    pn[p.len()..].fill(0.0);
    let mut m = _mm512_setzero_ps();
    for k in 0..BLOCK / 16 {
        m = _mm512_max_ps(m, ld512ps(pn, 16 * k));
    }
    let top = _mm512_reduce_max_ps(m);
    let inv = _mm512_set1_ps(if top > 0.0 { 32767.0 / top } else { 0.0 });
    for k in 0..BLOCK / 16 {
        let x = _mm512_mul_ps(ld512ps(pn, 16 * k), inv);
        // SAFETY: 16 f32 of pn's BLOCK at 16k.
        unsafe { _mm512_storeu_ps(pn.as_mut_ptr().add(16 * k), x) };
    }
    top
}

/// `dst[i] = round(pn[i]·dn[i])`: with both as [`scale_probs`] and [`value_scales`] made them,
/// |product| ≤ 32767 (rounding aside; the narrowing saturates), so each keeps ~15 bits
/// relative to the block's largest (bf16 kept 8 of each).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn quantise_probs(pn: &[f32; BLOCK], dn: &[f32], dst: &mut [i16]) {
    assert!(dn.len() >= BLOCK && dst.len() >= BLOCK);
    for k in 0..BLOCK / 16 {
        let q = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(ld512ps(pn, 16 * k), ld512ps(dn, 16 * k))));
        // SAFETY: dst holds BLOCK i16, 16k + 16 ≤ BLOCK.
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().add(16 * k).cast(), q) };
    }
}

/// The largest of `x` (−∞ when empty; NaN lanes are skipped, as `f32::max` skips them).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn max16(x: &[f32]) -> f32 {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut c = x.chunks_exact(16);
    for v in &mut c {
        m = _mm512_max_ps(m, ld512ps(v, 0));
    }
    c.remainder().iter().copied().fold(_mm512_reduce_max_ps(m), f32::max)
}

/// `x[i] = e^(x[i] − sub)` and their sum: the AVX2 kernels' `exp_sum` 16 lanes at a time, the
/// same polynomial (so the same values: each lane's operations are those of `exp8`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn exp_sum16(x: &mut [f32], sub: f32) -> f32 {
    let sv = _mm512_set1_ps(sub);
    let mut acc = _mm512_setzero_ps();
    let n16 = x.len() / 16 * 16;
    for v in x[..n16].chunks_exact_mut(16) {
        let e = exp16(_mm512_sub_ps(ld512ps(v, 0), sv));
        // SAFETY: `v` is 16 writable f32.
        unsafe { _mm512_storeu_ps(v.as_mut_ptr(), e) };
        acc = _mm512_add_ps(acc, e);
    }
    _mm512_reduce_add_ps(acc) + exp_sum(&mut x[n16..], sub)
}

/// e^x as the AVX2 `exp8` computes it (Cephes expf, the constants `x86::EXP_*`), 16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn exp16(x: __m512) -> __m512 {
    use crate::simd::x86::{EXP_HI, EXP_LN2, EXP_LO, EXP_POLY};
    let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_LO));
    let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
    let fx = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[0]), x);
    let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[1]), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127))));
    _mm512_maskz_mul_ps(!under, y, pow2)
}

/// Eight f32 as a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld256ps(x: &[f32; 8]) -> __m256 {
    // SAFETY: `x` is 8 readable f32.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// The d's of the first `nb` (1..=8) blocks of a q8_0 row as f32, then the last one's again
/// up to 8 (read without a branch per block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn block_scales(row: &[u8], nb: usize) -> [f32; 8] {
    assert!(nb >= 1 && row.len() >= 34 * nb);
    let last = nb - 1;
    let h: [u16; 8] = std::array::from_fn(|i| {
        let at = 34 * i.min(last);
        // SAFETY: at + 2 ≤ 34·nb ≤ row.len() (asserted).
        unsafe { row.as_ptr().add(at).cast::<u16>().read_unaligned() }
    });
    let mut d = [0f32; 8];
    // SAFETY: `h` is 16 readable bytes, `d` 32 writable ones.
    unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()))) };
    d
}

/// Stores the NH sums of rows p and p + 1 (`a0`, `a1`; p + 1 only below `p1`) times `scale`
/// into `scores[n·npos + p]`, reduced in one [`hsum16`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn store_pair<const NH: usize>(a: (&[__m512; NH], &[__m512; NH]), scale: f32, (p, p1, npos): (usize, usize, usize), scores: &mut [f32]) {
    let (a0, a1) = a;
    let zf = _mm512_setzero_ps();
    let v: [__m512; 16] = std::array::from_fn(|i| {
        if i < NH {
            a0[i]
        } else if i < 2 * NH {
            a1[i - NH]
        } else {
            zf
        }
    });
    let mut sums = [0f32; 16];
    // SAFETY: `sums` is 16 writable f32.
    unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), _mm512_mul_ps(hsum16(&v), _mm512_set1_ps(scale))) };
    for n in 0..NH {
        scores[n * npos + p] = sums[n];
        if p + 1 < p1 {
            scores[n * npos + p + 1] = sums[NH + n];
        }
    }
}

/// Scores `scale·q_n·k_p` of the run's NH heads at positions p0..p1 into `scores[n·npos + p]`
/// (f16 keys): each key row converted once and dotted with all NH queries (`qi`, as
/// [`Run::qi`]).
/// SAFETY (caller): as [`attn_blocked`]; `scores` holds NH·npos values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn f16_scores<const NH: usize>(io: &AttnIo<'_>, qi: &[f32], p0: usize, p1: usize, scores: &mut [f32]) {
    let AttnIo { npos, hd, scale, .. } = *io;
    // The queries are indexed through a pointer (a bounds check per 16-float load was ~7
    // instructions, more than the FMA it guards): qi holds NH·hd values.
    assert!(qi.len() >= NH * hd && scores.len() >= NH * npos && p1 <= npos);
    let qp = qi.as_ptr();
    let row = |p: usize| -> [__m512; NH] {
        let kr = io.k_row(p); // hd f16
        if p + PF_ROWS < npos {
            crate::simd::prefetch(io.k_row(p + PF_ROWS));
        }
        let mut acc = [_mm512_setzero_ps(); NH];
        for c in 0..hd / 16 {
            // SAFETY: bytes 32c..32c + 32 of the row's 2·hd.
            let kc = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(kr.as_ptr().add(32 * c).cast()) });
            // SAFETY: chunk c's NH·16 values end at 16·NH·(c + 1) ≤ NH·hd ≤ qi.len().
            let qc = unsafe { qp.add(16 * NH * c) };
            for (n, a) in acc.iter_mut().enumerate() {
                // SAFETY: as above, 16n + 16 ≤ 16·NH.
                *a = _mm512_fmadd_ps(kc, unsafe { _mm512_loadu_ps(qc.add(16 * n)) }, *a);
            }
        }
        acc
    };
    // Two rows a step (a last odd row is paired with itself, its sums dropped).
    for p in (p0..p1).step_by(2) {
        store_pair::<NH>((&row(p), &row((p + 1).min(p1 - 1))), scale, (p, p1, npos), scores);
    }
}

/// [`f16_scores`] over q8_0 keys, with the queries as [`quantise`]d: lanes are (block parity,
/// head), so a lane sums one head's whole block and nothing is reduced across lanes. Per pair
/// of key blocks, the keys + 128 (`vpdpbusd`'s unsigned operand; the queries' −128·Σq starts
/// each sum) and each of their 8 words broadcast to its block's 8 lanes, then times
/// (d_k·d_q) per lane into one f32 accumulator; its halves added give the 8 heads' scores.
/// SAFETY (caller): as [`attn_blocked`]; `scores` holds NH·npos values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_scores<const NH: usize>(io: &AttnIo<'_>, qq: &Quantised, p0: usize, p1: usize, scores: &mut [f32]) {
    let AttnIo { npos, hd, .. } = *io;
    assert!(scores.len() >= NH * npos && p1 <= npos);
    let (nb, np) = (hd / 32, hd / 64);
    let lanes = |j: i32| _mm512_setr_epi32(j, j, j, j, j, j, j, j, j + 8, j + 8, j + 8, j + 8, j + 8, j + 8, j + 8, j + 8);
    // Word i of each block of a pair; the pair's two d's.
    let word: [__m512i; 8] = std::array::from_fn(|i| lanes(i as i32));
    let pick: [__m512i; Q8_MAX_HD / 64] = std::array::from_fn(|j| {
        let j = 2 * j as i32;
        _mm512_setr_epi32(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1)
    });
    let flip = _mm512_set1_epi8(-128);
    let ld = |x: &[i32; 16]| {
        // SAFETY: `x` is 16 readable i32.
        unsafe { _mm512_loadu_si512(x.as_ptr().cast()) }
    };
    let mut s8 = [0f32; 8];
    for p in p0..p1 {
        let kr = io.k_q8(p); // nb blocks of 34 bytes
        if p + PF_ROWS < npos {
            crate::simd::prefetch(io.k_q8(p + PF_ROWS));
        }
        // (Each pair's two d's broadcast to their lanes instead were ~3 % slower on the op.)
        let dk = _mm512_zextps256_ps512(ld256ps(&block_scales(kr, nb)));
        let mut acc = _mm512_setzero_ps();
        for j in 0..np {
            let kb = &kr[68 * j..68 * j + 68];
            // SAFETY: bytes 2..34 and 36..68 of the pair's 68 are inside `kb`.
            let kv = unsafe { cat(_mm256_loadu_si256(kb.as_ptr().add(2).cast()), _mm256_loadu_si256(kb.as_ptr().add(36).cast())) };
            let ku = _mm512_xor_si512(kv, flip);
            // Two chains of four (one of eight waited on each `vpdpbusd`'s latency).
            let (mut t, mut u) = (ld(&qq.corr[j]), _mm512_setzero_si512());
            for i in 0..4 {
                t = _mm512_dpbusd_epi32(t, _mm512_permutexvar_epi32(word[i], ku), ld(&qq.qw[j][i]));
                u = _mm512_dpbusd_epi32(u, _mm512_permutexvar_epi32(word[i + 4], ku), ld(&qq.qw[j][i + 4]));
            }
            let t = _mm512_add_epi32(t, u);
            let sc = _mm512_mul_ps(_mm512_permutexvar_ps(pick[j], dk), ld512ps(&qq.dq[j], 0));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, acc);
        }
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        // SAFETY: `s8` is 8 writable f32.
        unsafe { _mm256_storeu_ps(s8.as_mut_ptr(), _mm256_add_ps(lo, hi)) };
        for (n, x) in s8.iter().take(NH).enumerate() {
            scores[n * npos + p] = *x;
        }
    }
}

/// Lane i of the result is the sum of the 16 lanes of `v[i]` (a transposing tree: 45
/// shuffles and adds for 16 sums, where one `_mm512_reduce_add_ps` is ~8 for one).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn hsum16(v: &[__m512; 16]) -> __m512 {
    // The tree leaves sum(w[L + 4e]) in lane 4L + e: feed w[L + 4e] = v[4L + e].
    let w: [__m512; 16] = std::array::from_fn(|s| v[4 * (s % 4) + s / 4]);
    // 16 → 8: the 256-bit halves of each pair added (128-bit lanes 0, 1 of a's sum, 2, 3 b's).
    let t: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (w[2 * i], w[2 * i + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b))
    });
    // 8 → 4: 128-bit lane L of u[j] holds w[4j + L]'s four partial sums.
    let u: [__m512; 4] = std::array::from_fn(|j| {
        let (x, y) = (t[2 * j], t[2 * j + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y))
    });
    // 4 → 2: lane L of z[k] holds two partials of w[8k + L], then two of w[8k + 4 + L].
    let z: [__m512; 2] = std::array::from_fn(|k| {
        let (x, y) = (u[2 * k], u[2 * k + 1]);
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(x, y), _mm512_shuffle_ps::<0xEE>(x, y))
    });
    _mm512_add_ps(_mm512_shuffle_ps::<0x88>(z[0], z[1]), _mm512_shuffle_ps::<0xDD>(z[0], z[1]))
}

/// Values 32c..32c + 32 of an f16 row as two vectors of 16 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn f16_vals(row: &[u8], c: usize) -> (__m512, __m512) {
    let b = &row[64 * c..64 * c + 64];
    // SAFETY: `b` is 64 readable bytes.
    let (lo, hi) = unsafe { (_mm256_loadu_si256(b.as_ptr().cast()), _mm256_loadu_si256(b.as_ptr().add(32).cast())) };
    (_mm512_cvtph_ps(lo), _mm512_cvtph_ps(hi))
}

/// The next block's rows r and r + 1 of the run's KV head (the value rows' lines, each once).
#[inline]
fn prefetch_next(io: &AttnIo<'_>, r: usize, q8: bool) {
    for x in [r, r + 1] {
        if x + BLOCK < io.npos {
            crate::simd::prefetch(if q8 { io.v_q8(x + BLOCK) } else { io.v_row(x + BLOCK) });
        }
    }
}

/// P·V of positions b0..b0 + len over q8_0 values in 16-bit integers, added to `out`: per
/// value block c, rows r and r + 1 sign-extended to 16 bits and interleaved (`vpunpck*wd`),
/// times the pair of quantised probabilities (`pw` `[c][head][i]`, scales `ps` `[c][head]` as
/// [`quantise_probs`] made them) in `vpdpwssd`, 32 products an instruction as `vdpbf16ps` but
/// with the values sign-extended instead of converted. A lane sums at most 64 products of
/// |q| ≤ 32767 and |v| ≤ 128: below 2^28, no overflow.
/// SAFETY (caller): as [`attn_blocked`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_pv<const NH: usize>(io: &AttnIo<'_>, b0: usize, len: usize, (pw, ps): (&[i16], &[f32]), out: &mut [f32]) {
    let hd = io.hd;
    // The interleave leaves values 8L..8L + 4 of each 128-bit lane L in `lo`, 8L + 4..8L + 8
    // in `hi`: these put them back in order (values 0..16, then 16..32).
    let ord0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    let ord1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    let base = page_rows(io, b0, len);
    // SAFETY (of each call): i < len, c < hd / 32: bytes 34c + 2..34c + 34 of row b0 + i's
    // q8_0 blocks (`page_rows`).
    let vals = |i: usize, c: usize| _mm512_cvtepi8_epi16(unsafe { _mm256_loadu_si256(base.add(i * io.rb + 34 * c + 2).cast()) });
    for c in 0..hd / 32 {
        let at0 = c * NH * BLOCK;
        assert!(at0 + NH * BLOCK <= pw.len() && c * NH + NH <= ps.len());
        let mut acc = [[_mm512_setzero_si512(); 2]; NH];
        for t in 0..len.div_ceil(2) {
            if c == 0 {
                prefetch_next(io, b0 + 2 * t, true);
            }
            let a = vals(2 * t, c);
            let b = if 2 * t + 1 < len { vals(2 * t + 1, c) } else { _mm512_setzero_si512() };
            let (lo, hi) = (_mm512_unpacklo_epi16(a, b), _mm512_unpackhi_epi16(a, b));
            for (n, x) in acc.iter_mut().enumerate() {
                // SAFETY: at0 + n·BLOCK + 2t + 2 ≤ at0 + NH·BLOCK ≤ pw.len() (asserted): one
                // unaligned word, the probabilities of positions 2t and 2t + 1.
                let w = unsafe { pw.as_ptr().add(at0 + n * BLOCK + 2 * t).cast::<i32>().read_unaligned() };
                let w = _mm512_set1_epi32(w);
                x[0] = _mm512_dpwssd_epi32(x[0], lo, w);
                x[1] = _mm512_dpwssd_epi32(x[1], hi, w);
            }
        }
        let f: [[__m512; 2]; NH] = std::array::from_fn(|n| {
            let s = _mm512_set1_ps(ps[c * NH + n]);
            let (l, h) = (_mm512_cvtepi32_ps(acc[n][0]), _mm512_cvtepi32_ps(acc[n][1]));
            [_mm512_mul_ps(_mm512_permutex2var_ps(l, ord0, h), s), _mm512_mul_ps(_mm512_permutex2var_ps(l, ord1, h), s)]
        });
        add_strip::<NH>(&f, out, hd, c);
    }
}

/// P·V of positions b0..b0 + len over f16 values in f32 FMAs (`pf`: the probabilities,
/// `[head][i]`), added to `out`.
/// SAFETY (caller): as [`attn_blocked`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn f16_pv_f32<const NH: usize>(io: &AttnIo<'_>, b0: usize, len: usize, pf: &[f32], out: &mut [f32]) {
    let hd = io.hd;
    assert!(NH * BLOCK <= pf.len());
    for c in 0..hd / 32 {
        let mut acc = [[_mm512_setzero_ps(); 2]; NH];
        for i in 0..len {
            let r = b0 + i;
            if c == 0 && i % 2 == 0 {
                prefetch_next(io, r, false);
            }
            let (v0, v1) = f16_vals(io.v_row(r), c);
            for (n, a) in acc.iter_mut().enumerate() {
                let s = _mm512_set1_ps(pf[n * BLOCK + i]);
                a[0] = _mm512_fmadd_ps(s, v0, a[0]);
                a[1] = _mm512_fmadd_ps(s, v1, a[1]);
            }
        }
        add_strip::<NH>(&acc, out, hd, c);
    }
}

/// Adds the accumulators of columns 32c..32c + 32 of each head to `out`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn add_strip<const NH: usize>(acc: &[[__m512; 2]; NH], out: &mut [f32], hd: usize, c: usize) {
    for (n, a) in acc.iter().enumerate() {
        let o = &mut out[n * hd + 32 * c..n * hd + 32 * c + 32];
        let (o0, o1) = (_mm512_add_ps(ld512ps(o, 0), a[0]), _mm512_add_ps(ld512ps(o, 16), a[1]));
        // SAFETY: `o` is 32 writable f32.
        unsafe {
            _mm512_storeu_ps(o.as_mut_ptr(), o0);
            _mm512_storeu_ps(o.as_mut_ptr().add(16), o1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reduction tree against plain sums, lane by lane.
    #[test]
    fn hsum16_sums_each_vector() {
        if super::super::Avx512::new().is_none() {
            return;
        }
        let x: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
        // SAFETY: the CPU has the features (checked above); x holds 16 vectors of 16.
        let got = unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(x.as_ptr().add(16 * i)));
            let mut o = [0f32; 16];
            _mm512_storeu_ps(o.as_mut_ptr(), hsum16(&v));
            o
        };
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, x[16 * i..16 * i + 16].iter().sum::<f32>(), "lane {i}");
        }
    }
}
