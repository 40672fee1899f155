//! The model's layers split across backends (issue 16: two GPUs of different sizes).
//!
//! [`Split`] is one [`Ops`] + [`SeqStore`] over several parts, each a whole backend (a GPU with
//! its expert tier, or the CPU): per layer, the part that runs it, as the planner's
//! `layer_home` says. Every op runs on the part that holds what it reads: an op with a weight
//! where the weight's layer is (the embeddings on the first part, the output norm and head on
//! the last), a layer's state ops where the layer is, the others where their first input is.
//! A handle is the split's own id for a part's handle; an input on another part is read there
//! and uploaded here (the hidden state crosses once per range boundary a step), and the handle
//! then names the copy (an in-place op's target moves with it).
//!
//! State: a slot or snapshot of the split is one of each part; the batch's slots are
//! translated for each part. A part's store holds its own layers' state (the others are
//! [`StateKind::Elsewhere`] there) and its attention layers' share of the KV pool. Every part is
//! given every weight and told which are its own ([`Ops::keep_weights`], [`part_weights`]): a
//! GPU part uploads only those, the CPU reads the mapped file.

use std::sync::Arc;

use ember_ops::store::Reclaim;
use ember_ops::{
    AttnHeads, AttnIn, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, DeviceId, ExpertStats, Gate, GatedNorm, LayerIdx, Mark,
    Mat, OpError, OpResult, Ops, RouteTable, Routing, SeqStore, Slot, SlotId, SnapInfo, Snapshot, StateKind, StateLayout, StoreStats,
    Tensor, WeightId, WeightSet,
};

/// Backends that run the model's layers by range.
pub struct Split {
    parts: Vec<Box<dyn Ops>>,
    /// Per layer, the part that runs it.
    layer_part: Vec<usize>,
    /// Per weight id, the part its ops run on (set by [`Ops::register`]).
    weight_part: Vec<usize>,
    /// This step's handles: the split's id is the index; the part and its handle there.
    handles: Vec<Option<(usize, Tensor)>>,
    routings: Vec<(usize, Routing)>,
    /// This step's marks (a [`Mark`] is an index here): the handles made before it, and each
    /// part's mark. Behind a lock because [`Ops::mark`] takes `&self`.
    marks: std::sync::Mutex<Vec<(usize, Vec<Mark>)>>,
    reclaim: Arc<Reclaim>,
    /// Per split slot id, each part's slot.
    slots: Vec<Option<Vec<Slot>>>,
    /// Per split snapshot id, each part's snapshot.
    snaps: Vec<Option<Vec<Snapshot>>>,
}

impl Split {
    /// `layer_part[l]`: the index in `parts` of the backend that runs layer l. Every part runs
    /// at least one layer, and a part's layers are one range (the hidden state crosses each
    /// boundary once).
    pub fn new(parts: Vec<Box<dyn Ops>>, layer_part: Vec<usize>) -> OpResult<Split> {
        let dev = parts.first().map_or(DeviceId::Host, |p| p.device());
        let bad = |why: String| Err(OpError::new("split", dev, format!("{} parts, layers {layer_part:?}", parts.len()), why));
        if parts.is_empty() || layer_part.is_empty() {
            return bad("no parts or no layers".into());
        }
        if let Some(p) = layer_part.iter().find(|&&p| p >= parts.len()) {
            return bad(format!("part {p} does not exist"));
        }
        if (0..parts.len()).any(|p| !layer_part.contains(&p)) {
            return bad("every part runs at least one layer".into());
        }
        if layer_part.windows(2).any(|w| w[1] < w[0]) {
            return bad("each part's layers are one range, in the parts' order".into());
        }
        Ok(Split {
            parts,
            layer_part,
            weight_part: Vec::new(),
            handles: Vec::new(),
            routings: Vec::new(),
            marks: Default::default(),
            reclaim: Reclaim::new(),
            slots: Vec::new(),
            snaps: Vec::new(),
        })
    }

    pub fn parts(&self) -> &[Box<dyn Ops>] {
        &self.parts
    }

    pub fn parts_mut(&mut self) -> &mut [Box<dyn Ops>] {
        &mut self.parts
    }

    fn err(&self, op: &'static str, p: usize, shapes: impl Into<String>, cause: impl Into<String>) -> OpError {
        OpError::new(op, self.parts[p].device(), shapes, cause)
    }

