//! The training loop of a group member (a server alone is a group of one): form an epoch,
//! catch up as the proposer decided, then heartbeat and step in the ring until it
//! dissolves or fails, and form the next. See [`crate::collective::group`] for the
//! protocol and why every member applies the same steps.
//!
//! A step here: the trainer's unnormalised gradient on the groups this member holds (none
//! is fine), the stats round, the gradient round, the commit round, then
//! [`Trainer::apply`] on the sums, the ledger, the engine's new weights and the metrics.
//! The member keeps its own gradient until the step is applied (a failed step is retried
//! from it in the next ring) and a summed gradient whose commit it did not see finish
//! (applied if another member applied it).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

mod diloco;

use super::group_state::{install_state, parameter_hash, state_bytes};
use super::train::{
    append_consumed, consumed_upto, unconsumed_episodes, CollectiveSettings, TrainSettings,
    TrainerInput,
};
use super::{ServedModel, TrainingError};
use crate::base::{lock, StopMode};
use crate::collective::group::{Action, GroupError, GroupNode, MemberState, Membership, Start};
use crate::collective::RoundStats;
use crate::swarm::GroupStatus;
use crate::train::checkpoint::RunDir;
use crate::train::groups::{next_batch, Group, GroupBuffer, ReadyReport};
use crate::train::outer::Outer;
use crate::train::trainer::{LocalGradient, Prepared, StepMetrics, Trainer};
use crate::train::TrainError;

/// A step computed here and not applied yet.
struct Held {
    prepared: Prepared,
    local: LocalGradient,
    /// The groups and report it was computed from (back to the ready list if the step
    /// is given up: a member that syncs to the group's state).
    groups: Vec<Group>,
    report: ReadyReport,
}

/// How a ring ended.
enum Ended {
    /// Dissolved cleanly at a heartbeat (a new epoch, or this member stops).
    Dissolved,
    /// A round failed: `0` says which.
    Failed(GroupError),
}

pub(super) struct MemberLoop<'a> {
    pub served: &'a ServedModel,
    pub trainer: Trainer,
    pub run_dir: &'a RunDir,
    pub s: &'a TrainSettings,
    pub rx: Receiver<TrainerInput>,
    pub buffer: GroupBuffer,
    pub node: GroupNode,
    pub last_saved: u64,
    ready: Vec<Group>,
    report: ReadyReport,
    held: Option<Held>,
    /// The group's summed gradient and stats of step `steps + 1`, commit unseen.
    pending: Option<(Vec<f32>, Vec<f32>)>,
    stop: Option<StopMode>,
    hash: [u8; 32],
    last_round: Option<(RoundStats, usize)>,
    /// Every episode id the ledger held at start, until the first epoch settles it.
    unsettled: Option<HashSet<String>>,
    /// DiLoCo mode: the outer optimizer (none: synchronous).
    outer: Option<Outer>,
    /// DiLoCo mode: this member's delta of the next outer step, until it is applied.
    held_delta: Option<Vec<f32>>,
}

/// One input of the training thread: an episode into `buffer`, or a stop (an abort
/// overrides a drain, never the other way).
fn take_input(input: TrainerInput, buffer: &mut GroupBuffer, stop: &mut Option<StopMode>) {
    match input {
        TrainerInput::Stop(mode) => {
            if *stop != Some(StopMode::Abort) {
                *stop = Some(mode);
            }
        }
        TrainerInput::Episode(stored) => {
            let size = stored.manifest.group_size as usize;
            let ep = stored.episode();
            let id = ep.id.clone();
            if let Err(e) = buffer.add_sized(ep, (size > 0).then_some(size)) {
                // A resubmission of an episode already buffered: trained once.
                warn!(episode = id, "not buffered: {e}");
            }
        }
    }
}

fn merge(into: &mut ReadyReport, r: ReadyReport) {
    into.skipped_equal += r.skipped_equal;
    into.dropped_short += r.dropped_short;
    into.aborted += r.aborted;
    into.skipped_rewards.extend(r.skipped_rewards);
    into.taken.extend(r.taken);
}

