//! The DeltaNet ops on the device: the conv, prep and the delta rule.

use ember_ops::{
    DeltaHeads, DeltaIn, DeltaMats, DeltaMode, DeltaPrep, GatedNorm, LayerIdx, Mat, OpError, OpResult, StateKind, Tensor, WeightId, check,
};

use super::arena::Ins;
use super::{CudaOps, act_of, cuda, shape_of};
use crate::ops::{ConvPart, DeltaPrepIn, DeltaPrepOut, DeltaPrepShape, DeltaShape, HeadNorm, SeqRows, StateAt};

impl CudaOps {
    /// [`ember_ops::Ops::conv1d_silu`]: every sequence's rows in one launch, its conv state carried.
    pub(super) fn conv_op(&mut self, layer: LayerIdx, x: Tensor, w: WeightId) -> OpResult<Tensor> {
        const OP: &str = "conv1d_silu";
        let dev = self.dev;
        self.rows_check(OP, x)?;
        let d = self.store.ordinal(OP, layer, StateKind::Delta)?;
        self.arena.check(OP, x)?;
        self.live_slots(OP)?;
        let wv = self.weights.vector(OP, w)?;
        check::spans(OP, dev, &self.spans, x.n, self.spans.len())?;
        let conv = self.store.layout.conv;
        for sp in &self.spans {
            check::conv(OP, dev, &Mat { n: sp.n, d: x.d, data: Vec::new() }, wv.len(), conv)?;
        }
        let kernel = wv.len().checked_div(x.d).unwrap_or(0);
        let (at, _) = self.delta_at(d);
        let y = self.arena.alloc(&self.gpu, OP, x.n, x.d)?;
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let state = self.store.delta.as_mut().ok_or_else(|| OpError::new(OP, dev, "", "the store is not configured"))?;
        let (ins, mut outs) = self.arena.split(y.id);
        self.gpu.conv1d_silu_seqs(&ins[x.id as usize], x.n, x.d, wv, kernel, seqs, state, at, outs[0]).map_err(cuda(OP, dev))?;
        Ok(y)
    }

