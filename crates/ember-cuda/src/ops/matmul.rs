use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr};
use ember_gguf::GgmlType;

use super::gemv_q8::q8_bytes;
use super::{blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::{MATMUL, MATMUL_MMA8};

const OP: &str = "matmul";

/// A 2-D weight on the device in its file format (Q6_K rearranged within each row at upload:
/// src/ops/q6_repack.rs): `n_rows` rows of `k` weights of type `ty`, `row_bytes` each.
#[derive(Debug)]
pub struct DeviceWeight {
    pub ty: GgmlType,
    pub k: usize,
    pub n_rows: usize,
    pub row_bytes: usize,
    pub(super) bytes: Buf<u8>,
}

/// Rows `row0..row0 + n_rows` of a [`DeviceWeight`] (e.g. one expert of a stacked tensor).
#[derive(Debug, Clone, Copy)]
pub struct WeightRef<'a> {
    w: &'a DeviceWeight,
    row0: usize,
    pub n_rows: usize,
}

impl WeightRef<'_> {
    pub fn ty(&self) -> GgmlType {
        self.w.ty
    }

    pub fn k(&self) -> usize {
        self.w.k
    }

    pub fn row_bytes(&self) -> usize {
        self.w.row_bytes
    }

    /// The device address of the first row.
    pub(crate) fn ptr(&self) -> u64 {
        self.w.ptr() + (self.row0 * self.w.row_bytes) as u64
    }
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

    /// A weight of no rows whose buffer holds `bytes`: scratch that [`DeviceWeight::reshape`]
    /// gives a type and a shape.
    pub fn scratch(gpu: &Gpu, bytes: usize) -> Result<DeviceWeight> {
        Ok(DeviceWeight { ty: GgmlType::F32, k: 0, n_rows: 0, row_bytes: 0, bytes: gpu.alloc(bytes)? })
    }

    /// Bytes the buffer holds.
    pub fn capacity(&self) -> usize {
        self.bytes.len()
    }

    /// Reads the buffer as `n_rows` rows of `k` values of `ty` (its contents are not touched).
    pub fn reshape(&mut self, ty: GgmlType, k: usize, n_rows: usize) -> Result<()> {
        let row_bytes = ty.row_bytes(k).ok_or_else(|| shape("reshape", format!("k = {k} is not a multiple of {}'s block", ty.name())))?;
        if row_bytes * n_rows > self.bytes.len() {
            return Err(shape("reshape", format!("{n_rows} rows of {row_bytes} bytes in a buffer of {}", self.bytes.len())));
        }
        (self.ty, self.k, self.n_rows, self.row_bytes) = (ty, k, n_rows, row_bytes);
        Ok(())
    }

    /// Copies rows `src_row..src_row + n` of `src` (same type and width) to rows `row0..`.
    pub fn copy_rows_from(&mut self, gpu: &Gpu, row0: usize, src: &DeviceWeight, src_row: usize, n: usize) -> Result<()> {
        if (src.ty, src.k) != (self.ty, self.k) || src_row + n > src.n_rows || row0 + n > self.n_rows {
            return Err(shape("copy_rows", format!("rows {src_row}+{n} of {} into {row0} of {}", src.n_rows, self.n_rows)));
        }
        gpu.copy(&src.bytes, src_row * src.row_bytes, &mut self.bytes, row0 * self.row_bytes, n * self.row_bytes)
    }

    /// Writes the concatenation of `parts` (whole rows) at rows `row0..`, staged through pinned
    /// memory.
    pub fn write_rows_parts(&mut self, gpu: &Gpu, row0: usize, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let n = len / self.row_bytes.max(1);
        if n * self.row_bytes != len || row0 + n > self.n_rows {
            return Err(shape("write_rows", format!("{len} bytes at row {row0} of {} rows of {} bytes", self.n_rows, self.row_bytes)));
        }
        gpu.write_parts(&mut self.bytes, row0 * self.row_bytes, parts)?;
        self.repack_uploaded(gpu, row0, n)
    }

    /// The device address of row `row0`, checking that `bytes` from there are whole rows inside
    /// the weight (an asynchronous upload's destination).
    pub fn rows_at(&self, row0: usize, bytes: usize) -> Result<u64> {
        let n = bytes / self.row_bytes.max(1);
        if n * self.row_bytes != bytes || row0 + n > self.n_rows {
            return Err(shape("rows_at", format!("{bytes} bytes at row {row0} of {} rows of {} bytes", self.n_rows, self.row_bytes)));
        }
        Ok(self.bytes.ptr() + (row0 * self.row_bytes) as u64)
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

/// How matmuls treat activations (like `ember_cpu::Precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Prompt-sized batches on tensor cores: weights and activations rounded to f16, f32 sums
    /// (about 1e-3 relative to Σ|w·x|). Fewer tokens take the exact kernels.
    #[default]
    Fast,
    /// Weights dequantised exactly, f32 activations and sums, for every batch size.
    Exact,
}

