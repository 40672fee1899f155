//! Decode GEMVs on int8 activations (kernels/gemv_q8.cu): one token's x quantised to int8 in
//! blocks of 32, then the weight rows summed against it with integer dot products. What
//! [`Precision::Fast`] runs for one-token matmuls of Q4_K, Q6_K and Q8_0 weights (the types of
//! the Q4_K_M and UD-Q4_K_M files' trunks and experts); `EMBER_GEMV_Q8=0` turns it off.

use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::matmul::{Precision, WeightRef};
use super::{blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::GEMV_Q8;

const OP: &str = "gemv_q8";
/// Weights per launch (`GEMV_Q8_MULTI` in kernels/gemv_q8.cu).
pub const GEMV_Q8_MULTI: usize = 4;
/// Threads per block (`GEMV_Q8_THREADS`).
pub(crate) const THREADS: usize = 128;
/// Threads per SM the launcher aims to give work (an H100/H200 SM holds 2,048 at once), by
/// weight type; `EMBER_Q8_FILL` overrides it for every type (measurements). Fewer workers per
/// row give each worker several weight blocks in flight instead of one and shorter cross-lane
/// sums. Measured on the H200, full-size 35B Q4_K_M, tg128 (2026-12-04): Q4_K and Q6_K at
/// 2048 → 291.8 t/s, 1024 → 300.8, 512 → 324.1 (three alternating rounds each, against
/// 1024's 302.8 in its own rounds), 256 → 307.5 (against 512's 324.0); Q6_K alone at 2048
/// 341.2 against 512's 348.4 (one round). Q8_0, whose unit is a lane's 8 bytes of 2-byte loads,
/// wants more workers (bench/gpu/gemv-micro.cu, one 12,288 × 2048 GEMV launched back to back
/// with programmatic launch: 19.6 us at 512, 11.8 at 2048).
fn threads_per_sm(ty: GgmlType) -> usize {
    static FILL: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let set = *FILL.get_or_init(|| std::env::var("EMBER_Q8_FILL").ok().and_then(|v| v.parse().ok()).filter(|&v| v > 0));
    set.unwrap_or(if ty == GgmlType::Q8_0 { 2048 } else { 512 })
}

/// Launches whose weights together take at most this many bytes ask for them in L2 before they
/// wait for the kernel ahead (`prefetch` in GemvQ8Params). Larger ones would push their own
/// first rows out of the H200's 60 MB L2 before reading them (measured: the 540 MB Q8_0 head
/// 384 → 425 us with it).
pub(crate) const PREFETCH_MAX_BYTES: usize = 32 << 20;

/// Weights of at least this many bytes (the output head) take gemv_q8_rows where their type
/// has it (Q6_K, Q8_0); `EMBER_GEMV_ROWS=0` turns that off. (DeltaNet's 13.8 MB Q6_K qkv on it
/// measured no faster: docs/perf.md g19.)
pub(crate) const ROWS_MIN_BYTES: usize = 64 << 20;

/// Rows per warp of gemv_q8_rows by type (`GEMV_Q8_ROWS_*`), and its warps per block.
fn rows_per_warp(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q6K => Some(4),
        GgmlType::Q8_0 => Some(2),
        _ => None,
    }
}
const ROWS_WARPS: usize = 4;

/// Whether a layer's one-token projections of one input go in one launch whatever their int8
/// types (`gemv_q8_mixed`: DeltaNet's Q6_K qkv with its Q4_K gate, a and b in the Q4_K_M
/// recipe); `EMBER_GEMV_MIXED=0`: one launch per type, as before.
pub(crate) fn gemv_q8_mixed_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch(&ON, "EMBER_GEMV_MIXED")
}

fn rows_kernel_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::switch(&ON, "EMBER_GEMV_ROWS")
}