    fn layer(&self, op: &'static str, l: LayerIdx) -> OpResult<usize> {
        self.layer_part.get(l.0 as usize).copied().ok_or_else(|| self.err(op, 0, format!("layer {}", l.0), "no such layer"))
    }

    fn of_weight(&self, op: &'static str, w: WeightId) -> OpResult<usize> {
        self.weight_part.get(w.index()).copied().ok_or_else(|| self.err(op, 0, format!("weight {}", w.0), "not registered"))
    }

    fn handle(&self, op: &'static str, t: Tensor) -> OpResult<(usize, Tensor)> {
        match self.handles.get(t.id as usize) {
            Some(Some(h)) => Ok(*h),
            _ => Err(self.err(op, 0, format!("tensor {} [{}x{}]", t.id, t.n, t.d), "not a live handle of this step")),
        }
    }

    fn wrap(&mut self, p: usize, t: Tensor) -> Tensor {
        self.handles.push(Some((p, t)));
        Tensor { id: (self.handles.len() - 1) as u32, n: t.n, d: t.d }
    }

    /// A delta rule's inputs, each [`Split::wrap`]ped from part `p`.
    fn wrap_delta(&mut self, p: usize, d: DeltaIn) -> DeltaIn {
        DeltaIn { q: self.wrap(p, d.q), k: self.wrap(p, d.k), v: self.wrap(p, d.v), g: self.wrap(p, d.g), beta: self.wrap(p, d.beta) }
    }

    /// A delta rule's inputs, each [`Split::on`] part `p`.
    fn delta_on(&mut self, op: &'static str, x: DeltaIn, p: usize) -> OpResult<DeltaIn> {
        Ok(DeltaIn {
            q: self.on(op, x.q, p)?,
            k: self.on(op, x.k, p)?,
            v: self.on(op, x.v, p)?,
            g: self.on(op, x.g, p)?,
            beta: self.on(op, x.beta, p)?,
        })
    }

    /// `t`'s handle on part `p`: copied there (and `t` names the copy from now on) when it is
    /// on another part.
    fn on(&mut self, op: &'static str, t: Tensor, p: usize) -> OpResult<Tensor> {
        let (q, inner) = self.handle(op, t)?;
        if q == p {
            return Ok(inner);
        }
        // Device to device when both parts can (two GPUs: a peer copy, ordered by events, the
        // host never waiting), else through the host.
        let moved = match self.parts[q].export_rows(inner)? {
            Some(rows) => match self.parts[p].import_rows(&rows)? {
                Some((moved, done)) => {
                    // The source rows stay as they are until the copy is done.
                    self.parts[q].wait_mark(&done)?;
                    Some(moved)
                }
                None => None,
            },
            None => None,
        };
        let moved = match moved {
            Some(m) => m,
            None => {
                let m = self.parts[q].read(inner)?;
                self.parts[p].upload(&m)?
            }
        };
        self.handles[t.id as usize] = Some((p, moved));
        Ok(moved)
    }

    /// Frees the parts' slots and snapshots whose split guards were dropped.
    fn drain(&mut self) {
        let (slots, snaps) = self.reclaim.take();
        for s in slots {
            if let Some(e) = self.slots.get_mut(s as usize) {
                *e = None;
            }
        }
        for s in snaps {
            if let Some(e) = self.snaps.get_mut(s as usize) {
                *e = None;
            }
        }
    }

