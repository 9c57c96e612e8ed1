//! The training-group member loop, one for every learner: the server's trainer
//! (`server::learner`) and netsim's stand-in ([`toy::ToyLearner`]) run this same code.
//!
//! A member forms an epoch ([`GroupNode::agree`]), moves state as the proposer decided (a
//! Sync member fetches the group's, the Ready ones offer theirs), builds the ring, catches
//! up (applies a pending sum another member applied, or drops it), then heartbeats and
//! steps in the ring until it dissolves or a round fails, and forms the next. A step: this
//! member's contribution ([`Learner::local_step`]), the stats round, the values round, the
//! commit round, then [`Learner::apply`] on the sums. The member keeps its contribution
//! until the step is applied (a failed step is retried from it in the next ring) and a sum
//! whose commit it did not see finish (applied if another member applied it). DiLoCo mode
//! (`diloco.rs`) runs inner steps alone and the same three rounds for the outer step. See
//! [`crate::collective::group`] for why no member applies a step another did not.
//!
//! Owns: the order of the protocol's calls, what a member holds between rounds, and the
//! events ([`MemberEvent`]) that say what happened. Never touches LibTorch, files or
//! stdout: the learner and the event sink do.
//!
//! Whatever ends the loop (a stop, a learner's error, being left out), it leaves the
//! group first: a member that stopped answering Prepare would keep every later proposal
//! from forming.

mod config;
mod diloco;
mod events;
mod learner;
mod rounds;
pub mod toy;

use std::time::{Duration, Instant};

use tracing::{info, warn};

pub use config::{LoopConfig, Mode};
pub use events::{hex8, EventSink, MemberEvent, SyncReason};
pub use learner::{Applied, Contribution, Learner, StepCtx, Wait};

use super::group::{Action, GroupError, GroupNode, MemberState, Membership, Start};
use super::RoundStats;
use crate::base::StopMode;
use crate::swarm::GroupStatus;

/// Why a member loop ended other than at a stop.
#[derive(Debug, thiserror::Error)]
pub enum MemberError<E: std::fmt::Display + std::fmt::Debug> {
    /// A group failure that is not a round's.
    #[error(transparent)]
    Group(GroupError),
    #[error("{0}")]
    Learner(E),
    /// This member's state contradicts the group's.
    #[error("{0}")]
    Invalid(String),
}

/// A step contributed and not applied yet: the learner's step (sync) and the values and
/// stats sent.
struct Held<S> {
    step: Option<S>,
    values: Vec<f32>,
    stats: Vec<f32>,
}

/// How a ring ended.
enum Ended<E: std::fmt::Display + std::fmt::Debug> {
    /// Dissolved cleanly at a heartbeat (a new epoch, or this member stops).
    Dissolved,
    /// A round failed: the next epoch is formed.
    RoundFailed(GroupError),
    /// The loop cannot go on.
    Fatal(MemberError<E>),
}

impl<E: std::fmt::Display + std::fmt::Debug> From<GroupError> for Ended<E> {
    fn from(e: GroupError) -> Self {
        match e {
            GroupError::Ring(_) | GroupError::Link(_) | GroupError::NonFinite(_) => {
                Ended::RoundFailed(e)
            }
            other => Ended::Fatal(MemberError::Group(other)),
        }
    }
}

/// One member of a training group: its node, its learner and where the rounds stand.
pub struct MemberLoop<'a, L: Learner> {
    node: GroupNode,
    cfg: LoopConfig,
    learner: L,
    events: EventSink<'a>,
    held: Option<Held<L::Step>>,
    /// The group's sums of the next group step, commit unseen.
    pending: Option<(Vec<f32>, Vec<f32>)>,
    /// The last value round and how many values it carried.
    last_round: Option<(RoundStats, usize)>,
}

type Res<T, L> = Result<T, MemberError<<L as Learner>::Error>>;

impl<'a, L: Learner> MemberLoop<'a, L> {
    pub fn new(node: GroupNode, cfg: LoopConfig, learner: L, events: EventSink<'a>) -> Self {
        MemberLoop {
            node,
            cfg,
            learner,
            events,
            held: None,
            pending: None,
            last_round: None,
        }
    }

    pub fn learner(&self) -> &L {
        &self.learner
    }

    fn emit(&mut self, e: MemberEvent) {
        (self.events)(&e);
    }

    /// The group's step at this member: its steps, or DiLoCo's outer steps.
    fn group_steps(&self) -> u64 {
        match self.cfg.mode {
            Mode::Sync => self.learner.steps(),
            Mode::Diloco { .. } => self.learner.version(),
        }
    }

