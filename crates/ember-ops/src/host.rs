//! [`HostBackend`]: the [`Ops`] of any host kernel set ([`HostKernels`]): handles index an arena
//! of [`Mat`]s, state lives in a [`HostStore`]. [`RefKernels`]: every op as written in
//! [`crate::reference`], on one thread; over it, [`HostOps`] is the reference backend that the
//! conformance suite ([`crate::conformance`]) runs every other backend against.

use std::sync::Arc;

use crate::{
    AttnHeads, AttnMats, AttnPrep, DeltaHeads, DeltaMats, DeltaMode, DeltaPrep, DeviceId, Gate, HostBackend, HostKernels, KvCache,
    LayerIdx, Mat, MoeSlot, OpError, OpResult, Ops, PagePool, Registry, RouteTable, SeqSpan, WeightId, WeightSet, WeightView,
};
use crate::{check, reference};

const DEV: DeviceId = DeviceId::Host;

/// The reference kernels.
#[derive(Debug, Default, Clone)]
pub struct RefKernels {
    weights: Registry,
}

impl RefKernels {
    pub fn new() -> Self {
        RefKernels { weights: Registry::new(DEV) }
    }
}

/// The reference backend.
pub type HostOps = HostBackend<RefKernels>;

impl HostOps {
    /// A reference backend with `weights` registered.
    pub fn with_weights(weights: Arc<WeightSet>) -> Self {
        let mut h = HostBackend::new(RefKernels::new());
        // unwrap_or_else: registering on the host only stores the set.
        h.register(weights).unwrap_or_else(|e| panic!("{e}"));
        h
    }
}

/// The MoE of `layer` as expert slots (routed experts by increasing id, then the shared one),
/// computed by `matmul`: shared by the host backends so they sum in the same order.
pub fn moe_via(
    op: &'static str,
    reg: &Registry,
    layer: LayerIdx,
    x: &Mat,
    routing: &RouteTable,
    shared_gate: &Mat,
    run: impl FnOnce(&[MoeSlot], &Mat) -> OpResult<Mat>,
) -> OpResult<Mat> {
    let m = reg.moe(op, layer)?;
    check::moe(op, reg_device(reg), x, routing, shared_gate, m.n_expert)?;
    let (routed, shared) = reference::moe_tokens(routing, m.n_expert, shared_gate);
    let mut slots = Vec::with_capacity(routed.len() + 1);
    for (e, toks) in &routed {
        slots.push(MoeSlot { expert: reg.expert(op, layer, *e)?, tokens: toks });
    }
    slots.push(MoeSlot { expert: reg.shared_expert(op, layer)?, tokens: &shared });
    let d = slots[0].expert.down.n_rows;
    for s in &slots {
        let e = &s.expert;
        if e.gate.k != x.d || e.up.k != x.d || e.gate.n_rows != e.up.n_rows || e.down.k != e.gate.n_rows || e.down.n_rows != d {
            return Err(OpError::new(op, reg_device(reg), format!("x {}x{}, {layer}", x.n, x.d), "expert shapes do not chain"));
        }
    }
    run(&slots, x)
}

/// Runs `f(i, span, rows)` for every span (`rows`: the span's rows of `x`, borrowed when one span
/// covers all) and stacks the outputs [ΣT, width]: how host backends run the sequence ops.
pub fn per_span(spans: &[SeqSpan], x: &Mat, width: usize, mut f: impl FnMut(usize, &SeqSpan, &Mat) -> OpResult<Mat>) -> OpResult<Mat> {
    if let [sp] = spans {
        return f(0, sp, x);
    }
    let mut out = Mat::zeros(x.n, width);
    for (i, sp) in spans.iter().enumerate() {
        let y = f(i, sp, &x.rows(sp.row0, sp.n))?;
        out.set_rows(sp.row0, &y);
    }
    Ok(out)
}

/// The rows of span `sp` of every input of the delta rule (all of it for one span).
pub fn delta_rows<'a>(spans: &[SeqSpan], x: &'a DeltaMats, sp: &SeqSpan) -> std::borrow::Cow<'a, DeltaMats> {
    if spans.len() == 1 { std::borrow::Cow::Borrowed(x) } else { std::borrow::Cow::Owned(x.rows(sp.row0, sp.n)) }
}

