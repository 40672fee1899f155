use super::*;
use proptest::prelude::*;

/// The sampler as one vector of candidates for the whole row (what `sample` did before its
/// one-pass paths), with top-k's survivors sorted by logit: the reference the fast paths
/// must match token for token, RNG state included.
fn sample_reference(s: &mut Sampler, logits: &[f32], history: &[u32]) -> u32 {
    s.cands.clear();
    s.cands.extend(logits.iter().enumerate().map(|(i, &l)| Cand { id: i as u32, logit: if l.is_nan() { f32::NEG_INFINITY } else { l } }));
    let c = s.cfg.clone();
    let off = c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0;
    if c.penalty_last_n > 0 && !off && !history.is_empty() {
        let mut w = history[history.len().saturating_sub(c.penalty_last_n)..].to_vec();
        w.sort_unstable();
        for run in w.chunk_by(|a, b| a == b) {
            let Some(cand) = s.cands.get_mut(run[0] as usize) else { continue };
            if cand.logit <= 0.0 {
                cand.logit *= c.repeat_penalty;
            } else {
                cand.logit /= c.repeat_penalty;
            }
            cand.logit -= run.len() as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }
    if c.temperature <= 0.0 {
        let mut best = (0u32, f32::NEG_INFINITY);
        for x in &s.cands {
            if x.logit > best.1 {
                best = (x.id, x.logit);
            }
        }
        return best.0;
    }
    s.cands.retain(|x| x.logit > f32::NEG_INFINITY);
    if s.cands.len() <= 1 {
        return s.cands.first().map_or_else(|| Sampler::greedy(logits), |x| x.id);
    }
    if c.top_k > 0 && c.top_k < s.cands.len() {
        s.cands.sort_unstable_by(by_logit_desc);
        s.cands.truncate(c.top_k);
    }
    // top-p as it was: the whole list sorted lazily.
    if c.top_p < 1.0 {
        let max = s.cands.iter().fold(f32::NEG_INFINITY, |m, x| m.max(x.logit));
        let total: f64 = s.cands.iter().map(|x| f64::from((x.logit - max).exp())).sum();
        lazy_nucleus(&mut s.cands, max, f64::from(c.top_p) * total);
    }
    s.min_p();
    s.draw()
}

/// A nucleus deep in a large row: one token 10 above 100,000 others, whose mass (4.5 of
/// 5.5) the 0.9 nucleus needs, with and without a top-k that keeps half the row.
#[test]
fn a_wide_nucleus_in_a_large_row() {
    let mut logits = vec![0.0f32; 100_000];
    logits[777] = 10.0;
    logits[5] = f32::NAN;
    for k in [0, 50_000] {
        let cfg = SamplerConfig { temperature: 1.0, top_k: k, top_p: 0.9, min_p: 0.0, seed: Some(3), ..Default::default() };
        let (mut a, mut b) = (Sampler::new(cfg.clone()).unwrap(), Sampler::new(cfg).unwrap());
        let mut tail = 0;
        for _ in 0..20 {
            let (x, y) = (a.sample(&logits, &[]), sample_reference(&mut b, &logits, &[]));
            assert_eq!(x, y, "top_k {k}");
            tail += usize::from(x != 777);
        }
        assert!(tail > 5, "top_k {k}: the nucleus holds the tail ({tail} of 20 drawn there)");
    }
}

/// `logprobs_of` as it was: a select over every id, ranked by log-probability.
fn logprobs_reference(row: &[f32], id: u32, k: usize) -> crate::engine::TokenLogprobs {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn logprobs_match_the_reference(logits in row(), id in 0u32..450, k in 0usize..30) {
        let (a, b) = (logprobs_of(&logits, id, k), logprobs_reference(&logits, id, k));
        prop_assert_eq!(a.logprob.to_bits(), b.logprob.to_bits());
        let bits = |t: &[(u32, f32)]| t.iter().map(|&(i, l)| (i, l.to_bits())).collect::<Vec<_>>();
        prop_assert_eq!(bits(&a.top), bits(&b.top));
    }
}

fn row() -> impl Strategy<Value = Vec<f32>> {
    // Ties, NaN and -inf included; rows of 1 to 400 tokens.
    prop::collection::vec(prop_oneof![-20.0f32..20.0, Just(5.0f32), Just(-3.0f32), Just(f32::NAN), Just(f32::NEG_INFINITY)], 1..400)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// Rows long enough for top-p's bins (more than 4096 candidates), spread over a range
    /// wider than the bins' 32 and with runs of equal logits.
    #[test]
    fn long_rows_match_the_reference(
        spread in 1.0f32..80.0,
        len in 4097usize..20_000,
        seed in any::<u64>(),
        top_p in 0.05f32..0.999,
        min_p in prop_oneof![Just(0.0f32), 0.0f32..0.2],
        t in 0.2f32..2.0,
    ) {
        let mut x = seed | 1;
        let logits: Vec<f32> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f32 / (1u64 << 53) as f32;
                // A quarter of the row on a few shared values (ties).
                if x % 4 == 0 { (x % 7) as f32 } else { u * spread - spread / 2.0 }
            })
            .collect();
        let cfg = SamplerConfig { temperature: t, top_k: 0, top_p, min_p, seed: Some(seed), ..Default::default() };
        let (mut a, mut b) = (Sampler::new(cfg.clone()).unwrap(), Sampler::new(cfg).unwrap());
        for _ in 0..3 {
            prop_assert_eq!(a.sample(&logits, &[]), sample_reference(&mut b, &logits, &[]));
        }
    }
}

