//! `ember serve`: the OpenAI-compatible server. Loads the model, starts the engine thread,
//! then serves HTTP until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use ember_cpu::Precision;
use ember_engine::{EngineConfig, ModelBackend, ScriptBackend};
use ember_ops::KvType;
use ember_server::AppState;
use serde_json::json;

use crate::{device, load};

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF (default: the bundled demo model, whose output is random text).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Address to bind. The default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Context size of each sequence, in tokens (default: the training context, at most 4096).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    /// Sequences generated at the same time (their decode steps share one forward pass).
    #[arg(long, default_value_t = 4, value_parser = load::parse_at_least_one)]
    parallel: usize,
    /// Requests that may wait for a free sequence; beyond that, 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Tokens per forward pass, all sequences together (llama-server's -b): decoding sequences
    /// get their token first, prompts share the rest, a long prompt goes in chunks.
    #[arg(short = 'b', long, default_value_t = 512, value_parser = load::parse_at_least_one)]
    batch: usize,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, env = "EMBER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model name served in /v1/models and expected in requests (default: the file name).
    #[arg(long)]
    alias: Option<String>,
    /// Where the model runs: auto (the GPU when the whole model fits, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, value_parser = device::parse_device, default_value = "auto")]
    device: device::Device,
    #[command(flatten)]
    place: device::PlaceArgs,
    /// Threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    #[arg(long, value_parser = load::parse_kv_type, default_value = "f16")]
    kv_type: KvType,
    /// RAM for the prompt cache in MiB (state checkpoints reused by follow-up requests; 0: off).
    #[arg(long, default_value_t = 2048)]
    cache_ram: usize,
    /// During long prompts, also checkpoint the state every this many tokens.
    #[arg(long, default_value_t = 2048)]
    checkpoint_every: usize,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// Compute every token with the same kernels whatever the batch: a seeded request gives
    /// the same tokens alone, batched with others, or with its prompt restored from the cache.
    /// Prompt processing is several times slower (no prompt-sized kernels); decode is not.
    #[arg(long)]
    batch_invariant: bool,
    /// Tokens of the prompt run once at start-up, before serving, so that the first request
    /// does not pay for the memory a full batch touches for the first time (default: --batch;
    /// 0: none). Never with the expert tier, whose routing heat it would skew.
    #[arg(long)]
    warm_up: Option<usize>,
    /// Testing aid: every response is this text (tokenized), whatever the prompt.
    #[arg(long, hide = true)]
    script: Option<String>,
}

pub fn main(a: Args) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if a.model.is_none() {
        eprintln!(
            "WARNING: serving the bundled demo model (tiny, random weights): its output is random text. Use -m MODEL.gguf for a real model."
        );
    }
    let model = load::open_model(a.model.as_ref())?;
    let tok = load::tokenizer(model.file())?;
    let template = model.file().get_str("tokenizer.chat_template").ok().map(str::to_string);
    let n_ctx_train = model.config.n_ctx_train;
    let n_ctx = a.ctx.unwrap_or(n_ctx_train.min(4096));
    anyhow::ensure!(n_ctx >= 2, "-c must be at least 2, got {n_ctx}");
    if n_ctx > n_ctx_train {
        tracing::warn!("context {n_ctx} is beyond the training context {n_ctx_train}");
    }
    let name = a.alias.clone().unwrap_or_else(|| match &a.model {
        Some(p) => p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned()),
        None => "ember-demo-tiny-a".into(),
    });
    let meta = json!({ "n_ctx": n_ctx, "n_ctx_train": n_ctx_train, "n_vocab": model.config.n_vocab, "n_parallel": a.parallel });
    let mut cfg = EngineConfig {
        n_parallel: a.parallel,
        n_queue: a.queue,
        n_ctx,
        n_batch: a.batch,
        cache_bytes: a.cache_ram << 20,
        checkpoint_every: a.checkpoint_every,
        warm_up: 0,
    };
    if a.cache_ram > 0 {
        tracing::info!(
            "prompt cache: {} MiB, checkpoints at message ends, prompt and generation ends, and every {} prompt tokens",
            a.cache_ram,
            a.checkpoint_every
        );
    } else {
        tracing::info!("prompt cache off (--cache-ram 0)");
    }
    let engine = match &a.script {
        Some(text) => {
            tracing::warn!("--script: every response is the given text, not the model's output");
            let backend =
                ScriptBackend::new(model.config.n_vocab, tok.encode(text, true), tok.eos_id().context("--script needs an EOS token")?);
            ember_engine::start(backend, cfg)
        }
        None => {
            let precision = if a.batch_invariant { Precision::BatchInvariant } else { Precision::Fast };
            let ops = device::backend(
                a.device,
                precision,
                a.threads,
                &device::Placement {
                    file: model.file(),
                    args: &a.place,
                    n_ctx,
                    parallel: a.parallel,
                    kv_type: a.kv_type,
                    step_tokens: a.batch,
                },
            )?;
            tracing::info!("{} sequence{} of {n_ctx} tokens, queue {}", a.parallel, if a.parallel == 1 { "" } else { "s" }, a.queue);
            if ops.expert_stats().is_none() {
                cfg.warm_up = a.warm_up.unwrap_or(a.batch);
            }
            if cfg.warm_up_tokens() > 0 {
                tracing::info!("warming up: one prompt of {} tokens", cfg.warm_up_tokens());
            }
            ember_engine::start(ModelBackend::new(model, ops, a.kv_type)?, cfg)
        }
    }
    .context("starting the engine")?
    .0;
    let state = Arc::new(AppState::new(engine, tok, template.as_deref(), name.clone(), a.api_key.clone(), meta));

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the async runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        let local: SocketAddr = listener.local_addr()?;
        eprintln!("ember: serving {name} on http://{local} (OpenAI API under /v1)");
        ember_server::serve(listener, state, shutdown_signal(), Duration::from_secs(a.grace)).await.context("serving")?;
        eprintln!("ember: stopped");
        Ok(())
    })
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
