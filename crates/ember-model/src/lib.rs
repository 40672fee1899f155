//! The `qwen35moe` model (Qwen3.5 / Qwen3.6 MoE): typed config, per-layer weights that borrow
//! the memory-mapped GGUF, per-sequence state, and a forward pass written over the op set.
//!
//! No device-specific code lives here: every computation is an [`ember_ops::Ops`] call, so the
//! same `forward` runs on the scalar reference, the CPU backend, or a future GPU backend. The
//! decision a reader may question: weights are never converted at load time, except the small
//! F32-by-convention vectors (norms, conv taps, decay parameters), which are copied into `Vec<f32>`
//! once because every op reads them whole.

#![forbid(unsafe_code)]

mod config;
mod qwen35moe;
mod state;
mod weights;

pub use config::{Config, LayerKind, SUPPORTED_ARCHS};
pub use ember_ops::Snapshot;
pub use qwen35moe::{DeltaMode, Forward, Logits, Model, QueuedTop, SeqBatch, StepRows};
pub use state::SeqState;
pub use weights::TensorGroup;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] ember_gguf::Error),
    #[error("unsupported architecture '{arch}' (supported: {supported})")]
    UnsupportedArch { arch: String, supported: String },
    #[error("bad model config: {0}")]
    BadConfig(String),
    #[error("tensor '{name}': {msg}")]
    BadTensor { name: String, msg: String },
    #[error("batch: {0}")]
    BadBatch(String),
    #[error(transparent)]
    Op(#[from] ember_ops::OpError),
    /// Sequence `index` of a batched forward call was rejected before anything ran.
    #[error("sequence {index}: {source}")]
    InSequence { index: usize, source: Box<Error> },
    #[error("context full: {n_past} tokens in the sequence + {n_new} new > context size {n_ctx}")]
    ContextFull { n_past: usize, n_new: usize, n_ctx: usize },
}
