use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr};

use super::kv_append::{KV_PAGE, KvPages};
use super::{Act, SeqRows, need, u32_of};
use crate::error::{Result, shape};
use crate::gpu::{Buf, Gpu};
use crate::kernels::{ATTENTION, ATTENTION_DECODE, ATTENTION_DECODE_MMA, ATTENTION_PREFILL, ATTENTION_WG};
use ember_gguf::GgmlType;

mod shape;
pub use shape::{
    ATTENTION_MMA_MIN_ROW_KEYS, ATTENTION_MMA_MIN_ROWS, ATTENTION_TILE_MIN_KEYS, ATTENTION_TILE_MIN_ROWS, AttentionPath, AttentionShape,
};

const OP: &str = "attention";
/// `ATT_MAX_PER_LANE` · 32 in kernels/attention.cuh.
const MAX_HEAD_DIM: usize = 256;
/// Warps per block (`ATT_MAX_WARPS` at most).
const WARPS: u32 = 8;

/// Keys per range of the split attention (the rows path): a multiple of the 64-row page, so a
/// range reads whole pages.
pub const ATTENTION_SPLIT_KEYS: usize = 256;

/// Key ranges per row the decode path aims at (`attention_decode`): a row of n keys runs as
/// ceil(n / kps) ranges of kps = 64 · ceil(pages / this) keys, a function of the row alone.
pub const ATTENTION_DECODE_SPLITS: usize = 64;
/// Threads of an `attention_mma` block (`ATM_THREADS`) and its dynamic shared memory
/// (`ATM_SMEM`: the Q tile, a K page and a V page as f16; 99 KiB, what sm_86 allows a block).
const MMA_THREADS: u32 = 128;
const MMA_SMEM: u32 = 3 * 64 * 264 * 2;
/// The same for `attention_mma_w8` (`ATM_SMEM_W8`: a Q tile of 128 rows; 132 KiB).
const MMA_W8_THREADS: u32 = 256;
const MMA_W8_SMEM: u32 = (128 + 2 * 64) * 264 * 2;
/// The same for `attention_wg` (head_dim 256, F16, sm_90a): Q [128][256], two stages each of K
/// and V [64][256] and (its `EMBER_ATTN_WG_PS` form) P [64][64] for each warpgroup, as f16,
/// 1,024-aligned (1 KiB of slack): 209 KiB.
const WG_THREADS: u32 = 256;
const WG_SMEM: u32 = 1024 + 128 * 256 * 2 + 4 * 64 * 256 * 2 + 2 * 64 * 64 * 2;
/// Warps of an `attention_merge` block (`ATT_MERGE_WARPS`).
const MERGE_WARPS: u32 = 8;
/// Floats of partial results [`AttentionPath::Auto`] lets the decode kernel take (128 MiB: 16
/// rows of the 35B model at depth 32768 take 17 MB, 64 take 67 MB); a call that would need
/// more takes the tiles or the rows path, whose scratch does not grow with the rows.
pub const ATTENTION_DECODE_SCRATCH_MAX: usize = 32 << 20;
/// Warps of an `attention_decode` block (`AD_WARPS` in kernels/attention_decode.cu).
const DECODE_WARPS: u32 = 4;
/// Query heads of an `attention_decode` block at most (the kernel's instances: 1, 2, 4, 8).
const DECODE_MAX_HEADS: usize = 8;
/// The decode kernel takes the most query heads a block (K/V rows read once for more heads)
/// that still gives at least this many blocks per SM, in quarters (6: 1.5), else one head a
/// block. Measured on the H100 (35B shape, F16 cache, 2026-12-05, us per call for 8 / 4 / 2 / 1
/// heads): 1 row at depth 32768 (64 ranges) 67.2 / 53.7 / 78.8 / 125.0, at 4096 21.5 / 16.6 /
/// 19.3 / 25.1, at 1024 (16 ranges) 18.3 / 12.0 / 10.5 / 10.1, at 16 keys 10.7 / 6.4 / 5.0 /
/// 4.5; 16 rows at 1024 31.9 / 33.8 / 44.7 / 66.3, at 256 18.0 / 13.0 / 15.8 / 21.0. The
/// heads a block do not change a result's bits (kernels/attention_decode.cu), so the choice may
/// follow the call's size.
const DECODE_MIN_BLOCKS_PER_SM_X4: usize = 6;
/// Whether the decode path runs on tensor cores where it can (`attention_decode_mma`;
/// `EMBER_ATTN_DECODE_MMA=1` or `=0` overrides). Measured on the H100 (35B, 2026-12-07,
/// docs/perf.md GPU g25): tg128 @ d32768 377.8 → 392.8 t/s (2 warps), 390.5 with 4 warps;
/// 16 sequences @ d4096 1,976.9 t/s (2.16x llama.cpp in the same call).
const DECODE_MMA_DEFAULT: bool = true;
/// Warps and ring stages of `attention_decode_mma`'s head_dim 256 entry (`EMBER_ATTN_DECODE_MMA`
/// = `w4s2`, `w4s3`, `w2s2` or `w2s3` picks another for measuring; `0`: the scalar decode kernel).
/// `bench_attention_decode_mma` on the H100 (us, scalar / 4 warps 2 stages / 2 warps 2 stages):
/// 1 row at 32768 keys 43.3 / 37.0 / 37.1, 16 rows at 32768 381 / 291 / 229, 16 rows at 4096
/// 77.0 / 99.5 / 55.0, 4 rows at 4096 27.8 / 33.5 / 25.4; 3 stages no better than 2.
const DECODE_MMA_256: (u32, u32) = (2, 2);
/// Keys of a tile of `attention_decode_mma` (`ADM_KT`).
const DECODE_MMA_KT: u32 = 16;

