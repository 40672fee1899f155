//! `/metrics` in the Prometheus text format (version 0.0.4), written by hand: a few counters,
//! two histograms and gauges read from the engine need no client library.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ember_engine::EngineStats;

/// Upper bounds (seconds) of the time-to-first-token buckets.
const TTFT_BOUNDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds (seconds) of the per-token latency buckets.
const TOKEN_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

/// A cumulative histogram.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if s <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9);
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// Server-side metrics; the engine's live gauges are read at render time.
#[derive(Debug)]
pub struct Metrics {
    /// (endpoint, status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub tokens_prompt: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub parse_warnings: AtomicU64,
    /// Finish reasons of completed generations.
    finish: Mutex<BTreeMap<&'static str, u64>>,
    pub ttft: Histogram,
    pub per_token: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            tokens_prompt: AtomicU64::new(0),
            tokens_generated: AtomicU64::new(0),
            parse_warnings: AtomicU64::new(0),
            finish: Mutex::default(),
            ttft: Histogram::new(TTFT_BOUNDS),
            per_token: Histogram::new(TOKEN_BOUNDS),
        }
    }
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        // unwrap_or_else: a poisoned lock only means another thread panicked mid-increment.
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
    }

    pub fn count_finish(&self, reason: &'static str) {
        let mut m = self.finish.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(reason).or_insert(0) += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self, engine: &EngineStats, n_parallel: usize) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(out, "# HELP ember_requests_total HTTP requests by endpoint and status.\n# TYPE ember_requests_total counter");
        for ((ep, status), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "ember_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}", escape(ep));
        }
        let _ = writeln!(out, "# HELP ember_finished_total Generations by finish reason.\n# TYPE ember_finished_total counter");
        for (reason, n) in self.finish.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "ember_finished_total{{reason=\"{reason}\"}} {n}");
        }
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(&mut out, "ember_prompt_tokens_total", "Prompt tokens of completed requests.", ld(&self.tokens_prompt));
        counter(&mut out, "ember_generated_tokens_total", "Tokens generated for completed requests.", ld(&self.tokens_generated));
        counter(
            &mut out,
            "ember_parse_warnings_total",
            "Malformed model output kept as text (reasoning/tool-call markup).",
            ld(&self.parse_warnings),
        );
        counter(&mut out, "ember_engine_steps_total", "Forward passes run by the engine.", ld(&engine.n_steps));
        counter(&mut out, "ember_engine_prompt_tokens_total", "Prompt tokens processed by the engine.", ld(&engine.tokens_prompt));
        counter(&mut out, "ember_engine_generated_tokens_total", "Tokens sampled by the engine.", ld(&engine.tokens_generated));
        let _ = writeln!(
            out,
            "# HELP ember_engine_step_seconds_total Wall time of the engine's steps (forward passes, sampling, events).\n# TYPE ember_engine_step_seconds_total counter\nember_engine_step_seconds_total {}",
            ld(&engine.step_us) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "# HELP ember_engine_forward_seconds_total Wall time of the steps inside the backend's forward passes, handing tokens to clients excluded (the rest is the engine's own host time).\n# TYPE ember_engine_forward_seconds_total counter\nember_engine_forward_seconds_total {}",
            ld(&engine.forward_us) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "# HELP ember_engine_deliver_seconds_total Wall time of the engine handing tokens to clients (on a GPU, while the next step runs).\n# TYPE ember_engine_deliver_seconds_total counter\nember_engine_deliver_seconds_total {}",
            ld(&engine.deliver_us) as f64 / 1e6
        );
        counter(
            &mut out,
            "ember_cancelled_total",
            "Sequences freed because the client left or a stop string matched.",
            ld(&engine.n_cancelled),
        );
        counter(&mut out, "ember_prompt_cache_hits_total", "Requests that restored a prompt-cache checkpoint.", ld(&engine.cache_hits));
        counter(&mut out, "ember_prompt_cache_misses_total", "Requests that found no usable checkpoint.", ld(&engine.cache_misses));
        counter(
            &mut out,
            "ember_prompt_cache_evictions_total",
            "Checkpoints evicted to stay in the RAM budget.",
            ld(&engine.cache_evictions),
        );
        counter(&mut out, "ember_prompt_cache_checkpoints_total", "Checkpoints stored.", ld(&engine.cache_checkpoints));
        counter(&mut out, "ember_prompt_cache_tokens_total", "Prompt tokens restored instead of computed.", ld(&engine.tokens_cached));
        // The expert tier (zero without one); per token: divide by the engine's token counters.
        counter(
            &mut out,
            "ember_expert_hits_total",
            "Routed (token, expert) pairs computed on the GPU (resident experts).",
            ld(&engine.expert_hits),
        );
        counter(
            &mut out,
            "ember_expert_misses_total",
            "Routed (token, expert) pairs whose expert was not resident (on the CPU, or streamed).",
            ld(&engine.expert_misses),
        );
        counter(
            &mut out,
            "ember_expert_streamed_pairs_total",
            "Non-resident pairs of prompt batches computed on the GPU after uploading their experts for the batch.",
            ld(&engine.expert_streamed_pairs),
        );
        counter(
            &mut out,
            "ember_expert_streamed_bytes_total",
            "Bytes of experts uploaded for prompt batches.",
            ld(&engine.expert_streamed_bytes),
        );
        counter(
            &mut out,
            "ember_expert_evictions_total",
            "Experts sent back to host memory because the GPU's free memory fell below its reserve.",
            ld(&engine.expert_evictions),
        );
        counter(&mut out, "ember_expert_uploads_total", "Experts moved onto the GPU by the tier.", ld(&engine.expert_uploads));
        counter(
            &mut out,
            "ember_expert_miss_bytes_total",
            "Bytes of expert weights the CPU read for misses.",
            ld(&engine.expert_miss_bytes),
        );
        let _ = writeln!(
            out,
            "# HELP ember_expert_miss_seconds_total Wall time of the CPU's expert work (overlapped with the GPU's).\n# TYPE ember_expert_miss_seconds_total counter\nember_expert_miss_seconds_total {}",
            ld(&engine.expert_miss_us) as f64 / 1e6
        );
        let layers = engine.expert_layers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if !layers.is_empty() {
            let _ = writeln!(
                out,
                "# HELP ember_expert_layer_pairs_total Routed pairs per layer and device of the expert tier, by where the expert was (resident on the device or not).\n# TYPE ember_expert_layer_pairs_total counter"
            );
            for (dev, l, hits, misses) in &layers {
                let _ = writeln!(out, "ember_expert_layer_pairs_total{{device=\"{dev}\",layer=\"{l}\",resident=\"yes\"}} {hits}");
                let _ = writeln!(out, "ember_expert_layer_pairs_total{{device=\"{dev}\",layer=\"{l}\",resident=\"no\"}} {misses}");
            }
        }
        gauge(&mut out, "ember_kv_pages_free", "KV pages free in the backend's pool.", engine.kv_pages_free.load(Ordering::Relaxed) as u64);
        gauge(&mut out, "ember_kv_pages_total", "KV pages in the backend's pool.", engine.kv_pages_total.load(Ordering::Relaxed) as u64);
        gauge(&mut out, "ember_prompt_cache_entries", "Checkpoints held.", engine.cache_entries.load(Ordering::Relaxed) as u64);
        gauge(&mut out, "ember_prompt_cache_bytes", "Bytes held by checkpoints.", engine.cache_bytes.load(Ordering::Relaxed) as u64);
        gauge(
            &mut out,
            "ember_prompt_cache_budget_bytes",
            "RAM budget of the prompt cache (--cache-ram).",
            engine.cache_budget_bytes.load(Ordering::Relaxed) as u64,
        );
        self.ttft.write(&mut out, "ember_time_to_first_token_seconds", "Time from request arrival to the first generated token.");
        self.per_token.write(&mut out, "ember_time_per_output_token_seconds", "Time between consecutive generated tokens of a request.");
        gauge(&mut out, "ember_queue_depth", "Requests waiting for a sequence slot.", engine.n_waiting.load(Ordering::Relaxed) as u64);
        gauge(&mut out, "ember_active_sequences", "Sequences generating now.", engine.n_active.load(Ordering::Relaxed) as u64);
        gauge(&mut out, "ember_parallel_sequences", "Sequence slots (--parallel).", n_parallel as u64);
        out
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expert_tier_is_rendered_per_layer_and_device() {
        let engine = EngineStats::default();
        engine.expert_hits.store(30, Ordering::Relaxed);
        engine.expert_misses.store(10, Ordering::Relaxed);
        engine.expert_miss_us.store(1_500_000, Ordering::Relaxed);
        engine.step_us.store(2_500_000, Ordering::Relaxed);
        engine.forward_us.store(2_000_000, Ordering::Relaxed);
        engine.deliver_us.store(250_000, Ordering::Relaxed);
        *engine.expert_layers.lock().unwrap() = vec![("gpu:0".into(), 3, 25, 5), ("gpu:0".into(), 7, 5, 5)];
        let text = Metrics::default().render(&engine, 4);
        for line in [
            "ember_expert_hits_total 30",
            "ember_expert_misses_total 10",
            "ember_expert_miss_seconds_total 1.5",
            "ember_engine_step_seconds_total 2.5",
            "ember_engine_forward_seconds_total 2",
            "ember_engine_deliver_seconds_total 0.25",
            "ember_expert_layer_pairs_total{device=\"gpu:0\",layer=\"3\",resident=\"yes\"} 25",
            "ember_expert_layer_pairs_total{device=\"gpu:0\",layer=\"7\",resident=\"no\"} 5",
            "# TYPE ember_expert_layer_pairs_total counter",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Without a tier: totals at zero, no per-layer family.
        let text = Metrics::default().render(&EngineStats::default(), 4);
        assert!(text.contains("ember_expert_hits_total 0") && !text.contains("ember_expert_layer_pairs_total"));
    }
}
