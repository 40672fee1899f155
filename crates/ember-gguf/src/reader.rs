use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::types::GgmlType;
use crate::value::{Value, ValueType};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_NAME (64, including the NUL).
const MAX_TENSOR_NAME: u64 = 63;
const MAX_DIMS: u32 = 4;

/// One tensor of the file: name, type, shape and where its bytes are.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// Number of dimensions as stored (1..=4).
    pub n_dims: u32,
    /// Shape, innermost first; missing dimensions are 1.
    pub ne: [u64; 4],
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
    /// File offset of this tensor-info record (for error messages).
    pub info_offset: u64,
    /// Which file of a split model holds the data (0: the first, or the only one).
    pub part: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Number of rows of `ne[0]` elements (ne1 * ne2 * ne3).
    pub fn n_rows(&self) -> u64 {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes of one row of `ne[0]` elements.
    pub fn row_bytes(&self) -> usize {
        // unwrap: validated at parse time (ne[0] is a multiple of the block size and the
        // tensor's byte size fits in the file, so a row fits in usize).
        self.ggml_type.row_bytes(self.ne[0] as usize).unwrap()
    }

    /// The shape without trailing 1s, for display: `[2048, 512, 256]`.
    pub fn shape(&self) -> Vec<u64> {
        let mut n = self.n_dims as usize;
        while n > 1 && self.ne[n - 1] == 1 {
            n -= 1;
        }
        self.ne[..n].to_vec()
    }
}

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One file of a model: its bytes and where its data section starts.
struct Part {
    backing: Backing,
    data_offset: u64,
}

/// Bytes read per step when a file is read into memory (progress granularity).
const READ_CHUNK: usize = 64 << 20;

/// How [`GgufFile::open_with`] brings a file in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LoadMode {
    /// Memory-map (the default: pages come in on demand and stay shared with the page cache).
    #[default]
    Mmap,
    /// Read every byte into process memory (`--no-mmap`: for file systems where mapping is
    /// slow or unavailable).
    Read,
}

/// A parsed, validated GGUF model: one file, or every file of a split model (llama.cpp's
/// `gguf-split`: `NAME-00001-of-0000N.gguf`, `split.*` keys) seen as one. Metadata comes from
/// the first file; tensor bytes are served from the memory map of the file that holds them.
pub struct GgufFile {
    parts: Vec<Part>,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses a file (with its other parts when it is the first of a split
    /// model).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, LoadMode::Mmap, &mut |_, _| {})
    }

    /// [`GgufFile::open`] with a choice of mapping or reading; `progress(done, total)` is
    /// called as bytes are read (`LoadMode::Read` only; totals span every part).
    pub fn open_with(path: impl AsRef<Path>, mode: LoadMode, progress: &mut dyn FnMut(u64, u64)) -> Result<Self> {
        let path = path.as_ref();
        let first = Self::parse(load(path, mode, &mut |done, total| progress(done, total))?)?;
        let Some(n_split) = first.split_key("split.count")? else {
            return Ok(first);
        };
        let no = first.split_key("split.no")?.unwrap_or(0);
        if n_split <= 1 {
            return Ok(first);
        }
        let paths = split_paths(path, n_split)?;
        if no != 0 {
            return Err(Error::Split {
                path: path.to_owned(),
                msg: format!("this is part {} of {n_split}; open the first part, {}", no + 1, paths[0].display()),
            });
        }
        let total: u64 = paths.iter().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
        let mut done = first.file_len();
        let mut model = first;
        for (i, p) in paths.iter().enumerate().skip(1) {
            if !p.is_file() {
                return Err(Error::Split { path: p.clone(), msg: format!("part {} of {n_split} is missing", i + 1) });
            }
            let base = done;
            let part = Self::parse(load(p, mode, &mut |d, _| progress(base + d, total))?)
                .map_err(|e| Error::Split { path: p.clone(), msg: format!("part {} of {n_split} does not parse: {e}", i + 1) })?;
            done += part.file_len();
            let bad = |msg: String| Error::Split { path: p.clone(), msg };
            match (part.split_key("split.count")?, part.split_key("split.no")?) {
                (Some(c), Some(n)) if c == n_split && n == i as u64 => {}
                (c, n) => {
                    return Err(bad(format!(
                        "expected part {} of {n_split} (split.no {i}, split.count {n_split}), found split.no {n:?}, split.count {c:?}: \
                         the parts come from different splits",
                        i + 1
                    )));
                }
            }
            if part.alignment != model.alignment {
                return Err(bad(format!("alignment {} differs from the first part's {}", part.alignment, model.alignment)));
            }
            let index = model.parts.len();
            let GgufFile { parts, tensors, .. } = part;
            model.parts.extend(parts);
            for mut t in tensors {
                t.part = index;
                if model.tensor_index.insert(t.name.clone(), model.tensors.len()).is_some() {
                    return Err(bad(format!("tensor '{}' is also in an earlier part", t.name)));
                }
                model.tensors.push(t);
            }
        }
        if let Some(n) = model.split_key("split.tensors.count")?
            && n != model.tensors.len() as u64
        {
            return Err(Error::Split {
                path: path.to_owned(),
                msg: format!("split.tensors.count says {n} tensors, the {n_split} parts hold {}", model.tensors.len()),
            });
        }
        Ok(model)
    }

