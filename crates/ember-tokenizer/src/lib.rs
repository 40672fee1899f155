//! ember-tokenizer: text <-> token ids for `gpt2`-model (byte-level BPE) GGUF vocabularies
//! with the `qwen35` (Qwen3.5/3.6) or `qwen2` pre-tokenizer, plus a streaming detokenizer
//! that never emits partial UTF-8. No chat formats here (that is `ember-chat`).
//!
//! Pipeline of [`Tokenizer::encode`] (spec `tokenizer-and-chat.md` §2-3, llama.cpp
//! `llm_tokenizer_bpe`): split out added tokens (longest first; CONTROL ones only with
//! `parse_special`), pre-tokenize each remaining fragment with the family regex, then
//! byte-level BPE following the merge ranks (no whole-word vocab shortcut, as llama.cpp and
//! HF; tiktoken differs on the 201 ranks that have no merge). BOS is never added.
//!
//! The design decision a reader may question: **no Unicode normalisation**. HF's
//! `Qwen3_5Tokenizer` applies NFC before pre-tokenising; llama.cpp applies none, and we
//! match llama.cpp (our reference for ids). The two agree on text that is already NFC (the
//! common case); on decomposed input they differ: NFD `"e\u{301}"` is `[68, 52033]` here
//! and `[933]` in HF. In `qwen36-vocab/vectors.json` exactly four strings differ from HF's
//! `ids_hf` for this reason (`é`, `résumé`, `àààà…` and `Café crème brûlée`, all NFD); the
//! tiny-a fixture has four such strings too. A caller that
//! wants HF's ids should NFC-normalise message text before rendering the prompt.
//!
//! Unicode classes (`\p{L}`, `\p{M}`, `\p{N}`, `\s`) come from the regex engine's tables
//! (regex-automata via fancy-regex), which agreed with llama.cpp's on every code point of
//! the fixture's cross-validation.

#![forbid(unsafe_code)]

mod bpe;
mod bytes;
mod error;
mod pretok;
mod stream;
mod tokenizer;

pub use error::Error;
pub use pretok::PreTokenizerKind;
pub use stream::StreamDecoder;
pub use tokenizer::{TokenType, Tokenizer, TokenizerSummary};
