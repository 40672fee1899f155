//! ember-engine: sessions, scheduling, batching, prefix/GDN-state checkpoints and sampling.
//! Ids in, ids out; never sees text. For now it holds the sampler.
//!
//! The decision a reader would question: the sampler has its own RNG (xoshiro256**) instead
//! of a `rand` dependency, so a seed fixes the token sequence across platforms and crate
//! upgrades, and the hot path is one reusable buffer with no allocation per token.
#![forbid(unsafe_code)]

pub mod prefix_cache;
pub mod sampler;

pub use sampler::{Sampler, SamplerConfig};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A sampling parameter is out of range.
    #[error("`{field}` must be {limit}, got {got}")]
    Config {
        field: &'static str,
        limit: &'static str,
        got: String,
    },
}
