use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong reading or writing a GGUF file. Parse errors carry the
/// byte offset at which the problem was found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a GGUF file: bad magic {found:02x?} at offset 0 (expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} at offset 4 (supported: 2, 3){hint}")]
    BadVersion { version: u32, hint: &'static str },
    #[error("file truncated: needed {needed} bytes for {what} at offset {offset}, file is {file_len} bytes")]
    Truncated { what: String, offset: u64, needed: u64, file_len: u64 },
    #[error("{what} at offset {offset}: {msg}")]
    Malformed { what: String, offset: u64, msg: String },
    #[error("tensor '{name}': {msg}")]
    BadTensor { name: String, msg: String },
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: String },
    #[error("tensor '{name}' not found")]
    MissingTensor { name: String },
    #[error("split model, {path}: {msg}")]
    Split { path: PathBuf, msg: String },
    #[error("quantisation: {0}")]
    Quant(String),
}

impl Error {
    pub(crate) fn malformed(what: impl Into<String>, offset: u64, msg: impl Into<String>) -> Self {
        Error::Malformed { what: what.into(), offset, msg: msg.into() }
    }
}
