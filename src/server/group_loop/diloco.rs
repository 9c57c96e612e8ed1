//! DiLoCo mode of a group member (`--sync-every H`): inner steps on this member's own
//! episodes, then an outer step with the whole group (see [`crate::train::outer`]).
//!
//! A member takes inner steps (its own AdamW, its own loss normalisation, no all-reduce)
//! until it has taken `H` since the last outer step; then it waits, its groups buffered.
//! While it can step it heartbeats only every few heartbeat rounds' time
//! ([`crate::collective::pace`]), at once when it cannot (at `H`, no data, stopping).
//! Heartbeats count the members at `H`; when all are, the
//! outer round runs on the same three rounds as a synchronous step (a weight, the deltas,
//! the commit), and the same recovery rule holds: no member applies an outer step another
//! did not, and a failed one is retried from the deltas the members hold (a member that
//! joined meanwhile contributes weight 0).
//!
//! The engine serves only the group's parameters: after an outer step, under the next
//! policy version (versions count outer steps). A call sampled between outer steps carries
//! the last outer step's version and was sampled with exactly those weights, at every
//! member; the inner steps' drift is never served. The inner steps' lines in
//! `metrics.jsonl` carry that version too and no parameter hash (their parameters are
//! the member's own); each outer step appends a line to `outer.jsonl` with the group's
//! parameter hash. Checkpoints are taken at outer steps only (a drain rewinds to the last
//! one): inner steps after it are lost with a restart, and their episodes trained again.

use std::io::Write;
use std::time::{Duration, Instant};

use tch::Tensor;
use tracing::info;

use super::{hex8, Ended, MemberLoop};
use crate::collective::group::{GroupError, Membership};
use crate::collective::BeatPacer;
use crate::server::group_state::parameter_hash;
use crate::server::train::append_consumed;
use crate::server::TrainingError;
use crate::train::checkpoint::RunDir;
use crate::train::outer::{Outer, OuterConfig};
use crate::train::trainer::Trainer;
use crate::train::TrainError;

/// The outer state's tensors in a checkpoint.
const MOMENTUM: &str = "outer.momentum";

/// The outer optimizer at the trainer's (resumed) parameters, with the momentum its
/// checkpoint saved.
pub(super) fn resume(t: &Trainer, cfg: OuterConfig, run_dir: &RunDir) -> Result<Outer, TrainError> {
    let mut o = Outer::new(t, cfg);
    let params = t.model.parameters();
    if let Some(named) = run_dir.saved_tensors()? {
        let momentum: Option<Vec<Tensor>> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let key = format!("{MOMENTUM}.{i}");
                named
                    .iter()
                    .find(|(k, v)| *k == key && v.size() == p.size())
                    .map(|(_, v)| v.to_device(p.device()))
            })
            .collect();
        if momentum.is_none() {
            return Err(TrainError::Invalid(format!(
                "the checkpoint in {} has an outer state of another model",
                run_dir.dir.display()
            )));
        }
        o.reanchor(t, momentum);
    }
    Ok(o)
}

