use cudarc::driver::DeviceRepr;

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
}

// SAFETY: plain #[repr(C)] data matching `AttnPrepParams` in kernels/attn_prep.cu.
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

impl Gpu {
    /// Splits q | gate per head, RMSNorms q and k per head, applies NeoX RoPE at each row's
    /// position: outputs q [n_tok, n_head·hd], gate [n_tok, n_head·hd], k [n_tok, n_head_kv·hd].
    pub fn attn_prep(&self, s: AttnPrepShape, i: AttnPrepIn<'_>, q: &mut Buf<f32>, gate: &mut Buf<f32>, k: &mut Buf<f32>) -> Result<()> {
        let hd = s.head_dim;
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
        };
        let f = self.function(&ATTN_PREP, "attn_prep")?;
        // SAFETY: sizes checked above; shared memory holds head_dim floats.
        unsafe { self.launch(&f, (p.n_head + p.n_head_kv, p.n_tok, 1), 128, 4 * hd as u32, &p) }
    }
}
