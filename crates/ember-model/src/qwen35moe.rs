//! qwen35moe forward pass (spec: shared/spec/qwen35moe.md §6). Reads top to bottom; shapes in
//! comments use T = tokens in the batch, D = n_embd.

use std::sync::Arc;

use ember_gguf::GgufFile;
use std::borrow::Cow;

use ember_ops::reference::{l2_norm, sigmoid, softplus};
use ember_ops::{AttnShape, DeltaShape, ExpertView, Gate, Mat, MoeSlot, Ops};

use crate::state::LayerState;
use crate::weights::Loader;
use crate::{Config, Error, LayerKind, SeqState, Weight};

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

/// Which form of the delta rule a multi-token batch uses (one token is always recurrent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaMode {
    /// Chunked (§6.5) for batches of more than one token.
    #[default]
    Auto,
    Recurrent,
    Chunked,
}

/// Options of one forward call; `tap` sees named intermediates (for diffing against HF dumps).
#[derive(Default)]
pub struct Forward<'a> {
    pub logits: Option<Logits>,
    pub delta: DeltaMode,
    #[allow(clippy::type_complexity)]
    pub tap: Option<&'a mut dyn FnMut(&str, usize, &Mat)>,
}

struct Attention {
    wq: Weight, // {D, n_head·2·head_dim}: per head [query | gate], interleaved
    wk: Weight,
    wv: Weight,
    wo: Weight,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

struct DeltaNet {
    qkv: Weight,   // {D, conv_channels}: q | k | v (v heads tiled)
    gate: Weight,  // {D, n_v_head·d_v}: z
    beta: Weight,  // {D, n_v_head}
    alpha: Weight, // {D, n_v_head}
    conv: Vec<f32>,
    a: Vec<f32>, // −exp(A_log) per value head
    dt_bias: Vec<f32>,
    norm: Vec<f32>, // gated RMSNorm weight, shared by heads, no +1
    out: Weight,
}

enum Mixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

enum ExpertsGateUp {
    Separate {
        gate: Weight,
        up: Weight,
    },
    /// {D, 2·n_ff, E}: rows 0..n_ff gate, n_ff..2·n_ff up.
    Fused(Weight),
}

struct Moe {
    router: Weight, // {D, n_expert}
    gate_up: ExpertsGateUp,
    down: Weight,            // {n_ff, D, n_expert}
    shared_gate_inp: Weight, // {D}: scalar gate of the shared expert
    shared_gate: Weight,
    shared_up: Weight,
    shared_down: Weight,
}

struct Layer {
    attn_norm: Vec<f32>,
    post_norm: Vec<f32>,
    mixer: Mixer,
    moe: Moe,
}

pub struct Model {
    pub config: Config,
    file: Arc<GgufFile>,
    tok_embd: Weight,
    output_norm: Vec<f32>,
    output: Weight,
    layers: Vec<Layer>,
}

impl Model {
    /// Builds the model over a parsed file, checking every tensor's presence and shape.
    /// `progress(i, n)` is called after each layer.
    pub fn load(file: Arc<GgufFile>, mut progress: impl FnMut(usize, usize)) -> Result<Self, Error> {
        let mut config = Config::from_gguf(&file)?;
        let c = &config;
        let ld = Loader { file: file.clone() };
        let d = c.n_embd;
        let tok_embd = ld.get("token_embd.weight", &[d, file.tensor("token_embd.weight").map_or(0, |t| t.ne[1] as usize)])?;
        let n_rows = tok_embd.info().ne[1] as usize;
        if n_rows == 0 {
            return Err(Error::BadTensor { name: "token_embd.weight".into(), msg: "has no rows".into() });
        }
        if c.n_vocab != 0 && c.n_vocab != n_rows {
            return Err(Error::BadConfig(format!("tokenizer has {} tokens but token_embd has {n_rows} rows", c.n_vocab)));
        }
        config.n_vocab = n_rows;
        let c = &config;
        let output = ld.try_get("output.weight", &[d, n_rows])?.unwrap_or_else(|| tok_embd.clone());
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
                        conv: ld.get(&n("ssm_conv1d.weight"), &[c.conv_kernel, ch])?.to_f32()?,
                        a: ld.vec(&n("ssm_a"), c.n_v_head)?,
                        dt_bias: ld.vec(&n("ssm_dt.bias"), c.n_v_head)?,
                        norm: ld.vec(&n("ssm_norm.weight"), c.d_v)?,
                        out: ld.get(&n("ssm_out.weight"), &[vd, d])?,
                    })
                }
            };
            let (e, f, fs) = (c.n_expert, c.n_ff_exp, c.n_ff_shexp);
            let gate_up = match ld.try_get(&n("ffn_gate_up_exps.weight"), &[d, 2 * f, e])? {
                Some(w) => ExpertsGateUp::Fused(w),
                None => ExpertsGateUp::Separate {
                    gate: ld.get(&n("ffn_gate_exps.weight"), &[d, f, e])?,
                    up: ld.get(&n("ffn_up_exps.weight"), &[d, f, e])?,
                },
            };
            let shared_gate_inp = match ld.try_get(&n("ffn_gate_inp_shexp.weight"), &[d])? {
                Some(w) => w,
                None => ld.get(&n("ffn_gate_inp_shexp.weight"), &[d, 1])?,
            };
            let moe = Moe {
                router: ld.get(&n("ffn_gate_inp.weight"), &[d, e])?,
                gate_up,
                down: ld.get(&n("ffn_down_exps.weight"), &[f, d, e])?,
                shared_gate_inp,
                shared_gate: ld.get(&n("ffn_gate_shexp.weight"), &[d, fs])?,
                shared_up: ld.get(&n("ffn_up_shexp.weight"), &[d, fs])?,
                shared_down: ld.get(&n("ffn_down_shexp.weight"), &[fs, d])?,
            };
            layers.push(Layer {
                attn_norm: ld.vec(&n("attn_norm.weight"), d)?,
                post_norm: ld.vec(&n("post_attention_norm.weight"), d)?,
                mixer,
                moe,
            });
            progress(i + 1, c.n_layer);
        }
        Ok(Model { config, file, tok_embd, output_norm, output, layers })
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
        for s in seqs.iter() {
            self.check_batch(s.tokens, s.state)?;
        }
        let mut spans = Vec::with_capacity(seqs.len()); // (first row, n_tok, pos0, chunked)
        let mut all_tokens = Vec::new();
        for s in seqs.iter() {
            let chunked = match delta {
                DeltaMode::Auto => s.tokens.len() > 1,
                DeltaMode::Recurrent => false,
                DeltaMode::Chunked => true,
            };
            spans.push(Span { row0: all_tokens.len(), n: s.tokens.len(), pos0: s.state.n_past, chunked });
            all_tokens.extend_from_slice(s.tokens);
        }
        let mut tap = |name: &str, i: usize, m: &Mat| {
            if let Some(t) = tap.as_mut() {
                t(name, i, m)
            }
        };

        let mut h = ops.get_rows(&self.tok_embd.view(), &all_tokens); // [ΣT, D]
        tap("embd", 0, &h);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = ops.rms_norm(&h, &layer.attn_norm, c.rms_eps);
            let mut states: Vec<&mut LayerState> = seqs.iter_mut().map(|s| &mut s.state.layers[i]).collect();
            let m = match &layer.mixer {
                Mixer::DeltaNet(dn) => dn.forward(c, ops, &x, &spans, &mut states)?,
                Mixer::Attention(at) => at.forward(c, ops, &x, &spans, &mut states)?,
            };
            add_in_place(&mut h, &m); // [ΣT, D]
            let f = ops.rms_norm(&h, &layer.post_norm, c.rms_eps);
            let y = layer.moe.forward(c, ops, &f);
            add_in_place(&mut h, &y);
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
            rows.extend_from_slice(&h.data[first * c.n_embd..(first + n) * c.n_embd]);
            counts.push(n);
        }
        let sel = Mat::from_vec(rows.len() / c.n_embd, c.n_embd, rows);
        let y = ops.rms_norm(&sel, &self.output_norm, c.rms_eps);
        tap("final_norm", 0, &y);
        let logits = ops.matmul(&self.output.view(), &y); // [rows, n_vocab]
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

