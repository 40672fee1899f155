//! [`HostBackend`]: [`Ops`] over any [`HostKernels`]. Handles index a per-step arena of host
//! matrices (slot `i` is the `i`-th allocation of the step, so a step that allocates in the same
//! order gets the same ids); sequence state lives in a [`HostStore`]; the step's batch is kept
//! once and every sequence op reads its spans, positions and slots from it.

use std::sync::Arc;

use crate::{
    AttnHeads, AttnIn, AttnMats, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMats, DeltaMode, DeltaPrep, DeviceId, Gate, GatedNorm,
    HostKernels, HostStore, KvCache, LayerIdx, Mark, Mat, MoeIn, OpError, OpResult, Ops, RouteTable, Routing, SeqSpan, SeqStore, Slot,
    SlotId, Snapshot, StateKind, StateLayout, StoreStats, Tensor, TopRead, TopRow, WeightId, WeightSet,
};

/// A host backend: kernels `K`, an arena of [`Mat`]s, a [`HostStore`].
#[derive(Debug)]
pub struct HostBackend<K> {
    kernels: K,
    arena: Vec<Mat>,
    used: usize,
    routes: Vec<RouteTable>,
    n_routes: usize,
    batch: Batch,
    spans: Vec<SeqSpan>,
    slots: Vec<SlotId>,
    pos: Vec<u32>,
    stepping: bool,
    store: HostStore,
}

impl<K: HostKernels> HostBackend<K> {
    pub fn new(kernels: K) -> Self {
        let store = HostStore::new(kernels.device());
        HostBackend {
            kernels,
            arena: Vec::new(),
            used: 0,
            routes: Vec::new(),
            n_routes: 0,
            batch: Batch::default(),
            spans: Vec::new(),
            slots: Vec::new(),
            pos: Vec::new(),
            stepping: false,
            store,
        }
    }

    /// The kernels (their own settings, e.g. threads).
    pub fn kernels(&self) -> &K {
        &self.kernels
    }

    /// The state store (bytes and pages, for tools).
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    fn dev(&self) -> DeviceId {
        self.kernels.device()
    }

    fn put(&mut self, m: Mat) -> Tensor {
        let t = Tensor { id: self.used as u32, n: m.n, d: m.d };
        if self.used < self.arena.len() {
            self.arena[self.used] = m;
        } else {
            self.arena.push(m);
        }
        self.used += 1;
        t
    }

    /// Moves `t`'s matrix out (an op that writes it in place, or reads it without a copy);
    /// [`Self::give`] puts it back.
    fn take(&mut self, op: &'static str, t: Tensor) -> OpResult<Mat> {
        get(&self.arena[..self.used], self.dev(), op, t)?;
        Ok(std::mem::take(&mut self.arena[t.id as usize]))
    }

    fn give(&mut self, t: Tensor, m: Mat) {
        self.arena[t.id as usize] = m;
    }

    fn mat(&self, op: &'static str, t: Tensor) -> OpResult<&Mat> {
        get(&self.arena[..self.used], self.dev(), op, t)
    }

    /// `f` over several handles moved out at once (distinct ids; a repeated id is copied).
    fn with_taken<R>(&mut self, op: &'static str, ts: &[Tensor], f: impl FnOnce(&K, &mut [Mat]) -> R) -> OpResult<R> {
        let mut ms = Vec::with_capacity(ts.len());
        for (i, t) in ts.iter().enumerate() {
            let m = match ts[..i].iter().position(|u| u.id == t.id) {
                Some(j) => {
                    let m: &Mat = &ms[j];
                    m.clone()
                }
                None => self.take(op, *t)?,
            };
            ms.push(m);
        }
        let r = f(&self.kernels, &mut ms);
        for (i, (t, m)) in ts.iter().zip(ms).enumerate().rev() {
            if !ts[..i].iter().any(|u| u.id == t.id) {
                self.give(*t, m);
            }
        }
        Ok(r)
    }

    fn rows_check(&self, op: &'static str, t: Tensor) -> OpResult<()> {
        let n = self.batch.n_rows();
        if t.n != n {
            return Err(OpError::new(op, self.dev(), format!("{}x{}", t.n, t.d), format!("the step's batch has {n} rows")));
        }
        Ok(())
    }
}

fn get<'a>(arena: &'a [Mat], dev: DeviceId, op: &'static str, t: Tensor) -> OpResult<&'a Mat> {
    match arena.get(t.id as usize) {
        Some(m) if m.n == t.n && m.d == t.d => Ok(m),
        _ => Err(OpError::new(op, dev, format!("tensor {} {}x{}", t.id, t.n, t.d), "no such tensor in this step (or freed)")),
    }
}

