//! AVX-512 VNNI kernels: the x86 kernel bodies of [`super::avx2`] with the integer product done
//! by `vpdpbusd` (u8 × i8 summed into i32 lanes in one instruction, no i16 saturation) on 256-bit
//! vectors (AVX-512 VL).

use std::arch::x86_64::*;

use super::Kernels;
use super::x86::x86_kernels;

mod decode;
mod prompt;
use decode::*;
use prompt::*;

/// The AVX-512 VNNI kernel token: exists only on CPUs with AVX2, FMA, F16C, AVX-512 F/BW/VL
/// and AVX-512 VNNI.
#[derive(Debug, Clone, Copy)]
pub struct Avx512 {
    _private: (),
}

impl Avx512 {
    pub fn new() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        ok.then_some(Avx512 { _private: () })
    }
}

/// Whether the CPU has AVX-512 BF16 (and `EMBER_BF16` is not `0`): the bf16 kernels run.
fn bf16_cpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| is_x86_feature_detected!("avx512bf16") && std::env::var("EMBER_BF16").as_deref() != Ok("0"))
}

/// Whether the prompt attention's P·V runs in bf16 ([`Kernels::has_bf16`]): the CPU has
/// AVX-512 BF16 and its `vdpbf16ps` clearly outruns f32 FMAs ([`bf16_pays`]); `EMBER_BF16=0`
/// or `1` decides instead. Decided once.
fn bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| bf16_cpu() && (std::env::var("EMBER_BF16").as_deref() == Ok("1") || bf16_pays()))
}

/// Whether `vdpbf16ps` makes at least 1.5x the multiply-adds per second of `vfmadd231ps` on
/// this core (the bf16 path also converts the values and probabilities), timed once: best of 5
/// runs of 2^14 instructions each, well under a millisecond. Zen 4 makes ~2x (prompt attention
/// at depth 1.28-1.45x faster in bf16); the Xeon the dev VM had on 2026-12-05 made 1.18-1.20x
/// (5 processes), and its prompt attention ran 1.16-1.28x slower in bf16.
fn bf16_pays() -> bool {
    const N: usize = 1 << 11;
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot_rate() -> f64 {
        let mut a = [_mm512_set1_ps(0.0); 8];
        let b = bh(_mm512_set1_epi16(0x3f80)); // 1.0 in every lane
        let t = std::time::Instant::now();
        for _ in 0..N {
            for x in a.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, b, b);
            }
            a = std::hint::black_box(a);
        }
        (32 * 8 * N) as f64 / t.elapsed().as_secs_f64()
    }
    #[target_feature(enable = "avx512f")]
    fn fma_rate() -> f64 {
        let mut a = [_mm512_set1_ps(0.0); 8];
        let b = _mm512_set1_ps(1.0);
        let t = std::time::Instant::now();
        for _ in 0..N {
            for x in a.iter_mut() {
                *x = _mm512_fmadd_ps(b, b, *x);
            }
            a = std::hint::black_box(a);
        }
        (16 * 8 * N) as f64 / t.elapsed().as_secs_f64()
    }
    if !is_x86_feature_detected!("avx512bf16") || !is_x86_feature_detected!("avx512f") {
        return false;
    }
    let (mut dot, mut fma) = (0f64, 0f64);
    for _ in 0..5 {
        // SAFETY: the CPU has AVX-512 F and BF16 (checked above).
        unsafe {
            dot = dot.max(dot_rate());
            fma = fma.max(fma_rate());
        }
    }
    dot >= 1.5 * fma
}

/// Σ of four neighbouring u8·i8 products into each i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dp(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

