//! The per-step arena: handle `i` is the step's `i`-th allocation and lives in device buffer
//! `i`, kept from step to step and reused while large enough, so a step that allocates the same
//! shapes in the same order gets the same handles and the same device addresses (what CUDA
//! graph replay needs). Routings have their own arena of (ids, weights) buffers.

use ember_ops::{DeviceId, OpError, OpResult, Routing, Tensor};

use crate::{Buf, Gpu};

pub(super) struct Arena {
    bufs: Vec<Buf<f32>>,
    shapes: Vec<(usize, usize)>,
    used: usize,
    dev: DeviceId,
}

fn no_tensor(op: &'static str, dev: DeviceId, t: Tensor) -> OpError {
    OpError::new(op, dev, format!("tensor {} {}x{}", t.id, t.n, t.d), "no such tensor in this step")
}

impl Arena {
    pub fn new(dev: DeviceId) -> Self {
        Arena { bufs: Vec::new(), shapes: Vec::new(), used: 0, dev }
    }

    /// Frees every handle (the buffers stay for the next step).
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The next handle, `n x d`, its buffer grown if it is too small.
    pub fn alloc(&mut self, gpu: &Gpu, op: &'static str, n: usize, d: usize) -> OpResult<Tensor> {
        let len = n.checked_mul(d).ok_or_else(|| OpError::new(op, self.dev, format!("{n}x{d}"), "too large"))?;
        let i = self.used;
        let oom = |e: crate::Error| OpError::new(op, self.dev, format!("{n}x{d}"), e.to_string());
        if i < self.bufs.len() {
            if self.bufs[i].len() < len {
                // The old buffer goes first, so its memory counts as free for the new one.
                self.bufs[i] = gpu.alloc(0).map_err(oom)?;
                self.bufs[i] = gpu.alloc(len).map_err(oom)?;
            }
            self.shapes[i] = (n, d);
        } else {
            self.bufs.push(gpu.alloc(len).map_err(oom)?);
            self.shapes.push((n, d));
        }
        self.used += 1;
        Ok(Tensor { id: i as u32, n, d })
    }

    /// Checks that `t` is a handle of this step.
    pub fn check(&self, op: &'static str, t: Tensor) -> OpResult<()> {
        match self.shapes[..self.used].get(t.id as usize) {
            Some(&s) if s == (t.n, t.d) => Ok(()),
            _ => Err(no_tensor(op, self.dev, t)),
        }
    }

    pub fn buf(&self, op: &'static str, t: Tensor) -> OpResult<&Buf<f32>> {
        self.check(op, t)?;
        Ok(&self.bufs[t.id as usize])
    }

    /// Every buffer below `at` (inputs) and from `at` on (the outputs just allocated).
    pub fn split(&mut self, at: u32) -> (&[Buf<f32>], &mut [Buf<f32>]) {
        let (a, b) = self.bufs.split_at_mut(at as usize);
        (a, b)
    }

    /// Buffers `a` and `c` to write and buffer `b` to read (all different and live, `c` after
    /// both others: a buffer just allocated).
    pub fn trio(&mut self, a: u32, b: u32, c: u32) -> (&mut Buf<f32>, &Buf<f32>, &mut Buf<f32>) {
        assert!(a.max(b) < c, "trio: buffer {c} must come after {a} and {b}");
        let (lo, hi) = self.bufs.split_at_mut(c as usize);
        let (a, b) = (a as usize, b as usize);
        let (wa, rb) = if a < b {
            let (l, h) = lo.split_at_mut(b);
            (&mut l[a], &h[0])
        } else {
            let (l, h) = lo.split_at_mut(a);
            (&mut h[0], &l[b])
        };
        (wa, rb, &mut hi[0])
    }

    /// Buffer `a` to write and buffer `b` to read (`a != b`, both live).
    pub fn pair(&mut self, a: u32, b: u32) -> (&mut Buf<f32>, &Buf<f32>) {
        let (a, b) = (a as usize, b as usize);
        if a < b {
            let (lo, hi) = self.bufs.split_at_mut(b);
            (&mut lo[a], &hi[0])
        } else {
            let (lo, hi) = self.bufs.split_at_mut(a);
            (&mut hi[0], &lo[b])
        }
    }
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
}

impl Routes {
    pub fn new(dev: DeviceId) -> Self {
        Routes { bufs: Vec::new(), shapes: Vec::new(), used: 0, dev }
    }

    pub fn reset(&mut self) {
        self.used = 0;
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
        match self.shapes[..self.used].get(r.id as usize) {
            Some(&(n, k, e)) if (n, k) == (r.n_tok, r.k) => Ok((&self.bufs[r.id as usize], e)),
            _ => Err(OpError::new(op, self.dev, format!("routing {}", r.id), "no such routing in this step")),
        }
    }
}
