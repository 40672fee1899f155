//! The engine thread's loop: admission of queued requests into sequence slots (KV pages
//! reserved, prompt-cache restores), and each step's forward pass, sampling, checkpoints and
//! hand-over of tokens (see the parent module's docs).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use super::tokens::{settle, take_token, top_request};
use super::{Backend, EngineConfig, EngineStats, Event, EventSink, GenRequest, Job, Logits, Msg, Row, Step};
use crate::prefix_cache::{Checkpoint, PrefixCache};
use crate::{Error, Sampler};

/// Whether a request fits now.
enum Room {
    Yes(Job),
    /// Not until a running sequence ends.
    Later(Job),
    /// Not even alone; the request was failed.
    Never,
}

/// One admitted request.
pub(super) struct Seq<S> {
    /// Unique among the engine's sequences (a step queued ahead names its rows' sequences so).
    pub(super) id: u64,
    pub(super) job: Job,
    pub(super) state: S,
    pub(super) sampler: Sampler,
    /// Prompt then generated tokens (the penalties' history).
    pub(super) history: Vec<u32>,
    /// Prompt tokens fed so far (restored ones included).
    pub(super) n_fed: usize,
    /// Tokens the state covers: `history[..n_done]`.
    pub(super) n_done: usize,
    pub(super) n_generated: usize,
    /// Tokens its KV pages were reserved for at admission.
    pub(super) reserve_to: usize,
    /// The logits of the prompt's last token, restored with the whole prompt from the cache:
    /// the first token is sampled from them before the next step, nothing is recomputed.
    pub(super) restored_logits: Option<Vec<f32>>,
    /// The last sampled token's event when the sequence goes on: it goes out while the next
    /// step runs (see `Scheduler::step_inner`).
    pub(super) unsent: Option<Event>,
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

pub(super) struct Scheduler<B: Backend> {
    pub(super) backend: B,
    pub(super) cfg: EngineConfig,
    pub(super) stats: Arc<EngineStats>,
    pub(super) rx: mpsc::Receiver<Msg>,
    pub(super) active: Vec<Seq<B::State>>,
    pub(super) cache: Option<PrefixCache<Cached<B::Snapshot>>>,
    /// The sequences of the decode step queued ahead and fed (in its rows' order), whose rows
    /// the next step collects (see `ahead.rs`).
    pub(super) ahead: Option<Vec<u64>>,
    /// The id the next admitted sequence gets.
    pub(super) next_id: u64,
}

/// A prompt-cache entry: a state, and at a prompt's end the logits of its last token.
pub(super) struct Cached<S> {
    pub(super) snap: S,
    pub(super) logits: Option<Vec<f32>>,
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
    pub(super) fn run(mut self) {
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
                        // Counted active before it stops waiting (submit's count of free slots
                        // never sees it in neither), and both before admit tells its client
                        // it started; then the true count (a client that left is not admitted).
                        self.stats.n_active.store(self.active.len() + 1, Ordering::SeqCst);
                        self.stats.n_waiting.fetch_sub(1, Ordering::SeqCst);
                        self.admit(job);
                        self.stats.n_active.store(self.active.len(), Ordering::SeqCst);
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
        self.next_id += 1;
        self.active.push(Seq {
            id: self.next_id,
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
            self.drop_ahead();
            return;
        }
        // Decode steps queued one ahead of the other, while every sequence decodes and the
        // backend can (`ahead.rs`); otherwise the step below.
        if self.step_ahead() {
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
        self.retire(done, finished, to_checkpoint);
    }

    /// The end of a step: the ended sequences' checkpoints, then each `done` one leaves and its
    /// `finished` event (if any) goes out.
    pub(super) fn retire(&mut self, done: Vec<bool>, mut finished: Vec<(usize, Event)>, to_checkpoint: Vec<usize>) {
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
