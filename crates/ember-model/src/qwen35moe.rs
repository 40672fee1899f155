//! qwen35moe forward pass (spec: shared/spec/qwen35moe.md §6). Reads top to bottom; shapes in
//! comments use T = tokens in the batch, D = n_embd.

use std::sync::Arc;

use ember_gguf::GgufFile;
pub use ember_ops::DeltaMode;
use ember_ops::{
    AttnHeads, AttnPrep, Batch, DeltaHeads, DeltaPrep, Gate, GateUp, GatedNorm, KvType, LayerIdx, Mat, MoeIn, MoeWeights, Ops, Routing,
    StateLayout, Tensor, WeightId, WeightSet,
};

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

    /// What a sequence keeps in a backend's state store, with KV rows of `kv_type`.
    pub fn state_layout(&self, kv_type: KvType) -> Result<StateLayout, Error> {
        crate::state::layout(&self.config, kv_type)
    }

    /// Sizes `ops`' state store for `slots` sequences of up to `n_ctx` tokens each, plus
    /// `extra_pages` KV pages (snapshots that outlive their sequence: the prompt cache).
    pub fn configure_store(&self, ops: &mut dyn Ops, kv_type: KvType, slots: usize, n_ctx: usize, extra_pages: usize) -> Result<(), Error> {
        let layout = self.state_layout(kv_type)?;
        // Every sequence full, plus one copied page per K/V cache (the first write after a
        // snapshot copies a shared partial page).
        let pages = slots.saturating_mul(layout.pages_at(n_ctx) + 2 * layout.n_kv_layers()).saturating_add(extra_pages);
        ops.configure(layout, slots, pages)?;
        Ok(())
    }

    /// A new sequence of up to `n_ctx` tokens in a slot of `ops`' store.
    pub fn new_state(&self, ops: &mut dyn Ops, n_ctx: usize) -> Result<SeqState, Error> {
        SeqState::new(ops, n_ctx)
    }

    /// Runs `tokens` through the model, continuing `st`. Returns logits [rows, n_vocab] for
    /// the positions `opts.logits` asks for (default: all).
    pub fn forward(&self, ops: &mut dyn Ops, tokens: &[u32], st: &mut SeqState, opts: Forward) -> Result<Mat, Error> {
        let logits = opts.logits.unwrap_or(Logits::All);
        let mut seqs = [SeqBatch { tokens, state: st, logits }];
        let mut out = self.forward_batch(ops, &mut seqs, opts.delta, opts.tap)?;
        Ok(out.pop().expect("one output per sequence"))
    }

    /// Runs several sequences through the model in one step: every weight is read once for
    /// all their tokens, and every op covers all sequences (each continuing its own state).
    /// Returns one logits matrix per sequence.
    #[allow(clippy::type_complexity)]
    pub fn forward_batch(
        &self,
        ops: &mut dyn Ops,
        seqs: &mut [SeqBatch],
        delta: DeltaMode,
        tap: Option<&mut dyn FnMut(&str, usize, &Mat)>,
    ) -> Result<Vec<Mat>, Error> {
        self.step(ops, seqs, delta, tap, &mut || {}, |ops, logits, counts| {
            let logits = ops.read(logits)?;
            // One sequence takes the rows as read (a decode step's 1 MB of logits for a 248k
            // vocabulary, not copied again).
            if counts.len() == 1 {
                return Ok(vec![logits]);
            }
            let mut at = 0;
            Ok(counts
                .iter()
                .map(|&n| {
                    at += n;
                    logits.rows(at - n, n)
                })
                .collect())
        })
    }

    /// [`Model::forward_batch`] where sequence i may ask, by `top[i] = Some((k, extra))`, for its
    /// one logit row (`Logits::Last`) as the row's `k` best entries and those at `extra`
    /// ([`ember_ops::TopRow`]: what a sampler needs for greedy or top-k, without the rest of
    /// the row; on a GPU the selection runs there and only those entries come down). The
    /// others get their rows whole. When every sequence with rows asks, one
    /// [`Ops::read_top`] serves them (with the largest k); otherwise the rows are read whole
    /// and the asked selections made on the host. `before_wait` runs once the step's work is
    /// all asked for and put in motion ([`Ops::submit`]), before the logits are waited for: host
    /// work that a device backend's step then overlaps (the engine's delivery of the previous
    /// step's tokens).
    pub fn forward_batch_top(
        &self,
        ops: &mut dyn Ops,
        seqs: &mut [SeqBatch],
        delta: DeltaMode,
        top: &[Option<(usize, Vec<u32>)>],
        before_wait: &mut dyn FnMut(),
    ) -> Result<Vec<StepRows>, Error> {
        if top.len() != seqs.len() {
            return Err(Error::BadBatch(format!("{} top requests for {} sequences", top.len(), seqs.len())));
        }
        for (s, t) in seqs.iter().zip(top) {
            if t.is_some() && s.logits != Logits::Last {
                return Err(Error::BadBatch("a top request needs Logits::Last".into()));
            }
        }
        self.step(ops, seqs, delta, None, before_wait, |ops, logits, counts| {
            let with_rows: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
            if !with_rows.is_empty() && with_rows.iter().all(|&i| top[i].is_some()) {
                let k = with_rows.iter().filter_map(|&i| top[i].as_ref().map(|t| t.0)).max().unwrap_or(0);
                let extra: Vec<Vec<u32>> = with_rows.iter().map(|&i| top[i].as_ref().map(|t| t.1.clone()).unwrap_or_default()).collect();
                let mut rows = ops.read_top(logits, k, &extra)?.into_iter();
                return Ok(counts
                    .iter()
                    .map(|&n| {
                        if n == 0 {
                            StepRows::Full(Mat::from_vec(0, logits.d, Vec::new()))
                        } else {
                            StepRows::Top(rows.next().unwrap_or_default())
                        }
                    })
                    .collect());
            }
            let m = ops.read(logits)?;
            let mut at = 0;
            Ok(counts
                .iter()
                .zip(top)
                .map(|(&n, t)| {
                    at += n;
                    match t {
                        Some((k, extra)) if n == 1 => {
                            StepRows::Top(ember_ops::top::top_of_row(&m.data[(at - 1) * m.d..at * m.d], *k, extra))
                        }
                        _ => StepRows::Full(m.rows(at - n, n)),
                    }
                })
                .collect())
        })
    }

    /// One step of the model over `seqs`; `read` brings the logits of the rows they ask for
    /// ([ΣT-selected, n_vocab], `counts[i]` rows of sequence i in order) to the host, before
    /// the step ends; `before_wait` runs just before, the step's work submitted, when the
    /// backend runs submitted work while the host goes on ([`Ops::overlaps`]), else first.
    #[allow(clippy::type_complexity)]
    fn step<R>(
        &self,
        ops: &mut dyn Ops,
        seqs: &mut [SeqBatch],
        delta: DeltaMode,
        tap: Option<&mut dyn FnMut(&str, usize, &Mat)>,
        before_wait: &mut dyn FnMut(),
        read: impl FnOnce(&mut dyn Ops, Tensor, &[usize]) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let Some((logits, counts)) = self.queue(ops, seqs, delta, tap, before_wait, false)? else {
            return Err(Error::BadBatch("a step with its tokens was refused".into()));
        };
        let out = read(ops, logits, &counts)?;
        ops.end_step()?;
        for s in seqs.iter_mut() {
            s.state.n_past += s.tokens.len();
        }
        Ok(out)
    }

    /// Queues a decode step over `seqs` (one token each, `Logits::Last`) whose rows' best
    /// entries (`top[i] = (k, extra)`, as [`Model::forward_batch_top`] asks) come back with
    /// [`Model::collect_top`], without waiting for it: the host may queue the next step first.
    /// With `deferred` the tokens are not known yet (`seqs`' tokens are not read): the step waits
    /// on the device for [`Model::feed`], which must come before anything waits for the device.
    /// Ok(None) when the backend cannot queue this step so ([`Ops::can_defer`]; nothing was
    /// queued). Each state counts the token as held from here on.
    pub fn submit_top(
        &self,
        ops: &mut dyn Ops,
        seqs: &mut [SeqBatch],
        top: &[(usize, Vec<u32>)],
        deferred: bool,
    ) -> Result<Option<QueuedTop>, Error> {
        if top.len() != seqs.len() {
            return Err(Error::BadBatch(format!("{} top requests for {} sequences", top.len(), seqs.len())));
        }
        if seqs.iter().any(|s| s.tokens.len() != 1 || s.logits != Logits::Last) {
            return Err(Error::BadBatch("a queued step has one token and its logits for each sequence".into()));
        }
        let n = seqs.len();
        let Some((logits, _)) = self.queue(ops, seqs, DeltaMode::Auto, None, &mut || {}, deferred)? else { return Ok(None) };
        let k = top.iter().map(|t| t.0).max().unwrap_or(0);
        let extra: Vec<Vec<u32>> = top.iter().map(|t| t.1.clone()).collect();
        let queued = (|| -> Result<ember_ops::TopRead, Error> {
            let read = ops.read_top_begin(logits, k, &extra)?;
            ops.end_step()?;
            Ok(read)
        })();
        match queued {
            Ok(read) => {
                for s in seqs.iter_mut() {
                    s.state.n_past += 1;
                }
                Ok(Some(QueuedTop { read, n_rows: n }))
            }
            Err(e) => {
                if deferred {
                    // Nobody reads its rows; the device must not wait for its tokens.
                    let _ = ops.feed_tokens(&vec![0; n]);
                }
                Err(e)
            }
        }
    }

    /// The tokens of the step [`Model::submit_top`] queued last with `deferred`, one per
    /// sequence in its order. A token out of the vocabulary is an error (the step then runs on
    /// token 0, and its rows are not to be used).
    pub fn feed(&self, ops: &mut dyn Ops, tokens: &[u32]) -> Result<(), Error> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
            let _ = ops.feed_tokens(&vec![0; tokens.len()]);
            return Err(Error::BadBatch(format!("token id {bad} is out of range (vocabulary has {} rows)", self.config.n_vocab)));
        }
        Ok(ops.feed_tokens(tokens)?)
    }

    /// The rows' best entries of a step [`Model::submit_top`] queued (waits for it), one per
    /// sequence in its order.
    pub fn collect_top(&self, ops: &mut dyn Ops, q: QueuedTop) -> Result<Vec<ember_ops::TopRow>, Error> {
        let rows = ops.read_top_end(q.read)?;
        if rows.len() != q.n_rows {
            return Err(Error::BadBatch(format!("{} rows read for a step of {}", rows.len(), q.n_rows)));
        }
        Ok(rows)
    }

    /// Everything of a step up to its logits, queued (and submitted, `before_wait` run, on a
    /// backend that overlaps): the logits handle and each sequence's number of logit rows.
    /// With `deferred`, the batch's tokens come later ([`Model::submit_top`]); None when the
    /// backend cannot take it so. A deferred step that fails once queued is fed token 0.
    #[allow(clippy::type_complexity)]
    fn queue(
        &self,
        ops: &mut dyn Ops,
        seqs: &mut [SeqBatch],
        delta: DeltaMode,
        tap: Option<&mut dyn FnMut(&str, usize, &Mat)>,
        before_wait: &mut dyn FnMut(),
        deferred: bool,
    ) -> Result<Option<(Tensor, Vec<usize>)>, Error> {
        for (index, s) in seqs.iter().enumerate() {
            // A bad sequence is named, and nothing has run yet: a caller may drop it and retry.
            // (A deferred step's tokens are checked when they come.)
            let tokens = if deferred { &[0u32][..] } else { s.tokens };
            self.check_batch(tokens, s.state)
                .map_err(|e| if seqs.len() == 1 { e } else { Error::InSequence { index, source: Box::new(e) } })?;
        }
        // A backend that does each op's work before returning overlaps nothing: the host work
        // goes first rather than a whole step late.
        let overlaps = ops.overlaps();
        if !overlaps {
            before_wait();
        }
        // The step's batch: every sequence's tokens after each other, and the rows that get logits.
        let mut batch = Batch::default();
        let mut counts = Vec::with_capacity(seqs.len());
        for s in seqs.iter() {
            let row0 = batch.n_rows() as u32;
            let n = s.tokens.len() as u32;
            let rows = match s.logits {
                Logits::All => row0..row0 + n,
                Logits::Last => row0 + n - 1..row0 + n,
                Logits::None => row0..row0,
            };
            counts.push(rows.len());
            batch.logit_rows.extend(rows);
            if deferred {
                batch.push(s.state.slot().id(), s.state.n_past, &vec![0; s.tokens.len()]);
            } else {
                batch.push(s.state.slot().id(), s.state.n_past, s.tokens);
            }
        }
        batch.deferred = deferred;
        if deferred && !ops.can_defer(&batch) {
            return Ok(None);
        }
        let n_rows = batch.n_rows();
        let queued =
            ops.begin_step(&batch).map_err(Error::from).and_then(|()| self.layers_and_head(ops, delta, tap, before_wait, overlaps));
        if queued.is_err() && deferred {
            // Nobody reads its rows; the device must not wait for its tokens.
            let _ = ops.feed_tokens(&vec![0; n_rows]);
        }
        Ok(Some((queued?, counts)))
    }

    /// The layers and the head of a begun step: its logits.
    #[allow(clippy::type_complexity)]
    fn layers_and_head(
        &self,
        ops: &mut dyn Ops,
        delta: DeltaMode,
        mut tap: Option<&mut dyn FnMut(&str, usize, &Mat)>,
        before_wait: &mut dyn FnMut(),
        overlaps: bool,
    ) -> Result<Tensor, Error> {
        let c = &self.config;

        let h = ops.embed(self.tok_embd)?; // [ΣT, D]
        see(&mut tap, ops, "embd", 0, h)?;
        // Everything made from here on but the residual h lives for one layer: each layer frees
        // what it made except the next layer's input norm, so a step holds one layer's
        // activations (a few hundred KiB a token), not all 40 layers' (~9.5 MiB a token).
        let layer_mark = ops.mark();
        // Each residual add goes with the norm that reads h next (one pass on backends that fuse
        // them): the mixer's with the post-norm, the MoE's with the next layer's input norm.
        let mut x = match self.layers.first() {
            Some(layer) => Some(ops.rms_norm(h, layer.attn_norm, c.rms_eps)?),
            None => None,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let li = LayerIdx(i as u16);
            let x_in = x.take().expect("every layer's input norm is made before it runs");
            let m = match &layer.mixer {
                Mixer::DeltaNet(dn) => dn.forward(c, ops, li, x_in, delta)?,
                Mixer::Attention(at) => at.forward(c, ops, li, x_in)?,
            };
            let (y, routing) = layer.moe.forward(li, c, ops, h, m, layer.post_norm)?; // h += m first
            if let Some(t) = tap.as_mut() {
                let r = ops.read_routing(routing)?;
                let k = r.k;
                t("route_ids", i, &Mat::from_vec(r.n_tok, k, r.ids.iter().map(|e| e.0 as f32).collect()));
                t("route_weights", i, &Mat::from_vec(r.n_tok, k, r.weights.clone()));
            }
            match self.layers.get(i + 1) {
                Some(next) => x = Some(ops.add_rms_norm(h, y, next.attn_norm, c.rms_eps)?), // h += y
                None => ops.add(h, y)?,
            }
            see(&mut tap, ops, "layer_out", i, h)?;
            ops.free_since(layer_mark, x.as_slice())?;
        }

        // Final norm and LM head on the requested rows of every sequence, in one matmul.
        let sel = ops.select_rows(h)?;
        let y = ops.rms_norm(sel, self.output_norm, c.rms_eps)?;
        see(&mut tap, ops, "final_norm", 0, y)?;
        let logits = ops.matmul(self.output, y)?; // [rows, n_vocab]
        if overlaps {
            ops.submit()?;
            before_wait();
        }
        Ok(logits)
    }

    fn check_batch(&self, tokens: &[u32], st: &SeqState) -> Result<(), Error> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(Error::BadBatch("no tokens".into()));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(Error::BadBatch(format!("token id {bad} is out of range (vocabulary has {} rows)", c.n_vocab)));
        }
        if st.n_past + tokens.len() > st.n_ctx {
            return Err(Error::ContextFull { n_past: st.n_past, n_new: tokens.len(), n_ctx: st.n_ctx });
        }
        Ok(())
    }
}

