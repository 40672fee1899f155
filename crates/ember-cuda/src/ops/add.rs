use cudarc::driver::DeviceRepr;

use super::{blocks, need};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::ADD;

#[repr(C)]
struct AddParams {
    h: u64,
    x: u64,
    n: u64,
    n_add: u32,
    set: u32,
}

// SAFETY: plain #[repr(C)] data matching `AddParams` in kernels/add.cu (3 u64, 2 u32: no padding).
unsafe impl DeviceRepr for AddParams {}

impl Gpu {
    /// `h[i] += x[i]` for i < n.
    pub fn add(&self, h: &mut Buf<f32>, x: &Buf<f32>, n: usize) -> Result<()> {
        need("add", "h", h, n)?;
        need("add", "x", x, n)?;
        if n == 0 {
            return Ok(());
        }
        let p = AddParams { h: h.ptr(), x: x.ptr(), n: n as u64, n_add: 1, set: 0 };
        let f = self.function(&ADD, "add")?;
        // SAFETY: both buffers hold n floats.
        unsafe { self.launch(&f, (blocks(n, 256), 1, 1), 256, 0, &p) }
    }

    /// `h[i] += Σ_j parts[j·n + i]` for i < n (the `n_parts` rows added in order first), or with
    /// `set`, `h[i] = Σ_j parts[j·n + i]`: a one-launch MoE's experts ([`Gpu::moe_fused_q8`])
    /// into the residual, or into the MoE's output when something else reads it.
    pub fn add_parts(&self, h: &mut Buf<f32>, parts: &Buf<f32>, n_parts: usize, n: usize, set: bool) -> Result<()> {
        need("add", "h", h, n)?;
        need("add", "parts", parts, n_parts * n)?;
        if n == 0 || n_parts == 0 {
            return Ok(());
        }
        let n_add = u32::try_from(n_parts).map_err(|_| crate::error::shape("add", format!("{n_parts} parts")))?;
        let p = AddParams { h: h.ptr(), x: parts.ptr(), n: n as u64, n_add, set: u32::from(set) };
        let f = self.function(&ADD, "add")?;
        // SAFETY: h holds n floats, parts n_parts·n.
        unsafe { self.launch(&f, (blocks(n, 256), 1, 1), 256, 0, &p) }
    }
}
