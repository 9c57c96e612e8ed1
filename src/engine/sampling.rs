//! Token sampling from one row of logits: greedy, temperature, top-k, top-p, with a
//! seeded generator so that a request with a seed is reproducible.
//!
//! Owns: choosing the next token and reporting its log-probability twice: under the model
//! (what the OpenAI API shows) and under the distribution it was actually drawn from (the
//! behaviour log-probability a trainer corrects with). Works on plain `f32` slices; never
//! touches a model.

use crate::base::Rng;

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    /// 1.0 disables nucleus sampling.
    pub top_p: f64,
    /// 0 disables top-k.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (0 disables).
    pub min_p: f64,
    /// OpenAI's: subtracted once from every token already generated.
    pub presence_penalty: f64,
    /// OpenAI's: subtracted per occurrence among the generated tokens.
    pub frequency_penalty: f64,
    /// HF's: positive logits divided, negative multiplied, for every token of the prompt
    /// and the generation (1.0 disables).
    pub repetition_penalty: f64,
    /// Added to the logits of these tokens.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Checks ranges; the message names the field.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |field: &'static str, problem: String| Err(SamplingError { field, problem });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "temperature",
                format!("must be >= 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(name, format!("must be between -2 and 2, got {v}"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                format!("must be positive, got {}", self.repetition_penalty),
            );
        }
        Ok(())
    }
}

/// A sampling parameter out of its range: `field` names it as the OpenAI API does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct SamplingError {
    pub field: &'static str,
    pub problem: String,
}

/// The log-softmax of `logits` at `id`, computed in f64.
pub fn logprob_of(logits: &[f32], id: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits[id] as f64 - max - sum.ln()
}

/// The `k` most likely tokens with their log-probabilities (descending; ties by id).
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    if k == 0 || logits.is_empty() {
        return Vec::new();
    }
    top_logprobs_given(logits, k, log_sum_exp(logits))
}

/// `log Σ exp(logits)`, in float64.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// [`top_logprobs`] with the log-sum-exp of `logits` given.
pub fn top_logprobs_given(logits: &[f32], k: usize, log_z: f64) -> Vec<(u32, f64)> {
    if k == 0 || logits.is_empty() {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx.into_iter()
        .map(|i| (i, logits[i as usize] as f64 - log_z))
        .collect()
}

/// Index of the largest logit (the first one on ties, as torch's argmax).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

impl SamplingParams {
    /// Penalties or a logit bias change the logits before temperature and truncation.
    pub fn changes_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// The logits after penalties and biases (what sampling chooses from).
fn processed(
    logits: &[f32],
    params: &SamplingParams,
    prompt: &[u32],
    generated: &[u32],
) -> Vec<f32> {
    let mut out = logits.to_vec();
    let n = out.len();
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; n];
        for &t in prompt.iter().chain(generated) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        let p = params.repetition_penalty as f32;
        for (l, s) in out.iter_mut().zip(&seen) {
            if *s {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = out.get_mut(t as usize) {
                *l -= (params.presence_penalty + params.frequency_penalty * c as f64) as f32;
            }
        }
    }
    for &(t, b) in &params.logit_bias {
        if let Some(l) = out.get_mut(t as usize) {
            *l += b;
        }
    }
    out
}

/// A chosen token and its two log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picked {
    pub id: u32,
    /// Under the model's own distribution (before penalties, biases, a constraint,
    /// temperature and truncation): what the OpenAI API reports.
    pub logprob: f64,
    /// Under the distribution the token was drawn from: the logits after penalties,
    /// biases and a constraint, divided by the temperature, truncated by min_p, top_k and
    /// top_p (in that order, as vLLM), renormalised. A greedy pick has no distribution to
    /// speak of: its behaviour log-probability is the model's.
    pub behaviour: f64,
}

/// Picks a token from `logits` (one row), given the prompt and the tokens generated so far
/// (for penalties).
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut Rng,
    prompt: &[u32],
    generated: &[u32],
) -> Picked {
    sample_within(logits, None, None, params, rng, prompt, generated)
}

