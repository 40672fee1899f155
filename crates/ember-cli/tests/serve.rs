//! `ember serve` end to end: the real binary on the bundled tiny model (random weights), over
//! real HTTP (ureq), SSE parsed by hand. Each test starts its own server on a free port with one
//! compute thread, so tests stay independent and light on a 2-core CI machine.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(args: &[&str]) -> Server {
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

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post_raw(&self.url(path), &body.to_string(), None)
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut r = agent().get(&self.url(path)).call().expect("GET");
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// Streams a request; returns the parsed `data:` payloads up to `[DONE]` (excluded) and
    /// whether `[DONE]` came.
    fn stream(&self, path: &str, body: &Value) -> (Vec<Value>, bool) {
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

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(120))).build().into()
}

fn post_raw(url: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = agent().post(url).header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", &format!("Bearer {k}"));
    }
    let mut r = req.send(body).expect("POST");
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

fn read_sse(reader: impl Read) -> (Vec<Value>, bool) {
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

fn user(text: &str) -> Value {
    json!([{ "role": "user", "content": text }])
}

/// Concatenates streamed chat deltas into (reasoning, content, finish_reason).
fn fold_chat(chunks: &[Value]) -> (String, String, Option<String>) {
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

fn assert_error(status: u16, body: &Value, want_status: u16, needle: &str) {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error lacks `{k}`: {body}");
    }
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
}

#[test]
fn chat_stream_equals_non_stream_with_same_seed() {
    let s = Server::start(&[]);
    let req = json!({ "messages": user("Tell me a story"), "max_tokens": 40, "seed": 7, "temperature": 1.0 });
    let (status, full) = s.post("/v1/chat/completions", &req);
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    let choice = &full["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    let usage = &full["usage"];
    assert_eq!(usage["completion_tokens"], 40);
    assert_eq!(usage["total_tokens"].as_u64(), Some(usage["prompt_tokens"].as_u64().unwrap() + 40));
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({ "include_usage": true });
    let (chunks, done) = s.stream("/v1/chat/completions", &sreq);
    assert!(done, "stream ended without [DONE]");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (r, c, fin) = fold_chat(&chunks);
    assert_eq!(r, choice["message"]["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(c, choice["message"]["content"].as_str().unwrap_or(""));
    assert_eq!(fin.as_deref(), Some("length"));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    let mut streamed_usage = last["usage"].clone();
    // The same prompt again: everything but its last token comes from the prompt cache.
    let n_prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(streamed_usage["prompt_tokens_details"]["cached_tokens"], n_prompt - 1);
    streamed_usage["prompt_tokens_details"]["cached_tokens"] = json!(0);
    assert_eq!(&streamed_usage, usage, "streamed usage equals the non-streamed one");
    for ch in &chunks {
        assert_eq!(ch["id"], chunks[0]["id"]);
        assert_eq!(ch["object"], "chat.completion.chunk");
    }
}

#[test]
fn completions_stream_equals_non_stream_and_usage_counts() {
    let s = Server::start(&[]);
    let prompt = "The quick brown fox";
    let (_, tok) = s.post("/tokenize", &json!({ "content": prompt }));
    let n_prompt = tok["tokens"].as_array().unwrap().len();
    let req = json!({ "prompt": prompt, "max_tokens": 30, "seed": 11, "top_k": 0, "top_p": 0.9, "logprobs": 3 });
    let (status, full) = s.post("/v1/completions", &req);
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["usage"]["prompt_tokens"].as_u64(), Some(n_prompt as u64));
    // The random demo model may sample an end token before max_tokens (which one depends on
    // the last bits of the numerics): the stream must end the same way either way.
    let n_gen = full["usage"]["completion_tokens"].as_u64().unwrap();
    let fin = full["choices"][0]["finish_reason"].as_str().unwrap().to_string();
    assert!((fin == "length" && n_gen == 30) || (fin == "stop" && (1..=30).contains(&n_gen)), "{n_gen} tokens, {fin}");
    // The end token counts as generated but has no text, so no logprobs entry.
    let n_text = if fin == "stop" { n_gen - 1 } else { n_gen };
    let lp = &full["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len() as u64, n_text);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3);
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap() <= 0.0));

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let (chunks, done) = s.stream("/v1/completions", &sreq);
    assert!(done);
    let text: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], fin);

    // A prompt given as token ids is the same prompt.
    let mut ids_req = req.clone();
    ids_req["prompt"] = tok["tokens"].clone();
    let (_, by_ids) = s.post("/v1/completions", &ids_req);
    assert_eq!(by_ids["choices"][0]["text"], full["choices"][0]["text"]);

    // Chat usage: prompt_tokens is the rendered template's token count.
    let (_, tpl) = s.post("/apply-template", &json!({ "messages": user("hi") }));
    let (_, tok) = s.post("/tokenize", &json!({ "content": tpl["prompt"] }));
    let (_, chat) = s.post("/v1/chat/completions", &json!({ "messages": user("hi"), "max_tokens": 3 }));
    assert_eq!(chat["usage"]["prompt_tokens"].as_u64(), Some(tok["tokens"].as_array().unwrap().len() as u64));
}

