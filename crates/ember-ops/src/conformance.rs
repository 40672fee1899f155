//! The conformance suite: every op of a backend against [`HostOps`] (the reference) on random
//! inputs and random odd shapes (one token, a few, many; several sequences in one step), the
//! state store (slots carried across steps, snapshots that share pages, restore, a full page
//! pool), the arena contract (a repeated step gets the same handles), plus the errors every op
//! must return instead of panicking. A backend's test crate calls
//! [`run`] with its constructor and the tolerances it claims, stating next to them the errors
//! it measured (the [`Report`] prints them); [`run_with`] also takes bounds for single checks
//! (a backend whose kernel for one case quantises where the others do not).
//!
//! Error measures: `rel` is the largest `|got − ref|` over the largest `|ref|` of a result;
//! `nmse` is `Σ(got − ref)² / Σ ref²` (for ops whose backend may quantise activations).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use ember_gguf::{GgmlType, quant};

use crate::{
    AttnHeads, AttnPrep, Batch, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, Gate, GateUp, GatedNorm, HostOps, KvType, LayerIdx, Mat,
    MoeWeights, OpResult, Ops, SeqStore, Slot, StateKind, StateLayout, Tensor, WeightId, WeightSet,
};

/// What a backend claims. Each bound should sit a few times above the error it measured.
#[derive(Debug, Clone, Copy)]
pub struct Tolerances {
    /// Max relative error of f32 element-wise and reduction ops (norms, gates, prep, conv,
    /// delta rule, attention over f32/f16/q8_0 caches, float-weight matmuls).
    pub rel: f32,
    /// NMSE of matmuls and MoE with quantised weights.
    pub quant_nmse: f32,
}

/// The largest error seen per check, by name.
#[derive(Debug, Default)]
pub struct Report {
    pub errors: BTreeMap<String, f32>,
}

impl Report {
    fn note(&mut self, name: String, err: f32) {
        let e = self.errors.entry(name).or_insert(0.0);
        *e = e.max(err);
    }

    /// The largest error of every check whose name starts with `prefix`.
    pub fn max(&self, prefix: &str) -> f32 {
        self.errors.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, v)| *v).fold(0.0, f32::max)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, v) in &self.errors {
            writeln!(f, "  {k:40} {v:.2e}")?;
        }
        Ok(())
    }
}

/// A small deterministic generator (tests must not depend on the platform's randomness).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [−1, 1).
    pub fn f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (((self.f32() + 1.0) * 0.5 * n as f32) as usize).min(n.saturating_sub(1))
    }

    pub fn mat(&mut self, n: usize, d: usize, scale: f32) -> Mat {
        Mat::from_vec(n, d, (0..n * d).map(|_| self.f32() * scale).collect())
    }
}

pub fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-20);
    got.iter().zip(want).fold(0f32, |m, (g, w)| if g.is_nan() != w.is_nan() { f32::INFINITY } else { m.max((g - w).abs()) }) / scale
}

pub fn nmse(got: &[f32], want: &[f32]) -> f32 {
    let (num, den) = sq_err(got, want);
    (num / den.max(1e-30)) as f32
}

/// `(Σ(got − ref)², Σ ref²)`, to pool an NMSE over several results.
fn sq_err(got: &[f32], want: &[f32]) -> (f64, f64) {
    if got.len() != want.len() {
        return (f64::INFINITY, 1.0);
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| ((g - w) as f64).powi(2)).sum();
    (num, want.iter().map(|w| (*w as f64).powi(2)).sum())
}

/// NMSEs pooled per check over all its cases: one output row of a random matrix can sit near
/// zero, so a per-case ratio says little about a quantised kernel.
#[derive(Default)]
struct Pooled(BTreeMap<String, (f64, f64)>);

impl Pooled {
    fn add(&mut self, name: String, got: &[f32], want: &[f32]) {
        let (n, d) = sq_err(got, want);
        let e = self.0.entry(name).or_insert((0.0, 0.0));
        e.0 += n;
        e.1 += d;
    }

    fn finish(self, r: &mut Report, bound: f32, own: &Bounds<'_>) {
        for (name, (n, d)) in self.0 {
            let err = (n / d.max(1e-30)) as f32;
            let bound = own.get(&name, bound);
            assert!(err <= bound, "{name}: NMSE {err:.3e} > bound {bound:.1e}");
            r.note(name, err);
        }
    }
}

/// Weight types of real Qwen3.5/3.6 GGUFs.
pub const WEIGHT_TYPES: [GgmlType; 8] =
    [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::IQ4XS];

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// A random `n_rows x k` matrix of type `ty`, as block bytes.
fn random_weight(rng: &mut Rng, ty: GgmlType, k: usize, n_rows: usize, scale: f32) -> Vec<u8> {
    // unwrap: k is a multiple of 256, a whole number of blocks for every type listed.
    let rb = ty.row_bytes(k).unwrap();
    let mut out = vec![0u8; rb * n_rows];
    let mut row = vec![0f32; k];
    for r in 0..n_rows {
        row.iter_mut().for_each(|x| *x = rng.f32() * scale);
        // unwrap: every weight type above has a quantiser.
        quant::quantize(ty, &row, &mut out[r * rb..(r + 1) * rb]).unwrap();
    }
    out
}

