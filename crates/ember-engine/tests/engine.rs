//! The engine thread: scheduling, finish reasons, queue limits and cancellation on a scripted
//! backend; seeded reproducibility under batching on the tiny fixture model.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use ember_engine::{EngineConfig, Error, Event, EventSink, FinishReason, GenRequest, ModelBackend, SamplerConfig, ScriptBackend};

/// A sink over a std channel; `closed` simulates a client that left.
struct TestSink {
    tx: mpsc::Sender<Event>,
    closed: Arc<AtomicBool>,
}

impl EventSink for TestSink {
    fn send(&mut self, ev: Event) -> bool {
        !self.closed.load(Ordering::SeqCst) && self.tx.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

fn sink() -> (Box<TestSink>, mpsc::Receiver<Event>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    (Box::new(TestSink { tx, closed: closed.clone() }), rx, closed)
}

fn req(prompt: Vec<u32>, max_tokens: usize, seed: u64) -> GenRequest {
    GenRequest {
        prompt,
        sampler: SamplerConfig { seed: Some(seed), temperature: 1.0, ..Default::default() },
        max_tokens,
        eog: vec![99],
        ignore_eos: false,
        n_logprobs: None,
        checkpoints: vec![],
    }
}

/// All events of one request, until it finishes.
fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, Event) {
    let mut ids = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).expect("engine event") {
            Event::Started { .. } => {}
            Event::Token { id, .. } => ids.push(id),
            ev => return (ids, ev),
        }
    }
}

fn script(tokens: &[u32]) -> ScriptBackend {
    ScriptBackend::new(100, tokens.to_vec(), 99)
}

#[test]
fn finish_reasons() {
    let cfg = EngineConfig { n_parallel: 2, n_queue: 8, n_ctx: 16, n_batch: 4, ..Default::default() };
    let (h, _t) = ember_engine::start(script(&[5, 6, 7]), cfg).unwrap();
    // EOG after the script: Eog, the EOG token counted but not sent.
    let (s, rx, _) = sink();
    h.submit(req(vec![1; 10], 100, 1), s).unwrap();
    let (ids, end) = collect(&rx);
    assert_eq!(ids, [5, 6, 7]);
    assert_eq!(end, Event::Finished { reason: FinishReason::Eog, n_prompt: 10, n_generated: 4 });
    // ignore_eos: the EOG token is never sampled, max_tokens ends the request.
    let (s, rx, _) = sink();
    h.submit(GenRequest { ignore_eos: true, ..req(vec![1; 4], 9, 1) }, s).unwrap();
    let (ids, end) = collect(&rx);
    assert_eq!(ids[..3], [5, 6, 7]);
    assert!(ids.len() == 9 && !ids.contains(&99), "{ids:?}");
    assert_eq!(end, Event::Finished { reason: FinishReason::MaxTokens, n_prompt: 4, n_generated: 9 });
    // max_tokens.
    let (s, rx, _) = sink();
    h.submit(req(vec![1; 3], 2, 1), s).unwrap();
    let (ids, end) = collect(&rx);
    assert_eq!(ids, [5, 6]);
    assert_eq!(end, Event::Finished { reason: FinishReason::MaxTokens, n_prompt: 3, n_generated: 2 });
    // Context end: 14 prompt tokens + 2 generated = 16.
    let (s, rx, _) = sink();
    h.submit(req(vec![1; 14], 100, 1), s).unwrap();
    let (ids, end) = collect(&rx);
    assert_eq!(ids, [5, 6]);
    assert_eq!(end, Event::Finished { reason: FinishReason::ContextFull, n_prompt: 14, n_generated: 2 });
    // Refused at submit.
    let (s, _rx, _) = sink();
    assert!(matches!(h.submit(req(vec![1; 16], 1, 1), s), Err(Error::PromptTooLong { n_prompt: 16, n_ctx: 16 })));
    let (s, _rx, _) = sink();
    assert!(matches!(h.submit(req(vec![100], 1, 1), s), Err(Error::TokenOutOfRange { id: 100, .. })));
}

