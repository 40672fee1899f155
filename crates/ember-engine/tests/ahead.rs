//! Decode steps run ahead (engine/ahead.rs) on a backend that queues steps as a device does
//! (state held by the backend, a deferred step's tokens applied when fed): the same tokens and
//! finish reasons as without, prompt-cache checkpoints that hold what their keys say, clients
//! that leave, and steps the backend will not defer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use ember_engine::prefix_cache::Checkpoint;
use ember_engine::{Backend, EngineConfig, Error, Event, EventSink, FinishReason, GenRequest, Logits, SamplerConfig, Step};
use ember_ops::TopRow;
use ember_ops::top::top_of_row;

const N_VOCAB: usize = 32;
const EOG: u32 = 31;

/// A row that depends on every token the state holds (a model's logits do): a state that holds
/// other tokens than its sequence's gives other rows.
fn row_of(toks: &[u32]) -> Vec<f32> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in toks {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    (0..N_VOCAB as u64)
        .map(|j| {
            let mut x = h ^ j.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 29;
            x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x ^= x >> 32;
            (x % 1000) as f32 / 100.0
        })
        .collect()
}

type Toks = Arc<Mutex<Vec<u32>>>;

struct HashState {
    toks: Toks,
    n_ctx: usize,
}

struct HashSnap(Vec<u32>);

