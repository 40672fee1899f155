//! `wgmma_check` (kernels/wgmma.cu): step 0 of docs/attention-wgmma.md, the wgmma building
//! blocks checked on their own before prompt attention is built on them. Not used by the model.

use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::CUfunction_attribute;

use super::need;
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::WGMMA;

#[repr(C)]
struct WgmmaCheckParams {
    q: u64,
    k: u64,
    v: u64,
    p: u64,
    s: u64,
    o: u64,
    v_lbo: u32,
    v_sbo: u32,
}

// SAFETY: plain #[repr(C)] data matching `WgmmaCheckParams` in kernels/wgmma.cu (6 u64, 2 u32).
unsafe impl DeviceRepr for WgmmaCheckParams {}

/// The kernel's dynamic shared memory: 1 KiB of slack to align its tiles, then three tiles of 64
/// rows of 256 f16 values.
const SMEM: usize = 1024 + 3 * 64 * 256 * 2;

impl Gpu {
    /// Whether this GPU runs the `sm_90a` kernels (compute capability 9.0: H100, H200).
    pub fn has_wgmma(&self) -> bool {
        self.info().sm() == 90
    }

    /// S = Q·Kᵀ [64 x 64] and O = P·V [64 x 256] by wgmma, one warpgroup: `q`, `k`, `v` [64][256]
    /// and `p` [64][64] f16 values (bits), row-major; `s`, `o` f32; V read through a descriptor
    /// with leading and stride byte offsets `v_offsets` (attention's: (8192, 1024)). On a GPU
    /// without wgmma ([`Gpu::has_wgmma`]) the outputs are NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn wgmma_check(
        &self,
        q: &Buf<u16>,
        k: &Buf<u16>,
        v: &Buf<u16>,
        p: &Buf<u16>,
        s: &mut Buf<f32>,
        o: &mut Buf<f32>,
        v_offsets: (u32, u32),
    ) -> Result<()> {
        const OP: &str = "wgmma_check";
        for (name, b) in [("q", q), ("k", k), ("v", v)] {
            need(OP, name, b, 64 * 256)?;
        }
        need(OP, "p", p, 64 * 64)?;
        need(OP, "s", s, 64 * 64)?;
        need(OP, "o", o, 64 * 256)?;
        let f = self.function(&WGMMA, "wgmma_check")?;
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM as i32)
            .map_err(|e| shape(OP, format!("{SMEM} bytes of shared memory a block: {e:?}")))?;
        let prm = WgmmaCheckParams {
            q: q.ptr(),
            k: k.ptr(),
            v: v.ptr(),
            p: p.ptr(),
            s: s.ptr(),
            o: o.ptr(),
            v_lbo: v_offsets.0,
            v_sbo: v_offsets.1,
        };
        // SAFETY: sizes checked above; one block of 128 threads reads 64·256 values of q, k, v and
        // 64·64 of p, writes 64·64 of s and 64·256 of o, within SMEM bytes of shared memory.
        unsafe { self.launch(&f, (1, 1, 1), 128, SMEM as u32, &prm) }
    }
}
