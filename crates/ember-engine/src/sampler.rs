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

/// Sorts `cands` lazily (64, then x4 at a time: select, then sort the new block) while summing
/// `exp(logit − max)` in that order; truncates after the token where the sum reaches `target`
/// and returns true, or returns false with all of them sorted.
fn lazy_nucleus(cands: &mut Vec<Cand>, max: f32, target: f64) -> bool {
    let n = cands.len();
    let (mut sorted, mut cum) = (0usize, 0.0f64);
    let mut want = 64.min(n);
    while sorted < n {
        let rest = &mut cands[sorted..];
        let block = want - sorted;
        if block < rest.len() {
            rest.select_nth_unstable_by(block - 1, by_logit_desc);
        }
        rest[..block].sort_unstable_by(by_logit_desc);
        for i in sorted..want {
            cum += f64::from((cands[i].logit - max).exp());
            if cum >= target {
                cands.truncate(i + 1);
                return true;
            }
        }
        sorted = want;
        want = (want * 4).min(n);
    }
    false
}

/// A candidate ordered worst first (lower logit, then higher id): the root of a max-heap of
/// these is the worst of the best `k` kept so far.
#[derive(Debug, Clone, Copy)]
struct Worst(Cand);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Worst {}

impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        by_logit_desc(&self.0, &other.0)
    }
}

/// Top-k over a row in id order: a max-heap of the k best by [`by_logit_desc`] whose root is
/// the worst kept, `n` tokens above `-inf` seen, the first of them.
struct TopK {
    heap: std::collections::BinaryHeap<Worst>,
    k: usize,
    n: usize,
    first: u32,
    /// The worst kept logit once k are kept: nothing below it enters.
    floor: f32,
}

impl TopK {
    fn offer(&mut self, id: u32, logit: f32) {
        if logit.is_nan() || logit == f32::NEG_INFINITY {
            return; // -inf or NaN: never drawn
        }
        if self.n == 0 {
            self.first = id;
        }
        self.n += 1;
        if self.heap.len() < self.k {
            self.heap.push(Worst(Cand { id, logit }));
        } else if logit >= self.floor {
            let c = Cand { id, logit };
            if let Some(mut root) = self.heap.peek_mut()
                && by_logit_desc(&c, &root.0) == Ordering::Less
            {
                *root = Worst(c);
            }
        } else {
            return;
        }
        if self.heap.len() == self.k {
            self.floor = self.heap.peek().map_or(f32::NEG_INFINITY, |w| w.0.logit);
        }
    }

    /// `row[from..to]` (no penalised ids among them), 16 at a time: a block whose max is below
    /// the floor only counts its tokens (the compiler vectorises the max and the count).
    fn scan(&mut self, row: &[f32], from: usize, to: usize) {
        let mut at = from;
        for block in row[from..to].chunks(16) {
            if self.heap.len() == self.k {
                let m = block.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                if m < self.floor {
                    self.n += block.iter().filter(|&&l| l > f32::NEG_INFINITY).count();
                    at += block.len();
                    continue;
                }
            }
            for (i, &l) in block.iter().enumerate() {
                self.offer((at + i) as u32, l);
            }
            at += block.len();
        }
    }
}

/// Calls `f(id, logit)` for every id of `row` in order, NaN as `-inf`, with the penalised
/// logits `pen` (sorted by id, distinct) in place of theirs: one pass, no per-id lookup.
#[inline]
fn for_each_logit(row: &[f32], pen: &[(u32, f32)], mut f: impl FnMut(u32, f32)) {
    let mut at = 0usize;
    for &(id, v) in pen {
        plain_logits(row, at, id as usize, &mut f);
        f(id, v);
        at = id as usize + 1;
    }
    plain_logits(row, at, row.len(), &mut f);
}

/// `best` = the first of `row[from..to]` above `best.1`, and the highest from there on (NaN
/// never wins; ties to the lower id): what a loop of `if l > best.1 { best = (i, l) }` leaves,
/// 16 at a time, each block's max (which the compiler vectorises) against the best so far.
fn argmax_into(row: &[f32], from: usize, to: usize, best: &mut (u32, f32)) {
    let mut at = from;
    for block in row[from..to].chunks(16) {
        // f32::max skips NaN; an all-NaN block gives -inf.
        let m = block.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        if m > best.1 {
            // The block's first element equal to its max: the strict loop's last improvement.
            let i = block.iter().position(|&l| l == m).unwrap_or(0);
            *best = ((at + i) as u32, m);
        }
        at += block.len();
    }
}

