//! [`ModelBackend`]: the engine's [`Backend`] over the qwen35moe model and an op set, and the
//! sizing of its state store ([`pool_pages`]).

use crate::Error;
use crate::engine::{Backend, Logits, Row, Step};
use crate::prefix_cache::Checkpoint;

impl Checkpoint for ember_model::Snapshot {
    fn bytes(&self) -> usize {
        self.own_bytes()
    }

    fn shared(&self) -> Vec<(usize, usize)> {
        self.kv_pages().to_vec()
    }
}

/// [`Backend`] over the qwen35moe model and an op set.
pub struct ModelBackend<O> {
    model: ember_model::Model,
    ops: O,
    layout: ember_ops::StateLayout,
    /// Whether the engine asks for rows' best entries ([`Backend::prefers_top`]).
    top_reads: bool,
    /// Steps [`Backend::submit`] queued, oldest first, and whether the newest waits for its
    /// tokens (its row count).
    queued: std::collections::VecDeque<ember_model::QueuedTop>,
    unfed: Option<usize>,
}

impl<O: ember_ops::Ops> ModelBackend<O> {
    /// Registers the model's weights with `ops`. Size its state with [`Backend::configure`]
    /// before the first sequence.
    pub fn new(model: ember_model::Model, mut ops: O, kv_type: ember_ops::KvType) -> Result<Self, Error> {
        let layout = model.state_layout(kv_type).map_err(|e| Error::Backend(e.to_string()))?;
        ops.register(model.weights().clone()).map_err(|e| Error::Backend(e.to_string()))?;
        // On for device backends, whose logits stay there unless asked for (the CPU's are in
        // memory already): on an H100 (2026-12-06, 35B-A3B Q4_K_M, tg128 of two rounds) 392.0 /
        // 392.7 t/s against 387.0 / 387.2 with whole rows. `EMBER_TOP_READS=0` / `1` decide by
        // hand (A/B runs, tests).
        let top_reads = match std::env::var("EMBER_TOP_READS").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => matches!(ops.device(), ember_ops::DeviceId::Gpu(_)),
        };
        Ok(ModelBackend { model, ops, layout, top_reads, queued: Default::default(), unfed: None })
    }

    /// Whether the engine asks this backend for rows' best entries instead of whole rows
    /// (default: on for a device backend; `EMBER_TOP_READS=0` / `1`).
    pub fn set_top_reads(&mut self, on: bool) {
        self.top_reads = on;
    }

    pub fn model(&self) -> &ember_model::Model {
        &self.model
    }

    pub fn ops(&self) -> &O {
        &self.ops
    }

    pub fn ops_mut(&mut self) -> &mut O {
        &mut self.ops
    }

    /// One sequence's forward pass through [`Backend::forward`] (the path the engine takes):
    /// the logit rows asked for, `[rows · n_vocab]`.
    pub fn run(&mut self, state: &mut ember_model::SeqState, tokens: &[u32], logits: Logits) -> Result<Vec<f32>, Error>
    where
        O: 'static,
    {
        let mut items = [Step { tokens, state, logits }];
        Ok(self.forward(&mut items)?.pop().flatten().unwrap_or_default())
    }
}

/// The KV page pool for `slots` sequences of up to `n_ctx` tokens and a prompt cache of
/// `cache_bytes`: every sequence full plus one copy-on-write page per K/V cache, plus the cache's
/// pages (they count against its byte budget). A backend that budgets its memory (a GPU) may hold
/// fewer (`fit`): the pool shrinks to that, and admission by free pages keeps requests within it
/// (one that could never fit fails with a clear error). Fewer pages than one token needs is an
/// error here.
pub fn pool_pages(l: &ember_ops::StateLayout, slots: usize, n_ctx: usize, cache_bytes: usize, fit: Option<usize>) -> Result<usize, String> {
    let extra = cache_bytes / l.page_bytes().max(1);
    let want = slots.saturating_mul(l.pages_at(n_ctx) + 2 * l.n_kv_layers()).saturating_add(extra);
    let pages = fit.map_or(want, |f| f.min(want));
    let one_token = l.pages_at(1);
    if pages < one_token {
        return Err(format!(
            "memory for {pages} KV pages ({} bytes each) is fewer than one token needs ({one_token}); lower --parallel or -c, or use another device",
            l.page_bytes()
        ));
    }
    Ok(pages)
}

