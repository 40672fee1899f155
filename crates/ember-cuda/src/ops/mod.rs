//! Launchers, one file per op (the same names as the kernels and the CPU ops). Each checks the
//! buffer sizes against the shapes, then launches; the kernels trust what the launcher checked.
//! Index inputs that live on the device (token ids, row indices, positions) cannot be checked
//! on the host: the kernels turn an out-of-range index into a NaN row instead of reading past.

mod add;
mod attn_prep;
mod conv1d_silu;
mod delta_prep;
mod delta_rule;
mod gate;
mod get_rows;
mod matmul;
mod moe;
mod rms_norm;
mod route;
mod select_rows;

pub use attn_prep::{AttnPrepIn, AttnPrepShape};
pub use delta_prep::{DeltaPrepIn, DeltaPrepOut, DeltaPrepShape};
pub use delta_rule::{DeltaIn, DeltaShape};
pub use gate::Act;
pub use matmul::{DeviceWeight, GEMV_MAX_TOKENS, WeightRef};
pub use moe::{MoeExperts, MoeRouting};
pub use route::ROUTE_SUM_MIN;

use crate::error::{Result, shape};
use crate::gpu::Buf;

/// Checks that `buf` holds at least `need` elements.
fn need<T>(op: &'static str, what: &str, buf: &Buf<T>, need: usize) -> Result<()> {
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