/// Shows `t` to the tap, if any (a download: only when tapping).
#[allow(clippy::type_complexity)]
fn see(tap: &mut Option<&mut dyn FnMut(&str, usize, &Mat)>, ops: &mut dyn Ops, name: &str, i: usize, t: Tensor) -> Result<(), Error> {
    if let Some(f) = tap.as_mut() {
        let m = ops.read(t)?;
        f(name, i, &m);
    }
    Ok(())
}

/// One sequence's logits from [`Model::forward_batch_top`].
#[derive(Debug, Clone, PartialEq)]
pub enum StepRows {
    /// The rows it asked for, whole.
    Full(Mat),
    /// Its one row's best entries and the extra ids it asked for.
    Top(ember_ops::TopRow),
}

/// A step [`Model::submit_top`] queued: its rows come with [`Model::collect_top`].
#[derive(Debug)]
pub struct QueuedTop {
    read: ember_ops::TopRead,
    n_rows: usize,
}

/// One sequence of a batched forward call.
pub struct SeqBatch<'a> {
    pub tokens: &'a [u32],
    pub state: &'a mut SeqState,
    pub logits: Logits,
}

impl Attention {
    /// Gated full attention, qwen35moe.md §6.3, over all rows of `x`; each sequence appends
    /// to and attends over its own KV rows.
    fn forward(&self, c: &Config, ops: &mut dyn Ops, layer: LayerIdx, x: Tensor) -> Result<Tensor, Error> {
        let (hd, nh) = (c.head_dim, c.n_head);
        let [qg, k, v]: [Tensor; 3] = take(ops.matmul_many(&[self.wq, self.wk, self.wv], x)?); // one pass over x
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
        // q, gate [ΣT, nh·hd], k normed + rotated at the step's positions; k and v appended to
        // every sequence's rows of its slot
        let a = ops.attn_prep_append(layer, prep, qg, k, v)?;
        let heads = AttnHeads { n_head: nh, n_head_kv: c.n_head_kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
        let o = ops.attention_gate(layer, heads, a.q, a.gate, Gate::Sigmoid)?; // [ΣT, nh·hd] ⊙ σ(gate)
        Ok(ops.matmul(self.wo, o)?) // [ΣT, D]
    }
}

impl DeltaNet {
    /// Gated DeltaNet, qwen35moe.md §6.4, over all rows of `x`; the conv and the delta rule
    /// continue each sequence's state.
    fn forward(&self, c: &Config, ops: &mut dyn Ops, layer: LayerIdx, x: Tensor, mode: DeltaMode) -> Result<Tensor, Error> {
        let (nk, nv, dk, dv) = (c.n_k_head, c.n_v_head, c.d_k, c.d_v);
        let [u, z, b, a]: [Tensor; 4] = take(ops.matmul_many(&[self.qkv, self.gate, self.beta, self.alpha], x)?); // one pass over x
        // u [ΣT, 2·nk·dk + nv·dv], z [ΣT, nv·dv], b and a [ΣT, nv]
        let prep = DeltaPrep { n_k_head: nk, n_v_head: nv, d_k: dk, d_v: dv, eps: c.rms_eps, a: self.a, dt_bias: self.dt_bias };
        // causal conv + SiLU, then q, k (L2-normed), v, g = log-decay, β
        let din = ops.conv_delta_prep(layer, u, self.conv, prep, b, a)?;
        let heads = DeltaHeads { n_k_head: nk, n_v_head: nv, d_k: dk, d_v: dv };
        // o [ΣT, nv·dv], then its gated norm: per head, shared weight; ⊙ silu(z)
        let norm = GatedNorm { w: self.norm, eps: c.rms_eps, act: Gate::Silu };
        let y = ops.delta_rule_norm(layer, heads, din, mode, norm, z)?;
        Ok(ops.matmul(self.out, y)?) // [ΣT, D]
    }
}

impl Moe {
    /// Routed experts (softmax over all, top-k, renormalised) plus the gated shared expert,
    /// qwen35moe.md §6.6: routing and the expert FFNs are ops. The residual add of the mixer's
    /// output `m` into `h` and the norm `norm` before the experts come first, with the router
    /// and the routing, as one op (`Ops::add_norm_route`: a backend may run it in one launch).
    fn forward(
        &self,
        layer: LayerIdx,
        c: &Config,
        ops: &mut dyn Ops,
        h: Tensor,
        m: Tensor,
        norm: WeightId,
    ) -> Result<(Tensor, Routing), Error> {
        // h += m; f = norm(h) [T, D]; router logits [T, E] (F32) routed to the top k; gs [T, 1]:
        // the shared expert's scalar gate
        let MoeIn { x: f, shared_gate: gs, routing } =
            ops.add_norm_route(h, m, norm, c.rms_eps, self.router, self.shared_gate_inp, c.n_expert_used)?;
        let y = ops.moe(layer, f, routing, gs)?; // [T, D] = Σ_e w_e·y_e + σ(gs)·s
        Ok((y, routing))
    }
}

/// The outputs of a `matmul_many` as an array.
fn take<const N: usize>(v: Vec<Tensor>) -> [Tensor; N] {
    v.try_into().unwrap_or_else(|v: Vec<Tensor>| panic!("expected {N} outputs, got {}", v.len()))
}
