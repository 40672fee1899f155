//! The `ember` binary end to end, as a user runs it: every subcommand on the fixture models,
//! and clear errors (non-zero exit, no panic) for bad input.

use std::process::{Command, Output};

use ember_testkit::{LogitStats, fixture, read_safetensors, tiny_case_ids};

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember")).args(args).output().expect("run ember")
}

fn ok(args: &[&str]) -> Output {
    let o = ember(args);
    assert!(o.status.success(), "ember {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn fails(args: &[&str], needle: &str) {
    let o = ember(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "ember {args:?} should fail");
    assert!(err.contains(needle), "ember {args:?}: stderr lacks '{needle}': {err}");
    assert!(!err.contains("panicked"), "ember {args:?} panicked: {err}");
}

fn path(rel: &str) -> String {
    fixture(rel).to_string_lossy().into_owned()
}

#[test]
fn tokenize_and_detokenize_real_vocab() {
    let vocab = path("qwen36-vocab/ggml-vocab-qwen36.gguf");
    let text = "<|im_start|>user\nHi <think>x</think><|im_end|>";
    let o = ok(&["tokenize", "-m", &vocab, text]);
    let ids: Vec<u32> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids[0], 248045, "<|im_start|> is one control token by default");
    assert!(ids.contains(&248068), "<think> matched");
    let o = ok(&["tokenize", "-m", &vocab, "--no-special", text]);
    let plain: Vec<u32> = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!plain.contains(&248045), "--no-special: control tokens are text");
    assert!(plain.contains(&248068), "--no-special: <think> (user-defined) still matches");
    let id_args: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    let mut args = vec!["detokenize", "-m", &vocab];
    args.extend(id_args.iter().map(|s| s.as_str()));
    assert_eq!(ok(&args).stdout, text.as_bytes(), "exact bytes, nothing added");
    args.insert(3, "--no-special");
    assert_eq!(ok(&args).stdout, b"user\nHi <think>x</think>", "control tokens render as nothing");
}

