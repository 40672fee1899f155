//! The registered weights on the device: every matrix as its file's block bytes, every vector
//! as f32, uploaded once at `register`. A fused `[gate | up]` expert tensor is uploaded split
//! into its gate and up halves (the MoE kernels read them as two stacked tensors); it is read
//! by nothing else.

use std::sync::Arc;

use ember_ops::{DeviceId, GateUp, LayerIdx, OpError, OpResult, Registry, WeightId, WeightInfo, WeightSet};

use crate::ops::DeviceWeight;
use crate::{Buf, Gpu};

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

pub(super) struct DevWeights {
    pub reg: Registry,
    w: Vec<Option<DevWeight>>,
    dev: DeviceId,
}

impl DevWeights {
    pub fn empty(dev: DeviceId) -> Self {
        DevWeights { reg: Registry::new(dev), w: Vec::new(), dev }
    }

    /// Uploads every weight of `set`.
    pub fn upload(gpu: &Gpu, dev: DeviceId, set: Arc<WeightSet>) -> OpResult<Self> {
        const OP: &str = "register";
        let fail = |name: &str, e: crate::Error| OpError::new(OP, dev, name.to_string(), e.to_string());
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
            let dw = if let Some(v) = set.vector(id) {
                DevWeight::Vector(gpu.upload(v).map_err(|e| fail(&info.name, e))?)
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
        Ok(DevWeights { reg, w, dev })
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