/// The suite's model-free fixture: weights of every type, norm vectors, one MoE layer.
struct Fixture {
    set: Arc<WeightSet>,
    mats: Vec<(GgmlType, usize, usize, WeightId)>, // (type, k, rows, id)
    norm64: WeightId,
    norm96: WeightId,
    norm48: WeightId, // the conformance DeltaNet's value head
    conv: WeightId,   // 4 taps x 40 channels
    a: WeightId,      // 4 value heads
    dt_bias: WeightId,
    moe_k: usize,
    n_expert: usize,
}

const D_MOE: usize = 256;

fn fixture(seed: u64) -> Fixture {
    let mut rng = Rng::new(seed);
    let mut set = WeightSet::new();
    let mut mats = Vec::new();
    for (i, ty) in WEIGHT_TYPES.iter().enumerate() {
        for (k, rows) in [(256, 1), (512, 67), (256, 17)] {
            let b = random_weight(&mut rng, *ty, k, rows, 0.5);
            // unwrap: the bytes were made for exactly this shape.
            let id = set.add_bytes(&format!("w{i}.{k}x{rows}"), *ty, k, rows, 1, b).unwrap();
            mats.push((*ty, k, rows, id));
        }
    }
    let norm64 = set.add_vector("norm64", (0..64).map(|_| 1.0 + 0.3 * rng.f32()).collect());
    let norm96 = set.add_vector("norm96", (0..96).map(|_| 1.0 + 0.3 * rng.f32()).collect());
    let conv = set.add_vector("conv", (0..40 * 4).map(|_| rng.f32()).collect());
    let a = set.add_vector("a", (0..4).map(|_| -(1.0 + rng.f32()).exp()).collect());
    let dt_bias = set.add_vector("dt_bias", (0..4).map(|_| rng.f32()).collect());
    // One MoE layer: 6 experts, hidden 256 (fused gate|up in Q4_K, down in Q6_K), a Q8_0
    // shared expert of hidden 256.
    let (n_expert, n_ff) = (6, 256);
    let gu = random_weight(&mut rng, GgmlType::Q4K, D_MOE, 2 * n_ff * n_expert, 0.5);
    let gu = set.add_bytes("gate_up", GgmlType::Q4K, D_MOE, 2 * n_ff * n_expert, n_expert, gu).unwrap();
    let down = random_weight(&mut rng, GgmlType::Q6K, n_ff, D_MOE * n_expert, 0.5);
    let down = set.add_bytes("down", GgmlType::Q6K, n_ff, D_MOE * n_expert, n_expert, down).unwrap();
    let mut shared = [WeightId(0); 3];
    for (j, (k, rows)) in [(D_MOE, n_ff), (D_MOE, n_ff), (n_ff, D_MOE)].into_iter().enumerate() {
        let b = random_weight(&mut rng, GgmlType::Q8_0, k, rows, 0.5);
        shared[j] = set.add_bytes(&format!("shared{j}"), GgmlType::Q8_0, k, rows, 1, b).unwrap();
    }
    set.set_moe(LayerIdx(0), MoeWeights { n_expert, n_ff, gate_up: GateUp::Fused(gu), down, shared });
    let norm48 = set.add_vector("norm48", (0..48).map(|_| 1.0 + 0.3 * rng.f32()).collect());
    Fixture { set: Arc::new(set), mats, norm64, norm96, norm48, conv, a, dt_bias, moe_k: 3, n_expert }
}

/// Token counts every op is tried at: one (decode), a few, across the 8-token panel and 64-token
/// chunk switch-overs.
const TOKENS: [usize; 5] = [1, 3, 9, 33, 70];

/// A pair of handles: the backend's, the reference's.
type Two = [Tensor; 2];

/// The backend under test and the reference, fed the same inputs, with the same slots.
struct Pair {
    b: Box<dyn Ops>,
    r: HostOps,
    slots: Vec<(Slot, Slot)>,
    lens: Vec<usize>,
    step: Vec<(usize, usize)>,
}

impl Pair {
    /// `f` on the backend (index 0) and the reference (index 1).
    fn both<R>(&mut self, what: &str, f: impl Fn(&mut dyn Ops, usize) -> OpResult<R>) -> [R; 2] {
        let a = f(&mut *self.b, 0).unwrap_or_else(|e| panic!("{what}: {e}"));
        let b = f(&mut self.r, 1).unwrap_or_else(|e| panic!("reference {what}: {e}"));
        [a, b]
    }

    fn up(&mut self, m: &Mat) -> Two {
        self.both("upload", |o, _| o.upload(m))
    }

    fn read(&mut self, t: Two) -> (Mat, Mat) {
        let [a, b] = self.both("read", |o, i| o.read(t[i]));
        (a, b)
    }

