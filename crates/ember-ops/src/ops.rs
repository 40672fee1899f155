//! The two op traits: [`Ops`] (on handles a backend owns) and [`HostKernels`] (on host
//! matrices, which [`HostBackend`](crate::HostBackend) turns into [`Ops`]).

use crate::*;

/// The op set a backend implements, on handles it owns. A step is `begin_step`, ops, then
/// `end_step`; the model does nothing else. Every op returns [`OpResult`]; there are no default
/// bodies. Shapes are documented per op; `T` is the number of rows of the step's batch unless
/// an op says otherwise.
pub trait Ops: SeqStore + Send {
    fn name(&self) -> &'static str;

    fn device(&self) -> DeviceId;

    /// Registers the weights later ops name by id (once per model, at load; a new set replaces
    /// the old one). A device backend uploads them here.
    fn register(&mut self, weights: std::sync::Arc<WeightSet>) -> OpResult<()>;

    /// Starts a step: frees the previous step's handles and writes the batch (token ids,
    /// positions, sequences with their slots, logit rows). Checks every slot is in use and each
    /// sequence continues at its slot's length.
    fn begin_step(&mut self, batch: &Batch) -> OpResult<()>;

    /// Ends the step: each sequence's slot now holds its `n` more tokens.
    fn end_step(&mut self) -> OpResult<()>;

    /// Where this step's next handle will be made.
    fn mark(&self) -> Mark;

    /// Frees every handle made since `mark` except those in `keep` (live handles of this
    /// step): their memory goes to the step's later handles, so a step holds one layer's
    /// intermediates, not every layer's. Handles made before `mark` stay; a freed handle is an
    /// error in every op, as a handle of an earlier step is.
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()>;

    /// A host matrix as a handle of this step (inputs of tests and tools; the model uses none).
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor>;

    /// A handle's values on the host.
    fn read(&mut self, x: Tensor) -> OpResult<Mat>;

    /// Per row of `x` (logits), its `k` best entries and those at `extra[row]` (ids past the
    /// row skipped; `extra` empty: none for any row), without bringing the rest to the host
    /// ([`top::top_of_row`] defines what: a device backend selects on the device and equals it).
    /// By default: [`Ops::read`], then the selection on the host.
    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<TopRow>> {
        if !extra.is_empty() && extra.len() != x.n {
            return Err(OpError::new("read_top", self.device(), format!("{}x{}", x.n, x.d), format!("{} rows of extra ids", extra.len())));
        }
        let m = self.read(x)?;
        Ok((0..m.n).map(|r| top::top_of_row(&m.data[r * m.d..(r + 1) * m.d], k, extra.get(r).map_or(&[], Vec::as_slice))).collect())
    }

