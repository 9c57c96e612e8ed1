//! The client's episode loop (`agentjet-peer --role client --agent CMD --tasks FILE`):
//! draws tasks from the sources (by weight), runs `--num-repeat` episodes of each as one
//! group, at most `--concurrency` at once, each through [`super::runner`]; when an episode
//! ends, takes its tracked calls from the proxy, and submits each trainable model's
//! timeline (with that model's reward) to that model's providers, or reports it aborted
//! so its group still completes. `--dry-run` runs and records without submitting.
//!
//! `<run-dir>/episodes.jsonl` gets one line per episode (status, reward, calls, what each
//! server answered); `<run-dir>/episodes/` the agents' stdout/stderr. A progress line every
//! few seconds, a summary table at the end. Stops: a drain (first Ctrl-C or SIGTERM, or
//! the time limit) starts nothing new and lets running episodes finish and be submitted;
//! an abort (a second one) kills the running agents (their episodes are aborted and
//! reported, so their groups still complete on the servers).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::backend::SwarmBackend;
use super::error::ClientError;
use super::events::ClientEvent;
use super::runner::{run_agent, AgentOutcome, AgentSpec};
use super::submit::submit_to_model;
use super::tasks::{Schedule, Task};
use crate::base::events::Events;
use crate::base::stop::TaskTracker;
use crate::base::{lock, Stop};
use crate::facade::reward::PostedReward;
use crate::facade::server::Tracking;
use crate::facade::Backend;
use crate::rpc::SubmitReply;
use crate::swarm::{PeerId, SwarmHandle};
use crate::timeline::{Episode, EpisodeStatus};

/// What the loop runs.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub agent: AgentSpec,
    pub num_repeat: usize,
    pub concurrency: usize,
    /// Groups in all.
    pub groups: usize,
    pub dry_run: bool,
    pub run_dir: PathBuf,
    /// The trainable models (each episode's calls of them are submitted).
    pub models: Vec<String>,
    /// A name unique to this run (episode and group ids start with it).
    pub run_id: String,
    /// Seconds between progress lines.
    pub progress_every: Duration,
    /// The run's time limit, if any (progress then counts down to it, not to `groups`).
    pub time_limit: Option<Duration>,
    /// The client's events (the run's start, a drain, its end).
    pub events: Events<ClientEvent>,
}

#[derive(Default)]
struct ModelStats {
    rewards: Vec<f64>,
    submitted: usize,
    rejected: usize,
    failed: usize,
}

/// A run's live figures (the progress line, the summary and the dashboard read them).
#[derive(Default)]
pub struct Stats {
    done: AtomicUsize,
    running: AtomicUsize,
    aborted: AtomicUsize,
    calls: AtomicU64,
    per_model: Mutex<BTreeMap<String, ModelStats>>,
    reasons: Mutex<BTreeMap<String, usize>>,
    /// The episodes running now: id, task, source, start (Unix ms).
    in_flight: Mutex<BTreeMap<String, (String, String, u64)>>,
    per_source: Mutex<BTreeMap<String, SourceStats>>,
}

/// One task source's episodes: ended, aborted, and the rewards of the finished ones.
#[derive(Default)]
struct SourceStats {
    ended: usize,
    aborted: usize,
    rewards: Vec<f64>,
}

/// The counts of a run so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub done: usize,
    pub running: usize,
    pub aborted: usize,
    pub calls: u64,
}

