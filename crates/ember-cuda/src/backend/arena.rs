//! The per-step arena. Handle `i` is the step's `i`-th allocation; it holds a device buffer
//! from the arena's spares until it is freed ([`Arena::free_since`]: the model frees a layer's
//! intermediates when the layer is done) or the step ends, when the buffer goes back to the
//! spares. An allocation takes the smallest spare that fits (ties: the one made first), so a
//! step holds about one layer's activations however many layers run, and a step that allocates
//! and frees the same shapes in the same order gets the same handles and the same device
//! addresses (what CUDA graph replay needs): the choice depends only on the set of spares, and
//! a buffer made for a request fits it exactly, so a step repeats the first one's choices.
//! Routings have their own arena of (ids, weights) buffers.

use std::ops::Index;

use ember_ops::{DeviceId, Mark, OpError, OpResult, Routing, Tensor};

use crate::{Buf, Gpu};

pub(super) struct Arena {
    /// Per handle of this step: its buffer (`None` once freed) and shape.
    held: Vec<Option<Slab>>,
    shapes: Vec<(usize, usize)>,
    /// Buffers no handle holds.
    spares: Vec<Slab>,
    /// Buffers made so far (each buffer's `made` is its number).
    made: u64,
    /// `EMBER_ARENA_FREE=0`: `free_since` checks its handles and frees nothing (every handle
    /// lives to the step's end, as before it existed: for A/B runs).
    keep_all: bool,
    dev: DeviceId,
    /// A one-token MoE run as one launch ([`Parts`]) whose output is not summed yet.
    pending: Option<Parts>,
}

/// A one-token MoE run as one launch (`Gpu::moe_fused_q8`): its output handle `out` is not
/// written; handle `parts` holds its `n` experts' rows (each of out's size), which the residual
/// add or norm that takes `out` sums itself, and [`CudaOps`](super::CudaOps) sums into `out`
/// before anything else reads it. Until then every other op is refused `out`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Parts {
    pub out: u32,
    pub parts: u32,
    pub n: usize,
    /// Values of `out` (n_tok · d).
    pub len: usize,
}

fn no_tensor(op: &'static str, dev: DeviceId, t: Tensor) -> OpError {
    OpError::new(op, dev, format!("tensor {} {}x{}", t.id, t.n, t.d), "no such tensor in this step (or freed)")
}

/// A device buffer and when it was made (the tie-break between spares of one size).
pub(super) struct Slab {
    buf: Buf<f32>,
    made: u64,
}

impl Slab {
    fn key(&self) -> (usize, u64) {
        (self.buf.len(), self.made)
    }
}

/// The buffers of the handles below an op's first output, indexed by handle id.
pub(super) struct Ins<'a>(&'a [Option<Slab>]);

impl Index<usize> for Ins<'_> {
    type Output = Buf<f32>;
    /// Panics on a freed handle: every op checks its inputs ([`Arena::check`]) first.
    fn index(&self, i: usize) -> &Buf<f32> {
        live(&self.0[i])
    }
}

impl Arena {
    pub fn new(dev: DeviceId) -> Self {
        let keep_all = !crate::ops::switch_now("EMBER_ARENA_FREE");
        Arena { held: Vec::new(), shapes: Vec::new(), spares: Vec::new(), made: 0, keep_all, dev, pending: None }
    }

    /// Frees every handle (their buffers stay, as spares for the next step).
    pub fn reset(&mut self) {
        self.spares.extend(self.held.drain(..).flatten());
        self.shapes.clear();
        self.pending = None;
    }

    /// Records a one-launch MoE's output as not summed yet (both handles live).
    pub fn set_pending(&mut self, p: Parts) {
        self.pending = Some(p);
    }

    /// The one-launch MoE whose output handle is `t`, if its sum is pending.
    pub fn pending(&self, t: Tensor) -> Option<Parts> {
        self.pending.filter(|p| p.out == t.id)
    }

    /// Its sum is in its output now (or nobody will read it).
    pub fn clear_pending(&mut self) {
        self.pending = None;
    }

    /// The one-launch MoE whose sum is pending, if any.
    pub fn pending_any(&self) -> Option<Parts> {
        self.pending
    }

    /// Device bytes the arena holds (live handles and spares).
    pub fn bytes(&self) -> usize {
        self.held.iter().flatten().chain(&self.spares).map(|s| s.buf.len() * 4).sum()
    }

    /// Where the next handle will be made.
    pub fn mark(&self) -> Mark {
        Mark(self.held.len() as u32)
    }