    /// [`Ops::read_top`] in two halves: the selection and its copy to the host queued behind the
    /// work asked for so far ([`Ops::read_top_end`] waits for it and returns the rows). Between
    /// the two the host may queue the next step (a device runs it after this one). By default
    /// the rows are read at once ([`TopRead::Ready`]).
    fn read_top_begin(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<TopRead> {
        Ok(TopRead::Ready(self.read_top(x, k, extra)?))
    }

    /// The rows of a [`Ops::read_top_begin`] of this backend (in the order they were begun).
    fn read_top_end(&mut self, r: TopRead) -> OpResult<Vec<TopRow>> {
        match r {
            TopRead::Ready(rows) => Ok(rows),
            TopRead::Queued(_) => Err(OpError::new("read_top_end", self.device(), "", "a read this backend did not begin")),
        }
    }

    /// Whether [`Ops::begin_step`] could ever take a batch whose tokens come later
    /// ([`Batch::deferred`]); [`Ops::can_defer`] says it for one batch.
    fn defers_tokens(&self) -> bool {
        false
    }

    /// Whether [`Ops::begin_step`] takes `batch` with [`Batch::deferred`] set: the step's work is
    /// queued behind a wait for its tokens on the device, and nothing until
    /// [`Ops::feed_tokens`] waits for the device on the host (no upload that waits, no read, no
    /// page table written mid-step). A host backend, whose ops run when called, never can.
    fn can_defer(&self, batch: &Batch) -> bool {
        let _ = batch;
        false
    }

    /// The tokens of the deferred step begun last, one per row: its queued work goes on. Called
    /// once per deferred step, before anything waits for the device; [`OpError`] when no
    /// deferred step waits for them (a step that failed while being queued is given tokens by
    /// its caller all the same, so that the device does not wait for them).
    fn feed_tokens(&mut self, tokens: &[u32]) -> OpResult<()> {
        let _ = tokens;
        Err(OpError::new("feed_tokens", self.device(), "", "this backend does not defer a step's tokens"))
    }

    /// A routing's ids and weights on the host.
    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable>;

    /// The embedding rows of the step's tokens ([T, k]).
    fn embed(&mut self, w: WeightId) -> OpResult<Tensor>;

    /// `y[t] = W·x[t]` for every row of `x` ([N, k] -> [N, n_rows]).
    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor>;

    /// `[W_i·x]` for several weights that read the same input.
    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>>;

    /// RMSNorm of every `len(w)`-wide group of every row, times the vector weight `w`.
    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor>;

    /// `h ← h + x` (same shapes): the residual adds.
    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()>;

    /// [`Ops::rms_norm`] of `x`, then [`Ops::gate`] of it by `g`: a gated norm. A backend may do
    /// both in one pass; the results are those of the two ops.
    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        let y = self.rms_norm(x, w, eps)?;
        self.gate(y, g, act)?;
        Ok(y)
    }

