use cudarc::driver::DeviceRepr;
use cudarc::driver::sys::CUfunction_attribute;
use ember_gguf::GgmlType;

use super::gemv_q8::q8_bytes;
use super::matmul::{Precision, type_suffix};
use super::{blocks, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::{MOE, MOE_MMA8, MOE_SHARED};
use crate::ops::DeviceWeight;

mod fused;
mod q8;
pub use fused::SharedWeights;
pub use q8::MoeSharedQ8;

const OP: &str = "moe";
/// Shared memory for the staged activations (x_t: d floats; h_t: k·n_ff floats): under the
/// 48 KiB a block gets without opt-in, less 1 KiB for the kernels' static arrays (the IQ4_XS
/// table). The launch fails otherwise (seen on the H200 with the GEMV's 48 KiB + 64 bytes).
const SMEM: usize = 47 << 10;
/// Warps per block.
const WARPS: usize = 8;

/// Rows per block: enough blocks for ~4 per SM, each with 8 to 64 rows (a multiple of the
/// warps), so what a block stages is shared by as many rows as the size allows.
fn rows_per_block(n_rows: usize, n_sm: u32) -> usize {
    (n_rows / (4 * n_sm.max(1) as usize)).next_multiple_of(WARPS).clamp(WARPS, 64)
}

/// The routed experts of one MoE layer, stacked as in the GGUF file: gate and up hold
/// `n_slots · n_ff` rows of `d` weights, down `n_slots · d` rows of `n_ff`. With every expert
/// on the device, `n_slots = n_expert` and expert e is slot e (`slot_of` None); with some, expert
/// e is at slot `slot_of[e]`, or [`MOE_MISS`] when it is not here (its pairs add nothing).
#[derive(Debug, Clone, Copy)]
pub struct MoeExperts<'a> {
    pub gate: &'a DeviceWeight,
    pub up: &'a DeviceWeight,
    pub down: &'a DeviceWeight,
    pub n_expert: usize,
    pub slots: Option<MoeSlots<'a>>,
}

/// Which experts of a layer are on the device, and where (see [`MoeExperts`]).
#[derive(Debug, Clone, Copy)]
pub struct MoeSlots<'a> {
    /// [n_expert] slot per expert, or [`MOE_MISS`].
    pub slot_of: &'a Buf<u32>,
    /// Experts the stacked tensors hold.
    pub n_slots: usize,
}

/// The slot of an expert that is not on the device (`MOE_MISS` in kernels/moe.cu).
pub const MOE_MISS: u32 = u32::MAX;

impl MoeExperts<'_> {
    fn n_slots(&self) -> usize {
        self.slots.map_or(self.n_expert, |s| s.n_slots)
    }

    fn slot_of(&self) -> u64 {
        self.slots.map_or(0, |s| s.slot_of.ptr())
    }
}