impl Stats {
    pub fn counts(&self) -> Counts {
        Counts {
            done: self.done.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            aborted: self.aborted.load(Ordering::Relaxed),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }

    /// Per model: (sum, count) of the rewards of finished episodes.
    pub fn rewards(&self) -> Vec<(String, f64, usize)> {
        lock(&self.per_model)
            .iter()
            .map(|(m, s)| (m.clone(), s.rewards.iter().sum(), s.rewards.len()))
            .collect()
    }

    /// An ended episode's journal line, counted for its source.
    fn count_source(&self, source: &str, line: &Value) {
        let mut per = lock(&self.per_source);
        let s = per.entry(source.to_string()).or_default();
        s.ended += 1;
        if line["status"] == "aborted" {
            s.aborted += 1;
        } else {
            let rewards: Vec<f64> = match line["reward"].as_f64() {
                Some(r) => vec![r],
                None => line["rewards"]
                    .as_object()
                    .map(|m| m.values().filter_map(Value::as_f64).collect())
                    .unwrap_or_default(),
            };
            if !rewards.is_empty() {
                s.rewards
                    .push(rewards.iter().sum::<f64>() / rewards.len() as f64);
            }
        }
    }

    /// What the client gossips beside its episode count (`PeerStatus::extra`, shown on
    /// every peer's dashboard): episodes aborted, and per model and per task source the
    /// mean reward of the last 32 finished episodes.
    pub fn gossip_extra(&self) -> BTreeMap<String, String> {
        let recent = |v: &[f64]| {
            let w = &v[v.len().saturating_sub(32)..];
            w.iter().sum::<f64>() / w.len().max(1) as f64
        };
        let mut out = BTreeMap::new();
        out.insert(
            "aborted".to_string(),
            self.aborted.load(Ordering::Relaxed).to_string(),
        );
        for (m, s) in lock(&self.per_model).iter() {
            if !s.rewards.is_empty() {
                out.insert(format!("reward/{m}"), format!("{:.3}", recent(&s.rewards)));
            }
        }
        for (src, s) in lock(&self.per_source).iter().take(16) {
            let r = if s.rewards.is_empty() {
                "-".to_string()
            } else {
                format!("{:.3}", recent(&s.rewards))
            };
            out.insert(
                format!("source/{src}"),
                format!("{} episodes, {} aborted, reward {r}", s.ended, s.aborted),
            );
        }
        out
    }

    /// The episodes running now: (id, task, source, start in Unix ms).
    pub fn in_flight(&self) -> Vec<(String, String, String, u64)> {
        lock(&self.in_flight)
            .iter()
            .map(|(id, (task, source, t))| (id.clone(), task.clone(), source.clone(), *t))
            .collect()
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub episodes: usize,
    pub aborted: usize,
    /// Per model: (episodes submitted, mean reward of each quarter of the run, in order).
    pub models: BTreeMap<String, (usize, Vec<f64>)>,
    /// Per model: the tracker's (first calls, continued calls, breaks).
    pub timeline: BTreeMap<String, (u64, u64, u64)>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Runs the groups; returns when all are done or a stop ended them.
pub async fn run_episodes(
    cfg: RunConfig,
    mut schedule: Schedule,
    backend: Arc<SwarmBackend>,
    tracking: Tracking,
    stats: Arc<Stats>,
    stop: Stop,
) -> Result<Summary, ClientError> {
    let logs = cfg.run_dir.join("episodes");
    std::fs::create_dir_all(&logs).map_err(|e| ClientError::io(&logs, e))?;
    let mut agent = cfg.agent.clone();
    agent.logs = logs;
    let agent = Arc::new(agent);
    let journal_path = cfg.run_dir.join("episodes.jsonl");
    let journal = Arc::new(Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&journal_path)
            .map_err(|e| ClientError::io(&journal_path, e))?,
    ));
    let sem = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let t0 = Instant::now();
    println!(
        "running {} groups x {} episodes of `{}` ({} at once) from {} tasks; models {:?}{}; run dir {}",
        cfg.groups,
        cfg.num_repeat,
        cfg.agent.command,
        cfg.concurrency,
        schedule.total_tasks(),
        cfg.models,
        if cfg.dry_run { " (dry run: nothing is submitted)" } else { "" },
        cfg.run_dir.display()
    );
    cfg.events.emit(ClientEvent::Running {
        groups: cfg.groups,
        num_repeat: cfg.num_repeat,
        concurrency: cfg.concurrency,
        run_dir: cfg.run_dir.display().to_string(),
    });
    let progress = {
        let stats = stats.clone();
        let every = cfg.progress_every;
        let total = cfg.groups * cfg.num_repeat;
        let limit = cfg.time_limit;
        let run = crate::dash::RunRef::new(&cfg.run_dir, crate::dash::RunKind::Episodes);
        tokio::spawn(async move {
            let mut plotted = Instant::now();
            loop {
                tokio::time::sleep(every).await;
                println!("{}", progress_line(&stats, t0, total, limit));
                let _ = std::io::stdout().flush();
                if plotted.elapsed() >= PLOT_EVERY {
                    plotted = Instant::now();
                    write_plots(&run);
                }
            }
        })
    };
    let running = TaskTracker::new();
    'groups: for g in 0..cfg.groups {
        let (source, task) = schedule.next_task();
        // The source by its file name (no directory of this machine in the journal).
        let source = schedule.sources()[source].name.clone();
        let source = std::path::Path::new(&source)
            .file_name()
            .map_or(source.clone(), |f| f.to_string_lossy().into_owned());
        let group_id = format!("{}-g{g}-{}", cfg.run_id, task.id);
        for r in 0..cfg.num_repeat {
            let permit = tokio::select! {
                p = sem.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break 'groups, // never closed
                },
                _ = stop.requested() => break 'groups,
            };
            if stop.mode().is_some() {
                break 'groups;
            }
            let ep = EpisodeRun {
                id: format!("{}-g{g}-e{r}", cfg.run_id),
                group_id: group_id.clone(),
                task: task.clone(),
                source: source.clone(),
                group_size: cfg.num_repeat as u32,
            };
            backend.router.register_episode(&ep.id, &group_id);
            let (agent, backend, tracking, stats, journal, models, dry) = (
                agent.clone(),
                backend.clone(),
                tracking.clone(),
                stats.clone(),
                journal.clone(),
                cfg.models.clone(),
                cfg.dry_run,
            );
            let st = stop.clone();
            let source = source.clone();
            running.spawn(async move {
                let _permit = permit;
                stats.running.fetch_add(1, Ordering::Relaxed);
                let id = ep.id.clone();
                lock(&stats.in_flight).insert(
                    id.clone(),
                    (ep.task.id.clone(), ep.source.clone(), unix_ms()),
                );
                let line = ep
                    .run(&agent, &backend, &tracking, &stats, &models, dry, &st)
                    .await;
                backend.router.forget_episode(&id);
                lock(&stats.in_flight).remove(&id);
                stats.running.fetch_sub(1, Ordering::Relaxed);
                stats.count_source(&source, &line);
                let extra = stats.gossip_extra();
                backend.swarm.set_status(|s| s.extra.extend(extra));
                let _ = writeln!(lock(&journal), "{line}");
            });
        }
    }
    if stop.mode().is_some() {
        let running = stats.running.load(Ordering::Relaxed);
        println!(
            "stopping: no new episodes; {running} running finish and are submitted (Ctrl-C again aborts them)"
        );
        cfg.events.emit(ClientEvent::Draining { running });
    }
    running.close();
    running.wait().await;
    progress.abort();
    write_plots(&crate::dash::RunRef::new(
        &cfg.run_dir,
        crate::dash::RunKind::Episodes,
    ));
    println!(
        "{}",
        progress_line(&stats, t0, cfg.groups * cfg.num_repeat, cfg.time_limit)
    );
    let out = summary(&stats, &cfg, t0, &tracking);
    cfg.events.emit(ClientEvent::Finished {
        episodes: out.episodes,
        aborted: out.aborted,
    });
    Ok(out)
}

