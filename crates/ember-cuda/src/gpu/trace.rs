//! A timeline of every launch from inside the GPU, for finding where a decode step's time goes
//! in the chain of kernels (CUDA graphs and programmatic launch included, which host-side
//! events cannot see).

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::{CudaModule, CudaSlice, CudaStream};

use crate::error::{Result, drv};
use crate::kernels::{self, Kernel};

/// `EMBER_CUDA_TRACE=FILE` with the kernel define `EMBER_TRACE` (`EMBER_KERNEL_DEFINES`):
/// block 0 of every launch appends, once its `pdl_enter` wait is over (kernels/prelude.cuh),
/// %globaltimer (ns), its module and its grid to a device buffer of `EMBER_CUDA_TRACE_CAP`
/// (default 1,000,000) launches. Since a launch waits there for the one ahead to finish, the
/// gap between launch i's time and launch i + 1's is what launch i costs the chain. Written to
/// FILE (FILE.N for GPU N > 0) when the GPU handle drops: one line a launch, `ns module grid_x
/// grid_y` (grids past 2^20 - 1 shown as that; a module, not an entry: `gemv_q8_mixed` and
/// `gemv_q8_q4_k` of one grid look alike).
/// `bench/gpu/trace.py` sums it per kernel. Timing only: the results are unchanged.
pub(super) struct Trace {
    buf: CudaSlice<u64>,
    cap: usize,
    path: String,
}

impl Trace {
    pub(super) fn from_env(stream: &Arc<CudaStream>, ordinal: usize) -> Result<Option<Trace>> {
        let Some(mut path) = std::env::var("EMBER_CUDA_TRACE").ok().filter(|v| !v.is_empty()) else { return Ok(None) };
        if ordinal > 0 {
            path = format!("{path}.{ordinal}"); // each GPU's handle its own file
        }
        if !kernels::defined("EMBER_TRACE") {
            eprintln!("EMBER_CUDA_TRACE: no trace without the kernel define (EMBER_KERNEL_DEFINES=EMBER_TRACE)");
            return Ok(None);
        }
        // At most 2^26 launches (1 GiB of device memory).
        let cap = std::env::var("EMBER_CUDA_TRACE_CAP").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000usize).clamp(1, 1 << 26);
        let mut head = vec![0u64; 2 + 2 * cap];
        head[1] = cap as u64;
        let buf = stream.clone_htod(&head).map_err(drv("cuMemcpyHtoD"))?;
        eprintln!("EMBER_CUDA_TRACE: up to {cap} launches to {path} (timing only)");
        Ok(Some(Trace { buf, cap, path }))
    }

    /// Points a module just loaded at the buffer and tells it its number (its place in
    /// [`kernels::ALL`]).
    pub(super) fn attach(&self, stream: &Arc<CudaStream>, module: &Arc<CudaModule>, kernel: &'static Kernel) -> Result<()> {
        use cudarc::driver::DevicePtr;
        let index = kernels::ALL.iter().position(|k| k.name == kernel.name).unwrap_or(usize::MAX) as u32;
        let (ptr, _guard) = self.buf.device_ptr(stream);
        let mut at = module.get_global("ember_trace_buf", stream).map_err(drv("cuModuleGetGlobal"))?;
        stream.memcpy_htod(&ptr.to_le_bytes(), &mut at).map_err(drv("cuMemcpyHtoD"))?;
        let mut at = module.get_global("ember_trace_mod", stream).map_err(drv("cuModuleGetGlobal"))?;
        stream.memcpy_htod(&index.to_le_bytes(), &mut at).map_err(drv("cuMemcpyHtoD"))?;
        Ok(())
    }

    /// Writes the launches so far to the file (after the stream's work).
    pub(super) fn dump(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let all = stream.clone_dtoh(&self.buf).map_err(drv("cuMemcpyDtoH"))?;
        let n = (all[0] as usize).min(self.cap);
        let names: Vec<&str> = kernels::ALL.iter().map(|k| k.name).collect();
        let mut out = Vec::with_capacity(n * 32);
        for e in all[2..2 + 2 * n].chunks_exact(2) {
            let (m, gy, gx) = ((e[1] >> 40) as usize, (e[1] >> 20) & 0xfffff, e[1] & 0xfffff);
            let _ = writeln!(out, "{} {} {gx} {gy}", e[0], names.get(m).copied().unwrap_or("?"));
        }
        match std::fs::write(&self.path, out) {
            Ok(()) => eprintln!("EMBER_CUDA_TRACE: {n} launches written to {} ({} counted)", self.path, all[0]),
            Err(e) => eprintln!("EMBER_CUDA_TRACE: could not write {}: {e}", self.path),
        }
        Ok(())
    }
}
