//! `ember serve` end to end: the real binary on the bundled tiny model (random weights), over
//! real HTTP (ureq), SSE parsed by hand. Each test starts its own server on a free port with one
//! compute thread, so tests stay independent and light on a 2-core CI machine. Load, clients that
//! leave and the prompt cache over long chats: tests/serve_load.rs.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::{Server, agent, assert_error, fold_chat, metric, post_raw, read_sse, user};
use serde_json::{Value, json};

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
    // The same prompt again: all of it comes from the prompt cache (with its last token's
    // logits), and the streamed answer above equals the first one.
    let n_prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(streamed_usage["prompt_tokens_details"]["cached_tokens"], n_prompt);
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
    // ignore_eos: the tiny model's random weights may sample the end of text early, and a first
    // request that ends lets the second take the slot and the third wait (seen once in CI).
    let slow = json!({ "prompt": "a", "max_tokens": 100000, "stream": true, "ignore_eos": true });
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

#[test]
fn disconnect_mid_stream_frees_the_sequence() {
    let s = Server::start(&["--parallel", "1"]);
    // ignore_eos: the random model may sample its end-of-generation token within the first
    // events, and the sequence must still be running when the client leaves (a clean CI run
    // failed here with the sequence already finished).
    let body = json!({ "prompt": "hello", "max_tokens": 100000, "stream": true, "ignore_eos": true });
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
    // The slot is freed (the gauge drops) just before the cancellation is counted: wait for
    // both (reading the counter as the gauge reached 0 failed once in a few dozen runs).
    loop {
        let m = s.get("/metrics").1;
        if metric(&m, "ember_active_sequences") == 0.0 && metric(&m, "ember_cancelled_total") >= 1.0 {
            assert_eq!(metric(&m, "ember_cancelled_total"), 1.0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "sequence still active, or not counted as cancelled, after the client left");
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
    // ignore_eos: the demo model's random weights may sample an end token within the five (CI
    // saw it once: four tokens went out, three gaps), and the counts below need all five.
    let (st, _) = s.post("/v1/chat/completions", &json!({ "messages": user("x"), "max_tokens": 5, "ignore_eos": true }));
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
        // ignore_eos: the demo model's random weights may sample an end token at once on some
        // hosts (the AVX2 kernels' order), and the request must still be running at SIGTERM.
        let r =
            agent().post(&url).send(json!({ "prompt": "a", "max_tokens": 60, "stream": true, "ignore_eos": true }).to_string()).unwrap();
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
