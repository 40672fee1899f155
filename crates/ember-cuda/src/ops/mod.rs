//! Launchers, one file per op (the same names as the kernels and the CPU ops). Each checks the
//! buffer sizes against the shapes, then launches; the kernels trust what the launcher checked.
//! Index inputs that live on the device (token ids, row indices, positions) cannot be checked
//! on the host: the kernels turn an out-of-range index into a NaN row instead of reading past.

mod add;
mod attention;
mod attn_prep;
mod conv1d_silu;
mod delta_prep;
mod delta_rule;
mod gate;
mod gemv_q8;
mod get_rows;
mod kv_append;
mod mailbox;
mod matmul;
mod moe;
mod moe_route;
mod q6_repack;
mod rms_norm;
mod route;
mod select_rows;
mod top_k;
mod wgmma;

pub use attention::{
    ATTENTION_DECODE_ENTRIES, ATTENTION_DECODE_SPLITS, ATTENTION_MMA_MIN_ROW_KEYS, ATTENTION_MMA_MIN_ROWS, ATTENTION_SPLIT_KEYS,
    ATTENTION_TILE_MIN_KEYS, ATTENTION_TILE_MIN_ROWS, AttentionPath, AttentionShape, decode_keys_per_split,
};
pub use attn_prep::{AttnPrepIn, AttnPrepKv, AttnPrepShape};
pub use delta_prep::{CONV_PREP_MAX_DK, ConvPart, DeltaPrepIn, DeltaPrepOut, DeltaPrepShape};
pub use delta_rule::{DELTA_AUTO_CHUNKED_FROM, DELTA_CHUNK, DELTA_NORM_MAX_DV, DeltaIn, DeltaShape, HeadNorm};
pub use gate::Act;
pub use gemv_q8::{GEMV_Q8_MULTI, q8_bytes};
pub(crate) use gemv_q8::{ROWS_MIN_BYTES as GEMV_Q8_ROWS_MIN_BYTES, gemv_q8_mixed_on};
pub use kv_append::{KV_PAGE, KvPages};
pub use matmul::{
    DeviceWeight, GEMV_MAX_TOKENS, GEMV_MULTI, MMA_MIN_TOKENS, MMA8_MAX_TOKENS, MMV_PROMPT_MAX_ROWS, MatmulKernel, Precision, WeightRef,
};
pub use moe::{
    DownForm, GateUpForm, MOE_MISS, MOE_MMA_MIN_TOKENS, MoeExperts, MoeRouting, MoeSharedQ8, MoeSlots, SharedWeights, moe_scratch_len,
};
pub(crate) use moe::{MOE8S_MAX_PAIRS, MOE8SD_MAX_PAIRS};
pub use q6_repack::q6k_repack_row;
pub use route::ROUTE_SUM_MIN;
pub use top_k::{TOPK_BINS, TOPK_CAND, TOPK_CHUNK, TOPK_SPLIT_MIN, TopKScratch};

use crate::error::{Result, shape};
use crate::gpu::Buf;

/// Whether a cluster launch of `f` (its cluster size a compile-time attribute: moe_route,
/// moe_fused_q8) fits this GPU: the function allowed a cluster past the portable 8 and `smem`
/// bytes of dynamic shared memory, then the driver asked whether one cluster of `blocks` blocks
/// of `threads` threads with that shared memory can be resident.
pub(crate) fn cluster_fits(f: &cudarc::driver::CudaFunction, blocks: u32, threads: u32, smem: usize) -> bool {
    use cudarc::driver::sys::{self, CUfunction_attribute::*};
    if f.set_attribute(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1).is_err()
        || f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).is_err()
    {
        return false;
    }
    let config = sys::CUlaunchConfig {
        gridDimX: blocks,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem as u32,
        hStream: std::ptr::null_mut(),
        attrs: std::ptr::null_mut(),
        numAttrs: 0,
    };
    let mut n = 0;
    // SAFETY: `f` is a loaded function of this context; the config names no attributes.
    let rc = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
    rc == sys::CUresult::CUDA_SUCCESS && n >= 1
}

/// Whether weight-reading decode kernels ask for their blocks' weights in L2 before they wait
/// for the kernel ahead (`prefetch_l2` in kernels/prelude.cuh); `EMBER_L2_PREFETCH=0` turns it
/// off (measurements).
pub(crate) fn l2_prefetch() -> u32 {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    u32::from(switch(&ON, "EMBER_L2_PREFETCH"))
}

/// An `EMBER_*` switch that turns a path off for measurements: on unless the environment sets
/// it to 0, off or false; read once, into `cell`.
pub(crate) fn switch(cell: &'static std::sync::OnceLock<bool>, name: &str) -> bool {
    *cell.get_or_init(|| switch_now(name))
}

/// [`switch`] read now.
pub(crate) fn switch_now(name: &str) -> bool {
    !matches!(std::env::var(name).as_deref(), Ok("0" | "off" | "false"))
}

/// The sequences of a step, as device buffers written once per step: sequence s has rows
/// `row0[s]..row0[s] + n[s]` of the activations and its state in slot `slot[s]`.
#[derive(Debug, Clone, Copy)]
pub struct SeqRows<'a> {
    pub row0: &'a Buf<u32>,
    pub n: &'a Buf<u32>,
    pub slot: &'a Buf<u32>,
    pub n_seq: usize,
}

impl SeqRows<'_> {
    fn check(&self, op: &'static str) -> Result<()> {
        need(op, "row0", self.row0, self.n_seq)?;
        need(op, "n", self.n, self.n_seq)?;
        need(op, "slot", self.slot, self.n_seq)?;
        if self.n_seq > 65535 {
            return Err(shape(op, format!("{} sequences (at most 65535 per call)", self.n_seq)));
        }
        Ok(())
    }
}

/// Where one layer's state sits in a buffer of per-slot states: slot s at
/// `s · slot_stride + offset`, `len` floats, for `n_slots` slots.
#[derive(Debug, Clone, Copy)]
pub struct StateAt {
    pub slot_stride: usize,
    pub offset: usize,
    pub len: usize,
    pub n_slots: usize,
}

impl StateAt {
    fn check(&self, op: &'static str, state: &Buf<f32>) -> Result<()> {
        if self.n_slots > 0 && self.offset + self.len > self.slot_stride {
            return Err(shape(op, format!("state {}+{} in slots of {}", self.offset, self.len, self.slot_stride)));
        }
        need(op, "state", state, self.n_slots * self.slot_stride)
    }
}

/// Checks that `buf` holds at least `need` elements.
fn need<T: crate::gpu::Elem>(op: &'static str, what: &str, buf: &Buf<T>, need: usize) -> Result<()> {
    if buf.len() < need {
        return Err(shape(op, format!("{what} holds {} values, needs {need}", buf.len())));
    }
    Ok(())
}

/// `n` as a kernel's u32 field.
fn u32_of(op: &'static str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| shape(op, format!("{what} = {n} exceeds u32")))
}

/// Blocks of `block` threads to cover `n` items.
fn blocks(n: usize, block: usize) -> u32 {
    n.div_ceil(block) as u32
}
