/// Everything that can go wrong building a [`crate::Tokenizer`] from GGUF metadata.
///
/// Encoding and decoding never fail: any `&str` encodes, any id decodes (unknown ids to
/// nothing).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A missing key or a key of the wrong type; the message names the key.
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] ember_gguf::Error),
    #[error("unsupported tokenizer model {found:?} in 'tokenizer.ggml.model' (supported: \"gpt2\")")]
    UnsupportedModel { found: String },
    #[error("unsupported pre-tokenizer {found:?} in 'tokenizer.ggml.pre' (supported: \"qwen35\", \"qwen2\")")]
    UnsupportedPre { found: String },
    #[error("'tokenizer.ggml.tokens' is empty")]
    EmptyVocab,
    #[error("'{key}' has {found} entries, expected {expected} (one per token of 'tokenizer.ggml.tokens')")]
    LengthMismatch { key: &'static str, found: usize, expected: usize },
    #[error("'tokenizer.ggml.token_type'[{index}] = {value} is not a token type (0..=6)")]
    BadTokenType { index: usize, value: i64 },
    #[error("'tokenizer.ggml.merges'[{index}] = {merge:?}: {msg}")]
    BadMerge { index: usize, merge: String, msg: String },
    #[error("'{key}' = {id} is out of range (n_vocab = {n_vocab})")]
    BadSpecialId { key: &'static str, id: i128, n_vocab: usize },
    /// The built-in pre-tokenizer pattern failed to compile (a bug, not a file problem).
    #[error("pre-tokenizer {pre:?}: regex does not compile: {msg}")]
    Regex { pre: &'static str, msg: String },
}
