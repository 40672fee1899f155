//! The tiny test model's own tokenizer (`tests/fixtures/tiny-a/`, 623 tokens, pre qwen35).
//!
//! `tokenizer_cases[].llama_cpp` were produced with special parsing on: the cases containing
//! `<|im_start|>` / `<|im_end|>` / `<|endoftext|>` hold the CONTROL ids (617, 618, 616), which
//! llama.cpp only emits with `parse_special = true`. We compare with `encode(text, true)`.
//! The `hf` ids differ on four decomposed-accent strings because HF applies NFC (we don't).

mod common;

use common::{ids, json, tiny};

#[test]
fn tokenizer_cases_match_llama_cpp() {
    let tok = tiny();
    let cases = json("tiny-a/cases.json");
    let list = cases["tokenizer_cases"].as_array().unwrap();
    assert_eq!(list.len(), 70);
    let mut n_with_control = 0;
    let mut n_hf_differs = 0;
    for (i, c) in list.iter().enumerate() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["llama_cpp"]);
        let got = tok.encode(text, true);
        assert_eq!(got, want, "case {i} {text:?}");
        assert_eq!(tok.decode(&got, true), text.as_bytes(), "case {i} roundtrip");
        if want.iter().any(|&id| id == 616 || id == 617 || id == 618) {
            n_with_control += 1;
            assert_ne!(tok.encode(text, false), want, "case {i}: CONTROL ids need parse_special");
        }
        if ids(&c["hf"]) != want {
            n_hf_differs += 1;
        }
    }
    assert!(n_with_control >= 4);
    assert_eq!(n_hf_differs, 4);
}

#[test]
fn chat_prompt_example() {
    let tok = tiny();
    let cases = json("tiny-a/cases.json");
    let ex = &cases["tokenizer"]["chat_prompt_example"];
    let text = ex["text"].as_str().unwrap();
    let want = ids(&ex["ids"]);
    assert_eq!(tok.encode(text, true), want);
    assert_eq!(tok.decode(&want, true), text.as_bytes());
}

#[test]
fn special_ids_resolved_by_text() {
    let tok = tiny();
    let cases = json("tiny-a/cases.json");
    for (text, id) in cases["tokenizer"]["special_and_added_tokens"].as_object().unwrap() {
        assert_eq!(tok.token_id(text), Some(id.as_u64().unwrap() as u32), "{text}");
    }
    assert!(tok.is_eog(618) && tok.is_eog(616) && !tok.is_eog(617));
    println!("{}", tok.summary());
}