    /// Each of a prep's five outputs against the reference's: (name, max relative error).
    fn prep_errors(&mut self, [a, b]: [DeltaIn; 2]) -> [(&'static str, f32); 5] {
        [("q", [a.q, b.q]), ("k", [a.k, b.k]), ("v", [a.v, b.v]), ("g", [a.g, b.g]), ("beta", [a.beta, b.beta])].map(|(name, t)| {
            let (got, want) = self.read(t);
            (name, max_rel(&got.data, &want.data))
        })
    }

    /// Reconfigures both stores and takes every slot.
    fn configure(&mut self, layout: &StateLayout, n_slots: usize, pages: usize) {
        self.slots.clear();
        self.both("configure", |o, _| o.configure(layout.clone(), n_slots, pages));
        for _ in 0..n_slots {
            let [a, b] = self.both("alloc_slot", |o, _| o.alloc_slot());
            self.slots.push((a, b));
        }
        self.lens = vec![0; n_slots];
    }

    /// Begins a step of `seqs` = (slot index, token ids) on both.
    fn begin_tokens(&mut self, seqs: &[(usize, Vec<u32>)], logit_rows: &[u32]) {
        let mut bs = [Batch::default(), Batch::default()];
        for (i, b) in bs.iter_mut().enumerate() {
            for (s, toks) in seqs {
                let slot = if i == 0 { &self.slots[*s].0 } else { &self.slots[*s].1 };
                b.push(slot.id(), self.lens[*s], toks);
            }
            b.logit_rows = logit_rows.to_vec();
        }
        self.both("begin_step", |o, i| o.begin_step(&bs[i]));
        self.step = seqs.iter().map(|(s, t)| (*s, t.len())).collect();
    }

    /// Begins a step of `seqs` = (slot index, token count).
    fn begin(&mut self, seqs: &[(usize, usize)]) {
        let seqs: Vec<(usize, Vec<u32>)> = seqs.iter().map(|&(s, n)| (s, vec![0; n])).collect();
        self.begin_tokens(&seqs, &[]);
    }

    fn end(&mut self) {
        self.both("end_step", |o, _| o.end_step());
        for (s, n) in std::mem::take(&mut self.step) {
            self.lens[s] += n;
        }
    }
}

/// Bounds of single checks, by the check's name as the [`Report`] prints it (e.g.
/// `("attention Q8_0", 1e-2)`), in place of the [`Tolerances`] bound of its kind; each name must
/// match a check ([`run_with`] panics otherwise, so a renamed check cannot silently lose its
/// bound).
struct Bounds<'a> {
    own: &'a [(&'a str, f32)],
    used: std::cell::RefCell<Vec<bool>>,
}

impl<'a> Bounds<'a> {
    fn new(own: &'a [(&'a str, f32)]) -> Self {
        Bounds { own, used: std::cell::RefCell::new(vec![false; own.len()]) }
    }

    /// The bound of check `name`: its own, else `default`.
    fn get(&self, name: &str, default: f32) -> f32 {
        match self.own.iter().position(|(n, _)| *n == name) {
            Some(i) => {
                self.used.borrow_mut()[i] = true;
                self.own[i].1
            }
            None => default,
        }
    }

    fn check_all_used(&self) {
        for ((name, _), used) in self.own.iter().zip(self.used.borrow().iter()) {
            assert!(*used, "conformance::run_with: no check is named {name:?}");
        }
    }
}

/// Runs every check; panics (a test failure) with the op, the case and the error when a bound
/// is exceeded, or when an op fails or panics where the reference does not.
pub fn run(make: &mut dyn FnMut(Arc<WeightSet>) -> Box<dyn Ops>, tol: Tolerances) -> Report {
    run_with(make, tol, &[])
}

