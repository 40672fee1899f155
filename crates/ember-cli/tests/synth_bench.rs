//! `ember synth`, `ember inspect` of its output and `ember bench` end to end on the `tiny`
//! preset: the file loads, the bench JSON parses and its test names are llama-bench's, and
//! `--n-seq` runs each test on several sequences at once.

use std::process::{Command, Output};

fn ember(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_ember")).args(args).output().expect("run ember");
    assert!(o.status.success(), "ember {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    o
}

/// llama-bench's markdown names for `-p 16 -n 4 -d 0,16` (tools/llama-bench/llama-bench.cpp:
/// "pp%d", "tg%d", then " @ d%d" for a depth), as printed by llama-bench 11434 on this file.
const LLAMA_BENCH_NAMES: &[&str] = &["pp16", "tg4", "pp16 @ d16", "tg4 @ d16"];

#[test]
fn synth_inspect_bench() {
    let dir = std::env::temp_dir().join(format!("ember-cli-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    let m = model.to_str().unwrap();
    ember(&["synth", "-o", m, "--preset", "tiny", "--quant", "q8_0", "--skew", "1.5", "--seed", "3"]);

    let o = ember(&["inspect", "-m", m, "--json"]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["architecture"], "qwen35moe");
    assert_eq!(r["tokenizer"]["n_tokens"], 248_320);
    assert_eq!(r["config"]["layers"], "DDDA");
    assert_eq!(r["metadata"]["ember.synthetic.skew"], 1.5);
    assert_eq!(r["metadata"]["ember.synthetic.preset"], "tiny");

    let o = ember(&["bench", "-m", m, "-p", "16", "-n", "4", "-d", "0,16", "-r", "2", "-t", "1", "-o", "json", "--prompts", "real"]);
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench JSON parses");
    let rows = rows.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|x| x["name"].as_str().unwrap()).collect();
    let want: Vec<String> = LLAMA_BENCH_NAMES.iter().map(|s| s.replace(' ', "")).collect();
    assert_eq!(names, want);
    for x in rows {
        assert_eq!(x["samples_ts"].as_array().unwrap().len(), 2);
        assert!(x["avg_ts"].as_f64().unwrap() > 0.0);
        for k in ["n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "stddev_ts", "n_threads", "model_size", "model_n_params"] {
            assert!(x.get(k).is_some(), "bench JSON lacks llama-bench's field {k}");
        }
        if x["n_gen"].as_u64().unwrap() > 0 {
            assert!(x["bytes_per_token"].as_u64().unwrap() > 0);
            assert!(x["gb_per_s"].as_f64().unwrap() > 0.0);
        }
    }

    // Several sequences at once: each test on 1 and on 3 sequences, named with `x3`, tokens/s
    // over all of them.
    let o = ember(&["bench", "-m", m, "-p", "8", "-n", "3", "-d", "0,16", "-r", "1", "-t", "1", "-o", "json", "--n-seq", "1,3"]);
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench JSON parses");
    let rows = rows.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|x| x["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["pp8", "pp8x3", "tg3", "tg3x3", "pp8@d16", "pp8x3@d16", "tg3@d16", "tg3x3@d16"]);
    for x in rows {
        let n = if x["name"].as_str().unwrap().contains("x3") { 3 } else { 1 };
        assert_eq!(x["n_seq"], n);
        assert!(x["avg_ts"].as_f64().unwrap() > 0.0);
    }
    let e = Command::new(env!("CARGO_BIN_EXE_ember")).args(["bench", "-m", m, "--n-seq", "0"]).output().unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("--n-seq"), "{}", String::from_utf8_lossy(&e.stderr));
    std::fs::remove_dir_all(dir).unwrap();
}
