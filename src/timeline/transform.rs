//! The sampling transform: which distribution a call's tokens were drawn from, as a
//! function of the model's logits. A trainer scores each sampled token under the same
//! transform of its current logits (as verl divides by the rollout temperature, and
//! further: the truncation too), so that the ratio to the behaviour log-probability the
//! server recorded is an importance weight between two policies of one kind.
//!
//! The transform, applied to one row of logits `z` (the engine's order, vLLM's too):
//!
//! ```text
//! z' = z / T                           (T = temperature; T = 0, greedy: see below)
//! keep j  iff  z'_j >= max z' + ln(min_p)                 (min_p > 0)
//!         and  j among the top_k largest kept (ties: lower id first)   (top_k > 0)
//!         and  the mass of the kept tokens ranked before j is < top_p  (top_p < 1)
//! q = softmax(z') over the kept tokens, 0 elsewhere
//! ```
//!
//! A greedy call (T = 0) has no distribution to train: it is scored as T = 1,
//! untruncated, and its behaviour log-probabilities are the model's. Penalties, a logit
//! bias or a grammar (`processed`) also shaped the distribution a server drew from; the
//! behaviour log-probabilities include them, the trainer does not reproduce them, and the
//! importance weight accounts for the difference.
//!
//! Owns: the transform's fields, their defaults for stored data that predates them, and
//! their bytes in a call's digest. Never samples (the engine does) nor scores (the trainer).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingTransform {
    /// 0: greedy.
    pub temperature: f64,
    /// 1: no nucleus truncation.
    pub top_p: f64,
    /// 0: no top-k truncation.
    pub top_k: u32,
    /// 0: no min-p truncation.
    pub min_p: f64,
    /// Penalties, a logit bias or a constraint changed the logits as well.
    pub processed: bool,
}

impl Default for SamplingTransform {
    fn default() -> Self {
        SamplingTransform::RAW
    }
}

impl SamplingTransform {
    /// The model's own distribution: what a call recorded before transforms travelled
    /// with calls is taken to be.
    pub const RAW: SamplingTransform = SamplingTransform {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        processed: false,
    };

    /// The temperature a trainer divides by (a greedy call is scored at 1).
    pub fn scoring_temperature(&self) -> f64 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }

    /// The truncation a trainer applies (none for a greedy call).
    pub fn truncates(&self) -> bool {
        self.temperature > 0.0 && (self.top_p < 1.0 || self.top_k > 0 || self.min_p > 0.0)
    }

    /// Checks the fields a peer sent (the same ranges the engine accepts).
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature {} is not >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} is not in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} is not in [0, 1]", self.min_p));
        }
        Ok(())
    }

    /// The transform's bytes in a call's digest.
    pub fn digest_into(&self, h: &mut blake3::Hasher) {
        h.update(&self.temperature.to_bits().to_le_bytes());
        h.update(&self.top_p.to_bits().to_le_bytes());
        h.update(&self.top_k.to_le_bytes());
        h.update(&self.min_p.to_bits().to_le_bytes());
        h.update(&[self.processed as u8]);
    }
}
