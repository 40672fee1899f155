use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::RMS_NORM;

const OP: &str = "rms_norm";

#[repr(C)]
struct RmsNormParams {
    x: u64,
    w: u64,
    out: u64,
    g: u32,
    n_group: u32,
    eps: f32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `RmsNormParams` in kernels/rms_norm.cu.
unsafe impl DeviceRepr for RmsNormParams {}

#[repr(C)]
struct RmsNormQ8Params {
    r: RmsNormParams,
    q: u64,
}

// SAFETY: plain #[repr(C)] data matching `RmsNormQ8Params` in kernels/rms_norm.cu (RmsNormParams
// is 32 bytes: no padding before q).
unsafe impl DeviceRepr for RmsNormQ8Params {}

impl Gpu {
    /// RMSNorm of every `w.len()`-wide group of x [n, d] (d a multiple of w.len()), times w.
    pub fn rms_norm(&self, x: &Buf<f32>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<()> {
        let g = w.len();
        if g == 0 || !d.is_multiple_of(g) {
            return Err(shape(OP, format!("width {d} is not a multiple of the weight length {g}")));
        }
        need(OP, "x", x, n * d)?;
        need(OP, "out", out, n * d)?;
        let n_group = n * d / g;
        if n_group == 0 {
            return Ok(());
        }
        let p = RmsNormParams {
            x: x.ptr(),
            w: w.ptr(),
            out: out.ptr(),
            g: u32_of(OP, "g", g)?,
            n_group: u32_of(OP, "groups", n_group)?,
            eps,
            pad: 0,
        };
        // A row of the model's width (2,048) in one pass of 1,024 threads: the norm is a
        // latency chain (load, block sum, store), so the fewer steps per thread the better.
        let block = if g <= 128 { 32 } else { g.div_ceil(2).next_multiple_of(32).min(1024) as u32 };
        let f = self.function(&RMS_NORM, "rms_norm")?;
        // SAFETY: x and out hold n_group·g floats, w holds g (checked above).
        unsafe { self.launch(&f, (p.n_group, 1, 1), block, 0, &p) }
    }

    /// [`Gpu::rms_norm`] that also leaves its output quantised to int8 in the GPU's int8
    /// scratch, as [`Gpu::quantize_q8`] of `out` would (the same values, bit for bit), for the
    /// int8 GEMVs that read it next; returns [`Gpu::q8_generation`] after it. Needs d a multiple
    /// of 32 and of the weight length, which a multiple of 32 too.
    pub fn rms_norm_q8(&self, x: &Buf<f32>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<u64> {
        let g = w.len();
        if g == 0 || !d.is_multiple_of(g) || !g.is_multiple_of(32) {
            return Err(shape(OP, format!("width {d}, weight length {g}: the int8 copy needs groups of a multiple of 32")));
        }
        need(OP, "x", x, n * d)?;
        need(OP, "out", out, n * d)?;
        let n_group = n * d / g;
        let q = self.q8_scratch(super::q8_bytes(n * d))?;
        let generation = self.bump_q8_generation();
        if n_group == 0 {
            return Ok(generation);
        }
        let p = RmsNormQ8Params {
            r: RmsNormParams {
                x: x.ptr(),
                w: w.ptr(),
                out: out.ptr(),
                g: u32_of(OP, "g", g)?,
                n_group: u32_of(OP, "groups", n_group)?,
                eps,
                pad: 0,
            },
            q,
        };
        let f = self.function(&RMS_NORM, "rms_norm_q8")?;
        let block = g.div_ceil(2).next_multiple_of(32).min(1024) as u32;
        // SAFETY: x and out hold n·d floats, w g (checked); the scratch holds q8_bytes(n·d);
        // one block per group; g % 32 == 0 keeps the kernel's warps whole.
        unsafe { self.launch(&f, (p.r.n_group, 1, 1), block, 0, &p)? };
        Ok(generation)
    }
}