#[test]
fn tokenize_from_file() {
    let dir = std::env::temp_dir().join(format!("ember-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("t.txt");
    std::fs::write(&f, "Hello world").unwrap();
    let o = ok(&["tokenize", "-m", &path("qwen36-vocab/ggml-vocab-qwen36.gguf"), "--file", f.to_str().unwrap()]);
    assert_eq!(String::from_utf8(o.stdout).unwrap().trim(), "[9419,1814]");
}

/// `ember logits` on the BF16 fixture: --exact within the float32 bounds of HF float64 (rel
/// <= 1e-4; measured 8e-7), and the prefill/decode split gives the same rows.
#[test]
fn logits_command_matches_reference() {
    let dir = std::env::temp_dir().join(format!("ember-logits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ids = tiny_case_ids("p37");
    let tokens = ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let want = &read_safetensors(&fixture("tiny-a/refs/hf-refs.safetensors"))["logits.p37.f64"];
    for extra in [vec!["--exact"], vec!["--exact", "--prefill", "20"], vec!["--kv-type", "f32"]] {
        let out = dir.join("l.safetensors");
        let mut args = vec![
            "logits",
            "-m",
            &*Box::leak(path("tiny-a/gguf/tiny-a-BF16.gguf").into_boxed_str()),
            "--tokens",
            &tokens,
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend(extra.iter());
        ok(&args);
        let got = &read_safetensors(&out)["logits"];
        assert_eq!(got.shape, vec![ids.len(), 640]);
        let got: Vec<f32> = got.data.iter().map(|&x| x as f32).collect();
        let s = LogitStats::compare(&got, want);
        assert!(s.max_rel() <= 1e-4 && s.top1 == 1.0, "{extra:?}: {s}");
    }
}

#[test]
fn run_is_deterministic_with_a_seed() {
    let m = path("tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    let a = ok(&["run", "-m", &m, "-p", "Hello", "-n", "24", "--seed", "7", "-t", "2"]);
    let b = ok(&["run", "-m", &m, "-p", "Hello", "-n", "24", "--seed", "7", "-t", "1"]);
    assert_eq!(a.stdout, b.stdout, "same seed, same text, any thread count");
    let err = String::from_utf8_lossy(&a.stderr);
    assert!(err.contains("tokens/s"), "speed report: {err}");
    let c = ok(&["run", "-p", "Hi", "-n", "8", "--chat", "--temp", "0"]);
    assert!(String::from_utf8_lossy(&c.stderr).contains("bundled demo"));
}

/// The model run as a layer split (`EMBER_SPLIT_PARTS`: the layers in ranges, one backend each,
/// the hidden state crossing between them) says so and writes the same text.
#[test]
fn a_layer_split_writes_the_same_text() {
    let m = path("tiny-a/gguf/tiny-a-Q8_0.gguf");
    let args = ["run", "-m", &m, "-p", "The quick brown fox", "-n", "24", "--temp", "0", "--device", "cpu", "-t", "1"];
    let one = ok(&args);
    for n in ["2", "3"] {
        let o = Command::new(env!("CARGO_BIN_EXE_ember")).env("EMBER_SPLIT_PARTS", n).args(args).output().expect("run ember");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert!(err.contains(&format!("EMBER_SPLIT_PARTS={n}: the layers in {n} ranges")), "{err}");
        assert_eq!(String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&one.stdout), "{n} parts");
    }
}

/// On the CPU a command says what the model and its state take of host memory. tiny-a has 2
/// attention layers of 2 KV heads × 64: at 4096 tokens (`run` sizes -c + 1) K and V take
/// 2 × 2 × 4096 rows of 128 values, 256 bytes each in f16 (4 MiB), 136 in q8_0 (2.125 MiB).
#[test]
fn cpu_reports_its_memory() {
    let m = path("tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    for (kv, want) in [
        ("f16", "KV cache f16 4.0 MiB a sequence at 4096 tokens (2 attention layers)"),
        ("q8_0", "KV cache q8_0 2.1 MiB a sequence at 4096 tokens"),
    ] {
        let o = ok(&["run", "-m", &m, "-p", "Hi", "-n", "1", "--device", "cpu", "-c", "4095", "--kv-type", kv]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want) && err.contains("DeltaNet state") && err.contains("host memory available"), "{err}");
    }
}

#[test]
fn inspect_reports_groups() {
    let o = ok(&["inspect", "-m", &path("tiny-a/gguf/tiny-a-Q4_K_M.gguf"), "--json"]);
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["architecture"], "qwen35moe");
    assert_eq!(r["config"]["n_layer"], 4);
    assert_eq!(r["config"]["layers"], "DADA");
    assert_eq!(r["tensors"].as_array().unwrap().len(), 73);
    let groups = r["bytes_by_group"].as_object().unwrap();
    let total: u64 = groups.values().map(|g| g["bytes"].as_u64().unwrap()).sum();
    let tensors: u64 = r["tensors"].as_array().unwrap().iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(total, tensors);
    assert!(groups["routed experts"]["by_type"]["Q4_K"].as_u64().unwrap() > 0);
    assert_eq!(r["tokenizer"]["n_tokens"], 640);
    let text = ok(&["inspect", "-m", &path("qwen36-vocab/ggml-vocab-qwen36.gguf")]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("n_merges: 247587"), "{text}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("ember-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trunc = dir.join("trunc.gguf");
    let bytes = std::fs::read(fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap();
    std::fs::write(&trunc, &bytes[..bytes.len() / 2]).unwrap();
    let trunc = trunc.to_str().unwrap();
    fails(&["run", "-m", trunc, "-p", "x"], "truncated");
    fails(&["inspect", "-m", trunc], "truncated");
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a model at all").unwrap();
    fails(&["run", "-m", junk.to_str().unwrap(), "-p", "x"], "bad magic");
    fails(&["run", "-m", "/nonexistent/model.gguf", "-p", "x"], "cannot open");
    // Each cause once, though the open error's own message already names the OS error.
    let err = String::from_utf8_lossy(&ember(&["run", "-m", "/nonexistent/model.gguf", "-p", "x"]).stderr).into_owned();
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    fails(&["serve", "--parallel", "0"], "--parallel <PARALLEL>': must be at least 1");
    fails(&["serve", "-b", "0"], "must be at least 1");
    fails(&["run", "-p", "x", "-n", "0"], "--n-predict <N_PREDICT>': must be at least 1");
    let vocab = path("qwen36-vocab/ggml-vocab-qwen36.gguf");
    fails(&["run", "-m", &vocab, "-p", "x"], "is missing");
    fails(&["run", "-p", "a b c d e f g h", "-n", "4", "-c", "3"], "more than the context size");
    fails(&["run", "-p", "x", "--top-p", "1.5"], "top_p");
    fails(&["detokenize", "99999"], "out of range");
    fails(&["logits", "--tokens", "1,x", "-o", "/tmp/x.safetensors"], "not a token id");
    fails(&["logits", "--tokens", "1,2", "--prefill", "5", "-o", "/tmp/x.safetensors"], "--prefill 5");
    fails(&["logits", "--tokens", "1,700", "-o", "/tmp/x.safetensors"], "out of range");
}

/// Issue 15: `--device`. Where no NVIDIA driver is present (CI), `--device cuda` is a one-line
/// error naming what is missing (exit 1, no panic) and `auto` runs on the CPU saying why; with a
/// GPU, both run there. A bad device name is a usage error; `inspect` lists the GPUs.
#[test]
fn device_choice() {
    let m = path("tiny-a/gguf/tiny-a-Q8_0.gguf");
    fails(&["run", "-m", &m, "-p", "Hi", "-n", "1", "--device", "tpu"], "not a device");
    let gpus = ember_cuda::devices();
    let o = ok(&["run", "-m", &m, "-p", "Hi", "-n", "2", "--device", "auto"]);
    let err = String::from_utf8_lossy(&o.stderr);
    let inspect = ok(&["inspect", "-m", &m, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    match gpus {
        Err(e) => {
            let o = ember(&["run", "-m", &m, "-p", "Hi", "-n", "1", "--device", "cuda"]);
            let msg = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "--device cuda without a driver: {msg}");
            assert!(msg.contains("no NVIDIA driver") && !msg.contains("panicked"), "{msg}");
            assert_eq!(msg.trim().lines().count(), 1, "one line: {msg}");
            assert!(err.contains("running on the CPU") && err.contains("no usable GPU"), "auto says why: {err}");
            assert!(report["gpus"]["error"].as_str().unwrap().contains("driver"), "{report}");
            eprintln!("no GPU here ({e}): checked the errors");
        }
        Ok(g) => {
            assert!(err.contains("running there"), "auto picks the GPU: {err}");
            ok(&["run", "-m", &m, "-p", "Hi", "-n", "2", "--device", "cuda:0"]);
            fails(&["run", "-m", &m, "-p", "Hi", "-n", "1", "--device", &format!("cuda:{}", g.len())], "CUDA devices");
            assert_eq!(report["gpus"].as_array().unwrap().len(), g.len());
        }
    }
}

/// `ember plan` with budgets given (no GPU needed): the JSON has what the planner promises, no
/// device is overfilled, every expert has one home, and a smaller budget keeps fewer experts.
#[test]
fn plan_places_layers_and_experts_within_the_budgets() {
    let m = path("tiny-a/gguf/tiny-a-Q8_0.gguf");
    let plan = |mem: &str| -> serde_json::Value {
        let o = ok(&["plan", "-m", &m, "--gpu-mem", mem, "-c", "2048", "--kv-type", "q8_0", "--parallel", "2", "--json"]);
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let big = plan("0=8GiB");
    let two = plan("0=1700MiB,1=1600MiB");
    for p in [&big, &two] {
        let mut experts = p["host"]["experts"].as_u64().unwrap();
        for d in p["devices"].as_array().unwrap() {
            for k in ["id", "budget_bytes", "used_bytes", "trunk_bytes", "kv_bytes", "experts"] {
                assert!(d.get(k).is_some(), "devices[] lacks {k}: {d}");
            }
            assert!(d["used_bytes"].as_u64() <= d["budget_bytes"].as_u64(), "overfilled: {d}");
            experts += d["experts"].as_u64().unwrap();
        }
        assert_eq!(experts, p["experts_total"].as_u64().unwrap(), "every expert has one home: {p}");
        assert!(p["host"]["bytes"].as_u64().is_some());
    }
    assert_eq!(big["host"]["experts"], 0, "the tiny model fits in 8 GiB: {big}");
    assert_eq!(big["host_bytes_per_token"], 0);
    let o = ok(&["plan", "-m", &m, "--gpu-mem", "0=8GiB"]);
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("cuda:0") && table.contains("host") && table.contains("routed experts on GPUs"), "{table}");
    fails(&["plan", "-m", &m, "--gpu-mem", "0=lots"], "is not a size");
    fails(&["plan", "-m", &m, "--gpu-mem", "0=1GiB,0=2GiB"], "two budgets");
    fails(&["plan", "-m", &m, "--gpu-mem", "0=1GiB", "--parallel", "0"], "--parallel");
}