/// Where a sequence's tokens sit in the batch.
struct Span {
    row0: usize,
    n: usize,
    pos0: usize,
    chunked: bool,
}

/// The rows of span `sp` of `m`: `m` itself when the span is the whole batch (one sequence,
/// the common case), else a copy.
fn span_rows<'a>(m: &'a Mat, sp: &Span) -> Cow<'a, Mat> {
    if sp.row0 == 0 && sp.n == m.n { Cow::Borrowed(m) } else { Cow::Owned(m.rows(sp.row0, sp.n)) }
}

/// The per-span outputs `parts` stacked into one [n, d] matrix (the single one as it is).
fn stack(parts: Vec<Mat>, n: usize, d: usize) -> Mat {
    if parts.len() == 1 && parts[0].n == n {
        return parts.into_iter().next().expect("one part");
    }
    let mut data = Vec::with_capacity(n * d);
    for p in &parts {
        data.extend_from_slice(&p.data);
    }
    Mat::from_vec(n, d, data)
}

fn add_in_place(h: &mut Mat, x: &Mat) {
    h.data.iter_mut().zip(&x.data).for_each(|(a, b)| *a += b);
}

impl Attention {
    /// Gated full attention, qwen35moe.md §6.3, over all rows of `x`; RoPE, the KV cache and
    /// the attention itself per sequence.
    fn forward(&self, c: &Config, ops: &dyn Ops, x: &Mat, spans: &[Span], states: &mut [&mut LayerState]) -> Result<Mat, Error> {
        let (hd, nh) = (c.head_dim, c.n_head);
        let [qg, k, v]: [Mat; 3] = take(ops.matmul_many(&[self.wq.view(), self.wk.view(), self.wv.view()], x)); // one pass over x
        // qg [ΣT, nh·2·hd]: per head [q | gate]; k, v [ΣT, hk·hd]
        let (mut q, mut gate) = (Vec::with_capacity(x.n * nh * hd), Vec::with_capacity(x.n * nh * hd));
        for head in qg.data.chunks_exact(2 * hd) {
            q.extend_from_slice(&head[..hd]);
            gate.extend_from_slice(&head[hd..]);
        }
        let (q, gate) = (Mat::from_vec(x.n, nh * hd, q), Mat::from_vec(x.n, nh * hd, gate));
        let q = ops.rms_norm(&q, &self.q_norm, c.rms_eps); // per head
        let k = ops.rms_norm(&k, &self.k_norm, c.rms_eps); // per head
        let mut parts = Vec::with_capacity(spans.len());
        for (sp, st) in spans.iter().zip(states.iter_mut()) {
            let LayerState::Attention { k: kc, v: vc } = &mut **st else { unreachable!("state kinds follow the layer kinds") };
            let (mut qs, mut ks) = (span_rows(&q, sp).into_owned(), span_rows(&k, sp).into_owned());
            ops.rope(&mut qs, hd, c.n_rot, sp.pos0, c.rope_base);
            ops.rope(&mut ks, hd, c.n_rot, sp.pos0, c.rope_base);
            kc.push(&ks)?;
            vc.push(&span_rows(&v, sp))?;
            let shape =
                AttnShape { n_tok: sp.n, n_head: nh, n_head_kv: c.n_head_kv, head_dim: hd, pos0: sp.pos0, scale: 1.0 / (hd as f32).sqrt() };
            parts.push(ops.attention(shape, &qs, kc, vc)); // [T, nh·hd]
        }
        let mut a = stack(parts, x.n, nh * hd);
        ops.gate(&mut a, &gate, Gate::Sigmoid);
        Ok(ops.matmul(&self.wo.view(), &a)) // [ΣT, D]
    }
}