/// Between two rewrites of the run's plots while it runs.
const PLOT_EVERY: Duration = Duration::from_secs(30);

/// The run's curves as SVG files in `<run>/plots/` (a failure is logged, not fatal).
fn write_plots(run: &crate::dash::RunRef) {
    if let Err(e) = crate::dash::runs::write_plots(run) {
        tracing::warn!("plots of {}: {e}", run.dir.display());
    }
}

fn progress_line(stats: &Stats, t0: Instant, total: usize, limit: Option<Duration>) -> String {
    let secs = t0.elapsed().as_secs_f64();
    let done = stats.done.load(Ordering::Relaxed);
    // With a time limit the run ends at whichever comes first; say both.
    let of = match limit {
        Some(l) => format!(
            "{done}/{total} done ({:.0} s left)",
            (l.as_secs_f64() - secs).max(0.0)
        ),
        None => format!("{done}/{total} done"),
    };
    let mut rewards = String::new();
    for (name, s) in lock(&stats.per_model).iter() {
        let recent = &s.rewards[s.rewards.len().saturating_sub(32)..];
        rewards.push_str(&format!(
            " | {name}: reward {:.3} (last {}), submitted {}",
            mean(recent),
            recent.len(),
            s.submitted
        ));
    }
    format!(
        "[{:>4.0}s] episodes {of}, {} running, {} aborted | {:.2} calls/s{}",
        secs,
        stats.running.load(Ordering::Relaxed),
        stats.aborted.load(Ordering::Relaxed),
        stats.calls.load(Ordering::Relaxed) as f64 / secs.max(1e-9),
        rewards
    )
}

