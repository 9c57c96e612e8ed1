//! DiLoCo mode of a member (`diloco/H`): inner steps on this member's own inputs, then an
//! outer step with the whole group.
//!
//! A member takes inner steps (its own optimizer, no all-reduce) until it has taken `H`
//! since the last outer step; then it waits, its inputs buffered. While it can step it
//! heartbeats only every few heartbeat rounds' time ([`crate::collective::pace`]), at once
//! when it cannot (at `H`, no data, stopping). Heartbeats count the members at `H`; when
//! all are, the outer round runs on the same three rounds as a synchronous step (a weight,
//! the deltas, the commit), and the same recovery rule holds: no member applies an outer
//! step another did not, and a failed one is retried from the deltas the members hold (a
//! member that joined meanwhile contributes weight 0).

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::rounds::learner_failed;
use super::{Ended, Held, Learner, MemberEvent, MemberLoop, StepCtx, Wait};
use crate::collective::group::Membership;
use crate::collective::BeatPacer;

impl<L: Learner> MemberLoop<'_, L> {
    fn every(&self) -> u64 {
        self.cfg.mode.every()
    }

    /// Inner steps taken since the last outer step.
    fn inner_done(&self) -> u64 {
        self.learner
            .steps()
            .saturating_sub(self.learner.version() * self.every())
    }

    /// Whether an inner step can start now: fewer than `H` since the last outer step, and
    /// a batch's groups at hand.
    fn can_inner_step(&self) -> bool {
        self.inner_done() < self.every() && self.learner.ready() >= self.cfg.groups_per_step.max(1)
    }

    pub(super) fn diloco_loop(&mut self, m: &mut Membership) -> Ended<L::Error> {
        let every = self.every();
        let (heartbeat, timeout) = (self.node.config().heartbeat, self.node.config().timeout);
        let mut pacer = BeatPacer::new(heartbeat, timeout, Instant::now());
        loop {
            if self.can_inner_step() {
                self.learner.feed(Duration::ZERO, Wait::Full);
            } else if m.size() == 1 {
                self.learner.feed(heartbeat, Wait::UntilInput);
            } else {
                self.learner.feed(heartbeat, Wait::Full);
            }
            self.learner.take_ready();
            if self.can_inner_step() {
                let at = StepCtx {
                    epoch: m.epoch(),
                    members: m.size(),
                };
                if let Err(e) = self.learner.inner_step(at) {
                    return learner_failed(e);
                }
                let (steps, version) = (self.learner.steps(), self.learner.version());
                self.emit(MemberEvent::InnerStep { steps, version });
            }
            let more = self.can_inner_step() && self.learner.stop().is_none();
            if !pacer.due(more, Instant::now()) {
                continue;
            }
            let at_h = (self.inner_done() >= every) as usize;
            let started = Instant::now();
            let stopping = self.learner.stop().is_some();
            let beat = match self.node.heartbeat(m, at_h, stopping) {
                Ok(b) => b,
                Err(e) => return e.into(),
            };
            pacer.beat(started, Instant::now());
            self.emit(MemberEvent::Beat {
                ready: beat.ready,
                dissolve: beat.dissolve,
                seconds: started.elapsed().as_secs_f64(),
            });
            if beat.dissolve {
                return Ended::Dissolved;
            }
            if beat.ready as usize >= m.size() {
                let before = self.group_steps();
                if let Err(end) = self
                    .outer_round(m)
                    .and_then(|()| self.check_hashes(m, before))
                {
                    return end;
                }
            }
        }
    }

    /// The outer round in ring `m`: the weights, the deltas, the commit.
    pub(super) fn outer_round(&mut self, m: &mut Membership) -> Result<(), Ended<L::Error>> {
        let retried = self.held.is_some();
        let step = self.learner.version() + 1;
        let (delta, finite) = match self.held.take() {
            Some(h) => (h.values, true),
            None => {
                let mut d = self.learner.delta().map_err(learner_failed)?;
                let finite = super::rounds::all_finite(&d);
                if !finite {
                    // Its own NaN never reaches the others: it adds nothing.
                    warn!(
                        group = self.node.config().name,
                        outer_step = step,
                        "this member's parameter delta is not finite: it contributes nothing to the outer step"
                    );
                    self.emit(MemberEvent::NonFinite { step });
                    d.fill(0.0);
                }
                (d, finite)
            }
        };
        // A member with no inner step since the last outer step (a joiner) adds nothing.
        let stats = vec![(finite && self.inner_done() > 0) as u8 as f32];
        self.held = Some(Held {
            step: None,
            values: delta.clone(),
            stats: stats.clone(),
        });
        info!(outer_step = step, members = m.size(), "outer step started");
        self.emit(MemberEvent::StepStarted {
            step,
            members: m.size(),
            retried,
        });
        self.sum_and_commit(m, stats, delta)
    }
}
