//! Quantisation recipes: which ggml type each tensor gets.
//!
//! `q4_k_m` follows llama.cpp's `llama-quantize` rules for `LLAMA_FTYPE_MOSTLY_Q4_K_M` on this
//! architecture (shared/spec/gguf-format.md §6.1; llama.cpp `src/llama-quant.cpp`
//! `llama_tensor_get_type_impl`). `ud-q4_k_m` is ember's guess at unsloth's "UD-Q4_K_M" (whose
//! per-tensor listing is unpublished, gguf-format.md §6.2), built from the evidence there:
//!
//! | tensors | ud-q4_k_m |
//! |---|---|
//! | `ffn_gate_exps`, `ffn_up_exps` | Q4_K |
//! | `ffn_down_exps` | Q6_K on the `more(layer)` layers (as Q4_K_M), else Q4_K |
//! | all other 2-D weights (`attn_*`, `ssm_*`, `*_shexp`, `nextn.eh_proj`) | Q8_0 |
//! | `token_embd` | Q6_K |
//! | `output` | Q8_0 |
//!
//! For the 35B-A3B shape (no MTP) this gives 20.53 GiB of tensor data, 0.4% below the published
//! 20.61 GiB file; the per-layer size (experts at Q4_K + non-expert at Q8_0 ≈ 470 MiB) matches
//! the deployment note in qwen35moe.md §9.3. Treat it as a plausible stand-in, not a copy.

use ember_gguf::GgmlType;

use crate::Error;

/// A quantisation recipe (`--quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipe {
    F16,
    BF16,
    Q8_0,
    Q4KM,
    UdQ4KM,
}

pub const RECIPES: &[&str] = &["f16", "bf16", "q8_0", "q4_k_m", "ud-q4_k_m"];

impl Recipe {
    pub fn parse(s: &str) -> Result<Recipe, Error> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f16" => Recipe::F16,
            "bf16" => Recipe::BF16,
            "q8_0" => Recipe::Q8_0,
            "q4_k_m" => Recipe::Q4KM,
            "ud-q4_k_m" | "ud_q4_k_m" => Recipe::UdQ4KM,
            other => return Err(Error::BadRecipe(format!("unknown quant recipe '{other}' (use one of {})", RECIPES.join(", ")))),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Recipe::F16 => "f16",
            Recipe::BF16 => "bf16",
            Recipe::Q8_0 => "q8_0",
            Recipe::Q4KM => "q4_k_m",
            Recipe::UdQ4KM => "ud-q4_k_m",
        }
    }

    /// `general.file_type` (llama.h `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            Recipe::F16 => 1,
            Recipe::BF16 => 32,
            Recipe::Q8_0 => 7,
            Recipe::Q4KM | Recipe::UdQ4KM => 15,
        }
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, Recipe::F16 | Recipe::BF16)
    }

    /// The type of a tensor of kind `kind` whose rows have `ne0` weights.
    /// `layer`/`n_block`: the block it belongs to and `block_count` (for ffn_down);
    /// `i_attn_v`/`n_attn_v`: its position among the `attn_v` + `attn_qkv` tensors.
    pub fn type_for(self, kind: Kind, ne0: usize, (layer, n_block): (usize, usize), (i_attn_v, n_attn_v): (usize, usize)) -> GgmlType {
        use GgmlType::*;
        if kind.always_f32() {
            return F32;
        }
        let want = match self {
            Recipe::F16 => F16,
            Recipe::BF16 => BF16,
            Recipe::Q8_0 => Q8_0,
            Recipe::Q4KM => match kind {
                Kind::Output => Q6K,
                Kind::AttnV | Kind::AttnQkv if more_bits(i_attn_v, n_attn_v) => Q6K,
                Kind::ExpDown | Kind::ShexpDown if more_bits(layer, n_block) => Q6K,
                _ => Q4K,
            },
            Recipe::UdQ4KM => match kind {
                Kind::ExpGate | Kind::ExpUp => Q4K,
                Kind::TokenEmbd => Q6K,
                Kind::Output => Q8_0,
                Kind::ExpDown if more_bits(layer, n_block) => Q6K,
                Kind::ExpDown => Q4K,
                _ => Q8_0,
            },
        };
        fallback(want, ne0)
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third between.
pub fn more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// llama.cpp's shape fallback when a row does not fill whole blocks (llama-quant.cpp
/// `tensor_type_fallback`): K-quants drop to 32-weight types, then F16.
fn fallback(t: GgmlType, ne0: usize) -> GgmlType {
    use GgmlType::*;
    if ne0.is_multiple_of(t.block_size()) {
        return t;
    }
    let t = match t {
        Q4K => Q5_0,
        Q5K => Q5_1,
        Q6K => Q8_0,
        other => other,
    };
    if ne0.is_multiple_of(t.block_size()) { t } else { F16 }
}

/// What a tensor is, independent of its layer: decides its type and its initialisation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    TokenEmbd,
    Output,
    /// RMSNorm weights (stored with the +1 already applied, or plain for `ssm_norm`).
    Norm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQkv,
    AttnGate,
    SsmBeta,
    SsmAlpha,
    SsmOut,
    SsmConv,
    SsmA,
    SsmDt,
    Router,
    ExpGate,
    ExpUp,
    ExpDown,
    ShexpGateInp,
    ShexpGate,
    ShexpUp,
    ShexpDown,
    EhProj,
}

impl Kind {
    /// Tensors that are F32 in every real file (gguf-format.md §6): 1-D tensors, the router
    /// and the conv taps.
    pub fn always_f32(self) -> bool {
        matches!(self, Kind::Norm | Kind::SsmConv | Kind::SsmA | Kind::SsmDt | Kind::Router | Kind::ShexpGateInp)
    }

    pub fn is_routed_expert(self) -> bool {
        matches!(self, Kind::ExpGate | Kind::ExpUp | Kind::ExpDown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_matches_the_spec_for_40_layers() {
        // gguf-format.md §6.1: i = 0-4, 7, 10, 13, ..., 34, 35-39
        let got: Vec<usize> = (0..40).filter(|&i| more_bits(i, 40)).collect();
        let mut want: Vec<usize> = (0..5).collect();
        want.extend((7..35).step_by(3));
        want.extend(35..40);
        assert_eq!(got, want);
    }

    #[test]
    fn fallbacks() {
        assert_eq!(fallback(GgmlType::Q4K, 2048), GgmlType::Q4K);
        assert_eq!(fallback(GgmlType::Q4K, 128), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6K, 128), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q8_0, 48), GgmlType::F16);
    }
}