/// A matmul kernel ([`Gpu::matmul_kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// A warp per row, 8 tokens per pass (re-reads the weight once per 8 tokens).
    Gemv,
    /// 64x64 tiles, f32 FMA.
    Tiled,
    /// Tensor cores: `tile_tokens` (32, 64 or 128) tokens x 128 rows per block, f16 operands.
    Mma { tile_tokens: usize },
    /// Tensor cores in the GEMV's shape: 32 rows a block, k split over its 8 warps, 8 or 16
    /// tokens a pass, f16 operands (k % 64 == 0, sm_80+).
    Mmv,
    /// Q4_K weights on int8 tensor cores, x quantised to int8 blocks of 32: `tile_tokens` (32
    /// or 64) tokens x 128 rows a block, operands staged through shared memory
    /// (`matmul_mma8s_q4_k`, `matmul_mma8s_q4_k_64`; k % 256 == 0, rows 16-byte aligned,
    /// sm_80+).
    Mma8 { tile_tokens: usize },
}

/// Tokens up to which [`MatmulKernel::Mma8`] replaces the f16 tiles: every prompt size since
/// its mmas are issued together (g22). H100, 35B-A3B Q4_K_M, 64-token blocks, one call
/// (`bench/results/20261206-1640-h100-final/`, two rounds): pp2048 13,852 / 13,912 t/s against
/// 12,840 / 12,878 with the f16 tiles above 512 tokens, pp8192 14,132 / 14,140 against 12,825 /
/// 12,830; `bench_matmul_prompt`, DeltaNet's qkv (2048 x 8192): 0.427 against 0.666 ms at 2048
/// tokens, 1.659 against 2.705 at 8192. (g16, before that change, it lost above 512 tokens.)
pub const MMA8_MAX_TOKENS: usize = usize::MAX;

/// Dynamic shared memory of `matmul_mma8s_q4_k` (32 tokens a block) and `..._64`
/// (kernels/matmul_mma8.cu `Mm8`): 3 and 2 stages of 128 rows' super-block (144 bytes each), the
/// tokens' 256 int8 values at a pitch of 272 and their 8 x (tokens + 1) block scales of 8 bytes.
fn mm8_smem(tile_tokens: usize) -> u32 {
    let stages = if tile_tokens == 32 { 3 } else { 2 };
    let t = tile_tokens as u32;
    stages * (128 * 144 + t * 272 + 8 * (t + 1) * 8)
}

/// Whether prompt-sized Q4_K matmuls run on int8 tensor cores ([`MatmulKernel::Mma8`];
/// `EMBER_MATMUL_MMA8=0`: the f16 tiles).
fn mma8_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("EMBER_MATMUL_MMA8").is_none_or(|v| v != "0"))
}

/// The most tokens [`MatmulKernel::Mma8`] takes ([`MMA8_MAX_TOKENS`]; `EMBER_MATMUL_MMA8_MAX_TOKENS`
/// overrides it, for measuring).
fn mma8_max_tokens() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("EMBER_MATMUL_MMA8_MAX_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(MMA8_MAX_TOKENS))
}

/// The tokens a block of [`MatmulKernel::Mma8`] takes for `n_tok` tokens of a weight of
/// `n_rows` rows: 64 (the weights read from L2 half as often as at 32) where its blocks still
/// give every SM one (two fit an SM: 128 registers, 80 KB of shared memory), else 32.
/// `bench_matmul_prompt` (H100, 132 SMs, call n of g22), 64 against 32 tokens a block: Q4_K
/// 2048 x 8192 at 512 tokens (512 blocks of 64) 0.112 against 0.132 ms, 2048 x 4096 (256)
/// 0.061 against 0.070, 4096 x 2048 (128) 0.071 against 0.074, 2048 x 8192 at 128 tokens (128)
/// 0.034 against 0.036; but 4096 x 2048 at 128 tokens (32 blocks of 64) 0.064 against 0.042.
/// The line at half the SMs' count falls between those. In the model (call p, every Q4_K
/// matmul at 64, two rounds): pp512 11,320 / 11,299 against 11,027 / 11,013.
/// `EMBER_MATMUL_MMA8_64=0` or `=1` fixes it at 32 or 64.
fn mma8_tile_tokens(n_tok: usize, n_rows: usize, n_sm: u32) -> usize {
    static FIXED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let fixed = *FIXED.get_or_init(|| match std::env::var("EMBER_MATMUL_MMA8_64").as_deref() {
        Ok("1") => Some(64),
        Ok("0") => Some(32),
        _ => None,
    });
    fixed.unwrap_or(if 2 * n_tok.div_ceil(64) * n_rows.div_ceil(128) >= n_sm as usize { 64 } else { 32 })
}

