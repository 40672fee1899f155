//! Routings on the device: the route op and the reads of a routing's ids and weights.

use ember_gguf::GgmlType;
use ember_ops::{DeviceId, ExpertId, Mat, MoeIn, OpResult, RouteTable, Routing, Tensor, WeightId, check};

use super::arena::{Arena, Routes};
use super::{CudaOps, cuda, shape_of};
use crate::Download;

impl CudaOps {
    /// [`ember_ops::Ops::route`]: one warp per token (kernels/route.cu).
    /// One token's routing is left to the one-launch MoE after it where that can route
    /// (`EMBER_MOE_FUSED=2`: [`crate::Gpu::moe_fused_routes`]); anything else that asks for it
    /// first runs the route kernel then ([`CudaOps::settle_route`]).
    pub(super) fn route_op(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        const OP: &str = "route";
        let lb = self.arena.buf(OP, logits)?;
        check::route(OP, self.dev, &shape_of(logits), k)?;
        let (r, rb) = self.routes.alloc(&self.gpu, OP, logits.n, k, logits.d)?;
        if logits.n == 1 && self.gpu.moe_fused_on() && self.gpu.moe_fused_routes(logits.d, k) {
            // One routing waits at a time: an earlier one still pending is computed now.
            if let Some((p, _)) = self.routes.pending_any() {
                settle_route(&self.gpu, &self.arena, &mut self.routes, self.dev, OP, p)?;
            }
            self.routes.defer(r, logits);
            return Ok(r);
        }
        self.gpu.route(lb, logits.n, logits.d, k, &mut rb.ids, &mut rb.weights).map_err(cuda(OP, self.dev))?;
        Ok(r)
    }

    /// Runs the route kernel for routing `r` if its route was deferred (before anything but
    /// the one-launch MoE reads it).
    pub(super) fn settle_route(&mut self, op: &'static str, r: Routing) -> OpResult<()> {
        settle_route(&self.gpu, &self.arena, &mut self.routes, self.dev, op, r)
    }

    /// [`ember_ops::Ops::add_norm_route`] as one `moe_route` launch ([`crate::Gpu::moe_route`]):
    /// with `EMBER_MOE_ROUTE=1` (off by default: slower on an H100, docs/perf.md g33), one token
    /// under Fast (where the norm leaves its int8 copy), F32 router and gate rows, where the GPU
    /// runs the kernel; `None` elsewhere (the caller runs the three ops).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_route_fused(
        &mut self,
        h: Tensor,
        x: Tensor,
        norm: WeightId,
        eps: f32,
        router: WeightId,
        shared_gate: WeightId,
        k: usize,
    ) -> OpResult<Option<MoeIn>> {
        const OP: &str = "add_norm_route";
        let d = h.d;
        if !self.gpu.moe_route_on()
            || h.id == x.id
            || h.n != 1
            || x.n != 1
            || x.d != d
            || !self.gpu.uses_gemv_q8(GgmlType::Q8_0, d, 1, self.precision)
        {
            return Ok(None);
        }
        self.arena.check(OP, h)?;
        self.arena.check(OP, x)?;
        let wv = self.weights.vector(OP, norm)?;
        let (_, rw) = self.weights.matrix(OP, router)?;
        let (_, gw) = self.weights.matrix(OP, shared_gate)?;
        let n_expert = rw.n_rows;
        let f32_rows = |ty: GgmlType, kk: usize| ty == GgmlType::F32 && kk == d;
        if wv.len() != d || !f32_rows(rw.ty, rw.k) || !f32_rows(gw.ty, gw.k) || gw.n_rows != 1 || !self.gpu.uses_moe_route(d, n_expert, k) {
            return Ok(None);
        }
        if self.q8_x.is_some_and(|(id, _)| id == h.id) {
            self.q8_x = None; // h changes: its int8 copy is stale
        }
        let f = self.arena.alloc(&self.gpu, OP, 1, d)?;
        let gs = self.arena.alloc(&self.gpu, OP, 1, 1)?;
        let (r, rb) = self.routes.alloc(&self.gpu, OP, 1, k, n_expert)?;
        let (hb, xb, fb, gb) = self.arena.quad(h.id, x.id, f.id, gs.id);
        let generation =
            self.gpu.moe_route(hb, xb, wv, eps, rw.all(), gw.all(), k, fb, gb, &mut rb.ids, &mut rb.weights).map_err(cuda(OP, self.dev))?;
        self.q8_x = Some((f.id, generation));
        Ok(Some(MoeIn { x: f, shared_gate: gs, routing: r }))
    }

    /// [`ember_ops::Ops::read_routing`] and [`ember_ops::Ops::read`] of `x` with one wait for
    /// the stream instead of two: what an expert tier needs on the host for a decode step's
    /// misses (the routing to find them, `x` to compute them).
    pub fn read_routing_with(&mut self, r: Routing, x: Tensor) -> OpResult<(RouteTable, Mat)> {
        self.settle_route("read_routing_with", r)?;
        let (table, data) = self.download_routing("read_routing_with", r, Some(x))?;
        Ok((table, Mat { n: x.n, d: x.d, data }))
    }

    /// A routing's ids and weights, and `x`'s values when asked for (else none), in one
    /// [`crate::Gpu::download_ranges`].
    pub(super) fn download_routing(&self, op: &'static str, r: Routing, x: Option<Tensor>) -> OpResult<(RouteTable, Vec<f32>)> {
        let (b, _) = self.routes.get(op, r)?;
        let n = r.n_tok * r.k;
        let (mut ids, mut weights, mut data) = (Vec::new(), Vec::new(), Vec::new());
        let xb = x.map(|x| self.arena.buf(op, x)).transpose()?;
        let mut parts = vec![Download::new(&b.ids, 0, n, &mut ids), Download::new(&b.weights, 0, n, &mut weights)];
        if let (Some(x), Some(xb)) = (x, xb) {
            parts.push(Download::new(xb, 0, x.n * x.d, &mut data));
        }
        self.gpu.download_ranges(&mut parts).map_err(cuda(op, self.dev))?;
        drop(parts);
        let table = RouteTable { n_tok: r.n_tok, k: r.k, ids: ids.into_iter().map(|e| ExpertId(e as u16)).collect(), weights };
        Ok((table, data))
    }
}

/// [`CudaOps::settle_route`] on the fields it needs (for callers that hold others borrowed).
pub(super) fn settle_route(
    gpu: &crate::Gpu,
    arena: &Arena,
    routes: &mut Routes,
    dev: DeviceId,
    op: &'static str,
    r: Routing,
) -> OpResult<()> {
    let Some(logits) = routes.pending(r) else { return Ok(()) };
    let lb = arena.buf(op, logits)?; // (still pending if its logits are gone: `get` refuses it)
    routes.clear_pending();
    let rb = routes.get_mut_any(op, r)?;
    gpu.route(lb, logits.n, logits.d, r.k, &mut rb.ids, &mut rb.weights).map_err(cuda(op, dev))
}
