//! [`CudaOps`]'s [`Ops`]: each op's shape checks, then its kernels (the module docs of the
//! parent say how a step runs).

use std::sync::Arc;

use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, DeviceId, Gate, GatedNorm, LayerIdx, Mark, Mat, MoeIn,
    OpError, OpResult, Ops, RouteTable, Routing, Tensor, WeightId, WeightSet, check,
};

use crate::Buf;
use crate::ops::{GEMV_MULTI, GEMV_Q8_MULTI};

use super::read::CudaMark;
use super::weights::DevWeights;
use super::{CudaOps, GRAPH_MAX_ROWS, act_of, check_matmul, cuda, put_all, shape_of};

impl Ops for CudaOps {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> DeviceId {
        self.dev
    }

    fn keep_weights(&mut self, kept: Option<Vec<bool>>) {
        self.set_weights_kept(kept);
    }

    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        // The old set's memory goes first.
        self.weights = DevWeights::empty(self.dev);
        // Every kernel compiles (or comes from the disk cache) while the weights go up.
        let gpu = &self.gpu;
        let up = gpu
            .preparing_kernels(|| DevWeights::upload(gpu, self.dev, weights, &self.resident, self.kept.as_deref()))
            .map_err(|e| OpError::new("register", self.dev, "", e.to_string()));
        gpu.release_staging();
        self.weights = up??;
        Ok(())
    }

    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        const OP: &str = "begin_step";
        let dev = self.dev;
        if self.release_feed() {
            // Its caller failed between queuing it and feeding it, and did not feed it: a bug
            // of the caller's, reported here (the device went on with token 0).
            self.stepping = false;
            return Err(OpError::new(OP, dev, "", "the deferred step before this one was never fed its tokens"));
        }
        if batch.deferred && !self.can_defer(batch) {
            return Err(OpError::new(OP, dev, "", "this step cannot wait for its tokens on the device (Ops::can_defer)"));
        }
        if batch.deferred && self.feed.is_none() {
            self.feed = Some(self.gpu.feed(super::FEED_ROWS).map_err(cuda(OP, dev))?);
        }
        let graphs = self.gpu.graphs();
        if let Some(t) = &mut self.times {
            t.begin(batch.n_rows() == 1 && graphs);
        }
        self.store.collect();
        ember_ops::check::batch(OP, dev, batch, |s| self.store.live_len(OP, s))?;
        self.stepping = false;
        self.arena.reset();
        self.routes.reset();
        self.q8_x = None;
        self.batch.clone_from(batch);
        self.spans = batch.spans();
        self.slots = batch.seqs.iter().map(|s| s.slot).collect();
        self.pos = batch.positions();
        let row_slot: Vec<u32> = batch.seqs.iter().flat_map(|s| std::iter::repeat_n(s.slot.0, s.n)).collect();
        let row0: Vec<u32> = self.spans.iter().map(|s| s.row0 as u32).collect();
        let seq_n: Vec<u32> = self.spans.iter().map(|s| s.n as u32).collect();
        let slot: Vec<u32> = self.slots.iter().map(|s| s.0).collect();
        self.generation = self.generation.checked_add(1).unwrap_or(1);
        let generation = [self.generation];
        let (g, st) = (&self.gpu, &mut self.step);
        let mut items = [
            (&mut st.tokens, &batch.tokens[..]),
            (&mut st.pos, &self.pos[..]),
            (&mut st.row_slot, &row_slot[..]),
            (&mut st.logit_rows, &batch.logit_rows[..]),
            (&mut st.seq_row0, &row0[..]),
            (&mut st.seq_n, &seq_n[..]),
            (&mut st.seq_slot, &slot[..]),
            (&mut st.generation, &generation[..]),
        ];
        put_all(g, &mut items).map_err(cuda(OP, dev))?;
        // A deferred step's KV pages are taken and their table queued now, before its wait for
        // the tokens: its kv_appends then write nothing from the host (can_defer checked the
        // pool has them).
        if batch.deferred {
            let ns: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
            for a in 0..self.store.n_kv() {
                self.store.reserve(g, OP, &self.slots, &ns, a)?;
            }
            self.store.sync_table(g, OP)?;
        }
        // A small step's launches are recorded from here and replayed as CUDA graphs (in lists
        // of 32, 64, .. 512 launches, and at the first call that touches the stream: `read`,
        // an upload, a page table write; see crate::graph).
        if batch.n_rows() <= GRAPH_MAX_ROWS {
            // A deferred step's launches wait behind the step before it anyway: its first list
            // may be as long as `EMBER_AHEAD_FIRST` says (for measuring a step in one graph: the
            // boundaries between a step's graphs have no programmatic edge).
            static AHEAD_FIRST: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
            let ahead_first = *AHEAD_FIRST
                .get_or_init(|| std::env::var("EMBER_AHEAD_FIRST").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0));
            g.begin_record_with(if batch.deferred { ahead_first } else { None }, batch.deferred);
        }
        if let Some(t) = &mut self.times {
            t.recording();
        }
        // A deferred step starts by waiting on the device for its tokens (`feed_tokens`).
        if batch.deferred
            && let Some(feed) = &self.feed
        {
            g.feed_wait(feed, &st.generation, &mut st.tokens, batch.n_rows(), crate::FEED_TIMEOUT_NS).map_err(cuda(OP, dev))?;
            self.unfed = Some(self.generation);
        }
        self.stepping = true;
        Ok(())
    }

    fn defers_tokens(&self) -> bool {
        // `EMBER_RUN_AHEAD=0`: never (A/B runs). Not while launches are timed or traced step by
        // step (their waits), nor without stream-ordered frees (a free would wait).
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        crate::ops::switch(&ON, "EMBER_RUN_AHEAD") && self.times.is_none() && self.gpu.host_waits_ok()
    }

    /// Also: no deferred step waits already, the step is recorded (graphs on, at most
    /// `GRAPH_MAX_ROWS` rows: a few graph launches behind the wait, not ~500 kernels), the pool
    /// has the step's KV pages (`begin_step` takes them and queues their table before the
    /// wait), and every cache is at its sequence's position.
    fn can_defer(&self, batch: &Batch) -> bool {
        self.defers_tokens()
            && self.unfed.is_none()
            && self.gpu.graphs()
            && (1..=GRAPH_MAX_ROWS.min(super::FEED_ROWS)).contains(&batch.n_rows())
            && self.kv_appends_stay_on_device(batch)
    }

    fn feed_tokens(&mut self, tokens: &[u32]) -> OpResult<()> {
        const OP: &str = "feed_tokens";
        let Some(generation) = self.unfed else {
            return Err(OpError::new(OP, self.dev, "", "no deferred step waits for tokens"));
        };
        let n = self.batch.n_rows();
        if tokens.len() != n {
            self.release_feed();
            return Err(OpError::new(OP, self.dev, format!("{} tokens", tokens.len()), format!("the deferred step has {n} rows")));
        }
        let Some(feed) = &self.feed else { return Err(OpError::new(OP, self.dev, "", "no feed")) };
        let written = feed.write(generation, tokens).map_err(cuda(OP, self.dev));
        if written.is_err() {
            self.release_feed();
            return written;
        }
        self.unfed = None;
        self.batch.tokens.copy_from_slice(tokens);
        Ok(())
    }

    fn end_step(&mut self) -> OpResult<()> {
        self.gpu.end_record().map_err(cuda("end_step", self.dev))?;
        if std::mem::take(&mut self.stepping) {
            for s in &self.batch.seqs {
                self.store.advance(s.slot, s.n);
            }
        }
        Ok(())
    }

    fn mark(&self) -> Mark {
        self.arena.mark()
    }

    /// The buffers become the arena's spares: stream order keeps a later kernel's writes to a
    /// reused buffer after every earlier kernel's reads of it.
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        self.settle_before_free(mark, keep)?;
        self.arena.free_since("free_since", mark, keep)
    }

    /// The copy is queued, not waited for ([`crate::Gpu::write_async`]; a large matrix waits).
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        const OP: &str = "upload";
        if x.data.len() != x.n * x.d {
            return Err(OpError::new(OP, self.dev, format!("{}x{}", x.n, x.d), format!("{} values", x.data.len())));
        }
        let t = self.arena.alloc(&self.gpu, OP, x.n, x.d)?;
        let (_, mut outs) = self.arena.split(t.id);
        self.gpu.write_async(outs[0], &x.data).map_err(cuda(OP, self.dev))?;
        Ok(t)
    }

    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        self.settle("read", x)?;
        self.read_rows(x)
    }

    /// See [`CudaOps::read_top_entries`].
    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<ember_ops::TopRow>> {
        self.settle("read_top", x)?;
        self.read_top_entries(x, k, extra)
    }

    /// See [`CudaOps::read_top_queue`].
    fn read_top_begin(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<ember_ops::TopRead> {
        self.settle("read_top_begin", x)?;
        self.read_top_queue(x, k, extra)
    }

    fn read_top_end(&mut self, r: ember_ops::TopRead) -> OpResult<Vec<ember_ops::TopRow>> {
        self.read_top_wait(r)
    }

    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        self.settle_route("read_routing", r)?;
        Ok(self.download_routing("read_routing", r, None)?.0)
    }

    /// See [`CudaOps::export_rows_at`].
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<ember_ops::DeviceRows>> {
        self.settle("export_rows", x)?;
        self.export_rows_at(x)
    }

    /// See [`CudaOps::import_rows_from`].
    fn import_rows(&mut self, rows: &ember_ops::DeviceRows) -> OpResult<Option<(Tensor, ember_ops::QueueMark)>> {
        self.import_rows_from(rows)
    }

    fn submit(&mut self) -> OpResult<()> {
        self.gpu.flush().map_err(cuda("submit", self.dev))
    }

    fn overlaps(&self) -> bool {
        true
    }

    fn wait_mark(&mut self, mark: &ember_ops::QueueMark) -> OpResult<()> {
        match mark.downcast_ref::<CudaMark>() {
            Some(m) => self.gpu.wait_event(&m.event).map_err(cuda("wait_mark", self.dev)),
            None => Ok(()),
        }
    }

    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        const OP: &str = "embed";
        let (info, dw) = self.weights.matrix(OP, w)?;
        check::get_rows(OP, self.dev, info, &self.batch.tokens)?;
        let n = self.batch.tokens.len();
        let y = self.arena.alloc(&self.gpu, OP, n, info.k)?;
        let (_, mut outs) = self.arena.split(y.id);
        self.gpu.get_rows(dw, &self.step.tokens, n, outs[0]).map_err(cuda(OP, self.dev))?;
        Ok(y)
    }

    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        const OP: &str = "matmul";
        self.arena.check(OP, x)?;
        let (info, dw) = self.weights.matrix(OP, w)?;
        check_matmul(OP, self.dev, info, x)?;
        let held = self.q8_holds(x) && self.gpu.uses_gemv_q8(dw.ty, dw.k, x.n, self.precision);
        let y = self.arena.alloc(&self.gpu, OP, x.n, info.n_rows)?;
        let (ins, mut outs) = self.arena.split(y.id);
        if held {
            self.gpu.gemv_q8_quantized(&[dw.all()], dw.k, &mut [&mut outs[0]]).map_err(cuda(OP, self.dev))?;
        } else {
            self.gpu.matmul_prec(dw.all(), &ins[x.id as usize], x.n, outs[0], self.precision).map_err(cuda(OP, self.dev))?;
        }
        Ok(y)
    }

    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        const OP: &str = "matmul_many";
        self.arena.check(OP, x)?;
        for &w in ws {
            check_matmul(OP, self.dev, self.weights.matrix(OP, w)?.0, x)?;
        }
        let mut ys = Vec::with_capacity(ws.len());
        for &w in ws {
            let rows = self.weights.matrix(OP, w)?.0.n_rows;
            ys.push(self.arena.alloc(&self.gpu, OP, x.n, rows)?);
        }
        let Some(first) = ys.first().map(|y| y.id) else { return Ok(ys) };
        let held = self.q8_holds(x);
        let (ins, mut outs) = self.arena.split(first);
        let xb = &ins[x.id as usize];
        let dws = ws.iter().map(|&w| Ok(self.weights.matrix(OP, w)?.1)).collect::<OpResult<Vec<_>>>()?;
        // Weights the GEMV runs go in launches of up to GEMV_MULTI of one type and k (a
        // layer's projections of one input: one launch each type instead of one per weight);
        // the rest one by one.
        let mut done = vec![false; dws.len()];
        // One-token Fast steps: x quantised to int8 once for every weight that takes the int8
        // GEMV.
        let q8 = |i: usize| self.gpu.uses_gemv_q8(dws[i].ty, dws[i].k, x.n, self.precision);
        let mut quantized = false;
        for j in 0..dws.len() {
            if done[j] {
                continue;
            }
            let (ty, k) = (dws[j].ty, dws[j].k);
            if q8(j) {
                // Weights of other int8 types join (one launch, gemv_q8_mixed) unless
                // EMBER_GEMV_MIXED=0; not those large enough for gemv_q8_rows, which takes a
                // weight alone (the output head's size), nor others with them.
                let small = |i: usize| dws[i].n_rows * dws[i].row_bytes < crate::ops::GEMV_Q8_ROWS_MIN_BYTES;
                let mixed = crate::ops::gemv_q8_mixed_on() && small(j);
                let group: Vec<usize> = (j..dws.len())
                    .filter(|&i| !done[i] && dws[i].k == k && (dws[i].ty == ty || mixed && q8(i) && small(i)))
                    .take(GEMV_Q8_MULTI)
                    .collect();
                let refs: Vec<_> = group.iter().map(|&i| dws[i].all()).collect();
                let mut ys_g: Vec<&mut Buf<f32>> =
                    outs.iter_mut().take(dws.len()).enumerate().filter(|(i, _)| group.contains(i)).map(|(_, y)| &mut **y).collect();
                if !quantized && !held {
                    self.gpu.quantize_q8(xb, k).map_err(cuda(OP, self.dev))?;
                }
                quantized = true;
                self.gpu.gemv_q8_quantized(&refs, k, &mut ys_g).map_err(cuda(OP, self.dev))?;
                for &i in &group {
                    done[i] = true;
                }
                continue;
            }
            if !self.gpu.uses_gemv(k, x.n, self.precision) {
                self.gpu.matmul_prec(dws[j].all(), xb, x.n, outs[j], self.precision).map_err(cuda(OP, self.dev))?;
                done[j] = true;
                continue;
            }
            let group: Vec<usize> = (j..dws.len()).filter(|&i| !done[i] && dws[i].ty == ty && dws[i].k == k).take(GEMV_MULTI).collect();
            let refs: Vec<_> = group.iter().map(|&i| dws[i].all()).collect();
            let mut ys_g: Vec<&mut Buf<f32>> =
                outs.iter_mut().take(dws.len()).enumerate().filter(|(i, _)| group.contains(i)).map(|(_, y)| &mut **y).collect();
            self.gpu.matmul_multi_prec(&refs, xb, x.n, &mut ys_g, self.precision).map_err(cuda(OP, self.dev))?;
            for &i in &group {
                done[i] = true;
            }
        }
        Ok(ys)
    }

    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        const OP: &str = "rms_norm";
        self.arena.check(OP, x)?;
        let wv = self.weights.vector(OP, w)?;
        check::rms_norm(OP, self.dev, &shape_of(x), wv.len())?;
        let y = self.arena.alloc(&self.gpu, OP, x.n, x.d)?;
        let (ins, mut outs) = self.arena.split(y.id);
        // One token under Fast: the int8 copy the next GEMVs read, in the same launch.
        if self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, x.d, x.n, self.precision) && wv.len() == x.d {
            let generation = self.gpu.rms_norm_q8(&ins[x.id as usize], x.n, x.d, wv, eps, outs[0]).map_err(cuda(OP, self.dev))?;
            self.q8_x = Some((y.id, generation));
        } else {
            self.gpu.rms_norm(&ins[x.id as usize], x.n, x.d, wv, eps, outs[0]).map_err(cuda(OP, self.dev))?;
        }
        Ok(y)
    }

    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        const OP: &str = "add";
        if let Some(p) = self.arena.pending(x)
            && h.id != x.id
        {
            // A one-launch MoE's output: its experts' rows straight into h.
            self.arena.check(OP, h)?;
            self.arena.check_live(OP, x)?;
            check::same(OP, self.dev, &shape_of(h), &shape_of(x))?;
            if self.q8_x.is_some_and(|(id, _)| id == h.id) {
                self.q8_x = None; // h changes: its int8 copy is stale
            }
            let (hb, pb) = self.arena.pair(h.id, p.parts);
            return self.gpu.add_parts(hb, pb, p.n, h.n * h.d, false).map_err(cuda(OP, self.dev));
        }
        self.settle(OP, x)?;
        self.in_place(OP, h, x, |g, h, x, n| g.add(h, x, n))
    }

    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        const OP: &str = "add_rms_norm";
        if let Some(p) = self.arena.pending(x)
            && h.id != x.id
            && let Some(y) = self.add_rms_norm_parts(h, x, p, w, eps)?
        {
            return Ok(y);
        }
        self.settle(OP, x)?;
        if h.id == x.id {
            self.add(h, x)?;
            return self.rms_norm(h, w, eps);
        }
        self.arena.check(OP, h)?;
        self.arena.check(OP, x)?;
        check::same(OP, self.dev, &shape_of(h), &shape_of(x))?;
        let wv = self.weights.vector(OP, w)?;
        check::rms_norm(OP, self.dev, &shape_of(h), wv.len())?;
        if self.q8_x.is_some_and(|(id, _)| id == h.id) {
            self.q8_x = None; // h changes: its int8 copy is stale
        }
        let y = self.arena.alloc(&self.gpu, OP, h.n, h.d)?;
        let (hb, xb, yb) = self.arena.trio(h.id, x.id, y.id);
        // As rms_norm: one token under Fast also gets the int8 copy.
        if self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, h.d, h.n, self.precision) && wv.len() == h.d {
            let generation = self.gpu.add_rms_norm_q8(hb, xb, h.n, h.d, wv, eps, yb).map_err(cuda(OP, self.dev))?;
            self.q8_x = Some((y.id, generation));
        } else {
            self.gpu.add_rms_norm(hb, xb, h.n, h.d, wv, eps, yb).map_err(cuda(OP, self.dev))?;
        }
        Ok(y)
    }

    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        self.attn_prep_with(s, qg, k, None)
    }

    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        const OP: &str = "kv_append";
        let (a, at_pos0) = self.kv_prepare(OP, layer, k, v)?;
        let pages = self.store.kv_pages(OP, self.dev, a)?;
        let pos = if at_pos0 { &self.step.pos } else { &self.step.kv_pos };
        let (kb, vb) = (self.arena.buf(OP, k)?, self.arena.buf(OP, v)?);
        self.gpu.kv_append(&pages, kb, vb, k.n, &self.step.row_slot, pos).map_err(cuda(OP, self.dev))
    }

    /// Where the GPU does that (`EMBER_ATTN_PREP_KV=1`, head_dim a multiple of 32), attn_prep's
    /// k heads write their rows of k and v into the caches themselves: one launch, the two ops'
    /// bits.
    fn attn_prep_append(&mut self, layer: LayerIdx, s: AttnPrep, qg: Tensor, k: Tensor, v: Tensor) -> OpResult<AttnIn> {
        if !self.gpu.attn_prep_kv_on() || !self.gpu.attn_prep_writes_kv(s.head_dim) {
            let a = self.attn_prep(s, qg, k)?;
            self.kv_append(layer, a.k, v)?;
            return Ok(a);
        }
        self.attn_prep_with(s, qg, k, Some((layer, v)))
    }

    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        Ok(self.attention_with(layer, h, q, None)?.0)
    }

    /// The gate in the attention's own launches where the GPU does that for this call
    /// (`EMBER_ATTN_GATE=1`: the tensor-core decode kernel; [`crate::Gpu::attention_gates`]),
    /// else the two ops.
    fn attention_gate(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, g: Tensor, act: Gate) -> OpResult<Tensor> {
        let (y, gated) = self.attention_with(layer, h, q, Some((g, act)))?;
        if !gated {
            self.gate(y, g, act)?;
        }
        Ok(y)
    }

    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        self.conv_op(layer, x, w)
    }

    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        self.prep_op(s, cu, b, alpha)
    }

    fn conv_delta_prep(&mut self, layer: LayerIdx, x: Tensor, w: WeightId, s: DeltaPrep, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        self.conv_prep_op(layer, x, w, s, b, alpha)
    }

    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        self.rule_op(layer, h, x, mode)
    }

    fn delta_rule_norm(
        &mut self,
        layer: LayerIdx,
        h: DeltaHeads,
        x: DeltaIn,
        mode: DeltaMode,
        norm: GatedNorm,
        z: Tensor,
    ) -> OpResult<Tensor> {
        self.rule_norm_op(layer, h, x, mode, norm, z)
    }

    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        let act = act_of(act);
        // One token under Fast: the int8 copy the next GEMV reads, in the same launch.
        if self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, y.d, y.n, self.precision) && y.id != g.id {
            let mut generation = 0;
            self.in_place("gate", y, g, |gpu, y, g, n| gpu.gate_q8(y, g, n, act).map(|gen_| generation = gen_))?;
            self.q8_x = Some((y.id, generation));
            return Ok(());
        }
        self.in_place("gate", y, g, |gpu, y, g, n| gpu.gate(y, g, n, act))
    }

    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        const OP: &str = "rms_norm_gate";
        self.arena.check(OP, x)?;
        self.arena.check(OP, g)?;
        check::same(OP, self.dev, &shape_of(x), &shape_of(g))?;
        let wv = self.weights.vector(OP, w)?;
        check::rms_norm(OP, self.dev, &shape_of(x), wv.len())?;
        let act = act_of(act);
        let y = self.arena.alloc(&self.gpu, OP, x.n, x.d)?;
        let (ins, mut outs) = self.arena.split(y.id);
        let (xb, gb) = (&ins[x.id as usize], &ins[g.id as usize]);
        // One token under Fast: the int8 copy the next GEMV reads, in the same launch.
        if self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, x.d, x.n, self.precision) && wv.len().is_multiple_of(32) {
            let generation = self.gpu.rms_norm_gate_q8(xb, x.n, x.d, wv, eps, gb, act, outs[0]).map_err(cuda(OP, self.dev))?;
            self.q8_x = Some((y.id, generation));
        } else {
            self.gpu.rms_norm_gate(xb, x.n, x.d, wv, eps, gb, act, outs[0]).map_err(cuda(OP, self.dev))?;
        }
        Ok(y)
    }

    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        self.route_op(logits, k)
    }

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
        match self.moe_route_fused(h, x, norm, eps, router, shared_gate, k)? {
            Some(r) => Ok(r),
            None => ember_ops::add_norm_route_ops(self, h, x, norm, eps, router, shared_gate, k),
        }
    }

    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        self.moe_on(layer, x, routing, shared_gate, false)
    }

    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        const OP: &str = "select_rows";
        self.rows_check(OP, x)?;
        self.arena.check(OP, x)?;
        let rows: Vec<usize> = self.batch.logit_rows.iter().map(|&r| r as usize).collect();
        check::select_rows(OP, self.dev, &shape_of(x), &rows)?;
        let y = self.arena.alloc(&self.gpu, OP, rows.len(), x.d)?;
        let (ins, mut outs) = self.arena.split(y.id);
        self.gpu.select_rows(&ins[x.id as usize], x.n, x.d, &self.step.logit_rows, rows.len(), outs[0]).map_err(cuda(OP, self.dev))?;
        Ok(y)
    }
}
