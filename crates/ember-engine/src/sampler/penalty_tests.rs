use super::*;

/// The candidate logits after the penalty stage, by id.
fn penalised(cfg: SamplerConfig, logits: &[f32], history: &[u32]) -> Vec<f32> {
    let mut s = Sampler::new(cfg).unwrap();
    s.penalties(logits, history);
    let mut out = Vec::new();
    for_each_logit(logits, &s.pen, |_, l| out.push(l));
    out
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