/// `EMBER_ATTN_DECODE_MMA`: None off, else the (warps, stages) of the head_dim 256 entry.
fn decode_mma_env() -> Option<(u32, u32)> {
    static ENV: std::sync::OnceLock<Option<(u32, u32)>> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| match std::env::var("EMBER_ATTN_DECODE_MMA").as_deref() {
        Ok("0") => None,
        Ok("1") => Some(DECODE_MMA_256),
        Ok(v) if v.len() == 4 && v.starts_with('w') && &v[2..3] == "s" => {
            let (w, st) = (v[1..2].parse().unwrap_or(0), v[3..4].parse().unwrap_or(0));
            Some(if matches!((w, st), (2 | 4, 2 | 3)) { (w, st) } else { DECODE_MMA_256 })
        }
        _ => DECODE_MMA_DEFAULT.then_some(DECODE_MMA_256),
    })
}

/// Keys of a decode range from which its warps load rows ahead (`_pf` entries): 16 groups of 4
/// keys a warp. On an H100 (F16, docs/perf.md GPU g21) the ring saved 16-18 % of a row at depth
/// 32768 (512-key ranges) and lost a little up to 8192 (64-128-key ranges: 4-8 groups a warp).
const DECODE_RING_MIN_KEYS: usize = 256;

/// Keys per range: [`ATTENTION_SPLIT_KEYS`], more when that would need over 65,535 ranges.
fn split_keys(s: &AttentionShape) -> usize {
    ATTENTION_SPLIT_KEYS.max(s.max_keys.div_ceil(65535))
}

/// Query vectors (rows x heads) per block of `attention_tiles` (`AT_M` in kernels/attention_prefill.cu).
const TILE_VECTORS: usize = 64;
/// Threads per block of `attention_tiles` (`AT_THREADS`).
const TILE_THREADS: u32 = 256;
/// Fewest keys per range when `attention_tiles` splits the keys of its tiles (a multiple of
/// the 64-row page).
const TILE_SPLIT_MIN_KEYS: usize = 512;
/// The `attention_decode` entry for a cache of type `ty`, `heads` query heads a block (1, 2, 4
/// or 8) and whether its warps load rows ahead (`ring`: the `_pf` entries; Q8_0 has none): one
/// entry each, so each instance has the registers it needs alone.
fn decode_entry(ty: GgmlType, heads: usize, ring: bool) -> &'static str {
    // The kernel reads any other type as Q8_0 (kv_append checks the cache's type).
    let t = match (ty, ring) {
        (GgmlType::F32, false) => 0,
        (GgmlType::F16, false) => 1,
        (GgmlType::F32, true) => 3,
        (GgmlType::F16, true) => 4,
        _ => 2,
    };
    ATTENTION_DECODE_ENTRIES[t][heads.clamp(1, DECODE_MAX_HEADS).ilog2() as usize]
}

/// The `attention_decode` entries the launcher names (kernels/attention_decode.cu's macros make
/// them): F32, F16, Q8_0, then F32 and F16 with the ring; 1, 2, 4 and 8 heads a block.
pub const ATTENTION_DECODE_ENTRIES: [[&str; 4]; 5] = [
    ["attention_decode_f32_h1", "attention_decode_f32_h2", "attention_decode_f32_h4", "attention_decode_f32_h8"],
    ["attention_decode_f16_h1", "attention_decode_f16_h2", "attention_decode_f16_h4", "attention_decode_f16_h8"],
    ["attention_decode_q8_0_h1", "attention_decode_q8_0_h2", "attention_decode_q8_0_h4", "attention_decode_q8_0_h8"],
    ["attention_decode_f32_h1_pf", "attention_decode_f32_h2_pf", "attention_decode_f32_h4_pf", "attention_decode_f32_h8_pf"],
    ["attention_decode_f16_h1_pf", "attention_decode_f16_h2_pf", "attention_decode_f16_h4_pf", "attention_decode_f16_h8_pf"],
];

/// Keys per range of a row of `n_keys` keys on the decode path (`decode_keys_per_split` in
/// kernels/attention_decode.cu: whole pages, about `splits` ranges).
pub fn decode_keys_per_split(n_keys: usize, splits: usize) -> usize {
    KV_PAGE * n_keys.div_ceil(KV_PAGE).div_ceil(splits.max(1)).max(1)
}

