//! Shared by malformed.rs and malformed_tensors.rs: valid files to patch, an independent walker
//! of valid files (where each field lives), and the error checks.
#![allow(dead_code)]

use ember_gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------------
// Building blocks
// ---------------------------------------------------------------------------------------------

/// Deterministic filler bytes (xorshift), so tensor data is not all zeros.
pub fn filler(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn small_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35moe".into()))
        .set("test.u8", Value::U8(200))
        .set("test.i8", Value::I8(-7))
        .set("test.u16", Value::U16(65_000))
        .set("test.i16", Value::I16(-30_000))
        .set("test.u32", Value::U32(4_000_000_000))
        .set("test.i32", Value::I32(-2_000_000_000))
        .set("test.f32", Value::F32(1.5e-6))
        .set("test.bool", Value::Bool(true))
        .set("test.str", Value::String("héllo, wörld".into()))
        .set("test.u64", Value::U64(u64::MAX - 1))
        .set("test.i64", Value::I64(i64::MIN + 1))
        .set("test.f64", Value::F64(-2.5e300))
        .set(
            "test.tokens",
            Value::Array(ValueType::String, ["<|im_start|>", "", "Ġthe", "日本"].iter().map(|s| Value::String((*s).into())).collect()),
        )
        .set("test.ids", Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]))
        .set("test.empty", Value::Array(ValueType::U8, vec![]));
    w.add_tensor(TensorSpec::new("t.f32a", GgmlType::F32, &[8, 3]))
        .add_tensor(TensorSpec::new("t.f16", GgmlType::F16, &[16]))
        .add_tensor(TensorSpec::new("t.q8_0", GgmlType::Q8_0, &[64, 2]))
        .add_tensor(TensorSpec::new("t.q4_k", GgmlType::Q4K, &[256, 2]))
        .add_tensor(TensorSpec::new("t.bf16", GgmlType::BF16, &[4, 2, 2]))
        .add_tensor(TensorSpec::new("t.f32b", GgmlType::F32, &[5]))
        .add_tensor(TensorSpec::new("t.q6_k", GgmlType::Q6K, &[256, 1, 1, 1]));
    w
}

pub fn tensor_bytes(w: &GgufWriter) -> Vec<Vec<u8>> {
    w.tensors().iter().enumerate().map(|(i, t)| filler(t.n_bytes().unwrap() as usize, i as u64 + 1)).collect()
}

pub fn write(w: &GgufWriter) -> Vec<u8> {
    let data = tensor_bytes(w);
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    w.to_bytes(&refs).unwrap()
}

pub fn small_file() -> Vec<u8> {
    write(&small_writer())
}

pub fn real_file() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Touches everything a caller can reach on a parsed file; must never panic.
pub fn touch(f: &GgufFile) -> u64 {
    let mut sum = 0u64;
    for t in f.tensors() {
        let bytes = f.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        sum = bytes.iter().fold(sum, |s, &b| s.wrapping_add(b as u64));
        sum = sum.wrapping_add(t.n_elements()).wrapping_add(t.n_rows());
        if t.n_bytes > 0 {
            sum = sum.wrapping_add(t.row_bytes() as u64);
        }
        sum = sum.wrapping_add(t.shape().len() as u64);
    }
    for (k, _) in f.metadata() {
        let _ = (f.get_str(k), f.get_u64(k), f.get_u32(k), f.get_f32(k));
        let _ = (f.get_bool(k), f.get_str_array(k), f.get_int_array(k));
    }
    sum
}

/// Parses `bytes`, which must fail; returns the message.
#[track_caller]
pub fn parse_err(bytes: Vec<u8>) -> String {
    match GgufFile::from_bytes(bytes) {
        Ok(f) => {
            touch(&f);
            panic!("malformed file parsed: {f:?}")
        }
        Err(e) => e.to_string(),
    }
}

/// Parses `bytes`, which must fail with a message containing every one of `needles`.
#[track_caller]
pub fn expect_err(bytes: Vec<u8>, needles: &[&str]) -> String {
    let msg = parse_err(bytes);
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} does not contain {n:?}");
    }
    msg
}