#[test]
fn stop_strings_are_never_emitted_even_across_tokens() {
    let s = Server::start(&[]);
    let base = json!({ "prompt": "def main():", "max_tokens": 40, "temperature": 0, "logprobs": 0 });
    let (_, full) = s.post("/v1/completions", &base);
    let toks: Vec<String> =
        full["choices"][0]["logprobs"]["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string made of the end of one token and the start of the next (ASCII tokens of
    // at least two characters), so it only appears once both are out.
    let k = (3..toks.len() - 1)
        .find(|&k| toks[k].len() >= 2 && toks[k + 1].len() >= 2 && toks[k].is_ascii() && toks[k + 1].is_ascii())
        .expect("two adjacent ASCII tokens");
    let stop = format!("{}{}", &toks[k][toks[k].len() - 1..], &toks[k + 1][..1]);
    let want = &text[..text.find(&stop).unwrap()];

    let mut req = base.clone();
    req["stop"] = json!(["never-appears", stop]);
    let (_, got) = s.post("/v1/completions", &req);
    assert_eq!(got["choices"][0]["text"].as_str().unwrap(), want, "stop {stop:?}");
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    assert!(got["usage"]["completion_tokens"].as_u64().unwrap() < 40);

    req["stream"] = json!(true);
    let (chunks, done) = s.stream("/v1/completions", &req);
    assert!(done);
    let streamed: String = chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap()).collect();
    assert_eq!(streamed, want);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[test]
fn every_error_class_has_openai_shape() {
    let s = Server::start(&["-c", "64", "--parallel", "1", "--queue", "1"]);
    let chat = s.url("/v1/chat/completions");
    let (st, b) = post_raw(&chat, "{\"messages\": [", None);
    assert_error(st, &b, 400, "could not parse the JSON");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "temperature": "warm" }));
    assert_error(st, &b, 400, "`temperature` must be a number");
    assert_eq!(b["error"]["param"], "temperature");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "top_p": 1.5 }));
    assert_error(st, &b, 400, "between 0 and 1");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "max_tokens": 0 }));
    assert_error(st, &b, 400, "max_tokens");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "model": "gpt-9" }));
    assert_error(st, &b, 404, "gpt-9");
    assert_eq!(b["error"]["code"], "model_not_found");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "n": 2 }));
    assert_error(st, &b, 400, "`n`");
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "response_format": { "type": "json_object" } }));
    assert_error(st, &b, 400, "response_format");
    let (st, b) = s.post("/v1/completions", &json!({ "prompt": "x", "suffix": "y" }));
    assert_error(st, &b, 400, "suffix");
    let (st, b) =
        s.post("/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "x" }, { "role": "ghost", "content": 3 }] }));
    assert_error(st, &b, 400, "");
    let long = "word ".repeat(100);
    let (st, b) = s.post("/v1/completions", &json!({ "prompt": long }));
    assert_error(st, &b, 400, "64 tokens");
    let n =
        b["error"]["message"].as_str().unwrap().split("prompt has ").nth(1).unwrap().split(' ').next().unwrap().parse::<usize>().unwrap();
    assert!(n > 64, "message names the prompt's token count");
    // Unknown fields are ignored.
    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "max_tokens": 2, "frobnicate": true }));
    assert_eq!(st, 200, "{b}");
}

