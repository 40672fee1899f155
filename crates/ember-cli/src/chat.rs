//! `ember chat`: a multi-turn chat in the terminal. The conversation is rendered with the
//! GGUF's chat template each turn and run on the same engine as `ember serve` (one sequence),
//! so the prompt cache restores everything up to the last message and only the new turn is
//! computed. Reasoning is printed dimmed (to stderr when stdout is not a terminal), then the
//! answer. Ctrl-C stops the answer being written and keeps the conversation; at the prompt it
//! quits. Lines starting with `/` are commands (`/help`). Piped stdin works: each line is a turn.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ember_chat::{ChatTemplate, ParseEvent, ParserOptions, RenderRequest};
use ember_cpu::Precision;
use ember_engine::{EngineConfig, EngineHandle, Event, EventSink, FinishReason, GenRequest, ModelBackend, SamplerConfig};
use ember_ops::KvType;
use ember_server::TextPipeline;
use ember_tokenizer::Tokenizer;
use serde_json::{Value, json};

use crate::{device, load};

#[derive(clap::Args)]
pub struct Args {
    /// Model GGUF (default: the bundled demo model, whose output is random text).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// A system message that starts every conversation (kept by /reset).
    #[arg(long)]
    system: Option<String>,
    /// Answer without thinking (template kwarg enable_thinking = false).
    #[arg(long)]
    no_think: bool,
    /// Most tokens per answer (default: until the context is full).
    #[arg(short = 'n', long)]
    n_predict: Option<usize>,
    /// Never sample the end-of-generation tokens: an answer runs to -n or the context's end
    /// (or Ctrl-C).
    #[arg(long)]
    ignore_eos: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Context size in tokens (default: the training context, at most 8192).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[arg(long, value_parser = load::parse_kv_type, default_value = "f16")]
    kv_type: KvType,
    /// RAM for the prompt cache in MiB (the conversation so far; 0: recompute every turn).
    #[arg(long, default_value_t = 1024)]
    cache_ram: usize,
    /// Where the model runs: auto (the GPU when the whole model fits, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, value_parser = device::parse_device, default_value = "auto")]
    device: device::Device,
    #[command(flatten)]
    place: device::PlaceArgs,
    /// Threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
}

const HELP: &str = "commands: /reset (start over), /save FILE, /load FILE (OpenAI-style messages JSON), /exit; Ctrl-C stops an answer";

/// What Ctrl-C does depends on whether an answer is being written.
#[derive(Default)]
struct Interrupt {
    generating: AtomicBool,
    stop: AtomicBool,
}

/// Engine events into a std channel; closed (which frees the engine's sequence) on Ctrl-C.
struct Sink {
    tx: mpsc::Sender<Event>,
    interrupt: Arc<Interrupt>,
}

impl EventSink for Sink {
    fn send(&mut self, ev: Event) -> bool {
        !self.is_closed() && self.tx.send(ev).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.interrupt.stop.load(Ordering::Relaxed)
    }
}

/// SIGINT: stop the answer being written, or quit at the prompt.
fn watch_ctrl_c(interrupt: Arc<Interrupt>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the signal watcher")?;
    std::thread::spawn(move || {
        rt.block_on(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                if interrupt.generating.load(Ordering::SeqCst) {
                    interrupt.stop.store(true, Ordering::SeqCst);
                } else {
                    eprintln!();
                    std::process::exit(130);
                }
            }
        })
    });
    Ok(())
}

struct Chat {
    engine: EngineHandle,
    tok: Arc<Tokenizer>,
    template: ChatTemplate,
    messages: Vec<Value>,
    system: Option<String>,
    no_think: bool,
    sampler: SamplerConfig,
    n_predict: Option<usize>,
    ignore_eos: bool,
    n_ctx: usize,
    interrupt: Arc<Interrupt>,
    /// Stdout is a terminal: reasoning is dimmed inline; else it goes to stderr.
    tty_out: bool,
}

