//! The registered weights on the device: every matrix as its file's block bytes (Q6_K's
//! rearranged within each row: src/ops/q6_repack.rs), every vector
//! as f32, uploaded once at `register`. A fused `[gate | up]` expert tensor is uploaded split
//! into its gate and up halves (the MoE kernels read them as two stacked tensors); it is read
//! by nothing else.
//!
//! A MoE layer may hold only some of its routed experts ([`CudaOps::set_resident_experts`]):
//! then its stacked expert tensors are slots, one expert each, in the order given, and the layer's
//! [`ExpertPool`] says which expert is in which slot.
//!
//! [`CudaOps::set_resident_experts`]: super::CudaOps::set_resident_experts

use std::sync::Arc;

use ember_ops::{DeviceId, ExpertId, GateUp, LayerIdx, OpError, OpResult, Registry, WeightId, WeightInfo, WeightSet};

use crate::gpu::UploadDone;
use crate::ops::{DeviceWeight, MOE_MISS};
use crate::{Buf, Gpu};

/// The routed experts one MoE layer holds on the device, by slot.
pub(super) struct ExpertPool {
    /// Per slot, its expert.
    pub experts: Vec<u16>,
    /// Per expert, its slot or [`MOE_MISS`] (the host copy of `dev`).
    pub slot_of: Vec<u32>,
    pub dev: Buf<u32>,
}

impl ExpertPool {
    fn new(gpu: &Gpu, n_expert: usize, experts: Vec<u16>) -> crate::Result<ExpertPool> {
        let mut slot_of = vec![MOE_MISS; n_expert];
        for (s, &e) in experts.iter().enumerate() {
            slot_of[e as usize] = s as u32;
        }
        let dev = gpu.upload(&slot_of)?;
        Ok(ExpertPool { experts, slot_of, dev })
    }
}

/// Which part of a layer's routed experts a stacked tensor is.
#[derive(Clone, Copy)]
enum ExpertPart {
    /// gate, up or down: matrix e is expert e.
    Whole,
    /// A fused gate|up tensor.
    Fused,
}

pub(super) enum DevWeight {
    Matrix(DeviceWeight),
    Vector(Buf<f32>),
    /// A fused gate|up expert tensor: per expert, its first n_ff rows in `gate`, the next n_ff
    /// in `up`.
    Split {
        gate: DeviceWeight,
        up: DeviceWeight,
    },
}

/// An expert on its way into a slot on the copy stream ([`DevWeights::place_expert`]): the
/// slot is in no table until it is done. Dropping one waits for its copies.
struct Upload {
    layer: usize,
    slot: usize,
    expert: u16,
    done: UploadDone,
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = self.done.wait();
    }
}

pub(super) struct DevWeights {
    /// Uploads not yet seen done. Declared first, so they are dropped (each waiting for its
    /// copies) before the tensors they write.
    uploads: Vec<Upload>,
    pub reg: Registry,
    w: Vec<Option<DevWeight>>,
    /// Per layer: the experts it holds, when not all of them.
    pub pools: Vec<Option<ExpertPool>>,
    dev: DeviceId,
}

impl DevWeights {
    pub fn empty(dev: DeviceId) -> Self {
        DevWeights { uploads: Vec::new(), reg: Registry::new(dev), w: Vec::new(), pools: Vec::new(), dev }
    }

