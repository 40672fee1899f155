//! The tiny-a fixture model against the references in tests/fixtures/tiny-a (HF transformers
//! float64, HF float64 on exactly dequantised weights, llama.cpp). Tolerances and the errors
//! measured when they were set are stated next to each assertion.

use std::sync::Arc;

use ember_cpu::{CpuBackend, Precision};
use ember_gguf::GgufFile;
use ember_model::{DeltaMode, Forward, Logits, Model, SeqState};
use ember_ops::{KvType, Ops};
use ember_testkit::{LogitStats, RefTensor, fixture, tiny_case_ids, tiny_refs};

const CASES: &[&str] = &["p1", "p5", "p37", "p64", "p65", "p130", "p300", "rand50"];

fn model(q: &str) -> Model {
    let f = Arc::new(GgufFile::open(fixture(&format!("tiny-a/gguf/tiny-a-{q}.gguf"))).unwrap());
    Model::load(f, |_, _| {}).unwrap()
}

fn exact(m: &Model) -> CpuBackend {
    with_weights(ember_cpu::backend(Precision::Exact, 2), m)
}

fn fast(m: &Model) -> CpuBackend {
    with_weights(ember_cpu::backend(Precision::Fast, 2), m)
}

/// Sizes `ops`' state store for `slots` sequences of `n_ctx` tokens with `kv` rows, and returns
/// a sequence in the first slot.
fn state(m: &Model, ops: &mut dyn Ops, kv: KvType, slots: usize, n_ctx: usize) -> SeqState {
    m.configure_store(ops, kv, slots, n_ctx, 0).unwrap();
    m.new_state(ops, n_ctx).unwrap()
}

/// `ops` with `m`'s weights registered.
fn with_weights(mut ops: CpuBackend, m: &Model) -> CpuBackend {
    ops.register(m.weights().clone()).unwrap();
    ops
}

/// All-position logits of `ids` in one prompt batch.
fn logits(m: &Model, ops: &mut dyn Ops, ids: &[u32], kv: KvType, delta: DeltaMode) -> Vec<f32> {
    let mut st = state(m, ops, kv, 1, ids.len() + 64);
    m.forward(ops, ids, &mut st, Forward { logits: Some(Logits::All), delta, ..Default::default() }).unwrap().data
}

/// Float32 bounds from the fixture README, used for every float32-compute comparison:
/// per-position relative L2 <= 1e-4, max abs <= 1e-3, top-1 identical (HF float32 and llama.cpp
/// F32 reach 2.2e-6 / 2.1e-5).
fn assert_f32_bounds(what: &str, s: &LogitStats) {
    eprintln!("{what}: {s}");
    assert!(s.max_rel() <= 1e-4, "{what}: max rel {:.3e} > 1e-4", s.max_rel());
    assert!(s.max_abs <= 1e-3, "{what}: max abs {:.3e} > 1e-3", s.max_abs);
    assert_eq!(s.top1, 1.0, "{what}: top-1 differs somewhere");
}

/// BF16 GGUF (bf16-exact weights = the HF checkpoint) through the exact path vs HF float64.
/// Measured: max rel 8.4e-7, max abs 9.0e-6, p50 rel 4.9e-7 over all cases (llama.cpp F32 GGUF:
/// 7.1e-7, 7.2e-6, 4.1e-7).
#[test]
fn bf16_exact_matches_hf_f64() {
    let m = model("BF16");
    let mut ops = exact(&m);
    let mut all = Vec::new();
    for case in CASES {
        let got = logits(&m, &mut ops, &tiny_case_ids(case), KvType::F32, DeltaMode::Auto);
        let s = LogitStats::compare(&got, &tiny_refs("hf")[&format!("logits.{case}.f64")]);
        assert_f32_bounds(&format!("BF16 exact {case}"), &s);
        all.push(s);
    }
    eprintln!("BF16 exact, all cases pooled: {}", LogitStats::pooled(&all));
}