pub fn main(a: Args) -> Result<()> {
    let model = load::open_model(a.model.as_ref())?;
    let tok = Arc::new(load::tokenizer(model.file())?);
    let src = model.file().get_str("tokenizer.chat_template").context("the model has no chat template")?;
    let template = ChatTemplate::new(src).context("compiling the chat template")?;
    let n_ctx = a.ctx.unwrap_or(model.config.n_ctx_train.min(8192));
    let cfg =
        EngineConfig { n_parallel: 1, n_queue: 4, n_ctx, n_batch: 512, cache_bytes: a.cache_ram << 20, checkpoint_every: 2048, warm_up: 0 };
    let ops = device::backend(
        a.device,
        Precision::Fast,
        a.threads,
        &device::Placement { file: model.file(), args: &a.place, n_ctx, parallel: 1, kv_type: a.kv_type, step_tokens: 512 },
    )?;
    let engine = ember_engine::start(ModelBackend::new(model, ops, a.kv_type)?, cfg).context("starting the engine")?.0;
    let interrupt = Arc::new(Interrupt::default());
    watch_ctrl_c(interrupt.clone())?;
    let sampler = SamplerConfig { temperature: a.temp, seed: a.seed, ..Default::default() };
    let mut chat = Chat {
        engine,
        tok,
        template,
        messages: Vec::new(),
        system: a.system.clone(),
        no_think: a.no_think,
        sampler,
        n_predict: a.n_predict,
        ignore_eos: a.ignore_eos,
        n_ctx,
        interrupt,
        tty_out: std::io::stdout().is_terminal(),
    };
    chat.reset();
    let tty_in = std::io::stdin().is_terminal();
    if tty_in {
        eprintln!("ember chat, context {n_ctx} tokens; {HELP}");
    }
    let mut line = String::new();
    loop {
        if tty_in {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        line.clear();
        if std::io::stdin().lock().read_line(&mut line)? == 0 {
            break;
        }
        let input = line.trim_end_matches(['\n', '\r']);
        if input.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = input.strip_prefix('/') {
            match chat.command(cmd.trim()) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => eprintln!("error: {}", crate::report(&e)),
            }
            continue;
        }
        if let Err(e) = chat.turn(input) {
            eprintln!("error: {}", crate::report(&e));
        }
    }
    Ok(())
}

impl Chat {
    fn reset(&mut self) {
        self.messages.clear();
        if let Some(s) = &self.system {
            self.messages.push(json!({ "role": "system", "content": s }));
        }
    }

    /// A `/command`; true to quit.
    fn command(&mut self, cmd: &str) -> Result<bool> {
        let (name, arg) = cmd.split_once(char::is_whitespace).map_or((cmd, ""), |(n, a)| (n, a.trim()));
        match name {
            "exit" | "quit" => return Ok(true),
            "help" => eprintln!("{HELP}"),
            "reset" => {
                self.reset();
                eprintln!("(conversation cleared)");
            }
            "save" => {
                if arg.is_empty() {
                    bail!("/save needs a file name");
                }
                let text = serde_json::to_string_pretty(&json!({ "messages": self.messages }))?;
                std::fs::write(arg, text + "\n").with_context(|| format!("writing {arg}"))?;
                eprintln!("(saved {} messages to {arg})", self.messages.len());
            }
            "load" => {
                if arg.is_empty() {
                    bail!("/load needs a file name");
                }
                self.messages = load_messages(Path::new(arg))?;
                eprintln!("(loaded {} messages from {arg})", self.messages.len());
            }
            other => bail!("unknown command /{other}; {HELP}"),
        }
        Ok(false)
    }

    /// One user message and the answer, streamed.
    fn turn(&mut self, text: &str) -> Result<()> {
        self.messages.push(json!({ "role": "user", "content": text }));
        let r = self.answer();
        if r.is_err() {
            self.messages.pop();
        }
        r
    }

    fn answer(&mut self) -> Result<()> {
        let mut kwargs = serde_json::Map::new();
        if self.no_think {
            kwargs.insert("enable_thinking".into(), false.into());
        }
        let mut req = RenderRequest::new(&self.messages);
        req.kwargs = kwargs;
        let prompt = self.template.render(&req).context("rendering the chat template")?;
        let reasoning = prompt.trim_end().ends_with("<think>");
        let ids = self.tok.encode(&prompt, true);
        if ids.len() >= self.n_ctx {
            bail!("the conversation has {} tokens, the context {} (use /reset, or a larger -c)", ids.len(), self.n_ctx);
        }
        let room = self.n_ctx - ids.len();
        let request = GenRequest {
            checkpoints: ember_server::message_ends(&self.tok, &ids),
            prompt: ids,
            sampler: self.sampler.clone(),
            max_tokens: self.n_predict.map_or(room, |n| n.min(room)),
            eog: self.tok.eog_ids().to_vec(),
            ignore_eos: self.ignore_eos,
            n_logprobs: None,
        };
        let (tx, rx) = mpsc::channel();
        self.interrupt.stop.store(false, Ordering::SeqCst);
        self.interrupt.generating.store(true, Ordering::SeqCst);
        let r = self.stream(request, tx, rx, reasoning);
        self.interrupt.generating.store(false, Ordering::SeqCst);
        let (content, thought) = r?;
        let mut msg = json!({ "role": "assistant", "content": content });
        if !thought.is_empty() {
            msg["reasoning_content"] = json!(thought);
        }
        self.messages.push(msg);
        Ok(())
    }

