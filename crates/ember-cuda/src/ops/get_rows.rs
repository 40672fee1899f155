use cudarc::driver::DeviceRepr;

use super::{blocks, need, u32_of};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::GET_ROWS;
use crate::ops::DeviceWeight;

const OP: &str = "get_rows";

#[repr(C)]
struct GetRowsParams {
    w: u64,
    ids: u64,
    out: u64,
    ty: u32,
    k: u32,
    n_rows: u32,
    n_ids: u32,
    row_bytes: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `GetRowsParams` in kernels/get_rows.cu.
unsafe impl DeviceRepr for GetRowsParams {}

impl Gpu {
    /// Dequantised rows `ids` of `w` into `out` [n_ids, k]. An id >= n_rows gives a NaN row.
    pub fn get_rows(&self, w: &DeviceWeight, ids: &Buf<u32>, n_ids: usize, out: &mut Buf<f32>) -> Result<()> {
        need(OP, "ids", ids, n_ids)?;
        need(OP, "out", out, n_ids * w.k)?;
        if n_ids == 0 {
            return Ok(());
        }
        let p = GetRowsParams {
            w: w.ptr(),
            ids: ids.ptr(),
            out: out.ptr(),
            ty: w.ty.id(),
            k: u32_of(OP, "k", w.k)?,
            n_rows: u32_of(OP, "n_rows", w.n_rows)?,
            n_ids: u32_of(OP, "n_ids", n_ids)?,
            row_bytes: u32_of(OP, "row_bytes", w.row_bytes)?,
            pad: 0,
        };
        let f = self.function(&GET_ROWS, "get_rows")?;
        // SAFETY: sizes checked above; the kernel bounds-checks each id against n_rows.
        unsafe { self.launch(&f, (blocks(w.k.div_ceil(8), 128), u32_of(OP, "n_ids", n_ids)?, 1), 128, 0, &p) }
    }
}