#[repr(C)]
struct AttentionParams {
    q: u64,
    out: u64,
    pool: u64,
    table: u64,
    row_slot: u64,
    pos: u64,
    part_ml: u64,
    part_acc: u64,
    seq_row0: u64,
    seq_n: u64,
    n_rows: u32,
    n_head: u32,
    n_head_kv: u32,
    head_dim: u32,
    ty: u32,
    row_bytes: u32,
    stride: u32,
    layer: u32,
    n_kv: u32,
    n_slots: u32,
    n_pages: u32,
    n_split: u32,
    keys_per_split: u32,
    n_seq: u32,
    heads_per_block: u32,
    scale: f32,
    gate: u64,
    q8: u64,
    act: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data matching `AttentionParams` in kernels/attention.cuh (10 u64, 16
// 4-byte fields, 2 u64, 2 u32: no padding).
unsafe impl DeviceRepr for AttentionParams {}

/// How one call runs: which kernels and how many key ranges of how many keys (the decode path:
/// the most ranges of any row, and the target ranges per row in `keys_per_split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan {
    kind: AttentionPath,
    n_split: usize,
    keys_per_split: usize,
    /// Query heads of a decode block.
    decode_heads: usize,
    /// Whether the decode kernel's warps load rows ahead (the `_pf` entries): where its deepest
    /// row's ranges hold at least [`DECODE_RING_MIN_KEYS`] keys.
    decode_ring: bool,
    /// The tiles take 128 query vectors a block (`attention_mma_w8`; [`Gpu::attention_mma_wide`]).
    wide: bool,
}

/// Keys of a row from which prompt tiles take 128 query vectors a block (`attention_mma_w8`):
/// each staged K/V page then serves twice the rows, at one block an SM instead of two. Measured
/// on an H100 (bench_attention_mma, 512 rows, docs/perf.md GPU g24): 0.044 -> 0.054 ms at depth 0,
/// 0.225 -> 0.218 at 4096, 0.390 -> 0.376 at 8192, 1.660 -> 1.655 at 32768; the 35B's pp8192 at
/// depth 32768 +1.4 % (two rounds), pp512 and pp8192 at depth 0 within 0.4 %.
pub const ATTN_MMA_WIDE_MIN_KEYS: usize = 4096;

impl Gpu {
    fn attention_plan(&self, s: &AttentionShape) -> Plan {
        let n_sm = self.info().n_sm.max(1) as usize;
        let kind = s.kind(self.attn_decode_on(), self.mma_wanted(s));
        if kind == AttentionPath::Decode {
            // The shape's own heads a block, else EMBER_ATTN_HEADS's, else the launcher's choice.
            let s = AttentionShape { decode_heads: if s.decode_heads > 0 { s.decode_heads } else { self.attn_heads() }, ..*s };
            let (n_split, decode_heads, decode_ring) = s.decode_plan(n_sm);
            return Plan { kind, n_split, keys_per_split: s.decode_splits.min(65535), decode_heads, decode_ring, wide: false };
        }
        if kind == AttentionPath::Tiles {
            // Enough blocks for the SMs (2 resident each, 1 of the wide tiles): the key range
            // count that minimises the waves of blocks times each block's share of the keys.
            let wide = self.attention_mma_wide(s);
            let blocks = if wide { s.n_tiles_wide } else { s.n_tiles } * (s.n_head / s.heads_per_tile());
            let slots = if wide { n_sm } else { 2 * n_sm };
            let cap = s.max_keys.div_ceil(TILE_SPLIT_MIN_KEYS).clamp(1, 64);
            let cost = |n: usize| (blocks * n).div_ceil(slots) as f64 / n as f64 * if n > 1 { 1.05 } else { 1.0 };
            let n_split = (1..=cap).min_by(|&a, &b| cost(a).total_cmp(&cost(b))).unwrap_or(1);
            let keys_per_split = s.max_keys.div_ceil(n_split).next_multiple_of(KV_PAGE).max(KV_PAGE);
            return Plan {
                kind,
                n_split: s.max_keys.div_ceil(keys_per_split).max(1),
                keys_per_split,
                decode_heads: 0,
                decode_ring: false,
                wide,
            };
        }
        let n_split = if s.n_rows * s.n_head >= 2 * n_sm { 1 } else { s.max_keys.div_ceil(split_keys(s)).max(1) };
        Plan { kind, n_split, keys_per_split: split_keys(s), decode_heads: 0, decode_ring: false, wide: false }
    }

    /// Key ranges [`Gpu::attention`] splits each row's keys into. The rows path: one pass when
    /// the rows and heads give at least 2 blocks per SM (prefill), else ranges of
    /// [`ATTENTION_SPLIT_KEYS`] keys (decode: flash-decoding); the ranges are fixed, so a row's
    /// result does not depend on the other rows of the call as long as the call stays in the
    /// decode regime (a row with at most that many keys gets the one-pass result bit for bit).
    /// The tiles path: as many ranges (of at least 512 keys) as fill the SMs. The decode path:
    /// the most ranges of a row ([`decode_keys_per_split`]).
    pub fn attention_splits(&self, s: &AttentionShape) -> usize {
        self.attention_plan(s).n_split
    }

