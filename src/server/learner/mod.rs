//! The server's [`Learner`]: its trainer, the episodes it hears, the engine it brings to
//! every new step, the ledger, the metrics and the checkpoints. The member loop
//! ([`crate::collective::member`], the same one netsim runs) drives it through the
//! group's rounds; a server alone is a group of one.
//!
//! A synchronous step here: the trainer's unnormalised gradient on the groups this member
//! holds (none is fine) is its contribution; the group's sums go to [`Trainer::apply`],
//! then the ledger, the engine's new weights and the metrics. A group of one takes the
//! trainer's own step (no flat copies; PPO's several updates per step need it). DiLoCo's
//! inner and outer steps are in [`diloco`].

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tracing::{info, warn};

mod diloco;
pub(super) mod events;
mod momentum;

use super::error::TrainingError;
use super::events::ServerEvent;
use super::group_state::{install_state, parameter_hash, state_bytes};
use super::ledger::{append_consumed, consumed_upto, unconsumed_episodes};
use super::served::ServedModel;
use super::settings::{TrainSettings, TrainerInput};
use crate::base::StopMode;
use crate::collective::member::{hex8, Applied, Contribution, Learner, StepCtx, Wait};
use crate::train::checkpoint::RunDir;
use crate::train::groups::{next_batch, Group, GroupBuffer, ReadyReport};
use crate::train::outer::Outer;
use crate::train::trainer::{LocalGradient, Prepared, StepMetrics, Trainer};
use crate::train::TrainError;

/// A synchronous step computed here and not applied yet, with the groups and report it was
/// computed from (back to the ready list if the step is given up).
pub(super) struct ServerStep {
    prepared: Prepared,
    groups: Vec<Group>,
    report: ReadyReport,
}

pub(super) struct ServerLearner<'a> {
    served: &'a ServedModel,
    trainer: Trainer,
    run_dir: &'a RunDir,
    s: &'a TrainSettings,
    rx: Receiver<TrainerInput>,
    buffer: GroupBuffer,
    ready: Vec<Group>,
    report: ReadyReport,
    stop: Option<StopMode>,
    hash: [u8; 32],
    /// The version (and parameter hash) last published to followers.
    published: Option<(u64, [u8; 32])>,
    last_saved: u64,
    /// Every episode id the ledger held at start, until the first epoch settles it.
    unsettled: Option<HashSet<String>>,
    /// DiLoCo mode: the outer optimizer (none: synchronous).
    outer: Option<Outer>,
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

