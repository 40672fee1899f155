//! AVX2 + FMA + F16C: the kernel token, its `dp` product, the x86 kernel bodies of
//! [`super::x86`] instantiated with them, and the panel, attention and delta-rule glue for the
//! prompt kernels in `avx2/prompt.rs`.
//!
//! Every quantised format is a 32-weight block of small integers: the integer product of a
//! block with 32 activation bytes is one `dp` (u8 × i8, summed in groups of four into eight
//! i32 lanes), converted to f32 and scaled by `d_w · d_a` of the block with one FMA. Unsigned
//! weight codes go straight into `dp` (Q4_K, Q5_K, Q6_K with their offsets folded into the
//! per-16 activation sums `ds16`/`ds32`); signed ones (Q8_0, IQ4_XS) use |w| and sign(a, w).

use std::arch::x86_64::*;

use super::x86::x86_kernels;
use super::{AttnIo, DeltaIo, Kernels};
use crate::panel::{Panel, ROWS};

mod prompt;
use prompt::*;

/// The AVX2 kernel token: exists only on CPUs with AVX2, FMA and F16C.
#[derive(Debug, Clone, Copy)]
pub struct Avx2 {
    _private: (),
}

impl Avx2 {
    pub fn new() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2 { _private: () })
    }
}

/// Σ of four neighbouring u8·i8 products into each i32 lane. `maddubs` saturates its i16 pair
/// sums, which the callers never reach: |u| ≤ 128 and |s| ≤ 127 give at most 2·128·127 = 32512.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dp(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

x86_kernels!(Avx2, "avx2,fma,f16c", {
    #[inline]
    fn has_panels(self) -> bool {
        true
    }

    fn attn_f16(self, io: &AttnIo<'_>, scores: &mut [f32], out: &mut [f32], ml: &mut [f32]) -> bool {
        super::attn_groups(io, false, scores, out, ml, |nh, io, sg, og, mg| {
            // SAFETY: the CPU has the features (token); attn_groups checked the bounds.
            unsafe {
                match nh {
                    8 => attn_group::<8>(io, sg, og, mg),
                    7 => attn_group::<7>(io, sg, og, mg),
                    6 => attn_group::<6>(io, sg, og, mg),
                    5 => attn_group::<5>(io, sg, og, mg),
                    4 => attn_group::<4>(io, sg, og, mg),
                    3 => attn_group::<3>(io, sg, og, mg),
                    2 => attn_group::<2>(io, sg, og, mg),
                    _ => attn_group::<1>(io, sg, og, mg),
                }
            }
        })
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

    fn delta_seq(self, st: &mut [f32], io: &DeltaIo<'_>, o: &mut [f32]) {
        let Some(kq) = super::delta_columns_kq(st, io, o, 8) else {
            return super::delta_stepwise(self, st, io, o);
        };
        let mut buf = vec![[0f32; 8]; io.dk];
        super::delta_columns_chunked(io, &kq, o, 8, |io, kq, o, c| {
            // SAFETY: the CPU has the features (token); delta_columns_kq checked the lengths
            // (a chunk's are within them).
            unsafe { delta_columns(st, io, kq, c, &mut buf, o) };
        });
    }

    fn panel_unpack(self, ty: GgmlType, k: usize, rows: &[u8], m: usize, p: &mut Panel) {
        let rb = ty.row_bytes(k).expect("panel rows are whole blocks");
        assert!((1..=ROWS).contains(&m) && rows.len() >= m * rb, "panel_unpack: {m} rows of {rb} bytes in {} bytes", rows.len());
        p.reset(ty, k, m);
        UNPACKED.with_borrow_mut(|u| {
            u.codes.resize(m * k, 0);
            u.s16.resize(m * k / 16, 0.0);
            u.o16.resize(m * k / 16, 0.0);
            for r in 0..m {
                let (c, s, o) =
                    (&mut u.codes[r * k..(r + 1) * k], &mut u.s16[r * k / 16..(r + 1) * k / 16], &mut u.o16[r * k / 16..(r + 1) * k / 16]);
                // SAFETY: the CPU has the features (token).
                unsafe { decode_row(ty, &rows[r * rb..(r + 1) * rb], c, s, o) };
            }
            // SAFETY: as above; `u` holds m rows of k codes and k/16 scales (resized above).
            unsafe { transpose_rows(u, m, p) };
        });
    }

    fn panel_dot(self, p: &Panel, a: &[&ActRow], out: &mut [[f32; ROWS]]) {
        assert!(out.len() >= a.len());
        let signed = signed_panel(p);
        for a in a {
            assert!(
                a.q.len() >= p.k && (signed || a.qu.len() >= p.k) && a.d.len() >= p.k / 32 && a.ds16.len() >= p.k / 16,
                "panel_dot: activation row shorter than the panel"
            );
        }
        assert!(p.q.len() >= p.k / 4 && p.sc.len() >= p.k / p.g && p.off.len() >= p.k / p.g && p.corr.len() >= p.k / p.g);
        if !signed && p.g == 32 && p.has_off && matches!(p.ty, Some(GgmlType::Q4K | GgmlType::Q5K)) {
            let q4 = p.ty == Some(GgmlType::Q4K);
            for (ai, oi) in a.chunks(4).zip(out.chunks_mut(4)) {
                // SAFETY: the CPU has the features (token); the lengths were checked above.
                unsafe {
                    match (ai.len(), q4) {
                        (4, true) => panel_dot_small::<4, 8>(p, ai, oi),
                        (4, false) => panel_dot_small::<4, 4>(p, ai, oi),
                        (3, true) => panel_dot_small::<3, 8>(p, ai, oi),
                        (3, false) => panel_dot_small::<3, 4>(p, ai, oi),
                        (2, true) => panel_dot_small::<2, 8>(p, ai, oi),
                        (2, false) => panel_dot_small::<2, 4>(p, ai, oi),
                        (_, true) => panel_dot_small::<1, 8>(p, ai, oi),
                        (_, false) => panel_dot_small::<1, 4>(p, ai, oi),
                    }
                }
            }
            return;
        }
        let mut i = 0;
        while i < a.len() {
            let n = (a.len() - i).min(PANEL_NT);
            let (ai, oi) = (&a[i..i + n], &mut out[i..i + n]);
            // SAFETY: the CPU has the features (token); the lengths were checked above.
            unsafe {
                match n {
                    4 => panel_dot_g::<4>(p, ai, oi, signed),
                    3 => panel_dot_g::<3>(p, ai, oi, signed),
                    2 => panel_dot_g::<2>(p, ai, oi, signed),
                    _ => panel_dot_g::<1>(p, ai, oi, signed),
                }
            }
            i += n;
        }
    }
});

/// Single-token K-quant dots sum each 256-block in integers (`maddubs` then `madd` with the
/// integer sub-block weights): ~60 instructions per block against ~95 for the per-32 f32
/// scaling, most of which were lane broadcasts of the scales.
const INT_DOTS: bool = true;

/// AVX2 has no wider single-token kernels than the shared ones.
#[inline(always)]
fn has_dot1_wide(_ty: GgmlType) -> bool {
    false
}

#[inline(always)]
unsafe fn dot1_wide(_ty: GgmlType, _w: &[u8], _a: &ActRow) -> Option<f32> {
    None
}
