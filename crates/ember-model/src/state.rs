//! Per-sequence state (qwen35moe.md §8) as the model sees it: a slot in the backend's state
//! store ([`ember_ops::SeqStore`]) and the number of tokens it holds. The KV rows of attention
//! layers and the conv + recurrent state of DeltaNet layers live in the backend.

use ember_ops::{KvType, Ops, Slot, Snapshot, StateKind, StateLayout};

use crate::{Config, Error, LayerKind};

/// What a sequence of this model keeps in a backend's store.
pub fn layout(cfg: &Config, kv_type: KvType) -> Result<StateLayout, Error> {
    if kv_type == KvType::Q8_0 && !cfg.head_dim.is_multiple_of(32) {
        return Err(Error::BadConfig(format!("q8_0 KV cache needs head_dim % 32 == 0, head_dim is {}", cfg.head_dim)));
    }
    let layers = cfg
        .layer_kinds
        .iter()
        .map(|k| match k {
            LayerKind::Attention => StateKind::Kv,
            LayerKind::DeltaNet => StateKind::Delta,
        })
        .collect();
    Ok(StateLayout {
        layers,
        kv_type,
        kv_width: cfg.n_head_kv * cfg.head_dim,
        conv: (cfg.conv_kernel - 1) * cfg.conv_channels(),
        rec: cfg.n_v_head * cfg.d_v * cfg.d_k,
    })
}

/// A sequence: its slot in the backend's store, the tokens it holds and the most it may hold.
/// Dropping it frees the slot.
#[derive(Debug)]
pub struct SeqState {
    /// Tokens processed so far (the position of the next token).
    pub n_past: usize,
    /// Most tokens this sequence may hold.
    pub n_ctx: usize,
    slot: Slot,
}

impl SeqState {
    /// A new, empty sequence in a slot of `ops`' store.
    pub fn new(ops: &mut dyn Ops, n_ctx: usize) -> Result<Self, Error> {
        Ok(SeqState { n_past: 0, n_ctx, slot: ops.alloc_slot()? })
    }

    pub fn slot(&self) -> &Slot {
        &self.slot
    }

    /// Forgets everything (a fresh sequence).
    pub fn reset(&mut self, ops: &mut dyn Ops) -> Result<(), Error> {
        ops.clear_slot(&self.slot)?;
        self.n_past = 0;
        Ok(())
    }

    /// The DeltaNet state of `layer`: the conv history [kernel−1][channels] (oldest first) and
    /// the recurrent state [v_head][d_v][d_k].
    pub fn delta_state(&self, ops: &mut dyn Ops, layer: usize) -> Result<(Vec<f32>, Vec<f32>), Error> {
        Ok(ops.read_delta(&self.slot, ember_ops::LayerIdx(layer as u16))?)
    }

    /// The current state: KV pages shared (a later append copies the partial last page first),
    /// DeltaNet state copied. DeltaNet state cannot be rewound, so restoring a prefix needs the
    /// snapshot taken exactly at its end.
    pub fn snapshot(&self, ops: &mut dyn Ops) -> Result<Snapshot, Error> {
        Ok(ops.snapshot(&self.slot)?)
    }

    /// Replaces this state by a snapshot of the same store.
    pub fn restore(&mut self, ops: &mut dyn Ops, snap: &Snapshot) -> Result<(), Error> {
        if snap.len() > self.n_ctx {
            return Err(Error::ContextFull { n_past: 0, n_new: snap.len(), n_ctx: self.n_ctx });
        }
        ops.restore(&self.slot, snap)?;
        self.n_past = snap.len();
        Ok(())
    }
}
