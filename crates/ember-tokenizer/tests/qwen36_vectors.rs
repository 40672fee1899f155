//! The real Qwen3.6 vocabulary against llama.cpp b11434 (`tests/fixtures/qwen36-vocab/`).
//! Tolerance: none — ids and bytes must be identical.

mod common;

use common::{ids, json, qwen36, unhex};
use ember_tokenizer::TokenType;

#[test]
fn vectors_json_both_parse_modes_and_roundtrip() {
    let tok = qwen36();
    let cases = json("qwen36-vocab/vectors.json");
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 66);
    let mut n_hf_differs = 0;
    for (i, c) in cases.iter().enumerate() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(tok.encode(text, false), want, "case {i} {text:?} parse_special=false");
        let want_ps = c.get("ids_parse_special").map_or_else(|| want.clone(), ids);
        assert_eq!(tok.encode(text, true), want_ps, "case {i} {text:?} parse_special=true");

        assert_eq!(tok.decode(&want, false), text.as_bytes(), "case {i} decode ids");
        assert_eq!(tok.decode(&want, true), text.as_bytes(), "case {i} decode ids (special)");
        assert_eq!(tok.decode(&want_ps, true), text.as_bytes(), "case {i} decode ids_parse_special");
        if let Some(hidden) = c.get("detok_parse_special_hidden") {
            assert_eq!(tok.decode(&want_ps, false), hidden.as_str().unwrap().as_bytes(), "case {i} hidden");
        }
        // We do not normalise (NFC); HF does, and matches every added token.
        if c.get("ids_hf").is_some_and(|hf| ids(hf) != want_ps) {
            n_hf_differs += 1;
        }
    }
    // The four NFD cases (é, résumé, àààà…, Vieết Nam) differ from HF; the other entries
    // with `ids_hf` only differ from `ids` by special parsing.
    assert_eq!(n_hf_differs, 4);
}

#[test]
fn llama_cpp_inp_out_pair() {
    let tok = qwen36();
    let inp = std::fs::read_to_string(ember_testkit::fixture("qwen36-vocab/ggml-vocab-qwen36.gguf.inp")).unwrap();
    let out = std::fs::read_to_string(ember_testkit::fixture("qwen36-vocab/ggml-vocab-qwen36.gguf.out")).unwrap();
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(texts.pop(), Some(""), "remainder after the last separator");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(texts.len(), 66);
    assert_eq!(lines.len(), texts.len());
    for (i, (text, line)) in texts.iter().zip(&lines).enumerate() {
        let want: Vec<u32> = line.split_whitespace().map(|x| x.parse().unwrap()).collect();
        assert_eq!(tok.encode(text, false), want, "test {i} {text:?}");
    }
}

#[test]
fn detok_json_exact_bytes() {
    let tok = qwen36();
    let cases = json("qwen36-vocab/detok.json");
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 38);
    for (i, c) in cases.iter().enumerate() {
        let id = ids(&c["ids"]);
        assert_eq!(tok.decode(&id, true), unhex(c["bytes_hex"].as_str().unwrap()), "case {i} {id:?}");
        assert_eq!(tok.decode(&id, false), unhex(c["bytes_hex_no_special"].as_str().unwrap()), "case {i} {id:?}");
    }
}

#[test]
fn anchors_types_and_special_ids() {
    let tok = qwen36();
    let s = tok.summary();
    assert_eq!((s.model.as_str(), s.pre.as_str()), ("gpt2", "qwen35"));
    assert_eq!((s.n_vocab, s.n_merges), (248_320, 247_587));
    assert_eq!((s.n_normal, s.n_control, s.n_user_defined, s.n_unused), (248_044, 27, 6, 243));
    assert_eq!((s.bos_id, s.eos_id, s.pad_id), (Some(248044), Some(248046), Some(248044)));
    assert_eq!(tok.eog_ids(), &[248044, 248046, 248063, 248064, 248065]);
    assert!(tok.is_eog(248046) && tok.is_eog(248044) && !tok.is_eog(248045) && !tok.is_eog(u32::MAX));
    for (text, id, ty) in [
        ("<|endoftext|>", 248044, TokenType::Control),
        ("<|im_start|>", 248045, TokenType::Control),
        ("<|im_end|>", 248046, TokenType::Control),
        ("<tool_call>", 248058, TokenType::UserDefined),
        ("<|fim_pad|>", 248063, TokenType::Control),
        ("<think>", 248068, TokenType::UserDefined),
        ("</think>", 248069, TokenType::UserDefined),
        ("[PAD248077]", 248077, TokenType::Unused),
        ("Ġthe", 279, TokenType::Normal),
    ] {
        assert_eq!(tok.token_id(text), Some(id), "{text}");
        assert_eq!(tok.token_type(id), ty, "{text}");
    }
    assert_eq!(tok.token_type(300_000), TokenType::Undefined);
    assert_eq!(tok.piece(279, false), b" the");
    assert_eq!(tok.piece(248046, false), b"");
    assert_eq!(tok.piece(248046, true), b"<|im_end|>");
    assert_eq!(tok.piece(248068, false), b"<think>");
    assert_eq!(tok.piece(u32::MAX, true), b"");
    assert_eq!(tok.decode(&[9419, 999_999, u32::MAX], true), b"Hello");
    println!("{s}");
}

#[test]
fn no_whole_word_shortcut() {
    // 加拿大 is rank 108918 but has no merge: BPE (llama.cpp, HF) gives three pieces.
    assert_eq!(qwen36().encode("加拿大", false), [95984, 97048, 95779]);
}

#[test]
fn partition_edge_cases() {
    let tok = qwen36();
    // Added token glued to text on both sides, repeated, and inside a word.
    assert_eq!(tok.encode("a<think>b<think><think>", false), [64, 248068, 65, 248068, 248068]);
    // CONTROL text is plain text without parse_special, a token with it.
    let plain = tok.encode("x<|im_end|>y", false);
    assert!(!plain.contains(&248046));
    assert_eq!(tok.decode(&plain, false), b"x<|im_end|>y");
    assert_eq!(tok.encode("x<|im_end|>y", true), [87, 248046, 88]);
    // Partial added-token text stays text.
    assert_eq!(tok.decode(&tok.encode("<think", true), false), b"<think");
    assert!(tok.encode("", true).is_empty());
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ember_tokenizer::Tokenizer>();
    check::<ember_tokenizer::StreamDecoder>();
}
