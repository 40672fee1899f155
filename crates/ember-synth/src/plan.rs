//! The file to write: every tensor (name, shape, type, how to initialise it) and the metadata.

use ember_gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};

use crate::recipe::{Kind, Recipe};
use crate::rng::{Rng, mix};
use crate::{Error, Shape};

/// Weight statistics of the generator. Sub-layer inputs are RMS-normed to 1 per element, so
/// projections are N(0, 1/fan_in) ("unit-preserving"); the projections that write into the
/// residual stream are scaled down so that each sub-layer adds an RMS of about 0.3, which keeps
/// the residual stream O(1) to O(5) across 40 layers, as in trained models.
pub mod scale {
    /// Each embedding row is N(0, 1) plus `EMBD_SHARED`·s, s = a fixed ±1 pattern (the shared
    /// direction û = s/√D). Trained models' hidden states share such directions too; here it
    /// gives the router something to skew on.
    pub const EMBD_SHARED: f32 = 1.0;
    /// Output projections: `attn_output`, `ssm_out`, `ffn_down_exps`, `ffn_down_shexp` (× 1/√K).
    pub const ATTN_OUT: f32 = 0.6;
    pub const SSM_OUT: f32 = 0.5;
    pub const EXP_DOWN: f32 = 1.0;
    pub const SHEXP_DOWN: f32 = 0.6;
    /// `ssm_alpha` (× 1/√D): with dt_bias ∈ softplus⁻¹[1e-3, 0.1] and A ∈ [1, 16] the decays
    /// exp(g) spread from ~0.2 to ~0.999, as HF's initialisation intends.
    pub const SSM_ALPHA: f32 = 0.5;
    /// LM head (× 1/√D): logits with a standard deviation of 2.5.
    pub const OUTPUT: f32 = 2.5;
    /// Router logit noise, per token and expert: std 1.28 ≈ that of a Gumbel(1) variable, so
    /// top-1 routing with popularity logits β_e = −Z·ln(rank_e) picks experts with Zipf(Z)
    /// frequencies; top-k is close to it (measured in the tests).
    pub const ROUTER_NOISE: f32 = 1.28;
    /// Mean-square that each sub-layer adds to the residual stream (measured on the presets),
    /// used to predict how much of the normed router input lies along û at each depth.
    pub const SUBLAYER_VAR: f32 = 0.12;
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: Shape,
    pub recipe: Recipe,
    pub seed: u64,
    /// Zipf exponent of router popularity; 0 = uniform.
    pub skew: f32,
    /// Recorded as `ember.synthetic.preset` (a preset name or "custom").
    pub preset: String,
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Const(f32),
    /// N(0, std²).
    Normal(f32),
    /// N(0, 1) + EMBD_SHARED·s per row.
    Embedding,
    /// Router of trunk block `layer`: noise orthogonal to û plus a popularity component along û.
    Router {
        layer: usize,
    },
    /// −exp(A_log), A_log = ln U(1, 16).
    SsmA,
    /// softplus⁻¹(dt), dt = exp U(ln 1e-3, ln 0.1).
    SsmDt,
}

#[derive(Debug, Clone)]
pub struct Planned {
    pub spec: TensorSpec,
    pub kind: Kind,
    /// Block index, None for globals.
    pub layer: Option<usize>,
    pub init: Init,
}

impl Planned {
    pub fn row_len(&self) -> usize {
        self.spec.ne[0] as usize
    }
    pub fn n_rows(&self) -> usize {
        self.spec.ne[1..].iter().product::<u64>() as usize
    }
}

/// A fully described file, ready to stream.
#[derive(Debug, Clone)]
pub struct Plan {
    pub opts: SynthOptions,
    pub n_vocab: usize,
    pub tensors: Vec<Planned>,
    pub writer: GgufWriter,
    /// The ±1 pattern of the shared direction, length n_embd.
    pub shared_sign: Vec<f32>,
}

