//! qwen35moe forward pass (spec: shared/spec/qwen35moe.md §6). Reads top to bottom; shapes in
//! comments use T = tokens in the batch, D = n_embd.

use std::sync::Arc;

use ember_gguf::GgufFile;
pub use ember_ops::DeltaMode;
use ember_ops::{
    AttnHeads, AttnPrep, DeltaHeads, DeltaPrep, Gate, GateUp, KvCache, LayerIdx, Mat, MoeWeights, Ops, Routing, SeqSpan, WeightId,
    WeightSet,
};

use crate::state::LayerState;
use crate::weights::Loader;
use crate::{Config, Error, LayerKind, SeqState};

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

/// Options of one forward call; `tap` sees named intermediates (for diffing against HF dumps):
/// `embd`, then per layer `route_ids` / `route_weights` [T, k] and `layer_out` [T, D], then
/// `final_norm`.
#[derive(Default)]
pub struct Forward<'a> {
    pub logits: Option<Logits>,
    pub delta: DeltaMode,
    #[allow(clippy::type_complexity)]
    pub tap: Option<&'a mut dyn FnMut(&str, usize, &Mat)>,
}

struct Attention {
    wq: WeightId, // {D, n_head·2·head_dim}: per head [query | gate], interleaved
    wk: WeightId,
    wv: WeightId,
    wo: WeightId,
    q_norm: WeightId,
    k_norm: WeightId,
}

struct DeltaNet {
    qkv: WeightId,   // {D, conv_channels}: q | k | v (v heads tiled)
    gate: WeightId,  // {D, n_v_head·d_v}: z
    beta: WeightId,  // {D, n_v_head}
    alpha: WeightId, // {D, n_v_head}
    conv: WeightId,  // taps [channel][kernel]
    a: WeightId,     // −exp(A_log) per value head
    dt_bias: WeightId,
    norm: WeightId, // gated RMSNorm weight, shared by heads, no +1
    out: WeightId,
}

enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

struct Moe {
    router: WeightId,          // {D, n_expert}
    shared_gate_inp: WeightId, // {D}: scalar gate of the shared expert
}

struct Layer {
    attn_norm: WeightId,
    post_norm: WeightId,
    mixer: Mixer,
    moe: Moe,
}

pub struct Model {
    pub config: Config,
    file: Arc<GgufFile>,
    weights: Arc<WeightSet>,
    tok_embd: WeightId,
    output_norm: WeightId,
    output: WeightId,
    layers: Vec<Layer>,
}