    /// The next handle, `n x d`: the smallest spare that fits, else a new buffer (the largest
    /// spare is given back first, so its memory counts as free for the new one).
    pub fn alloc(&mut self, gpu: &Gpu, op: &'static str, n: usize, d: usize) -> OpResult<Tensor> {
        let len = n.checked_mul(d).ok_or_else(|| OpError::new(op, self.dev, format!("{n}x{d}"), "too large"))?;
        let oom = |e: crate::Error| OpError::new(op, self.dev, format!("{n}x{d}"), e.to_string());
        let fit = (0..self.spares.len()).filter(|&i| self.spares[i].buf.len() >= len).min_by_key(|&i| self.spares[i].key());
        let buf = match fit {
            Some(i) => self.spares.swap_remove(i),
            None => {
                if let Some(i) = (0..self.spares.len()).max_by_key(|&i| self.spares[i].key()) {
                    drop(self.spares.swap_remove(i));
                }
                self.made += 1;
                Slab { buf: gpu.alloc(len).map_err(oom)?, made: self.made }
            }
        };
        let id = self.held.len() as u32;
        self.held.push(Some(buf));
        self.shapes.push((n, d));
        Ok(Tensor { id, n, d })
    }

    /// Frees every live handle made since `mark` except `keep` (each a live handle of this
    /// step); their buffers become spares.
    pub fn free_since(&mut self, op: &'static str, mark: Mark, keep: &[Tensor]) -> OpResult<()> {
        for &t in keep {
            self.check(op, t)?;
        }
        if self.keep_all {
            return Ok(());
        }
        for id in (mark.0 as usize).min(self.held.len())..self.held.len() {
            if !keep.iter().any(|t| t.id as usize == id)
                && let Some(b) = self.held[id].take()
            {
                self.spares.push(b);
            }
        }
        if self.pending.is_some_and(|p| self.held[p.out as usize].is_none() || self.held[p.parts as usize].is_none()) {
            self.pending = None;
        }
        Ok(())
    }

    /// Checks that `t` is a live handle of this step.
    pub fn check(&self, op: &'static str, t: Tensor) -> OpResult<()> {
        if self.pending(t).is_some() {
            return Err(OpError::new(
                op,
                self.dev,
                format!("tensor {} {}x{}", t.id, t.n, t.d),
                "a one-launch MoE's output whose experts are not summed yet (only add, add_rms_norm and reads take it)",
            ));
        }
        self.check_live(op, t)
    }

    /// [`Arena::check`] that takes a pending MoE output too.
    pub fn check_live(&self, op: &'static str, t: Tensor) -> OpResult<()> {
        let i = t.id as usize;
        match self.shapes.get(i) {
            Some(&s) if s == (t.n, t.d) && self.held[i].is_some() => Ok(()),
            _ => Err(no_tensor(op, self.dev, t)),
        }
    }

    pub fn buf(&self, op: &'static str, t: Tensor) -> OpResult<&Buf<f32>> {
        self.check(op, t)?;
        Ok(live(&self.held[t.id as usize]))
    }

    /// `t`'s buffer to write (a live handle of this step, made by an earlier op).
    pub fn buf_mut(&mut self, op: &'static str, t: Tensor) -> OpResult<&mut Buf<f32>> {
        self.check(op, t)?;
        Ok(live_mut(&mut self.held[t.id as usize]))
    }

    /// The buffers of the handles below `at` (inputs, by id) and of those from `at` on (the
    /// outputs just allocated, in order).
    pub fn split(&mut self, at: u32) -> (Ins<'_>, Vec<&mut Buf<f32>>) {
        let (lo, hi) = self.held.split_at_mut(at as usize);
        (Ins(lo), hi.iter_mut().map(live_mut).collect())
    }

    /// Buffers `a` and `c` to write and buffer `b` to read (all different and live, `c` after
    /// both others: a buffer just allocated).
    pub fn trio(&mut self, a: u32, b: u32, c: u32) -> (&mut Buf<f32>, &Buf<f32>, &mut Buf<f32>) {
        assert!(a.max(b) < c, "trio: buffer {c} must come after {a} and {b}");
        let (lo, hi) = self.held.split_at_mut(c as usize);
        let (a, b) = (a as usize, b as usize);
        let (wa, rb) = if a < b {
            let (l, h) = lo.split_at_mut(b);
            (&mut l[a], &h[0])
        } else {
            let (l, h) = lo.split_at_mut(a);
            (&mut h[0], &l[b])
        };
        (live_mut(wa), live(rb), live_mut(&mut hi[0]))
    }

    /// [`Arena::trio`] with a fourth buffer `d` to write, after `c`.
    pub fn quad(&mut self, a: u32, b: u32, c: u32, d: u32) -> (&mut Buf<f32>, &Buf<f32>, &mut Buf<f32>, &mut Buf<f32>) {
        assert!(c < d, "quad: buffer {d} must come after {c}");
        let (lo, hi) = self.held.split_at_mut(d as usize);
        let (lo, mid) = lo.split_at_mut(c as usize);
        let (a, b) = (a as usize, b as usize);
        assert!(a.max(b) < c as usize && a != b, "quad: buffers {a} and {b} must differ and come before {c}");
        let (wa, rb) = if a < b {
            let (l, h) = lo.split_at_mut(b);
            (&mut l[a], &h[0])
        } else {
            let (l, h) = lo.split_at_mut(a);
            (&mut h[0], &l[b])
        };
        (live_mut(wa), live(rb), live_mut(&mut mid[0]), live_mut(&mut hi[0]))
    }