x86_kernels!(Avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", {
    #[inline]
    fn has_panels(self) -> bool {
        true
    }

    #[inline]
    fn wants_k4_order(self) -> bool {
        true
    }

    fn attn_f16(self, io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) -> bool {
        if !super::attn_check(io, false, scores, out, ml) {
            return false;
        }
        // SAFETY: the CPU has the features (token); attn_check checked the bounds.
        unsafe { attn_blocked(io, Cache::F16, scores, out, ml) };
        true
    }

    fn attn_q8(self, io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) -> bool {
        if !io.hd.is_multiple_of(64) || io.hd > Q8_MAX_HD || !super::attn_check(io, true, scores, out, ml) {
            return false;
        }
        // SAFETY: the CPU has the features (token); attn_check checked the bounds; hd is a
        // multiple of 64, at most Q8_MAX_HD.
        unsafe { attn_blocked(io, Cache::Q8, scores, out, ml) };
        true
    }

    fn gemm_f32(self, g: &super::Gemm<'_>, c: &mut [f32]) {
        g.check(c);
        if !g.m.is_multiple_of(GEMM_ROWS) || !g.n.is_multiple_of(16) {
            return super::gemm_f32_scalar(g, c);
        }
        // SAFETY: the CPU has the features (token); `check` bounded every element the tiles
        // touch, and m, n are multiples of the tile's rows and of 16 columns.
        unsafe { gemm_f32(g, c) }
    }

    #[inline]
    fn has_bf16(self) -> bool {
        bf16()
    }

    fn gemm_bf16(self, g: &super::GemmBf16<'_>, c: &mut [f32]) {
        g.check(c);
        if !bf16_cpu() || !g.m.is_multiple_of(GEMM_ROWS) || !g.n.is_multiple_of(16) {
            return super::gemm_bf16_scalar(g, c);
        }
        // SAFETY: the CPU has the token's features and AVX-512 BF16 (`bf16_cpu`); `check` bounded
        // every element the tiles touch; m, n are multiples of the tile's rows and of 16
        // columns.
        unsafe { gemm_bf16(g, c) }
    }

    fn f32_to_bf16(self, src: &[f32], dst: &mut [u16]) {
        assert!(dst.len() >= src.len(), "f32_to_bf16: {} values into {}", src.len(), dst.len());
        if !bf16_cpu() {
            return dst.iter_mut().zip(src).for_each(|(d, x)| *d = super::bf16_of(*x));
        }
        // SAFETY: the CPU has AVX-512 BF16 (`bf16_cpu`); dst holds at least src.len() values.
        unsafe { f32_to_bf16(src, dst) }
    }

    fn delta_seq(self, st: &mut [f32], io: &DeltaIo<'_>, o: &mut [f32]) {
        let Some(kq) = super::delta_columns_kq(st, io, o, ROWS) else {
            return super::delta_stepwise(self, st, io, o);
        };
        let mut buf = vec![Lanes::<f32>::default(); io.dk];
        super::delta_columns_chunked(io, &kq, o, ROWS, |io, kq, o, c| {
            // SAFETY: the CPU has the features (token); delta_columns_kq checked the lengths
            // (a chunk's are within them).
            unsafe { delta_columns(st, io, kq, c, &mut buf, o) };
        });
    }

    fn panel_unpack(self, ty: GgmlType, k: usize, rows: &[u8], m: usize, p: &mut Panel) {
        let rb = ty.row_bytes(k).expect("panel rows are whole blocks");
        assert!((1..=ROWS).contains(&m) && rows.len() >= m * rb, "panel_unpack: {m} rows of {rb} bytes in {} bytes", rows.len());
        assert!(ROWS * rb < i32::MAX as usize, "panel_unpack: rows of {rb} bytes are too long to gather");
        if !matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q8_0 | GgmlType::IQ4XS) {
            let rs: Vec<&[u8]> = (0..m).map(|r| &rows[r * rb..(r + 1) * rb]).collect();
            return p.unpack_scalar(ty, k, &rs);
        }
        p.reset(ty, k, m);
        // SAFETY: the CPU has the features (token); `rows` holds m rows of rb bytes (checked
        // above), and every unpacker gathers only 4-byte words inside a block of a row.
        unsafe {
            let r = Gather::new(rows, rb, m);
            match ty {
                GgmlType::Q4K => unpack_k4::<false>(&r, k, p),
                GgmlType::Q5K => unpack_k4::<true>(&r, k, p),
                GgmlType::Q6K => unpack_q6k(&r, k, p),
                GgmlType::Q8_0 => unpack_q8_0(&r, k, p),
                _ => unpack_iq4xs(&r, k, p),
            }
            finish_corr(p);
        }
    }

    fn panel_dot(self, p: &Panel, a: &[&ActRow], out: &mut [[f32; ROWS]]) {
        assert!(out.len() >= a.len());
        for a in a {
            assert!(
                a.qu.len() >= p.k && a.d.len() >= p.k / 32 && a.ds16.len() >= p.k / 16,
                "panel_dot: activation row shorter than the panel"
            );
        }
        assert!(p.q.len() >= p.k / 4 && p.sc.len() >= p.k / p.g && p.off.len() >= p.k / p.g && p.corr.len() >= p.k / p.g);
        let mut i = 0;
        while i < a.len() {
            let n = (a.len() - i).min(8);
            let (a, o) = (&a[i..i + n], &mut out[i..i + n]);
            // SAFETY: the CPU has the features (token); the lengths were checked above.
            unsafe {
                match n {
                    8 => panel_dot_g::<8>(p, a, o),
                    7 => panel_dot_g::<7>(p, a, o),
                    6 => panel_dot_g::<6>(p, a, o),
                    5 => panel_dot_g::<5>(p, a, o),
                    4 => panel_dot_g::<4>(p, a, o),
                    3 => panel_dot_g::<3>(p, a, o),
                    2 => panel_dot_g::<2>(p, a, o),
                    _ => panel_dot_g::<1>(p, a, o),
                }
            }
            i += n;
        }
    }
});

