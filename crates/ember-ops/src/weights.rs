//! Weights by identity: the model registers every tensor it reads once, at load, in a
//! [`WeightSet`]; ops name weights by [`WeightId`]. A host backend resolves an id to the
//! memory-mapped bytes; a device backend uploads the same bytes once and resolves ids to device
//! memory. Small f32 vectors (norms, conv taps, decay parameters) are weights too.

use std::collections::HashMap;
use std::sync::Arc;

use ember_gguf::{GgmlType, GgufFile, TensorInfo};

use crate::{DeviceId, ExpertId, LayerIdx, OpError, OpResult, WeightId, WeightView};

/// What a registered weight is: `n_rows` rows of `k` values of type `ty`; a stacked expert
/// tensor has `n_mat` matrices of `n_rows / n_mat` rows each.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightInfo {
    pub name: String,
    pub ty: GgmlType,
    pub k: usize,
    pub n_rows: usize,
    pub n_mat: usize,
}

impl WeightInfo {
    pub fn rows_per_mat(&self) -> usize {
        self.n_rows / self.n_mat.max(1)
    }

    /// "512x2048 Q4_K" (rows x k, type), for error messages.
    pub fn describe(&self) -> String {
        format!("{} {}x{} {}", self.name, self.n_rows, self.k, self.ty)
    }
}

#[derive(Debug)]
enum Source {
    /// A tensor of a (memory-mapped) model file.
    File { file: Arc<GgufFile>, info: TensorInfo },
    /// A small vector converted to f32 at load.
    Vector(Vec<f32>),
    /// Block-format bytes held in memory (synthetic weights, tests).
    Bytes(Vec<u8>),
}

#[derive(Debug)]
struct Entry {
    info: WeightInfo,
    src: Source,
}

/// The gate and up projections of a layer's routed experts: two stacked tensors, or one with
/// `[gate | up]` rows per expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUp {
    Separate { gate: WeightId, up: WeightId },
    Fused(WeightId),
}

/// The weights of one layer's mixture of experts (qwen35moe.md §6.6), registered so the `moe`
/// op can be called with just the layer, the routing and the shared-expert gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeWeights {
    pub n_expert: usize,
    /// Hidden width of one routed expert.
    pub n_ff: usize,
    pub gate_up: GateUp,
    pub down: WeightId,
    /// The shared expert: gate, up {D -> n_ff_shexp}, down {n_ff_shexp -> D}.
    pub shared: [WeightId; 3],
}

/// One expert's three matrices, borrowed from the registered bytes (host backends).
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    pub gate: WeightView<'a>,
    pub up: WeightView<'a>,
    pub down: WeightView<'a>,
}

/// Every weight a model reads, by id, and the MoE layout of each layer.
#[derive(Debug, Default)]
pub struct WeightSet {
    entries: Vec<Entry>,
    by_name: HashMap<String, WeightId>,
    moe: Vec<Option<MoeWeights>>,
}

impl WeightSet {
    pub fn new() -> Self {
        WeightSet::default()
    }

    fn push(&mut self, info: WeightInfo, src: Source) -> WeightId {
        if let Some(&id) = self.by_name.get(&info.name) {
            return id;
        }
        let id = WeightId(self.entries.len() as u32);
        self.by_name.insert(info.name.clone(), id);
        self.entries.push(Entry { info, src });
        id
    }

    /// Registers a tensor of `file` as `n_mat` stacked matrices of `k`-wide rows. The caller
    /// has checked its shape; registering the same name twice returns the first id.
    pub fn add_tensor(&mut self, file: &Arc<GgufFile>, info: &TensorInfo, n_mat: usize) -> WeightId {
        let winfo = WeightInfo {
            name: info.name.clone(),
            ty: info.ggml_type,
            k: info.ne[0] as usize,
            n_rows: info.n_rows() as usize,
            n_mat: n_mat.max(1),
        };
        self.push(winfo, Source::File { file: file.clone(), info: info.clone() })
    }

    /// Registers a matrix given as block-format bytes: `n_rows` rows of `k` values of type
    /// `ty` (`n_mat` stacked matrices). Errors if the byte count does not match.
    pub fn add_bytes(
        &mut self,
        name: &str,
        ty: GgmlType,
        k: usize,
        n_rows: usize,
        n_mat: usize,
        bytes: Vec<u8>,
    ) -> Result<WeightId, String> {
        let want = ty.row_bytes(k).ok_or_else(|| format!("{name}: {k} is not a whole number of {ty} blocks"))? * n_rows;
        if bytes.len() != want || n_mat == 0 || !n_rows.is_multiple_of(n_mat) {
            return Err(format!("{name}: {} bytes for {n_rows} rows of {k} {ty} in {n_mat} matrices (want {want})", bytes.len()));
        }
        let info = WeightInfo { name: name.into(), ty, k, n_rows, n_mat };
        Ok(self.push(info, Source::Bytes(bytes)))
    }

    /// Registers a small f32 vector (a norm weight, conv taps, a bias).
    pub fn add_vector(&mut self, name: &str, values: Vec<f32>) -> WeightId {
        let info = WeightInfo { name: name.into(), ty: GgmlType::F32, k: values.len(), n_rows: 1, n_mat: 1 };
        self.push(info, Source::Vector(values))
    }

    /// Records the MoE layout of `layer`.
    pub fn set_moe(&mut self, layer: LayerIdx, m: MoeWeights) {
        if self.moe.len() <= layer.index() {
            self.moe.resize(layer.index() + 1, None);
        }
        self.moe[layer.index()] = Some(m);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn ids(&self) -> impl Iterator<Item = WeightId> + '_ {
        (0..self.entries.len() as u32).map(WeightId)
    }

