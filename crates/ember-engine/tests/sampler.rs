//! Sampler behaviour: determinism, the greedy limits of each filter, the sampled
//! distribution, penalties, and robustness to NaN.

use ember_engine::{Error, Sampler, SamplerConfig};
use proptest::prelude::*;

fn cfg(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerConfig {
    SamplerConfig { temperature, top_k, top_p, min_p, seed: Some(seed), ..Default::default() }
}

/// Reference argmax: first index of the maximum, NaN ignored.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Logit rows with ties and a wide range (ties exercise the lowest-id rule).
fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(prop_oneof![-20.0f32..20.0, Just(5.0f32), Just(-3.0f32)], 1..300)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn same_seed_same_tokens(logits in logits_strategy(), seed in any::<u64>(), t in 0.1f32..2.0) {
        let c = SamplerConfig { temperature: t, seed: Some(seed), top_k: 0, top_p: 0.9, min_p: 0.01, ..Default::default() };
        let mut a = Sampler::new(c.clone()).unwrap();
        let mut b = Sampler::new(c).unwrap();
        let mut history = Vec::new();
        for _ in 0..20 {
            let x = a.sample(&logits, &history);
            prop_assert_eq!(x, b.sample(&logits, &history));
            history.push(x);
        }
    }

    #[test]
    fn greedy_is_first_argmax(logits in logits_strategy()) {
        prop_assert_eq!(Sampler::greedy(&logits), argmax(&logits));
        let mut s = Sampler::new(cfg(0.0, 40, 0.95, 0.05, 7)).unwrap();
        prop_assert_eq!(s.sample(&logits, &[]), argmax(&logits));
    }

    #[test]
    fn top_k_one_is_greedy(logits in logits_strategy(), seed in any::<u64>(), t in 0.1f32..5.0) {
        let mut s = Sampler::new(cfg(t, 1, 1.0, 0.0, seed)).unwrap();
        prop_assert_eq!(s.sample(&logits, &[]), argmax(&logits));
    }

    #[test]
    fn tiny_top_p_is_greedy(logits in logits_strategy(), seed in any::<u64>(), t in 0.1f32..5.0) {
        let mut s = Sampler::new(cfg(t, 0, 1e-6, 0.0, seed)).unwrap();
        prop_assert_eq!(s.sample(&logits, &[]), argmax(&logits));
    }

    #[test]
    fn min_p_one_is_greedy_up_to_ties(logits in logits_strategy(), seed in any::<u64>()) {
        let mut s = Sampler::new(cfg(1.0, 0, 1.0, 1.0, seed)).unwrap();
        let x = s.sample(&logits, &[]) as usize;
        prop_assert_eq!(logits[x], logits[argmax(&logits) as usize]);
    }

    #[test]
    fn sample_stays_in_top_k(logits in logits_strategy(), seed in any::<u64>(), k in 1usize..8) {
        let mut s = Sampler::new(cfg(1.5, k, 1.0, 0.0, seed)).unwrap();
        let x = s.sample(&logits, &[]) as usize;
        let n_greater = logits.iter().filter(|&&l| l > logits[x]).count();
        prop_assert!(n_greater < k, "token {} has {} larger logits, k = {}", x, n_greater, k);
    }

    #[test]
    fn nan_logits_never_panic_nor_win(
        logits in logits_strategy(),
        nan_at in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
        seed in any::<u64>(),
    ) {
        let mut logits = logits;
        for i in &nan_at {
            let j = i.index(logits.len());
            logits[j] = f32::NAN;
        }
        let all_nan = logits.iter().all(|l| l.is_nan());
        for c in [cfg(0.0, 0, 1.0, 0.0, seed), cfg(1.0, 0, 1.0, 0.0, seed), SamplerConfig { seed: Some(seed), ..Default::default() }] {
            let mut s = Sampler::new(c).unwrap();
            let x = s.sample(&logits, &[0, 1, 2]) as usize;
            prop_assert!(x < logits.len());
            prop_assert!(all_nan || !logits[x].is_nan(), "picked NaN logit at {}", x);
        }
        prop_assert!(all_nan || !logits[Sampler::greedy(&logits) as usize].is_nan());
    }
}

