//! The tokenizer carried inside the binary (`bundled_vocab`, deflated by build.rs) is the
//! Qwen3.6 vocabulary fixture, byte for byte: every metadata key and value is equal.

use ember_gguf::GgufFile;

#[test]
fn bundled_vocab_is_the_fixture() {
    let bundled = ember_synth::bundled_vocab().expect("inflates and parses");
    let fixture = GgufFile::open(ember_synth::DEFAULT_VOCAB).expect("vocab fixture");
    assert_eq!(bundled.file_len(), fixture.file_len());
    assert_eq!(bundled.metadata(), fixture.metadata());
    assert_eq!(bundled.get_array("tokenizer.ggml.tokens").unwrap().len(), 248_320);
}