    /// An integer `split.*` key, if present.
    fn split_key(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_u64(key).map(Some),
        }
    }

    /// Parses a file held in memory (tests, fuzzing, small files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Backing::Owned(bytes))
    }

    /// Number of files the model was read from (1 unless split).
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// File offset of the data section (of the first file).
    pub fn data_offset(&self) -> u64 {
        self.parts[0].data_offset
    }

    /// Bytes of the file (of all files of a split model).
    pub fn file_len(&self) -> u64 {
        self.parts.iter().map(|p| p.backing.bytes().len() as u64).sum()
    }

    /// All key/value pairs, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::MissingKey { key: key.to_owned() })
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, "string", v))
    }

    /// An integer key of any integer type, checked to fit in u64.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_int().and_then(|i| u64::try_from(i).ok()).ok_or_else(|| wrong_type(key, "non-negative integer", v))
    }

    pub fn get_u32(&self, key: &str) -> Result<u32> {
        let v = self.require(key)?;
        v.as_int().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| wrong_type(key, "u32", v))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_f64().map(|f| f as f32).ok_or_else(|| wrong_type(key, "number", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| wrong_type(key, "bool", v))
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| wrong_type(key, "array", v))
    }

    /// A string-array key as borrowed strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, "array<string>", v))?;
        items.iter().map(|x| x.as_str().ok_or_else(|| wrong_type(key, "array<string>", v))).collect()
    }

    /// An integer-array key as i64s.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.require(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, "array<int>", v))?;
        items.iter().map(|x| x.as_int().and_then(|i| i64::try_from(i).ok()).ok_or_else(|| wrong_type(key, "array<int>", v))).collect()
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were validated at parse time).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let part = &self.parts[t.part];
        let start = (part.data_offset + t.offset) as usize;
        &part.backing.bytes()[start..start + t.n_bytes as usize]
    }

    /// Advise the kernel that the whole file will be read soon (best effort).
    pub fn advise_willneed(&self) {
        for p in &self.parts {
            if let Backing::Mmap(m) = &p.backing {
                let _ = m.advise(memmap2::Advice::WillNeed);
            }
        }
    }

    /// Maps every page of the file into this process now (reading it into the page cache where
    /// needed), so that inference never stops on a page fault: without it the first touch of
    /// each expert's pages costs a fault in the middle of a token, which shows as decode speed
    /// creeping up over the first hundreds of tokens. Best effort (Linux ≥ 5.14; elsewhere a
    /// no-op); returns whether it was done. Callers should only ask when the file fits in
    /// memory with room to spare.
    pub fn populate(&self) -> bool {
        self.populate_with(&mut |_, _| {})
    }

    /// [`GgufFile::populate`] in steps of 64 MiB, calling `progress(done, total)` after each.
    pub fn populate_with(&self, progress: &mut dyn FnMut(u64, u64)) -> bool {
        let total = self.file_len();
        let mut done = 0u64;
        let mut all = true;
        for p in &self.parts {
            match &p.backing {
                #[cfg(target_os = "linux")]
                Backing::Mmap(m) => {
                    let mut at = 0;
                    while at < m.len() {
                        let n = READ_CHUNK.min(m.len() - at);
                        all &= m.advise_range(memmap2::Advice::PopulateRead, at, n).is_ok();
                        at += n;
                        progress(done + at as u64, total);
                    }
                }
                #[cfg(not(target_os = "linux"))]
                Backing::Mmap(_) => all = false,
                Backing::Owned(_) => {}
            }
            done += p.backing.bytes().len() as u64;
        }
        all
    }

    fn parse(backing: Backing) -> Result<Self> {
        let bytes = backing.bytes();
        let mut c = Cursor { bytes, pos: 0 };
        let magic: [u8; 4] = c.take(4, "magic")?.try_into().expect("take(4) returns 4 bytes");
        if &magic != MAGIC {
            return Err(Error::BadMagic { found: magic });
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            let hint = if version & 0xFFFF == 0 && version != 0 { " (looks byte-swapped: big-endian files are not supported)" } else { "" };
            return Err(Error::BadVersion { version, hint });
        }
        let n_tensors_at = c.pos as u64;
        let n_tensors = c.u64("tensor count")?;
        let n_kv_at = c.pos as u64;
        let n_kv = c.u64("metadata count")?;
        // Each KV pair needs at least 8 (key len) + 4 (type) + 1 bytes; each tensor info at
        // least 8 + 4 + 8 + 4 + 8. Reject absurd counts before allocating anything.
        let remaining = c.remaining();
        if n_kv.checked_mul(13).is_none_or(|b| b > remaining) {
            return Err(Error::malformed("metadata count", n_kv_at, format!("{n_kv} pairs cannot fit in the {remaining} bytes left")));
        }
        if n_tensors.checked_mul(32).is_none_or(|b| b > remaining) {
            return Err(Error::malformed(
                "tensor count",
                n_tensors_at,
                format!("{n_tensors} tensors cannot fit in the {remaining} bytes left"),
            ));
        }

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index = HashMap::with_capacity(n_kv as usize);
        let mut alignment_at = 0;
        for i in 0..n_kv {
            let at = c.pos as u64;
            let key = c.string(&format!("key of metadata pair {i}"))?;
            let vt_at = c.pos as u64;
            let vt = c.u32(&format!("value type of '{key}'"))?;
            let vt = ValueType::from_id(vt)
                .ok_or_else(|| Error::malformed(format!("value type of '{key}'"), vt_at, format!("unknown type id {vt}")))?;
            let value = c.value(vt, &format!("value of '{key}'"))?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(Error::malformed("metadata key", at, format!("duplicate key '{key}'")));
            }
            if key == "general.alignment" {
                alignment_at = at;
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some(v) => {
                // Numbers are shown; anything else is named by type only (it may be huge).
                let got = match (v.as_int(), v.as_f64()) {
                    (Some(i), _) => format!("{} {i}", v.type_name()),
                    (None, Some(f)) => format!("{} {f}", v.type_name()),
                    _ => v.type_name(),
                };
                return Err(Error::malformed("general.alignment", alignment_at, format!("must be a power-of-two u32, got {got}")));
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let info_offset = c.pos as u64;
            let name = c.string(&format!("name of tensor {i}"))?;
            if name.len() as u64 > MAX_TENSOR_NAME {
                return Err(Error::malformed("tensor name", info_offset, format!("'{name}' is longer than {MAX_TENSOR_NAME} bytes")));
            }
            let dims_at = c.pos as u64;
            let n_dims = c.u32(&format!("n_dims of '{name}'"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(Error::malformed(format!("n_dims of '{name}'"), dims_at, format!("{n_dims} is outside 1..={MAX_DIMS}")));
            }
            let mut ne = [1u64; 4];
            for d in ne.iter_mut().take(n_dims as usize) {
                *d = c.u64(&format!("shape of '{name}'"))?;
            }
            let type_at = c.pos as u64;
            let type_id = c.u32(&format!("type of '{name}'"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
                Error::malformed(format!("type of '{name}'"), type_at, format!("unknown or unsupported ggml type id {type_id}"))
            })?;
            let offset_at = c.pos as u64;
            let offset = c.u64(&format!("offset of '{name}'"))?;
            let bad = |msg: String| Error::malformed(format!("tensor '{name}'"), info_offset, msg);
            // ggml stores ne as int64. Bounding the product of the non-zero dimensions bounds
            // every partial product, so n_elements() and n_rows() cannot overflow even when a
            // zero dimension makes the tensor empty.
            let n_nonzero = ne.iter().filter(|&&d| d != 0).try_fold(1u64, |a, &d| a.checked_mul(d));
            if n_nonzero.is_none_or(|n| n > i64::MAX as u64) {
                return Err(bad(format!("element count of shape {:?} overflows", &ne[..n_dims as usize])));
            }
            if ne[0] % ggml_type.block_size() as u64 != 0 {
                return Err(bad(format!("ne[0] = {} is not a multiple of the {} block size {}", ne[0], ggml_type, ggml_type.block_size())));
            }
            let n_bytes = (ne[0] / ggml_type.block_size() as u64)
                .checked_mul(ggml_type.type_size() as u64)
                .and_then(|b| b.checked_mul(ne[1]))
                .and_then(|b| b.checked_mul(ne[2]))
                .and_then(|b| b.checked_mul(ne[3]))
                .filter(|&b| b <= bytes.len() as u64)
                .ok_or_else(|| bad(format!("shape {:?} of type {} is larger than the file", &ne[..n_dims as usize], ggml_type)))?;
            if offset % alignment != 0 {
                return Err(Error::malformed(
                    format!("offset of '{name}'"),
                    offset_at,
                    format!("{offset} is not a multiple of the alignment {alignment}"),
                ));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::malformed("tensor name", info_offset, format!("duplicate tensor '{name}'")));
            }
            tensors.push(TensorInfo { name, ggml_type, n_dims, ne, offset, n_bytes, info_offset, part: 0 });
        }

        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        // Tensors are checked against the file length, not a saturated data length: the padded
        // data start may lie past the end of a short file, and even an empty tensor there would
        // make tensor_data() slice out of bounds.
        let data_len = file_len.checked_sub(data_offset);
        for t in &tensors {
            match data_len {
                Some(data_len) if t.offset <= data_len => {
                    if t.n_bytes > data_len - t.offset {
                        return Err(Error::Truncated {
                            what: format!("data of tensor '{}'", t.name),
                            offset: data_offset + t.offset,
                            needed: t.n_bytes,
                            file_len,
                        });
                    }
                }
                _ => {
                    return Err(Error::malformed(
                        format!("offset of '{}'", t.name),
                        t.info_offset,
                        format!(
                            "data offset {} is beyond the end of the data section \
                             ({} bytes from file offset {data_offset}; file is {file_len} bytes)",
                            t.offset,
                            data_len.unwrap_or(0),
                        ),
                    ));
                }
            }
        }
        let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
        by_offset.sort_by_key(|t| t.offset);
        for w in by_offset.windows(2) {
            if w[0].offset + w[0].n_bytes > w[1].offset {
                return Err(Error::malformed(
                    format!("tensor '{}'", w[1].name),
                    w[1].info_offset,
                    format!(
                        "data at {}..{} overlaps tensor '{}' at {}..{}",
                        w[1].offset,
                        w[1].offset + w[1].n_bytes,
                        w[0].name,
                        w[0].offset,
                        w[0].offset + w[0].n_bytes
                    ),
                ));
            }
        }

        Ok(GgufFile { parts: vec![Part { backing, data_offset }], version, alignment, metadata, key_index, tensors, tensor_index })
    }
}