#[test]
fn full_queue_gets_503_with_retry_after() {
    let s = Server::start(&["--parallel", "1", "--queue", "1"]);
    // One request generating (4000 tokens: it outlives the test), one waiting, the third is refused.
    let slow = json!({ "prompt": "a", "max_tokens": 100000, "stream": true });
    let r1 = agent().post(&s.url("/v1/completions")).send(slow.to_string()).unwrap();
    let mut rd1 = BufReader::new(r1.into_body().into_reader());
    let mut line = String::new();
    rd1.read_line(&mut line).unwrap(); // first token out: request 1 has the slot
    let r2 = agent().post(&s.url("/v1/completions")).send(slow.to_string()).unwrap();
    assert_eq!(r2.status().as_u16(), 200);
    let mut r3 = agent().post(&s.url("/v1/completions")).send(slow.to_string()).unwrap();
    assert_eq!(r3.status().as_u16(), 503);
    assert!(r3.headers().get("retry-after").is_some(), "503 carries Retry-After");
    let b: Value = serde_json::from_str(&r3.body_mut().read_to_string().unwrap()).unwrap();
    assert_error(503, &b, 503, "busy");
}

#[test]
fn api_key_is_required_when_set() {
    let s = Server::start(&["--api-key", "sekrit"]);
    let body = json!({ "messages": user("x"), "max_tokens": 2 }).to_string();
    let (st, b) = post_raw(&s.url("/v1/chat/completions"), &body, None);
    assert_error(st, &b, 401, "API key");
    let (st, b) = post_raw(&s.url("/v1/chat/completions"), &body, Some("wrong"));
    assert_error(st, &b, 401, "API key");
    let (st, b) = post_raw(&s.url("/v1/chat/completions"), &body, Some("sekrit"));
    assert_eq!(st, 200, "{b}");
    assert_eq!(s.get("/health").0, 200, "/health needs no key");
    assert_eq!(s.get("/v1/models").0, 401);
}

#[test]
fn sixteen_concurrent_streams_all_complete_and_match_solo_runs() {
    // Batch-invariant kernels: the default ones compute prompt-sized batches in another float
    // summation order, so a seeded result could change with the batch it ran in.
    let s = Server::start(&["--parallel", "4", "--queue", "16", "--batch-invariant"]);
    let base = s.base.clone();
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let url = format!("{base}/v1/chat/completions");
            thread::spawn(move || {
                let body = json!({ "messages": user(&format!("client {i}")), "max_tokens": 16 + i, "seed": i, "temperature": 1.0, "stream": true });
                let r = agent().post(&url).send(body.to_string()).unwrap();
                assert_eq!(r.status().as_u16(), 200);
                let (chunks, done) = read_sse(r.into_body().into_reader());
                assert!(done, "client {i}: no [DONE]");
                fold_chat(&chunks)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().expect("client thread")).collect();
    for (i, (_, _, fin)) in results.iter().enumerate() {
        // The random model may sample an end-of-generation token before max_tokens.
        assert!(matches!(fin.as_deref(), Some("length" | "stop")), "client {i}: {fin:?}");
    }
    // Batching must not change a seeded result: rerun a few alone.
    for i in [0usize, 5, 15] {
        let body = json!({ "messages": user(&format!("client {i}")), "max_tokens": 16 + i, "seed": i, "temperature": 1.0 });
        let (_, full) = s.post("/v1/chat/completions", &body);
        let m = &full["choices"][0]["message"];
        assert_eq!(results[i].0, m["reasoning_content"].as_str().unwrap_or(""), "client {i}: batched != alone");
        assert_eq!(results[i].1, m["content"].as_str().unwrap_or(""), "client {i}");
    }
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

#[test]
fn disconnect_mid_stream_frees_the_sequence() {
    let s = Server::start(&["--parallel", "1"]);
    let body = json!({ "prompt": "hello", "max_tokens": 100000, "stream": true });
    {
        let r = agent().post(&s.url("/v1/completions")).send(body.to_string()).unwrap();
        let mut rd = BufReader::new(r.into_body().into_reader());
        let mut line = String::new();
        for _ in 0..6 {
            line.clear();
            rd.read_line(&mut line).unwrap();
        }
        assert_eq!(metric(&s.get("/metrics").1, "ember_active_sequences"), 1.0);
    } // dropped: the connection closes mid-stream
    let t0 = Instant::now();
    loop {
        let m = s.get("/metrics").1;
        if metric(&m, "ember_active_sequences") == 0.0 {
            assert_eq!(metric(&m, "ember_cancelled_total"), 1.0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "sequence still active after the client left");
        thread::sleep(Duration::from_millis(20));
    }
    // The slot is free again.
    let (st, b) = s.post("/v1/completions", &json!({ "prompt": "x", "max_tokens": 3 }));
    assert_eq!(st, 200, "{b}");
}

/// Checks the Prometheus text format line by line (the subset we write: HELP/TYPE comments,
/// samples with optional labels) and returns the samples.
type Sample = (String, Vec<(String, String)>, f64);

fn parse_prometheus(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut typed = std::collections::HashMap::new();
    let is_name = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut it = rest.splitn(3, ' ');
            let (kw, name, arg) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap_or(""));
            assert!(is_name(name), "bad metric name in {line:?}");
            match kw {
                "HELP" => {}
                "TYPE" => {
                    assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&arg), "{line:?}");
                    typed.insert(name.to_string(), arg.to_string());
                }
                _ => panic!("unknown comment {line:?}"),
            }
            continue;
        }
        let (head, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line:?}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let (name, labels) = match head.split_once('{') {
            None => (head, Vec::new()),
            Some((n, l)) => {
                let l = l.strip_suffix('}').unwrap_or_else(|| panic!("unclosed labels: {line:?}"));
                let labels = l
                    .split(',')
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap();
                        assert!(is_name(k) && v.starts_with('"') && v.ends_with('"'), "bad label in {line:?}");
                        (k.to_string(), v.trim_matches('"').to_string())
                    })
                    .collect();
                (n, labels)
            }
        };
        assert!(is_name(name), "bad sample name {line:?}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| typed.get(*f).is_some_and(|t| t == "histogram"))
            .unwrap_or(name);
        assert!(typed.contains_key(family), "sample before its TYPE: {line:?}");
        samples.push((name.to_string(), labels, value));
    }
    samples
}

