//! Issue 17: an installed `ember` works from anywhere with nothing but a model file. The binary
//! is copied out of the build tree and run in a mount namespace where the checkout is hidden
//! under an empty tmpfs (`unshare -rm`), so no compile-time path into the sources can be
//! opened: `synth` must use the tokenizer inside the binary and `bench-http` the server's
//! `/tokenize`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Runs `ember ARGS` (the copy at `exe`) in `dir` with the checkout hidden.
fn hidden(exe: &Path, dir: &Path, args: &[&str]) -> Output {
    let root = checkout();
    let script = r#"mount -t tmpfs none "$1" && ! test -e "$1/Cargo.toml" || { echo "could not hide the checkout" >&2; exit 97; }; shift; exec "$@""#;
    Command::new("unshare")
        .args(["-rm", "sh", "-c", script, "sh"])
        .arg(&root)
        .arg(exe)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run unshare")
}

fn namespaces_work() -> bool {
    Command::new("unshare").args(["-rm", "sh", "-c", "mount -t tmpfs none /mnt"]).status().is_ok_and(|s| s.success())
}

#[test]
fn r17_installed_binary_needs_no_checkout() {
    if !namespaces_work() {
        assert!(std::env::var_os("CI").is_none(), "CI is set but `unshare -rm` (user + mount namespaces) does not work here");
        eprintln!("SKIPPED r17_installed_binary_needs_no_checkout: `unshare -rm` is not permitted on this machine");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ember-installed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    assert!(!dir.starts_with(checkout()), "the temp dir must lie outside the checkout");
    let exe = dir.join("ember");
    std::fs::copy(env!("CARGO_BIN_EXE_ember"), &exe).unwrap();

    let o = hidden(&exe, &dir, &["synth", "-o", "tiny.gguf", "--preset", "tiny", "--quant", "q8_0"]);
    assert!(o.status.success(), "synth with the checkout hidden: {}", String::from_utf8_lossy(&o.stderr));
    let o = hidden(&exe, &dir, &["inspect", "-m", "tiny.gguf", "--json"]);
    assert!(o.status.success(), "inspect: {}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["tokenizer"]["n_tokens"], 248_320, "the real Qwen3.6 vocabulary, from inside the binary");

    // A server on the file synth just wrote, also from the copy with the checkout hidden.
    let root = checkout();
    let mut server = Command::new("unshare")
        .args(["-rm", "sh", "-c", r#"mount -t tmpfs none "$1" && shift && exec "$@""#, "sh"])
        .arg(&root)
        .arg(&exe)
        .args(["serve", "-m", "tiny.gguf", "--port", "0", "-t", "1"])
        .current_dir(&dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = server.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(i) = line.find("on http://") {
                let _ = tx.send(line[i + 3..].split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("server did not report its address");
    let o = hidden(&exe, &dir, &["bench-http", "--url", &url, "--depths", "40", "--n-predict", "2", "--runs", "1", "-o", "json"]);
    let _ = server.kill();
    let _ = server.wait();
    assert!(o.status.success(), "bench-http with the checkout hidden: {}", String::from_utf8_lossy(&o.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // The server counts the prompt it got; cut by its own tokenizer, the text is 40 tokens
    // (+-2: a cut may split a multi-token character that the server re-tokenizes differently).
    let n = rows[0]["n_prompt"].as_u64().unwrap();
    assert!((38..=42).contains(&n), "prompt of {n} tokens, asked 40");
    std::fs::remove_dir_all(&dir).unwrap();
}
