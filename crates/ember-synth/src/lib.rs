//! Synthetic `qwen35moe` models: a valid GGUF of any shape of the Qwen3.5/3.6 MoE family with
//! random weights and the real Qwen3.6 tokenizer, so speed can be measured (by ember and by
//! llama.cpp, on the same file) without downloading the real 20 GiB checkpoint.
//!
//! * [`Shape`]: the hyper-parameters, with presets (`tiny`, `small`, `35b-a3b`) and JSON.
//! * [`Recipe`]: which ggml type each tensor gets (`f16` … `q4_k_m`, `ud-q4_k_m`).
//! * [`Plan`]: every tensor and metadata key of the file; [`write`] streams it.
//!
//! The decision a reader may question: weights are random but not arbitrary. Their scales are
//! chosen so the residual stream stays O(1) through all layers and logits look like a trained
//! model's (std ~2.5), and the router has a configurable Zipf popularity skew, because expert
//! placement and caching work must be measured on skewed routing. Values are drawn per chunk
//! from a seed derived from (seed, tensor, chunk), so a file is reproducible bit for bit
//! whatever the thread count.

#![forbid(unsafe_code)]

mod draw;
pub mod fastq;
mod plan;
mod recipe;
pub mod rng;
mod shape;
mod write;

pub use draw::expert_rank;
pub use plan::{Init, Plan, Planned, SynthOptions, scale, type_counts};
pub use recipe::{Kind, RECIPES, Recipe, more_bits};
pub use shape::{PRESETS, Shape};
pub use write::write;

/// Path of the Qwen3.6 vocabulary fixture in a checkout of this repository (tests and
/// examples; an installed binary uses [`bundled_vocab`]).
pub const DEFAULT_VOCAB: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/qwen36-vocab/ggml-vocab-qwen36.gguf");

/// The same vocabulary, deflated by `build.rs` and carried in the binary.
const BUNDLED_VOCAB: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/qwen36-vocab.gguf.deflate"));

/// Inflated size limit: the file is 10.9 MB; anything much larger is not our file.
const MAX_VOCAB_BYTES: usize = 64 << 20;

/// The Qwen3.6 tokenizer (a vocabulary-only GGUF: `tokenizer.*` keys, no tensors) from inside
/// the binary, so `ember synth` needs no file but its output.
pub fn bundled_vocab() -> Result<ember_gguf::GgufFile, Error> {
    let bytes = miniz_oxide::inflate::decompress_to_vec_with_limit(BUNDLED_VOCAB, MAX_VOCAB_BYTES)
        .map_err(|e| Error::BundledVocab(format!("{:?}", e.status)))?;
    Ok(ember_gguf::GgufFile::from_bytes(bytes)?)
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] ember_gguf::Error),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad shape: {0}")]
    BadShape(String),
    #[error("{0}")]
    BadRecipe(String),
    #[error("the tokenizer bundled in this binary does not inflate ({0})")]
    BundledVocab(String),
}
