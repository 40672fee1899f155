//! Compresses the Qwen3.6 vocabulary fixture into OUT_DIR, where `bundled_vocab` includes it:
//! `ember synth` then carries the real tokenizer inside the binary and works away from the
//! checkout. Deflate at level 9 takes 10.9 MB to about 3 MB.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let src = dir.join("../../tests/fixtures/qwen36-vocab/ggml-vocab-qwen36.gguf");
    println!("cargo::rerun-if-changed={}", src.display());
    let bytes = std::fs::read(&src).unwrap_or_else(|e| panic!("reading {}: {e}", src.display()));
    let packed = miniz_oxide::deflate::compress_to_vec(&bytes, 9);
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("qwen36-vocab.gguf.deflate");
    std::fs::write(&out, packed).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
