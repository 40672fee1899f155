use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ember_cpu::Precision;
use ember_engine::{EngineConfig, Event, EventSink, FinishReason, GenRequest, ModelBackend, Sampler, SamplerConfig};
use ember_ops::KvType;
use ember_tokenizer::StreamDecoder;

use crate::{device, load};

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF (default: the bundled demo model, which has random weights).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128, value_parser = load::parse_at_least_one)]
    n_predict: usize,
    /// Never sample the end-of-generation tokens: generate all -n tokens.
    #[arg(long)]
    ignore_eos: bool,
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
    /// Where the model runs: auto (the GPU when the whole model fits, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, value_parser = device::parse_device, default_value = "auto")]
    device: device::Device,
    #[command(flatten)]
    place: device::PlaceArgs,
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
    let ops = device::backend(
        a.device,
        Precision::Fast,
        a.threads,
        &device::Placement { file: model.file(), args: &a.place, n_ctx: n_ctx + 1, parallel: 1, kv_type: a.kv_type, step_tokens: 512 },
    )?;
    let n_threads = device::threads(a.threads);
    let seed = a.seed;
    let sampler = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed,
        ..Default::default()
    };
    Sampler::new(sampler.clone()).context("sampling parameters")?;
    let eog = tok.eog_ids().to_vec();
    // The same engine as `ember serve`, with one slot: one driver of the model everywhere.
    let backend = ModelBackend::new(model, ops, a.kv_type)?;
    let cfg = EngineConfig { n_parallel: 1, n_queue: 1, n_ctx: n_ctx + 1, n_batch: 512, cache_bytes: 0, checkpoint_every: 0, warm_up: 0 };
    let (engine, thread) = ember_engine::start(backend, cfg).context("starting the engine")?;
    eprintln!("loaded in {:.2} s, {n_threads} threads, prompt {} tokens, context {n_ctx}", t_load.elapsed().as_secs_f64(), ids.len());

    let (tx, rx) = std::sync::mpsc::channel();
    let req = GenRequest {
        prompt: ids.clone(),
        sampler,
        max_tokens: a.n_predict,
        eog,
        ignore_eos: a.ignore_eos,
        n_logprobs: None,
        checkpoints: Vec::new(),
    };
    let t_prompt = Instant::now();
    engine.submit(req, Box::new(Sink(tx))).context("submitting the prompt")?;
    drop(engine); // the engine thread ends once this request is done
    let mut out = std::io::stdout().lock();
    let mut dec = StreamDecoder::new(false);
    let (mut s_prompt, mut t_first) = (None, None);
    let (mut n_gen, mut stop) = (0, "length");
    for ev in rx {
        match ev {
            Event::Started { .. } => {}
            Event::Token { id, .. } => {
                if s_prompt.is_none() {
                    s_prompt = Some(t_prompt.elapsed().as_secs_f64());
                    t_first = Some(Instant::now());
                }
                n_gen += 1;
                out.write_all(dec.push(&tok, id).as_bytes())?;
                out.flush()?;
            }
            Event::Finished { reason, n_generated, .. } => {
                n_gen = n_generated;
                stop = match reason {
                    FinishReason::Eog => "end of generation token",
                    FinishReason::MaxTokens => "length",
                    FinishReason::ContextFull => "context full",
                };
                break;
            }
            Event::Failed(e) => bail!("generation failed: {e}"),
        }
    }
    out.write_all(dec.finish().as_bytes())?;
    writeln!(out)?;
    let s_prompt = s_prompt.unwrap_or_else(|| t_prompt.elapsed().as_secs_f64());
    // The first token came with the prompt; generation speed is over the ones after it.
    let s_gen = t_first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    eprintln!(
        "prompt: {} tokens in {:.2} s ({:.1} tokens/s) | generation: {n_gen} tokens in {:.2} s ({:.1} tokens/s) | stop: {stop}",
        ids.len(),
        s_prompt,
        ids.len() as f64 / s_prompt,
        s_gen,
        n_gen.saturating_sub(1) as f64 / s_gen.max(1e-9)
    );
    thread.join().map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    Ok(())
}

/// Engine events into a channel.
struct Sink(std::sync::mpsc::Sender<Event>);

impl EventSink for Sink {
    fn send(&mut self, ev: Event) -> bool {
        self.0.send(ev).is_ok()
    }

    fn is_closed(&self) -> bool {
        false
    }
}