/// Maps or reads one file.
fn load(path: &Path, mode: LoadMode, progress: &mut dyn FnMut(u64, u64)) -> Result<Backing> {
    let open_err = |source| Error::Open { path: path.to_owned(), source };
    let mut file = std::fs::File::open(path).map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    if !meta.is_file() {
        // open(2) succeeds on a directory; mmap would then fail with a bare ENODEV.
        let kind = if meta.is_dir() { "is a directory" } else { "is not a regular file" };
        return Err(open_err(std::io::Error::new(std::io::ErrorKind::InvalidInput, kind)));
    }
    let len = meta.len();
    if len == 0 {
        return Err(Error::Truncated { what: "magic".into(), offset: 0, needed: 4, file_len: 0 });
    }
    match mode {
        LoadMode::Mmap => {
            // SAFETY: the map is read-only and private. If another process truncates or rewrites
            // the file while it is mapped, reads may fault or see new bytes; that is the
            // documented contract of memory-mapped model files (llama.cpp has the same), and the
            // parser never trusts the bytes: every read is bounds-checked against this length.
            let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(open_err)?;
            Ok(Backing::Mmap(map))
        }
        LoadMode::Read => {
            let len = usize::try_from(len).map_err(|_| open_err(std::io::Error::other("file larger than the address space")))?;
            let mut bytes = Vec::new();
            bytes.try_reserve_exact(len).map_err(|e| open_err(std::io::Error::other(format!("cannot allocate {len} bytes: {e}"))))?;
            let mut buf = vec![0u8; READ_CHUNK.min(len)];
            loop {
                let n = file.read(&mut buf).map_err(open_err)?;
                if n == 0 {
                    break;
                }
                bytes.extend_from_slice(&buf[..n]);
                progress(bytes.len() as u64, len as u64);
            }
            Ok(Backing::Owned(bytes))
        }
    }
}