    /// [`ember_ops::Ops::delta_prep`].
    pub(super) fn prep_op(&mut self, s: DeltaPrep, cu: Tensor, b: Tensor, alpha: Tensor) -> OpResult<DeltaIn> {
        const OP: &str = "delta_prep";
        for t in [cu, b, alpha] {
            self.arena.check(OP, t)?;
        }
        let (av, dt) = (self.weights.vector(OP, s.a)?, self.weights.vector(OP, s.dt_bias)?);
        check::delta_prep(OP, self.dev, &s, (av.len(), dt.len()), &shape_of(cu), &shape_of(b), &shape_of(alpha))?;
        let (n, nk, dk, nv, dv) = (cu.n, s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        let q = self.arena.alloc(&self.gpu, OP, n, nk * dk)?;
        let k = self.arena.alloc(&self.gpu, OP, n, nk * dk)?;
        let v = self.arena.alloc(&self.gpu, OP, n, nv * dv)?;
        let g = self.arena.alloc(&self.gpu, OP, n, nv)?;
        let beta = self.arena.alloc(&self.gpu, OP, n, nv)?;
        let (ins, mut outs) = self.arena.split(q.id);
        let [qb, kb, vb, gb, bb, ..] = &mut outs[..] else { unreachable!("five outputs were just allocated") };
        let shape = DeltaPrepShape { n_tok: n, n_k_head: nk, d_k: dk, n_v_head: nv, d_v: dv, eps: s.eps };
        let input = DeltaPrepIn { cu: &ins[cu.id as usize], b: &ins[b.id as usize], alpha: &ins[alpha.id as usize], a: av, dt_bias: dt };
        self.gpu.delta_prep(shape, input, DeltaPrepOut { q: qb, k: kb, v: vb, g: gb, beta: bb }).map_err(cuda(OP, self.dev))?;
        Ok(DeltaIn { q, k, v, g, beta })
    }

    /// [`ember_ops::Ops::conv_delta_prep`]: [`CudaOps::conv_op`] then [`CudaOps::prep_op`], or,
    /// with `EMBER_CONV_PREP_FUSED=1`, one launch (`Gpu::conv_delta_prep`) when every sequence
    /// of the step has one row (decode) and the conv has 4 taps: the same bits either way. Off
    /// until it has run on a GPU and been measured (docs/perf.md g28; bench/gpu/next/callW.sh).
    pub(super) fn conv_prep_op(
        &mut self,
        layer: LayerIdx,
        x: Tensor,
        w: WeightId,
        s: DeltaPrep,
        b: Tensor,
        alpha: Tensor,
    ) -> OpResult<DeltaIn> {
        const OP: &str = "conv_delta_prep";
        static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let (nk, dk, nv, dv) = (s.n_k_head, s.d_k, s.n_v_head, s.d_v);
        let taps = self.weights.vector(OP, w)?.len().checked_div(x.d).unwrap_or(0);
        let fits = taps == 4
            && x.d == 2 * nk * dk + nv * dv
            && dk <= crate::ops::CONV_PREP_MAX_DK
            && !self.spans.is_empty()
            && self.spans.iter().all(|sp| sp.n == 1);
        let on = *FUSED.get_or_init(|| std::env::var_os("EMBER_CONV_PREP_FUSED").is_some_and(|v| v == "1"));
        if !fits || !on {
            let cu = self.conv_op(layer, x, w)?;
            return self.prep_op(s, cu, b, alpha);
        }
        let dev = self.dev;
        self.rows_check(OP, x)?;
        let d = self.store.ordinal(OP, layer, StateKind::Delta)?;
        for t in [x, b, alpha] {
            self.arena.check(OP, t)?;
        }
        self.live_slots(OP)?;
        check::spans(OP, dev, &self.spans, x.n, self.spans.len())?;
        let conv = self.store.layout.conv;
        let wv = self.weights.vector(OP, w)?;
        check::conv(OP, dev, &Mat { n: 1, d: x.d, data: Vec::new() }, wv.len(), conv)?;
        let (av, dt) = (self.weights.vector(OP, s.a)?, self.weights.vector(OP, s.dt_bias)?);
        check::delta_prep(OP, dev, &s, (av.len(), dt.len()), &shape_of(x), &shape_of(b), &shape_of(alpha))?;
        let (at, _) = self.delta_at(d);
        let n = x.n;
        let q = self.arena.alloc(&self.gpu, OP, n, nk * dk)?;
        let k = self.arena.alloc(&self.gpu, OP, n, nk * dk)?;
        let v = self.arena.alloc(&self.gpu, OP, n, nv * dv)?;
        let g = self.arena.alloc(&self.gpu, OP, n, nv)?;
        let beta = self.arena.alloc(&self.gpu, OP, n, nv)?;
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let state = self.store.delta.as_mut().ok_or_else(|| OpError::new(OP, dev, "", "the store is not configured"))?;
        let (ins, mut outs) = self.arena.split(q.id);
        let [qb, kb, vb, gb, bb, ..] = &mut outs[..] else { unreachable!("five outputs were just allocated") };
        let shape = DeltaPrepShape { n_tok: n, n_k_head: nk, d_k: dk, n_v_head: nv, d_v: dv, eps: s.eps };
        let (xb, bin, ain) = (&ins[x.id as usize], &ins[b.id as usize], &ins[alpha.id as usize]);
        let input = DeltaPrepIn { cu: xb, b: bin, alpha: ain, a: av, dt_bias: dt };
        let part = ConvPart { x: xb, w: wv, seqs, state, at };
        self.gpu.conv_delta_prep(shape, part, input, DeltaPrepOut { q: qb, k: kb, v: vb, g: gb, beta: bb }).map_err(cuda(OP, dev))?;
        Ok(DeltaIn { q, k, v, g, beta })
    }

    /// [`ember_ops::Ops::delta_rule_norm`]: [`CudaOps::rule_op`] then the gated norm, or, with
    /// `EMBER_DELTA_NORM_FUSED=1`, one launch (`Gpu::delta_rule_norm_seqs`: each head's last
    /// block normalises it; `=2`: its cluster form, each head's first block normalising it after
    /// the cluster's barrier, where the GPU and d_v allow) when every sequence of the step has one row (decode) and a value head
    /// fits the norm's warp: the same bits either way. Off: measured on an H100 (docs/perf.md
    /// g30), one sequence's step chain +6 us (the rule +3.5 us a layer, the norm's 4.1 us launch
    /// gone, the kernels after it slower by about the rest), 16 sequences' decode 5 % slower.
    pub(super) fn rule_norm_op(
        &mut self,
        layer: LayerIdx,
        h: DeltaHeads,
        x: DeltaIn,
        mode: DeltaMode,
        norm: GatedNorm,
        z: Tensor,
    ) -> OpResult<Tensor> {
        const OP: &str = "delta_rule_norm";
        static FUSED: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
        let form = *FUSED.get_or_init(|| match std::env::var("EMBER_DELTA_NORM_FUSED").as_deref() {
            Ok("1") => 1,
            Ok("2") => 2,
            _ => 0,
        });
        let on = form == 1 || form == 2 && self.gpu.delta_norm_cluster_fits(h.d_v);
        let width = if on { self.weights.vector(OP, norm.w)?.len() } else { 0 };
        let fits = on
            && width == h.d_v
            && h.d_v.is_multiple_of(32)
            && h.d_v <= crate::ops::DELTA_NORM_MAX_DV
            && !self.spans.is_empty()
            && self.spans.iter().all(|sp| sp.n == 1);
        if !fits {
            let o = self.rule_op(layer, h, x, mode)?;
            return ember_ops::Ops::rms_norm_gate(self, o, norm.w, norm.eps, z, norm.act);
        }
        let dev = self.dev;
        self.arena.check(OP, z)?;
        let (at, shape) = self.rule_checks(OP, layer, h, x)?;
        let n = x.q.n;
        let o_shape = Mat { n, d: h.n_v_head * h.d_v, data: Vec::new() };
        check::same(OP, dev, &shape_of(z), &o_shape)?;
        check::rms_norm(OP, dev, &o_shape, width)?;
        let lens: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
        // The two ops' handles: o, the delta rule's (unused) scratch, the norm's output.
        let o = self.arena.alloc(&self.gpu, OP, n, h.n_v_head * h.d_v)?;
        self.arena.alloc(&self.gpu, OP, 1, 1)?;
        let y = self.arena.alloc(&self.gpu, OP, n, h.n_v_head * h.d_v)?;
        // One token under Fast: the int8 copy the output projection reads, as rms_norm_gate's.
        let q8 = self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, o_shape.d, n, self.precision);
        let wv = self.weights.vector(OP, norm.w)?;
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let state = self.store.delta.as_mut().ok_or_else(|| OpError::new(OP, dev, "", "the store is not configured"))?;
        let (ins, mut outs) = self.arena.split(o.id);
        let [ob, _, yb, ..] = &mut outs[..] else { unreachable!("three buffers were just allocated") };
        let input = rule_input(&ins, x);
        let hn = HeadNorm { w: wv, eps: norm.eps, gate: &ins[z.id as usize], act: act_of(norm.act) };
        let generation =
            self.gpu.delta_rule_norm_seqs(shape, input, seqs, &lens, state, at, ob, hn, yb, q8, form == 2).map_err(cuda(OP, dev))?;
        if let Some(generation) = generation {
            self.q8_x = Some((y.id, generation));
        }
        Ok(y)
    }