    /// `h ← h + x`, then RMSNorm of `h` as [`Ops::rms_norm`]: a residual add and the norm that
    /// reads it next. A backend may do both in one pass; the results are those of the two ops.
    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        self.add(h, x)?;
        self.rms_norm(h, w, eps)
    }

    /// Gated attention prep (qwen35moe.md §6.3 steps 1–4) at the step's positions: splits `qg`
    /// [T, n_head·2·head_dim] into q and gate, RMS-normalises q and `k` per head, NeoX RoPE.
    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn>;

    /// Appends each sequence's rows of `k` and `v` [T, n_head_kv·head_dim] to the KV rows of
    /// attention layer `layer` of its slot.
    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()>;

    /// [`Ops::attn_prep`], then [`Ops::kv_append`] of its k and `v` to layer `layer`: the
    /// attention mixer between its projections and the attention. A device backend may run both
    /// in one launch; the results (the returned tensors and the KV rows) are the two ops'.
    fn attn_prep_append(&mut self, layer: LayerIdx, s: AttnPrep, qg: Tensor, k: Tensor, v: Tensor) -> OpResult<AttnIn> {
        let a = self.attn_prep(s, qg, k)?;
        self.kv_append(layer, a.k, v)?;
        Ok(a)
    }

    /// Causal GQA attention of every sequence's rows of `q` over its slot's K/V rows of
    /// `layer` (token t of a sequence at pos0 sees positions 0..=pos0 + t).
    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor>;

    /// [`Ops::attention`], then [`Ops::gate`] of its output by `g` with `act`: the attention
    /// mixer before its output projection. A device backend may run both in the attention's
    /// launches; the results are the two ops'.
    fn attention_gate(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, g: Tensor, act: Gate) -> OpResult<Tensor> {
        let o = self.attention(layer, h, q)?;
        self.gate(o, g, act)?;
        Ok(o)
    }

    /// Causal depthwise conv (taps `[ch][j]`) over each sequence's conv history of `layer` and
    /// its rows of `x`, then SiLU; the history is updated.
    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor>;

    /// DeltaNet prep (qwen35moe.md §6.4 steps 3–6): q | k | v split, L2 norms (q also scaled by
    /// 1/√d_k), β = sigmoid(`b`), g = a·softplus(`alpha` + dt_bias).
    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn>;

    /// [`Ops::conv1d_silu`] of `x` then [`Ops::delta_prep`] of its output: the DeltaNet mixer
    /// between its input projections and the delta rule. A device backend may run both in one
    /// launch (the conv output never stored); the results are the two ops'.
    fn conv_delta_prep(&mut self, layer: LayerIdx, x: Tensor, w: WeightId, s: DeltaPrep, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        let cu = self.conv1d_silu(layer, x, w)?;
        self.delta_prep(s, cu, b, alpha)
    }

    /// Gated delta rule over each sequence's rows, continuing its slot's recurrent state of
    /// `layer`; recurrent or chunked per `mode`. Returns o [T, n_v_head·d_v].
    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor>;

    /// [`Ops::gated_delta_rule`], then [`Ops::rms_norm_gate`] of its output by `z` (`norm`'s
    /// weight one value head wide): the DeltaNet mixer between the delta rule and its output
    /// projection. A device backend may run both in one launch; the results are the two ops'.
    fn delta_rule_norm(
        &mut self,
        layer: LayerIdx,
        h: DeltaHeads,
        x: DeltaIn,
        mode: DeltaMode,
        norm: GatedNorm,
        z: Tensor,
    ) -> OpResult<Tensor> {
        let o = self.gated_delta_rule(layer, h, x, mode)?;
        self.rms_norm_gate(o, norm.w, norm.eps, z, norm.act)
    }

    /// `y ← y ⊙ act(g)` element by element (same shapes).
    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()>;

    /// Routing from router logits [N, n_expert]: softmax, the `k` largest (ties to the lower
    /// id), renormalised.
    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing>;

    /// [`Ops::add_rms_norm`] of `h` and `x` with the norm weight `norm`, then [`Ops::matmul_many`]
    /// of the `router` and the shared expert's gate row `shared_gate` on its output, then
    /// [`Ops::route`] of the router's logits to the top `k`: the MoE block's prelude. A device
    /// backend may run it in one launch; the results are the three ops'.
    #[allow(clippy::too_many_arguments)]
    fn add_norm_route(
        &mut self,
        h: Tensor,
        x: Tensor,
        norm: WeightId,
        eps: f32,
        router: WeightId,
        shared_gate: WeightId,
        k: usize,
    ) -> OpResult<MoeIn> {
        add_norm_route_ops(self, h, x, norm, eps, router, shared_gate, k)
    }

    /// The mixture of experts of `layer` on `routing` plus the gated shared expert
    /// (qwen35moe.md §6.6 steps 4–7); `shared_gate` [N, 1]. Returns [N, D].
    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor>;

    /// The step's logit rows of `x`, in the batch's order.
    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor>;

    /// Puts the work asked for so far in motion (a device backend sends the launches it has
    /// recorded), before host work meant to overlap it. By default nothing: a host backend
    /// has done its work when each op returns.
    fn submit(&mut self) -> OpResult<()> {
        Ok(())
    }

    /// Whether work submitted ([`Ops::submit`]) runs while the host goes on (a device), so
    /// that host work placed after it overlaps it; false for a backend whose ops do their
    /// work before they return (then such host work is better done before the step).
    fn overlaps(&self) -> bool {
        false
    }

    /// `x`'s rows for another backend to copy on its own queue ([`Ops::import_rows`]), ready
    /// once the work queued so far is done; None when this backend has none to offer (the
    /// caller reads them and uploads them instead). Until the importer's copy is done the rows
    /// must stay as they are: the caller passes the import's mark to [`Ops::wait_mark`] here
    /// before any later op.
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<DeviceRows>> {
        let _ = x;
        Ok(None)
    }

    /// A handle of this step holding a copy of another backend's exported `rows`, the copy
    /// queued after they are ready, and the mark of the copy's end (for the exporter to wait
    /// on); None when this backend cannot copy them (another kind of device).
    fn import_rows(&mut self, rows: &DeviceRows) -> OpResult<Option<(Tensor, QueueMark)>> {
        let _ = rows;
        Ok(None)
    }

    /// Orders this backend's later work after `mark` (another backend's copy of rows exported
    /// here). A mark this backend cannot read is ignored.
    fn wait_mark(&mut self, mark: &QueueMark) -> OpResult<()> {
        let _ = mark;
        Ok(())
    }

    /// Which weights the next [`Ops::register`] keeps, by id (None: all): a layer split's part
    /// (`ember_plan::split`) is given every weight and runs only its layers'. A device backend
    /// uploads only those kept; a host backend, which reads the mapped file, may ignore it.
    fn keep_weights(&mut self, kept: Option<Vec<bool>>) {
        let _ = kept;
    }

    /// What the backend's expert tier has done, when it holds only some routed experts on its
    /// device (None: every expert is where the MoE runs, no tier).
    fn expert_stats(&self) -> Option<ExpertStats> {
        None
    }

    /// Per layer, routed pairs (resident, not resident) since the start, for the layers the
    /// tier manages (empty without a tier).
    fn expert_layer_stats(&self) -> Vec<(LayerIdx, u64, u64)> {
        Vec::new()
    }

    /// The device that runs `layer` (a layer split's part for it; else this backend's).
    fn layer_device(&self, layer: LayerIdx) -> DeviceId {
        let _ = layer;
        self.device()
    }
}

