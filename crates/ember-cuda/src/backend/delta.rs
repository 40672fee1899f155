//! The DeltaNet ops on the device: the conv, prep and the delta rule.

use ember_ops::{
    DeltaHeads, DeltaIn, DeltaMats, DeltaMode, DeltaPrep, Gate, LayerIdx, Mat, OpError, OpResult, Ops, StateKind, Tensor, WeightId, check,
};

use super::{CudaOps, act_of, cuda, shape_of};
use crate::ops::{DELTA_NORM_TAIL_MAX, DeltaPrepIn, DeltaPrepOut, DeltaPrepShape, DeltaShape, GatedNorm, SeqRows};

/// The gated norm after a delta rule ([`ember_ops::Ops::gated_delta_rule_norm`]).
pub(super) struct RuleNorm {
    pub w: WeightId,
    pub eps: f32,
    pub g: Tensor,
    pub act: Gate,
}

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

    /// [`ember_ops::Ops::gated_delta_rule`]: the scan, the chunked form, or both split by length;
    /// with `norm`, [`ember_ops::Ops::gated_delta_rule_norm`]: the norm in the scan's launch
    /// where every sequence is scanned and the head fits the tail (`EMBER_DELTA_NORM_TAIL=1`),
    /// else [`ember_ops::Ops::rms_norm_gate`] after it. Either way the step allocates the same
    /// handles in the same order (the rule's output, the chunked form's scratch, the norm's
    /// output), so what follows does not depend on the form.
    pub(super) fn rule_op(
        &mut self,
        layer: LayerIdx,
        h: DeltaHeads,
        x: DeltaIn,
        mode: DeltaMode,
        norm: Option<RuleNorm>,
    ) -> OpResult<Tensor> {
        const OP: &str = "gated_delta_rule";
        let dev = self.dev;
        self.rows_check(OP, x.q)?;
        let d = self.store.ordinal(OP, layer, StateKind::Delta)?;
        for t in [x.q, x.k, x.v, x.g, x.beta] {
            self.arena.check(OP, t)?;
        }
        self.live_slots(OP)?;
        check::spans(OP, dev, &self.spans, x.q.n, self.spans.len())?;
        let mats = DeltaMats { q: shape_of(x.q), k: shape_of(x.k), v: shape_of(x.v), g: shape_of(x.g), beta: shape_of(x.beta) };
        check::delta_rule(OP, dev, &h.shape(x.q.n), &mats, self.store.layout.rec)?;
        let (_, at) = self.delta_at(d);
        let n = x.q.n;
        let shape = DeltaShape { n_tok: n, n_k_head: h.n_k_head, d_k: h.d_k, n_v_head: h.n_v_head, d_v: h.d_v };
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
        let tail = match &norm {
            Some(nm) if self.gpu.delta_norm_tail_on() && !chunked => self.norm_tail_fits(h, y, nm)?,
            _ => None,
        };
        let seqs = SeqRows { row0: &self.step.seq_row0, n: &self.step.seq_n, slot: &self.step.seq_slot, n_seq: self.spans.len() };
        let state = self.store.delta.as_mut().ok_or_else(|| OpError::new(OP, dev, "", "the store is not configured"))?;
        let (ins, mut outs) = self.arena.split(y.id);
        let (out, rest) = outs.split_at_mut(1);
        let input = crate::ops::DeltaIn {
            q: &ins[x.q.id as usize],
            k: &ins[x.k.id as usize],
            v: &ins[x.v.id as usize],
            g: &ins[x.g.id as usize],
            beta: &ins[x.beta.id as usize],
        };
        let (Some((q8, yn)), Some(nm)) = (tail, &norm) else {
            self.gpu
                .delta_rule_seqs_split(shape, input, seqs, &lens, state, at, out[0], rest[0], from)
                .map_err(|e| OpError::new(OP, dev, "", e.to_string()))?;
            return match norm {
                Some(nm) => self.rms_norm_gate(y, nm.w, nm.eps, nm.g, nm.act),
                None => Ok(y),
            };
        };
        let wv = self.weights.vector(OP, nm.w)?;
        let gated = GatedNorm { w: wv, eps: nm.eps, gate: &ins[nm.g.id as usize], act: act_of(nm.act), y: rest[1] };
        let generation = self
            .gpu
            .delta_rule_seqs_norm(shape, input, seqs, state, at, out[0], gated, q8)
            .map_err(|e| OpError::new(OP, dev, "", e.to_string()))?;
        if let Some(generation) = generation {
            self.q8_x = Some((yn.id, generation));
        }
        Ok(yn)
    }

    /// Whether the gated norm after the rule's output `o` fits the scan's tail (d_v a multiple
    /// of 32, at most [`DELTA_NORM_TAIL_MAX`], the weight d_v long, the gate o's shape): if so
    /// the norm's output, allocated here, and whether it also takes the int8 copy (as
    /// [`ember_ops::Ops::rms_norm_gate`] would). The gate's and weight's checks are
    /// `rms_norm_gate`'s.
    fn norm_tail_fits(&mut self, h: DeltaHeads, o: Tensor, nm: &RuleNorm) -> OpResult<Option<(bool, Tensor)>> {
        const OP: &str = "rms_norm_gate";
        self.arena.check(OP, nm.g)?;
        check::same(OP, self.dev, &shape_of(o), &shape_of(nm.g))?;
        let wv = self.weights.vector(OP, nm.w)?;
        check::rms_norm(OP, self.dev, &shape_of(o), wv.len())?;
        if wv.len() != h.d_v || !h.d_v.is_multiple_of(32) || h.d_v > DELTA_NORM_TAIL_MAX {
            return Ok(None);
        }
        let q8 = self.gpu.uses_gemv_q8(ember_gguf::GgmlType::Q8_0, o.d, o.n, self.precision);
        Ok(Some((q8, self.arena.alloc(&self.gpu, OP, o.n, o.d)?)))
    }
}
