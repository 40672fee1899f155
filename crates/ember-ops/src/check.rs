//! Shape checks shared by every backend, so each op rejects the same inputs with the same
//! message whatever device runs it.

use crate::{
    AttnPrep, AttnShape, DeltaMats, DeltaPrep, DeltaShape, DeviceId, Gate, KvRows, Mat, OpError, OpResult, RouteTable, SeqSpan, WeightInfo,
};

fn dims(m: &Mat) -> String {
    format!("{}x{}", m.n, m.d)
}

fn err(op: &'static str, dev: DeviceId, shapes: String, cause: String) -> OpError {
    OpError::new(op, dev, shapes, cause)
}

pub fn matmul(op: &'static str, dev: DeviceId, w: &WeightInfo, x: &Mat) -> OpResult<()> {
    if x.d != w.k || x.data.len() != x.n * x.d {
        return Err(err(op, dev, format!("x {}, w {}", dims(x), w.describe()), format!("x has {} columns, weight rows have {}", x.d, w.k)));
    }
    Ok(())
}

pub fn same(op: &'static str, dev: DeviceId, a: &Mat, b: &Mat) -> OpResult<()> {
    if (a.n, a.d) != (b.n, b.d) {
        return Err(err(op, dev, format!("{} and {}", dims(a), dims(b)), "shapes differ".into()));
    }
    Ok(())
}

pub fn rms_norm(op: &'static str, dev: DeviceId, x: &Mat, g: usize) -> OpResult<()> {
    if g == 0 || !x.d.is_multiple_of(g) {
        return Err(err(
            op,
            dev,
            format!("x {}, weight {g}", dims(x)),
            format!("width {} is not a multiple of the weight length {g}", x.d),
        ));
    }
    Ok(())
}

pub fn get_rows(op: &'static str, dev: DeviceId, w: &WeightInfo, ids: &[u32]) -> OpResult<()> {
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= w.n_rows) {
        return Err(err(op, dev, format!("{} ids, w {}", ids.len(), w.describe()), format!("row {bad} is out of range")));
    }
    Ok(())
}

/// `norms`: the lengths of the q and k norm weights.
pub fn attn_prep(op: &'static str, dev: DeviceId, s: &AttnPrep, norms: (usize, usize), qg: &Mat, k: &Mat, pos: &[u32]) -> OpResult<()> {
    let (qn, kn) = norms;
    let (hd, nh, nkv) = (s.head_dim, s.n_head, s.n_head_kv);
    let ok = qg.d == nh * 2 * hd
        && k.d == nkv * hd
        && k.n == qg.n
        && pos.len() == qg.n
        && qn == hd
        && kn == hd
        && s.n_rot <= hd
        && s.n_rot.is_multiple_of(2);
    if !ok {
        return Err(err(
            op,
            dev,
            format!("qg {}, k {}, {} positions, norms {qn}/{kn}, heads {nh}/{nkv}x{hd}, n_rot {}", dims(qg), dims(k), pos.len(), s.n_rot),
            "shapes do not match the head layout".into(),
        ));
    }
    Ok(())
}

pub fn kv_append(op: &'static str, dev: DeviceId, cache: &KvRows, rows: &Mat) -> OpResult<()> {
    if rows.d != cache.width {
        return Err(err(op, dev, format!("rows {}, cache width {}", dims(rows), cache.width), "widths differ".into()));
    }
    Ok(())
}

pub fn attention(op: &'static str, dev: DeviceId, s: &AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> OpResult<()> {
    let shapes =
        || format!("q {}, heads {}/{}x{}, pos0 {}, cache {}/{} rows", dims(q), s.n_head, s.n_head_kv, s.head_dim, s.pos0, k.len, v.len);
    if q.n != s.n_tok || q.d != s.n_head * s.head_dim || s.n_head_kv == 0 || !s.n_head.is_multiple_of(s.n_head_kv) {
        return Err(err(op, dev, shapes(), "q does not match the head layout".into()));
    }
    if k.width != s.n_head_kv * s.head_dim || v.width != k.width {
        return Err(err(op, dev, shapes(), "cache width does not match the KV heads".into()));
    }
    if k.len < s.pos0 + s.n_tok || v.len < s.pos0 + s.n_tok {
        return Err(err(op, dev, shapes(), "the cache is shorter than the positions attended".into()));
    }
    Ok(())
}

pub fn conv(op: &'static str, dev: DeviceId, x: &Mat, n_w: usize, n_state: usize) -> OpResult<()> {
    let c = x.d;
    if c == 0 || n_w == 0 || !n_w.is_multiple_of(c) || n_state != (n_w / c - 1) * c {
        return Err(err(op, dev, format!("x {}, taps {n_w}, state {n_state}", dims(x)), "taps and state do not match the channels".into()));
    }
    Ok(())
}

/// `params`: the lengths of the `a` and `dt_bias` vectors.
pub fn delta_prep(op: &'static str, dev: DeviceId, s: &DeltaPrep, params: (usize, usize), cu: &Mat, b: &Mat, alpha: &Mat) -> OpResult<()> {
    let (na, ndt) = params;
    let ch = 2 * s.n_k_head * s.d_k + s.n_v_head * s.d_v;
    let ok =
        cu.d == ch && b.d == s.n_v_head && alpha.d == s.n_v_head && b.n == cu.n && alpha.n == cu.n && na == s.n_v_head && ndt == s.n_v_head;
    if !ok || s.n_k_head == 0 || s.d_k == 0 {
        return Err(err(
            op,
            dev,
            format!(
                "cu {}, b {}, alpha {}, a/dt {na}/{ndt}, heads {}x{} / {}x{}",
                dims(cu),
                dims(b),
                dims(alpha),
                s.n_k_head,
                s.d_k,
                s.n_v_head,
                s.d_v
            ),
            "shapes do not match the head layout".into(),
        ));
    }
    Ok(())
}