/// The op set on host matrices, with state passed in: what a host backend's kernels implement
/// ([`HostOps`] = [`HostBackend`] over the reference kernels, the CPU backend over its SIMD
/// kernels). [`HostBackend`] turns it into [`Ops`]. Shapes are documented per op; `T` is the
/// number of token rows.
pub trait HostKernels: Send + Sync {
    fn name(&self) -> &'static str;

    fn device(&self) -> DeviceId;

    /// Registers the weights later ops name by id (once per model, at load; a new set replaces
    /// the old one). A device backend uploads them here.
    fn register(&mut self, weights: std::sync::Arc<WeightSet>) -> OpResult<()>;

    /// Rows `ids` of an embedding table, dequantised ([ids.len(), k]).
    fn get_rows(&self, w: WeightId, ids: &[u32]) -> OpResult<Mat>;

    /// `y[t] = W·x[t]` for every row of `x` ([T, k] -> [T, n_rows]).
    fn matmul(&self, w: WeightId, x: &Mat) -> OpResult<Mat>;

    /// `[W_i·x]` for several weights that read the same input (e.g. the four DeltaNet input
    /// projections): a backend quantises `x` once and runs them as one parallel region.
    fn matmul_many(&self, ws: &[WeightId], x: &Mat) -> OpResult<Vec<Mat>>;

    /// RMSNorm of every `len(w)`-wide group of every row, times the vector weight `w`.
    fn rms_norm(&self, x: &Mat, w: WeightId, eps: f32) -> OpResult<Mat>;

    /// `h ← h + x` (same shapes): the residual adds.
    fn add(&self, h: &mut Mat, x: &Mat) -> OpResult<()>;

    /// Gated attention prep (qwen35moe.md §6.3 steps 1–4): splits `qg` [T, n_head·2·head_dim]
    /// (per head `[q | gate]`) into q and gate, RMS-normalises q and `k` per head with their
    /// weights, and applies NeoX RoPE to both at the positions `pos` (one per row).
    fn attn_prep(&self, s: AttnPrep, qg: &Mat, k: &Mat, pos: &[u32]) -> OpResult<AttnMats>;

