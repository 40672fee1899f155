//! Malformed GGUFs, continued from malformed.rs (whose module docs say how the corpus is built):
//! tensor infos, opening files and the fuzz seeds.

mod malformed_kit;
use malformed_kit::*;

use ember_gguf::{GgmlType, GgufFile, GgufWriter, TensorSpec, Value, ValueType};
use std::path::PathBuf;

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
