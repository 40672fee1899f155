//! The mailbox form of a partial layer's decode MoE (see the module docs of [`super`] and
//! docs/backend.md): the GPU publishes the routing, the host serves it before the step's first
//! wait for the stream.

use std::time::{Duration, Instant};

use ember_cuda::Mailbox;
use ember_ops::{LayerIdx, Mat, OpError, OpResult, Ops, Routing, Tensor};

use super::{Hybrid, X_WITH_ROUTING_BYTES};

/// A layer's routing published in its mailbox by a queued `moe_post`, not served yet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Posted {
    layer: LayerIdx,
    step: u32,
    n_tok: usize,
    k: usize,
    d: usize,
}

/// How long the host waits for a step's `moe_post` to publish before it calls the step failed
/// (the GPU reaches a layer within milliseconds; a stream that failed is seen sooner).
const POST_TIMEOUT: Duration = Duration::from_secs(30);

impl Hybrid {
    /// The decode form of a partial layer's MoE: the routing goes to the layer's mailbox
    /// (`moe_post`), the GPU computes the resident pairs and the shared expert, and
    /// `moe_wait_add` adds the host's sum of the misses, waiting for it only when there are
    /// some. Nothing waits here: the host serves the mailbox later ([`Hybrid::drain`]).
    pub(super) fn moe_posted(&mut self, layer: LayerIdx, x: Tensor, routing: Routing, shared_gate: Tensor) -> OpResult<Tensor> {
        self.posted_unwaited = true;
        let l = layer.index();
        let (pairs, floats) = (routing.n_tok * routing.k, x.n * x.d);
        let fits = |b: &Option<Mailbox>| b.as_ref().is_some_and(|b| b.cap_pairs() >= pairs && b.cap_x() >= floats);
        if !self.boxes.get(l).is_some_and(fits) {
            // Making (or replacing) one may wait for the stream: serve what is posted first.
            self.drain()?;
            if self.boxes.len() <= l {
                self.boxes.resize_with(l + 1, || None);
            }
            let cap_x = (X_WITH_ROUTING_BYTES / std::mem::size_of::<f32>()).max(floats);
            let cap_pairs = (cap_x / x.d.max(1) * routing.k).max(pairs);
            // No launch naming the old mailbox is left unsent (drain flushed what was posted;
            // every recorded moe_post is posted): dropping it waits for the stream.
            self.gpu.flush()?;
            self.boxes[l] = None;
            self.boxes[l] = Some(self.gpu.mailbox(cap_pairs, cap_x)?);
        }
        let Some(mb) = self.boxes[l].as_ref() else { unreachable!("made above") };
        self.gpu.moe_post(layer, routing, x, mb)?;
        // Posted as soon as moe_post is queued: drain serves it even if what follows fails.
        self.posted.push(Posted { layer, step: self.gpu.generation(), n_tok: routing.n_tok, k: routing.k, d: x.d });
        let out = self.gpu.moe(layer, x, routing, shared_gate)?;
        self.gpu.moe_wait_add(out, mb)?;
        Ok(out)
    }

    /// Serves every posted mailbox of this step, in layer order: what runs before anything
    /// that waits for the stream (a posted layer with misses waits for the host). On an error
    /// the mailboxes not served get NaN answers, so the stream finishes at once and the step's
    /// outputs show the failure.
    pub(super) fn drain(&mut self) -> OpResult<()> {
        if self.posted.is_empty() {
            return Ok(());
        }
        let posted = std::mem::take(&mut self.posted);
        let failed = match self.gpu.flush() {
            Err(e) => Some((0, e)),
            Ok(()) => posted.iter().enumerate().find_map(|(i, p)| self.serve(*p).err().map(|e| (i, e))),
        };
        let Some((i, e)) = failed else { return Ok(()) };
        for q in &posted[i..] {
            if let Some(mb) = self.boxes.get(q.layer.index()).and_then(Option::as_ref) {
                let _ = mb.answer(q.step, &vec![f32::NAN; q.n_tok * q.d]);
            }
        }
        Err(e)
    }

    /// An error when a wait of a step the stream has finished gave up on the host (NaN rows in
    /// that step's outputs and state); each is reported once. Called after calls that waited
    /// for the stream.
    pub(super) fn check_timeouts(&mut self) -> OpResult<()> {
        let newest = self.boxes.iter().enumerate().filter_map(|(l, b)| b.as_ref().map(|b| (b.timed_out(), l))).max();
        let Some((step, l)) = newest.filter(|(step, _)| *step > self.timeouts_seen) else { return Ok(()) };
        self.timeouts_seen = step;
        Err(OpError::new(
            "moe",
            self.gpu.device(),
            format!("layer {l}"),
            format!("the GPU waited more than {:?} for the host's sum of the misses", Duration::from_nanos(ember_cuda::MAILBOX_TIMEOUT_NS)),
        ))
    }

    fn mailbox_of(&self, layer: LayerIdx) -> OpResult<&Mailbox> {
        self.boxes
            .get(layer.index())
            .and_then(Option::as_ref)
            .ok_or_else(|| OpError::new("moe", self.gpu.device(), format!("{layer}"), "no mailbox"))
    }

    /// Waits for `p`'s routing, records it for the heat and the stats, and when some pairs
    /// miss computes them on the CPU and answers with their sum.
    fn serve(&mut self, p: Posted) -> OpResult<()> {
        const OP: &str = "moe";
        let dev = self.gpu.device();
        let fail = |msg: String| OpError::new(OP, dev, format!("{}", p.layer), msg);
        let (ids, weights, gpu_misses) = {
            let mb = self.mailbox_of(p.layer)?;
            let t0 = Instant::now();
            let mut spins = 0u32;
            while mb.routed() != p.step {
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(256) {
                    std::hint::spin_loop();
                    continue;
                }
                // The stream finished without publishing (a failed launch) or takes far too
                // long: an error, never a hang.
                let idle = self.gpu.gpu().stream_idle().map_err(|e| fail(e.to_string()))?;
                if (idle && mb.routed() != p.step) || t0.elapsed() > POST_TIMEOUT {
                    return Err(fail(format!("the GPU did not publish the routing (stream idle: {idle}, waited {:?})", t0.elapsed())));
                }
                std::thread::yield_now();
            }
            let (ids, weights) = mb.routing(p.n_tok * p.k).map_err(|e| fail(e.to_string()))?;
            (ids, weights, mb.n_miss())
        };
        self.heat.record(p.layer.index(), &ids).map_err(|e| fail(e.to_string()))?;
        let misses = self.misses(p.layer, &ids, &weights, p.k);
        let n_miss: usize = misses.values().map(Vec::len).sum();
        self.count(p.layer, ids.len(), n_miss);
        if gpu_misses as usize != n_miss {
            return Err(fail(format!("the GPU counted {gpu_misses} misses, the host {n_miss}")));
        }
        if n_miss == 0 {
            return Ok(());
        }
        let x = Mat { n: p.n_tok, d: p.d, data: self.mailbox_of(p.layer)?.x(p.n_tok * p.d).map_err(|e| fail(e.to_string()))? };
        let y = self.cpu_misses(p.layer, &misses, &x)?;
        self.mailbox_of(p.layer)?.answer(p.step, &y.data).map_err(|e| fail(e.to_string()))
    }
}
