//! The CPU backend against the reference backend (ember_ops::conformance), in every precision
//! and on every instruction set this machine has (scalar included), on 1 and 2 threads.

use ember_cpu::{CpuOps, Isa, Precision};
use ember_ops::conformance::{self, Tolerances};
use ember_ops::{HostBackend, Ops};

fn conform(precision: Precision, tol: Tolerances, own: &[(&str, f32)]) {
    for isa in Isa::available() {
        for threads in [1, 2] {
            let report = conformance::run_with(
                &mut |w| {
                    let mut ops = HostBackend::new(CpuOps::with_isa(precision, threads, isa));
                    ops.register(w).unwrap();
                    Box::new(ops) as Box<dyn Ops>
                },
                tol,
                own,
            );
            eprintln!("{precision:?} {isa:?} {threads} threads:\n{report}");
        }
    }
}

/// Fast precision quantises activations to 8 bits per 32 values for quantised weights.
/// Measured (scalar, AVX2, AVX-512; 1 and 2 threads): quantised matmul NMSE up to 1.6e-5, MoE
/// 1.1e-4; float ops up to 2.0e-6 relative (the delta rule; norms, gates with a vectorised exp,
/// attention over f32/f16 caches ~4e-7). Bounds about 10x: 1e-3 and 2e-5.
///
/// Attention over a q8_0 cache has its own bound: its scores are integer dots with the query
/// quantised like a matmul's activations (8 bits per 32 values), so its error is that
/// rounding. Measured max relative error 2.30e-3 (AVX2, AVX-512: decode and prompt tiles;
/// scalar, whose prompts keep f32 tiles, 1.69e-3), 3.39e-3 with the prompt tiles' P·V in bf16
/// (AVX-512 BF16, below; 3.88e-3 when decode's P·V was bf16 too; now 16-bit integers);
/// bound 1e-2, ~2.6x.
const ATTN_Q8_0: (&str, f32) = ("attention Q8_0", 1e-2);

/// Prompt attention over an f16 cache on a CPU with AVX-512 BF16 sums P·V in bf16 (values and
/// probabilities rounded to 8 significant bits, pairs of products summed in f32; decode and
/// the other instruction sets stay in f32): measured max relative error 2.94e-3 (1 and 2
/// threads); bound 1e-2 as for q8_0. Without AVX-512 BF16 the f16 cases stay within the 2e-5
/// of every float op.
const ATTN_F16: (&str, f32) = ("attention F16", 1e-2);

#[test]
fn fast_conforms() {
    conform(Precision::Fast, Tolerances { rel: 2e-5, quant_nmse: 1e-3 }, &[ATTN_Q8_0, ATTN_F16]);
}

/// Exact precision dequantises weights and sums in f32. Measured (every ISA, 1 and 2 threads):
/// quantised matmul NMSE up to 3.0e-14, float matmuls up to 3.4e-6 relative (F16, k = 256, a
/// single output row whose dot products nearly cancel, so the largest |ref| is small; the other
/// float cases 2.5e-7), other ops 0 (the reference's code). Bounds: 1e-10 and 1e-5.
#[test]
fn exact_conforms() {
    conform(Precision::Exact, Tolerances { rel: 1e-5, quant_nmse: 1e-10 }, &[]);
}

/// Batch-invariant precision: the fast numerics through the single-token kernels; measured as
/// the fast precision (NMSE up to 1.6e-5, MoE 1.1e-4; 2.0e-6 relative; attention Q8_0 2.30e-3
/// on every instruction set: every token takes the decode kernel's integer scores; 1.81e-3
/// on AVX-512, whose decode P·V is in 16-bit integers).
#[test]
fn batch_invariant_conforms() {
    conform(Precision::BatchInvariant, Tolerances { rel: 2e-5, quant_nmse: 1e-3 }, &[ATTN_Q8_0]);
}