use super::{AttnIo, DeltaIo};

/// The integer-summing single-token K-quant kernels of the shared macro are for `maddubs`;
/// here `dot1_wide` (VNNI on 512-bit vectors) answers for those formats.
const INT_DOTS: bool = false;

/// Single-token (decode) dots on 512-bit vectors for the formats of real files: two 32-weight
/// blocks per `vpdpbusd`, so the instructions per weight byte drop by about a third against
/// the shared 256-bit kernels (decode on a fast memory bus is bound by them, not by DRAM).
/// `None`: use the shared kernel.
/// Whether [`dot1_wide`] answers for `ty`.
#[inline(always)]
fn has_dot1_wide(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q8_0)
}

/// SAFETY (caller): the CPU has the features of this module's token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot1_wide(ty: GgmlType, w: &[u8], a: &ActRow) -> Option<f32> {
    match ty {
        GgmlType::Q4K if a.qk.len() == a.q.len() => Some(dot1_q4k_ordered(w, a)),
        GgmlType::Q4K => Some(dot1_k4::<false>(w, a)),
        GgmlType::Q5K => Some(dot1_k4::<true>(w, a)),
        GgmlType::Q6K => Some(dot1_q6k(w, a)),
        GgmlType::Q8_0 => Some(dot1_q8_0(w, a)),
        _ => None,
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld512i(b: &[i8], at: usize) -> __m512i {
    let s = &b[at..at + 64];
    // SAFETY: `s` is 64 readable bytes; loadu has no alignment requirement.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn ld512ps(x: &[f32], at: usize) -> __m512 {
    let s = &x[at..at + 16];
    // SAFETY: `s` is 16 readable f32; loadu has no alignment requirement.
    unsafe { _mm512_loadu_ps(s.as_ptr()) }
}

/// Two 256-bit halves as one 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn cat(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Q4_K / Q5_K, one token: per 32-byte chunk p, its low and high nibbles (sub-blocks 2p and
/// 2p+1, i.e. activations 64p..64p+64) form one 512-bit operand.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot1_k4<const Q5: bool>(w: &[u8], a: &ActRow) -> f32 {
    let bs = if Q5 { 176 } else { 144 };
    let qs0 = if Q5 { 48 } else { 16 };
    let m4 = _mm256_set1_epi8(0x0F);
    let idx: [__m512i; 4] = std::array::from_fn(|p| {
        let (x, y) = (2 * p as i32, 2 * p as i32 + 1);
        _mm512_setr_epi32(x, x, x, x, x, x, x, x, y, y, y, y, y, y, y, y)
    });
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut accm = _mm256_setzero_ps();
    for (i, b) in w.chunks_exact(bs).enumerate() {
        let (sc, mn, d, dmin) = k4_header(b);
        let s8 = _mm256_mul_ps(_mm256_mul_ps(d, sc), ldps(&a.d, 8 * i));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(dmin, mn), ldps(&a.ds32, 8 * i), accm);
        let s16 = _mm512_castps256_ps512(s8);
        let mut hb = if Q5 { ld256(b, 16) } else { _mm256_setzero_si256() };
        for p in 0..4 {
            let q = ld256(b, qs0 + 32 * p);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if Q5 {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(hb, _mm256_set1_epi8(1))));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(hb, _mm256_set1_epi8(2))));
                hb = _mm256_srli_epi16::<2>(hb);
            }
            let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cat(lo, hi), ld512i(&a.q, 256 * i + 64 * p));
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_permutexvar_ps(idx[p], s16), acc[p]);
        }
    }
    let acc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(acc) - hsum(accm)
}

/// Q4_K, one token, with the activations in Q4_K nibble order (`ActRow::qk`): one 64-byte
/// load covers chunks 2pp and 2pp+1, whose low nibbles (sub-blocks 4pp, 4pp+2) and high
/// nibbles (4pp+1, 4pp+3) each make one `vpdpbusd` with a plain 64-byte activation load.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot1_q4k_ordered(w: &[u8], a: &ActRow) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let lanes = |x: i32, y: i32| _mm512_setr_epi32(x, x, x, x, x, x, x, x, y, y, y, y, y, y, y, y);
    let idx = [lanes(0, 2), lanes(1, 3), lanes(4, 6), lanes(5, 7)];
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut accm = _mm256_setzero_ps();
    for (i, b) in w.chunks_exact(144).enumerate() {
        let (sc, mn, d, dmin) = k4_header(b);
        let s16 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_mul_ps(d, sc), ldps(&a.d, 8 * i)));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(dmin, mn), ldps(&a.ds32, 8 * i), accm);
        for pp in 0..2 {
            let qs = &b[16 + 64 * pp..16 + 64 * pp + 64];
            // SAFETY: `qs` is 64 readable bytes.
            let q = unsafe { _mm512_loadu_si512(qs.as_ptr().cast()) };
            let lo = _mm512_and_si512(q, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
            let at = 256 * i + 128 * pp;
            let plo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ld512i(&a.qk, at));
            let phi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, ld512i(&a.qk, at + 64));
            acc[2 * pp] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(plo), _mm512_permutexvar_ps(idx[2 * pp], s16), acc[2 * pp]);
            acc[2 * pp + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(phi), _mm512_permutexvar_ps(idx[2 * pp + 1], s16), acc[2 * pp + 1]);
        }
    }
    let acc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(acc) - hsum(accm)
}