#[test]
fn metrics_parse_as_prometheus_text() {
    let s = Server::start(&[]);
    let (st, _) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "max_tokens": 5 }));
    assert_eq!(st, 200);
    s.post("/v1/chat/completions", &json!({ "messages": "nope" }));
    let r = agent().get(&s.url("/metrics")).call().unwrap();
    assert!(r.headers().get("content-type").unwrap().to_str().unwrap().starts_with("text/plain"));
    let text = r.into_body().read_to_string().unwrap();
    let samples = parse_prometheus(&text);
    let get = |name: &str, label: Option<(&str, &str)>| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && label.is_none_or(|(k, v)| l.iter().any(|(a, b)| a == k && b == v)))
            .map(|s| s.2)
            .unwrap_or_else(|| panic!("missing {name} {label:?}"))
    };
    assert_eq!(get("ember_requests_total", Some(("status", "200"))), 1.0);
    assert_eq!(get("ember_requests_total", Some(("status", "400"))), 1.0);
    assert_eq!(get("ember_generated_tokens_total", None), 5.0);
    assert!(get("ember_prompt_tokens_total", None) > 0.0);
    assert_eq!(get("ember_time_to_first_token_seconds_count", None), 1.0);
    assert_eq!(get("ember_time_per_output_token_seconds_count", None), 4.0);
    assert_eq!(get("ember_time_to_first_token_seconds_bucket", Some(("le", "+Inf"))), 1.0);
    assert_eq!(get("ember_queue_depth", None), 0.0);
    assert_eq!(get("ember_active_sequences", None), 0.0);
}

