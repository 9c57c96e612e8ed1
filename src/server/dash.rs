//! What a server shows on its dashboard ([`crate::dash`]): its models' training runs, the
//! engine's metrics and the trainer's last figures.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};

use super::ServedModel;
use crate::dash::runs::{read_lines, with_scanned};
use crate::dash::{DashSource, Prom, RunKind, RunRef};
use crate::facade::{Backend, LocalBackend};

pub(super) struct ServerDash {
    pub backend: LocalBackend,
    /// Every model this server serves (several with `--adapter`), each with its training
    /// run (none: serving only).
    pub models: Vec<(Arc<ServedModel>, Option<RunRef>)>,
    pub data_dir: PathBuf,
}

/// Figures of the last line of `metrics.jsonl` a scrape reports (metric, help, field).
const TRAIN_GAUGES: &[(&str, &str, &str)] = &[
    (
        "agentjet_train_reward_mean",
        "Mean reward of the last step's episodes.",
        "reward_mean",
    ),
    ("agentjet_train_loss", "Loss of the last step.", "loss"),
    (
        "agentjet_train_kl",
        "KL to the reference policy at the last step.",
        "kl",
    ),
    (
        "agentjet_train_entropy",
        "Entropy of the last step's trained tokens (nats/token).",
        "entropy",
    ),
    (
        "agentjet_train_clip_fraction",
        "Share of tokens whose ratio was clipped at the last step.",
        "clip_frac",
    ),
    (
        "agentjet_train_grad_norm",
        "Gradient norm of the last step.",
        "grad_norm",
    ),
    (
        "agentjet_train_tokens_per_second",
        "Trained tokens per second of the last step.",
        "tokens_per_s",
    ),
    (
        "agentjet_train_group_members",
        "Members of the training group at the last step.",
        "members",
    ),
];

/// The last line of a run's `metrics.jsonl`.
fn last_line(run: &RunRef) -> Option<Value> {
    // The tail is enough for the last line.
    read_lines(&run.points_path(), 0, 64 << 10)
        .ok()?
        .points
        .pop()
}

impl DashSource for ServerDash {
    fn live(&self) -> Value {
        let models: Vec<Value> = self
            .models
            .iter()
            .map(|(m, run)| {
                json!({
                    "model": m.name,
                    "run": run.as_ref().map(|r| r.name.clone()),
                    "train_step": m.train_step.load(Ordering::Relaxed),
                    "weights": m.broadcast.get().and_then(|b| b.current(None)).map(|w| json!({
                        "follower": w.follower,
                        "group": w.group,
                        "version": w.version,
                        "lag": w.lag,
                        "param_hash": w.param_hash,
                        "fetched_bytes": w.fetched_bytes,
                        "served_bytes": w.served_bytes,
                    })),
                })
            })
            .collect();
        // The first model's figures at the top, as a server of one model shows them.
        let mut live = models.first().cloned().unwrap_or_else(|| json!({}));
        live["kind"] = json!("server");
        live["models"] = Value::Array(models);
        live
    }

    fn runs(&self) -> Vec<RunRef> {
        let own = self.models.iter().filter_map(|(_, r)| r.clone()).collect();
        with_scanned(own, &self.data_dir)
    }

    fn metrics(&self, p: &mut Prom) {
        self.backend.metrics(p);
        for (served, run) in &self.models {
            let model = [("model", served.name.as_str())];
            p.counter(
                "agentjet_train_steps_total",
                "Optimizer steps this server's trainer took (DiLoCo: inner steps).",
                &model,
                served.train_step.load(Ordering::Relaxed) as f64,
            );
            if let Some(w) = served.broadcast.get().and_then(|b| b.current(None)) {
                p.gauge(
                    "agentjet_weights_version",
                    "The policy version this server holds and serves chunks of (weight broadcast).",
                    &model,
                    w.version as f64,
                );
                p.gauge(
                    "agentjet_weights_lag",
                    "Versions this follower is behind the newest its group announces.",
                    &model,
                    w.lag as f64,
                );
                p.counter(
                    "agentjet_weights_fetched_bytes_total",
                    "Bytes of weight chunks fetched from other peers.",
                    &model,
                    w.fetched_bytes as f64,
                );
                p.counter(
                    "agentjet_weights_served_bytes_total",
                    "Bytes of weight chunks served to other peers (every model of this server).",
                    &model,
                    w.served_bytes as f64,
                );
            }
            if let Some(last) = run.as_ref().and_then(last_line) {
                for (name, help, field) in TRAIN_GAUGES {
                    if let Some(v) = last[*field].as_f64() {
                        p.gauge(name, help, &model, v);
                    }
                }
            }
        }
    }
}

impl ServerDash {
    /// The run directory of a training server's model, as the dashboard names it.
    pub fn training_run(dir: &std::path::Path) -> RunRef {
        RunRef::new(dir, RunKind::Train)
    }
}