impl Plan {
    /// Builds the plan; `vocab` supplies every `tokenizer.*` key (and so `n_vocab`).
    pub fn new(opts: SynthOptions, vocab: &GgufFile) -> Result<Plan, Error> {
        opts.shape.validate()?;
        if !(opts.skew >= 0.0 && opts.skew.is_finite()) {
            return Err(Error::BadShape(format!("skew must be a finite number >= 0, got {}", opts.skew)));
        }
        let n_vocab = vocab.get_array("tokenizer.ggml.tokens").map_err(Error::Gguf)?.len();
        if n_vocab == 0 {
            return Err(Error::BadShape("the vocabulary has no tokens".into()));
        }
        let s = &opts.shape;
        let tensors = tensor_list(s, opts.recipe, n_vocab);
        let mut w = GgufWriter::new();
        metadata(&mut w, &opts, vocab);
        for t in &tensors {
            w.add_tensor(t.spec.clone());
        }
        let mut rng = Rng::new(mix(&[opts.seed, 0x5348_4152_4544])); // "SHARED"
        let shared_sign = (0..s.n_embd).map(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }).collect();
        Ok(Plan { opts, n_vocab, tensors, writer: w, shared_sign })
    }

    /// Bytes of tensor data (what the progress bar counts).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.spec.n_bytes().unwrap_or(0)).sum()
    }

    /// Predicted fraction of the normed MoE input of trunk block `layer` that lies along û.
    pub fn shared_fraction(&self, layer: usize) -> f32 {
        let m = scale::EMBD_SHARED;
        let l = layer.min(self.opts.shape.n_layer.saturating_sub(1)) as f32;
        m / (1.0 + m * m + (2.0 * l + 1.0) * scale::SUBLAYER_VAR).sqrt()
    }
}

