//! CUDA graph replay ([`Gpu::begin_record`], on by default in [`CudaOps`]) against eager
//! launches: the same kernels with the same parameters in the same order, so every result must
//! be bit for bit the same (tolerance 0).
//!
//! * `recorded_launches_equal_eager_ones`: chains of `add` launches recorded and replayed
//!   (first sighting eager, then a built graph, then updated nodes when the sizes change), and a
//!   buffer dropped while a recorded launch still names it.
//! * `graph_steps_equal_eager_steps`: the tiny fixture model through a session of steps, once
//!   with graphs off and once on: prompts of several sizes, decode whose depth crosses KV page
//!   boundaries and the attention's split of the keys (256 keys), batched steps of three
//!   sequences, a snapshot and restore, and a store reconfigured in between. Logits must be
//!   equal bit for bit, and decode must stay on the graph update path (few builds). Prompts of
//!   at most `GRAPH_MAX_ROWS` (40) rows (37, 23, 5, a 20-token chunk beside a decode) take the
//!   graphs; the 150- and 50-token ones launch eagerly in both runs.
//!
//! With no NVIDIA driver each test prints why and passes (CI has no GPU).

use std::path::PathBuf;
use std::sync::Arc;

use ember_cuda::{CudaOps, Gpu, GraphStats, Precision};
use ember_gguf::GgufFile;
use ember_model::{DeltaMode, Forward, Logits, Model, SeqBatch, SeqState};
use ember_ops::{KvType, Ops};

fn fixture(rel: &str) -> PathBuf {
    let local = PathBuf::from("tests/fixtures").join(rel);
    if local.exists() { local } else { ember_testkit::fixture(rel) }
}

fn delta(a: GraphStats, b: GraphStats) -> GraphStats {
    GraphStats {
        graph_launches: b.graph_launches - a.graph_launches,
        builds: b.builds - a.builds,
        node_updates: b.node_updates - a.node_updates,
        eager_kernels: b.eager_kernels - a.eager_kernels,
        failures: b.failures - a.failures,
    }
}

/// `h += x` `reps` times for each size in `sizes`, recorded when `record`; returns h.
fn add_chain(gpu: &Gpu, record: bool, sizes: &[usize], reps: usize) -> Vec<f32> {
    let n_max = sizes.iter().copied().max().unwrap_or(0);
    let x = gpu.upload(&(0..n_max).map(|i| (i % 17) as f32 * 0.25 + 0.5).collect::<Vec<_>>()).unwrap();
    let mut h = gpu.upload(&vec![1.0f32; n_max]).unwrap();
    for &n in sizes {
        if record {
            gpu.begin_record();
        }
        for _ in 0..reps {
            gpu.add(&mut h, &x, n).unwrap();
        }
        // A buffer that a recorded launch names, dropped before the flush: its free must come
        // after the launch.
        let tmp = gpu.upload(&vec![2.0f32; n_max]).unwrap();
        if record {
            gpu.begin_record();
        }
        gpu.add(&mut h, &tmp, n).unwrap();
        drop(tmp);
        gpu.end_record().unwrap();
    }
    gpu.download(&h).unwrap()
}

#[test]
fn recorded_launches_equal_eager_ones() {
    let gpu = match Gpu::new(0) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    gpu.set_graphs(true).unwrap();
    // The same structure three times (eager, build, hit), then other sizes (node updates).
    let sizes = [1000, 1000, 1000, 777, 5000, 1000];
    let want = add_chain(&gpu, false, &sizes, 12);
    let s0 = gpu.graph_stats();
    let got = add_chain(&gpu, true, &sizes, 12);
    let s = delta(s0, gpu.graph_stats());
    println!("add chains: {s:?}");
    assert_eq!(got, want, "recorded add chains differ from eager ones");
    assert_eq!(s.builds, 1, "one structure, one graph");
    assert_eq!(s.graph_launches, 5, "every chain after the first goes out as the graph");
    assert!(s.node_updates >= 12, "changed sizes update the nodes in place");
    assert_eq!(s.failures, 0);
}

fn model(q: &str) -> Model {
    let f = Arc::new(GgufFile::open(fixture(&format!("tiny-a/gguf/tiny-a-{q}.gguf"))).unwrap());
    Model::load(f, |_, _| {}).unwrap()
}

