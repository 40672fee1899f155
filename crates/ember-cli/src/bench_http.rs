//! `ember bench-http`: prompt and generation throughput of any OpenAI-compatible server (ember
//! or llama-server), measured as a client sees it. One streamed `/v1/completions` request per
//! run; prefill tokens/s = prompt tokens / time to first token, decode tokens/s from the
//! streamed tokens after the first. Token counts come from the server's `usage`.
//!
//! Prompts are real text from the bundled corpus, a different slice for every request so no
//! server can answer from its prompt cache (we also send llama.cpp's `cache_prompt: false`).
//! The slices are cut with the server's own tokenizer (`/tokenize`, `/detokenize`, which ember
//! and llama-server both serve), so a prompt is as long as asked whatever the model.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{CORPUS, Format};

#[derive(clap::Args)]
pub struct Args {
    /// Server base URL, e.g. http://127.0.0.1:8080
    #[arg(long)]
    url: String,
    /// Prompt lengths in tokens (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "512,8192,32768")]
    depths: Vec<usize>,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    n_predict: usize,
    /// Timed requests per depth (after one warm-up request).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Model name sent in requests (default: the first id of the server's /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "md")]
    output: Format,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
}

/// What one streamed request showed.
struct Sample {
    prompt_tokens: usize,
    completion_tokens: usize,
    s_first: f64,
    s_decode: f64,
}

