//! Per-sequence state: KV rows for attention layers, conv + recurrent state for DeltaNet
//! layers (qwen35moe.md §8).

use ember_ops::{KvRows, KvType};

use crate::{Config, Error, LayerKind};

#[derive(Debug, Clone)]
pub(crate) enum LayerState {
    Attention { k: KvRows, v: KvRows },
    /// conv: the last `conv_kernel − 1` pre-conv inputs, oldest first ([hist][channels]);
    /// s: one d_v × d_k matrix per value head, stored transposed (row = value index).
    DeltaNet { conv: Vec<f32>, s: Vec<f32> },
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
        if kv_type == KvType::Q8_0 && cfg.head_dim % 32 != 0 {
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

    /// Bytes held: KV rows plus recurrent state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Attention { k, v } => k.bytes.len() + v.bytes.len(),
                LayerState::DeltaNet { conv, s } => 4 * (conv.len() + s.len()),
            })
            .sum()
    }
}
