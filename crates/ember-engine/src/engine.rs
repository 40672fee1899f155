//! The engine thread: owns a [`Backend`] (model + ops), admits requests from a bounded queue
//! into at most `n_parallel` sequence slots, and runs continuous batching: every step is one
//! forward pass over the next prompt chunk of sequences still in prefill and the last sampled
//! token of every decoding sequence. Sequences join and leave between steps.
//!
//! Ids in, ids out: a request is a prompt of token ids plus sampling parameters; the results
//! are [`Event`]s (token ids, optional logprobs, a finish reason) pushed into the request's
//! [`EventSink`]. Stop strings, detokenizing and output parsing happen on the caller's side;
//! the caller ends a request early by closing its sink (the engine checks it every step).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::prefix_cache::{Checkpoint, PrefixCache};
use crate::{Error, Sampler, SamplerConfig};

mod ahead;
mod scheduler;
mod tokens;
use scheduler::{Cached, Scheduler, Seq};
pub use tokens::TOP_MAX;

/// One forward item: new tokens of one sequence and its state.
pub struct Step<'a, S> {
    pub tokens: &'a [u32],
    pub state: &'a mut S,
    /// Which logit rows to return: the last token's (a decode step, the end of a prompt), none
    /// (a prompt chunk that is not the last), or every token's (`ember logits`).
    pub logits: Logits,
}

pub use ember_model::Logits;

/// One sequence's logits from a step: its last row whole, or the best entries the sampler
/// needs ([`Backend::forward_top`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Row {
    Full(Vec<f32>),
    Top(ember_ops::TopRow),
}