    /// The parts' slots of `slot`, when the split handed it out and it is in use.
    fn owned<'a>(
        reclaim: &Arc<Reclaim>,
        slots: &'a [Option<Vec<Slot>>],
        slot: &Slot,
        op: &'static str,
        dev: DeviceId,
    ) -> OpResult<&'a [Slot]> {
        if !reclaim.owns_slot(slot) {
            return Err(OpError::new(op, dev, slot.id().to_string(), "a slot of another store"));
        }
        match slots.get(slot.id().0 as usize) {
            Some(Some(s)) => Ok(s),
            _ => Err(OpError::new(op, dev, slot.id().to_string(), "not in use")),
        }
    }

    /// `layout` with the layers of other parts marked [`StateKind::Elsewhere`].
    fn part_layout(&self, layout: &StateLayout, p: usize) -> StateLayout {
        let layers = layout.layers.iter().zip(&self.layer_part).map(|(&k, &q)| if q == p { k } else { StateKind::Elsewhere }).collect();
        StateLayout { layers, ..layout.clone() }
    }

    fn check_layout(&self, op: &'static str, layout: &StateLayout) -> OpResult<()> {
        if layout.layers.len() != self.layer_part.len() {
            return Err(self.err(
                op,
                0,
                format!("{} layers", layout.layers.len()),
                format!("the split has {} layers", self.layer_part.len()),
            ));
        }
        Ok(())
    }

    fn routing(&self, op: &'static str, r: Routing) -> OpResult<(usize, Routing)> {
        self.routings.get(r.id as usize).copied().ok_or_else(|| self.err(op, 0, format!("routing {}", r.id), "not a routing of this step"))
    }

    fn inner_slot_id(&self, op: &'static str, id: SlotId, p: usize) -> OpResult<SlotId> {
        match self.slots.get(id.0 as usize) {
            Some(Some(s)) => Ok(s[p].id()),
            _ => Err(self.err(op, p, id.to_string(), "not in use")),
        }
    }
}

/// The layer a weight belongs to, from its GGUF name (`blk.N.…`).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Per weight id of `set`, the part whose ops read it under `layer_part`: a layer's weights
/// its layer's part, the embeddings the first part, the output norm and head the last.
pub fn weight_parts(set: &WeightSet, layer_part: &[usize]) -> Result<Vec<usize>, String> {
    let last = layer_part.iter().copied().max().unwrap_or(0);
    let mut part = vec![0; set.len()];
    for id in set.ids() {
        let Some(info) = set.info(id) else { continue };
        part[id.index()] = match layer_of(&info.name) {
            Some(l) => *layer_part.get(l).ok_or_else(|| format!("{}: layer {l} of a {}-layer split", info.name, layer_part.len()))?,
            None if info.name.starts_with("token_embd") => 0,
            None => last,
        };
    }
    Ok(part)
}

/// Which weights of `set` part `part` reads (by id): what a device part registers, e.g.
/// `CudaOps::set_weights_kept`, so each card holds its own layers' weights only.
pub fn part_weights(set: &WeightSet, layer_part: &[usize], part: usize) -> Result<Vec<bool>, String> {
    Ok(weight_parts(set, layer_part)?.into_iter().map(|p| p == part).collect())
}

impl SeqStore for Split {
    fn configure(&mut self, layout: StateLayout, slots: usize, kv_pages: usize) -> OpResult<()> {
        self.drain();
        self.slots.clear();
        self.snaps.clear();
        // Handed-out guards of the old store no longer name anything.
        self.reclaim = Reclaim::new();
        self.check_layout("configure", &layout)?;
        let total = layout.n_kv_layers();
        for p in 0..self.parts.len() {
            let mine = self.part_layout(&layout, p);
            // Pages are per attention layer's K or V: a part's share of the pool is its layers'.
            let pages = if total == 0 { kv_pages } else { (kv_pages * mine.n_kv_layers()).div_ceil(total) };
            self.parts[p].configure(mine, slots, pages)?;
        }
        Ok(())
    }

    fn alloc_slot(&mut self) -> OpResult<Slot> {
        self.drain();
        let inner = self.parts.iter_mut().map(|p| p.alloc_slot()).collect::<OpResult<Vec<Slot>>>()?;
        let id = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[id] = Some(inner);
        Ok(self.reclaim.slot(id as u32))
    }

    fn clear_slot(&mut self, slot: &Slot) -> OpResult<()> {
        self.drain();
        let inner = Self::owned(&self.reclaim, &self.slots, slot, "clear_slot", self.parts[0].device())?;
        for (p, s) in self.parts.iter_mut().zip(inner) {
            p.clear_slot(s)?;
        }
        Ok(())
    }

    fn slot_len(&mut self, slot: &Slot) -> OpResult<usize> {
        self.drain();
        let inner = Self::owned(&self.reclaim, &self.slots, slot, "slot_len", self.parts[0].device())?;
        self.parts[0].slot_len(&inner[0])
    }

