use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::RMS_NORM;
use crate::ops::Act;

const OP: &str = "rms_norm";

#[repr(C)]
pub(super) struct RmsNormParams {
    x: u64,
    w: u64,
    out: u64,
    g: u32,
    n_group: u32,
    eps: f32,
    n_add: u32,
    add: u64,
    gate: u64,
    act: u32,
    pad2: u32,
}

// SAFETY: plain #[repr(C)] data matching `RmsNormParams` in kernels/rms_norm.cu.
unsafe impl DeviceRepr for RmsNormParams {}

#[repr(C)]
struct RmsNormQ8Params {
    r: RmsNormParams,
    q: u64,
}

// SAFETY: plain #[repr(C)] data matching `RmsNormQ8Params` in kernels/rms_norm.cu (RmsNormParams
// is 64 bytes: no padding before q).
unsafe impl DeviceRepr for RmsNormQ8Params {}

/// What a norm launch does besides the norm: a residual add before it (`x ← x + add`, written
/// back), a gate after it (`out ⊙= act(gate)`).
#[derive(Clone, Copy, Default)]
struct Extra<'a> {
    add: Option<&'a Buf<f32>>,
    gate: Option<(&'a Buf<f32>, Act)>,
}

impl Extra<'_> {
    fn check(&self, len: usize) -> Result<()> {
        if let Some(a) = self.add {
            need(OP, "a", a, len)?;
        }
        if let Some((g, _)) = self.gate {
            need(OP, "gate", g, len)?;
        }
        Ok(())
    }

    fn params(&self, x: &Buf<f32>, w: &Buf<f32>, out: &Buf<f32>, g: usize, n_group: usize, eps: f32) -> Result<RmsNormParams> {
        Ok(RmsNormParams {
            x: x.ptr(),
            w: w.ptr(),
            out: out.ptr(),
            g: u32_of(OP, "g", g)?,
            n_group: u32_of(OP, "groups", n_group)?,
            eps,
            n_add: 0,
            add: self.add.map_or(0, Buf::ptr),
            gate: self.gate.map_or(0, |(b, _)| b.ptr()),
            act: self.gate.map_or(0, |(_, a)| (a == Act::Sigmoid) as u32),
            pad2: 0,
        })
    }
}

/// Threads per group of `g` values, the same for every norm kernel (their block sums then add in
/// the same order, so the fused and int8 forms give the plain form's bits). A row of the model's
/// width (2,048) in one pass of 1,024 threads: the norm is a latency chain (load, block sum,
/// store), so the fewer steps per thread the better; heads (g <= 128) one warp.
pub(super) fn block_of(g: usize) -> u32 {
    if g <= 128 { 32 } else { g.div_ceil(2).next_multiple_of(32).min(1024) as u32 }
}

/// The parameters of `h ← h + a`, then the norm of h's one `g`-wide row into out, for a kernel
/// that runs rms_norm's code in its own launch (moe_route).
pub(super) fn add_norm_params(h: &Buf<f32>, a: &Buf<f32>, w: &Buf<f32>, out: &Buf<f32>, g: usize, eps: f32) -> Result<RmsNormParams> {
    Extra { add: Some(a), gate: None }.params(h, w, out, g, 1, eps)
}

/// The parameters of a gated norm of `n_group` groups of `g` values of x into out (`gate`'s
/// product after it), for a kernel that runs rms_norm's code in its own launch.
#[allow(clippy::too_many_arguments)]
pub(super) fn gated_norm_params(
    x: &Buf<f32>,
    w: &Buf<f32>,
    out: &Buf<f32>,
    g: usize,
    n_group: usize,
    eps: f32,
    gate: &Buf<f32>,
    act: Act,
) -> Result<RmsNormParams> {
    Extra { add: None, gate: Some((gate, act)) }.params(x, w, out, g, n_group, eps)
}

