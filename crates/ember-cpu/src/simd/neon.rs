//! aarch64 NEON kernels. Float dots are vectorised; quantised dots and the activation
//! quantiser use the scalar kernels until an aarch64 machine is available to measure and test
//! them on (the trait keeps the call sites ISA-independent).

use std::arch::aarch64::*;

use ember_gguf::GgmlType;

use super::{Kernels, Scalar};
use crate::kernels::ActRow;

#[derive(Debug, Clone, Copy)]
pub struct Neon {
    _private: (),
}

impl Neon {
    pub fn new() -> Option<Self> {
        std::arch::is_aarch64_feature_detected!("neon").then_some(Neon { _private: () })
    }
}

impl Kernels for Neon {
    fn dot_q<const NT: usize>(self, ty: GgmlType, w: &[u8], a: [&ActRow; NT]) -> [f32; NT] {
        Scalar.dot_q(ty, w, a)
    }

    fn dot_float<const NT: usize>(self, ty: GgmlType, w: &[u8], x: [&[f32]; NT]) -> [f32; NT] {
        Scalar.dot_float(ty, w, x)
    }

    fn quantize(self, x: &[f32], out: &mut ActRow) {
        ActRow::quantize(x, out)
    }

    fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: a Neon token exists only if the CPU has NEON (new()).
        unsafe { dot_f32(a, b) }
    }

    fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        Scalar.axpy(a, x, y)
    }

    fn mul_add(self, a: &[f32], x: &[f32], y: &mut [f32]) {
        Scalar.mul_add(a, x, y)
    }

    fn exp_sum(self, x: &mut [f32], sub: f32) -> f32 {
        Scalar.exp_sum(x, sub)
    }

    fn silu(self, x: &mut [f32]) {
        Scalar.silu(x)
    }

    fn f16_to_f32(self, src: &[u8], dst: &mut [f32]) {
        Scalar.f16_to_f32(src, dst)
    }

    fn delta_step(self, st: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: f32, beta: f32, o: &mut [f32]) {
        Scalar.delta_step(st, q, k, v, decay, beta, o)
    }
}

#[target_feature(enable = "neon")]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (l, v) in acc.iter_mut().enumerate() {
            let (x, y) = (&a[i + 4 * l..i + 4 * l + 4], &b[i + 4 * l..i + 4 * l + 4]);
            // SAFETY: `x` and `y` are 4 readable f32 each.
            *v = unsafe { vfmaq_f32(*v, vld1q_f32(x.as_ptr()), vld1q_f32(y.as_ptr())) };
        }
        i += 16;
    }
    let s = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    let mut sum = vaddvq_f32(s);
    for j in i..n {
        sum += a[j] * b[j];
    }
    sum
}
