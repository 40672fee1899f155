use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::DELTA_PREP;

const OP: &str = "delta_prep";

/// Shape of [`Gpu::delta_prep`] (ember_ops::DeltaPrep plus the token count).
#[derive(Debug, Clone, Copy)]
pub struct DeltaPrepShape {
    pub n_tok: usize,
    pub n_k_head: usize,
    pub d_k: usize,
    pub n_v_head: usize,
    pub d_v: usize,
    pub eps: f32,
}

#[repr(C)]
struct DeltaPrepParams {
    cu: u64,
    b: u64,
    alpha: u64,
    a: u64,
    dt_bias: u64,
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    n_tok: u32,
    n_k_head: u32,
    d_k: u32,
    n_v_head: u32,
    d_v: u32,
    eps: f32,
}

// SAFETY: plain #[repr(C)] data matching `DeltaPrepParams` in kernels/delta_prep.cu.
unsafe impl DeviceRepr for DeltaPrepParams {}

/// The inputs of [`Gpu::delta_prep`].
pub struct DeltaPrepIn<'a> {
    /// [n_tok, 2·nk·dk + nv·dv]: the conv output, q | k | v.
    pub cu: &'a Buf<f32>,
    /// [n_tok, nv]
    pub b: &'a Buf<f32>,
    /// [n_tok, nv]
    pub alpha: &'a Buf<f32>,
    /// [nv]
    pub a: &'a Buf<f32>,
    /// [nv]
    pub dt_bias: &'a Buf<f32>,
}

/// The outputs of [`Gpu::delta_prep`]: q, k [n_tok, nk·dk], v [n_tok, nv·dv], g, beta [n_tok, nv].
pub struct DeltaPrepOut<'a> {
    pub q: &'a mut Buf<f32>,
    pub k: &'a mut Buf<f32>,
    pub v: &'a mut Buf<f32>,
    pub g: &'a mut Buf<f32>,
    pub beta: &'a mut Buf<f32>,
}

/// Values of v one block copies (`DELTA_PREP_V_CHUNK` in kernels/delta_prep.cu).
const V_CHUNK: usize = 512;

impl Gpu {
    /// Splits the conv output into q | k | v, L2-normalises q (then ·1/√d_k) and k per head,
    /// β = sigmoid(b), g = a·softplus(alpha + dt_bias).
    pub fn delta_prep(&self, s: DeltaPrepShape, i: DeltaPrepIn<'_>, o: DeltaPrepOut<'_>) -> Result<()> {
        let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        need(OP, "cu", i.cu, t * (2 * nk * dk + nv * dv))?;
        need(OP, "b", i.b, t * nv)?;
        need(OP, "alpha", i.alpha, t * nv)?;
        need(OP, "a", i.a, nv)?;
        need(OP, "dt_bias", i.dt_bias, nv)?;
        need(OP, "q", o.q, t * nk * dk)?;
        need(OP, "k", o.k, t * nk * dk)?;
        need(OP, "v", o.v, t * nv * dv)?;
        need(OP, "g", o.g, t * nv)?;
        need(OP, "beta", o.beta, t * nv)?;
        if t == 0 {
            return Ok(());
        }
        let p = DeltaPrepParams {
            cu: i.cu.ptr(),
            b: i.b.ptr(),
            alpha: i.alpha.ptr(),
            a: i.a.ptr(),
            dt_bias: i.dt_bias.ptr(),
            q: o.q.ptr(),
            k: o.k.ptr(),
            v: o.v.ptr(),
            g: o.g.ptr(),
            beta: o.beta.ptr(),
            n_tok: u32_of(OP, "n_tok", t)?,
            n_k_head: u32_of(OP, "n_k_head", nk)?,
            d_k: u32_of(OP, "d_k", dk)?,
            n_v_head: u32_of(OP, "n_v_head", nv)?,
            d_v: u32_of(OP, "d_v", dv)?,
            eps: s.eps,
        };
        let f = self.function(&DELTA_PREP, "delta_prep")?;
        // SAFETY: sizes checked above.
        let v_blocks = u32_of(OP, "v blocks", (nv * dv).div_ceil(V_CHUNK))?;
        unsafe { self.launch(&f, (2 * p.n_k_head + 1 + v_blocks, p.n_tok, 1), 128, 0, &p) }
    }
}
