//! The engine thread: owns a [`Backend`] (model + ops), admits requests from a bounded queue
//! into at most `n_parallel` sequence slots, and runs continuous batching: every step is one
//! forward pass over the next prompt chunk of sequences still in prefill and the last sampled
//! token of every decoding sequence. Sequences join and leave between steps.
//!
//! Ids in, ids out: a request is a prompt of token ids plus sampling parameters; the results
//! are [`Event`]s (token ids, optional logprobs, a finish reason) pushed into the request's
//! [`EventSink`]. Stop strings, detokenizing and output parsing happen on the caller's side;
//! the caller ends a request early by closing its sink (the engine checks it every step).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::prefix_cache::{Checkpoint, PrefixCache};
use crate::{Error, Sampler, SamplerConfig};

mod tokens;
pub use tokens::TOP_MAX;
use tokens::{settle, take_token, top_request};

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
        let waiting = self.stats.n_waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.cfg.n_queue {
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
                Scheduler { backend, cfg, stats, rx, active: Vec::new(), cache }.run()
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

/// Whether a request fits now.
enum Room {
    Yes(Job),
    /// Not until a running sequence ends.
    Later(Job),
    /// Not even alone; the request was failed.
    Never,
}

/// One admitted request.
struct Seq<S> {
    job: Job,
    state: S,
    sampler: Sampler,
    /// Prompt then generated tokens (the penalties' history).
    history: Vec<u32>,
    /// Prompt tokens fed so far (restored ones included).
    n_fed: usize,
    /// Tokens the state covers: `history[..n_done]`.
    n_done: usize,
    n_generated: usize,
    /// Tokens its KV pages were reserved for at admission.
    reserve_to: usize,
    /// The logits of the prompt's last token, restored with the whole prompt from the cache:
    /// the first token is sampled from them before the next step, nothing is recomputed.
    restored_logits: Option<Vec<f32>>,
    /// The last sampled token's event when the sequence goes on: it goes out while the next
    /// step runs (see `Scheduler::step_inner`).
    unsent: Option<Event>,
}

impl<S> Seq<S> {
    /// Checkpoint positions of the prompt: the ones the request names, every `every` tokens,
    /// and the prompt's end (kept with its last token's logits, so the same prompt again
    /// restores everything and computes nothing before its first token).
    fn is_checkpoint(&self, pos: usize, every: usize) -> bool {
        let n_prompt = self.job.req.prompt.len();
        pos > 0
            && pos <= n_prompt
            && (pos == n_prompt || (every > 0 && pos.is_multiple_of(every)) || self.job.req.checkpoints.contains(&pos))
    }

    /// Where the current prompt chunk must end so that the next checkpoint is hit exactly.
    fn next_checkpoint(&self, every: usize) -> usize {
        let n_prompt = self.job.req.prompt.len();
        let periodic = self.n_fed.checked_div(every).map_or(n_prompt, |k| (k + 1) * every);
        let asked = self.job.req.checkpoints.iter().copied().filter(|&p| p > self.n_fed).min().unwrap_or(n_prompt);
        periodic.min(asked).min(n_prompt)
    }
}

struct Scheduler<B: Backend> {
    backend: B,
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    rx: mpsc::Receiver<Msg>,
    active: Vec<Seq<B::State>>,
    cache: Option<PrefixCache<Cached<B::Snapshot>>>,
}

/// A prompt-cache entry: a state, and at a prompt's end the logits of its last token.
struct Cached<S> {
    snap: S,
    logits: Option<Vec<f32>>,
}

impl<S: Checkpoint> Checkpoint for Cached<S> {
    fn bytes(&self) -> usize {
        self.snap.bytes() + self.logits.as_ref().map_or(0, |l| std::mem::size_of_val(l.as_slice()))
    }
    fn shared(&self) -> Vec<(usize, usize)> {
        self.snap.shared()
    }
}

impl<B: Backend> Scheduler<B> {
    fn run(mut self) {
        let mut open = true;
        let mut pending: VecDeque<Job> = VecDeque::new();
        loop {
            // Take what arrived; block only when there is nothing to do.
            loop {
                let msg = if self.active.is_empty() && pending.is_empty() && open {
                    self.rx.recv().ok()
                } else {
                    match self.rx.try_recv() {
                        Ok(m) => Some(m),
                        Err(mpsc::TryRecvError::Empty) => break,
                        Err(mpsc::TryRecvError::Disconnected) => None,
                    }
                };
                match msg {
                    Some(Msg::Submit(job)) => pending.push_back(job),
                    None => {
                        open = false;
                        break;
                    }
                }
            }
            while self.active.len() < self.cfg.n_parallel {
                let Some(job) = pending.pop_front() else { break };
                // A request waits (busy) while the KV pages it may need are not free.
                match self.room_for(job) {
                    Room::Yes(job) => {
                        self.stats.n_waiting.fetch_sub(1, Ordering::SeqCst);
                        self.admit(job);
                    }
                    Room::Later(job) => {
                        pending.push_front(job);
                        break;
                    }
                    Room::Never => {}
                }
            }
            self.stats.n_active.store(self.active.len(), Ordering::Relaxed);
            if self.active.is_empty() {
                if !open && pending.is_empty() {
                    return;
                }
                continue;
            }
            self.step();
            self.stats.n_active.store(self.active.len(), Ordering::Relaxed);
            if let Some((free, total)) = self.backend.kv_pages() {
                self.stats.kv_pages_free.store(free, Ordering::Relaxed);
                self.stats.kv_pages_total.store(total, Ordering::Relaxed);
            }
            if let Some(x) = self.backend.expert_stats() {
                self.stats.expert_hits.store(x.hits, Ordering::Relaxed);
                self.stats.expert_misses.store(x.misses, Ordering::Relaxed);
                self.stats.expert_uploads.store(x.uploads, Ordering::Relaxed);
                self.stats.expert_miss_bytes.store(x.miss_bytes, Ordering::Relaxed);
                self.stats.expert_miss_us.store((x.miss_secs * 1e6) as u64, Ordering::Relaxed);
                self.stats.expert_evictions.store(x.evictions, Ordering::Relaxed);
                self.stats.expert_streamed_pairs.store(x.streamed_pairs, Ordering::Relaxed);
                self.stats.expert_streamed_bytes.store(x.streamed_bytes, Ordering::Relaxed);
                *self.stats.expert_layers.lock().unwrap_or_else(|e| e.into_inner()) = self.backend.expert_layer_stats();
            }
        }
    }

    /// KV pages a request may grow to: its prompt plus every token it may generate.
    fn reserve_to(&self, req: &GenRequest) -> usize {
        req.prompt.len().saturating_add(req.max_tokens).min(self.cfg.n_ctx)
    }

    /// Whether the backend's free KV pages cover what the active sequences may still take
    /// plus what `job` may take (evicting prompt-cache checkpoints to make room). A request
    /// that cannot fit even with nothing else running fails here.
    fn room_for(&mut self, mut job: Job) -> Room {
        let need = self.backend.pages_for(0, self.reserve_to(&job.req));
        loop {
            let Some((free, _)) = self.backend.kv_pages() else { return Room::Yes(job) };
            let owed: usize = self.active.iter().map(|s| self.backend.pages_for(s.n_done, s.reserve_to)).sum();
            if free >= owed.saturating_add(need) {
                return Room::Yes(job);
            }
            if self.cache.as_mut().is_some_and(|c| c.evict_one()) {
                self.stats.cache_evictions.fetch_add(1, Ordering::Relaxed);
                self.update_cache_stats();
                continue;
            }
            if !self.active.is_empty() {
                return Room::Later(job);
            }
            self.stats.n_waiting.fetch_sub(1, Ordering::SeqCst);
            job.sink.send(Event::Failed(format!(
                "the request may need {need} KV pages (prompt + max_tokens) but only {free} are free; lower max_tokens or the prompt"
            )));
            return Room::Never;
        }
    }

    fn admit(&mut self, mut job: Job) {
        if job.sink.is_closed() {
            self.stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // The longest cached prefix that ends at a checkpoint: the whole prompt only with its
        // last token's logits (they are needed to sample), else at least that token is computed.
        let prompt = &job.req.prompt;
        let n_prompt = prompt.len();
        let restored = self
            .cache
            .as_mut()
            .and_then(|c| c.lookup_with(prompt, |n, e| n < n_prompt || e.logits.is_some()))
            .map(|(n, e)| (n, e.logits.clone().filter(|_| n == n_prompt), self.backend.restore(&e.snap, self.cfg.n_ctx)));
        self.update_cache_stats();
        let (state, n_cached, restored_logits) = match restored {
            Some((n, logits, Ok(s))) => (s, n, logits),
            Some((_, _, Err(e))) => {
                job.sink.send(Event::Failed(format!("restoring a prompt-cache checkpoint: {e}")));
                return;
            }
            None => match self.backend.new_state(self.cfg.n_ctx) {
                Ok(s) => (s, 0, None),
                Err(e) => {
                    job.sink.send(Event::Failed(e.to_string()));
                    return;
                }
            },
        };
        self.stats.tokens_cached.fetch_add(n_cached as u64, Ordering::Relaxed);
        let sampler = match Sampler::new(job.req.sampler.clone()) {
            Ok(s) => s,
            Err(e) => {
                job.sink.send(Event::Failed(e.to_string()));
                return;
            }
        };
        let n_prompt = job.req.prompt.len();
        if !job.sink.send(Event::Started { n_prompt, n_cached }) {
            self.stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let history = job.req.prompt.clone();
        let reserve_to = self.reserve_to(&job.req);
        self.active.push(Seq {
            job,
            state,
            sampler,
            history,
            n_fed: n_cached,
            n_done: n_cached,
            n_generated: 0,
            reserve_to,
            restored_logits,
            unsent: None,
        });
    }

    /// One forward pass over every active sequence, then sampling.
    fn step(&mut self) {
        let t0 = std::time::Instant::now();
        self.step_inner();
        self.stats.step_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    fn step_inner(&mut self) {
        // Free the slots of requests nobody listens to any more.
        let n_before = self.active.len();
        self.active.retain(|s| !s.job.sink.is_closed());
        self.stats.n_cancelled.fetch_add((n_before - self.active.len()) as u64, Ordering::Relaxed);
        if self.active.is_empty() {
            return;
        }
        let caching = self.cache.is_some();
        let every = if caching { self.cfg.checkpoint_every } else { 0 };
        let n_ctx = self.cfg.n_ctx;
        let mut done = vec![false; self.active.len()];
        let mut to_checkpoint: Vec<usize> = Vec::new();
        // Finished events go out after the end-of-generation checkpoint is taken and the slot
        // is freed, so a client that sees the end also sees the cache and slot counts updated.
        let mut finished: Vec<(usize, Event)> = Vec::new();
        // A sequence restored with its whole prompt takes its first token from the restored
        // logits, then decodes in this step like the others.
        for (i, s) in self.active.iter_mut().enumerate() {
            let Some(row) = s.restored_logits.take() else { continue };
            let took = take_token(s, &Row::Full(row), n_ctx, &self.stats);
            settle(i, took, &mut done, &mut finished, &mut to_checkpoint);
        }
        // The tokens sampled since the last step that go on: delivered once this step's work is
        // in motion (a GPU runs it meanwhile: a client's wake-up costs the engine thread tens
        // of microseconds on a VM), or at the end of the step when none runs.
        let mut unsent: Vec<(usize, Event)> =
            self.active.iter_mut().enumerate().filter_map(|(i, s)| s.unsent.take().map(|e| (i, e))).collect();
        let mut gone: Vec<usize> = Vec::new();
        // Which tokens each sequence feeds this step: (start, end, wants logits). Decoders take
        // one token each; prompt chunks share what is left of the budget, first come first
        // served, and end at checkpoint positions. A prompt left without budget waits (a, a).
        let n_decoding = self.active.iter().zip(&done).filter(|(s, d)| !**d && s.n_fed >= s.job.req.prompt.len()).count();
        let mut left = self.cfg.n_batch.saturating_sub(n_decoding);
        let spans: Vec<(usize, usize, bool)> = self
            .active
            .iter()
            .zip(&done)
            .map(|(s, &d)| {
                let n_prompt = s.job.req.prompt.len();
                if d {
                    (0, 0, false) // ended on its restored logits
                } else if s.n_fed < n_prompt {
                    let cut = if caching { s.next_checkpoint(every) } else { n_prompt };
                    let end = (s.n_fed + left).min(cut);
                    left -= end - s.n_fed;
                    (s.n_fed, end, end == n_prompt)
                } else {
                    // Decoding: feed the last sampled token.
                    (s.history.len() - 1, s.history.len(), true)
                }
            })
            .collect();
        let n_prompt_tokens: usize =
            self.active.iter().zip(&spans).filter(|(s, _)| s.n_fed < s.job.req.prompt.len()).map(|(_, sp)| sp.1 - sp.0).sum();
        // A step with prompt work may wait for the device mid-way (the expert tier's routing,
        // a page table): its tokens go out first, not after the prompt chunk.
        if n_prompt_tokens > 0 {
            let t0 = std::time::Instant::now();
            for (i, ev) in unsent.drain(..) {
                if !self.active[i].job.sink.send(ev) {
                    gone.push(i);
                }
            }
            self.stats.deliver_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        // Run the step; a sequence the backend rejects before running anything fails alone and
        // the step runs again without it.
        let mut failed = vec![false; self.active.len()];
        let result = loop {
            let order: Vec<usize> = (0..self.active.len()).filter(|&i| !failed[i] && spans[i].1 > spans[i].0).collect();
            if order.is_empty() {
                break Ok(Vec::new());
            }
            let mut items: Vec<Step<B::State>> = Vec::with_capacity(order.len());
            let mut top: Vec<Option<(usize, Vec<u32>)>> = Vec::with_capacity(order.len());
            let mut sinks: Vec<(usize, &mut Box<dyn EventSink>)> = Vec::with_capacity(unsent.len());
            let mut pos = 0;
            let prefers_top = self.backend.prefers_top();
            for (i, s) in self.active.iter_mut().enumerate() {
                let item = order.get(pos) == Some(&i);
                let (a, b, want) = spans[i];
                // A prompt's end that the cache will keep needs its whole row.
                let keeps_row = caching && s.n_fed < s.job.req.prompt.len();
                let ask = if item && want && prefers_top && !keeps_row { top_request(s) } else { None };
                let Seq { job, state, history, .. } = s;
                if unsent.iter().any(|u| u.0 == i) {
                    sinks.push((i, &mut job.sink));
                }
                if item {
                    top.push(ask);
                    items.push(Step { tokens: &history[a..b], state, logits: if want { Logits::Last } else { Logits::None } });
                    pos += 1;
                }
            }
            let mut delivering = std::time::Duration::ZERO;
            let mut deliver = || {
                let t0 = std::time::Instant::now();
                for (i, ev) in unsent.drain(..) {
                    if let Some((_, sink)) = sinks.iter_mut().find(|(j, _)| *j == i)
                        && !sink.send(ev)
                    {
                        gone.push(i);
                    }
                }
                delivering += t0.elapsed();
            };
            let t_fwd = std::time::Instant::now();
            let out = self.backend.forward_top(&mut items, &top, &mut deliver);
            let forward = t_fwd.elapsed().saturating_sub(delivering);
            self.stats.forward_us.fetch_add(forward.as_micros() as u64, Ordering::Relaxed);
            self.stats.deliver_us.fetch_add(delivering.as_micros() as u64, Ordering::Relaxed);
            match out {
                Ok(rows) => break Ok(order.into_iter().zip(rows).collect::<Vec<_>>()),
                Err(Error::Sequence { index, msg }) if index < order.len() => {
                    let i = order[index];
                    failed[i] = true;
                    // Its last token first, if still undelivered.
                    if let Some(k) = unsent.iter().position(|u| u.0 == i) {
                        let (_, ev) = unsent.remove(k);
                        self.active[i].job.sink.send(ev);
                    }
                    self.active[i].job.sink.send(Event::Failed(msg));
                }
                Err(e) => break Err(e),
            }
        };
        // Tokens no step delivered (none ran, or it failed before its work was in motion).
        let t0 = std::time::Instant::now();
        for (i, ev) in unsent.drain(..) {
            if !self.active[i].job.sink.send(ev) {
                gone.push(i);
            }
        }
        self.stats.deliver_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        // A client gone since its last token: its sequence is freed (its row of this step,
        // if any, is not sampled).
        for i in gone {
            if !std::mem::replace(&mut done[i], true) {
                self.stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.stats.n_steps.fetch_add(1, Ordering::Relaxed);
        self.stats.tokens_prompt.fetch_add(n_prompt_tokens as u64, Ordering::Relaxed);
        let mut logits: Vec<Option<Option<Row>>> = vec![None; self.active.len()];
        match result {
            Ok(rows) => {
                for (i, row) in rows {
                    logits[i] = Some(row);
                }
            }
            Err(e) => {
                // An op failed mid-pass: every sequence of the step may hold a half-advanced state.
                for mut s in self.active.drain(..) {
                    s.job.sink.send(Event::Failed(e.to_string()));
                }
                return;
            }
        }
        let mut prompt_checkpoints: Vec<(usize, Option<Vec<f32>>)> = Vec::new();
        let mut rows: Vec<(usize, Row)> = Vec::new();
        for (i, ((s, row), &(a, b, _))) in self.active.iter_mut().zip(logits).zip(&spans).enumerate() {
            if done[i] {
                continue;
            }
            if failed[i] {
                done[i] = true;
                continue;
            }
            // Not in this step (a prompt waiting for budget).
            let Some(row) = row else { continue };
            let n_prompt = s.job.req.prompt.len();
            s.n_done += b - a;
            if s.n_fed < n_prompt {
                s.n_fed = b;
                if self.cache.is_some() && s.is_checkpoint(b, every) {
                    // The prompt's end keeps its last token's logits.
                    // (Whole: a prompt end the cache keeps never asks for its best entries.)
                    let whole = match &row {
                        Some(Row::Full(r)) if b == n_prompt => Some(r.clone()),
                        _ => None,
                    };
                    prompt_checkpoints.push((i, whole));
                }
            }
            if let Some(row) = row {
                rows.push((i, row));
            }
        }
        // Prompt checkpoints before the first token goes out: its time to first token holds
        // the state's copy, not the decode that follows.
        for (i, logits) in prompt_checkpoints {
            self.checkpoint(i, logits);
        }
        for (i, row) in rows {
            let took = take_token(&mut self.active[i], &row, n_ctx, &self.stats);
            settle(i, took, &mut done, &mut finished, &mut to_checkpoint);
        }
        finished.sort_by_key(|f| f.0);
        for i in to_checkpoint {
            self.checkpoint(i, None);
        }
        let mut sinks: Vec<(Box<dyn EventSink>, Event)> = Vec::with_capacity(finished.len());
        let mut events = finished.into_iter().peekable();
        let mut kept = Vec::with_capacity(self.active.len());
        for (i, s) in self.active.drain(..).enumerate() {
            if !done[i] {
                kept.push(s);
            } else if events.peek().is_some_and(|(j, _)| *j == i) {
                // unwrap: peeked just above.
                sinks.push((s.job.sink, events.next().unwrap().1));
            }
        }
        self.active = kept;
        self.stats.n_active.store(self.active.len(), Ordering::Relaxed);
        for (mut sink, ev) in sinks {
            // A client that left after the last token took no finish: its sequence was freed
            // because it left.
            if !sink.send(ev) {
                self.stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