/// Tokens up to which the GEMV kernel is used (it re-reads the weight once per 8 tokens).
pub const GEMV_MAX_TOKENS: usize = 16;
/// Tokens above which [`Precision::Fast`] uses the tensor-core kernel; up to this many it runs
/// the GEMV. Measured on the H200 (Q4_K 4096 x 2048, 2026-12-03): GEMV 46 / 71 / 106 / 138 us
/// at 17 / 32 / 48 / 64 tokens, tensor cores 89 / 92 / 98 / 100 us (a few row blocks of one
/// token tile leave most SMs idle), so the switch is at ~40 tokens.
pub const MMA_MIN_TOKENS: usize = 40;
/// Weight rows per `matmul_mmv` block (`MMV_ROWS` in kernels/matmul.cu) and the weights of its
/// k steps (`MMV_STEP`: k must be a multiple).
const MMV_ROWS: usize = 32;
const MMV_STEP: usize = 64;
/// Rows up to which a prompt-sized batch takes `matmul_mmv` ([`Gpu::uses_mmv_prompt`]).
pub const MMV_PROMPT_MAX_ROWS: usize = 512;
/// Warps and threads per `matmul_mmv` block (`MMV_WARPS`).
const MMV_WARPS: usize = 8;
const MMV_THREADS: u32 = 32 * MMV_WARPS as u32;

/// Weight rows per tensor-core block (`MMA_BN` in kernels/mma.cuh).
const MMA_ROWS: usize = 128;
/// Threads per tensor-core block (`MMA_THREADS`).
const MMA_THREADS: u32 = 256;
const GEMV_NT: usize = 8;
/// Warps per GEMV block.
const GEMV_WARPS: usize = 4;

/// Warps that share one GEMV row (`gemv_ksplit` in kernels/matmul.cu, which must agree): a
/// weight of few rows gives each of its rows 2 or 4 warps over its 256-weight chunks, so that
/// enough warps are in flight to hide the memory latency (with one warp a row, a 512-row weight
/// fills 128 warps on a 132-SM GPU, each walking its row's chunks one after another).
pub(super) fn gemv_ksplit(n_rows: usize, k: usize) -> usize {
    let mut ks = if std::env::var_os("EMBER_GEMV_KSPLIT").is_some_and(|v| v == "0") {
        1
    } else if n_rows <= 1024 {
        4
    } else if n_rows <= 4096 {
        2
    } else {
        1
    };
    while ks > 1 && ks > k.div_ceil(256) {
        ks /= 2;
    }
    ks
}

/// GEMV blocks for a weight of `n_rows` rows of `k`.
fn gemv_blocks(n_rows: usize, k: usize) -> u32 {
    blocks(n_rows, GEMV_WARPS / gemv_ksplit(n_rows, k))
}

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
    /// GEMV: warps per row ([`gemv_ksplit`]).
    ksplit: u32,
}

// SAFETY: plain #[repr(C)] data matching `MatmulParams` in kernels/matmul.cu.
unsafe impl DeviceRepr for MatmulParams {}

/// Weights per `matmul_gemv_multi` launch (`GEMV_MULTI` in kernels/matmul.cu).
pub const GEMV_MULTI: usize = 4;

#[repr(C)]
struct MatmulMultiParams {
    w: [u64; GEMV_MULTI],
    y: [u64; GEMV_MULTI],
    x: u64,
    n_rows: [u32; GEMV_MULTI],
    row_bytes: [u32; GEMV_MULTI],
    block0: [u32; GEMV_MULTI + 1],
    ty: u32,
    k: u32,
    n_tok: u32,
    n: u32,
    ksplit: [u32; GEMV_MULTI],
    prefetch: u32,
}

// SAFETY: plain #[repr(C)] data matching `MatmulMultiParams` in kernels/matmul.cu (u64 arrays
// first, then u32s: no padding on either side).
unsafe impl DeviceRepr for MatmulMultiParams {}

impl Gpu {
    /// Uploads a weight's file bytes (unchanged, but for Q6_K, which is repacked on the device:
    /// src/ops/q6_repack.rs).
    pub fn upload_weight(&self, ty: GgmlType, k: usize, n_rows: usize, data: &[u8]) -> Result<DeviceWeight> {
        if type_suffix(ty).is_none() {
            return Err(shape(OP, format!("weight type {} has no CUDA kernel", ty.name())));
        }
        let row_bytes = ty.row_bytes(k).ok_or_else(|| shape(OP, format!("k = {k} is not a multiple of {}'s block", ty.name())))?;
        if data.len() != row_bytes * n_rows {
            return Err(shape(OP, format!("{} bytes for {n_rows} rows of {row_bytes}", data.len())));
        }
        let bytes = if data.is_empty() { self.alloc(0)? } else { self.upload(data)? };
        let mut w = DeviceWeight { ty, k, n_rows, row_bytes, bytes };
        w.repack_uploaded(self, 0, n_rows)?;
        Ok(w)
    }

