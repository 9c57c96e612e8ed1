//! A [`Learner`] without a model: the trainer's stand-in for netsim (dozens of members in
//! one process) and for the member loop's in-process tests.
//!
//! It keeps what the group sees: `values` f32 parameters, a gradient per step (drawn from
//! the member's seed and the step, so members differ) that takes `compute` to make (a
//! sleep: the GPU's time), the synchronous update (plain SGD on the summed gradient over
//! the contributors) and DiLoCo's (SGD inner steps on the member's own gradients, then the
//! summed deltas and the same Nesterov outer step as `train::outer`). Its inputs never run
//! out (one group always at hand) unless [`ToyHooks::ready`] says otherwise. Test hooks
//! make it drift, stall, fail or keep checkpoints, as a real member can.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Applied, Contribution, Learner, Mode, StepCtx, Wait};
use crate::base::{lock, Rng, Stop, StopMode};

/// A stand-in's numbers.
#[derive(Debug, Clone)]
pub struct ToyConfig {
    pub values: usize,
    /// Draws this member's gradients (members with another seed differ).
    pub seed: u64,
    /// How long a gradient takes to make.
    pub compute: Duration,
    pub lr: f32,
    /// Synchronous, or DiLoCo with its inner steps per outer step.
    pub mode: Mode,
    pub outer_lr: f32,
    pub outer_momentum: f32,
}

impl Default for ToyConfig {
    fn default() -> Self {
        ToyConfig {
            values: 1000,
            seed: 1,
            compute: Duration::ZERO,
            lr: 0.1,
            mode: Mode::Sync,
            outer_lr: 0.7,
            outer_momentum: 0.9,
        }
    }
}

/// A checkpoint store: the last [`Learner::export`] a stand-in saved.
pub type ToyStore = Arc<Mutex<Option<Vec<u8>>>>;

/// Faults and records, for tests.
#[derive(Debug, Clone, Default)]
pub struct ToyHooks {
    /// After applying this group step, one parameter drifts by 1e-3 (a corrupted member).
    pub perturb_after: Option<u64>,
    /// Making the contribution to this group step first sleeps this long (a stall).
    pub stall: Option<(u64, Duration)>,
    /// Making the contribution to this group step fails (a member whose trainer broke).
    pub fail_at: Option<u64>,
    /// Where checkpoints go: every `checkpoint_every` group steps and on a drain.
    pub checkpoint: Option<ToyStore>,
    pub checkpoint_every: u64,
    /// Groups it has at hand (none: always one).
    pub ready: Option<Arc<AtomicUsize>>,
}

/// The stand-in: parameters, counters and (DiLoCo) the outer state.
pub struct ToyLearner {
    cfg: ToyConfig,
    hooks: ToyHooks,
    stop: Stop,
    params: Vec<f32>,
    /// The parameters at the last group step (sync: the parameters themselves).
    anchor: Vec<f32>,
    momentum: Option<Vec<f32>>,
    steps: u64,
    version: u64,
    hash: [u8; 32],
}

impl ToyLearner {
    /// Every member starts from the same parameters (one model, one initialisation).
    pub fn new(cfg: ToyConfig, hooks: ToyHooks, stop: Stop) -> ToyLearner {
        let mut rng = Rng::seeded(0x5eed);
        let params: Vec<f32> = (0..cfg.values)
            .map(|_| rng.next_f64() as f32 - 0.5)
            .collect();
        let mut t = ToyLearner {
            cfg,
            hooks,
            stop,
            anchor: params.clone(),
            params,
            momentum: None,
            steps: 0,
            version: 0,
            hash: [0; 32],
        };
        t.rehash();
        t
    }

    /// A stand-in resumed from a checkpoint (an [`Learner::export`]).
    pub fn resume(
        cfg: ToyConfig,
        hooks: ToyHooks,
        stop: Stop,
        state: &[u8],
    ) -> Result<ToyLearner, String> {
        let mut t = ToyLearner::new(cfg, hooks, stop);
        let saved = t.decode(state)?;
        t.install(saved);
        Ok(t)
    }

    pub fn params(&self) -> &[f32] {
        &self.params
    }

    fn group_steps(&self) -> u64 {
        match self.cfg.mode {
            Mode::Sync => self.steps,
            Mode::Diloco { .. } => self.version,
        }
    }

    fn rehash(&mut self) {
        let mut h = blake3::Hasher::new();
        for v in self.anchor.iter().chain(self.momentum.iter().flatten()) {
            h.update(&v.to_le_bytes());
        }
        self.hash = *h.finalize().as_bytes();
    }