/// A routing on the device ([`Gpu::route`]'s output): `k` expert ids and weights per token.
#[derive(Debug, Clone, Copy)]
pub struct MoeRouting<'a> {
    pub ids: &'a Buf<u32>,
    pub weights: &'a Buf<f32>,
    pub k: usize,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeParams {
    gate: u64,
    up: u64,
    down: u64,
    x: u64,
    ids: u64,
    weights: u64,
    h: u64,
    out: u64,
    slot_of: u64,
    d: u32,
    n_ff: u32,
    n_expert: u32,
    n_tok: u32,
    k_top: u32,
    row_bytes_gu: u32,
    row_bytes_down: u32,
    rows_per_block: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeParams` in kernels/moe.cu.
unsafe impl DeviceRepr for MoeParams {}

#[repr(C)]
struct MoePlanParams {
    ids: u64,
    plan: u64,
    slot_of: u64,
    n_pairs: u32,
    n_expert: u32,
    max_tiles: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoePlanParams` in kernels/moe.cu.
unsafe impl DeviceRepr for MoePlanParams {}

#[repr(C)]
#[derive(Clone, Copy)]
struct MoeMmaParams {
    m: MoeParams,
    plan: u64,
    part: u64,
    max_tiles: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeMmaParams` in kernels/moe.cu (MoeParams is 104
// bytes, so `plan` needs no padding in either language).
unsafe impl DeviceRepr for MoeMmaParams {}

#[repr(C)]
struct MoeMma8Params {
    q: MoeMmaParams,
    xq: u64,
}

// SAFETY: plain #[repr(C)] data matching `MoeMma8Params` in kernels/moe_mma8.cu (MoeMmaParams is 128
// bytes: no padding before `xq`).
unsafe impl DeviceRepr for MoeMma8Params {}

/// How a grouped prompt MoE ([`Gpu::moe_mma`]) runs its gate and up projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUpForm {
    /// f16 tensor-core tiles, gate and up in one pass over k (`moe_mma_gate_up_fused_<type>`).
    Fused,
    /// Q4_K weights on int8 tensor cores with x quantised to int8 (`moe_mma8_gate_up_q4_k`;
    /// Q4_K gate/up, d % 256 == 0, n_ff % 64 == 0; else as `Fused`).
    Int8,
    /// `Int8`'s sums, bit for bit, with the operands staged through shared memory
    /// (`moe_mma8s_gate_up_q4_k`; same conditions, else as `Fused`).
    Int8Staged,
}

/// How a grouped prompt MoE ([`Gpu::moe_mma`]) runs its down projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownForm {
    /// f16 tensor-core tiles.
    Tiles,
    /// Q4_K or Q6_K weights on int8 tensor cores with h quantised to int8
    /// (`moe_mma8_down_<type>`; n_ff % 256 == 0, d % 128 == 0; else as `Tiles`).
    Int8,
    /// `Int8`'s sums, bit for bit, with the operands staged through shared memory
    /// (`moe_mma8s_down_<type>`; n_ff 256 or 512 for Q4_K, 512 for Q6_K; else as `Int8`).
    Int8Staged,
}

/// Gate/up rows a block of `moe_mma8_gate_up_q4_k` (kernels/moe_mma8.cu MOE8_ROWS).
const MOE8_ROWS: usize = 64;
/// Whether `moe_mma8s_down_<type>` takes a down of this type and k = n_ff: it holds all of k in
/// shared memory (n_ff <= 512) and copies Q6_K rows as 420-byte rows in 4-byte pieces (n_ff =
/// 512: 4-byte aligned; 210-byte rows would be 2-byte aligned).
fn moe8s_down_fits(ty: GgmlType, n_ff: usize) -> bool {
    match ty {
        GgmlType::Q4K => n_ff == 256 || n_ff == 512,
        GgmlType::Q6K => n_ff == 512,
        _ => false,
    }
}

/// Dynamic shared memory of `moe_mma8s_down_<type>` (kernels/moe_mma8.cu): 128 rows of down at
/// the type's pitch (Q4_K 304 bytes, Q6_K 432), 32 h rows at 528, their 32 x 17 block scales of
/// 8 bytes.
fn moe8s_down_smem(ty: GgmlType) -> u32 {
    let pitch = if ty == GgmlType::Q6K { 432 } else { 304 };
    128 * pitch + 32 * 528 + 32 * 17 * 8
}

/// Dynamic shared memory of `moe_mma8s_gate_up_q4_k`: MOE8S_STAGES (3) stages of
/// MOE8S_STAGE_BYTES (its 128 rows' super-block, 128 x 144 bytes; the tile's 32 x rows of 256
/// values at a pitch of 272; their 8 x 33 block scales of 8 bytes) in kernels/moe_mma8.cu.
const MOE8S_SMEM: u32 = 3 * (128 * 144 + 32 * 272 + 8 * 33 * 8);
/// The most (token, slot) pairs an expert on average for which [`Gpu::moe_mma`] takes the int8
/// down, and the int8 gate/up read straight into registers: above it the f16 tiles were faster
/// (35B-A3B, 256 experts x 8 slots, H100, `bench/results/20261205-1750-h100-moe-int8/`: pp512
/// (16 a expert) +8 %, pp2048 (64) even, pp8192 (256) -3 %; `bench_moe_prompt` at 2048 tokens
/// 2.54 against 2.39 ms).
const MOE8_MAX_PAIRS: usize = 32;
/// The same bound for the staged int8 gate/up (`moe_mma8s_gate_up_q4_k`), by default: in the
/// model (35B-A3B Q4_K_M, H100, `bench/results/20261206-0205-h100-int8-prompts/`, one round)
/// it and the staged down up to 256 pairs an expert ran pp8192 (256 pairs) at 11,686 t/s
/// against 10,227 with the f16 tiles there, pp2048 at 11,456 against 11,022 (64 pairs, gate/up
/// int8 and down f16), pp512 even; in `bench_moe_prompt` at 2048 tokens the staged pair took
/// 1.552 ms against the f16 tiles' 2.340. Not measured above 256. `EMBER_MOE_MMA8_MAX_PAIRS`
/// overrides it.
pub(crate) const MOE8S_MAX_PAIRS: usize = 256;
/// The same for the staged int8 down (`moe_mma8s_down_<type>`; the figures above).
/// `EMBER_MOE_MMA8_DOWN_MAX_PAIRS` overrides it.
pub(crate) const MOE8SD_MAX_PAIRS: usize = 256;
/// Down rows a block of `moe_mma8_down_<type>` (kernels/moe_mma8.cu MOE8D_ROWS).
const MOE8D_ROWS: usize = 128;

/// Pairs per tensor-core tile of the grouped MoE (`MOE_BM` in kernels/moe.cu).
const MOE_BM: usize = 32;
/// Weight rows and threads per tensor-core block (`MMA_BN`, `MMA_THREADS` in kernels/mma.cuh).
const MOE_ROWS: usize = 128;
const MOE_THREADS: u32 = 256;
/// Tokens above which [`Precision::Fast`] groups the MoE by expert ([`Gpu::moe_mma`]; since
/// g14-g22 its kernels are int8 and staged). H100, the 35B's batched decode at depth 0
/// (`ember bench --n-seq N -p 0 -n 32`, aggregate t/s, two rounds, per-pair against grouped;
/// docs/perf.md g23): 2 sequences 437 / 442 against 419 / 417, 4: 744 / 746 against 709 / 705,
/// 5: 796 / 795 against 875 / 869, 6: 940 / 940 against 1,041 / 1,026, 8: 1,197 / 1,198 against
/// 1,276 / 1,273, 16: 1,794 / 1,778 against 2,022 / 2,014 (at depth 4096: 1,659 against 1,865).
/// The per-pair kernels read an expert's rows once per pair, the grouped ones once per expert.
/// (2026-12-03, H200, when the grouped kernels were f16 tiles: 48.)
pub const MOE_MMA_MIN_TOKENS: usize = 4;
/// Most experts the grouped plan handles (its per-expert counters live in shared memory).
const MOE_MAX_EXPERTS: usize = 4096;

/// The most tiles a routing of `pairs` (token, slot) pairs over `n_expert` experts can cut into:
/// every full tile, plus one partial tile per expert that has pairs.
fn max_tiles(pairs: usize, n_expert: usize) -> usize {
    pairs.div_ceil(MOE_BM) + n_expert.min(pairs)
}

/// Floats of scratch [`Gpu::moe_prec`] needs besides `h` when it groups by expert
/// ([`Gpu::moe_grouped`] says when): the weighted expert outputs (n_tok·k·d) and the plan (u32
/// words: a tile table and the pairs' list).
pub fn moe_scratch_len(n_tok: usize, k: usize, n_expert: usize, d: usize) -> usize {
    let pairs = n_tok * k;
    pairs * d + 1 + 3 * max_tiles(pairs, n_expert) + pairs
}

#[repr(C)]
struct MoeSharedParams {
    out: u64,
    s: u64,
    gate: u64,
    n_tok: u32,
    d: u32,
}

// SAFETY: plain #[repr(C)] data matching `MoeSharedParams` in kernels/moe_shared.cu.
unsafe impl DeviceRepr for MoeSharedParams {}

impl Gpu {
    /// The shared expert's share of the MoE: `out[t][i] += sigmoid(gate[t]) · s[t][i]` for
    /// out and s [n_tok, d], gate [n_tok].
    pub fn moe_shared_add(&self, out: &mut Buf<f32>, s: &Buf<f32>, gate: &Buf<f32>, n_tok: usize, d: usize) -> Result<()> {
        const OP: &str = "moe_shared_add";
        need(OP, "out", out, n_tok * d)?;
        need(OP, "s", s, n_tok * d)?;
        need(OP, "gate", gate, n_tok)?;
        if n_tok == 0 || d == 0 {
            return Ok(());
        }
        if n_tok > 65535 {
            return Err(shape(OP, format!("{n_tok} tokens (at most 65535 per call)")));
        }
        let p = MoeSharedParams { out: out.ptr(), s: s.ptr(), gate: gate.ptr(), n_tok: n_tok as u32, d: u32_of(OP, "d", d)? };
        let f = self.function(&MOE_SHARED, "moe_shared_add")?;
        // SAFETY: out and s hold n_tok·d floats, gate n_tok (checked above).
        unsafe { self.launch(&f, (blocks(d, 256), p.n_tok, 1), 256, 0, &p) }
    }

    /// Whether [`Gpu::moe_prec`] groups the pairs by expert on tensor cores for this batch
    /// (then it needs [`moe_scratch_len`] floats of scratch): Fast batches of more than
    /// [`MOE_MMA_MIN_TOKENS`] tokens (`EMBER_MOE_MMA_MIN_TOKENS` overrides it).
    pub fn moe_grouped(&self, n_tok: usize, n_expert: usize, precision: Precision) -> bool {
        precision == Precision::Fast && n_tok > self.moe_mma_min_tokens && self.has_mma() && n_expert <= MOE_MAX_EXPERTS
    }

    /// [`Gpu::moe`] at `precision`: under [`Precision::Fast`], batches of more than
    /// [`MOE_MMA_MIN_TOKENS`] tokens run [`Gpu::moe_mma`]; `scratch` must then hold
    /// [`moe_scratch_len`] floats (else it is unused). Fewer tokens, or Exact, run [`Gpu::moe`].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_prec(
        &self,
        e: MoeExperts<'_>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        out: &mut Buf<f32>,
        precision: Precision,
    ) -> Result<()> {
        if self.moe_grouped(n_tok, e.n_expert, precision) {
            self.moe_mma(e, x, n_tok, r, h, scratch, out)
        } else if self.moe_uses_q8(e, precision) {
            self.moe_q8(e, None, x, n_tok, r, h, out, false)
        } else {
            self.moe(e, x, n_tok, r, h, out)
        }
    }

    /// [`Gpu::moe`] grouped by expert on tensor cores (sm_80+, at most 4096 experts): the
    /// (token, slot) pairs are listed per expert on the device and each expert's tokens run as
    /// tensor-core tiles (f16 operands, f32 sums), then each token's experts are summed in slot
    /// order. `scratch` holds [`moe_scratch_len`] floats.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_mma(
        &self,
        e: MoeExperts<'_>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        let pairs = n_tok * r.k;
        let few = pairs <= MOE8_MAX_PAIRS.saturating_mul(e.n_expert);
        let few_staged = pairs <= self.moe_mma8s_max_pairs.saturating_mul(e.n_expert);
        let form = match (self.moe_mma8, self.moe_mma8_staged) {
            (true, true) if few_staged => GateUpForm::Int8Staged,
            (true, false) if few => GateUpForm::Int8,
            _ => GateUpForm::Fused,
        };
        let few_down = pairs <= self.moe_mma8s_down_max_pairs.saturating_mul(e.n_expert);
        // Where the staged down cannot run (moe8s_down_fits), the unstaged one keeps its own
        // bound: above it the f16 tiles were faster.
        let staged_down = self.moe_mma8_staged && moe8s_down_fits(e.down.ty, e.down.k);
        let down = match (self.moe_mma8_down, staged_down) {
            (true, true) if few_down => DownForm::Int8Staged,
            (true, false) if few => DownForm::Int8,
            _ => DownForm::Tiles,
        };
        self.moe_mma_form(form, down, e, x, n_tok, r, h, scratch, out)
    }

    /// [`Gpu::moe_mma`] with its gate/up and down in the given forms (what `EMBER_MOE_MMA8` and
    /// `EMBER_MOE_MMA8_DOWN` pick for `moe_mma`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_mma_form(
        &self,
        form: GateUpForm,
        down: DownForm,
        e: MoeExperts<'_>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        let (p, [gu, dn]) = self.moe_params(e, x, n_tok, r, h, out)?;
        let (ne, d, n_ff) = (e.n_expert, e.gate.k, e.down.k);
        if !self.has_mma() || ne > MOE_MAX_EXPERTS {
            return Err(shape(
                OP,
                format!("the tensor-core MoE needs sm_80 and at most {MOE_MAX_EXPERTS} experts: sm_{}, {ne}", self.info().sm()),
            ));
        }
        if n_tok == 0 {
            return Ok(());
        }
        let pairs = n_tok * r.k;
        need(OP, "scratch", scratch, moe_scratch_len(n_tok, r.k, ne, d))?;
        let tiles = max_tiles(pairs, ne);
        if tiles > 65_535 {
            return Err(shape(OP, format!("{n_tok} tokens x {} slots (at most {} tiles per call)", r.k, 65_535)));
        }
        let plan_at = scratch.ptr() + 4 * (pairs * d) as u64;
        let plan = MoePlanParams {
            ids: r.ids.ptr(),
            plan: plan_at,
            slot_of: e.slot_of(),
            n_pairs: u32_of(OP, "n_tok · k", pairs)?,
            n_expert: u32_of(OP, "n_expert", ne)?,
            max_tiles: tiles as u32,
            pad: 0,
        };
        let q = MoeMmaParams { m: p, plan: plan_at, part: scratch.ptr(), max_tiles: tiles as u32, pad: 0 };
        let f_plan = self.function(&MOE, "moe_plan")?;
        let int8 = form != GateUpForm::Fused && e.gate.ty == GgmlType::Q4K && d.is_multiple_of(256) && n_ff.is_multiple_of(MOE8_ROWS);
        let staged = int8 && form == GateUpForm::Int8Staged;
        let f_gu = match (int8, staged) {
            (true, true) => {
                let f = self.function(&MOE_MMA8, "moe_mma8s_gate_up_q4_k")?;
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                f.set_attribute(attr, MOE8S_SMEM as i32)
                    .map_err(|e| shape(OP, format!("moe_mma8s_gate_up_q4_k's {MOE8S_SMEM} bytes of shared memory: {e:?}")))?;
                f
            }
            (true, false) => self.function(&MOE_MMA8, "moe_mma8_gate_up_q4_k")?,
            (false, _) => self.function(&MOE, &format!("moe_mma_gate_up_fused_{gu}"))?,
        };
        let int8_down = down != DownForm::Tiles
            && matches!(e.down.ty, GgmlType::Q4K | GgmlType::Q6K)
            && n_ff.is_multiple_of(256)
            && d.is_multiple_of(MOE8D_ROWS);
        // The staged down holds all of k in shared memory, and copies Q6_K rows in 4-byte
        // pieces (420-byte rows at n_ff = 512; 210-byte ones would be 2-byte aligned).
        let staged_down = int8_down && down == DownForm::Int8Staged && moe8s_down_fits(e.down.ty, n_ff);
        // The int8 scratch holds x's copy for gate/up, then h's for down: sized for both
        // before the first launch, so it is not replaced under a queued kernel.
        let q8_len = if int8 { n_tok * d } else { 0 }.max(if int8_down { pairs * n_ff } else { 0 });
        let xq = if q8_len > 0 { self.q8_scratch(q8_bytes(q8_len))? } else { 0 };
        if int8 {
            // x's int8 copy for the gate/up kernel (the GEMVs' scratch: later decode GEMVs see
            // the generation change and quantise their own x again).
            self.quantize_q8(x, n_tok * d)?;
        }
        let q8 = MoeMma8Params { q, xq };
        let dn_smem = moe8s_down_smem(e.down.ty);
        let f_dn = match (int8_down, staged_down) {
            (true, true) => {
                let f = self.function(&MOE_MMA8, &format!("moe_mma8s_down_{dn}"))?;
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                f.set_attribute(attr, dn_smem as i32)
                    .map_err(|e| shape(OP, format!("moe_mma8s_down_{dn}'s {dn_smem} bytes of shared memory: {e:?}")))?;
                f
            }
            (true, false) => self.function(&MOE_MMA8, &format!("moe_mma8_down_{dn}"))?,
            (false, _) => self.function(&MOE, &format!("moe_mma_down_{dn}"))?,
        };
        let f_sum = self.function(&MOE, "moe_combine")?;
        // SAFETY: moe_params checked the stacked weight shapes and the sizes of x, ids, weights,
        // h and out; scratch holds the parts (pairs·d floats) and then the plan (1 + 3·tiles +
        // pairs words), checked above. The plan kernel writes at most `tiles` tiles (a bound on
        // any routing of `pairs` pairs) and `pairs` list entries; ids out of range are left out
        // of the plan (their outputs become NaN in moe_combine). moe_plan's shared memory is
        // 2·n_expert words (n_expert <= MOE_MAX_EXPERTS: 32 KiB).
        unsafe {
            self.launch(&f_plan, (1, 1, 1), 1024, 8 * ne as u32, &plan)?;
            if int8 {
                // quantize_q8 above wrote n_tok·d values and their scales into the scratch
                // (q8_bytes); the kernel reads the gate/up rows of the plan's experts (Q4_K,
                // whole super-blocks: d % 256 == 0) and writes h for rows r0..r0 + 64 < n_ff.
                let smem = if staged { MOE8S_SMEM } else { 0 };
                self.launch(&f_gu, ((n_ff / MOE8_ROWS) as u32, tiles as u32, 1), 256, smem, &q8)?;
            } else {
                self.launch(&f_gu, (n_ff.div_ceil(MOE_ROWS) as u32, tiles as u32, 1), MOE_THREADS, 0, &q)?;
            }
        }
        if int8_down {
            // h's int8 copy for the down kernel, in the scratch sized above (same address).
            self.quantize_q8(h, pairs * n_ff)?;
        }
        // SAFETY: as above; the int8 down kernel reads h's copy (pairs·n_ff values and their
        // scales, written by quantize_q8 just before it) and the down rows of the plan's experts
        // (Q4_K or Q6_K, whole super-blocks: n_ff % 256 == 0; the staged kernel n_ff <= 512,
        // its shared memory set above), and writes the parts of rows r0..r0 + 128 <= d.
        unsafe {
            if int8_down {
                let smem = if staged_down { dn_smem } else { 0 };
                self.launch(&f_dn, ((d / MOE8D_ROWS) as u32, tiles as u32, 1), 256, smem, &q8)?;
            } else {
                self.launch(&f_dn, (d.div_ceil(MOE_ROWS) as u32, tiles as u32, 1), MOE_THREADS, 0, &q)?;
            }
            let grid = u32_of(OP, "n_tok · d / 256", (n_tok * d).div_ceil(256))?;
            self.launch(&f_sum, (grid, 1, 1), 256, 0, &q)
        }
    }

    /// `out[t] = Σ_j w[t][j] · down_e(silu(gate_e·x_t) ⊙ up_e·x_t)`, e = ids[t][j], for x
    /// [n_tok, d]; `h` is scratch of n_tok·k·n_ff floats. Only the routed experts are read.
    pub fn moe(
        &self,
        e: MoeExperts<'_>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &mut Buf<f32>,
        out: &mut Buf<f32>,
    ) -> Result<()> {
        let (mut p, [gu, dn]) = self.moe_params(e, x, n_tok, r, h, out)?;
        if n_tok == 0 {
            return Ok(());
        }
        let (d, n_ff) = (e.gate.k, e.down.k);
        let f_gu = self.function(&MOE, &format!("moe_gate_up_{gu}"))?;
        let f_dn = self.function(&MOE, &format!("moe_down_{dn}"))?;
        let pairs = u32_of(OP, "n_tok · k", n_tok * r.k)?;
        if pairs > 65_535 || n_tok > 65_535 {
            return Err(shape(OP, format!("{n_tok} tokens x {} slots (at most 65,535 pairs and tokens per call)", r.k)));
        }
        // SAFETY: the weights have the stacked shapes checked above; x, ids, weights, h and out
        // hold what the shapes need; the kernels bounds-check each expert id against n_expert.
        // Shared memory: d floats (gate/up), k·n_ff floats (down), both <= SMEM (checked).
        let n_sm = self.info().n_sm;
        unsafe {
            p.rows_per_block = rows_per_block(n_ff * n_tok * r.k, n_sm) as u32;
            self.launch(&f_gu, (blocks(n_ff, p.rows_per_block as usize), pairs, 1), 32 * WARPS as u32, 4 * d as u32, &p)?;
            p.rows_per_block = rows_per_block(d * n_tok, n_sm) as u32;
            self.launch(&f_dn, (blocks(d, p.rows_per_block as usize), p.n_tok, 1), 32 * WARPS as u32, 4 * (r.k * n_ff) as u32, &p)
        }
    }

    /// The shape checks of [`Gpu::moe`], its kernels' parameters (rows_per_block unset) and the
    /// kernel suffixes of the gate/up and down types.
    fn moe_params(
        &self,
        e: MoeExperts<'_>,
        x: &Buf<f32>,
        n_tok: usize,
        r: MoeRouting<'_>,
        h: &Buf<f32>,
        out: &Buf<f32>,
    ) -> Result<(MoeParams, [&'static str; 2])> {
        let (d, ne, ns) = (e.gate.k, e.n_expert, e.n_slots());
        let n_ff = e.down.k;
        let ok = ne > 0
            && e.up.k == d
            && e.gate.ty == e.up.ty
            && e.gate.n_rows == ns * n_ff
            && e.up.n_rows == ns * n_ff
            && e.down.n_rows == ns * d
            && d.is_multiple_of(8)
            && n_ff.is_multiple_of(8)
            && 4 * d <= SMEM
            && 4 * r.k * n_ff <= SMEM;
        if !ok {
            let desc = |w: &DeviceWeight| format!("{} {}x{}", w.ty.name(), w.n_rows, w.k);
            return Err(shape(
                OP,
                format!("{ne} experts in {ns} slots, k = {}: gate {}, up {}, down {}", r.k, desc(e.gate), desc(e.up), desc(e.down)),
            ));
        }
        if let Some(s) = e.slots {
            need(OP, "slot_of", s.slot_of, ne)?;
        }
        let (Some(gu), Some(dn)) = (type_suffix(e.gate.ty), type_suffix(e.down.ty)) else {
            return Err(shape(OP, format!("no CUDA kernel for {} / {}", e.gate.ty.name(), e.down.ty.name())));
        };
        need(OP, "x", x, n_tok * d)?;
        need(OP, "ids", r.ids, n_tok * r.k)?;
        need(OP, "weights", r.weights, n_tok * r.k)?;
        need(OP, "h", h, n_tok * r.k * n_ff)?;
        need(OP, "out", out, n_tok * d)?;
        let p = MoeParams {
            gate: e.gate.ptr(),
            up: e.up.ptr(),
            down: e.down.ptr(),
            x: x.ptr(),
            ids: r.ids.ptr(),
            weights: r.weights.ptr(),
            h: h.ptr(),
            out: out.ptr(),
            slot_of: e.slot_of(),
            d: u32_of(OP, "d", d)?,
            n_ff: u32_of(OP, "n_ff", n_ff)?,
            n_expert: u32_of(OP, "n_expert", ne)?,
            n_tok: u32_of(OP, "n_tok", n_tok)?,
            k_top: u32_of(OP, "k", r.k)?,
            row_bytes_gu: u32_of(OP, "row bytes", e.gate.row_bytes)?,
            row_bytes_down: u32_of(OP, "row bytes", e.down.row_bytes)?,
            rows_per_block: 0,
        };
        Ok((p, [gu, dn]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The number after `key` in the kernel source (a `#define NAME N` or `NAME = N`).
    fn number_after(src: &str, key: &str) -> u32 {
        let at = src.find(key).unwrap_or_else(|| panic!("{key} not in kernels/moe_mma8.cu")) + key.len();
        let digits: String = src[at..].trim_start_matches([' ', '=']).chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("no number after {key}"))
    }

    /// The dynamic shared memory the host sets for the staged kernels is what their layouts in
    /// kernels/moe_mma8.cu index (a stage's or the down's rows, x/h rows at their pitch, the
    /// block scales at theirs): a drift on either side would read past the allocation.
    #[test]
    fn staged_shared_memory_matches_the_kernel_layouts() {
        let src = include_str!("../../../kernels/moe_mma8.cu");
        let (rows, stages, xld) =
            (number_after(src, "#define MOE8_ROWS"), number_after(src, "#define MOE8S_STAGES"), number_after(src, "#define MOE8S_XLD"));
        let bm = number_after(include_str!("../../../kernels/moe.cuh"), "#define MOE_BM");
        assert_eq!(MOE8S_SMEM, stages * (2 * rows * 144 + bm * xld + 8 * (bm + 1) * 8));
        let (d_rows, hld, sld) =
            (number_after(src, "#define MOE8D_ROWS"), number_after(src, "#define MOE8SD_HLD"), number_after(src, "#define MOE8SD_SLD"));
        let pitch = |ty: &str| number_after(&src[src.find(&format!("struct Moe8sDown<{ty}>")).expect("Moe8sDown")..], "PITCH");
        // h rows hold all of k (n_ff <= 512) and 16 block scales, both padded by one unit.
        assert!(hld >= 512 && sld > 16);
        assert_eq!(moe8s_down_smem(GgmlType::Q4K), d_rows * pitch("TY_Q4_K") + bm * hld + bm * sld * 8);
        assert_eq!(moe8s_down_smem(GgmlType::Q6K), d_rows * pitch("TY_Q6_K") + bm * hld + bm * sld * 8);
        // A whole row of k = 512 fits its pitch: 2·144 (Q4_K), 420 (Q6_K).
        assert!(pitch("TY_Q4_K") >= 288 && pitch("TY_Q6_K") >= 420);
    }
}
