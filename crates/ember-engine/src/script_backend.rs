//! [`ScriptBackend`]: a backend that plays back fixed tokens, for end-to-end tests of clients.

use crate::Error;
use crate::engine::{Backend, Logits, Step};
use crate::prefix_cache::Checkpoint;

/// A [`Backend`] that plays back a fixed token sequence, whatever the prompt: the `k`-th
/// sampled token of every sequence is `script[k]`, then `eog`. Its logits put the scripted
/// token 50 nats above all others, so any sampler settings pick it. For end-to-end tests of
/// clients and output parsing, where a random-weight model cannot be made to emit tool calls.
pub struct ScriptBackend {
    pub n_vocab: usize,
    pub script: Vec<u32>,
    pub eog: u32,
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
            let id = self.script.get(st.n_sampled).copied().unwrap_or(self.eog);
            st.n_sampled += 1;
            // Every row but the last is flat (only `ember logits` asks for them).
            let n_rows = if it.logits == Logits::All { it.tokens.len() } else { 1 };
            let mut rows = vec![0.0f32; n_rows * self.n_vocab];
            if let Some(x) = rows.get_mut((n_rows - 1) * self.n_vocab + id as usize) {
                *x = 50.0;
            }
            out.push(Some(rows));
        }
        Ok(out)
    }
}
