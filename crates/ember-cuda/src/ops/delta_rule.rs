use cudarc::driver::DeviceRepr;

use super::rms_norm::RmsNormParams;
use super::{Act, SeqRows, StateAt, blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::{DELTA_CHUNKED, DELTA_RULE};

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
    scan_below: u32,
}

// SAFETY: plain #[repr(C)] data matching `DeltaSeqsParams` in kernels/delta_rule.cu.
unsafe impl DeviceRepr for DeltaSeqsParams {}

#[repr(C)]
struct DeltaNormParams {
    d: DeltaSeqsParams,
    r: RmsNormParams,
    q: u64,
    count: u64,
}

// SAFETY: plain #[repr(C)] data matching `DeltaNormParams` in kernels/delta_rule.cu
// (DeltaSeqsParams is 120 bytes and RmsNormParams 64: no padding between the parts).
unsafe impl DeviceRepr for DeltaNormParams {}

/// The widest value head [`Gpu::delta_rule_norm_seqs`] normalises (one warp's 4 values a lane:
/// NORM_REGS in kernels/norm.cuh).
pub const DELTA_NORM_MAX_DV: usize = 128;

/// The gated RMSNorm of each value head after the delta rule ([`Gpu::delta_rule_norm_seqs`]):
/// o / rms(o) · w ⊙ act(gate), w d_v long.
pub struct HeadNorm<'a> {
    pub w: &'a Buf<f32>,
    pub eps: f32,
    pub gate: &'a Buf<f32>,
    pub act: Act,
}

/// Tokens per chunk of the chunked form (`DC` in kernels/delta_chunked.cu).
pub const DELTA_CHUNK: usize = 32;

/// Under `DeltaMode::Auto` (CudaOps::gated_delta_rule), spans of at least this many tokens take
/// the chunked form, shorter ones the scan. Measured on the H200 at the 35B model's shape (one
/// sequence, tests/delta_rule.rs's bench): scan 0.070 / chunked 0.078 ms at 64 tokens, 0.103 /
/// 0.091 at 96, 0.136 / 0.105 at 128.
pub const DELTA_AUTO_CHUNKED_FROM: usize = 80;

#[repr(C)]
struct DeltaChunkParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    state: u64,
    out: u64,
    w: u64,
    p: u64,
    gc: u64,
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
    from: u32,
}

// SAFETY: plain #[repr(C)] data matching `DeltaChunkParams` in kernels/delta_chunked.cu.
unsafe impl DeviceRepr for DeltaChunkParams {}

impl DeltaShape {
    /// Whether the chunked kernels take this shape: d_k 32, 64 or 128, d_v up to 128 (one
    /// chunk's keys, queries and values in a block's 48 KiB of shared memory).
    pub fn chunkable(&self) -> bool {
        [32, 64, 128].contains(&self.d_k) && (1..=128).contains(&self.d_v) && self.n_k_head > 0 && self.n_v_head <= 65535
    }