/// [`run`], with the checks named in `own` held to their own bounds instead of `tol`'s (the
/// same error measure: relative for the `rel` checks, NMSE for the pooled ones). Panics when a
/// name in `own` matches no check.
pub fn run_with(make: &mut dyn FnMut(Arc<WeightSet>) -> Box<dyn Ops>, tol: Tolerances, own: &[(&str, f32)]) -> Report {
    let own = Bounds::new(own);
    let fx = fixture(1);
    let mut p = Pair { b: make(fx.set.clone()), r: HostOps::with_weights(fx.set.clone()), slots: vec![], lens: vec![], step: vec![] };
    let mut r = Report::default();
    let mut pooled = Pooled::default();
    let mut rng = Rng::new(2);
    let check = |r: &mut Report, name: String, err: f32, bound: f32| {
        let bound = own.get(&name, bound);
        assert!(err <= bound, "{name}: error {err:.3e} > bound {bound:.1e}");
        r.note(name, err);
    };

    // matmul / matmul_many over every weight type (no sequences: a step of no rows).
    p.begin(&[]);
    for &(ty, k, _, id) in &fx.mats {
        for n in TOKENS {
            let x = p.up(&rng.mat(n, k, 1.0));
            let y = p.both("matmul", |o, i| o.matmul(id, x[i]));
            let (got, want) = p.read(y);
            if is_float(ty) {
                check(&mut r, format!("matmul {ty}"), max_rel(&got.data, &want.data), tol.rel);
            } else {
                pooled.add(format!("matmul {ty}"), &got.data, &want.data);
            }
        }
    }
    for n in [1, 9] {
        let ws: Vec<WeightId> = fx.mats.iter().filter(|m| m.1 == 512).map(|m| m.3).collect();
        let x = p.up(&rng.mat(n, 512, 1.0));
        let [ys, yr] = p.both("matmul_many", |o, i| o.matmul_many(&ws, x[i]));
        assert_eq!(ys.len(), ws.len(), "matmul_many: one output per weight");
        for ((g, w), &id) in ys.into_iter().zip(yr).zip(&ws) {
            let (g, w) = p.read([g, w]);
            // unwrap: ids come from the fixture's set.
            let ty = fx.set.info(id).unwrap().ty;
            if is_float(ty) {
                check(&mut r, format!("matmul_many {ty}"), max_rel(&g.data, &w.data), tol.rel);
            } else {
                pooled.add(format!("matmul_many {ty}"), &g.data, &w.data);
            }
        }
    }

    // rms_norm (groups of the weight's width), add, gate.
    for n in TOKENS {
        for (w, d) in [(fx.norm64, 64), (fx.norm64, 192), (fx.norm96, 96 * 21)] {
            let x = p.up(&rng.mat(n, d, 2.0));
            let y = p.both("rms_norm", |o, i| o.rms_norm(x[i], w, 1e-6));
            let (got, want) = p.read(y);
            check(&mut r, "rms_norm".into(), max_rel(&got.data, &want.data), tol.rel);
        }
        let (a, b) = (p.up(&rng.mat(n, 2048 + 3, 1.0)), p.up(&rng.mat(n, 2048 + 3, 1.0)));
        p.both("add", |o, i| o.add(a[i], b[i]));
        let (got, want) = p.read(a);
        check(&mut r, "add".into(), max_rel(&got.data, &want.data), tol.rel);
        // The residual add with the norm after it: one group per row (the model's case, where a
        // backend may also keep an int8 copy) and several.
        for (w, d) in [(fx.norm96, 96), (fx.norm64, 192)] {
            let (h, a) = (p.up(&rng.mat(n, d, 2.0)), p.up(&rng.mat(n, d, 1.0)));
            let y = p.both("add_rms_norm", |o, i| o.add_rms_norm(h[i], a[i], w, 1e-6));
            let (got, want) = p.read(y);
            check(&mut r, "add_rms_norm".into(), max_rel(&got.data, &want.data), tol.rel);
            let (got, want) = p.read(h);
            check(&mut r, "add_rms_norm h".into(), max_rel(&got.data, &want.data), tol.rel);
        }
        // The gated norm, per head (groups of the weight's width) and over whole rows; the gate
        // at a width a backend may also quantise (a multiple of 32).
        for (w, d) in [(fx.norm64, 192), (fx.norm96, 96)] {
            for act in [Gate::Silu, Gate::Sigmoid] {
                let (x, g) = (p.up(&rng.mat(n, d, 2.0)), p.up(&rng.mat(n, d, 4.0)));
                let y = p.both("rms_norm_gate", |o, i| o.rms_norm_gate(x[i], w, 1e-6, g[i], act));
                let (got, want) = p.read(y);
                check(&mut r, "rms_norm_gate".into(), max_rel(&got.data, &want.data), tol.rel);
            }
        }
        for act in [Gate::Silu, Gate::Sigmoid] {
            let (y, g) = (p.up(&rng.mat(n, 4096, 1.0)), p.up(&rng.mat(n, 4096, 8.0)));
            p.both("gate", |o, i| o.gate(y[i], g[i], act));
            let (got, want) = p.read(y);
            check(&mut r, format!("gate {act:?}"), max_rel(&got.data, &want.data), tol.rel);
        }
        for act in [Gate::Silu, Gate::Sigmoid] {
            let mut g = rng.mat(n, 4096 + 5, 1.0);
            g.data.iter_mut().for_each(|v| *v *= 40.0);
            let (y, g) = (p.up(&rng.mat(n, 4096 + 5, 1.0)), p.up(&g));
            p.both("gate", |o, i| o.gate(y[i], g[i], act));
            let (got, want) = p.read(y);
            check(&mut r, format!("gate {act:?}"), max_rel(&got.data, &want.data), tol.rel);
        }
    }

    // Sequence ops over a store of two attention and two DeltaNet layers, three slots.
    let layout = |kv_type| StateLayout {
        layers: vec![StateKind::Kv, StateKind::Delta, StateKind::Kv, StateKind::Delta],
        kv_type,
        kv_width: 2 * 64,
        conv: 3 * 40,
        rec: 4 * 48 * 32,
    };
    p.configure(&layout(KvType::F16), 3, 1 << 12);

    // embed and select_rows: the step's tokens and logit rows.
    for &(ty, _, rows, id) in &fx.mats {
        let toks: Vec<u32> = (0..5).map(|_| rng.below(rows) as u32).chain([rows as u32 - 1]).collect();
        p.begin_tokens(&[(0, toks[..2].to_vec()), (1, toks[2..].to_vec())], &[5, 0, 3]);
        let y = p.both("embed", |o, _| o.embed(id));
        let (got, want) = p.read(y);
        check(&mut r, format!("embed {ty}"), max_rel(&got.data, &want.data), tol.rel);
        let y = p.both("select_rows", |o, i| o.select_rows(y[i]));
        let (got, want) = p.read(y);
        assert_eq!(got.n, 3, "select_rows: one row per logit row");
        check(&mut r, "select_rows".into(), max_rel(&got.data, &want.data), 0.0);
    }

    // attn_prep at the step's positions: sequences at 0, deep, and restarting.
    let prep =
        AttnPrep { n_head: 4, n_head_kv: 2, head_dim: 64, n_rot: 16, rope_base: 1e7, eps: 1e-6, q_norm: fx.norm64, k_norm: fx.norm64 };
    p.begin(&[(2, 4000)]);
    p.end(); // slot 2 now at position 4000, without KV rows (the store only counts)
    for seqs in [vec![(0, 1)], vec![(0, 3), (1, 2), (2, 1)], vec![(1, 70), (2, 3)]] {
        p.begin(&seqs);
        let n = seqs.iter().map(|s| s.1).sum();
        let (qg, k) = (p.up(&rng.mat(n, 4 * 2 * 64, 2.0)), p.up(&rng.mat(n, 2 * 64, 2.0)));
        let [a, b] = p.both("attn_prep", |o, i| o.attn_prep(prep, qg[i], k[i]));
        for (name, t) in [("q", [a.q, b.q]), ("gate", [a.gate, b.gate]), ("k", [a.k, b.k])] {
            let (got, want) = p.read(t);
            check(&mut r, format!("attn_prep {name}"), max_rel(&got.data, &want.data), tol.rel);
        }
        p.end();
    }

    // kv_append + attention, per cache type: three sequences growing in steps that mix decode
    // (one token) and prompt chunks, all sequences of a step in one call, on both attention
    // layers; conv and the delta rule carried on the DeltaNet layers of the same slots.
    let steps: [[usize; 3]; 5] = [[5, 1, 70], [1, 1, 1], [70, 3, 1], [1, 9, 2], [3, 1, 1]];
    let heads = AttnHeads { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125 };
    let dp = DeltaPrep { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48, eps: 1e-6, a: fx.a, dt_bias: fx.dt_bias };
    let dh = DeltaHeads { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48 };
    for (kv, mode) in [(KvType::F32, DeltaMode::Auto), (KvType::F16, DeltaMode::Recurrent), (KvType::Q8_0, DeltaMode::Chunked)] {
        p.configure(&layout(kv), 3, 1 << 12);
        for step in steps {
            let seqs: Vec<(usize, usize)> = step.iter().copied().enumerate().collect();
            p.begin(&seqs);
            let n: usize = step.iter().sum();
            for layer in [LayerIdx(0), LayerIdx(2)] {
                let (k, v, q) = (p.up(&rng.mat(n, 128, 1.0)), p.up(&rng.mat(n, 128, 1.0)), p.up(&rng.mat(n, 8 * 64, 1.0)));
                p.both("kv_append", |o, i| o.kv_append(layer, k[i], v[i]));
                let y = p.both("attention", |o, i| o.attention(layer, heads, q[i]));
                let (got, want) = p.read(y);
                check(&mut r, format!("attention {kv:?}"), max_rel(&got.data, &want.data), tol.rel);
                // With its gate (a backend may run it in the attention's launches).
                let g = p.up(&rng.mat(n, 8 * 64, 2.0));
                let y = p.both("attention_gate", |o, i| o.attention_gate(layer, heads, q[i], g[i], Gate::Sigmoid));
                let (got, want) = p.read(y);
                // The attention's own bound (its gate multiplies each value by a number in (0, 1)).
                let (err, bound) = (max_rel(&got.data, &want.data), own.get(&format!("attention {kv:?}"), tol.rel));
                assert!(err <= bound, "attention_gate {kv:?}: error {err:.3e} > bound {bound:.1e}");
                r.note(format!("attention_gate {kv:?}"), err);
            }
            for layer in [LayerIdx(1), LayerIdx(3)] {
                let x = p.up(&rng.mat(n, 40, 1.0));
                let y = p.both("conv1d_silu", |o, i| o.conv1d_silu(layer, x[i], fx.conv));
                let (got, want) = p.read(y);
                check(&mut r, "conv1d_silu".into(), max_rel(&got.data, &want.data), tol.rel);
                let cu = p.up(&rng.mat(n, 2 * 2 * 32 + 4 * 48, 1.0));
                let (b, al) = (p.up(&rng.mat(n, 4, 3.0)), p.up(&rng.mat(n, 4, 3.0)));
                let [din, dref] = p.both("delta_prep", |o, i| o.delta_prep(dp, cu[i], b[i], al[i]));
                for (name, err) in p.prep_errors([din, dref]) {
                    check(&mut r, format!("delta_prep {name}"), err, tol.rel);
                }
                // Both run the delta rule on the reference's prep, so only the rule is compared.
                let y = p.both("gated_delta_rule", |o, i| {
                    let x = if i == 0 { din } else { dref };
                    o.gated_delta_rule(layer, dh, x, mode)
                });
                let (got, want) = p.read(y);
                check(&mut r, format!("gated_delta_rule {mode:?}"), max_rel(&got.data, &want.data), tol.rel);
                // The delta rule with its gated norm as one op (a backend may fuse them where
                // every sequence has one row), the state carried on from the rule above.
                let z = p.up(&rng.mat(n, 4 * 48, 2.0));
                let norm = GatedNorm { w: fx.norm48, eps: 1e-6, act: Gate::Silu };
                let y = p.both("delta_rule_norm", |o, i| {
                    let x = if i == 0 { din } else { dref };
                    o.delta_rule_norm(layer, dh, x, mode, norm, z[i])
                });
                let (got, want) = p.read(y);
                check(&mut r, format!("delta_rule_norm {mode:?}"), max_rel(&got.data, &want.data), tol.rel);
                // The conv and the prep as one op (a backend may fuse them where every sequence
                // has one row: the [1, 1, 1] step) on the conv's 40 channels as q | k | v.
                let x = p.up(&rng.mat(n, 40, 1.0));
                let (b, al) = (p.up(&rng.mat(n, 4, 3.0)), p.up(&rng.mat(n, 4, 3.0)));
                let dpc = DeltaPrep { n_k_head: 1, n_v_head: 4, d_k: 8, d_v: 6, ..dp };
                let fused = p.both("conv_delta_prep", |o, i| o.conv_delta_prep(layer, x[i], fx.conv, dpc, b[i], al[i]));
                for (name, err) in p.prep_errors(fused) {
                    check(&mut r, format!("conv_delta_prep {name}"), err, tol.rel);
                }
            }
            p.end();
            for s in 0..3 {
                for layer in [LayerIdx(1), LayerIdx(3)] {
                    let [(c, st), (cr, sr)] = {
                        let slots = &p.slots[s];
                        let a = p.b.read_delta(&slots.0, layer).unwrap_or_else(|e| panic!("read_delta: {e}"));
                        let b = p.r.read_delta(&slots.1, layer).unwrap_or_else(|e| panic!("reference read_delta: {e}"));
                        [a, b]
                    };
                    check(&mut r, "conv1d_silu state".into(), max_rel(&c, &cr), tol.rel);
                    check(&mut r, format!("gated_delta_rule {mode:?} state"), max_rel(&st, &sr), tol.rel);
                }
            }
        }
    }

    // route (ids exact, weights close) and the MoE on that routing.
    p.begin(&[]);
    for n in TOKENS {
        let logits = p.up(&rng.mat(n, fx.n_expert, 3.0));
        let rt = p.both("route", |o, i| o.route(logits[i], fx.moe_k));
        let [got, want] = p.both("read_routing", |o, i| o.read_routing(rt[i]));
        assert_eq!(got.ids, want.ids, "route: expert ids differ from the reference ({n} tokens)");
        check(&mut r, "route weights".into(), max_rel(&got.weights, &want.weights), tol.rel);
        let (x, gs) = (p.up(&rng.mat(n, D_MOE, 1.0)), p.up(&rng.mat(n, 1, 2.0)));
        let y = p.both("moe", |o, i| o.moe(LayerIdx(0), x[i], rt[i], gs[i]));
        let (got, want) = p.read(y);
        pooled.add("moe".into(), &got.data, &want.data);
    }
    pooled.finish(&mut r, tol.quant_nmse, &own);
    own.check_all_used();

    store(&mut *p.b, &mut rng, &layout(KvType::F16), &fx);
    arena_repeats(&mut *p.b, &fx);
    frees(&mut *p.b, &fx);
    shape_errors(&mut *p.b, &fx);
    r
}

