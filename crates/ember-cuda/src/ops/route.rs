use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::matmul::{Precision, WeightRef};
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

/// The routing at the end of the router's GEMV (`RouteTail` in kernels/matmul.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct RouteTail {
    ids: u64,
    weights: u64,
    count: u64,
    n_expert: u32,
    k: u32,
    sum_min: f32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `RouteTail` in kernels/matmul.cu (3 u64, 4 4-byte
// fields: 40 bytes, no padding).
unsafe impl DeviceRepr for RouteTail {}
const _: () = assert!(std::mem::size_of::<RouteTail>() == 40);

/// The most experts the GEMV's last warp routes (route.cuh's registers: 8 a lane).
pub const ROUTE_TAIL_MAX_EXPERTS: usize = 256;

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

    /// [`Gpu::matmul_multi_prec`] of one token whose first weight's outputs (a router's logits)
    /// go on into [`Gpu::route`]'s routing (top `k`, into `ids` and `weights`) in the same
    /// launch, by the warp that writes the last logit: the same ids and weights as the route
    /// kernel on those logits. False, with nothing launched, where it does not apply (weights
    /// not of a float type, more than [`ROUTE_TAIL_MAX_EXPERTS`] experts, k not in 1..=experts):
    /// the caller launches the two then.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_multi_route(
        &self,
        ws: &[WeightRef<'_>],
        x: &Buf<f32>,
        ys: &mut [&mut Buf<f32>],
        precision: Precision,
        k: usize,
        ids: &mut Buf<u32>,
        weights: &mut Buf<f32>,
    ) -> Result<bool> {
        let Some(first) = ws.first() else { return Ok(false) };
        let n_expert = first.n_rows;
        let float_ty = matches!(first.ty(), GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if !float_ty || n_expert > ROUTE_TAIL_MAX_EXPERTS || k == 0 || k > n_expert || self.uses_mmv(first.k(), 1, precision) {
            return Ok(false);
        }
        need(OP, "ids", ids, k)?;
        need(OP, "weights", weights, k)?;
        let rt = RouteTail {
            ids: ids.ptr(),
            weights: weights.ptr(),
            count: self.tail_count(1)?,
            n_expert: n_expert as u32,
            k: k as u32,
            sum_min: ROUTE_SUM_MIN,
            pad: 0,
        };
        self.matmul_multi_launch(ws, x, 1, ys, precision, rt)?;
        Ok(true)
    }
}