    /// `y[t][r] = Σ_j W[r][j]·x[t][j]`: x is [n_tok, k], y [n_tok, w.n_rows] (row-major f32),
    /// with f32 activations and sums ([`Precision::Exact`]).
    pub fn matmul(&self, w: WeightRef<'_>, x: &Buf<f32>, n_tok: usize, y: &mut Buf<f32>) -> Result<()> {
        self.matmul_prec(w, x, n_tok, y, Precision::Exact)
    }

    /// [`Gpu::matmul`] at `precision`: [`Precision::Fast`] runs batches of more than
    /// [`MMA_MIN_TOKENS`] tokens on tensor cores (sm_80+), f16 operands and f32 sums (and the
    /// GEMV up to that size; Exact takes the GEMV up to [`GEMV_MAX_TOKENS`], then the FMA tiles).
    pub fn matmul_prec(&self, w: WeightRef<'_>, x: &Buf<f32>, n_tok: usize, y: &mut Buf<f32>, precision: Precision) -> Result<()> {
        if self.uses_gemv_q8(w.ty(), w.k(), n_tok, precision) {
            return self.gemv_q8(&[w], x, &mut [y]);
        }
        let fast = precision == Precision::Fast && self.has_mma();
        let gemv_max = if fast { MMA_MIN_TOKENS } else { GEMV_MAX_TOKENS };
        let kernel = if self.uses_mmv(w.w.k, n_tok, precision) || self.uses_mmv_prompt(w.w.k, w.n_rows, n_tok, precision) {
            MatmulKernel::Mmv
        } else if n_tok <= gemv_max && w.w.k.is_multiple_of(8) {
            MatmulKernel::Gemv
        } else if self.uses_mma8(w, n_tok, precision) {
            MatmulKernel::Mma8 { tile_tokens: mma8_tile_tokens(n_tok, w.n_rows, self.info().n_sm) }
        } else if fast && n_tok > GEMV_MAX_TOKENS {
            MatmulKernel::Mma { tile_tokens: mma_tile_tokens(n_tok, w.n_rows, self.info().n_sm) }
        } else {
            MatmulKernel::Tiled
        };
        self.matmul_kernel(w, x, n_tok, y, kernel)
    }

    /// Whether [`Gpu::matmul_prec`] takes [`MatmulKernel::Mma8`] for `w` on `n_tok` tokens:
    /// Fast, more than [`MMA_MIN_TOKENS`] and at most [`MMA8_MAX_TOKENS`] tokens, not
    /// [`Gpu::uses_mmv_prompt`] (few rows), Q4_K, k % 256 == 0, rows 16-byte aligned, sm_80+
    /// (`EMBER_MATMUL_MMA8=0` turns it off).
    pub fn uses_mma8(&self, w: WeightRef<'_>, n_tok: usize, precision: Precision) -> bool {
        precision == Precision::Fast
            && (MMA_MIN_TOKENS + 1..=mma8_max_tokens()).contains(&n_tok)
            && !self.uses_mmv_prompt(w.k(), w.n_rows, n_tok, precision)
            && w.ty() == GgmlType::Q4K
            && w.k().is_multiple_of(256)
            && w.ptr().is_multiple_of(16)
            && self.has_mma()
            && mma8_on()
    }

    /// Whether [`Gpu::matmul_prec`] runs a weight of `k` columns on `n_tok` tokens with the
    /// GEMV kernel (what [`Gpu::matmul_multi`] does for several weights at once).
    pub fn uses_gemv(&self, k: usize, n_tok: usize, precision: Precision) -> bool {
        let gemv_max = if precision == Precision::Fast && self.has_mma() { MMA_MIN_TOKENS } else { GEMV_MAX_TOKENS };
        n_tok <= gemv_max && k.is_multiple_of(8)
    }

    /// Whether [`Gpu::matmul_prec`] takes [`MatmulKernel::Mmv`]: Fast, 2 to [`MMA_MIN_TOKENS`]
    /// tokens, k a multiple of 64, sm_80+ (`EMBER_MMV=0` turns it off).
    pub fn uses_mmv(&self, k: usize, n_tok: usize, precision: Precision) -> bool {
        precision == Precision::Fast
            && (2..=MMA_MIN_TOKENS).contains(&n_tok)
            && k.is_multiple_of(MMV_STEP)
            && k > 0
            && self.has_mma()
            && mmv_on()
    }

    /// Whether [`Gpu::matmul_prec`] takes [`MatmulKernel::Mmv`] for a prompt-sized batch: a
    /// weight of at most [`MMV_PROMPT_MAX_ROWS`] rows (the router, the shared expert's gate, the
    /// DeltaNet's alpha and beta), where the tensor-core tiles (128 rows a block) leave most SMs
    /// idle, each block walking all of k (F32 router, 512 tokens: ~94 us a call on the H100);
    /// `EMBER_MMV_PROMPT=0` turns it off.
    pub fn uses_mmv_prompt(&self, k: usize, n_rows: usize, n_tok: usize, precision: Precision) -> bool {
        precision == Precision::Fast
            && n_tok > MMA_MIN_TOKENS
            && n_rows <= MMV_PROMPT_MAX_ROWS
            && k.is_multiple_of(MMV_STEP)
            && k > 0
            && self.has_mma()
            && mmv_on()
            && mmv_prompt_on()
    }

