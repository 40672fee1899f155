//! Decode steps queued ahead on the GPU ([`Model::submit_top`] with `deferred`: the step waits
//! on the device for its tokens, which [`Model::feed`] brings once the step before has been
//! read): the same kernels on the same tokens, so every row's best entries must equal those
//! of steps run one after the other with their tokens (tolerance 0).
//!
//! * `deferred_steps_equal_steps_with_their_tokens`: the tiny fixture model, three sequences
//!   decoding greedily from prompts of 60, 37 and 5 tokens for 80 steps (KV page boundaries at
//!   64 and 128 tokens: a deferred step takes its pages before it waits), one sequence leaving
//!   the batch half way; once each step after the other (`forward_batch_top`), once queued
//!   ahead, every step after the first deferred.
//! * `an_unfed_step_does_not_hang_the_device`: a deferred step whose caller never feeds it is
//!   released when the next step begins (an error) and when the backend is dropped.
//!
//! With no NVIDIA driver each test prints why and passes (CI has no GPU).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_cuda::{CudaOps, Gpu, Precision};
use ember_gguf::GgufFile;
use ember_model::{DeltaMode, Forward, Logits, Model, SeqBatch, SeqState, StepRows};
use ember_ops::{KvType, Ops, TopRow};

fn fixture(rel: &str) -> PathBuf {
    let local = PathBuf::from("tests/fixtures").join(rel);
    if local.exists() { local } else { ember_testkit::fixture(rel) }
}

fn model(q: &str) -> Model {
    let f = Arc::new(GgufFile::open(fixture(&format!("tiny-a/gguf/tiny-a-{q}.gguf"))).unwrap());
    Model::load(f, |_, _| {}).unwrap()
}

const K: usize = 8;
const STEPS: usize = 80;

/// The greedy token of a row's best entries (the largest value, the lower id on a tie).
fn best(r: &TopRow) -> u32 {
    let mut b = (0u32, f32::NEG_INFINITY);
    for (&i, &v) in r.ids.iter().zip(&r.vals) {
        if v > b.1 || (v == b.1 && i < b.0) {
            b = (i, v);
        }
    }
    b.0
}

/// Three sequences after their prompts, and each one's first token.
fn start(m: &Model, ops: &mut CudaOps) -> (Vec<SeqState>, Vec<u32>) {
    m.configure_store(ops, KvType::F16, 3, 512, 0).unwrap();
    let mut st: Vec<SeqState> = (0..3).map(|_| m.new_state(ops, 512).unwrap()).collect();
    let last = || Forward { logits: Some(Logits::Last), delta: DeltaMode::Auto, ..Default::default() };
    let mut first = Vec::new();
    for (i, (s, n)) in st.iter_mut().zip([60usize, 37, 5]).enumerate() {
        let p: Vec<u32> = (0..n).map(|j| ((i * 7 + j * 13 + 5) % 600) as u32).collect();
        let row = m.forward(ops, &p, s, last()).unwrap();
        first.push(best(&ember_ops::top::top_of_row(&row.data, K, &[])));
    }
    (st, first)
}

/// Which sequences decode at step `s`: all three, the second leaving after 40 steps.
fn members(s: usize) -> Vec<usize> {
    if s < 40 { vec![0, 1, 2] } else { vec![0, 2] }
}

/// Every step's rows, each step after the other with its tokens.
fn one_by_one(m: &Model, ops: &mut CudaOps) -> Vec<Vec<TopRow>> {
    let (mut st, mut next) = start(m, ops);
    let mut out = Vec::new();
    for s in 0..STEPS {
        let who = members(s);
        let toks: Vec<[u32; 1]> = who.iter().map(|&i| [next[i]]).collect();
        let mut seqs: Vec<SeqBatch> = st
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| who.contains(i))
            .zip(&toks)
            .map(|((_, st), t)| SeqBatch { tokens: t, state: st, logits: Logits::Last })
            .collect();
        let top = vec![Some((K, Vec::new())); who.len()];
        let rows: Vec<TopRow> = m
            .forward_batch_top(ops, &mut seqs, DeltaMode::Auto, &top, &mut || {})
            .unwrap()
            .into_iter()
            .map(|r| match r {
                StepRows::Top(t) => t,
                StepRows::Full(_) => panic!("whole rows"),
            })
            .collect();
        for (&i, r) in who.iter().zip(&rows) {
            next[i] = best(r);
        }
        out.push(rows);
    }
    out
}

