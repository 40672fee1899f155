//! Build time of the 248k vocab and encode speed; no quadratic blow-ups.
//! Bounds are loose (shared 2-core CI, debug-ish profiles): they catch O(n^2), not 20 %.

use std::time::{Duration, Instant};

use ember_gguf::GgufFile;
use ember_tokenizer::Tokenizer;

fn load() -> (Tokenizer, Duration) {
    let f = GgufFile::open(ember_testkit::fixture("qwen36-vocab/ggml-vocab-qwen36.gguf")).unwrap();
    let t = Instant::now();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    (tok, t.elapsed())
}

#[test]
fn build_and_encode_speed() {
    let (tok, build) = load();
    println!("build 248k vocab: {:.1} ms", build.as_secs_f64() * 1e3);

    for (name, text) in [
        ("100 KB of 'a'", "a".repeat(100_000)),
        ("100 KB of spaces + x", " ".repeat(100_000) + "x"),
        ("100 KB of '的'", "的".repeat(33_000)),
        ("100 KB of '1'", "1".repeat(100_000)),
        ("100 KB of ' \\n'", " \n".repeat(50_000)),
        ("100 KB of '<think>'", "<think>".repeat(14_000)),
    ] {
        let t = Instant::now();
        let ids = tok.encode(&text, true);
        let dt = t.elapsed();
        println!("{name}: {} tokens in {:.1} ms", ids.len(), dt.as_secs_f64() * 1e3);
        assert_eq!(tok.decode(&ids, true), text.as_bytes());
        assert!(dt < Duration::from_secs(1), "{name}: {dt:?}");
    }

    // Mixed text: the fixture READMEs and spec-like prose, repeated to ~1 MB.
    let base = std::fs::read_to_string(ember_testkit::fixture("qwen36-vocab/README.md")).unwrap()
        + &std::fs::read_to_string(ember_testkit::fixture("qwen36-vocab/ggml-vocab-qwen36.gguf.inp")).unwrap();
    let text = base.repeat(1_000_000 / base.len() + 1);
    let t = Instant::now();
    let ids = tok.encode(&text, false);
    let dt = t.elapsed().as_secs_f64();
    println!(
        "mixed {:.2} MB: {} tokens in {:.0} ms = {:.1} MB/s, {:.2} M tok/s",
        text.len() as f64 / 1e6,
        ids.len(),
        dt * 1e3,
        text.len() as f64 / 1e6 / dt,
        ids.len() as f64 / 1e6 / dt
    );
    assert_eq!(tok.decode(&ids, false), text.as_bytes());
    assert!(build < Duration::from_secs(3));
}