fn softmax(logits: &[f32], t: f32) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| (((l - max) / t) as f64).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// Empirical frequencies over 20k draws vs the softmax. Tolerance 0.015 absolute: the
/// standard error of a frequency near 0.5 over 20k draws is 0.0035, so this is ~4 sigma.
fn check_distribution(temperature: f32) {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 3.0, 2.5];
    let want = softmax(&logits, temperature);
    let mut s = Sampler::new(cfg(temperature, 0, 1.0, 0.0, 42)).unwrap();
    let n = 20_000;
    let mut counts = [0usize; 6];
    for _ in 0..n {
        counts[s.sample(&logits, &[]) as usize] += 1;
    }
    for (i, (&c, &p)) in counts.iter().zip(&want).enumerate() {
        let f = c as f64 / n as f64;
        assert!((f - p).abs() < 0.015, "T={temperature} token {i}: frequency {f:.4}, softmax {p:.4}");
    }
}

#[test]
fn distribution_matches_softmax_t1() {
    check_distribution(1.0);
}

#[test]
fn distribution_matches_softmax_t2() {
    check_distribution(2.0);
}

#[test]
fn top_p_keeps_the_nucleus() {
    // probabilities 0.5, 0.25, 0.125, 0.125: top_p 0.7 keeps {0, 1}, renormalised to 2/3, 1/3.
    let logits = [0.0f32, -std::f32::consts::LN_2, -2.0 * std::f32::consts::LN_2, -2.0 * std::f32::consts::LN_2];
    let mut s = Sampler::new(cfg(1.0, 0, 0.7, 0.0, 3)).unwrap();
    let mut counts = [0usize; 4];
    for _ in 0..20_000 {
        counts[s.sample(&logits, &[]) as usize] += 1;
    }
    assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
    let f0 = counts[0] as f64 / 20_000.0;
    assert!((f0 - 2.0 / 3.0).abs() < 0.015, "{counts:?}");
}

#[test]
fn min_p_filters() {
    // relative probabilities 1, 0.5, 0.1, 0.01: min_p 0.2 keeps {0, 1} only.
    let logits = [0.0f32, 0.5f32.ln(), 0.1f32.ln(), 0.01f32.ln()];
    let mut s = Sampler::new(cfg(1.0, 0, 1.0, 0.2, 9)).unwrap();
    let mut counts = [0usize; 4];
    for _ in 0..5_000 {
        counts[s.sample(&logits, &[]) as usize] += 1;
    }
    assert!(counts[0] > 0 && counts[1] > 0 && counts[2] == 0 && counts[3] == 0, "{counts:?}");
}

#[test]
fn large_vocab_top_p_without_top_k() {
    // 248k-row logits with a long flat tail: the lazily sorted top-p prefix must grow past its
    // first block and still keep the right number of tokens.
    let n = 248_320;
    let logits: Vec<f32> = (0..n).map(|i| if i % 1000 == 0 { 5.0 } else { 0.0 }).collect();
    // 249 tokens at e^5 hold 249*148.4/(249*148.4 + 248071) = 13% of the mass: top_p 0.1 stays
    // among them; top_p 0.5 reaches into the flat tail.
    let mut s = Sampler::new(cfg(1.0, 0, 0.1, 0.0, 5)).unwrap();
    for _ in 0..50 {
        assert_eq!(s.sample(&logits, &[]) % 1000, 0);
    }
    let mut s = Sampler::new(cfg(1.0, 0, 0.5, 0.0, 5)).unwrap();
    let tail = (0..200).filter(|_| !s.sample(&logits, &[]).is_multiple_of(1000)).count();
    assert!(tail > 100, "top_p 0.5 should mostly sample the tail, got {tail}/200");
}

