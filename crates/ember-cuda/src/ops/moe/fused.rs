//! One token's MoE in one launch (`moe_fused_q8_<down type>`, kernels/moe.cu): a cluster of 16
//! blocks an expert (the k routed ones, then the shared one) runs the expert's gate/up as
//! `moe_gate_up_q8w_q4_k` does, gathers the expert's int8 h from its blocks' shared memory, and
//! runs its down from shared memory, where each block copied its rows while its gate/up ran. Each
//! expert's weighted output is a row of `parts`; the norm after the MoE adds them in order
//! (`Gpu::add_rms_norm_q8_parts`). Two links of a decode step's chain become one.

use cudarc::driver::{CudaFunction, DeviceRepr};
use ember_gguf::GgmlType;

use super::q8::{MoeQ8Params, MoeSharedQ8, gu_wide, shared_fits};
use super::{MoeExperts, MoeRouting, OP};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::MOE;
use crate::ops::gemv_q8::q8_bytes;
use crate::ops::route::ROUTE_SUM_MIN;
use crate::ops::{DeviceWeight, cluster_fits, u32_of};

/// Blocks a cluster (one expert; kernels/moe.cu's MF_CLUSTER), rows of h a block
/// (MOE_GU_ROWS), lanes a row (MF_SEG) and threads a block (MF_THREADS).
const CLUSTER: usize = 16;
const GU_ROWS: usize = 32;
const SEG: usize = 16;
const THREADS: usize = GU_ROWS * SEG;
/// The most dynamic shared memory a block asks for: two blocks an SM (the 35B: 54,400 bytes).
const MAX_SMEM: usize = 100 * 1024;
/// The most experts and routed pairs the routing inside the launch takes (kernels/route.cuh's
/// 32 · ROUTE_PER_LANE, moe.cu's MF_MAX_K).
const ROUTE_MAX_EXPERTS: usize = 256;
const ROUTE_MAX_K: usize = 32;