    fn snapshot(&mut self, slot: &Slot) -> OpResult<Snapshot> {
        self.drain();
        let n = self.parts.len();
        let inner = Self::owned(&self.reclaim, &self.slots, slot, "snapshot", self.parts[0].device())?;
        let mut snaps = Vec::with_capacity(n);
        for (p, s) in self.parts.iter_mut().zip(inner) {
            snaps.push(p.snapshot(s)?);
        }
        // Page ids are each part's: spread them so two parts' pages never share an id.
        let info = SnapInfo {
            len: snaps[0].len(),
            own_bytes: snaps.iter().map(Snapshot::own_bytes).sum(),
            pages: snaps.iter().enumerate().flat_map(|(p, s)| s.kv_pages().iter().map(move |&(id, b)| (id * n + p, b))).collect(),
        };
        let id = match self.snaps.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.snaps.push(None);
                self.snaps.len() - 1
            }
        };
        self.snaps[id] = Some(snaps);
        Ok(self.reclaim.snapshot(id as u32, info))
    }

    fn restore(&mut self, slot: &Slot, snap: &Snapshot) -> OpResult<()> {
        self.drain();
        let dev = self.parts[0].device();
        if !self.reclaim.owns_snapshot(snap) {
            return Err(OpError::new("restore", dev, format!("snapshot {}", snap.id()), "a snapshot of another store"));
        }
        let inner_slots = Self::owned(&self.reclaim, &self.slots, slot, "restore", dev)?;
        let inner_snaps = match self.snaps.get(snap.id() as usize) {
            Some(Some(s)) => s,
            _ => return Err(OpError::new("restore", dev, format!("snapshot {}", snap.id()), "released")),
        };
        for ((p, s), sn) in self.parts.iter_mut().zip(inner_slots).zip(inner_snaps) {
            p.restore(s, sn)?;
        }
        Ok(())
    }

    fn read_delta(&mut self, slot: &Slot, layer: LayerIdx) -> OpResult<(Vec<f32>, Vec<f32>)> {
        self.drain();
        let p = self.layer("read_delta", layer)?;
        let inner = Self::owned(&self.reclaim, &self.slots, slot, "read_delta", self.parts[p].device())?;
        self.parts[p].read_delta(&inner[p], layer)
    }

    fn store_stats(&mut self) -> StoreStats {
        self.drain();
        let all: Vec<StoreStats> = self.parts.iter_mut().map(|p| p.store_stats()).collect();
        StoreStats {
            slots: all[0].slots,
            slots_free: all.iter().map(|s| s.slots_free).min().unwrap_or(0),
            pages: all.iter().map(|s| s.pages).sum(),
            pages_free: all.iter().map(|s| s.pages_free).sum(),
            page_bytes: all[0].page_bytes,
            snapshots: all[0].snapshots,
        }
    }

    fn kv_pages_that_fit(&mut self, layout: &StateLayout, slots: usize) -> OpResult<Option<usize>> {
        self.check_layout("kv_pages_that_fit", layout)?;
        // The split's pool, shared out by attention layers (configure): as large as the
        // tightest part's share allows.
        let total = layout.n_kv_layers();
        let mut fit: Option<usize> = None;
        for p in 0..self.parts.len() {
            let mine = self.part_layout(layout, p);
            let n_kv = mine.n_kv_layers();
            if let Some(n) = self.parts[p].kv_pages_that_fit(&mine, slots)? {
                let whole = n.saturating_mul(total).checked_div(n_kv).unwrap_or(usize::MAX);
                fit = Some(fit.map_or(whole, |f| f.min(whole)));
            }
        }
        Ok(fit)
    }
}