#[test]
fn penalties_steer_greedy() {
    let pen = |repeat: f32, presence: f32, frequency: f32| SamplerConfig {
        temperature: 0.0,
        repeat_penalty: repeat,
        presence_penalty: presence,
        frequency_penalty: frequency,
        penalty_last_n: 64,
        seed: Some(0),
        ..Default::default()
    };
    let pick = |c: SamplerConfig, logits: &[f32], history: &[u32]| Sampler::new(c).unwrap().sample(logits, history);
    // 2.0 / 1.1 = 1.82 < 1.9
    assert_eq!(pick(pen(1.1, 0.0, 0.0), &[2.0, 1.9], &[0]), 1);
    assert_eq!(pick(pen(1.1, 0.0, 0.0), &[2.0, 1.9], &[1]), 0);
    // negative logits are multiplied: -1.0 * 1.1 = -1.1 < -1.05
    assert_eq!(pick(pen(1.1, 0.0, 0.0), &[-1.0, -1.05], &[0]), 1);
    // frequency 0.2 per occurrence: 3 -> 0.4 < 0.5, 2 -> 0.6 > 0.5
    assert_eq!(pick(pen(1.0, 0.0, 0.2), &[1.0, 0.5], &[0, 0, 0]), 1);
    assert_eq!(pick(pen(1.0, 0.0, 0.2), &[1.0, 0.5], &[0, 0]), 0);
    // presence once regardless of count
    assert_eq!(pick(pen(1.0, 0.6, 0.0), &[1.0, 0.5], &[0, 0, 0, 0]), 1);
    assert_eq!(pick(pen(1.0, 0.4, 0.0), &[1.0, 0.5], &[0, 0, 0, 0]), 0);
}

#[test]
fn config_errors_name_field_and_limit() {
    let bad = |c: SamplerConfig| Sampler::new(c).unwrap_err().to_string();
    let d = SamplerConfig::default;
    assert_eq!(bad(SamplerConfig { temperature: -0.5, ..d() }), "`temperature` must be a finite number >= 0, got -0.5");
    assert!(bad(SamplerConfig { temperature: f32::NAN, ..d() }).starts_with("`temperature`"));
    assert_eq!(bad(SamplerConfig { top_p: 0.0, ..d() }), "`top_p` must be in (0, 1], got 0");
    assert_eq!(bad(SamplerConfig { top_p: 1.5, ..d() }), "`top_p` must be in (0, 1], got 1.5");
    assert_eq!(bad(SamplerConfig { min_p: -0.1, ..d() }), "`min_p` must be in [0, 1], got -0.1");
    assert_eq!(bad(SamplerConfig { repeat_penalty: 0.0, ..d() }), "`repeat_penalty` must be a finite number > 0, got 0");
    assert!(bad(SamplerConfig { frequency_penalty: f32::INFINITY, ..d() }).starts_with("`frequency_penalty`"));
    assert!(matches!(Sampler::new(SamplerConfig { top_p: 2.0, ..d() }), Err(Error::Config { field: "top_p", .. })));
}

#[test]
fn unseeded_samplers_differ_and_report_their_seed() {
    let a = Sampler::new(SamplerConfig::default()).unwrap();
    let b = Sampler::new(SamplerConfig::default()).unwrap();
    assert_ne!(a.seed(), b.seed());
    // Replaying with the reported seed reproduces the draws.
    let logits = [0.0f32, 0.1, 0.2, 0.3];
    let mut a = a;
    let mut r = Sampler::new(SamplerConfig { seed: Some(a.seed()), ..SamplerConfig::default() }).unwrap();
    for _ in 0..10 {
        assert_eq!(a.sample(&logits, &[]), r.sample(&logits, &[]));
    }
}

#[test]
fn empty_and_single_rows() {
    let mut s = Sampler::new(SamplerConfig { seed: Some(1), ..Default::default() }).unwrap();
    assert_eq!(s.sample(&[], &[]), 0);
    assert_eq!(s.sample(&[1.0], &[0]), 0);
    assert_eq!(s.sample(&[f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY], &[]), 1);
    assert_eq!(Sampler::greedy(&[]), 0);
}
