//! Routings on the device: the route op and the reads of a routing's ids and weights.

use ember_ops::{ExpertId, Mat, OpResult, RouteTable, Routing, Tensor, check};

use super::{CudaOps, cuda, shape_of};
use crate::Download;

impl CudaOps {
    /// [`ember_ops::Ops::route`]: one warp per token (kernels/route.cu).
    pub(super) fn route_op(&mut self, logits: Tensor, k: usize) -> OpResult<Routing> {
        const OP: &str = "route";
        let lb = self.arena.buf(OP, logits)?;
        check::route(OP, self.dev, &shape_of(logits), k)?;
        let (r, rb) = self.routes.alloc(&self.gpu, OP, logits.n, k, logits.d)?;
        self.gpu.route(lb, logits.n, logits.d, k, &mut rb.ids, &mut rb.weights).map_err(cuda(OP, self.dev))?;
        Ok(r)
    }

    /// [`ember_ops::Ops::read_routing`] and [`ember_ops::Ops::read`] of `x` with one wait for
    /// the stream instead of two: what an expert tier needs on the host for a decode step's
    /// misses (the routing to find them, `x` to compute them).
    pub fn read_routing_with(&mut self, r: Routing, x: Tensor) -> OpResult<(RouteTable, Mat)> {
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
