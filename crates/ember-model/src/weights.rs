//! Weights that borrow the memory-mapped file, and the loader's shape checks.

use std::sync::Arc;

use ember_gguf::{GgmlType, GgufFile, TensorInfo};
use ember_ops::{Device, WeightView};

use crate::Error;

/// A tensor of the model file, still in its block format.
#[derive(Debug, Clone)]
pub struct Weight {
    file: Arc<GgufFile>,
    info: TensorInfo,
    /// Rows per expert for stacked expert tensors ({k, n, n_expert}); the row count otherwise.
    rows_per_slice: usize,
}

impl Weight {
    pub fn info(&self) -> &TensorInfo {
        &self.info
    }

    pub fn ty(&self) -> GgmlType {
        self.info.ggml_type
    }

    /// All rows as one 2-D view (experts stacked).
    pub fn view(&self) -> WeightView<'_> {
        WeightView {
            ty: self.info.ggml_type,
            k: self.info.ne[0] as usize,
            n_rows: self.info.n_rows() as usize,
            data: self.file.tensor_data(&self.info),
            device: Device::Host,
        }
    }

    /// Expert `e` of a stacked {k, n, n_expert} tensor.
    pub fn expert(&self, e: usize) -> WeightView<'_> {
        self.view().rows(e * self.rows_per_slice, self.rows_per_slice)
    }

    /// The whole tensor dequantised (only for small vectors: norms, conv taps, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>, Error> {
        let mut out = vec![0f32; self.info.n_elements() as usize];
        ember_gguf::quant::dequantize(self.ty(), self.file.tensor_data(&self.info), &mut out)?;
        Ok(out)
    }
}

/// Looks tensors up by name and checks their shapes.
pub(crate) struct Loader {
    pub file: Arc<GgufFile>,
}

impl Loader {
    /// A tensor that must exist with shape `ne` (trailing 1s ignored).
    pub fn get(&self, name: &str, ne: &[usize]) -> Result<Weight, Error> {
        self.try_get(name, ne)?.ok_or_else(|| Error::BadTensor { name: name.into(), msg: "missing from the file".into() })
    }

    pub fn try_get(&self, name: &str, ne: &[usize]) -> Result<Option<Weight>, Error> {
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
        let rows_per_slice = if ne.len() >= 3 { ne[1] } else { info.n_rows() as usize };
        Ok(Some(Weight { file: self.file.clone(), info: info.clone(), rows_per_slice }))
    }

    /// A small vector, dequantised to f32.
    pub fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>, Error> {
        self.get(name, &[n])?.to_f32()
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
