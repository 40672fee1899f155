//! The MoE on int8 activations for batches too small to group by expert (a decode step's
//! tokens): gate/up and down in two launches, the shared expert riding along
//! (`kernels/moe.cu`'s int8 half), and their launch shapes.

use cudarc::driver::DeviceRepr;
use ember_gguf::GgmlType;

use super::{MoeExperts, MoeParams, MoeRouting, OP};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::MOE;
use crate::ops::gemv_q8::{self, q8_bytes, workers_per_row};
use crate::ops::matmul::Precision;
use crate::ops::{DeviceWeight, blocks, need, u32_of};

/// Rows of h per gate/up block in the int8 kernels (`MOE_GU_ROWS`: one int8 block, which the
/// block quantises itself) and the most lanes per row (`MOE_GU_MAX_SEG`: 512 threads a block).
const GU_ROWS: usize = 32;
const GU_MAX_SEG: usize = 16;

/// GU_MAX_SEG, or 8 or 32 from `EMBER_MOE_GU_SEG` (32: seg_sum stays in shuffles, as the
/// kernel's `part` of MOE_GU_MAX_SEG floats serves only seg > 32).
fn gu_max_seg() -> usize {
    static SEG: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SEG.get_or_init(|| match std::env::var("EMBER_MOE_GU_SEG").as_deref() {
        Ok("8") => 8,
        Ok("32") => 32,
        _ => GU_MAX_SEG,
    })
}

/// Whether Q4_K gate/up runs at 4 lanes a unit (`moe_gate_up_q8w_q4_k`: each lane 32 bytes of
/// a unit, half the header loads and scale decodes a weight). Measured on an H100 (docs/perf.md
/// g30): the 35B's one-token gate/up 8.63 → 8.09 us a layer in the step's chain; 16 sequences
/// (grouped, not this kernel) unchanged. `EMBER_MOE_GU_WIDE=0`: the 8-lane form.
pub(super) fn gu_wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| !std::env::var("EMBER_MOE_GU_WIDE").is_ok_and(|v| v == "0"))
}

/// `EMBER_MOE_DOWN_WIDE=1`: the Q6_K down at 4 lanes a unit (`moe_down_q8w_q6_k`: 16 bytes of
/// each field a lane, half the x and scale loads a weight), for measuring (the gate/up's wide
/// form took 0.55 us a layer off its 8.6, g30).
fn down_wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| std::env::var("EMBER_MOE_DOWN_WIDE").is_ok_and(|v| v == "1"))
}

/// `EMBER_MOE_DOWN_WR`: the one-token down's workers a row (a power of two), or None.
fn down_wr() -> Option<usize> {
    static WR: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *WR.get_or_init(|| std::env::var("EMBER_MOE_DOWN_WR").ok().and_then(|v| v.parse::<usize>().ok()).filter(|w| w.is_power_of_two()))
}