/// Q6_K, one token: codes of activations 128n + 64h .. + 64 (two of the four 32-code vectors
/// of half n) form one 512-bit operand; the 16 group scales times the activation scales sit in
/// one vector, permuted per operand (lanes 4m..4m+4 = group 4·(2n+h) + m).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot1_q6k(w: &[u8], a: &ActRow) -> f32 {
    let m4z = _mm512_set1_epi8(0x0F);
    let m3z = _mm512_set1_epi8(3);
    // 16-bit shift counts: operand 0 takes qh bits 0-1 (ql0 half) and 2-3 (ql1 half), operand 1
    // bits 4-5 and 6-7.
    let half = |x: i16, y: i16| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_set1_epi16(x)), _mm256_set1_epi16(y));
    let shifts = [half(0, 2), half(4, 6)];
    // Activation scale of each 16-group: a.d[group / 2].
    let dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let idx: [__m512i; 4] = std::array::from_fn(|o| {
        let g = |m: i32| 4 * o as i32 + m;
        _mm512_setr_epi32(g(0), g(0), g(0), g(0), g(1), g(1), g(1), g(1), g(2), g(2), g(2), g(2), g(3), g(3), g(3), g(3))
    });
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut accm = _mm512_setzero_ps();
    for (i, b) in w.chunks_exact(210).enumerate() {
        // SAFETY: b[192..208] are 16 readable bytes.
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(b[192..208].as_ptr().cast()) }));
        let scd = _mm512_mul_ps(sc, _mm512_set1_ps(f16(b, 208)));
        accm = _mm512_fmadd_ps(scd, ld512ps(&a.ds16, 16 * i), accm);
        let ad = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(ldps(&a.d, 8 * i)));
        let s16 = _mm512_mul_ps(scd, ad);
        for n in 0..2 {
            // ql[64n..64n + 64] = [ql0 | ql1]; codes of operand h: nibble h of each byte, with
            // two bits of qh: bits 2h.. for the ql0 half, 2h + 2.. for the ql1 half.
            let qs = &b[64 * n..64 * n + 64];
            // SAFETY: `qs` is 64 readable bytes.
            let ql = unsafe { _mm512_loadu_si512(qs.as_ptr().cast()) };
            let qh = ld256(b, 128 + 32 * n);
            let qh2 = cat(qh, qh);
            for h in 0..2 {
                let nib = if h == 0 { _mm512_and_si512(ql, m4z) } else { _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4z) };
                let hi = _mm512_and_si512(_mm512_srlv_epi16(qh2, shifts[h]), m3z);
                let codes = _mm512_or_si512(nib, _mm512_slli_epi16::<4>(hi));
                let o = 2 * n + h;
                let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, ld512i(&a.q, 256 * i + 64 * o));
                acc[o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_permutexvar_ps(idx[o], s16), acc[o]);
            }
        }
    }
    let acc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(acc) - 32.0 * _mm512_reduce_add_ps(accm)
}

/// Q8_0, one token: two blocks per 512-bit operand; signed weights through |w| and the
/// activations negated where w < 0; four pairs (four accumulator chains) per step.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dot1_q8_0(w: &[u8], a: &ActRow) -> f32 {
    let n_blocks = w.len() / 34;
    let pair = |j: usize, acc: __m512| -> __m512 {
        let q = cat(ld256(w, 34 * j + 2), ld256(w, 34 * j + 36));
        let av = ld512i(&a.q, 32 * j);
        let sa = _mm512_mask_sub_epi8(av, _mm512_movepi8_mask(q), _mm512_setzero_si512(), av);
        let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), sa);
        let (s0, s1) = (f16(w, 34 * j) * a.d[j], f16(w, 34 * j + 34) * a.d[j + 1]);
        let s =
            _mm512_castsi512_ps(_mm512_inserti64x4::<1>(_mm512_castps_si512(_mm512_set1_ps(s0)), _mm256_castps_si256(_mm256_set1_ps(s1))));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), s, acc)
    };
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut j = 0;
    while j + 8 <= n_blocks {
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = pair(j + 2 * c, *acc);
        }
        j += 8;
    }
    while j + 2 <= n_blocks {
        acc[0] = pair(j, acc[0]);
        j += 2;
    }
    let acc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let mut sum = _mm512_reduce_add_ps(acc);
    if j < n_blocks {
        // An odd last block.
        let qs = &w[34 * j + 2..34 * j + 34];
        let isum: i32 = qs.iter().zip(&a.q[32 * j..32 * j + 32]).map(|(x, y)| *x as i8 as i32 * *y as i32).sum();
        sum += f16(w, 34 * j) * a.d[j] * isum as f32;
    }
    sum
}
use crate::panel::{Lanes, Panel, ROWS};