#[test]
fn full_queue_is_refused_and_closed_sinks_free_their_slot() {
    // An endless script: sequences run until cancelled.
    let cfg = EngineConfig { n_parallel: 1, n_queue: 1, n_ctx: 1 << 20, n_batch: 8, ..Default::default() };
    let (h, _t) = ember_engine::start(script(&[7; 1 << 16]), cfg).unwrap();
    let (s1, rx1, closed1) = sink();
    h.submit(req(vec![1], usize::MAX, 1), s1).unwrap();
    assert!(matches!(rx1.recv().unwrap(), Event::Started { .. }));
    let (s2, rx2, _) = sink();
    h.submit(req(vec![1], 3, 1), s2).unwrap();
    let (s3, _rx3, _) = sink();
    assert!(matches!(h.submit(req(vec![1], 3, 1), s3), Err(Error::QueueFull { n_queue: 1 })));
    assert_eq!(h.stats().n_waiting.load(Ordering::SeqCst), 1);
    // The first client leaves: the waiting request gets the slot and completes.
    closed1.store(true, Ordering::SeqCst);
    let (ids, end) = collect(&rx2);
    assert_eq!(ids, [7, 7, 7]);
    assert!(matches!(end, Event::Finished { reason: FinishReason::MaxTokens, .. }));
    assert_eq!(h.stats().n_cancelled.load(Ordering::SeqCst), 1);
}