    /// `ys[i] = x · ws[i]ᵀ` for 1 to [`GEMV_MULTI`] weights of one type and k in one GEMV
    /// launch (f32 activations and sums, as [`MatmulKernel::Gemv`]): a layer's several
    /// projections of the same input cost one launch.
    pub fn matmul_multi(&self, ws: &[WeightRef<'_>], x: &Buf<f32>, n_tok: usize, ys: &mut [&mut Buf<f32>]) -> Result<()> {
        self.matmul_multi_prec(ws, x, n_tok, ys, Precision::Exact)
    }

    /// [`Gpu::matmul_multi`] at `precision`: where [`Gpu::uses_mmv`], the weights share one
    /// [`MatmulKernel::Mmv`] launch (each weight's rows exactly as that kernel alone gives them).
    pub fn matmul_multi_prec(
        &self,
        ws: &[WeightRef<'_>],
        x: &Buf<f32>,
        n_tok: usize,
        ys: &mut [&mut Buf<f32>],
        precision: Precision,
    ) -> Result<()> {
        let n = ws.len();
        if n == 0 || n > GEMV_MULTI || ys.len() != n {
            return Err(shape(OP, format!("{n} weights and {} outputs in one launch (1 to {GEMV_MULTI})", ys.len())));
        }
        let (ty, k) = (ws[0].w.ty, ws[0].w.k);
        if ws.iter().any(|w| w.w.ty != ty || w.w.k != k) {
            return Err(shape(OP, "weights of one launch share their type and k".to_string()));
        }
        if !k.is_multiple_of(8) {
            return Err(shape(OP, format!("the GEMV needs k % 8 == 0, k = {k}")));
        }
        need(OP, "x", x, n_tok * k)?;
        let mmv = self.uses_mmv(k, n_tok, precision);
        let mut p = MatmulMultiParams {
            w: [0; GEMV_MULTI],
            y: [0; GEMV_MULTI],
            x: x.ptr(),
            n_rows: [0; GEMV_MULTI],
            row_bytes: [0; GEMV_MULTI],
            block0: [0; GEMV_MULTI + 1],
            ty: ty.id(),
            k: u32_of(OP, "k", k)?,
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            n: n as u32,
            ksplit: [1; GEMV_MULTI],
            prefetch: 0,
        };
        if ws.iter().map(|w| w.n_rows * w.w.row_bytes).sum::<usize>() <= super::gemv_q8::PREFETCH_MAX_BYTES {
            p.prefetch = super::l2_prefetch();
        }
        let mut blocks_so_far = 0u32;
        for (i, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
            need(OP, "y", y, n_tok * w.n_rows)?;
            p.w[i] = w.w.ptr() + (w.row0 * w.w.row_bytes) as u64;
            p.y[i] = y.ptr();
            p.n_rows[i] = u32_of(OP, "n_rows", w.n_rows)?;
            p.row_bytes[i] = u32_of(OP, "row_bytes", w.w.row_bytes)?;
            p.block0[i] = blocks_so_far;
            p.ksplit[i] = gemv_ksplit(w.n_rows, k) as u32;
            blocks_so_far += if mmv { u32_of(OP, "row blocks", w.n_rows.div_ceil(MMV_ROWS))? } else { gemv_blocks(w.n_rows, k) };
        }
        for b in &mut p.block0[n..] {
            *b = blocks_so_far;
        }
        if n_tok == 0 || blocks_so_far == 0 {
            return Ok(());
        }
        let suffix = type_suffix(ty).ok_or_else(|| shape(OP, format!("weight type {} has no CUDA kernel", ty.name())))?;
        // SAFETY (both launches): `p` is the kernel's parameter struct; every weight pointer
        // addresses its rows (WeightRef's range was checked), x holds n_tok·k values and each y
        // n_tok·n_rows (checked above); matmul_mmv's 16-byte activation loads need k % 64 == 0
        // (uses_mmv).
        if mmv {
            let aligned = ws.iter().all(|w| w.ptr().is_multiple_of(16));
            let (f, grid, smem) = self.mmv_function("matmul_mmv_multi", ty, k, ws[0].w.row_bytes, aligned, n_tok, blocks_so_far)?;
            return unsafe { self.launch(&f, grid, MMV_THREADS, smem, &p) };
        }
        let f = self.function(&MATMUL, &format!("matmul_gemv_multi_{suffix}"))?;
        let grid = (blocks_so_far, blocks(n_tok, GEMV_NT), 1);
        unsafe { self.launch(&f, grid, 32 * GEMV_WARPS as u32, 0, &p) }
    }

    /// Whether this GPU has the tensor-core kernels (`mma.sync` m16n8k16 with f16: sm_80+).
    pub fn has_mma(&self) -> bool {
        self.info().sm() >= 80
    }

    /// [`Gpu::matmul`] with a chosen kernel (tests and benchmarks). An error where the kernel
    /// does not apply: the GEMV needs k % 8 == 0, the tensor-core kernel sm_80 and a tile of
    /// 32, 64 or 128 tokens.
    pub fn matmul_kernel(&self, w: WeightRef<'_>, x: &Buf<f32>, n_tok: usize, y: &mut Buf<f32>, kernel: MatmulKernel) -> Result<()> {
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
            ksplit: gemv_ksplit(w.n_rows, dw.k) as u32,
        };
        // Every weight type passed upload_weight, so it has a suffix.
        let suffix = type_suffix(dw.ty).ok_or_else(|| shape(OP, format!("weight type {} has no CUDA kernel", dw.ty.name())))?;
        let (f, grid, threads) = match kernel {
            MatmulKernel::Gemv => {
                if !dw.k.is_multiple_of(8) {
                    return Err(shape(OP, format!("the GEMV needs k % 8 == 0, k = {}", dw.k)));
                }
                let f = self.function(&MATMUL, &format!("matmul_gemv_{suffix}"))?;
                (f, (gemv_blocks(w.n_rows, dw.k), blocks(n_tok, GEMV_NT), 1), 32 * GEMV_WARPS as u32)
            }
            MatmulKernel::Tiled => (self.function(&MATMUL, "matmul_tiled")?, (blocks(w.n_rows, 64), blocks(n_tok, 64), 1), 256),
            MatmulKernel::Mmv => {
                if !self.has_mma() {
                    return Err(shape(OP, format!("tensor-core matmul needs sm_80 or later, this GPU is sm_{}", self.info().sm())));
                }
                if !dw.k.is_multiple_of(MMV_STEP) {
                    return Err(shape(OP, format!("matmul_mmv needs k % {MMV_STEP} == 0, k = {}", dw.k)));
                }
                let row_blocks = u32_of(OP, "row blocks", w.n_rows.div_ceil(MMV_ROWS))?;
                let (f, grid, smem) =
                    self.mmv_function("matmul_mmv", dw.ty, dw.k, dw.row_bytes, w.ptr().is_multiple_of(16), n_tok, row_blocks)?;
                // SAFETY: as below; matmul_mmv's dynamic shared memory is what mmv_function sized.
                return unsafe { self.launch(&f, grid, MMV_THREADS, smem, &p) };
            }
            MatmulKernel::Mma8 { tile_tokens } => return self.matmul_mma8(w, x, n_tok, y, tile_tokens),
            MatmulKernel::Mma { tile_tokens } => {
                if !self.has_mma() {
                    return Err(shape(OP, format!("tensor-core matmul needs sm_80 or later, this GPU is sm_{}", self.info().sm())));
                }
                if ![32, 64, 128].contains(&tile_tokens) {
                    return Err(shape(OP, format!("tensor-core tiles are 32, 64 or 128 tokens, not {tile_tokens}")));
                }
                let row_blocks = w.n_rows.div_ceil(MMA_ROWS);
                if row_blocks > 65_535 {
                    return Err(shape(OP, format!("{} rows (at most {} per call)", w.n_rows, 65_535 * MMA_ROWS)));
                }
                let f = self.function(&MATMUL, &format!("matmul_mma_{suffix}_{tile_tokens}"))?;
                (f, (blocks(n_tok, tile_tokens), row_blocks as u32, 1), MMA_THREADS)
            }
        };
        // SAFETY: x holds n_tok·k floats and y n_tok·n_rows (checked above); the weight pointer
        // plus n_rows·row_bytes stays inside the uploaded bytes (WeightRef is bounds-checked),
        // and its alignment is that of row_bytes, which the wide loads rely on (GEMV: 16-byte
        // loads for f32/f16/bf16, which k % 8 == 0 makes aligned; 4-byte loads for
        // Q4_K/Q5_K/IQ4_XS, whose block sizes are multiples of 4; Q8_0/Q6_K read 2 bytes at a
        // time. The tensor-core tiles: 8-byte loads for Q4_K/Q5_K/IQ4_XS, multiples of 8; float
        // rows use 16-byte loads only when k % 8 == 0, activations when k % 4 == 0; matmul_mmv
        // reads weights as the tiles do and activations 16 bytes at a time, k % 64 == 0).
        unsafe { self.launch(&f, grid, threads, 0, &p) }
    }
}

#[repr(C)]
struct MatmulMma8Params {
    w: u64,
    xq: u64,
    y: u64,
    k: u32,
    n_rows: u32,
    n_tok: u32,
    row_bytes: u32,
}

// SAFETY: plain #[repr(C)] data matching `MatmulMma8Params` in kernels/matmul_mma8.cu (three
// u64 then four u32: no padding).
unsafe impl DeviceRepr for MatmulMma8Params {}

impl Gpu {
    /// [`MatmulKernel::Mma8`]: x quantised into the int8 scratch, then `matmul_mma8s_q4_k` (or
    /// its 64-token form).
    fn matmul_mma8(&self, w: WeightRef<'_>, x: &Buf<f32>, n_tok: usize, y: &mut Buf<f32>, tile_tokens: usize) -> Result<()> {
        let dw = w.w;
        if tile_tokens != 32 && tile_tokens != 64 {
            return Err(shape(OP, format!("int8 tensor-core tiles are 32 or 64 tokens, not {tile_tokens}")));
        }
        if !self.has_mma() {
            return Err(shape(OP, format!("tensor-core matmul needs sm_80 or later, this GPU is sm_{}", self.info().sm())));
        }
        if dw.ty != GgmlType::Q4K || !dw.k.is_multiple_of(256) || !w.ptr().is_multiple_of(16) {
            return Err(shape(
                OP,
                format!("the int8 tensor-core matmul takes Q4_K rows of k % 256 == 0, 16-byte aligned: {}, k = {}", dw.ty.name(), dw.k),
            ));
        }
        let row_blocks = w.n_rows.div_ceil(128);
        if row_blocks > 65_535 {
            return Err(shape(OP, format!("{} rows (at most {} per call)", w.n_rows, 65_535 * 128)));
        }
        let xq = self.q8_scratch(q8_bytes(n_tok * dw.k))?;
        self.quantize_q8(x, n_tok * dw.k)?;
        let p = MatmulMma8Params {
            w: w.ptr(),
            xq,
            y: y.ptr(),
            k: u32_of(OP, "k", dw.k)?,
            n_rows: u32_of(OP, "n_rows", w.n_rows)?,
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            row_bytes: u32_of(OP, "row_bytes", dw.row_bytes)?,
        };
        let name = if tile_tokens == 32 { "matmul_mma8s_q4_k" } else { "matmul_mma8s_q4_k_64" };
        let smem = mm8_smem(tile_tokens);
        let f = self.function(&MATMUL_MMA8, name)?;
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        f.set_attribute(attr, smem as i32).map_err(|e| shape(OP, format!("{name}'s {smem} bytes of shared memory: {e:?}")))?;
        // SAFETY: matmul_kernel checked x (n_tok·k floats) and y (n_tok·n_rows); quantize_q8
        // just wrote x's n_tok·k int8 values and their scales into the scratch at xq (sized
        // above: the same buffer). The kernel reads rows min(r, n_rows − 1) of the weight (Q4_K,
        // whole super-blocks, 16-byte aligned: checked), writes y only for rows < n_rows and
        // tokens < n_tok, and uses the `smem` bytes of dynamic shared memory set above.
        unsafe { self.launch(&f, (blocks(n_tok, tile_tokens), row_blocks as u32, 1), 256, smem, &p) }
    }