/// What the engine runs. Implemented over `ember_model::Model` by [`ModelBackend`]; tests can
/// script one.
pub trait Backend: Send + 'static {
    type State: Send;
    /// A copy of a sequence's state after some tokens, for the prompt cache; dropping it
    /// releases what it holds.
    type Snapshot: Checkpoint + Send;
    /// Logit row width.
    fn n_vocab(&self) -> usize;
    /// Sizes the backend's state for `slots` sequences of up to `n_ctx` tokens and a prompt
    /// cache of `cache_bytes`; called once by [`start`] before anything else.
    fn configure(&mut self, slots: usize, n_ctx: usize, cache_bytes: usize) -> Result<(), Error>;
    /// A fresh sequence state able to hold `n_ctx` tokens.
    fn new_state(&mut self, n_ctx: usize) -> Result<Self::State, Error>;
    /// One forward pass over several sequences. Returns, in order, the logit rows each item
    /// asked for (`[rows · n_vocab]`), `None` for the items that asked for none.
    fn forward(&mut self, items: &mut [Step<'_, Self::State>]) -> Result<Vec<Option<Vec<f32>>>, Error>;
    /// [`Backend::forward`] where item i may ask, by `top[i] = Some((k, extra))` with
    /// `Logits::Last`, for its row's `k` best entries and those at `extra` instead of the whole
    /// row ([`Row::Top`]; `ember_ops::top::top_of_row` says which). `before_wait` runs once,
    /// after the step's work is put in motion and before its logits are waited for (host work
    /// a device's step overlaps: the engine delivers the previous step's tokens then). By
    /// default it runs first, then the whole rows come back and the selection runs on the host.
    fn forward_top(
        &mut self,
        items: &mut [Step<'_, Self::State>],
        top: &[Option<(usize, Vec<u32>)>],
        before_wait: &mut dyn FnMut(),
    ) -> Result<Vec<Option<Row>>, Error> {
        before_wait();
        let rows = self.forward(items)?;
        Ok(rows
            .into_iter()
            .zip(top.iter().chain(std::iter::repeat(&None)))
            .map(|(row, t)| {
                row.map(|r| match t {
                    Some((k, extra)) => Row::Top(ember_ops::top::top_of_row(&r, *k, extra)),
                    None => Row::Full(r),
                })
            })
            .collect())
    }
    /// Whether the backend can run a decode step ahead ([`Backend::submit`] with `deferred`):
    /// queue it while the step before it runs, its tokens fed once sampled from that step's
    /// rows, so that the device goes from one step to the next without waiting for the host.
    fn runs_ahead(&self) -> bool {
        false
    }
    /// Queues a decode step: one token a sequence, each item's row's best entries `top[i] = (k,
    /// extra)`, returned by [`Backend::collect`] (steps come back in the order they were
    /// queued); the host goes on meanwhile. With `deferred` the items' tokens are not known yet:
    /// [`Backend::feed`] brings them, before anything else waits for the device. Ok(false): this
    /// step cannot be queued deferred (nothing was). Each item's state counts its token as held
    /// from here on. On an error nothing of the step is left waiting.
    fn submit(&mut self, items: &mut [Step<'_, Self::State>], top: &[(usize, Vec<u32>)], deferred: bool) -> Result<bool, Error> {
        let _ = (items, top, deferred);
        Err(Error::Backend("this backend does not queue steps".into()))
    }
    /// The tokens of the deferred step queued last, one per item in its order.
    fn feed(&mut self, tokens: &[u32]) -> Result<(), Error> {
        let _ = tokens;
        Err(Error::Backend("this backend does not queue steps".into()))
    }
    /// The rows of the oldest step queued by [`Backend::submit`], one per item (waits for it).
    /// After an error every queued step is dropped.
    fn collect(&mut self) -> Result<Vec<ember_ops::TopRow>, Error> {
        Err(Error::Backend("this backend does not queue steps".into()))
    }
    /// Drops every step [`Backend::submit`] queued (one waiting for tokens is fed zeros first):
    /// after a failure, before the engine fails their sequences.
    fn abandon(&mut self) {}
    /// Whether [`Backend::forward_top`] saves something over whole rows (a GPU: the selection
    /// runs there and only a few entries of the row come to the host); the engine asks for
    /// rows' best entries only then.
    fn prefers_top(&self) -> bool {
        false
    }
    /// A snapshot of a sequence's state.
    fn snapshot(&mut self, state: &Self::State) -> Result<Self::Snapshot, Error>;
    /// A sequence state (able to hold `n_ctx` tokens) continuing from a snapshot.
    fn restore(&mut self, snap: &Self::Snapshot, n_ctx: usize) -> Result<Self::State, Error>;
    /// Free KV pages and the pool's size, when the backend keeps state in a bounded page
    /// pool (`None`: no limit).
    fn kv_pages(&mut self) -> Option<(usize, usize)>;
    /// The expert tier's counters, when the backend has one.
    fn expert_stats(&self) -> Option<ember_ops::ExpertStats> {
        None
    }
    /// Per layer, (device, layer, resident pairs, not resident pairs), for the layers the tier
    /// manages.
    fn expert_layer_stats(&self) -> Vec<(String, u16, u64, u64)> {
        Vec::new()
    }
    /// KV pages a sequence grows by from `from` to `to` tokens.
    fn pages_for(&self, from: usize, to: usize) -> usize;
}

/// Engine limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences generating at the same time (slots).
    pub n_parallel: usize,
    /// Requests that may wait for a slot; more are refused with [`Error::QueueFull`].
    pub n_queue: usize,
    /// Context size of every sequence (prompt + generated tokens).
    pub n_ctx: usize,
    /// Tokens per step, all sequences together (llama-server's `-b`): every decoding sequence
    /// gets its token first, then prompts fill what is left in arrival order, so a long
    /// prompt is split over steps instead of stalling the decoders.
    pub n_batch: usize,
    /// RAM budget of the prompt cache in bytes (0: no cache).
    pub cache_bytes: usize,
    /// During long prompts, also checkpoint every this many tokens (0: never).
    pub checkpoint_every: usize,
    /// Before serving, run one prompt of this many tokens (at most `n_batch`) on a scratch
    /// sequence and drop it (0: none), as llama-server warms up: the first request's prompt
    /// then does not pay for the memory a full batch touches for the first time (on the 2-core
    /// VM a first 512-token prompt of `small` took 2.6 s, the next ones 1.9 s: 409k page faults).
    pub warm_up: usize,
}

impl EngineConfig {
    /// The tokens the warm-up runs: [`EngineConfig::warm_up`], at most a batch, within the context.
    pub fn warm_up_tokens(&self) -> usize {
        self.warm_up.min(self.n_batch).min(self.n_ctx.saturating_sub(1))
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { n_parallel: 4, n_queue: 64, n_ctx: 4096, n_batch: 512, cache_bytes: 0, checkpoint_every: 2048, warm_up: 0 }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// Prompt token ids; at least one, fewer than the context size.
    pub prompt: Vec<u32>,
    pub sampler: SamplerConfig,
    /// Most tokens to generate (the context end may stop earlier).
    pub max_tokens: usize,
    /// End-of-generation ids: sampling one ends the request with [`FinishReason::Eog`]; it is
    /// counted as generated but not sent as a token.
    pub eog: Vec<u32>,
    /// Never sample the `eog` ids (their logits masked), so only `max_tokens` or the context
    /// end stops the request (llama.cpp's `--ignore-eos`, llama-server's and vLLM's
    /// `ignore_eos`).
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's logprob and the `k` most likely alternatives.
    pub n_logprobs: Option<usize>,
    /// Prompt positions where a follow-up request may diverge (e.g. the end of every chat
    /// message): the state after that many tokens is checkpointed into the prompt cache. The
    /// prompt's end (with its last token's logits) and the end of the generation are always
    /// checkpointed.
    pub checkpoints: Vec<usize>,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was sampled.
    Eog,
    /// `max_tokens` reached.
    MaxTokens,
    /// The context is full.
    ContextFull,
}

/// Log-probabilities of one generated token, from the model's raw distribution
/// (log-softmax of the logits, before penalties, filters and temperature: what OpenAI reports).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine reports about a request, in this order: `Started`, `Token`*, then
/// `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The request got a slot. `n_cached`: prompt tokens restored from a prompt-cache
    /// checkpoint instead of computed.
    Started {
        n_prompt: usize,
        n_cached: usize,
    },
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        n_prompt: usize,
        n_generated: usize,
    },
    /// An internal error; the request is over. Details are in the message.
    Failed(String),
}

/// Where a request's events go. `send` returns false once nobody listens; the engine then
/// frees the sequence.
pub trait EventSink: Send {
    fn send(&mut self, ev: Event) -> bool;
    /// The receiver is gone (client disconnected, or a stop string ended the request).
    fn is_closed(&self) -> bool;
}

/// Live counters, shared with the server's `/metrics`.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub n_waiting: AtomicUsize,
    pub n_active: AtomicUsize,
    pub n_steps: AtomicU64,
    pub tokens_prompt: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub n_cancelled: AtomicU64,
    /// Prompt cache: lookups that found a checkpoint / found none.
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub cache_evictions: AtomicU64,
    pub cache_checkpoints: AtomicU64,
    /// Prompt tokens restored from checkpoints instead of computed.
    pub tokens_cached: AtomicU64,
    pub cache_entries: AtomicUsize,
    pub cache_bytes: AtomicUsize,
    pub cache_budget_bytes: AtomicUsize,
    /// The backend's KV page pool (0 and 0 when it has none): pages free, and in all.
    pub kv_pages_free: AtomicUsize,
    pub kv_pages_total: AtomicUsize,
    /// The expert tier (all zero without one): routed pairs computed on the GPU / on the CPU,
    /// experts uploaded, bytes of experts the CPU read, microseconds it spent on them.
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub expert_uploads: AtomicU64,
    pub expert_miss_bytes: AtomicU64,
    pub expert_miss_us: AtomicU64,
    pub expert_evictions: AtomicU64,
    pub expert_streamed_pairs: AtomicU64,
    pub expert_streamed_bytes: AtomicU64,
    /// Per tier-managed layer: (device, layer, resident pairs, other pairs).
    pub expert_layers: std::sync::Mutex<Vec<(String, u16, u64, u64)>>,
    /// Microseconds the engine spent in its steps, and of those inside the backend's forward
    /// passes: the difference is the engine's own host time (sampling, events, bookkeeping),
    /// which a GPU waits through between decode steps.
    pub step_us: AtomicU64,
    pub forward_us: AtomicU64,
    /// Microseconds spent handing tokens to their clients (waking their tasks), inside the
    /// forward passes they overlap or not: not counted in `forward_us`.
    pub deliver_us: AtomicU64,
}