    /// Appends each sequence's rows of `k` and `v` [ΣT, n_head_kv·head_dim] to its caches
    /// (quantised to their type, new pages from `pool`); `caches[i]` belongs to `spans[i]`.
    fn kv_append(&self, spans: &[SeqSpan], k: &Mat, v: &Mat, caches: &mut [KvCache<'_>], pool: &PagePool) -> OpResult<()>;

    /// Causal GQA attention of every sequence's rows of `q` [ΣT, n_head·head_dim] over its
    /// cached K/V rows (token t of span s sees positions 0..=s.pos0 + t).
    fn attention(&self, h: AttnHeads, spans: &[SeqSpan], q: &Mat, caches: &[KvCache<'_>]) -> OpResult<Mat>;

    /// Causal depthwise conv (kernel `len(w) / channels`, taps `[ch][j]`) over `[state | x]`
    /// per sequence, then SiLU. `states[i]` holds the last kernel−1 inputs of `spans[i]`
    /// (oldest first) and is updated.
    fn conv1d_silu(&self, spans: &[SeqSpan], x: &Mat, w: WeightId, states: &mut [&mut [f32]]) -> OpResult<Mat>;

    /// DeltaNet prep (qwen35moe.md §6.4 steps 3–6): splits the conv output `cu`
    /// [T, 2·n_k_head·d_k + n_v_head·d_v] into q | k | v, L2-normalises q and k per head (q also
    /// scaled by 1/√d_k), β = sigmoid(`b`) and g = a·softplus(`alpha` + dt_bias) per value head.
    fn delta_prep(&self, s: DeltaPrep, cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<DeltaMats>;

    /// Gated delta rule over every sequence's rows of `x`, continuing `states[i]` (one
    /// `d_v x d_k` matrix per value head, row jv = value index); recurrent or chunked form per
    /// `mode` (equal up to rounding). Returns o [ΣT, n_v_head·d_v].
    fn gated_delta_rule(
        &self,
        h: DeltaHeads,
        spans: &[SeqSpan],
        x: &DeltaMats,
        states: &mut [&mut [f32]],
        mode: DeltaMode,
    ) -> OpResult<Mat>;

    /// `y ← y ⊙ act(g)` element by element (same shapes): the output gates of the DeltaNet
    /// (SiLU of z) and of gated attention (sigmoid).
    fn gate(&self, y: &mut Mat, g: &Mat, act: Gate) -> OpResult<()>;

    /// RouteTable from router logits [T, n_expert]: softmax over all experts, the `k` largest
    /// (ties to the lower id), renormalised to sum 1.
    fn route(&self, logits: &Mat, k: usize) -> OpResult<RouteTable>;

    /// The mixture of experts of `layer` (qwen35moe.md §6.6 steps 4–7):
    /// `y[t] = Σ_j w_tj · E_{id_tj}(x_t) + sigmoid(shared_gate[t]) · S(x_t)`, `E(x) =
    /// down(silu(gate·x) ⊙ up·x)`, `S` the shared expert, `shared_gate` [T, 1]. Returns [T, D].
    fn moe(&self, layer: LayerIdx, x: &Mat, routing: &RouteTable, shared_gate: &Mat) -> OpResult<Mat>;

    /// Rows `rows` of `x`, in that order (the rows that get logits).
    fn select_rows(&self, x: &Mat, rows: &[usize]) -> OpResult<Mat>;
}

/// [`Ops::add_norm_route`] as its three ops ([`Ops::add_rms_norm`], [`Ops::matmul_many`],
/// [`Ops::route`]): the trait's default, and what a backend that fuses it runs where it does not.
#[allow(clippy::too_many_arguments)]
pub fn add_norm_route_ops<O: Ops + ?Sized>(
    ops: &mut O,
    h: Tensor,
    x: Tensor,
    norm: WeightId,
    eps: f32,
    router: WeightId,
    shared_gate: WeightId,
    k: usize,
) -> OpResult<MoeIn> {
    let f = ops.add_rms_norm(h, x, norm, eps)?;
    let gs = ops.matmul_many(&[router, shared_gate], f)?;
    let &[logits, shared_gate] = gs.as_slice() else {
        return Err(OpError::new("add_norm_route", ops.device(), format!("{} outputs", gs.len()), "matmul_many of 2 weights"));
    };
    let routing = ops.route(logits, k)?;
    Ok(MoeIn { x: f, shared_gate, routing })
}