/// Every logit row of one session, and the graph statistics of its long decode.
fn session(m: &Model, ops: &mut CudaOps, kv: KvType) -> (Vec<Vec<f32>>, GraphStats) {
    let mut out = Vec::new();
    let last = || Forward { logits: Some(Logits::Last), delta: DeltaMode::Auto, ..Default::default() };
    let all = || Forward { logits: Some(Logits::All), delta: DeltaMode::Auto, ..Default::default() };
    let tok = |s: usize, i: usize| ((s * 7 + i * 13 + 5) % 600) as u32;
    m.configure_store(ops, kv, 3, 512, 64).unwrap();
    let mut st: Vec<SeqState> = (0..3).map(|_| m.new_state(ops, 512).unwrap()).collect();
    // Prompts of several sizes: 150 + 50 tokens for sequence 0 (at 200), 37 and 5 for the others.
    let p0: Vec<u32> = (0..200).map(|i| tok(i, 0)).collect();
    out.push(m.forward(ops, &p0[..150], &mut st[0], all()).unwrap().data);
    out.push(m.forward(ops, &p0[150..], &mut st[0], last()).unwrap().data);
    let p1: Vec<u32> = (0..37).map(|i| tok(i, 1)).collect();
    out.push(m.forward(ops, &p1, &mut st[1], all()).unwrap().data);
    let p2: Vec<u32> = (0..5).map(|i| tok(i, 2)).collect();
    out.push(m.forward(ops, &p2, &mut st[2], last()).unwrap().data);
    // Decode sequence 0 from 200 to 290 keys: page boundary at 256, the split at 257 keys.
    let s0 = ops.gpu().graph_stats();
    for s in 0..90 {
        out.push(m.forward(ops, &[tok(s, 3)], &mut st[0], last()).unwrap().data);
    }
    let decode = delta(s0, ops.gpu().graph_stats());
    let snap = st[0].snapshot(ops).unwrap();
    // Batched decode of all three, then a mixed step (a decode and a 20-token chunk).
    for s in 0..6 {
        let toks: Vec<Vec<u32>> = (0..3).map(|i| vec![tok(s, 4 + i)]).collect();
        let mut seqs: Vec<SeqBatch> =
            st.iter_mut().zip(&toks).map(|(st, t)| SeqBatch { tokens: t, state: st, logits: Logits::Last }).collect();
        out.extend(m.forward_batch(ops, &mut seqs, DeltaMode::Auto, None).unwrap().into_iter().map(|x| x.data));
    }
    let chunk: Vec<u32> = (0..20).map(|j| tok(j, 8)).collect();
    let one = [tok(0, 9)];
    {
        let (a, b) = st.split_at_mut(2);
        let mut seqs = [
            SeqBatch { tokens: &one, state: &mut a[1], logits: Logits::Last },
            SeqBatch { tokens: &chunk, state: &mut b[0], logits: Logits::All },
        ];
        out.extend(m.forward_batch(ops, &mut seqs, DeltaMode::Auto, None).unwrap().into_iter().map(|x| x.data));
    }
    // Rewind sequence 0 and decode again.
    st[0].restore(ops, &snap).unwrap();
    for s in 0..8 {
        out.push(m.forward(ops, &[tok(s, 10)], &mut st[0], last()).unwrap().data);
    }
    drop(snap);
    drop(st);
    // A reconfigured store (other slot count and KV type): a prompt and a decode.
    m.configure_store(ops, KvType::F32, 2, 256, 0).unwrap();
    let mut st = m.new_state(ops, 256).unwrap();
    out.push(m.forward(ops, &p1[..23], &mut st, all()).unwrap().data);
    for s in 0..10 {
        out.push(m.forward(ops, &[tok(s, 11)], &mut st, last()).unwrap().data);
    }
    (out, decode)
}

fn first_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> Option<(usize, f32)> {
    a.iter().zip(b).enumerate().find_map(|(i, (x, y))| {
        (x.len() != y.len() || x.iter().zip(y).any(|(p, q)| p.to_bits() != q.to_bits()))
            .then(|| (i, x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max)))
    })
}

#[test]
fn graph_steps_equal_eager_steps() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    for (q, prec, kv) in
        [("Q4_K_M", Precision::Exact, KvType::F16), ("BF16", Precision::Fast, KvType::Q8_0), ("Q6_K", Precision::Fast, KvType::F32)]
    {
        let m = model(q);
        let mut ops = CudaOps::with_precision(0, prec).unwrap();
        ops.register(m.weights().clone()).unwrap();
        ops.gpu().set_graphs(false).unwrap();
        let (eager, _) = session(&m, &mut ops, kv);
        let (eager2, _) = session(&m, &mut ops, kv);
        ops.gpu().set_graphs(true).unwrap();
        let g0 = ops.gpu().graph_stats();
        let (graph, decode) = session(&m, &mut ops, kv);
        let (graph2, _) = session(&m, &mut ops, kv);
        let all = delta(g0, ops.gpu().graph_stats());
        println!("{q} {prec:?} kv {kv:?}: {} logit rows; whole sessions {all:?}; the 90-step decode of the first {decode:?}", graph.len());
        // Eager against eager first: a kernel that is not deterministic would show here, not
        // as a graph fault.
        assert_eq!(first_difference(&eager, &eager2), None, "{q} {prec:?}: two eager sessions differ (row, max diff)");
        assert_eq!(first_difference(&eager, &graph), None, "{q} {prec:?}: graph replay differs from eager launches (row, max diff)");
        assert_eq!(first_difference(&eager, &graph2), None, "{q} {prec:?}: a second graph session differs (row, max diff)");
        assert_eq!(all.failures, 0, "{q}: the driver refused a graph build or update");
        assert!(decode.graph_launches >= 80, "{q}: decode steps should replay graphs: {decode:?}");
        // A step goes out in a few lists (32, 64, 128.. launches): a few graphs per structure,
        // a few structures (the split of the keys, a page boundary) over the 90 steps.
        assert!(decode.builds <= 12, "{q}: decode at growing depth should update graphs, not rebuild them: {decode:?}");
    }
}