#[repr(C)]
struct QuantizeQ8Params {
    x: u64,
    q: u64,
    n: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `QuantizeQ8Params` in kernels/gemv_q8.cu.
unsafe impl DeviceRepr for QuantizeQ8Params {}

#[repr(C)]
struct GemvQ8Params {
    w: [u64; GEMV_Q8_MULTI],
    y: [u64; GEMV_Q8_MULTI],
    xq: u64,
    n_rows: [u32; GEMV_Q8_MULTI],
    row_bytes: [u32; GEMV_Q8_MULTI],
    block0: [u32; GEMV_Q8_MULTI + 1],
    wr: [u32; GEMV_Q8_MULTI],
    k: u32,
    n: u32,
    prefetch: u32,
}

// SAFETY: plain #[repr(C)] data matching `GemvQ8Params` in kernels/gemv_q8.cu (72 bytes of u64,
// then 17 + 3 u32: 152 bytes, no padding in either language).
unsafe impl DeviceRepr for GemvQ8Params {}

#[repr(C)]
struct GemvQ8MixedParams {
    g: GemvQ8Params,
    ty: [u32; GEMV_Q8_MULTI],
}

// SAFETY: plain #[repr(C)] data matching `GemvQ8MixedParams` in kernels/gemv_q8.cu (152 bytes,
// then 4 u32: 168 bytes, a multiple of the 8-byte alignment; no padding in either language).
unsafe impl DeviceRepr for GemvQ8MixedParams {}

#[repr(C)]
struct GemvQ8RowsParams {
    w: u64,
    y: u64,
    xq: u64,
    n_rows: u32,
    row_bytes: u32,
    k: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `GemvQ8RowsParams` in kernels/gemv_q8.cu (3 u64, 4 u32:
// 40 bytes, no padding in either language).
unsafe impl DeviceRepr for GemvQ8RowsParams {}

/// Lanes and weights per unit of work (`Q8Unit<TY>::L`, `::W`) of the types the kernel has.
pub(crate) fn unit(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        GgmlType::Q4K | GgmlType::Q6K => Some((8, 256)),
        GgmlType::Q8_0 => Some((4, 32)),
        _ => None,
    }
}

pub(crate) fn suffix(ty: GgmlType) -> Option<&'static str> {
    match ty {
        GgmlType::Q4K => Some("q4_k"),
        GgmlType::Q6K => Some("q6_k"),
        GgmlType::Q8_0 => Some("q8_0"),
        _ => None,
    }
}

/// Bytes of [`Gpu::quantize_q8`]'s output for `k` values: the int8 values, then a (d, d·Σq)
/// pair of f32 per block of 32.
pub fn q8_bytes(k: usize) -> usize {
    k + 8 * k.div_ceil(32)
}

/// Workers (of `lanes` lanes) per row for a weight of `n_rows` rows of `n_units` units: enough
/// that the launch fills every SM, at most one per unit and what a block holds.
pub(crate) fn workers_per_row(ty: GgmlType, n_rows: usize, n_units: usize, lanes: usize, n_sm: u32) -> usize {
    let want = (n_sm as usize * threads_per_sm(ty)).div_ceil(n_rows.max(1) * lanes).next_power_of_two();
    let units = if n_units.is_power_of_two() { n_units } else { n_units.next_power_of_two() / 2 };
    want.min(units.max(1)).min(THREADS / lanes)
}

impl Gpu {
    /// Whether one-token matmuls of `ty` weights of `k` columns take the int8 GEMV at
    /// `precision` (Fast only: the activations' rounding is Fast's error).
    pub fn uses_gemv_q8(&self, ty: GgmlType, k: usize, n_tok: usize, precision: Precision) -> bool {
        precision == Precision::Fast && n_tok == 1 && self.gemv_q8_on() && unit(ty).is_some_and(|(_, w)| k > 0 && k.is_multiple_of(w))
    }

