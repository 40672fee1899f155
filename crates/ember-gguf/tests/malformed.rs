//! Malformed GGUFs: every one must come back as an `Error` that names the problem (and, for
//! parse errors, the byte offset), never a panic, an out-of-bounds read or a huge allocation.
//!
//! The corpus is built by patching fields of valid files: a small file written here with
//! `GgufWriter` (every value type, string arrays, F32/F16/BF16/Q8_0/Q4_K/Q6_K tensors) and
//! the real `tiny-a-Q4_K_M.gguf` fixture. Field offsets come from `Layout`, a minimal
//! independent walker of valid files, so the tests do not trust the reader they test.
//! This file: valid files, truncation, the header and metadata; malformed_tensors.rs: tensor
//! infos, opening files and the fuzz seeds.

mod malformed_kit;
use malformed_kit::*;

use ember_gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};

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
