use cudarc::driver::DeviceRepr;

use super::kv_append::KvPages;
use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::ATTENTION;

const OP: &str = "attention";
/// `ATT_MAX_PER_LANE` · 32 in kernels/attention.cu.
const MAX_HEAD_DIM: usize = 256;
/// Warps per block (`ATT_MAX_WARPS` at most).
const WARPS: u32 = 8;

/// The heads of [`Gpu::attention`] (ember_ops::AttnHeads plus the rows).
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub n_rows: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
}

#[repr(C)]
struct AttentionParams {
    q: u64,
    out: u64,
    pool: u64,
    table: u64,
    row_slot: u64,
    pos: u64,
    n_rows: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    ty: u32,
    row_bytes: u32,
    stride: u32,
    layer: u32,
    n_kv: u32,
    n_slots: u32,
    n_pages: u32,
    scale: f32,
}

// SAFETY: plain #[repr(C)] data matching `AttentionParams` in kernels/attention.cu.
unsafe impl DeviceRepr for AttentionParams {}

impl Gpu {
    /// Causal GQA attention of q [n_rows, n_head·hd]: row r attends over positions
    /// 0..=pos[r] of the K/V caches of slot `row_slot[r]` (layer `pages.layer`) into out
    /// [n_rows, n_head·hd]. The caller guarantees those positions were written; a slot or page
    /// out of range gives a NaN row.
    pub fn attention(
        &self,
        pages: &KvPages<'_>,
        s: AttentionShape,
        q: &Buf<f32>,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        let rb = pages.check(OP)?;
        let (nh, nkv, hd) = (s.n_head, s.n_head_kv, s.head_dim);
        if nkv == 0 || !nh.is_multiple_of(nkv) || hd == 0 || hd > MAX_HEAD_DIM || pages.width != nkv * hd {
            return Err(shape(OP, format!("heads {nh}/{nkv}x{hd} over cache rows of {} (head_dim at most {MAX_HEAD_DIM})", pages.width)));
        }
        if s.n_rows > 65535 {
            return Err(shape(OP, format!("{} rows (at most 65535 per call)", s.n_rows)));
        }
        need(OP, "q", q, s.n_rows * nh * hd)?;
        need(OP, "row slots", row_slot, s.n_rows)?;
        need(OP, "positions", pos, s.n_rows)?;
        need(OP, "out", out, s.n_rows * nh * hd)?;
        if s.n_rows == 0 || nh == 0 {
            return Ok(());
        }
        let p = AttentionParams {
            q: q.ptr(),
            out: out.ptr(),
            pool: pages.pool.ptr(),
            table: pages.table.ptr(),
            row_slot: row_slot.ptr(),
            pos: pos.ptr(),
            n_rows: s.n_rows as u32,
            n_head: u32_of(OP, "n_head", nh)?,
            n_head_kv: u32_of(OP, "n_head_kv", nkv)?,
            head_dim: hd as u32,
            ty: pages.ty.id(),
            row_bytes: u32_of(OP, "row bytes", rb)?,
            stride: u32_of(OP, "stride", pages.stride)?,
            layer: pages.layer as u32,
            n_kv: u32_of(OP, "n_kv", pages.n_kv)?,
            n_slots: u32_of(OP, "n_slots", pages.n_slots)?,
            n_pages: u32_of(OP, "n_pages", pages.n_pages)?,
            scale: s.scale,
        };
        let f = self.function(&ATTENTION, "attention")?;
        // SAFETY: q and out hold n_rows·n_head·hd floats, row_slot and pos n_rows values, the pool
        // n_pages pages and the table its rows (checked above); the kernel reads table entries
        // only below ceil((pos + 1) / 64) <= stride and checks slots and page ids; hd <= 256.
        unsafe { self.launch(&f, (p.n_head, p.n_rows, 1), 32 * WARPS, 0, &p) }
    }
}