impl Model {
    /// Builds the model over a parsed file, checking every tensor's presence and shape.
    /// `progress(i, n)` is called after each layer.
    pub fn load(file: Arc<GgufFile>, mut progress: impl FnMut(usize, usize)) -> Result<Self, Error> {
        let mut config = Config::from_gguf(&file)?;
        let c = &config;
        let mut ld = Loader { file: file.clone(), set: WeightSet::new() };
        let d = c.n_embd;
        let n_rows = file.tensor("token_embd.weight").map_or(0, |t| t.ne[1] as usize);
        let tok_embd = ld.get("token_embd.weight", &[d, n_rows])?;
        if n_rows == 0 {
            return Err(Error::BadTensor { name: "token_embd.weight".into(), msg: "has no rows".into() });
        }
        if c.n_vocab != 0 && c.n_vocab != n_rows {
            return Err(Error::BadConfig(format!("tokenizer has {} tokens but token_embd has {n_rows} rows", c.n_vocab)));
        }
        config.n_vocab = n_rows;
        let c = &config;
        let output = ld.try_get("output.weight", &[d, n_rows])?.unwrap_or(tok_embd);
        let output_norm = ld.vec("output_norm.weight", d)?;

        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, kind) in c.layer_kinds.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mixer = match kind {
                LayerKind::Attention => {
                    let (h, hk, hd) = (c.n_head, c.n_head_kv, c.head_dim);
                    Mixer::Attention(Attention {
                        wq: ld.get(&n("attn_q.weight"), &[d, 2 * h * hd])?,
                        wk: ld.get(&n("attn_k.weight"), &[d, hk * hd])?,
                        wv: ld.get(&n("attn_v.weight"), &[d, hk * hd])?,
                        wo: ld.get(&n("attn_output.weight"), &[h * hd, d])?,
                        q_norm: ld.vec(&n("attn_q_norm.weight"), hd)?,
                        k_norm: ld.vec(&n("attn_k_norm.weight"), hd)?,
                    })
                }
                LayerKind::DeltaNet => {
                    let vd = c.n_v_head * c.d_v;
                    let ch = c.conv_channels();
                    Mixer::DeltaNet(DeltaNet {
                        qkv: ld.get(&n("attn_qkv.weight"), &[d, ch])?,
                        gate: ld.get(&n("attn_gate.weight"), &[d, vd])?,
                        beta: ld.get(&n("ssm_beta.weight"), &[d, c.n_v_head])?,
                        alpha: ld.get(&n("ssm_alpha.weight"), &[d, c.n_v_head])?,
                        conv: ld.vector(&n("ssm_conv1d.weight"), &[c.conv_kernel, ch])?,
                        a: ld.vec(&n("ssm_a"), c.n_v_head)?,
                        dt_bias: ld.vec(&n("ssm_dt.bias"), c.n_v_head)?,
                        norm: ld.vec(&n("ssm_norm.weight"), c.d_v)?,
                        out: ld.get(&n("ssm_out.weight"), &[vd, d])?,
                    })
                }
            };
            let (e, f, fs) = (c.n_expert, c.n_ff_exp, c.n_ff_shexp);
            let gate_up = match ld.try_get(&n("ffn_gate_up_exps.weight"), &[d, 2 * f, e])? {
                Some(w) => GateUp::Fused(w),
                None => GateUp::Separate {
                    gate: ld.get(&n("ffn_gate_exps.weight"), &[d, f, e])?,
                    up: ld.get(&n("ffn_up_exps.weight"), &[d, f, e])?,
                },
            };
            let shared_gate_inp = match ld.try_get(&n("ffn_gate_inp_shexp.weight"), &[d])? {
                Some(w) => w,
                None => ld.get(&n("ffn_gate_inp_shexp.weight"), &[d, 1])?,
            };
            let moe = MoeWeights {
                n_expert: e,
                n_ff: f,
                gate_up,
                down: ld.get(&n("ffn_down_exps.weight"), &[f, d, e])?,
                shared: [
                    ld.get(&n("ffn_gate_shexp.weight"), &[d, fs])?,
                    ld.get(&n("ffn_up_shexp.weight"), &[d, fs])?,
                    ld.get(&n("ffn_down_shexp.weight"), &[fs, d])?,
                ],
            };
            ld.set.set_moe(LayerIdx(i as u16), moe);
            layers.push(Layer {
                attn_norm: ld.vec(&n("attn_norm.weight"), d)?,
                post_norm: ld.vec(&n("post_attention_norm.weight"), d)?,
                mixer,
                moe: Moe { router: ld.get(&n("ffn_gate_inp.weight"), &[d, e])?, shared_gate_inp },
            });
            progress(i + 1, c.n_layer);
        }
        Ok(Model { config, file, weights: Arc::new(ld.set), tok_embd, output_norm, output, layers })
    }

    /// Every weight the model reads, by id: register it with a backend
    /// ([`ember_ops::Ops::register`]) before the first forward call.
    pub fn weights(&self) -> &Arc<WeightSet> {
        &self.weights
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// Runs `tokens` through the model, continuing `st`. Returns logits [rows, n_vocab] for
    /// the positions `opts.logits` asks for (default: all).
    pub fn forward(&self, ops: &dyn Ops, tokens: &[u32], st: &mut SeqState, opts: Forward) -> Result<Mat, Error> {
        let logits = opts.logits.unwrap_or(Logits::All);
        let mut seqs = [SeqBatch { tokens, state: st, logits }];
        let mut out = self.forward_batch(ops, &mut seqs, opts.delta, opts.tap)?;
        Ok(out.pop().expect("one output per sequence"))
    }

    /// Runs several sequences through the model in one pass: every weight is read once for all
    /// their tokens; only the per-sequence parts (conv, delta rule, attention over the sequence's
    /// own cache) run sequence by sequence. Returns one logits matrix per sequence.
    #[allow(clippy::type_complexity)]
    pub fn forward_batch(
        &self,
        ops: &dyn Ops,
        seqs: &mut [SeqBatch],
        delta: DeltaMode,
        mut tap: Option<&mut dyn FnMut(&str, usize, &Mat)>,
    ) -> Result<Vec<Mat>, Error> {
        let c = &self.config;
        for (index, s) in seqs.iter().enumerate() {
            // A bad sequence is named, and nothing has run yet: a caller may drop it and retry.
            self.check_batch(s.tokens, s.state)
                .map_err(|e| if seqs.len() == 1 { e } else { Error::InSequence { index, source: Box::new(e) } })?;
        }
        let mut spans = Vec::with_capacity(seqs.len()); // the step's batch: one span per sequence
        let mut all_tokens = Vec::new();
        for s in seqs.iter() {
            spans.push(SeqSpan { row0: all_tokens.len(), n: s.tokens.len(), pos0: s.state.n_past });
            all_tokens.extend_from_slice(s.tokens);
        }
        let tapping = tap.is_some();
        let mut tap = |name: &str, i: usize, m: &Mat| {
            if let Some(t) = tap.as_mut() {
                t(name, i, m)
            }
        };

        let mut h = ops.get_rows(self.tok_embd, &all_tokens)?; // [ΣT, D]
        tap("embd", 0, &h);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = ops.rms_norm(&h, layer.attn_norm, c.rms_eps)?;
            let mut states: Vec<&mut LayerState> = seqs.iter_mut().map(|s| &mut s.state.layers[i]).collect();
            let m = match &layer.mixer {
                Mixer::DeltaNet(dn) => dn.forward(c, ops, &x, &spans, &mut states, delta)?,
                Mixer::Attention(at) => at.forward(c, ops, &x, &spans, &mut states)?,
            };
            ops.add(&mut h, &m)?; // [ΣT, D]
            let f = ops.rms_norm(&h, layer.post_norm, c.rms_eps)?;
            let (y, routing) = layer.moe.forward(LayerIdx(i as u16), c, ops, &f)?;
            if tapping {
                let k = routing.k;
                tap("route_ids", i, &Mat::from_vec(routing.n_tok, k, routing.ids.iter().map(|e| e.0 as f32).collect()));
                tap("route_weights", i, &Mat::from_vec(routing.n_tok, k, routing.weights.clone()));
            }
            ops.add(&mut h, &y)?;
            tap("layer_out", i, &h);
        }

        // Final norm and LM head on the requested rows of every sequence, in one matmul.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(seqs.len());
        for (s, sp) in seqs.iter_mut().zip(&spans) {
            s.state.n_past += sp.n;
            let (first, n) = match s.logits {
                Logits::All => (sp.row0, sp.n),
                Logits::Last => (sp.row0 + sp.n - 1, 1),
                Logits::None => (sp.row0, 0),
            };
            rows.extend(first..first + n);
            counts.push(n);
        }
        let sel = ops.select_rows(&h, &rows)?;
        let y = ops.rms_norm(&sel, self.output_norm, c.rms_eps)?;
        tap("final_norm", 0, &y);
        let logits = ops.matmul(self.output, &y)?; // [rows, n_vocab]
        let mut out = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for n in counts {
            out.push(logits.rows(at, n));
            at += n;
        }
        Ok(out)
    }

    fn check_batch(&self, tokens: &[u32], st: &SeqState) -> Result<(), Error> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(Error::BadBatch("no tokens".into()));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(Error::BadBatch(format!("token id {bad} is out of range (vocabulary has {} rows)", c.n_vocab)));
        }
        if st.layers.len() != self.layers.len() {
            return Err(Error::BadBatch(format!("state has {} layers, model {}", st.layers.len(), self.layers.len())));
        }
        if st.n_past + tokens.len() > st.n_ctx {
            return Err(Error::ContextFull { n_past: st.n_past, n_new: tokens.len(), n_ctx: st.n_ctx });
        }
        Ok(())
    }
}

