//! What the `ember serve` end-to-end tests share: a server on a free port (the real binary, the
//! bundled tiny model, one compute thread), HTTP with ureq, SSE parsed by hand. Each test binary
//! uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};

pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["serve", "--port", "0", "-t", "1"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ember serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("on http://") {
                    let url = line[i + 3..].split_whitespace().next().unwrap().to_string();
                    let _ = tx.send(url);
                }
                // Keep draining so the server never blocks on a full pipe.
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(60)).expect("server did not report its address");
        Server { child, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post_raw(&self.url(path), &body.to_string(), None)
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut r = agent().get(&self.url(path)).call().expect("GET");
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// Streams a request; returns the parsed `data:` payloads up to `[DONE]` (excluded) and
    /// whether `[DONE]` came.
    pub fn stream(&self, path: &str, body: &Value) -> (Vec<Value>, bool) {
        let r = agent().post(&self.url(path)).header("content-type", "application/json").send(body.to_string()).expect("POST");
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers().get("content-type").unwrap().to_str().unwrap().starts_with("text/event-stream"));
        read_sse(r.into_body().into_reader())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(120))).build().into()
}

pub fn post_raw(url: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = agent().post(url).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", &format!("Bearer {k}"));
    }
    let mut r = req.send(body).expect("POST");
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

pub fn read_sse(reader: impl Read) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    for line in BufReader::new(reader).lines() {
        let line = line.expect("read SSE");
        let Some(data) = line.strip_prefix("data: ") else {
            assert!(line.is_empty() || line.starts_with(':'), "unexpected SSE line {line:?}");
            continue;
        };
        if data == "[DONE]" {
            return (out, true);
        }
        out.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("bad chunk ({e}): {data}")));
    }
    (out, false)
}

pub fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

/// Concatenates streamed chat deltas into (reasoning, content, finish_reason).
pub fn fold_chat(chunks: &[Value]) -> (String, String, Option<String>) {
    let (mut r, mut c, mut fin) = (String::new(), String::new(), None);
    for ch in chunks {
        for choice in ch["choices"].as_array().unwrap() {
            let d = &choice["delta"];
            r.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            c.push_str(d["content"].as_str().unwrap_or(""));
            if let Some(f) = choice["finish_reason"].as_str() {
                fin = Some(f.to_string());
            }
        }
    }
    (r, c, fin)
}

pub fn assert_error(status: u16, body: &Value, want_status: u16, needle: &str) {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error lacks `{k}`: {body}");
    }
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
}

pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}