struct Job {
    req: GenRequest,
    sink: Box<dyn EventSink>,
}

enum Msg {
    Submit(Job),
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
    stats: Arc<EngineStats>,
    cfg: Arc<EngineConfig>,
    n_vocab: usize,
}

impl EngineHandle {
    /// Queues a request. Fails at once if the queue is full, the prompt does not fit, or the
    /// engine thread has stopped.
    pub fn submit(&self, req: GenRequest, sink: Box<dyn EventSink>) -> Result<(), Error> {
        let n_ctx = self.cfg.n_ctx;
        if req.prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(Error::Config { field: "max_tokens", limit: ">= 1", got: "0".into() });
        }
        if req.prompt.len() >= n_ctx {
            return Err(Error::PromptTooLong { n_prompt: req.prompt.len(), n_ctx });
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(Error::TokenOutOfRange { id: bad, n_vocab: self.n_vocab });
        }
        // Validate now so the caller gets the error, not the engine thread.
        Sampler::new(req.sampler.clone())?;
        // Admitted while fewer than n_queue wait beyond the free slots: a burst that meets idle
        // slots fills them and the queue (the engine thread moves a request to a slot only
        // after it counts it active, so the sum is never seen short).
        let waiting = self.stats.n_waiting.fetch_add(1, Ordering::SeqCst);
        let free = self.cfg.n_parallel.saturating_sub(self.stats.n_active.load(Ordering::SeqCst));
        if waiting >= self.cfg.n_queue + free {
            self.stats.n_waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::QueueFull { n_queue: self.cfg.n_queue });
        }
        if self.tx.send(Msg::Submit(Job { req, sink })).is_err() {
            self.stats.n_waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::Stopped);
        }
        Ok(())
    }

    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }
}

