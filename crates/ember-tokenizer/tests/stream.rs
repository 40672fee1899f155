//! StreamDecoder: chunks are always valid UTF-8 and concatenate to the one-shot decode.

mod common;

use common::{ids, json, qwen36};
use ember_tokenizer::{StreamDecoder, Tokenizer};
use proptest::prelude::*;

fn stream(tok: &Tokenizer, ids: &[u32], render_special: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(render_special);
    let mut chunks: Vec<String> = ids.iter().map(|&id| d.push(tok, id)).collect();
    chunks.push(d.finish());
    chunks
}

#[test]
fn vectors_stream_equals_decode() {
    let tok = qwen36();
    let cases = json("qwen36-vocab/vectors.json");
    let mut n_held = 0;
    for c in cases.as_array().unwrap() {
        for key in ["ids", "ids_parse_special"] {
            let Some(v) = c.get(key) else { continue };
            let id = ids(v);
            for special in [false, true] {
                let chunks = stream(tok, &id, special);
                assert_eq!(chunks.concat().as_bytes(), tok.decode(&id, special).as_slice());
                assert_eq!(chunks.last().map(String::as_str), Some(""), "nothing left to flush");
                // A token that ends inside a UTF-8 sequence yields a shorter chunk than its bytes.
                n_held += id.iter().zip(&chunks).filter(|(i, ch)| tok.piece(**i, special).len() != ch.len()).count();
            }
        }
    }
    assert!(n_held > 0, "some vector tokens end mid-UTF-8");
}

#[test]
fn detok_partial_utf8_ranks() {
    let tok = qwen36();
    let cases = json("qwen36-vocab/detok.json");
    for c in cases.as_array().unwrap() {
        let id = ids(&c["ids"]);
        for special in [false, true] {
            let chunks = stream(tok, &id, special);
            assert_eq!(chunks.concat(), String::from_utf8_lossy(&tok.decode(&id, special)), "{id:?}");
        }
    }
}

#[test]
fn holds_back_then_flushes_lossily() {
    let mut d = StreamDecoder::new(false);
    assert_eq!(d.push_bytes(&[0xE4, 0xB8]), "");
    assert_eq!(d.pending(), &[0xE4, 0xB8]);
    assert_eq!(d.push_bytes(&[0xAD, b'x', 0xF0]), "中x");
    assert_eq!(d.push_bytes(b"y"), "\u{FFFD}y");
    assert_eq!(d.push_bytes(&[0xE4]), "");
    assert_eq!(d.finish(), "\u{FFFD}");
    assert_eq!(d.finish(), "");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random ids, biased to byte ranks 0..256 (many are lone UTF-8 lead/continuation
    /// bytes) and to multi-byte CJK/emoji ranks and added tokens.
    #[test]
    fn random_ids_stream_is_lossy_decode(
        id in prop::collection::vec(prop_oneof![0u32..256, 100_000u32..248_320, 248_040u32..248_080], 0..40),
        special in any::<bool>(),
    ) {
        let tok = qwen36();
        let chunks = stream(tok, &id, special);
        prop_assert_eq!(chunks.concat(), String::from_utf8_lossy(&tok.decode(&id, special)).into_owned());
    }

    /// Any text: encode -> stream-decode gives the text back, chunk by chunk.
    #[test]
    fn text_roundtrip_through_stream(text in "(\\PC|[ \\n\\t]|<think>|<\\|im_end\\|>|é|中|👋){0,40}", ps in any::<bool>()) {
        let tok = qwen36();
        let id = tok.encode(&text, ps);
        prop_assert_eq!(tok.decode(&id, true), text.as_bytes().to_vec());
        prop_assert_eq!(stream(tok, &id, true).concat(), text);
    }
}