#[repr(C)]
struct MoeFusedParams {
    q: MoeQ8Params,
    parts: u64,
    down_rows: u32,
    act_bytes: u32,
    logits: u64,
    sum_min: f32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeFusedParams` in kernels/moe.cu (MoeQ8Params is 176
// bytes, a multiple of 8, then a u64, two u32, a u64, an f32 and a u32: no padding).
unsafe impl DeviceRepr for MoeFusedParams {}

/// Shared memory before a block's down rows: h's n_ff int8 values and their n_ff / 32 (d, d·Σq)
/// pairs, to whole 16-byte chunks.
fn act_bytes(n_ff: usize) -> usize {
    (n_ff + 8 * (n_ff / 32)).next_multiple_of(16)
}

/// A shared expert's gate, up and down (what [`Gpu::uses_moe_fused`] asks about).
#[derive(Clone, Copy)]
pub struct SharedWeights<'a> {
    pub gate: &'a DeviceWeight,
    pub up: &'a DeviceWeight,
    pub down: &'a DeviceWeight,
}

impl Gpu {
    /// Whether [`Gpu::moe_fused_q8`] runs these experts with this shared expert over rows of `d`
    /// for one token: `EMBER_MOE_FUSED=1` (or [`Gpu::set_moe_fused`]), compute capability 9.0+
    /// (clusters), every expert resident at its index, Q4_K gate/up (their 4-lane form on), a
    /// Q4_K or Q6_K down, n_ff = 16 · 32 for the routed and the shared expert, the shared expert's
    /// gate/up and down of an int8 type, d a multiple of 16 · 32, and a cluster of 16 that fits.
    pub fn uses_moe_fused(&self, e: MoeExperts<'_>, s: SharedWeights<'_>, d: usize) -> bool {
        self.moe_fused_runs(e, s, d) && self.moe_fused_function(e.down.ty == GgmlType::Q6K).is_ok_and(|f| f.is_some())
    }

    fn moe_fused_runs(&self, e: MoeExperts<'_>, s: SharedWeights<'_>, d: usize) -> bool {
        let n_ff = CLUSTER * GU_ROWS;
        let int8 = |ty| matches!(ty, GgmlType::Q4K | GgmlType::Q6K | GgmlType::Q8_0);
        let down_rows = d / CLUSTER;
        let slice = |rb: usize| (down_rows * rb).is_multiple_of(16) && act_bytes(n_ff) + down_rows * rb <= MAX_SMEM;
        self.moe_fused_on()
            && self.info().sm() >= 90
            && e.slots.is_none()
            && gu_wide()
            && e.gate.ty == GgmlType::Q4K
            && e.up.ty == GgmlType::Q4K
            && matches!(e.down.ty, GgmlType::Q4K | GgmlType::Q6K)
            && e.gate.k == d
            && e.down.k == n_ff
            && e.gate.n_rows == e.n_expert * n_ff
            && e.down.n_rows == e.n_expert * d
            && shared_fits(s.gate, s.up, s.down, e, d)
            && s.gate.n_rows == n_ff
            && int8(s.gate.ty)
            && int8(s.down.ty)
            && d.is_multiple_of(CLUSTER * GU_ROWS)
            && slice(e.down.row_bytes)
            && slice(s.down.row_bytes)
            && e.down.ptr().is_multiple_of(16)
            && s.down.ptr().is_multiple_of(16)
    }

    /// Whether [`Gpu::moe_fused_q8`] can also route `n_expert` experts to the top `k` itself
    /// (`EMBER_MOE_FUSED=2` or [`Gpu::set_moe_fused_route`], where the one launch runs at all).
    pub fn moe_fused_routes(&self, n_expert: usize, k: usize) -> bool {
        self.moe_fused_route_on() && (1..=ROUTE_MAX_EXPERTS).contains(&n_expert) && (1..=ROUTE_MAX_K.min(n_expert)).contains(&k)
    }

    /// The kernel for a Q6_K (else Q4_K) down with its shared memory and cluster size allowed, if
    /// a cluster of it fits.
    fn moe_fused_function(&self, q6: bool) -> Result<Option<CudaFunction>> {
        let f = self.function(&MOE, if q6 { "moe_fused_q8_q6_k" } else { "moe_fused_q8_q4_k" })?;
        let fits = *self.moe_fused_fits(q6).get_or_init(|| cluster_fits(&f, CLUSTER as u32, THREADS as u32, MAX_SMEM));
        Ok(fits.then_some(f))
    }

    /// One token's MoE with its shared expert in one launch: `parts` [k + 1, d] gets each
    /// expert's weighted output (routing order, then the shared expert's, weighted by the sigmoid
    /// of its gate logit), whose sum is what [`Gpu::moe_q8`] writes to its `out` (another
    /// grouping of the same sums: not its bits). x quantised first unless `x_quantized` (the
    /// caller's last [`Gpu::quantize_q8`] was this x). `h` is the MoE's scratch (unused here:
    /// each cluster keeps its expert's h in shared memory). With `route_logits` (the router's
    /// [n_expert] logits; where [`Gpu::moe_fused_routes`]) the launch routes them itself, as
    /// [`Gpu::route`] would, and writes r's ids and weights: the route's launch is not needed.
    /// Only where [`Gpu::uses_moe_fused`].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_fused_q8(
        &self,
        e: MoeExperts<'_>,
        s: MoeSharedQ8<'_>,
        x: &Buf<f32>,
        r: MoeRouting<'_>,
        route_logits: Option<&Buf<f32>>,
        h: &Buf<f32>,
        parts: &mut Buf<f32>,
        x_quantized: bool,
    ) -> Result<()> {
        let d = e.gate.k;
        if !self.moe_fused_runs(e, SharedWeights { gate: s.gate, up: s.up, down: s.down }, d) {
            return Err(shape(OP, format!("d = {d}, down {}: not for the one-launch MoE on this GPU", e.down.ty.name())));
        }
        let q6 = e.down.ty == GgmlType::Q6K;
        let func = self.moe_fused_function(q6)?.ok_or_else(|| shape(OP, "no cluster of 16 fits this GPU".to_string()))?;
        crate::ops::need(OP, "parts", parts, (r.k + 1) * d)?;
        if let Some(l) = route_logits {
            if !self.moe_fused_routes(e.n_expert, r.k) {
                return Err(shape(OP, format!("{} experts, top {}: not routed inside the one-launch MoE", e.n_expert, r.k)));
            }
            crate::ops::need(OP, "router logits", l, e.n_expert)?;
        }
        crate::ops::need(OP, "shared gate logit", s.gate_logit, 1)?;
        let (m, _) = self.moe_params(e, x, 1, r, h, parts)?;
        if !x_quantized {
            self.quantize_q8(x, d)?;
        }
        let n_ff = e.down.k;
        let q = MoeQ8Params {
            m,
            xq: self.q8_scratch(q8_bytes(d))?,
            sg: s.gate.ptr(),
            su: s.up.ptr(),
            sd: s.down.ptr(),
            gs: s.gate_logit.ptr(),
            wr: (SEG / 4) as u32,
            n_hq: 0,
            ty_s_gu: s.gate.ty.id(),
            ty_s_down: s.down.ty.id(),
            row_bytes_s_gu: u32_of(OP, "row bytes", s.gate.row_bytes)?,
            row_bytes_s_down: u32_of(OP, "row bytes", s.down.row_bytes)?,
            n_ff_s: n_ff as u32,
            prefetch: 0,
        };
        let down_rows = d / CLUSTER;
        let f = MoeFusedParams {
            q,
            parts: parts.ptr(),
            down_rows: down_rows as u32,
            act_bytes: act_bytes(n_ff) as u32,
            logits: route_logits.map_or(0, Buf::ptr),
            sum_min: ROUTE_SUM_MIN,
            pad: 0,
        };
        let smem = act_bytes(n_ff) + down_rows * e.down.row_bytes.max(s.down.row_bytes);
        let blocks_y = u32_of(OP, "k + 1", r.k + 1)?;
        // SAFETY: moe_params checked the stacked weights (every expert at its index: no slots),
        // x, ids and weights; moe_fused_runs the shapes the kernel assumes (n_ff = 16 · 32 for
        // both experts, so a cluster's 16 blocks of 32 rows are its h; d / 16 down rows a block,
        // whole 16-byte chunks of 16-byte aligned rows, which smem <= MAX_SMEM holds after h's
        // int8 copy) and the types it dispatches on; parts holds (k + 1)·d floats, the gate
        // logit 1; the int8 scratch holds x's quantisation; with route logits, they hold n_expert
        // values (at most 256, k at most 32: route_regs' registers, the kernel's MF_MAX_K), and
        // the routing's ids and weights k each (moe_params). Grid (16, k + 1) in clusters of 16
        // along x, 512 threads, as the function allows.
        unsafe { self.launch(&func, (CLUSTER as u32, blocks_y, 1), THREADS as u32, smem as u32, &f) }
    }
}
