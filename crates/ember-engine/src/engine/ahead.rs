//! Decode steps run ahead: while every sequence decodes, the engine queues step N + 1 before it
//! reads step N's rows, its tokens not known yet ([`Backend::submit`] with `deferred`); once N's
//! rows are in and sampled it feeds N + 1 its tokens ([`Backend::feed`]), and the device, which
//! has been waiting on the feed, goes straight on. The host's work between two steps (reading
//! the rows, sampling, handing tokens over, queuing the next step's launches) then overlaps the
//! device's instead of following it: on an H100 the device idled ~75 us between two decode
//! steps of the 35B (3 % of a step) waiting for it.
//!
//! What a step queued ahead cannot know is whether a sequence samples its end: a sequence
//! that ends at N (an end-of-generation token, or its client leaves) has a row in N + 1 all
//! the same, fed the token it sampled. That row is not read; its state then holds that token
//! too, so its end-of-generation checkpoint covers it (the next chat turn's prompt starts with
//! it). The ends by count (`max_tokens`, the context) are known before: such a sequence is not
//! in N + 1. Anything else that changes the set of sequences (a new request, a prompt, a
//! restored prompt's first token) waits for the steps queued ahead to be collected (the engine
//! then takes a normal step), as does a sampler whose draw depends on the token before
//! (penalties: their ids must be known when the step is queued), a request for logprobs or
//! for whole rows, and any step the backend cannot queue so (on the GPU: a KV page pool without
//! the pages the step needs).

use std::sync::atomic::Ordering;

use super::tokens::{Took, goes_on_by_count, settle, take_token_id, top_request};
use super::{Backend, Event, FinishReason, Logits, Row, Scheduler, Seq, Step};

/// What `s` asks of a step queued ahead: its row's best entries, when it decodes and its
/// sampler needs nothing that depends on the token before.
fn ahead_top<S>(s: &Seq<S>) -> Option<(usize, Vec<u32>)> {
    if s.n_fed < s.job.req.prompt.len() || s.restored_logits.is_some() || s.sampler.reads_history() {
        return None;
    }
    top_request(s)
}

