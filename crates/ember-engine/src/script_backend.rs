//! [`ScriptBackend`]: a backend that plays back fixed tokens, for end-to-end tests of clients.

use crate::Error;
use crate::engine::{Backend, Logits, Step};
use crate::prefix_cache::Checkpoint;

/// A [`Backend`] that plays back a fixed token sequence, whatever the prompt: the `k`-th
/// sampled token of every sequence is `script[k]`, then `eog`. Its logits put the scripted
/// token 50 nats above all others, so any sampler settings pick it. For end-to-end tests of
/// clients and output parsing, where a random-weight model cannot be made to emit tool calls.
/// It runs decode steps ahead as a device backend does ([`Backend::runs_ahead`]: a step queued
/// before the one ahead of it is read, its tokens fed after), so that those tests take the
/// engine's path of a GPU; a step's rows do not depend on the tokens fed.
pub struct ScriptBackend {
    n_vocab: usize,
    script: Vec<u32>,
    eog: u32,
    /// Steps queued by [`Backend::submit`] (their rows), oldest first.
    queued: std::collections::VecDeque<Vec<ember_ops::TopRow>>,
    /// The newest queued step waits for its tokens.
    unfed: bool,
}

impl ScriptBackend {
    /// Every sequence samples `script`, then `eog`, from rows of `n_vocab` logits.
    pub fn new(n_vocab: usize, script: Vec<u32>, eog: u32) -> ScriptBackend {
        ScriptBackend { n_vocab, script, eog, queued: Default::default(), unfed: false }
    }

    /// The row of `st`'s next sampled token (`Logits::Last`), counted as sampled.
    fn next_row(&self, st: &mut ScriptState) -> Vec<f32> {
        let id = self.script.get(st.n_sampled).copied().unwrap_or(self.eog);
        st.n_sampled += 1;
        let mut row = vec![0.0f32; self.n_vocab];
        if let Some(x) = row.get_mut(id as usize) {
            *x = 50.0;
        }
        row
    }
}

/// State of a [`ScriptBackend`] sequence.
pub struct ScriptState {
    n_past: usize,
    n_ctx: usize,
    n_sampled: usize,
}

/// Snapshot of a [`ScriptBackend`] sequence: only its length.
pub struct ScriptSnapshot {
    n_past: usize,
}

impl Checkpoint for ScriptSnapshot {
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
    }

    fn shared(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
}

impl Backend for ScriptBackend {
    type State = ScriptState;
    type Snapshot = ScriptSnapshot;

    fn configure(&mut self, _slots: usize, _n_ctx: usize, _cache_bytes: usize) -> Result<(), Error> {
        Ok(())
    }

    fn snapshot(&mut self, state: &ScriptState) -> Result<ScriptSnapshot, Error> {
        Ok(ScriptSnapshot { n_past: state.n_past })
    }

    fn kv_pages(&mut self) -> Option<(usize, usize)> {
        None
    }

    fn pages_for(&self, _from: usize, _to: usize) -> usize {
        0
    }

    fn restore(&mut self, snap: &ScriptSnapshot, n_ctx: usize) -> Result<ScriptState, Error> {
        Ok(ScriptState { n_past: snap.n_past, n_ctx, n_sampled: 0 })
    }

    fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    fn new_state(&mut self, n_ctx: usize) -> Result<ScriptState, Error> {
        Ok(ScriptState { n_past: 0, n_ctx, n_sampled: 0 })
    }

    fn forward(&mut self, items: &mut [Step<'_, ScriptState>]) -> Result<Vec<Option<Vec<f32>>>, Error> {
        let mut out = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let st = &mut *it.state;
            if st.n_past + it.tokens.len() > st.n_ctx {
                return Err(Error::Backend(format!("context full: {} + {} > {}", st.n_past, it.tokens.len(), st.n_ctx)));
            }
            st.n_past += it.tokens.len();
            if it.logits == Logits::None {
                out.push(None);
                continue;
            }
            // Every row but the last is flat (only `ember logits` asks for them).
            let n_rows = if it.logits == Logits::All { it.tokens.len() } else { 1 };
            let mut rows = vec![0.0f32; (n_rows - 1) * self.n_vocab];
            rows.extend(self.next_row(st));
            out.push(Some(rows));
        }
        Ok(out)
    }

    fn runs_ahead(&self) -> bool {
        true
    }

    fn submit(&mut self, items: &mut [Step<'_, ScriptState>], top: &[(usize, Vec<u32>)], deferred: bool) -> Result<bool, Error> {
        if self.unfed {
            return Err(Error::Backend("a step was queued while the one before waits for its tokens".into()));
        }
        let mut rows = Vec::with_capacity(items.len());
        for (it, (k, extra)) in items.iter_mut().zip(top) {
            let st = &mut *it.state;
            if it.tokens.len() != 1 || st.n_past + 1 > st.n_ctx {
                return Err(Error::Backend(format!("a queued step of {} tokens at {} of {}", it.tokens.len(), st.n_past, st.n_ctx)));
            }
            st.n_past += 1;
            rows.push(ember_ops::top::top_of_row(&self.next_row(st), *k, extra));
        }
        self.queued.push_back(rows);
        self.unfed = deferred;
        Ok(true)
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<(), Error> {
        let n = self.queued.back().map_or(0, Vec::len);
        if !std::mem::take(&mut self.unfed) || tokens.len() != n {
            return Err(Error::Backend(format!("{} tokens fed to a step of {n} rows waiting for none", tokens.len())));
        }
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<ember_ops::TopRow>, Error> {
        if self.unfed && self.queued.len() == 1 {
            return Err(Error::Backend("collected a step that waits for its tokens".into()));
        }
        self.queued.pop_front().ok_or_else(|| Error::Backend("no queued step to collect".into()))
    }

    fn abandon(&mut self) {
        self.queued.clear();
        self.unfed = false;
    }
}