fn reg_device(_reg: &Registry) -> DeviceId {
    DEV
}

/// The matrix weights `ws` for an op on `x`, each checked against `x` (matmul, matmul_many).
pub fn checked_views<'a>(op: &'static str, reg: &'a Registry, ws: &[WeightId], x: &Mat) -> OpResult<Vec<WeightView<'a>>> {
    ws.iter()
        .map(|&w| {
            check::matmul(op, DEV, reg.info(op, w)?, x)?;
            reg.view(op, w)
        })
        .collect()
}

/// The host ops whose every host backend runs the reference, checked: shared by [`HostOps`] and
/// the CPU backend so both check and compute the same way.
pub fn get_rows(reg: &Registry, w: WeightId, ids: &[u32]) -> OpResult<Mat> {
    const OP: &str = "get_rows";
    check::get_rows(OP, DEV, reg.info(OP, w)?, ids)?;
    Ok(reference::get_rows(&reg.view(OP, w)?, ids))
}

pub fn add(h: &mut Mat, x: &Mat) -> OpResult<()> {
    check::same("add", DEV, h, x)?;
    reference::add(h, x);
    Ok(())
}

pub fn delta_prep(reg: &Registry, s: DeltaPrep, cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<DeltaMats> {
    const OP: &str = "delta_prep";
    let (a, dt) = (reg.vector(OP, s.a)?, reg.vector(OP, s.dt_bias)?);
    check::delta_prep(OP, DEV, &s, (a.len(), dt.len()), cu, b, alpha)?;
    Ok(reference::delta_prep(&s, a, dt, cu, b, alpha))
}

pub fn route(logits: &Mat, k: usize) -> OpResult<RouteTable> {
    check::route("route", DEV, logits, k)?;
    Ok(reference::route(logits, k))
}

pub fn select_rows(x: &Mat, rows: &[usize]) -> OpResult<Mat> {
    check::select_rows("select_rows", DEV, x, rows)?;
    Ok(reference::select_rows(x, rows))
}

/// [`Ops::kv_append`] on host caches: every sequence's rows pushed in turn.
pub fn kv_append_each(spans: &[SeqSpan], k: &Mat, v: &Mat, caches: &mut [KvCache<'_>], pool: &PagePool) -> OpResult<()> {
    const OP: &str = "kv_append";
    check::spans(OP, DEV, spans, k.n, caches.len())?;
    check::same(OP, DEV, k, v)?;
    for (sp, c) in spans.iter().zip(caches.iter_mut()) {
        let (ks, vs) = (k.rows(sp.row0, sp.n), v.rows(sp.row0, sp.n));
        check::kv_append(OP, DEV, c.k, &ks)?;
        check::kv_append(OP, DEV, c.v, &vs)?;
        let fail = |e: String| OpError::new(OP, DEV, format!("{}x{}", ks.n, ks.d), e);
        c.k.push(&ks, pool).map_err(fail)?;
        c.v.push(&vs, pool).map_err(fail)?;
    }
    Ok(())
}

impl HostKernels for RefKernels {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn device(&self) -> DeviceId {
        DEV
    }

    fn register(&mut self, weights: Arc<WeightSet>) -> OpResult<()> {
        self.weights.set(weights);
        Ok(())
    }

    fn get_rows(&self, w: WeightId, ids: &[u32]) -> OpResult<Mat> {
        get_rows(&self.weights, w, ids)
    }

    fn matmul(&self, w: WeightId, x: &Mat) -> OpResult<Mat> {
        let views = checked_views("matmul", &self.weights, &[w], x)?;
        Ok(reference::matmul(&views[0], x))
    }

    fn matmul_many(&self, ws: &[WeightId], x: &Mat) -> OpResult<Vec<Mat>> {
        Ok(checked_views("matmul_many", &self.weights, ws, x)?.iter().map(|v| reference::matmul(v, x)).collect())
    }

    fn rms_norm(&self, x: &Mat, w: WeightId, eps: f32) -> OpResult<Mat> {
        const OP: &str = "rms_norm";
        let w = self.weights.vector(OP, w)?;
        check::rms_norm(OP, DEV, x, w.len())?;
        Ok(reference::rms_norm(x, w, eps))
    }

    fn add(&self, h: &mut Mat, x: &Mat) -> OpResult<()> {
        add(h, x)
    }

    fn attn_prep(&self, s: AttnPrep, qg: &Mat, k: &Mat, pos: &[u32]) -> OpResult<AttnMats> {
        const OP: &str = "attn_prep";
        let (qn, kn) = (self.weights.vector(OP, s.q_norm)?, self.weights.vector(OP, s.k_norm)?);
        check::attn_prep(OP, DEV, &s, (qn.len(), kn.len()), qg, k, pos)?;
        Ok(reference::attn_prep(&s, qn, kn, qg, k, pos))
    }

    fn kv_append(&self, spans: &[SeqSpan], k: &Mat, v: &Mat, caches: &mut [KvCache<'_>], pool: &PagePool) -> OpResult<()> {
        kv_append_each(spans, k, v, caches, pool)
    }

    fn attention(&self, h: AttnHeads, spans: &[SeqSpan], q: &Mat, caches: &[KvCache<'_>]) -> OpResult<Mat> {
        const OP: &str = "attention";
        check::spans(OP, DEV, spans, q.n, caches.len())?;
        per_span(spans, q, q.d, |i, sp, q| {
            let (s, c) = (h.shape(sp), &caches[i]);
            check::attention(OP, DEV, &s, q, c.k, c.v)?;
            Ok(reference::attention(s, q, c.k, c.v))
        })
    }

    fn conv1d_silu(&self, spans: &[SeqSpan], x: &Mat, w: WeightId, states: &mut [&mut [f32]]) -> OpResult<Mat> {
        const OP: &str = "conv1d_silu";
        let w = self.weights.vector(OP, w)?;
        check::spans(OP, DEV, spans, x.n, states.len())?;
        per_span(spans, x, x.d, |i, _, x| {
            check::conv(OP, DEV, x, w.len(), states[i].len())?;
            Ok(reference::conv1d_silu(x, w, states[i]))
        })
    }

    fn delta_prep(&self, s: DeltaPrep, cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<DeltaMats> {
        delta_prep(&self.weights, s, cu, b, alpha)
    }

    fn gated_delta_rule(
        &self,
        h: DeltaHeads,
        spans: &[SeqSpan],
        x: &DeltaMats,
        states: &mut [&mut [f32]],
        mode: DeltaMode,
    ) -> OpResult<Mat> {
        const OP: &str = "gated_delta_rule";
        check::spans(OP, DEV, spans, x.q.n, states.len())?;
        per_span(spans, &x.q, h.n_v_head * h.d_v, |i, sp, _| {
            let (s, x) = (h.shape(sp.n), delta_rows(spans, x, sp));
            let st = &mut *states[i];
            check::delta_rule(OP, DEV, &s, &x, st.len())?;
            Ok(if mode.chunked(sp.n) {
                reference::delta_rule_chunked(s, &x.q, &x.k, &x.v, &x.g, &x.beta, st)
            } else {
                reference::delta_rule_recurrent(s, &x.q, &x.k, &x.v, &x.g, &x.beta, st)
            })
        })
    }

    fn gate(&self, y: &mut Mat, g: &Mat, act: Gate) -> OpResult<()> {
        check::gate("gate", DEV, y, g, act)?;
        reference::gate(y, g, act);
        Ok(())
    }

    fn route(&self, logits: &Mat, k: usize) -> OpResult<RouteTable> {
        route(logits, k)
    }

    fn moe(&self, layer: LayerIdx, x: &Mat, routing: &RouteTable, shared_gate: &Mat) -> OpResult<Mat> {
        moe_via("moe", &self.weights, layer, x, routing, shared_gate, |slots, x| Ok(reference::moe(reference::matmul, slots, x)))
    }

    fn select_rows(&self, x: &Mat, rows: &[usize]) -> OpResult<Mat> {
        select_rows(x, rows)
    }
}
