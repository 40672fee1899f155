//! The loader's shape checks and weight registration, and the byte groups `inspect` reports.

use std::sync::Arc;

use ember_gguf::{GgmlType, GgufFile, TensorInfo};
use ember_ops::{WeightId, WeightSet};

use crate::Error;

/// Looks tensors up by name, checks their shapes and registers them in the model's
/// [`WeightSet`] (by identity: ops name them by [`WeightId`]).
pub(crate) struct Loader {
    pub file: Arc<GgufFile>,
    pub set: WeightSet,
}

impl Loader {
    /// A tensor that must exist with shape `ne` (trailing 1s ignored); a 3-D shape registers
    /// `ne[2]` stacked matrices (experts).
    pub fn get(&mut self, name: &str, ne: &[usize]) -> Result<WeightId, Error> {
        self.try_get(name, ne)?.ok_or_else(|| Error::BadTensor { name: name.into(), msg: "missing from the file".into() })
    }

    pub fn try_get(&mut self, name: &str, ne: &[usize]) -> Result<Option<WeightId>, Error> {
        let Some(info) = self.checked(name, ne)? else { return Ok(None) };
        let n_mat = if ne.len() >= 3 { ne[2] } else { 1 };
        Ok(Some(self.set.add_tensor(&self.file, &info, n_mat)))
    }

    fn checked(&self, name: &str, ne: &[usize]) -> Result<Option<TensorInfo>, Error> {
        let Some(info) = self.file.tensor(name) else { return Ok(None) };
        let mut want = [1u64; 4];
        for (w, n) in want.iter_mut().zip(ne) {
            *w = *n as u64;
        }
        if info.ne != want {
            return Err(Error::BadTensor { name: name.into(), msg: format!("shape {:?}, expected {:?}", info.shape(), ne) });
        }
        if matches!(info.ggml_type, GgmlType::Q8_1 | GgmlType::Q8K) {
            return Err(Error::BadTensor { name: name.into(), msg: format!("type {} is for activations, not weights", info.ggml_type) });
        }
        Ok(Some(info.clone()))
    }

    /// A small tensor of shape `ne`, dequantised to f32 and registered as a vector weight.
    pub fn vector(&mut self, name: &str, ne: &[usize]) -> Result<WeightId, Error> {
        let info = self.checked(name, ne)?.ok_or_else(|| Error::BadTensor { name: name.into(), msg: "missing from the file".into() })?;
        let mut out = vec![0f32; info.n_elements() as usize];
        ember_gguf::quant::dequantize(info.ggml_type, self.file.tensor_data(&info), &mut out)?;
        Ok(self.set.add_vector(name, out))
    }

    /// A small vector of `n` values ([`Loader::vector`]).
    pub fn vec(&mut self, name: &str, n: usize) -> Result<WeightId, Error> {
        self.vector(name, &[n])
    }
}

/// How `ember inspect` groups bytes (DESIGN.md: trunk first, then experts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorGroup {
    /// Read for every token: projections, norms, router, shared expert, output head.
    Trunk,
    /// Routed experts: only the selected ones are read per token.
    RoutedExperts,
    /// The input embedding table (one row read per token).
    Embeddings,
    /// MTP block (not run by the main pass).
    Mtp,
}

impl TensorGroup {
    pub fn of(name: &str, n_layer: usize) -> Self {
        if name.starts_with("token_embd") {
            return TensorGroup::Embeddings;
        }
        if let Some(rest) = name.strip_prefix("blk.") {
            let layer: Option<usize> = rest.split('.').next().and_then(|s| s.parse().ok());
            if layer.is_some_and(|l| l >= n_layer) {
                return TensorGroup::Mtp;
            }
            if name.contains("_exps") {
                return TensorGroup::RoutedExperts;
            }
        }
        TensorGroup::Trunk
    }

    pub fn name(self) -> &'static str {
        match self {
            TensorGroup::Trunk => "trunk",
            TensorGroup::RoutedExperts => "routed experts",
            TensorGroup::Embeddings => "embeddings",
            TensorGroup::Mtp => "mtp",
        }
    }
}