pub fn main(a: Args) -> Result<()> {
    if a.runs == 0 || a.n_predict == 0 {
        bail!("--runs and --n-predict must be at least 1");
    }
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(a.timeout))).build().into();
    let base = a.url.trim_end_matches('/');
    let corpus = tokenize(&agent, base, CORPUS)?;
    if corpus.is_empty() {
        bail!("{base}/tokenize gave no tokens for the corpus");
    }
    let url = format!("{base}/v1/completions");
    let model = match &a.model {
        Some(m) => m.clone(),
        None => served_model(&agent, base).unwrap_or_else(|| "default".into()),
    };

    // Prompt i of length n: the corpus from a fresh offset, wrapping around.
    let mut cursor = 0usize;
    let mut prompt = |n: usize| -> Result<String> {
        let ids: Vec<u64> = (0..n).map(|k| corpus[(cursor + k) % corpus.len()]).collect();
        cursor += n + 7919; // a prime step, so consecutive prompts never share a prefix
        detokenize(&agent, base, &ids)
    };

    eprintln!("warm-up request");
    request(&agent, &url, &model, &prompt(64)?, 8)?;
    let mut rows = Vec::new();
    for &d in &a.depths {
        let mut samples = Vec::new();
        for r in 0..a.runs {
            let s = request(&agent, &url, &model, &prompt(d)?, a.n_predict)?;
            eprintln!(
                "depth {d}: run {}/{}: {} prompt tokens, first token after {:.2} s ({:.1} t/s), {} tokens at {:.2} t/s",
                r + 1,
                a.runs,
                s.prompt_tokens,
                s.s_first,
                s.prompt_tokens as f64 / s.s_first,
                s.completion_tokens,
                decode_ts(&s)
            );
            samples.push(s);
        }
        let pp: Vec<f64> = samples.iter().map(|s| s.prompt_tokens as f64 / s.s_first).collect();
        let tg: Vec<f64> = samples.iter().map(decode_ts).collect();
        let ttft: Vec<f64> = samples.iter().map(|s| s.s_first).collect();
        let (pp_mean, pp_std) = mean_std(&pp);
        let (tg_mean, tg_std) = mean_std(&tg);
        let (ttft_mean, _) = mean_std(&ttft);
        let n_prompt = samples.iter().map(|s| s.prompt_tokens).sum::<usize>() / samples.len();
        let n_gen = samples.iter().map(|s| s.completion_tokens).sum::<usize>() / samples.len();
        rows.push(json!({
            "url": a.url, "model": model, "depth": d, "n_prompt": n_prompt, "n_gen": n_gen, "runs": a.runs,
            "pp_name": format!("pp{d}"), "tg_name": format!("tg{}@d{d}", a.n_predict),
            "prefill_ts": pp_mean, "prefill_ts_std": pp_std, "ttft_s": ttft_mean,
            "decode_ts": tg_mean, "decode_ts_std": tg_std,
            "samples": samples.iter().map(|s| json!({"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens, "s_first": s.s_first, "s_decode": s.s_decode})).collect::<Vec<_>>(),
        }));
    }
    match a.output {
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Format::Md => {
            println!("| server | depth | prompt tokens | TTFT s | prefill t/s | generated | decode t/s |");
            println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
            for r in &rows {
                println!(
                    "| {} | {} | {} | {:.2} | {:.1} ± {:.1} | {} | {:.2} ± {:.2} |",
                    r["url"].as_str().unwrap_or(""),
                    r["depth"],
                    r["n_prompt"],
                    r["ttft_s"].as_f64().unwrap_or(0.0),
                    r["prefill_ts"].as_f64().unwrap_or(0.0),
                    r["prefill_ts_std"].as_f64().unwrap_or(0.0),
                    r["n_gen"],
                    r["decode_ts"].as_f64().unwrap_or(0.0),
                    r["decode_ts_std"].as_f64().unwrap_or(0.0),
                );
            }
        }
    }
    Ok(())
}

fn decode_ts(s: &Sample) -> f64 {
    if s.completion_tokens > 1 && s.s_decode > 0.0 { (s.completion_tokens - 1) as f64 / s.s_decode } else { 0.0 }
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// One streamed completion; times the first and last streamed token chunks.
fn request(agent: &ureq::Agent, url: &str, model: &str, prompt: &str, n_predict: usize) -> Result<Sample> {
    let body = json!({
        "model": model, "prompt": prompt, "max_tokens": n_predict, "temperature": 0.0,
        "stream": true, "stream_options": { "include_usage": true },
        // llama-server extensions (ignored elsewhere): no prompt cache, no early stop.
        "cache_prompt": false, "ignore_eos": true,
    });
    let t0 = Instant::now();
    let resp = agent.post(url).send_json(&body).with_context(|| format!("POST {url}"))?;
    let reader = BufReader::new(resp.into_body().into_reader());
    let (mut t_first, mut t_last) = (None, 0.0f64);
    let mut n_chunks = 0usize;
    let mut usage: Option<Value> = None;
    for line in reader.lines() {
        let line = line.context("reading the event stream")?;
        let Some(data) = line.strip_prefix("data:") else { continue };
        let data = data.trim();
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).with_context(|| format!("bad event: {data}"))?;
        if let Some(e) = v.get("error") {
            bail!("server error: {e}");
        }
        let now = t0.elapsed().as_secs_f64();
        if v["choices"].as_array().is_some_and(|c| c.iter().any(|c| c.get("text").is_some() && c["finish_reason"].is_null())) {
            t_first.get_or_insert(now);
            t_last = now;
            n_chunks += 1;
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            usage = Some(v["usage"].clone());
        }
    }
    let t_first = t_first.context("the stream carried no tokens")?;
    let u = usage.context("the server sent no usage (stream_options.include_usage)")?;
    let prompt_tokens = u["prompt_tokens"].as_u64().context("usage.prompt_tokens")? as usize;
    let completion_tokens = u["completion_tokens"].as_u64().map_or(n_chunks, |n| n as usize);
    Ok(Sample { prompt_tokens, completion_tokens, s_first: t_first, s_decode: t_last - t_first })
}

/// The server's token ids of `text` (llama-server's `/tokenize`; special tokens as text).
fn tokenize(agent: &ureq::Agent, base: &str, text: &str) -> Result<Vec<u64>> {
    let url = format!("{base}/tokenize");
    let v: Value = agent
        .post(&url)
        .send_json(json!({ "content": text, "add_special": false, "parse_special": false }))
        .with_context(|| format!("POST {url} (the server must offer llama-server's /tokenize)"))?
        .body_mut()
        .read_json()
        .with_context(|| format!("reading the answer of {url}"))?;
    v["tokens"]
        .as_array()
        .and_then(|t| t.iter().map(Value::as_u64).collect())
        .with_context(|| format!("{url} answered without `tokens`: {v}"))
}

/// The text of token ids (`/detokenize`).
fn detokenize(agent: &ureq::Agent, base: &str, ids: &[u64]) -> Result<String> {
    let url = format!("{base}/detokenize");
    let v: Value = agent
        .post(&url)
        .send_json(json!({ "tokens": ids }))
        .with_context(|| format!("POST {url}"))?
        .body_mut()
        .read_json()
        .with_context(|| format!("reading the answer of {url}"))?;
    v["content"].as_str().map(str::to_owned).with_context(|| format!("{url} answered without `content`: {v}"))
}

/// The first model id the server lists, if it answers /v1/models.
fn served_model(agent: &ureq::Agent, base: &str) -> Option<String> {
    let v: Value = agent.get(format!("{base}/v1/models")).call().ok()?.body_mut().read_json().ok()?;
    v["data"][0]["id"].as_str().map(str::to_owned)
}
