//! DiLoCo's outer optimizer (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
//! Training of Language Models"): members far apart each take `H` inner steps (their own
//! AdamW on their own data), then average their parameter deltas and take one outer step.
//!
//! With `θ` the parameters every member held after the last outer step (the *anchor*),
//! `θ_i` member i's parameters after its inner steps and `n` the members that contributed:
//!
//! ```text
//! Δ   = (1/n) Σ_i (θ - θ_i)            the outer gradient (the members' mean delta)
//! b   = Δ                               first outer step
//! b   = μ b + Δ                         later ones (momentum μ, no dampening)
//! θ'  = θ - lr (Δ + μ b)                Nesterov (torch.optim.SGD(nesterov=True))
//! ```
//!
//! Bad deltas: a non-finite value anywhere in the sum refuses the outer step (the anchor,
//! the momentum and the parameters stay the last outer step's; [`OuterStep::refused`]),
//! and the mean delta's global L2 norm is clipped to [`OuterConfig::max_norm`], by
//! default to what honest inner steps can move: AdamW moves a coordinate by at most about
//! 3.2 lr per update (β = 0.9, 0.999), so `H` inner steps of `U` updates each (PPO
//! epochs x mini-batches) move the parameters by at most `4 lr H U sqrt(N) + lr wd H U |θ|`
//! (`N` values, the inner peak learning rate and weight decay). Members with other inner
//! settings clip at other norms; the hash round then finds them apart and re-syncs them. A member that sends a huge finite delta then moves the group no further than an
//! honest member could.
//!
//! DiLoCo's defaults: lr 0.7, μ 0.9. Every member computes the same float32 operations on
//! the same bytes (the same anchor, the same summed deltas, the same momentum), so every
//! member ends the outer step with bit-identical parameters; the inner AdamW state stays
//! each member's own (as in DiLoCo). The members' delta sum is the caller's: this module
//! turns parameters into a flat delta and a summed delta into the outer step.

use tch::Tensor;

use super::trainer::Trainer;
use super::{flat_f32, TrainError};

/// DiLoCo's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterConfig {
    /// Inner steps per outer step (`H`).
    pub every: u64,
    pub lr: f64,
    pub momentum: f64,
    /// The mean delta's global L2 norm is clipped to this; `None`: to the bound on what
    /// honest inner steps can move (module docs).
    pub max_norm: Option<f64>,
}

impl Default for OuterConfig {
    fn default() -> Self {
        OuterConfig {
            every: 500,
            lr: 0.7,
            momentum: 0.9,
            max_norm: None,
        }
    }
}

/// What one outer step did with the members' deltas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterStep {
    /// The mean delta's global L2 norm (NaN or infinite when refused).
    pub norm: f64,
    /// The norm the mean delta was clipped to, when it was.
    pub clipped_to: Option<f64>,
    /// A non-finite value was in the sum: nothing moved.
    pub refused: bool,
}

/// The outer optimizer's state: the anchor and the momentum buffer.
pub struct Outer {
    pub cfg: OuterConfig,
    anchor: Vec<Tensor>,
    momentum: Option<Vec<Tensor>>,
}

fn copies(ts: &[Tensor]) -> Vec<Tensor> {
    tch::no_grad(|| ts.iter().map(|t| t.detach().copy()).collect())
}

impl Outer {
    /// Anchored at the trainer's parameters now (they must be the group's).
    pub fn new(t: &Trainer, cfg: OuterConfig) -> Outer {
        Outer {
            cfg,
            anchor: copies(&t.model.parameters()),
            momentum: None,
        }
    }

    /// Re-anchors at the trainer's parameters (after installing the group's state).
    pub fn reanchor(&mut self, t: &Trainer, momentum: Option<Vec<Tensor>>) {
        self.anchor = copies(&t.model.parameters());
        self.momentum = momentum;
    }

    pub fn anchor(&self) -> &[Tensor] {
        &self.anchor
    }

    /// The momentum buffer (none before the first outer step).
    pub fn momentum(&self) -> Option<&[Tensor]> {
        self.momentum.as_deref()
    }

