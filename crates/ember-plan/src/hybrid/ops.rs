//! [`Hybrid`]'s [`SeqStore`] and [`Ops`]: every op is the GPU's ([`ember_cuda::CudaOps`]) but `moe`, which
//! splits a layer's pairs between the resident experts on the GPU and the CPU (module docs of
//! the parent).

use std::sync::Arc;
use std::time::Instant;

use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, DeviceId, ExpertId, ExpertStats, Gate, GatedNorm,
    LayerIdx, Mark, Mat, MoeIn, OpError, OpResult, Ops, RouteTable, Routing, SeqStore, Slot, Snapshot, StateLayout, StoreStats, Tensor,
    WeightId, WeightSet,
};

use super::{Hybrid, MissPath, X_WITH_ROUTING_BYTES, kv_pages_within, say};
impl SeqStore for Hybrid {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.drain()?;
        self.gpu.configure(layout, slots, kv_pages)
    }
    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.drain()?;
        self.gpu.alloc_slot()
    }
    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.drain()?;
        self.gpu.clear_slot(slot)
    }
    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.drain()?;
        self.gpu.slot_len(slot)
    }
    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.drain()?;
        self.gpu.snapshot(slot)
    }
    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.drain()?;
        self.gpu.restore(slot, snap)
    }
    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.drain()?;
        self.gpu.read_delta(slot, layer)
    }
    fn store_stats(&mut self) -> StoreStats {
        self.gpu.store_stats()
    }
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        self.drain()?;
        let free = SeqStore::kv_pages_that_fit(&mut self.gpu, layout, slots)?;
        Ok(kv_pages_within(free, self.kv_cap, layout.page_bytes()))
    }
}