/// One decode-like step on `slot`: a K/V row appended to layer 0 and attention over it, a
/// delta rule step on layer 1. Returns the attention and delta outputs.
fn state_step(o: &mut dyn Ops, slot: &Slot, x: &[Mat; 4], fx: &Fixture) -> OpResult<Vec<f32>> {
    let len = o.slot_len(slot)?;
    let mut b = Batch::default();
    b.push(slot.id(), len, &[0]);
    o.begin_step(&b)?;
    let [k, v, q, cu] = [o.upload(&x[0])?, o.upload(&x[1])?, o.upload(&x[2])?, o.upload(&x[3])?];
    o.kv_append(LayerIdx(0), k, v)?;
    let heads = AttnHeads { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125 };
    let a = o.attention(LayerIdx(0), heads, q)?;
    let dp = DeltaPrep { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48, eps: 1e-6, a: fx.a, dt_bias: fx.dt_bias };
    let one = o.upload(&Mat::from_vec(1, 4, vec![0.5; 4]))?;
    let din = o.delta_prep(dp, cu, one, one)?;
    let d = o.gated_delta_rule(LayerIdx(1), DeltaHeads { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48 }, din, DeltaMode::Auto)?;
    let mut out = o.read(a)?.data;
    out.extend(o.read(d)?.data);
    o.end_step()?;
    Ok(out)
}

