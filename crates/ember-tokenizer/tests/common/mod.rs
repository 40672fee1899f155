#![allow(dead_code)]

use std::sync::OnceLock;

use ember_gguf::GgufFile;
use ember_tokenizer::Tokenizer;

/// The real 248k Qwen3.6 vocabulary, loaded once per test binary.
pub fn qwen36() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let f = GgufFile::open(ember_testkit::fixture("qwen36-vocab/ggml-vocab-qwen36.gguf")).expect("open qwen36 vocab");
        Tokenizer::from_gguf(&f).expect("build qwen36 tokenizer")
    })
}

pub fn tiny() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let f = GgufFile::open(ember_testkit::fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).expect("open tiny-a");
        Tokenizer::from_gguf(&f).expect("build tiny-a tokenizer")
    })
}

pub fn json(rel: &str) -> serde_json::Value {
    let path = ember_testkit::fixture(rel);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_slice(&bytes).expect("fixture json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}
