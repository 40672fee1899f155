//! GGUF files: parsing, memory mapping, writing, and the ggml block formats.
//!
//! The reader validates every count, length and offset against the file size before it
//! hands out a view, so malformed files produce an [`Error`] naming the problem and the
//! byte offset instead of a panic. Tensor data is never copied: a [`TensorInfo`] plus
//! [`GgufFile::tensor_data`] give the raw, still-quantised bytes straight from the map.
//!
//! The design decision a reader may question: metadata arrays are parsed eagerly into
//! owned values. The Qwen3.6 vocabulary is 248k strings + 247k merges (~10 MB); parsing it
//! once costs ~20 ms and makes every later lookup trivial and safe.

mod error;
mod reader;
mod types;
mod value;
mod writer;

pub mod quant;

pub use error::{Error, Result};
pub use reader::{GgufFile, LoadMode, TensorInfo};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::{GgufWriter, TensorSpec, write_split};
