//! Typed hyper-parameters read once from GGUF metadata (qwen35moe.md §2, §3).

use ember_gguf::GgufFile;

use crate::Error;

pub const SUPPORTED_ARCHS: &[&str] = &["qwen35moe"];

/// Which mixer a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with recurrent state).
    DeltaNet,
    /// Gated full attention with a KV cache.
    Attention,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: String,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    /// Main-trunk layers (block_count − nextn_predict_layers).
    pub n_layer: usize,
    /// Trailing MTP blocks in the file (not run by the main pass).
    pub n_layer_mtp: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub rms_eps: f32,
    // full attention
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    // DeltaNet
    pub conv_kernel: usize,
    /// key/query heads (ssm.group_count)
    pub n_k_head: usize,
    /// value heads (ssm.time_step_rank)
    pub n_v_head: usize,
    /// key head dim (ssm.state_size); the value head dim is ssm.inner_size / n_v_head
    pub d_k: usize,
    pub d_v: usize,
    // MoE
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_ff_shexp: usize,
}

impl Config {
    /// What one sequence keeps in a backend's state store with `kv_type` KV rows.
    pub fn state_layout(&self, kv_type: ember_ops::KvType) -> Result<ember_ops::StateLayout, Error> {
        crate::state::layout(self, kv_type)
    }