/// The delta rule for value columns `16c..16c + 16` of one head over all tokens, with those
/// columns of the state held key-major in `buf` (`buf[i]` lane l = S[i][16c + l], 8 KiB at
/// d_k = 128: it stays in L1 for the whole sequence). Per token, from `r = Sᵀk` and `u = Sᵀq`:
/// `δ = β(v − decay·r)`, `o = decay·u + δ·(k·q)` (= the updated `Sᵀq`), then one pass
/// `S ← decay·S + kδᵀ` that also accumulates the next token's `r` and `u`. No horizontal sums:
/// the 16 lanes are 16 independent state columns.
/// SAFETY (caller): `st` holds d_k·d_v values, `o` n·d_v, `kq`/`decay`/`beta` n, and every
/// token's q, k, v are in bounds (checked by `delta_seq`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn delta_columns(st: &mut [f32], io: &DeltaIo<'_>, kq: &[f32], c: usize, buf: &mut [Lanes<f32>], o: &mut [f32]) {
    let (dk, dv) = (io.dk, io.dv);
    let col0 = c * ROWS;
    let idx: [i32; ROWS] = std::array::from_fn(|l| (l * dk) as i32);
    // SAFETY: `idx` is 16 readable i32.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    for (i, b) in buf.iter_mut().enumerate() {
        // SAFETY: lane l reads st[(col0 + l)·dk + i] < dk·dv.
        put_f(b, unsafe { _mm512_i32gather_ps::<4>(idx, st.as_ptr().add(col0 * dk + i).cast()) });
    }
    // r and u of token 0, four partial sums each (dk is a multiple of 4: `delta_seq`).
    let (q0, k0, _) = io.token(0);
    let (mut r, mut u) = ([_mm512_setzero_ps(); 4], [_mm512_setzero_ps(); 4]);
    for ((b, kc), qc) in buf.chunks_exact(4).zip(k0.chunks_exact(4)).zip(q0.chunks_exact(4)) {
        for j in 0..4 {
            let s = get_f(&b[j]);
            r[j] = _mm512_fmadd_ps(s, _mm512_set1_ps(kc[j]), r[j]);
            u[j] = _mm512_fmadd_ps(s, _mm512_set1_ps(qc[j]), u[j]);
        }
    }
    for t in 0..io.n {
        let (_, k, v) = io.token(t);
        let decay = _mm512_set1_ps(io.decay[t]);
        let rs = _mm512_add_ps(_mm512_add_ps(r[0], r[1]), _mm512_add_ps(r[2], r[3]));
        let us = _mm512_add_ps(_mm512_add_ps(u[0], u[1]), _mm512_add_ps(u[2], u[3]));
        // SAFETY: v has dv ≥ col0 + 16 values.
        let vv = unsafe { _mm512_loadu_ps(v.as_ptr().add(col0)) };
        let delta = _mm512_mul_ps(_mm512_set1_ps(io.beta[t]), _mm512_fnmadd_ps(decay, rs, vv));
        let ot = _mm512_fmadd_ps(delta, _mm512_set1_ps(kq[t]), _mm512_mul_ps(decay, us));
        // SAFETY: o has n·dv values and t·dv + col0 + 16 ≤ n·dv.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(t * dv + col0), ot) };
        let (qn, kn, _) = io.token((t + 1).min(io.n - 1));
        r = [_mm512_setzero_ps(); 4];
        u = [_mm512_setzero_ps(); 4];
        for (((b, kc), knc), qnc) in buf.chunks_exact_mut(4).zip(k.chunks_exact(4)).zip(kn.chunks_exact(4)).zip(qn.chunks_exact(4)) {
            for j in 0..4 {
                let s = _mm512_fmadd_ps(get_f(&b[j]), decay, _mm512_mul_ps(_mm512_set1_ps(kc[j]), delta));
                put_f(&mut b[j], s);
                // For the last token these sums are not used (kn, qn repeat it).
                r[j] = _mm512_fmadd_ps(s, _mm512_set1_ps(knc[j]), r[j]);
                u[j] = _mm512_fmadd_ps(s, _mm512_set1_ps(qnc[j]), u[j]);
            }
        }
    }
    for (i, b) in buf.iter().enumerate() {
        // SAFETY: as the gather above; distinct lanes write distinct addresses.
        unsafe { _mm512_i32scatter_ps::<4>(st.as_mut_ptr().add(col0 * dk + i).cast(), idx, get_f(b)) };
    }
}

