//! The op set on the CPU: SIMD kernels computing directly on the quantised blocks of the
//! memory-mapped weights, run on a persistent low-latency thread pool.
//!
//! Two precisions share one backend. [`Precision::Fast`] quantises each activation row once per
//! op to 8 bits in blocks of 32 and takes integer block dot products for every quantised weight
//! type ([`kernels`] is the scalar reference, [`simd`] the AVX2 / AVX-512 VNNI / NEON versions
//! chosen at run time); F32/F16/BF16 weights keep f32 activations. [`Precision::Exact`]
//! dequantises weight rows exactly and computes in f32: the reference the fixtures are checked
//! with. The decision a reader may question: decode runs ~10^3 parallel regions per token, so
//! threads come from our own spin-then-park [`pool`] (a few µs per region) rather than rayon
//! (+15 µs per region once its workers sleep; shared/STACK.md).

#![deny(unsafe_code)]
// Kernels index lanes, tokens and rows in counted loops that mirror the formulas they compute
// (often several arrays with one index); iterator chains would hide that.
#![allow(clippy::needless_range_loop)]

#[allow(unsafe_code)]
mod alloc;
pub mod kernels;
mod ops;
pub mod panel;
#[allow(unsafe_code)]
pub mod pool;
#[allow(unsafe_code)]
pub mod simd;
mod threads;

pub use ops::{CpuOps, Precision};

/// The CPU backend: the CPU kernels behind the host arena and state store.
pub type CpuBackend = ember_ops::HostBackend<CpuOps>;

/// A CPU backend of `precision` on `n_threads` threads.
pub fn backend(precision: Precision, n_threads: usize) -> CpuBackend {
    ember_ops::HostBackend::new(CpuOps::new(precision, n_threads))
}
pub use simd::Isa;
pub use threads::physical_cores;
