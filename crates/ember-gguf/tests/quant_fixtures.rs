//! ember's dequantisers and reference quantisers against gguf-py (NumPy ports of
//! ggml-quants.c). Vectors: `tests/fixtures/quant/*.bin`, made by `tests/fixtures/quant/gen.py`.
//!
//! Tolerance: none. Every dequantiser is bit-exact (ember uses ggml's f32 operation order:
//! e.g. Q4_K `(d·sc)·q − dmin·mn`, Q6_K `(d·sc)·(q−32)`; Rust never fuses multiply-adds).
//! The quantisers for F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are ports of ggml's
//! `quantize_row_*_ref`, like gguf-py's, so their bytes must match exactly too. gguf-py has no
//! quantiser for the K-quants or IQ4 (ember's own ones are error-bounded in quant_roundtrip.rs)
//! and no Q8_1/Q8_K codec at all (those are pinned against the C formulas in quant_activation.rs).

use ember_gguf::GgmlType;
use ember_gguf::quant::{dequantize, quantize};
use std::path::PathBuf;

const MAGIC_DEQ: u32 = 0x5144_4551;
const MAGIC_Q: u32 = 0x5154_4E51;

struct Fixture {
    t: GgmlType,
    n_values: usize,
    /// Raw blocks then f32 values (dequant fixture), or f32 inputs then raw blocks (quant).
    body: Vec<u8>,
}

fn load(name: &str, magic: u32) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quant").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(word(0), magic, "{name}: bad magic");
    let t = GgmlType::from_id(word(1)).unwrap_or_else(|| panic!("{name}: unknown type {}", word(1)));
    let (n_blocks, block_size, type_size) = (word(2) as usize, word(3) as usize, word(4) as usize);
    assert_eq!((block_size, type_size), (t.block_size(), t.type_size()), "{name}");
    let n_values = n_blocks * block_size;
    let body = bytes[20..].to_vec();
    assert_eq!(body.len(), n_blocks * type_size + 4 * n_values, "{name}: size");
    Fixture { t, n_values, body }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

const DEQ_TYPES: &[&str] =
    &["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"];

#[test]
fn dequantize_matches_gguf_py_bit_exact() {
    for name in DEQ_TYPES {
        let f = load(&format!("deq_{name}.bin"), MAGIC_DEQ);
        assert_eq!(f.t.name(), *name);
        let n_bytes = f.t.row_bytes(f.n_values).unwrap();
        let (raw, want) = f.body.split_at(n_bytes);
        let want = f32s(want);
        let mut got = vec![0f32; f.n_values];
        dequantize(f.t, raw, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name} value {i} (block {}): got {g}, gguf-py {w}", i / f.t.block_size());
        }
        // Row by row (one block at a time) gives the same values.
        for (b, (raw_b, want_b)) in raw.chunks(f.t.type_size()).zip(want.chunks(f.t.block_size())).enumerate() {
            let mut one = vec![0f32; f.t.block_size()];
            dequantize(f.t, raw_b, &mut one).unwrap();
            assert_eq!(one, want_b, "{name} block {b}");
        }
    }
}

#[test]
fn reference_quantizers_match_gguf_py_bit_exact() {
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        let f = load(&format!("q_{name}.bin"), MAGIC_Q);
        let (x, want) = f.body.split_at(4 * f.n_values);
        let x = f32s(x);
        let mut got = vec![0u8; want.len()];
        quantize(f.t, &x, &mut got).unwrap();
        for (b, (g, w)) in got.chunks(f.t.type_size()).zip(want.chunks(f.t.type_size())).enumerate() {
            let xs = &x[b * f.t.block_size()..(b + 1) * f.t.block_size()];
            assert_eq!(g, w, "{name} block {b}, input {xs:?}");
        }
    }
}