    /// Quantises `x` (k values) into the GPU's int8 activation scratch, which
    /// [`Gpu::gemv_q8_quantized`] reads until the next call.
    pub fn quantize_q8(&self, x: &Buf<f32>, k: usize) -> Result<()> {
        need(OP, "x", x, k)?;
        if !k.is_multiple_of(32) || k == 0 {
            return Err(shape(OP, format!("int8 activations come in blocks of 32 values, k = {k}")));
        }
        let q = self.q8_scratch(q8_bytes(k))?;
        self.bump_q8_generation();
        let p = QuantizeQ8Params { x: x.ptr(), q, n: u32_of(OP, "k", k)?, pad: 0 };
        let f = self.function(&GEMV_Q8, "quantize_q8")?;
        // SAFETY: x holds k floats (checked); the scratch holds q8_bytes(k) bytes; one warp per
        // block of 32 values, blocks of 8 warps.
        unsafe { self.launch(&f, (blocks(k / 32, 8), 1, 1), 256, 0, &p) }
    }

    /// `ys[i] = x · ws[i]ᵀ` for one token, 1 to [`GEMV_Q8_MULTI`] weights of one k, from the x
    /// that [`Gpu::quantize_q8`] last quantised (with this k). Weights of one type take that
    /// type's kernel; of several types, `gemv_q8_mixed`, whose outputs are the same bits.
    pub fn gemv_q8_quantized(&self, ws: &[WeightRef<'_>], k: usize, ys: &mut [&mut Buf<f32>]) -> Result<()> {
        let n = ws.len();
        if n == 0 || n > GEMV_Q8_MULTI || ys.len() != n {
            return Err(shape(OP, format!("{n} weights and {} outputs in one launch (1 to {GEMV_Q8_MULTI})", ys.len())));
        }
        if let Some(w) = ws.iter().find(|w| w.k() != k) {
            return Err(shape(OP, format!("weights of one launch share k = {k} (one has {})", w.k())));
        }
        for w in ws {
            let ty = w.ty();
            let Some((_, per_unit)) = unit(ty) else { return Err(shape(OP, format!("no int8 GEMV for {}", ty.name()))) };
            if !k.is_multiple_of(per_unit) || k == 0 {
                return Err(shape(OP, format!("{} rows of k = {k} are not whole blocks of {per_unit}", ty.name())));
            }
        }
        let ty = ws[0].ty();
        let mixed = ws.iter().any(|w| w.ty() != ty);
        let q = self.q8_scratch(q8_bytes(k))?;
        if n == 1 && self.gemv_q8_rows(&ws[0], k, q, ys[0])? {
            return Ok(());
        }
        let bytes: usize = ws.iter().map(|w| w.n_rows * w.row_bytes()).sum();
        let mut p = GemvQ8Params {
            w: [0; GEMV_Q8_MULTI],
            y: [0; GEMV_Q8_MULTI],
            xq: q,
            n_rows: [0; GEMV_Q8_MULTI],
            row_bytes: [0; GEMV_Q8_MULTI],
            block0: [0; GEMV_Q8_MULTI + 1],
            wr: [1; GEMV_Q8_MULTI],
            k: u32_of(OP, "k", k)?,
            n: n as u32,
            prefetch: if bytes <= PREFETCH_MAX_BYTES { super::l2_prefetch() } else { 0 },
        };
        let mut total = 0u32;
        let mut tys = [0u32; GEMV_Q8_MULTI];
        for (i, (w, y)) in ws.iter().zip(ys.iter()).enumerate() {
            need(OP, "y", y, w.n_rows)?;
            let Some((lanes, per_unit)) = unit(w.ty()) else { unreachable!("every type was checked above") };
            let wr = workers_per_row(w.ty(), w.n_rows, k / per_unit, lanes, self.info().n_sm);
            tys[i] = w.ty().id();
            p.w[i] = w.ptr();
            p.y[i] = y.ptr();
            p.n_rows[i] = u32_of(OP, "n_rows", w.n_rows)?;
            p.row_bytes[i] = u32_of(OP, "row_bytes", w.row_bytes())?;
            p.wr[i] = wr as u32;
            p.block0[i] = total;
            total += blocks(w.n_rows, THREADS / (wr * lanes));
        }
        for b in &mut p.block0[n..] {
            *b = total;
        }
        if total == 0 {
            return Ok(());
        }
        // SAFETY (both launches): every weight pointer addresses n_rows rows of row_bytes
        // (WeightRef's range was checked), of whole blocks of its type (k % per_unit == 0 for
        // each); each y holds n_rows floats (checked); the scratch holds q8_bytes(k). Alignment:
        // Q4_K rows and blocks are multiples of 16 bytes (the kernel's 16-byte loads), Q6_K and
        // Q8_0 are read 2 bytes at a time; the int8 x is read 16 (Q4_K) or 8 bytes at a time at
        // multiples of that. gemv_q8_mixed's ty[i] is weight i's type, one the kernel has.
        if mixed {
            let f = self.function(&GEMV_Q8, "gemv_q8_mixed")?;
            let p = GemvQ8MixedParams { g: p, ty: tys };
            return unsafe { self.launch(&f, (total, 1, 1), THREADS as u32, 0, &p) };
        }
        let Some(sfx) = suffix(ty) else { unreachable!("every type was checked above") };
        let f = self.function(&GEMV_Q8, &format!("gemv_q8_{sfx}"))?;
        unsafe { self.launch(&f, (total, 1, 1), THREADS as u32, 0, &p) }
    }

    /// `y = x · wᵀ` by gemv_q8_rows when `w` is large and of a type it has, its rows whole
    /// 16-byte chunks and the shared memory fits; false (nothing launched) otherwise.
    fn gemv_q8_rows(&self, w: &WeightRef<'_>, k: usize, xq: u64, y: &mut Buf<f32>) -> Result<bool> {
        let (ty, rb) = (w.ty(), w.row_bytes());
        let (Some(r), Some(sfx)) = (rows_per_warp(ty), suffix(ty)) else { return Ok(false) };
        let smem = ROWS_WARPS * r * rb;
        if !rows_kernel_on() || w.n_rows * rb < ROWS_MIN_BYTES || !rb.is_multiple_of(16) || !w.ptr().is_multiple_of(16) || smem > 48 << 10 {
            return Ok(false);
        }
        need(OP, "y", y, w.n_rows)?;
        let p = GemvQ8RowsParams {
            w: w.ptr(),
            y: y.ptr(),
            xq,
            n_rows: u32_of(OP, "n_rows", w.n_rows)?,
            row_bytes: u32_of(OP, "row_bytes", rb)?,
            k: u32_of(OP, "k", k)?,
            pad: 0,
        };
        let f = self.function(&GEMV_Q8, &format!("gemv_q8_rows_{sfx}"))?;
        // SAFETY: w addresses n_rows rows of row_bytes (WeightRef's range), whole blocks of its
        // type (the caller checked k), at a 16-byte aligned address with rows of whole 16-byte
        // chunks (checked: the kernel's 16-byte copies); y holds n_rows floats (checked); the
        // scratch holds q8_bytes(k); each warp's R rows fit its share of the shared memory.
        unsafe { self.launch(&f, (blocks(w.n_rows, ROWS_WARPS * r), 1, 1), (32 * ROWS_WARPS) as u32, smem as u32, &p)? };
        Ok(true)
    }

    /// [`Gpu::quantize_q8`] then [`Gpu::gemv_q8_quantized`].
    pub fn gemv_q8(&self, ws: &[WeightRef<'_>], x: &Buf<f32>, ys: &mut [&mut Buf<f32>]) -> Result<()> {
        let k = ws.first().map_or(0, |w| w.k());
        self.quantize_q8(x, k)?;
        self.gemv_q8_quantized(ws, k, ys)
    }
}