    /// This member's gradient of its next step, after the test hooks of group step `of`.
    fn gradient(&self, of: u64) -> Result<Vec<f32>, String> {
        let t0 = Instant::now();
        if let Some((at, pause)) = self.hooks.stall {
            if at == of {
                std::thread::sleep(pause);
            }
        }
        if self.hooks.fail_at == Some(of) {
            return Err(format!("test hook: the gradient of group step {of} fails"));
        }
        let mut rng = Rng::seeded(self.cfg.seed ^ (self.steps + 1).wrapping_mul(0x9E37_79B9));
        let g = (0..self.params.len())
            .map(|_| (rng.next_f64() as f32 - 0.5) * 1e-2)
            .collect();
        std::thread::sleep(self.cfg.compute.saturating_sub(t0.elapsed()));
        Ok(g)
    }

    /// After a group step: the drift hook, the hash, the checkpoint.
    fn after_group_step(&mut self) {
        let now = self.group_steps();
        if self.hooks.perturb_after == Some(now) {
            self.params[0] += 1e-3;
            self.anchor[0] += 1e-3;
        }
        self.rehash();
        let every = self.hooks.checkpoint_every.max(1);
        if now % every == 0 {
            self.save();
        }
    }

    fn save(&self) {
        if let Some(store) = &self.hooks.checkpoint {
            *lock(store) = Some(self.state_bytes());
        }
    }

    /// A state of [`ToyLearner::state_bytes`]'s layout, checked for this shape, bounded
    /// counters and finite values.
    fn decode(&self, b: &[u8]) -> Result<ToyState, String> {
        let n = self.params.len();
        let has_m = *b.get(16).ok_or("a state of under 17 bytes")? == 1;
        let want = 17 + 4 * n * (1 + has_m as usize);
        if b.len() != want {
            return Err(format!("a state of {} bytes, {want} expected", b.len()));
        }
        let f32s = |at: usize| -> Vec<f32> {
            b[at..at + 4 * n]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        let new = ToyState {
            steps: word(0),
            version: word(8),
            params: f32s(17),
            momentum: has_m.then(|| f32s(17 + 4 * n)),
        };
        if new.steps > 1 << 48 || new.version > 1 << 48 {
            return Err(format!(
                "a state of step {}, version {}: above the bound",
                new.steps, new.version
            ));
        }
        if new
            .params
            .iter()
            .chain(new.momentum.iter().flatten())
            .any(|x| !x.is_finite())
        {
            return Err("a state with a non-finite value".into());
        }
        Ok(new)
    }

    fn install(&mut self, new: ToyState) {
        self.steps = new.steps;
        self.version = new.version;
        self.params = new.params;
        self.anchor = self.params.clone();
        self.momentum = new.momentum;
        self.rehash();
    }

    /// The counters at the anchor, the anchor, the momentum.
    fn state_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(17 + 8 * self.anchor.len());
        b.extend(self.anchor_steps().to_le_bytes());
        b.extend(self.version.to_le_bytes());
        b.push(self.momentum.is_some() as u8);
        for v in self.anchor.iter().chain(self.momentum.iter().flatten()) {
            b.extend(v.to_le_bytes());
        }
        b
    }

    fn anchor_steps(&self) -> u64 {
        match self.cfg.mode {
            Mode::Sync => self.steps,
            Mode::Diloco { .. } => self.version * self.cfg.mode.every(),
        }
    }
}

/// A state being checked before it is installed.
struct ToyState {
    steps: u64,
    version: u64,
    params: Vec<f32>,
    momentum: Option<Vec<f32>>,
}

impl Learner for ToyLearner {
    type Step = ();
    type Error = String;

    fn values(&self) -> u64 {
        self.cfg.values as u64
    }
    fn steps(&self) -> u64 {
        self.steps
    }
    fn version(&self) -> u64 {
        self.version
    }
    fn hash(&self) -> [u8; 32] {
        self.hash
    }

