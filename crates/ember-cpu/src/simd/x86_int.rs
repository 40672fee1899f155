//! The activation side of the x86 kernel bodies ([`super::x86`]), kept apart to keep that
//! file readable: the activation quantisers (per-32 and grouped scales, bit-exact with
//! [`crate::kernels::ActRow`]'s) and the single-token K-quant kernels that sum a whole
//! 256-weight block in integers on grouped rows. They use the helpers of `x86_kernels!`
//! (`k4_scale_bytes`, `k4_codes`, `ld_mask`, `q6k_codes`, `ld256`, `ldps`, `f16`, `hsum`), which invokes this macro.

/// The quantiser and integer K-quant kernel bodies for one x86 instruction set; `$feat` is its
/// target-feature list.
macro_rules! x86_int_kernels {
    ($feat:literal) => {
        /// Byte shuffles for [`dot_q4k_int`]: mask j spreads i16 element j over all sixteen
        /// i16 lanes (of a vector holding the eight sub-block weights in both 128-bit lanes).
        static K4_SELS: [[u8; 32]; 8] = {
            let mut t = [[0u8; 32]; 8];
            let mut j = 0;
            while j < 8 {
                let mut b = 0;
                while b < 32 {
                    t[j][b] = (2 * j + b % 2) as u8;
                    b += 1;
                }
                j += 1;
            }
            t
        };

        /// Byte shuffles for [`dot_q6k_int`]: for 32-block k of a 128-half, group 2k's weight
        /// over the low 128-bit lane and group 2k + 1's over the high one (i16 elements of a
        /// vector holding groups 0..7 or 8..15 in both lanes).
        static Q6K_SELS: [[u8; 32]; 4] = {
            let mut t = [[0u8; 32]; 4];
            let mut k = 0;
            while k < 4 {
                let mut b = 0;
                while b < 32 {
                    t[k][b] = (4 * k + 2 * (b / 16) + b % 2) as u8;
                    b += 1;
                }
                k += 1;
            }
            t
        };

        /// Single-token Q4_K (Q5_K with `Q5`) summed in integers per 256-block: sub-block j's
        /// product `Σ q·a` times its integer weight `sc_j · m32_j` ([`ActRow::m32`]) in i32
        /// lanes, one convert and one FMA with `d · d256` per block. The mins use the f32
        /// activation sums as in [`dot_q4k`]. No overflow: a `maddubs` i16 is at most
        /// 2·31·127 = 7874 (Q5_K), `sc·m` at most 63·32 = 2016 (`kernels::MAX_MULT`), so a
        /// `madd` lane at most 2·7874·2016 < 2^25 and a lane of the sum of 8 of them < 2^28.
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_q4k_int<const Q5: bool>(w: &[u8], a: &ActRow) -> f32 {
            let bs = if Q5 { 176 } else { 144 };
            let nb = w.len() / bs;
            assert!(
                a.q.len() >= 256 * nb && a.d256.len() >= nb && a.m32.len() >= 8 * nb && a.ds32.len() >= 8 * nb,
                "dot_q4k_int: activation row shorter than the weights"
            );
            let (aq, ad, am, ads) = (a.q.as_ptr(), a.d256.as_ptr(), a.m32.as_ptr(), a.ds32.as_ptr());
            // Opaque: the optimiser would otherwise turn each one-instruction byte shuffle of the
            // broadcast scales into an extract plus a cross-lane broadcast (two), and a per-call
            // copy of the masks costs a row of 512.
            let sels = std::hint::black_box(&K4_SELS);
            let mut acc = _mm256_setzero_ps();
            let mut accm = _mm256_setzero_ps();
            for (i, b) in w.chunks_exact(bs).enumerate() {
                let (all, dm) = k4_scale_bytes(b);
                let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(all)));
                // SAFETY: i < nb: 8i + 8 ≤ 8nb values of m32 and ds32, i < nb of d256 (asserted).
                let (m, ds, dd) = unsafe {
                    (_mm_loadu_si128(am.add(8 * i).cast()), _mm256_loadu_ps(ads.add(8 * i)), _mm256_set1_ps(_mm_cvtss_f32(dm) * *ad.add(i)))
                };
                accm = _mm256_fmadd_ps(_mm256_mul_ps(dmin, mn), ds, accm);
                let scm = _mm256_broadcastsi128_si256(_mm_mullo_epi16(_mm_cvtepu8_epi16(all), m));
                let mut hb = if Q5 { ld256(b, 16) } else { _mm256_setzero_si256() };
                let mut isum = [_mm256_setzero_si256(); 2];
                for p in 0..4 {
                    let (lo, hi) = k4_codes::<Q5>(b, p, &mut hb);
                    let base = 256 * i + 64 * p;
                    // SAFETY: base + 64 ≤ 256nb bytes of q (asserted).
                    let (q0, q1) = unsafe { (_mm256_loadu_si256(aq.add(base).cast()), _mm256_loadu_si256(aq.add(base + 32).cast())) };
                    let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, q0), _mm256_shuffle_epi8(scm, ld_mask(sels, 2 * p)));
                    let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, q1), _mm256_shuffle_epi8(scm, ld_mask(sels, 2 * p + 1)));
                    isum[0] = _mm256_add_epi32(isum[0], p0);
                    isum[1] = _mm256_add_epi32(isum[1], p1);
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum[0], isum[1])), dd, acc);
            }
            hsum(_mm256_sub_ps(acc, accm))
        }

        /// Single-token Q6_K summed in integers per 256-block, as [`dot_q4k_int`]: group g's
        /// product times `sc_g · m16_g`, less the codes' offset 32 as `32 · Σ_g sc_g·m16_g·s16_g`
        /// ([`ActRow::s16`]). No overflow: a `maddubs` i16 is at most 2·63·127 = 16002, |sc·m|
        /// at most 128·32 = 4096, so a `madd` lane at most 2·16002·4096 < 2^27 and a lane of
        /// the sum of 8 of them < 2^30; the offset lane at most 32·2·4096·2032 < 2^29.
        #[inline]
        #[target_feature(enable = $feat)]
        fn dot_q6k_int(w: &[u8], a: &ActRow) -> f32 {
            let nb = w.len() / 210;
            assert!(
                a.q.len() >= 256 * nb && a.d256.len() >= nb && a.m16.len() >= 16 * nb && a.s16.len() >= 16 * nb,
                "dot_q6k_int: activation row shorter than the weights"
            );
            let (aq, ad, am, asum) = (a.q.as_ptr(), a.d256.as_ptr(), a.m16.as_ptr(), a.s16.as_ptr());
            // Opaque, as in dot_q4k_int (masks described at Q6K_SELS).
            let sels = std::hint::black_box(&Q6K_SELS);
            let mut acc = _mm256_setzero_ps();
            for (i, b) in w.chunks_exact(210).enumerate() {
                let d = f16(b, 208);
                // SAFETY: i < nb: 16i + 16 ≤ 16nb values of m16 and s16, i < nb of d256
                // (asserted); `b` has 210 bytes, so 192..208 is readable.
                let (sc, m, sums, dd) = unsafe {
                    (
                        _mm_loadu_si128(b[192..208].as_ptr().cast()),
                        _mm256_loadu_si256(am.add(16 * i).cast()),
                        _mm256_loadu_si256(asum.add(16 * i).cast()),
                        _mm256_set1_ps(d * *ad.add(i)),
                    )
                };
                let scm = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc), m);
                // The offset 32 of every code: 32 · Σ_g (sc·m)_g · Σq_g.
                let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scm, sums));
                let halves = [_mm256_permute2x128_si256::<0x00>(scm, scm), _mm256_permute2x128_si256::<0x11>(scm, scm)];
                let mut isum = [_mm256_setzero_si256(); 2];
                for n in 0..2 {
                    let q = q6k_codes(b, n);
                    for (j, qj) in q.iter().enumerate() {
                        let base = 256 * i + 128 * n + 32 * j;
                        // SAFETY: base + 32 ≤ 256nb bytes of q (asserted).
                        let av = unsafe { _mm256_loadu_si256(aq.add(base).cast()) };
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qj, av), _mm256_shuffle_epi8(halves[n], ld_mask(sels, j)));
                        isum[j % 2] = _mm256_add_epi32(isum[j % 2], p);
                    }
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(isum[0], isum[1]), off)), dd, acc);
            }
            hsum(acc)
        }
        /// `f32::round` (half away from zero) on 8 lanes: trunc, plus ±1 where |frac| ≥ 0.5.
        #[inline]
        #[target_feature(enable = $feat)]
        fn round_away(y: __m256) -> __m256 {
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let sign = _mm256_set1_ps(-0.0);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
            let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
            let one = _mm256_or_ps(_mm256_and_ps(y, sign), _mm256_set1_ps(1.0));
            _mm256_add_ps(t, _mm256_and_ps(up, one))
        }

        /// The largest |x| of block `b` (32 values) of `x`.
        #[inline]
        #[target_feature(enable = $feat)]
        fn block_amax(x: &[f32], b: usize) -> f32 {
            let sign = _mm256_set1_ps(-0.0);
            let v = [ldps(x, 32 * b), ldps(x, 32 * b + 8), ldps(x, 32 * b + 16), ldps(x, 32 * b + 24)];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
        }

        #[target_feature(enable = $feat)]
        fn quantize(x: &[f32], out: &mut ActRow) {
            let nb = x.len() / 32;
            out.resize(nb, false);
            let sign = _mm256_set1_ps(-0.0);
            let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
            let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for b in 0..nb {
                let v = [ldps(x, 32 * b), ldps(x, 32 * b + 8), ldps(x, 32 * b + 16), ldps(x, 32 * b + 24)];
                let m = _mm256_max_ps(
                    _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
                );
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
                let d = amax / 127.0;
                let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
                let mut r = [_mm256_setzero_ps(); 4];
                for k in 0..4 {
                    r[k] = _mm256_min_ps(_mm256_max_ps(round_away(_mm256_mul_ps(v[k], id)), lo), hi);
                }
                let i = [_mm256_cvttps_epi32(r[0]), _mm256_cvttps_epi32(r[1]), _mm256_cvttps_epi32(r[2]), _mm256_cvttps_epi32(r[3])];
                let p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
                let p = _mm256_permutevar8x32_epi32(p, perm);
                let dst = &mut out.q[32 * b..32 * b + 32];
                // SAFETY: `dst` is 32 writable bytes; storeu has no alignment requirement.
                unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), p) };
                // Sums of integers below 2^24 are exact in f32.
                let s0 = hsum(_mm256_add_ps(r[0], r[1])) as i32;
                let s1 = hsum(_mm256_add_ps(r[2], r[3])) as i32;
                out.set_block(b, d, s0, s1);
            }
        }

        #[target_feature(enable = $feat)]
        fn quantize_grouped(x: &[f32], out: &mut ActRow) {
            let nb = x.len() / 32;
            out.resize(nb, true);
            let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
            let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for g in 0..nb.div_ceil(8) {
                let blocks = 8 * g..(8 * g + 8).min(nb);
                let mut amax = [0f32; 8];
                for b in blocks.clone() {
                    amax[b - 8 * g] = block_amax(x, b);
                }
                let top = amax.iter().fold(0f32, |m, &v| m.max(v));
                let unit = top / 127.0 / kernels::MAX_MULT as f32;
                out.d256[g] = unit;
                for b in blocks {
                    let m = kernels::block_mult(amax[b - 8 * g], top);
                    let db = unit * m as f32;
                    let idb = _mm256_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
                    let v = [ldps(x, 32 * b), ldps(x, 32 * b + 8), ldps(x, 32 * b + 16), ldps(x, 32 * b + 24)];
                    let mut r = [_mm256_setzero_ps(); 4];
                    for k in 0..4 {
                        r[k] = _mm256_min_ps(_mm256_max_ps(round_away(_mm256_mul_ps(v[k], idb)), lo), hi);
                    }
                    let i = [_mm256_cvttps_epi32(r[0]), _mm256_cvttps_epi32(r[1]), _mm256_cvttps_epi32(r[2]), _mm256_cvttps_epi32(r[3])];
                    let p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
                    let p = _mm256_permutevar8x32_epi32(p, perm);
                    let dst = &mut out.q[32 * b..32 * b + 32];
                    // SAFETY: `dst` is 32 writable bytes; storeu has no alignment requirement.
                    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), p) };
                    // Sums of integers below 2^24 are exact in f32.
                    let s0 = hsum(_mm256_add_ps(r[0], r[1])) as i32;
                    let s1 = hsum(_mm256_add_ps(r[2], r[3])) as i32;
                    out.set_block(b, db, s0, s1);
                    out.set_mult(b, m);
                }
            }
        }
    };
}
pub(crate) use x86_int_kernels;
