use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::ROUTE;

const OP: &str = "route";

/// The smallest normal f16, the floor of the routing weights' sum (ember_ops::reference).
pub const ROUTE_SUM_MIN: f32 = 6.103_515_6e-5;

#[repr(C)]
struct RouteParams {
    logits: u64,
    ids: u64,
    weights: u64,
    n_tok: u32,
    n_expert: u32,
    k: u32,
    sum_min: f32,
}

// SAFETY: plain #[repr(C)] data matching `RouteParams` in kernels/route.cu.
unsafe impl DeviceRepr for RouteParams {}

impl Gpu {
    /// Per token of logits [n_tok, n_expert]: the k most probable experts (largest first,
    /// ties to the lower id) into ids [n_tok, k] and their renormalised weights.
    pub fn route(
        &self,
        logits: &Buf<f32>,
        n_tok: usize,
        n_expert: usize,
        k: usize,
        ids: &mut Buf<u32>,
        weights: &mut Buf<f32>,
    ) -> Result<()> {
        if k > n_expert || n_expert > 8192 {
            return Err(shape(OP, format!("k = {k} of {n_expert} experts (at most 8192)")));
        }
        need(OP, "logits", logits, n_tok * n_expert)?;
        need(OP, "ids", ids, n_tok * k)?;
        need(OP, "weights", weights, n_tok * k)?;
        if n_tok == 0 || k == 0 {
            return Ok(());
        }
        let p = RouteParams {
            logits: logits.ptr(),
            ids: ids.ptr(),
            weights: weights.ptr(),
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            n_expert: n_expert as u32,
            k: k as u32,
            sum_min: ROUTE_SUM_MIN,
        };
        let f = self.function(&ROUTE, "route")?;
        // SAFETY: sizes checked above; shared memory holds n_expert floats (<= 32 KiB).
        unsafe { self.launch(&f, (p.n_tok, 1, 1), 32, 4 * n_expert as u32, &p) }
    }
}