    /// Uploads every weight of `set`; of the routed experts of layer l, only `resident[l]` when
    /// that is given (in that order, one slot each).
    pub fn upload(gpu: &Gpu, dev: DeviceId, set: Arc<WeightSet>, resident: &[Option<Vec<u16>>], kept: Option<&[bool]>) -> OpResult<Self> {
        const OP: &str = "register";
        let fail = |name: &str, e: crate::Error| OpError::new(OP, dev, name.to_string(), e.to_string());
        // The expert tensors of layers that hold some of their experts, and which.
        let mut partial: Vec<Option<(usize, ExpertPart)>> = vec![None; set.len()];
        let mut pools = Vec::new();
        for (l, r) in resident.iter().enumerate() {
            let Some(list) = r else {
                pools.push(None);
                continue;
            };
            let layer = LayerIdx(l as u16);
            let m = set
                .moe(layer)
                .ok_or_else(|| OpError::new(OP, dev, format!("{layer}"), "resident experts given for a layer with no MoE"))?;
            let mut seen = vec![false; m.n_expert];
            for &e in list {
                if (e as usize) >= m.n_expert || std::mem::replace(&mut seen[e as usize], true) {
                    return Err(OpError::new(OP, dev, format!("{layer}"), format!("resident expert {e} repeated or past {}", m.n_expert)));
                }
            }
            match m.gate_up {
                GateUp::Separate { gate, up } => {
                    partial[gate.index()] = Some((l, ExpertPart::Whole));
                    partial[up.index()] = Some((l, ExpertPart::Whole));
                }
                GateUp::Fused(w) => partial[w.index()] = Some((l, ExpertPart::Fused)),
            }
            partial[m.down.index()] = Some((l, ExpertPart::Whole));
            pools.push(Some(ExpertPool::new(gpu, m.n_expert, list.clone()).map_err(|e| fail("expert pool", e))?));
        }
        // Fused gate|up tensors, with the width of one expert's half.
        let mut fused = vec![None; set.len()];
        for l in 0..set.len().min(u16::MAX as usize) {
            if let Some(m) = set.moe(LayerIdx(l as u16))
                && let GateUp::Fused(w) = m.gate_up
                && let Some(f) = fused.get_mut(w.index())
            {
                *f = Some(m.n_ff);
            }
        }
        let mut w = Vec::with_capacity(set.len());
        for id in set.ids() {
            // unwrap-free: ids come from the set.
            let Some(info) = set.info(id) else { return Err(OpError::new(OP, dev, format!("weight {}", id.0), "not in the set")) };
            if kept.is_some_and(|k| !k.get(id.index()).copied().unwrap_or(true)) {
                w.push(None);
                continue;
            }
            let dw = if let Some(v) = set.vector(id) {
                DevWeight::Vector(gpu.upload(v).map_err(|e| fail(&info.name, e))?)
            } else if let Some((l, part)) = partial[id.index()] {
                let list = resident[l].as_deref().unwrap_or_default();
                some_experts(gpu, &set, id, info, part, list, set.moe(LayerIdx(l as u16)).map_or(0, |m| m.n_ff))
                    .map_err(|e| fail(&info.name, e))?
            } else if let Some(bytes) = set.file_bytes(id) {
                match fused[id.index()].filter(|n_ff| info.rows_per_mat() == 2 * n_ff) {
                    Some(n_ff) => split(gpu, info, n_ff, bytes).map_err(|e| fail(&info.name, e))?,
                    None => DevWeight::Matrix(gpu.upload_weight(info.ty, info.k, info.n_rows, bytes).map_err(|e| fail(&info.name, e))?),
                }
            } else {
                return Err(OpError::new(OP, dev, info.describe(), "neither a vector nor a matrix"));
            };
            w.push(Some(dw));
        }
        let mut reg = Registry::new(dev);
        reg.set(set);
        Ok(DevWeights { uploads: Vec::new(), reg, w, pools, dev })
    }

