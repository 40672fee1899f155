//! Where a [`Gpu`]'s time goes: GPU time of its flushes and the host's recording
//! (`EMBER_CUDA_GRAPH_STATS`), and GPU time per kernel entry (`EMBER_CUDA_PROFILE`).

use std::collections::HashMap;

use cudarc::driver::CudaEvent;

#[cfg(doc)]
use super::{Gpu, GraphStats};

/// GPU time from an event pair around every flush (`EMBER_CUDA_GRAPH_STATS=1`): with graphs on,
/// the GPU time of the step's kernels (the stream is idle when a flush starts, so the pair spans
/// the graph's start to its end); printed with the [`GraphStats`] when the [`Gpu`] is dropped.
///
/// Also the host's side of the recorded steps: wall time from [`Gpu::begin_record`] to the start
/// of the step's last flush that sent launches (the model's ops recorded; the logits' read
/// flushes the end of the step and waits), so a step's wall time splits into the host's
/// recording, what the GPU ran and what it waited for.
#[derive(Default)]
pub(super) struct FlushTime {
    pub(super) pending: Vec<(CudaEvent, CudaEvent)>,
    pub(super) n: u64,
    pub(super) ms: f64,
    pub(super) record_start: Option<std::time::Instant>,
    pub(super) last_flush: Option<std::time::Instant>,
    pub(super) record_ms: f64,
    pub(super) steps: u64,
}

impl FlushTime {
    pub(super) fn collect(&mut self) {
        if let Some((_, end)) = self.pending.last() {
            let _ = end.synchronize();
        }
        for (a, b) in self.pending.drain(..) {
            self.ms += a.elapsed_ms(&b).unwrap_or(0.0) as f64;
            self.n += 1;
        }
    }
}

/// GPU time per kernel entry from an event pair around every launch (`EMBER_CUDA_PROFILE=1`),
/// read back in batches; the totals go to stderr when the [`Gpu`] is dropped. The events cost
/// host time per launch, so wall-clock figures of a profiled run are not the engine's.
#[derive(Default)]
pub(super) struct Profile {
    pub(super) names: HashMap<usize, String>,
    pub(super) pending: Vec<(String, CudaEvent, CudaEvent)>,
    pub(super) spare: Vec<(CudaEvent, CudaEvent)>,
    pub(super) totals: HashMap<String, (u64, f64)>,
}

impl Profile {
    /// Adds every pending pair's time to the totals (waits for the last one).
    pub(super) fn flush(&mut self) {
        if let Some((_, _, end)) = self.pending.last() {
            let _ = end.synchronize();
        }
        for (name, a, b) in self.pending.drain(..) {
            let ms = a.elapsed_ms(&b).unwrap_or(0.0) as f64;
            let t = self.totals.entry(name).or_default();
            t.0 += 1;
            t.1 += ms;
            self.spare.push((a, b));
        }
    }

    pub(super) fn report(&mut self) -> String {
        self.flush();
        let mut rows: Vec<_> = self.totals.iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let total: f64 = rows.iter().map(|r| r.1.1).sum();
        let calls: u64 = rows.iter().map(|r| r.1.0).sum();
        let mut out = format!("GPU time per kernel (EMBER_CUDA_PROFILE): {total:.1} ms in {calls} launches\n");
        out += &format!("{:<40} {:>9} {:>11} {:>9} {:>7}\n", "kernel", "calls", "total ms", "us/call", "share");
        for (name, (n, ms)) in rows {
            out += &format!("{name:<40} {n:>9} {ms:>11.2} {:>9.2} {:>6.1}%\n", 1e3 * ms / *n as f64, 100.0 * ms / total.max(1e-9));
        }
        out
    }
}