/// The model's view of a step's items.
fn seq_batches<'a, 's>(items: &'a mut [Step<'s, ember_model::SeqState>]) -> Vec<ember_model::SeqBatch<'a>>
where
    's: 'a,
{
    items.iter_mut().map(|it| ember_model::SeqBatch { tokens: it.tokens, state: &mut *it.state, logits: it.logits }).collect()
}

/// A forward pass's error: one sequence's own (the engine fails that request alone) or the
/// backend's.
fn model_err(e: ember_model::Error) -> Error {
    match e {
        ember_model::Error::InSequence { index, source } => Error::Sequence { index, msg: source.to_string() },
        e => Error::Backend(e.to_string()),
    }
}

fn backend_err(e: impl std::fmt::Display) -> Error {
    Error::Backend(e.to_string())
}

impl<O: ember_ops::Ops + 'static> Backend for ModelBackend<O> {
    type State = ember_model::SeqState;
    type Snapshot = ember_model::Snapshot;

    fn configure(&mut self, slots: usize, n_ctx: usize, cache_bytes: usize) -> Result<(), Error> {
        let fit = self.ops.kv_pages_that_fit(&self.layout, slots).map_err(backend_err)?;
        let pages = pool_pages(&self.layout, slots, n_ctx, cache_bytes, fit)
            .map_err(|e| Error::Backend(format!("device {}: {e}", self.ops.device())))?;
        self.ops.configure(self.layout.clone(), slots, pages).map_err(backend_err)
    }

    fn snapshot(&mut self, state: &Self::State) -> Result<Self::Snapshot, Error> {
        state.snapshot(&mut self.ops).map_err(backend_err)
    }

    fn restore(&mut self, snap: &Self::Snapshot, n_ctx: usize) -> Result<Self::State, Error> {
        let mut st = self.new_state(n_ctx)?;
        st.restore(&mut self.ops, snap).map_err(backend_err)?;
        Ok(st)
    }

    fn n_vocab(&self) -> usize {
        self.model.config.n_vocab
    }

    fn new_state(&mut self, n_ctx: usize) -> Result<Self::State, Error> {
        self.model.new_state(&mut self.ops, n_ctx).map_err(backend_err)
    }

    fn forward(&mut self, items: &mut [Step<'_, Self::State>]) -> Result<Vec<Option<Vec<f32>>>, Error> {
        use ember_model::DeltaMode;
        let mut seqs = seq_batches(items);
        let out = self.model.forward_batch(&mut self.ops, &mut seqs, DeltaMode::Auto, None).map_err(model_err)?;
        Ok(out.into_iter().zip(items.iter()).map(|(m, it)| (it.logits != Logits::None).then_some(m.data)).collect())
    }

    fn forward_top(
        &mut self,
        items: &mut [Step<'_, Self::State>],
        top: &[Option<(usize, Vec<u32>)>],
        before_wait: &mut dyn FnMut(),
    ) -> Result<Vec<Option<Row>>, Error> {
        use ember_model::{DeltaMode, StepRows};
        let mut seqs = seq_batches(items);
        let mut asks = top.to_vec();
        asks.resize(seqs.len(), None);
        let out = self.model.forward_batch_top(&mut self.ops, &mut seqs, DeltaMode::Auto, &asks, before_wait).map_err(model_err)?;
        Ok(out
            .into_iter()
            .zip(items.iter())
            .map(|(r, it)| {
                (it.logits != Logits::None).then_some(match r {
                    StepRows::Full(m) => Row::Full(m.data),
                    StepRows::Top(t) => Row::Top(t),
                })
            })
            .collect())
    }

    fn prefers_top(&self) -> bool {
        self.top_reads
    }

    fn runs_ahead(&self) -> bool {
        self.top_reads && self.ops.defers_tokens()
    }

    fn submit(&mut self, items: &mut [Step<'_, Self::State>], top: &[(usize, Vec<u32>)], deferred: bool) -> Result<bool, Error> {
        if self.unfed.is_some() {
            return Err(Error::Backend("a step was queued while the one before waits for its tokens".into()));
        }
        let mut seqs = seq_batches(items);
        match self.model.submit_top(&mut self.ops, &mut seqs, top, deferred) {
            Ok(Some(q)) => {
                self.queued.push_back(q);
                if deferred {
                    self.unfed = Some(items.len());
                }
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => {
                // The sequences' states may be half advanced: the steps queued before are
                // dropped too (the engine fails them all).
                self.abandon();
                Err(model_err(e))
            }
        }
    }

    fn feed(&mut self, tokens: &[u32]) -> Result<(), Error> {
        if self.unfed.take().is_none() {
            return Err(Error::Backend("no queued step waits for tokens".into()));
        }
        self.model.feed(&mut self.ops, tokens).map_err(model_err)
    }

    fn collect(&mut self) -> Result<Vec<ember_ops::TopRow>, Error> {
        let Some(q) = self.queued.pop_front() else { return Err(Error::Backend("no queued step to collect".into())) };
        let rows = self.model.collect_top(&mut self.ops, q);
        if rows.is_err() {
            self.abandon();
        }
        rows.map_err(model_err)
    }

    fn abandon(&mut self) {
        if let Some(n) = self.unfed.take() {
            let _ = self.model.feed(&mut self.ops, &vec![0; n]);
        }
        for q in std::mem::take(&mut self.queued) {
            let _ = self.model.collect_top(&mut self.ops, q);
        }
    }

    fn kv_pages(&mut self) -> Option<(usize, usize)> {
        let st = self.ops.store_stats();
        Some((st.pages_free, st.pages))
    }

    fn expert_stats(&self) -> Option<ember_ops::ExpertStats> {
        self.ops.expert_stats()
    }

    fn expert_layer_stats(&self) -> Vec<(String, u16, u64, u64)> {
        self.ops.expert_layer_stats().into_iter().map(|(l, h, m)| (self.ops.layer_device(l).to_string(), l.0, h, m)).collect()
    }

    fn pages_for(&self, from: usize, to: usize) -> usize {
        self.layout.pages_at(to).saturating_sub(self.layout.pages_at(from))
    }
}

#[cfg(test)]
mod tests {
    use ember_ops::{KvType, StateKind, StateLayout};

    use super::pool_pages;

    /// Pages: sized for every sequence full when memory allows, clamped to what fits otherwise,
    /// an error when not even one token fits.
    #[test]
    fn pool_pages_shrink_to_what_fits() {
        let l = StateLayout {
            layers: vec![StateKind::Kv, StateKind::Delta, StateKind::Kv],
            kv_type: KvType::F16,
            kv_width: 512,
            conv: 8,
            rec: 16,
        };
        // 2 KV layers x (K, V) = 4 caches; 4096 tokens = 64 pages each; + 1 copy page each.
        let full = 2 * (4 * 64 + 4);
        let page = l.page_bytes();
        assert_eq!(pool_pages(&l, 2, 4096, 0, None), Ok(full));
        assert_eq!(pool_pages(&l, 2, 4096, 10 * page, None), Ok(full + 10), "the cache's budget in pages");
        assert_eq!(pool_pages(&l, 2, 4096, 0, Some(1 << 20)), Ok(full), "more memory than needed: no more pages");
        assert_eq!(pool_pages(&l, 2, 4096, 0, Some(100)), Ok(100), "less memory: the pool shrinks");
        let e = pool_pages(&l, 2, 4096, 0, Some(3)).unwrap_err();
        assert!(e.contains("fewer than one token needs (4)"), "{e}");
    }
}