    /// Floats of scratch [`Gpu::delta_rule_seqs_split`] needs for `n_tok` rows: per row and
    /// value head W (d_k), P (a chunk's width) and the cumulative decay.
    pub fn chunk_scratch(&self) -> usize {
        self.n_tok * self.n_v_head * (self.d_k + DELTA_CHUNK + 1)
    }
}

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
        check_seqs(OP, s, &i, seqs, state, at, out)?;
        self.scan(s, &i, seqs, state, at, out, u32::MAX)
    }

    /// [`Gpu::delta_rule_seqs`] with the sequences of at least `from` tokens (`lens`, the host's
    /// copy of `seqs.n`) in the chunked form (qwen35moe.md §6.5, kernels/delta_chunked.cu) and the
    /// others in the scan: at most three launches for the whole step. `from` is at least 2 (one
    /// token is always the scan); `usize::MAX` scans everything. `scratch` holds
    /// [`DeltaShape::chunk_scratch`] floats when a sequence is chunked. Needs
    /// [`DeltaShape::chunkable`] when a sequence is chunked.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_seqs_split(
        &self,
        s: DeltaShape,
        i: DeltaIn<'_>,
        seqs: SeqRows<'_>,
        lens: &[usize],
        state: &mut Buf<f32>,
        at: StateAt,
        out: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        from: usize,
    ) -> Result<()> {
        const OP: &str = "delta_rule_seqs_split";
        check_seqs(OP, s, &i, seqs, state, at, out)?;
        if lens.len() != seqs.n_seq || from < 2 {
            return Err(shape(OP, format!("{} lengths for {} sequences, chunked from {from} tokens (at least 2)", lens.len(), seqs.n_seq)));
        }
        let longest = lens.iter().copied().filter(|&n| n >= from).max();
        let below = u32::try_from(from).unwrap_or(u32::MAX);
        if lens.iter().any(|&n| n < from) {
            self.scan(s, &i, seqs, state, at, out, below)?;
        }
        let Some(longest) = longest else { return Ok(()) };
        if !s.chunkable() {
            return Err(shape(OP, format!("d_k = {}, d_v = {} (the chunked form takes d_k 32, 64 or 128, d_v <= 128)", s.d_k, s.d_v)));
        }
        let (t, nv, dk) = (s.n_tok, s.n_v_head, s.d_k);
        need(OP, "scratch", scratch, s.chunk_scratch())?;
        if nv * s.d_v == 0 || seqs.n_seq == 0 {
            return Ok(());
        }
        let base = scratch.ptr();
        let p = DeltaChunkParams {
            q: i.q.ptr(),
            k: i.k.ptr(),
            v: i.v.ptr(),
            g: i.g.ptr(),
            beta: i.beta.ptr(),
            state: state.ptr(),
            out: out.ptr(),
            w: base,
            p: base + 4 * (t * nv * dk) as u64,
            gc: base + 4 * (t * nv * (dk + DELTA_CHUNK)) as u64,
            row0: seqs.row0.ptr(),
            n: seqs.n.ptr(),
            slot: seqs.slot.ptr(),
            slot_stride: at.slot_stride as u64,
            offset: at.offset as u64,
            n_k_head: s.n_k_head as u32,
            d_k: dk as u32,
            n_v_head: u32_of(OP, "n_v_head", nv)?,
            d_v: s.d_v as u32,
            n_slots: u32_of(OP, "n_slots", at.n_slots)?,
            from: below,
        };
        let chunks = u32_of(OP, "chunks", longest.div_ceil(DELTA_CHUNK))?;
        let prep = self.function(&DELTA_CHUNKED, "delta_chunk_prep")?;
        let scan = self.function(&DELTA_CHUNKED, "delta_chunk_scan")?;
        // SAFETY: the inputs, out and scratch hold what t rows need, the state n_slots slots
        // with the layer's state inside each (checked above); the spans lie inside the rows (the
        // caller's contract) and `lens` are their lengths; the scan skips slots >= n_slots; the
        // shape is chunkable (the kernels' shared arrays).
        unsafe {
            self.launch(&prep, (chunks, nv as u32, seqs.n_seq as u32), 256, 0, &p)?;
            self.launch(&scan, (s.d_v.div_ceil(16) as u32, nv as u32, seqs.n_seq as u32), 256, 0, &p)
        }
    }

    /// Whether [`Gpu::delta_rule_norm_seqs`] may take its cluster form for value heads of
    /// `d_v`: compute capability 9.0+ (clusters) and d_v = 128 (8 blocks of 16 columns a head).
    pub fn delta_norm_cluster_fits(&self, d_v: usize) -> bool {
        self.info().sm() >= 90 && d_v == 128
    }

    /// The scan of the sequences of fewer than `below` tokens (checked by the caller).
    #[allow(clippy::too_many_arguments)]
    fn scan(
        &self,
        s: DeltaShape,
        i: &DeltaIn<'_>,
        seqs: SeqRows<'_>,
        state: &mut Buf<f32>,
        at: StateAt,
        out: &mut Buf<f32>,
        below: u32,
    ) -> Result<()> {
        let (nv, dv) = (s.n_v_head, s.d_v);
        if nv * dv == 0 || seqs.n_seq == 0 {
            return Ok(());
        }
        let p = seqs_params(s, i, seqs, state, at, out, below)?;
        let f = self.function(&DELTA_RULE, "delta_rule_seqs")?;
        // SAFETY: sizes checked by the caller (check_seqs); the spans lie inside the rows (the
        // caller's contract); the kernel skips slots >= n_slots; d_k / 32 <= DELTA_MAX_PER_LANE.
        unsafe { self.launch(&f, (blocks(nv * dv, 4), seqs.n_seq as u32, 1), 128, 0, &p) }
    }

    /// [`Gpu::delta_rule_seqs`] for a step whose sequences have one row each (`lens`, the host's
    /// copy of `seqs.n`, all 1, one a row), then [`Gpu::rms_norm_gate_q8`] of each value head's
    /// output (`norm`: the weight, d_v long, shared by the heads), in one launch: `out` gets the
    /// delta rule's o, `y` the norm, and with `q8` the int8 scratch y's copy (as
    /// [`Gpu::rms_norm_gate_q8`]; its generation returned). Each head's last block to finish
    /// normalises it (kernels/delta_rule.cu), with the same sums as the norm's own launch: the
    /// same bits as the two launches. d_v a multiple of 32, at most 128. With `cluster`
    /// (where [`Gpu::delta_norm_cluster_fits`]), `delta_rule_norm_cluster`: a cluster of 8
    /// blocks of 16 columns a head, whose barrier stands where the counting kernel counts.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_norm_seqs(
        &self,
        s: DeltaShape,
        i: DeltaIn<'_>,
        seqs: SeqRows<'_>,
        lens: &[usize],
        state: &mut Buf<f32>,
        at: StateAt,
        out: &mut Buf<f32>,
        norm: HeadNorm<'_>,
        y: &mut Buf<f32>,
        q8: bool,
        cluster: bool,
    ) -> Result<Option<u64>> {
        const OP: &str = "delta_rule_norm_seqs";
        if cluster && !self.delta_norm_cluster_fits(s.d_v) {
            return Err(shape(OP, format!("d_v = {} on sm_{}: the cluster form needs d_v 128 and sm_90", s.d_v, self.info().sm())));
        }
        check_seqs(OP, s, &i, seqs, state, at, out)?;
        let (t, nv, dv) = (s.n_tok, s.n_v_head, s.d_v);
        if lens.len() != seqs.n_seq || seqs.n_seq != t || lens.iter().any(|&n| n != 1) {
            return Err(shape(OP, format!("{} sequences of {lens:?} rows in {t} rows (one row each)", seqs.n_seq)));
        }
        if !dv.is_multiple_of(32) || dv > DELTA_NORM_MAX_DV || norm.w.len() != dv {
            return Err(shape(
                OP,
                format!("d_v = {dv}, norm weight of {} (d_v a multiple of 32, at most {DELTA_NORM_MAX_DV})", norm.w.len()),
            ));
        }
        need(OP, "gate", norm.gate, t * nv * dv)?;
        need(OP, "y", y, t * nv * dv)?;
        let (q, generation) = match q8 {
            true => (self.q8_scratch(super::q8_bytes(t * nv * dv))?, Some(self.bump_q8_generation())),
            false => (0, None),
        };
        if nv * dv == 0 || t == 0 {
            return Ok(generation);
        }
        let count = if cluster { 0 } else { self.counters(t * nv)? };
        let d = seqs_params(s, &i, seqs, state, at, out, u32::MAX)?;
        let r = super::rms_norm::gated_norm_params(out, norm.w, y, dv, t * nv, norm.eps, norm.gate, norm.act)?;
        let p = DeltaNormParams { d, r, q, count };
        if cluster {
            let f = self.function(&DELTA_RULE, "delta_rule_norm_cluster")?;
            // SAFETY: as below, without counters; d_v = 128 (checked) makes a cluster of 8 blocks
            // of 16 columns one head, so n_v_head · d_v / 16 blocks are whole clusters.
            unsafe { self.launch(&f, ((nv * dv / 16) as u32, t as u32, 1), 512, 0, &p)? };
            return Ok(generation);
        }
        let f = self.function(&DELTA_RULE, "delta_rule_norm_seqs")?;
        // SAFETY: sizes checked above and by check_seqs; one row a sequence (lens), inside the
        // rows (the caller's contract, as for delta_rule_seqs); the kernel skips slots >= n_slots;
        // d_v % 32 == 0 keeps a block's 4 columns in one head, d_v <= 128 the norm one warp's;
        // the counters hold t · nv zeros and the kernel leaves them zero; with q set the
        // scratch holds q8_bytes(t · nv · d_v).
        unsafe { self.launch(&f, ((nv * dv / 4) as u32, t as u32, 1), 128, 0, &p)? };
        Ok(generation)
    }
}

