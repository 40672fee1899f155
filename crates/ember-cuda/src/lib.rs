//! ember's CUDA layer: driver and NVRTC loading, the kernel cache, device buffers, and the
//! kernels (`kernels/*.cu`, one op per file) with their launchers ([`ops`]), and [`CudaOps`],
//! ember's op trait (`ember_ops::Ops` + `SeqStore`) on one GPU built on them. It knows no model.
//!
//! The decision a reader may question: kernels are CUDA C++ compiled at run time by NVRTC for
//! the exact GPU (`sm_XX` CUBIN, cached on disk), not built by nvcc at build time. So every
//! crate builds and CI runs with no CUDA installed, the binary carries no toolkit, and NVRTC
//! is found at run time by our own loader ([`nvrtc`]); see shared/STACK.md.
//!
//! FFI and `unsafe` live here only: the NVRTC symbols ([`nvrtc`]), a few driver calls and the
//! launches ([`Gpu`]) and their replay as CUDA graphs ([`graph`]), each block with its invariant. README.md beside this crate lists the
//! kernels, the errors and speeds measured on an H200, and what is left.

mod backend;
mod error;
mod gpu;
mod graph;
pub mod kernels;
pub mod nvrtc;
pub mod ops;

pub use backend::{ACT_RESERVE, CudaOps, GRAPH_MAX_ROWS};
pub use error::{Error, Result};
pub use gpu::{
    Buf, DevRange, DeviceInfo, Download, Elem, FEED_TIMEOUT_NS, Feed, Gpu, LaterDownload, MAILBOX_TIMEOUT_NS, Mailbox, devices,
    driver_version,
};
pub use graph::GraphStats;
pub use ops::Precision;
