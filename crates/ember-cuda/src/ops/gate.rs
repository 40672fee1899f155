use cudarc::driver::DeviceRepr;

use super::{blocks, need};
use crate::error::{Result, shape};
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
    q: u64,
}

// SAFETY: plain #[repr(C)] data matching `GateParams` in kernels/gate.cu.
unsafe impl DeviceRepr for GateParams {}

impl Gpu {
    /// `y[i] *= act(g[i])` for i < n.
    pub fn gate(&self, y: &mut Buf<f32>, g: &Buf<f32>, n: usize, act: Act) -> Result<()> {
        self.gate_to(y, g, n, act, 0)
    }

    /// [`Gpu::gate`] that also leaves y quantised to int8 in the GPU's int8 scratch, as
    /// [`Gpu::quantize_q8`] of y would, for the int8 GEMV that reads it next; returns
    /// [`Gpu::q8_generation`] after it. n a multiple of 32.
    pub fn gate_q8(&self, y: &mut Buf<f32>, g: &Buf<f32>, n: usize, act: Act) -> Result<u64> {
        if !n.is_multiple_of(32) {
            return Err(shape("gate", format!("{n} values: the int8 copy needs a multiple of 32")));
        }
        let q = self.q8_scratch(super::q8_bytes(n))?;
        let generation = self.bump_q8_generation();
        self.gate_to(y, g, n, act, q)?;
        Ok(generation)
    }

    fn gate_to(&self, y: &mut Buf<f32>, g: &Buf<f32>, n: usize, act: Act, q: u64) -> Result<()> {
        need("gate", "y", y, n)?;
        need("gate", "g", g, n)?;
        if n == 0 {
            return Ok(());
        }
        let p = GateParams { y: y.ptr(), g: g.ptr(), n: n as u64, act: (act == Act::Sigmoid) as u32, pad: 0, q };
        let f = self.function(&GATE, "gate")?;
        // SAFETY: both buffers hold n floats; q is 0 or the int8 scratch of q8_bytes(n) bytes
        // with n a multiple of 32, so the kernel's warps are whole (blocks of 256 threads).
        unsafe { self.launch(&f, (blocks(n, 256), 1, 1), 256, 0, &p) }
    }
}