/// Gathers of one 4-byte word from each of 16 rows (rows past the real ones repeat the last).
struct Gather {
    base: *const u8,
    idx: __m512i,
    #[cfg(debug_assertions)]
    row_bytes: usize,
}

impl Gather {
    /// SAFETY (caller): `rows` holds `m` ≥ 1 rows of `rb` bytes and 16·rb < 2^31.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn new(rows: &[u8], rb: usize, m: usize) -> Gather {
        let o: [i32; ROWS] = std::array::from_fn(|r| (r.min(m - 1) * rb) as i32);
        Gather {
            base: rows.as_ptr(),
            // SAFETY: `o` is 16 readable i32.
            idx: unsafe { _mm512_loadu_si512(o.as_ptr().cast()) },
            #[cfg(debug_assertions)]
            row_bytes: rb,
        }
    }

    /// Lane r = the 4 bytes at `at` of row r.
    /// SAFETY (caller): `at + 4 ≤ rb`, so every lane reads inside its row.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn at(&self, at: usize) -> __m512i {
        #[cfg(debug_assertions)]
        debug_assert!(at + 4 <= self.row_bytes);
        // SAFETY: per the caller's promise, each lane's address is inside its row.
        unsafe { _mm512_i32gather_epi32::<1>(self.idx, self.base.add(at).cast()) }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn put_i(dst: &mut Lanes<i32>, v: __m512i) {
    // SAFETY: `Lanes` is 64 bytes aligned to 64.
    unsafe { _mm512_store_si512((dst as *mut Lanes<i32>).cast(), v) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn put_f(dst: &mut Lanes<f32>, v: __m512) {
    // SAFETY: as above.
    unsafe { _mm512_store_ps((dst as *mut Lanes<f32>).cast(), v) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn get_i(src: &Lanes<i32>) -> __m512i {
    // SAFETY: as above.
    unsafe { _mm512_load_si512((src as *const Lanes<i32>).cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn get_f(src: &Lanes<f32>) -> __m512 {
    // SAFETY: as above.
    unsafe { _mm512_load_ps((src as *const Lanes<f32>).cast()) }
}

/// The low 16 bits of each lane as an f16, in f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn lo_f16(v: __m512i) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
}

/// Byte `n` of each lane, zero-extended.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn byte(v: __m512i, n: usize) -> __m512i {
    _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * n as i32)), _mm512_set1_epi32(0xFF))
}

/// Q4_K / Q5_K (`Q5`): per 256-block d, dmin, eight 6-bit scales and mins, 4-bit codes (+ a
/// fifth bit from qh); panel codes 0..15 / 0..31, offsets −dmin·m.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_k4<const Q5: bool>(r: &Gather, k: usize, p: &mut Panel) {
    let (ts, qs0) = if Q5 { (176, 48) } else { (144, 16) };
    let m4 = _mm512_set1_epi32(0x0F0F_0F0F);
    let one = _mm512_set1_epi32(0x0101_0101);
    let (k1, k2, k3) = (_mm512_set1_epi32(0x3f3f_3f3f), _mm512_set1_epi32(0x0f0f_0f0f), _mm512_set1_epi32(0x0303_0303));
    for b in 0..k / 256 {
        let bb = b * ts;
        // SAFETY (all gathers here): offsets are inside block b, which is inside every row.
        let dd = unsafe { r.at(bb) };
        let d = lo_f16(dd);
        let dmin = lo_f16(_mm512_srli_epi32::<16>(dd));
        let (u0, u1, u2) = unsafe { (r.at(bb + 4), r.at(bb + 8), r.at(bb + 12)) };
        // gguf-format.md §5: scales 0..3 are the low 6 bits of bytes 0..3, mins 0..3 of bytes
        // 4..7; 4..7 take their low nibbles from bytes 8..11 and high bits from 0..7.
        let s_lo = _mm512_and_si512(u0, k1);
        let s_hi = _mm512_or_si512(_mm512_and_si512(u2, k2), _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), k3)));
        let m_lo = _mm512_and_si512(u1, k1);
        let m_hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2),
            _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), k3)),
        );
        for j in 0..8 {
            let (sv, mv) = if j < 4 { (s_lo, m_lo) } else { (s_hi, m_hi) };
            put_f(&mut p.sc[8 * b + j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(byte(sv, j % 4))));
            put_f(&mut p.off[8 * b + j], _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin), _mm512_cvtepi32_ps(byte(mv, j % 4))));
        }
        let mut hb = [_mm512_setzero_si512(); 8];
        if Q5 {
            for (s, h) in hb.iter_mut().enumerate() {
                *h = unsafe { r.at(bb + 16 + 4 * s) };
            }
        }
        for pp in 0..4 {
            for (s, h) in hb.iter().enumerate() {
                let v = unsafe { r.at(bb + qs0 + 32 * pp + 4 * s) };
                let mut lo = _mm512_and_si512(v, m4);
                let mut hi = _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4);
                if Q5 {
                    // bit 2pp of qh byte l is the fifth bit of sub-block 2pp, bit 2pp+1 of 2pp+1.
                    let h0 = _mm512_and_si512(_mm512_srl_epi32(*h, _mm_cvtsi32_si128(2 * pp as i32)), one);
                    let h1 = _mm512_and_si512(_mm512_srl_epi32(*h, _mm_cvtsi32_si128(2 * pp as i32 + 1)), one);
                    lo = _mm512_or_si512(lo, _mm512_slli_epi32::<4>(h0));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi32::<4>(h1));
                }
                put_i(&mut p.q[64 * b + 16 * pp + s], lo);
                put_i(&mut p.q[64 * b + 16 * pp + 8 + s], hi);
            }
        }
    }
}