    /// `matmul_mmv`'s function (`base`: the one-weight or the multi entry), grid and dynamic
    /// shared memory for `n_tok` tokens over `row_blocks` blocks of 32 rows: 8 tokens a pass up
    /// to 8, else 16; the staged entry where the weight's blocks come in 256-weight super-blocks
    /// (k % 256 == 0) and its rows are whole 16-byte chunks from a 16-byte aligned start
    /// (`aligned`), unless `EMBER_MMV_STAGED=0`.
    #[allow(clippy::too_many_arguments)]
    fn mmv_function(
        &self,
        base: &str,
        ty: GgmlType,
        k: usize,
        row_bytes: usize,
        aligned: bool,
        n_tok: usize,
        row_blocks: u32,
    ) -> Result<(CudaFunction, (u32, u32, u32), u32)> {
        let suffix = type_suffix(ty).ok_or_else(|| shape(OP, format!("weight type {} has no CUDA kernel", ty.name())))?;
        if n_tok.div_ceil(16) > 65_535 {
            return Err(shape(OP, format!("{n_tok} tokens (at most {} per matmul_mmv call)", 65_535 * 16)));
        }
        let (pass, grid) = if n_tok <= 8 { (8, (row_blocks, 1, 1)) } else { (16, (row_blocks, blocks(n_tok, 16), 1)) };
        let staged = mmv_sb_bytes(ty).filter(|_| aligned && k.is_multiple_of(256) && row_bytes.is_multiple_of(16) && mmv_staged_on());
        let Some(sb) = staged else {
            let f = self.function(&MATMUL, &format!("{base}_{suffix}_{pass}"))?;
            return Ok((f, grid, (MMV_WARPS * MMV_ROWS * (pass + 1) * 4) as u32));
        };
        let smem = MMV_ROWS * (MMV_WARPS * sb + 16);
        let f = self.function(&MATMUL, &format!("{base}_{suffix}_{pass}_staged"))?;
        if smem > 48 << 10 {
            let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, smem as i32).map_err(|e| shape(OP, format!("matmul_mmv's {smem} bytes of shared memory: {e:?}")))?;
        }
        Ok((f, grid, smem as u32))
    }
}