impl Ops for Hybrid {
    fn name(&self) -> &'static str {
        if self.partial.iter().any(|p| *p) { "cuda+cpu" } else { "cuda" }
    }
    fn device(&self) -> DeviceId {
        self.gpu.device()
    }
    fn keep_weights(&mut self, kept: Option<Vec<bool>>) {
        self.gpu.set_weights_kept(kept.clone());
        self.kept = kept;
    }
    /// Uploads the trunk and the resident experts, hottest first in each layer. When the GPU
    /// has less memory than the plan counted on (another process took some since), it starts
    /// smaller: each failed try keeps 3/4 of every layer's experts, the coldest going.
    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.drain()?;
        self.host.set(weights.clone());
        let n_layer = self.resident.len().max(self.heat.n_layer());
        self.owned = (0..n_layer)
            .map(|l| match (&self.kept, weights.moe(LayerIdx(l as u16))) {
                (Some(k), Some(m)) => k.get(m.down.index()).copied().unwrap_or(true),
                _ => true,
            })
            .collect();
        for (l, list) in self.resident.iter_mut().enumerate() {
            if let Some(list) = list {
                list.sort_by(|a, b| self.heat.get(l, *b as usize).total_cmp(&self.heat.get(l, *a as usize)).then(a.cmp(b)));
            }
        }
        let mut tries = 0;
        loop {
            self.gpu.set_resident_experts(self.resident.clone());
            match self.gpu.register(weights.clone()) {
                Ok(()) => break,
                Err(e) if tries < 4 && e.to_string().contains("out of memory") => {
                    tries += 1;
                    let owned = self.owned.clone();
                    for (l, list) in self.resident.iter_mut().enumerate().filter(|(l, _)| owned.get(*l).copied().unwrap_or(true)) {
                        let all = || -> Vec<u16> {
                            let n = weights.moe(LayerIdx(l as u16)).map_or(0, |m| m.n_expert);
                            let mut v: Vec<u16> = (0..n as u16).collect();
                            v.sort_by(|a, b| self.heat.get(l, *b as usize).total_cmp(&self.heat.get(l, *a as usize)).then(a.cmp(b)));
                            v
                        };
                        let v = list.get_or_insert_with(all);
                        v.truncate(v.len() * 3 / 4);
                        if let Some(p) = self.partial.get_mut(l) {
                            *p = true;
                        }
                    }
                    say(format!("expert tier: {e}; starting with fewer experts on the GPU (try {tries})"));
                }
                Err(e) => return Err(e),
            }
        }
        self.cost = self.measure_costs()?;
        Ok(())
    }
    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        self.drain()?;
        self.step_tokens = batch.tokens.len();
        // A step that posted mailboxes and read no rows (a prompt chunk without logits) was
        // never waited for: wait now, so a mailbox wait of it that timed out is reported here,
        // against this batch's predecessor, not some later step (begin_step itself queues the
        // batch's uploads without waiting).
        if std::mem::take(&mut self.posted_unwaited) {
            self.gpu.gpu().sync().map_err(|e| OpError::new("begin_step", self.gpu.device(), "", e.to_string()))?;
        }
        self.gpu.begin_step(batch)?;
        self.unfed = batch.deferred;
        self.check_timeouts()
    }
    fn end_step(&mut self) -> OpResult<()> {
        self.drain()?;
        self.gpu.end_step()?;
        self.heat.advance(self.step_tokens);
        self.stats.tokens += self.step_tokens as u64;
        self.step_tokens = 0;
        if self.unfed {
            self.upkeep_owed = true;
            return Ok(());
        }
        self.upkeep()
    }
    /// Only with every routed expert of every layer on the GPU (a tier's misses wait on the
    /// host mid-step) and no mailbox posted.
    fn defers_tokens(&self) -> bool {
        !self.partial.iter().any(|p| *p) && self.gpu.defers_tokens()
    }
    fn can_defer(&self, batch: &Batch) -> bool {
        self.defers_tokens() && self.posted.is_empty() && !self.posted_unwaited && self.gpu.can_defer(batch)
    }
    fn feed_tokens(&mut self, tokens: &[u32]) -> OpResult<()> {
        let fed = self.gpu.feed_tokens(tokens);
        self.unfed = false;
        fed?;
        if std::mem::take(&mut self.upkeep_owed) {
            self.upkeep()?;
        }
        Ok(())
    }
    fn mark(&self) -> Mark {
        self.gpu.mark()
    }
    /// The host reads no handle's device buffer (misses read their own copies and post their
    /// sums through the mailbox, which a kernel in stream order adds): nothing to drain first.
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        self.gpu.free_since(mark, keep)
    }
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        self.drain()?;
        self.gpu.upload(x)
    }
    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        self.drain()?;
        let m = self.gpu.read(x)?;
        // A read of rows has waited for the stream (one of none has not; begin_step checks).
        if x.n * x.d > 0 {
            self.posted_unwaited = false;
            self.check_timeouts()?;
        }
        Ok(m)
    }
    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<ember_ops::TopRow>> {
        self.drain()?;
        let t = self.gpu.read_top(x, k, extra)?;
        // It waited for the stream when it brought entries down (none asked for: no wait).
        if x.n > 0 && (k.min(x.d) > 0 || extra.iter().flatten().any(|&i| (i as usize) < x.d)) {
            self.posted_unwaited = false;
            self.check_timeouts()?;
        }
        Ok(t)
    }
    fn read_top_begin(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<ember_ops::TopRead> {
        self.drain()?;
        self.gpu.read_top_begin(x, k, extra)
    }
    fn read_top_end(&mut self, r: ember_ops::TopRead) -> OpResult<Vec<ember_ops::TopRow>> {
        let rows = self.gpu.read_top_end(r)?;
        // It waited for the stream (as read_top does when it brings entries down).
        self.posted_unwaited = false;
        self.check_timeouts()?;
        Ok(rows)
    }
    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        self.drain()?;
        self.gpu.read_routing(r)
    }
    /// Serves the posted mailboxes first: the rows are ready only once the GPU has had the
    /// host's sums of the misses, and nothing else of this part waits for the stream before the
    /// next part's layers run.
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<ember_ops::DeviceRows>> {
        self.drain()?;
        self.gpu.export_rows(x)
    }
    fn import_rows(&mut self, rows: &ember_ops::DeviceRows) -> OpResult<Option<(Tensor, ember_ops::QueueMark)>> {
        self.drain()?;
        self.gpu.import_rows(rows)
    }
    fn wait_mark(&mut self, mark: &ember_ops::QueueMark) -> OpResult<()> {
        self.gpu.wait_mark(mark)
    }
    /// Also serves the posted mailboxes: the GPU would wait on them at the first layer with
    /// misses while the host did what comes after the submit.
    fn submit(&mut self) -> OpResult<()> {
        self.gpu.submit()?;
        self.drain()
    }
    fn overlaps(&self) -> bool {
        true
    }
    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        self.gpu.embed(w)
    }
    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        self.gpu.matmul(w, x)
    }
    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        self.gpu.matmul_many(ws, x)
    }
    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        self.gpu.rms_norm(x, w, eps)
    }
    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        self.gpu.add(h, x)
    }
    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        self.gpu.add_rms_norm(h, x, w, eps)
    }
    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        self.gpu.rms_norm_gate(x, w, eps, g, act)
    }
    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        self.gpu.attn_prep(s, qg, k)
    }
    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        // A new KV page's table write waits for the stream, which may wait on a mailbox.
        if !self.posted.is_empty() && self.gpu.kv_append_waits(layer) {
            self.drain()?;
        }
        self.gpu.kv_append(layer, k, v)
    }
    fn attn_prep_append(&mut self, layer: LayerIdx, s: AttnPrep, qg: Tensor, k: Tensor, v: Tensor) -> OpResult<AttnIn> {
        // As kv_append: a new KV page's table write waits for the stream.
        if !self.posted.is_empty() && self.gpu.kv_append_waits(layer) {
            self.drain()?;
        }
        self.gpu.attn_prep_append(layer, s, qg, k, v)
    }
    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        self.gpu.attention(layer, h, q)
    }
    fn attention_gate(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, g: Tensor, act: Gate) -> OpResult<Tensor> {
        self.gpu.attention_gate(layer, h, q, g, act)
    }
    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        self.gpu.conv1d_silu(layer, x, w)
    }
    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        self.gpu.delta_prep(s, cu, b, alpha)
    }
    fn conv_delta_prep(&mut self, layer: LayerIdx, x: Tensor, w: WeightId, s: DeltaPrep, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        self.gpu.conv_delta_prep(layer, x, w, s, b, alpha)
    }
    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        self.gpu.gated_delta_rule(layer, h, x, mode)
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
        self.gpu.delta_rule_norm(layer, h, x, mode, norm, z)
    }
    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        self.gpu.gate(y, g, act)
    }
    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        self.gpu.route(logits, k)
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
        self.gpu.add_norm_route(h, x, norm, eps, router, shared_gate, k)
    }

    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        const OP: &str = "moe";
        let Some(slots) = self.gpu.expert_slots(layer) else { return self.gpu.moe(layer, x, routing, shared_gate) };
        let n_expert = slots.len();
        let small = x.n * x.d * std::mem::size_of::<f32>() <= X_WITH_ROUTING_BYTES;
        // Decode: the mailbox (no wait here), unless the host may wait for the stream mid-step
        // (timed launches or flushes, frees that are not stream-ordered: Gpu::host_waits_ok).
        if small && self.opts.mailbox && self.gpu.gpu().host_waits_ok() {
            return self.moe_posted(layer, x, routing, shared_gate);
        }
        self.drain()?;
        // Decode: x comes down with the routing (X_WITH_ROUTING_BYTES); a prompt's later, if
        // its misses run on the CPU.
        let (table, xh) = if routing.n_tok == 1 || small {
            let (table, xh) = self.gpu.read_routing_with(routing, x)?;
            (table, Some(xh))
        } else {
            (self.gpu.read_routing(routing)?, None)
        };
        let ids: Vec<u32> = table.ids.iter().map(|e| e.0 as u32).collect();
        self.heat.record(layer.index(), &ids).map_err(|e| OpError::new(OP, self.gpu.device(), format!("{layer}"), e.to_string()))?;
        let misses = self.misses(layer, &ids, &table.weights, table.k);
        let n_miss: usize = misses.values().map(Vec::len).sum();
        self.count(layer, ids.len(), n_miss);
        if misses.is_empty() {
            return self.gpu.moe(layer, x, routing, shared_gate);
        }
        // A prompt batch: up or to the CPU, whichever the cost model says is faster.
        if table.n_tok > 1
            && let Some(cost) = self.cost
        {
            let mut bytes = 0u64;
            for &e in misses.keys() {
                let v = self.host.expert(OP, layer, ExpertId(e))?;
                bytes += (v.gate.data.len() + v.up.data.len() + v.down.data.len()) as u64;
            }
            let (cpu, up) = (cost.cpu(misses.len(), n_miss), cost.upload(bytes));
            let go_up = match self.opts.prompt_misses {
                MissPath::Auto => up < cpu,
                MissPath::Cpu => false,
                MissPath::Upload => true,
            };
            if go_up {
                let mut touched: Vec<u16> = ids.iter().filter(|&&e| (e as usize) < n_expert).map(|&e| e as u16).collect();
                touched.sort_unstable();
                touched.dedup();
                let t0 = Instant::now();
                let out = self.gpu.moe_streamed(layer, x, routing, shared_gate, &touched)?;
                let took = t0.elapsed().as_secs_f64();
                // The upload's share of the model follows what it took (the layer's GPU work
                // is queued, not waited for, so this is the upload's time).
                if let Some(c) = self.cost.as_mut() {
                    c.up_per_byte *= (took / up).clamp(0.5, 2.0).powf(0.25);
                }
                self.stats.streamed_pairs += n_miss as u64;
                self.stats.streamed_bytes += bytes;
                return Ok(out);
            }
        }
        let xh = match xh {
            Some(xh) => xh,
            None => self.gpu.read(x)?,
        };
        // The GPU's launches are queued; the CPU computes the misses meanwhile.
        let out = self.gpu.moe(layer, x, routing, shared_gate)?;
        // Recorded launches (a graph-replayed step) go out now, so the GPU runs them while
        // the CPU computes.
        self.gpu.flush()?;
        let t0 = Instant::now();
        let y = self.cpu_misses(layer, &misses, &xh)?;
        let took = t0.elapsed().as_secs_f64();
        if table.n_tok > 1
            && let Some(c) = self.cost.as_mut()
        {
            let want = c.cpu(misses.len(), n_miss);
            let f = (took / want.max(1e-9)).clamp(0.5, 2.0).powf(0.25);
            c.cpu_per_expert *= f;
            c.cpu_per_pair *= f;
        }
        // Queued, not waited for (CudaOps::upload); the add runs after it on the stream.
        let yt = self.gpu.upload(&y)?;
        self.gpu.add(out, yt)?;
        Ok(out)
    }

    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        self.gpu.select_rows(x)
    }

    fn expert_stats(&self) -> Option<ExpertStats> {
        Some(self.stats)
    }

    fn expert_layer_stats(&self) -> Vec<(LayerIdx, u64, u64)> {
        self.per_layer.iter().enumerate().filter(|(_, c)| c.0 + c.1 > 0).map(|(l, c)| (LayerIdx(l as u16), c.0, c.1)).collect()
    }
}