fn summary(stats: &Stats, cfg: &RunConfig, t0: Instant, tracking: &Tracking) -> Summary {
    let mut out = Summary {
        episodes: stats.done.load(Ordering::Relaxed),
        aborted: stats.aborted.load(Ordering::Relaxed),
        ..Default::default()
    };
    println!();
    println!(
        "summary: {} episodes in {:.1} min ({} aborted); run dir {}",
        out.episodes,
        t0.elapsed().as_secs_f64() / 60.0,
        out.aborted,
        cfg.run_dir.display()
    );
    println!(
        "{:<24} {:>9} {:>9} {:>8} {:>11}  REWARD BY QUARTER OF THE RUN",
        "MODEL", "SUBMITTED", "REJECTED", "FAILED", "REWARD MEAN"
    );
    for (name, s) in lock(&stats.per_model).iter() {
        let n = s.rewards.len();
        let quarters: Vec<f64> = (0..4)
            .map(|q| mean(&s.rewards[q * n / 4..(q + 1) * n / 4]))
            .collect();
        println!(
            "{:<24} {:>9} {:>9} {:>8} {:>11.3}  {}",
            name,
            s.submitted,
            s.rejected,
            s.failed,
            mean(&s.rewards),
            quarters
                .iter()
                // A quarter without episodes (a run of fewer than 4) has no mean.
                .map(|q| if q.is_nan() {
                    "-".into()
                } else {
                    format!("{q:.3}")
                })
                .collect::<Vec<_>>()
                .join(" -> ")
        );
        out.models.insert(name.clone(), (s.submitted, quarters));
    }
    for (why, n) in lock(&stats.reasons).iter() {
        println!("aborted x{n}: {why}");
    }
    // How the calls merged into timelines (token-in-token-out continuations vs breaks).
    for (model, c) in tracking.tracker.counts() {
        let later = c.continued + c.breaks;
        println!(
            "timeline {model}: {} first calls, {} continued, {} breaks ({:.1}% of later calls continued)",
            c.first,
            c.continued,
            c.breaks,
            100.0 * c.continued as f64 / later.max(1) as f64
        );
        out.timeline.insert(model, (c.first, c.continued, c.breaks));
    }
    let rewards: BTreeMap<String, Vec<f64>> = lock(&stats.per_model)
        .iter()
        .filter(|(_, s)| !s.rewards.is_empty())
        .map(|(k, s)| (k.clone(), s.rewards.clone()))
        .collect();
    if !rewards.is_empty() {
        let path = cfg.run_dir.join("reward.svg");
        // The agent's command by file names (no directories of this machine in a file
        // one may share).
        let agent: Vec<String> = cfg
            .agent
            .command
            .split_whitespace()
            .map(|w| {
                std::path::Path::new(w)
                    .file_name()
                    .map_or(w.to_string(), |f| f.to_string_lossy().into_owned())
            })
            .collect();
        let title = format!("{}: episode reward by order of ending", agent.join(" "));
        let svg = super::curve::rewards_svg(&title, &rewards, (cfg.num_repeat * 4).max(8));
        match std::fs::write(&path, svg) {
            Ok(()) => println!("reward curve: {}", path.display()),
            Err(e) => println!("reward curve not written ({}: {e})", path.display()),
        }
    }
    out
}

struct EpisodeRun {
    id: String,
    group_id: String,
    task: Task,
    /// The task source's file name.
    source: String,
    group_size: u32,
}

