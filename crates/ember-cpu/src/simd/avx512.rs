//! AVX-512 VNNI kernels: the x86 kernel bodies of [`super::avx2`] with the integer product done
//! by `vpdpbusd` (u8 × i8 summed into i32 lanes in one instruction, no i16 saturation) on 256-bit
//! vectors (AVX-512 VL).

use std::arch::x86_64::*;

use super::Kernels;
use super::avx2::x86_kernels;

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

/// Σ of four neighbouring u8·i8 products into each i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dp(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

x86_kernels!(Avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