impl Checkpoint for HashSnap {
    fn bytes(&self) -> usize {
        4 * self.0.len() + 16
    }
    fn shared(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
}

enum Queued {
    Rows(Vec<TopRow>),
    Waiting(Vec<(Toks, (usize, Vec<u32>))>),
}

#[derive(Default)]
struct Counts {
    deferred: AtomicUsize,
    refused: AtomicUsize,
    fed_rows: AtomicUsize,
}

/// The state lives in the backend (as on a device): a queued step holds the sequences' states
/// and applies its tokens when fed. `ahead` off: no steps queued (the engine's normal path).
/// Steps at a state length divisible by 7 are refused deferral (as a GPU refuses one that
/// crosses into a new KV page).
struct HashBackend {
    ahead: bool,
    queued: VecDeque<Queued>,
    counts: Arc<Counts>,
}

fn apply(toks: &Toks, tokens: &[u32], n_ctx: usize) -> Result<Vec<f32>, Error> {
    let mut t = toks.lock().unwrap();
    if t.len() + tokens.len() > n_ctx {
        return Err(Error::Backend(format!("context full: {} + {} > {n_ctx}", t.len(), tokens.len())));
    }
    t.extend_from_slice(tokens);
    Ok(row_of(&t))
}

impl Backend for HashBackend {
    type State = HashState;
    type Snapshot = HashSnap;
    fn n_vocab(&self) -> usize {
        N_VOCAB
    }
    fn configure(&mut self, _slots: usize, _n_ctx: usize, _cache_bytes: usize) -> Result<(), Error> {
        Ok(())
    }
    fn new_state(&mut self, n_ctx: usize) -> Result<HashState, Error> {
        Ok(HashState { toks: Arc::default(), n_ctx })
    }
    fn forward(&mut self, items: &mut [Step<'_, HashState>]) -> Result<Vec<Option<Vec<f32>>>, Error> {
        assert!(self.queued.is_empty(), "a normal step while steps are queued");
        items
            .iter_mut()
            .map(|it| {
                let row = apply(&it.state.toks, it.tokens, it.state.n_ctx)?;
                Ok((it.logits != Logits::None).then_some(row))
            })
            .collect()
    }
    fn prefers_top(&self) -> bool {
        true
    }
    fn runs_ahead(&self) -> bool {
        self.ahead
    }
    fn submit(&mut self, items: &mut [Step<'_, HashState>], top: &[(usize, Vec<u32>)], deferred: bool) -> Result<bool, Error> {
        assert!(self.queued.len() < 2, "at most two steps queued");
        assert!(!matches!(self.queued.back(), Some(Queued::Waiting(_))), "a step queued behind one waiting for tokens");
        if !deferred {
            let rows = items
                .iter_mut()
                .zip(top)
                .map(|(it, (k, extra))| Ok(top_of_row(&apply(&it.state.toks, it.tokens, it.state.n_ctx)?, *k, extra)))
                .collect::<Result<Vec<_>, Error>>()?;
            self.queued.push_back(Queued::Rows(rows));
            return Ok(true);
        }
        if items.iter().any(|it| it.state.toks.lock().unwrap().len().is_multiple_of(7)) {
            self.counts.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(false);
        }
        for it in items.iter() {
            assert!(it.state.toks.lock().unwrap().len() < it.state.n_ctx, "a step queued ahead past the context");
        }
        self.counts.deferred.fetch_add(1, Ordering::Relaxed);
        self.queued.push_back(Queued::Waiting(items.iter().map(|it| it.state.toks.clone()).zip(top.iter().cloned()).collect()));
        Ok(true)
    }
    fn feed(&mut self, tokens: &[u32]) -> Result<(), Error> {
        let Some(Queued::Waiting(w)) = self.queued.pop_back() else { panic!("fed without a step waiting") };
        assert_eq!(w.len(), tokens.len());
        self.counts.fed_rows.fetch_add(tokens.len(), Ordering::Relaxed);
        let rows = w
            .into_iter()
            .zip(tokens)
            .map(|((toks, (k, extra)), &t)| {
                assert!((t as usize) < N_VOCAB);
                let mut v = toks.lock().unwrap();
                v.push(t);
                top_of_row(&row_of(&v), k, &extra)
            })
            .collect();
        self.queued.push_back(Queued::Rows(rows));
        Ok(())
    }
    fn collect(&mut self) -> Result<Vec<TopRow>, Error> {
        match self.queued.pop_front() {
            Some(Queued::Rows(rows)) => Ok(rows),
            Some(Queued::Waiting(_)) => panic!("collected a step that waits for its tokens (a device would wait forever)"),
            None => panic!("collected with nothing queued"),
        }
    }
    fn abandon(&mut self) {
        self.queued.clear();
    }
    fn snapshot(&mut self, state: &HashState) -> Result<HashSnap, Error> {
        assert!(!matches!(self.queued.back(), Some(Queued::Waiting(_))), "a snapshot while a step waits for its tokens");
        Ok(HashSnap(state.toks.lock().unwrap().clone()))
    }
    fn restore(&mut self, snap: &HashSnap, n_ctx: usize) -> Result<HashState, Error> {
        Ok(HashState { toks: Arc::new(Mutex::new(snap.0.clone())), n_ctx })
    }
    fn kv_pages(&mut self) -> Option<(usize, usize)> {
        None
    }
    fn pages_for(&self, _from: usize, _to: usize) -> usize {
        0
    }
}

struct TestSink {
    tx: mpsc::Sender<Event>,
    closed: Arc<AtomicBool>,
    /// Closes itself after this many tokens (a client that leaves mid-stream).
    leave_after: Option<usize>,
    sent: usize,
}

impl EventSink for TestSink {
    fn send(&mut self, ev: Event) -> bool {
        if matches!(ev, Event::Token { .. }) {
            self.sent += 1;
            if self.leave_after.is_some_and(|n| self.sent > n) {
                self.closed.store(true, Ordering::SeqCst);
            }
        }
        !self.closed.load(Ordering::SeqCst) && self.tx.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

fn req(prompt: Vec<u32>, max_tokens: usize, seed: u64, temperature: f32) -> GenRequest {
    GenRequest {
        prompt,
        sampler: SamplerConfig { seed: Some(seed), temperature, ..Default::default() },
        max_tokens,
        eog: vec![EOG],
        ignore_eos: false,
        n_logprobs: None,
        checkpoints: vec![],
    }
}

/// What a request got: (n_cached, tokens, finish), or what it got before its client left.
type Outcome = (usize, Vec<u32>, Option<Event>);

fn outcome(rx: &mpsc::Receiver<Event>) -> Outcome {
    let (mut cached, mut ids) = (0, Vec::new());
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Event::Started { n_cached, .. }) => cached = n_cached,
            Ok(Event::Token { id, .. }) => ids.push(id),
            Ok(ev) => return (cached, ids, Some(ev)),
            // A client that left gets nothing more: the sender is dropped with its sequence.
            Err(mpsc::RecvTimeoutError::Disconnected) => return (cached, ids, None),
            Err(e) => panic!("no event: {e}"),
        }
    }
}

/// Runs `reqs` (all queued at once, with the clients leaving as `leave` says), then the
/// follow-ups `follow(outcomes)` makes, on a fresh engine with the backend running ahead or not.
fn run(
    ahead: bool,
    n_parallel: usize,
    reqs: &[(GenRequest, Option<usize>)],
    follow: impl Fn(&[Outcome]) -> Vec<GenRequest>,
) -> (Vec<Outcome>, Vec<Outcome>, Arc<Counts>) {
    let counts = Arc::new(Counts::default());
    let backend = HashBackend { ahead, queued: VecDeque::new(), counts: counts.clone() };
    let cfg = EngineConfig { n_parallel, n_ctx: 96, cache_bytes: 1 << 20, checkpoint_every: 0, ..Default::default() };
    let (h, thread) = ember_engine::start(backend, cfg).unwrap();
    let submit = |r: &GenRequest, leave: Option<usize>| {
        let (tx, rx) = mpsc::channel();
        let sink = TestSink { tx, closed: Arc::new(AtomicBool::new(false)), leave_after: leave, sent: 0 };
        h.submit(r.clone(), Box::new(sink)).unwrap();
        rx
    };
    let rxs: Vec<_> = reqs.iter().map(|(r, leave)| submit(r, *leave)).collect();
    let first: Vec<Outcome> = rxs.iter().map(outcome).collect();
    let rxs: Vec<_> = follow(&first).iter().map(|r| submit(r, None)).collect();
    let second: Vec<Outcome> = rxs.iter().map(outcome).collect();
    drop(h);
    thread.join().unwrap();
    (first, second, counts)
}

fn finish_of(o: &Outcome) -> Option<FinishReason> {
    match &o.2 {
        Some(Event::Finished { reason, .. }) => Some(*reason),
        _ => None,
    }
}

/// Greedy and seeded sampling, several sequences at once and one at a time, ends of every
/// kind: the tokens and finish reasons are those of the normal path; every decode step after
/// the first ran ahead but for the refused ones; a sequence that ended on its end token had
/// that token in its state, and a follow-up prompt that continues the conversation restores
/// it from the checkpoint with it (more tokens cached than without running ahead) and gets
/// the same tokens.
#[test]
fn running_ahead_gives_the_normal_path_tokens_and_checkpoints() {
    let mut reqs: Vec<(GenRequest, Option<usize>)> = Vec::new();
    for i in 0..10u32 {
        let temp = if i % 3 == 0 { 0.0 } else { 0.9 };
        let mut r = req(vec![1 + i, 2, 3 + i % 4], 5 + 7 * i as usize % 40, u64::from(i), temp);
        if i == 4 {
            r.ignore_eos = true;
        }
        reqs.push((r, None));
    }
    // Penalties: its steps are never run ahead (their extra ids need the last token).
    let mut pen = req(vec![7, 7, 7], 20, 99, 0.8);
    pen.sampler.repeat_penalty = 1.3;
    reqs.push((pen, None));
    // A client that leaves after three tokens.
    reqs.push((req(vec![9, 8], 60, 5, 0.7), Some(3)));
    // The follow-ups: each finished request's conversation, its end token included, then more.
    let follow = |first: &[Outcome]| -> Vec<GenRequest> {
        reqs.iter()
            .zip(first)
            .filter(|(_, o)| finish_of(o).is_some())
            .map(|((r, _), o)| {
                let mut p = r.prompt.clone();
                p.extend(&o.1);
                p.extend([EOG, 4, 5]);
                req(p, 6, 1, 0.0)
            })
            .collect()
    };
    for n_parallel in [4, 1] {
        let (f0, s0, c0) = run(false, n_parallel, &reqs, follow);
        let (f1, s1, c1) = run(true, n_parallel, &reqs, follow);
        assert_eq!(c0.deferred.load(Ordering::Relaxed), 0);
        assert!(c1.deferred.load(Ordering::Relaxed) > 20, "steps ran ahead: {}", c1.deferred.load(Ordering::Relaxed));
        assert!(c1.refused.load(Ordering::Relaxed) > 0, "the backend refused some");
        let toks = |v: &[Outcome]| v.iter().map(|o| (o.1.clone(), finish_of(o))).collect::<Vec<_>>();
        assert_eq!(toks(&f0), toks(&f1), "n_parallel {n_parallel}: first requests");
        assert_eq!(toks(&s0), toks(&s1), "n_parallel {n_parallel}: follow-ups");
        // The client that left saw its three tokens and no finish.
        assert_eq!(f1.last().unwrap().1.len(), 3);
        assert!(f1.last().unwrap().2.is_none());
        // Some request ended on its end token; its follow-up restored more with running ahead
        // (the end token in the checkpoint), never less.
        let eog_ended = f1.iter().filter(|o| finish_of(o) == Some(FinishReason::Eog)).count();
        assert!(eog_ended > 0, "no request ended on its end token: the test needs one");
        let mut more = 0;
        for (a, b) in s0.iter().zip(&s1) {
            assert!(b.0 >= a.0, "cached {} with running ahead, {} without", b.0, a.0);
            more += usize::from(b.0 > a.0);
        }
        assert!(more > 0, "no follow-up restored its end token");
    }
}