/// The paths of every part of a split model, from the name of any one of them:
/// `NAME-00001-of-00003.gguf` -> `NAME-0000{1,2,3}-of-00003.gguf` (llama.cpp `llama_split_path`).
fn split_paths(path: &Path, n_split: u64) -> Result<Vec<PathBuf>> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let parsed = name.strip_suffix(".gguf").and_then(|stem| {
        let (rest, count) = stem.rsplit_once("-of-")?;
        let (prefix, no) = rest.rsplit_once('-')?;
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        (digits(no) && digits(count)).then_some((prefix, count.parse::<u64>().ok()?))
    });
    let Some((prefix, count)) = parsed else {
        return Err(Error::Split {
            path: path.to_owned(),
            msg: format!(
                "split.count is {n_split} but the file name does not end in -NNNNN-of-NNNNN.gguf, so the other parts cannot be found"
            ),
        });
    };
    if count != n_split {
        return Err(Error::Split { path: path.to_owned(), msg: format!("the file name says {count} parts, split.count says {n_split}") });
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    Ok((1..=n_split).map(|i| dir.join(format!("{prefix}-{i:05}-of-{n_split:05}.gguf"))).collect())
}

fn wrong_type(key: &str, expected: &'static str, v: &Value) -> Error {
    Error::WrongType { key: key.to_owned(), expected, found: v.type_name() }
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Truncated { what: what.to_owned(), offset: self.pos as u64, needed: n, file_len: self.bytes.len() as u64 });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("take(N) returns N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64(what)?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|e| Error::malformed(what, at + 8, format!("invalid UTF-8: {e}")))
    }

    /// One value; `what` names it in errors. It is formatted once by the caller, not per
    /// array element: a long key times a long array would otherwise cost quadratic time.
    fn value(&mut self, vt: ValueType, what: &str) -> Result<Value> {
        Ok(match vt {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let at = self.pos as u64;
                match self.array::<1>(what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(Error::malformed(what, at, format!("bool byte is {b}, expected 0 or 1"))),
                }
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                let at = self.pos as u64;
                let et = self.u32(what)?;
                let et = ValueType::from_id(et).ok_or_else(|| Error::malformed(what, at, format!("unknown array element type id {et}")))?;
                if et == ValueType::Array {
                    return Err(Error::malformed(what, at, "nested arrays are not allowed"));
                }
                let count_at = self.pos as u64;
                let count = self.u64(what)?;
                // Strings need at least 8 bytes each; scalars their size.
                let min = et.scalar_size().unwrap_or(8) as u64;
                if count.checked_mul(min).is_none_or(|b| b > self.remaining()) {
                    return Err(Error::malformed(
                        what,
                        count_at,
                        format!("array of {count} elements cannot fit in the {} bytes left", self.remaining()),
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(et, what)?);
                }
                Value::Array(et, items)
            }
        })
    }
}
