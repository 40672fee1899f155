use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::KV_APPEND;

const OP: &str = "kv_append";

/// Rows per KV page (`KV_PAGE` in kernels/kv_append.cu and attention.cuh; ember_ops::KV_PAGE).
pub const KV_PAGE: usize = 64;

/// The paged KV caches of a store: `n_pages` pages of [`KV_PAGE`] rows of `width` values of type
/// `ty` (F32, F16 or Q8_0) in `pool`, and a page table row of `stride` page ids per cache, cache
/// `(slot · n_kv + layer) · 2 + (0 for K, 1 for V)`.
#[derive(Debug, Clone, Copy)]
pub struct KvPages<'a> {
    pub pool: &'a Buf<u8>,
    pub table: &'a Buf<u32>,
    pub ty: GgmlType,
    pub width: usize,
    pub n_pages: usize,
    pub stride: usize,
    pub n_kv: usize,
    pub n_slots: usize,
    /// The attention layer (its ordinal among the KV layers) the op works on.
    pub layer: usize,
}

impl KvPages<'_> {
    /// Checks the pool and table sizes; returns the bytes of one row.
    pub(crate) fn check(&self, op: &'static str) -> Result<usize> {
        if !matches!(self.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0) {
            return Err(shape(op, format!("KV rows of type {} (F32, F16 or Q8_0)", self.ty.name())));
        }
        let rb = self.ty.row_bytes(self.width).ok_or_else(|| shape(op, format!("width {} is not a whole number of blocks", self.width)))?;
        if self.layer >= self.n_kv || self.stride == 0 {
            return Err(shape(op, format!("layer {} of {} KV layers, table stride {}", self.layer, self.n_kv, self.stride)));
        }
        need(op, "pool", self.pool, self.n_pages * KV_PAGE * rb)?;
        need(op, "page table", self.table, self.n_slots * self.n_kv * 2 * self.stride)?;
        Ok(rb)
    }
}

/// Where a step's K and V rows go in the paged caches (kernels/kv_store.cuh's `KvDest`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct KvDest {
    pool: u64,
    table: u64,
    row_slot: u64,
    pos: u64,
    ty: u32,
    row_bytes: u32,
    stride: u32,
    layer: u32,
    n_kv: u32,
    n_slots: u32,
    n_pages: u32,
    pad: u32,
}

impl KvDest {
    /// No cache: a launch that takes a `KvDest` and writes no rows.
    pub(super) fn none() -> KvDest {
        KvDest { pool: 0, table: 0, row_slot: 0, pos: 0, ty: 0, row_bytes: 0, stride: 0, layer: 0, n_kv: 0, n_slots: 0, n_pages: 0, pad: 0 }
    }

    /// The caches of `pages` at the step's rows' slots and positions (`row_slot`, `pos`: at
    /// least `n_rows` each), after checking the pages (see [`KvPages::check`]).
    pub(super) fn new(op: &'static str, pages: &KvPages<'_>, n_rows: usize, row_slot: &Buf<u32>, pos: &Buf<u32>) -> Result<KvDest> {
        let rb = pages.check(op)?;
        need(op, "row slots", row_slot, n_rows)?;
        need(op, "positions", pos, n_rows)?;
        Ok(KvDest {
            pool: pages.pool.ptr(),
            table: pages.table.ptr(),
            row_slot: row_slot.ptr(),
            pos: pos.ptr(),
            ty: pages.ty.id(),
            row_bytes: u32_of(op, "row bytes", rb)?,
            stride: u32_of(op, "stride", pages.stride)?,
            layer: pages.layer as u32,
            n_kv: u32_of(op, "n_kv", pages.n_kv)?,
            n_slots: u32_of(op, "n_slots", pages.n_slots)?,
            n_pages: u32_of(op, "n_pages", pages.n_pages)?,
            pad: 0,
        })
    }
}

#[repr(C)]
struct KvAppendParams {
    k: u64,
    v: u64,
    dst: KvDest,
    n_rows: u32,
    width: u32,
}

// SAFETY: plain #[repr(C)] data matching `KvAppendParams` and `KvDest` in kernels/kv_append.cu
// and kv_store.cuh (KvDest: 4 u64, 8 u32, 64 bytes; then 2 u32: no padding).
unsafe impl DeviceRepr for KvAppendParams {}

impl Gpu {
    /// Writes row r of k and v [n_rows, width] at position `pos[r]` of the K and V caches of slot
    /// `row_slot[r]` (layer `pages.layer`), converted to the cache type. The pages must be in the
    /// table already; a slot, position or page out of range skips the row (device-side indices).
    pub fn kv_append(
        &self,
        pages: &KvPages<'_>,
        k: &Buf<f32>,
        v: &Buf<f32>,
        n_rows: usize,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
    ) -> Result<()> {
        let dst = KvDest::new(OP, pages, n_rows, row_slot, pos)?;
        need(OP, "k", k, n_rows * pages.width)?;
        need(OP, "v", v, n_rows * pages.width)?;
        if n_rows == 0 || pages.width == 0 {
            return Ok(());
        }
        let p =
            KvAppendParams { k: k.ptr(), v: v.ptr(), dst, n_rows: u32_of(OP, "n_rows", n_rows)?, width: u32_of(OP, "width", pages.width)? };
        let f = self.function(&KV_APPEND, "kv_append")?;
        // SAFETY: k and v hold n_rows·width floats, row_slot and pos n_rows values; the pool holds
        // n_pages pages and the table n_slots·n_kv·2 rows of stride ids (checked above); the kernel
        // skips a row whose slot, page index or page id is out of those ranges.
        unsafe { self.launch(&f, (p.n_rows, 2, 1), 128, 0, &p) }
    }
}
