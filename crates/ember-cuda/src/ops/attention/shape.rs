//! The shape of an attention call and the path it takes ([`AttentionPath`]), with the
//! thresholds that choose it (measured; see each).

use super::*;

/// [`AttentionPath::Auto`] takes the f32 tiles (Exact) when a sequence of the call has at
/// least this many rows, else the decode kernel. Measured on the H200 (16/2 heads x 256, F16
/// cache, one sequence, GPU ms decode / f32 tiles, 2026-12-04): at depth 1024 64 rows
/// 0.107/0.418, 128 rows 0.216/0.419; at 8192 64 rows 0.503/0.827, 128 rows 0.980/1.613; at
/// 32768 64 rows 1.603/3.163, 128 rows 3.150/6.089: the decode kernel is faster up to 128 rows,
/// but its scratch grows with the rows (rows x heads x ranges x head_dim floats: 67 MB at 64
/// rows of the 35B model), so the tiles take 64 and more.
pub const ATTENTION_TILE_MIN_ROWS: usize = 64;
/// [`AttentionPath::Auto`] takes the tensor-core tiles (Fast) when a sequence has at least
/// [`ATTENTION_MMA_MIN_ROWS`] rows and rows x keys reaches this. Measured as above, decode /
/// tensor-core tiles: 2 rows at 32768 0.080/0.094, 4 rows 0.138/0.096; 8 rows at 8192
/// 0.078/0.083, 16 rows 0.145/0.084; 32 rows at 1024 0.060/0.066, 64 rows 0.107/0.067.
pub const ATTENTION_MMA_MIN_ROW_KEYS: usize = 65536;
/// See [`ATTENTION_MMA_MIN_ROW_KEYS`].
pub const ATTENTION_MMA_MIN_ROWS: usize = 4;
/// Where the decode kernel does not fit (head_dim not a multiple of 8), [`AttentionPath::Auto`]
/// takes the tiles for a row of at least this many keys: one row on the tiles was 2x slower
/// than the rows path at depth 8192 and 2x faster at 32768.
pub const ATTENTION_TILE_MIN_KEYS: usize = 16384;

/// Which kernels [`Gpu::attention`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPath {
    /// [`AttentionPath::Tiles`] when head_dim is a multiple of 64 and a sequence has at least
    /// [`ATTENTION_TILE_MIN_ROWS`] rows (on tensor cores: [`ATTENTION_MMA_MIN_ROWS`] rows and
    /// [`ATTENTION_MMA_MIN_ROW_KEYS`] rows x keys), else [`AttentionPath::Decode`] (head_dim a multiple
    /// of 8; else the tiles for rows of at least [`ATTENTION_TILE_MIN_KEYS`] keys, else
    /// [`AttentionPath::Rows`]).
    Auto,
    /// A block per (head, row): `attention`, or `attention_split` + `attention_merge`.
    Rows,
    /// `attention_tiles` (+ `attention_merge` when the keys are split); head_dim a multiple of
    /// 64.
    Tiles,
    /// `attention_decode` (+ `attention_merge` when a row's keys are split): a block per (KV
    /// head, row, key range) with up to 8 query heads of the KV head; head_dim a multiple of 8.
    Decode,
}

/// The heads of [`Gpu::attention`] (ember_ops::AttnHeads plus the rows).
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub n_rows: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// The most keys any row sees (its position + 1).
    pub max_keys: usize,
    /// The most rows of one sequence.
    pub max_seq_rows: usize,
    /// Blocks of query rows over all sequences: Σ ceil(rows / [`AttentionShape::tile_rows`]).
    pub n_tiles: usize,
    /// The same for tiles of twice the rows (`attention_mma_w8`).
    pub n_tiles_wide: usize,
    pub path: AttentionPath,
    /// Key ranges per row the decode path aims at ([`ATTENTION_DECODE_SPLITS`]).
    pub decode_splits: usize,
    /// Query heads of a decode block (0: `EMBER_ATTN_HEADS` when set, else as many as fill
    /// the GPU, see [`AttentionShape::decode_heads_for`]).
    pub decode_heads: usize,
    /// Precision::Fast: the tiles run on tensor cores (`attention_mma`: Q, K, V and the
    /// softmax weights rounded to f16, f32 sums) where the GPU has them (sm_80+) and head_dim
    /// is a multiple of 16.
    pub fast: bool,
    /// Whether the decode path may run on tensor cores (`attention_decode_mma`, under `fast`,
    /// sm_80+, an F16 cache, head_dim 64, 128 or 256, where `EMBER_ATTN_DECODE_MMA` or the
    /// default turns it on). Tests clear it to reach the scalar decode kernel.
    pub decode_mma: bool,
}

impl AttentionShape {
    /// The shape of a call over sequences of `seq_rows` rows each (in row order), the most keys
    /// of a row `max_keys`, with the path chosen by [`AttentionPath::Auto`].
    pub fn new(n_head: usize, n_head_kv: usize, head_dim: usize, scale: f32, seq_rows: &[usize], max_keys: usize) -> AttentionShape {
        let mut s = AttentionShape {
            n_rows: seq_rows.iter().sum(),
            n_head,
            n_head_kv,
            head_dim,
            scale,
            max_keys,
            max_seq_rows: seq_rows.iter().copied().max().unwrap_or(0),
            n_tiles: 0,
            n_tiles_wide: 0,
            path: AttentionPath::Auto,
            decode_splits: ATTENTION_DECODE_SPLITS,
            decode_heads: 0,
            fast: false,
            decode_mma: true,
        };
        let tr = s.tile_rows();
        s.n_tiles = seq_rows.iter().map(|n| n.div_ceil(tr)).sum();
        s.n_tiles_wide = seq_rows.iter().map(|n| n.div_ceil(2 * tr)).sum();
        s
    }