#[repr(C)]
pub(super) struct MoeQ8Params {
    pub(super) m: MoeParams,
    pub(super) xq: u64,
    pub(super) sg: u64,
    pub(super) su: u64,
    pub(super) sd: u64,
    pub(super) gs: u64,
    pub(super) wr: u32,
    pub(super) n_hq: u32,
    pub(super) ty_s_gu: u32,
    pub(super) ty_s_down: u32,
    pub(super) row_bytes_s_gu: u32,
    pub(super) row_bytes_s_down: u32,
    pub(super) n_ff_s: u32,
    pub(super) prefetch: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeQ8Params` in kernels/moe.cu (MoeParams is 104
// bytes, a multiple of 8, then 5 u64 and 8 u32: no padding in either language).
unsafe impl DeviceRepr for MoeQ8Params {}

/// The shared expert, for [`Gpu::moe_q8`] to run inside the routed experts' two kernels: gate
/// and up [n_ff_s rows of d] of one int8 type, down [d rows of n_ff_s], and its gate logit per
/// token (`sigmoid(gate_logit[t])` weighs its output).
#[derive(Clone, Copy)]
pub struct MoeSharedQ8<'a> {
    pub gate: &'a DeviceWeight,
    pub up: &'a DeviceWeight,
    pub down: &'a DeviceWeight,
    pub gate_logit: &'a Buf<f32>,
}

impl MoeSharedQ8<'_> {
    /// Whether [`Gpu::moe_q8`] can take it with experts `e` over rows of `d`: int8 types whose
    /// blocks tile the rows, shapes that chain, gate and up of one type.
    pub fn fits(&self, e: MoeExperts<'_>, d: usize) -> bool {
        shared_fits(self.gate, self.up, self.down, e, d)
    }
}

/// [`MoeSharedQ8::fits`] of a shared expert's gate, up and down.
pub(super) fn shared_fits(gate: &DeviceWeight, up: &DeviceWeight, down: &DeviceWeight, e: MoeExperts<'_>, d: usize) -> bool {
    let tiles = |w: &DeviceWeight| gemv_q8::unit(w.ty).is_some_and(|(_, bw)| w.k.is_multiple_of(bw));
    let n_ff_s = gate.n_rows;
    gate.ty == up.ty
        && tiles(gate)
        && tiles(down)
        && gate.k == d
        && up.k == d
        && up.n_rows == n_ff_s
        && down.k == n_ff_s
        && down.n_rows == d
        && n_ff_s.is_multiple_of(32)
        && gemv_q8::unit(e.gate.ty).is_some()
}

impl Gpu {
    /// Whether [`Gpu::moe_prec`] runs batches too small to group on int8 activations
    /// ([`Gpu::moe_q8`]): Fast, and gate/up and down of the types the int8 kernels have.
    pub fn moe_uses_q8(&self, e: MoeExperts<'_>, precision: Precision) -> bool {
        let fits = |ty, k: usize| gemv_q8::unit(ty).is_some_and(|(_, w)| k.is_multiple_of(w));
        precision == Precision::Fast && self.gemv_q8_on() && fits(e.gate.ty, e.gate.k) && fits(e.down.ty, e.down.k)
    }

    /// [`Gpu::moe`] on int8 activations: x quantised (unless `x_quantized`: the caller's last
    /// [`Gpu::quantize_q8`] was this x, n_tok·d values), gate/up, h quantised, down. With
    /// `shared`, the shared expert runs in the same kernels and `out` gets its gated output too
    /// (h then holds n_tok·(k·n_ff + n_ff_s) floats). The GPU's int8 scratch holds h's
    /// quantisation afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_q8(
        &self,
        e: MoeExperts<'_>,
        shared: Option<MoeSharedQ8<'_>>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &mut Buf<f32>,
        out: &mut Buf<f32>,
        x_quantized: bool,
    ) -> Result<()> {
        let (p, _) = self.moe_params(e, x, n_tok, r, h, out)?;
        let (d, n_ff) = (e.gate.k, e.down.k);
        let (Some((l_gu, w_gu)), Some((l_dn, w_dn)), Some(gu), Some(dn)) =
            (gemv_q8::unit(e.gate.ty), gemv_q8::unit(e.down.ty), gemv_q8::suffix(e.gate.ty), gemv_q8::suffix(e.down.ty))
        else {
            return Err(shape(OP, format!("no int8 MoE kernels for {} / {}", e.gate.ty.name(), e.down.ty.name())));
        };
        if !d.is_multiple_of(w_gu) || !n_ff.is_multiple_of(w_dn) {
            return Err(shape(OP, format!("d = {d}, n_ff = {n_ff}: not whole blocks of {w_gu} / {w_dn}")));
        }
        if let Some(s) = shared {
            if !s.fits(e, d) {
                let desc = |w: &DeviceWeight| format!("{} {}x{}", w.ty.name(), w.n_rows, w.k);
                return Err(shape(
                    OP,
                    format!("shared expert gate {}, up {}, down {} with d = {d}", desc(s.gate), desc(s.up), desc(s.down)),
                ));
            }
            need(OP, "shared gate logit", s.gate_logit, n_tok)?;
        }
        let n_ff_s = shared.map_or(0, |s| s.gate.n_rows);
        if !n_ff.is_multiple_of(GU_ROWS) || !n_ff_s.is_multiple_of(GU_ROWS) {
            return Err(shape(OP, format!("n_ff = {n_ff}, shared n_ff = {n_ff_s}: h is quantised in blocks of {GU_ROWS}")));
        }
        let n_hq = n_tok * (r.k * n_ff + n_ff_s);
        // h's int8 copy (values, then a (d, d·Σq) pair per 32) goes into the f32 h buffer.
        need(OP, "h", h, n_hq)?;
        if n_tok == 0 {
            return Ok(());
        }
        let pairs = n_tok * r.k;
        let blocks_y = u32_of(OP, "n_tok · (k + 1)", pairs + if shared.is_some() { n_tok } else { 0 })?;
        if !x_quantized {
            self.quantize_q8(x, n_tok * d)?;
        }
        let n_sm = self.info().n_sm;
        // The shared expert's weights use the routed layout's lanes per row: at least their
        // unit's lanes (all powers of two).
        let lanes_s = |w: Option<&DeviceWeight>| w.and_then(|w| gemv_q8::unit(w.ty)).map_or(1, |(l, _)| l);
        // Gate/up: 32 rows a block, at most GU_MAX_SEG lanes a row (threads = 32 · wr · L;
        // `EMBER_MOE_GU_SEG=32` allows the 8-lane form 32 lanes, 1,024 threads, for measuring;
        // the wide form is bounded at 512 threads, so at most GU_MAX_SEG).
        let wide = gu_wide() && e.gate.ty == GgmlType::Q4K && e.up.ty == GgmlType::Q4K;
        let l_gu = if wide { 4 } else { l_gu };
        let max_seg = if wide { gu_max_seg().min(GU_MAX_SEG) } else { gu_max_seg() };
        let wr_gu = workers_per_row(e.gate.ty, n_tok * r.k * n_ff, d / w_gu, l_gu, n_sm)
            .max(lanes_s(shared.map(|s| s.gate)) / l_gu)
            .clamp(1, (max_seg / l_gu).max(1));
        // Down: `EMBER_MOE_DOWN_WR` sets its workers a row (a power of two, wr · L <= 128), for
        // measuring.
        let down_w = down_wide() && e.down.ty == GgmlType::Q6K;
        let l_dn = if down_w { 4 } else { l_dn };
        let wr_dn = down_wr()
            .filter(|&w| w * l_dn <= gemv_q8::THREADS)
            .unwrap_or_else(|| workers_per_row(e.down.ty, n_tok * d, r.k * (n_ff / w_dn), l_dn, n_sm))
            .max(lanes_s(shared.map(|s| s.down)) / l_dn)
            .max(1);
        let down_bytes = n_tok * (r.k + usize::from(shared.is_some())) * d * e.down.row_bytes;
        let f_gu = self.function(&MOE, &if wide { "moe_gate_up_q8w_q4_k".to_string() } else { format!("moe_gate_up_q8_{gu}") })?;
        let f_dn = self.function(&MOE, &if down_w { "moe_down_q8w_q6_k".to_string() } else { format!("moe_down_q8_{dn}") })?;
        let threads = gemv_q8::THREADS;
        let mut q = MoeQ8Params {
            m: p,
            xq: self.q8_scratch(q8_bytes(n_tok * d))?,
            sg: 0,
            su: 0,
            sd: 0,
            gs: 0,
            wr: wr_gu as u32,
            n_hq: u32_of(OP, "h values", n_hq)?,
            ty_s_gu: 0,
            ty_s_down: 0,
            row_bytes_s_gu: 0,
            row_bytes_s_down: 0,
            n_ff_s: n_ff_s as u32,
            prefetch: if down_bytes <= gemv_q8::PREFETCH_MAX_BYTES { crate::ops::l2_prefetch() } else { 0 },
        };
        if let Some(s) = shared {
            q.sg = s.gate.ptr();
            q.su = s.up.ptr();
            q.sd = s.down.ptr();
            q.gs = s.gate_logit.ptr();
            q.ty_s_gu = s.gate.ty.id();
            q.ty_s_down = s.down.ty.id();
            q.row_bytes_s_gu = u32_of(OP, "row bytes", s.gate.row_bytes)?;
            q.row_bytes_s_down = u32_of(OP, "row bytes", s.down.row_bytes)?;
        }
        let threads_gu = GU_ROWS * wr_gu * l_gu;
        // SAFETY: moe_params checked the stacked weight shapes and the sizes of x, ids, weights,
        // h and out; the shared expert's shapes chain (`fits`), its gate logit holds n_tok and h
        // its n_tok·n_ff_s more floats (checked); the int8 scratch holds x's quantisation
        // (n_tok·d values, quantize_q8 above or the caller's); rows are whole blocks of their
        // types (checked), whose loads q8.cuh aligns as gemv_q8 does; seg = wr·L is a multiple
        // of the shared types' lanes and at most 32 (wr above: gu_max_seg); n_ff and n_ff_s are
        // multiples of 32 (checked), so each block's 32 rows are one int8 block of h, and h's
        // 4·n_hq bytes hold its int8 copy (n_hq + 8·n_hq/32 bytes).
        unsafe { self.launch(&f_gu, (blocks(n_ff.max(n_ff_s), GU_ROWS), blocks_y, 1), threads_gu as u32, 0, &q)? };
        debug_assert!(q8_bytes(n_hq) <= 4 * n_hq);
        q.xq = h.ptr();
        q.wr = wr_dn as u32;
        // SAFETY: as above; h now holds its own int8 copy (n_hq values), written by gate/up.
        // Down must be launched right after gate/up, with nothing between: with `prefetch` its
        // blocks read the routing (ids, slot_of) before pdl_enter, which is safe only because
        // the kernel that wrote the ids is then at least two launches back.
        unsafe { self.launch(&f_dn, (blocks(d, threads / (wr_dn * l_dn)), p.n_tok, 1), threads as u32, 0, &q) }
    }
}
