//! AdamW (Loshchilov & Hutter) over plain parameter tensors, as PyTorch's `torch.optim.AdamW`
//! computes it: decoupled weight decay `p -= lr * wd * p`, then the bias-corrected Adam
//! step `p -= lr * m̂ / (sqrt(v̂) + eps)`. Parameters of one dimension (norms, biases) take
//! no weight decay. Gradients may be clipped to a global norm first.

use tch::{no_grad, Tensor};

use super::TrainError;

#[derive(Debug, Clone)]
pub struct AdamWConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (none when `None`).
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-6,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
        }
    }
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    params: Vec<Tensor>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    step: i64,
}

impl AdamW {
    /// Tracks `params` (tensors that require gradients). The moments (twice the
    /// parameters' bytes) are allocated by the first step or restore, so a server that
    /// has not trained yet does not hold them.
    pub fn new(params: Vec<Tensor>, cfg: AdamWConfig) -> AdamW {
        AdamW {
            cfg,
            params,
            m: Vec::new(),
            v: Vec::new(),
            step: 0,
        }
    }

    fn zeros(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| p.zeros_like().set_requires_grad(false))
            .collect()
    }

    fn allocate(&mut self) {
        if self.m.len() != self.params.len() {
            self.m = self.zeros();
            self.v = self.zeros();
        }
    }

    pub fn steps(&self) -> i64 {
        self.step
    }

    /// The moments (first, second) per parameter, for checkpoints (zeros before the
    /// first step).
    pub fn moments(&self) -> (Vec<Tensor>, Vec<Tensor>) {
        if self.m.len() != self.params.len() {
            return (self.zeros(), self.zeros());
        }
        let clone = |t: &Vec<Tensor>| t.iter().map(Tensor::shallow_clone).collect();
        (clone(&self.m), clone(&self.v))
    }

    /// Restores moments and the step count (from a checkpoint): shapes must match.
    pub fn restore(&mut self, m: &[Tensor], v: &[Tensor], step: i64) -> Result<(), TrainError> {
        if m.len() != self.params.len() || v.len() != self.params.len() {
            return Err(TrainError::Invalid(format!(
                "optimizer state has {}/{} moments for {} parameters",
                m.len(),
                v.len(),
                self.params.len()
            )));
        }
        self.allocate();
        no_grad(|| {
            for (i, (dst, src)) in self
                .m
                .iter_mut()
                .chain(self.v.iter_mut())
                .zip(m.iter().chain(v))
                .enumerate()
            {
                if dst.size() != src.size() {
                    return Err(TrainError::Invalid(format!(
                        "optimizer moment {i} is {:?}, the parameter's {:?}",
                        src.size(),
                        dst.size()
                    )));
                }
                dst.f_copy_(src)?;
            }
            Ok(())
        })?;
        self.step = step;
        Ok(())
    }

    /// The global norm of the current gradients (0 for parameters without one).
    pub fn grad_norm(&self) -> f64 {
        norm_of(self.params.iter().map(|p| p.grad()))
    }

    /// One step with the accumulated gradients, which it then zeroes. Returns the gradient
    /// norm before clipping.
    pub fn step(&mut self) -> f64 {
        let mut grads: Vec<Tensor> = self.params.iter().map(|p| p.grad()).collect();
        let norm = self.step_with(&mut grads);
        no_grad(|| {
            for g in &mut grads {
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        });
        norm
    }

    /// One step with the gradients `grads` (one per parameter, in order; an undefined
    /// tensor skips its parameter), clipped in place. Returns the norm before clipping.
    /// The same gradient bytes give the same parameter bytes on every machine of one kind:
    /// what keeps the members of a training group identical.
    ///
    /// A non-finite norm (a NaN or infinite value anywhere in `grads`) is refused: nothing
    /// changes (parameters, moments, step count) and the norm is returned for the caller
    /// to count the skipped step.
    pub fn step_with(&mut self, grads: &mut [Tensor]) -> f64 {
        assert_eq!(grads.len(), self.params.len(), "one gradient per parameter");
        self.allocate();
        let norm = norm_of(grads.iter().map(Tensor::shallow_clone));
        if !norm.is_finite() {
            return norm;
        }
        let clip = match self.cfg.max_grad_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        self.step += 1;
        let (b1, b2) = self.cfg.betas;
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2 = 1.0 - b2.powi(self.step as i32);
        let lr = self.cfg.lr;
        no_grad(|| {
            for (((p, m), v), g) in self
                .params
                .iter()
                .zip(&mut self.m)
                .zip(&mut self.v)
                .zip(grads.iter_mut())
            {
                if !g.defined() {
                    continue;
                }
                // In place, few passes over memory: the step is a fixed cost of every
                // update, over every parameter.
                if clip != 1.0 {
                    let _ = g.g_mul_scalar_(clip);
                }
                let mut p = p.shallow_clone();
                if p.dim() > 1 && self.cfg.weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - lr * self.cfg.weight_decay);
                }
                let _ = m.lerp_(&*g, 1.0 - b1);
                let _ = v.g_mul_scalar_(b2);
                let _ = v.addcmul_(&(&*g * (1.0 - b2)), &*g);
                // p -= lr * (m / bc1) / (sqrt(v / bc2) + eps)
                let mut denom = v.sqrt();
                let _ = denom.g_mul_scalar_(1.0 / bc2.sqrt());
                let _ = denom.g_add_scalar_(self.cfg.eps);
                let _ = denom.g_mul_scalar_(-bc1 / lr);
                let _ = p.addcdiv_(m, &denom);
            }
        });
        norm
    }
}