fn tensor_list(s: &Shape, recipe: Recipe, n_vocab: usize) -> Vec<Planned> {
    let d = s.n_embd;
    let n_block = s.n_block();
    let n_attn_v = n_block; // one attn_v or attn_qkv per block
    let mut i_attn_v = 0;
    let mut out = Vec::new();
    let mut add = |name: String, kind: Kind, ne: &[usize], layer: Option<usize>, init: Init, i_attn_v: usize| {
        let ty = recipe.type_for(kind, ne[0], (layer.unwrap_or(0), n_block), (i_attn_v, n_attn_v));
        let ne: Vec<u64> = ne.iter().map(|&x| x as u64).collect();
        out.push(Planned { spec: TensorSpec::new(name, ty, &ne), kind, layer, init });
    };
    let unit = |k: usize| Init::Normal(1.0 / (k as f32).sqrt());
    let scaled = |a: f32, k: usize| Init::Normal(a / (k as f32).sqrt());

    add("token_embd.weight".into(), Kind::TokenEmbd, &[d, n_vocab], None, Init::Embedding, 0);
    for i in 0..n_block {
        let n = |x: &str| format!("blk.{i}.{x}");
        let l = Some(i);
        add(n("attn_norm.weight"), Kind::Norm, &[d], l, Init::Const(1.0), 0);
        if s.is_attention(i) {
            let (h, hk, hd) = (s.n_head, s.n_head_kv, s.head_dim);
            add(n("attn_q.weight"), Kind::AttnQ, &[d, 2 * h * hd], l, unit(d), 0);
            add(n("attn_k.weight"), Kind::AttnK, &[d, hk * hd], l, unit(d), 0);
            add(n("attn_v.weight"), Kind::AttnV, &[d, hk * hd], l, unit(d), i_attn_v);
            i_attn_v += 1;
            add(n("attn_output.weight"), Kind::AttnOutput, &[h * hd, d], l, scaled(scale::ATTN_OUT, h * hd), 0);
            add(n("attn_q_norm.weight"), Kind::Norm, &[hd], l, Init::Const(1.0), 0);
            add(n("attn_k_norm.weight"), Kind::Norm, &[hd], l, Init::Const(1.0), 0);
        } else {
            let vd = s.n_v_head * s.d_state;
            add(n("attn_qkv.weight"), Kind::AttnQkv, &[d, s.conv_channels()], l, unit(d), i_attn_v);
            i_attn_v += 1;
            add(n("attn_gate.weight"), Kind::AttnGate, &[d, vd], l, unit(d), 0);
            add(n("ssm_beta.weight"), Kind::SsmBeta, &[d, s.n_v_head], l, unit(d), 0);
            add(n("ssm_alpha.weight"), Kind::SsmAlpha, &[d, s.n_v_head], l, scaled(scale::SSM_ALPHA, d), 0);
            add(n("ssm_conv1d.weight"), Kind::SsmConv, &[s.conv_kernel, s.conv_channels()], l, unit(s.conv_kernel), 0);
            add(n("ssm_dt.bias"), Kind::SsmDt, &[s.n_v_head], l, Init::SsmDt, 0);
            add(n("ssm_a"), Kind::SsmA, &[s.n_v_head], l, Init::SsmA, 0);
            add(n("ssm_norm.weight"), Kind::Norm, &[s.d_state], l, Init::Const(1.0), 0);
            add(n("ssm_out.weight"), Kind::SsmOut, &[vd, d], l, scaled(scale::SSM_OUT, vd), 0);
        }
        add(n("post_attention_norm.weight"), Kind::Norm, &[d], l, Init::Const(1.0), 0);
        let (e, f, fs) = (s.n_expert, s.n_ff_exp, s.n_ff_shexp);
        add(n("ffn_gate_inp.weight"), Kind::Router, &[d, e], l, Init::Router { layer: i }, 0);
        add(n("ffn_gate_exps.weight"), Kind::ExpGate, &[d, f, e], l, unit(d), 0);
        add(n("ffn_up_exps.weight"), Kind::ExpUp, &[d, f, e], l, unit(d), 0);
        add(n("ffn_down_exps.weight"), Kind::ExpDown, &[f, d, e], l, scaled(scale::EXP_DOWN, f), 0);
        add(n("ffn_gate_inp_shexp.weight"), Kind::ShexpGateInp, &[d], l, unit(d), 0);
        add(n("ffn_gate_shexp.weight"), Kind::ShexpGate, &[d, fs], l, unit(d), 0);
        add(n("ffn_up_shexp.weight"), Kind::ShexpUp, &[d, fs], l, unit(d), 0);
        add(n("ffn_down_shexp.weight"), Kind::ShexpDown, &[fs, d], l, scaled(scale::SHEXP_DOWN, fs), 0);
        if i >= s.n_layer {
            // MTP block (qwen35moe.md §4.7): shares token_embd and output with the trunk.
            add(n("nextn.eh_proj.weight"), Kind::EhProj, &[2 * d, d], l, unit(2 * d), 0);
            add(n("nextn.enorm.weight"), Kind::Norm, &[d], l, Init::Const(1.0), 0);
            add(n("nextn.hnorm.weight"), Kind::Norm, &[d], l, Init::Const(1.0), 0);
            add(n("nextn.shared_head_norm.weight"), Kind::Norm, &[d], l, Init::Const(1.0), 0);
        }
    }
    add("output_norm.weight".into(), Kind::Norm, &[d], None, Init::Const(1.0), 0);
    add("output.weight".into(), Kind::Output, &[d, n_vocab], None, scaled(scale::OUTPUT, d), 0);
    out
}