/// Starts the engine thread. It runs until every [`EngineHandle`] is dropped and the work in
/// hand is done; join the returned thread to wait for that.
pub fn start<B: Backend>(mut backend: B, cfg: EngineConfig) -> Result<(EngineHandle, JoinHandle<()>), Error> {
    if cfg.n_parallel == 0 || cfg.n_batch == 0 || cfg.n_ctx < 2 {
        return Err(Error::Config { field: "engine", limit: "n_parallel >= 1, n_batch >= 1, n_ctx >= 2", got: format!("{cfg:?}") });
    }
    backend.configure(cfg.n_parallel, cfg.n_ctx, cfg.cache_bytes)?;
    let pages = backend.kv_pages();
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(EngineStats::default());
    let n_vocab = backend.n_vocab();
    let handle = EngineHandle { tx, stats: stats.clone(), cfg: Arc::new(cfg.clone()), n_vocab };
    let cache = (cfg.cache_bytes > 0).then(|| PrefixCache::new(cfg.cache_bytes));
    stats.cache_budget_bytes.store(cfg.cache_bytes, Ordering::Relaxed);
    if let Some((free, total)) = pages {
        stats.kv_pages_free.store(free, Ordering::Relaxed);
        stats.kv_pages_total.store(total, Ordering::Relaxed);
    }
    // The warm-up runs on the engine thread, whose allocations the requests then reuse; start
    // returns once it is done, with its error if it failed.
    let (ready_tx, ready_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("ember-engine".into())
        .spawn(move || {
            let warm = warm_up(&mut backend, &cfg);
            let ok = warm.is_ok();
            let _ = ready_tx.send(warm);
            if ok {
                Scheduler { backend, cfg, stats, rx, active: Vec::new(), cache, ahead: None, next_id: 0 }.run()
            }
        })
        .map_err(|e| Error::Backend(format!("spawning the engine thread: {e}")))?;
    ready_rx.recv().map_err(|_| Error::Backend("the engine thread stopped while warming up".into()))??;
    Ok((handle, thread))
}

/// [`EngineConfig::warm_up`]: one prompt on a scratch sequence, dropped after.
fn warm_up<B: Backend>(backend: &mut B, cfg: &EngineConfig) -> Result<(), Error> {
    let n = cfg.warm_up_tokens();
    if n == 0 {
        return Ok(());
    }
    let tokens: Vec<u32> = (0..n).map(|i| (i % backend.n_vocab().max(1)) as u32).collect();
    let mut state = backend.new_state(n + 1)?;
    backend.forward(&mut [Step { tokens: &tokens, state: &mut state, logits: Logits::Last }])?;
    Ok(())
}
