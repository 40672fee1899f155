//! Per-sequence state: KV rows for attention layers, conv + recurrent state for DeltaNet
//! layers (qwen35moe.md §8).

use ember_ops::{KvRows, KvType};

use crate::{Config, Error, LayerKind};

#[derive(Debug, Clone)]
pub(crate) enum LayerState {
    Attention {
        k: KvRows,
        v: KvRows,
    },
    /// conv: the last `conv_kernel − 1` pre-conv inputs, oldest first ([hist][channels]);
    /// s: one d_v × d_k matrix per value head, stored transposed (row = value index).
    DeltaNet {
        conv: Vec<f32>,
        s: Vec<f32>,
    },
}

/// Everything a sequence carries between forward calls.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens processed so far (the position of the next token).
    pub n_past: usize,
    /// Most tokens this sequence may hold.
    pub n_ctx: usize,
    pub(crate) layers: Vec<LayerState>,
}

impl SeqState {
    pub fn new(cfg: &Config, n_ctx: usize, kv_type: KvType) -> Result<Self, Error> {
        let width = cfg.n_head_kv * cfg.head_dim;
        if kv_type == KvType::Q8_0 && !cfg.head_dim.is_multiple_of(32) {
            return Err(Error::BadConfig(format!("q8_0 KV cache needs head_dim % 32 == 0, head_dim is {}", cfg.head_dim)));
        }
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|kind| match kind {
                LayerKind::Attention => LayerState::Attention { k: KvRows::new(kv_type, width), v: KvRows::new(kv_type, width) },
                LayerKind::DeltaNet => LayerState::DeltaNet {
                    conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.conv_channels()],
                    s: vec![0.0; cfg.n_v_head * cfg.d_v * cfg.d_k],
                },
            })
            .collect();
        Ok(SeqState { n_past: 0, n_ctx, layers })
    }

    /// Forgets everything (a fresh sequence).
    pub fn reset(&mut self) {
        self.n_past = 0;
        for l in &mut self.layers {
            match l {
                LayerState::Attention { k, v } => {
                    k.truncate(0);
                    v.truncate(0);
                }
                LayerState::DeltaNet { conv, s } => {
                    conv.fill(0.0);
                    s.fill(0.0);
                }
            }
        }
    }

    /// The DeltaNet state of `layer`: the conv history [kernel−1][channels] (oldest first) and
    /// the recurrent state [v_head][d_v][d_k]; `None` for an attention layer.
    pub fn delta_state(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match self.layers.get(layer)? {
            LayerState::DeltaNet { conv, s } => Some((conv, s)),
            LayerState::Attention { .. } => None,
        }
    }

    /// Bytes held: KV rows plus recurrent state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention { k, v } => k.bytes() + v.bytes(),
                LayerState::DeltaNet { conv, s } => 4 * (conv.len() + s.len()),
            })
            .sum()
    }
}

/// A copy of a sequence's state after `n_past` tokens: the KV rows 0..n_past and the DeltaNet
/// conv + recurrent states. DeltaNet state cannot be rewound, so restoring a prefix needs the
/// snapshot taken exactly at its end (qwen35moe.md §8).
#[derive(Debug, Clone)]
pub struct StateSnapshot {
    n_past: usize,
    layers: Vec<LayerState>,
}

impl StateSnapshot {
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Bytes held by the snapshot: its KV pages (shared with the sequence it was taken from and
    /// with other snapshots of the same prefix) plus its own DeltaNet state.
    pub fn bytes(&self) -> usize {
        self.own_bytes() + self.kv_pages().iter().map(|p| p.1).sum::<usize>()
    }

    /// The bytes only this snapshot holds: the DeltaNet conv and recurrent states.
    pub fn own_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::DeltaNet { conv, s } => 4 * (conv.len() + s.len()),
                LayerState::Attention { .. } => 0,
            })
            .sum()
    }

    /// The KV pages it references, `(id, bytes)`: the same page (shared with another snapshot
    /// of the same prefix) has the same id. Known without copying anything.
    pub fn kv_pages(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for l in &self.layers {
            if let LayerState::Attention { k, v } = l {
                for c in [k, v] {
                    let pb = ember_ops::KV_PAGE * c.row_bytes();
                    out.extend(c.pages().iter().map(|p| (std::sync::Arc::as_ptr(p) as usize, pb)));
                }
            }
        }
        out
    }
}

impl SeqState {
    /// The current state: KV pages shared (a later append copies the partial last page first),
    /// DeltaNet state copied.
    pub fn snapshot(&self) -> StateSnapshot {
        StateSnapshot { n_past: self.n_past, layers: self.layers.clone() }
    }

    /// Replaces this state by a snapshot (of a sequence of the same model and KV type).
    pub fn restore(&mut self, snap: &StateSnapshot) -> Result<(), Error> {
        if snap.layers.len() != self.layers.len() {
            return Err(Error::BadBatch(format!("snapshot has {} layers, state {}", snap.layers.len(), self.layers.len())));
        }
        if snap.n_past > self.n_ctx {
            return Err(Error::ContextFull { n_past: 0, n_new: snap.n_past, n_ctx: self.n_ctx });
        }
        for (dst, src) in self.layers.iter_mut().zip(&snap.layers) {
            match (dst, src) {
                (LayerState::Attention { k, v }, LayerState::Attention { k: sk, v: sv }) => {
                    if k.ty != sk.ty || k.width != sk.width {
                        return Err(Error::BadBatch("snapshot KV cache type or width differs".into()));
                    }
                    k.clone_from(sk);
                    v.clone_from(sv);
                }
                (LayerState::DeltaNet { conv, s }, LayerState::DeltaNet { conv: sc, s: ss }) => {
                    conv.copy_from_slice(sc);
                    s.copy_from_slice(ss);
                }
                _ => return Err(Error::BadBatch("snapshot layer kinds differ from the model's".into())),
            }
        }
        self.n_past = snap.n_past;
        Ok(())
    }
}
