use std::io::Write;

use crate::error::{Error, Result};
use crate::types::GgmlType;
use crate::value::Value;

/// A tensor to be written: name, type and shape (innermost first).
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub ggml_type: GgmlType,
    pub ne: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, ggml_type: GgmlType, ne: &[u64]) -> Self {
        TensorSpec { name: name.into(), ggml_type, ne: ne.to_vec() }
    }

    /// Bytes of the tensor's data, or an error if the shape does not fit the block size.
    pub fn n_bytes(&self) -> Result<u64> {
        let ne0 = *self.ne.first().ok_or_else(|| Error::BadTensor { name: self.name.clone(), msg: "no dimensions".into() })?;
        let row = self.ggml_type.row_bytes(ne0 as usize).ok_or_else(|| Error::BadTensor {
            name: self.name.clone(),
            msg: format!("ne[0] = {ne0} is not a multiple of the {} block size {}", self.ggml_type, self.ggml_type.block_size()),
        })?;
        self.ne[1..]
            .iter()
            .try_fold(row as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Error::BadTensor { name: self.name.clone(), msg: format!("shape {:?} overflows the byte size", self.ne) })
    }
}

/// Writes GGUF v3 files in the layout llama.cpp requires: tensors stored in tensor-info
/// order, each starting at the next multiple of the alignment. Tensor data is streamed,
/// so files larger than memory can be written.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces a metadata key (insertion order is kept).
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    pub fn add_tensor(&mut self, spec: TensorSpec) -> &mut Self {
        self.tensors.push(spec);
        self
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
            _ => 32,
        }
    }

    /// Writes the whole file. `data(i, out)` must write exactly the bytes of tensor `i`.
    pub fn write<W: Write>(&self, out: &mut W, mut data: impl FnMut(usize, &mut dyn Write) -> Result<()>) -> Result<()> {
        let align = self.alignment();
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut header, k);
            header.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut header, v)?;
        }
        let mut offset = 0u64;
        let mut sizes = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let n = t.n_bytes()?;
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            sizes.push(n);
            offset = (offset + n).div_ceil(align) * align;
        }
        let pad = (header.len() as u64).div_ceil(align) * align - header.len() as u64;
        header.resize(header.len() + pad as usize, 0);
        out.write_all(&header)?;

        for (i, &n) in sizes.iter().enumerate() {
            let mut counter = CountingWriter { inner: &mut *out, n: 0 };
            data(i, &mut counter)?;
            if counter.n != n {
                return Err(Error::BadTensor {
                    name: self.tensors[i].name.clone(),
                    msg: format!("wrote {} bytes, expected {n}", counter.n),
                });
            }
            let pad = n.div_ceil(align) * align - n;
            if i + 1 < sizes.len() {
                out.write_all(&vec![0u8; pad as usize])?;
            }
        }
        out.flush()?;
        Ok(())
    }

    /// Builds a whole file in memory from one byte buffer per tensor.
    pub fn to_bytes(&self, data: &[&[u8]]) -> Result<Vec<u8>> {
        if data.len() != self.tensors.len() {
            return Err(Error::Quant(format!("{} data buffers for {} tensors", data.len(), self.tensors.len())));
        }
        let mut out = Vec::new();
        self.write(&mut out, |i, w| Ok(w.write_all(data[i])?))?;
        Ok(out)
    }
}

struct CountingWriter<'a, W: Write> {
    inner: &'a mut W,
    n: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(et, items) => {
            if *et == crate::value::ValueType::Array {
                return Err(Error::Quant("nested arrays cannot be written".into()));
            }
            out.extend_from_slice(&et.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                if it.value_type() != *et {
                    return Err(Error::Quant(format!("array of {et:?} holds a {:?}", it.value_type())));
                }
                put_value(out, it)?;
            }
        }
    }
    Ok(())
}

/// Writes `src` as `n_split` files in llama.cpp's `gguf-split` layout, which
/// [`crate::GgufFile::open`] reads back as one model: the first part holds every metadata key
/// plus `split.no` (u16), `split.count` (u16) and `split.tensors.count` (i32); every other
/// part holds only its `split.*` keys; tensors are shared out in order, in contiguous runs.
/// `stem` is the path without the `-00001-of-0000N.gguf` tail. Returns the paths written.
pub fn write_split(src: &crate::GgufFile, n_split: usize, stem: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    let n_tensors = src.tensors().len();
    if n_split == 0 || n_split > n_tensors || n_split > u16::MAX as usize {
        return Err(Error::Quant(format!("cannot split {n_tensors} tensors into {n_split} parts")));
    }
    let n_total = i32::try_from(n_tensors).map_err(|_| Error::Quant(format!("{n_tensors} tensors do not fit split.tensors.count")))?;
    let mut paths = Vec::with_capacity(n_split);
    for i in 0..n_split {
        let (lo, hi) = (i * n_tensors / n_split, (i + 1) * n_tensors / n_split);
        let mut w = GgufWriter::new();
        if i == 0 {
            for (k, v) in src.metadata() {
                w.set(k.clone(), v.clone());
            }
        } else if let Some(a) = src.get("general.alignment") {
            w.set("general.alignment", a.clone());
        }
        w.set("split.no", Value::U16(i as u16))
            .set("split.count", Value::U16(n_split as u16))
            .set("split.tensors.count", Value::I32(n_total));
        let infos = &src.tensors()[lo..hi];
        for t in infos {
            w.add_tensor(TensorSpec::new(t.name.clone(), t.ggml_type, &t.ne[..t.n_dims as usize]));
        }
        let name = format!("{}-{:05}-of-{n_split:05}.gguf", stem.file_name().and_then(|n| n.to_str()).unwrap_or("model"), i + 1);
        let path = stem.with_file_name(name);
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        w.write(&mut out, |j, o| Ok(o.write_all(src.tensor_data(&infos[j]))?))?;
        paths.push(path);
    }
    Ok(paths)
}
