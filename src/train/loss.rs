//! GRPO-family policy losses over sampled tokens.
//!
//! Inputs are per sampled token t (a target of a packed row): the current policy's
//! log-probability `lp_t` (differentiable), the log-probability `old_t` under the policy
//! the update started from (detached; equal to `lp_t`'s value when each batch takes one
//! optimizer step), the behaviour log-probability `beh_t` the serving engine recorded
//! when it sampled the token, the advantage `A_t` (its episode's), and the index of its
//! sequence (episode).
//!
//! Per token, with `ε_lo`, `ε_hi` the clip range:
//!
//! ```text
//! r_t   = exp(lp_t - old_t)                                   (ratio = token)
//!       = exp(sg(mean_{u in seq} (lp_u - old_u)) + lp_t - sg(lp_t))  (ratio = sequence, GSPO)
//! pg_t  = -min(r_t A_t, clip(r_t, 1 - ε_lo, 1 + ε_hi) A_t)
//!         and with dual clip c, for A_t < 0: pg_t = min(pg_t, -c A_t)
//! w_t   = min(exp(old_t - beh_t), cap)      truncated importance weight (detached)
//! kl_t  = exp(ref_t - lp_t) - (ref_t - lp_t) - 1                  (k3, low variance)
//! l_t   = w_t pg_t + β kl_t - η H_t
//! ```
//!
//! Normalisation: token-level `L = Σ_t l_t / N_tokens`; sequence-level
//! `L = Σ_seq (Σ_{t in seq} l_t / |seq|) / N_seqs`, with N the counts over the whole batch
//! (all micro-batches), so accumulating micro-batch gradients gives the batch's gradient.
//! GSPO is the sequence ratio with sequence-level normalisation (its gradient is then
//! `s_i A_i mean_t ∇lp_t`, as in the paper).

use super::TrainError;
use tch::{Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    Token,
    Sequence,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Normalization {
    Token,
    Sequence,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LossConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual clip constant c > 1 (negative advantages' loss capped at c |A|); none when None.
    pub dual_clip: Option<f64>,
    pub ratio: RatioLevel,
    pub normalization: Normalization,
    /// β: weight of the KL to the reference model (0: no reference needed).
    pub kl_coef: f64,
    /// η: weight of the entropy bonus.
    pub entropy_coef: f64,
    /// Cap of the truncated importance weight exp(old - behaviour); none: no correction.
    pub tis_cap: Option<f64>,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: Some(3.0),
            ratio: RatioLevel::Token,
            normalization: Normalization::Token,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            tis_cap: Some(2.0),
        }
    }
}

impl LossConfig {
    /// GSPO's setting: sequence ratio, sequence normalisation, its small clip range.
    pub fn gspo() -> LossConfig {
        LossConfig {
            clip_low: 3e-4,
            clip_high: 4e-4,
            dual_clip: None,
            ratio: RatioLevel::Sequence,
            normalization: Normalization::Sequence,
            ..LossConfig::default()
        }
    }
}

/// The per-token inputs of one micro-batch (all `[T]`, on one device).
pub struct LossInputs<'a> {
    pub logprobs: &'a Tensor,
    /// `None`: the update's starting policy is the current one (one step per batch), so
    /// old = lp's value.
    pub old_logprobs: Option<&'a Tensor>,
    pub behaviour_logprobs: &'a Tensor,
    pub advantages: &'a Tensor,
    /// Sequence (episode) index of each token, int64, in 0..`seq_count`.
    pub seq: &'a Tensor,
    pub seq_count: i64,
    /// How many tokens each token's sequence has in the whole batch, `[T]`.
    pub seq_len: &'a Tensor,
    pub reference_logprobs: Option<&'a Tensor>,
    pub entropy: Option<&'a Tensor>,
}

/// Totals over the whole batch, for normalisation.
#[derive(Debug, Clone, Copy)]
pub struct BatchCounts {
    pub tokens: f64,
    pub seqs: f64,
}

/// Sums over the micro-batch's tokens, for metrics (divide by the token count).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    pub tokens: f64,
    /// Tokens whose clipped term was the one taken (no gradient from them).
    pub clipped: f64,
    pub kl: f64,
    pub entropy: f64,
    /// Σ of the truncated importance weights, and how many were capped.
    pub is_weight: f64,
    pub is_capped: f64,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.tokens += o.tokens;
        self.clipped += o.clipped;
        self.kl += o.kl;
        self.entropy += o.entropy;
        self.is_weight += o.is_weight;
        self.is_capped += o.is_capped;
    }
}

