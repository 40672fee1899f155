//! What the placement tests share: the tiny fixture models and runs of them on any backend.

use std::sync::Arc;

use ember_gguf::GgufFile;
use ember_model::{DeltaMode, Forward, Logits, Model};
use ember_ops::{KvType, Ops};
pub use ember_testkit::tiny_case_ids as case_ids;

/// tiny-a at quantisation `q` (`BF16`, `Q8_0`, `Q6_K`, `Q4_K_M`).
pub fn model(q: &str) -> Model {
    let f = Arc::new(GgufFile::open(ember_testkit::fixture(&format!("tiny-a/gguf/tiny-a-{q}.gguf"))).unwrap());
    Model::load(f, |_, _| {}).unwrap()
}

/// Every position's logits of `ids` as one prompt, in a fresh store.
pub fn logits(m: &Model, ops: &mut dyn Ops, ids: &[u32]) -> Vec<f32> {
    m.configure_store(ops, KvType::F32, 1, ids.len() + 64, 0).unwrap();
    let mut st = m.new_state(ops, ids.len() + 64).unwrap();
    let opts = Forward { logits: Some(Logits::All), delta: DeltaMode::Auto, ..Default::default() };
    m.forward(ops, ids, &mut st, opts).unwrap().data
}

/// `n` greedy tokens after the prompt `ids`, in a fresh store.
pub fn greedy(m: &Model, ops: &mut dyn Ops, ids: &[u32], n: usize) -> Vec<u32> {
    m.configure_store(ops, KvType::F32, 1, ids.len() + n + 8, 0).unwrap();
    let mut st = m.new_state(ops, ids.len() + n + 8).unwrap();
    let last = || Forward { logits: Some(Logits::Last), ..Default::default() };
    let mut l = m.forward(ops, ids, &mut st, last()).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = ember_testkit::argmax(l.data.iter().map(|&x| x as f64)) as u32;
        out.push(t);
        l = m.forward(ops, &[t], &mut st, last()).unwrap();
    }
    out
}