#[test]
fn llama_server_endpoints() {
    let s = Server::start(&[]);
    let (st, b) = s.post("/tokenize", &json!({ "content": "<|im_start|>Hi", "with_pieces": true }));
    assert_eq!(st, 200);
    assert_eq!(b["tokens"][0], json!({ "id": 617, "piece": "<|im_start|>" }));
    let (_, b) = s.post("/tokenize", &json!({ "content": "<|im_start|>Hi", "parse_special": false }));
    assert!(!b["tokens"].as_array().unwrap().contains(&json!(617)));
    let (_, b) = s.post("/tokenize", &json!({ "content": "Hello world" }));
    let (st, d) = s.post("/detokenize", &json!({ "tokens": b["tokens"] }));
    assert_eq!(st, 200);
    assert_eq!(d["content"], "Hello world");
    let (st, d) = s.post("/detokenize", &json!({ "tokens": [1, 99999] }));
    assert_error(st, &d, 400, "99999");
    let (st, t) = s.post("/apply-template", &json!({ "messages": user("hi"), "chat_template_kwargs": { "enable_thinking": false } }));
    assert_eq!(st, 200);
    assert_eq!(t["prompt"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    let (st, m) = s.get("/v1/models");
    assert_eq!(st, 200);
    let m: Value = serde_json::from_str(&m).unwrap();
    assert_eq!(m["data"][0]["id"], "ember-demo-tiny-a");
    assert_eq!(s.get("/health").0, 200);
    // With thinking off the output starts as content.
    let (_, c) = s.post(
        "/v1/chat/completions",
        &json!({ "messages": user("hi"), "max_tokens": 8, "chat_template_kwargs": { "enable_thinking": false } }),
    );
    assert!(c["choices"][0]["message"].get("reasoning_content").is_none(), "{c}");
}

const SCRIPT: &str = "<think>\nLet me check.\n</think>\n\nSure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>";

fn tools() -> Value {
    json!([
        { "type": "function", "function": { "name": "get_weather", "parameters": { "type": "object", "properties": { "city": { "type": "string" }, "days": { "type": "integer" } } } } },
        { "type": "function", "function": { "name": "get_time", "parameters": { "type": "object", "properties": { "zone": { "type": "string" } } } } },
    ])
}

#[test]
fn tool_calls_parsed_and_streamed() {
    let s = Server::start(&["--script", SCRIPT]);
    let req = json!({ "messages": user("weather?"), "tools": tools() });
    let (st, full) = s.post("/v1/chat/completions", &req);
    assert_eq!(st, 200, "{full}");
    let choice = &full["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let msg = &choice["message"];
    assert_eq!(msg["reasoning_content"], "Let me check.");
    assert_eq!(msg["content"], "Sure.");
    let calls = msg["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({ "city": "Paris", "days": 3 }), "typed by the schema");
    assert_eq!(calls[1]["function"]["name"], "get_time");
    assert!(calls[0]["id"].as_str().unwrap() != calls[1]["id"].as_str().unwrap());

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let (chunks, done) = s.stream("/v1/chat/completions", &sreq);
    assert!(done);
    let mut streamed: Vec<(String, String, String)> = Vec::new();
    for ch in &chunks {
        let Some(tcs) = ch["choices"][0]["delta"]["tool_calls"].as_array() else { continue };
        for tc in tcs {
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(id) = tc["id"].as_str() {
                assert_eq!(i, streamed.len(), "indices count up from 0");
                streamed.push((id.to_string(), tc["function"]["name"].as_str().unwrap().to_string(), String::new()));
            }
            streamed[i].2.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(streamed.len(), 2);
    assert_eq!(streamed[0].1, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&streamed[0].2).unwrap(), args);
    assert_eq!(fold_chat(&chunks).2.as_deref(), Some("tool_calls"));

    // tool_choice "none": the markup is content.
    let mut none = req.clone();
    none["tool_choice"] = json!("none");
    let (_, b) = s.post("/v1/chat/completions", &none);
    assert!(b["choices"][0]["message"]["content"].as_str().unwrap().contains("<tool_call>"));
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
}

#[test]
fn graceful_shutdown_finishes_running_requests() {
    let mut s = Server::start(&[]);
    let url = s.url("/v1/completions");
    let client = thread::spawn(move || {
        let r = agent().post(&url).send(json!({ "prompt": "a", "max_tokens": 60, "stream": true }).to_string()).unwrap();
        read_sse(r.into_body().into_reader())
    });
    // Let the stream start, then SIGTERM.
    let t0 = Instant::now();
    while metric(&s.get("/metrics").1, "ember_active_sequences") == 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        thread::sleep(Duration::from_millis(5));
    }
    let st = Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let (chunks, done) = client.join().unwrap();
    assert!(done, "the running stream finished");
    assert!(chunks.last().unwrap()["choices"][0]["finish_reason"].is_string());
    let status = s.child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
}

/// The official `openai` Python client (installed by `.ci/run`): chat, streaming, tools.
#[test]
fn openai_python_client() {
    let have = Command::new("python3").args(["-c", "import openai"]).status().is_ok_and(|s| s.success());
    if !have {
        assert!(std::env::var_os("CI").is_none(), "CI is set but the `openai` Python module is missing (pip install openai)");
        eprintln!("SKIPPED openai_python_client: python3 with the `openai` module not found (pip install openai)");
        return;
    }
    let model = Server::start(&["--api-key", "k1"]);
    let script = Server::start(&["--script", SCRIPT, "--api-key", "k1"]);
    let py = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3").args([py, &format!("{}/v1", model.base), &format!("{}/v1", script.base), "k1"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client test failed:\n{text}");
    assert!(text.contains("ALL OK"), "{text}");
}

/// A five-turn chat through the HTTP API: every follow-up restores the conversation so far
/// from the prompt cache (`usage.prompt_tokens_details.cached_tokens`) and computes only the
/// new tokens; with the cache off nothing is reused; /metrics counts the hits.
#[test]
fn multi_turn_chat_reuses_the_conversation() {
    // Batch-invariant kernels, so that "same answer with and without the cache" holds bit for
    // bit although the cached run computes only the suffix of each prompt.
    let s = Server::start(&["--batch-invariant"]);
    let off = Server::start(&["--cache-ram", "0", "--batch-invariant"]);
    let mut messages = vec![json!({ "role": "system", "content": "You are terse." })];
    let mut prev_prompt = 0u64;
    for turn in 0..5 {
        messages.push(json!({ "role": "user", "content": format!("Question number {turn}: what is the sea made of?") }));
        let body = json!({ "messages": messages, "max_tokens": 8, "seed": 3, "temperature": 0,
                           "chat_template_kwargs": { "enable_thinking": false } });
        let (status, r) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{r}");
        let usage = &r["usage"];
        let (n_prompt, cached) =
            (usage["prompt_tokens"].as_u64().unwrap(), usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap());
        if turn == 0 {
            assert_eq!(cached, 0);
        } else {
            // Everything up to the end of the previous turn's last message is reused: at least
            // the previous prompt minus its generation prompt (`<|im_start|>assistant\n<think>\n\n</think>\n\n`).
            assert!(
                cached + 12 >= prev_prompt && cached < n_prompt,
                "turn {turn}: cached {cached} of {n_prompt} (previous prompt {prev_prompt})"
            );
        }
        let (status, r_off) = off.post("/v1/chat/completions", &body);
        assert_eq!(status, 200);
        assert_eq!(r_off["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "cache off");
        assert_eq!(r["choices"][0]["message"], r_off["choices"][0]["message"], "turn {turn}: same answer with and without the cache");
        prev_prompt = n_prompt;
        let reply = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        messages.push(json!({ "role": "assistant", "content": reply }));
    }
    let (_, m) = s.get("/metrics");
    assert_eq!(metric(&m, "ember_prompt_cache_hits_total"), 4.0, "{m}");
    assert!(metric(&m, "ember_prompt_cache_tokens_total") > 0.0);
    assert!(metric(&m, "ember_prompt_cache_bytes") > 0.0);
}

/// Issue 14: the prompt cache of a growing chat costs its new state, not a copy of the whole
/// prefix per checkpoint. Twelve turns through the server; after each, the cache's bytes (from
/// /metrics) per context token. Snapshots share KV pages, so turn 12 stays within 1.5x of turn 1
/// (before pages were shared: 3.9 -> 27.7 KiB per token, 7x). Every follow-up reuses the
/// conversation from the cache.
#[test]
fn r14_chat_cache_bytes_per_token_stay_flat() {
    let s = Server::start(&["--cache-ram", "256"]);
    let mut messages = vec![json!({"role": "system", "content": "You are a terse assistant."})];
    let mut per_token = Vec::new();
    for turn in 0..12 {
        messages.push(
            json!({"role": "user", "content": format!("Question {turn}: tell me about the number {} and why it matters.", turn * 7 + 3)}),
        );
        let (st, v) = s.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 24, "temperature": 0, "seed": 1}));
        assert_eq!(st, 200, "{v}");
        let usage = &v["usage"];
        let ctx = usage["prompt_tokens"].as_f64().unwrap() + usage["completion_tokens"].as_f64().unwrap();
        if turn > 0 {
            assert!(usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "turn {turn} reused nothing: {usage}");
        }
        let m = s.get("/metrics").1;
        let bytes = metric(&m, "ember_prompt_cache_bytes");
        eprintln!(
            "turn {turn}: context {ctx}, cached {}, entries {}, bytes {bytes}",
            usage["prompt_tokens_details"]["cached_tokens"],
            metric(&m, "ember_prompt_cache_entries")
        );
        per_token.push(bytes / ctx);
        let reply = v["choices"][0]["message"]["content"].as_str().unwrap_or("").to_string();
        messages.push(json!({"role": "assistant", "content": reply}));
    }
    let kib: Vec<String> = per_token.iter().map(|b| format!("{:.1}", b / 1024.0)).collect();
    eprintln!("prompt cache KiB per context token, turns 1..12: {}", kib.join(" "));
    assert!(per_token[11] <= 1.5 * per_token[0], "cache bytes per token grew {:.2}x: {kib:?}", per_token[11] / per_token[0]);
}

/// Issue 17: the follow-up of a tool round exactly as OpenAI clients send it (`content: null`
/// next to `tool_calls`, `arguments` as JSON text, a `tool` message with `tool_call_id` and
/// `name`, content parts, `developer`) is answered; an unknown role is a 400 naming the field.
#[test]
fn r17_tool_round_follow_up_and_bad_roles() {
    let s = Server::start(&["--script", SCRIPT]);
    let (st, first) = s.post("/v1/chat/completions", &json!({ "messages": user("weather?"), "tools": tools() }));
    assert_eq!(st, 200, "{first}");
    let reply = first["choices"][0]["message"].clone();
    let call = &reply["tool_calls"][0];
    let mut assistant = json!({ "role": "assistant", "content": null, "tool_calls": [call] });
    let follow_up = |assistant: &Value| {
        json!({ "tools": tools(), "max_tokens": 4, "messages": [
            { "role": "developer", "content": "Use tools." },
            { "role": "user", "content": [{ "type": "text", "text": "weather?" }] },
            assistant,
            { "role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": "18 C" },
        ]})
    };
    let (st, b) = s.post("/v1/chat/completions", &follow_up(&assistant));
    assert_eq!(st, 200, "content null: {b}");
    assistant.as_object_mut().unwrap().remove("content");
    let (st, b) = s.post("/v1/chat/completions", &follow_up(&assistant));
    assert_eq!(st, 200, "content missing: {b}");
    let (st, t) = s.post("/apply-template", &follow_up(&assistant));
    assert_eq!(st, 200, "{t}");
    assert!(t["prompt"].as_str().unwrap().starts_with("<|im_start|>system\nUse tools.<|im_end|>"), "{t}");

    let (st, b) = s.post("/v1/chat/completions", &json!({ "messages": [{ "role": "wizard", "content": "hi" }] }));
    assert_error(st, &b, 400, "messages[0].role");
    assert_eq!(b["error"]["param"], "messages[0].role");
    let bad_part = json!({ "messages": [{ "role": "user", "content": [{ "type": "text", "text": 5 }] }] });
    let (st, b) = s.post("/v1/chat/completions", &bad_part);
    assert_error(st, &b, 400, "messages[0].content[0].text");
    let mut bad_args = follow_up(&assistant);
    bad_args["messages"][2]["tool_calls"][0]["function"]["arguments"] = json!("{\"city\": ");
    let (st, b) = s.post("/v1/chat/completions", &bad_args);
    assert_error(st, &b, 400, "not valid JSON");
    assert_eq!(b["error"]["param"], "messages[2].tool_calls[0].function.arguments");
}

/// Resident memory of a process in KiB (`VmRSS` in /proc; Linux).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `n_clients` threads, each sending `n_each` streaming chat requests one after another.
/// Returns the failures (anything but a 200 stream ending in a finish reason and `[DONE]`).
fn load_run(base: &str, n_clients: usize, n_each: usize) -> Vec<String> {
    let handles: Vec<_> = (0..n_clients)
        .map(|c| {
            let url = format!("{base}/v1/chat/completions");
            thread::spawn(move || {
                let mut failures = Vec::new();
                for r in 0..n_each {
                    let body = json!({ "messages": user(&format!("client {c} request {r}")), "max_tokens": 8, "seed": r, "stream": true });
                    match agent().post(&url).send(body.to_string()) {
                        Ok(resp) if resp.status().as_u16() == 200 => {
                            let (chunks, done) = read_sse(resp.into_body().into_reader());
                            let fin = fold_chat(&chunks).2;
                            if !done || !matches!(fin.as_deref(), Some("length" | "stop")) {
                                failures.push(format!("client {c} request {r}: done {done}, finish {fin:?}"));
                            }
                        }
                        Ok(resp) => failures.push(format!("client {c} request {r}: status {}", resp.status())),
                        Err(e) => failures.push(format!("client {c} request {r}: {e}")),
                    }
                }
                failures
            })
        })
        .collect();
    handles.into_iter().flat_map(|h| h.join().expect("client thread")).collect()
}

/// Issue 17 item 5 on the demo model: 64 concurrent streaming clients x 10 requests, twice,
/// with 0 failures and flat memory; 16 clients leaving mid-stream free their sequences at
/// once; past `--queue` every request gets a 503 with Retry-After or a full answer, never a
/// hang. Memory: RSS after the second run may exceed RSS after the first by at most 16 MiB
/// (allocator noise; a per-request leak of even 30 KB would exceed it over 640 requests).
/// The prompt cache is capped at 16 MiB so it is full, and evicting, after the first run.
#[test]
fn r17_load_disconnects_and_overload() {
    let s = Server::start(&["--parallel", "4", "--queue", "64", "--cache-ram", "16", "-c", "256"]);
    let pid = s.child.id();
    let (st, _) = s.post("/v1/chat/completions", &json!({ "messages": user("warm up"), "max_tokens": 4 }));
    assert_eq!(st, 200);
    let rss_start = rss_kib(pid);
    let t0 = Instant::now();
    let failures = load_run(&s.base, 64, 10);
    let secs_1 = t0.elapsed().as_secs_f64();
    assert!(failures.is_empty(), "{} of 640 failed: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    let rss_1 = rss_kib(pid);
    let t0 = Instant::now();
    let failures = load_run(&s.base, 64, 10);
    let secs_2 = t0.elapsed().as_secs_f64();
    assert!(failures.is_empty(), "second run: {} of 640 failed: {:?}", failures.len(), &failures[..failures.len().min(5)]);
    let rss_2 = rss_kib(pid);
    eprintln!(
        "r17 load: 2 x 64 clients x 10 streams, 0 failures ({secs_1:.1} s, {secs_2:.1} s); RSS start {rss_start} KiB, after run 1 {rss_1} KiB, after run 2 {rss_2} KiB"
    );
    assert!(rss_2 <= rss_1 + 16 * 1024, "memory grew from {rss_1} KiB to {rss_2} KiB over the second run");
    let m = s.get("/metrics").1;
    assert_eq!(metric(&m, "ember_active_sequences"), 0.0);
    assert_eq!(metric(&m, "ember_queue_depth"), 0.0);

    // 16 clients start long streams and leave after the first chunks.
    let cancelled_before = metric(&m, "ember_cancelled_total");
    let leavers: Vec<_> = (0..16)
        .map(|i| {
            let url = s.url("/v1/completions");
            thread::spawn(move || {
                let body = json!({ "prompt": format!("leaver {i}"), "max_tokens": 100000, "stream": true });
                let r = agent().post(&url).send(body.to_string()).unwrap();
                let mut rd = BufReader::new(r.into_body().into_reader());
                let mut line = String::new();
                for _ in 0..4 {
                    line.clear();
                    rd.read_line(&mut line).unwrap();
                }
            }) // the reader drops here: the connection closes mid-stream
        })
        .collect();
    leavers.into_iter().for_each(|h| h.join().unwrap());
    let t0 = Instant::now();
    loop {
        let m = s.get("/metrics").1;
        if metric(&m, "ember_active_sequences") == 0.0 && metric(&m, "ember_queue_depth") == 0.0 {
            assert_eq!(metric(&m, "ember_cancelled_total") - cancelled_before, 16.0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "sequences still held 5 s after their clients left: {m}");
        thread::sleep(Duration::from_millis(20));
    }
    eprintln!("r17 load: 16 disconnects freed in {:.0} ms", t0.elapsed().as_secs_f64() * 1000.0);

    // Overload: one slot, two waiting; 24 at once.
    let small = Server::start(&["--parallel", "1", "--queue", "2"]);
    let t0 = Instant::now();
    // All 24 send at once (a barrier), and each answer is long enough (512 tokens) that the
    // slot is still busy when the last one arrives, however loaded the machine is.
    let gate = std::sync::Arc::new(std::sync::Barrier::new(24));
    let clients: Vec<_> = (0..24)
        .map(|i| {
            let url = small.url("/v1/completions");
            let gate = gate.clone();
            thread::spawn(move || {
                gate.wait();
                let mut r = agent().post(&url).send(json!({ "prompt": format!("x {i}"), "max_tokens": 512 }).to_string()).unwrap();
                let status = r.status().as_u16();
                let retry = r.headers().get("retry-after").is_some();
                let body: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
                (status, retry, body)
            })
        })
        .collect();
    let results: Vec<_> = clients.into_iter().map(|h| h.join().unwrap()).collect();
    let n_ok = results.iter().filter(|r| r.0 == 200).count();
    let n_busy = results.iter().filter(|r| r.0 == 503).count();
    for (status, retry, body) in &results {
        match status {
            200 => assert!(body["choices"][0]["finish_reason"].is_string(), "{body}"),
            503 => {
                assert!(retry, "503 without Retry-After");
                assert_eq!(body["error"]["code"], "server_busy");
            }
            other => panic!("status {other}: {body}"),
        }
    }
    assert!(n_ok >= 3 && n_busy >= 1, "{n_ok} answered, {n_busy} refused");
    eprintln!(
        "r17 overload: 24 at once on --parallel 1 --queue 2: {n_ok} answered, {n_busy} got 503 + Retry-After, all within {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