impl<'a> ServerLearner<'a> {
    /// `ledger`: every episode id the ledger held at start; the first epoch settles it
    /// ([`ServerLearner::settle`]).
    pub fn new(
        served: &'a ServedModel,
        trainer: Trainer,
        run_dir: &'a RunDir,
        s: &'a TrainSettings,
        rx: Receiver<TrainerInput>,
        buffer: GroupBuffer,
        ledger: HashSet<String>,
    ) -> Result<ServerLearner<'a>, TrainingError> {
        let outer = match s.outer {
            Some(cfg) => Some(momentum::resume(&trainer, cfg, run_dir)?),
            None => None,
        };
        let hash = parameter_hash(&trainer, outer.as_ref())?;
        let last_saved = trainer.steps();
        Ok(ServerLearner {
            served,
            trainer,
            run_dir,
            s,
            rx,
            buffer,
            ready: Vec::new(),
            report: ReadyReport::default(),
            stop: None,
            hash,
            published: None,
            last_saved,
            unsettled: Some(ledger),
            outer,
        })
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
            self.served.events.emit(ServerEvent::Refed {
                episodes: lost.len(),
            });
        }
        for stored in lost {
            let size = stored.manifest.group_size as usize;
            let _ = self
                .buffer
                .add_sized(stored.episode(), (size > 0).then_some(size));
        }
        Ok(())
    }

    /// Takes what arrived (waiting up to `wait` for the first input).
    fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let input = if left.is_zero() {
                match self.rx.try_recv() {
                    Ok(i) => i,
                    Err(TryRecvError::Empty) => return,
                    Err(TryRecvError::Disconnected) => {
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
            take_input(input, &mut self.buffer, &mut self.stop);
        }
    }

    /// Like [`ServerLearner::pump`], but returns as soon as one input arrived (and took
    /// whatever else was already there).
    fn pump_until_input(&mut self, wait: Duration) {
        match self.rx.recv_timeout(wait) {
            Ok(i) => {
                take_input(i, &mut self.buffer, &mut self.stop);
                self.pump(Duration::ZERO);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                self.stop.get_or_insert(StopMode::Drain);
            }
        }
    }

    /// The next step's groups: at most `max_groups_per_step`, oldest first, with their
    /// share of the report ([`next_batch`]).
    fn next_batch(&mut self) -> (Vec<Group>, ReadyReport) {
        let cap = self.s.max_groups_per_step.max(self.s.groups_per_step);
        next_batch(&mut self.ready, &mut self.report, cap)
    }

    /// The ledger, the engine's new weights, the metrics and the checkpoint after a step.
    fn after_step(
        &mut self,
        mut m: StepMetrics,
        taken: &[String],
        by: Applied,
    ) -> Result<(), TrainingError> {
        m.members = by.members;
        m.allreduce_seconds = by.round.map_or(0.0, |r| r.seconds);
        if self.s.collective.perturb_at == Some(self.trainer.steps()) {
            // Tests only: a silent drift of this member's parameters.
            let p = self.trainer.model.parameters();
            tch::no_grad(|| {
                let _ = p[0].view([-1]).narrow(0, 0, 1).f_add_scalar_(1e-3);
            });
            warn!(model = self.served.name, "test hook: parameters perturbed");
        }
        self.hash = parameter_hash(&self.trainer, None)?;
        m.param_hash = Some(self.hash.iter().map(|b| format!("{b:02x}")).collect());
        self.serve_trained()?;
        if self.outer.is_none() {
            // In DiLoCo mode a version is an outer step's (published there).
            self.publish();
        }
        // The metrics line first: once the ledger names an episode, the step that took it
        // is recorded (a reader of both never sees the one without the other).
        self.record(&m)?;
        append_consumed(&self.run_dir.dir, self.trainer.steps(), taken)?;
        if self.trainer.steps() % self.s.checkpoint_every.max(1) == 0 {
            self.save()?;
            self.saved(false);
        }
        Ok(())
    }

    fn saved(&self, on_stop: bool) {
        self.served.events.emit(ServerEvent::CheckpointSaved {
            step: self.trainer.steps(),
            on_stop,
        });
    }

    /// A step's line on stdout, in the log, in `metrics.jsonl` and on the reward curve.
    fn record(&self, m: &StepMetrics) -> Result<(), TrainingError> {
        match self.served.adapter {
            // Several adapters train in one process: each line names its model.
            Some(_) => println!("train {} [{}]", m.line(), self.served.name),
            None => println!("train {}", m.line()),
        }
        info!(
            step = m.step,
            version = m.version,
            reward = m.reward_mean,
            members = m.members,
            hash = hex8(&self.hash),
            "trained"
        );
        self.run_dir.append(m)?;
        // After the metrics line: whoever sees the event finds the step in the file.
        self.served.events.emit(ServerEvent::TrainStep {
            model: self.served.name.clone(),
            step: m.step,
            version: m.version,
            trained: m.trained,
            members: m.members,
            reward_mean: m.reward_mean,
            params: m.param_hash.clone(),
        });
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

    /// The group's current version goes to the followers (weight broadcast), once per
    /// version, while the view shows followers of the model: a trainer nobody follows
    /// spends nothing on it (a follower that appears gets the version at the next
    /// heartbeat). In DiLoCo mode a version is the outer step's anchor.
    fn publish(&mut self) {
        let Some(b) = self.served.broadcast.get() else {
            return;
        };
        let version = self.trainer.version();
        // In DiLoCo mode `hash` follows the inner steps; a version is the anchor's.
        let same = match &self.outer {
            Some(_) => self.published.is_some_and(|(v, _)| v == version),
            None => self.published == Some((version, self.hash)),
        };
        if same
            || crate::collective::broadcast::follow::followers_of(
                &self.served.swarm,
                &self.served.name,
                &b.group,
            )
            .is_empty()
        {
            return;
        }
        let (params, hash): (Vec<tch::Tensor>, [u8; 32]) = match &self.outer {
            Some(o) => (
                o.anchor().iter().map(tch::Tensor::shallow_clone).collect(),
                super::group_state::hash_of(o.anchor()),
            ),
            None => (self.trainer.model.parameters(), self.hash),
        };
        b.publish(&params, version, &hash);
        self.published = Some((version, hash));
    }

    /// The engine serves the trainer's weights under its version; the status says its step.
    fn serve_trained(&self) -> Result<(), TrainingError> {
        self.served
            .serve_weights(&self.trainer.model.parameters(), self.trainer.version())?;
        self.served
            .train_step
            .store(self.trainer.steps(), Ordering::Relaxed);
        Ok(())
    }

    /// The checkpoint (in DiLoCo mode with the outer momentum: call it only at an outer
    /// step, when the trainer holds the anchor).
    fn save(&mut self) -> Result<(), TrainError> {
        let tensors = self.outer.as_ref().map(momentum::saved).unwrap_or_default();
        self.run_dir.save_with(
            &self.trainer,
            &self.served.card,
            serde_json::json!({}),
            &tensors,
        )?;
        self.last_saved = self.trainer.steps();
        Ok(())
    }

    fn started(&self, groups: usize, members: usize) {
        self.served.events.emit(ServerEvent::StepStarted {
            step: self.trainer.steps() + 1,
            members,
        });
        info!(
            step = self.trainer.steps() + 1,
            groups, members, "training step started"
        );
    }
}

impl Learner for ServerLearner<'_> {
    type Step = ServerStep;
    type Error = TrainingError;

    fn values(&self) -> u64 {
        self.trainer.gradient_len() as u64
    }
    fn steps(&self) -> u64 {
        self.trainer.steps()
    }
    fn version(&self) -> u64 {
        self.trainer.version()
    }
    fn hash(&self) -> [u8; 32] {
        self.hash
    }

    fn feed(&mut self, wait: Duration, how: Wait) {
        self.publish();
        match how {
            Wait::Full => self.pump(wait),
            Wait::UntilInput => self.pump_until_input(wait),
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

    fn ready(&self) -> usize {
        self.ready.len()
    }
    fn stop(&self) -> Option<StopMode> {
        self.stop
    }

    fn local_step(&mut self, at: StepCtx) -> Result<(ServerStep, Contribution), TrainingError> {
        let (groups, report) = self.next_batch();
        self.started(groups.len(), at.members);
        let prepared = self.trainer.prepare(&groups, &report)?;
        let LocalGradient { grad, stats } = self.trainer.gradient(&prepared)?;
        let step = ServerStep {
            prepared,
            groups,
            report,
        };
        Ok((
            step,
            Contribution {
                values: grad,
                stats,
            },
        ))
    }

    fn apply(
        &mut self,
        step: ServerStep,
        sum: &[f32],
        stats: &[f32],
        by: Applied,
    ) -> Result<(), TrainingError> {
        let m = self.trainer.apply(step.prepared, sum, stats)?;
        self.after_step(m, &step.report.taken, by)
    }

    /// The trainer's own step (no flat copies of the gradient; any number of updates).
    fn solo_step(&mut self, _at: StepCtx) -> Result<(), TrainingError> {
        let (groups, rep) = self.next_batch();
        self.started(groups.len(), 1);
        let m = self.trainer.step(&groups, &rep)?;
        let by = Applied {
            members: 1,
            round: None,
        };
        self.after_step(m, &rep.taken, by)
    }

    fn give_back(&mut self, step: ServerStep) {
        self.ready.extend(step.groups);
        merge(&mut self.report, step.report);
    }

    fn inner_step(&mut self, _at: StepCtx) -> Result<(), TrainingError> {
        self.diloco_inner_step()
    }

    fn delta(&mut self) -> Result<Vec<f32>, TrainingError> {
        Ok(self.outer()?.delta(&self.trainer)?)
    }

    fn outer_step(
        &mut self,
        sum: &[f32],
        contributors: usize,
        by: Applied,
    ) -> Result<(), TrainingError> {
        self.diloco_outer_step(sum, contributors, by)
    }

    fn export(&self) -> Result<Vec<u8>, TrainingError> {
        Ok(state_bytes(&self.trainer, self.outer.as_ref())?)
    }

    /// Installs the group's state, once checked against the group's step and parameter
    /// hash; the engine serves it and the checkpoint holds it.
    fn import(&mut self, bytes: &[u8], steps: u64, hash: &[u8; 32]) -> Result<(), TrainingError> {
        let every = self.outer.as_ref().map(|o| o.cfg.every);
        let momentum = install_state(&mut self.trainer, bytes, steps, every, hash)?;
        if let Some(o) = &mut self.outer {
            o.reanchor(&self.trainer, momentum);
        }
        self.hash = parameter_hash(&self.trainer, self.outer.as_ref())?;
        self.serve_trained()?;
        self.publish();
        self.save()?;
        Ok(())
    }

    fn formed(&mut self, _epoch: u64, _members: usize) -> Result<(), TrainingError> {
        self.settle()
    }

    fn finish(&mut self, mode: StopMode) -> Result<(), TrainingError> {
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
                    self.saved(true);
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