impl DeltaNet {
    /// Gated DeltaNet, qwen35moe.md §6.4, over all rows of `x`; the conv and the delta rule run
    /// per sequence on its carried state.
    fn forward(&self, c: &Config, ops: &dyn Ops, x: &Mat, spans: &[Span], states: &mut [&mut LayerState]) -> Result<Mat, Error> {
        let (nk, nv, dk, dv) = (c.n_k_head, c.n_v_head, c.d_k, c.d_v);
        let proj = [self.qkv.view(), self.gate.view(), self.beta.view(), self.alpha.view()];
        let [u, z, b, a]: [Mat; 4] = take(ops.matmul_many(&proj, x)); // one pass over x
        // u [ΣT, 2·nk·dk + nv·dv], z [ΣT, nv·dv], b and a [ΣT, nv]
        let mut parts = Vec::with_capacity(spans.len());
        for (sp, st) in spans.iter().zip(states.iter_mut()) {
            let LayerState::DeltaNet { conv, .. } = &mut **st else { unreachable!("state kinds follow the layer kinds") };
            parts.push(ops.conv1d_silu(&span_rows(&u, sp), &self.conv, conv)); // causal conv + SiLU
        }
        let cu = stack(parts, u.n, u.d);
        let mut q = cu.cols(0, nk * dk);
        let mut k = cu.cols(nk * dk, nk * dk);
        let v = cu.cols(2 * nk * dk, nv * dv);
        let q_scale = 1.0 / (dk as f32).sqrt();
        for head in q.data.chunks_exact_mut(dk) {
            l2_norm(head, c.rms_eps);
            head.iter_mut().for_each(|x| *x *= q_scale);
        }
        for head in k.data.chunks_exact_mut(dk) {
            l2_norm(head, c.rms_eps);
        }
        let mut beta = b;
        beta.data.iter_mut().for_each(|x| *x = sigmoid(*x));
        let mut g = a; // g = ssm_a · softplus(a + dt_bias) ≤ 0
        for t in 0..g.n {
            for (h, x) in g.row_mut(t).iter_mut().enumerate() {
                *x = self.a[h] * softplus(*x + self.dt_bias[h]);
            }
        }
        let mut parts = Vec::with_capacity(spans.len());
        for (sp, st) in spans.iter().zip(states.iter_mut()) {
            let LayerState::DeltaNet { s, .. } = &mut **st else { unreachable!("state kinds follow the layer kinds") };
            let rows = |m| span_rows(m, sp);
            let shape = DeltaShape { n_tok: sp.n, n_k_head: nk, n_v_head: nv, d_k: dk, d_v: dv };
            parts.push(ops.gated_delta_rule(shape, &rows(&q), &rows(&k), &rows(&v), &rows(&g), &rows(&beta), s, sp.chunked)); // [T, nv·dv]
        }
        let o = stack(parts, x.n, nv * dv);
        let mut y = ops.rms_norm(&o, &self.norm, c.rms_eps); // per head, shared weight
        ops.gate(&mut y, &z, Gate::Silu);
        Ok(ops.matmul(&self.out.view(), &y)) // [ΣT, D]
    }
}