/// The global L2 norm of `grads` (undefined ones count 0), summed in f64 in order.
fn norm_of(grads: impl Iterator<Item = Tensor>) -> f64 {
    let mut sq = 0.0;
    for g in grads {
        if g.defined() {
            sq += g.square().sum(tch::Kind::Double).double_value(&[]);
        }
    }
    sq.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_matches_the_adamw_formula() {
        // After one step m̂ = g and v̂ = g², so the Adam part is lr * g / (|g| + eps): the
        // sign of g times lr. Weight decay first scales the matrix by (1 - lr * wd); the
        // vector (a "norm") is not decayed.
        let w = Tensor::from_slice(&[1.0f32, -2.0])
            .view([1, 2])
            .set_requires_grad(true);
        let b = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let loss = (&w * Tensor::from_slice(&[0.5f32, -1.0]).view([1, 2])).sum(tch::Kind::Float)
            + &b * 2.0;
        loss.sum(tch::Kind::Float).backward();
        let mut opt = AdamW::new(
            vec![w.shallow_clone(), b.shallow_clone()],
            AdamWConfig {
                lr: 0.1,
                weight_decay: 0.01,
                max_grad_norm: None,
                ..Default::default()
            },
        );
        let norm = opt.step();
        assert!((norm - (0.25f64 + 1.0 + 4.0).sqrt()).abs() < 1e-6);
        let w: Vec<f32> = Vec::try_from(&w.detach().view([-1])).unwrap();
        let b: Vec<f32> = Vec::try_from(&b.detach()).unwrap();
        assert!((w[0] - (1.0 * 0.999 - 0.1)).abs() < 1e-6, "{w:?}");
        assert!((w[1] - (-2.0 * 0.999 + 0.1)).abs() < 1e-6, "{w:?}");
        assert!((b[0] - (3.0 - 0.1)).abs() < 1e-6, "{b:?}");
        assert_eq!(opt.steps(), 1);
    }

    #[test]
    fn a_non_finite_gradient_changes_nothing_even_with_clipping_on() {
        for bad in [f32::NAN, f32::INFINITY] {
            let w = Tensor::from_slice(&[1.0f32, -2.0]);
            let mut opt = AdamW::new(
                vec![w.shallow_clone()],
                AdamWConfig {
                    lr: 0.1,
                    max_grad_norm: Some(1.0),
                    ..Default::default()
                },
            );
            let mut g = vec![Tensor::from_slice(&[bad, 1.0f32])];
            let norm = opt.step_with(&mut g);
            assert!(!norm.is_finite());
            assert_eq!(opt.steps(), 0);
            let after: Vec<f32> = Vec::try_from(&w).unwrap();
            assert_eq!(after, [1.0, -2.0]);
            // The moments are untouched too: the next good step is a first step.
            let norm = opt.step_with(&mut [Tensor::from_slice(&[0.5f32, 0.0])]);
            assert_eq!(norm, 0.5);
            let after: Vec<f32> = Vec::try_from(&w).unwrap();
            assert!((after[0] - 0.9).abs() < 1e-5, "{bad}: {after:?}");
        }
    }
}