    pub fn id(&self, name: &str) -> Option<WeightId> {
        self.by_name.get(name).copied()
    }

    pub fn info(&self, id: WeightId) -> Option<&WeightInfo> {
        self.entries.get(id.index()).map(|e| &e.info)
    }

    pub fn moe(&self, layer: LayerIdx) -> Option<&MoeWeights> {
        self.moe.get(layer.index()).and_then(|m| m.as_ref())
    }

    /// The weight's bytes in its block format (a vector: its f32 values, little-endian order
    /// as stored in memory is not exposed; use [`WeightSet::vector`]).
    pub fn file_bytes(&self, id: WeightId) -> Option<&[u8]> {
        match &self.entries.get(id.index())?.src {
            Source::File { file, info } => Some(file.tensor_data(info)),
            Source::Bytes(b) => Some(b),
            Source::Vector(_) => None,
        }
    }

    /// The values of a vector weight.
    pub fn vector(&self, id: WeightId) -> Option<&[f32]> {
        match &self.entries.get(id.index())?.src {
            Source::Vector(v) => Some(v),
            Source::File { .. } | Source::Bytes(_) => None,
        }
    }

    /// A matrix weight as one 2-D view (stacked matrices one after another).
    pub fn view(&self, id: WeightId) -> Option<WeightView<'_>> {
        let e = self.entries.get(id.index())?;
        let data = self.file_bytes(id)?;
        Some(WeightView { ty: e.info.ty, k: e.info.k, n_rows: e.info.n_rows, data })
    }

    /// Matrix `m` of a stacked weight.
    pub fn matrix(&self, id: WeightId, m: usize) -> Option<WeightView<'_>> {
        let info = self.info(id)?;
        if m >= info.n_mat {
            return None;
        }
        let per = info.rows_per_mat();
        Some(self.view(id)?.rows(m * per, per))
    }

    /// Expert `e` of `layer` as three views.
    pub fn expert(&self, layer: LayerIdx, e: ExpertId) -> Option<ExpertView<'_>> {
        let m = self.moe(layer)?;
        let (gate, up) = match m.gate_up {
            GateUp::Separate { gate, up } => (self.matrix(gate, e.index())?, self.matrix(up, e.index())?),
            GateUp::Fused(w) => {
                let gu = self.matrix(w, e.index())?;
                (gu.rows(0, m.n_ff), gu.rows(m.n_ff, m.n_ff))
            }
        };
        Some(ExpertView { gate, up, down: self.matrix(m.down, e.index())? })
    }

    /// The shared expert of `layer`.
    pub fn shared_expert(&self, layer: LayerIdx) -> Option<ExpertView<'_>> {
        let [g, u, d] = self.moe(layer)?.shared;
        Some(ExpertView { gate: self.view(g)?, up: self.view(u)?, down: self.view(d)? })
    }

    /// Bytes of the weights in the file (vectors count as f32).
    pub fn bytes(&self, id: WeightId) -> usize {
        match self.entries.get(id.index()).map(|e| &e.src) {
            Some(Source::File { file, info }) => file.tensor_data(info).len(),
            Some(Source::Vector(v)) => 4 * v.len(),
            Some(Source::Bytes(b)) => b.len(),
            None => 0,
        }
    }
}

/// A backend's registered weights, with lookups that fail as an [`OpError`] naming the op.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    set: Option<Arc<WeightSet>>,
    device: DeviceId,
}

impl Registry {
    pub fn new(device: DeviceId) -> Self {
        Registry { set: None, device }
    }

    pub fn set(&mut self, weights: Arc<WeightSet>) {
        self.set = Some(weights);
    }

    pub fn weights(&self, op: &'static str) -> OpResult<&Arc<WeightSet>> {
        self.set.as_ref().ok_or_else(|| OpError::new(op, self.device, "", "no weights registered (call Ops::register at load)"))
    }

    fn missing(&self, op: &'static str, what: String) -> OpError {
        OpError::new(op, self.device, what, "not registered")
    }

    pub fn info(&self, op: &'static str, id: WeightId) -> OpResult<&WeightInfo> {
        self.weights(op)?.info(id).ok_or_else(|| self.missing(op, format!("weight {}", id.0)))
    }

    /// A matrix weight; an error if `id` is unknown or a vector.
    pub fn view(&self, op: &'static str, id: WeightId) -> OpResult<WeightView<'_>> {
        self.weights(op)?.view(id).ok_or_else(|| self.missing(op, format!("matrix weight {}", id.0)))
    }

    /// A vector weight; an error if `id` is unknown or a matrix.
    pub fn vector(&self, op: &'static str, id: WeightId) -> OpResult<&[f32]> {
        self.weights(op)?.vector(id).ok_or_else(|| self.missing(op, format!("vector weight {}", id.0)))
    }

    pub fn moe(&self, op: &'static str, layer: LayerIdx) -> OpResult<&MoeWeights> {
        self.weights(op)?.moe(layer).ok_or_else(|| self.missing(op, format!("MoE of {layer}")))
    }

    pub fn expert(&self, op: &'static str, layer: LayerIdx, e: ExpertId) -> OpResult<ExpertView<'_>> {
        self.weights(op)?.expert(layer, e).ok_or_else(|| self.missing(op, format!("expert {} of {layer}", e.0)))
    }

    pub fn shared_expert(&self, op: &'static str, layer: LayerIdx) -> OpResult<ExpertView<'_>> {
        self.weights(op)?.shared_expert(layer).ok_or_else(|| self.missing(op, format!("shared expert of {layer}")))
    }
}