    /// Starts moving expert `e` of `layer` into `slot`, whose expert leaves the device at once:
    /// the slot table marks both as not here (their pairs run on the CPU), the table write and
    /// then the copies of e's gate, up and down rows are queued (the copies on the copy stream,
    /// after the work queued so far), and nothing waits. [`DevWeights::finish_uploads`] puts
    /// e in the table once its copies are done.
    pub fn place_expert(&mut self, gpu: &Gpu, layer: LayerIdx, slot: usize, e: ExpertId) -> OpResult<()> {
        const OP: &str = "place_expert";
        let dev = self.dev;
        let fail = |e: crate::Error| OpError::new(OP, dev, format!("{layer}"), e.to_string());
        let set = self.reg.weights(OP)?.clone();
        let m = *self.reg.moe(OP, layer)?;
        let view = set.expert(layer, e).ok_or_else(|| OpError::new(OP, dev, format!("{layer} expert {}", e.0), "no such expert"))?;
        let pool = self.pools.get(layer.index()).and_then(Option::as_ref);
        let Some(pool) = pool.filter(|p| slot < p.experts.len() && e.index() < m.n_expert) else {
            return Err(OpError::new(OP, dev, format!("{layer} slot {slot} expert {}", e.0), "no such slot or expert"));
        };
        if pool.slot_of[e.index()] != MOE_MISS || self.uploading(layer).iter().any(|&(s, x)| s == slot || x == e.0) {
            return Err(OpError::new(OP, dev, format!("{layer} slot {slot} expert {}", e.0), "already on the device or on its way"));
        }
        let (gate, up, down) = (view.gate.data, view.up.data, view.down.data);
        let (gr, dr) = (slot * m.n_ff, slot * set.info(m.down).map_or(0, |i| i.rows_per_mat()));
        let (g, u) = match m.gate_up {
            GateUp::Separate { gate: g, up: u } => (self.matrix(OP, g)?.1, self.matrix(OP, u)?.1),
            GateUp::Fused(w) => match self.w.get(w.index()).and_then(Option::as_ref) {
                Some(DevWeight::Split { gate: g, up: u }) => (g, u),
                _ => return Err(OpError::new(OP, dev, format!("weight {}", w.0), "not a fused gate|up expert tensor")),
            },
        };
        let d = self.matrix(OP, m.down)?.1;
        let dsts = [g.rows_at(gr, gate.len()), u.rows_at(gr, up.len()), d.rows_at(dr, down.len())];
        let [Ok(gd), Ok(ud), Ok(dd)] = dsts else {
            let msg = dsts.into_iter().filter_map(|r| r.err()).map(|e| e.to_string()).collect::<Vec<_>>().join("; ");
            return Err(OpError::new(OP, dev, format!("{layer} slot {slot}"), msg));
        };
        // The slot leaves the table first (the host's copy once the device's write is queued):
        // kernels queued from now on do not read it.
        let Some(pool) = self.pools.get_mut(layer.index()).and_then(Option::as_mut) else { unreachable!("checked above") };
        let old = pool.experts[slot] as usize;
        let mut table = pool.slot_of.clone();
        table[old] = MOE_MISS;
        gpu.write_async(&mut pool.dev, &table).map_err(fail)?;
        pool.slot_of = table;
        pool.experts[slot] = e.0;
        // SAFETY: each destination is whole rows inside a stacked expert tensor of this layer
        // (rows_at checked it), in the slot no table names until the upload is done
        // (finish_uploads); the tensors are freed only after the pending uploads are waited
        // for (set_layer_experts, and `uploads` drops first). A failed upload has waited for
        // its copies; its slot then holds no expert a table names.
        let done = unsafe { gpu.upload_async(&[(gd, gate), (ud, up), (dd, down)]) }.map_err(fail)?;
        self.uploads.push(Upload { layer: layer.index(), slot, expert: e.0, done });
        Ok(())
    }

    /// The (slot, expert) pairs of `layer` on their way in.
    pub fn uploading(&self, layer: LayerIdx) -> Vec<(usize, u16)> {
        self.uploads.iter().filter(|u| u.layer == layer.index()).map(|u| (u.slot, u.expert)).collect()
    }

    /// Puts the experts whose copies are done into their layers' slot tables (a table write
    /// queued on the compute stream, before the kernels queued after it); with `wait`, waits
    /// for every upload first. Returns how many went in. On a copy's error, the uploads seen
    /// done before it still go in; on a repack's (a failed launch), no table is written and the
    /// error returns.
    pub fn finish_uploads(&mut self, gpu: &Gpu, wait: bool) -> OpResult<usize> {
        const OP: &str = "finish_uploads";
        let dev = self.dev;
        let fail = |e: crate::Error| OpError::new(OP, dev, "", e.to_string());
        let mut done = Vec::new();
        let mut err = None;
        let mut i = 0;
        while i < self.uploads.len() {
            let u = &self.uploads[i];
            let finished = if wait { u.done.wait().map(|()| true) } else { u.done.is_done() };
            match finished {
                Ok(true) => {
                    let u = self.uploads.swap_remove(i);
                    done.push((u.layer, u.slot, u.expert));
                }
                Ok(false) => i += 1,
                Err(e) => {
                    err = Some(fail(e));
                    break;
                }
            }
        }
        // Q6_K rows came up as the file has them: repacked on the stream before a table names
        // the slot.
        for &(l, slot, _) in &done {
            self.repack_slot(gpu, LayerIdx(l as u16), slot).map_err(fail)?;
        }
        let mut layers: Vec<usize> = done.iter().map(|d| d.0).collect();
        layers.sort_unstable();
        layers.dedup();
        for l in layers {
            let Some(pool) = self.pools.get_mut(l).and_then(Option::as_mut) else { continue };
            let mut table = pool.slot_of.clone();
            for &(_, slot, e) in done.iter().filter(|d| d.0 == l) {
                if pool.experts.get(slot) == Some(&e) {
                    table[e as usize] = slot as u32;
                }
            }
            // The host's table follows the device's only once its write is queued.
            gpu.write_async(&mut pool.dev, &table).map_err(fail)?;
            pool.slot_of = table;
        }
        err.map_or(Ok(done.len()), Err)
    }