fn seq_mean(values: &Tensor, x: &LossInputs) -> Tensor {
    let sums =
        Tensor::zeros([x.seq_count], (values.kind(), values.device())).index_add(0, x.seq, values);
    let counts = Tensor::zeros([x.seq_count], (values.kind(), values.device())).index_add(
        0,
        x.seq,
        &values.ones_like(),
    );
    (sums / counts.clamp_min(1.0)).index_select(0, x.seq)
}

/// The micro-batch's share of the batch loss (a scalar, differentiable through
/// `logprobs` and `entropy`), and sums for metrics.
// `x = x * y` on purpose: tch's `*=` is an in-place op, which autograd may refuse on a
// tensor an earlier op saved for its backward.
#[allow(clippy::assign_op_pattern)]
pub fn policy_loss(
    cfg: &LossConfig,
    x: &LossInputs,
    counts: BatchCounts,
) -> Result<(Tensor, LossSums), TrainError> {
    let bad = TrainError::Invalid;
    let t = x.logprobs.size();
    if t.len() != 1 {
        return Err(bad(format!("logprobs must be [T], got {t:?}")));
    }
    for (name, v) in [
        ("behaviour_logprobs", Some(x.behaviour_logprobs)),
        ("advantages", Some(x.advantages)),
        ("seq", Some(x.seq)),
        ("seq_len", Some(x.seq_len)),
        ("old_logprobs", x.old_logprobs),
        ("reference_logprobs", x.reference_logprobs),
        ("entropy", x.entropy),
    ] {
        if let Some(v) = v {
            if v.size() != t {
                return Err(bad(format!("{name} is {:?}, logprobs {t:?}", v.size())));
            }
        }
    }
    if cfg.kl_coef != 0.0 && x.reference_logprobs.is_none() {
        return Err(bad(
            "kl_coef is set but no reference logprobs were given".into()
        ));
    }
    if cfg.entropy_coef != 0.0 && x.entropy.is_none() {
        return Err(bad("entropy_coef is set but no entropies were given".into()));
    }
    let f = |v: &Tensor| v.to_kind(Kind::Float);
    let lp = f(x.logprobs);
    let old = match x.old_logprobs {
        Some(o) => f(o).detach(),
        None => lp.detach(),
    };
    let adv = f(x.advantages).detach();
    let ratio = match cfg.ratio {
        RatioLevel::Token => (&lp - &old).exp(),
        RatioLevel::Sequence => {
            let s = seq_mean(&(&lp - &old).detach(), x);
            (s + &lp - lp.detach()).exp()
        }
    };
    let unclipped = &ratio * &adv;
    let clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * &adv;
    let mut pg = -unclipped.minimum(&clipped);
    let clip_taken = clipped.lt_tensor(&unclipped);
    if let Some(c) = cfg.dual_clip {
        let neg = adv.lt(0.0);
        let cap = -(&adv * c);
        pg = pg.where_self(&neg.logical_not(), &pg.minimum(&cap));
    }
    let mut sums = LossSums {
        tokens: t[0] as f64,
        clipped: clip_taken
            .to_kind(Kind::Float)
            .sum(Kind::Double)
            .double_value(&[]),
        ..Default::default()
    };
    if let Some(cap) = cfg.tis_cap {
        let w_raw = (&old - f(x.behaviour_logprobs)).exp().detach();
        let w = w_raw.clamp_max(cap);
        sums.is_weight = w.sum(Kind::Double).double_value(&[]);
        sums.is_capped = w_raw
            .gt(cap)
            .to_kind(Kind::Float)
            .sum(Kind::Double)
            .double_value(&[]);
        pg = pg * w;
    } else {
        sums.is_weight = t[0] as f64;
    }
    let mut per_token = pg;
    if let Some(r) = x.reference_logprobs {
        let d = f(r).detach() - &lp;
        let kl = d.exp() - &d - 1.0;
        sums.kl = kl.detach().sum(Kind::Double).double_value(&[]);
        if cfg.kl_coef != 0.0 {
            per_token = per_token + kl * cfg.kl_coef;
        }
    }
    if let Some(h) = x.entropy {
        let h = f(h);
        sums.entropy = h.detach().sum(Kind::Double).double_value(&[]);
        if cfg.entropy_coef != 0.0 {
            per_token = per_token - h * cfg.entropy_coef;
        }
    }
    let loss = match cfg.normalization {
        Normalization::Token => per_token.sum(Kind::Float) / counts.tokens.max(1.0),
        Normalization::Sequence => {
            (per_token / f(x.seq_len).clamp_min(1.0)).sum(Kind::Float) / counts.seqs.max(1.0)
        }
    };
    Ok((loss, sums))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64]) -> Tensor {
        Tensor::from_slice(v).to_kind(Kind::Float)
    }

    /// Five tokens in two sequences, by hand. clip 0.2/0.2, dual clip 3, TIS cap 2.
    ///
    /// | t | lp   | old  | beh  | A  | r = e^(lp-old) | term taken             | pg        | ∂pg/∂lp |
    /// |---|------|------|------|----|----------------|------------------------|-----------|---------|
    /// | 0 | -1.0 | -1.1 | -1.1 | +1 | e^0.1 = 1.1052 | unclipped (in range)   | -e^0.1    | -e^0.1  |
    /// | 1 | -0.5 | -0.5 | -0.9 | +1 | 1              | unclipped; w = e^0.4   | -1        | -1      |
    /// | 2 | -2.0 | -1.5 | -1.5 | -1 | e^-0.5 = 0.607 | clipped: -min(-.607,-.8) | 0.8     | 0       |
    /// | 3 | -0.1 | -0.1 | -1.0 | -1 | 1              | unclipped; w = min(e^0.9, 2) = 2 | 1 | 1    |
    /// | 4 |  0.0 | -1.5 | -1.5 | -1 | e^1.5 = 4.48   | unclipped, 4.48 > dual 3 | 3       | 0       |
    ///
    /// Loss per token l_t = w_t pg_t; token-level normalisation divides by 5.
    #[test]
    fn ppo_clip_dual_clip_and_truncated_is_by_hand() {
        let lp = t(&[-1.0, -0.5, -2.0, -0.1, 0.0]).set_requires_grad(true);
        let old = t(&[-1.1, -0.5, -1.5, -0.1, -1.5]);
        let beh = t(&[-1.1, -0.9, -1.5, -1.0, -1.5]);
        let adv = t(&[1.0, 1.0, -1.0, -1.0, -1.0]);
        let seq = Tensor::from_slice(&[0i64, 0, 0, 1, 1]);
        let seq_len = t(&[3.0, 3.0, 3.0, 2.0, 2.0]);
        let cfg = LossConfig {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: Some(3.0),
            tis_cap: Some(2.0),
            ..LossConfig::default()
        };
        let x = LossInputs {
            logprobs: &lp,
            old_logprobs: Some(&old),
            behaviour_logprobs: &beh,
            advantages: &adv,
            seq: &seq,
            seq_count: 2,
            seq_len: &seq_len,
            reference_logprobs: None,
            entropy: None,
        };
        let counts = BatchCounts {
            tokens: 5.0,
            seqs: 2.0,
        };
        let (loss, sums) = policy_loss(&cfg, &x, counts).unwrap();
        let e = f64::exp;
        let w1 = e(0.4);
        let pg = [-e(0.1), -w1, 0.8, 2.0, 3.0];
        let want = pg.iter().sum::<f64>() / 5.0;
        assert!(
            (loss.double_value(&[]) - want).abs() < 1e-6,
            "{loss} vs {want}"
        );
        let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
        let want_g = [-e(0.1) / 5.0, -w1 / 5.0, 0.0, 2.0 / 5.0, 0.0];
        for (i, w) in want_g.iter().enumerate() {
            let got = g[0].double_value(&[i as i64]);
            assert!((got - w).abs() < 1e-6, "grad {i}: {got} vs {w}");
        }
        assert_eq!(sums.clipped, 1.0);
        assert_eq!(sums.is_capped, 1.0);
        assert!((sums.is_weight - (1.0 + w1 + 1.0 + 2.0 + 1.0)).abs() < 1e-5);

        // Sequence-level normalisation: (l0 + l1 + l2) / 3 and (l3 + l4) / 2, over 2 seqs.
        let cfg_seq = LossConfig {
            normalization: Normalization::Sequence,
            ..cfg.clone()
        };
        let (loss, _) = policy_loss(&cfg_seq, &x, counts).unwrap();
        let want = ((pg[0] + pg[1] + pg[2]) / 3.0 + (pg[3] + pg[4]) / 2.0) / 2.0;
        assert!((loss.double_value(&[]) - want).abs() < 1e-6);
    }

    /// GSPO: s_i = exp(mean over the sequence of (lp - old)), clipped per sequence; the
    /// gradient of each token is s_i A_i / |seq| / N_seqs (zero when the clip binds).
    #[test]
    fn gspo_sequence_ratio_by_hand() {
        let lp = t(&[-1.0, -2.0, -0.5, -0.7]).set_requires_grad(true);
        let old = t(&[-1.0002, -2.0002, -0.5, -0.8]);
        let beh = old.copy();
        let adv = t(&[2.0, 2.0, 1.0, 1.0]);
        let seq = Tensor::from_slice(&[0i64, 0, 1, 1]);
        let seq_len = t(&[2.0, 2.0, 2.0, 2.0]);
        let cfg = LossConfig {
            tis_cap: None,
            ..LossConfig::gspo()
        };
        let x = LossInputs {
            logprobs: &lp,
            old_logprobs: Some(&old),
            behaviour_logprobs: &beh,
            advantages: &adv,
            seq: &seq,
            seq_count: 2,
            seq_len: &seq_len,
            reference_logprobs: None,
            entropy: None,
        };
        let (loss, sums) = policy_loss(
            &cfg,
            &x,
            BatchCounts {
                tokens: 4.0,
                seqs: 2.0,
            },
        )
        .unwrap();
        // seq 0: s = e^0.0002 = 1.0002 (inside 1 + 4e-4): loss -s*2 per token.
        // seq 1: s = e^0.05 = 1.051, above 1 + 4e-4 with A > 0: the clipped term
        // (1 + 4e-4) * 1 is the smaller, taken for both tokens, no gradient.
        let s0 = f64::exp(0.0002);
        let want = ((-s0 * 2.0 * 2.0) / 2.0 + (-(1.0 + 4e-4) * 2.0) / 2.0) / 2.0;
        assert!(
            (loss.double_value(&[]) - want).abs() < 1e-5,
            "{loss} vs {want}"
        );
        let g = Tensor::run_backward(&[&loss], &[&lp], false, false);
        let want_g = [-s0 * 2.0 / 2.0 / 2.0, -s0 * 2.0 / 2.0 / 2.0, 0.0, 0.0];
        for (i, w) in want_g.iter().enumerate() {
            let got = g[0].double_value(&[i as i64]);
            assert!((got - w).abs() < 1e-5, "grad {i}: {got} vs {w}");
        }
        assert_eq!(sums.clipped, 2.0);
    }

    #[test]
    fn kl_and_entropy_terms() {
        // k3 at d = ref - lp: e^d - d - 1 ≥ 0, gradient w.r.t. lp: 1 - e^d.
        let lp = t(&[-1.0, -2.0]).set_requires_grad(true);
        let reference = t(&[-1.5, -2.0]);
        let ent = t(&[3.0, 1.0]).set_requires_grad(true);
        let zeros = t(&[0.0, 0.0]);
        let seq = Tensor::from_slice(&[0i64, 0]);
        let len = t(&[2.0, 2.0]);
        let cfg = LossConfig {
            kl_coef: 0.1,
            entropy_coef: 0.01,
            tis_cap: None,
            ..LossConfig::default()
        };
        let x = LossInputs {
            logprobs: &lp,
            old_logprobs: None,
            behaviour_logprobs: &lp,
            advantages: &zeros,
            seq: &seq,
            seq_count: 1,
            seq_len: &len,
            reference_logprobs: Some(&reference),
            entropy: Some(&ent),
        };
        let (loss, sums) = policy_loss(
            &cfg,
            &x,
            BatchCounts {
                tokens: 2.0,
                seqs: 1.0,
            },
        )
        .unwrap();
        let k = f64::exp(-0.5) + 0.5 - 1.0;
        let want = (0.1 * k - 0.01 * 4.0) / 2.0;
        assert!((loss.double_value(&[]) - want).abs() < 1e-6);
        assert!((sums.kl - k).abs() < 1e-6 && (sums.entropy - 4.0).abs() < 1e-6);
        let g = Tensor::run_backward(&[&loss], &[&lp, &ent], false, false);
        assert!((g[0].double_value(&[0]) - 0.1 * (1.0 - f64::exp(-0.5)) / 2.0).abs() < 1e-6);
        assert!((g[1].double_value(&[1]) + 0.01 / 2.0).abs() < 1e-7);
        // A KL weight without reference logprobs is an error, not a silent zero.
        let x = LossInputs {
            reference_logprobs: None,
            ..x
        };
        assert!(policy_loss(
            &cfg,
            &x,
            BatchCounts {
                tokens: 2.0,
                seqs: 1.0
            }
        )
        .is_err());
    }
}