/// Q6_K: per 256-block an f16 d, sixteen i8 scales (one per 16), 6-bit codes − 32.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q6k(r: &Gather, k: usize, p: &mut Panel) {
    let m4 = _mm512_set1_epi32(0x0F0F_0F0F);
    let m3 = _mm512_set1_epi32(0x0303_0303);
    let off = _mm512_set1_epi8(32);
    for b in 0..k / 256 {
        let bb = b * 210;
        // SAFETY (all gathers here): inside block b (d is the high half of the word at 206).
        let d = lo_f16(_mm512_srli_epi32::<16>(unsafe { r.at(bb + 206) }));
        for i in 0..4 {
            let sv = unsafe { r.at(bb + 192 + 4 * i) };
            for l in 0..4 {
                // group 4i + l (weights 16·(4i+l)..) has scale byte 4i + l (kernels.rs).
                let s = _mm512_srai_epi32::<24>(_mm512_sll_epi32(sv, _mm_cvtsi32_si128(24 - 8 * l as i32)));
                put_f(&mut p.sc[16 * b + 4 * i + l], _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
                put_f(&mut p.off[16 * b + 4 * i + l], _mm512_setzero_ps());
            }
        }
        for n in 0..2 {
            for s in 0..8 {
                let (a, c, h) = unsafe { (r.at(bb + 64 * n + 4 * s), r.at(bb + 64 * n + 32 + 4 * s), r.at(bb + 128 + 32 * n + 4 * s)) };
                let q = [
                    _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi32::<4>(_mm512_and_si512(h, m3))),
                    _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<2>(h), m3))),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi32::<4>(a), m4),
                        _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<4>(h), m3)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi32::<4>(c), m4),
                        _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(h), m3)),
                    ),
                ];
                for (i, qi) in q.iter().enumerate() {
                    put_i(&mut p.q[64 * b + 32 * n + 8 * i + s], _mm512_sub_epi8(*qi, off));
                }
            }
        }
    }
}

/// Q8_0: per 32-block an f16 d and 32 signed bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_q8_0(r: &Gather, k: usize, p: &mut Panel) {
    for b in 0..k / 32 {
        let bb = b * 34;
        // SAFETY (all gathers here): inside block b (34 bytes).
        put_f(&mut p.sc[b], lo_f16(unsafe { r.at(bb) }));
        put_f(&mut p.off[b], _mm512_setzero_ps());
        for s in 0..8 {
            put_i(&mut p.q[8 * b + s], unsafe { r.at(bb + 2 + 4 * s) });
        }
    }
}

