//! One token's MoE prelude in one launch (kernels/moe_route.cu): `h ← h + m`, the norm with its
//! int8 copy, the router's logits and the shared expert's gate from it, and the routing, the
//! bits of `add_rms_norm_q8`, the router's GEMV and `route` run one after another, where a
//! one-token step chains them as three launches (~11 us of the 35B's decode step a layer on an
//! H100, docs/perf.md g30). Measured on an H100 (g33): tg128 436 against 452 t/s with the three
//! launches, so off by default (`EMBER_MOE_ROUTE=1` turns it on).

use cudarc::driver::{CudaFunction, DeviceRepr};

use super::matmul::gemv_ksplit;
use super::rms_norm::{RmsNormParams, add_norm_params, block_of};
use super::{WeightRef, cluster_fits, need, q8_bytes, route::ROUTE_SUM_MIN};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::MOE_ROUTE;
use ember_gguf::GgmlType;

const OP: &str = "moe_route";

/// Blocks of the kernel's one cluster (past the portable 8; the H100's GPCs hold 16) and
/// threads a block (kernels/moe_route.cu's MR_BLOCKS, MR_THREADS).
const BLOCKS: usize = 16;
const THREADS: u32 = 1024;
/// The experts route_regs holds in registers (kernels/route.cuh: 32 lanes x ROUTE_PER_LANE).
const MAX_EXPERTS: usize = 256;
/// The dynamic shared memory the function is allowed (and the occupancy query asks about):
/// the 35B's 2,048-wide rows, 16 of the router's 256 and the gate row a block, take 148,752 bytes.
const MAX_SMEM: usize = 160 * 1024;

#[repr(C)]
struct MoeRouteParams {
    r: RmsNormParams,
    q: u64,
    router: u64,
    gate_inp: u64,
    gs: u64,
    ids: u64,
    weights: u64,
    pad0: u64,
    n_expert: u32,
    k: u32,
    rows_per_block: u32,
    norm_threads: u32,
    ks_router: u32,
    ks_gate: u32,
    sum_min: f32,
    pad1: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeRouteParams` in kernels/moe_route.cu (RmsNormParams
// is 64 bytes, then 8 u64 and 8 4-byte fields: no padding).
unsafe impl DeviceRepr for MoeRouteParams {}

/// Shared memory of a block for rows `d` wide and `n_expert` experts: its rows and the gate row,
/// the normed row, the logits, the rows' part sums.
fn smem_bytes(d: usize, n_expert: usize) -> usize {
    let r = n_expert.div_ceil(BLOCKS);
    4 * ((r + 1) * d + d + n_expert + 4 * (r + 1))
}

impl Gpu {
    /// Whether [`Gpu::moe_route`] runs for rows `d` wide, `n_expert` experts and the top `k`:
    /// compute capability 9.0+ (clusters), a cluster of 16 that fits the GPU, `d` a multiple of
    /// 32 whose norm fits rms_norm's registers, at most 256 experts, and `EMBER_MOE_ROUTE=1` (or
    /// [`Gpu::set_moe_route`]).
    pub fn uses_moe_route(&self, d: usize, n_expert: usize, k: usize) -> bool {
        self.moe_route_runs(d, n_expert, k) && self.moe_route_function().is_ok_and(|f| f.is_some())
    }

    /// [`Gpu::uses_moe_route`] but for whether a cluster fits (the kernel's function).
    fn moe_route_runs(&self, d: usize, n_expert: usize, k: usize) -> bool {
        self.moe_route_on()
            && self.info().sm() >= 90
            && d > 0
            && d.is_multiple_of(32)
            && d <= 4 * block_of(d) as usize
            && (1..=MAX_EXPERTS).contains(&n_expert)
            && (1..=n_expert).contains(&k)
            && smem_bytes(d, n_expert) <= MAX_SMEM
    }

    /// The kernel with its shared memory and cluster size allowed, if a cluster of it fits.
    fn moe_route_function(&self) -> Result<Option<CudaFunction>> {
        let f = self.function(&MOE_ROUTE, "moe_route")?;
        let fits = *self.moe_route_fits().get_or_init(|| cluster_fits(&f, BLOCKS as u32, THREADS, MAX_SMEM));
        Ok(fits.then_some(f))
    }

    /// One token's MoE prelude: `h ← h + m`; f = RMSNorm(h)·`norm_w` with its int8 copy in the
    /// GPU's int8 scratch (as [`Gpu::add_rms_norm_q8`]); the logits of the F32 `router` [n_expert,
    /// d] and the F32 `gate_inp` row [1, d] on f, the latter into `gs` (as the GEMV of
    /// [`Gpu::matmul_multi`]); the routing of the logits into `ids` and `weights` (as
    /// [`Gpu::route`]). Bit for bit what those launches give. Returns the int8 copy's
    /// [`Gpu::q8_generation`]. Only where [`Gpu::uses_moe_route`].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        h: &mut Buf<f32>,
        m: &Buf<f32>,
        norm_w: &Buf<f32>,
        eps: f32,
        router: WeightRef<'_>,
        gate_inp: WeightRef<'_>,
        k: usize,
        f: &mut Buf<f32>,
        gs: &mut Buf<f32>,
        ids: &mut Buf<u32>,
        weights: &mut Buf<f32>,
    ) -> Result<u64> {
        let d = norm_w.len();
        let n_expert = router.n_rows;
        for (name, w, rows) in [("router", &router, n_expert), ("gate_inp", &gate_inp, 1)] {
            if w.ty() != GgmlType::F32 || w.k() != d || w.n_rows != rows {
                return Err(shape(OP, format!("{name}: {} rows of {} x {}, want F32 rows of {d}", w.n_rows, w.k(), w.ty().name())));
            }
        }
        if !self.moe_route_runs(d, n_expert, k) {
            return Err(shape(OP, format!("width {d}, {n_expert} experts, top {k}: not for this kernel or GPU")));
        }
        need(OP, "h", h, d)?;
        need(OP, "m", m, d)?;
        need(OP, "f", f, d)?;
        need(OP, "gs", gs, 1)?;
        need(OP, "ids", ids, k)?;
        need(OP, "weights", weights, k)?;
        let func = self.moe_route_function()?.ok_or_else(|| shape(OP, "no cluster of 16 fits this GPU".to_string()))?;
        let q = self.q8_scratch(q8_bytes(d))?;
        let generation = self.bump_q8_generation();
        let p = MoeRouteParams {
            r: add_norm_params(h, m, norm_w, f, d, eps)?,
            q,
            router: router.ptr(),
            gate_inp: gate_inp.ptr(),
            gs: gs.ptr(),
            ids: ids.ptr(),
            weights: weights.ptr(),
            pad0: 0,
            n_expert: n_expert as u32,
            k: k as u32,
            rows_per_block: n_expert.div_ceil(BLOCKS) as u32,
            norm_threads: block_of(d),
            ks_router: gemv_ksplit(n_expert, d) as u32,
            ks_gate: gemv_ksplit(1, d) as u32,
            sum_min: ROUTE_SUM_MIN,
            pad1: 0,
        };
        let smem = smem_bytes(d, n_expert) as u32;
        // SAFETY: h, m, f hold d floats, gs 1, ids and weights k, the router n_expert rows of d
        // f32 and the gate row d (checked above); the int8 scratch holds q8_bytes(d); one cluster
        // of 16 blocks of 1,024 threads with smem <= MAX_SMEM bytes, which the function allows.
        unsafe { self.launch(&func, (BLOCKS as u32, 1, 1), THREADS, smem, &p)? };
        Ok(generation)
    }
}