    fn feed(&mut self, wait: Duration, how: Wait) {
        // Inputs never run out: a ring member still waits its heartbeat for them.
        if how == Wait::Full && !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
    fn ready(&self) -> usize {
        self.hooks
            .ready
            .as_ref()
            .map_or(1, |r| r.load(Ordering::Relaxed))
    }
    fn stop(&self) -> Option<StopMode> {
        self.stop.mode()
    }

    fn local_step(&mut self, _at: StepCtx) -> Result<((), Contribution), String> {
        let values = self.gradient(self.group_steps() + 1)?;
        Ok((
            (),
            Contribution {
                values,
                stats: vec![1.0],
            },
        ))
    }

    fn apply(&mut self, _: (), sum: &[f32], stats: &[f32], _by: Applied) -> Result<(), String> {
        if sum.len() != self.params.len() {
            return Err(format!(
                "a sum of {} values for {}",
                sum.len(),
                self.params.len()
            ));
        }
        let lr = self.cfg.lr / stats.first().copied().unwrap_or(1.0).max(1.0);
        for (p, g) in self.params.iter_mut().zip(sum) {
            *p -= lr * g;
        }
        self.steps += 1;
        self.version += 1;
        self.anchor.copy_from_slice(&self.params);
        self.after_group_step();
        Ok(())
    }

    fn inner_step(&mut self, _at: StepCtx) -> Result<(), String> {
        let g = self.gradient(self.version + 1)?;
        for (p, g) in self.params.iter_mut().zip(&g) {
            *p -= self.cfg.lr * g;
        }
        self.steps += 1;
        Ok(())
    }

    fn delta(&mut self) -> Result<Vec<f32>, String> {
        Ok(self
            .anchor
            .iter()
            .zip(&self.params)
            .map(|(a, p)| a - p)
            .collect())
    }

    fn outer_step(&mut self, sum: &[f32], contributors: usize, _by: Applied) -> Result<(), String> {
        if sum.len() != self.anchor.len() {
            return Err(format!(
                "a sum of {} values for {}",
                sum.len(),
                self.anchor.len()
            ));
        }
        let n = contributors.max(1) as f32;
        let (lr, mu) = (self.cfg.outer_lr, self.cfg.outer_momentum);
        let mut momentum = self.momentum.take().unwrap_or_else(|| vec![0.0; sum.len()]);
        for ((a, b), s) in self.anchor.iter_mut().zip(&mut momentum).zip(sum) {
            let avg = s / n;
            *b = *b * mu + avg;
            *a -= lr * (avg + *b * mu);
        }
        self.momentum = Some(momentum);
        self.params.copy_from_slice(&self.anchor);
        self.version += 1;
        self.steps = self.version * self.cfg.mode.every();
        self.after_group_step();
        Ok(())
    }

    fn export(&self) -> Result<Vec<u8>, String> {
        Ok(self.state_bytes())
    }

    fn import(&mut self, b: &[u8], steps: u64, hash: &[u8; 32]) -> Result<(), String> {
        // Checked on a copy: a state that is not the group's changes nothing here.
        let new = self.decode(b)?;
        // The group's steps count outer steps in DiLoCo mode (the state's step count is
        // then `version x H`).
        let group_steps = match self.cfg.mode {
            Mode::Sync => new.steps,
            Mode::Diloco { .. } => new.version,
        };
        if group_steps != steps {
            return Err(format!(
                "a state of step {} (version {}): the group's step is {steps}",
                new.steps, new.version
            ));
        }
        let mut h = blake3::Hasher::new();
        for v in new.params.iter().chain(new.momentum.iter().flatten()) {
            h.update(&v.to_le_bytes());
        }
        if h.finalize().as_bytes() != hash {
            return Err("a state whose parameters are not the group's (their hash differs)".into());
        }
        self.install(new);
        Ok(())
    }

    fn finish(&mut self, mode: StopMode) -> Result<(), String> {
        if mode == StopMode::Drain {
            // DiLoCo: the inner steps since the last outer step are this member's own.
            self.params.copy_from_slice(&self.anchor);
            self.steps = self.anchor_steps();
            self.save();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state is installed only at the group's step and hash with finite values; any
    /// other leaves the learner as it was.
    #[test]
    fn a_state_that_is_not_the_groups_changes_nothing() {
        let cfg = ToyConfig {
            values: 8,
            ..ToyConfig::default()
        };
        let mut group = ToyLearner::new(cfg.clone(), ToyHooks::default(), Stop::new());
        group.params[0] = 0.25;
        group.anchor = group.params.clone();
        group.steps = 3;
        group.version = 3;
        group.rehash();
        let good = group.export().unwrap();
        let mut joiner = ToyLearner::new(cfg, ToyHooks::default(), Stop::new());
        let before = (joiner.hash(), joiner.steps);
        let mut flipped = good.clone();
        flipped[20] ^= 1;
        let mut nan = good.clone();
        nan[17..21].copy_from_slice(&f32::NAN.to_le_bytes());
        for (what, bytes, steps) in [
            ("a wrong step", &good, 4),
            ("a flipped bit", &flipped, 3),
            ("a NaN", &nan, 3),
            ("a short state", &good[..40].to_vec(), 3),
        ] {
            assert!(
                joiner.import(bytes, steps, &group.hash()).is_err(),
                "{what}"
            );
            assert_eq!((joiner.hash(), joiner.steps), before, "{what}: changed");
        }
        joiner.import(&good, 3, &group.hash()).unwrap();
        assert_eq!((joiner.hash(), joiner.steps), (group.hash(), 3));
    }
}
