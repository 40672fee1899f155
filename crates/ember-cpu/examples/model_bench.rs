//! End-to-end CPU throughput on a synthetic model, llama-bench style: `pp<N>` (one prompt batch
//! of N tokens) and `tg<N>` (N single-token steps), optionally after a prompt of `depth` tokens.
//! Writes the model with ember-synth first if the file does not exist.
//!
//! `cargo run --release -p ember-cpu --example model_bench -- FILE [preset quant] [pp] [tg] [depth] [threads]`
//! (`EMBER_KV=q8_0` for a q8_0 KV cache; f16 by default).

use std::sync::Arc;
use std::time::Instant;

use ember_cpu::{CpuOps, Precision};
use ember_gguf::GgufFile;
use ember_model::{Forward, Logits, Model};
use ember_ops::{
    AttnHeads, AttnMats, AttnPrep, DeltaHeads, DeltaMats, DeltaMode, DeltaPrep, DeviceId, Gate, HostBackend, HostKernels, KvCache, KvType,
    LayerIdx, Mat, OpResult, Ops, PagePool, RouteTable, SeqSpan, WeightId, WeightSet,
};

/// Wraps the backend and adds up the time of each op (`EMBER_PROFILE=1`).
struct Timed {
    inner: CpuOps,
    weights: Option<Arc<WeightSet>>,
    times: std::sync::Mutex<std::collections::BTreeMap<String, (f64, usize)>>,
}

impl Timed {
    fn time<T>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        let dt = t.elapsed().as_secs_f64();
        let mut m = self.times.lock().unwrap();
        let e = m.entry(name()).or_default();
        e.0 += dt;
        e.1 += 1;
        r
    }

    fn report(&self, steps: usize) {
        let m = self.times.lock().unwrap();
        let total: f64 = m.values().map(|v| v.0).sum();
        let mut v: Vec<_> = m.iter().collect();
        v.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        println!("ops total {:.2} ms per step", total * 1e3 / steps as f64);
        for (k, (t, n)) in v.iter().take(25) {
            println!("  {k:50} {:8.3} ms/step {:6} calls/step {:8.1} us/call", t * 1e3 / steps as f64, n / steps, t * 1e6 / *n as f64);
        }
    }
}

impl Timed {
    /// "Q4_K 512x2048" for a registered weight.
    fn desc(&self, w: WeightId) -> String {
        self.weights.as_ref().and_then(|s| s.info(w)).map_or_else(|| format!("w{}", w.0), |i| format!("{} {}x{}", i.ty, i.n_rows, i.k))
    }
}

