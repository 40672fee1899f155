use cudarc::driver::DeviceRepr;

use super::{SeqRows, StateAt, blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::CONV1D_SILU;

const OP: &str = "conv1d_silu";
/// `CONV_MAX_K` in kernels/conv1d_silu.cu.
const MAX_KERNEL: usize = 8;

#[repr(C)]
struct ConvParams {
    x: u64,
    w: u64,
    state: u64,
    out: u64,
    n_tok: u32,
    c: u32,
    k: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `ConvParams` in kernels/conv1d_silu.cu.
unsafe impl DeviceRepr for ConvParams {}

#[repr(C)]
struct ConvSeqsParams {
    x: u64,
    w: u64,
    state: u64,
    out: u64,
    row0: u64,
    n: u64,
    slot: u64,
    slot_stride: u64,
    offset: u64,
    c: u32,
    k: u32,
    n_slots: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `ConvSeqsParams` in kernels/conv1d_silu.cu.
unsafe impl DeviceRepr for ConvSeqsParams {}

impl Gpu {
    /// Causal depthwise conv of x [n_tok, c] with w [c · kernel] (`w[ch·kernel + j]`) over the
    /// carried state [(kernel − 1) · c], then SiLU, into out [n_tok, c]; the state becomes the
    /// last kernel − 1 inputs.
    #[allow(clippy::too_many_arguments)] // the op's own arguments: x, w and state with their sizes
    pub fn conv1d_silu(
        &self,
        x: &Buf<f32>,
        n_tok: usize,
        c: usize,
        w: &Buf<f32>,
        kernel: usize,
        state: &mut Buf<f32>,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        if kernel == 0 || kernel > MAX_KERNEL {
            return Err(shape(OP, format!("kernel length {kernel} (1..={MAX_KERNEL})")));
        }
        need(OP, "x", x, n_tok * c)?;
        need(OP, "w", w, c * kernel)?;
        need(OP, "state", state, (kernel - 1) * c)?;
        need(OP, "out", out, n_tok * c)?;
        if c == 0 {
            return Ok(());
        }
        let p = ConvParams {
            x: x.ptr(),
            w: w.ptr(),
            state: state.ptr(),
            out: out.ptr(),
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            c: u32_of(OP, "c", c)?,
            k: kernel as u32,
            pad: 0,
        };
        let f = self.function(&CONV1D_SILU, "conv1d_silu")?;
        // SAFETY: sizes checked above; kernel <= CONV_MAX_K.
        unsafe { self.launch(&f, (blocks(c, 128), 1, 1), 128, 0, &p) }
    }

    /// [`Gpu::conv1d_silu`] for every sequence of a step in one launch: sequence s's rows of x
    /// [n_rows, c] continue the history in slot `seqs.slot[s]` of `state` (at `at`). The spans
    /// must lie inside the rows (the caller built them); a slot out of range gives NaN rows.
    #[allow(clippy::too_many_arguments)] // the op's own arguments: x, w and the states with their layout
    pub fn conv1d_silu_seqs(
        &self,
        x: &Buf<f32>,
        n_rows: usize,
        c: usize,
        w: &Buf<f32>,
        kernel: usize,
        seqs: SeqRows<'_>,
        state: &mut Buf<f32>,
        at: StateAt,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        if kernel == 0 || kernel > MAX_KERNEL || at.len != (kernel - 1) * c {
            return Err(shape(OP, format!("kernel length {kernel} (1..={MAX_KERNEL}), state of {} for {c} channels", at.len)));
        }
        need(OP, "x", x, n_rows * c)?;
        need(OP, "w", w, c * kernel)?;
        need(OP, "out", out, n_rows * c)?;
        seqs.check(OP)?;
        at.check(OP, state)?;
        if c == 0 || seqs.n_seq == 0 {
            return Ok(());
        }
        let p = ConvSeqsParams {
            x: x.ptr(),
            w: w.ptr(),
            state: state.ptr(),
            out: out.ptr(),
            row0: seqs.row0.ptr(),
            n: seqs.n.ptr(),
            slot: seqs.slot.ptr(),
            slot_stride: at.slot_stride as u64,
            offset: at.offset as u64,
            c: u32_of(OP, "c", c)?,
            k: kernel as u32,
            n_slots: u32_of(OP, "n_slots", at.n_slots)?,
            pad: 0,
        };
        let f = self.function(&CONV1D_SILU, "conv1d_silu_seqs")?;
        let chunks = n_rows.div_ceil(CONV_CHUNK).max(1);
        if chunks > 65_535 {
            return Err(shape(OP, format!("{n_rows} rows (at most {} per call)", 65_535 * CONV_CHUNK)));
        }
        // SAFETY: x and out hold n_rows·c floats, w c·kernel, the state n_slots slots with the
        // layer's history inside each (checked above); the spans lie inside the rows (the
        // caller's contract); the kernel skips slots >= n_slots and chunks past a sequence's
        // rows.
        unsafe { self.launch(&f, (blocks(c, 128), seqs.n_seq as u32, chunks as u32), 128, 0, &p) }
    }
}

/// Tokens a thread of `conv1d_silu_seqs` walks (`CONV_CHUNK` in kernels/conv1d_silu.cu): a
/// 512-token prompt of 8,192 channels is 64 blocks with one thread a channel walking every
/// token, 2,048 in chunks of 16. Each sequence of a call has at most `n_rows` rows, so
/// `n_rows / CONV_CHUNK` chunks cover every one of them (blocks past a sequence's rows leave).
const CONV_CHUNK: usize = 16;