impl Ops for Split {
    fn name(&self) -> &'static str {
        "split"
    }

    fn device(&self) -> DeviceId {
        self.parts[0].device()
    }

    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        let part = weight_parts(&weights, &self.layer_part).map_err(|e| self.err("register", 0, "", e))?;
        for (i, p) in self.parts.iter_mut().enumerate() {
            p.keep_weights(Some(part.iter().map(|&q| q == i).collect()));
            p.register(weights.clone())?;
        }
        self.weight_part = part;
        Ok(())
    }

    fn begin_step(&mut self, batch: &Batch) -> OpResult<()> {
        self.drain();
        self.handles.clear();
        self.routings.clear();
        self.marks.lock().unwrap_or_else(|e| e.into_inner()).clear();
        for p in 0..self.parts.len() {
            let mut b = batch.clone();
            for s in &mut b.seqs {
                s.slot = self.inner_slot_id("begin_step", s.slot, p)?;
            }
            self.parts[p].begin_step(&b)?;
        }
        Ok(())
    }

    fn end_step(&mut self) -> OpResult<()> {
        for p in &mut self.parts {
            p.end_step()?;
        }
        Ok(())
    }

    fn mark(&self) -> Mark {
        let parts = self.parts.iter().map(|p| p.mark()).collect();
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        marks.push((self.handles.len(), parts));
        Mark((marks.len() - 1) as u32)
    }

    fn free_since(&mut self, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        let Some((made_before, part_marks)) = self.marks.lock().unwrap_or_else(|e| e.into_inner()).get(mark.0 as usize).cloned() else {
            return Err(self.err("free_since", 0, format!("mark {}", mark.0), "not a mark of this step"));
        };
        // Each part keeps the handles of the split's live handles made before the mark (one
        // that moved here since is newer than the part's mark) and of `keep`.
        let keep_ids: Vec<usize> = keep.iter().map(|t| t.id as usize).collect();
        for (p, (part, m)) in self.parts.iter_mut().zip(part_marks).enumerate() {
            let live: Vec<Tensor> = self
                .handles
                .iter()
                .enumerate()
                .filter(|(i, _)| *i < made_before || keep_ids.contains(i))
                .filter_map(|(_, h)| h.filter(|h| h.0 == p).map(|h| h.1))
                .collect();
            part.free_since(m, &live)?;
        }
        for (i, h) in self.handles.iter_mut().enumerate().skip(made_before) {
            if !keep_ids.contains(&i) {
                *h = None;
            }
        }
        Ok(())
    }

    fn upload(&mut self, x: &Mat) -> OpResult<Tensor> {
        let t = self.parts[0].upload(x)?;
        Ok(self.wrap(0, t))
    }

    fn read(&mut self, x: Tensor) -> OpResult<Mat> {
        let (p, t) = self.handle("read", x)?;
        self.parts[p].read(t)
    }

    fn submit(&mut self) -> OpResult<()> {
        for p in &mut self.parts {
            p.submit()?;
        }
        Ok(())
    }

    fn overlaps(&self) -> bool {
        self.parts.iter().any(|p| p.overlaps())
    }

    fn read_top(&mut self, x: Tensor, k: usize, extra: &[Vec<u32>]) -> OpResult<Vec<ember_ops::TopRow>> {
        let (p, t) = self.handle("read_top", x)?;
        self.parts[p].read_top(t, k, extra)
    }

    fn read_routing(&mut self, r: Routing) -> OpResult<RouteTable> {
        let (p, inner) = self.routing("read_routing", r)?;
        self.parts[p].read_routing(inner)
    }

    fn embed(&mut self, w: WeightId) -> OpResult<Tensor> {
        let p = self.of_weight("embed", w)?;
        let t = self.parts[p].embed(w)?;
        Ok(self.wrap(p, t))
    }

    fn matmul(&mut self, w: WeightId, x: Tensor) -> OpResult<Tensor> {
        let p = self.of_weight("matmul", w)?;
        let x = self.on("matmul", x, p)?;
        let y = self.parts[p].matmul(w, x)?;
        Ok(self.wrap(p, y))
    }

    fn matmul_many(&mut self, ws: &[WeightId], x: Tensor) -> OpResult<Vec<Tensor>> {
        let Some(&w0) = ws.first() else { return Ok(Vec::new()) };
        let p = self.of_weight("matmul_many", w0)?;
        for &w in ws {
            if self.of_weight("matmul_many", w)? != p {
                return Err(self.err("matmul_many", p, format!("{} weights", ws.len()), "weights of one call on two parts"));
            }
        }
        let x = self.on("matmul_many", x, p)?;
        let ys = self.parts[p].matmul_many(ws, x)?;
        Ok(ys.into_iter().map(|y| self.wrap(p, y)).collect())
    }

    fn rms_norm(&mut self, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        let p = self.of_weight("rms_norm", w)?;
        let x = self.on("rms_norm", x, p)?;
        let y = self.parts[p].rms_norm(x, w, eps)?;
        Ok(self.wrap(p, y))
    }

    fn add(&mut self, h: Tensor, x: Tensor) -> OpResult<()> {
        let (p, hi) = self.handle("add", h)?;
        let x = self.on("add", x, p)?;
        self.parts[p].add(hi, x)
    }

    fn rms_norm_gate(&mut self, x: Tensor, w: WeightId, eps: f32, g: Tensor, act: Gate) -> OpResult<Tensor> {
        let p = self.of_weight("rms_norm_gate", w)?;
        let x = self.on("rms_norm_gate", x, p)?;
        let g = self.on("rms_norm_gate", g, p)?;
        let y = self.parts[p].rms_norm_gate(x, w, eps, g, act)?;
        Ok(self.wrap(p, y))
    }

    fn add_rms_norm(&mut self, h: Tensor, x: Tensor, w: WeightId, eps: f32) -> OpResult<Tensor> {
        // Where the norm's layer is: the residual moves there at a range boundary.
        let p = self.of_weight("add_rms_norm", w)?;
        let h = self.on("add_rms_norm", h, p)?;
        let x = self.on("add_rms_norm", x, p)?;
        let y = self.parts[p].add_rms_norm(h, x, w, eps)?;
        Ok(self.wrap(p, y))
    }

    fn attn_prep(&mut self, s: AttnPrep, qg: Tensor, k: Tensor) -> OpResult<AttnIn> {
        let p = self.of_weight("attn_prep", s.q_norm)?;
        let qg = self.on("attn_prep", qg, p)?;
        let k = self.on("attn_prep", k, p)?;
        let a = self.parts[p].attn_prep(s, qg, k)?;
        Ok(AttnIn { q: self.wrap(p, a.q), gate: self.wrap(p, a.gate), k: self.wrap(p, a.k) })
    }

    fn kv_append(&mut self, layer: LayerIdx, k: Tensor, v: Tensor) -> OpResult<()> {
        let p = self.layer("kv_append", layer)?;
        let k = self.on("kv_append", k, p)?;
        let v = self.on("kv_append", v, p)?;
        self.parts[p].kv_append(layer, k, v)
    }

    fn attn_prep_append(&mut self, layer: LayerIdx, s: AttnPrep, qg: Tensor, k: Tensor, v: Tensor) -> OpResult<AttnIn> {
        const OP: &str = "attn_prep_append";
        let p = self.layer(OP, layer)?;
        if self.of_weight(OP, s.q_norm)? != p {
            // The prep's weights and the layer's caches on different parts: each op where it lives.
            let a = self.attn_prep(s, qg, k)?;
            self.kv_append(layer, a.k, v)?;
            return Ok(a);
        }
        let qg = self.on(OP, qg, p)?;
        let k = self.on(OP, k, p)?;
        let v = self.on(OP, v, p)?;
        let a = self.parts[p].attn_prep_append(layer, s, qg, k, v)?;
        Ok(AttnIn { q: self.wrap(p, a.q), gate: self.wrap(p, a.gate), k: self.wrap(p, a.k) })
    }

    fn attention(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor) -> OpResult<Tensor> {
        let p = self.layer("attention", layer)?;
        let q = self.on("attention", q, p)?;
        let y = self.parts[p].attention(layer, h, q)?;
        Ok(self.wrap(p, y))
    }

    fn attention_gate(&mut self, layer: LayerIdx, h: AttnHeads, q: Tensor, g: Tensor, act: Gate) -> OpResult<Tensor> {
        let p = self.layer("attention_gate", layer)?;
        let q = self.on("attention_gate", q, p)?;
        let g = self.on("attention_gate", g, p)?;
        let y = self.parts[p].attention_gate(layer, h, q, g, act)?;
        Ok(self.wrap(p, y))
    }

    fn conv1d_silu(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        let p = self.layer("conv1d_silu", layer)?;
        let x = self.on("conv1d_silu", x, p)?;
        let y = self.parts[p].conv1d_silu(layer, x, w)?;
        Ok(self.wrap(p, y))
    }

    fn delta_prep(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        let p = self.of_weight("delta_prep", s.a)?;
        let cu = self.on("delta_prep", cu, p)?;
        let b = self.on("delta_prep", b, p)?;
        let alpha = self.on("delta_prep", alpha, p)?;
        let d = self.parts[p].delta_prep(s, cu, b, alpha)?;
        Ok(self.wrap_delta(p, d))
    }

    fn conv_delta_prep(&mut self, layer: LayerIdx, x: Tensor, w: WeightId, s: DeltaPrep, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        const OP: &str = "conv_delta_prep";
        let p = self.layer(OP, layer)?;
        if self.of_weight(OP, s.a)? != p {
            // The conv's layer and the prep's weights on different parts: the two ops, each
            // where it lives.
            let cu = self.conv1d_silu(layer, x, w)?;
            return self.delta_prep(s, cu, b, alpha);
        }
        let x = self.on(OP, x, p)?;
        let b = self.on(OP, b, p)?;
        let alpha = self.on(OP, alpha, p)?;
        let d = self.parts[p].conv_delta_prep(layer, x, w, s, b, alpha)?;
        Ok(self.wrap_delta(p, d))
    }

    fn gated_delta_rule(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        const OP: &str = "gated_delta_rule";
        let p = self.layer(OP, layer)?;
        let x = self.delta_on(OP, x, p)?;
        let y = self.parts[p].gated_delta_rule(layer, h, x, mode)?;
        Ok(self.wrap(p, y))
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
        const OP: &str = "delta_rule_norm";
        let p = self.layer(OP, layer)?;
        if self.of_weight(OP, norm.w)? != p {
            // The layer's state and the norm's weight on different parts: the two ops, each
            // where it lives.
            let o = self.gated_delta_rule(layer, h, x, mode)?;
            return self.rms_norm_gate(o, norm.w, norm.eps, z, norm.act);
        }
        let x = self.delta_on(OP, x, p)?;
        let z = self.on(OP, z, p)?;
        let y = self.parts[p].delta_rule_norm(layer, h, x, mode, norm, z)?;
        Ok(self.wrap(p, y))
    }

    fn gate(&mut self, y: Tensor, g: Tensor, act: Gate) -> OpResult<()> {
        let (p, yi) = self.handle("gate", y)?;
        let g = self.on("gate", g, p)?;
        self.parts[p].gate(yi, g, act)
    }

    fn route(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        let (p, l) = self.handle("route", logits)?;
        let r = self.parts[p].route(l, k)?;
        self.routings.push((p, r));
        Ok(Routing { id: (self.routings.len() - 1) as u32, n_tok: r.n_tok, k: r.k })
    }

    fn moe(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        let p = self.layer("moe", layer)?;
        let (q, r) = self.routing("moe", routing)?;
        if q != p {
            return Err(self.err(
                "moe",
                p,
                format!("layer {}", layer.0),
                format!("the routing was made on part {q}, the layer runs on part {p}"),
            ));
        }
        let x = self.on("moe", x, p)?;
        let g = self.on("moe", shared_gate, p)?;
        let y = self.parts[p].moe(layer, x, r, g)?;
        Ok(self.wrap(p, y))
    }

    fn select_rows(&mut self, x: Tensor) -> OpResult<Tensor> {
        let (p, xi) = self.handle("select_rows", x)?;
        let y = self.parts[p].select_rows(xi)?;
        Ok(self.wrap(p, y))
    }

    fn expert_stats(&self) -> Option<ExpertStats> {
        let all: Vec<ExpertStats> = self.parts.iter().filter_map(|p| p.expert_stats()).collect();
        if all.is_empty() {
            return None;
        }
        let mut s = ExpertStats::default();
        for a in all {
            s.hits += a.hits;
            s.misses += a.misses;
            s.uploads += a.uploads;
            s.evictions += a.evictions;
            s.miss_secs += a.miss_secs;
            s.miss_bytes += a.miss_bytes;
            s.streamed_pairs += a.streamed_pairs;
            s.streamed_bytes += a.streamed_bytes;
            // Every part runs every token (its own layers of it).
            s.tokens = s.tokens.max(a.tokens);
        }
        Some(s)
    }

    fn expert_layer_stats(&self) -> Vec<(LayerIdx, u64, u64)> {
        self.parts.iter().flat_map(|p| p.expert_layer_stats()).collect()
    }

    fn layer_device(&self, layer: LayerIdx) -> DeviceId {
        match self.layer_part.get(layer.index()) {
            Some(&p) => self.parts[p].device(),
            None => self.device(),
        }
    }
}
