//! The hyper-parameters of a `qwen35moe` model to synthesise, and the presets.

use serde::{Deserialize, Serialize};

use crate::Error;

/// Every hyper-parameter of the family that changes a tensor shape or a metadata key
/// (shared/spec/qwen35moe.md §1-§3). JSON field names are these names; a `--config` file may
/// give any subset, the rest defaults to the Qwen3.6-35B-A3B values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Shape {
    pub n_embd: usize,
    /// Main-trunk layers (the MTP block is extra).
    pub n_layer: usize,
    /// Trailing MTP blocks: 0 or 1 (llama.cpp supports one).
    pub n_layer_mtp: usize,
    /// Every `full_attention_interval`-th layer is full attention, the others Gated DeltaNet.
    pub full_attention_interval: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    /// DeltaNet key/query heads (`ssm.group_count`).
    pub n_k_head: usize,
    /// DeltaNet value heads (`ssm.time_step_rank`).
    pub n_v_head: usize,
    /// DeltaNet head dim; llama.cpp uses `ssm.state_size` for keys and values alike.
    pub d_state: usize,
    pub conv_kernel: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
}

impl Default for Shape {
    /// Qwen3.6-35B-A3B without the MTP block (qwen35moe.md §1).
    fn default() -> Self {
        Shape {
            n_embd: 2048,
            n_layer: 40,
            n_layer_mtp: 0,
            full_attention_interval: 4,
            n_head: 16,
            n_head_kv: 2,
            head_dim: 256,
            n_rot: 64,
            rope_base: 1.0e7,
            n_k_head: 16,
            n_v_head: 32,
            d_state: 128,
            conv_kernel: 4,
            n_expert: 256,
            n_expert_used: 8,
            n_ff_exp: 512,
            n_ff_shexp: 512,
            n_ctx_train: 262_144,
            rms_eps: 1e-6,
        }
    }
}

/// Preset names accepted by [`Shape::preset`].
pub const PRESETS: &[&str] = &["tiny", "small", "35b-a3b"];

impl Shape {
    /// * `tiny`: 4 layers (3 DeltaNet + 1 attention), hidden 256, 8 experts top-2: written in
    ///   about a second, for tests. Hidden 256 keeps every row a multiple of the K-quant block.
    /// * `small`: hidden 1024, 16 layers, 64 experts top-8, the 35B-A3B head structure: about
    ///   1.3 GiB at Q4_K_M, for quick benchmarks.
    /// * `35b-a3b`: exactly Qwen3.6-35B-A3B (add the MTP block with `n_layer_mtp = 1`).
    pub fn preset(name: &str) -> Option<Shape> {
        let real = Shape::default();
        Some(match name {
            "35b-a3b" => real,
            "small" => Shape { n_embd: 1024, n_layer: 16, n_expert: 64, n_ctx_train: 262_144, ..real },
            "tiny" => Shape {
                n_embd: 256,
                n_layer: 4,
                n_head: 4,
                n_head_kv: 2,
                head_dim: 64,
                n_rot: 16,
                n_k_head: 2,
                n_v_head: 4,
                d_state: 64,
                n_expert: 8,
                n_expert_used: 2,
                n_ff_exp: 256,
                n_ff_shexp: 256,
                n_ctx_train: 32_768,
                ..real
            },
            _ => return None,
        })
    }