pub fn delta_rule(op: &'static str, dev: DeviceId, s: &DeltaShape, x: &DeltaMats, n_state: usize) -> OpResult<()> {
    let (nk, nv, dk, dv) = (s.n_k_head, s.n_v_head, s.d_k, s.d_v);
    let rows = [&x.q, &x.k, &x.v, &x.g, &x.beta].iter().all(|m| m.n == s.n_tok);
    let ok = rows
        && x.q.d == nk * dk
        && x.k.d == nk * dk
        && x.v.d == nv * dv
        && x.g.d == nv
        && x.beta.d == nv
        && n_state == nv * dv * dk
        && nk > 0;
    if !ok {
        return Err(err(
            op,
            dev,
            format!(
                "q {}, k {}, v {}, g {}, beta {}, state {n_state}, heads {nk}x{dk} / {nv}x{dv}",
                dims(&x.q),
                dims(&x.k),
                dims(&x.v),
                dims(&x.g),
                dims(&x.beta)
            ),
            "shapes do not match the head layout".into(),
        ));
    }
    Ok(())
}

pub fn gate(op: &'static str, dev: DeviceId, y: &Mat, g: &Mat, _act: Gate) -> OpResult<()> {
    same(op, dev, y, g)
}

pub fn route(op: &'static str, dev: DeviceId, logits: &Mat, k: usize) -> OpResult<()> {
    if k == 0 || k > logits.d || logits.d > u16::MAX as usize {
        return Err(err(op, dev, format!("logits {}, k {k}", dims(logits)), "k must be in 1..=n_expert".into()));
    }
    Ok(())
}

pub fn moe(op: &'static str, dev: DeviceId, x: &Mat, r: &RouteTable, shared_gate: &Mat, n_expert: usize) -> OpResult<()> {
    let shapes = || format!("x {}, routing {}x{}, shared gate {}, {n_expert} experts", dims(x), r.n_tok, r.k, dims(shared_gate));
    if r.n_tok != x.n || shared_gate.n != x.n || shared_gate.d != 1 || r.ids.len() != r.n_tok * r.k || r.weights.len() != r.ids.len() {
        return Err(err(op, dev, shapes(), "routing, gate and x disagree on the tokens".into()));
    }
    if let Some(e) = r.ids.iter().find(|e| e.index() >= n_expert) {
        return Err(err(op, dev, shapes(), format!("expert {} is out of range", e.0)));
    }
    Ok(())
}

pub fn select_rows(op: &'static str, dev: DeviceId, x: &Mat, rows: &[usize]) -> OpResult<()> {
    if let Some(r) = rows.iter().find(|&&r| r >= x.n) {
        return Err(err(op, dev, format!("x {}, {} rows", dims(x), rows.len()), format!("row {r} is out of range")));
    }
    Ok(())
}

/// Spans in row order, covering the `n_rows` rows exactly, one state per span.
pub fn spans(op: &'static str, dev: DeviceId, spans: &[SeqSpan], n_rows: usize, n_states: usize) -> OpResult<()> {
    let mut at = 0;
    for sp in spans {
        if sp.row0 != at || sp.n == 0 {
            return Err(err(
                op,
                dev,
                format!("{} spans over {n_rows} rows", spans.len()),
                format!("span {sp:?} does not start at row {at} or is empty"),
            ));
        }
        at += sp.n;
    }
    if at != n_rows || n_states != spans.len() {
        return Err(err(
            op,
            dev,
            format!("{} spans over {n_rows} rows, {n_states} states", spans.len()),
            "spans must cover the rows, one state per span".into(),
        ));
    }
    Ok(())
}

/// A step's batch ([`crate::Ops::begin_step`]): each sequence's slot in use (`slot_len` gives
/// its length, or the error for a slot not in use) and continuing at its length, no slot twice,
/// one token per row, logit rows and positions in range. Shared by every backend.
pub fn batch(
    op: &'static str,
    dev: DeviceId,
    batch: &crate::Batch,
    mut slot_len: impl FnMut(crate::SlotId) -> OpResult<usize>,
) -> OpResult<()> {
    for (i, s) in batch.seqs.iter().enumerate() {
        let len = slot_len(s.slot)?;
        if s.pos0 != len {
            return Err(OpError::new(
                op,
                dev,
                s.slot.to_string(),
                format!("the sequence continues at {} but its slot holds {len} tokens", s.pos0),
            ));
        }
        if batch.seqs[..i].iter().any(|t| t.slot == s.slot) {
            return Err(OpError::new(op, dev, s.slot.to_string(), "a slot appears twice in one step"));
        }
    }
    let n = batch.n_rows();
    if batch.tokens.len() != n {
        return Err(OpError::new(op, dev, format!("{} tokens", batch.tokens.len()), format!("the sequences have {n} rows")));
    }
    if let Some(r) = batch.logit_rows.iter().find(|&&r| r as usize >= n) {
        return Err(OpError::new(op, dev, format!("logit row {r}"), format!("the step has {n} rows")));
    }
    if let Some(s) = batch.seqs.iter().find(|s| u32::try_from(s.pos0 + s.n).is_err()) {
        return Err(OpError::new(op, dev, s.slot.to_string(), "positions beyond u32"));
    }
    Ok(())
}