    /// Query heads of a decode block for `s` ([`AttentionShape::decode_heads_for`]; 0 off the
    /// decode path).
    pub fn attention_decode_heads(&self, s: &AttentionShape) -> usize {
        self.attention_plan(s).decode_heads
    }

    /// `attention_mma` with its shared memory allowed, when the tiles of `s` take it: Fast, sm_80+
    /// (and the opt-in shared memory the kernel needs), head_dim a multiple of 16 and
    /// `EMBER_ATTN_MMA` not 0.
    fn attention_mma_function(&self, s: &AttentionShape) -> Result<Option<CudaFunction>> {
        if !self.mma_wanted(s) {
            return Ok(None);
        }
        let f = self.function(&ATTENTION_PREFILL, "attention_mma")?;
        // A GPU whose blocks cannot have that much shared memory keeps the f32 tiles.
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        Ok(f.set_attribute(attr, MMA_SMEM as i32).is_ok().then_some(f))
    }

    /// `attention_mma_w8` with its shared memory allowed, for [`Gpu::attention_mma_wide`].
    fn attention_mma_w8_function(&self) -> Result<Option<CudaFunction>> {
        let f = self.function(&ATTENTION_PREFILL, "attention_mma_w8")?;
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        Ok(f.set_attribute(attr, MMA_W8_SMEM as i32).is_ok().then_some(f))
    }

    /// `attention_wg` with its shared memory allowed, where the wide tiles of a `ty` cache of
    /// head_dim `hd` may take it: compute capability 9.0 (its module is built for sm_90a there),
    /// an F16 cache of head_dim 256, `EMBER_ATTN_WG` not 0. Measured on an H100 against
    /// `attention_mma_w8` (bench_attention_mma, 512 rows, 2026-12-07): 0.218 -> 0.127 ms at 4096
    /// keys, 0.375 -> 0.207 at 8192, 1.651 -> 0.990 at 32768 (168 -> 280 TFLOP/s), the same bits.
    fn attention_wg_function(&self, ty: GgmlType, hd: usize) -> Result<Option<CudaFunction>> {
        if !(self.attn_wg_on() && self.has_wgmma() && ty == GgmlType::F16 && hd == 256) {
            return Ok(None);
        }
        let f = self.function(&ATTENTION_WG, "attention_wg")?;
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        Ok(f.set_attribute(attr, WG_SMEM as i32).is_ok().then_some(f))
    }

    /// Whether the tensor-core tiles of `s` take 128 query vectors a block: rows of at least
    /// [`ATTN_MMA_WIDE_MIN_KEYS`] keys (`EMBER_ATTN_MMA_WIDE=1`: always, `=0`: never), the tiles on
    /// tensor cores, and the GPU allows the 132 KiB of shared memory (sm_80, sm_90).
    fn attention_mma_wide(&self, s: &AttentionShape) -> bool {
        self.attn_mma_wide_on().unwrap_or(s.max_keys >= ATTN_MMA_WIDE_MIN_KEYS)
            && self.mma_wanted(s)
            && matches!(self.attention_mma_w8_function(), Ok(Some(_)))
    }

    /// `attention_decode_mma` for a decode call of `s` over a `ty` cache, with its shared memory
    /// allowed, and its threads and shared memory bytes: None where it does not apply (see
    /// [`AttentionShape::decode_mma`]) or the GPU cannot give a block that much shared memory.
    fn decode_mma_function(&self, s: &AttentionShape, ty: GgmlType) -> Result<Option<(CudaFunction, u32, u32)>> {
        let Some(env) = decode_mma_env() else { return Ok(None) };
        if !(s.fast && s.decode_mma && self.has_mma() && self.attn_mma_on() && ty == GgmlType::F16) {
            return Ok(None);
        }
        let (name, (w, st)) = match s.head_dim {
            64 => ("attention_decode_mma_d64_w4_s2", (4, 2)),
            128 => ("attention_decode_mma_d128_w4_s2", (4, 2)),
            256 => match env {
                (4, 3) => ("attention_decode_mma_d256_w4_s3", env),
                (2, 2) => ("attention_decode_mma_d256_w2_s2", env),
                (2, 3) => ("attention_decode_mma_d256_w2_s3", env),
                _ => ("attention_decode_mma_d256_w4_s2", (4, 2)),
            },
            _ => return Ok(None),
        };
        // ADM_SMEM: the warps' rings of K and V tiles as f16, rows padded by 8 halves.
        let smem = w * st * 2 * DECODE_MMA_KT * (s.head_dim as u32 + 8) * 2;
        let f = self.function(&ATTENTION_DECODE_MMA, name)?;
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        Ok(f.set_attribute(attr, smem as i32).is_ok().then_some((f, 32 * w, smem)))
    }