// ---------------------------------------------------------------------------------------------
// An independent walker of *valid* files: where each field lives
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
pub struct Kv {
    pub at: usize,
    pub key: String,
    pub type_at: usize,
    pub value_at: usize,
    pub end: usize,
}

#[derive(Debug)]
pub struct Info {
    pub at: usize,
    pub name: String,
    pub n_dims_at: usize,
    pub ne_at: usize,
    pub type_at: usize,
    pub offset_at: usize,
    pub offset: u64,
    pub n_bytes: u64,
}

#[derive(Debug)]
pub struct Layout {
    pub kvs: Vec<Kv>,
    pub infos: Vec<Info>,
    pub infos_end: usize,
    pub data_offset: usize,
}

pub fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
pub fn rd_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

pub fn skip_value(b: &[u8], at: usize, vt: u32) -> usize {
    match vt {
        0 | 1 | 7 => at + 1,
        2 | 3 => at + 2,
        4..=6 => at + 4,
        10..=12 => at + 8,
        8 => at + 8 + rd_u64(b, at) as usize,
        9 => {
            let et = rd_u32(b, at);
            let n = rd_u64(b, at + 4);
            (0..n).fold(at + 12, |p, _| skip_value(b, p, et))
        }
        _ => panic!("walker: bad value type {vt}"),
    }
}

impl Layout {
    pub fn of(b: &[u8]) -> Layout {
        let n_tensors = rd_u64(b, 8) as usize;
        let n_kv = rd_u64(b, 16) as usize;
        let mut pos = 24;
        let mut alignment = 32;
        let mut kvs = Vec::new();
        for _ in 0..n_kv {
            let at = pos;
            let len = rd_u64(b, pos) as usize;
            let key = String::from_utf8(b[pos + 8..pos + 8 + len].to_vec()).unwrap();
            let type_at = pos + 8 + len;
            let vt = rd_u32(b, type_at);
            let value_at = type_at + 4;
            let end = skip_value(b, value_at, vt);
            if key == "general.alignment" && vt == 4 {
                // The writer falls back to 32 for an invalid alignment; so does the walker.
                let a = rd_u32(b, value_at) as usize;
                alignment = if a.is_power_of_two() { a } else { 32 };
            }
            kvs.push(Kv { at, key, type_at, value_at, end });
            pos = end;
        }
        let mut infos = Vec::new();
        for _ in 0..n_tensors {
            let at = pos;
            let len = rd_u64(b, pos) as usize;
            let name = String::from_utf8(b[pos + 8..pos + 8 + len].to_vec()).unwrap();
            let n_dims_at = pos + 8 + len;
            let n_dims = rd_u32(b, n_dims_at) as usize;
            let ne_at = n_dims_at + 4;
            let ne: Vec<u64> = (0..n_dims).map(|d| rd_u64(b, ne_at + 8 * d)).collect();
            let type_at = ne_at + 8 * n_dims;
            let ty = GgmlType::from_id(rd_u32(b, type_at)).unwrap();
            let offset_at = type_at + 4;
            let n_bytes = TensorSpec::new(&name, ty, &ne).n_bytes().unwrap();
            infos.push(Info { at, name, n_dims_at, ne_at, type_at, offset_at, offset: rd_u64(b, offset_at), n_bytes });
            pos = offset_at + 8;
        }
        Layout { kvs, infos, infos_end: pos, data_offset: pos.div_ceil(alignment) * alignment }
    }

    pub fn kv(&self, key: &str) -> &Kv {
        self.kvs.iter().find(|k| k.key == key).unwrap()
    }

    pub fn info(&self, name: &str) -> &Info {
        self.infos.iter().find(|t| t.name == name).unwrap()
    }
}

pub fn patched(b: &[u8], at: usize, new: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    v[at..at + new.len()].copy_from_slice(new);
    v
}

pub const ABSURD: [u64; 4] = [u64::MAX, 1 << 40, 1 << 63, u64::MAX / 13 + 1];
