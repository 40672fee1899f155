//! The conformance suite: every op of a backend against [`HostOps`] (the reference) on random
//! inputs and random odd shapes (one token, a few, many; several sequences in one call), plus
//! the shape errors every op must return instead of panicking. A backend's test crate calls
//! [`run`] with its constructor and the tolerances it claims, stating next to them the errors
//! it measured (the [`Report`] prints them).
//!
//! Error measures: `rel` is the largest `|got − ref|` over the largest `|ref|` of a result;
//! `nmse` is `Σ(got − ref)² / Σ ref²` (for ops whose backend may quantise activations).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use ember_gguf::{GgmlType, quant};

use crate::{
    AttnHeads, AttnPrep, DeltaHeads, DeltaIn, DeltaMode, DeltaPrep, ExpertId, Gate, GateUp, HostOps, KvCache, KvRows, KvType, LayerIdx,
    Mat, MoeWeights, OpResult, Ops, Routing, SeqSpan, WeightId, WeightSet,
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

    fn finish(self, r: &mut Report, bound: f32) {
        for (name, (n, d)) in self.0 {
            let err = (n / d.max(1e-30)) as f32;
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
    conv: WeightId, // 4 taps x 40 channels
    a: WeightId,    // 4 value heads
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
    Fixture { set: Arc::new(set), mats, norm64, norm96, conv, a, dt_bias, moe_k: 3, n_expert }
}

/// Token counts every op is tried at: one (decode), a few, across the 8-token panel and 64-token
/// chunk switch-overs.
const TOKENS: [usize; 5] = [1, 3, 9, 33, 70];

/// Runs every check; panics (a test failure) with the op, the case and the error when a bound
/// is exceeded, or when an op fails or panics where the reference does not.
pub fn run(make: &mut dyn FnMut(Arc<WeightSet>) -> Box<dyn Ops>, tol: Tolerances) -> Report {
    let fx = fixture(1);
    let ops = make(fx.set.clone());
    let host = HostOps::with_weights(fx.set.clone());
    let mut r = Report::default();
    let mut pooled = Pooled::default();
    let mut rng = Rng::new(2);
    let ok = |what: &str, res: OpResult<Mat>| res.unwrap_or_else(|e| panic!("{what}: {e}"));
    let check = |r: &mut Report, name: String, err: f32, bound: f32| {
        assert!(err <= bound, "{name}: error {err:.3e} > bound {bound:.1e}");
        r.note(name, err);
    };

    // matmul / matmul_many / get_rows over every weight type.
    for &(ty, k, rows, id) in &fx.mats {
        for n in TOKENS {
            let x = rng.mat(n, k, 1.0);
            let want = ok("reference matmul", host.matmul(id, &x));
            let got = ok("matmul", ops.matmul(id, &x));
            if is_float(ty) {
                check(&mut r, format!("matmul {ty}"), max_rel(&got.data, &want.data), tol.rel);
            } else {
                pooled.add(format!("matmul {ty}"), &got.data, &want.data);
            }
        }
        let ids: Vec<u32> = (0..5).map(|_| rng.below(rows) as u32).chain([rows as u32 - 1]).collect();
        let got = ok("get_rows", ops.get_rows(id, &ids));
        check(&mut r, format!("get_rows {ty}"), max_rel(&got.data, &ok("reference get_rows", host.get_rows(id, &ids)).data), tol.rel);
    }
    for n in [1, 9] {
        let ws: Vec<WeightId> = fx.mats.iter().filter(|m| m.1 == 512).map(|m| m.3).collect();
        let x = rng.mat(n, 512, 1.0);
        let got = ops.matmul_many(&ws, &x).unwrap_or_else(|e| panic!("matmul_many: {e}"));
        let want = host.matmul_many(&ws, &x).unwrap_or_else(|e| panic!("reference matmul_many: {e}"));
        assert_eq!(got.len(), ws.len(), "matmul_many: one output per weight");
        for ((g, w), &id) in got.iter().zip(&want).zip(&ws) {
            // unwrap: ids come from the fixture's set.
            let ty = fx.set.info(id).unwrap().ty;
            if is_float(ty) {
                check(&mut r, format!("matmul_many {ty}"), max_rel(&g.data, &w.data), tol.rel);
            } else {
                pooled.add(format!("matmul_many {ty}"), &g.data, &w.data);
            }
        }
    }

    // rms_norm (groups of the weight's width), add, gate, select_rows.
    for n in TOKENS {
        for (w, d) in [(fx.norm64, 64), (fx.norm64, 192), (fx.norm96, 96 * 21)] {
            let x = rng.mat(n, d, 2.0);
            let got = ok("rms_norm", ops.rms_norm(&x, w, 1e-6));
            check(&mut r, "rms_norm".into(), max_rel(&got.data, &ok("reference rms_norm", host.rms_norm(&x, w, 1e-6)).data), tol.rel);
        }
        let (mut a, b) = (rng.mat(n, 2048 + 3, 1.0), rng.mat(n, 2048 + 3, 1.0));
        let mut want = a.clone();
        ops.add(&mut a, &b).unwrap_or_else(|e| panic!("add: {e}"));
        host.add(&mut want, &b).unwrap_or_else(|e| panic!("reference add: {e}"));
        check(&mut r, "add".into(), max_rel(&a.data, &want.data), tol.rel);
        for act in [Gate::Silu, Gate::Sigmoid] {
            let (mut y, mut g) = (rng.mat(n, 4096 + 5, 1.0), rng.mat(n, 4096 + 5, 1.0));
            g.data.iter_mut().for_each(|v| *v *= 40.0);
            let mut want = y.clone();
            ops.gate(&mut y, &g, act).unwrap_or_else(|e| panic!("gate: {e}"));
            host.gate(&mut want, &g, act).unwrap_or_else(|e| panic!("reference gate: {e}"));
            check(&mut r, format!("gate {act:?}"), max_rel(&y.data, &want.data), tol.rel);
        }
        let x = rng.mat(n, 33, 1.0);
        let rows: Vec<usize> = (0..n).rev().step_by(2).collect();
        check(
            &mut r,
            "select_rows".into(),
            max_rel(&ok("select_rows", ops.select_rows(&x, &rows)).data, &host.select_rows(&x, &rows).unwrap().data),
            0.0,
        );
    }

    // attn_prep over several sequences (positions restart, jump, run deep).
    let prep =
        AttnPrep { n_head: 4, n_head_kv: 2, head_dim: 64, n_rot: 16, rope_base: 1e7, eps: 1e-6, q_norm: fx.norm64, k_norm: fx.norm64 };
    for pos in [vec![0u32], vec![7, 8, 9, 0, 1, 4000], (0..70).chain(1000..1003).collect::<Vec<_>>()] {
        let (qg, k) = (rng.mat(pos.len(), 4 * 2 * 64, 2.0), rng.mat(pos.len(), 2 * 64, 2.0));
        let got = ops.attn_prep(prep, &qg, &k, &pos).unwrap_or_else(|e| panic!("attn_prep: {e}"));
        let want = host.attn_prep(prep, &qg, &k, &pos).unwrap_or_else(|e| panic!("reference attn_prep: {e}"));
        for (name, g, w) in [("q", &got.q, &want.q), ("gate", &got.gate, &want.gate), ("k", &got.k, &want.k)] {
            check(&mut r, format!("attn_prep {name}"), max_rel(&g.data, &w.data), tol.rel);
        }
    }

    // kv_append + attention, per cache type: three sequences growing in steps that mix decode
    // (one token) and prompt chunks, all sequences of a step in one call.
    let steps: [[usize; 3]; 5] = [[5, 1, 70], [1, 1, 1], [70, 3, 1], [1, 9, 2], [3, 1, 1]];
    for kv in [KvType::F32, KvType::F16, KvType::Q8_0] {
        let heads = AttnHeads { n_head: 8, n_head_kv: 2, head_dim: 64, scale: 0.125 };
        let w = 2 * 64;
        let mut mine: Vec<(KvRows, KvRows)> = (0..3).map(|_| (KvRows::new(kv, w), KvRows::new(kv, w))).collect();
        let mut refs = mine.clone();
        for step in steps {
            let spans = spans_of(&step, &mine.iter().map(|c| c.0.len).collect::<Vec<_>>());
            let n: usize = step.iter().sum();
            let (k, v, q) = (rng.mat(n, w, 1.0), rng.mat(n, w, 1.0), rng.mat(n, 8 * 64, 1.0));
            let mut caches: Vec<KvCache> = mine.iter_mut().map(|(k, v)| KvCache { k, v }).collect();
            ops.kv_append(&spans, &k, &v, &mut caches).unwrap_or_else(|e| panic!("kv_append: {e}"));
            let got = ok("attention", ops.attention(heads, &spans, &q, &caches));
            let mut rcaches: Vec<KvCache> = refs.iter_mut().map(|(k, v)| KvCache { k, v }).collect();
            host.kv_append(&spans, &k, &v, &mut rcaches).unwrap();
            let want = ok("reference attention", host.attention(heads, &spans, &q, &rcaches));
            for (c, r) in caches.iter().zip(&rcaches) {
                assert_eq!(c.k.len, r.k.len, "kv_append {kv:?}: cache lengths differ");
                for p in 0..c.k.len {
                    assert_eq!((c.k.row(p), c.v.row(p)), (r.k.row(p), r.v.row(p)), "kv_append {kv:?}: row {p} differs from the reference");
                }
            }
            check(&mut r, format!("attention {kv:?}"), max_rel(&got.data, &want.data), tol.rel);
        }
    }

    // conv1d_silu with the states of three sequences carried across steps.
    let (mut st, mut st_ref) = (vec![vec![0f32; 3 * 40]; 3], vec![vec![0f32; 3 * 40]; 3]);
    for step in steps {
        let spans = spans_of(&step, &[0; 3]);
        let x = rng.mat(step.iter().sum(), 40, 1.0);
        let mut sm: Vec<&mut [f32]> = st.iter_mut().map(|v| &mut v[..]).collect();
        let got = ok("conv1d_silu", ops.conv1d_silu(&spans, &x, fx.conv, &mut sm));
        let mut sr: Vec<&mut [f32]> = st_ref.iter_mut().map(|v| &mut v[..]).collect();
        let want = ok("reference conv1d_silu", host.conv1d_silu(&spans, &x, fx.conv, &mut sr));
        check(&mut r, "conv1d_silu".into(), max_rel(&got.data, &want.data), tol.rel);
        check(&mut r, "conv1d_silu state".into(), max_rel(&st.concat(), &st_ref.concat()), tol.rel);
    }

    // delta_prep, then the delta rule (every form) over three sequences with their states carried.
    let dp = DeltaPrep { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48, eps: 1e-6, a: fx.a, dt_bias: fx.dt_bias };
    let dh = DeltaHeads { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48 };
    let s_len = 4 * 48 * 32;
    for mode in [DeltaMode::Auto, DeltaMode::Recurrent, DeltaMode::Chunked] {
        let (mut st, mut st_ref) = (vec![vec![0f32; s_len]; 3], vec![vec![0f32; s_len]; 3]);
        for step in steps {
            let spans = spans_of(&step, &[0; 3]);
            let n = step.iter().sum();
            let cu = rng.mat(n, 2 * 2 * 32 + 4 * 48, 1.0);
            let (b, al) = (rng.mat(n, 4, 3.0), rng.mat(n, 4, 3.0));
            let din: DeltaIn = ops.delta_prep(dp, &cu, &b, &al).unwrap_or_else(|e| panic!("delta_prep: {e}"));
            let want = host.delta_prep(dp, &cu, &b, &al).unwrap();
            for (name, g, w) in [
                ("q", &din.q, &want.q),
                ("k", &din.k, &want.k),
                ("v", &din.v, &want.v),
                ("g", &din.g, &want.g),
                ("beta", &din.beta, &want.beta),
            ] {
                check(&mut r, format!("delta_prep {name}"), max_rel(&g.data, &w.data), tol.rel);
            }
            let mut sm: Vec<&mut [f32]> = st.iter_mut().map(|v| &mut v[..]).collect();
            let got = ok("gated_delta_rule", ops.gated_delta_rule(dh, &spans, &want, &mut sm, mode));
            let mut sr: Vec<&mut [f32]> = st_ref.iter_mut().map(|v| &mut v[..]).collect();
            let w = ok("reference gated_delta_rule", host.gated_delta_rule(dh, &spans, &want, &mut sr, mode));
            check(&mut r, "gated_delta_rule".into(), max_rel(&got.data, &w.data), tol.rel);
            check(&mut r, "gated_delta_rule state".into(), max_rel(&st.concat(), &st_ref.concat()), tol.rel);
        }
    }

    // route (ids exact, weights close) and the MoE on that routing.
    for n in TOKENS {
        let logits = rng.mat(n, fx.n_expert, 3.0);
        let got: Routing = ops.route(&logits, fx.moe_k).unwrap_or_else(|e| panic!("route: {e}"));
        let want = host.route(&logits, fx.moe_k).unwrap();
        assert_eq!(got.ids, want.ids, "route: expert ids differ from the reference ({n} tokens)");
        check(&mut r, "route weights".into(), max_rel(&got.weights, &want.weights), tol.rel);
        let x = rng.mat(n, D_MOE, 1.0);
        let gs = rng.mat(n, 1, 2.0);
        let got = ok("moe", ops.moe(LayerIdx(0), &x, &want, &gs));
        pooled.add("moe".into(), &got.data, &ok("reference moe", host.moe(LayerIdx(0), &x, &want, &gs)).data);
    }
    pooled.finish(&mut r, tol.quant_nmse);

    shape_errors(&*ops, &fx);
    r
}

/// Spans of `counts` tokens, rows in order, each sequence at position `pos[i]`.
fn spans_of(counts: &[usize], pos: &[usize]) -> Vec<SeqSpan> {
    let mut row0 = 0;
    counts
        .iter()
        .zip(pos)
        .map(|(&n, &pos0)| {
            let sp = SeqSpan { row0, n, pos0 };
            row0 += n;
            sp
        })
        .collect()
}

/// Every op rejects inputs of the wrong shape (or unknown ids) with an error naming the op.
fn shape_errors(ops: &dyn Ops, fx: &Fixture) {
    let named = |op: &str, res: Result<(), crate::OpError>| match res {
        Ok(()) => panic!("{op}: accepted a bad input"),
        Err(e) => assert!(e.op == op && e.to_string().contains(op), "{op}: error does not name the op: {e}"),
    };
    let (ty, k, rows, id) = fx.mats[4];
    let bad = Mat::zeros(2, k + 1);
    named("matmul", ops.matmul(id, &bad).map(drop));
    named("matmul", ops.matmul(WeightId(99_999), &Mat::zeros(1, k)).map(drop));
    named("matmul_many", ops.matmul_many(&[id, id], &bad).map(drop));
    named("get_rows", ops.get_rows(id, &[rows as u32]).map(drop));
    named("rms_norm", ops.rms_norm(&Mat::zeros(1, 65), fx.norm64, 1e-6).map(drop));
    named("rms_norm", ops.rms_norm(&Mat::zeros(1, 64), id, 1e-6).map(drop));
    named("add", ops.add(&mut Mat::zeros(2, 3), &Mat::zeros(3, 2)));
    named("gate", ops.gate(&mut Mat::zeros(2, 3), &Mat::zeros(2, 4), Gate::Silu));
    named("select_rows", ops.select_rows(&Mat::zeros(2, 3), &[2]).map(drop));
    let prep =
        AttnPrep { n_head: 4, n_head_kv: 2, head_dim: 64, n_rot: 16, rope_base: 1e7, eps: 1e-6, q_norm: fx.norm64, k_norm: fx.norm64 };
    named("attn_prep", ops.attn_prep(prep, &Mat::zeros(2, 4 * 2 * 64), &Mat::zeros(2, 128), &[0]).map(drop));
    let (mut kc, mut vc) = (KvRows::new(KvType::F16, 128), KvRows::new(KvType::F16, 128));
    let one = [SeqSpan { row0: 0, n: 1, pos0: 0 }];
    named("kv_append", ops.kv_append(&one, &Mat::zeros(1, 64), &Mat::zeros(1, 64), &mut [KvCache { k: &mut kc, v: &mut vc }]));
    named("kv_append", ops.kv_append(&one, &Mat::zeros(2, 128), &Mat::zeros(2, 128), &mut [KvCache { k: &mut kc, v: &mut vc }]));
    let heads = AttnHeads { n_head: 4, n_head_kv: 2, head_dim: 64, scale: 1.0 };
    named("attention", ops.attention(heads, &one, &Mat::zeros(1, 256), &[KvCache { k: &mut kc, v: &mut vc }]).map(drop));
    named("conv1d_silu", ops.conv1d_silu(&one, &Mat::zeros(1, 40), fx.conv, &mut [&mut [0.0; 7][..]]).map(drop));
    named("conv1d_silu", ops.conv1d_silu(&one, &Mat::zeros(1, 40), fx.conv, &mut []).map(drop));
    let dp = DeltaPrep { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48, eps: 1e-6, a: fx.a, dt_bias: fx.dt_bias };
    named("delta_prep", ops.delta_prep(dp, &Mat::zeros(1, 10), &Mat::zeros(1, 4), &Mat::zeros(1, 4)).map(drop));
    let z = |d| Mat::zeros(1, d);
    let din = DeltaIn { q: z(64), k: z(64), v: z(192), g: z(4), beta: z(4) };
    let dh = DeltaHeads { n_k_head: 2, n_v_head: 4, d_k: 32, d_v: 48 };
    named("gated_delta_rule", ops.gated_delta_rule(dh, &one, &din, &mut [&mut [0.0; 10][..]], DeltaMode::Auto).map(drop));
    let two = [SeqSpan { row0: 0, n: 1, pos0: 0 }, SeqSpan { row0: 2, n: 1, pos0: 0 }];
    let mut s2 = [vec![0f32; 4 * 48 * 32], vec![0f32; 4 * 48 * 32]];
    let mut sm: Vec<&mut [f32]> = s2.iter_mut().map(|v| &mut v[..]).collect();
    named("gated_delta_rule", ops.gated_delta_rule(dh, &two, &din, &mut sm, DeltaMode::Auto).map(drop));
    named("route", ops.route(&Mat::zeros(1, 6), 7).map(drop));
    let routing = Routing { n_tok: 1, k: 1, ids: vec![ExpertId(fx.n_expert as u16)], weights: vec![1.0] };
    named("moe", ops.moe(LayerIdx(0), &Mat::zeros(1, D_MOE), &routing, &Mat::zeros(1, 1)).map(drop));
    named("moe", ops.moe(LayerIdx(7), &Mat::zeros(1, D_MOE), &routing, &Mat::zeros(1, 1)).map(drop));
    let _ = ty;
}
