//! Test support: fixture paths, a safetensors reader for the reference files, and the
//! error statistics every numeric test reports (relative L2 per position, top-1 agreement).
//!
//! Dev-only. Fixtures live in the repository's `tests/fixtures/` so a fresh clone has
//! everything the tests need.

use std::collections::HashMap;
use std::path::PathBuf;

/// `tests/fixtures/<rel>` at the repository root: the build tree's, or, where a test binary runs
/// away from the tree it was built in (the GPU machine), the working directory's.
pub fn fixture(rel: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(rel);
    let local = PathBuf::from("tests/fixtures").join(rel);
    if !built.exists() && local.exists() { local } else { built }
}

/// The tiny-a fixture's reference tensors (`tests/fixtures/tiny-a/refs/<file>-refs.safetensors`,
/// `file` one of "hf" (HF float64), "hfdq" (HF float64 on exactly dequantised weights),
/// "llama" (llama.cpp)), read once per test binary.
pub fn tiny_refs(file: &str) -> &'static HashMap<String, RefTensor> {
    static HF: std::sync::OnceLock<HashMap<String, RefTensor>> = std::sync::OnceLock::new();
    static HFDQ: std::sync::OnceLock<HashMap<String, RefTensor>> = std::sync::OnceLock::new();
    static LLAMA: std::sync::OnceLock<HashMap<String, RefTensor>> = std::sync::OnceLock::new();
    let cell = match file {
        "hf" => &HF,
        "hfdq" => &HFDQ,
        "llama" => &LLAMA,
        _ => panic!("no tiny-a reference file {file:?} (hf, hfdq, llama)"),
    };
    cell.get_or_init(|| read_safetensors(&fixture(&format!("tiny-a/refs/{file}-refs.safetensors"))))
}

/// A tensor from a safetensors file, converted to f64 (ints too).
#[derive(Debug, Clone)]
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl RefTensor {
    /// Row `i` of a 2-D tensor.
    pub fn row(&self, i: usize) -> &[f64] {
        let w = self.shape[1..].iter().product::<usize>();
        &self.data[i * w..(i + 1) * w]
    }
}

/// Reads every tensor of a safetensors file (F64, F32, I64, I32, BF16, F16).
pub fn read_safetensors(path: &std::path::Path) -> HashMap<String, RefTensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("safetensors header json");
    let data = &bytes[8 + n..];
    let mut out = HashMap::new();
    for (name, info) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap();
        let shape: Vec<usize> = info["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let off = info["data_offsets"].as_array().unwrap();
        let raw = &data[off[0].as_u64().unwrap() as usize..off[1].as_u64().unwrap() as usize];
        let vals: Vec<f64> = match dtype {
            "F64" => raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
            "F32" => raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
            "I64" => raw.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
            "I32" => raw.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
            "BF16" => raw.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64).collect(),
            "F16" => raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
            d => panic!("unsupported safetensors dtype {d}"),
        };
        out.insert(name.clone(), RefTensor { shape, data: vals });
    }
    out
}

/// Per-position comparison of logits `got` [T, V] (row-major f32) with `want` [T, V].
#[derive(Debug, Clone)]
pub struct LogitStats {
    /// ||got - want|| / ||want|| per position.
    pub rel: Vec<f64>,
    pub max_abs: f64,
    /// Fraction of positions whose argmax agrees.
    pub top1: f64,
}

impl LogitStats {
    pub fn compare(got: &[f32], want: &RefTensor) -> Self {
        let v = want.shape[1];
        assert_eq!(got.len(), want.data.len(), "logit shapes differ");
        let t = want.shape[0];
        let mut rel = Vec::with_capacity(t);
        let mut max_abs = 0f64;
        let mut agree = 0usize;
        for i in 0..t {
            let g = &got[i * v..(i + 1) * v];
            let w = want.row(i);
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in g.iter().zip(w) {
                let d = *a as f64 - b;
                num += d * d;
                den += b * b;
                max_abs = max_abs.max(d.abs());
            }
            rel.push((num / den.max(1e-300)).sqrt());
            if argmax(g.iter().map(|&x| x as f64)) == argmax(w.iter().copied()) {
                agree += 1;
            }
        }
        LogitStats { rel, max_abs, top1: agree as f64 / t as f64 }
    }

    pub fn max_rel(&self) -> f64 {
        self.rel.iter().copied().fold(0.0, f64::max)
    }

    /// Percentile `p` in [0, 100] of the per-position relative errors.
    pub fn percentile(&self, p: f64) -> f64 {
        percentile(&self.rel, p)
    }

    /// Merges the statistics of several cases (positions pooled).
    pub fn pooled(all: &[LogitStats]) -> LogitStats {
        let n: usize = all.iter().map(|s| s.rel.len()).sum();
        let agree: f64 = all.iter().map(|s| s.top1 * s.rel.len() as f64).sum();
        LogitStats {
            rel: all.iter().flat_map(|s| s.rel.iter().copied()).collect(),
            max_abs: all.iter().map(|s| s.max_abs).fold(0.0, f64::max),
            top1: agree / n as f64,
        }
    }
}

impl std::fmt::Display for LogitStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max_abs {:.3e}  max_rel {:.3e}  p50_rel {:.3e}  p99_rel {:.3e}  top1 {:.4}",
            self.max_abs,
            self.max_rel(),
            self.percentile(50.0),
            self.percentile(99.0),
            self.top1
        )
    }
}

pub fn percentile(xs: &[f64], p: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let k = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[k.min(v.len() - 1)]
}

pub fn argmax(xs: impl Iterator<Item = f64>) -> usize {
    let mut best = (0usize, f64::NEG_INFINITY);
    for (i, x) in xs.enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0
}

/// Token ids of a case in `tests/fixtures/tiny-a/cases.json` (`cases` or `greedy`).
pub fn tiny_case_ids(name: &str) -> Vec<u32> {
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("tiny-a/cases.json")).unwrap()).unwrap();
    let entry = c["cases"].get(name).or_else(|| c["greedy"].get(name)).unwrap_or_else(|| panic!("no case {name}"));
    entry["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// xorshift64* for random test data; the seed (from `EMBER_SEED`, else the clock) is printed so
/// a failure can be replayed.
pub struct Rng(u64);

impl Rng {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Rng {
        let seed = std::env::var("EMBER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) | 1
        });
        println!("EMBER_SEED={seed}");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [lo, hi), never exactly zero.
    pub fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        let v = lo + (hi - lo) * u;
        if v == 0.0 { 1e-3 } else { v }
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(lo, hi)).collect()
    }
}
