//! Bad GGUF metadata gives an error naming the key; never a panic.

use ember_gguf::{GgufFile, GgufWriter, Value, ValueType};
use ember_tokenizer::{Error, Tokenizer};

fn strs(v: &[&str]) -> Value {
    Value::Array(ValueType::String, v.iter().map(|s| Value::String(s.to_string())).collect())
}

/// A 6-token vocab: bytes `a`, `b`, `Ġ`, merges `a b`, `ab Ġ`... built with the given edits.
fn build(edit: impl FnOnce(&mut GgufWriter)) -> Result<Tokenizer, Error> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35moe".into()));
    w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.set("tokenizer.ggml.pre", Value::String("qwen35".into()));
    w.set("tokenizer.ggml.tokens", strs(&["a", "b", "Ġ", "ab", "Ġab", "<|im_end|>"]));
    w.set("tokenizer.ggml.token_type", Value::Array(ValueType::I32, [1, 1, 1, 1, 1, 3].into_iter().map(Value::I32).collect()));
    w.set("tokenizer.ggml.merges", strs(&["a b", "Ġ ab"]));
    w.set("tokenizer.ggml.eos_token_id", Value::U32(5));
    edit(&mut w);
    let f = GgufFile::from_bytes(w.to_bytes(&[]).unwrap()).unwrap();
    Tokenizer::from_gguf(&f)
}

fn err(edit: impl FnOnce(&mut GgufWriter)) -> String {
    build(edit).expect_err("should fail").to_string()
}

#[test]
fn minimal_vocab_works() {
    let tok = build(|_| {}).unwrap();
    assert_eq!(tok.encode("ab ab", false), [3, 4]);
    assert_eq!(tok.encode("ab<|im_end|>", true), [3, 5]);
    assert_eq!(tok.eog_ids(), &[5]);
    // A byte with no token (here 'c') is dropped, as llama.cpp's byte fallback does.
    assert_eq!(tok.encode("acb", false), [0, 1]);
}

#[test]
fn unsupported_pre_lists_supported() {
    let e = err(|w| {
        w.set("tokenizer.ggml.pre", Value::String("llama-bpe".into()));
    });
    assert!(e.contains("tokenizer.ggml.pre") && e.contains("llama-bpe") && e.contains("qwen35") && e.contains("qwen2"), "{e}");
    let tok = build(|w| {
        w.set("tokenizer.ggml.pre", Value::String("qwen2".into()));
    })
    .unwrap();
    assert_eq!(tok.summary().pre, "qwen2");
}

#[test]
fn unsupported_model() {
    let e = err(|w| {
        w.set("tokenizer.ggml.model", Value::String("llama".into()));
    });
    assert!(e.contains("tokenizer.ggml.model") && e.contains("gpt2"), "{e}");
}

#[test]
fn merge_naming_unknown_token() {
    let e = err(|w| {
        w.set("tokenizer.ggml.merges", strs(&["a b", "Ġ zz"]));
    });
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("[1]") && e.contains("\"zz\""), "{e}");
    let e = err(|w| {
        w.set("tokenizer.ggml.merges", strs(&["ab"]));
    });
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("[0]"), "{e}");
    // Both sides are tokens but their concatenation is not.
    let e = err(|w| {
        w.set("tokenizer.ggml.merges", strs(&["b a"]));
    });
    assert!(e.contains("merged") && e.contains("\"ba\""), "{e}");
}

#[test]
fn missing_keys_and_lengths() {
    let e = err(|w| {
        w.set("tokenizer.ggml.pre", Value::U32(1));
    });
    assert!(e.contains("tokenizer.ggml.pre"), "{e}");
    let e = err(|w| {
        w.set("tokenizer.ggml.token_type", Value::Array(ValueType::I32, vec![Value::I32(1); 3]));
    });
    assert!(e.contains("tokenizer.ggml.token_type") && e.contains("3") && e.contains("6"), "{e}");
    let e = err(|w| {
        w.set("tokenizer.ggml.token_type", Value::Array(ValueType::I32, vec![Value::I32(9); 6]));
    });
    assert!(e.contains("tokenizer.ggml.token_type") && e.contains("9"), "{e}");
    let e = err(|w| {
        w.set("tokenizer.ggml.eos_token_id", Value::U32(6));
    });
    assert!(e.contains("tokenizer.ggml.eos_token_id") && e.contains("6"), "{e}");
    let e = err(|w| {
        w.set("tokenizer.ggml.tokens", strs(&[]));
    });
    assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
}

#[test]
fn missing_required_key() {
    let mut w = GgufWriter::new();
    w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.set("tokenizer.ggml.pre", Value::String("qwen35".into()));
    w.set("tokenizer.ggml.tokens", strs(&["a"]));
    let f = GgufFile::from_bytes(w.to_bytes(&[]).unwrap()).unwrap();
    let e = Tokenizer::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.merges") && e.contains("missing"), "{e}");
}
