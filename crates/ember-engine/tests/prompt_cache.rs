//! The prompt cache on the tiny fixture model: a follow-up request restores the longest
//! checkpointed prefix and computes only the rest, and its output distribution equals that of
//! processing the whole prompt from scratch.
//!
//! Tolerance: every request asks for the log-probabilities of all 640 vocabulary rows at every
//! generated position (log-softmax of the logits, so equal up to the shift the softmax
//! removes). Exact path (dequantised weights, f32, f32 KV): max abs difference <= 1e-3 and
//! relative L2 <= 1e-4, the float32 bounds of the foundation tests; measured ~1e-6.

use std::sync::Arc;
use std::sync::mpsc;

use ember_chat::{ChatTemplate, RenderRequest};
use ember_cpu::Precision;
use ember_engine::{EngineConfig, EngineHandle, Event, EventSink, GenRequest, ModelBackend, SamplerConfig};
use ember_gguf::GgufFile;
use ember_model::Model;
use ember_ops::KvType;
use ember_testkit::fixture;
use ember_tokenizer::Tokenizer;
use serde_json::json;

struct Sink(mpsc::Sender<Event>);
impl EventSink for Sink {
    fn send(&mut self, ev: Event) -> bool {
        self.0.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

struct Setup {
    tok: Tokenizer,
    /// The real Qwen3.5 template (drops reasoning of earlier turns), rendered into the tiny
    /// model's tokens (it has <|im_start|>, <|im_end|>, <think> and </think>).
    qwen: ChatTemplate,
    file: Arc<GgufFile>,
}

fn setup() -> Setup {
    let file = Arc::new(GgufFile::open(fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let vocab = GgufFile::open(fixture("qwen36-vocab/ggml-vocab-qwen36.gguf")).unwrap();
    let qwen = ChatTemplate::new(vocab.get_str("tokenizer.chat_template").unwrap()).unwrap();
    Setup { tok, qwen, file }
}

fn engine(s: &Setup, cache_bytes: usize) -> EngineHandle {
    let model = Model::load(s.file.clone(), |_, _| {}).unwrap();
    let backend = ModelBackend::new(model, ember_cpu::backend(Precision::Exact, 2), KvType::F32).unwrap();
    let cfg = EngineConfig { n_parallel: 2, n_queue: 8, n_ctx: 1024, n_batch: 64, cache_bytes, checkpoint_every: 48, warm_up: 0 };
    ember_engine::start(backend, cfg).unwrap().0
}

fn prompt(s: &Setup, messages: serde_json::Value) -> Vec<u32> {
    let msgs = messages.as_array().unwrap().clone();
    let text = s.qwen.render(&RenderRequest { messages: &msgs, add_generation_prompt: true, ..Default::default() }).unwrap();
    s.tok.encode(&text, true)
}

/// Positions after each `<|im_end|>` + newline (what the server checkpoints).
fn message_ends(s: &Setup, ids: &[u32]) -> Vec<usize> {
    let end = s.tok.token_id("<|im_end|>").unwrap();
    let nl = s.tok.encode("\n", false)[0];
    ids.iter().enumerate().filter(|(_, t)| **t == end).map(|(i, _)| if ids.get(i + 1) == Some(&nl) { i + 2 } else { i + 1 }).collect()
}

struct Output {
    n_cached: usize,
    tokens: Vec<u32>,
    /// Full log-softmax at every generated position.
    dists: Vec<Vec<f32>>,
}

fn run(s: &Setup, e: &EngineHandle, ids: &[u32], n: usize) -> Output {
    let (tx, rx) = mpsc::channel();
    let req = GenRequest {
        prompt: ids.to_vec(),
        sampler: SamplerConfig { temperature: 0.0, seed: Some(1), ..Default::default() },
        max_tokens: n,
        eog: vec![],
        ignore_eos: false,
        n_logprobs: Some(640),
        checkpoints: message_ends(s, ids),
    };
    e.submit(req, Box::new(Sink(tx))).unwrap();
    let mut out = Output { n_cached: usize::MAX, tokens: Vec::new(), dists: Vec::new() };
    for ev in rx.iter() {
        match ev {
            Event::Started { n_cached, .. } => out.n_cached = n_cached,
            Event::Token { id, logprobs } => {
                let lp = logprobs.unwrap();
                let mut d = vec![0f32; 640];
                for (t, v) in lp.top {
                    d[t as usize] = v;
                }
                out.tokens.push(id);
                out.dists.push(d);
            }
            Event::Finished { .. } => break,
            Event::Failed(m) => panic!("engine failed: {m}"),
        }
    }
    out
}

fn assert_same(what: &str, got: &Output, want: &Output) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens differ");
    for (g, w) in got.dists.iter().zip(&want.dists) {
        let max_abs = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let num: f32 = g.iter().zip(w).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = w.iter().map(|b| b * b).sum();
        let rel = (num / den).sqrt();
        assert!(max_abs <= 1e-3 && rel <= 1e-4, "{what}: max abs {max_abs:e}, rel {rel:e}");
    }
}

fn conversation(s: &Setup, reply: &str) -> (Vec<u32>, Vec<u32>) {
    let turn1 = json!([{ "role": "system", "content": "You are terse." }, { "role": "user", "content": "Why is the sea salty?" }]);
    let turn2 = json!([
        { "role": "system", "content": "You are terse." },
        { "role": "user", "content": "Why is the sea salty?" },
        { "role": "assistant", "reasoning_content": "Rivers carry minerals.", "content": reply },
        { "role": "user", "content": "And why is it blue? Answer in one line." }
    ]);
    (prompt(s, turn1), prompt(s, turn2))
}

#[test]
fn follow_up_turn_reuses_the_conversation() {
    let s = setup();
    let cached = engine(&s, 512 << 20);
    let fresh = engine(&s, 0);
    let (p1, p2) = conversation(&s, "Dissolved salts from rocks.");
    let first = run(&s, &cached, &p1, 6);
    assert_eq!(first.n_cached, 0, "nothing cached yet");
    assert_same("turn 1", &first, &run(&s, &fresh, &p1, 6));

    // Turn 2 re-renders turn 1's assistant message without its reasoning (the template drops
    // it before the last user query), so it diverges from turn 1's prompt + generation right
    // after the last user message: that checkpoint is the one to restore.
    let got = run(&s, &cached, &p2, 6);
    let ends = message_ends(&s, &p1);
    assert_eq!(got.n_cached, *ends.last().unwrap(), "restored at the end of turn 1's user message");
    assert!(got.n_cached > 20);
    assert_same("turn 2", &got, &run(&s, &fresh, &p2, 6));

    // The same prompt again (a 'regenerate'): all of it is restored, with its last token's
    // logits, and the first token is sampled from those (the same distribution, bit for bit).
    let again = run(&s, &cached, &p2, 6);
    assert_eq!(again.n_cached, p2.len());
    assert_same("turn 2 again", &again, &got);
}

#[test]
fn divergence_inside_a_message_restores_the_previous_boundary() {
    let s = setup();
    let cached = engine(&s, 512 << 20);
    let fresh = engine(&s, 0);
    let a = prompt(
        &s,
        json!([{ "role": "system", "content": "You are terse." }, { "role": "user", "content": "Tell me about the moon and the tides." }]),
    );
    let b = prompt(
        &s,
        json!([{ "role": "system", "content": "You are terse." }, { "role": "user", "content": "Tell me about the sun and the wind." }]),
    );
    run(&s, &cached, &a, 2);
    let got = run(&s, &cached, &b, 6);
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let boundary = message_ends(&s, &b).into_iter().filter(|&p| p <= common).max().unwrap();
    assert_eq!(got.n_cached, boundary, "the system message's end, before the divergence at token {common}");
    assert_same("diverged mid-message", &got, &run(&s, &fresh, &b, 6));
}

#[test]
fn long_prompts_checkpoint_periodically_and_a_full_cache_evicts() {
    let s = setup();
    // A snapshot of this model is 140 KB of DeltaNet state plus 2 KB of f32 KV rows per token:
    // ~240-420 KB here, 4-5 per prompt (every 48 tokens, the prompt end, the generation end).
    // 2 MB holds about one and a half prompts' worth.
    let budget = 2_000_000;
    let cached = engine(&s, budget);
    let fresh = engine(&s, 0);
    let long = |topic: &str| prompt(&s, json!([{ "role": "user", "content": format!("{topic} ").repeat(40) }]));
    let (x, y, z) = (long("waves"), long("rocks"), long("clouds"));
    for p in [&x, &y, &z] {
        let got = run(&s, &cached, p, 3);
        assert_same("long prompt", &got, &run(&s, &fresh, p, 3));
    }
    let st = cached.stats();
    let ld = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert!(ld(&st.cache_evictions) > 0, "the budget forced evictions");
    assert!(st.cache_bytes.load(std::sync::atomic::Ordering::Relaxed) <= budget);
    // z's checkpoints are the most recent: a prompt extending z restores from z's periodic
    // checkpoint (every 48 tokens). x's (least recently used) were evicted.
    let mut z_more = z.clone();
    z_more.truncate(100); // inside the user message: the best checkpoint is the periodic one at 96
    z_more.extend_from_slice(&s.tok.encode(" and more", false));
    let got = run(&s, &cached, &z_more, 3);
    assert!(z.len() > 110);
    assert_eq!(got.n_cached, 96, "z's periodic checkpoint");
    assert_same("extended z", &got, &run(&s, &fresh, &z_more, 3));
    let again_x = run(&s, &cached, &x, 3);
    assert!(again_x.n_cached < x.len(), "x was evicted (restored {} of {})", again_x.n_cached, x.len());
    // A budget smaller than one snapshot stores nothing and still gives the same answers.
    let tiny = engine(&s, 1000);
    run(&s, &tiny, &x, 2);
    let got = run(&s, &tiny, &x, 3);
    assert_eq!(got.n_cached, 0);
    assert_same("no room", &got, &run(&s, &fresh, &x, 3));
}