/// IQ4_XS: per 256-block an f16 d, 6-bit scales (−32) per 32, 4-bit indices into the IQ4_NL table.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack_iq4xs(r: &Gather, k: usize, p: &mut Panel) {
    const VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
    // SAFETY: VALUES is 16 readable bytes.
    let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(VALUES.as_ptr().cast()) });
    let m4 = _mm512_set1_epi32(0x0F0F_0F0F);
    for b in 0..k / 256 {
        let bb = b * 136;
        // SAFETY (all gathers here): inside block b.
        let w0 = unsafe { r.at(bb) };
        let d = lo_f16(w0);
        let sh = _mm512_srli_epi32::<16>(w0);
        let sl = unsafe { r.at(bb + 4) };
        for j in 0..8 {
            let lo = _mm512_and_si512(_mm512_srl_epi32(sl, _mm_cvtsi32_si128(4 * j as i32)), _mm512_set1_epi32(0xF));
            let hi = _mm512_and_si512(_mm512_srl_epi32(sh, _mm_cvtsi32_si128(2 * j as i32)), _mm512_set1_epi32(3));
            let ls = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi)), _mm512_set1_epi32(32));
            put_f(&mut p.sc[8 * b + j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(ls)));
            put_f(&mut p.off[8 * b + j], _mm512_setzero_ps());
            for s in 0..4 {
                let v = unsafe { r.at(bb + 8 + 16 * j + 4 * s) };
                put_i(&mut p.q[64 * b + 8 * j + s], _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4)));
                put_i(&mut p.q[64 * b + 8 * j + 4 + s], _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4)));
            }
        }
    }
}

/// `corr[g] = −128 · Σ q` over each group, per row (one `vpdpbusd` with unit bytes per word).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn finish_corr(p: &mut Panel) {
    let ones = _mm512_set1_epi8(1);
    let w = p.g / 4;
    for gi in 0..p.k / p.g {
        let mut s = _mm512_setzero_si512();
        for q in &p.q[gi * w..(gi + 1) * w] {
            s = _mm512_dpbusd_epi32(s, ones, get_i(q));
        }
        put_i(&mut p.corr[gi], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(s)));
    }
}

/// Dispatch on the panel's group size and offsets.
/// SAFETY (caller): the lengths checked in `panel_dot`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn panel_dot_g<const NT: usize>(p: &Panel, a: &[&ActRow], out: &mut [[f32; ROWS]]) {
    let a: [&ActRow; NT] = std::array::from_fn(|t| a[t]);
    // SAFETY: forwarded.
    let o = unsafe {
        match (p.g, p.has_off) {
            (32, false) => panel_dot_nt::<NT, 32, false>(p, a),
            (32, true) => panel_dot_nt::<NT, 32, true>(p, a),
            (16, false) => panel_dot_nt::<NT, 16, false>(p, a),
            _ => panel_dot_nt::<NT, 16, true>(p, a),
        }
    };
    out[..NT].copy_from_slice(&o);
}

/// The panel product for NT tokens: per group of G weights, G/4 `vpdpbusd` per token into
/// integer accumulators that start at `corr`, then one convert and one FMA with
/// `sc · d_a` (and one with `off · d_a·Σqa`). Each weight vector load serves NT tokens.
/// SAFETY (caller): every `a[t]` has ≥ k bytes in `qu`, ≥ k/32 scales and ≥ k/16 sums; the
/// panel's buffers cover k (what `panel_dot` checks).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn panel_dot_nt<const NT: usize, const G: usize, const OFF: bool>(p: &Panel, a: [&ActRow; NT]) -> [[f32; ROWS]; NT] {
    let au = a.map(|a| a.qu.as_ptr());
    let ad = a.map(|a| a.d.as_ptr());
    let ads = a.map(|a| if G == 32 { a.ds32.as_ptr() } else { a.ds16.as_ptr() });
    let mut facc = [_mm512_setzero_ps(); NT];
    for gi in 0..p.k / G {
        let mut iacc = [get_i(&p.corr[gi]); NT];
        for s in 0..G / 4 {
            let w = get_i(&p.q[gi * G / 4 + s]);
            for t in 0..NT {
                // SAFETY: gi·G + 4s + 4 ≤ k ≤ qu.len().
                let av = _mm512_set1_epi32(unsafe { au[t].add(gi * G + 4 * s).cast::<i32>().read_unaligned() });
                iacc[t] = _mm512_dpbusd_epi32(iacc[t], av, w);
            }
        }
        let sc = get_f(&p.sc[gi]);
        for t in 0..NT {
            // SAFETY: gi·G/32 < k/32 ≤ d.len().
            let s = _mm512_mul_ps(sc, _mm512_set1_ps(unsafe { *ad[t].add(gi * G / 32) }));
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[t]), s, facc[t]);
        }
        if OFF {
            let off = get_f(&p.off[gi]);
            for t in 0..NT {
                // SAFETY: gi < k/G ≤ the length of ds32 (G = 32) or ds16 (G = 16).
                facc[t] = _mm512_fmadd_ps(off, _mm512_set1_ps(unsafe { *ads[t].add(gi) }), facc[t]);
            }
        }
    }
    let mut out = [[0f32; ROWS]; NT];
    for t in 0..NT {
        // SAFETY: out[t] is 16 writable f32.
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), facc[t]) };
    }
    out
}