    /// Repacks the Q6_K rows of `slot` in `layer`'s stacked expert tensors (an expert uploaded
    /// as the file has it, by place_expert), on the stream.
    fn repack_slot(&mut self, gpu: &Gpu, layer: LayerIdx, slot: usize) -> crate::Result<()> {
        let bad = |what: &str| crate::error::shape("repack_slot", what.to_string());
        let m = *self.reg.moe("repack_slot", layer).map_err(|e| bad(&e.to_string()))?;
        let set = self.reg.weights("repack_slot").map_err(|e| bad(&e.to_string()))?.clone();
        let d_rows = set.info(m.down).map_or(0, |i| i.rows_per_mat());
        let mut ranges: Vec<(WeightId, usize)> = vec![(m.down, d_rows)];
        match m.gate_up {
            GateUp::Separate { gate, up } => ranges.extend([(gate, m.n_ff), (up, m.n_ff)]),
            GateUp::Fused(w) => ranges.push((w, m.n_ff)),
        }
        for (id, rows) in ranges {
            match self.w.get_mut(id.index()).and_then(Option::as_mut) {
                Some(DevWeight::Matrix(w)) => w.repack_uploaded(gpu, slot * rows, rows)?,
                Some(DevWeight::Split { gate, up }) => {
                    gate.repack_uploaded(gpu, slot * rows, rows)?;
                    up.repack_uploaded(gpu, slot * rows, rows)?;
                }
                _ => return Err(bad("not an expert tensor")),
            }
        }
        Ok(())
    }

    /// Re-uploads the routed experts of `layer` as slots holding exactly `list` (the old
    /// tensors are freed first, so this can run when memory is short): how the tier shrinks a
    /// layer under memory pressure or grows it back. A layer that held every expert becomes
    /// one with slots.
    pub fn set_layer_experts(&mut self, gpu: &Gpu, layer: LayerIdx, list: Vec<u16>) -> OpResult<()> {
        const OP: &str = "set_layer_experts";
        // Copies still on their way may write the tensors freed below.
        self.finish_uploads(gpu, true)?;
        let dev = self.dev;
        let set = self.reg.weights(OP)?.clone();
        let m = *self.reg.moe(OP, layer)?;
        let mut seen = vec![false; m.n_expert];
        for &e in &list {
            if (e as usize) >= m.n_expert || std::mem::replace(&mut seen[e as usize], true) {
                return Err(OpError::new(OP, dev, format!("{layer}"), format!("expert {e} repeated or past {}", m.n_expert)));
            }
        }
        let parts: Vec<(WeightId, ExpertPart)> = match m.gate_up {
            GateUp::Separate { gate, up } => vec![(gate, ExpertPart::Whole), (up, ExpertPart::Whole), (m.down, ExpertPart::Whole)],
            GateUp::Fused(w) => vec![(w, ExpertPart::Fused), (m.down, ExpertPart::Whole)],
        };
        if self.pools.len() <= layer.index() {
            self.pools.resize_with(layer.index() + 1, || None);
        }
        // On the device first: each tensor rebuilt from the experts it keeps (device copies)
        // and the new ones (one staged gather), one tensor at a time, so the extra memory is
        // one tensor's new size and nothing waits on the host for kept experts.
        // Per old slot, its expert, or u16::MAX when the table does not name it there (an
        // upload that failed): only experts the table names are copied over.
        let held: Vec<u16> = match &self.pools[layer.index()] {
            Some(p) => p.experts.iter().enumerate().map(|(s, &e)| if p.slot_of[e as usize] == s as u32 { e } else { u16::MAX }).collect(),
            None => (0..m.n_expert as u16).collect(),
        };
        let mut order: Vec<u16> = list.iter().copied().filter(|e| held.contains(e)).collect();
        order.extend(list.iter().copied().filter(|e| !held.contains(e)));
        let mut rebuilt = true;
        for &(id, part) in &parts {
            let Some(info) = set.info(id) else { break };
            match rebuild(gpu, &set, id, info, part, &held, &order, m.n_ff, self.w.get(id.index()).and_then(Option::as_ref)) {
                Ok(dw) => self.w[id.index()] = Some(dw),
                Err(_) => {
                    rebuilt = false;
                    break;
                }
            }
        }
        if rebuilt {
            let pool = ExpertPool::new(gpu, m.n_expert, order).map_err(|e| OpError::new(OP, dev, format!("{layer}"), e.to_string()))?;
            self.pools[layer.index()] = Some(pool);
            return Ok(());
        }
        // Not enough memory for that (or a tensor was already gone): free the layer's tensors,
        // then upload the list from host memory.
        self.pools[layer.index()] = None;
        for &(id, _) in &parts {
            if let Some(w) = self.w.get_mut(id.index()) {
                *w = None;
            }
        }
        for (id, part) in parts {
            let info = set.info(id).ok_or_else(|| OpError::new(OP, dev, format!("weight {}", id.0), "not in the set"))?;
            let dw = some_experts(gpu, &set, id, info, part, &list, m.n_ff)
                .map_err(|e| OpError::new(OP, dev, info.name.clone(), e.to_string()))?;
            if let Some(w) = self.w.get_mut(id.index()) {
                *w = Some(dw);
            }
        }
        let pool = ExpertPool::new(gpu, m.n_expert, list).map_err(|e| OpError::new(OP, dev, format!("{layer}"), e.to_string()))?;
        self.pools[layer.index()] = Some(pool);
        Ok(())
    }