/// [`sample`], choosing only among tokens with `allowed[i]` (constrained decoding; at
/// least one must be allowed). The logprob reported is still the model's, over the whole
/// vocabulary (`log_z`, the log-sum-exp of `logits`, if the caller has it already).
pub fn sample_within(
    logits: &[f32],
    log_z: Option<f64>,
    allowed: Option<&[bool]>,
    params: &SamplingParams,
    rng: &mut Rng,
    prompt: &[u32],
    generated: &[u32],
) -> Picked {
    let owned;
    let choose_from: &[f32] = if params.changes_logits() || allowed.is_some() {
        let mut v = if params.changes_logits() {
            processed(logits, params, prompt, generated)
        } else {
            logits.to_vec()
        };
        if let Some(allowed) = allowed {
            for (x, &ok) in v.iter_mut().zip(allowed) {
                if !ok {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        owned = v;
        &owned
    } else {
        logits
    };
    let (id, drawn) = if params.temperature == 0.0 {
        (argmax(choose_from), None)
    } else {
        let (id, p) = sample_tempered(choose_from, params, rng);
        (id, Some(p.ln()))
    };
    let logprob = match log_z {
        Some(z) => logits[id] as f64 - z,
        None => logprob_of(logits, id),
    };
    Picked {
        id: id as u32,
        logprob,
        behaviour: drawn.unwrap_or(logprob),
    }
}

/// Draws from the tempered, truncated distribution; returns the index and its probability
/// there.
fn sample_tempered(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> (usize, f64) {
    let inv_t = 1.0 / params.temperature;
    let mut cand: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i, l as f64 * inv_t))
        .collect();
    if cand.is_empty() {
        return (argmax(logits), 1.0);
    }
    if params.min_p > 0.0 {
        // p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
        let max = cand.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
        let floor = max + params.min_p.ln();
        cand.retain(|c| c.1 >= floor);
    }
    let restrict = params.top_k > 0 && params.top_k < cand.len() || params.top_p < 1.0;
    if restrict {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if params.top_k > 0 && params.top_k < cand.len() {
            cand.truncate(params.top_k);
        }
    }
    let max = cand.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        // Keep the smallest prefix (by descending probability) whose mass reaches top_p.
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        cand.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut u = rng.next_f64();
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return (cand[i].0, *p);
        }
        u -= p;
    }
    let last = cand.len() - 1;
    (cand[last].0, probs[last])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_max_and_reports_logprob() {
        let logits = [0.0f32, 2.0, 1.0];
        let p = sample(
            &logits,
            &SamplingParams::greedy(),
            &mut Rng::seeded(1),
            &[],
            &[],
        );
        assert_eq!(p.id, 1);
        let z = (0f64.exp() + 2f64.exp() + 1f64.exp()).ln();
        assert!((p.logprob - (2.0 - z)).abs() < 1e-12);
        assert_eq!(p.behaviour, p.logprob);
    }

    #[test]
    fn seeded_sampling_repeats_and_respects_top_k() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32) * 0.1).collect();
        let p = SamplingParams {
            top_k: 3,
            ..Default::default()
        };
        let run = |seed| {
            let mut rng = Rng::seeded(seed);
            (0..100)
                .map(|_| sample(&logits, &p, &mut rng, &[], &[]).id)
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert!(
            a.iter().all(|&t| t >= 47),
            "top_k=3 keeps the three largest"
        );
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }

    #[test]
    fn penalties_bias_and_min_p_change_the_choice_not_the_logprob() {
        let logits = [2.0f32, 1.9, 0.0, -1.0];
        let mut rng = Rng::seeded(1);
        let greedy = SamplingParams::greedy();
        assert_eq!(sample(&logits, &greedy, &mut rng, &[], &[]).id, 0);
        // token 0 generated twice: frequency penalty 0.1 * 2 moves it below token 1
        let p = SamplingParams {
            frequency_penalty: 0.1,
            ..SamplingParams::greedy()
        };
        let picked = sample(&logits, &p, &mut rng, &[], &[0, 0]);
        assert_eq!(picked.id, 1);
        assert!(
            (picked.logprob - logprob_of(&logits, 1)).abs() < 1e-12,
            "logprob is the model's"
        );
        let p = SamplingParams {
            presence_penalty: 0.2,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&logits, &p, &mut rng, &[], &[0]).id, 1);
        let p = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&logits, &p, &mut rng, &[0], &[]).id, 1);
        let p = SamplingParams {
            logit_bias: vec![(3, 10.0)],
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&logits, &p, &mut rng, &[], &[]).id, 3);
        // min_p 0.5 keeps only tokens with p >= 0.5 p_max: tokens 0 and 1
        let p = SamplingParams {
            min_p: 0.5,
            ..Default::default()
        };
        for _ in 0..200 {
            assert!(sample(&logits, &p, &mut rng, &[], &[]).id <= 1);
        }
        assert!(SamplingParams {
            presence_penalty: 3.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn top_logprobs_are_sorted_and_normalised() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let top = top_logprobs(&logits, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!((top[0].1 - logprob_of(&logits, 1)).abs() < 1e-12);
        assert_eq!(top_logprobs(&logits, 10).len(), 4);
        assert!(top_logprobs(&logits, 0).is_empty());
    }

    #[test]
    fn top_p_keeps_nucleus_only() {
        // probabilities ~ [0.7, 0.2, 0.1]: top_p 0.75 keeps the first two.
        let logits = [0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let p = SamplingParams {
            top_p: 0.75,
            ..Default::default()
        };
        let mut rng = Rng::seeded(3);
        let picks: Vec<u32> = (0..500)
            .map(|_| sample(&logits, &p, &mut rng, &[], &[]).id)
            .collect();
        assert!(picks.iter().all(|&t| t != 2));
        assert!(picks.contains(&1));
    }
}