#[inline(always)]
fn plain_logits<F: FnMut(u32, f32)>(row: &[f32], from: usize, to: usize, f: &mut F) {
    for (i, &l) in row[from..to].iter().enumerate() {
        f((from + i) as u32, if l.is_nan() { f32::NEG_INFINITY } else { l });
    }
}

/// Samples one token per call from a logit row. One per sequence (it owns the RNG state).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    seed: u64,
    rng: Xoshiro256,
    cands: Vec<Cand>,
    window: Vec<u32>,
    /// This call's penalised logits: (id, logit after the penalties), sorted by id.
    pen: Vec<(u32, f32)>,
    heap: std::collections::BinaryHeap<Worst>,
    /// top-p's candidates in the bins near the max.
    band: Vec<Cand>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Result<Self, Error> {
        cfg.validate()?;
        let seed = cfg.seed.unwrap_or_else(random_seed);
        Ok(Sampler {
            cfg,
            seed,
            rng: Xoshiro256::new(seed),
            cands: Vec::new(),
            window: Vec::new(),
            pen: Vec::new(),
            heap: std::collections::BinaryHeap::new(),
            band: Vec::new(),
        })
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
    ///
    /// One pass over the row, with no copy of it, when greedy or `top_k` is on (a 248k-token
    /// vocabulary is 1 MB a token, which a GPU step of ~3 ms would otherwise wait on): the
    /// penalties touch only the window's tokens, greedy keeps the best, top-k a heap of k. The
    /// candidates top-k keeps are sorted by logit (then id), the order the draw walks.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.penalties(logits, history);
        if self.cfg.temperature <= 0.0 {
            let mut best = (0u32, f32::NEG_INFINITY);
            let mut at = 0usize;
            for &(id, v) in &self.pen {
                argmax_into(logits, at, id as usize, &mut best);
                if v > best.1 {
                    best = (id, v);
                }
                at = id as usize + 1;
            }
            argmax_into(logits, at, logits.len(), &mut best);
            return best.0;
        }
        let k = self.cfg.top_k;
        if k > 0 {
            if let Some(only) = self.stream_top_k(logits, k) {
                return only;
            }
        } else {
            self.cands.clear();
            // Tokens at -inf can never be drawn; dropping them keeps the softmax finite.
            let cands = &mut self.cands;
            for_each_logit(logits, &self.pen, |id, logit| {
                if logit > f32::NEG_INFINITY {
                    cands.push(Cand { id, logit });
                }
            });
            if self.cands.len() <= 1 {
                return self.cands.first().map_or_else(|| Self::greedy(logits), |c| c.id);
            }
        }
        self.top_p();
        self.min_p();
        self.draw()
    }

    /// The candidates after top-k (`k` > 0) in `cands`: the k largest logits above `-inf`,
    /// sorted by [`by_logit_desc`], or all of them in id order when there are no more than k.
    /// Returns the token when one or none is left (as `sample` does before filtering).
    fn stream_top_k(&mut self, logits: &[f32], k: usize) -> Option<u32> {
        let mut t = TopK { heap: std::mem::take(&mut self.heap), k, n: 0, first: 0, floor: f32::NEG_INFINITY };
        t.heap.clear();
        let mut at = 0usize;
        for &(id, v) in &self.pen {
            t.scan(logits, at, id as usize);
            t.offer(id, v);
            at = id as usize + 1;
        }
        t.scan(logits, at, logits.len());
        let (n, first) = (t.n, t.first);
        self.heap = t.heap;
        if n <= 1 {
            return Some(if n == 1 { first } else { Self::greedy(logits) });
        }
        self.cands.clear();
        self.cands.extend(self.heap.drain().map(|w| w.0));
        if n > k {
            self.cands.sort_unstable_by(by_logit_desc);
        } else {
            self.cands.sort_unstable_by_key(|c| c.id);
        }
        None
    }

    /// How many of a row's best entries (by logit, NaN as `-inf`, ties to the lower id:
    /// `ember_ops::top::top_of_row`) [`Sampler::sample_sparse`] needs, beside the ids of
    /// [`Sampler::touched_ids`], to draw what [`Sampler::sample`] draws from the whole row: one
    /// when greedy, `top_k + 1` when top-k is on (one more than k, so that a row with more
    /// than k tokens above `-inf` shows more than k: top-k orders its survivors by logit then,
    /// and by id when the row has no more than k); None when the whole row is needed (top-k off
    /// at a temperature above 0: top-p and min-p then see every token).
    pub fn top_needed(&self) -> Option<usize> {
        if self.cfg.temperature <= 0.0 {
            Some(1)
        } else if self.cfg.top_k > 0 {
            Some(self.cfg.top_k.saturating_add(1))
        } else {
            None
        }
    }

    /// Whether the next draw depends on the history (the penalties are on): a step whose row's
    /// entries are asked for before the last token is known cannot serve it.
    pub fn reads_history(&self) -> bool {
        let c = &self.cfg;
        let off = c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0;
        c.penalty_last_n != 0 && !off
    }

    /// The tokens whose logits the penalties change for the next draw after `history` (the
    /// penalty window's distinct tokens, ascending; none when the penalties are off).
    pub fn touched_ids(&self, history: &[u32]) -> Vec<u32> {
        let c = &self.cfg;
        if !self.reads_history() {
            return Vec::new();
        }
        let mut w = history[history.len().saturating_sub(c.penalty_last_n)..].to_vec();
        w.sort_unstable();
        w.dedup();
        w
    }

    /// [`Sampler::sample`] over some entries of a row, `ids` ascending and distinct with their
    /// logits `vals`: the same token and the same state after, when they hold the changed ids
    /// (the [`Sampler::touched_ids`] and any the caller masked) and the row's `need + changed`
    /// best entries, `need` = [`Sampler::top_needed`] (what `ember_ops::top::top_of_row(row,
    /// need + extra.len(), extra)` selects). Why that suffices: the penalties and the mask change
    /// only those ids, which are all here; every other token keeps its logit, and the `need`
    /// best of the others are among the row's `need + changed` best; greedy and top-k keep at
    /// most `k` tokens, and top-p, min-p and the draw see only those. Ids past the row are
    /// skipped as `sample` skips them.
    pub fn sample_sparse(&mut self, ids: &[u32], vals: &[f32], history: &[u32]) -> u32 {
        let window = &history[history.len().saturating_sub(self.cfg.penalty_last_n)..];
        let local: Vec<u32> = window.iter().filter_map(|t| ids.binary_search(t).ok().map(|j| j as u32)).collect();
        let j = self.sample(&vals[..ids.len().min(vals.len())], &local);
        ids.get(j as usize).copied().unwrap_or(0)
    }

    /// Argmax with NaN as `-inf`; ties go to the lowest id. An empty row yields 0.
    pub fn greedy(logits: &[f32]) -> u32 {
        let mut best = (0u32, f32::NEG_INFINITY);
        argmax_into(logits, 0, logits.len(), &mut best);
        best.0
    }

    /// llama.cpp `llama_sampler_penalties_apply`, into `pen`: for each distinct token among
    /// the last `penalty_last_n` of history (inside the row), with count n: logit = logit <= 0 ?
    /// logit * r : logit / r, then logit -= n * frequency + presence (NaN counts as `-inf`).
    fn penalties(&mut self, row: &[f32], history: &[u32]) {
        self.pen.clear();
        let c = &self.cfg;
        let off = c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0;
        if c.penalty_last_n == 0 || off || history.is_empty() {
            return;
        }
        self.window.clear();
        self.window.extend_from_slice(&history[history.len().saturating_sub(c.penalty_last_n)..]);
        self.window.sort_unstable();
        for run in self.window.chunk_by(|a, b| a == b) {
            let Some(&l) = row.get(run[0] as usize) else {
                continue;
            };
            let mut logit = if l.is_nan() { f32::NEG_INFINITY } else { l };
            if logit <= 0.0 {
                logit *= c.repeat_penalty;
            } else {
                logit /= c.repeat_penalty;
            }
            logit -= run.len() as f32 * c.frequency_penalty + c.presence_penalty;
            self.pen.push((run[0], logit));
        }
    }

    /// llama.cpp `llama_sampler_top_p_apply`: softmax over the current candidates, keep the
    /// sorted prefix up to and including the token where the cumulative mass reaches `top_p`
    /// (all of them, sorted, when rounding keeps it from getting there). The prefix is sorted
    /// lazily ([`lazy_nucleus`]). A long row (no top-k: the whole vocabulary) first sums its
    /// mass into bins of logit below the max, and sorts only the bins that reach the target
    /// and one more: they hold the row's sorted prefix (a bin's tokens are above every later
    /// bin's), so the result is the same, without selecting over 248k candidates.
    fn top_p(&mut self) {
        const BINS: usize = 1024;
        const SPAN: f32 = 32.0;
        let p = self.cfg.top_p;
        if p >= 1.0 {
            return;
        }
        let max = self.cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
        if self.cands.len() <= 4096 || !max.is_finite() {
            let total: f64 = self.cands.iter().map(|c| f64::from((c.logit - max).exp())).sum();
            lazy_nucleus(&mut self.cands, max, f64::from(p) * total);
            return;
        }
        // Bin b holds logits with (max − logit)·BINS/SPAN in [b, b + 1); the last, all below.
        let bin = |l: f32| {
            let x = (max - l) * (BINS as f32 / SPAN);
            if x < BINS as f32 { x as usize } else { BINS }
        };
        let mut mass = [0f64; BINS + 1];
        // The total in the candidates' order, as the short path sums it (the same target).
        let mut total = 0.0f64;
        for c in &self.cands {
            let w = f64::from((c.logit - max).exp());
            total += w;
            mass[bin(c.logit)] += w;
        }
        let target = f64::from(p) * total;
        let mut acc = 0.0f64;
        let last = mass.iter().position(|&w| {
            acc += w;
            acc >= target
        });
        if let Some(j) = last.map(|j| j + 1).filter(|&j| j < BINS) {
            let mut band = std::mem::take(&mut self.band);
            band.clear();
            band.extend(self.cands.iter().filter(|c| bin(c.logit) <= j));
            let reached = lazy_nucleus(&mut band, max, target);
            if reached {
                std::mem::swap(&mut self.cands, &mut band);
            }
            self.band = band;
            if reached {
                return;
            }
        }
        lazy_nucleus(&mut self.cands, max, target);
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
    // f32::max skips NaN; 16 at a time, which the compiler vectorises.
    let max = row.chunks(16).map(|b| b.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x))).fold(f32::NEG_INFINITY, f32::max);
    let log_total = (row.iter().filter(|x| !x.is_nan()).map(|&x| f64::from(x - max).exp()).sum::<f64>()).ln() as f32;
    let lp = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x - max - log_total };
    let logprob = row.get(id as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    // The k best in one pass (a heap of k, most tokens one compare), when k tokens are above
    // -inf; else the select below, which ranks -inf ones too.
    if k > 0 && k < row.len() {
        let mut t = TopK { heap: std::collections::BinaryHeap::with_capacity(k), k, n: 0, first: 0, floor: f32::NEG_INFINITY };
        for (i, &x) in row.iter().enumerate() {
            t.offer(i as u32, lp(x));
        }
        if t.n >= k {
            let mut top: Vec<Cand> = t.heap.into_vec().into_iter().map(|w| w.0).collect();
            top.sort_unstable_by(by_logit_desc);
            return crate::engine::TokenLogprobs { logprob, top: top.into_iter().map(|c| (c.id, c.logit)).collect() };
        }
    }
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let by_desc = |a: &u32, b: &u32| lp(row[*b as usize]).total_cmp(&lp(row[*a as usize])).then(a.cmp(b));
    let k = k.min(idx.len());
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_desc);
    }
    idx.truncate(k);
    idx.sort_unstable_by(by_desc);
    crate::engine::TokenLogprobs { logprob, top: idx.into_iter().map(|t| (t, lp(row[t as usize]))).collect() }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod penalty_tests;
