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
}

// SAFETY: plain #[repr(C)] data matching `AddParams` in kernels/add.cu.
unsafe impl DeviceRepr for AddParams {}

impl Gpu {
    /// `h[i] += x[i]` for i < n.
    pub fn add(&self, h: &mut Buf<f32>, x: &Buf<f32>, n: usize) -> Result<()> {
        need("add", "h", h, n)?;
        need("add", "x", x, n)?;
        if n == 0 {
            return Ok(());
        }
        let p = AddParams { h: h.ptr(), x: x.ptr(), n: n as u64 };
        let f = self.function(&ADD, "add")?;
        // SAFETY: both buffers hold n floats.
        unsafe { self.launch(&f, (blocks(n, 256), 1, 1), 256, 0, &p) }
    }
}
