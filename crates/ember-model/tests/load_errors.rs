//! Files that parse as GGUF but are not a usable qwen35moe model get an error naming the cause.

use std::sync::Arc;

use ember_gguf::{GgufFile, GgufWriter, TensorSpec, Value};
use ember_model::Model;
use ember_testkit::fixture;

/// Rewrites the tiny Q8_0 fixture: `keep_key`/`keep_tensor` filter, `edit` adjusts the writer.
fn variant(
    keep_key: impl Fn(&str) -> bool,
    keep_tensor: impl Fn(&str) -> bool,
    edit: impl FnOnce(&mut GgufWriter) -> Vec<Vec<u8>>,
) -> Result<Model, String> {
    let src = GgufFile::open(fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if keep_key(k) {
            w.set(k.clone(), v.clone());
        }
    }
    let kept: Vec<_> = src.tensors().iter().filter(|t| keep_tensor(&t.name)).collect();
    for t in &kept {
        w.add_tensor(TensorSpec::new(t.name.clone(), t.ggml_type, &t.shape()));
    }
    let extra = edit(&mut w);
    let mut data: Vec<&[u8]> = kept.iter().map(|t| src.tensor_data(t)).collect();
    data.extend(extra.iter().map(|v| v.as_slice()));
    let bytes = w.to_bytes(&data).map_err(|e| e.to_string())?;
    let f = GgufFile::from_bytes(bytes).map_err(|e| e.to_string())?;
    Model::load(Arc::new(f), |_, _| {}).map_err(|e| e.to_string())
}

fn err(r: Result<Model, String>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn unchanged_copy_loads() {
    variant(|_| true, |_| true, |_| vec![]).unwrap();
}

#[test]
fn wrong_architecture() {
    let e = err(variant(
        |_| true,
        |_| true,
        |w| {
            w.set("general.architecture", Value::String("llama".into()));
            vec![]
        },
    ));
    assert!(e.contains("unsupported architecture 'llama'") && e.contains("qwen35moe"), "{e}");
}

#[test]
fn missing_key_is_named() {
    let e = err(variant(|k| k != "qwen35moe.expert_count", |_| true, |_| vec![]));
    assert!(e.contains("qwen35moe.expert_count"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let e = err(variant(|_| true, |t| t != "blk.2.ssm_a", |_| vec![]));
    assert!(e.contains("blk.2.ssm_a") && e.contains("missing"), "{e}");
}

#[test]
fn wrong_shape_is_named() {
    let e = err(variant(
        |_| true,
        |t| t != "blk.0.attn_norm.weight",
        |w| {
            w.add_tensor(TensorSpec::new("blk.0.attn_norm.weight", ember_gguf::GgmlType::F32, &[128]));
            vec![vec![0u8; 512]]
        },
    ));
    assert!(e.contains("blk.0.attn_norm.weight") && e.contains("shape [128], expected [256]"), "{e}");
}

#[test]
fn wrong_key_type_is_named() {
    let e = err(variant(
        |_| true,
        |_| true,
        |w| {
            w.set("qwen35moe.embedding_length", Value::String("256".into()));
            vec![]
        },
    ));
    assert!(e.contains("qwen35moe.embedding_length") && e.contains("string"), "{e}");
}
