use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::{blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::MATMUL;

const OP: &str = "matmul";

/// A 2-D weight on the device in its file format, uploaded unchanged: `n_rows` rows of `k`
/// weights of type `ty`, `row_bytes` each.
#[derive(Debug)]
pub struct DeviceWeight {
    pub ty: GgmlType,
    pub k: usize,
    pub n_rows: usize,
    pub row_bytes: usize,
    bytes: Buf<u8>,
}

/// Rows `row0..row0 + n_rows` of a [`DeviceWeight`] (e.g. one expert of a stacked tensor).
#[derive(Debug, Clone, Copy)]
pub struct WeightRef<'a> {
    w: &'a DeviceWeight,
    row0: usize,
    pub n_rows: usize,
}

impl DeviceWeight {
    pub fn all(&self) -> WeightRef<'_> {
        WeightRef { w: self, row0: 0, n_rows: self.n_rows }
    }

    pub fn rows(&self, start: usize, n: usize) -> Result<WeightRef<'_>> {
        if start + n > self.n_rows {
            return Err(shape(OP, format!("rows {start}..{} of a {}-row weight", start + n, self.n_rows)));
        }
        Ok(WeightRef { w: self, row0: start, n_rows: n })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.bytes.ptr()
    }
}

/// The suffix of the per-type kernel entries (`matmul_gemv_q4_k`, `moe_down_q6_k`, ...), for
/// the weight types with CUDA kernels.
pub(crate) fn type_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        GgmlType::IQ4XS => "iq4_xs",
        _ => return None,
    })
}

/// Tokens up to which the GEMV kernel is used (it re-reads the weight once per 8 tokens).
pub const GEMV_MAX_TOKENS: usize = 16;
const GEMV_NT: usize = 8;
const GEMV_ROWS_PER_BLOCK: usize = 4;

#[repr(C)]
struct MatmulParams {
    w: u64,
    x: u64,
    y: u64,
    ty: u32,
    k: u32,
    n_rows: u32,
    n_tok: u32,
    row_bytes: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `MatmulParams` in kernels/matmul.cu.
unsafe impl DeviceRepr for MatmulParams {}

impl Gpu {
    /// Uploads a weight's file bytes unchanged.
    pub fn upload_weight(&self, ty: GgmlType, k: usize, n_rows: usize, data: &[u8]) -> Result<DeviceWeight> {
        if type_suffix(ty).is_none() {
            return Err(shape(OP, format!("weight type {} has no CUDA kernel", ty.name())));
        }
        let row_bytes = ty.row_bytes(k).ok_or_else(|| shape(OP, format!("k = {k} is not a multiple of {}'s block", ty.name())))?;
        if data.len() != row_bytes * n_rows {
            return Err(shape(OP, format!("{} bytes for {n_rows} rows of {row_bytes}", data.len())));
        }
        Ok(DeviceWeight { ty, k, n_rows, row_bytes, bytes: self.upload(data)? })
    }

    /// `y[t][r] = Σ_j W[r][j]·x[t][j]`: x is [n_tok, k], y [n_tok, w.n_rows] (row-major f32).
    pub fn matmul(&self, w: WeightRef<'_>, x: &Buf<f32>, n_tok: usize, y: &mut Buf<f32>) -> Result<()> {
        let dw = w.w;
        need(OP, "x", x, n_tok * dw.k)?;
        need(OP, "y", y, n_tok * w.n_rows)?;
        if n_tok == 0 || w.n_rows == 0 {
            return Ok(());
        }
        let p = MatmulParams {
            w: dw.ptr() + (w.row0 * dw.row_bytes) as u64,
            x: x.ptr(),
            y: y.ptr(),
            ty: dw.ty.id(),
            k: u32_of(OP, "k", dw.k)?,
            n_rows: u32_of(OP, "n_rows", w.n_rows)?,
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            row_bytes: u32_of(OP, "row_bytes", dw.row_bytes)?,
            pad: 0,
        };
        let gemv = type_suffix(dw.ty).filter(|_| n_tok <= GEMV_MAX_TOKENS && dw.k.is_multiple_of(8));
        // SAFETY: x holds n_tok·k floats and y n_tok·n_rows (checked above); the weight pointer
        // plus n_rows·row_bytes stays inside the uploaded bytes (WeightRef is bounds-checked),
        // and its alignment is that of row_bytes, which the GEMV's wide loads rely on
        // (16-byte loads for f32/f16/bf16, which k % 8 == 0 makes aligned; 4-byte loads for
        // Q4_K/Q5_K/IQ4_XS, whose block sizes are multiples of 4; Q8_0/Q6_K read 2 bytes at a time).
        unsafe {
            match gemv {
                Some(suffix) => {
                    let f = self.function(&MATMUL, &format!("matmul_gemv_{suffix}"))?;
                    let grid = (blocks(w.n_rows, GEMV_ROWS_PER_BLOCK), blocks(n_tok, GEMV_NT), 1);
                    self.launch(&f, grid, 32 * GEMV_ROWS_PER_BLOCK as u32, 0, &p)
                }
                None => {
                    let f = self.function(&MATMUL, "matmul_tiled")?;
                    self.launch(&f, (blocks(w.n_rows, 64), blocks(n_tok, 64), 1), 256, 0, &p)
                }
            }
        }
    }
}