/// A burst that meets idle slots fills them and the queue whatever the engine thread has taken
/// so far: n_parallel + n_queue are admitted, the rest refused (a request counted only while it
/// waited would let a burst in only n_queue deep: the CI flake of serve_load's overload test).
#[test]
fn a_burst_fills_the_free_slots_and_the_queue() {
    for _ in 0..20 {
        let cfg = EngineConfig { n_parallel: 2, n_queue: 1, n_ctx: 1 << 20, n_batch: 8, ..Default::default() };
        let (h, _t) = ember_engine::start(script(&[7; 1 << 16]), cfg).unwrap();
        let mut kept = Vec::new();
        let mut refused = 0;
        for _ in 0..6 {
            let (s, rx, closed) = sink();
            match h.submit(req(vec![1], usize::MAX, 1), s) {
                Ok(()) => kept.push((rx, closed)),
                Err(Error::QueueFull { n_queue: 1 }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!((kept.len(), refused), (3, 3), "2 slots + 1 waiting admitted, the rest refused");
        for (_, closed) in &kept {
            closed.store(true, Ordering::SeqCst);
        }
    }
}

/// A client that leaves between its last token and the finish: every token is taken, the
/// finish is refused.
struct LeavesBeforeFinish(mpsc::Sender<Event>);

impl EventSink for LeavesBeforeFinish {
    fn send(&mut self, ev: Event) -> bool {
        !matches!(ev, Event::Finished { .. }) && self.0.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// A finish that cannot be delivered counts the sequence as cancelled, so every request is
/// accounted for once (the server counts the finishes its clients receive).
#[test]
fn an_undelivered_finish_counts_as_cancelled() {
    let cfg = EngineConfig { n_parallel: 1, n_queue: 1, n_ctx: 64, n_batch: 8, ..Default::default() };
    let (h, _t) = ember_engine::start(script(&[5, 6]), cfg).unwrap();
    let (tx, rx) = mpsc::channel();
    h.submit(req(vec![1; 3], 2, 1), Box::new(LeavesBeforeFinish(tx))).unwrap();
    let ids: Vec<u32> = (0..3)
        .filter_map(|_| match rx.recv_timeout(Duration::from_secs(60)).expect("engine event") {
            Event::Token { id, .. } => Some(id),
            _ => None,
        })
        .collect();
    assert_eq!(ids, [5, 6]);
    let t0 = std::time::Instant::now();
    while h.stats().n_cancelled.load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the refused finish was not counted");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(h.stats().n_cancelled.load(Ordering::SeqCst), 1);
}

#[test]
fn seeded_tokens_do_not_depend_on_batching() {
    let file = Arc::new(ember_gguf::GgufFile::open(ember_testkit::fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap());
    let model = ember_model::Model::load(file, |_, _| {}).unwrap();
    // Bit-identical results whatever the batch are what the batch-invariant precision promises
    // (the default one runs prompt-sized batches through kernels with another summation order).
    let ops = ember_cpu::backend(ember_cpu::Precision::BatchInvariant, 1);
    let cfg = EngineConfig { n_parallel: 4, n_queue: 16, n_ctx: 256, n_batch: 7, ..Default::default() };
    let (h, _t) = ember_engine::start(ModelBackend::new(model, ops, ember_ops::KvType::F16).unwrap(), cfg).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|i| (0..10 + 3 * i).map(|j| (j * 37 + i * 11) % 600).collect()).collect();
    let run = |i: usize| {
        let (s, rx, _) = sink();
        let mut r = req(prompts[i].clone(), 20, i as u64);
        r.eog = Vec::new();
        r.n_logprobs = Some(2);
        h.submit(r, s).unwrap();
        rx
    };
    // Alone, one at a time.
    let alone: Vec<_> = (0..4).map(|i| collect(&run(i)).0).collect();
    // All four at once: prompts (in chunks of 7) and decodes share forward passes.
    let rxs: Vec<_> = (0..4).map(run).collect();
    let batched: Vec<_> = rxs.iter().map(|rx| collect(rx).0).collect();
    assert_eq!(alone, batched);
}

/// Rows' best entries instead of whole rows (what a GPU backend asks for: `prefers_top`) give the
/// same tokens as whole rows, request for request, batched: greedy, the default chain (top-k 40,
/// top-p, min-p), penalties with a small and a large top-k, end-of-generation ids masked
/// (`ignore_eos`), and a request with logprobs (which takes whole rows) beside them.
#[test]
fn rows_best_entries_give_the_whole_rows_tokens() {
    let file = Arc::new(ember_gguf::GgufFile::open(ember_testkit::fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap());
    let configs = [
        SamplerConfig { temperature: 0.0, ..Default::default() },
        SamplerConfig { seed: Some(3), ..Default::default() },
        SamplerConfig {
            seed: Some(4),
            temperature: 1.5,
            top_k: 5,
            repeat_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: -0.2,
            ..Default::default()
        },
        SamplerConfig {
            seed: Some(5),
            temperature: 0.9,
            top_k: 300,
            top_p: 0.9,
            repeat_penalty: 0.8,
            penalty_last_n: 16,
            ..Default::default()
        },
        SamplerConfig { seed: Some(6), temperature: 1.0, top_k: 2, ..Default::default() },
    ];
    let run = |top: bool| -> Vec<Vec<u32>> {
        let model = ember_model::Model::load(file.clone(), |_, _| {}).unwrap();
        let ops = ember_cpu::backend(ember_cpu::Precision::BatchInvariant, 1);
        let mut b = ModelBackend::new(model, ops, ember_ops::KvType::F16).unwrap();
        b.set_top_reads(top);
        let cfg = EngineConfig { n_parallel: 6, n_queue: 16, n_ctx: 256, n_batch: 16, ..Default::default() };
        let (h, _t) = ember_engine::start(b, cfg).unwrap();
        let rxs: Vec<_> = (0..6usize)
            .map(|i| {
                let (s, rx, _) = sink();
                let mut r = req((0..12 + i as u32).map(|j| (j * 53 + i as u32 * 7) % 600).collect(), 24, 0);
                r.sampler = configs[i % configs.len()].clone();
                // The greedy request runs with its end-of-generation ids masked, the last one with
                // logprobs.
                r.eog = vec![5, 17];
                r.ignore_eos = i == 0 || i == 2;
                r.n_logprobs = (i == 5).then_some(3);
                h.submit(r, s).unwrap();
                rx
            })
            .collect();
        rxs.iter().map(|rx| collect(rx).0).collect()
    };
    let (whole, best) = (run(false), run(true));
    assert!(whole.iter().all(|t| !t.is_empty()), "{whole:?}");
    assert_eq!(best, whole);
}

/// A scripted backend that records the tokens of every item of every step, and rejects (before
/// running anything) any item containing token 42, as the model does for a bad sequence. With
/// `late_hook` its `forward_top` runs the engine's delivery hook after its work, as a GPU step
/// does (the default runs it first).
struct Recording {
    inner: ScriptBackend,
    steps: Arc<std::sync::Mutex<Vec<Vec<usize>>>>,
    late_hook: bool,
}

impl ember_engine::Backend for Recording {
    type State = <ScriptBackend as ember_engine::Backend>::State;
    type Snapshot = <ScriptBackend as ember_engine::Backend>::Snapshot;
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }
    fn configure(&mut self, slots: usize, n_ctx: usize, cache_bytes: usize) -> Result<(), Error> {
        self.inner.configure(slots, n_ctx, cache_bytes)
    }
    fn new_state(&mut self, n_ctx: usize) -> Result<Self::State, Error> {
        self.inner.new_state(n_ctx)
    }
    fn kv_pages(&mut self) -> Option<(usize, usize)> {
        self.inner.kv_pages()
    }
    fn pages_for(&self, from: usize, to: usize) -> usize {
        self.inner.pages_for(from, to)
    }
    fn forward(&mut self, items: &mut [ember_engine::Step<'_, Self::State>]) -> Result<Vec<Option<Vec<f32>>>, Error> {
        if let Some(index) = items.iter().position(|it| it.tokens.contains(&42)) {
            return Err(Error::Sequence { index, msg: "token 42 is not allowed here".into() });
        }
        self.steps.lock().unwrap().push(items.iter().map(|it| it.tokens.len()).collect());
        self.inner.forward(items)
    }
    fn snapshot(&mut self, state: &Self::State) -> Result<Self::Snapshot, Error> {
        self.inner.snapshot(state)
    }
    fn restore(&mut self, snap: &Self::Snapshot, n_ctx: usize) -> Result<Self::State, Error> {
        self.inner.restore(snap, n_ctx)
    }
    fn forward_top(
        &mut self,
        items: &mut [ember_engine::Step<'_, Self::State>],
        top: &[Option<(usize, Vec<u32>)>],
        before_wait: &mut dyn FnMut(),
    ) -> Result<Vec<Option<ember_engine::Row>>, Error> {
        if !self.late_hook {
            before_wait();
        }
        let rows = self.forward(items)?;
        if self.late_hook {
            before_wait();
        }
        Ok(rows
            .into_iter()
            .zip(top.iter().chain(std::iter::repeat(&None)))
            .map(|(r, t)| {
                r.map(|r| match t {
                    Some((k, extra)) => ember_engine::Row::Top(ember_ops::top::top_of_row(&r, *k, extra)),
                    None => ember_engine::Row::Full(r),
                })
            })
            .collect())
    }
}

/// The engine hands a token that goes on to its client while the next step runs (late hook):
/// every token still arrives, in order, before the finish; a sequence the backend rejects when
/// it feeds a token gets that token, then its failure; a client that leaves frees its slot; the
/// same with the hook first.
#[test]
fn tokens_handed_over_during_the_next_step_all_arrive_in_order() {
    for late_hook in [true, false] {
        let steps = Arc::new(std::sync::Mutex::new(Vec::new()));
        let backend = Recording { inner: script(&[5, 6, 42, 8, 9]), steps: steps.clone(), late_hook };
        let cfg = EngineConfig { n_parallel: 2, n_queue: 8, n_ctx: 256, n_batch: 64, ..Default::default() };
        let (h, _t) = ember_engine::start(backend, cfg).unwrap();
        // Three tokens then the end: 5, 6 go on, 42 is the last (max_tokens 3).
        let (s, rx, _) = sink();
        h.submit(req(vec![1, 2], 3, 1), s).unwrap();
        let (ids, end) = collect(&rx);
        assert_eq!(ids, [5, 6, 42], "late_hook {late_hook}");
        assert_eq!(end, Event::Finished { reason: FinishReason::MaxTokens, n_prompt: 2, n_generated: 3 });
        // Fed 42 on the next step, the sequence is rejected: 5, 6, 42 arrive, then the failure.
        let (s, rx, _) = sink();
        h.submit(req(vec![1, 2], 10, 1), s).unwrap();
        let (ids, end) = collect(&rx);
        assert_eq!(ids, [5, 6, 42], "late_hook {late_hook}");
        assert!(matches!(&end, Event::Failed(m) if m.contains("token 42")), "{end:?}");
        // A client that leaves mid-generation frees its slot for the next request.
        let (s, rx, closed) = sink();
        let mut r = req(vec![1, 2], 1000, 1);
        r.eog = Vec::new();
        h.submit(r, s).unwrap();
        assert!(matches!(rx.recv().unwrap(), Event::Started { .. }));
        assert!(matches!(rx.recv().unwrap(), Event::Token { id: 5, .. }));
        closed.store(true, Ordering::SeqCst);
        let (s, rx, _) = sink();
        h.submit(req(vec![3], 2, 1), s).unwrap();
        assert_eq!(collect(&rx).0, [5, 6], "late_hook {late_hook}");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while h.stats().n_active.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(h.stats().n_active.load(Ordering::SeqCst), 0, "late_hook {late_hook}: the left client's slot was freed");
    }
}

/// Issue 14: a step holds at most `n_batch` tokens over all sequences; decoders get their token
/// every step while a long prompt is fed in chunks beside them; and a sequence the model
/// rejects fails alone while the others run on.
#[test]
fn r14_token_budget_and_failing_alone() {
    let steps = Arc::new(std::sync::Mutex::new(Vec::new()));
    let backend = Recording { inner: script(&[7; 1 << 16]), steps: steps.clone(), late_hook: true };
    let cfg = EngineConfig { n_parallel: 3, n_queue: 8, n_ctx: 1 << 20, n_batch: 8, ..Default::default() };
    let (h, _t) = ember_engine::start(backend, cfg).unwrap();
    // An endless decoder first, then a 100-token prompt and a bad one.
    let (s1, rx1, closed1) = sink();
    h.submit(req(vec![1; 2], usize::MAX, 1), s1).unwrap();
    assert!(matches!(rx1.recv().unwrap(), Event::Started { .. }));
    assert!(matches!(rx1.recv().unwrap(), Event::Token { .. }));
    let (s2, rx2, _) = sink();
    h.submit(req(vec![1; 100], 3, 1), s2).unwrap();
    let (s3, rx3, _) = sink();
    h.submit(req(vec![1, 42, 1], 3, 1), s3).unwrap();
    let (_, end3) = collect(&rx3);
    assert!(matches!(&end3, Event::Failed(m) if m.contains("token 42")), "{end3:?}");
    let (ids2, end2) = collect(&rx2);
    assert_eq!((ids2.len(), end2.clone()), (3, Event::Finished { reason: FinishReason::MaxTokens, n_prompt: 100, n_generated: 3 }));
    closed1.store(true, Ordering::SeqCst);
    let steps = steps.lock().unwrap().clone();
    assert!(rx1.try_iter().all(|e| !matches!(e, Event::Failed(_))), "the decoder failed");
    assert!(steps.iter().all(|s| s.iter().sum::<usize>() <= 8), "a step over the budget: {steps:?}");
    // While the long prompt was fed (steps with an item of more than one token), the decoder
    // was in every step.
    let prompt_steps: Vec<&Vec<usize>> = steps.iter().filter(|s| s.iter().any(|&n| n > 1)).collect();
    assert!(prompt_steps.len() >= 100 / 8, "the prompt came in chunks: {prompt_steps:?}");
    assert!(prompt_steps.iter().skip(1).all(|s| s.contains(&1)), "the decoder waited: {steps:?}");
}

/// The tiny model's backend with its KV page pool sized for 64 tokens per slot instead of the
/// whole context, so that requests compete for pages.
struct SmallPool(ModelBackend<ember_cpu::CpuBackend>);

impl ember_engine::Backend for SmallPool {
    type State = <ModelBackend<ember_cpu::CpuBackend> as ember_engine::Backend>::State;
    type Snapshot = <ModelBackend<ember_cpu::CpuBackend> as ember_engine::Backend>::Snapshot;
    fn n_vocab(&self) -> usize {
        self.0.n_vocab()
    }
    fn configure(&mut self, slots: usize, _n_ctx: usize, _cache_bytes: usize) -> Result<(), Error> {
        self.0.configure(slots, 64, 0)
    }
    fn new_state(&mut self, n_ctx: usize) -> Result<Self::State, Error> {
        self.0.new_state(n_ctx)
    }
    fn forward(&mut self, items: &mut [ember_engine::Step<'_, Self::State>]) -> Result<Vec<Option<Vec<f32>>>, Error> {
        self.0.forward(items)
    }
    fn snapshot(&mut self, state: &Self::State) -> Result<Self::Snapshot, Error> {
        self.0.snapshot(state)
    }
    fn restore(&mut self, snap: &Self::Snapshot, n_ctx: usize) -> Result<Self::State, Error> {
        self.0.restore(snap, n_ctx)
    }
    fn kv_pages(&mut self) -> Option<(usize, usize)> {
        self.0.kv_pages()
    }
    fn pages_for(&self, from: usize, to: usize) -> usize {
        self.0.pages_for(from, to)
    }
}

/// A sink that also writes every event's kind into a log shared by several requests, in the
/// order the engine sends them.
struct LogSink {
    name: char,
    log: Arc<std::sync::Mutex<Vec<(char, &'static str)>>>,
    tx: mpsc::Sender<Event>,
}

impl EventSink for LogSink {
    fn send(&mut self, ev: Event) -> bool {
        let kind = match &ev {
            Event::Started { .. } => "started",
            Event::Token { .. } => "token",
            Event::Finished { .. } => "finished",
            _ => "other",
        };
        if kind != "token" {
            self.log.lock().unwrap().push((self.name, kind));
        }
        self.tx.send(ev).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Issue 14: admission by free KV pages. Each request reserves the pages its prompt plus
/// `max_tokens` may take; one that does not fit beside the running ones waits (with a slot
/// free) and starts when they end; one that cannot fit even alone fails at once with a clear
/// error; every page is back at the end.
#[test]
fn r14_admission_by_free_kv_pages() {
    use ember_engine::Backend;
    let file = Arc::new(ember_gguf::GgufFile::open(ember_testkit::fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap());
    let model = ember_model::Model::load(file, |_, _| {}).unwrap();
    let mut backend =
        SmallPool(ModelBackend::new(model, ember_cpu::backend(ember_cpu::Precision::Fast, 1), ember_ops::KvType::F16).unwrap());
    // Three slots of 64 tokens: per K/V cache 1 page each plus 1 copy-on-write page each.
    backend.configure(3, 0, 0).unwrap();
    let (_, total) = backend.kv_pages().unwrap();
    let step = backend.pages_for(0, 1); // one page per K/V cache
    assert_eq!(total, 6 * step, "pool of 3 slots x (1 page + 1 copy page) per cache");
    let cfg = EngineConfig { n_parallel: 3, n_queue: 8, n_ctx: 1024, n_batch: 64, ..Default::default() };
    let (h, _t) = ember_engine::start(backend, cfg).unwrap();
    let stats = h.stats().clone();
    assert_eq!(stats.kv_pages_total.load(Ordering::SeqCst), total);
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let submit = |name: char, max_tokens: usize| {
        let (tx, rx) = mpsc::channel();
        let mut r = req(vec![7, 8, 9, 10, 11], max_tokens, name as u64);
        r.eog.clear();
        h.submit(r, Box::new(LogSink { name, log: log.clone(), tx })).unwrap();
        rx
    };

    // X: 5 + 400 tokens need 7 pages per cache, more than the pool: it fails alone, at once.
    match submit('X', 400).recv_timeout(Duration::from_secs(60)).expect("engine event") {
        Event::Failed(msg) => assert!(msg.contains("KV pages"), "{msg}"),
        ev => panic!("expected a failure, got {ev:?}"),
    }
    // A: 5 + 300 = 5 pages per cache; C: 5 + 20 = 1, fits beside A; B: 5 + 150 = 3, does not
    // fit beside A (8 > 6) though a slot is free: it starts only after A has finished.
    let (ra, rc, rb) = (submit('A', 300), submit('C', 20), submit('B', 150));
    for (rx, n) in [(&rc, 20), (&ra, 300), (&rb, 150)] {
        let (ids, end) = collect(rx);
        assert_eq!(ids.len(), n, "{end:?}");
        assert!(matches!(end, Event::Finished { reason: FinishReason::MaxTokens, .. }), "{end:?}");
    }
    let log = log.lock().unwrap().clone();
    let at = |e: (char, &'static str)| log.iter().position(|x| *x == e).unwrap_or_else(|| panic!("{e:?} not in {log:?}"));
    assert!(at(('C', "started")) < at(('A', "finished")), "C ran beside A: {log:?}");
    assert!(at(('B', "started")) > at(('A', "finished")), "B must wait for A's pages: {log:?}");
    // Every page comes back once the engine is idle.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while stats.kv_pages_free.load(Ordering::SeqCst) != total && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(stats.kv_pages_free.load(Ordering::SeqCst), total, "pages held after every request ended");
}

/// The start-up warm-up (`EngineConfig::warm_up`) runs one prompt of at most `n_batch` tokens
/// on a scratch sequence before `start` returns, and leaves nothing behind: on the tiny model
/// the same seeded requests give the same tokens with and without it.
#[test]
fn warm_up_runs_one_batch_first_and_changes_nothing() {
    let steps = Arc::new(std::sync::Mutex::new(Vec::new()));
    let cfg = EngineConfig { n_parallel: 1, n_queue: 4, n_ctx: 64, n_batch: 6, warm_up: 40, ..Default::default() };
    let (_h, _t) = ember_engine::start(Recording { inner: script(&[1, 2, 3]), steps: steps.clone(), late_hook: true }, cfg).unwrap();
    assert_eq!(*steps.lock().unwrap(), vec![vec![6]], "one item of n_batch tokens, before any request");

    let file = Arc::new(ember_gguf::GgufFile::open(ember_testkit::fixture("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap());
    let tokens = |warm_up: usize| {
        let model = ember_model::Model::load(file.clone(), |_, _| {}).unwrap();
        let ops = ember_cpu::backend(ember_cpu::Precision::BatchInvariant, 1);
        let cfg = EngineConfig { n_parallel: 2, n_queue: 4, n_ctx: 128, n_batch: 16, warm_up, ..Default::default() };
        let (h, _t) = ember_engine::start(ModelBackend::new(model, ops, ember_ops::KvType::F16).unwrap(), cfg).unwrap();
        (0..2u32)
            .map(|i| {
                let (s, rx, _) = sink();
                let mut r = req((0..12 + i).map(|j| (j * 29 + i * 7) % 600).collect(), 12, i as u64);
                r.eog = Vec::new();
                h.submit(r, s).unwrap();
                collect(&rx).0
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(tokens(16), tokens(0));
}
