use cudarc::driver::DeviceRepr;

use super::{need, u32_of};
use crate::error::Result;
use crate::gpu::{Buf, Gpu};
use crate::kernels::TOP_K;

const OP: &str = "top_k_rows";

/// Threads of every top-k block.
const THREADS: u32 = 1024;
/// Histogram bins of the first digit (`TOPK_BINS` in kernels/top_k.cu).
pub const TOPK_BINS: usize = 2048;
/// Candidates the split form's last step sorts (`TOPK_CAND`).
pub const TOPK_CAND: usize = 4096;
/// Entries a block of the split form's first two steps reads (at most `TOPK_MAX_PER` = 8 a
/// thread: each thread loads its values at once), for several rows; one row takes
/// [`TOPK_CHUNK_ONE`].
pub const TOPK_CHUNK: usize = 8192;
/// The block's entries when the selection is one row (a decode step of one sequence: ~122
/// blocks for a 248k row, where 8,192 gave ~31). Measured on an H100 (docs/perf.md g30): the two
/// wide steps 9.99 → 7.39 us each in the step's chain; 16 rows at 2,048 slightly slower than at
/// 8,192 (1,851 against 1,860 t/s), so several rows keep [`TOPK_CHUNK`].
pub const TOPK_CHUNK_ONE: usize = 2048;
/// Rows at least this long take the split form (a decode step's 248k logits: ~122 blocks for
/// one row, ~31 a row for several, instead of one SM reading each row four times).
pub const TOPK_SPLIT_MIN: usize = 32_768;

/// A block's entries for `n_rows` rows: [`TOPK_CHUNK_ONE`] for one, else [`TOPK_CHUNK`];
/// `EMBER_TOPK_CHUNK` (a multiple of 1,024 up to 8,192) sets it for any number, for measuring.
fn chunk(n_rows: usize) -> usize {
    static CHUNK: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let set = *CHUNK.get_or_init(|| {
        std::env::var("EMBER_TOPK_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&c| c > 0 && c.is_multiple_of(THREADS as usize) && c <= TOPK_CHUNK)
    });
    set.unwrap_or(if n_rows == 1 { TOPK_CHUNK_ONE } else { TOPK_CHUNK })
}

#[repr(C)]
struct TopKParams {
    x: u64,
    extra: u64,
    extra_at: u64,
    out_ids: u64,
    out_vals: u64,
    hist: u64,
    counts: u64,
    cand: u64,
    n: u32,
    k: u32,
    cap: u32,
    chunk: u32,
}

// SAFETY: plain #[repr(C)] data matching `TopKParams` in kernels/top_k.cu.
unsafe impl DeviceRepr for TopKParams {}

/// The split form's scratch: per row a first-digit histogram and two counters, both zero
/// between calls (allocated zeroed; the last step zeroes them again), and its candidates.
pub struct TopKScratch<'a> {
    pub hist: &'a Buf<u32>,
    pub counts: &'a Buf<u32>,
    pub cand: &'a Buf<u32>,
}

impl Gpu {
    /// Per row r of `x` [n_rows, n]: its `k` best entries (value descending, NaN as −∞, ties to
    /// the lower id; in no particular order) into `out_ids` / `out_vals` [n_rows, cap] from
    /// column 0, then the entries at `extra[extra_at[r]..extra_at[r + 1]]` (ids below n). `k`
    /// at most n; `cap` at least k plus the most extras of a row. With `split` (scratch for
    /// n_rows rows, zeroed: [n_rows · TOPK_BINS], [n_rows · 2], [n_rows · TOPK_CAND]) and k > 0,
    /// three kernels over ~n / chunk blocks a row (chunk: [`TOPK_CHUNK_ONE`] for one row, else
    /// [`TOPK_CHUNK`]; `EMBER_TOPK_CHUNK` sets it); otherwise one block a row
    /// (`kernels/top_k.cu`). The same entries either way.
    #[allow(clippy::too_many_arguments)]
    pub fn top_k_rows(
        &self,
        x: &Buf<f32>,
        n_rows: usize,
        n: usize,
        k: usize,
        extra: &Buf<u32>,
        extra_at: &Buf<u32>,
        cap: usize,
        out_ids: &mut Buf<u32>,
        out_vals: &mut Buf<f32>,
        split: Option<TopKScratch<'_>>,
    ) -> Result<()> {
        need(OP, "x", x, n_rows * n)?;
        need(OP, "extra_at", extra_at, n_rows + 1)?;
        need(OP, "out_ids", out_ids, n_rows * cap)?;
        need(OP, "out_vals", out_vals, n_rows * cap)?;
        if k > n || k > cap {
            return Err(crate::error::shape(OP, format!("k {k} with rows of {n} and room for {cap}")));
        }
        if n_rows == 0 || cap == 0 {
            return Ok(());
        }
        let mut p = TopKParams {
            x: x.ptr(),
            extra: extra.ptr(),
            extra_at: extra_at.ptr(),
            out_ids: out_ids.ptr(),
            out_vals: out_vals.ptr(),
            hist: 0,
            counts: 0,
            cand: 0,
            n: u32_of(OP, "n", n)?,
            k: u32_of(OP, "k", k)?,
            cap: u32_of(OP, "cap", cap)?,
            chunk: 0,
        };
        let rows = u32_of(OP, "n_rows", n_rows)?;
        match split.filter(|_| k > 0) {
            None => {
                let f = self.function(&TOP_K, "top_k_rows")?;
                // SAFETY: x, extra_at and the outputs are checked above for n_rows rows; the
                // extras' offsets and ids are the caller's (CudaOps::read_top writes them:
                // offsets within `extra`, at most cap - k a row, ids below n; the kernel reads an
                // id >= n as NaN).
                unsafe { self.launch(&f, (rows, 1, 1), THREADS, 0, &p) }
            }
            Some(s) => {
                need(OP, "hist", s.hist, n_rows * TOPK_BINS)?;
                need(OP, "counts", s.counts, n_rows * 2)?;
                need(OP, "cand", s.cand, n_rows * TOPK_CAND)?;
                let chunk = chunk(n_rows);
                (p.hist, p.counts, p.cand, p.chunk) = (s.hist.ptr(), s.counts.ptr(), s.cand.ptr(), chunk as u32);
                let blocks = n.div_ceil(chunk);
                if blocks > 65_535 {
                    return Err(crate::error::shape(OP, format!("rows of {n} entries need {blocks} blocks, more than a grid's 65,535")));
                }
                let blocks = blocks as u32;
                let (hist, gather, finish) =
                    (self.function(&TOP_K, "top_k_hist")?, self.function(&TOP_K, "top_k_gather")?, self.function(&TOP_K, "top_k_finish")?);
                // SAFETY: as above; the scratch is checked for n_rows rows; a block reads
                // x[blockIdx.y · chunk ..] clamped to n (chunk at most 8 values a thread, the
                // kernels' register array); candidates past TOPK_CAND are counted,
                // not stored (then top_k_finish runs the one-block form on the row). A scratch
                // not zero on entry (the contract, which top_k_finish keeps for the next call)
                // gives wrong entries but no access out of bounds: gather writes only below the
                // row's k - need, finish reads only candidate ids below n.
                unsafe {
                    self.launch(&hist, (rows, blocks, 1), THREADS, 0, &p)?;
                    self.launch(&gather, (rows, blocks, 1), THREADS, 0, &p)?;
                    self.launch(&finish, (rows, 1, 1), THREADS, (TOPK_CAND * 8) as u32, &p)
                }
            }
        }
    }
}
