//! The op set on the CPU: multithreaded, computing directly on the quantised blocks of the
//! memory-mapped weights.
//!
//! Two precisions share one backend. [`Precision::Fast`] quantises each activation row once per
//! op to 8 bits in blocks of 32 and takes integer block dot products for every quantised weight
//! type ([`kernels`]); F32/F16/BF16 weights keep f32 activations. [`Precision::Exact`] dequantises
//! weight rows exactly and computes in f32: the reference the fixtures are checked with. The
//! decision a reader may question: threads come from a rayon pool sized to the physical cores;
//! the low-latency spin pool for decode is a later, measured change.

#![forbid(unsafe_code)]

pub mod kernels;
mod ops;
mod threads;

pub use ops::{CpuOps, Precision};
pub use threads::physical_cores;