impl EpisodeRun {
    /// Runs the agent, submits, and returns the journal line.
    #[allow(clippy::too_many_arguments)]
    async fn run(
        self,
        agent: &AgentSpec,
        backend: &SwarmBackend,
        tracking: &Tracking,
        stats: &Stats,
        models: &[String],
        dry_run: bool,
        stop: &Stop,
    ) -> Value {
        let t0 = Instant::now();
        let started_unix_ms = unix_ms();
        let tracker = tracking.tracker.clone();
        let id = self.id.clone();
        let external = tracking.external.clone();
        let transcript = || {
            let calls = tracker.peek(&id).unwrap_or_default();
            let trained = calls.iter().map(|c| {
                let text = backend
                    .card(&c.model)
                    .and_then(|card| card.tokenizer.decode(&c.completion_ids, true).ok())
                    .unwrap_or_default();
                json!({"model": c.model, "completion": text})
            });
            // External models' calls in the order they were made among themselves; after
            // the trained ones (the two are recorded apart).
            let ext = external.peek(&id);
            let ext = ext.iter().map(
                |c| json!({"model": c.model, "completion": c.completion_text(), "external": true}),
            );
            Value::Array(trained.chain(ext).collect())
        };
        let outcome = run_agent(
            agent,
            &self.id,
            &self.task,
            &tracking.rewards,
            transcript,
            stop,
        )
        .await;
        let calls = tracking.tracker.take(&self.id).unwrap_or_default();
        stats.calls.fetch_add(calls.len() as u64, Ordering::Relaxed);
        // External models' calls are recorded beside the agent's output, never submitted.
        let external_calls = tracking.external.take(&self.id);
        let external_file = (!external_calls.is_empty()).then(|| {
            agent.logs.join(format!(
                "{}.external.jsonl",
                crate::base::safe_file_name(&self.id)
            ))
        });
        if let Some(path) = &external_file {
            stats
                .calls
                .fetch_add(external_calls.len() as u64, Ordering::Relaxed);
            let text: String = external_calls
                .iter()
                .filter_map(|c| serde_json::to_string(c).ok())
                .map(|l| l + "\n")
                .collect();
            if let Err(e) = std::fs::write(path, text) {
                tracing::warn!(episode = self.id, "cannot write {}: {e}", path.display());
            }
        }
        let mut episode = Episode {
            id: self.id.clone(),
            task_id: self.task.id.clone(),
            group_id: self.group_id.clone(),
            calls,
            reward: None,
            rewards: Default::default(),
            status: EpisodeStatus::Finished,
        };
        match &outcome {
            AgentOutcome::Reward(PostedReward::One(r)) => episode.reward = Some(*r),
            AgentOutcome::Reward(PostedReward::PerModel(m)) => episode.rewards = m.clone(),
            AgentOutcome::Aborted(why) => {
                episode.status = EpisodeStatus::Aborted {
                    reason: why.clone(),
                };
                stats.aborted.fetch_add(1, Ordering::Relaxed);
                // Reasons vary in their details; group them by their start.
                let key: String = why.chars().take(80).collect();
                *lock(&stats.reasons).entry(key).or_default() += 1;
            }
        }
        let mut answers = serde_json::Map::new();
        for model in models {
            // Per model: an episode that made no call of it, or gave no reward for it,
            // is reported aborted for that model's group.
            let mut ep = episode.clone();
            if ep.status == EpisodeStatus::Finished {
                let why = if ep.calls_of(model).next().is_none() {
                    Some(format!("the episode made no call of {model:?}"))
                } else if ep.reward_for(model).is_none() {
                    Some(format!("the agent gave no reward for {model:?}"))
                } else {
                    None
                };
                if let Some(reason) = why {
                    ep.status = EpisodeStatus::Aborted { reason };
                }
            }
            if let (EpisodeStatus::Finished, Some(r)) = (&ep.status, ep.reward_for(model)) {
                lock(&stats.per_model)
                    .entry(model.clone())
                    .or_default()
                    .rewards
                    .push(r);
            }
            if dry_run {
                continue;
            }
            let r = submit_to_model(
                &backend.swarm,
                || trainers_of(&backend.swarm, backend.router.providers(model), model),
                &ep,
                model,
                self.group_size,
                Duration::from_secs(60),
            )
            .await;
            let mut per = lock(&stats.per_model);
            let ms = per.entry(model.clone()).or_default();
            let answer = match r {
                Ok((peer, out)) => match out.reply {
                    SubmitReply::Stored {
                        fragments_received,
                        fragments_known,
                        ..
                    } => {
                        ms.submitted += 1;
                        json!({"server": peer.to_string(), "stored": true,
                               "fragments_sent": fragments_received, "fragments_known": fragments_known,
                               "bytes_sent": out.bytes_sent})
                    }
                    SubmitReply::Rejected(why) => {
                        ms.rejected += 1;
                        tracing::warn!(episode = self.id, model, "rejected: {why}");
                        json!({"server": peer.to_string(), "rejected": why})
                    }
                    other => {
                        json!({"server": peer.to_string(), "unexpected": format!("{other:?}")})
                    }
                },
                Err(e) => {
                    ms.failed += 1;
                    tracing::warn!(episode = self.id, model, "not submitted: {e}");
                    json!({"error": e.to_string()})
                }
            };
            answers.insert(model.clone(), answer);
        }
        stats.done.fetch_add(1, Ordering::Relaxed);
        backend.swarm.set_status(|s| s.episodes += 1);
        let (status, reason) = match &episode.status {
            EpisodeStatus::Aborted { reason } => ("aborted", Some(reason.clone())),
            _ => ("finished", None),
        };
        // How each model's calls merged: calls that continued the timeline, and breaks.
        let mut timeline = serde_json::Map::new();
        for model in models {
            if let Ok(t) = episode.timeline(model) {
                if t.calls > 0 {
                    timeline.insert(
                        model.clone(),
                        json!({"calls": t.calls, "continued": (t.calls - 1).saturating_sub(t.breaks), "breaks": t.breaks}),
                    );
                }
            }
        }
        // The agent's (and grader's) log files, by name within the run's episodes/.
        let safe = crate::base::safe_file_name(&self.id);
        let logs: Vec<String> = [
            "stdout",
            "stderr",
            "grader.stdout",
            "grader.stderr",
            "external.jsonl",
        ]
        .iter()
        .map(|ext| format!("{safe}.{ext}"))
        .filter(|f| agent.logs.join(f).is_file())
        .collect();
        json!({
            "episode": self.id,
            "task": self.task.id,
            "source": self.source,
            "group": self.group_id,
            "started_unix_ms": started_unix_ms,
            "ended_unix_ms": unix_ms(),
            "timeline": timeline,
            "logs": logs,
            "status": status,
            "reason": reason,
            "reward": episode.reward,
            "rewards": episode.rewards,
            "calls": episode.calls.len(),
            "external_calls": external_calls.len(),
            "external_log": external_file.map(|p| p.display().to_string()),
            "policy_versions": episode.calls.iter().map(|c| c.policy_version).collect::<Vec<_>>(),
            "seconds": t0.elapsed().as_secs_f64(),
            "submitted": if dry_run { Value::Null } else { Value::Object(answers) },
        })
    }
}