impl Moe {
    /// Routed experts (softmax over all, top-k, renormalised) plus the gated shared expert,
    /// qwen35moe.md §6.6; the expert FFNs themselves are one `moe` op.
    fn forward(&self, c: &Config, ops: &dyn Ops, f: &Mat) -> Mat {
        let k = c.n_expert_used;
        let [logits, gs]: [Mat; 2] = take(ops.matmul_many(&[self.router.view(), self.shared_gate_inp.view()], f));
        // logits [T, E] (F32 router), gs [T, 1]: scalar gate of the shared expert
        // Per expert: the tokens routed to it and their weights.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); c.n_expert];
        let mut p = vec![0f32; c.n_expert];
        let mut sel = vec![0usize; k];
        for t in 0..f.n {
            softmax(logits.row(t), &mut p);
            top_k(&p, &mut sel);
            let sum: f32 = sel.iter().map(|&e| p[e]).sum();
            let norm = sum.max(6.103_515_6e-5); // llama.cpp clamps the sum to the smallest normal f16
            for &e in &sel {
                routed[e].push((t, p[e] / norm));
            }
        }
        let shared: Vec<(usize, f32)> = (0..f.n).map(|t| (t, sigmoid(gs.row(t)[0]))).collect();
        let mut slots: Vec<MoeSlot> = Vec::with_capacity(k * f.n + 1);
        for (e, toks) in routed.iter().enumerate().filter(|(_, toks)| !toks.is_empty()) {
            let (gate, up) = match &self.gate_up {
                ExpertsGateUp::Separate { gate, up } => (gate.expert(e), up.expert(e)),
                ExpertsGateUp::Fused(w) => (w.expert(e).rows(0, c.n_ff_exp), w.expert(e).rows(c.n_ff_exp, c.n_ff_exp)),
            };
            slots.push(MoeSlot { expert: ExpertView { gate, up, down: self.down.expert(e) }, tokens: toks });
        }
        let shared_expert = ExpertView { gate: self.shared_gate.view(), up: self.shared_up.view(), down: self.shared_down.view() };
        slots.push(MoeSlot { expert: shared_expert, tokens: &shared });
        ops.moe(&slots, f) // [T, D] = Σ_e w_e·y_e + σ·s
    }
}

/// The outputs of a `matmul_many` as an array.
fn take<const N: usize>(v: Vec<Mat>) -> [Mat; N] {
    v.try_into().unwrap_or_else(|v: Vec<Mat>| panic!("expected {N} outputs, got {}", v.len()))
}

fn softmax(x: &[f32], out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.iter_mut().zip(x).for_each(|(o, v)| *o = (v - m).exp());
    let s: f64 = out.iter().map(|v| *v as f64).sum();
    out.iter_mut().for_each(|v| *v = (*v as f64 / s) as f32);
}

/// The `sel.len()` largest entries of `p`, largest first, ties to the lower index (the order a
/// stable descending sort gives).
fn top_k(p: &[f32], sel: &mut [usize]) {
    if sel.is_empty() {
        return;
    }
    let mut n = 0;
    for (e, &v) in p.iter().enumerate() {
        if n == sel.len() && p[sel[n - 1]].total_cmp(&v).is_ge() {
            continue;
        }
        let mut i = n.min(sel.len() - 1);
        while i > 0 && p[sel[i - 1]].total_cmp(&v).is_lt() {
            sel[i] = sel[i - 1];
            i -= 1;
        }
        sel[i] = e;
        n = (n + 1).min(sel.len());
    }
}