/// Every step's rows, step s + 1 queued (deferred when the backend takes it so) before step
/// s's rows are read; and how many steps were deferred.
fn ahead(m: &Model, ops: &mut CudaOps) -> (Vec<Vec<TopRow>>, usize) {
    let (mut st, mut next) = start(m, ops);
    let top = |n: usize| vec![(K, Vec::new()); n];
    let submit = |ops: &mut CudaOps, st: &mut [SeqState], who: &[usize], toks: Option<&[u32]>| {
        let fed_later = [0u32];
        let per: Vec<[u32; 1]> = who.iter().enumerate().map(|(j, _)| [toks.map_or(0, |t| t[j])]).collect();
        let mut seqs: Vec<SeqBatch> = st
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| who.contains(i))
            .zip(&per)
            .map(|((_, st), t)| SeqBatch { tokens: if toks.is_some() { t } else { &fed_later }, state: st, logits: Logits::Last })
            .collect();
        m.submit_top(ops, &mut seqs, &top(who.len()), toks.is_none()).unwrap()
    };
    let who0 = members(0);
    let toks0: Vec<u32> = who0.iter().map(|&i| next[i]).collect();
    let mut queued = submit(ops, &mut st, &who0, Some(&toks0)).expect("a step with its tokens is always queued");
    let (mut out, mut deferred) = (Vec::new(), 0);
    for s in 0..STEPS {
        let who = members(s);
        // Step s + 1, deferred: its sequences are those of step s + 1.
        let later = if s + 1 < STEPS { submit(ops, &mut st, &members(s + 1), None) } else { None };
        let rows = m.collect_top(ops, queued).unwrap();
        for (&i, r) in who.iter().zip(&rows) {
            next[i] = best(r);
        }
        out.push(rows);
        if s + 1 == STEPS {
            break;
        }
        let who1 = members(s + 1);
        let toks1: Vec<u32> = who1.iter().map(|&i| next[i]).collect();
        queued = match later {
            Some(q) => {
                deferred += 1;
                m.feed(ops, &toks1).unwrap();
                q
            }
            None => submit(ops, &mut st, &who1, Some(&toks1)).expect("a step with its tokens is always queued"),
        };
    }
    (out, deferred)
}

#[test]
fn deferred_steps_equal_steps_with_their_tokens() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    for (q, prec) in [("Q4_K_M", Precision::Fast), ("Q6_K", Precision::Exact)] {
        let m = model(q);
        let mut ops = CudaOps::with_precision(0, prec).unwrap();
        ops.register(m.weights().clone()).unwrap();
        assert!(ops.defers_tokens(), "{q}: the GPU defers tokens by default");
        let a = one_by_one(&m, &mut ops);
        let t0 = Instant::now();
        let (b, deferred) = ahead(&m, &mut ops);
        println!("{q} {prec:?}: {STEPS} steps, {deferred} deferred, {:.1} ms queued ahead", t0.elapsed().as_secs_f64() * 1e3);
        assert_eq!(a.len(), b.len());
        for (s, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x, y, "{q}: step {s} differs");
        }
        // Page boundaries included (the first sequence at 64 and 128 tokens, the others at 64).
        assert_eq!(deferred, STEPS - 1, "{q}: steps deferred");
    }
}

#[test]
fn an_unfed_step_does_not_hang_the_device() {
    if let Err(e) = Gpu::new(0) {
        println!("skipped: {e}");
        return;
    }
    let m = model("Q4_K_M");
    let mut ops = CudaOps::with_precision(0, Precision::Fast).unwrap();
    ops.register(m.weights().clone()).unwrap();
    let (mut st, next) = start(&m, &mut ops);
    let top = vec![(K, Vec::new())];
    let t0 = Instant::now();
    // A deferred step never fed: the next step's begin releases it (token 0) and says so.
    let mut seqs = [SeqBatch { tokens: &[0], state: &mut st[2], logits: Logits::Last }];
    let q = m.submit_top(&mut ops, &mut seqs, &top, true).unwrap().expect("deferred");
    let mut seqs = [SeqBatch { tokens: &[next[2]], state: &mut st[2], logits: Logits::Last }];
    let e = m.submit_top(&mut ops, &mut seqs, &top, false).unwrap_err();
    assert!(e.to_string().contains("never fed"), "{e}");
    // Its rows can still be collected (garbage, token 0), without waiting for a timeout.
    m.collect_top(&mut ops, q).unwrap();
    // Another one left unfed when the backend goes: the drop does not hang either.
    let mut seqs = [SeqBatch { tokens: &[0], state: &mut st[0], logits: Logits::Last }];
    let q = m.submit_top(&mut ops, &mut seqs, &top, true).unwrap().expect("deferred");
    drop(q);
    drop(st);
    drop(ops);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}: a step waited for a feed's timeout", t0.elapsed());
}
