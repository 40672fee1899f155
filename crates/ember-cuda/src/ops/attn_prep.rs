use cudarc::driver::DeviceRepr;

use super::kv_append::{KvDest, KvPages};
use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::ATTN_PREP;

const OP: &str = "attn_prep";

/// Shape and constants of [`Gpu::attn_prep`] (ember_ops::AttnPrep plus the token count).
#[derive(Debug, Clone, Copy)]
pub struct AttnPrepShape {
    pub n_tok: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub eps: f32,
    pub rope_base: f32,
}

#[repr(C)]
struct AttnPrepParams {
    qg: u64,
    k: u64,
    q_norm: u64,
    k_norm: u64,
    pos: u64,
    q_out: u64,
    gate: u64,
    k_out: u64,
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    n_rot: u32,
    pad: u32,
    eps: f32,
    rope_base: f32,
    kv: KvDest,
    v: u64,
}

// SAFETY: plain #[repr(C)] data matching `AttnPrepParams` in kernels/attn_prep.cu (8 u64, 8
// 4-byte fields, KvDest's 64 bytes, a u64: no padding).
unsafe impl DeviceRepr for AttnPrepParams {}

/// The inputs of [`Gpu::attn_prep`].
pub struct AttnPrepIn<'a> {
    /// [n_tok, n_head · 2 · head_dim]: per head q then gate.
    pub qg: &'a Buf<f32>,
    /// [n_tok, n_head_kv · head_dim]
    pub k: &'a Buf<f32>,
    pub q_norm: &'a Buf<f32>,
    pub k_norm: &'a Buf<f32>,
    /// [n_tok] positions.
    pub pos: &'a Buf<u32>,
}

/// The K and V caches [`Gpu::attn_prep_kv`] writes the step's rows into, as
/// [`Gpu::kv_append`] would: the caches, v [n_tok, n_head_kv · head_dim], each row's slot and
/// position.
pub struct AttnPrepKv<'a> {
    pub pages: &'a KvPages<'a>,
    pub v: &'a Buf<f32>,
    pub row_slot: &'a Buf<u32>,
    pub pos: &'a Buf<u32>,
}

impl Gpu {
    /// Splits q | gate per head, RMSNorms q and k per head, applies NeoX RoPE at each row's
    /// position: outputs q [n_tok, n_head·hd], gate [n_tok, n_head·hd], k [n_tok, n_head_kv·hd].
    pub fn attn_prep(&self, s: AttnPrepShape, i: AttnPrepIn<'_>, q: &mut Buf<f32>, gate: &mut Buf<f32>, k: &mut Buf<f32>) -> Result<()> {
        self.attn_prep_kv(s, i, q, gate, k, None)
    }

    /// Whether [`Gpu::attn_prep_kv`] takes heads of `head_dim`: a multiple of 32 (each Q8_0
    /// block of a cache row inside one head, one warp's).
    pub fn attn_prep_writes_kv(&self, head_dim: usize) -> bool {
        head_dim.is_multiple_of(32)
    }

    /// [`Gpu::attn_prep`], and with `kv` also each row's k (as written to `k`) and v into the
    /// caches, as [`Gpu::kv_append`] of them would (the same bits): one launch where the two ops
    /// take two. Only where [`Gpu::attn_prep_writes_kv`].
    pub fn attn_prep_kv(
        &self,
        s: AttnPrepShape,
        i: AttnPrepIn<'_>,
        q: &mut Buf<f32>,
        gate: &mut Buf<f32>,
        k: &mut Buf<f32>,
        kv: Option<AttnPrepKv<'_>>,
    ) -> Result<()> {
        let hd = s.head_dim;
        let (kv_dest, v) = match &kv {
            Some(c) => {
                if !self.attn_prep_writes_kv(hd) || c.pages.width != s.n_head_kv * hd {
                    return Err(shape(OP, format!("cache rows of {} for {} kv heads of {hd}", c.pages.width, s.n_head_kv)));
                }
                need(OP, "v", c.v, s.n_tok * s.n_head_kv * hd)?;
                (KvDest::new(OP, c.pages, s.n_tok, c.row_slot, c.pos)?, c.v.ptr())
            }
            None => (KvDest::none(), 0),
        };
        if s.n_rot > hd || !s.n_rot.is_multiple_of(2) || hd > 4096 {
            return Err(shape(OP, format!("n_rot {} with head_dim {hd}", s.n_rot)));
        }
        need(OP, "qg", i.qg, s.n_tok * s.n_head * 2 * hd)?;
        need(OP, "k", i.k, s.n_tok * s.n_head_kv * hd)?;
        need(OP, "q_norm", i.q_norm, hd)?;
        need(OP, "k_norm", i.k_norm, hd)?;
        need(OP, "pos", i.pos, s.n_tok)?;
        need(OP, "q out", q, s.n_tok * s.n_head * hd)?;
        need(OP, "gate out", gate, s.n_tok * s.n_head * hd)?;
        need(OP, "k out", k, s.n_tok * s.n_head_kv * hd)?;
        if s.n_tok == 0 || s.n_head + s.n_head_kv == 0 {
            return Ok(());
        }
        let p = AttnPrepParams {
            qg: i.qg.ptr(),
            k: i.k.ptr(),
            q_norm: i.q_norm.ptr(),
            k_norm: i.k_norm.ptr(),
            pos: i.pos.ptr(),
            q_out: q.ptr(),
            gate: gate.ptr(),
            k_out: k.ptr(),
            n_tok: u32_of(OP, "n_tok", s.n_tok)?,
            n_head: u32_of(OP, "n_head", s.n_head)?,
            n_head_kv: u32_of(OP, "n_head_kv", s.n_head_kv)?,
            head_dim: hd as u32,
            n_rot: s.n_rot as u32,
            pad: 0,
            eps: s.eps,
            rope_base: s.rope_base,
            kv: kv_dest,
            v,
        };
        let f = self.function(&ATTN_PREP, "attn_prep")?;
        // SAFETY: sizes checked above; shared memory holds head_dim floats; with the caches, v
        // holds n_tok rows and KvDest::new checked the pool, the table and the row slots and
        // positions (the kernel skips rows whose slot, page index or page id is out of range);
        // head_dim a multiple of 32 and 128 threads keep each Q8_0 block one warp's.
        unsafe { self.launch(&f, (p.n_head + p.n_head_kv, p.n_tok, 1), 128, 4 * hd as u32, &p) }
    }
}