    /// [`ember_ops::Ops::gated_delta_rule`]: the scan, the chunked form, or both split by length.
    pub(super) fn rule_op(&mut self, layer: LayerIdx, h: DeltaHeads, x: DeltaIn, mode: DeltaMode) -> OpResult<Tensor> {
        const OP: &str = "gated_delta_rule";
        let dev = self.dev;
        let (at, shape) = self.rule_checks(OP, layer, h, x)?;
        let n = x.q.n;
        // Sequences of at least `from` tokens take the chunked form, the others the scan
        // (always one token: decode).
        let from = match mode {
            _ if !shape.chunkable() => usize::MAX,
            DeltaMode::Recurrent => usize::MAX,
            DeltaMode::Chunked => 2,
            DeltaMode::Auto => crate::ops::DELTA_AUTO_CHUNKED_FROM,
        };
        let lens: Vec<usize> = self.spans.iter().map(|s| s.n).collect();
        let chunked = lens.iter().any(|&l| l >= from);
        // The output, then the chunked form's scratch (always allocated, so the handles that
        // follow do not depend on the mode).
        let y = self.arena.alloc(&self.gpu, OP, n, h.n_v_head * h.d_v)?;
        let (sn, sd) = if chunked { (n, shape.chunk_scratch() / n) } else { (1, 1) };
        self.arena.alloc(&self.gpu, OP, sn, sd)?;
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let state = self.store.delta.as_mut().ok_or_else(|| OpError::new(OP, dev, "", "the store is not configured"))?;
        let (ins, mut outs) = self.arena.split(y.id);
        let (out, scratch) = outs.split_at_mut(1);
        let input = rule_input(&ins, x);
        self.gpu
            .delta_rule_seqs_split(shape, input, seqs, &lens, state, at, out[0], scratch[0], from)
            .map_err(|e| OpError::new(OP, dev, "", e.to_string()))?;
        Ok(y)
    }

    /// The checks of a step's delta rule on `layer` (its rows, inputs, slots and state), then
    /// where its recurrent state lies and the kernels' shape.
    fn rule_checks(&mut self, op: &'static str, layer: LayerIdx, h: DeltaHeads, x: DeltaIn) -> OpResult<(StateAt, DeltaShape)> {
        let dev = self.dev;
        self.rows_check(op, x.q)?;
        let d = self.store.ordinal(op, layer, StateKind::Delta)?;
        for t in [x.q, x.k, x.v, x.g, x.beta] {
            self.arena.check(op, t)?;
        }
        self.live_slots(op)?;
        check::spans(op, dev, &self.spans, x.q.n, self.spans.len())?;
        let mats = DeltaMats { q: shape_of(x.q), k: shape_of(x.k), v: shape_of(x.v), g: shape_of(x.g), beta: shape_of(x.beta) };
        check::delta_rule(op, dev, &h.shape(x.q.n), &mats, self.store.layout.rec)?;
        let (_, at) = self.delta_at(d);
        Ok((at, DeltaShape { n_tok: x.q.n, n_k_head: h.n_k_head, d_k: h.d_k, n_v_head: h.n_v_head, d_v: h.d_v }))
    }
}

/// The delta rule's input buffers among the arena's.
fn rule_input<'a>(ins: &'a Ins<'_>, x: DeltaIn) -> crate::ops::DeltaIn<'a> {
    let b = |t: Tensor| &ins[t.id as usize];
    crate::ops::DeltaIn { q: b(x.q), k: b(x.k), v: b(x.v), g: b(x.g), beta: b(x.beta) }
}
