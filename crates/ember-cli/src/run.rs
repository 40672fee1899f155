use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ember_cpu::{CpuOps, Precision};
use ember_engine::{Sampler, SamplerConfig};
use ember_model::{Forward, Logits, SeqState};
use ember_ops::KvType;
use ember_tokenizer::StreamDecoder;

use crate::load;

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF (default: the bundled demo model, which has random weights).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    n_predict: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// RNG seed (default: random).
    #[arg(long)]
    seed: Option<u64>,
    /// Wrap the prompt with the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// With --chat: disable thinking (template kwarg enable_thinking = false).
    #[arg(long, requires = "chat")]
    no_think: bool,
    /// Context size in tokens (default: prompt + n_predict, at most the training context).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[arg(long, value_parser = load::parse_kv_type, default_value = "f16")]
    kv_type: KvType,
    /// Threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
}

pub fn main(a: Args) -> Result<()> {
    let t_load = Instant::now();
    let model = load::open_model(a.model.as_ref())?;
    let tok = load::tokenizer(model.file())?;
    let prompt = if a.chat {
        let src = model.file().get_str("tokenizer.chat_template").context("--chat: the model has no chat template")?;
        let tpl = ember_chat::ChatTemplate::new(src).context("compiling the chat template")?;
        let messages = vec![serde_json::json!({ "role": "user", "content": a.prompt })];
        let mut kwargs = serde_json::Map::new();
        if a.no_think {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        let req = ember_chat::RenderRequest { messages: &messages, tools: None, add_generation_prompt: true, kwargs, ..Default::default() };
        tpl.render(&req).context("rendering the chat template")?
    } else {
        a.prompt.clone()
    };
    let ids = tok.encode(&prompt, true);
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let n_ctx_max = model.config.n_ctx_train;
    let n_ctx = a.ctx.unwrap_or((ids.len() + a.n_predict).min(n_ctx_max));
    if ids.len() > n_ctx {
        bail!("the prompt has {} tokens, more than the context size {n_ctx}", ids.len());
    }
    let ops = CpuOps::new(Precision::Fast, a.threads);
    let mut st = SeqState::new(&model.config, n_ctx, a.kv_type)?;
    let seed = a.seed;
    let cfg = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed,
        ..Default::default()
    };
    let mut sampler = Sampler::new(cfg).context("sampling parameters")?;
    eprintln!(
        "loaded in {:.2} s, {} threads, prompt {} tokens, context {n_ctx}",
        t_load.elapsed().as_secs_f64(),
        ops.n_threads(),
        ids.len()
    );

    let mut out = std::io::stdout().lock();
    let mut history = ids.clone();
    let t_prompt = Instant::now();
    let mut logits = model.forward(&ops, &ids, &mut st, Forward { logits: Some(Logits::Last), ..Default::default() })?;
    let s_prompt = t_prompt.elapsed().as_secs_f64();
    let mut dec = StreamDecoder::new(false);
    let t_gen = Instant::now();
    let mut n_gen = 0;
    let mut stop = "length";
    while n_gen < a.n_predict {
        let id = sampler.sample(&logits.data, &history);
        n_gen += 1;
        if tok.is_eog(id) {
            stop = "end of generation token";
            break;
        }
        out.write_all(dec.push(&tok, id).as_bytes())?;
        out.flush()?;
        history.push(id);
        if n_gen == a.n_predict {
            break;
        }
        if st.n_past + 1 > n_ctx {
            stop = "context full";
            break;
        }
        logits = model.forward(&ops, &[id], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() })?;
    }
    out.write_all(dec.finish().as_bytes())?;
    writeln!(out)?;
    let s_gen = t_gen.elapsed().as_secs_f64();
    eprintln!(
        "prompt: {} tokens in {:.2} s ({:.1} tokens/s) | generation: {n_gen} tokens in {:.2} s ({:.1} tokens/s) | stop: {stop}",
        ids.len(),
        s_prompt,
        ids.len() as f64 / s_prompt,
        s_gen,
        n_gen as f64 / s_gen.max(1e-9)
    );
    Ok(())
}