/// The launch parameters of the scan over a step's sequences (those of fewer than `below` rows).
fn seqs_params(
    s: DeltaShape,
    i: &DeltaIn<'_>,
    seqs: SeqRows<'_>,
    state: &Buf<f32>,
    at: StateAt,
    out: &Buf<f32>,
    below: u32,
) -> Result<DeltaSeqsParams> {
    const OP: &str = "delta_rule_seqs";
    Ok(DeltaSeqsParams {
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
        n_k_head: s.n_k_head as u32,
        d_k: s.d_k as u32,
        n_v_head: u32_of(OP, "n_v_head", s.n_v_head)?,
        d_v: u32_of(OP, "d_v", s.d_v)?,
        n_slots: u32_of(OP, "n_slots", at.n_slots)?,
        scan_below: below,
    })
}

/// The checks of a step's delta rule: the shape the scan takes, the inputs and output for
/// `s.n_tok` rows, the sequences and the state.
fn check_seqs(
    op: &'static str,
    s: DeltaShape,
    i: &DeltaIn<'_>,
    seqs: SeqRows<'_>,
    state: &Buf<f32>,
    at: StateAt,
    out: &Buf<f32>,
) -> Result<()> {
    let (t, nk, dk, nv, dv) = (s.n_tok, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
    if !dk.is_multiple_of(32) || dk > 256 || nk == 0 || at.len != nv * dv * dk {
        return Err(shape(op, format!("d_k = {dk} (a multiple of 32, at most 256), n_k_head = {nk}, state of {}", at.len)));
    }
    need(op, "q", i.q, t * nk * dk)?;
    need(op, "k", i.k, t * nk * dk)?;
    need(op, "v", i.v, t * nv * dv)?;
    need(op, "g", i.g, t * nv)?;
    need(op, "beta", i.beta, t * nv)?;
    need(op, "out", out, t * nv * dv)?;
    seqs.check(op)?;
    at.check(op, state)
}