/// Bytes of 256 weights of the block types `matmul_mmv` stages (`mmv_sb_bytes` in
/// kernels/matmul.cu).
fn mmv_sb_bytes(ty: GgmlType) -> Option<usize> {
    // (Not Q6_K: the GPU's repacked rows hold their d's after the runs, outside a staged window
    // of super-blocks; src/ops/q6_repack.rs.)
    let staged = matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::IQ4XS | GgmlType::Q8_0);
    staged.then(|| ty.row_bytes(256)).flatten()
}

/// Whether prompt-sized batches of small weights may take `matmul_mmv` (`EMBER_MMV_PROMPT=0`
/// turns it off).
fn mmv_prompt_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch(&ON, "EMBER_MMV_PROMPT")
}

/// Whether `matmul_mmv` may stage its rows in shared memory (`EMBER_MMV_STAGED=0` turns it off).
fn mmv_staged_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch(&ON, "EMBER_MMV_STAGED")
}

/// Whether the small-batch tensor-core kernel may be picked (`EMBER_MMV=0` turns it off).
fn mmv_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch(&ON, "EMBER_MMV")
}

/// Tokens per tensor-core tile for a matmul of `n_tok` tokens and `n_rows` rows: 128 (the
/// fewest weight decodes per product) where that still fills every SM once, else 64 where that
/// gives at least half a wave, else 32. Measured on the H200 at 512 tokens (ms, tiles of
/// 32 / 64 / 128): Q4_K 8192 rows 0.334 / 0.204 / 0.156; 4096 rows 0.174 / 0.121 / 0.118;
/// k 4096, 2048 rows 0.212 / 0.185 / 0.230; Q8_0 512 rows 0.087 / 0.101 / 0.123; F16 4096
/// rows 0.122 / 0.094 / 0.114; Q6_K 248,320 rows 11.4 / 6.9 / 5.2.
pub(crate) fn mma_tile_tokens(n_tok: usize, n_rows: usize, n_sm: u32) -> usize {
    let (row_blocks, n_sm) = (n_rows.div_ceil(MMA_ROWS), n_sm as usize);
    if n_tok >= 128 && n_tok.div_ceil(128) * row_blocks >= n_sm {
        128
    } else if n_tok > 32 && 2 * n_tok.div_ceil(64) * row_blocks >= n_sm {
        64
    } else {
        32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64-token int8 blocks where they give every SM of the GPU one (132 SMs: the H100's), 32
    /// below (the cases `mma8_tile_tokens`'s comment measured).
    #[test]
    fn int8_tiles_take_64_tokens_where_they_fill_the_gpu() {
        if std::env::var_os("EMBER_MATMUL_MMA8_64").is_some() {
            return; // fixed by the environment for measuring
        }
        assert_eq!(mma8_tile_tokens(512, 8192, 132), 64);
        assert_eq!(mma8_tile_tokens(512, 4096, 132), 64); // 8 x 32 blocks
        assert_eq!(mma8_tile_tokens(512, 2048, 132), 64); // 8 x 16 = 128 blocks of 64
        assert_eq!(mma8_tile_tokens(128, 8192, 132), 64); // 2 x 64
        assert_eq!(mma8_tile_tokens(128, 2048, 132), 32); // 2 x 16 = 32 blocks of 64
        assert_eq!(mma8_tile_tokens(256, 2048, 132), 32); // 64 blocks of 64
        assert_eq!(mma8_tile_tokens(2048, 2048, 132), 64);
        assert_eq!(mma8_tile_tokens(41, 512, 132), 32);
    }

    /// [`mm8_smem`] against kernels/matmul_mma8.cu's `Mm8` layout: `STAGES` stages of 128 rows'
    /// super-block, the tokens' values at MM8_XLD and their block scales.
    #[test]
    fn int8_tiles_shared_memory_matches_the_kernel_layout() {
        let src = include_str!("../../kernels/matmul_mma8.cu");
        assert!(src.contains("#define MM8_ROWS 128") && src.contains("#define MM8_XLD 272"), "the layout's constants moved");
        assert!(src.contains("STAGES = TOK == 32 ? 3 : 2;"), "the stage counts moved");
        for (tok, stages) in [(32u32, 3u32), (64, 2)] {
            assert_eq!(mm8_smem(tok as usize), stages * (128 * 144 + tok * 272 + 8 * (tok + 1) * 8), "{tok} tokens");
        }
    }
}