    fn state(&self) -> MemberState {
        MemberState {
            steps: self.group_steps(),
            version: self.learner.version(),
            hash: self.learner.hash(),
            values: self.learner.values(),
            pending: self.pending.is_some(),
            held: self.held.is_some(),
        }
    }

    /// The status to gossip: in epoch `m`, or forming (epoch 0).
    fn emit_status(&mut self, m: Option<&Membership>) {
        let (allreduce_ms, allreduce_gbps) = match &self.last_round {
            Some((r, values)) => (
                r.seconds * 1e3,
                r.bus_bandwidth(*values, m.map_or(1, |m| m.size())) / 1e9,
            ),
            None => (0.0, 0.0),
        };
        let status = GroupStatus {
            name: self.node.config().name.clone(),
            epoch: m.map_or(0, |m| m.epoch()),
            members: m.map_or(0, |m| m.size() as u32),
            param_hash: hex8(&self.learner.hash()),
            allreduce_ms,
            allreduce_gbps,
            mode: self.node.config().mode.clone(),
        };
        self.emit(MemberEvent::Status(status));
    }

    /// Runs until the learner's stop; returns the learner.
    pub fn run(mut self) -> Result<L, MemberError<L::Error>> {
        loop {
            if let Some(mode) = self.learner.stop() {
                return self.finish(mode);
            }
            self.emit_status(None);
            let state = self.state();
            let agreed = {
                let (node, learner) = (&mut self.node, &mut self.learner);
                let mut stopped = || {
                    learner.feed(Duration::ZERO, Wait::Full);
                    learner.stop().is_some()
                };
                node.agree(&state, &mut stopped)
            };
            let start = match agreed {
                Ok(s) => s,
                Err(GroupError::Stopped) => continue,
                Err(GroupError::LeftOut { reason, retry_in }) => {
                    self.emit(MemberEvent::LeftOut { error: reason });
                    // A new promise ends the wait: a proposer wants this member in its
                    // next epoch (its ring would wait for it otherwise).
                    let until = Instant::now() + retry_in;
                    let at = self.node.promised();
                    while Instant::now() < until
                        && self.learner.stop().is_none()
                        && self.node.promised() == at
                    {
                        self.learner.feed(Duration::ZERO, Wait::Full);
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    continue;
                }
                Err(e) => {
                    warn!(group = self.node.config().name, "forming an epoch: {e}");
                    continue;
                }
            };
            if let Some(action) = self.node.action_in(&start) {
                self.emit(MemberEvent::Agreed {
                    epoch: start.ballot.epoch,
                    members: start.members.len(),
                    steps: start.steps,
                    action,
                });
            }
            if let Err(e) = self.sync_or_offer(&start) {
                warn!(group = self.node.config().name, "state transfer: {e}");
                self.emit(MemberEvent::TransferFailed {
                    error: e.to_string(),
                });
                continue;
            }
            let mut m = match self.node.build(start) {
                Ok(m) => m,
                Err(e) => {
                    warn!(group = self.node.config().name, "building the ring: {e}");
                    self.emit(MemberEvent::BuildFailed {
                        error: e.to_string(),
                    });
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            let caught_up = self.catch_up(&m).and_then(|()| {
                self.learner
                    .formed(m.epoch(), m.size())
                    .map_err(MemberError::Learner)
            });
            if let Err(e) = caught_up {
                return self.fail(e);
            }
            self.emit_status(Some(&m));
            let formed = MemberEvent::Formed {
                epoch: m.epoch(),
                members: m.size(),
                rank: m.ring.rank,
                steps: self.group_steps(),
                version: self.learner.version(),
                hash: self.learner.hash(),
                retry: m.start.retry,
            };
            self.emit(formed);
            let ended = if m.start.retry {
                match self.step_round(&mut m) {
                    Ok(()) => self.ring_loop(&mut m),
                    Err(e) => e,
                }
            } else {
                self.ring_loop(&mut m)
            };
            match ended {
                Ended::Dissolved => {
                    info!(group = self.node.config().name, "the ring dissolved");
                    self.emit(MemberEvent::Dissolved { epoch: m.epoch() });
                }
                Ended::RoundFailed(e) => {
                    warn!(
                        group = self.node.config().name,
                        epoch = m.epoch(),
                        "a round failed: {e}"
                    );
                    self.emit(MemberEvent::RoundFailed {
                        epoch: m.epoch(),
                        error: e.to_string(),
                    });
                }
                Ended::Fatal(e) => return self.fail(e),
            }
        }
    }

    /// Leaves the group and says why the loop ends.
    fn fail(mut self, e: MemberError<L::Error>) -> Result<L, MemberError<L::Error>> {
        self.node.leave();
        self.emit(MemberEvent::Failed {
            error: e.to_string(),
        });
        Err(e)
    }

    fn finish(mut self, mode: StopMode) -> Result<L, MemberError<L::Error>> {
        self.node.leave();
        let steps = self.group_steps();
        self.emit(MemberEvent::Stopped { mode, steps });
        self.learner.finish(mode).map_err(MemberError::Learner)?;
        Ok(self.learner)
    }

    /// Before the ring: a Sync member fetches the group's state and installs it; the
    /// Ready members offer theirs while some member syncs.
    fn sync_or_offer(&mut self, start: &Start) -> Res<(), L> {
        let syncing = start.actions.contains(&Action::Sync);
        match self.node.action_in(start) {
            Some(Action::Sync) => {
                let t0 = Instant::now();
                let reason = if self.group_steps() == start.steps {
                    SyncReason::Differs {
                        mine: self.learner.hash(),
                        group: start.hash,
                    }
                } else {
                    SyncReason::Behind {
                        at: self.group_steps(),
                    }
                };
                self.emit(MemberEvent::Syncing {
                    steps: start.steps,
                    reason,
                });
                // A state is at most the parameters, two optimizer moments and an outer
                // momentum, plus a header: what a peer's manifest may announce.
                let max_len = self
                    .state()
                    .values
                    .saturating_mul(16)
                    .saturating_add(1 << 20);
                let bytes = self
                    .node
                    .fetch_state(start, max_len)
                    .map_err(MemberError::Group)?;
                // Checked against the group's step and hash before anything is installed.
                self.learner
                    .import(&bytes, start.steps, &start.hash)
                    .map_err(MemberError::Learner)?;
                // Its own step in progress is given up: its inputs go back.
                if let Some(step) = self.held.take().and_then(|h| h.step) {
                    self.learner.give_back(step);
                }
                self.pending = None;
                if self.learner.hash() != start.hash || self.group_steps() != start.steps {
                    return Err(MemberError::Invalid(format!(
                        "the fetched state has step {} parameters {}, the group step {} parameters {}",
                        self.group_steps(),
                        hex8(&self.learner.hash()),
                        start.steps,
                        hex8(&start.hash)
                    )));
                }
                self.emit(MemberEvent::Synced {
                    steps: self.group_steps(),
                    version: self.learner.version(),
                    bytes: bytes.len(),
                    seconds: t0.elapsed().as_secs_f64(),
                });
            }
            // Only Ready members are asked for the state.
            Some(Action::Ready) if syncing => {
                let bytes = self.learner.export().map_err(MemberError::Learner)?;
                let (steps, len) = (self.group_steps(), bytes.len());
                self.node.offer_state(bytes, steps, self.learner.hash());
                self.emit(MemberEvent::Offered { steps, bytes: len });
            }
            _ => {}
        }
        Ok(())
    }

    /// Does what the proposer decided this member does first; checks the parameters.
    fn catch_up(&mut self, m: &Membership) -> Res<(), L> {
        match m.action() {
            Action::ApplyPending => {
                let (sum, stats) = self.pending.take().ok_or_else(|| {
                    MemberError::Invalid("told to apply a pending sum it does not hold".into())
                })?;
                info!(
                    group = self.node.config().name,
                    "applying the step another member applied"
                );
                self.apply_sum(&sum, &stats, m.size())?;
                let steps = self.group_steps();
                self.emit(MemberEvent::AppliedPending { steps });
            }
            // Done before the ring was built.
            Action::Sync => {}
            Action::Ready => {
                if self.pending.take().is_some() {
                    info!(
                        group = self.node.config().name,
                        "no member applied the last step: its sum is dropped"
                    );
                    self.emit(MemberEvent::DroppedPending);
                }
            }
        }
        if self.group_steps() != m.start.steps || self.learner.hash() != m.start.hash {
            return Err(MemberError::Invalid(format!(
                "after catching up, step {} parameters {} differ from the group's step {} parameters {}",
                self.group_steps(),
                hex8(&self.learner.hash()),
                m.start.steps,
                hex8(&m.start.hash)
            )));
        }
        Ok(())
    }

    fn ring_loop(&mut self, m: &mut Membership) -> Ended<L::Error> {
        match self.cfg.mode {
            Mode::Sync => self.sync_loop(m),
            Mode::Diloco { .. } => self.diloco_loop(m),
        }
    }
}
