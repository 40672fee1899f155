//! Q6_K rows in the layout every kernel reads (kernels/q6_repack.cu, kernels/dequant.cuh's
//! `q6k_blk` / `q6k_dp`): each row's 210-byte blocks as 208-byte runs (ql, qh, scales), then the
//! blocks' f16 d's; the same bytes a row. Every Q6_K upload is repacked on the device, after its
//! copy, on the same stream. Measured in gemv-micro (docs/perf.md g27): one-token GEMVs of rows of
//! whole 16-byte chunks take 5 loads a lane and unit instead of 17 (DeltaNet's qkv 9.29 → 6.99 us
//! a launch on an H100); end to end tg128 +2.7 % (g28).

use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::{DeviceWeight, u32_of};
use crate::error::{Result, shape};
use crate::gpu::Gpu;
use crate::kernels::Q6_REPACK;

const OP: &str = "q6k_repack";
const BLOCK: usize = 210;
const RUN: usize = 208;

/// One row of 210-byte Q6_K blocks in the repacked layout (the reference of the kernel).
pub fn q6k_repack_row(row: &[u8]) -> Vec<u8> {
    let nb = row.len() / BLOCK;
    let mut out = vec![0u8; row.len()];
    for (c, b) in row.chunks_exact(BLOCK).enumerate() {
        out[RUN * c..RUN * (c + 1)].copy_from_slice(&b[..RUN]);
        out[RUN * nb + 2 * c..RUN * nb + 2 * c + 2].copy_from_slice(&b[RUN..]);
    }
    out
}

#[repr(C)]
struct Q6RepackParams {
    w: u64,
    n_rows: u64,
    row_bytes: u32,
    nb: u32,
}

// SAFETY: plain #[repr(C)] data matching `Q6RepackParams` in kernels/q6_repack.cu (2 u64, 2 u32:
// 24 bytes, no padding in either language).
unsafe impl DeviceRepr for Q6RepackParams {}

impl Gpu {
    /// Repacks rows `row0..row0 + n` of the Q6_K weight `w` in place (from the file's blocks:
    /// each range once, after its upload, on the stream).
    pub fn q6k_repack_rows(&self, w: &mut DeviceWeight, row0: usize, n: usize) -> Result<()> {
        if w.ty != GgmlType::Q6K || row0 + n > w.n_rows {
            return Err(shape(OP, format!("rows {row0}+{n} of {} {} rows", w.n_rows, w.ty.name())));
        }
        if n == 0 || w.row_bytes == 0 {
            return Ok(());
        }
        let p = Q6RepackParams {
            w: w.rows_at(row0, n * w.row_bytes)?,
            n_rows: n as u64,
            row_bytes: u32_of(OP, "row_bytes", w.row_bytes)?,
            nb: u32_of(OP, "nb", w.row_bytes / BLOCK)?,
        };
        let f = self.function(&Q6_REPACK, "q6k_repack")?;
        if w.row_bytes > 48 << 10 {
            // A row goes through shared memory: past the default 48 KiB, the device's opt-in
            // limit (227 KiB on sm_90: k up to ~277,000), else a clear error.
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, p.row_bytes as i32)
                .map_err(|e| shape(OP, format!("Q6_K rows of {} bytes (a row goes through shared memory): {e:?}", w.row_bytes)))?;
        }
        let grid = n.min(self.info().n_sm as usize * 16) as u32;
        // SAFETY: p.w addresses n whole rows of row_bytes inside the weight (rows_at checked);
        // row_bytes = 210·nb (a Q6_K row) bytes of dynamic shared memory, allowed above.
        unsafe { self.launch(&f, (grid, 1, 1), 256, p.row_bytes, &p) }
    }
}

impl DeviceWeight {
    /// After rows `row0..row0 + n` were written from the file's bytes: repacks them if they are
    /// Q6_K; nothing otherwise.
    pub(crate) fn repack_uploaded(&mut self, gpu: &Gpu, row0: usize, n: usize) -> Result<()> {
        if self.ty == GgmlType::Q6K { gpu.q6k_repack_rows(self, row0, n) } else { Ok(()) }
    }

    /// The weight's bytes as the device holds them (tests).
    pub fn download(&self, gpu: &Gpu) -> Result<Vec<u8>> {
        gpu.download(&self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each block's first 208 bytes become its run, its last two the d of the plane, in order.
    #[test]
    fn a_repacked_row_holds_each_blocks_run_then_the_ds() {
        let nb = 3;
        let row: Vec<u8> = (0..BLOCK * nb).map(|i| (i * 7 % 251) as u8).collect();
        let out = q6k_repack_row(&row);
        assert_eq!(out.len(), row.len());
        for c in 0..nb {
            assert_eq!(&out[RUN * c..RUN * (c + 1)], &row[BLOCK * c..BLOCK * c + RUN], "run {c}");
            assert_eq!(&out[RUN * nb + 2 * c..RUN * nb + 2 * c + 2], &row[BLOCK * c + RUN..BLOCK * (c + 1)], "d {c}");
        }
    }
}