impl<B: Backend> Scheduler<B> {
    /// One decode step run ahead (module docs): collects the step queued ahead (queuing it
    /// first, with its tokens, when none is), queuing the next before it when nothing changes.
    /// False when it does not apply (nothing queued ahead and the step is not one it takes):
    /// the caller takes a normal step.
    pub(super) fn step_ahead(&mut self) -> bool {
        let cur = match self.ahead.take() {
            Some(ids) => ids,
            None => match self.queue_current() {
                Ok(Some(ids)) => ids,
                Ok(None) => return false,
                Err(e) => return self.fail_all(e),
            },
        };
        let t_fwd = std::time::Instant::now();
        let mut delivering = std::time::Duration::ZERO;
        let n_ctx = self.cfg.n_ctx;
        // The next step: the sequences of this one that go on whatever they sample but an end,
        // while the active ones are all in this one and can be queued ahead.
        let same = self.active.iter().all(|s| cur.contains(&s.id));
        let tops: Option<Vec<(usize, Vec<u32>)>> = self.active.iter().map(ahead_top).collect();
        let next: Vec<usize> = match (same, &tops) {
            (true, Some(_)) if self.backend.runs_ahead() => {
                (0..self.active.len()).filter(|&i| goes_on_by_count(&self.active[i], n_ctx)).collect()
            }
            _ => Vec::new(),
        };
        let mut queued_next = false;
        if let (false, Some(tops)) = (next.is_empty(), &tops) {
            let tops: Vec<(usize, Vec<u32>)> = next.iter().map(|&i| tops[i].clone()).collect();
            // One token slot a sequence; a deferred step does not read it (its tokens come by feed).
            let fed_later = [0u32];
            let mut items: Vec<Step<B::State>> = self
                .active
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| next.contains(i))
                .map(|(_, s)| Step { tokens: &fed_later, state: &mut s.state, logits: Logits::Last })
                .collect();
            match self.backend.submit(&mut items, &tops, true) {
                Ok(q) => queued_next = q,
                Err(e) => return self.fail_all(e),
            }
        }
        // The tokens sampled last time go out while the device works.
        let t0 = std::time::Instant::now();
        let mut gone: Vec<usize> = Vec::new();
        for (i, s) in self.active.iter_mut().enumerate() {
            if let Some(ev) = s.unsent.take()
                && !s.job.sink.send(ev)
            {
                gone.push(i);
            }
        }
        delivering += t0.elapsed();
        let rows = match self.backend.collect() {
            Ok(rows) => rows,
            Err(e) => return self.fail_all(e),
        };
        self.stats.n_steps.fetch_add(1, Ordering::Relaxed);
        // Sample every sequence of the step that is still here and listening.
        let mut done = vec![false; self.active.len()];
        let mut finished: Vec<(usize, Event)> = Vec::new();
        let mut to_checkpoint: Vec<usize> = Vec::new();
        let mut sampled: Vec<Option<(u32, bool)>> = vec![None; self.active.len()];
        for i in gone {
            done[i] = true;
            self.stats.n_cancelled.fetch_add(1, Ordering::Relaxed);
        }
        for (j, row) in rows.into_iter().enumerate() {
            let Some(i) = cur.get(j).and_then(|id| self.active.iter().position(|s| s.id == *id)) else { continue };
            if done[i] {
                continue;
            }
            let (id, took) = take_token_id(&mut self.active[i], &Row::Top(row), n_ctx, &self.stats);
            let eog = matches!(took, Took::Ends(Event::Finished { reason: FinishReason::Eog, .. }));
            sampled[i] = Some((id, eog));
            settle(i, took, &mut done, &mut finished, &mut to_checkpoint);
        }
        if queued_next {
            // Each row's token: the one its sequence sampled (an end of generation too: the
            // state then holds it, and its checkpoint covers it); 0 for one that left.
            let tokens: Vec<u32> = next.iter().map(|&i| sampled[i].map_or(0, |t| t.0)).collect();
            if let Err(e) = self.backend.feed(&tokens) {
                return self.fail_all(e);
            }
            for &i in &next {
                let s = &mut self.active[i];
                match sampled[i] {
                    Some((id, true)) => {
                        s.history.push(id);
                        s.n_done = s.history.len();
                    }
                    Some((_, false)) if !done[i] => s.n_done = s.history.len(),
                    _ => {}
                }
            }
            self.ahead = Some(next.iter().map(|&i| self.active[i].id).collect());
        }
        let forward = t_fwd.elapsed().saturating_sub(delivering);
        self.stats.forward_us.fetch_add(forward.as_micros() as u64, Ordering::Relaxed);
        self.stats.deliver_us.fetch_add(delivering.as_micros() as u64, Ordering::Relaxed);
        self.retire(done, finished, to_checkpoint);
        // A step queued ahead for sequences that all ended is collected now: nothing else
        // would (the engine takes no step without sequences).
        if self.active.is_empty() {
            self.drop_ahead();
        }
        true
    }

    /// Queues the step of every active sequence's last token, when each can be in a step run
    /// ahead; their ids in row order.
    fn queue_current(&mut self) -> Result<Option<Vec<u64>>, crate::Error> {
        if !self.backend.runs_ahead() || self.active.is_empty() {
            return Ok(None);
        }
        let Some(tops) = self.active.iter().map(ahead_top).collect::<Option<Vec<_>>>() else { return Ok(None) };
        // (A decoding sequence's history ends with the token it feeds next.)
        let mut items: Vec<Step<B::State>> = self
            .active
            .iter_mut()
            .map(|s| Step { tokens: &s.history[s.history.len() - 1..], state: &mut s.state, logits: Logits::Last })
            .collect();
        if !self.backend.submit(&mut items, &tops, false)? {
            return Ok(None);
        }
        for s in self.active.iter_mut() {
            s.n_done = s.history.len();
        }
        Ok(Some(self.active.iter().map(|s| s.id).collect()))
    }

    /// Collects the step queued ahead, if any, and drops its rows.
    pub(super) fn drop_ahead(&mut self) {
        if self.ahead.take().is_some() {
            let _ = self.backend.collect();
        }
    }

    /// A step failed on the device: every active sequence fails (each may hold a half-advanced
    /// state), and nothing stays queued. True (the step was taken).
    fn fail_all(&mut self, e: crate::Error) -> bool {
        self.ahead = None;
        self.backend.abandon();
        for mut s in self.active.drain(..) {
            if let Some(ev) = s.unsent.take() {
                s.job.sink.send(ev);
            }
            s.job.sink.send(Event::Failed(e.to_string()));
        }
        self.stats.n_active.store(0, Ordering::Relaxed);
        true
    }
}