/// The tensors a checkpoint keeps of `o` (its anchor is the checkpoint's model).
pub(super) fn saved(o: &Outer) -> Vec<(String, Tensor)> {
    o.momentum()
        .map(|m| {
            m.iter()
                .enumerate()
                .map(|(i, t)| (format!("{MOMENTUM}.{i}"), t.shallow_clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn outer_of(o: &Option<Outer>) -> Result<&Outer, TrainError> {
    o.as_ref()
        .ok_or_else(|| TrainError::Invalid("not in DiLoCo mode".into()))
}

impl MemberLoop<'_> {
    fn every(&self) -> u64 {
        self.outer.as_ref().map_or(1, |o| o.cfg.every.max(1))
    }

    /// Inner steps taken since the last outer step.
    fn inner_done(&self) -> u64 {
        self.trainer
            .steps()
            .saturating_sub(self.trainer.version() * self.every())
    }

    /// Whether an inner step can start now: fewer than `H` since the last outer step, and
    /// a batch's groups at hand.
    fn can_inner_step(&self) -> bool {
        self.inner_done() < self.every() && self.ready.len() >= self.s.groups_per_step.max(1)
    }

    pub(super) fn diloco_loop(&mut self, m: &mut Membership) -> Ended {
        let every = self.every();
        let mut pacer = BeatPacer::new(self.cs().heartbeat, self.cs().timeout, Instant::now());
        loop {
            if self.can_inner_step() {
                self.pump(Duration::ZERO);
            } else if m.size() == 1 {
                self.pump_until_input(self.cs().heartbeat);
            } else {
                self.pump(self.cs().heartbeat);
            }
            self.take_ready();
            if self.can_inner_step() {
                if let Err(e) = self.inner_step() {
                    return Ended::Failed(GroupError::Refused(format!("an inner step: {e}")));
                }
            }
            let more = self.can_inner_step() && self.stop.is_none();
            if !pacer.due(more, Instant::now()) {
                continue;
            }
            let at_h = (self.inner_done() >= every) as usize;
            let started = Instant::now();
            let beat = match self.node.heartbeat(m, at_h, self.stop.is_some()) {
                Ok(b) => b,
                Err(e) => return Ended::Failed(e),
            };
            pacer.beat(started, Instant::now());
            if beat.dissolve {
                return Ended::Dissolved;
            }
            if beat.ready as usize >= m.size() {
                let before = self.group_steps();
                if let Err(e) = self.outer_round(m) {
                    return Ended::Failed(e);
                }
                if let Some(end) = self.check_hashes(m, before) {
                    return end;
                }
            }
        }
    }

    /// One inner step on the groups this member holds: its own, not served.
    fn inner_step(&mut self) -> Result<(), TrainingError> {
        let (groups, rep) = self.next_batch();
        let version = self.trainer.version();
        info!(
            step = self.trainer.steps() + 1,
            groups = groups.len(),
            version,
            "inner step started"
        );
        let mut metrics = self.trainer.step(&groups, &rep)?;
        // Versions count outer steps.
        self.trainer.set_counters(self.trainer.steps(), version);
        metrics.version = version;
        metrics.members = 1;
        append_consumed(&self.run_dir.dir, self.trainer.steps(), &rep.taken)?;
        self.record(&metrics)
    }

    /// The outer round in ring `m`: the weights, the deltas, the commit.
    pub(super) fn outer_round(&mut self, m: &mut Membership) -> Result<(), GroupError> {
        let refused = |e: TrainError| GroupError::Refused(e.to_string());
        let delta = match self.held_delta.take() {
            Some(d) => d,
            None => outer_of(&self.outer)
                .and_then(|o| o.delta(&self.trainer))
                .map_err(refused)?,
        };
        // A member with no inner step since the last outer step (a joiner) adds nothing.
        let stats = vec![(self.inner_done() > 0) as u8 as f32];
        let sum = delta.clone();
        self.held_delta = Some(delta);
        info!(
            outer_step = self.trainer.version() + 1,
            members = m.size(),
            "outer step started"
        );
        self.sum_and_commit(m, stats, sum)
    }

    /// The outer step from the summed deltas and weights; serves the new version.
    pub(super) fn apply_outer(
        &mut self,
        sum: &[f32],
        stats: &[f32],
        members: usize,
    ) -> Result<(), TrainingError> {
        let contributors = stats.first().copied().unwrap_or(0.0).max(0.0) as usize;
        let every = self.every();
        let o = self
            .outer
            .as_mut()
            .ok_or_else(|| TrainError::Invalid("not in DiLoCo mode".into()))?;
        // No member trained: a zero outer gradient (the momentum still moves).
        o.step(&mut self.trainer, sum, contributors.max(1))?;
        self.held_delta = None;
        let v = self.trainer.version() + 1;
        self.trainer.set_counters(v * every, v);
        self.hash = parameter_hash(&self.trainer, self.outer.as_ref())?;
        self.serve_trained()?;
        let (seconds, bytes_sent) = self
            .last_round
            .map_or((0.0, 0), |(r, _)| (r.seconds, r.bytes_sent));
        let line = serde_json::json!({
            "outer_step": v,
            "version": v,
            "step": v * every,
            "members": members,
            "contributors": contributors,
            "param_hash": self.hash.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "allreduce_seconds": seconds,
            "bytes_sent": bytes_sent,
        });
        let path = self.run_dir.dir.join("outer.jsonl");
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"))
            .map_err(|e| TrainError::file(&path, e))?;
        println!(
            "outer step {v}: {members} member(s), {contributors} contributed, parameters {}",
            hex8(&self.hash)
        );
        info!(
            outer_step = v,
            members,
            contributors,
            hash = hex8(&self.hash),
            "outer step applied"
        );
        if v % self.s.checkpoint_every.max(1) == 0 {
            self.save()?;
        }
        Ok(())
    }

    /// In DiLoCo mode, brings the trainer back to the last outer step's parameters and
    /// step count (its inner progress is dropped); nothing otherwise.
    pub(super) fn rewind_to_anchor(&mut self) -> Result<(), TrainingError> {
        let Some(o) = &self.outer else {
            return Ok(());
        };
        let params = self.trainer.model.parameters();
        tch::no_grad(|| -> Result<(), TrainError> {
            for (p, a) in params.iter().zip(o.anchor()) {
                p.shallow_clone().f_copy_(a)?;
            }
            Ok(())
        })?;
        let v = self.trainer.version();
        self.trainer.set_counters(v * self.every(), v);
        self.held_delta = None;
        Ok(())
    }
}
