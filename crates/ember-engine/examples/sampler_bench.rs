//! Time per `Sampler::sample` call on a vocabulary-sized logit row (the per-token host cost
//! every generated token pays in `run`, `chat` and `serve`).
//!
//!   cargo run --release -p ember-engine --example sampler_bench [-- VOCAB]

use std::time::Instant;

use ember_engine::{Sampler, SamplerConfig};

fn main() {
    let vocab: usize = std::env::args().nth(1).and_then(|v| v.parse().ok()).unwrap_or(248_320);
    // Logits shaped like a model's: most far below the top few (a xorshift stream, reproducible).
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let logits: Vec<f32> = (0..vocab).map(|_| (next() * 12.0 - 6.0 + if next() < 0.001 { 8.0 } else { 0.0 }) as f32).collect();
    let history: Vec<u32> = (0..256).map(|i| (i * 7919 % vocab) as u32).collect();
    let configs = [
        ("greedy", SamplerConfig { temperature: 0.0, seed: Some(1), ..Default::default() }),
        ("default (t 0.8, top_k 40, top_p 0.95, min_p 0.05)", SamplerConfig { seed: Some(1), ..Default::default() }),
        (
            "t 0.7, top_k 0, top_p 0.8, min_p 0",
            SamplerConfig { temperature: 0.7, top_k: 0, top_p: 0.8, min_p: 0.0, seed: Some(1), ..Default::default() },
        ),
        ("greedy, repeat_penalty 1.1", SamplerConfig { temperature: 0.0, repeat_penalty: 1.1, seed: Some(1), ..Default::default() }),
    ];
    for (name, cfg) in configs.iter().chain(configs.iter()).cloned() {
        let mut s = Sampler::new(cfg).unwrap();
        let mut sink = 0u64;
        for _ in 0..5 {
            sink += u64::from(s.sample(&logits, &history));
        }
        let n = 200;
        let t0 = Instant::now();
        for _ in 0..n {
            sink += u64::from(s.sample(&logits, &history));
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
        println!("sample, vocab {vocab}, {name}: {us:.1} us a call (checksum {sink})");
    }
    // What a request with `logprobs` adds a token (top 5 alternatives).
    let n = 50;
    let t0 = Instant::now();
    let mut sink = 0.0f64;
    for i in 0..n {
        let lp = ember_engine::sampler::logprobs_of(&logits, (i * 31) as u32, 5);
        sink += f64::from(lp.logprob) + lp.top.iter().map(|t| f64::from(t.1)).sum::<f64>();
    }
    println!("logprobs_of, vocab {vocab}, top 5: {:.1} us a call (checksum {sink:.3})", t0.elapsed().as_secs_f64() * 1e6 / n as f64);
}