/// A sampler config of the property tests: the chain's knobs, penalties (repeat, presence,
/// frequency) over the last 64 tokens, a seed.
fn chain(t: f32, k: usize, top_p: f32, min_p: f32, pen: (f32, f32, f32), seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: t,
        top_k: k,
        top_p,
        min_p,
        repeat_penalty: pen.0,
        presence_penalty: pen.1,
        frequency_penalty: pen.2,
        penalty_last_n: 64,
        seed: Some(seed),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn one_pass_paths_match_the_reference(
        logits in row(),
        history in prop::collection::vec(0u32..450, 0..80),
        seed in any::<u64>(),
        t in prop_oneof![Just(0.0f32), 0.1f32..2.0],
        k in prop_oneof![Just(0usize), 1usize..60, Just(1000usize)],
        top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
        min_p in prop_oneof![Just(0.0f32), 0.0f32..0.5],
        pen in prop_oneof![Just((1.0f32, 0.0f32, 0.0f32)), (0.5f32..2.0, -1.0f32..1.0, -1.0f32..1.0)],
    ) {
        let cfg = chain(t, k, top_p, min_p, pen, seed);
        let (mut a, mut b) = (Sampler::new(cfg.clone()).unwrap(), Sampler::new(cfg).unwrap());
        for _ in 0..4 {
            let (x, y) = (a.sample(&logits, &history), sample_reference(&mut b, &logits, &history));
            prop_assert_eq!(x, y);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A sparse row (the `top_needed` best entries, the penalties' tokens and the masked
    /// ids, as `ember_ops::top::top_of_row` selects them) draws the whole row's tokens,
    /// draw after draw (the RNG in step), with penalties, masks, ties, NaN and -inf.
    #[test]
    fn sparse_rows_draw_the_whole_rows_tokens(
        logits in row(),
        history in prop::collection::vec(0u32..450, 0..80),
        mask in prop::collection::vec(0u32..450, 0..4),
        seed in any::<u64>(),
        t in prop_oneof![Just(0.0f32), 0.1f32..2.0],
        k in prop_oneof![1usize..60, Just(1000usize)],
        top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
        min_p in prop_oneof![Just(0.0f32), 0.0f32..0.5],
        pen in prop_oneof![Just((1.0f32, 0.0f32, 0.0f32)), (0.5f32..2.0, -1.0f32..1.0, -1.0f32..1.0)],
    ) {
        let cfg = chain(t, k, top_p, min_p, pen, seed);
        let (mut a, mut b) = (Sampler::new(cfg.clone()).unwrap(), Sampler::new(cfg).unwrap());
        let full = masked(&logits, &mask);
        let mut history = history;
        for _ in 0..4 {
            let mut extra = a.touched_ids(&history);
            extra.extend_from_slice(&mask);
            let need = a.top_needed().unwrap() + extra.len();
            let top = ember_ops::top::top_of_row(&logits, need, &extra);
            let vals: Vec<f32> = top.ids.iter().zip(&top.vals).map(|(i, &v)| if mask.contains(i) { f32::NEG_INFINITY } else { v }).collect();
            let (x, y) = (a.sample_sparse(&top.ids, &vals, &history), b.sample(&full, &history));
            prop_assert_eq!(x, y);
            history.push(x);
        }
    }
}

#[test]
fn xoshiro_reference_vector() {
    // Reference: xoshiro256** with state {1, 2, 3, 4} (Vigna's C code) yields
    // 11520, 0, 1509978240, 1215971899390074240.
    let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
    let got: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
    assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240]);
}