    fn get(&self, op: &'static str, id: WeightId) -> OpResult<&DevWeight> {
        self.reg.info(op, id)?;
        self.w
            .get(id.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| OpError::new(op, self.dev, format!("weight {}", id.0), "not registered"))
    }

    /// A matrix weight and its info; an error if `id` is unknown or not a plain matrix.
    pub fn matrix(&self, op: &'static str, id: WeightId) -> OpResult<(&WeightInfo, &DeviceWeight)> {
        let info = self.reg.info(op, id)?;
        match self.get(op, id)? {
            DevWeight::Matrix(m) => Ok((info, m)),
            _ => Err(OpError::new(op, self.dev, format!("matrix weight {}", id.0), "not registered")),
        }
    }

    /// A vector weight; an error if `id` is unknown or a matrix.
    pub fn vector(&self, op: &'static str, id: WeightId) -> OpResult<&Buf<f32>> {
        self.reg.vector(op, id)?;
        match self.get(op, id)? {
            DevWeight::Vector(v) => Ok(v),
            _ => Err(OpError::new(op, self.dev, format!("vector weight {}", id.0), "not registered")),
        }
    }

    /// The routed experts' gate and up tensors of a MoE layer (stacked, n_ff rows per expert).
    pub fn gate_up(&self, op: &'static str, gu: GateUp) -> OpResult<(&DeviceWeight, &DeviceWeight)> {
        match gu {
            GateUp::Separate { gate, up } => Ok((self.matrix(op, gate)?.1, self.matrix(op, up)?.1)),
            GateUp::Fused(w) => match self.get(op, w)? {
                DevWeight::Split { gate, up } => Ok((gate, up)),
                _ => Err(OpError::new(op, self.dev, format!("weight {}", w.0), "not a fused gate|up expert tensor")),
            },
        }
    }
}