    /// A JSON object with any subset of the fields; missing fields default to 35B-A3B.
    pub fn from_json(s: &str) -> Result<Shape, Error> {
        let shape: Shape = serde_json::from_str(s).map_err(|e| Error::BadShape(format!("config JSON: {e}")))?;
        shape.validate()?;
        Ok(shape)
    }

    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::BadShape(m));
        let positive = [
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("full_attention_interval", self.full_attention_interval),
            ("n_head", self.n_head),
            ("n_head_kv", self.n_head_kv),
            ("head_dim", self.head_dim),
            ("n_k_head", self.n_k_head),
            ("n_v_head", self.n_v_head),
            ("d_state", self.d_state),
            ("conv_kernel", self.conv_kernel),
            ("n_expert", self.n_expert),
            ("n_expert_used", self.n_expert_used),
            ("n_ff_exp", self.n_ff_exp),
            ("n_ff_shexp", self.n_ff_shexp),
            ("n_ctx_train", self.n_ctx_train),
        ];
        for (name, v) in positive {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.n_layer_mtp > 1 {
            return bad(format!("n_layer_mtp must be 0 or 1 (llama.cpp runs one MTP block), got {}", self.n_layer_mtp));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!("n_head {} must be a multiple of n_head_kv {}", self.n_head, self.n_head_kv));
        }
        if !self.n_v_head.is_multiple_of(self.n_k_head) {
            return bad(format!("n_v_head {} must be a multiple of n_k_head {}", self.n_v_head, self.n_k_head));
        }
        if self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return bad(format!("n_rot {} must be even and <= head_dim {}", self.n_rot, self.head_dim));
        }
        if self.n_expert_used > self.n_expert {
            return bad(format!("n_expert_used {} must be <= n_expert {}", self.n_expert_used, self.n_expert));
        }
        // Every row length must fit the 32-weight blocks of Q8_0 (the fallback of every recipe).
        let rows = [
            ("n_embd", self.n_embd),
            ("n_ff_exp", self.n_ff_exp),
            ("n_ff_shexp", self.n_ff_shexp),
            ("n_head·head_dim", self.n_head * self.head_dim),
            ("n_v_head·d_state", self.n_v_head * self.d_state),
        ];
        for (name, v) in rows {
            if !v.is_multiple_of(32) {
                return bad(format!("{name} = {v} must be a multiple of 32"));
            }
        }
        if !(self.rms_eps > 0.0 && self.rope_base > 0.0) {
            return bad("rms_eps and rope_base must be positive".into());
        }
        Ok(())
    }

    /// Total blocks in the file (`block_count`).
    pub fn n_block(&self) -> usize {
        self.n_layer + self.n_layer_mtp
    }

    /// Whether trunk layer `i` is full attention (qwen35moe.md §3; MTP blocks always are).
    pub fn is_attention(&self, i: usize) -> bool {
        i >= self.n_layer || (i + 1).is_multiple_of(self.full_attention_interval)
    }

    /// DeltaNet conv channels: q and k (n_k_head·d) and v (n_v_head·d).
    pub fn conv_channels(&self) -> usize {
        (2 * self.n_k_head + self.n_v_head) * self.d_state
    }

    /// IMRoPE sections for `n_rot` rotated dims: n_rot/2 frequencies split t/h/w as llama.cpp's
    /// converter does for Qwen3.5 ([11, 11, 10, 0] for 64 dims).
    pub fn rope_sections(&self) -> [i32; 4] {
        let n = (self.n_rot / 2) as i32;
        let s0 = (n + 2) / 3;
        let s1 = (n - s0 + 1) / 2;
        [s0, s1, n - s0 - s1, 0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid() {
        for p in PRESETS {
            Shape::preset(p).unwrap().validate().unwrap();
        }
        assert_eq!(Shape::default().rope_sections(), [11, 11, 10, 0]);
        assert_eq!(Shape::preset("tiny").unwrap().rope_sections(), [3, 3, 2, 0]);
    }

    #[test]
    fn json_overrides_defaults() {
        let s = Shape::from_json(r#"{"n_layer": 48, "n_layer_mtp": 1}"#).unwrap();
        assert_eq!((s.n_layer, s.n_layer_mtp, s.n_embd), (48, 1, 2048));
        assert!(Shape::from_json(r#"{"n_layers": 4}"#).is_err());
        assert!(Shape::from_json(r#"{"n_embd": 1000}"#).is_err());
    }
}