/// Per-model counts for tests and callers that read the journal.
pub fn read_journal(path: &std::path::Path) -> Result<Vec<Value>, ClientError> {
    let text = std::fs::read_to_string(path).map_err(|e| ClientError::io(path, e))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| ClientError::Journal {
                path: path.to_path_buf(),
                problem: e.to_string(),
            })
        })
        .collect()
}

/// A short unique run id: the time and the process id.
pub fn new_run_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("r{t:x}{:x}", std::process::id())
}

/// Groups by default: every task once per epoch.
pub fn default_groups(schedule: &Schedule, epochs: usize) -> usize {
    schedule.total_tasks() * epochs.max(1)
}

/// The providers of `model` an episode is submitted to: not its followers (`--follow`
/// servers serve the group's policy without training; the calls they signed are trained
/// by the group's members like any others).
fn trainers_of(swarm: &SwarmHandle, providers: Vec<PeerId>, model: &str) -> Vec<PeerId> {
    let followers: std::collections::HashSet<PeerId> = swarm
        .view()
        .into_iter()
        .filter(|e| {
            e.status
                .models
                .iter()
                .any(|m| m.name == model && m.weights.as_ref().is_some_and(|w| w.follower))
        })
        .map(|e| e.peer)
        .collect();
    providers
        .into_iter()
        .filter(|p| !followers.contains(p))
        .collect()
}