/// The store: a snapshot shares pages and copies the DeltaNet state; restored into another
/// slot, the same inputs give the same outputs, bit for bit, and the original slot is
/// untouched by writes after the snapshot; a full page pool is an error; freed slots and
/// snapshots give their pages back.
fn store(o: &mut dyn Ops, rng: &mut Rng, layout: &StateLayout, fx: &Fixture) {
    let ok = |what: &str, e: crate::OpError| -> ! { panic!("{what}: {e}") };
    let pages = 2 * 2 * 3; // 2 KV layers x (K, V) x 3 pages: one slot of 130 tokens, nothing more
    o.configure(layout.clone(), 3, pages).unwrap_or_else(|e| ok("configure", e));
    let st = o.store_stats();
    assert_eq!((st.slots, st.slots_free, st.pages, st.pages_free), (3, 3, pages, pages), "store_stats after configure");
    let inputs = |rng: &mut Rng| [rng.mat(1, 128, 1.0), rng.mat(1, 128, 1.0), rng.mat(1, 512, 1.0), rng.mat(1, 320, 1.0)];
    let a = o.alloc_slot().unwrap_or_else(|e| ok("alloc_slot", e));
    for _ in 0..70 {
        let x = inputs(rng);
        state_step(o, &a, &x, fx).unwrap_or_else(|e| ok("state step", e));
    }
    // 70 tokens: two pages per KV cache, the second partial. Layer 2 (Kv) was never written.
    assert_eq!(o.store_stats().pages_free, pages - 4, "pages after 70 tokens on one KV layer");
    let snap = o.snapshot(&a).unwrap_or_else(|e| ok("snapshot", e));
    assert_eq!(snap.len(), 70, "snapshot length");
    assert_eq!(snap.own_bytes(), layout.delta_bytes(), "a snapshot owns exactly the DeltaNet state");
    assert_eq!(snap.kv_pages().len(), 4, "a snapshot references the slot's pages");
    assert_eq!(o.store_stats().pages_free, pages - 4, "a snapshot takes no pages");
    let next: Vec<[Mat; 4]> = (0..3).map(|_| inputs(rng)).collect();
    let want: Vec<Vec<f32>> = next.iter().map(|x| state_step(o, &a, x, fx).unwrap_or_else(|e| ok("state step", e))).collect();
    assert_eq!(o.store_stats().pages_free, pages - 6, "the first write after a snapshot copies the partial page (K and V)");
    let b = o.alloc_slot().unwrap_or_else(|e| ok("alloc_slot", e));
    o.restore(&b, &snap).unwrap_or_else(|e| ok("restore", e));
    assert_eq!(o.slot_len(&b).unwrap_or_else(|e| ok("slot_len", e)), 70, "restored length");
    for (x, w) in next.iter().zip(&want) {
        let got = state_step(o, &b, x, fx).unwrap_or_else(|e| ok("state step after restore", e));
        assert_eq!(&got, w, "restore: the same inputs after a restore give different outputs");
    }
    // Grow `a` until the pool runs out: an error, not a panic.
    let mut hit = None;
    for i in 0..200 {
        if let Err(e) = state_step(o, &a, &inputs(rng), fx) {
            hit = Some((i, e));
            break;
        }
    }
    let (_, e) = hit.expect("a full KV page pool must be an error");
    assert!(e.op == "kv_append" && e.to_string().contains("pool"), "a full pool names kv_append and the pool: {e}");
    drop((a, b, snap));
    let st = o.store_stats();
    assert_eq!((st.slots_free, st.pages_free, st.snapshots), (3, pages, 0), "dropped slots and snapshots give everything back");
    // A slot of another store (or of a reconfigured one) is refused.
    let c = o.alloc_slot().unwrap_or_else(|e| ok("alloc_slot", e));
    o.configure(layout.clone(), 1, pages).unwrap_or_else(|e| ok("configure", e));
    assert!(o.slot_len(&c).is_err(), "a slot from before configure must be refused");
    let _d = o.alloc_slot().unwrap_or_else(|e| ok("alloc_slot", e));
    assert!(o.alloc_slot().is_err(), "alloc_slot with every slot in use must be an error");
}

