use cudarc::driver::DeviceRepr;

use super::{SeqRows, StateAt, need, u32_of};
use crate::error::{Result, shape};
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

#[repr(C)]
struct ConvPrepParams {
    p: DeltaPrepParams,
    x: u64,
    w: u64,
    state: u64,
    row0: u64,
    slot: u64,
    slot_stride: u64,
    offset: u64,
    c: u32,
    n_slots: u32,
}

// SAFETY: plain #[repr(C)] data matching `ConvPrepParams` in kernels/delta_prep.cu
// (DeltaPrepParams: 10 u64 then 6 four-byte fields, 104 bytes; then 7 u64 and 2 u32: no padding
// in either language).
unsafe impl DeviceRepr for ConvPrepParams {}

/// The conv's part of [`Gpu::conv_delta_prep`]: its input x [n_rows, c], taps w [c · 4], and the
/// sequences' histories.
pub struct ConvPart<'a> {
    pub x: &'a Buf<f32>,
    pub w: &'a Buf<f32>,
    pub seqs: SeqRows<'a>,
    pub state: &'a mut Buf<f32>,
    pub at: StateAt,
}

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

/// The largest d_k [`Gpu::conv_delta_prep`] takes: a head's values in dynamic shared memory
/// beside the block sum's 128 static bytes, within the default 48 KiB.
pub const CONV_PREP_MAX_DK: usize = ((48 << 10) - 128) / 4;

impl Gpu {
    /// Splits the conv output into q | k | v, L2-normalises q (then ·1/√d_k) and k per head,
    /// β = sigmoid(b), g = a·softplus(alpha + dt_bias).
    pub fn delta_prep(&self, s: DeltaPrepShape, i: DeltaPrepIn<'_>, o: DeltaPrepOut<'_>) -> Result<()> {
        let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        need(OP, "cu", i.cu, t * (2 * nk * dk + nv * dv))?;
        let p = prep_params(OP, s, &i, &o, i.cu.ptr())?;
        if t == 0 {
            return Ok(());
        }
        let f = self.function(&DELTA_PREP, "delta_prep")?;
        // SAFETY: sizes checked above.
        let v_blocks = u32_of(OP, "v blocks", (nv * dv).div_ceil(V_CHUNK))?;
        unsafe { self.launch(&f, (2 * p.n_k_head + 1 + v_blocks, p.n_tok, 1), 128, 0, &p) }
    }

    /// [`Gpu::conv1d_silu_seqs`] (kernel length 4) then [`Gpu::delta_prep`] on its output in
    /// one launch, for steps whose sequences have one row each (sequence s's row `row0[s]`, its
    /// history in slot `slot[s]`, updated): the same bits as the two launches; the conv output
    /// is never stored. `i.cu` is not read (pass any buffer). The step's sequences are its rows
    /// (`seqs.n_seq` = `s.n_tok`); d_k at most [`CONV_PREP_MAX_DK`]. A slot out of range gives
    /// NaN q, k and v rows.
    pub fn conv_delta_prep(&self, s: DeltaPrepShape, conv: ConvPart<'_>, i: DeltaPrepIn<'_>, o: DeltaPrepOut<'_>) -> Result<()> {
        const OP: &str = "conv_delta_prep";
        let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        let c = 2 * nk * dk + nv * dv;
        if conv.at.len != 3 * c || conv.seqs.n_seq != t {
            return Err(shape(
                OP,
                format!("a history of {} for {c} channels (kernel length 4), {} sequences of {t} rows", conv.at.len, conv.seqs.n_seq),
            ));
        }
        if dk > CONV_PREP_MAX_DK {
            return Err(shape(OP, format!("d_k = {dk} (at most {CONV_PREP_MAX_DK}: a head's values go through shared memory)")));
        }
        need(OP, "x", conv.x, t * c)?;
        need(OP, "w", conv.w, c * 4)?;
        conv.seqs.check(OP)?;
        conv.at.check(OP, conv.state)?;
        let prep = prep_params(OP, s, &i, &o, 0)?;
        if t == 0 {
            return Ok(());
        }
        let p = ConvPrepParams {
            p: prep,
            x: conv.x.ptr(),
            w: conv.w.ptr(),
            state: conv.state.ptr(),
            row0: conv.seqs.row0.ptr(),
            slot: conv.seqs.slot.ptr(),
            slot_stride: conv.at.slot_stride as u64,
            offset: conv.at.offset as u64,
            c: u32_of(OP, "c", c)?,
            n_slots: u32_of(OP, "n_slots", conv.at.n_slots)?,
        };
        let f = self.function(&DELTA_PREP, "conv_delta_prep")?;
        let v_blocks = u32_of(OP, "v blocks", (nv * dv).div_ceil(V_CHUNK))?;
        // SAFETY: x holds t·c floats, w c·4, the state n_slots slots with the layer's 3·c history
        // inside each, the outputs their t rows (checked above); the caller's contract, as for
        // conv1d_silu_seqs' spans: the t sequences have one row each (n[s] = 1), at distinct rows
        // row0[s] < t and distinct slots (no two blocks shift the same history); the kernel
        // skips slots >= n_slots; dk floats of dynamic shared memory beside 128 static bytes,
        // within the default 48 KiB (dk checked above).
        unsafe { self.launch(&f, (2 * p.p.n_k_head + 1 + v_blocks, conv.seqs.n_seq as u32, 1), 128, (dk * 4) as u32, &p) }
    }
}

/// [`Gpu::delta_prep`]'s parameters, the buffers other than the conv output checked (`cu`: its
/// address, 0 where the kernel computes it).
fn prep_params(op: &'static str, s: DeltaPrepShape, i: &DeltaPrepIn<'_>, o: &DeltaPrepOut<'_>, cu: u64) -> Result<DeltaPrepParams> {
    let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
    need(op, "b", i.b, t * nv)?;
    need(op, "alpha", i.alpha, t * nv)?;
    need(op, "a", i.a, nv)?;
    need(op, "dt_bias", i.dt_bias, nv)?;
    need(op, "q", o.q, t * nk * dk)?;
    need(op, "k", o.k, t * nk * dk)?;
    need(op, "v", o.v, t * nv * dv)?;
    need(op, "g", o.g, t * nv)?;
    need(op, "beta", o.beta, t * nv)?;
    Ok(DeltaPrepParams {
        cu,
        b: i.b.ptr(),
        alpha: i.alpha.ptr(),
        a: i.a.ptr(),
        dt_bias: i.dt_bias.ptr(),
        q: o.q.ptr(),
        k: o.k.ptr(),
        v: o.v.ptr(),
        g: o.g.ptr(),
        beta: o.beta.ptr(),
        n_tok: u32_of(op, "n_tok", t)?,
        n_k_head: u32_of(op, "n_k_head", nk)?,
        d_k: u32_of(op, "d_k", dk)?,
        n_v_head: u32_of(op, "n_v_head", nv)?,
        d_v: u32_of(op, "d_v", dv)?,
        eps: s.eps,
    })
}