impl Gpu {
    /// RMSNorm of every `w.len()`-wide group of x [n, d] (d a multiple of w.len()), times w.
    pub fn rms_norm(&self, x: &Buf<f32>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<()> {
        self.norm(x, Extra::default(), n, d, w, eps, out)
    }

    /// [`Gpu::rms_norm`], then `out ⊙= act(gate)` ([`Gpu::gate`]'s product), in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_gate(
        &self,
        x: &Buf<f32>,
        n: usize,
        d: usize,
        w: &Buf<f32>,
        eps: f32,
        gate: &Buf<f32>,
        act: Act,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        self.norm(x, Extra { add: None, gate: Some((gate, act)) }, n, d, w, eps, out)
    }

    /// `h ← h + a`, then [`Gpu::rms_norm`] of h, in one launch (the same sums as [`Gpu::add`]
    /// then [`Gpu::rms_norm`]).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        h: &mut Buf<f32>,
        a: &Buf<f32>,
        n: usize,
        d: usize,
        w: &Buf<f32>,
        eps: f32,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        self.norm(h, Extra { add: Some(a), gate: None }, n, d, w, eps, out)
    }

    /// [`Gpu::rms_norm`] of x with `extra` (x is written when it adds: the callers that add
    /// hold it mutably).
    #[allow(clippy::too_many_arguments)]
    fn norm(&self, x: &Buf<f32>, extra: Extra<'_>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<()> {
        let g = w.len();
        if g == 0 || !d.is_multiple_of(g) {
            return Err(shape(OP, format!("width {d} is not a multiple of the weight length {g}")));
        }
        need(OP, "x", x, n * d)?;
        need(OP, "out", out, n * d)?;
        extra.check(n * d)?;
        let n_group = n * d / g;
        if n_group == 0 {
            return Ok(());
        }
        let p = extra.params(x, w, out, g, n_group, eps)?;
        let block = block_of(g);
        let f = self.function(&RMS_NORM, "rms_norm")?;
        // SAFETY: x, out, the add and the gate (when given) hold n_group·g floats, w holds g
        // (checked above).
        unsafe { self.launch(&f, (p.n_group, 1, 1), block, 0, &p) }
    }

    /// [`Gpu::rms_norm`] that also leaves its output quantised to int8 in the GPU's int8
    /// scratch, as [`Gpu::quantize_q8`] of `out` would (the same values, bit for bit), for the
    /// int8 GEMVs that read it next; returns [`Gpu::q8_generation`] after it. Needs d a multiple
    /// of 32 and of the weight length, which a multiple of 32 too.
    pub fn rms_norm_q8(&self, x: &Buf<f32>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<u64> {
        self.norm_q8(x, Extra::default(), n, d, w, eps, out)
    }

    /// [`Gpu::rms_norm_gate`] that also leaves its output quantised, as [`Gpu::rms_norm_q8`].
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_gate_q8(
        &self,
        x: &Buf<f32>,
        n: usize,
        d: usize,
        w: &Buf<f32>,
        eps: f32,
        gate: &Buf<f32>,
        act: Act,
        out: &mut Buf<f32>,
    ) -> Result<u64> {
        self.norm_q8(x, Extra { add: None, gate: Some((gate, act)) }, n, d, w, eps, out)
    }

    /// `h ← h + a`, then [`Gpu::rms_norm_q8`] of h, in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_q8(
        &self,
        h: &mut Buf<f32>,
        a: &Buf<f32>,
        n: usize,
        d: usize,
        w: &Buf<f32>,
        eps: f32,
        out: &mut Buf<f32>,
    ) -> Result<u64> {
        self.norm_q8(h, Extra { add: Some(a), gate: None }, n, d, w, eps, out)
    }

    /// Whether [`Gpu::add_rms_norm_parts`] takes rows `d` wide with a weight of `g`.
    pub fn norm_parts_fit(&self, d: usize, g: usize) -> bool {
        g > 0 && d == g && g.is_multiple_of(32) && g <= 4 * block_of(g) as usize
    }

    /// `h ← h + Σ_j parts[j]` (the `n_parts` rows of n·d values of `parts`, added in order
    /// first), then [`Gpu::rms_norm`] of h, in one launch, with the int8 copy too when `q8` (as
    /// [`Gpu::add_rms_norm_q8`]; then Some of its generation): the norm after a one-launch MoE
    /// ([`Gpu::moe_fused_q8`]), whose experts' outputs are the parts. Rows whose norm fits in
    /// registers (a row's d at most 4 a thread of its block), d a multiple of 32 for the copy.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_parts(
        &self,
        h: &mut Buf<f32>,
        parts: &Buf<f32>,
        n_parts: usize,
        n: usize,
        d: usize,
        w: &Buf<f32>,
        eps: f32,
        out: &mut Buf<f32>,
        q8: bool,
    ) -> Result<Option<u64>> {
        let g = w.len();
        if !self.norm_parts_fit(d, g) || n_parts < 2 {
            return Err(shape(OP, format!("width {d}, weight length {g}, {n_parts} parts: not for the norm over parts")));
        }
        need(OP, "x", h, n * d)?;
        need(OP, "out", out, n * d)?;
        need(OP, "parts", parts, n_parts * n * d)?;
        let mut r = Extra { add: Some(parts), gate: None }.params(h, w, out, g, n, eps)?;
        r.n_add = u32_of(OP, "parts", n_parts)?;
        let block = block_of(g);
        if !q8 {
            if n == 0 {
                return Ok(None);
            }
            let f = self.function(&RMS_NORM, "rms_norm_parts")?;
            // SAFETY: h and out hold n·d floats, parts n_parts·n·d, w d = g; one block a row, whose
            // g values fit in registers (at most 4 a thread of block_of(g)).
            unsafe { self.launch(&f, (r.n_group, 1, 1), block, 0, &r)? };
            return Ok(None);
        }
        let q = self.q8_scratch(super::q8_bytes(n * d))?;
        let generation = self.bump_q8_generation();
        if n == 0 {
            return Ok(Some(generation));
        }
        let p = RmsNormQ8Params { r, q };
        let f = self.function(&RMS_NORM, "rms_norm_q8_parts")?;
        // SAFETY: as above; the scratch holds q8_bytes(n·d); g % 32 == 0 keeps the warps whole.
        unsafe { self.launch(&f, (p.r.n_group, 1, 1), block, 0, &p)? };
        Ok(Some(generation))
    }

    /// [`Gpu::rms_norm_q8`] of x with `extra` (see [`Gpu::norm`]).
    #[allow(clippy::too_many_arguments)]
    fn norm_q8(&self, x: &Buf<f32>, extra: Extra<'_>, n: usize, d: usize, w: &Buf<f32>, eps: f32, out: &mut Buf<f32>) -> Result<u64> {
        let g = w.len();
        if g == 0 || !d.is_multiple_of(g) || !g.is_multiple_of(32) {
            return Err(shape(OP, format!("width {d}, weight length {g}: the int8 copy needs groups of a multiple of 32")));
        }
        need(OP, "x", x, n * d)?;
        need(OP, "out", out, n * d)?;
        extra.check(n * d)?;
        let n_group = n * d / g;
        let q = self.q8_scratch(super::q8_bytes(n * d))?;
        let generation = self.bump_q8_generation();
        if n_group == 0 {
            return Ok(generation);
        }
        let p = RmsNormQ8Params { r: extra.params(x, w, out, g, n_group, eps)?, q };
        let f = self.function(&RMS_NORM, "rms_norm_q8")?;
        let block = block_of(g);
        // SAFETY: x, out, the add and the gate (when given) hold n·d floats, w g (checked); the scratch holds q8_bytes(n·d);
        // one block per group; g % 32 == 0 keeps the kernel's warps whole.
        unsafe { self.launch(&f, (p.r.n_group, 1, 1), block, 0, &p)? };
        Ok(generation)
    }
}
