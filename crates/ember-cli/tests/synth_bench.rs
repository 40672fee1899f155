//! `ember synth`, `ember inspect` of its output and `ember bench` end to end on the `tiny`
//! preset: the file loads, the bench JSON parses and its test names are llama-bench's.

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
    std::fs::remove_dir_all(dir).unwrap();
}