/// Two steps that allocate in the same order get the same handles.
fn arena_repeats(o: &mut dyn Ops, fx: &Fixture) {
    let run = |o: &mut dyn Ops| -> OpResult<Vec<Tensor>> {
        o.begin_step(&Batch::default())?;
        let x = o.upload(&Mat::from_vec(2, 64, vec![0.25; 128]))?;
        let y = o.rms_norm(x, fx.norm64, 1e-6)?;
        let (_, k, _, id) = fx.mats[3];
        let w = o.upload(&Mat::from_vec(2, k, vec![0.5; 2 * k]))?;
        let z = o.matmul(id, w)?;
        Ok(vec![x, y, w, z])
    };
    let a = run(o).unwrap_or_else(|e| panic!("arena step: {e}"));
    let b = run(o).unwrap_or_else(|e| panic!("arena step: {e}"));
    assert_eq!(a, b, "the same allocations in a new step must give the same handles");
}

/// `free_since` as the model uses it (a residual made before the mark, each "layer" freeing all
/// it made but its output): the same values bit for bit as without freeing while later handles
/// reuse the freed memory; a freed handle is an error in an op and as a handle to keep; two
/// steps that free alike get the same handles.
fn frees(o: &mut dyn Ops, fx: &Fixture) {
    let run = |o: &mut dyn Ops, free: bool| -> OpResult<(Vec<Tensor>, Mat, Mat)> {
        o.begin_step(&Batch::default())?;
        let h = o.upload(&Mat::from_vec(2, 64, (0..128).map(|i| (i as f32 - 60.0) / 32.0).collect()))?;
        let mark = o.mark();
        let (mut handles, mut k) = (vec![h], None);
        for l in 0..4 {
            let x = o.upload(&Mat::from_vec(2, 64, (0..128).map(|i| ((i * 7 + l * 13) % 17) as f32 / 8.0 - 1.0).collect()))?;
            let y = o.rms_norm(x, fx.norm64, 1e-6)?;
            if let Some(k) = k {
                o.add(h, k)?; // the last layer's output, read after its neighbours' memory was reused
            }
            o.add(h, y)?;
            let out = o.rms_norm(h, fx.norm64, 1e-6)?;
            if free {
                o.free_since(mark, &[out])?;
            }
            handles.extend([x, y, out]);
            k = Some(out);
        }
        let k = k.expect("four layers ran");
        Ok((handles, o.read(h)?, o.read(k)?))
    };
    let step = |o: &mut dyn Ops, free: bool| run(o, free).unwrap_or_else(|e| panic!("free_since step (free: {free}): {e}"));
    let (_, h0, k0) = step(o, false);
    let (a, h1, k1) = step(o, true);
    assert_eq!((h1.data, k1.data), (h0.data, k0.data), "freeing a layer's handles changed what the kept ones hold");
    let (b, _, _) = step(o, true);
    assert_eq!(a, b, "the same allocations and frees in a new step must give the same handles");
    // In that step: the first layer's x is freed, the last layer's output is not.
    let (x0, last) = (b[1], b[b.len() - 1]);
    let e = o.rms_norm(x0, fx.norm64, 1e-6).expect_err("an op on a freed handle must be an error");
    assert_eq!(e.op, "rms_norm", "the error names the op: {e}");
    o.rms_norm(last, fx.norm64, 1e-6).unwrap_or_else(|e| panic!("a kept handle: {e}"));
    assert!(o.free_since(o.mark(), &[x0]).is_err(), "keeping a freed handle must be an error");
}

