//! The x86 kernel bodies, written once as a macro for both x86 instruction sets: [`super::avx2`]
//! instantiates it with the `vpmaddubsw` product, [`super::avx512`] with the VNNI one. The
//! decode dots (one weight row against 1–4 activation rows) and the float helpers live here;
//! the activation quantisers and the integer K-quant dots in `x86_int.rs`, the prompt kernels
//! in `avx2/prompt.rs` and `avx512.rs`.

/// e^x as the kernels' `exp8` (and the AVX-512 decode's `exp16`) compute it, Cephes expf: the
/// input clamped to [EXP_LO, EXP_HI] (below EXP_LO gives 0), x = n·ln2 + r with ln2 split in
/// two for precision, then this degree-6 polynomial in r (highest power first).
pub(crate) const EXP_HI: f32 = 88.3;
pub(crate) const EXP_LO: f32 = -87.3;
pub(crate) const EXP_LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
pub(crate) const EXP_POLY: [f32; 6] = [1.987_569_2e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// The kernel bodies for one x86 instruction set: `$feat` is its target-feature list and the
/// invoking module provides `fn dp(u8 x32, i8 x32) -> i32 x8` with the same features.
macro_rules! x86_kernels {
    ($token:ident, $feat:literal $(, { $($extra:item)* })?) => {
        use ember_gguf::GgmlType;

        use crate::kernels::{self, ActRow};

        impl Kernels for $token {
            #[inline]
            fn dot_q<const NT: usize>(self, ty: GgmlType, w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
                if NT == 1 {
                    // SAFETY: a token exists only if the CPU has every feature in `$feat` (new()).
                    if let Some(v) = unsafe { dot1_wide(ty, w, a[0]) } {
                        let mut out = [0f32; NT];
                        out[0] = v;
                        return out;
                    }
                }
                // SAFETY: as above.
                unsafe { dot_q::<NT>(ty, w, a) }
            }

            #[inline]
            fn dot_rows(self, ty: GgmlType, rows: &[u8], rb: usize, a: &ActRow, out: &mut [f32], pf: impl FnMut(usize)) {
                // SAFETY: as above.
                unsafe { dot_rows(ty, rows, rb, a, out, pf) }
            }

            #[inline]
            fn dot_float<const NT: usize>(self, ty: GgmlType, w: &[u8], x: [&[f32]; NT]) -> [f32; NT] {
                // SAFETY: as above.
                unsafe { dot_float::<NT>(ty, w, x) }
            }

            #[inline]
            fn quantize(self, x: &[f32], out: &mut ActRow) {
                // SAFETY: as above.
                unsafe { quantize(x, out) }
            }

            #[inline]
            fn quantize_grouped(self, x: &[f32], out: &mut ActRow) {
                // SAFETY: as above.
                unsafe { quantize_grouped(x, out) }
            }

            #[inline]
            fn wants_grouped(self) -> bool {
                INT_DOTS
            }

            #[inline]
            fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
                // SAFETY: as above.
                unsafe { dot_f32(a, b) }
            }

            #[inline]
            fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
                // SAFETY: as above.
                unsafe { axpy(a, x, y) }
            }

            #[inline]
            fn mul_add(self, a: &[f32], x: &[f32], y: &mut [f32]) {
                // SAFETY: as above.
                unsafe { mul_add(a, x, y) }
            }

            #[inline]
            fn exp_sum(self, x: &mut [f32], sub: f32) -> f32 {
                // SAFETY: as above.
                unsafe { exp_sum(x, sub) }
            }

            #[inline]
            fn silu(self, x: &mut [f32]) {
                // SAFETY: as above.
                unsafe { silu(x) }
            }

            #[inline]
            fn f16_to_f32(self, src: &[u8], dst: &mut [f32]) {
                // SAFETY: as above.
                unsafe { f16_to_f32(src, dst) }
            }

            #[inline]
            fn q8_0_to_f32(self, src: &[u8], dst: &mut [f32]) {
                // SAFETY: as above.
                unsafe { q8_0_to_f32(src, dst) }
            }

            #[inline]
            fn delta_step(self, st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]) {
                if k.len() % 8 != 0 {
                    return super::delta_step_scalar(st, q, k, v, decay, beta, o);
                }
                // SAFETY: as above.
                unsafe { delta_step(st, q, k, v, decay, beta, o) }
            }

            $($($extra)*)?
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn stps(x: &mut [f32], at: usize, v: __m256) {
            let s = &mut x[at..at + 8];
            // SAFETY: `s` is 8 writable f32; storeu has no alignment requirement.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), v) }
        }

        #[target_feature(enable = $feat)]
        fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
            let n = x.len().min(y.len());
            let av = _mm256_set1_ps(a);
            let mut i = 0;
            while i + 8 <= n {
                let r = _mm256_fmadd_ps(av, ldps(x, i), ldps(y, i));
                stps(y, i, r);
                i += 8;
            }
            for j in i..n {
                y[j] += a * x[j];
            }
        }

        #[target_feature(enable = $feat)]
        fn mul_add(a: &[f32], x: &[f32], y: &mut [f32]) {
            let n = a.len().min(x.len()).min(y.len());
            let mut i = 0;
            while i + 8 <= n {
                let r = _mm256_fmadd_ps(ldps(a, i), ldps(x, i), ldps(y, i));
                stps(y, i, r);
                i += 8;
            }
            for j in i..n {
                y[j] += a[j] * x[j];
            }
        }

        /// e^x for x ≤ 88.3 (Cephes expf: x = n·ln2 + r, degree-6 polynomial in r, 2^n from the
        /// exponent bits); x below −87.3 gives 0.
        #[inline]
        #[target_feature(enable = $feat)]
        fn exp8(x: __m256) -> __m256 {
            use crate::simd::x86::{EXP_HI, EXP_LN2, EXP_LO, EXP_POLY};
            let x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
            let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
            let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
            let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
            ));
            let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[0]), x);
            let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[1]), r);
            let mut p = _mm256_set1_ps(EXP_POLY[0]);
            for c in &EXP_POLY[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
            }
            let r2 = _mm256_mul_ps(r, r);
            let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127))));
            _mm256_andnot_ps(under, _mm256_mul_ps(y, pow2))
        }

        #[target_feature(enable = $feat)]
        fn exp_sum(x: &mut [f32], sub: f32) -> f32 {
            let n = x.len();
            let sv = _mm256_set1_ps(sub);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= n {
                let e = exp8(_mm256_sub_ps(ldps(x, i), sv));
                stps(x, i, e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            let mut tail = 0f32;
            if i < n {
                let mut buf = [0f32; 8];
                buf[..n - i].copy_from_slice(&x[i..]);
                let e = exp8(_mm256_sub_ps(ldps(&buf, 0), sv));
                stps(&mut buf, 0, e);
                x[i..].copy_from_slice(&buf[..n - i]);
                tail = buf[..n - i].iter().sum();
            }
            hsum(acc) + tail
        }

        #[target_feature(enable = $feat)]
        fn silu(x: &mut [f32]) {
            let n = x.len();
            let one = _mm256_set1_ps(1.0);
            let neg = _mm256_set1_ps(-0.0);
            let mut i = 0;
            while i + 8 <= n {
                let v = ldps(x, i);
                stps(x, i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_xor_ps(v, neg)))));
                i += 8;
            }
            for v in &mut x[i..] {
                *v = ember_ops::reference::silu(*v);
            }
        }

        /// Eight int8 lanes at a time: sign-extended to i32, converted, scaled by the block's d
        /// (the same product as the scalar form, so the same values).
        #[target_feature(enable = $feat)]
        fn q8_0_to_f32(src: &[u8], dst: &mut [f32]) {
            for (b, o) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
                let d = _mm256_set1_ps(f16(b, 0));
                for j in 0..4 {
                    let q = &b[2 + 8 * j..10 + 8 * j];
                    // SAFETY: `q` is 8 readable bytes; loadl reads exactly 8, unaligned.
                    let q = unsafe { _mm_loadl_epi64(q.as_ptr().cast()) };
                    stps(o, 8 * j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
                }
            }
        }

        #[target_feature(enable = $feat)]
        fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
            let n = dst.len().min(src.len() / 2);
            let mut i = 0;
            while i + 8 <= n {
                stps(dst, i, _mm256_cvtph_ps(ld128(src, 2 * i)));
                i += 8;
            }
            for j in i..n {
                dst[j] = f16(src, 2 * j);
            }
        }

        /// [`super::delta_step_scalar`] with each state row read and written once.
        #[target_feature(enable = $feat)]
        fn delta_step(st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]) {
            let dk = k.len();
            let dc = _mm256_set1_ps(decay);
            for (jv, row) in st.chunks_exact_mut(dk).enumerate() {
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut i = 0;
                while i + 16 <= dk {
                    a0 = _mm256_fmadd_ps(ldps(row, i), ldps(k, i), a0);
                    a1 = _mm256_fmadd_ps(ldps(row, i + 8), ldps(k, i + 8), a1);
                    i += 16;
                }
                if i < dk {
                    a0 = _mm256_fmadd_ps(ldps(row, i), ldps(k, i), a0);
                }
                let r = decay * hsum(_mm256_add_ps(a0, a1));
                let dv = _mm256_set1_ps(beta * (v[jv] - r));
                let mut acc = _mm256_setzero_ps();
                let mut i = 0;
                while i < dk {
                    let nr = _mm256_fmadd_ps(ldps(k, i), dv, _mm256_mul_ps(ldps(row, i), dc));
                    stps(row, i, nr);
                    acc = _mm256_fmadd_ps(nr, ldps(q, i), acc);
                    i += 8;
                }
                o[jv] = hsum(acc);
            }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn ld256(b: &[u8], at: usize) -> __m256i {
            let s = &b[at..at + 32];
            // SAFETY: `s` is 32 readable bytes; loadu has no alignment requirement.
            unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn ld256i(b: &[i8], at: usize) -> __m256i {
            let s = &b[at..at + 32];
            // SAFETY: `s` is 32 readable bytes; loadu has no alignment requirement.
            unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn ld128(b: &[u8], at: usize) -> __m128i {
            let s = &b[at..at + 16];
            // SAFETY: `s` is 16 readable bytes; loadu has no alignment requirement.
            unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn ldps(x: &[f32], at: usize) -> __m256 {
            let s = &x[at..at + 8];
            // SAFETY: `s` is 8 readable f32; loadu has no alignment requirement.
            unsafe { _mm256_loadu_ps(s.as_ptr()) }
        }

        /// 8 floats of a float weight row starting at element `at`, as f32.
        #[inline]
        #[target_feature(enable = $feat)]
        fn ldw<const TY: u8>(w: &[u8], at: usize) -> __m256 {
            match TY {
                F32 => {
                    let s = &w[4 * at..4 * at + 32];
                    // SAFETY: `s` is 32 readable bytes (8 f32); loadu is unaligned.
                    unsafe { _mm256_loadu_ps(s.as_ptr().cast()) }
                }
                F16 => _mm256_cvtph_ps(ld128(w, 2 * at)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(w, 2 * at)))),
            }
        }

        const F32: u8 = 0;
        const F16: u8 = 1;
        const BF16: u8 = 2;

        #[inline]
        #[target_feature(enable = $feat)]
        fn f16(b: &[u8], at: usize) -> f32 {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([b[at], b[at + 1]]) as i32)))
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn hsum(v: __m256) -> f32 {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }

        /// Independent accumulators per token: with one token, the FMA latency (4 cycles)
        /// rather than the loads would bound a single chain, so steps rotate over four; with
        /// several tokens the tokens' own chains overlap and one each keeps registers free.
        const CHAINS: usize = 4;

        /// The chain of step `i`.
        #[inline(always)]
        const fn chain<const NT: usize>(i: usize) -> usize {
            if NT == 1 { i % CHAINS } else { 0 }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn sum_chains(a: [__m256; CHAINS]) -> __m256 {
            _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))
        }

        /// Lane `j` of `v` in every lane.
        #[inline]
        #[target_feature(enable = $feat)]
        fn lane(v: __m256, j: usize) -> __m256 {
            _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j as i32))
        }

        /// Eight i8 as f32.
        #[inline]
        #[target_feature(enable = $feat)]
        fn cvt8i(b: &[u8]) -> __m256 {
            let a: [u8; 8] = [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]];
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(a))))
        }

        /// The header of a Q4_K / Q5_K block in vector registers: the eight 6-bit scales and mins as
        /// f32, and d, dmin broadcast (gguf-format.md §5; the unpacking of `kernels::scale_min_k4`, done
        /// with byte shuffles instead of ~50 scalar instructions per block).
        #[inline]
        #[target_feature(enable = $feat)]
        fn k4_header(b: &[u8]) -> (__m256, __m256, __m256, __m256) {
            let (all, dm) = k4_scale_bytes(b);
            let d = _mm256_broadcastss_ps(dm);
            let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(all));
            let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(all)));
            (sc, mn, d, dmin)
        }

        /// The eight scales and eight mins of a Q4_K / Q5_K block as bytes (sc0..7, mn0..7),
        /// and (d, dmin) in lanes 0 and 1.
        #[inline]
        #[target_feature(enable = $feat)]
        fn k4_scale_bytes(b: &[u8]) -> (__m128i, __m128) {
            let h = &b[..16];
            // SAFETY: `h` is 16 readable bytes.
            let raw = unsafe { _mm_loadu_si128(h.as_ptr().cast()) }; // d, dmin, s[0..12]
            let dm = _mm_cvtph_ps(raw);
            // p = [s0..s3, s8..s11, s4..s7, s8..s11]: the low parts of sc0..3, sc4..7, mn0..3, mn4..7.
            let p = _mm_shuffle_epi8(raw, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
            let low = _mm_and_si128(p, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
            let low = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16::<4>(p), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
            // The top two bits of sc4..7 come from s0..s3, of mn4..7 from s4..s7.
            let q = _mm_shuffle_epi8(raw, _mm_setr_epi8(-128, -128, -128, -128, 4, 5, 6, 7, -128, -128, -128, -128, 8, 9, 10, 11));
            let high = _mm_slli_epi16::<4>(_mm_and_si128(_mm_srli_epi16::<6>(q), _mm_set1_epi8(3)));
            (_mm_or_si128(low, high), dm)
        }

        /// The codes of sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles) of a Q4_K block,
        /// or of a Q5_K block with `Q5`, whose fifth bits come from `hb` (its `qh` bytes, loaded
        /// by the caller and shifted on by two bits per call: bit 2p of qh is the fifth bit of
        /// sub-block 2p, bit 2p+1 of 2p+1).
        #[inline]
        #[target_feature(enable = $feat)]
        fn k4_codes<const Q5: bool>(b: &[u8], p: usize, hb: &mut __m256i) -> (__m256i, __m256i) {
            let m4 = _mm256_set1_epi8(0x0F);
            let q = ld256(b, if Q5 { 48 } else { 16 } + 32 * p);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if Q5 {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(*hb, _mm256_set1_epi8(1))));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(*hb, _mm256_set1_epi8(2))));
                *hb = _mm256_srli_epi16::<2>(*hb);
            }
            (lo, hi)
        }

        /// A 32-byte shuffle mask from a table, read through a reference the caller made opaque
        /// (`black_box`) so the optimiser keeps the one-instruction byte shuffle.
        #[inline]
        #[target_feature(enable = $feat)]
        fn ld_mask(t: &[[u8; 32]], j: usize) -> __m256i {
            // SAFETY: t[j] is 32 readable bytes; loadu has no alignment requirement.
            unsafe { _mm256_loadu_si256(t[j].as_ptr().cast()) }
        }

        #[target_feature(enable = $feat)]
        fn dot_q<const NT: usize>(ty: GgmlType, w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
            if NT == 1 && INT_DOTS && a[0].is_grouped() {
                match ty {
                    GgmlType::Q4K => return [dot_q4k_int::<false>(w, a[0]); NT],
                    GgmlType::Q5K => return [dot_q4k_int::<true>(w, a[0]); NT],
                    GgmlType::Q6K => return [dot_q6k_int(w, a[0]); NT],
                    _ => {}
                }
            }
            match ty {
                GgmlType::Q4K => dot_q4k::<NT, false>(w, a),
                GgmlType::Q5K => dot_q4k::<NT, true>(w, a),
                GgmlType::Q6K => dot_q6k::<NT>(w, a),
                GgmlType::Q8_0 => dot_q8_0::<NT>(w, a),
                GgmlType::IQ4XS => dot_iq4xs::<NT>(w, a),
                _ => {
                    let mut out = [0f32; NT];
                    for t in 0..NT {
                        out[t] = kernels::dot(ty, w, a[t]);
                    }
                    out
                }
            }
        }

        /// [`Kernels::dot_rows`]: the type matched once, each row's kernel inlined into the loop.
        /// With 1024-wide rows (4 Q4_K blocks) the per-row call and dispatch were about a fifth
        /// of the time.
        #[target_feature(enable = $feat)]
        fn dot_rows(ty: GgmlType, rows: &[u8], rb: usize, a: &ActRow, out: &mut [f32], mut pf: impl FnMut(usize)) {
            assert!(rows.len() >= out.len() * rb, "dot_rows: {} rows of {rb} bytes in {}", out.len(), rows.len());
            if has_dot1_wide(ty) {
                // SAFETY: this function runs only where the CPU has `$feat` (its callers hold a
                // token); `has_dot1_wide` says dot1_wide answers (Some) for this type.
                return each_row(rows, rb, out, &mut pf, |r| unsafe { dot1_wide(ty, r, a) }.unwrap_or_default());
            }
            match ty {
                GgmlType::Q4K if INT_DOTS && a.is_grouped() => each_row(rows, rb, out, &mut pf, |r| dot_q4k_int::<false>(r, a)),
                GgmlType::Q5K if INT_DOTS && a.is_grouped() => each_row(rows, rb, out, &mut pf, |r| dot_q4k_int::<true>(r, a)),
                GgmlType::Q6K if INT_DOTS && a.is_grouped() => each_row(rows, rb, out, &mut pf, |r| dot_q6k_int(r, a)),
                GgmlType::Q4K => each_row(rows, rb, out, &mut pf, |r| dot_q4k::<1, false>(r, [a])[0]),
                GgmlType::Q5K => each_row(rows, rb, out, &mut pf, |r| dot_q4k::<1, true>(r, [a])[0]),
                GgmlType::Q6K => each_row(rows, rb, out, &mut pf, |r| dot_q6k::<1>(r, [a])[0]),
                GgmlType::Q8_0 => each_row(rows, rb, out, &mut pf, |r| dot_q8_0::<1>(r, [a])[0]),
                _ => each_row(rows, rb, out, &mut pf, |r| dot_q::<1>(ty, r, [a])[0]),
            }
        }

        /// The loop of [`dot_rows`], inlined into it with each type's kernel.
        #[inline(always)]
        fn each_row(rows: &[u8], rb: usize, out: &mut [f32], pf: &mut impl FnMut(usize), f: impl Fn(&[u8]) -> f32) {
            for (j, (row, o)) in rows.chunks_exact(rb).zip(out.iter_mut()).enumerate() {
                pf(j);
                *o = f(row);
            }
        }

        /// Q4_K (and Q5_K with `Q5`): 8 sub-blocks of 32 with 6-bit scale and min.
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_q4k<const NT: usize, const Q5: bool>(w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
            let bs = if Q5 { 176 } else { 144 };
            let nb = w.len() / bs;
            for a in &a {
                assert!(a.q.len() >= 256 * nb && a.d.len() >= 8 * nb && a.ds32.len() >= 8 * nb, "dot_q4k: activation row shorter than the weights");
            }
            // Activations through pointers (checked above): slice indexing re-loaded each
            // row's slices and checked bounds at every load.
            let (aq, ad, ads) = (a.map(|a| a.q.as_ptr()), a.map(|a| a.d.as_ptr()), a.map(|a| a.ds32.as_ptr()));
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; NT];
            let mut accm = [_mm256_setzero_ps(); NT];
            for (i, b) in w.chunks_exact(bs).enumerate() {
                let (sc, mn, d, dmin) = k4_header(b);
                let (scv, mnv) = (_mm256_mul_ps(d, sc), _mm256_mul_ps(dmin, mn));
                let mut s = [_mm256_setzero_ps(); NT];
                for t in 0..NT {
                    // SAFETY: i < nb, so 8i + 8 ≤ 8nb values of d and ds32 (asserted).
                    let (d, ds) = unsafe { (_mm256_loadu_ps(ad[t].add(8 * i)), _mm256_loadu_ps(ads[t].add(8 * i))) };
                    s[t] = _mm256_mul_ps(scv, d);
                    accm[t] = _mm256_fmadd_ps(mnv, ds, accm[t]);
                }
                let mut hb = if Q5 { ld256(b, 16) } else { _mm256_setzero_si256() };
                for p in 0..4 {
                    let (lo, hi) = k4_codes::<Q5>(b, p, &mut hb);
                    let base = 256 * i + 64 * p;
                    for t in 0..NT {
                        // SAFETY: base + 64 ≤ 256nb bytes of q (asserted).
                        let (q0, q1) = unsafe { (_mm256_loadu_si256(aq[t].add(base).cast()), _mm256_loadu_si256(aq[t].add(base + 32).cast())) };
                        let p0 = _mm256_cvtepi32_ps(dp(lo, q0));
                        let p1 = _mm256_cvtepi32_ps(dp(hi, q1));
                        let (c0, c1) = (chain::<NT>(2 * p), chain::<NT>(2 * p + 1));
                        acc[t][c0] = _mm256_fmadd_ps(p0, lane(s[t], 2 * p), acc[t][c0]);
                        acc[t][c1] = _mm256_fmadd_ps(p1, lane(s[t], 2 * p + 1), acc[t][c1]);
                    }
                }
            }
            let mut out = [0f32; NT];
            for t in 0..NT {
                out[t] = hsum(sum_chains(acc[t])) - hsum(accm[t]);
            }
            out
        }

        // The activation quantisers and the integer-summing single-token K-quant kernels.
        super::x86_int::x86_int_kernels!($feat);

        /// The 128 6-bit codes (0..63) of half `n` of a Q6_K block, as four vectors of 32:
        /// `q[j]` holds weights 128n + 32j .. 128n + 32j + 32.
        #[inline]
        #[target_feature(enable = $feat)]
        fn q6k_codes(b: &[u8], n: usize) -> [__m256i; 4] {
            let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
            let ql0 = ld256(b, 64 * n);
            let ql1 = ld256(b, 64 * n + 32);
            let qh = ld256(b, 128 + 32 * n);
            let hi = |s: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(s, m3));
            [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), hi(qh)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), hi(_mm256_srli_epi16::<2>(qh))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), hi(_mm256_srli_epi16::<4>(qh))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), hi(_mm256_srli_epi16::<6>(qh))),
            ]
        }

        /// Q6_K: 16 groups of 16 with i8 scales; codes 0..63 with offset 32 (folded into ds16).
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_q6k<const NT: usize>(w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
            let idx_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            let idx_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            let nb = w.len() / 210;
            for a in &a {
                assert!(a.q.len() >= 256 * nb && a.d.len() >= 8 * nb && a.ds16.len() >= 16 * nb, "dot_q6k: activation row shorter than the weights");
            }
            // Activations through pointers (checked above), as in dot_q4k.
            let (aq, ad, ads) = (a.map(|a| a.q.as_ptr()), a.map(|a| a.d.as_ptr()), a.map(|a| a.ds16.as_ptr()));
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; NT];
            let mut accm = [_mm256_setzero_ps(); NT];
            for (i, b) in w.chunks_exact(210).enumerate() {
                let d = _mm256_set1_ps(f16(b, 208));
                let sc = [_mm256_mul_ps(d, cvt8i(&b[192..200])), _mm256_mul_ps(d, cvt8i(&b[200..208]))];
                // Per token: group scale times the activation scale of its 32-block.
                let mut s = [[_mm256_setzero_ps(); 2]; NT];
                for t in 0..NT {
                    // SAFETY: i < nb: 8i + 8 ≤ 8nb values of d, 16i + 16 ≤ 16nb of ds16 (asserted).
                    let (adv, ds0, ds1) =
                        unsafe { (_mm256_loadu_ps(ad[t].add(8 * i)), _mm256_loadu_ps(ads[t].add(16 * i)), _mm256_loadu_ps(ads[t].add(16 * i + 8))) };
                    s[t][0] = _mm256_mul_ps(sc[0], _mm256_permutevar8x32_ps(adv, idx_lo));
                    s[t][1] = _mm256_mul_ps(sc[1], _mm256_permutevar8x32_ps(adv, idx_hi));
                    accm[t] = _mm256_fmadd_ps(sc[0], ds0, accm[t]);
                    accm[t] = _mm256_fmadd_ps(sc[1], ds1, accm[t]);
                }
                for n in 0..2 {
                    let q = q6k_codes(b, n);
                    for (j, qj) in q.iter().enumerate() {
                        let base = 256 * i + 128 * n + 32 * j;
                        let j2 = 2 * j as i32;
                        let sel = _mm256_setr_epi32(j2, j2, j2, j2, j2 + 1, j2 + 1, j2 + 1, j2 + 1);
                        for t in 0..NT {
                            // SAFETY: base + 32 ≤ 256nb bytes of q (asserted).
                            let p = _mm256_cvtepi32_ps(dp(*qj, unsafe { _mm256_loadu_si256(aq[t].add(base).cast()) }));
                            let c = chain::<NT>(j);
                            acc[t][c] = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(s[t][n], sel), acc[t][c]);
                        }
                    }
                }
            }
            let mut out = [0f32; NT];
            for t in 0..NT {
                out[t] = hsum(sum_chains(acc[t])) - 32.0 * hsum(accm[t]);
            }
            out
        }

        /// Q8_0: 32 signed bytes and an f16 scale per block. Reads through pointers after one
        /// length check per call: with slice indexing, each 32-weight block re-loaded the
        /// activation slices and checked four bounds, more instructions than the product.
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_q8_0<const NT: usize>(w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
            let n_blocks = w.len() / 34;
            for a in &a {
                assert!(a.q.len() >= 32 * n_blocks && a.d.len() >= n_blocks, "dot_q8_0: activation row shorter than the weights");
            }
            let (wp, aq, ad) = (w.as_ptr(), a.map(|a| a.q.as_ptr()), a.map(|a| a.d.as_ptr()));
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; NT];
            // Eight blocks per step with their scales converted and multiplied as one vector
            // (per block, the scalar f16 convert, multiply and broadcast were a third of the
            // work); block j + u into chain u % 4 (for NT = 1), as in the four-block tail.
            let mut j = 0;
            while j + 8 <= n_blocks {
                // SAFETY: j + 8 ≤ n_blocks: bytes 34(j+u).. + 34 (u < 8) are in `w`, activations
                // 32(j+u).. + 32 and scales j..j + 8 in every `a[t]` (asserted above); loadu and
                // read_unaligned have no alignment requirement.
                unsafe {
                    let h = |u: usize| wp.add(34 * (j + u)).cast::<u16>().read_unaligned() as i16;
                    let dv = _mm256_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7)));
                    let mut sa = [[0f32; 8]; NT];
                    for t in 0..NT {
                        _mm256_storeu_ps(sa[t].as_mut_ptr(), _mm256_mul_ps(dv, _mm256_loadu_ps(ad[t].add(j))));
                    }
                    for u in 0..8 {
                        let q = _mm256_loadu_si256(wp.add(34 * (j + u) + 2).cast());
                        let qu = _mm256_abs_epi8(q);
                        let c = chain::<NT>(u % 4);
                        for t in 0..NT {
                            let sgn = _mm256_sign_epi8(_mm256_loadu_si256(aq[t].add(32 * (j + u)).cast()), q);
                            let p = _mm256_cvtepi32_ps(dp(qu, sgn));
                            acc[t][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(sa[t][u]), acc[t][c]);
                        }
                    }
                }
                j += 8;
            }
            while j < n_blocks {
                for u in 0..4.min(n_blocks - j) {
                    // SAFETY: j + u < n_blocks: bytes 34(j+u).. + 34 are in `w`, activations
                    // 32(j+u).. + 32 and scale j + u in every `a[t]` (asserted above); loadu
                    // has no alignment requirement.
                    unsafe {
                        let b = wp.add(34 * (j + u));
                        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(b.cast::<u16>().read_unaligned() as i32)));
                        let q = _mm256_loadu_si256(b.add(2).cast());
                        let qu = _mm256_abs_epi8(q);
                        let c = chain::<NT>(u);
                        for t in 0..NT {
                            let sgn = _mm256_sign_epi8(_mm256_loadu_si256(aq[t].add(32 * (j + u)).cast()), q);
                            let p = _mm256_cvtepi32_ps(dp(qu, sgn));
                            acc[t][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * *ad[t].add(j + u)), acc[t][c]);
                        }
                    }
                }
                j += 4;
            }
            let mut out = [0f32; NT];
            for t in 0..NT {
                out[t] = hsum(sum_chains(acc[t]));
            }
            out
        }

        /// IQ4_XS: 8 sub-blocks of 32 non-linear 4-bit codes with 6-bit scales.
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_iq4xs<const NT: usize>(w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
            let table =
                _mm256_broadcastsi128_si256(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
            let m4 = _mm256_set1_epi8(0x0F);
            let mut acc = [[_mm256_setzero_ps(); CHAINS]; NT];
            for (i, b) in w.chunks_exact(136).enumerate() {
                let d = f16(b, 0);
                let sh = u16::from_le_bytes([b[2], b[3]]);
                let mut sc = [0f32; 8];
                for (sub, v) in sc.iter_mut().enumerate() {
                    let ls = ((b[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) as i32 | ((((sh >> (2 * sub)) & 3) as i32) << 4);
                    *v = d * (ls - 32) as f32;
                }
                let scv = ldps(&sc, 0);
                let mut s = [_mm256_setzero_ps(); NT];
                for t in 0..NT {
                    s[t] = _mm256_mul_ps(scv, ldps(&a[t].d, 8 * i));
                }
                for sub in 0..8 {
                    let q = ld128(b, 8 + 16 * sub);
                    let idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4);
                    let v = _mm256_shuffle_epi8(table, idx);
                    let u = _mm256_abs_epi8(v);
                    for t in 0..NT {
                        let sgn = _mm256_sign_epi8(ld256i(&a[t].q, 256 * i + 32 * sub), v);
                        let p = _mm256_cvtepi32_ps(dp(u, sgn));
                        let c = chain::<NT>(sub);
                        acc[t][c] = _mm256_fmadd_ps(p, lane(s[t], sub), acc[t][c]);
                    }
                }
            }
            let mut out = [0f32; NT];
            for t in 0..NT {
                out[t] = hsum(sum_chains(acc[t]));
            }
            out
        }

        #[target_feature(enable = $feat)]
        fn dot_float<const NT: usize>(ty: GgmlType, w: &[u8], x: [&[f32]; NT]) -> [f32; NT] {
            match ty {
                GgmlType::F32 => dot_float_t::<F32, NT>(w, x),
                GgmlType::F16 => dot_float_t::<F16, NT>(w, x),
                _ => dot_float_t::<BF16, NT>(w, x),
            }
        }

        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_float_t<const TY: u8, const NT: usize>(w: &[u8], x: [&[f32]; NT]) -> [f32; NT] {
            let n = x[0].len();
            let mut acc = [[_mm256_setzero_ps(); 2]; NT];
            let mut i = 0;
            while i + 16 <= n {
                let (w0, w1) = (ldw::<TY>(w, i), ldw::<TY>(w, i + 8));
                for t in 0..NT {
                    acc[t][0] = _mm256_fmadd_ps(w0, ldps(x[t], i), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(w1, ldps(x[t], i + 8), acc[t][1]);
                }
                i += 16;
            }
            if i + 8 <= n {
                let w0 = ldw::<TY>(w, i);
                for t in 0..NT {
                    acc[t][0] = _mm256_fmadd_ps(w0, ldps(x[t], i), acc[t][0]);
                }
                i += 8;
            }
            let ty = match TY {
                F32 => GgmlType::F32,
                F16 => GgmlType::F16,
                _ => GgmlType::BF16,
            };
            let mut out = [0f32; NT];
            for t in 0..NT {
                let mut tail = 0f32;
                for j in i..n {
                    tail += super::float_at(ty, w, j) * x[t][j];
                }
                out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + tail;
            }
            out
        }

        #[target_feature(enable = $feat)]
        fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (l, v) in acc.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(ldps(a, i + 8 * l), ldps(b, i + 8 * l), *v);
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(ldps(a, i), ldps(b, i), acc[0]);
                i += 8;
            }
            let mut tail = 0f32;
            for j in i..n {
                tail += a[j] * b[j];
            }
            hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + tail
        }
    };
}
pub(crate) use x86_kernels;