fn hex8(h: &[u8; 32]) -> String {
    h[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl<'a> MemberLoop<'a> {
    pub fn new(
        served: &'a ServedModel,
        trainer: Trainer,
        run_dir: &'a RunDir,
        s: &'a TrainSettings,
        rx: Receiver<TrainerInput>,
        buffer: GroupBuffer,
        node: GroupNode,
    ) -> Result<MemberLoop<'a>, TrainingError> {
        let outer = match s.outer {
            Some(cfg) => Some(diloco::resume(&trainer, cfg, run_dir)?),
            None => None,
        };
        let hash = parameter_hash(&trainer, outer.as_ref())?;
        let last_saved = trainer.steps();
        Ok(MemberLoop {
            served,
            trainer,
            run_dir,
            s,
            rx,
            buffer,
            node,
            last_saved,
            ready: Vec::new(),
            report: ReadyReport::default(),
            held: None,
            pending: None,
            stop: None,
            hash,
            last_round: None,
            unsettled: None,
            outer,
            held_delta: None,
        })
    }

    /// After the first epoch, settles the ledger lines of steps after the checkpoint.
    pub fn settle_after_first_epoch(mut self, ledger: HashSet<String>) -> Self {
        self.unsettled = Some(ledger);
        self
    }

    /// The ledger's steps beyond the step this member goes on from are lost (their
    /// episodes are trained again); steps up to it are kept: either this member's own
    /// checkpoint holds them, or the group's state it fetched does.
    fn settle(&mut self) -> Result<(), TrainingError> {
        let Some(before) = self.unsettled.take() else {
            return Ok(());
        };
        let kept = consumed_upto(&self.run_dir.dir, self.trainer.steps())?;
        // (In DiLoCo mode the trainer is at its last outer step here: inner steps after
        // it are lost with the restart, and their episodes trained again.)
        let lost: Vec<_> = unconsumed_episodes(self.served, &kept)?
            .into_iter()
            .filter(|e| before.contains(&e.manifest.episode_id))
            .collect();
        if !lost.is_empty() {
            println!(
                "training: {} stored episodes not trained yet are fed to the trainer again",
                lost.len()
            );
        }
        for stored in lost {
            let size = stored.manifest.group_size as usize;
            let _ = self
                .buffer
                .add_sized(stored.episode(), (size > 0).then_some(size));
        }
        Ok(())
    }

    fn cs(&self) -> &CollectiveSettings {
        &self.s.collective
    }

    /// The group's step count at this member: its optimizer steps, or in DiLoCo mode its
    /// outer steps (the policy version).
    fn group_steps(&self) -> u64 {
        match self.outer {
            Some(_) => self.trainer.version(),
            None => self.trainer.steps(),
        }
    }

    fn state(&self) -> MemberState {
        MemberState {
            steps: self.group_steps(),
            version: self.trainer.version(),
            hash: self.hash,
            values: self.trainer.gradient_len() as u64,
            pending: self.pending.is_some(),
            held: self.held.is_some() || self.held_delta.is_some(),
        }
    }

    fn publish(&self, m: Option<&Membership>) {
        let (allreduce_ms, allreduce_gbps) = match &self.last_round {
            Some((r, values)) => (
                r.seconds * 1e3,
                r.bus_bandwidth(*values, m.map_or(1, |m| m.size())) / 1e9,
            ),
            None => (0.0, 0.0),
        };
        *lock(&self.served.group) = Some(GroupStatus {
            name: self.node.config().name.clone(),
            epoch: m.map_or(0, |m| m.epoch()),
            members: m.map_or(0, |m| m.size() as u32),
            param_hash: hex8(&self.hash),
            allreduce_ms,
            allreduce_gbps,
            mode: self.node.config().mode.clone(),
        });
    }

    /// Takes what arrived (waiting up to `wait` for the first input).
    fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let input = if left.is_zero() {
                match self.rx.try_recv() {
                    Ok(i) => i,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        self.stop.get_or_insert(StopMode::Drain);
                        return;
                    }
                }
            } else {
                match self.rx.recv_timeout(left) {
                    Ok(i) => i,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        self.stop.get_or_insert(StopMode::Drain);
                        return;
                    }
                }
            };
            self.handle(input);
        }
    }

    fn handle(&mut self, input: TrainerInput) {
        take_input(input, &mut self.buffer, &mut self.stop);
    }

    /// Like [`MemberLoop::pump`], but returns as soon as one input arrived (and took
    /// whatever else was already there).
    fn pump_until_input(&mut self, wait: Duration) {
        match self.rx.recv_timeout(wait) {
            Ok(i) => {
                self.handle(i);
                self.pump(Duration::ZERO);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                self.stop.get_or_insert(StopMode::Drain);
            }
        }
    }

    /// Moves the buffer's trainable groups to the ready list. Episodes taken that no step
    /// will train (groups without signal, groups dropped short, aborted episodes, extras
    /// beyond a group's size) go to the ledger at once: no step may follow to record them
    /// (the last groups of a run), and a member would otherwise hold them unconsumed. If
    /// the ledger cannot be written they wait for the next step's lines, as before.
    fn take_ready(&mut self) {
        let (groups, mut r) = self.buffer.take_ready(Instant::now());
        let trained: HashSet<&str> = groups
            .iter()
            .flat_map(|g| g.episodes.iter().map(|e| e.id.as_str()))
            .collect();
        let (kept, untrained): (Vec<String>, Vec<String>) = std::mem::take(&mut r.taken)
            .into_iter()
            .partition(|id| trained.contains(id.as_str()));
        r.taken = kept;
        if !untrained.is_empty() {
            if let Err(e) = append_consumed(&self.run_dir.dir, self.trainer.steps(), &untrained) {
                warn!(model = self.served.name, "the ledger: {e}");
                r.taken.extend(untrained);
            }
        }
        self.ready.extend(groups);
        merge(&mut self.report, r);
    }

    /// The next step's groups: at most `max_groups_per_step`, oldest first, with their
    /// share of the report ([`next_batch`]).
    fn next_batch(&mut self) -> (Vec<Group>, ReadyReport) {
        let cap = self.s.max_groups_per_step.max(self.s.groups_per_step);
        next_batch(&mut self.ready, &mut self.report, cap)
    }

    /// Runs until the role stops (or the group cannot go on).
    pub fn run(mut self) -> Result<(), TrainingError> {
        loop {
            if let Some(mode) = self.stop {
                return self.finish(mode);
            }
            self.publish(None);
            let state = self.state();
            let agreed = {
                let (node, rx, buffer, stop) =
                    (&mut self.node, &self.rx, &mut self.buffer, &mut self.stop);
                let mut stopped = || {
                    while let Ok(i) = rx.try_recv() {
                        take_input(i, buffer, stop);
                    }
                    stop.is_some()
                };
                node.agree(&state, &mut stopped)
            };
            let start = match agreed {
                Ok(s) => s,
                Err(GroupError::Stopped) => continue,
                Err(e @ GroupError::Refused(_)) if self.stop.is_none() => {
                    error!(model = self.served.name, "{e}");
                    eprintln!("training of {:?}: {e}", self.served.name);
                    *lock(&self.served.group) = None;
                    self.node.leave();
                    return Err(TrainError::Invalid(e.to_string()).into());
                }
                Err(e) => {
                    warn!(model = self.served.name, "forming an epoch: {e}");
                    continue;
                }
            };
            if let Err(e) = self.sync_or_offer(&start) {
                warn!(model = self.served.name, "state transfer: {e}");
                continue;
            }
            let mut m = match self.node.build(start) {
                Ok(m) => m,
                Err(e) => {
                    warn!(model = self.served.name, "building the ring: {e}");
                    std::thread::sleep(Duration::from_millis(200));
                    continue;
                }
            };
            if let Err(e) = self.catch_up(&m).and_then(|()| self.settle()) {
                *lock(&self.served.group) = None;
                self.node.leave();
                return Err(e);
            }
            self.publish(Some(&m));
            println!(
                "group {:?}: epoch {} with {} member(s), step {}, parameters {}",
                self.served.name,
                m.epoch(),
                m.size(),
                self.group_steps(),
                hex8(&self.hash)
            );
            let ended = if m.start.retry {
                match self.step_round(&mut m) {
                    Ok(()) => self.ring_loop(&mut m),
                    Err(e) => Ended::Failed(e),
                }
            } else {
                self.ring_loop(&mut m)
            };
            match ended {
                Ended::Dissolved => info!(model = self.served.name, "the ring dissolved"),
                Ended::Failed(GroupError::Ring(e)) => {
                    warn!(
                        model = self.served.name,
                        epoch = m.epoch(),
                        "a round failed: {e}"
                    );
                    println!(
                        "group {:?}: a round of epoch {} failed ({e}); forming the next",
                        self.served.name,
                        m.epoch()
                    );
                }
                Ended::Failed(e) => return Err(TrainError::Invalid(e.to_string()).into()),
            }
        }
    }

    /// Before the ring: a Sync member fetches the group's state and installs it; the
    /// others offer theirs when some member syncs.
    fn sync_or_offer(&mut self, start: &Start) -> Result<(), TrainingError> {
        let syncing = start.actions.contains(&Action::Sync);
        match self.node.action_in(start) {
            Some(Action::Sync) => {
                let t0 = Instant::now();
                let why = if self.group_steps() == start.steps && self.hash != start.hash {
                    format!(
                        "its parameters {} differ from the group's {} at that step",
                        hex8(&self.hash),
                        hex8(&start.hash)
                    )
                } else {
                    format!("it is at step {}", self.group_steps())
                };
                println!(
                    "group {:?}: fetching the group's state (step {}) from its members: {why}",
                    self.served.name, start.steps
                );
                let bytes = self
                    .node
                    .fetch_state(start)
                    .map_err(|e| TrainError::Invalid(e.to_string()))?;
                // Its own step in progress is given up: its groups go back to the list.
                if let Some(h) = self.held.take() {
                    self.ready.extend(h.groups);
                    merge(&mut self.report, h.report);
                }
                self.pending = None;
                self.held_delta = None;
                let momentum = install_state(&mut self.trainer, &bytes)?;
                if let Some(o) = &mut self.outer {
                    o.reanchor(&self.trainer, momentum);
                }
                self.hash = parameter_hash(&self.trainer, self.outer.as_ref())?;
                if self.hash != start.hash || self.group_steps() != start.steps {
                    return Err(TrainError::Invalid(format!(
                        "the fetched state has step {} parameters {}, the group step {} parameters {}",
                        self.group_steps(),
                        hex8(&self.hash),
                        start.steps,
                        hex8(&start.hash)
                    ))
                    .into());
                }
                self.serve_trained()?;
                self.save()?;
                println!(
                    "group {:?}: joined at step {} (policy version {}), {} bytes in {:.2} s",
                    self.served.name,
                    self.group_steps(),
                    self.trainer.version(),
                    bytes.len(),
                    t0.elapsed().as_secs_f64()
                );
            }
            Some(_) if syncing => {
                let bytes = state_bytes(&self.trainer, self.outer.as_ref())?;
                self.node.offer_state(bytes, self.group_steps(), self.hash);
            }
            _ => {}
        }
        Ok(())
    }

    /// Does what the proposer decided this member does first; checks the parameters.
    fn catch_up(&mut self, m: &Membership) -> Result<(), TrainingError> {
        match m.action() {
            Action::ApplyPending => {
                let (grad, stats) = self.pending.take().ok_or_else(|| {
                    TrainError::Invalid("told to apply a pending sum it does not hold".into())
                })?;
                info!(
                    model = self.served.name,
                    "applying the step another member applied"
                );
                self.apply(&grad, &stats, m.size())?;
            }
            // Done before the ring was built.
            Action::Sync => {}
            Action::Ready => {
                if self.pending.take().is_some() {
                    info!(
                        model = self.served.name,
                        "no member applied the last step: its sum is dropped"
                    );
                }
            }
        }
        if self.group_steps() != m.start.steps || self.hash != m.start.hash {
            return Err(TrainError::Invalid(format!(
                "after catching up, step {} parameters {} differ from the group's step {} parameters {}",
                self.group_steps(),
                hex8(&self.hash),
                m.start.steps,
                hex8(&m.start.hash)
            ))
            .into());
        }
        Ok(())
    }

    fn ring_loop(&mut self, m: &mut Membership) -> Ended {
        if self.outer.is_some() {
            return self.diloco_loop(m);
        }
        loop {
            if m.size() == 1 {
                // Alone: no one to wait for, so no heartbeat period (a step starts as
                // soon as the groups are there); newcomers are still looked for.
                self.pump_until_input(self.cs().heartbeat);
            } else {
                self.pump(self.cs().heartbeat);
            }
            self.take_ready();
            let beat = match self
                .node
                .heartbeat(m, self.ready.len(), self.stop.is_some())
            {
                Ok(b) => b,
                Err(e) => return Ended::Failed(e),
            };
            if beat.dissolve {
                return Ended::Dissolved;
            }
            if beat.ready >= self.s.groups_per_step.max(1) as f64 {
                let before = self.group_steps();
                if let Err(e) = self.step_round(m) {
                    return Ended::Failed(e);
                }
                if let Some(end) = self.check_hashes(m, before) {
                    return end;
                }
            }
        }
    }

    /// After a round that may have applied a step (from group step `before`): every
    /// `hash_every` group steps the members compare parameter hashes; if they differ the
    /// ring dissolves everywhere, and the next epoch re-syncs the members off the
    /// majority's hash.
    fn check_hashes(&mut self, m: &mut Membership, before: u64) -> Option<Ended> {
        let (every, now) = (self.cs().hash_every, self.group_steps());
        if every == 0 || now == before || now % every != 0 || m.size() < 2 {
            return None;
        }
        match self.node.hashes_agree(m, &self.hash) {
            Ok(true) => None,
            Ok(false) => {
                warn!(
                    model = self.served.name,
                    step = now,
                    "the members' parameter hashes differ"
                );
                println!(
                    "group {:?}: the members' parameter hashes differ at step {now} (mine {}); \
                     forming the next epoch, whose members off the majority re-sync",
                    self.served.name,
                    hex8(&self.hash)
                );
                Some(Ended::Dissolved)
            }
            Err(e) => Some(Ended::Failed(e)),
        }
    }

    /// One step in ring `m`: from the gradient held (a retry) or the groups ready now.
    fn step_round(&mut self, m: &mut Membership) -> Result<(), GroupError> {
        if self.outer.is_some() {
            return self.outer_round(m);
        }
        if m.size() == 1 && self.held.is_none() {
            self.solo_step()
                .map_err(|e| GroupError::Refused(e.to_string()))?;
            self.publish(Some(m));
            return Ok(());
        }
        let held = match self.held.take() {
            Some(h) => h,
            None => {
                let (groups, rep) = self.next_batch();
                info!(
                    step = self.trainer.steps() + 1,
                    groups = groups.len(),
                    members = m.size(),
                    "training step started"
                );
                let computed = self
                    .trainer
                    .prepare(&groups, &rep)
                    .and_then(|p| Ok((self.trainer.gradient(&p)?, p)));
                let (local, prepared) = match computed {
                    Ok(x) => x,
                    Err(e) => {
                        // This member cannot contribute: it leaves the ring (its groups
                        // are dropped, their episodes stay stored).
                        error!(model = self.served.name, "computing the gradient: {e}");
                        return Err(GroupError::Refused(format!("computing the gradient: {e}")));
                    }
                };
                Held {
                    prepared,
                    local,
                    groups,
                    report: rep,
                }
            }
        };
        let (stats, grad) = (held.local.stats.clone(), held.local.grad.clone());
        self.held = Some(held);
        self.sum_and_commit(m, stats, grad)
    }

    /// A step's rounds in ring `m` after its local parts: the stats, the values (with the
    /// test pause) and the commit. Applies the sums when every member commits; keeps them
    /// as pending when the commit's outcome is unknown here. (Both modes: the values are
    /// gradients, or DiLoCo's deltas.)
    fn sum_and_commit(
        &mut self,
        m: &mut Membership,
        mut stats: Vec<f32>,
        mut values: Vec<f32>,
    ) -> Result<(), GroupError> {
        self.node.sum(m, &mut stats, crate::collective::Wire::F32)?;
        m.ring.midway_pause = self.cs().midway_pause;
        let round = self.node.sum(m, &mut values, self.cs().wire);
        m.ring.midway_pause = None;
        let round = round?;
        self.last_round = Some((round, values.len()));
        match self.node.commit(m) {
            Ok(true) => {
                self.apply(&values, &stats, m.size())
                    .map_err(|e| GroupError::Refused(e.to_string()))?;
                self.publish(Some(m));
                Ok(())
            }
            Ok(false) => {
                info!(
                    model = self.served.name,
                    "a member did not commit: the step is retried"
                );
                Ok(())
            }
            Err(e) => {
                self.pending = Some((values, stats));
                Err(e)
            }
        }
    }

    /// Applies the summed gradient to the held step, then the ledger, engine and metrics.
    fn apply(&mut self, grad: &[f32], stats: &[f32], members: usize) -> Result<(), TrainingError> {
        if self.outer.is_some() {
            return self.apply_outer(grad, stats, members);
        }
        let held = self
            .held
            .take()
            .ok_or_else(|| TrainError::Invalid("a sum to apply but no step held".into()))?;
        let m: StepMetrics = self.trainer.apply(held.prepared, grad, stats)?;
        self.after_step(m, &held.report.taken, members)
    }

    /// A step of a group of one: the trainer's own step (no flat copies of the gradient).
    fn solo_step(&mut self) -> Result<(), TrainingError> {
        let (groups, rep) = self.next_batch();
        info!(
            step = self.trainer.steps() + 1,
            groups = groups.len(),
            members = 1,
            "training step started"
        );
        self.last_round = None;
        let m = self.trainer.step(&groups, &rep)?;
        self.after_step(m, &rep.taken, 1)
    }

    /// The ledger, the engine's new weights, the metrics and the checkpoint after a step.
    fn after_step(
        &mut self,
        mut m: StepMetrics,
        taken: &[String],
        members: usize,
    ) -> Result<(), TrainingError> {
        m.members = members;
        m.allreduce_seconds = self.last_round.map_or(0.0, |(r, _)| r.seconds);
        if self.cs().perturb_at == Some(self.trainer.steps()) {
            // Tests only: a silent drift of this member's parameters.
            let p = self.trainer.model.parameters();
            tch::no_grad(|| {
                let _ = p[0].view([-1]).narrow(0, 0, 1).f_add_scalar_(1e-3);
            });
            warn!(model = self.served.name, "test hook: parameters perturbed");
        }
        self.hash = parameter_hash(&self.trainer, None)?;
        m.param_hash = Some(self.hash.iter().map(|b| format!("{b:02x}")).collect());
        append_consumed(&self.run_dir.dir, self.trainer.steps(), taken)?;
        self.serve_trained()?;
        self.record(&m)?;
        if self.trainer.steps() % self.s.checkpoint_every.max(1) == 0 {
            self.save()?;
        }
        Ok(())
    }

    /// A step's line on stdout, in the log, in `metrics.jsonl` and on the reward curve.
    fn record(&self, m: &StepMetrics) -> Result<(), TrainingError> {
        println!("train {}", m.line());
        info!(
            step = m.step,
            version = m.version,
            reward = m.reward_mean,
            members = m.members,
            hash = hex8(&self.hash),
            "trained"
        );
        self.run_dir.append(m)?;
        if let Ok(all) = self.run_dir.metrics() {
            let title = format!(
                "{}: mean training reward per step (AgentJet server)",
                self.served.name
            );
            let svg = crate::train::plot::reward_svg(&title, &all, None);
            let _ = std::fs::write(self.run_dir.dir.join("reward.svg"), svg);
        }
        // Every curve as its own SVG in `plots/` (each step at first, then every tenth).
        if m.step <= 20 || m.step % 10 == 0 {
            let run = crate::dash::RunRef::new(&self.run_dir.dir, crate::dash::RunKind::Train);
            if let Err(e) = crate::dash::runs::write_plots(&run) {
                warn!("plots of {}: {e}", run.dir.display());
            }
        }
        Ok(())
    }

    /// The engine serves the trainer's weights under its version; the status says its step.
    fn serve_trained(&self) -> Result<(), TrainingError> {
        self.served
            .engine
            .update_weights(&self.trainer.model.parameters(), self.trainer.version())?;
        self.served
            .train_step
            .store(self.trainer.steps(), Ordering::Relaxed);
        Ok(())
    }

    /// The checkpoint (in DiLoCo mode with the outer momentum: call it only at an outer
    /// step, when the trainer holds the anchor).
    fn save(&mut self) -> Result<(), TrainError> {
        let tensors = self.outer.as_ref().map(diloco::saved).unwrap_or_default();
        self.run_dir.save_with(
            &self.trainer,
            &self.served.card,
            serde_json::json!({}),
            &tensors,
        )?;
        self.last_saved = self.trainer.steps();
        Ok(())
    }

    fn finish(mut self, mode: StopMode) -> Result<(), TrainingError> {
        self.node.leave();
        *lock(&self.served.group) = None;
        match mode {
            StopMode::Abort => {
                println!(
                    "training: aborted at step {} (checkpoint of step {} kept)",
                    self.trainer.steps(),
                    self.last_saved
                );
            }
            StopMode::Drain => {
                // DiLoCo: inner steps since the last outer step are the member's own;
                // the checkpoint holds the group's state (their episodes are trained
                // again after a restart).
                self.rewind_to_anchor()?;
                if self.trainer.steps() != self.last_saved {
                    self.save()?;
                    println!(
                        "training: checkpoint at step {} saved on stop",
                        self.trainer.steps()
                    );
                }
            }
        }
        Ok(())
    }
}
