//! The fixture GGUFs parse, and their tensors tile the data section as llama.cpp lays it out.

use ember_gguf::GgufFile;
use std::path::PathBuf;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel)
}

#[test]
fn tiny_fixtures_parse() {
    for q in ["BF16", "Q8_0", "Q6_K", "Q4_K_M"] {
        let f = GgufFile::open(fixture(&format!("tiny-a/gguf/tiny-a-{q}.gguf"))).unwrap();
        assert_eq!(f.get_str("general.architecture").unwrap(), "qwen35moe");
        assert_eq!(f.tensors().len(), 73, "{q}");
        let mut end = 0;
        for t in f.tensors() {
            assert_eq!(t.offset % f.alignment(), 0);
            assert!(t.offset >= end);
            end = t.offset + t.n_bytes;
        }
        assert_eq!(f.data_offset() + end, f.file_len(), "{q}: tensors tile the data section");
    }
}

#[test]
fn vocab_fixture_parses() {
    let f = GgufFile::open(fixture("qwen36-vocab/ggml-vocab-qwen36.gguf")).unwrap();
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 248_320);
    assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap().len(), 247_587);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 248_046);
    assert!(f.tensors().is_empty());
}
