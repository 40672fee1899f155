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
}