    /// Buffer `a` to write and buffer `b` to read (`a != b`, both live).
    pub fn pair(&mut self, a: u32, b: u32) -> (&mut Buf<f32>, &Buf<f32>) {
        let (a, b) = (a as usize, b as usize);
        if a < b {
            let (lo, hi) = self.held.split_at_mut(b);
            (live_mut(&mut lo[a]), live(&hi[0]))
        } else {
            let (lo, hi) = self.held.split_at_mut(a);
            (live_mut(&mut hi[0]), live(&lo[b]))
        }
    }
}

fn live(s: &Option<Slab>) -> &Buf<f32> {
    &s.as_ref().expect("a checked handle (or an op's new output) is live").buf
}

fn live_mut(s: &mut Option<Slab>) -> &mut Buf<f32> {
    &mut s.as_mut().expect("a checked handle (or an op's new output) is live").buf
}

/// A routing's device buffers: expert ids and weights, `n_tok x k`.
pub(super) struct RouteBufs {
    pub ids: Buf<u32>,
    pub weights: Buf<f32>,
}

pub(super) struct Routes {
    bufs: Vec<RouteBufs>,
    /// (n_tok, k, experts routed over) per routing of this step.
    shapes: Vec<(usize, usize, usize)>,
    used: usize,
    dev: DeviceId,
    /// A routing not computed yet, and the logits it is to be computed from: its route left to
    /// the one-launch MoE that reads it (`Gpu::moe_fused_q8` with route logits), or to the
    /// route kernel when anything else asks for it first ([`CudaOps`](super::CudaOps)'s
    /// `settle_route`). Until then [`Routes::get`] refuses it.
    pending: Option<(Routing, Tensor)>,
}

impl Routes {
    pub fn new(dev: DeviceId) -> Self {
        Routes { bufs: Vec::new(), shapes: Vec::new(), used: 0, dev, pending: None }
    }

    pub fn reset(&mut self) {
        self.used = 0;
        self.pending = None;
    }

    /// Records routing `r` (just allocated) as to be computed from `logits` later.
    pub fn defer(&mut self, r: Routing, logits: Tensor) {
        self.pending = Some((r, logits));
    }

    /// The logits routing `r` is still to be computed from, if it is pending.
    pub fn pending(&self, r: Routing) -> Option<Tensor> {
        self.pending.filter(|p| p.0.id == r.id).map(|p| p.1)
    }

    /// The routing still to be computed, and its logits, if any.
    pub fn pending_any(&self) -> Option<(Routing, Tensor)> {
        self.pending
    }

    /// It is computed now (or being computed by the launch just queued).
    pub fn clear_pending(&mut self) {
        self.pending = None;
    }

    /// [`Routes::get`], pending or not (for the launch that computes it), to write.
    pub fn get_mut_any(&mut self, op: &'static str, r: Routing) -> OpResult<&mut RouteBufs> {
        match self.shapes[..self.used].get(r.id as usize) {
            Some(&(n, k, _)) if (n, k) == (r.n_tok, r.k) => Ok(&mut self.bufs[r.id as usize]),
            _ => Err(OpError::new(op, self.dev, format!("routing {}", r.id), "no such routing in this step")),
        }
    }

    /// The next routing handle, its buffers grown if too small.
    pub fn alloc(&mut self, gpu: &Gpu, op: &'static str, n_tok: usize, k: usize, n_expert: usize) -> OpResult<(Routing, &mut RouteBufs)> {
        let len = n_tok * k;
        let oom = |e: crate::Error| OpError::new(op, self.dev, format!("{n_tok}x{k}"), e.to_string());
        let i = self.used;
        if i == self.bufs.len() {
            self.bufs.push(RouteBufs { ids: gpu.alloc(len).map_err(oom)?, weights: gpu.alloc(len).map_err(oom)? });
            self.shapes.push((n_tok, k, n_expert));
        } else {
            if self.bufs[i].ids.len() < len {
                self.bufs[i] = RouteBufs { ids: gpu.alloc(len).map_err(oom)?, weights: gpu.alloc(len).map_err(oom)? };
            }
            self.shapes[i] = (n_tok, k, n_expert);
        }
        self.used += 1;
        Ok((Routing { id: i as u32, n_tok, k }, &mut self.bufs[i]))
    }

    /// A routing of this step, with the number of experts it was routed over.
    pub fn get(&self, op: &'static str, r: Routing) -> OpResult<(&RouteBufs, usize)> {
        if self.pending(r).is_some() {
            return Err(OpError::new(op, self.dev, format!("routing {}", r.id), "not computed yet (its route is deferred)"));
        }
        self.get_any(op, r)
    }

    /// [`Routes::get`], pending or not.
    pub fn get_any(&self, op: &'static str, r: Routing) -> OpResult<(&RouteBufs, usize)> {
        match self.shapes[..self.used].get(r.id as usize) {
            Some(&(n, k, e)) if (n, k) == (r.n_tok, r.k) => Ok((&self.bufs[r.id as usize], e)),
            _ => Err(OpError::new(op, self.dev, format!("routing {}", r.id), "no such routing in this step")),
        }
    }
}
