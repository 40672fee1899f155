use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::TOP_K;

const OP: &str = "top_k_rows";

/// Threads of a `top_k_rows` block (one block a row).
const THREADS: u32 = 1024;

#[repr(C)]
struct TopKParams {
    x: u64,
    extra: u64,
    extra_at: u64,
    out_ids: u64,
    out_vals: u64,
    n: u32,
    k: u32,
    cap: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `TopKParams` in kernels/top_k.cu.
unsafe impl DeviceRepr for TopKParams {}

impl Gpu {
    /// Per row r of `x` [n_rows, n]: its `k` best entries (value descending, NaN as −∞, ties to
    /// the lower id; in no particular order) into `out_ids` / `out_vals` [n_rows, cap] from
    /// column 0, then the entries at `extra[extra_at[r]..extra_at[r + 1]]` (ids below n). `k`
    /// at most n; `cap` at least k plus the most extras of a row. One block a row
    /// (`kernels/top_k.cu`).
    #[allow(clippy::too_many_arguments)]
    pub fn top_k_rows(
        &self,
        x: &Buf<f32>,
        n_rows: usize,
        n: usize,
        k: usize,
        extra: &Buf<u32>,
        extra_at: &Buf<u32>,
        cap: usize,
        out_ids: &mut Buf<u32>,
        out_vals: &mut Buf<f32>,
    ) -> Result<()> {
        need(OP, "x", x, n_rows * n)?;
        need(OP, "extra_at", extra_at, n_rows + 1)?;
        need(OP, "out_ids", out_ids, n_rows * cap)?;
        need(OP, "out_vals", out_vals, n_rows * cap)?;
        if k > n || k > cap {
            return Err(crate::error::shape(OP, format!("k {k} with rows of {n} and room for {cap}")));
        }
        if n_rows == 0 || cap == 0 {
            return Ok(());
        }
        let p = TopKParams {
            x: x.ptr(),
            extra: extra.ptr(),
            extra_at: extra_at.ptr(),
            out_ids: out_ids.ptr(),
            out_vals: out_vals.ptr(),
            n: u32_of(OP, "n", n)?,
            k: u32_of(OP, "k", k)?,
            cap: u32_of(OP, "cap", cap)?,
            pad: 0,
        };
        let f = self.function(&TOP_K, "top_k_rows")?;
        // SAFETY: x, extra_at and the outputs are checked above for n_rows rows; the extras'
        // offsets and ids are the caller's (CudaOps::read_top writes them: offsets within
        // `extra`, at most cap - k a row, ids below n; the kernel reads an id >= n as NaN).
        unsafe { self.launch(&f, (u32_of(OP, "n_rows", n_rows)?, 1, 1), THREADS, 0, &p) }
    }
}
