//! DiLoCo mode of the server's learner (`--sync-every H`): inner steps on this member's
//! own episodes (its own AdamW, its own loss normalisation, no all-reduce), then an outer
//! step with the whole group (see [`crate::train::outer`]); when the member loop runs them
//! is in [`crate::collective::member`].
//!
//! The engine serves only the group's parameters: after an outer step, under the next
//! policy version (versions count outer steps). A call sampled between outer steps carries
//! the last outer step's version and was sampled with exactly those weights, at every
//! member; the inner steps' drift is never served. The inner steps' lines in
//! `metrics.jsonl` carry that version too and no parameter hash (their parameters are
//! the member's own); each outer step appends a line to `outer.jsonl` with the group's
//! parameter hash. Checkpoints are taken at outer steps only (a drain rewinds to the last
//! one): inner steps after it are lost with a restart, and their episodes trained again.

use tracing::info;

use super::ServerLearner;
use crate::collective::member::{hex8, Applied};
use crate::server::error::TrainingError;
use crate::server::events::ServerEvent;
use crate::server::group_state::parameter_hash;
use crate::server::ledger::append_consumed;
use crate::train::outer::Outer;
use crate::train::TrainError;

impl ServerLearner<'_> {
    pub(super) fn outer(&self) -> Result<&Outer, TrainError> {
        self.outer
            .as_ref()
            .ok_or_else(|| TrainError::Invalid("not in DiLoCo mode".into()))
    }

    fn every(&self) -> u64 {
        self.outer.as_ref().map_or(1, |o| o.cfg.every.max(1))
    }

    /// One inner step on the groups this member holds: its own, not served.
    pub(super) fn diloco_inner_step(&mut self) -> Result<(), TrainingError> {
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
        // The metrics line first: once the ledger names an episode, the step that took
        // it is recorded.
        self.record(&metrics)?;
        append_consumed(&self.run_dir.dir, self.trainer.steps(), &rep.taken)?;
        Ok(())
    }

    /// The outer step from the summed deltas and weights; serves the new version.
    pub(super) fn diloco_outer_step(
        &mut self,
        sum: &[f32],
        contributors: usize,
        by: Applied,
    ) -> Result<(), TrainingError> {
        let every = self.every();
        let o = self
            .outer
            .as_mut()
            .ok_or_else(|| TrainError::Invalid("not in DiLoCo mode".into()))?;
        // No member trained: a zero outer gradient (the momentum still moves).
        let step = o.step(&mut self.trainer, sum, contributors.max(1))?;
        if step.refused {
            tracing::warn!(
                norm = step.norm,
                contributors,
                "the members' summed deltas hold a non-finite value: the outer step is refused, the parameters stay the last outer step's"
            );
        } else if let Some(to) = step.clipped_to {
            tracing::warn!(
                norm = step.norm,
                clipped_to = to,
                "the members' mean delta is above the outer clip: scaled down"
            );
        }
        let v = self.trainer.version() + 1;
        self.trainer.set_counters(v * every, v);
        self.hash = parameter_hash(&self.trainer, self.outer.as_ref())?;
        self.serve_trained()?;
        self.publish();
        let (seconds, bytes_sent) = by.round.map_or((0.0, 0), |r| (r.seconds, r.bytes_sent));
        let members = by.members;
        let line = serde_json::json!({
            "outer_step": v,
            "version": v,
            "step": v * every,
            "members": members,
            "contributors": contributors,
            "param_hash": self.hash.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            "allreduce_seconds": seconds,
            "bytes_sent": bytes_sent,
            "delta_norm": step.norm.is_finite().then_some(step.norm),
            "clipped_to": step.clipped_to,
            "refused": step.refused,
        });
        let path = self.run_dir.dir.join("outer.jsonl");
        crate::base::files::append_durable(&path, format!("{line}\n").as_bytes())
            .map_err(|e| TrainError::file(&path, e))?;
        println!(
            "outer step {v}: {members} member(s), {contributors} contributed, parameters {}",
            hex8(&self.hash)
        );
        self.served.events.emit(ServerEvent::OuterStep {
            version: v,
            members,
            contributors,
            params: hex8(&self.hash),
        });
        info!(
            outer_step = v,
            members,
            contributors,
            hash = hex8(&self.hash),
            "outer step applied"
        );
        if v % self.s.checkpoint_every.max(1) == 0 {
            self.save()?;
            self.saved(false);
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
        Ok(())
    }
}
