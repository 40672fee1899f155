//! Where a one-row step's wall time goes on the host (`EMBER_CUDA_STEP_TIMES=1`): what the GPU
//! may be waiting for between two decode steps. Each step is split at five instants:
//!
//! ```text
//! read returned ─ outside ─▶ begin_step ─ setup ─▶ recording ─ first ─▶ first flush
//!   ─ record ─▶ read called ─ wait ─▶ stream idle ─ copy ─▶ read returned
//! ```
//!
//! `outside` is everything between two steps that is not the backend (the engine, the sampler,
//! the caller's loop); `setup` is `begin_step` (the step's small uploads); `first` is recording
//! the launches of the step's first list, the GPU idle all along; `record` the rest of the
//! recording, which the GPU overlaps; `wait` the last list's flush and the wait for the GPU;
//! `copy` the read itself, after the stream went idle (the timed read waits for the stream
//! first, one extra synchronisation a step, so this mode costs a few microseconds a step).
//! The GPU idles during `copy`, `outside`, `setup` and `first` of each step, plus the launch
//! latency of the first list. The means are printed to stderr when the backend is dropped.

use std::time::Instant;

#[derive(Default)]
pub(super) struct StepTimes {
    steps: u64,
    /// Seconds summed: outside, setup, first, record, wait, copy.
    sums: [f64; 6],
    last_read_end: Option<Instant>,
    begin: Option<Instant>,
    recording: Option<Instant>,
    first_flush: Option<Instant>,
    read_start: Option<Instant>,
    idle: Option<Instant>,
}

pub(super) fn from_env() -> Option<StepTimes> {
    std::env::var_os("EMBER_CUDA_STEP_TIMES").filter(|v| !v.is_empty() && v != "0").map(|_| StepTimes::default())
}

impl StepTimes {
    /// `begin_step` was entered (`timed`: a one-row step, recorded).
    pub fn begin(&mut self, timed: bool) {
        let now = Instant::now();
        self.begin = timed.then_some(now);
        self.recording = None;
        self.first_flush = None;
        self.read_start = None;
        self.idle = None;
        if !timed {
            self.last_read_end = None;
        }
    }

    /// The step's launches are recorded from now on.
    pub fn recording(&mut self) {
        if self.begin.is_some() {
            self.recording = Some(Instant::now());
        }
    }

    /// Whether this step is timed.
    pub fn timed(&self) -> bool {
        self.begin.is_some()
    }

    /// A read was called (`first_flush`: when the step's first list went out, if it did).
    pub fn read_start(&mut self, first_flush: Option<Instant>) {
        if self.begin.is_some() && self.read_start.is_none() {
            self.read_start = Some(Instant::now());
            self.first_flush = first_flush;
        }
    }

    /// The stream went idle inside the read.
    pub fn idle(&mut self) {
        if self.read_start.is_some() && self.idle.is_none() {
            self.idle = Some(Instant::now());
        }
    }

    /// The read returned: the step's split is added up.
    pub fn read_end(&mut self) {
        let now = Instant::now();
        let (Some(b), Some(rec), Some(rs), Some(idle)) = (self.begin, self.recording, self.read_start, self.idle) else {
            return;
        };
        // A step whose launches all went out at the read: its first list is the read's flush.
        let first = self.first_flush.unwrap_or(rs).max(rec);
        if let Some(prev) = self.last_read_end {
            let parts = [b - prev, rec - b, first - rec, rs.max(first) - first, idle - rs, now - idle];
            for (s, d) in self.sums.iter_mut().zip(parts) {
                *s += d.as_secs_f64();
            }
            self.steps += 1;
        }
        self.last_read_end = Some(now);
        self.begin = None;
    }

    /// The means in microseconds, as one line.
    pub fn report(&self) -> Option<String> {
        if self.steps == 0 {
            return None;
        }
        let us = |i: usize| 1e6 * self.sums[i] / self.steps as f64;
        let total: f64 = (0..6).map(us).sum();
        Some(format!(
            "host time per one-row step (EMBER_CUDA_STEP_TIMES), mean of {} steps: {total:.1} us = outside {:.1} + setup {:.1} + first list {:.1} + rest of the recording {:.1} + wait for the GPU {:.1} + read {:.1}; the GPU idles for about outside + setup + first list + read = {:.1} us",
            self.steps,
            us(0),
            us(1),
            us(2),
            us(3),
            us(4),
            us(5),
            us(0) + us(1) + us(2) + us(5)
        ))
    }
}
