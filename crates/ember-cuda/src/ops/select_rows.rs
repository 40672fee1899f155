use cudarc::driver::DeviceRepr;

use super::{blocks, need, u32_of};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::SELECT_ROWS;

const OP: &str = "select_rows";

#[repr(C)]
struct SelectRowsParams {
    x: u64,
    rows: u64,
    out: u64,
    n: u32,
    d: u32,
    n_sel: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `SelectRowsParams` in kernels/select_rows.cu.
unsafe impl DeviceRepr for SelectRowsParams {}

impl Gpu {
    /// `out[i] = x[rows[i]]` for x [n, d]; a row index >= n gives a NaN row.
    pub fn select_rows(&self, x: &Buf<f32>, n: usize, d: usize, rows: &Buf<u32>, n_sel: usize, out: &mut Buf<f32>) -> Result<()> {
        need(OP, "x", x, n * d)?;
        need(OP, "rows", rows, n_sel)?;
        need(OP, "out", out, n_sel * d)?;
        if n_sel == 0 || d == 0 {
            return Ok(());
        }
        let p = SelectRowsParams {
            x: x.ptr(),
            rows: rows.ptr(),
            out: out.ptr(),
            n: u32_of(OP, "n", n)?,
            d: u32_of(OP, "d", d)?,
            n_sel: u32_of(OP, "n_sel", n_sel)?,
            pad: 0,
        };
        let f = self.function(&SELECT_ROWS, "select_rows")?;
        // SAFETY: sizes checked above; the kernel bounds-checks each row index against n.
        unsafe { self.launch(&f, (blocks(d, 256), p.n_sel, 1), 256, 0, &p) }
    }
}