    pub fn from_gguf(f: &GgufFile) -> Result<Self, Error> {
        let arch = f.get_str("general.architecture").map_err(Error::Gguf)?.to_owned();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(Error::UnsupportedArch { arch, supported: SUPPORTED_ARCHS.join(", ") });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize, Error> { Ok(f.get_u64(&key(k)).map_err(Error::Gguf)? as usize) };
        let opt = |k: &str| -> Result<Option<usize>, Error> {
            match f.get(&key(k)) {
                None => Ok(None),
                // Per-layer arrays are allowed by the format; this family uses one value.
                Some(ember_gguf::Value::Array(..)) => {
                    let v = f.get_int_array(&key(k)).map_err(Error::Gguf)?;
                    let first = *v.first().ok_or_else(|| Error::BadConfig(format!("{} is an empty array", key(k))))?;
                    if v.iter().any(|&x| x != first) {
                        return Err(Error::BadConfig(format!("{} varies per layer ({v:?}); not supported", key(k))));
                    }
                    Ok(Some(first as usize))
                }
                Some(_) => Ok(Some(f.get_u64(&key(k)).map_err(Error::Gguf)? as usize)),
            }
        };

        let n_embd = req("embedding_length")?;
        let block_count = req("block_count")?;
        let n_layer_mtp = opt("nextn_predict_layers")?.unwrap_or(0);
        if n_layer_mtp >= block_count {
            return Err(Error::BadConfig(format!("nextn_predict_layers {n_layer_mtp} >= block_count {block_count}")));
        }
        let n_layer = block_count - n_layer_mtp;
        let n_head = opt("attention.head_count")?.ok_or_else(|| missing(&key("attention.head_count")))?;
        let n_head_kv = opt("attention.head_count_kv")?.unwrap_or(n_head);
        let head_dim = req("attention.key_length")?;
        let value_length = opt("attention.value_length")?.unwrap_or(head_dim);
        if value_length != head_dim {
            return Err(Error::BadConfig(format!("attention.value_length {value_length} != key_length {head_dim}")));
        }
        let rms_eps = f.get_f32(&key("attention.layer_norm_rms_epsilon")).map_err(Error::Gguf)?;
        let n_rot = opt("rope.dimension_count")?.unwrap_or(head_dim);
        let rope_base = match f.get(&key("rope.freq_base")) {
            Some(_) => f.get_f32(&key("rope.freq_base")).map_err(Error::Gguf)?,
            None => 10_000.0,
        };
        if let Some(v) = f.get(&key("rope.dimension_sections")) {
            let n = v.as_array().map_or(0, |a| a.len());
            if !(3..=4).contains(&n) {
                return Err(Error::BadConfig(format!("{} must have 3 or 4 entries, has {n}", key("rope.dimension_sections"))));
            }
        }

        let layer_kinds = match f.get(&key("attention.recurrent_layers")) {
            Some(v) => {
                let a = v
                    .as_array()
                    .ok_or_else(|| Error::BadConfig(format!("{} must be an array of bool", key("attention.recurrent_layers"))))?;
                if a.len() < n_layer {
                    return Err(Error::BadConfig(format!(
                        "{} has {} entries for {n_layer} layers",
                        key("attention.recurrent_layers"),
                        a.len()
                    )));
                }
                a[..n_layer]
                    .iter()
                    .map(|x| match x.as_bool().or(x.as_int().map(|i| i != 0)) {
                        Some(true) => Ok(LayerKind::DeltaNet),
                        Some(false) => Ok(LayerKind::Attention),
                        None => Err(Error::BadConfig(format!("{} must hold booleans", key("attention.recurrent_layers")))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => {
                let interval = opt("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(Error::BadConfig(format!("{} must be > 0", key("full_attention_interval"))));
                }
                (0..n_layer).map(|i| if (i + 1) % interval != 0 { LayerKind::DeltaNet } else { LayerKind::Attention }).collect()
            }
        };

        let n_v_head = req("ssm.time_step_rank")?;
        let inner = req("ssm.inner_size")?;
        let n_expert_used = opt("expert_used_count")?.ok_or_else(|| missing(&key("expert_used_count")))?;
        let n_ff = opt("feed_forward_length")?;
        let n_ff_exp = match opt("expert_feed_forward_length")? {
            Some(v) => v,
            None => n_ff.map(|f| f / n_expert_used.max(1)).ok_or_else(|| missing(&key("expert_feed_forward_length")))?,
        };
        let n_ff_shexp = match opt("expert_shared_feed_forward_length")? {
            Some(v) => v,
            None => n_ff.ok_or_else(|| missing(&key("expert_shared_feed_forward_length")))?,
        };
        let tokens = f.get_array("tokenizer.ggml.tokens").map(|a| a.len()).ok();

        let cfg = Config {
            n_vocab: tokens.unwrap_or(0),
            n_ctx_train: req("context_length")?,
            n_embd,
            n_layer,
            n_layer_mtp,
            layer_kinds,
            rms_eps,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_base,
            conv_kernel: req("ssm.conv_kernel")?,
            n_k_head: req("ssm.group_count")?,
            n_v_head,
            d_k: req("ssm.state_size")?,
            d_v: inner.checked_div(n_v_head).unwrap_or(0),
            n_expert: req("expert_count")?,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            arch,
        };
        cfg.validate(inner)?;
        Ok(cfg)
    }

    fn validate(&self, inner: usize) -> Result<(), Error> {
        let bad = |m: String| Err(Error::BadConfig(m));
        if self.n_embd == 0 || self.n_layer == 0 {
            return bad(format!("embedding_length {} and block_count {} must be > 0", self.n_embd, self.n_layer));
        }
        if self.n_head == 0 || self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!("head_count {} must be a positive multiple of head_count_kv {}", self.n_head, self.n_head_kv));
        }
        if self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return bad(format!("rope.dimension_count {} must be even and <= key_length {}", self.n_rot, self.head_dim));
        }
        if self.n_k_head == 0 || self.n_v_head == 0 || !self.n_v_head.is_multiple_of(self.n_k_head) || !inner.is_multiple_of(self.n_v_head)
        {
            return bad(format!(
                "ssm.time_step_rank {} must be a multiple of ssm.group_count {} and divide ssm.inner_size {inner}",
                self.n_v_head, self.n_k_head
            ));
        }
        if self.conv_kernel < 1 {
            return bad("ssm.conv_kernel must be >= 1".into());
        }
        if self.n_expert == 0 || self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return bad(format!("expert_used_count {} must be in 1..=expert_count {}", self.n_expert_used, self.n_expert));
        }
        if !(self.rms_eps > 0.0 && self.rms_eps.is_finite()) {
            return bad(format!("attention.layer_norm_rms_epsilon must be positive, got {}", self.rms_eps));
        }
        Ok(())
    }

    /// DeltaNet conv channels: q and k (n_k_head·d_k each) and v (n_v_head·d_v).
    pub fn conv_channels(&self) -> usize {
        2 * self.n_k_head * self.d_k + self.n_v_head * self.d_v
    }

    pub fn n_attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count()
    }
}

fn missing(key: &str) -> Error {
    Error::Gguf(ember_gguf::Error::MissingKey { key: key.to_owned() })
}