impl<K: HostKernels> SeqStore for HostBackend<K> {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.store.configure(layout, slots, kv_pages)
    }

    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.store.alloc_slot()
    }

    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.store.clear_slot(slot)
    }

    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.store.slot_len(slot)
    }

    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.store.snapshot(slot)
    }

    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.store.restore(slot, snap)
    }

    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.store.read_delta(slot, layer)
    }

    fn store_stats(&mut self) -> StoreStats {
        self.store.store_stats()
    }

    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        self.store.kv_pages_that_fit(layout, slots)
    }
}

impl<K: HostKernels> Ops for HostBackend<K> {
    fn name(&self) -> &'static str {
        self.kernels.name()
    }

    fn device(&self) -> DeviceId {
        self.dev()
    }

    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.kernels.register(weights)
    }

    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        const OP: &str = "begin_step";
        let dev = self.dev();
        if batch.deferred {
            return Err(OpError::new(OP, dev, "", "a host backend runs each op when called: it cannot wait for a step's tokens"));
        }
        crate::check::batch(OP, dev, batch, |s| self.store.live_len(OP, s))?;
        self.used = 0;
        self.n_routes = 0;
        self.batch.clone_from(batch);
        self.spans = batch.spans();
        self.slots = batch.seqs.iter().map(|s| s.slot).collect();
        self.pos = batch.positions();
        self.stepping = true;
        Ok(())
    }

    fn end_step(&mut self) -> OpResult<()> {
        if std::mem::take(&mut self.stepping) {
            for s in &self.batch.seqs {
                self.store.advance(s.slot, s.n);
            }
        }
        Ok(())
    }

    fn mark(&self) -> Mark {
        Mark(self.used as u32)
    }

    /// A freed handle's matrix is dropped (its memory goes back to the allocator) and its
    /// place holds an empty 0x0 one, which no handle's shape matches (every tensor has columns).
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        for &t in keep {
            self.mat("free_since", t)?;
        }
        for id in (mark.0 as usize).min(self.used)..self.used {
            if !keep.iter().any(|t| t.id as usize == id) {
                self.arena[id] = Mat::default();
            }
        }
        Ok(())
    }

    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        Ok(self.put(x.clone()))
    }

    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        Ok(self.mat("read", x)?.clone())
    }

    /// The rows, copied (host memory is every host backend's): another host backend imports
    /// them; a device backend cannot (it gets them by `read` and `upload`).
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<crate::DeviceRows>> {
        let m = self.mat("export_rows", x)?.clone();
        Ok(Some(crate::DeviceRows { device: self.dev(), ptr: 0, n: m.n, d: m.d, ready: std::sync::Arc::new(m) }))
    }

    fn import_rows(&mut self, rows: &crate::DeviceRows) -> OpResult<Option<(Tensor, crate::QueueMark)>> {
        let Some(m) = rows.ready.downcast_ref::<Mat>() else { return Ok(None) };
        Ok(Some((self.put(m.clone()), std::sync::Arc::new(()))))
    }

    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        match self.routes[..self.n_routes].get(r.id as usize) {
            Some(t) if t.n_tok == r.n_tok && t.k == r.k => Ok(t.clone()),
            _ => Err(OpError::new("read_routing", self.dev(), format!("routing {}", r.id), "no such routing in this step")),
        }
    }

    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        let m = self.kernels.get_rows(w, &self.batch.tokens)?;
        Ok(self.put(m))
    }

    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        let y = self.kernels.matmul(w, self.mat("matmul", x)?)?;
        Ok(self.put(y))
    }

    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        let ys = self.kernels.matmul_many(ws, self.mat("matmul_many", x)?)?;
        Ok(ys.into_iter().map(|y| self.put(y)).collect())
    }

    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        let y = self.kernels.rms_norm(self.mat("rms_norm", x)?, w, eps)?;
        Ok(self.put(y))
    }

    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        self.with_taken("add", &[h, x], |k, m| {
            let (a, b) = m.split_at_mut(1);
            k.add(&mut a[0], &b[0])
        })?
    }

    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        const OP: &str = "attn_prep";
        self.rows_check(OP, qg)?;
        let AttnMats { q, gate, k } = self.kernels.attn_prep(s, self.mat(OP, qg)?, self.mat(OP, k)?, &self.pos)?;
        Ok(AttnIn { q: self.put(q), gate: self.put(gate), k: self.put(k) })
    }

    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        const OP: &str = "kv_append";
        self.rows_check(OP, k)?;
        let a = self.store.ordinal(OP, layer, StateKind::Kv)?;
        let dev = self.kernels.device();
        let (km, vm) = (get(&self.arena[..self.used], dev, OP, k)?, get(&self.arena[..self.used], dev, OP, v)?);
        let (rows, pool) = self.store.kv_of(OP, &self.slots, a)?;
        let mut caches: Vec<KvCache> = rows.into_iter().map(|(k, v)| KvCache { k, v }).collect();
        self.kernels.kv_append(&self.spans, km, vm, &mut caches, pool)
    }

    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        const OP: &str = "attention";
        self.rows_check(OP, q)?;
        let a = self.store.ordinal(OP, layer, StateKind::Kv)?;
        let qm = get(&self.arena[..self.used], self.kernels.device(), OP, q)?;
        let (rows, _) = self.store.kv_of(OP, &self.slots, a)?;
        let caches: Vec<KvCache> = rows.into_iter().map(|(k, v)| KvCache { k, v }).collect();
        let y = self.kernels.attention(h, &self.spans, qm, &caches)?;
        Ok(self.put(y))
    }

    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        const OP: &str = "conv1d_silu";
        self.rows_check(OP, x)?;
        let d = self.store.ordinal(OP, layer, StateKind::Delta)?;
        let xm = get(&self.arena[..self.used], self.kernels.device(), OP, x)?;
        let (mut convs, _) = self.store.delta_of(OP, &self.slots, d)?;
        let y = self.kernels.conv1d_silu(&self.spans, xm, w, &mut convs)?;
        Ok(self.put(y))
    }

    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        const OP: &str = "delta_prep";
        let DeltaMats { q, k, v, g, beta } = self.kernels.delta_prep(s, self.mat(OP, cu)?, self.mat(OP, b)?, self.mat(OP, alpha)?)?;
        Ok(DeltaIn { q: self.put(q), k: self.put(k), v: self.put(v), g: self.put(g), beta: self.put(beta) })
    }

    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        const OP: &str = "gated_delta_rule";
        self.rows_check(OP, x.q)?;
        let d = self.store.ordinal(OP, layer, StateKind::Delta)?;
        // The inputs are moved out of the arena for the call (no copies) and put back after.
        let ts = [x.q, x.k, x.v, x.g, x.beta];
        let mut ms = Vec::with_capacity(5);
        for (i, t) in ts.iter().enumerate() {
            ms.push(if ts[..i].iter().any(|u| u.id == t.id) { self.mat(OP, *t)?.clone() } else { self.take(OP, *t)? });
        }
        let [q, k, v, g, beta]: [Mat; 5] = ms.try_into().unwrap_or_else(|_| unreachable!("five inputs"));
        let mats = DeltaMats { q, k, v, g, beta };
        let res = match self.store.delta_of(OP, &self.slots, d) {
            Ok((_, mut recs)) => self.kernels.gated_delta_rule(h, &self.spans, &mats, &mut recs, mode),
            Err(e) => Err(e),
        };
        let DeltaMats { q, k, v, g, beta } = mats;
        for (i, (t, m)) in ts.iter().zip([q, k, v, g, beta]).enumerate() {
            if !ts[..i].iter().any(|u| u.id == t.id) {
                self.give(*t, m);
            }
        }
        Ok(self.put(res?))
    }

    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        self.with_taken("gate", &[y, g], |k, m| {
            let (a, b) = m.split_at_mut(1);
            k.gate(&mut a[0], &b[0], act)
        })?
    }

    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        let t = self.kernels.route(self.mat("route", logits)?, k)?;
        let r = Routing { id: self.n_routes as u32, n_tok: t.n_tok, k: t.k };
        if self.n_routes < self.routes.len() {
            self.routes[self.n_routes] = t;
        } else {
            self.routes.push(t);
        }
        self.n_routes += 1;
        Ok(r)
    }

    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        const OP: &str = "moe";
        let table = match self.routes[..self.n_routes].get(routing.id as usize) {
            Some(t) if t.n_tok == routing.n_tok && t.k == routing.k => t,
            _ => return Err(OpError::new(OP, self.dev(), format!("routing {}", routing.id), "no such routing in this step")),
        };
        let y = self.kernels.moe(layer, self.mat(OP, x)?, table, self.mat(OP, shared_gate)?)?;
        Ok(self.put(y))
    }

    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        const OP: &str = "select_rows";
        self.rows_check(OP, x)?;
        let rows: Vec<usize> = self.batch.logit_rows.iter().map(|&r| r as usize).collect();
        let y = self.kernels.select_rows(self.mat(OP, x)?, &rows)?;
        Ok(self.put(y))
    }
}