/// One sequence of a batched forward call.
pub struct SeqBatch<'a> {
    pub tokens: &'a [u32],
    pub state: &'a mut SeqState,
    pub logits: Logits,
}

/// Every token's position: span by span, pos0 + t.
fn positions(spans: &[SeqSpan]) -> Vec<u32> {
    spans.iter().flat_map(|sp| (sp.pos0..sp.pos0 + sp.n).map(|p| p as u32)).collect()
}

impl Attention {
    /// Gated full attention, qwen35moe.md §6.3, over all rows of `x`; each sequence appends
    /// to and attends over its own KV cache.
    fn forward(&self, c: &Config, ops: &dyn Ops, x: &Mat, spans: &[SeqSpan], states: &mut [&mut LayerState]) -> Result<Mat, Error> {
        let (hd, nh) = (c.head_dim, c.n_head);
        let [qg, k, v]: [Mat; 3] = take(ops.matmul_many(&[self.wq, self.wk, self.wv], x)?); // one pass over x
        // qg [ΣT, nh·2·hd]: per head [q | gate]; k, v [ΣT, hk·hd]
        let prep = AttnPrep {
            n_head: nh,
            n_head_kv: c.n_head_kv,
            head_dim: hd,
            n_rot: c.n_rot,
            rope_base: c.rope_base,
            eps: c.rms_eps,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
        };
        let a = ops.attn_prep(prep, &qg, &k, &positions(spans))?; // q, gate [ΣT, nh·hd], k normed + rotated
        let mut caches: Vec<KvCache> = states
            .iter_mut()
            .map(|st| match &mut **st {
                LayerState::Attention { k, v } => KvCache { k, v },
                LayerState::DeltaNet { .. } => unreachable!("state kinds follow the layer kinds"),
            })
            .collect();
        ops.kv_append(spans, &a.k, &v, &mut caches)?; // every sequence's rows onto its cache
        let heads = AttnHeads { n_head: nh, n_head_kv: c.n_head_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
        let mut o = ops.attention(heads, spans, &a.q, &caches)?; // [ΣT, nh·hd]
        ops.gate(&mut o, &a.gate, Gate::Sigmoid)?;
        Ok(ops.matmul(self.wo, &o)?) // [ΣT, D]
    }
}

impl DeltaNet {
    /// Gated DeltaNet, qwen35moe.md §6.4, over all rows of `x`; the conv and the delta rule
    /// continue each sequence's carried state.
    fn forward(
        &self,
        c: &Config,
        ops: &dyn Ops,
        x: &Mat,
        spans: &[SeqSpan],
        states: &mut [&mut LayerState],
        mode: DeltaMode,
    ) -> Result<Mat, Error> {
        let (nk, nv, dk, dv) = (c.n_k_head, c.n_v_head, c.d_k, c.d_v);
        let [u, z, b, a]: [Mat; 4] = take(ops.matmul_many(&[self.qkv, self.gate, self.beta, self.alpha], x)?); // one pass over x
        // u [ΣT, 2·nk·dk + nv·dv], z [ΣT, nv·dv], b and a [ΣT, nv]
        let (mut convs, mut recs): (Vec<&mut [f32]>, Vec<&mut [f32]>) = states
            .iter_mut()
            .map(|st| match &mut **st {
                LayerState::DeltaNet { conv, s } => (&mut conv[..], &mut s[..]),
                LayerState::Attention { .. } => unreachable!("state kinds follow the layer kinds"),
            })
            .unzip();
        let cu = ops.conv1d_silu(spans, &u, self.conv, &mut convs)?; // causal conv + SiLU
        let prep = DeltaPrep { n_k_head: nk, n_v_head: nv, d_k: dk, d_v: dv, eps: c.rms_eps, a: self.a, dt_bias: self.dt_bias };
        let din = ops.delta_prep(prep, &cu, &b, &a)?; // q, k (L2-normed), v, g = log-decay, β
        let heads = DeltaHeads { n_k_head: nk, n_v_head: nv, d_k: dk, d_v: dv };
        let o = ops.gated_delta_rule(heads, spans, &din, &mut recs, mode)?; // [ΣT, nv·dv]
        let mut y = ops.rms_norm(&o, self.norm, c.rms_eps)?; // per head, shared weight
        ops.gate(&mut y, &z, Gate::Silu)?;
        Ok(ops.matmul(self.out, &y)?) // [ΣT, D]
    }
}

impl Moe {
    /// Routed experts (softmax over all, top-k, renormalised) plus the gated shared expert,
    /// qwen35moe.md §6.6: routing and the expert FFNs are ops.
    fn forward(&self, layer: LayerIdx, c: &Config, ops: &dyn Ops, f: &Mat) -> Result<(Mat, Routing), Error> {
        let [logits, gs]: [Mat; 2] = take(ops.matmul_many(&[self.router, self.shared_gate_inp], f)?);
        // logits [T, E] (F32 router), gs [T, 1]: scalar gate of the shared expert
        let routing = ops.route(&logits, c.n_expert_used)?;
        let y = ops.moe(layer, f, &routing, &gs)?; // [T, D] = Σ_e w_e·y_e + σ(gs)·s
        Ok((y, routing))
    }
}

/// The outputs of a `matmul_many` as an array.
fn take<const N: usize>(v: Vec<Mat>) -> [Mat; N] {
    v.try_into().unwrap_or_else(|v: Vec<Mat>| panic!("expected {N} outputs, got {}", v.len()))
}