    /// Whether [`Gpu::attention`] runs the decode path of `s` over a `ty` cache on tensor cores
    /// (`attention_decode_mma`).
    pub fn attention_decode_uses_mma(&self, s: &AttentionShape, ty: GgmlType) -> bool {
        self.attention_plan(s).kind == AttentionPath::Decode && matches!(self.decode_mma_function(s, ty), Ok(Some(_)))
    }

    fn mma_wanted(&self, s: &AttentionShape) -> bool {
        s.fast && self.has_mma() && self.attn_mma_on() && s.head_dim.is_multiple_of(16)
    }

    /// Whether [`Gpu::attention_gated`] runs `s` over a `ty` cache with the gate in its own
    /// launches: the tensor-core decode kernel (its epilogue with one key range a row, else the
    /// merge's) at head_dim a multiple of 128 (whole warps of the epilogue's 8-lane int8 blocks).
    pub fn attention_gates(&self, s: &AttentionShape, ty: GgmlType) -> bool {
        s.head_dim.is_multiple_of(128) && self.attention_decode_uses_mma(s, ty)
    }

    /// Whether [`Gpu::attention`] takes the tensor-core tiles for `s`.
    pub fn attention_uses_mma(&self, s: &AttentionShape) -> bool {
        self.attention_plan(s).kind == AttentionPath::Tiles && matches!(self.attention_mma_function(s), Ok(Some(_)))
    }

    /// Whether [`Gpu::attention`] runs `s` over a `ty` cache on `attention_wg` (the wide tiles
    /// with both products on wgmma; [`Gpu::set_attention_wg`]).
    pub fn attention_uses_wg(&self, s: &AttentionShape, ty: GgmlType) -> bool {
        let plan = self.attention_plan(s);
        plan.kind == AttentionPath::Tiles && plan.wide && matches!(self.attention_wg_function(ty, s.head_dim), Ok(Some(_)))
    }

    /// Whether [`Gpu::attention`] runs `s` on the tiles (see [`AttentionPath`]).
    pub fn attention_uses_tiles(&self, s: &AttentionShape) -> bool {
        self.attention_plan(s).kind == AttentionPath::Tiles
    }

    /// The kernels [`Gpu::attention`] runs `s` on: [`AttentionPath::Rows`],
    /// [`AttentionPath::Tiles`] or [`AttentionPath::Decode`].
    pub fn attention_path(&self, s: &AttentionShape) -> AttentionPath {
        self.attention_plan(s).kind
    }

    /// Floats of scratch [`Gpu::attention`] needs for `s` (the split ranges' partial results).
    pub fn attention_scratch(&self, s: &AttentionShape) -> usize {
        match self.attention_splits(s) {
            1 => 0,
            n => part_floats(s.n_rows * s.n_head * n) + s.n_rows * s.n_head * n * s.head_dim,
        }
    }

    /// Causal GQA attention of q [n_rows, n_head·hd]: row r attends over positions
    /// 0..=pos[r] of the K/V caches of slot `row_slot[r]` (layer `pages.layer`) into out
    /// [n_rows, n_head·hd]. The rows are those of `seqs` (one slot and consecutive positions
    /// per sequence; `s` made by [`AttentionShape::new`] from the same row counts). The caller
    /// guarantees those positions were written and that no row sees more than `s.max_keys`
    /// keys; a slot or page out of range gives NaN rows. `scratch` holds
    /// [`Gpu::attention_scratch`] floats.
    #[allow(clippy::too_many_arguments)] // the op's inputs, output and scratch
    pub fn attention(
        &self,
        pages: &KvPages<'_>,
        s: AttentionShape,
        q: &Buf<f32>,
        seqs: &SeqRows<'_>,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
        out: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
    ) -> Result<()> {
        self.attention_to(pages, s, q, seqs, row_slot, pos, out, scratch, None).map(drop)
    }

