//! What a client shows on its dashboard ([`crate::dash`], with `--dashboard`): its run's
//! episodes (in flight and recent, with their logs), its calls' timelines, and its
//! episode counters in `/metrics`.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};

use super::backend::SwarmBackend;
use super::episodes::Stats;
use crate::dash::runs::with_scanned;
use crate::dash::{DashSource, Prom, RunRef};
use crate::facade::server::tracking_metrics;
use crate::facade::track::Tracker;
use crate::facade::Backend;

pub(super) struct ClientDash {
    pub backend: Arc<SwarmBackend>,
    pub tracker: Option<Arc<Tracker>>,
    pub stats: Arc<Stats>,
    /// The job's run (none: a proxy only) and its id.
    pub run: Option<(RunRef, String)>,
    pub data_dir: PathBuf,
}

impl DashSource for ClientDash {
    fn live(&self) -> Value {
        let c = self.stats.counts();
        let running: Vec<Value> = self
            .stats
            .in_flight()
            .into_iter()
            .map(|(id, task, source, started)| {
                let calls = self
                    .tracker
                    .as_ref()
                    .and_then(|t| t.peek(&id))
                    .map_or(0, |c| c.len());
                json!({"id": id, "task": task, "source": source,
                       "started_unix_ms": started, "calls": calls})
            })
            .collect();
        json!({
            "kind": "client",
            "run": self.run.as_ref().map(|(_, id)| id.clone()),
            "run_name": self.run.as_ref().map(|(r, _)| r.name.clone()),
            "running": running,
            "done": c.done,
            "aborted": c.aborted,
            "calls": c.calls,
            "models": self.backend.model_ids(),
        })
    }

    fn runs(&self) -> Vec<RunRef> {
        with_scanned(
            self.run.iter().map(|(r, _)| r.clone()).collect(),
            &self.data_dir,
        )
    }

    fn metrics(&self, p: &mut Prom) {
        self.backend.metrics(p);
        if let Some(t) = &self.tracker {
            tracking_metrics(t, p);
        }
        let c = self.stats.counts();
        let finished = c.done.saturating_sub(c.aborted);
        for (status, n) in [("finished", finished), ("aborted", c.aborted)] {
            p.counter(
                "agentjet_episodes_total",
                "Episodes this client ran to their end, by status.",
                &[("status", status)],
                n as f64,
            );
        }
        p.gauge(
            "agentjet_episodes_running",
            "Episodes running now.",
            &[],
            c.running as f64,
        );
        p.counter(
            "agentjet_episode_calls_total",
            "Model calls of ended episodes.",
            &[],
            c.calls as f64,
        );
        for (model, sum, n) in self.stats.rewards() {
            let l = [("model", model.as_str())];
            p.gauge(
                "agentjet_episode_reward_sum",
                "Sum of the rewards of finished episodes (divide by the count for the mean).",
                &l,
                sum,
            );
            p.counter(
                "agentjet_episode_reward_count",
                "Finished episodes with a reward.",
                &l,
                n as f64,
            );
        }
    }
}
