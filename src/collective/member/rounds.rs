//! A synchronous ring: heartbeats until the group holds a step's groups, then the step's
//! rounds (stats, values, commit) and the hash round every `hash_every` group steps.

use std::time::Instant;

use tracing::{info, warn};

use super::{
    hex8, Applied, Ended, Held, Learner, MemberError, MemberEvent, MemberLoop, Mode, Res, StepCtx,
    Wait,
};
use crate::collective::group::Membership;
use crate::collective::Wire;

impl<L: Learner> MemberLoop<'_, L> {
    pub(super) fn sync_loop(&mut self, m: &mut Membership) -> Ended<L::Error> {
        let heartbeat = self.node.config().heartbeat;
        loop {
            // Alone: no one to wait for, so no heartbeat period (a step starts as soon as
            // the groups are there); newcomers are still looked for.
            let how = if m.size() == 1 {
                Wait::UntilInput
            } else {
                Wait::Full
            };
            self.learner.feed(heartbeat, how);
            self.learner.take_ready();
            if let Err(end) = self.beat(m, self.learner.ready()) {
                return end;
            }
        }
    }

    /// A heartbeat with `ready` here; a step when the group is ready, then the hash round.
    /// `Err` ends the ring.
    fn beat(&mut self, m: &mut Membership, ready: usize) -> Result<(), Ended<L::Error>> {
        let t0 = Instant::now();
        let stopping = self.learner.stop().is_some();
        let beat = self.node.heartbeat(m, ready, stopping)?;
        self.emit(MemberEvent::Beat {
            ready: beat.ready,
            dissolve: beat.dissolve,
            seconds: t0.elapsed().as_secs_f64(),
        });
        if beat.dissolve {
            return Err(Ended::Dissolved);
        }
        if beat.ready >= self.cfg.groups_per_step.max(1) as f64 {
            let before = self.group_steps();
            self.step_round(m)?;
            self.check_hashes(m, before)?;
        }
        Ok(())
    }

    /// After a round that may have applied a step (from group step `before`): every
    /// `hash_every` group steps the members compare parameter hashes; if they differ the
    /// ring dissolves everywhere, and the next epoch re-syncs the members off the
    /// majority's hash.
    pub(super) fn check_hashes(
        &mut self,
        m: &mut Membership,
        before: u64,
    ) -> Result<(), Ended<L::Error>> {
        let (every, now) = (self.cfg.hash_every, self.group_steps());
        if every == 0 || now == before || now % every != 0 || m.size() < 2 {
            return Ok(());
        }
        let hash = self.learner.hash();
        if self.node.hashes_agree(m, &hash)? {
            self.emit(MemberEvent::HashesAgree { steps: now });
            return Ok(());
        }
        warn!(
            group = self.node.config().name,
            step = now,
            mine = hex8(&hash),
            "the members' parameter hashes differ"
        );
        self.emit(MemberEvent::HashesDiffer {
            steps: now,
            mine: hash,
        });
        Err(Ended::Dissolved)
    }

    /// One group step in ring `m`: from what this member holds (a retry) or a new
    /// contribution (DiLoCo: the outer step).
    pub(super) fn step_round(&mut self, m: &mut Membership) -> Result<(), Ended<L::Error>> {
        if let Mode::Diloco { .. } = self.cfg.mode {
            return self.outer_round(m);
        }
        let at = StepCtx {
            epoch: m.epoch(),
            members: m.size(),
        };
        let step = self.group_steps() + 1;
        if m.size() == 1 && self.held.is_none() {
            // A group of one: the learner's own step (no flat copies, any number of
            // updates).
            self.last_round = None;
            self.learner.solo_step(at).map_err(learner_failed)?;
            self.emit_applied(1, None);
            self.emit_status(Some(m));
            return Ok(());
        }
        let retried = self.held.is_some();
        let held = match self.held.take() {
            Some(h) => h,
            None => {
                let (s, mut c) = self.learner.local_step(at).map_err(learner_failed)?;
                if !all_finite(&c.values) || !all_finite(&c.stats) {
                    // Its own NaN never reaches the others: it contributes nothing (its
                    // tokens and groups count nowhere) and says so.
                    warn!(
                        group = self.node.config().name,
                        step,
                        "this member's gradient or loss is not finite: it contributes nothing to the step"
                    );
                    self.emit(MemberEvent::NonFinite { step });
                    c.values.fill(0.0);
                    c.stats.fill(0.0);
                }
                Held {
                    step: Some(s),
                    values: c.values,
                    stats: c.stats,
                }
            }
        };
        self.emit(MemberEvent::StepStarted {
            step,
            members: m.size(),
            retried,
        });
        let (stats, values) = (held.stats.clone(), held.values.clone());
        self.held = Some(held);
        self.sum_and_commit(m, stats, values)
    }

    /// A step's rounds in ring `m` after its local parts: the stats, the values (with the
    /// test pause) and the commit. Applies the sums when every member commits; keeps them
    /// as pending when the commit's outcome is unknown here. (Both modes: the values are
    /// gradients, or DiLoCo's deltas.)
    pub(super) fn sum_and_commit(
        &mut self,
        m: &mut Membership,
        mut stats: Vec<f32>,
        mut values: Vec<f32>,
    ) -> Result<(), Ended<L::Error>> {
        self.node.sum(m, &mut stats, Wire::F32)?;
        if self
            .cfg
            .send_nan_from
            .is_some_and(|s| self.group_steps() + 1 >= s)
        {
            warn!(
                group = self.node.config().name,
                "test hook: this member sends NaN values"
            );
            values.fill(f32::NAN);
        }
        m.ring.midway_pause = self.cfg.midway_pause;
        let round = self.node.sum(m, &mut values, self.cfg.wire);
        m.ring.midway_pause = None;
        let round = round?;
        self.last_round = Some((round, values.len()));
        self.emit(MemberEvent::ValueRound {
            round,
            values: values.len(),
            members: m.size(),
        });
        match self.node.commit(m) {
            Ok(true) => {
                self.apply_sum(&values, &stats, m.size())
                    .map_err(Ended::Fatal)?;
                self.emit_status(Some(m));
                Ok(())
            }
            Ok(false) => {
                info!(
                    group = self.node.config().name,
                    "a member did not commit: the step is retried"
                );
                let step = self.group_steps() + 1;
                self.emit(MemberEvent::NotCommitted { step });
                Ok(())
            }
            Err(e) => {
                self.pending = Some((values, stats));
                Err(e.into())
            }
        }
    }

    /// Applies the group's sums: to the held step (sync), or as the outer step (DiLoCo).
    pub(super) fn apply_sum(&mut self, sum: &[f32], stats: &[f32], members: usize) -> Res<(), L> {
        let by = Applied {
            members,
            round: self.last_round.map(|(r, _)| r),
        };
        match self.cfg.mode {
            Mode::Sync => {
                let step = self.held.take().and_then(|h| h.step).ok_or_else(|| {
                    MemberError::Invalid("a sum to apply but no step held".into())
                })?;
                self.learner
                    .apply(step, sum, stats, by)
                    .map_err(MemberError::Learner)?;
                self.emit_applied(members, None);
            }
            Mode::Diloco { every } => {
                let contributors = stats.first().copied().unwrap_or(0.0).max(0.0) as usize;
                self.learner
                    .outer_step(sum, contributors, by)
                    .map_err(MemberError::Learner)?;
                self.held = None;
                let (steps, version) = (self.learner.steps(), self.learner.version());
                if steps != version * every.max(1) {
                    return Err(MemberError::Invalid(format!(
                        "after outer step {version} the learner is at step {steps}, not {}",
                        version * every.max(1)
                    )));
                }
                self.emit_applied(members, Some(contributors));
            }
        }
        Ok(())
    }

    fn emit_applied(&mut self, members: usize, contributors: Option<usize>) {
        let e = MemberEvent::Applied {
            steps: self.group_steps(),
            version: self.learner.version(),
            members,
            contributors,
            hash: self.learner.hash(),
        };
        self.emit(e);
    }
}

pub(super) fn learner_failed<E: std::fmt::Display + std::fmt::Debug>(e: E) -> Ended<E> {
    Ended::Fatal(MemberError::Learner(e))
}

/// No NaN or infinity in `v`.
pub(super) fn all_finite(v: &[f32]) -> bool {
    v.iter().all(|x| x.is_finite())
}