/// Every op rejects inputs of the wrong shape (or unknown ids and handles) with an error naming
/// the op.
fn shape_errors(o: &mut dyn Ops, fx: &Fixture) {
    let named = |op: &str, res: Result<(), crate::OpError>| match res {
        Ok(()) => panic!("{op}: accepted a bad input"),
        Err(e) => assert!(e.op == op && e.to_string().contains(op), "{op}: error does not name the op: {e}"),
    };
    let layout =
        StateLayout { layers: vec![StateKind::Kv, StateKind::Delta], kv_type: KvType::F16, kv_width: 128, conv: 3 * 40, rec: 4 * 48 * 32 };
    o.configure(layout, 2, 64).unwrap_or_else(|e| panic!("configure: {e}"));
    let s = o.alloc_slot().unwrap_or_else(|e| panic!("alloc_slot: {e}"));
    let mut b = Batch::default();
    b.push(s.id(), 0, &[0, 0]);
    let mut bad = b.clone();
    bad.seqs[0].pos0 = 5;
    named("begin_step", o.begin_step(&bad));
    let mut bad = b.clone();
    bad.logit_rows = vec![2];
    named("begin_step", o.begin_step(&bad));
    let mut bad = b.clone();
    bad.push(s.id(), 0, &[0]);
    named("begin_step", o.begin_step(&bad));
    o.begin_step(&b).unwrap_or_else(|e| panic!("begin_step: {e}"));
    let mut up = |n: usize, d: usize| o.upload(&Mat::zeros(n, d)).unwrap_or_else(|e| panic!("upload: {e}"));
    let (_, k, rows, id) = fx.mats[4];
    let (x_bad, x1, n65, n64, a23, a32, y23, y24) = (up(2, k + 1), up(1, k), up(1, 65), up(1, 64), up(2, 3), up(3, 2), up(2, 3), up(2, 4));
    let (qg, k2, k64, q256, x40, cu, b4, din_q, ghost) =
        (up(2, 4 * 2 * 64), up(2, 128), up(2, 64), up(2, 256), up(2, 40), up(2, 10), up(2, 4), up(2, 64), Tensor { id: 9999, n: 1, d: 1 });
    let (logits, x_moe, gs) = (up(1, 6), up(1, D_MOE), up(1, 1));
    let _ = rows;
    named("matmul", o.matmul(id, x_bad).map(drop));
    named("matmul", o.matmul(WeightId(99_999), x1).map(drop));
    named("matmul", o.matmul(id, ghost).map(drop));
    named("matmul_many", o.matmul_many(&[id, id], x_bad).map(drop));
    named("rms_norm", o.rms_norm(n65, fx.norm64, 1e-6).map(drop));
    named("rms_norm", o.rms_norm(n64, id, 1e-6).map(drop));
    named("add", o.add(a23, a32));
    // The default add_rms_norm is add then rms_norm: its errors may name either.
    for res in [o.add_rms_norm(a23, a32, fx.norm64, 1e-6), o.add_rms_norm(a23, y23, id, 1e-6)] {
        match res {
            Ok(_) => panic!("add_rms_norm: accepted a bad input"),
            Err(e) => assert!(["add_rms_norm", "add", "rms_norm"].contains(&e.op), "add_rms_norm: error names another op: {e}"),
        }
    }
    named("gate", o.gate(y23, y24, Gate::Silu));
    named("select_rows", o.select_rows(a32).map(drop));
    let prep =
        AttnPrep { n_head: 4, n_head_kv: 2, head_dim: 64, n_rot: 16, rope_base: 1e7, eps: 1e-6, q_norm: fx.norm64, k_norm: fx.norm64 };
    named("attn_prep", o.attn_prep(prep, qg, k64).map(drop));
    named("attn_prep", o.attn_prep(prep, x1, k2).map(drop));
    named("kv_append", o.kv_append(LayerIdx(0), k64, k64));
    named("kv_append", o.kv_append(LayerIdx(1), k2, k2));
    named("kv_append", o.kv_append(LayerIdx(9), k2, k2));
    let heads = AttnHeads { n_head: 4, n_head_kv: 2, head_dim: 64, scale: 1.0 };
    named("attention", o.attention(LayerIdx(0), heads, q256).map(drop));
    named("conv1d_silu", o.conv1d_silu(LayerIdx(0), x40, fx.conv).map(drop));
    named("conv1d_silu", o.conv1d_silu(LayerIdx(1), x1, fx.conv).map(drop));
    let dp = DeltaPrep { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48, eps: 1e-6, a: fx.a, dt_bias: fx.dt_bias };
    named("delta_prep", o.delta_prep(dp, cu, b4, b4).map(drop));
    let dh = DeltaHeads { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48 };
    let din = DeltaIn { q: din_q, k: din_q, v: din_q, g: b4, beta: b4 };
    named("gated_delta_rule", o.gated_delta_rule(LayerIdx(1), dh, din, DeltaMode::Auto).map(drop));
    named("route", o.route(logits, 7).map(drop));
    let rt = o.route(logits, 1).unwrap_or_else(|e| panic!("route: {e}"));
    named("moe", o.moe(LayerIdx(7), x_moe, rt, gs).map(drop));
    named("moe", o.moe(LayerIdx(0), x_moe, crate::Routing { id: 99, n_tok: 1, k: 1 }, gs).map(drop));
}
