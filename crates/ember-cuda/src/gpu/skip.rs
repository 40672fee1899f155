//! Kernels left out of a run, for measuring what each costs a decode step.

use std::collections::HashMap;
use std::sync::Mutex;

/// `EMBER_CUDA_SKIP=entry,entry,..`: those kernel entries stop being launched after their
/// first `EMBER_CUDA_SKIP_AFTER` (default 2,000) launches, so that the buffers they write hold
/// finite values from those launches and the kernels after them run on the same shapes. The
/// step then runs without them: how much faster it gets is what each one costs in the chain of
/// a step (launch, ramp and drain included), an upper bound on what fusing it away can save.
/// The results are wrong; a diagnostic for benchmarks only.
pub(super) struct Skip {
    names: Vec<String>,
    after: u64,
    seen: Mutex<HashMap<usize, u64>>,
}

impl Skip {
    pub(super) fn from_env() -> Option<Skip> {
        let v = std::env::var("EMBER_CUDA_SKIP").ok().filter(|v| !v.is_empty())?;
        let after = std::env::var("EMBER_CUDA_SKIP_AFTER").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
        eprintln!("EMBER_CUDA_SKIP: leaving out {v} after {after} launches each (results are wrong: timing only)");
        Some(Skip { names: v.split(',').map(str::to_owned).collect(), after, seen: Mutex::default() })
    }

    pub(super) fn register(&self, entry: &str, f: usize) {
        if self.names.iter().any(|n| n == entry) {
            self.seen.lock().unwrap_or_else(|e| e.into_inner()).insert(f, 0);
        }
    }

    pub(super) fn skips(&self, f: usize) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.get_mut(&f).is_some_and(|n| {
            *n += 1;
            *n > self.after
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_entries_stop_after_their_first_launches_and_others_never() {
        let s = Skip { names: vec!["route".into(), "gate".into()], after: 3, seen: Mutex::default() };
        s.register("route", 1);
        s.register("moe_down_q8_q4_k", 2);
        let route: Vec<bool> = (0..5).map(|_| s.skips(1)).collect();
        assert_eq!(route, [false, false, false, true, true]);
        assert!((0..10).all(|_| !s.skips(2)), "an entry not named is never left out");
        assert!(!s.skips(3), "a function never registered is never left out");
    }
}