    /// Query heads of one tile: the largest power of two dividing the GQA ratio, at most 64.
    pub fn heads_per_tile(&self) -> usize {
        let g = (self.n_head / self.n_head_kv.max(1)).max(1);
        (1 << g.trailing_zeros()).min(TILE_VECTORS)
    }

    /// Rows of one tile (64 query vectors over [`AttentionShape::heads_per_tile`] heads).
    pub fn tile_rows(&self) -> usize {
        TILE_VECTORS / self.heads_per_tile()
    }

    /// Query heads of one `attention_decode` block: the largest power of two dividing the GQA
    /// ratio, at most 8.
    pub fn heads_per_decode_block(&self) -> usize {
        self.heads_per_tile().min(DECODE_MAX_HEADS)
    }

    /// Query heads of a decode block over `n_split` key ranges a row on `n_sm` SMs: a power of
    /// two dividing [`AttentionShape::heads_per_decode_block`]; `decode_heads` when set, else the
    /// most that still give [`DECODE_MIN_BLOCKS_PER_SM_X4`] / 4 blocks per SM, else 1.
    pub fn decode_heads_for(&self, n_split: usize, n_sm: usize) -> usize {
        let most = self.heads_per_decode_block();
        if self.decode_heads > 0 {
            return (1 << self.decode_heads.ilog2()).min(most);
        }
        let blocks = |hb: usize| self.n_rows * (self.n_head / hb) * n_split;
        let mut hb = most;
        while hb > 1 && 4 * blocks(hb) < DECODE_MIN_BLOCKS_PER_SM_X4 * n_sm {
            hb /= 2;
        }
        hb
    }

    /// The decode kernel's ranges a row, heads a block and whether its warps load rows ahead
    /// (the `_pf` entries), on `n_sm` SMs. The ranges of a row depend on its keys only: at most
    /// `decode_splits`, or one per page (a row with fewer leaves the rest empty). The ring where
    /// the deepest row's ranges hold at least [`DECODE_RING_MIN_KEYS`] keys; heads a block by
    /// [`AttentionShape::decode_heads_for`], at most 4 without the ring when the launcher chooses
    /// (their 128 registers give 4 blocks an SM, 8 heads' 215 give 2; 16 rows at depth
    /// 1024-8192 on an H100: 4 heads 13-20 % faster, docs/perf.md GPU g21).
    pub fn decode_plan(&self, n_sm: usize) -> (usize, usize, bool) {
        let splits = self.decode_splits.min(65535);
        let n_split = self.max_keys.div_ceil(KV_PAGE).clamp(1, splits.max(1));
        let ring = decode_keys_per_split(self.max_keys, splits) >= DECODE_RING_MIN_KEYS;
        let heads = self.decode_heads_for(n_split, n_sm);
        (n_split, if self.decode_heads == 0 && !ring { heads.min(4) } else { heads }, ring)
    }

    /// Floats of partial results the decode kernel needs for this shape (0: one range a row).
    pub(super) fn decode_scratch(&self) -> usize {
        match self.max_keys.div_ceil(KV_PAGE).clamp(1, self.decode_splits.clamp(1, 65535)) {
            1 => 0,
            n => part_floats(self.n_rows * self.n_head * n) + self.n_rows * self.n_head * n * self.head_dim,
        }
    }

    /// The kernels this shape runs on ([`AttentionPath::Auto`] resolved; `auto_decode`: whether
    /// Auto may take the decode kernel; `mma`: whether the tiles would run on tensor cores).
    /// Auto chooses one path for the whole call from its longest sequence and deepest row, so a
    /// decode row batched with a prompt chunk takes the chunk's path (a row's result is the
    /// same alone or batched only while the call stays on the decode kernel).
    pub fn kind(&self, auto_decode: bool, mma: bool) -> AttentionPath {
        let tiles = self.head_dim.is_multiple_of(64) && self.n_tiles > 0;
        let decode = self.head_dim.is_multiple_of(8) && self.decode_splits > 0;
        if self.path == AttentionPath::Auto && !auto_decode {
            // The choice before the decode kernel.
            return if tiles && (self.max_seq_rows >= 4 || self.max_keys >= ATTENTION_TILE_MIN_KEYS) {
                AttentionPath::Tiles
            } else {
                AttentionPath::Rows
            };
        }
        let prompt = if mma {
            self.max_seq_rows >= ATTENTION_MMA_MIN_ROWS && self.max_seq_rows * self.max_keys >= ATTENTION_MMA_MIN_ROW_KEYS
        } else {
            self.max_seq_rows >= ATTENTION_TILE_MIN_ROWS
        };
        // The decode kernel for short sequences whose partial results stay small; else the
        // choice before it.
        let decode_fits = self.max_seq_rows < ATTENTION_TILE_MIN_ROWS && self.decode_scratch() <= ATTENTION_DECODE_SCRATCH_MAX;
        match self.path {
            AttentionPath::Auto if tiles && prompt => AttentionPath::Tiles,
            AttentionPath::Auto if decode && decode_fits => AttentionPath::Decode,
            AttentionPath::Auto if tiles && (self.max_seq_rows >= 4 || self.max_keys >= ATTENTION_TILE_MIN_KEYS) => AttentionPath::Tiles,
            AttentionPath::Tiles if tiles => AttentionPath::Tiles,
            AttentionPath::Decode if decode => AttentionPath::Decode,
            _ => AttentionPath::Rows,
        }
    }
}
