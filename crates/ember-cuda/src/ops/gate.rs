use cudarc::driver::DeviceRepr;

use super::{blocks, need};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::GATE;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    Silu,
    Sigmoid,
}

#[repr(C)]
struct GateParams {
    y: u64,
    g: u64,
    n: u64,
    act: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `GateParams` in kernels/gate.cu.
unsafe impl DeviceRepr for GateParams {}

impl Gpu {
    /// `y[i] *= act(g[i])` for i < n.
    pub fn gate(&self, y: &mut Buf<f32>, g: &Buf<f32>, n: usize, act: Act) -> Result<()> {
        need("gate", "y", y, n)?;
        need("gate", "g", g, n)?;
        if n == 0 {
            return Ok(());
        }
        let p = GateParams { y: y.ptr(), g: g.ptr(), n: n as u64, act: (act == Act::Sigmoid) as u32, pad: 0 };
        let f = self.function(&GATE, "gate")?;
        // SAFETY: both buffers hold n floats.
        unsafe { self.launch(&f, (blocks(n, 256), 1, 1), 256, 0, &p) }
    }
}
