//! Malformed GGUFs: every one must come back as an `Error` that names the problem (and, for
//! parse errors, the byte offset), never a panic, an out-of-bounds read or a huge allocation.
//!
//! The corpus is built by patching fields of valid files: a small file written here with
//! `GgufWriter` (every value type, string arrays, F32/F16/BF16/Q8_0/Q4_K/Q6_K tensors) and
//! the real `tiny-a-Q4_K_M.gguf` fixture. Field offsets come from `Layout`, a minimal
//! independent walker of valid files, so the tests do not trust the reader they test.

use ember_gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------------
// Building blocks
// ---------------------------------------------------------------------------------------------

/// Deterministic filler bytes (xorshift), so tensor data is not all zeros.
fn filler(n: usize, seed: u64) -> Vec<u8> {
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

fn small_writer() -> GgufWriter {
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

fn tensor_bytes(w: &GgufWriter) -> Vec<Vec<u8>> {
    w.tensors().iter().enumerate().map(|(i, t)| filler(t.n_bytes().unwrap() as usize, i as u64 + 1)).collect()
}

fn write(w: &GgufWriter) -> Vec<u8> {
    let data = tensor_bytes(w);
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    w.to_bytes(&refs).unwrap()
}

fn small_file() -> Vec<u8> {
    write(&small_writer())
}

fn real_file() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-a/gguf/tiny-a-Q4_K_M.gguf");
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Touches everything a caller can reach on a parsed file; must never panic.
fn touch(f: &GgufFile) -> u64 {
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
fn parse_err(bytes: Vec<u8>) -> String {
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
fn expect_err(bytes: Vec<u8>, needles: &[&str]) -> String {
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
struct Kv {
    at: usize,
    key: String,
    type_at: usize,
    value_at: usize,
    end: usize,
}

#[derive(Debug)]
struct Info {
    at: usize,
    name: String,
    n_dims_at: usize,
    ne_at: usize,
    type_at: usize,
    offset_at: usize,
    offset: u64,
    n_bytes: u64,
}

#[derive(Debug)]
struct Layout {
    kvs: Vec<Kv>,
    infos: Vec<Info>,
    infos_end: usize,
    data_offset: usize,
}

fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn rd_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn skip_value(b: &[u8], at: usize, vt: u32) -> usize {
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
    fn of(b: &[u8]) -> Layout {
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

    fn kv(&self, key: &str) -> &Kv {
        self.kvs.iter().find(|k| k.key == key).unwrap()
    }

    fn info(&self, name: &str) -> &Info {
        self.infos.iter().find(|t| t.name == name).unwrap()
    }
}

fn patched(b: &[u8], at: usize, new: &[u8]) -> Vec<u8> {
    let mut v = b.to_vec();
    v[at..at + new.len()].copy_from_slice(new);
    v
}

const ABSURD: [u64; 4] = [u64::MAX, 1 << 40, 1 << 63, u64::MAX / 13 + 1];

// ---------------------------------------------------------------------------------------------
// Valid files
// ---------------------------------------------------------------------------------------------

#[test]
fn round_trip_small_file() {
    let w = small_writer();
    let data = tensor_bytes(&w);
    let bytes = write(&w);
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    touch(&f);

    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    let expected: Vec<(String, Value)> = small_writer_metadata();
    assert_eq!(f.metadata(), expected.as_slice());
    assert_eq!(f.get_str("test.str").unwrap(), "héllo, wörld");
    assert_eq!(f.get_u64("test.u64").unwrap(), u64::MAX - 1);
    assert_eq!(f.get_str_array("test.tokens").unwrap(), ["<|im_start|>", "", "Ġthe", "日本"]);
    assert_eq!(f.get_int_array("test.ids").unwrap(), [1, -2]);
    assert!(f.get_bool("test.bool").unwrap());

    assert_eq!(f.tensors().len(), w.tensors().len());
    let layout = Layout::of(&bytes);
    assert_eq!(f.data_offset(), layout.data_offset as u64);
    for ((t, spec), d) in f.tensors().iter().zip(w.tensors()).zip(&data) {
        assert_eq!(t.name, spec.name);
        assert_eq!(t.ggml_type, spec.ggml_type);
        assert_eq!(t.n_dims as usize, spec.ne.len());
        assert_eq!(&t.ne[..spec.ne.len()], spec.ne.as_slice());
        assert_eq!(f.tensor_data(t), d.as_slice(), "{}", t.name);
        assert_eq!(f.tensor(&t.name), Some(t));
    }

    // Re-writing what was read gives the same bytes.
    let mut w2 = GgufWriter::new();
    for (k, v) in f.metadata() {
        w2.set(k.clone(), v.clone());
    }
    for t in f.tensors() {
        w2.add_tensor(TensorSpec::new(&t.name, t.ggml_type, &t.ne[..t.n_dims as usize]));
    }
    let refs: Vec<&[u8]> = f.tensors().iter().map(|t| f.tensor_data(t)).collect();
    assert_eq!(w2.to_bytes(&refs).unwrap(), bytes);
}

/// The metadata given to `small_writer`, in order, written out independently.
fn small_writer_metadata() -> Vec<(String, Value)> {
    vec![
        ("general.architecture".into(), Value::String("qwen35moe".into())),
        ("test.u8".into(), Value::U8(200)),
        ("test.i8".into(), Value::I8(-7)),
        ("test.u16".into(), Value::U16(65_000)),
        ("test.i16".into(), Value::I16(-30_000)),
        ("test.u32".into(), Value::U32(4_000_000_000)),
        ("test.i32".into(), Value::I32(-2_000_000_000)),
        ("test.f32".into(), Value::F32(1.5e-6)),
        ("test.bool".into(), Value::Bool(true)),
        ("test.str".into(), Value::String("héllo, wörld".into())),
        ("test.u64".into(), Value::U64(u64::MAX - 1)),
        ("test.i64".into(), Value::I64(i64::MIN + 1)),
        ("test.f64".into(), Value::F64(-2.5e300)),
        (
            "test.tokens".into(),
            Value::Array(ValueType::String, ["<|im_start|>", "", "Ġthe", "日本"].iter().map(|s| Value::String((*s).into())).collect()),
        ),
        ("test.ids".into(), Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)])),
        ("test.empty".into(), Value::Array(ValueType::U8, vec![])),
    ]
}

#[test]
fn round_trip_alignment_and_empty_tensor() {
    let mut w = small_writer();
    w.set("general.alignment", Value::U32(64)).add_tensor(TensorSpec::new("t.empty", GgmlType::Q4K, &[0, 7]));
    let bytes = write(&w);
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    for t in f.tensors() {
        assert_eq!(t.offset % 64, 0, "{}", t.name);
    }
    let e = f.tensor("t.empty").unwrap();
    assert_eq!((e.n_bytes, e.n_elements(), e.n_rows()), (0, 0, 7));
    assert!(f.tensor_data(e).is_empty());
    assert_eq!(f.file_len(), bytes.len() as u64);
}

#[test]
fn real_fixture_walker_agrees_with_reader() {
    let bytes = real_file();
    let layout = Layout::of(&bytes);
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(f.data_offset(), layout.data_offset as u64);
    assert_eq!(f.tensors().len(), layout.infos.len());
    for (t, i) in f.tensors().iter().zip(&layout.infos) {
        assert_eq!((&t.name, t.offset, t.n_bytes), (&i.name, i.offset, i.n_bytes));
    }
    touch(&f);
}

// ---------------------------------------------------------------------------------------------
// Truncation
// ---------------------------------------------------------------------------------------------

/// Every truncation error must say it is one (or that a count cannot fit what is left).
#[track_caller]
fn expect_truncation_err(bytes: &[u8], len: usize) {
    let msg = parse_err(bytes[..len].to_vec());
    assert!(
        ["truncated", "cannot fit", "beyond the end", "larger than the file"].iter().any(|n| msg.contains(n)),
        "prefix of {len} bytes: {msg}"
    );
    assert!(msg.contains("offset"), "prefix of {len} bytes: {msg}");
}

#[test]
fn truncated_small_file_every_header_prefix() {
    let bytes = small_file();
    let layout = Layout::of(&bytes);
    // Every prefix through the tensor infos and their padding.
    for len in 0..=layout.data_offset.min(bytes.len() - 1) {
        expect_truncation_err(&bytes, len);
    }
    // A sample of data-section lengths, plus each tensor's first/last byte.
    let mut lens: Vec<usize> = (layout.data_offset..bytes.len()).step_by(7).collect();
    for i in &layout.infos {
        let start = layout.data_offset + i.offset as usize;
        let end = start + i.n_bytes as usize;
        lens.extend([start, start + 1, end - 1]);
    }
    lens.push(bytes.len() - 1);
    for len in lens.into_iter().filter(|&l| l < bytes.len()) {
        expect_truncation_err(&bytes, len);
    }
    // Specific messages at a few points.
    expect_err(bytes[..3].to_vec(), &["truncated", "magic", "offset 0"]);
    expect_err(bytes[..6].to_vec(), &["truncated", "version", "offset 4"]);
    expect_err(bytes[..20].to_vec(), &["truncated", "metadata count", "offset 16"]);
    let last = layout.infos.last().unwrap();
    expect_err(bytes[..bytes.len() - 1].to_vec(), &["truncated", &format!("data of tensor '{}'", last.name)]);
}

#[test]
fn truncated_real_file_at_every_section_boundary() {
    let bytes = real_file();
    let layout = Layout::of(&bytes);
    let mut cuts = vec![0, 1, 4, 8, 16, 24];
    for kv in &layout.kvs {
        cuts.extend([kv.at, kv.at + 8, kv.type_at, kv.value_at, kv.end - 1]);
    }
    for i in &layout.infos {
        cuts.extend([i.at, i.n_dims_at, i.ne_at, i.type_at, i.offset_at]);
        let start = layout.data_offset + i.offset as usize;
        cuts.extend([start, start + 1, start + i.n_bytes as usize - 1]);
    }
    cuts.extend([layout.infos_end, layout.data_offset, bytes.len() - 1]);
    cuts.sort();
    cuts.dedup();
    for len in cuts {
        expect_truncation_err(&bytes, len);
    }
}

// ---------------------------------------------------------------------------------------------
// Header
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_magic() {
    let b = small_file();
    expect_err(patched(&b, 0, b"GGUG"), &["bad magic", "offset 0"]);
    expect_err(patched(&b, 0, b"FUGG"), &["not a GGUF file"]);
    expect_err(patched(&b, 0, &[0; 4]), &["bad magic"]);
    expect_err(b"ggml".to_vec(), &["bad magic"]);
}

#[test]
fn bad_version() {
    let b = small_file();
    for v in [0u32, 1, 4, 0xFFFF_FFFF] {
        let msg = expect_err(patched(&b, 4, &v.to_le_bytes()), &[&format!("unsupported GGUF version {v} "), "offset 4"]);
        assert!(!msg.contains("byte-swapped"), "{msg}");
    }
    for v in [2u32, 3] {
        expect_err(patched(&b, 4, &v.to_be_bytes()), &["unsupported GGUF version", "byte-swapped"]);
    }
    // Version 2 has the v3 layout for everything we read: accepted.
    GgufFile::from_bytes(patched(&b, 4, &2u32.to_le_bytes())).unwrap();
}

#[test]
fn absurd_counts() {
    let b = small_file();
    for n in ABSURD {
        expect_err(patched(&b, 8, &n.to_le_bytes()), &["tensor count", "offset 8", "cannot fit"]);
        expect_err(patched(&b, 16, &n.to_le_bytes()), &["metadata count", "offset 16", "cannot fit"]);
    }
    // One more pair/tensor than there are: runs into the next section and fails there.
    let l = Layout::of(&b);
    let n_kv = l.kvs.len() as u64 + 1;
    parse_err(patched(&b, 16, &n_kv.to_le_bytes()));
    let n_tensors = l.infos.len() as u64 + 1;
    parse_err(patched(&b, 8, &n_tensors.to_le_bytes()));
}

// ---------------------------------------------------------------------------------------------
// Metadata
// ---------------------------------------------------------------------------------------------

#[test]
fn absurd_string_lengths() {
    let b = small_file();
    let l = Layout::of(&b);
    for n in ABSURD {
        let n = n.to_le_bytes();
        expect_err(patched(&b, l.kvs[0].at, &n), &["truncated", "key of metadata pair 0", &format!("offset {}", l.kvs[0].at + 8)]);
        let s = l.kv("test.str");
        expect_err(patched(&b, s.value_at, &n), &["truncated", "value of 'test.str'"]);
        // First string inside the string array (after elem type u32 + count u64).
        let arr = l.kv("test.tokens");
        expect_err(patched(&b, arr.value_at + 12, &n), &["truncated", "value of 'test.tokens'"]);
        let t = &l.infos[0];
        expect_err(patched(&b, t.at, &n), &["truncated", "name of tensor 0"]);
    }
    // A length that fits but swallows the rest of the header.
    let s = l.kv("test.str");
    let rest = (b.len() - s.value_at - 8) as u64;
    let msg = parse_err(patched(&b, s.value_at, &rest.to_le_bytes()));
    assert!(msg.contains("offset"), "{msg}");
}

#[test]
fn absurd_array_counts() {
    let b = small_file();
    let l = Layout::of(&b);
    for key in ["test.tokens", "test.ids", "test.empty"] {
        let kv = l.kv(key);
        for n in ABSURD {
            expect_err(
                patched(&b, kv.value_at + 4, &n.to_le_bytes()),
                &[&format!("value of '{key}'"), &format!("offset {}", kv.value_at + 4), "cannot fit"],
            );
        }
    }
}

#[test]
fn unknown_value_types() {
    let b = small_file();
    let l = Layout::of(&b);
    let kv = l.kv("test.u32");
    for t in [13u32, 255, u32::MAX] {
        expect_err(
            patched(&b, kv.type_at, &t.to_le_bytes()),
            &["value type of 'test.u32'", &format!("offset {}", kv.type_at), &format!("unknown type id {t}")],
        );
    }
    let arr = l.kv("test.ids");
    expect_err(patched(&b, arr.value_at, &13u32.to_le_bytes()), &["value of 'test.ids'", "unknown array element type id 13"]);
}

#[test]
fn nested_arrays() {
    let b = small_file();
    let l = Layout::of(&b);
    for key in ["test.ids", "test.empty", "test.tokens"] {
        let kv = l.kv(key);
        expect_err(
            patched(&b, kv.value_at, &9u32.to_le_bytes()),
            &[&format!("value of '{key}'"), &format!("offset {}", kv.value_at), "nested arrays are not allowed"],
        );
    }
}

#[test]
fn bool_byte_not_0_or_1() {
    let b = small_file();
    let kv = Layout::of(&b).kv("test.bool").value_at;
    for byte in [2u8, 0xFF] {
        expect_err(
            patched(&b, kv, &[byte]),
            &["value of 'test.bool'", &format!("offset {kv}"), &format!("bool byte is {byte}, expected 0 or 1")],
        );
    }
    // In an array too.
    let mut w = GgufWriter::new();
    w.set("flags", Value::Array(ValueType::Bool, vec![Value::Bool(false), Value::Bool(true)]));
    let b = write(&w);
    let at = Layout::of(&b).kv("flags").value_at + 12 + 1;
    expect_err(patched(&b, at, &[2]), &["bool byte is 2"]);
}

#[test]
fn invalid_utf8() {
    let b = small_file();
    let l = Layout::of(&b);
    let kv = &l.kvs[1];
    expect_err(patched(&b, kv.at + 8, &[0xFF]), &["key of metadata pair 1", &format!("offset {}", kv.at + 8), "invalid UTF-8"]);
    // Truncated multi-byte sequence inside a value: 'é' is C3 A9; break the continuation byte.
    let s = l.kv("test.str");
    expect_err(patched(&b, s.value_at + 8 + 2, &[0x41]), &["value of 'test.str'", "invalid UTF-8"]);
    let t = &l.infos[2];
    expect_err(patched(&b, t.at + 8, &[0xC0]), &["name of tensor 2", "invalid UTF-8"]);
}

#[test]
fn duplicate_keys() {
    let b = small_file();
    let l = Layout::of(&b);
    // "test.i32" -> "test.u32": same length, so the layout is unchanged.
    let kv = l.kv("test.i32");
    let msg = expect_err(patched(&b, kv.at + 8 + 5, b"u"), &["duplicate key 'test.u32'", &format!("offset {}", kv.at)]);
    assert!(msg.contains("metadata key"), "{msg}");
}

#[test]
fn alignment_key() {
    let cases: [(Value, &str); 6] = [
        (Value::U32(0), "got u32 0"),
        (Value::U32(3), "got u32 3"),
        (Value::U32(48), "got u32 48"),
        (Value::I32(32), "got i32 32"),
        (Value::U64(32), "got u64 32"),
        (Value::Array(ValueType::U32, vec![Value::U32(32)]), "got array<u32>"),
    ];
    for (v, got) in cases {
        let mut w = small_writer();
        w.set("general.alignment", v);
        let b = write(&w);
        let at = Layout::of(&b).kv("general.alignment").at;
        expect_err(b, &["general.alignment", &format!("offset {at}"), "power-of-two u32", got]);
    }
    let mut w = small_writer();
    w.set("general.alignment", Value::String("32".into()));
    expect_err(write(&w), &["general.alignment", "got string"]);
}

// ---------------------------------------------------------------------------------------------
// Tensor infos
// ---------------------------------------------------------------------------------------------

#[test]
fn duplicate_tensor_names() {
    let b = small_file();
    let t = Layout::of(&b).info("t.f32b").at;
    // "t.f32b" -> "t.f32a"
    expect_err(patched(&b, t + 8 + 5, b"a"), &["duplicate tensor 't.f32a'", &format!("offset {t}")]);
}

#[test]
fn long_tensor_name() {
    let mut w = GgufWriter::new();
    w.add_tensor(TensorSpec::new("x".repeat(64), GgmlType::F32, &[1]));
    expect_err(write(&w), &["tensor name", "longer than 63 bytes", "offset 24"]);
    let mut w = GgufWriter::new();
    w.add_tensor(TensorSpec::new("x".repeat(63), GgmlType::F32, &[1]));
    GgufFile::from_bytes(write(&w)).unwrap();
}

#[test]
fn bad_n_dims() {
    let b = small_file();
    let t = Layout::of(&b).info("t.q4_k").n_dims_at;
    for n in [0u32, 5, u32::MAX] {
        expect_err(patched(&b, t, &n.to_le_bytes()), &["n_dims of 't.q4_k'", &format!("offset {t}"), &format!("{n} is outside 1..=4")]);
    }
}

#[test]
fn ne0_not_a_multiple_of_block_size() {
    let b = small_file();
    let l = Layout::of(&b);
    for (name, ne0, ty, bs) in
        [("t.q4_k", 255u64, "Q4_K", 256), ("t.q4_k", 128, "Q4_K", 256), ("t.q8_0", 48, "Q8_0", 32), ("t.q6_k", 1, "Q6_K", 256)]
    {
        let t = l.info(name);
        expect_err(
            patched(&b, t.ne_at, &ne0.to_le_bytes()),
            &[
                &format!("tensor '{name}'"),
                &format!("offset {}", t.at),
                &format!("ne[0] = {ne0} is not a multiple of the {ty} block size {bs}"),
            ],
        );
    }
}

#[test]
fn element_count_overflow() {
    let b = small_file();
    let l = Layout::of(&b);
    let t = l.info("t.bf16"); // 3 dims
    let shapes: [[u64; 3]; 5] = [
        [1 << 32, 1 << 32, 1],
        [u64::MAX, 2, 1],
        [0, u64::MAX, u64::MAX], // empty, but the other dims still overflow
        [u64::MAX, 0, u64::MAX], // n_rows() would overflow
        [1 << 63, 1, 1],         // > i64::MAX, ggml's ne type
    ];
    for ne in shapes {
        let raw: Vec<u8> = ne.iter().flat_map(|d| d.to_le_bytes()).collect();
        expect_err(patched(&b, t.ne_at, &raw), &["tensor 't.bf16'", &format!("offset {}", t.at), "element count", "overflows"]);
    }
    // Fits in u64 but not in the file.
    let raw: Vec<u8> = [1u64 << 20, 1 << 20, 1 << 10].iter().flat_map(|d| d.to_le_bytes()).collect();
    expect_err(patched(&b, t.ne_at, &raw), &["tensor 't.bf16'", "larger than the file"]);
}

#[test]
fn unknown_ggml_type() {
    let b = small_file();
    let t = Layout::of(&b).info("t.q8_0").type_at;
    // 4 and 5 are the removed Q4_2/Q4_3; 39 is MXFP4 (not supported here).
    for id in [4u32, 5, 39, 41, 1000, u32::MAX] {
        expect_err(
            patched(&b, t, &id.to_le_bytes()),
            &["type of 't.q8_0'", &format!("offset {t}"), &format!("unknown or unsupported ggml type id {id}")],
        );
    }
}

#[test]
fn offset_not_aligned() {
    let b = small_file();
    let l = Layout::of(&b);
    let t = l.info("t.q4_k");
    for delta in [1u64, 16, 31] {
        let off = t.offset + delta;
        expect_err(
            patched(&b, t.offset_at, &off.to_le_bytes()),
            &["offset of 't.q4_k'", &format!("offset {}", t.offset_at), &format!("{off} is not a multiple of the alignment 32")],
        );
    }
}

#[test]
fn offset_beyond_data_section() {
    let b = small_file();
    let l = Layout::of(&b);
    let t = l.info("t.f16");
    let data_len = (b.len() - l.data_offset) as u64;
    for off in [
        1u64 << 40,
        !31u64, // the largest aligned offset: data_offset + offset would overflow
        data_len.next_multiple_of(32) + 32,
    ] {
        expect_err(
            patched(&b, t.offset_at, &off.to_le_bytes()),
            &["offset of 't.f16'", &format!("offset {}", t.at), &format!("data offset {off} is beyond the end of the data section")],
        );
    }
    // Starts inside the data section but runs past its end.
    let last = l.infos.last().unwrap();
    let off = last.offset + 32;
    expect_err(patched(&b, last.offset_at, &off.to_le_bytes()), &["truncated", &format!("data of tensor '{}'", last.name)]);
}

#[test]
fn overlapping_tensors() {
    let b = small_file();
    let l = Layout::of(&b);
    let (a, c) = (l.info("t.f32a"), l.info("t.q8_0"));
    // t.q8_0 placed on top of t.f32a.
    expect_err(
        patched(&b, c.offset_at, &a.offset.to_le_bytes()),
        &["tensor 't.q8_0'", &format!("offset {}", c.at), "overlaps tensor 't.f32a'"],
    );
    // Partial overlap: t.q4_k (288 bytes) moved to start 32 bytes before t.bf16 ends... use
    // the tensor after t.q4_k moved back by one alignment unit.
    let (q, bf) = (l.info("t.q4_k"), l.info("t.bf16"));
    let off = bf.offset - 32;
    assert!(off > q.offset && off < q.offset + q.n_bytes);
    expect_err(patched(&b, bf.offset_at, &off.to_le_bytes()), &["tensor 't.bf16'", "overlaps tensor 't.q4_k'"]);
    // Empty tensors may share an offset with anything.
    let mut w = small_writer();
    w.add_tensor(TensorSpec::new("t.empty", GgmlType::F32, &[0]));
    let b = write(&w);
    let e = Layout::of(&b).info("t.empty").offset_at;
    GgufFile::from_bytes(patched(&b, e, &0u64.to_le_bytes())).unwrap();
}

/// Regression: an empty tensor in a file whose header padding is cut short made the
/// data section start past the end of the file; the tensor passed the bounds check (data
/// length saturated to 0) and `tensor_data` then sliced out of bounds.
#[test]
fn r_empty_tensor_past_end_of_file() {
    let mut w = GgufWriter::new();
    w.set("general.alignment", Value::U32(1 << 20));
    w.add_tensor(TensorSpec::new("empty", GgmlType::F32, &[0]));
    let b = write(&w);
    let l = Layout::of(&b);
    assert_eq!(b.len(), l.data_offset);
    GgufFile::from_bytes(b.clone()).unwrap();
    expect_err(b[..l.infos_end].to_vec(), &["offset of 'empty'", "beyond the end of the data section"]);
}

/// Regression: shapes with a zero dimension skipped the overflow check, so `n_rows()` could
/// overflow (a panic with debug assertions).
#[test]
fn r_zero_dim_hides_overflow() {
    // (Patched in: GgufWriter's own size arithmetic overflows on this shape.)
    let mut w = GgufWriter::new();
    w.add_tensor(TensorSpec::new("z", GgmlType::F32, &[0, 1, 1]));
    let b = write(&w);
    let ne_at = Layout::of(&b).info("z").ne_at;
    let raw: Vec<u8> = [0u64, 1 << 32, 1 << 32].iter().flat_map(|d| d.to_le_bytes()).collect();
    expect_err(patched(&b, ne_at, &raw), &["tensor 'z'", "element count", "overflows"]);
}

/// Random byte flips in the header of the small file: Ok or Err, never a panic.
#[test]
fn random_header_corruption_never_panics() {
    let b = small_file();
    let l = Layout::of(&b);
    let mut rng = filler(4 * 4096, 99).into_iter();
    let mut n_ok = 0;
    for _ in 0..4096 {
        let at = u16::from_le_bytes([rng.next().unwrap(), rng.next().unwrap()]) as usize % l.infos_end;
        let byte = rng.next().unwrap();
        let mut v = b.clone();
        v[at] = byte;
        if let Ok(f) = GgufFile::from_bytes(v) {
            touch(&f);
            n_ok += 1;
        }
        let _ = rng.next();
    }
    // Flipping bytes inside values and tensor data keeps the file valid often enough.
    assert!(n_ok > 0);
}

// ---------------------------------------------------------------------------------------------
// Opening files
// ---------------------------------------------------------------------------------------------

#[test]
fn open_missing_directory_and_empty() {
    let dir = std::env::temp_dir().join(format!("ember-gguf-malformed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("missing.gguf");
    let msg = GgufFile::open(&missing).unwrap_err().to_string();
    assert!(msg.contains("cannot open"), "{msg}");
    assert!(msg.contains("missing.gguf"), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");

    let msg = GgufFile::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("cannot open"), "{msg}");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    assert!(msg.contains("is a directory"), "{msg}");

    let empty = dir.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let msg = GgufFile::open(&empty).unwrap_err().to_string();
    assert!(msg.contains("truncated"), "{msg}");
    assert!(msg.contains("file is 0 bytes"), "{msg}");

    let small = dir.join("small.gguf");
    std::fs::write(&small, small_file()).unwrap();
    touch(&GgufFile::open(&small).unwrap());
    std::fs::write(&small, &small_file()[..20]).unwrap();
    let msg = GgufFile::open(&small).unwrap_err().to_string();
    assert!(msg.contains("truncated"), "{msg}");

    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Fuzz seeds
// ---------------------------------------------------------------------------------------------

/// Writes the seed corpus of `fuzz/`:
/// `cargo test -p ember-gguf --test malformed -- --ignored write_fuzz_seeds`.
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus-seed");
    std::fs::create_dir_all(&dir).unwrap();
    let save = |name: &str, b: &[u8]| std::fs::write(dir.join(name), b).unwrap();

    save("small.gguf", &small_file());

    let mut w = small_writer();
    w.set("general.alignment", Value::U32(64)).add_tensor(TensorSpec::new("t.empty", GgmlType::Q4K, &[0, 7]));
    save("small-align64.gguf", &write(&w));

    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35moe".into())).set("qwen35moe.block_count", Value::U32(2)).set(
        "tokenizer.ggml.tokens",
        Value::Array(ValueType::String, ["a", "b", "ab"].iter().map(|s| Value::String((*s).into())).collect()),
    );
    save("metadata-only.gguf", &write(&w));

    let mut w = GgufWriter::new();
    for (i, ty) in GgmlType::all().enumerate() {
        let bs = ty.block_size() as u64;
        w.add_tensor(TensorSpec::new(format!("t{i}"), ty, &[bs, 1]));
    }
    save("every-type.gguf", &write(&w));

    save("empty.gguf", &write(&GgufWriter::new()));

    // The real fixture's metadata (tokenizer arrays included) as a valid tensor-less file, and
    // its full header (tensor infos too) without the data section.
    let real = real_file();
    let l = Layout::of(&real);
    let kv_end = l.kvs.last().unwrap().end;
    save("tiny-a-metadata.gguf", &patched(&real[..kv_end], 8, &0u64.to_le_bytes()));
    save("tiny-a-header.gguf", &real[..l.infos_end]);
}

/// Regression: the error context "value of '<key>'" was formatted once per array element, so
/// a long key with a long array cost key length x count (here 2^40 bytes copied: hours).
#[test]
fn r_long_key_times_long_array_is_linear() {
    let mut w = GgufWriter::new();
    w.set("k".repeat(1 << 20), Value::Array(ValueType::U8, vec![Value::U8(7); 1 << 20]));
    let t = std::time::Instant::now();
    let f = GgufFile::from_bytes(write(&w)).unwrap();
    assert_eq!(f.metadata()[0].1.as_array().unwrap().len(), 1 << 20);
    assert!(t.elapsed().as_secs() < 10, "took {:?}", t.elapsed());
}

#[test]
fn writer_rejects_overflowing_shapes() {
    let mut w = ember_gguf::GgufWriter::new();
    w.add_tensor(ember_gguf::TensorSpec::new("huge", ember_gguf::GgmlType::F32, &[4, 1 << 32, 1 << 32]));
    let e = w.to_bytes(&[&[]]).unwrap_err().to_string();
    assert!(e.contains("huge") && e.contains("overflows"), "{e}");
}
