//! Token sampling: llama.cpp's default chain, `penalties -> top_k -> top_p -> min_p ->
//! temperature -> dist` (common/sampling.cpp, src/llama-sampling.cpp), on one logit row.
//!
//! Filters run on the *untempered* logits, as in llama.cpp: temperature only reshapes the
//! distribution over the tokens that survive. Candidates are kept in one reusable buffer;
//! a call allocates nothing once the buffer has grown to the vocabulary size. [`logprobs_of`]:
//! the log-probabilities a response reports for a sampled token.

use std::cmp::Ordering;

use crate::Error;

/// Sampling parameters of one sequence. Neutral values switch a stage off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// `<= 0`: greedy (argmax after penalties). Must be finite and `>= 0`.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Nucleus: keep the smallest prefix of probability mass `>= top_p`; in `(0, 1]`, `1` = off.
    pub top_p: f32,
    /// Drop tokens with probability `< min_p * p_max`; in `[0, 1]`, `0` = off.
    pub min_p: f32,
    /// Divides positive / multiplies negative logits of recent tokens; `> 0`, `1` = off.
    pub repeat_penalty: f32,
    /// OpenAI `presence_penalty`: subtracted once from every recent token's logit.
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty`: subtracted per occurrence among the recent tokens.
    pub frequency_penalty: f32,
    /// How many of the last history tokens the three penalties look at; `0` = penalties off.
    pub penalty_last_n: usize,
    /// `Some(s)`: reproducible draws. `None`: a fresh seed per sampler from the OS-seeded
    /// std hasher (OpenAI semantics: no seed, no reproducibility); see [`Sampler::seed`].
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults (`common_params_sampling`).
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplerConfig {
    /// Checks every field's range; the error names the field and the limit.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field: &'static str, limit: &'static str, got: f32| Err(Error::Config { field, limit, got: got.to_string() });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", "a finite number >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "in [0, 1]", self.min_p);
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat_penalty", "a finite number > 0", self.repeat_penalty);
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", "finite", self.presence_penalty);
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", "finite", self.frequency_penalty);
        }
        Ok(())
    }
}

/// A candidate token: id and (penalised, filtered) logit.
#[derive(Debug, Clone, Copy)]
struct Cand {
    id: u32,
    logit: f32,
}

/// Descending logit, ties to the lower id: a total order, so partial sorts are deterministic.
fn by_logit_desc(a: &Cand, b: &Cand) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Samples one token per call from a logit row. One per sequence (it owns the RNG state).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    seed: u64,
    rng: Xoshiro256,
    cands: Vec<Cand>,
    window: Vec<u32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self, Error> {
        cfg.validate()?;
        let seed = cfg.seed.unwrap_or_else(random_seed);
        Ok(Sampler { cfg, seed, rng: Xoshiro256::new(seed), cands: Vec::new(), window: Vec::new() })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The seed in use (drawn at construction when the config had none), for logs and replay.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Picks the next token. `history` holds the previous tokens of the sequence (prompt and
    /// generated) for the penalties. NaN logits count as `-inf`; an empty row yields 0.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.cands.clear();
        self.cands
            .extend(logits.iter().enumerate().map(|(i, &l)| Cand { id: i as u32, logit: if l.is_nan() { f32::NEG_INFINITY } else { l } }));
        self.apply_penalties(history);

        if self.cfg.temperature <= 0.0 {
            return argmax(&self.cands);
        }
        // Tokens at -inf can never be drawn; dropping them keeps the softmax finite.
        self.cands.retain(|c| c.logit > f32::NEG_INFINITY);
        if self.cands.len() <= 1 {
            return self.cands.first().map_or_else(|| Self::greedy(logits), |c| c.id);
        }
        self.top_k();
        self.top_p();
        self.min_p();
        self.draw()
    }

    /// Argmax with NaN as `-inf`; ties go to the lowest id. An empty row yields 0.
    pub fn greedy(logits: &[f32]) -> u32 {
        let mut best = (0u32, f32::NEG_INFINITY);
        for (i, &l) in logits.iter().enumerate() {
            if l > best.1 {
                best = (i as u32, l);
            }
        }
        best.0
    }

    /// llama.cpp `llama_sampler_penalties_apply`: for each distinct token among the last
    /// `penalty_last_n` of history, with count n: logit = logit <= 0 ? logit * r : logit / r,
    /// then logit -= n * frequency + presence.
    fn apply_penalties(&mut self, history: &[u32]) {
        let c = &self.cfg;
        let off = c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0;
        if c.penalty_last_n == 0 || off || history.is_empty() {
            return;
        }
        self.window.clear();
        self.window.extend_from_slice(&history[history.len().saturating_sub(c.penalty_last_n)..]);
        self.window.sort_unstable();
        // Candidates are still indexed by id here (penalties run first).
        for run in self.window.chunk_by(|a, b| a == b) {
            let Some(cand) = self.cands.get_mut(run[0] as usize) else {
                continue;
            };
            if cand.logit <= 0.0 {
                cand.logit *= c.repeat_penalty;
            } else {
                cand.logit /= c.repeat_penalty;
            }
            cand.logit -= run.len() as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }

    /// Keeps the `top_k` largest logits (unordered).
    fn top_k(&mut self) {
        let k = self.cfg.top_k;
        if k > 0 && k < self.cands.len() {
            self.cands.select_nth_unstable_by(k - 1, by_logit_desc);
            self.cands.truncate(k);
        }
    }

    /// llama.cpp `llama_sampler_top_p_apply`: softmax over the current candidates, keep the
    /// sorted prefix up to and including the token where the cumulative mass reaches `top_p`.
    /// The prefix is sorted lazily (grown x4 at a time) instead of sorting the vocabulary.
    fn top_p(&mut self) {
        let p = self.cfg.top_p;
        if p >= 1.0 {
            return;
        }
        let max = self.cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
        let total: f64 = self.cands.iter().map(|c| f64::from((c.logit - max).exp())).sum();
        let target = f64::from(p) * total;
        let n = self.cands.len();
        let (mut sorted, mut cum) = (0usize, 0.0f64);
        let mut want = 64.min(n);
        loop {
            // Sort candidates [sorted..want) into place: select then sort the new block.
            let rest = &mut self.cands[sorted..];
            let block = want - sorted;
            if block < rest.len() {
                rest.select_nth_unstable_by(block - 1, by_logit_desc);
            }
            rest[..block].sort_unstable_by(by_logit_desc);
            for i in sorted..want {
                cum += f64::from((self.cands[i].logit - max).exp());
                if cum >= target {
                    self.cands.truncate(i + 1);
                    return;
                }
            }
            if want == n {
                return; // rounding: the mass never quite reached target; keep everything
            }
            sorted = want;
            want = (want * 4).min(n);
        }
    }

    /// llama.cpp `llama_sampler_min_p_apply`: keep logits >= max + ln(min_p).
    fn min_p(&mut self) {
        let p = self.cfg.min_p;
        if p <= 0.0 {
            return;
        }
        let max = self.cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
        let threshold = max + p.ln();
        self.cands.retain(|c| c.logit >= threshold);
    }

    /// Temperature, softmax, one draw (inverse CDF in candidate order).
    fn draw(&mut self) -> u32 {
        let inv_t = 1.0 / self.cfg.temperature;
        let max = self.cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
        let mut total = 0.0f64;
        for c in self.cands.iter_mut() {
            // Reuse the logit slot for the unnormalised probability.
            c.logit = ((c.logit - max) * inv_t).exp();
            total += f64::from(c.logit);
        }
        let mut r = self.rng.next_f64() * total;
        for c in &self.cands {
            r -= f64::from(c.logit);
            if r < 0.0 {
                return c.id;
            }
        }
        // Rounding left r >= 0 after the last one: take the last token with mass.
        self.cands.iter().rev().find(|c| c.logit > 0.0).map_or(self.cands[0].id, |c| c.id)
    }
}

/// Argmax over candidates indexed by id; ties go to the lowest id.
fn argmax(cands: &[Cand]) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for c in cands {
        if c.logit > best.1 {
            best = (c.id, c.logit);
        }
    }
    best.0
}

/// A seed from std's per-process random hasher keys (OS entropy) and a counter, so two
/// samplers made in the same process differ.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

/// xoshiro256** (Blackman & Vigna 2018), state filled by splitmix64 from the seed.
#[derive(Debug, Clone)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 { s: [splitmix(), splitmix(), splitmix(), splitmix()] }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// `row` with the logits of `ids` at −∞ (never sampled): a copy, or `row` itself when `ids` is
/// empty.
pub fn masked<'a>(row: &'a [f32], ids: &[u32]) -> std::borrow::Cow<'a, [f32]> {
    if ids.is_empty() {
        return std::borrow::Cow::Borrowed(row);
    }
    let mut m = row.to_vec();
    for &e in ids {
        if let Some(x) = m.get_mut(e as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
    std::borrow::Cow::Owned(m)
}

/// Log-softmax of `row` at `id`, plus the `k` largest entries (most likely first, ties to the
/// lower id).
pub fn logprobs_of(row: &[f32], id: u32, k: usize) -> crate::engine::TokenLogprobs {
    let max = row.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let log_total = (row.iter().filter(|x| !x.is_nan()).map(|&x| f64::from(x - max).exp()).sum::<f64>()).ln() as f32;
    let lp = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x - max - log_total };
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let by_desc = |a: &u32, b: &u32| lp(row[*b as usize]).total_cmp(&lp(row[*a as usize])).then(a.cmp(b));
    let k = k.min(idx.len());
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_desc);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by_desc);
    crate::engine::TokenLogprobs {
        logprob: row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: idx.into_iter().map(|t| (t, lp(row[t as usize]))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xoshiro_reference_vector() {
        // Reference: xoshiro256** with state {1, 2, 3, 4} (Vigna's C code) yields
        // 11520, 0, 1509978240, 1215971899390074240.
        let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
        let got: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240]);
    }
}

#[cfg(test)]
mod penalty_tests {
    use super::*;

    /// The candidate logits after the penalty stage, by id.
    fn penalised(cfg: SamplerConfig, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let mut s = Sampler::new(cfg).unwrap();
        s.cands.clear();
        s.cands.extend(logits.iter().enumerate().map(|(i, &logit)| Cand { id: i as u32, logit }));
        s.apply_penalties(history);
        s.cands.iter().map(|c| c.logit).collect()
    }

    fn cfg(repeat: f32, presence: f32, frequency: f32, last_n: usize) -> SamplerConfig {
        SamplerConfig {
            repeat_penalty: repeat,
            presence_penalty: presence,
            frequency_penalty: frequency,
            penalty_last_n: last_n,
            seed: Some(1),
            ..Default::default()
        }
    }

    #[test]
    fn repeat_penalty_divides_positive_multiplies_negative() {
        let got = penalised(cfg(2.0, 0.0, 0.0, 64), &[4.0, -1.0, 3.0, 0.0], &[0, 1, 1, 3, 99]);
        // id 99 is outside the row and ignored; id 2 is not in the history.
        assert_eq!(got, [2.0, -2.0, 3.0, 0.0]);
    }

    #[test]
    fn presence_and_frequency_are_openai_style() {
        // token 0 seen 3x, token 2 once: logit -= count * 0.5 + 1.0 (presence once).
        let got = penalised(cfg(1.0, 1.0, 0.5, 64), &[4.0, 1.0, 3.0], &[0, 2, 0, 0]);
        assert_eq!(got, [4.0 - 1.5 - 1.0, 1.0, 3.0 - 0.5 - 1.0]);
    }

    #[test]
    fn only_the_last_n_tokens_count() {
        let got = penalised(cfg(1.0, 0.0, 1.0, 2), &[0.0, 0.0, 0.0], &[0, 0, 0, 1, 2]);
        assert_eq!(got, [0.0, -1.0, -1.0]);
        let off = penalised(cfg(2.0, 1.0, 1.0, 0), &[1.0, 1.0], &[0, 1]);
        assert_eq!(off, [1.0, 1.0]);
    }
}