impl HostKernels for Timed {
    fn name(&self) -> &'static str {
        "timed"
    }
    fn device(&self) -> DeviceId {
        self.inner.device()
    }
    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.weights = Some(weights.clone());
        self.inner.register(weights)
    }
    fn matmul(&self, w: WeightId, x: &Mat) -> OpResult<Mat> {
        self.time(|| format!("matmul {} n={}", self.desc(w), x.n.min(2)), || self.inner.matmul(w, x))
    }
    fn matmul_many(&self, ws: &[WeightId], x: &Mat) -> OpResult<Vec<Mat>> {
        self.time(
            || format!("matmul_many {} [{}] n={}", ws.len(), ws.iter().map(|&w| self.desc(w)).collect::<Vec<_>>().join(", "), x.n.min(2)),
            || self.inner.matmul_many(ws, x),
        )
    }
    fn gate(&self, y: &mut Mat, g: &Mat, act: Gate) -> OpResult<()> {
        self.time(|| format!("gate {act:?}"), || self.inner.gate(y, g, act))
    }
    fn route(&self, logits: &Mat, k: usize) -> OpResult<RouteTable> {
        self.time(|| "route".into(), || self.inner.route(logits, k))
    }
    fn moe(&self, layer: LayerIdx, x: &Mat, routing: &RouteTable, shared_gate: &Mat) -> OpResult<Mat> {
        self.time(|| format!("moe n={}", x.n.min(2)), || self.inner.moe(layer, x, routing, shared_gate))
    }
    fn get_rows(&self, w: WeightId, ids: &[u32]) -> OpResult<Mat> {
        self.time(|| "get_rows".into(), || self.inner.get_rows(w, ids))
    }
    fn rms_norm(&self, x: &Mat, w: WeightId, eps: f32) -> OpResult<Mat> {
        self.time(|| "rms_norm".into(), || self.inner.rms_norm(x, w, eps))
    }
    fn add(&self, h: &mut Mat, x: &Mat) -> OpResult<()> {
        self.time(|| "add".into(), || self.inner.add(h, x))
    }
    fn attn_prep(&self, s: AttnPrep, qg: &Mat, k: &Mat, pos: &[u32]) -> OpResult<AttnMats> {
        self.time(|| "attn_prep".into(), || self.inner.attn_prep(s, qg, k, pos))
    }
    fn kv_append(&self, spans: &[SeqSpan], k: &Mat, v: &Mat, caches: &mut [KvCache<'_>], pool: &PagePool) -> OpResult<()> {
        self.time(|| "kv_append".into(), || self.inner.kv_append(spans, k, v, caches, pool))
    }
    fn attention(&self, h: AttnHeads, spans: &[SeqSpan], q: &Mat, caches: &[KvCache<'_>]) -> OpResult<Mat> {
        self.time(|| "attention".into(), || self.inner.attention(h, spans, q, caches))
    }
    fn conv1d_silu(&self, spans: &[SeqSpan], x: &Mat, w: WeightId, states: &mut [&mut [f32]]) -> OpResult<Mat> {
        self.time(|| "conv1d_silu".into(), || self.inner.conv1d_silu(spans, x, w, states))
    }
    fn delta_prep(&self, s: DeltaPrep, cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<DeltaMats> {
        self.time(|| "delta_prep".into(), || self.inner.delta_prep(s, cu, b, alpha))
    }
    fn gated_delta_rule(
        &self,
        h: DeltaHeads,
        spans: &[SeqSpan],
        x: &DeltaMats,
        states: &mut [&mut [f32]],
        mode: DeltaMode,
    ) -> OpResult<Mat> {
        self.time(|| "gated_delta_rule".into(), || self.inner.gated_delta_rule(h, spans, x, states, mode))
    }
    fn select_rows(&self, x: &Mat, rows: &[usize]) -> OpResult<Mat> {
        self.time(|| "select_rows".into(), || self.inner.select_rows(x, rows))
    }
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let path = a.first().cloned().unwrap_or_else(|| "/tmp/perf/small-q4_k_m.gguf".into());
    let preset = a.get(1).cloned().unwrap_or_else(|| "small".into());
    let quant = a.get(2).cloned().unwrap_or_else(|| "q4_k_m".into());
    let pp: usize = a.get(3).and_then(|s| s.parse().ok()).unwrap_or(512);
    let tg: usize = a.get(4).and_then(|s| s.parse().ok()).unwrap_or(128);
    let depth: usize = a.get(5).and_then(|s| s.parse().ok()).unwrap_or(0);
    let threads: usize = a.get(6).and_then(|s| s.parse().ok()).unwrap_or(0);
    if !std::path::Path::new(&path).exists() {
        let vocab = GgufFile::open(ember_synth::DEFAULT_VOCAB).unwrap();
        let shape = ember_synth::Shape::preset(&preset).unwrap();
        let recipe = ember_synth::Recipe::parse(&quant).unwrap();
        let plan = ember_synth::Plan::new(ember_synth::SynthOptions { shape, recipe, seed: 0, skew: 0.0, preset: preset.clone() }, &vocab)
            .unwrap();
        let t = Instant::now();
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        ember_synth::write(&plan, &mut out, &mut |_, _| {}).unwrap();
        eprintln!("wrote {path} in {:.1} s", t.elapsed().as_secs_f64());
    }
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let model = Model::load(file, |_, _| {}).unwrap();
    let mut ops = HostBackend::new(Timed { inner: CpuOps::new(Precision::Fast, threads), weights: None, times: Default::default() });
    ops.register(model.weights().clone()).unwrap();
    let profile = std::env::var("EMBER_PROFILE").is_ok();
    println!("{path}: {} threads, isa {:?}", ops.kernels().inner.n_threads(), ops.kernels().inner.isa());
    let n_vocab = model.config.n_vocab as u64;
    let mut seed = 12345u64;
    let mut tok = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) % n_vocab.min(150_000)) as u32
    };
    let ctx = depth + pp.max(1) + tg + 16;
    // The KV cache type: f16, or `EMBER_KV` (q8_0, f32).
    let kv = std::env::var("EMBER_KV").ok().and_then(|s| KvType::parse(&s)).unwrap_or(KvType::F16);
    model.configure_store(&mut ops, kv, 3, ctx, 0).unwrap();
    // Warm-up: one short prompt and a few steps (page in the weights).
    {
        let mut st = model.new_state(&mut ops, 64).unwrap();
        let p: Vec<u32> = (0..16).map(|_| tok()).collect();
        model.forward(&mut ops, &p, &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
        for _ in 0..4 {
            let t = tok();
            model.forward(&mut ops, &[t], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
        }
    }
    let mut st = model.new_state(&mut ops, ctx).unwrap();
    if depth > 0 {
        let t = Instant::now();
        for chunk in (0..depth).collect::<Vec<_>>().chunks(512) {
            let p: Vec<u32> = chunk.iter().map(|_| tok()).collect();
            model.forward(&mut ops, &p, &mut st, Forward { logits: Some(Logits::None), ..Default::default() }).unwrap();
        }
        println!("depth {depth}: filled in {:.1} s", t.elapsed().as_secs_f64());
    }
    if pp > 0 {
        let mut s2 = model.new_state(&mut ops, ctx).unwrap();
        let p: Vec<u32> = (0..pp).map(|_| tok()).collect();
        ops.kernels().times.lock().unwrap().clear();
        let t = Instant::now();
        model.forward(&mut ops, &p, &mut s2, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
        let dt = t.elapsed().as_secs_f64();
        println!("pp{pp}: {:.2} tok/s ({:.3} s)", pp as f64 / dt, dt);
        if profile {
            ops.kernels().report(1);
        }
    }
    if tg > 0 {
        ops.kernels().times.lock().unwrap().clear();
        let mut times = Vec::with_capacity(tg);
        for _ in 0..tg {
            let t0 = tok();
            let t = Instant::now();
            model.forward(&mut ops, &[t0], &mut st, Forward { logits: Some(Logits::Last), ..Default::default() }).unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
        let total: f64 = times.iter().sum();
        times.sort_by(f64::total_cmp);
        if profile {
            ops.kernels().report(tg);
        }
        println!(
            "tg{tg}{}: {:.2} tok/s (median step {:.2} ms, best {:.2} ms)",
            if depth > 0 { format!("@d{depth}") } else { String::new() },
            tg as f64 / total,
            times[tg / 2] * 1e3,
            times[0] * 1e3
        );
    }
}
