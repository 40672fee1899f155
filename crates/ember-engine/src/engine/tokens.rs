//! What a step does with a sequence's row: the entries it asks for, the token it takes, what
//! becomes of the sequence; and the prompt cache's checkpoints of a sequence's state.

use std::borrow::Cow;
use std::sync::atomic::Ordering;

use super::{Backend, Cached, EngineStats, Event, FinishReason, Row, Scheduler, Seq};
use crate::sampler::{logprobs_of, masked};

impl<B: Backend> Scheduler<B> {
    /// Stores the state of active sequence `i` (covering `history[..n_done]`) in the prompt
    /// cache, with `logits` of its last token when given, unless that exact prefix is there.
    pub(super) fn checkpoint(&mut self, i: usize, logits: Option<Vec<f32>>) {
        let Some(cache) = self.cache.as_mut() else { return };
        let s = &self.active[i];
        let key = &s.history[..s.n_done];
        if key.is_empty() || cache.contains(key) {
            return;
        }
        let snap = match self.backend.snapshot(&s.state) {
            Ok(snap) => snap,
            // A checkpoint is an optimisation: without one the prompt is recomputed later.
            Err(_) => return,
        };
        let evicted = cache.insert(key, Cached { snap, logits });
        self.stats.cache_checkpoints.fetch_add(1, Ordering::Relaxed);
        self.stats.cache_evictions.fetch_add(evicted as u64, Ordering::Relaxed);
        self.update_cache_stats();
    }

    pub(super) fn update_cache_stats(&self) {
        if let Some(c) = &self.cache {
            let st = c.stats();
            self.stats.cache_hits.store(st.hits, Ordering::Relaxed);
            self.stats.cache_misses.store(st.misses, Ordering::Relaxed);
            self.stats.cache_entries.store(st.entries, Ordering::Relaxed);
            self.stats.cache_bytes.store(st.bytes, Ordering::Relaxed);
        }
    }
}

/// What became of a sequence that took a token.
pub(super) enum Took {
    /// It goes on.
    Goes,
    /// It ended (end of generation, max tokens, full context): this event goes out.
    Ends(Event),
    /// Its client left.
    Gone,
}

/// What `s` asks of its next row when the backend prefers rows' best entries
/// ([`Backend::prefers_top`]): the entries its sampler needs and the ids whose logits change
/// (the penalties' tokens, the masked end-of-generation ids), or None for the whole row
/// (logprobs, top-k off at a temperature above 0, or more entries than [`TOP_MAX`]).
pub(super) fn top_request<S>(s: &Seq<S>) -> Option<(usize, Vec<u32>)> {
    if s.job.req.n_logprobs.is_some() {
        return None;
    }
    let need = s.sampler.top_needed()?;
    let mut extra = s.sampler.touched_ids(&s.history);
    if s.job.req.ignore_eos {
        extra.extend_from_slice(&s.job.req.eog);
        extra.sort_unstable();
        extra.dedup();
    }
    let k = need.checked_add(extra.len()).filter(|&k| k <= TOP_MAX)?;
    Some((k, extra))
}

/// The most best entries of a row the engine asks for; a sampler that needs more (top-k above
/// ~1,000, or a long penalty window) takes the whole row.
pub const TOP_MAX: usize = 1024;

/// Samples the next token of `s` from `row` (its last token's logits), sends it, and appends it
/// to the history when the sequence goes on.
pub(super) fn take_token<S>(s: &mut Seq<S>, row: &Row, n_ctx: usize, stats: &EngineStats) -> Took {
    take_token_id(s, row, n_ctx, stats).1
}

/// Whether `s` goes on after its next token whatever that is, unless it is an end of
/// generation: neither `max_tokens` nor the context ends it there ([`take_token`]'s test).
pub(super) fn goes_on_by_count<S>(s: &Seq<S>, n_ctx: usize) -> bool {
    s.n_generated + 1 < s.job.req.max_tokens && s.history.len() + 1 < n_ctx
}

/// [`take_token`], and the token sampled.
pub(super) fn take_token_id<S>(s: &mut Seq<S>, row: &Row, n_ctx: usize, stats: &EngineStats) -> (u32, Took) {
    let n_prompt = s.job.req.prompt.len();
    let (id, full) = match row {
        Row::Full(row) => {
            let row = if s.job.req.ignore_eos { masked(row, &s.job.req.eog) } else { Cow::Borrowed(&row[..]) };
            (s.sampler.sample(&row, &s.history), Some(row))
        }
        Row::Top(t) => {
            let eog = if s.job.req.ignore_eos { &s.job.req.eog[..] } else { &[] };
            let vals: Vec<f32> = t.ids.iter().zip(&t.vals).map(|(i, &v)| if eog.contains(i) { f32::NEG_INFINITY } else { v }).collect();
            (s.sampler.sample_sparse(&t.ids, &vals, &s.history), None)
        }
    };
    s.n_generated += 1;
    stats.tokens_generated.fetch_add(1, Ordering::Relaxed);
    (id, took(s, id, full, n_prompt, n_ctx, stats))
}

fn took<S>(s: &mut Seq<S>, id: u32, full: Option<Cow<'_, [f32]>>, n_prompt: usize, n_ctx: usize, stats: &EngineStats) -> Took {
    if s.job.req.eog.contains(&id) {
        return Took::Ends(Event::Finished { reason: FinishReason::Eog, n_prompt, n_generated: s.n_generated });
    }
    // (A request with logprobs always gets its whole row: top_request.)
    let logprobs = s.job.req.n_logprobs.zip(full.as_deref()).map(|(k, row)| logprobs_of(row, id, k));
    let token = Event::Token { id, logprobs };
    let reason = if s.n_generated >= s.job.req.max_tokens {
        Some(FinishReason::MaxTokens)
    } else if s.history.len() + 1 >= n_ctx {
        // The sampled token cannot be fed: the context is full.
        Some(FinishReason::ContextFull)
    } else {
        None
    };
    match reason {
        // The last token goes out now, its finish after the step's end-of-generation work.
        Some(reason) => {
            if !s.job.sink.send(token) {
                stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
                return Took::Gone;
            }
            s.history.push(id);
            Took::Ends(Event::Finished { reason, n_prompt, n_generated: s.n_generated })
        }
        // One that goes on is fed by the next step and goes out while that step runs.
        None => {
            s.history.push(id);
            s.unsent = Some(token);
            Took::Goes
        }
    }
}

/// Records what became of sequence `i`: an ended one is done, its event goes out and its
/// generation is checkpointed; a gone one is done.
pub(super) fn settle(i: usize, took: Took, done: &mut [bool], finished: &mut Vec<(usize, Event)>, to_checkpoint: &mut Vec<usize>) {
    match took {
        Took::Goes => {}
        Took::Ends(ev) => {
            finished.push((i, ev));
            done[i] = true;
            to_checkpoint.push(i);
        }
        Took::Gone => done[i] = true,
    }
}