/// A layer's expert tensor holding `order` (the experts of `held`, in `old`'s slots, first; then
/// new ones), built from `old` by device copies and one staged gather of the new experts.
#[allow(clippy::too_many_arguments)]
fn rebuild(
    gpu: &Gpu,
    set: &WeightSet,
    id: WeightId,
    info: &WeightInfo,
    part: ExpertPart,
    held: &[u16],
    order: &[u16],
    n_ff: usize,
    old: Option<&DevWeight>,
) -> crate::Result<DevWeight> {
    let per = info.rows_per_mat();
    let fail = |why: &str| crate::error::shape("set_layer_experts", format!("{}: {why}", info.name));
    let rb = info.ty.row_bytes(info.k).ok_or_else(|| fail("row bytes"))?;
    let kept = order.iter().take_while(|e| held.contains(e)).count();
    // (device tensor, rows per expert, byte range of an expert's matrix in the file)
    let halves: Vec<(&DeviceWeight, usize, std::ops::Range<usize>)> = match (part, old) {
        (ExpertPart::Whole, Some(DevWeight::Matrix(w))) => vec![(w, per, 0..per * rb)],
        (ExpertPart::Fused, Some(DevWeight::Split { gate, up })) if per == 2 * n_ff => {
            vec![(gate, n_ff, 0..n_ff * rb), (up, n_ff, n_ff * rb..2 * n_ff * rb)]
        }
        _ => return Err(fail("no tensor to rebuild from")),
    };
    let mut out = Vec::new();
    for (w, rows, bytes) in halves {
        let mut new = DeviceWeight::scratch(gpu, (order.len() * rows * rb).max(1))?;
        new.reshape(info.ty, info.k, order.len() * rows)?;
        for (j, e) in order[..kept].iter().enumerate() {
            let s = held.iter().position(|h| h == e).ok_or_else(|| fail("kept expert not held"))?;
            new.copy_rows_from(gpu, j * rows, w, s * rows, rows)?;
        }
        let mut parts: Vec<&[u8]> = Vec::new();
        for &e in &order[kept..] {
            let m = set.matrix(id, e as usize).ok_or_else(|| fail("expert"))?;
            parts.push(&m.data[bytes.clone()]);
        }
        new.write_rows_parts(gpu, kept * rows, &parts)?;
        out.push(new);
    }
    let mut it = out.into_iter();
    match (part, it.next(), it.next()) {
        (ExpertPart::Whole, Some(w), None) => Ok(DevWeight::Matrix(w)),
        (ExpertPart::Fused, Some(gate), Some(up)) => Ok(DevWeight::Split { gate, up }),
        _ => Err(fail("halves")),
    }
}

/// Uploads experts `list` of a stacked expert tensor, one slot each in that order (a fused
/// gate|up tensor split as [`split`] does).
fn some_experts(
    gpu: &Gpu,
    set: &WeightSet,
    id: WeightId,
    info: &WeightInfo,
    part: ExpertPart,
    list: &[u16],
    n_ff: usize,
) -> crate::Result<DevWeight> {
    let per = info.rows_per_mat();
    let mat = |e: u16| {
        set.matrix(id, e as usize).map(|v| v.data).ok_or_else(|| crate::error::shape("register", format!("{}: expert {e}", info.name)))
    };
    match part {
        ExpertPart::Whole => {
            let mut bytes = Vec::new();
            for &e in list {
                bytes.extend_from_slice(mat(e)?);
            }
            Ok(DevWeight::Matrix(gpu.upload_weight(info.ty, info.k, list.len() * per, &bytes)?))
        }
        ExpertPart::Fused => {
            let rb = info.ty.row_bytes(info.k).unwrap_or(0);
            if per != 2 * n_ff {
                return Err(crate::error::shape("register", format!("{}: {per} rows per expert, not 2 x {n_ff}", info.name)));
            }
            let (mut g, mut u) = (Vec::new(), Vec::new());
            for &e in list {
                let b = mat(e)?;
                g.extend_from_slice(&b[..n_ff * rb]);
                u.extend_from_slice(&b[n_ff * rb..2 * n_ff * rb]);
            }
            let rows = list.len() * n_ff;
            Ok(DevWeight::Split { gate: gpu.upload_weight(info.ty, info.k, rows, &g)?, up: gpu.upload_weight(info.ty, info.k, rows, &u)? })
        }
    }
}

/// Uploads a fused `[gate | up]` expert tensor as two stacked tensors.
fn split(gpu: &Gpu, info: &WeightInfo, n_ff: usize, bytes: &[u8]) -> crate::Result<DevWeight> {
    let rb = info.ty.row_bytes(info.k).ok_or_else(|| crate::error::shape("register", format!("{}: k {}", info.name, info.k)))?;
    let half = n_ff * rb;
    let (mut g, mut u) = (Vec::with_capacity(bytes.len() / 2), Vec::with_capacity(bytes.len() / 2));
    for e in bytes.chunks_exact(2 * half) {
        g.extend_from_slice(&e[..half]);
        u.extend_from_slice(&e[half..]);
    }
    let rows = info.n_mat * n_ff;
    Ok(DevWeight::Split { gate: gpu.upload_weight(info.ty, info.k, rows, &g)?, up: gpu.upload_weight(info.ty, info.k, rows, &u)? })
}
