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

/// Keys per range of the split attention (decode): a multiple of the 64-row page, so a range
/// reads whole pages.
pub const ATTENTION_SPLIT_KEYS: usize = 256;

/// Keys per range: [`ATTENTION_SPLIT_KEYS`], more when that would need over 65,535 ranges.
fn split_keys(s: &AttentionShape) -> usize {
    ATTENTION_SPLIT_KEYS.max(s.max_keys.div_ceil(65535))
}

/// The heads of [`Gpu::attention`] (ember_ops::AttnHeads plus the rows).
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub n_rows: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// The most keys any row sees (its position + 1).
    pub max_keys: usize,
}

#[repr(C)]
struct AttentionParams {
    q: u64,
    out: u64,
    pool: u64,
    table: u64,
    row_slot: u64,
    pos: u64,
    part_ml: u64,
    part_acc: u64,
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
    n_split: u32,
    keys_per_split: u32,
    scale: f32,
}

// SAFETY: plain #[repr(C)] data matching `AttentionParams` in kernels/attention.cu.
unsafe impl DeviceRepr for AttentionParams {}

impl Gpu {
    /// Key ranges [`Gpu::attention`] splits each row's keys into: one pass when the rows and
    /// heads give at least 2 blocks per SM (prefill), else ranges of [`ATTENTION_SPLIT_KEYS`]
    /// keys (decode: flash-decoding). The ranges are fixed, so a row's result does not depend on
    /// the other rows of the call as long as the call stays in the decode regime (a row with at
    /// most that many keys gets the one-pass result bit for bit).
    pub fn attention_splits(&self, s: &AttentionShape) -> usize {
        let n_sm = self.info().n_sm.max(1) as usize;
        if s.n_rows * s.n_head >= 2 * n_sm {
            return 1;
        }
        s.max_keys.div_ceil(split_keys(s)).max(1)
    }

    /// Floats of scratch [`Gpu::attention`] needs for `s` (the split ranges' partial results).
    pub fn attention_scratch(&self, s: &AttentionShape) -> usize {
        match self.attention_splits(s) {
            1 => 0,
            n => s.n_rows * s.n_head * n * (2 + s.head_dim),
        }
    }

    /// Causal GQA attention of q [n_rows, n_head·hd]: row r attends over positions
    /// 0..=pos[r] of the K/V caches of slot `row_slot[r]` (layer `pages.layer`) into out
    /// [n_rows, n_head·hd]. The caller guarantees those positions were written and that no
    /// row sees more than `s.max_keys` keys; a slot or page out of range gives a NaN row.
    /// `scratch` holds [`Gpu::attention_scratch`] floats.
    #[allow(clippy::too_many_arguments)] // the op's inputs, output and scratch
    pub fn attention(
        &self,
        pages: &KvPages<'_>,
        s: AttentionShape,
        q: &Buf<f32>,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
        out: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
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
        need(OP, "scratch", scratch, self.attention_scratch(&s))?;
        if s.n_rows == 0 || nh == 0 {
            return Ok(());
        }
        let n_split = self.attention_splits(&s);
        let part = s.n_rows * nh * n_split;
        let p = AttentionParams {
            q: q.ptr(),
            out: out.ptr(),
            pool: pages.pool.ptr(),
            table: pages.table.ptr(),
            row_slot: row_slot.ptr(),
            pos: pos.ptr(),
            part_ml: scratch.ptr(),
            part_acc: scratch.ptr() + 4 * 2 * part as u64,
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
            n_split: n_split as u32,
            keys_per_split: u32_of(OP, "keys per split", split_keys(&s))?,
            scale: s.scale,
        };
        // SAFETY: q and out hold n_rows·n_head·hd floats, row_slot and pos n_rows values, the pool
        // n_pages pages and the table its rows, the scratch n_rows·n_head·n_split·(2 + hd)
        // floats when n_split > 1 (checked above); the kernels read table entries only below
        // ceil(keys / 64) <= stride and check slots and page ids; hd <= 256.
        unsafe {
            if n_split == 1 {
                let f = self.function(&ATTENTION, "attention")?;
                return self.launch(&f, (p.n_head, p.n_rows, 1), 32 * WARPS, 0, &p);
            }
            let split = self.function(&ATTENTION, "attention_split")?;
            let merge = self.function(&ATTENTION, "attention_merge")?;
            self.launch(&split, (p.n_head, p.n_rows, p.n_split), 32 * WARPS, 0, &p)?;
            self.launch(&merge, (p.n_head, p.n_rows, 1), 128, 0, &p)
        }
    }
}
