use cudarc::driver::DeviceRepr;

use super::{SeqRows, StateAt, blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::DELTA_RULE;

const OP: &str = "delta_rule_recurrent";

/// Shape of the gated delta rule (ember_ops::DeltaShape).
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    pub n_tok: usize,
    pub n_k_head: usize,
    pub d_k: usize,
    pub n_v_head: usize,
    pub d_v: usize,
}

#[repr(C)]
struct DeltaRuleParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    state: u64,
    out: u64,
    n_tok: u32,
    n_k_head: u32,
    d_k: u32,
    n_v_head: u32,
    d_v: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `DeltaRuleParams` in kernels/delta_rule.cu.
unsafe impl DeviceRepr for DeltaRuleParams {}

/// The inputs of [`Gpu::delta_rule_recurrent`] (delta_prep's outputs).
pub struct DeltaIn<'a> {
    pub q: &'a Buf<f32>,
    pub k: &'a Buf<f32>,
    pub v: &'a Buf<f32>,
    pub g: &'a Buf<f32>,
    pub beta: &'a Buf<f32>,
}

#[repr(C)]
struct DeltaSeqsParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    state: u64,
    out: u64,
    row0: u64,
    n: u64,
    slot: u64,
    slot_stride: u64,
    offset: u64,
    n_k_head: u32,
    d_k: u32,
    n_v_head: u32,
    d_v: u32,
    n_slots: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `DeltaSeqsParams` in kernels/delta_rule.cu.
unsafe impl DeviceRepr for DeltaSeqsParams {}

impl Gpu {
    /// The gated delta rule token by token over the state [n_v_head, d_v, d_k] (updated in
    /// place), output [n_tok, n_v_head·d_v]. d_k must be a multiple of 32, at most 256.
    pub fn delta_rule_recurrent(&self, s: DeltaShape, i: DeltaIn<'_>, state: &mut Buf<f32>, out: &mut Buf<f32>) -> Result<()> {
        let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        if !dk.is_multiple_of(32) || dk > 256 || nk == 0 {
            return Err(shape(OP, format!("d_k = {dk} (a multiple of 32, at most 256), n_k_head = {nk}")));
        }
        need(OP, "q", i.q, t * nk * dk)?;
        need(OP, "k", i.k, t * nk * dk)?;
        need(OP, "v", i.v, t * nv * dv)?;
        need(OP, "g", i.g, t * nv)?;
        need(OP, "beta", i.beta, t * nv)?;
        need(OP, "state", state, nv * dv * dk)?;
        need(OP, "out", out, t * nv * dv)?;
        if nv * dv == 0 {
            return Ok(());
        }
        let p = DeltaRuleParams {
            q: i.q.ptr(),
            k: i.k.ptr(),
            v: i.v.ptr(),
            g: i.g.ptr(),
            beta: i.beta.ptr(),
            state: state.ptr(),
            out: out.ptr(),
            n_tok: u32_of(OP, "n_tok", t)?,
            n_k_head: nk as u32,
            d_k: dk as u32,
            n_v_head: u32_of(OP, "n_v_head", nv)?,
            d_v: u32_of(OP, "d_v", dv)?,
            pad: 0,
        };
        let f = self.function(&DELTA_RULE, "delta_rule_recurrent")?;
        // SAFETY: sizes checked above; d_k / 32 <= DELTA_MAX_PER_LANE.
        unsafe { self.launch(&f, (blocks(nv * dv, 4), 1, 1), 128, 0, &p) }
    }

    /// [`Gpu::delta_rule_recurrent`] for every sequence of a step in one launch (`s.n_tok` is
    /// the step's rows): sequence s's rows continue the state in slot `seqs.slot[s]` of `state`
    /// (at `at`). The spans must lie inside the rows (the caller built them); a slot out of range
    /// gives NaN rows.
    pub fn delta_rule_seqs(
        &self,
        s: DeltaShape,
        i: DeltaIn<'_>,
        seqs: SeqRows<'_>,
        state: &mut Buf<f32>,
        at: StateAt,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        const OP: &str = "delta_rule_seqs";
        let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        if !dk.is_multiple_of(32) || dk > 256 || nk == 0 || at.len != nv * dv * dk {
            return Err(shape(OP, format!("d_k = {dk} (a multiple of 32, at most 256), n_k_head = {nk}, state of {}", at.len)));
        }
        need(OP, "q", i.q, t * nk * dk)?;
        need(OP, "k", i.k, t * nk * dk)?;
        need(OP, "v", i.v, t * nv * dv)?;
        need(OP, "g", i.g, t * nv)?;
        need(OP, "beta", i.beta, t * nv)?;
        need(OP, "out", out, t * nv * dv)?;
        seqs.check(OP)?;
        at.check(OP, state)?;
        if nv * dv == 0 || seqs.n_seq == 0 {
            return Ok(());
        }
        let p = DeltaSeqsParams {
            q: i.q.ptr(),
            k: i.k.ptr(),
            v: i.v.ptr(),
            g: i.g.ptr(),
            beta: i.beta.ptr(),
            state: state.ptr(),
            out: out.ptr(),
            row0: seqs.row0.ptr(),
            n: seqs.n.ptr(),
            slot: seqs.slot.ptr(),
            slot_stride: at.slot_stride as u64,
            offset: at.offset as u64,
            n_k_head: nk as u32,
            d_k: dk as u32,
            n_v_head: u32_of(OP, "n_v_head", nv)?,
            d_v: u32_of(OP, "d_v", dv)?,
            n_slots: u32_of(OP, "n_slots", at.n_slots)?,
            pad: 0,
        };
        let f = self.function(&DELTA_RULE, "delta_rule_seqs")?;
        // SAFETY: the inputs and out hold what t rows need, the state n_slots slots with the
        // layer's state inside each (checked above); the spans lie inside the rows (the caller's
        // contract); the kernel skips slots >= n_slots; d_k / 32 <= DELTA_MAX_PER_LANE.
        unsafe { self.launch(&f, (blocks(nv * dv, 4), seqs.n_seq as u32, 1), 128, 0, &p) }
    }
}
