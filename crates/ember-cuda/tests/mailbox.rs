//! The expert tier's mailbox kernels (kernels/mailbox.cu) and the host side ([`Mailbox`]), on
//! made-up routings: copies and f32 sums of values exact in f32, so tolerance 0.
//!
//! * `post_publishes_the_routing_and_x_only_with_misses`: after `moe_post`, `routed` is the
//!   generation, ids and weights are the routing's, `n_miss` counts the pairs whose slot is
//!   MOE_MISS (an id out of range counts as resident), x is copied only when some pair misses.
//! * `wait_adds_the_host_answer_given_while_it_waits`: post and wait queued together; the host
//!   polls `routed` while the GPU runs and answers; out gets exactly out + sum. With no misses
//!   the wait kernel neither waits nor adds (no answer is given).
//! * `a_host_that_never_answers_gives_nan_rows_not_a_hang`: the wait ends after its timeout
//!   (50 ms here) with NaN rows and `timed_out` set, and the stream goes on.
//!
//! With no NVIDIA driver each test prints why and passes (CI has no GPU).

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ember_cuda::ops::{MOE_MISS, MoeRouting};
use ember_cuda::{Buf, Gpu, Mailbox};
use ember_testkit::Rng;

/// One test of this file at a time, with the GPU (None, having said why, without one).
fn gpu() -> Option<(MutexGuard<'static, ()>, Gpu)> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    match Gpu::new(0) {
        Ok(g) => Some((guard, g)),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn quarters(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (rng.below(512) as f32 - 256.0) * 0.25).collect()
}

/// A routing of `n_tok` tokens, `k` experts each, over 16 experts of which `resident` are on
/// the device (the others MOE_MISS), plus one id out of range when `bad_id`.
struct Case {
    ids: Buf<u32>,
    weights: Buf<f32>,
    x: Buf<f32>,
    slot_of: Buf<u32>,
    host_ids: Vec<u32>,
    host_w: Vec<f32>,
    host_x: Vec<f32>,
    n_miss: u32,
    n_tok: usize,
    k: usize,
    d: usize,
}

const N_EXPERT: usize = 16;

fn case(g: &Gpu, rng: &mut Rng, n_tok: usize, k: usize, d: usize, resident: &[u32], bad_id: bool) -> Case {
    let mut ids: Vec<u32> = (0..n_tok * k).map(|_| rng.below(N_EXPERT) as u32).collect();
    if bad_id {
        ids[0] = N_EXPERT as u32 + 3;
    }
    let slot_of: Vec<u32> = (0..N_EXPERT as u32).map(|e| resident.iter().position(|&r| r == e).map_or(MOE_MISS, |s| s as u32)).collect();
    let n_miss = ids.iter().filter(|&&e| (e as usize) < N_EXPERT && slot_of[e as usize] == MOE_MISS).count() as u32;
    let w = quarters(rng, n_tok * k);
    let x = quarters(rng, n_tok * d);
    Case {
        ids: g.upload(&ids).unwrap(),
        weights: g.upload(&w).unwrap(),
        x: g.upload(&x).unwrap(),
        slot_of: g.upload(&slot_of).unwrap(),
        host_ids: ids,
        host_w: w,
        host_x: x,
        n_miss,
        n_tok,
        k,
        d,
    }
}

fn post(g: &Gpu, c: &Case, generation: &Buf<u32>, mb: &Mailbox) {
    let r = MoeRouting { ids: &c.ids, weights: &c.weights, k: c.k };
    g.moe_post(r, c.n_tok, &c.x, c.n_tok * c.d, &c.slot_of, N_EXPERT, generation, mb).unwrap();
}

