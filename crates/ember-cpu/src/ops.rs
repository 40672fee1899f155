use ember_gguf::quant;

use crate::kernels::{self, ActRow};
use ember_ops::reference::{self, scatter_head};
use ember_ops::{AttnShape, DeltaShape, KvRows, Mat, Ops, WeightView};
use rayon::prelude::*;

/// How matmuls treat activations (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Weights dequantised exactly, f32 activations and sums.
    Exact,
    /// Activations quantised to the weight's dot-product type, integer block dot products.
    Fast,
}

pub struct CpuOps {
    precision: Precision,
    pool: rayon::ThreadPool,
    n_threads: usize,
}

impl std::fmt::Debug for CpuOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuOps").field("precision", &self.precision).field("n_threads", &self.n_threads).finish()
    }
}

impl CpuOps {
    /// `n_threads = 0` means one per physical core.
    pub fn new(precision: Precision, n_threads: usize) -> Self {
        let n_threads = if n_threads == 0 { crate::physical_cores() } else { n_threads };
        // unwrap: building a pool fails only if the OS refuses to spawn threads at start-up,
        // where there is nothing sensible to continue with.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(n_threads).thread_name(|i| format!("ember-cpu-{i}")).build().unwrap();
        CpuOps { precision, pool, n_threads }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Rows per parallel task: a few tasks per thread for balance, at least one row.
    fn rows_per_task(&self, n_rows: usize) -> usize {
        n_rows.div_ceil(self.n_threads * 4).max(1)
    }
}

/// f32 dot product with 8 independent partial sums, so the compiler can vectorise it.
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

impl Ops for CpuOps {
    fn name(&self) -> &'static str {
        match self.precision {
            Precision::Exact => "cpu-exact",
            Precision::Fast => "cpu",
        }
    }

    fn matmul(&self, w: &WeightView, x: &Mat) -> Mat {
        assert_eq!(x.d, w.k, "matmul: x has {} columns, weight rows have {}", x.d, w.k);
        let (n, k, n_rows) = (x.n, w.k, w.n_rows);
        if n == 0 || n_rows == 0 {
            return Mat::zeros(n, n_rows);
        }
        let quantised = self.precision == Precision::Fast && kernels::supported(w.ty);
        let rpt = self.rows_per_task(n_rows);
        // y transposed: row r holds the n outputs of weight row r (contiguous per task).
        let mut yt = vec![0f32; n_rows * n];
        self.pool.install(|| {
            if quantised {
                // Activations quantised once per row, shared by every weight row.
                let act: Vec<ActRow> = x
                    .data
                    .par_chunks(k)
                    .map(|row| {
                        let mut a = ActRow::default();
                        ActRow::quantize(row, &mut a);
                        a
                    })
                    .collect();
                yt.par_chunks_mut(rpt * n).enumerate().for_each(|(ci, out)| {
                    for (j, yr) in out.chunks_exact_mut(n).enumerate() {
                        let wr = w.row(ci * rpt + j);
                        for (y, a) in yr.iter_mut().zip(&act) {
                            *y = kernels::dot(w.ty, wr, a);
                        }
                    }
                });
            } else {
                yt.par_chunks_mut(rpt * n).enumerate().for_each(|(ci, out)| {
                    let mut row = vec![0f32; k];
                    for (j, yr) in out.chunks_exact_mut(n).enumerate() {
                        // unwrap: the view's rows are whole blocks of its type.
                        quant::dequantize(w.ty, w.row(ci * rpt + j), &mut row).unwrap();
                        for (t, y) in yr.iter_mut().enumerate() {
                            *y = dot_f32(&row, x.row(t));
                        }
                    }
                });
            }
        });
        let mut y = Mat::zeros(n, n_rows);
        for (r, col) in yt.chunks_exact(n).enumerate() {
            for (t, v) in col.iter().enumerate() {
                y.data[t * n_rows + r] = *v;
            }
        }
        y
    }

    fn gated_delta_rule(&self, s: DeltaShape, q: &Mat, k: &Mat, v: &Mat, g: &Mat, beta: &Mat, state: &mut [f32], chunked: bool) -> Mat {
        let per_head: Vec<Vec<f32>> = self.pool.install(|| {
            state
                .par_chunks_mut(s.d_v * s.d_k)
                .enumerate()
                .map(|(h, st)| reference::delta_rule_head(s, h, q, k, v, g, beta, st, chunked))
                .collect()
        });
        let mut out = Mat::zeros(s.n_tok, s.n_v_head * s.d_v);
        for (h, o) in per_head.iter().enumerate() {
            scatter_head(&mut out, h, s.d_v, o);
        }
        out
    }

    fn attention(&self, s: AttnShape, q: &Mat, k: &KvRows, v: &KvRows) -> Mat {
        let per_head: Vec<Vec<f32>> = self.pool.install(|| (0..s.n_head).into_par_iter().map(|n| reference::attention_head(s, n, q, k, v)).collect());
        let mut out = Mat::zeros(s.n_tok, s.n_head * s.head_dim);
        for (n, o) in per_head.iter().enumerate() {
            scatter_head(&mut out, n, s.head_dim, o);
        }
        out
    }
}
