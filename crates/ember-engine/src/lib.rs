//! ember-engine: sessions, scheduling, batching, prefix/GDN-state checkpoints and sampling.
//! Ids in, ids out; never sees text. `engine` is the scheduler thread (continuous batching over
//! a [`Backend`]); `sampler` picks tokens.
//!
//! Decisions a reader would question: the engine runs on its own OS thread and talks through
//! channels and an [`EventSink`] callback, so it depends on no async runtime; and the sampler
//! has its own RNG (xoshiro256**) instead of a `rand` dependency, so a seed fixes the token
//! sequence across platforms and crate upgrades, and the hot path is one reusable buffer with
//! no allocation per token.
#![forbid(unsafe_code)]

pub mod engine;
mod model_backend;
pub mod prefix_cache;
pub mod sampler;
mod script_backend;

pub use engine::{
    Backend, EngineConfig, EngineHandle, EngineStats, Event, EventSink, FinishReason, GenRequest, Logits, Row, Step, TokenLogprobs, start,
};
pub use model_backend::{ModelBackend, pool_pages};
pub use sampler::{Sampler, SamplerConfig};
pub use script_backend::{ScriptBackend, ScriptSnapshot, ScriptState};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A sampling parameter is out of range.
    #[error("`{field}` must be {limit}, got {got}")]
    Config { field: &'static str, limit: &'static str, got: String },
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt leaves no room to generate.
    #[error("the prompt has {n_prompt} tokens but the context size is {n_ctx} (at least one token must be left for generation)")]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
    #[error("token id {id} is out of range (the vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    /// All slots are busy and `n_queue` requests already wait.
    #[error("the server is busy: {n_queue} requests are already waiting")]
    QueueFull { n_queue: usize },
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// The model or its ops failed.
    #[error("backend: {0}")]
    Backend(String),
    /// Item `index` of a forward call was rejected before anything ran (its state is
    /// untouched): only that sequence fails.
    #[error("sequence {index}: {msg}")]
    Sequence { index: usize, msg: String },
}