    /// This member's flat delta `θ - θ_i` (parameter order, float32).
    pub fn delta(&self, t: &Trainer) -> Result<Vec<f32>, TrainError> {
        let d: Vec<Tensor> = tch::no_grad(|| {
            self.anchor
                .iter()
                .zip(t.model.parameters())
                .map(|(a, p)| a - p.detach())
                .collect()
        });
        flat_f32(&d)
    }

    /// The default clip of the mean delta's norm for `t`'s inner settings (module docs).
    pub fn honest_bound(&self, t: &Trainer) -> f64 {
        let o = &t.cfg.optim;
        let n: usize = self.anchor.iter().map(Tensor::numel).sum();
        let theta = tch::no_grad(|| {
            self.anchor
                .iter()
                .map(|a| a.square().sum(tch::Kind::Double).double_value(&[]))
                .sum::<f64>()
                .sqrt()
        });
        // AdamW updates between two outer steps: H steps of (PPO epochs x mini-batches).
        let h = (self.cfg.every.max(1) * t.updates_per_step().max(1) as u64) as f64;
        4.0 * o.lr * h * (n as f64).sqrt() + o.lr * o.weight_decay * h * theta
    }

    /// The outer step from the members' summed deltas (`sum`, from `members` members):
    /// the new anchor goes into the trainer's parameters (the inner optimizer's state is
    /// kept). Discards the trainer's inner progress. A sum with a non-finite value is
    /// refused (the parameters go back to the anchor, nothing else moves); a mean delta
    /// above the clip is scaled down to it.
    pub fn step(
        &mut self,
        t: &mut Trainer,
        sum: &[f32],
        members: usize,
    ) -> Result<OuterStep, TrainError> {
        let total: usize = self.anchor.iter().map(Tensor::numel).sum();
        if sum.len() != total || members == 0 {
            return Err(TrainError::Invalid(format!(
                "an outer step from {} summed values of {members} member(s), for {total} parameter values",
                sum.len()
            )));
        }
        // In f64 and in order: every member computes the same norm from the same bytes.
        let norm = sum
            .iter()
            .map(|&x| (x as f64) * (x as f64))
            .sum::<f64>()
            .sqrt()
            / members as f64;
        if !norm.is_finite() {
            let params = t.model.parameters();
            tch::no_grad(|| -> Result<(), TrainError> {
                for (a, p) in self.anchor.iter().zip(&params) {
                    p.shallow_clone().f_copy_(a)?;
                }
                Ok(())
            })?;
            return Ok(OuterStep {
                norm,
                clipped_to: None,
                refused: true,
            });
        }
        let bound = self.cfg.max_norm.unwrap_or_else(|| self.honest_bound(t));
        let clipped_to = (norm > bound).then_some(bound);
        let (lr, mu) = (self.cfg.lr, self.cfg.momentum);
        let mut at = 0;
        let mut mom = Vec::with_capacity(self.anchor.len());
        let params = t.model.parameters();
        tch::no_grad(|| -> Result<(), TrainError> {
            for (i, (a, p)) in self.anchor.iter_mut().zip(&params).enumerate() {
                let n = a.numel();
                let avg = Tensor::from_slice(&sum[at..at + n])
                    .view(a.size().as_slice())
                    .to_device(a.device())
                    .to_kind(a.kind())
                    / members as f64;
                let avg = match clipped_to {
                    Some(b) => avg * (b / norm),
                    None => avg,
                };
                at += n;
                let b = match &self.momentum {
                    Some(m) => &m[i] * mu + &avg,
                    None => avg.copy(),
                };
                let update = &avg + &b * mu;
                let _ = a.f_sub_(&(update * lr))?;
                let mut p = p.shallow_clone();
                p.f_copy_(a)?;
                mom.push(b);
            }
            Ok(())
        })?;
        self.momentum = Some(mom);
        Ok(OuterStep {
            norm,
            clipped_to,
            refused: false,
        })
    }
}