/// A backend chosen at run time (`--device`) is a `Box<dyn Ops>`: it forwards every call.
#[deny(clippy::missing_trait_methods)]
impl<T: SeqStore + ?Sized> SeqStore for Box<T> {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        (**self).configure(layout, slots, kv_pages)
    }
    fn alloc_slot(&mut self) -> OpResult<Slot> {
        (**self).alloc_slot()
    }
    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        (**self).clear_slot(slot)
    }
    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        (**self).slot_len(slot)
    }
    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        (**self).snapshot(slot)
    }
    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        (**self).restore(slot, snap)
    }
    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        (**self).read_delta(slot, layer)
    }
    fn store_stats(&mut self) -> StoreStats {
        (**self).store_stats()
    }
    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        (**self).kv_pages_that_fit(layout, slots)
    }
}

// Every method forwards, the trait's defaults too (a default left out would run the default
// on a boxed backend that overrides it: a split's parts are boxed).
#[deny(clippy::missing_trait_methods)]
impl<T: Ops + ?Sized> Ops for Box<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn device(&self) -> DeviceId {
        (**self).device()
    }
    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        (**self).register(weights)
    }
    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        (**self).begin_step(batch)
    }
    fn end_step(&mut self) -> OpResult<()> {
        (**self).end_step()
    }
    fn mark(&self) -> Mark {
        (**self).mark()
    }
    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        (**self).free_since(mark, keep)
    }
    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        (**self).upload(x)
    }
    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        (**self).read(x)
    }
    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        (**self).read_routing(r)
    }
    fn read_top_begin(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<TopRead> {
        (**self).read_top_begin(x, k, extra)
    }
    fn read_top_end(&mut self, r: TopRead) -> OpResult<Vec<TopRow>> {
        (**self).read_top_end(r)
    }
    fn defers_tokens(&self) -> bool {
        (**self).defers_tokens()
    }
    fn can_defer(&self, batch: &Batch) -> bool {
        (**self).can_defer(batch)
    }
    fn feed_tokens(&mut self, tokens: &[u32]) -> OpResult<()> {
        (**self).feed_tokens(tokens)
    }
    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        (**self).embed(w)
    }
    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        (**self).matmul(w, x)
    }
    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        (**self).matmul_many(ws, x)
    }
    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        (**self).rms_norm(x, w, eps)
    }
    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        (**self).add(h, x)
    }
    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        (**self).add_rms_norm(h, x, w, eps)
    }
    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        (**self).rms_norm_gate(x, w, eps, g, act)
    }
    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        (**self).attn_prep(s, qg, k)
    }
    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        (**self).kv_append(layer, k, v)
    }
    fn attn_prep_append(&mut self, layer: LayerIdx, s: AttnPrep, qg: Tensor, k: Tensor, v: Tensor) -> OpResult<AttnIn> {
        (**self).attn_prep_append(layer, s, qg, k, v)
    }
    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        (**self).attention(layer, h, q)
    }
    fn attention_gate(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, g: Tensor, act: Gate) -> OpResult<Tensor> {
        (**self).attention_gate(layer, h, q, g, act)
    }
    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        (**self).conv1d_silu(layer, x, w)
    }
    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        (**self).delta_prep(s, cu, b, alpha)
    }
    fn conv_delta_prep(&mut self, layer: LayerIdx, x: Tensor, w: WeightId, s: DeltaPrep, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        (**self).conv_delta_prep(layer, x, w, s, b, alpha)
    }
    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        (**self).gated_delta_rule(layer, h, x, mode)
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
        (**self).delta_rule_norm(layer, h, x, mode, norm, z)
    }
    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        (**self).gate(y, g, act)
    }
    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        (**self).route(logits, k)
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
        (**self).add_norm_route(h, x, norm, eps, router, shared_gate, k)
    }
    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        (**self).moe(layer, x, routing, shared_gate)
    }
    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        (**self).select_rows(x)
    }
    fn expert_stats(&self) -> Option<crate::ExpertStats> {
        (**self).expert_stats()
    }
    fn expert_layer_stats(&self) -> Vec<(LayerIdx, u64, u64)> {
        (**self).expert_layer_stats()
    }
    fn keep_weights(&mut self, kept: Option<Vec<bool>>) {
        (**self).keep_weights(kept)
    }
    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<crate::TopRow>> {
        (**self).read_top(x, k, extra)
    }
    fn submit(&mut self) -> OpResult<()> {
        (**self).submit()
    }
    fn overlaps(&self) -> bool {
        (**self).overlaps()
    }
    fn export_rows(&mut self, x: Tensor) -> OpResult<Option<crate::DeviceRows>> {
        (**self).export_rows(x)
    }
    fn import_rows(&mut self, rows: &crate::DeviceRows) -> OpResult<Option<(Tensor, crate::QueueMark)>> {
        (**self).import_rows(rows)
    }
    fn wait_mark(&mut self, mark: &crate::QueueMark) -> OpResult<()> {
        (**self).wait_mark(mark)
    }
    fn layer_device(&self, layer: LayerIdx) -> DeviceId {
        (**self).layer_device(layer)
    }
}