/// Greedy continuations by teacher forcing: prompt, then HF's 32 greedy tokens one at a time
/// through the decode path; every step's logits within the float32 bounds of HF float64 and
/// every argmax equal to HF's token.
#[test]
fn bf16_exact_greedy_teacher_forced() {
    let m = model("BF16");
    let mut ops = exact(&m);
    for case in ["g_chat", "g_p37"] {
        let ids = tiny_case_ids(case);
        let want_tokens = &tiny_refs("hf")[&format!("greedy.{case}.tokens.f64")];
        let want_logits = &tiny_refs("hf")[&format!("greedy.{case}.logits.f64")];
        let mut st = state(&m, &mut ops, KvType::F32, 1, ids.len() + 40);
        let mut got = m.forward(&mut ops, &ids, &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap().data;
        let mut rows = Vec::new();
        for step in 0..want_tokens.data.len() {
            rows.extend_from_slice(&got);
            let tok = want_tokens.data[step] as u32;
            got = m.forward(&mut ops, &[tok], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap().data;
        }
        let s = LogitStats::compare(&rows, want_logits);
        assert_f32_bounds(&format!("greedy {case}"), &s);
    }
}

/// Quantised GGUFs through the exact path vs HF float64 on the same exactly dequantised
/// weights: the same float32 bounds. Measured max rel: Q8_0 8.2e-7, Q6_K 1.2e-6, Q4_K_M 9.1e-7.
#[test]
fn quantised_exact_matches_hfdq() {
    for q in ["Q8_0", "Q6_K", "Q4_K_M"] {
        let m = model(q);
        let mut ops = exact(&m);
        for case in ["p300", "rand50"] {
            let got = logits(&m, &mut ops, &tiny_case_ids(case), KvType::F32, DeltaMode::Auto);
            let s = LogitStats::compare(&got, &tiny_refs("hfdq")[&format!("hfdq.{q}.logits.{case}")]);
            assert_f32_bounds(&format!("{q} exact {case}"), &s);
        }
    }
}

/// The default (fast) path of every file is at least as close to its reference as llama.cpp's
/// logits are: median per-position error no larger and top-1 agreement no lower, over p300 and
/// rand50 pooled. Per-logit bounds are meaningless here (routing flips; fixture README). The KV
/// cache is f32 as in the llama.cpp reference run. Measured (ours / llama.cpp), p50 rel and top-1:
/// Q8_0 0.0200 / 0.0212, 0.960 / 0.949; Q6_K 0.0210 / 0.0314, 0.949 / 0.937; Q4_K_M 0.0210 /
/// 0.0330, 0.954 / 0.926: our activation blocks of 32 (kernels.rs) round less than Q8_K's 256.
/// With the AVX2 kernels (another summation order, and grouped activation scales for K-quant
/// weights, kernels.rs): Q8_0 0.0199, 0.960; Q6_K 0.0211, 0.969; Q4_K_M 0.0211, 0.937.
#[test]
fn fast_path_at_least_as_close_as_llama_cpp() {
    for q in ["Q8_0", "Q6_K", "Q4_K_M"] {
        let m = model(q);
        let mut ops = fast(&m);
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for case in ["p300", "rand50"] {
            let want = &tiny_refs("hfdq")[&format!("hfdq.{q}.logits.{case}")];
            let got = logits(&m, &mut ops, &tiny_case_ids(case), KvType::F32, DeltaMode::Auto);
            ours.push(LogitStats::compare(&got, want));
            let llama: Vec<f32> = tiny_refs("llama")[&format!("llama.{q}.logits.{case}")].data.iter().map(|&x| x as f32).collect();
            theirs.push(LogitStats::compare(&llama, want));
        }
        let (o, t) = (LogitStats::pooled(&ours), LogitStats::pooled(&theirs));
        eprintln!("{q} fast vs hfdq:      {o}\n{q} llama.cpp vs hfdq: {t}");
        for case in ["p300", "rand50"] {
            let l = &tiny_refs("llama")[&format!("llama.{q}.logits.{case}")];
            let got = logits(&m, &mut ops, &tiny_case_ids(case), KvType::F32, DeltaMode::Auto);
            eprintln!("{q} fast vs llama.cpp {case}: {}", LogitStats::compare(&got, l));
        }
        assert!(
            o.percentile(50.0) <= t.percentile(50.0),
            "{q}: median rel {:.4} > llama.cpp's {:.4}",
            o.percentile(50.0),
            t.percentile(50.0)
        );
        assert!(o.top1 >= t.top1, "{q}: top-1 {:.4} < llama.cpp's {:.4}", o.top1, t.top1);
    }
    // BF16: llama.cpp's BF16 path (bf16 activations) reaches p50 rel 5.2e-3 and top-1 0.9969 vs
    // HF float64 (fixture agreement table); ours keeps f32 activations for float weights.
    let m = model("BF16");
    let mut ops = fast(&m);
    let mut all = Vec::new();
    for case in CASES {
        let got = logits(&m, &mut ops, &tiny_case_ids(case), KvType::F32, DeltaMode::Auto);
        all.push(LogitStats::compare(&got, &tiny_refs("hf")[&format!("logits.{case}.f64")]));
    }
    let o = LogitStats::pooled(&all);
    eprintln!("BF16 fast vs HF f64: {o}");
    assert!(o.percentile(50.0) <= 5.2e-3 && o.top1 >= 0.9969, "BF16 fast: {o}");
}

/// The default KV cache types (f16, q8_0) stay close to the f32 cache on the fast path.
/// Measured p50 rel vs the f32 cache on p300: f16 1.7e-4, q8_0 4.2e-3 with the prompt P·V in
/// f32; 7.6e-4 and 5.8e-3 in bf16 (AVX-512 BF16 CPUs). Bounds 2e-3 and 2e-2 (2.6x, 3.4x).
#[test]
fn kv_cache_types() {
    let m = model("BF16");
    let mut ops = fast(&m);
    let ids = tiny_case_ids("p300");
    let base = logits(&m, &mut ops, &ids, KvType::F32, DeltaMode::Auto);
    let base = RefTensor { shape: vec![ids.len(), m.config.n_vocab], data: base.iter().map(|&x| x as f64).collect() };
    for (kv, bound) in [(KvType::F16, 2e-3), (KvType::Q8_0, 2e-2)] {
        let got = logits(&m, &mut ops, &ids, kv, DeltaMode::Auto);
        let s = LogitStats::compare(&got, &base);
        eprintln!("{kv:?} cache vs f32 cache: {s}");
        assert!(s.percentile(50.0) <= bound, "{kv:?}: p50 rel {:.3e} > {bound}", s.percentile(50.0));
    }
}

/// Chunked and recurrent delta rule agree (both vs HF float64 within the float32 bounds, and
/// with each other to 1e-5 rel; measured 8.8e-7).
#[test]
fn chunked_equals_recurrent() {
    let m = model("BF16");
    let mut ops = exact(&m);
    let ids = tiny_case_ids("p300");
    let want = &tiny_refs("hf")["logits.p300.f64"];
    let rec = logits(&m, &mut ops, &ids, KvType::F32, DeltaMode::Recurrent);
    let chk = logits(&m, &mut ops, &ids, KvType::F32, DeltaMode::Chunked);
    assert_f32_bounds("recurrent p300", &LogitStats::compare(&rec, want));
    assert_f32_bounds("chunked p300", &LogitStats::compare(&chk, want));
    let rec_t = RefTensor { shape: vec![ids.len(), m.config.n_vocab], data: rec.iter().map(|&x| x as f64).collect() };
    let s = LogitStats::compare(&chk, &rec_t);
    eprintln!("chunked vs recurrent: {s}");
    assert!(s.max_rel() <= 1e-5, "chunked vs recurrent: {s}");
}

/// Prompt path then decode path (fixture decode_check: prefill 60 of p130, then one token at a
/// time) and a split prefill (chunked_check: 64 + 36 + 30) equal the HF float64 logits.
#[test]
fn prompt_and_decode_paths_agree() {
    let m = model("BF16");
    let mut ops = exact(&m);
    let ids = tiny_case_ids("p130");
    let want = &tiny_refs("hf")["logits.p130.f64"];
    for splits in [vec![60, 1], vec![64, 36, 30]] {
        let mut st = state(&m, &mut ops, KvType::F32, 1, ids.len());
        let mut rows = Vec::new();
        let mut at = 0;
        let mut k = 0;
        while at < ids.len() {
            let n = splits[k.min(splits.len() - 1)].min(ids.len() - at);
            let l = m.forward(&mut ops, &ids[at..at + n], &mut st, Forward::default()).unwrap();
            rows.extend_from_slice(&l.data);
            at += n;
            k += 1;
        }
        assert_f32_bounds(&format!("p130 in batches {splits:?}"), &LogitStats::compare(&rows, want));
    }
}

/// Bad batches are errors, not panics.
#[test]
fn batch_errors() {
    let m = model("Q8_0");
    let mut ops = fast(&m);
    let mut st = state(&m, &mut ops, KvType::F16, 1, 4);
    let e = m.forward(&mut ops, &[], &mut st, Forward::default()).unwrap_err();
    assert!(e.to_string().contains("no tokens"), "{e}");
    let e = m.forward(&mut ops, &[9999], &mut st, Forward::default()).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = m.forward(&mut ops, &[1, 2, 3, 4, 5], &mut st, Forward::default()).unwrap_err();
    assert!(e.to_string().contains("context full"), "{e}");
    m.forward(&mut ops, &[1, 2, 3, 4], &mut st, Forward::default()).unwrap();
    let e = m.forward(&mut ops, &[1], &mut st, Forward::default()).unwrap_err();
    assert!(e.to_string().contains("context full"), "{e}");
}

/// Several sequences in one forward_batch call (a prompt, a decode step, a second prompt, at
/// different depths) give the same logits as separate calls: the exact path agrees to 1e-5 rel
/// (only the batch composition of matmuls differs; measured ~1e-7).
#[test]
fn batched_sequences_equal_separate_calls() {
    use ember_model::SeqBatch;
    let m = model("Q4_K_M");
    let mut ops = exact(&m);
    let a = tiny_case_ids("p65");
    let b = tiny_case_ids("rand50");
    m.configure_store(&mut ops, KvType::F16, 4, 200, 0).unwrap();
    let new_state = |ops: &mut CpuBackend| m.new_state(ops, 200).unwrap();
    // Separate: a[..40] then a[40], b[..50], a[41..].
    let (mut s1, mut s2) = (new_state(&mut ops), new_state(&mut ops));
    m.forward(&mut ops, &a[..40], &mut s1, Forward::default()).unwrap();
    let want_a = m.forward(&mut ops, &a[40..41], &mut s1, Forward::default()).unwrap();
    let want_b = m.forward(&mut ops, &b, &mut s2, Forward::default()).unwrap();
    // Batched: the same prefixes, then both continuations in one call.
    let (mut t1, mut t2) = (new_state(&mut ops), new_state(&mut ops));
    m.forward(&mut ops, &a[..40], &mut t1, Forward::default()).unwrap();
    let mut seqs = [
        SeqBatch { tokens: &a[40..41], state: &mut t1, logits: Logits::All },
        SeqBatch { tokens: &b, state: &mut t2, logits: Logits::All },
    ];
    let got = m.forward_batch(&mut ops, &mut seqs, DeltaMode::Auto, None).unwrap();
    for (g, w) in got.iter().zip([&want_a, &want_b]) {
        let wt = RefTensor { shape: vec![w.n, w.d], data: w.data.iter().map(|&x| x as f64).collect() };
        let s = LogitStats::compare(&g.data, &wt);
        eprintln!("batched vs separate: {s}");
        assert!(s.max_rel() <= 1e-5, "{s}");
    }
    assert_eq!((t1.n_past, t2.n_past), (41, 50));
}

/// forward_batch_top: a sequence asking for its row's best entries gets what
/// `ember_ops::top::top_of_row` selects from the whole row of the same step, bit for bit, both
/// when every sequence with rows asks (one `read_top`) and when one asks for its rows whole
/// (the selection on the host); a sequence with no rows gets none; a top request without
/// `Logits::Last` is refused.
#[test]
fn top_rows_are_the_whole_rows_best_entries() {
    use ember_model::{SeqBatch, StepRows};
    let m = model("Q4_K_M");
    let mut ops = exact(&m);
    let a = tiny_case_ids("p65");
    let b = tiny_case_ids("rand50");
    m.configure_store(&mut ops, KvType::F16, 6, 200, 0).unwrap();
    let run = |ops: &mut CpuBackend, top: &[Option<(usize, Vec<u32>)>], last_b: Logits| -> Vec<StepRows> {
        let (mut s1, mut s2, mut s3) = (m.new_state(ops, 200).unwrap(), m.new_state(ops, 200).unwrap(), m.new_state(ops, 200).unwrap());
        let mut seqs = [
            SeqBatch { tokens: &a[..20], state: &mut s1, logits: Logits::Last },
            SeqBatch { tokens: &b, state: &mut s2, logits: last_b },
            SeqBatch { tokens: &a[20..30], state: &mut s3, logits: Logits::None },
        ];
        m.forward_batch_top(ops, &mut seqs, DeltaMode::Auto, top, &mut || {}).unwrap()
    };
    let whole = run(&mut ops, &[None, None, None], Logits::Last);
    let row = |i: usize| match &whole[i] {
        StepRows::Full(x) => x.data.clone(),
        other => panic!("{other:?}"),
    };
    let (ra, rb) = (row(0), row(1));
    // Both ask: one read_top with the larger k (a superset for the smaller ask).
    let got = run(&mut ops, &[Some((3, vec![7, 2])), Some((5, vec![])), None], Logits::Last);
    assert_eq!(got[0], StepRows::Top(ember_ops::top::top_of_row(&ra, 5, &[7, 2])));
    assert_eq!(got[1], StepRows::Top(ember_ops::top::top_of_row(&rb, 5, &[])));
    assert!(matches!(&got[2], StepRows::Full(x) if x.n == 0));
    // One asks, one wants its rows whole: read whole, selected on the host.
    let got = run(&mut ops, &[Some((3, vec![9])), None, None], Logits::Last);
    assert_eq!(got[0], StepRows::Top(ember_ops::top::top_of_row(&ra, 3, &[9])));
    assert_eq!(got[1], whole[1]);
    let mut st = m.new_state(&mut ops, 200).unwrap();
    let mut seqs = [SeqBatch { tokens: &a[..5], state: &mut st, logits: Logits::All }];
    let e = m.forward_batch_top(&mut ops, &mut seqs, DeltaMode::Auto, &[Some((2, vec![]))], &mut || {}).unwrap_err();
    assert!(e.to_string().contains("Logits::Last"), "{e}");
}

/// Snapshot after a prefix, run on, restore, continue differently: the logits equal a run from
/// scratch over the whole new prompt (float32 bounds vs HF float64 on p130, which shares the
/// first 64 tokens with p65).
#[test]
fn snapshot_restore_continues_exactly() {
    let m = model("BF16");
    let mut ops = exact(&m);
    let ids = tiny_case_ids("p130");
    let mut st = state(&m, &mut ops, KvType::F32, 1, 200);
    m.forward(&mut ops, &ids[..50], &mut st, Forward::default()).unwrap();
    let snap = st.snapshot(&mut ops).unwrap();
    assert_eq!(snap.len(), 50);
    assert!(snap.bytes() > 0);
    m.forward(&mut ops, &[1, 2, 3, 4, 5], &mut st, Forward::default()).unwrap(); // a different continuation
    st.restore(&mut ops, &snap).unwrap();
    let rest = m.forward(&mut ops, &ids[50..], &mut st, Forward::default()).unwrap();
    let want = &tiny_refs("hf")["logits.p130.f64"];
    let want_tail = RefTensor { shape: vec![80, want.shape[1]], data: want.data[50 * want.shape[1]..].to_vec() };
    assert_f32_bounds("restored p130[50..]", &LogitStats::compare(&rest.data, &want_tail));
}

/// Free-running greedy decoding (32 tokens) on every file through the exact path reproduces the
/// reference's tokens: HF float64 for BF16, HF float64 on the dequantised weights for the
/// quantised files. The fast path's agreement with the reference and with llama.cpp's greedy
/// tokens is printed for the record (random weights amplify rounding, so it is not asserted).
#[test]
fn greedy_continuations() {
    for q in ["BF16", "Q8_0", "Q6_K", "Q4_K_M"] {
        let m = model(q);
        for case in ["g_chat", "g_p37"] {
            let ids = tiny_case_ids(case);
            let want: Vec<u32> = match q {
                "BF16" => tiny_refs("hf")[&format!("greedy.{case}.tokens.f64")].data.iter().map(|&x| x as u32).collect(),
                _ => tiny_refs("hfdq")[&format!("hfdq.{q}.greedy.{case}.tokens")].data.iter().map(|&x| x as u32).collect(),
            };
            let llama: Vec<u32> = tiny_refs("llama")[&format!("llama.{q}.greedy.{case}.tokens")].data.iter().map(|&x| x as u32).collect();
            let run = |mut ops: CpuBackend| -> Vec<u32> {
                let ops: &mut dyn Ops = &mut ops;
                let mut st = state(&m, ops, KvType::F32, 1, ids.len() + 40);
                let mut l = m.forward(ops, &ids, &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
                let mut out = Vec::new();
                for _ in 0..want.len() {
                    let t = ember_testkit::argmax(l.data.iter().map(|&x| x as f64)) as u32;
                    out.push(t);
                    l = m.forward(ops, &[t], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
                }
                out
            };
            let same = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
            let ex = run(exact(&m));
            let fa = run(fast(&m));
            eprintln!(
                "{q} {case}: exact = reference for {}/32, fast = reference for {}, fast = llama.cpp for {}, llama.cpp = reference for {}",
                same(&ex, &want),
                same(&fa, &want),
                same(&fa, &llama),
                same(&llama, &want)
            );
            assert_eq!(ex, want, "{q} {case}: exact greedy tokens differ from the reference");
        }
    }
}

/// Batch-invariant precision: a 300-token prompt run whole, split 137 + 1 + 162, or split into
/// single tokens gives bit-identical last logits (every token takes the single-token kernels).
/// The default fast precision only agrees to rounding: prompt-sized batches use panels and the
/// column-block delta rule (measured here: rel L2 up to ~1e-2 between the splits, the tiny
/// random model turning rounding into an occasional MoE routing flip; bound 0.1).
#[test]
fn batch_invariant_precision_is_bitwise_invariant_to_splits() {
    let ids = tiny_case_ids("p300");
    let last = |m: &Model, ops: &mut CpuBackend, parts: &[usize]| -> Vec<f32> {
        let mut st = state(m, ops, KvType::F16, 1, ids.len() + 8);
        let mut at = 0;
        let mut out = Vec::new();
        for &n in parts {
            let f = Forward { logits: Some(Logits::Last), delta: DeltaMode::Recurrent, ..Default::default() };
            out = m.forward(ops, &ids[at..at + n], &mut st, f).unwrap().data;
            at += n;
        }
        assert_eq!(at, ids.len());
        out
    };
    for q in ["Q4_K_M", "Q8_0"] {
        let m = model(q);
        let mut inv = with_weights(ember_cpu::backend(Precision::BatchInvariant, 2), &m);
        let whole = last(&m, &mut inv, &[300]);
        assert_eq!(whole, last(&m, &mut inv, &[137, 1, 162]), "{q}: invariant, 137+1+162");
        assert_eq!(whole, last(&m, &mut inv, &[1; 300]), "{q}: invariant, one token at a time");
        let mut f = fast(&m);
        let (a, b) = (last(&m, &mut f, &[300]), last(&m, &mut f, &[137, 1, 162]));
        let rel = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt()
            / a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        eprintln!("{q}: fast precision, whole vs 137+1+162: rel L2 {rel:.2e}");
        assert!(rel < 0.1, "{q}: fast precision splits differ by rel L2 {rel}");
    }
}

/// Layer by layer against HF float64 on p37 (BF16 weights, exact path): the residual stream
/// after the embedding, after every decoder layer and after the final norm; every layer's
/// routing (top-k ids in order, renormalised weights); and the DeltaNet layers' recurrent and
/// conv states after the prompt. HF keeps the value heads grouped by key head (value head j
/// uses key head j / (n_v/n_k)), the GGUF tiles them (head h uses key head h % n_k), and we
/// store each head's state transposed ([d_v][d_k]): the comparison maps both.
/// Measured: hidden max rel 6.2e-7, routing weights 6.2e-7 (ids identical), recurrent state
/// 7.3e-7, conv state 2.9e-7; bounds 1e-4 (the float32 bound of the logits).
#[test]
fn hidden_states_routing_and_recurrent_state_match_hf() {
    let m = model("BF16");
    let mut ops = exact(&m);
    let c = &m.config;
    let ids = tiny_case_ids("p37");
    let hf = tiny_refs("hf");
    let mut st = state(&m, &mut ops, KvType::F32, 1, ids.len());
    let mut taps: Vec<(String, usize, ember_ops::Mat)> = Vec::new();
    let mut tap = |name: &str, i: usize, x: &ember_ops::Mat| taps.push((name.to_string(), i, x.clone()));
    m.forward(&mut ops, &ids, &mut st, Forward { logits: Some(Logits::All), tap: Some(&mut tap), ..Default::default() }).unwrap();
    let rel = |got: &[f32], want: &[f64]| -> f64 {
        let scale = want.iter().fold(0f64, |a, b| a.max(b.abs()));
        got.iter().zip(want).fold(0f64, |a, (g, w)| a.max((*g as f64 - w).abs())) / scale
    };
    let find = |name: &str, i: usize| &taps.iter().find(|t| t.0 == name && t.1 == i).unwrap_or_else(|| panic!("no tap {name} {i}")).2;

    let hidden = &hf["hidden.p37.f64"]; // [L + 2, T, D]
    let plane = ids.len() * c.n_embd;
    let mut worst = 0f64;
    for (slot, (name, i)) in
        [("embd", 0)].into_iter().chain((0..c.n_layer).map(|i| ("layer_out", i))).chain([("final_norm", 0)]).enumerate()
    {
        let e = rel(&find(name, i).data, &hidden.data[slot * plane..(slot + 1) * plane]);
        assert!(e <= 1e-4, "{name} {i}: max rel {e:.2e}");
        worst = worst.max(e);
    }
    eprintln!("hidden states: max rel {worst:.2e}");

    let mut worst = 0f64;
    for i in 0..c.n_layer {
        let want_ids: Vec<f32> = hf[&format!("router.p37.layer{i}.topk_ids.f64")].data.iter().map(|&x| x as f32).collect();
        assert_eq!(find("route_ids", i).data, want_ids, "layer {i}: routed experts differ from HF's");
        let e = rel(&find("route_weights", i).data, &hf[&format!("router.p37.layer{i}.topk_weights.f64")].data);
        assert!(e <= 1e-4, "layer {i}: routing weights max rel {e:.2e}");
        worst = worst.max(e);
    }
    eprintln!("routing weights: max rel {worst:.2e}");

    let (nk, nv, dk, dv) = (c.n_k_head, c.n_v_head, c.d_k, c.d_v);
    let hf_head = |h: usize| (h % nk) * (nv / nk) + h / nk; // GGUF value head -> HF value head
    let (mut worst_s, mut worst_c) = (0f64, 0f64);
    for i in 0..c.n_layer {
        if c.layer_kinds[i] != ember_model::LayerKind::DeltaNet {
            continue;
        }
        let (conv, s) = st.delta_state(&mut ops, i).unwrap();
        let want = &hf[&format!("state.p37.layer{i}.recurrent.f64")]; // [nv, dk, dv]
        let mut got = vec![0f32; want.data.len()];
        for h in 0..nv {
            for jv in 0..dv {
                for ik in 0..dk {
                    got[(hf_head(h) * dk + ik) * dv + jv] = s[(h * dv + jv) * dk + ik];
                }
            }
        }
        let e = rel(&got, &want.data);
        assert!(e <= 1e-4, "layer {i}: recurrent state max rel {e:.2e}");
        worst_s = worst_s.max(e);
        let want = &hf[&format!("state.p37.layer{i}.conv.f64")]; // [channels, kernel]
        let (ch, kernel) = (want.shape[0], want.shape[1]);
        let qk = 2 * nk * dk;
        let hf_channel = |c: usize| if c < qk { c } else { qk + hf_head((c - qk) / dv) * dv + (c - qk) % dv };
        let (mut g, mut w) = (Vec::new(), Vec::new());
        for j in 0..kernel - 1 {
            for cc in 0..ch {
                g.push(conv[j * ch + cc]);
                w.push(want.data[hf_channel(cc) * kernel + j + 1]);
            }
        }
        let e = rel(&g, &w);
        assert!(e <= 1e-4, "layer {i}: conv state max rel {e:.2e}");
        worst_c = worst_c.max(e);
    }
    eprintln!("recurrent state: max rel {worst_s:.2e}; conv state: max rel {worst_c:.2e}");
}