    /// [`Gpu::attention`], then `out ⊙= act(gate)` ([`Gpu::gate`]'s product) in the same launches,
    /// and with `q8` the int8 copy of out in the GPU's int8 scratch, as [`Gpu::gate_q8`] leaves it
    /// (then Some of its [`Gpu::q8_generation`]): the bits of the two ops. Only where
    /// [`Gpu::attention_gates`].
    #[allow(clippy::too_many_arguments)] // the op's inputs, output and scratch
    pub fn attention_gated(
        &self,
        pages: &KvPages<'_>,
        s: AttentionShape,
        q: &Buf<f32>,
        seqs: &SeqRows<'_>,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
        out: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        gate: &Buf<f32>,
        act: Act,
        q8: bool,
    ) -> Result<Option<u64>> {
        if !self.attention_gates(&s, pages.ty) {
            return Err(shape(OP, format!("head_dim {} over {} rows: no gate in the attention's launches", s.head_dim, pages.ty.name())));
        }
        let n = s.n_rows * s.n_head * s.head_dim;
        need(OP, "gate", gate, n)?;
        let (q8p, generation) = if q8 { (self.q8_scratch(super::q8_bytes(n))?, Some(self.bump_q8_generation())) } else { (0, None) };
        self.attention_to(pages, s, q, seqs, row_slot, pos, out, scratch, Some((gate.ptr(), q8p, act)))?;
        Ok(generation)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_to(
        &self,
        pages: &KvPages<'_>,
        s: AttentionShape,
        q: &Buf<f32>,
        seqs: &SeqRows<'_>,
        row_slot: &Buf<u32>,
        pos: &Buf<u32>,
        out: &mut Buf<f32>,
        scratch: &mut Buf<f32>,
        gated: Option<(u64, u64, Act)>,
    ) -> Result<()> {
        let rb = pages.check(OP)?;
        let (nh, nkv, hd) = (s.n_head, s.n_head_kv, s.head_dim);
        if nkv == 0 || !nh.is_multiple_of(nkv) || hd == 0 || hd > MAX_HEAD_DIM || pages.width != nkv * hd {
            return Err(shape(OP, format!("heads {nh}/{nkv}x{hd} over cache rows of {} (head_dim at most {MAX_HEAD_DIM})", pages.width)));
        }
        if s.n_rows > 65535 {
            return Err(shape(OP, format!("{} rows (at most 65535 per call)", s.n_rows)));
        }
        if s.path == AttentionPath::Tiles && !hd.is_multiple_of(64) {
            return Err(shape(OP, format!("head_dim {hd} for the tiles (a multiple of 64)")));
        }
        if s.path == AttentionPath::Decode && !hd.is_multiple_of(8) {
            return Err(shape(OP, format!("head_dim {hd} for the decode kernel (a multiple of 8)")));
        }
        seqs.check(OP)?;
        need(OP, "q", q, s.n_rows * nh * hd)?;
        need(OP, "row slots", row_slot, s.n_rows)?;
        need(OP, "positions", pos, s.n_rows)?;
        need(OP, "out", out, s.n_rows * nh * hd)?;
        need(OP, "scratch", scratch, self.attention_scratch(&s))?;
        if s.n_rows == 0 || nh == 0 {
            return Ok(());
        }
        let plan = self.attention_plan(&s);
        let decode_mma = if plan.kind == AttentionPath::Decode { self.decode_mma_function(&s, pages.ty)? } else { None };
        let part = s.n_rows * nh * plan.n_split;
        let p = AttentionParams {
            q: q.ptr(),
            out: out.ptr(),
            pool: pages.pool.ptr(),
            table: pages.table.ptr(),
            row_slot: row_slot.ptr(),
            pos: pos.ptr(),
            part_ml: scratch.ptr(),
            part_acc: scratch.ptr() + 4 * part_floats(part) as u64,
            seq_row0: seqs.row0.ptr(),
            seq_n: seqs.n.ptr(),
            n_rows: s.n_rows as u32,
            n_head: u32_of(OP, "n_head", nh)?,
            n_head_kv: u32_of(OP, "n_head_kv", nkv)?,
            head_dim: hd as u32,
            ty: pages.ty.id(),
            row_bytes: u32_of(OP, "row bytes", rb)?,
            stride: u32_of(OP, "stride", pages.stride)?,
            layer: pages.layer as u32,
            n_kv: u32_of(OP, "n_kv", pages.n_kv)?,
            n_slots: u32_of(OP, "n_slots", pages.n_slots)?,
            n_pages: u32_of(OP, "n_pages", pages.n_pages)?,
            n_split: plan.n_split as u32,
            keys_per_split: u32_of(OP, "keys per split", plan.keys_per_split)?,
            n_seq: seqs.n_seq as u32,
            heads_per_block: match plan.kind {
                // The tensor-core decode kernel takes a KV head's group (up to 8 heads, its mma's N).
                AttentionPath::Decode if decode_mma.is_some() => s.heads_per_decode_block(),
                AttentionPath::Decode => plan.decode_heads,
                _ => s.heads_per_tile(),
            } as u32,
            scale: s.scale,
            gate: gated.map_or(0, |g| g.0),
            q8: gated.map_or(0, |g| g.1),
            act: gated.is_some_and(|g| g.2 == Act::Sigmoid) as u32,
            pad: 0,
        };
        let merge = |gpu: &Gpu| -> Result<()> {
            let f = gpu.function(&ATTENTION, "attention_merge")?;
            // SAFETY: as below; the merge reads the n_split partials of each (row, head).
            unsafe { gpu.launch(&f, (p.n_head, p.n_rows, 1), 32 * MERGE_WARPS, 0, &p) }
        };
        // SAFETY: q and out hold n_rows·n_head·hd floats, row_slot and pos n_rows values, the
        // sequences' row0 and n n_seq values (whose rows the caller made the rows of q), the
        // pool n_pages pages and the table its rows, the scratch the partials of n_split ranges
        // when n_split > 1 (checked above); the kernels read table entries only below
        // ceil(keys / 64) <= stride and check slots and page ids; hd <= 256 (a multiple of 64
        // for the tiles, of 8 for the decode kernel, whose heads_per_block is 1, 2, 4 or 8 and
        // divides n_head / n_head_kv; 64, 128 or 256 for the tensor-core decode kernel, its
        // entry's, over F16 rows, with the shared memory its attribute allowed).
        unsafe {
            if let Some((f, threads, smem)) = &decode_mma {
                let groups = u32_of(OP, "head groups", nh / p.heads_per_block as usize)?;
                self.launch(f, (groups, p.n_rows, p.n_split), *threads, *smem, &p)?;
                return if plan.n_split > 1 { merge(self) } else { Ok(()) };
            }
            if plan.kind == AttentionPath::Decode {
                let f = self.function(&ATTENTION_DECODE, decode_entry(pages.ty, plan.decode_heads, plan.decode_ring))?;
                let groups = u32_of(OP, "head groups", nh / plan.decode_heads)?;
                self.launch(&f, (groups, p.n_rows, p.n_split), 32 * DECODE_WARPS, 0, &p)?;
                return if plan.n_split > 1 { merge(self) } else { Ok(()) };
            }
            if plan.kind == AttentionPath::Tiles {
                let groups = u32_of(OP, "head groups", nh / s.heads_per_tile())?;
                let tiles = u32_of(OP, "tiles", s.n_tiles)?;
                // The wide tiles: on wgmma where it applies, else on mma.sync.
                let wide = match plan.wide {
                    false => None,
                    true => match self.attention_wg_function(pages.ty, hd)? {
                        Some(f) => Some((f, WG_THREADS, WG_SMEM)),
                        None => self.attention_mma_w8_function()?.map(|f| (f, MMA_W8_THREADS, MMA_W8_SMEM)),
                    },
                };
                if let Some((f, threads, smem)) = wide {
                    let tiles = u32_of(OP, "tiles", s.n_tiles_wide)?;
                    self.launch(&f, (tiles, groups, p.n_split), threads, smem, &p)?;
                    return if plan.n_split > 1 { merge(self) } else { Ok(()) };
                }
                if let Some(f) = self.attention_mma_function(&s)? {
                    self.launch(&f, (tiles, groups, p.n_split), MMA_THREADS, MMA_SMEM, &p)?;
                    return if plan.n_split > 1 { merge(self) } else { Ok(()) };
                }
                let f = self.function(&ATTENTION_PREFILL, "attention_tiles")?;
                self.launch(&f, (tiles, groups, p.n_split), TILE_THREADS, 0, &p)?;
                return if plan.n_split > 1 { merge(self) } else { Ok(()) };
            }
            if plan.n_split == 1 {
                let f = self.function(&ATTENTION, "attention")?;
                return self.launch(&f, (p.n_head, p.n_rows, 1), 32 * WARPS, 0, &p);
            }
            let split = self.function(&ATTENTION, "attention_split")?;
            self.launch(&split, (p.n_head, p.n_rows, p.n_split), 32 * WARPS, 0, &p)?;
        }
        merge(self)
    }
}

/// Floats of the (max, sum) pairs of `part` partial results, rounded up to 4 so the values
/// after them are 16-byte aligned (the tiles store them as float4).
fn part_floats(part: usize) -> usize {
    (2 * part).next_multiple_of(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 35B model's heads (16 query, 2 KV, head_dim 256) over sequences of `rows` rows, the
    /// deepest row seeing `keys` keys.
    fn shape(hd: usize, rows: &[usize], keys: usize) -> AttentionShape {
        AttentionShape::new(16, 2, hd, 0.0625, rows, keys)
    }

    /// Tiles of 64 and of 128 query vectors (8 heads a tile: 8 and 16 rows), counted per
    /// sequence as the kernels walk them (`attention_mma`, `attention_mma_w8`).
    #[test]
    fn tiles_are_counted_per_sequence() {
        for (rows, tiles, wide) in [(vec![512], 64, 32), (vec![5, 9], 3, 2), (vec![16, 17, 1], 6, 4), (vec![1; 4], 4, 4)] {
            let s = shape(256, &rows, 40_000);
            assert_eq!((s.tile_rows(), s.n_tiles, s.n_tiles_wide), (8, tiles, wide), "{rows:?}");
        }
    }

    /// The decode kernel's heads a block on 132 SMs (the H100's and H200's count): the most
    /// that give 1.5 blocks an SM, the measured best of each case in
    /// [`DECODE_MIN_BLOCKS_PER_SM_X4`]'s table; `decode_heads` overrides.
    #[test]
    fn decode_heads_fill_the_sms() {
        // (rows, ranges a row, heads a block)
        for (rows, split, want) in [(1, 64, 4), (1, 16, 1), (1, 1, 1), (16, 16, 8), (16, 4, 4), (16, 1, 1), (64, 64, 8)] {
            let mut s = shape(256, &vec![1; rows], 64 * split);
            s.decode_heads = 0;
            assert_eq!(s.decode_heads_for(split, 132), want, "{rows} rows, {split} ranges");
            s.decode_heads = 3;
            assert_eq!(s.decode_heads_for(split, 132), 2);
            s.decode_heads = 64;
            assert_eq!(s.decode_heads_for(split, 132), 8);
        }
        // GQA 3: one head a block whatever is asked.
        let mut s = AttentionShape::new(6, 2, 64, 0.125, &[1], 100);
        s.decode_heads = 8;
        assert_eq!(s.decode_heads_for(1, 132), 1);
    }

    /// The decode plan on 132 SMs: the ring from 256-key ranges (64 ranges a row: from 12,289
    /// keys, 193 pages), at most 4 heads a block without it unless the shape asks for more; and
    /// the entry each (type, heads, ring) names.
    #[test]
    fn decode_plan_takes_the_ring_for_deep_ranges() {
        // (rows, keys of the deepest row, heads asked, (ranges, heads, ring))
        let cases = [
            (1, 32768, 0, (64, 4, true)),
            (1, 12288, 0, (64, 4, false)),
            (1, 12289, 0, (64, 4, true)),
            (1, 1024, 0, (16, 1, false)),
            (16, 4096, 0, (64, 4, false)),
            (16, 4096, 8, (64, 8, false)),
            (16, 32768, 0, (64, 8, true)),
        ];
        for (rows, keys, heads, want) in cases {
            let mut s = shape(256, &vec![1; rows], keys);
            s.decode_heads = heads;
            assert_eq!(s.decode_plan(132), want, "{rows} rows at {keys} keys, {heads} heads asked");
        }
        assert_eq!(decode_entry(GgmlType::F16, 4, true), "attention_decode_f16_h4_pf");
        assert_eq!(decode_entry(GgmlType::F16, 8, false), "attention_decode_f16_h8");
        assert_eq!(decode_entry(GgmlType::F32, 1, true), "attention_decode_f32_h1_pf");
        // Q8_0 has no ring: its plain entries either way.
        assert_eq!(decode_entry(GgmlType::Q8_0, 2, true), "attention_decode_q8_0_h2");
        assert_eq!(decode_entry(GgmlType::Q8_0, 8, false), "attention_decode_q8_0_h8");
    }

    /// Auto's choice, with the decode kernel and tensor cores (Fast) or without (Exact).
    #[test]
    fn auto_follows_the_measured_crossovers() {
        let (fast, exact) = ((true, true), (true, false));
        // (rows per sequence, keys of the deepest row, (decode kernel, tensor cores), path)
        type Case = (&'static [usize], usize, (bool, bool), AttentionPath);
        let cases: &[Case] = &[
            (&[1], 32768, fast, AttentionPath::Decode),
            (&[1; 16], 4096, fast, AttentionPath::Decode),
            (&[2], 32768, fast, AttentionPath::Decode),
            (&[4], 20000, fast, AttentionPath::Tiles),
            (&[8], 1024, fast, AttentionPath::Decode),
            (&[512], 512, fast, AttentionPath::Tiles),
            (&[63], 8192, exact, AttentionPath::Decode),
            (&[64], 8192, exact, AttentionPath::Tiles),
            // A decode row beside a prompt chunk takes the chunk's path.
            (&[1, 300], 4096, fast, AttentionPath::Tiles),
            // Without the decode kernel: the choice before it.
            (&[1], 8192, (false, true), AttentionPath::Rows),
            (&[1], 32768, (false, true), AttentionPath::Tiles),
        ];
        for &(rows, keys, (dec, mma), want) in cases {
            assert_eq!(shape(256, rows, keys).kind(dec, mma), want, "{rows:?} at {keys} keys, decode {dec}, mma {mma}");
        }
    }

    /// A prompt chunk whose head_dim the tiles cannot take goes to the rows path (one pass, no
    /// scratch), not to the decode kernel, whose partial results grow with the rows: 512 rows
    /// of head_dim 96 at depth 8192 would need ~400 MB there.
    #[test]
    fn long_chunks_do_not_take_the_decode_kernel() {
        let s = AttentionShape::new(32, 32, 96, 0.1, &[512], 8192);
        assert!(s.decode_scratch() > ATTENTION_DECODE_SCRATCH_MAX);
        assert_eq!(s.kind(true, true), AttentionPath::Rows);
        assert_eq!(AttentionShape::new(32, 32, 96, 0.1, &[1], 8192).kind(true, true), AttentionPath::Decode);
        // Many short sequences deep in their contexts: 512 decode rows at depth 32768 would
        // need 537 MB of partial results; the tiles take them.
        let many = shape(256, &[1; 512], 32768);
        assert!(many.decode_scratch() > ATTENTION_DECODE_SCRATCH_MAX);
        assert_eq!(many.kind(true, true), AttentionPath::Tiles);
        assert_eq!(shape(256, &[1; 64], 32768).kind(true, true), AttentionPath::Decode);
    }
}