#[test]
fn post_publishes_the_routing_and_x_only_with_misses() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    let mb = g.mailbox(32 * 8, 32 * 64).unwrap();
    for (step, (n_tok, resident, bad)) in
        [(1, vec![0, 1, 2], false), (7, (0..16).collect::<Vec<u32>>(), true), (32, vec![5], false), (3, vec![], true)]
            .into_iter()
            .enumerate()
    {
        let step = step as u32 + 1;
        let c = case(&g, &mut rng, n_tok, 8, 64, &resident, bad);
        let generation = g.upload(&[step]).unwrap();
        post(&g, &c, &generation, &mb);
        g.sync().unwrap();
        assert_eq!(mb.routed(), step);
        assert_eq!(mb.n_miss(), c.n_miss, "{n_tok} tokens, resident {resident:?}");
        let (ids, w) = mb.routing(n_tok * 8).unwrap();
        assert_eq!(ids, c.host_ids);
        assert_eq!(w, c.host_w);
        assert_eq!(g.download(mb.need()).unwrap()[0], c.n_miss);
        if c.n_miss > 0 {
            assert_eq!(mb.x(n_tok * 64).unwrap(), c.host_x);
        }
        println!("{n_tok} tokens, {} resident: {} misses published", resident.len(), c.n_miss);
    }
    // A routing larger than the mailbox is refused before any launch.
    let c = case(&g, &mut rng, 33, 8, 64, &[], false);
    let generation = g.upload(&[9u32]).unwrap();
    let r = MoeRouting { ids: &c.ids, weights: &c.weights, k: 8 };
    assert!(g.moe_post(r, 33, &c.x, 33 * 64, &c.slot_of, N_EXPERT, &generation, &mb).is_err());
}

#[test]
fn wait_adds_the_host_answer_given_while_it_waits() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    let mb = g.mailbox(32 * 8, 32 * 256).unwrap();
    for (step, (n_tok, resident)) in [(1usize, vec![1u32, 2]), (32, vec![0, 3, 4, 9]), (4, (0..16).collect())].into_iter().enumerate() {
        let step = step as u32 + 1;
        let d = 256;
        let c = case(&g, &mut rng, n_tok, 8, d, &resident, false);
        let generation = g.upload(&[step]).unwrap();
        let out0 = quarters(&mut rng, n_tok * d);
        let sum = quarters(&mut rng, n_tok * d);
        let mut out = g.upload(&out0).unwrap();
        post(&g, &c, &generation, &mb);
        g.moe_wait_add(&mut out, n_tok * d, &generation, &mb).unwrap();
        // The host side, as the tier runs it: poll `routed`, then answer only when there are misses.
        let t0 = Instant::now();
        while mb.routed() != step {
            assert!(t0.elapsed() < Duration::from_secs(5), "moe_post never published");
            std::hint::spin_loop();
        }
        if mb.n_miss() > 0 {
            assert_eq!(mb.x(n_tok * d).unwrap(), c.host_x);
            mb.answer(step, &sum).unwrap();
        }
        let got = g.download(&out).unwrap();
        let want: Vec<f32> = if c.n_miss > 0 { out0.iter().zip(&sum).map(|(a, b)| a + b).collect() } else { out0.clone() };
        assert_eq!(got[..n_tok * d], want[..], "{n_tok} tokens, {} misses", c.n_miss);
        println!("{n_tok} tokens, {} misses: out {} the answer", c.n_miss, if c.n_miss > 0 { "+" } else { "without" });
    }
}

#[test]
fn a_host_that_never_answers_gives_nan_rows_not_a_hang() {
    let Some((_lock, g)) = gpu() else { return };
    let mut rng = Rng::new();
    let mut mb = g.mailbox(8, 64).unwrap();
    mb.set_timeout_ns(50_000_000);
    let c = case(&g, &mut rng, 1, 8, 64, &[], false);
    assert!(c.n_miss > 0);
    let generation = g.upload(&[1u32]).unwrap();
    let mut out = g.upload(&quarters(&mut rng, 64)).unwrap();
    let t0 = Instant::now();
    post(&g, &c, &generation, &mb);
    g.moe_wait_add(&mut out, 64, &generation, &mb).unwrap();
    let got = g.download(&out).unwrap();
    let took = t0.elapsed();
    assert!(got.iter().all(|v| v.is_nan()), "{got:?}");
    assert_eq!(mb.timed_out(), 1);
    assert!(took >= Duration::from_millis(50) && took < Duration::from_secs(5), "{took:?}");
    // The stream goes on: an answer given late does not matter to a new step.
    let generation = g.upload(&[2u32]).unwrap();
    let mut out = g.upload(&[1.0f32; 64]).unwrap();
    post(&g, &c, &generation, &mb);
    mb.answer(2, &[0.5; 64]).unwrap();
    g.moe_wait_add(&mut out, 64, &generation, &mb).unwrap();
    assert_eq!(g.download(&out).unwrap(), vec![1.5f32; 64]);
    assert_eq!(mb.timed_out(), 1, "step 2 was answered in time");
    println!("no answer: NaN rows after {took:?}; the next step's answer added");
}
