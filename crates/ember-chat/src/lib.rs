//! ember-chat: messages -> prompt text (the GGUF's Jinja chat template), and the model's
//! streamed text -> content, reasoning and tool calls (`OutputParser`, `src/parse.rs`).
//! No HTTP, no token ids.
//!
//! The decision a reader would question: templates run on minijinja, a reimplementation of
//! Jinja2, yet prompts must be byte-identical to HF transformers' Python Jinja2. minijinja with
//! `pycompat` gets the syntax and string methods right; what differs is Python's *value*
//! semantics, so this crate overrides exactly those (`tojson` = `json.dumps`, `str()` of
//! floats/containers, the `iterable`/`sequence` tests) in `src/python.rs`, and the tests compare
//! against renders produced by Jinja2 itself (`tests/fixtures/gen_expected.py`).
//!
//! Known remaining difference: the `~` operator formats floats with minijinja's own
//! `Display` (`0.0000001`, Python `1e-07`); no known Qwen template concatenates floats.
#![forbid(unsafe_code)]

mod parse;
mod python;
mod template;

pub use parse::{OutputParser, ParseEvent, ParsedOutput, ParsedToolCall, ParserOptions, ToolSpec, parse_complete};
pub use template::{ChatTemplate, RenderRequest};

/// Errors of template compilation and rendering.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The template does not compile (message names the cause and line).
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`: the request is not renderable
    /// (e.g. "No user query found in messages."). The message is shown verbatim.
    #[error("{message}")]
    Template { message: String },
    /// Any other failure while rendering (bad value types, unknown filter, ...).
    #[error("chat template failed: {0}")]
    Render(String),
    /// A tool call's `arguments` string is not JSON.
    #[error("messages[{message}].tool_calls[{call}].function.arguments is not valid JSON: {reason}")]
    ToolCallArguments { message: usize, call: usize, reason: String },
    /// A request's `tools` entry is not an OpenAI function tool (`field` is its JSON path).
    #[error("{field} {reason}")]
    Tools { field: String, reason: String },
    /// `chat_template_kwargs` tried to set a name the renderer owns.
    #[error("chat_template_kwargs may not set `{0}`")]
    ReservedKwarg(String),
}