fn metadata(w: &mut GgufWriter, o: &SynthOptions, vocab: &GgufFile) {
    let s = &o.shape;
    let u = |x: usize| Value::U32(x as u32);
    w.set("general.architecture", Value::String("qwen35moe".into()));
    w.set("general.type", Value::String("model".into()));
    w.set("general.name", Value::String(format!("ember-synth {} {}", o.preset, o.recipe.name())));
    w.set("general.description", Value::String("Synthetic Qwen3.6-MoE-shaped model with random weights, written by `ember synth`: for speed measurements only, its output is meaningless.".into()));
    w.set("general.file_type", Value::U32(o.recipe.file_type()));
    if o.recipe.is_quantized() {
        w.set("general.quantization_version", Value::U32(2));
    }
    let a = |k: &str| format!("qwen35moe.{k}");
    w.set(a("context_length"), u(s.n_ctx_train));
    w.set(a("embedding_length"), u(s.n_embd));
    w.set(a("block_count"), u(s.n_block()));
    if s.n_layer_mtp > 0 {
        w.set(a("nextn_predict_layers"), u(s.n_layer_mtp));
    }
    w.set(a("attention.head_count"), u(s.n_head));
    w.set(a("attention.head_count_kv"), u(s.n_head_kv));
    w.set(a("attention.key_length"), u(s.head_dim));
    w.set(a("attention.value_length"), u(s.head_dim));
    w.set(a("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps));
    w.set(a("rope.dimension_count"), u(s.n_rot));
    w.set(a("rope.freq_base"), Value::F32(s.rope_base));
    w.set(a("rope.dimension_sections"), Value::Array(ValueType::I32, s.rope_sections().iter().map(|&x| Value::I32(x)).collect()));
    w.set(a("full_attention_interval"), u(s.full_attention_interval));
    w.set(a("ssm.conv_kernel"), u(s.conv_kernel));
    w.set(a("ssm.inner_size"), u(s.n_v_head * s.d_state));
    w.set(a("ssm.state_size"), u(s.d_state));
    w.set(a("ssm.time_step_rank"), u(s.n_v_head));
    w.set(a("ssm.group_count"), u(s.n_k_head));
    w.set(a("expert_count"), u(s.n_expert));
    w.set(a("expert_used_count"), u(s.n_expert_used));
    w.set(a("expert_feed_forward_length"), u(s.n_ff_exp));
    w.set(a("expert_shared_feed_forward_length"), u(s.n_ff_shexp));

    let e = |k: &str| format!("ember.synthetic.{k}");
    w.set(e("version"), Value::U32(1));
    w.set(e("preset"), Value::String(o.preset.clone()));
    w.set(e("recipe"), Value::String(o.recipe.name().into()));
    w.set(e("seed"), Value::U64(o.seed));
    w.set(e("skew"), Value::F32(o.skew));
    w.set(
        e("skew.method"),
        Value::String(
            "router row e = noise orthogonal to a shared direction u (logit std 1.28) + (-skew*ln(rank_e)) along u, scaled by the \
             predicted share of u in the normed input; rank_e = a per-layer random permutation of the experts; 0 = uniform routing"
                .into(),
        ),
    );
    w.set(e("router_noise"), Value::F32(scale::ROUTER_NOISE));
    w.set(e("embd_shared"), Value::F32(scale::EMBD_SHARED));
    w.set(
        e("init"),
        Value::String(format!(
            "approx-normal weights: projections N(0,1/fan_in); output projections x{}/{}/{}/{} (attn_output/ssm_out/ffn_down_exps/ffn_down_shexp); \
             ssm_alpha x{}; output x{}; norms 1; ssm_a = -U(1,16); ssm_dt.bias = softplus^-1(logU(1e-3,0.1)); conv N(0,1/kernel)",
            scale::ATTN_OUT,
            scale::SSM_OUT,
            scale::EXP_DOWN,
            scale::SHEXP_DOWN,
            scale::SSM_ALPHA,
            scale::OUTPUT
        )),
    );
    w.set(
        e("quantizer"),
        Value::String("ember-synth one-pass min/max (Q4_K) and absmax (Q6_K); ember-gguf for Q8_0/F16/BF16/others".into()),
    );
    for (k, v) in vocab.metadata() {
        if k.starts_with("tokenizer.") {
            w.set(k.clone(), v.clone());
        }
    }
}

/// (type, tensor count, bytes) over the plan, for reports.
pub fn type_counts(plan: &Plan) -> Vec<(GgmlType, usize, u64)> {
    let mut m: std::collections::BTreeMap<GgmlType, (usize, u64)> = Default::default();
    for t in &plan.tensors {
        let e = m.entry(t.spec.ggml_type).or_default();
        e.0 += 1;
        e.1 += t.spec.n_bytes().unwrap_or(0);
    }
    m.into_iter().map(|(t, (n, b))| (t, n, b)).collect()
}