    /// Runs one generation to its end (or Ctrl-C); returns (answer, reasoning) as shown.
    fn stream(&self, request: GenRequest, tx: mpsc::Sender<Event>, rx: mpsc::Receiver<Event>, reasoning: bool) -> Result<(String, String)> {
        let n_prompt = request.prompt.len();
        self.engine.submit(request, Box::new(Sink { tx, interrupt: self.interrupt.clone() })).context("submitting to the engine")?;
        let opts = ParserOptions { reasoning, tools: Vec::new(), parse_tool_calls: false };
        let mut text = TextPipeline::new(Vec::new(), Some(opts));
        let (mut content, mut thought) = (String::new(), String::new());
        let mut out = Printer { tty_out: self.tty_out, in_reasoning: false, reasoning_to_stderr: false };
        let (mut n_cached, mut n_gen) = (0usize, 0usize);
        let mut t_first = None;
        let why = loop {
            if self.interrupt.stop.load(Ordering::SeqCst) {
                break "stopped (Ctrl-C)";
            }
            let ev = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(ev) => ev,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                // Ctrl-C closed the sink and the engine dropped it before the flag was seen.
                Err(mpsc::RecvTimeoutError::Disconnected) if self.interrupt.stop.load(Ordering::SeqCst) => break "stopped (Ctrl-C)",
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the engine dropped the request"),
            };
            let events = match ev {
                Event::Started { n_cached: c, .. } => {
                    n_cached = c;
                    continue;
                }
                Event::Token { id, .. } => {
                    t_first.get_or_insert_with(Instant::now);
                    n_gen += 1;
                    text.push_token(&self.tok, id)
                }
                Event::Finished { reason, .. } => {
                    out.show(&text.finish(), &mut content, &mut thought)?;
                    break match reason {
                        FinishReason::Eog => "end of answer",
                        FinishReason::MaxTokens => "token limit (-n)",
                        FinishReason::ContextFull => "context full",
                    };
                }
                Event::Failed(msg) => bail!("generation failed: {msg}"),
            };
            out.show(&events, &mut content, &mut thought)?;
        };
        out.end()?;
        let tps = t_first.map_or(0.0, |t| n_gen.saturating_sub(1) as f64 / t.elapsed().as_secs_f64().max(1e-9));
        let stats = format!("[{n_prompt} prompt tokens, {n_cached} from the cache | {n_gen} tokens, {tps:.1} t/s | {why}]");
        if std::io::stderr().is_terminal() {
            eprintln!("\x1b[2m{stats}\x1b[0m");
        } else {
            eprintln!("{stats}");
        }
        Ok((content, thought))
    }
}

/// Writes reasoning and answer apart: on a terminal, reasoning dimmed before the answer;
/// otherwise reasoning to stderr and only the answer to stdout.
struct Printer {
    tty_out: bool,
    in_reasoning: bool,
    reasoning_to_stderr: bool,
}

impl Printer {
    fn show(&mut self, events: &[ParseEvent], content: &mut String, thought: &mut String) -> Result<()> {
        let mut stdout = std::io::stdout().lock();
        for ev in events {
            match ev {
                ParseEvent::Reasoning(s) => {
                    thought.push_str(s);
                    if self.tty_out {
                        if !self.in_reasoning {
                            write!(stdout, "\x1b[2m")?;
                            self.in_reasoning = true;
                        }
                        write!(stdout, "{s}")?;
                    } else {
                        eprint!("{s}");
                        self.reasoning_to_stderr = true;
                    }
                }
                ParseEvent::Content(s) => {
                    if self.in_reasoning {
                        writeln!(stdout, "\x1b[0m")?;
                        self.in_reasoning = false;
                    }
                    content.push_str(s);
                    write!(stdout, "{s}")?;
                }
                _ => {}
            }
        }
        stdout.flush()?;
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.in_reasoning {
            write!(stdout, "\x1b[0m")?;
        }
        if self.reasoning_to_stderr {
            eprintln!();
        }
        writeln!(stdout)?;
        stdout.flush()?;
        Ok(())
    }
}

/// `/load`: `{"messages": [...]}` or a bare array, checked like a chat request's messages.
fn load_messages(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let list = match &v {
        Value::Array(m) => m,
        Value::Object(o) => {
            o.get("messages").and_then(Value::as_array).with_context(|| format!("{} has no `messages` array", path.display()))?
        }
        _ => bail!("{}: expected {{\"messages\": [...]}} or an array of messages", path.display()),
    };
    ember_server::map_messages(list).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.message))
}
