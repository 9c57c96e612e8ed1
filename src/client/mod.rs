//! The client role (`agentjet-peer --role client`), as a library: [`run`] joins the swarm,
//! finds a provider of every model it needs (DHT), fetches their cards, starts the local
//! OpenAI-compatible proxy on loopback (the [`crate::facade`] facade over
//! [`backend::SwarmBackend`]), and, with a job ([`EpisodeJob`]), runs the agent on the
//! tasks ([`episodes`]); it returns a [`Client`] with the peer id, addresses and the proxy's
//! URL. [`Client::finish`] waits for the job (or the stop) and winds everything down.
//!
//! Stopping: a drain (first Ctrl-C or SIGTERM, or the job's time limit) starts no new
//! episode; running ones finish and are submitted; then the proxy stops. An abort (a second
//! one) kills the running agents; their episodes are reported aborted.
//!
//! Never touches LibTorch: a client-only build (`--no-default-features`) has all of it.

pub mod backend;
pub mod curve;
mod dash;
pub mod episodes;
mod error;
pub mod events;
pub mod runner;
pub mod submit;
pub mod tasks;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use backend::{fetch_card, CardError, SwarmBackend};
pub use error::ClientError;
pub use events::ClientEvent;

use crate::base::events::Events;
use crate::base::stop::{wind_down, TaskTracker};
use crate::base::{flush_stdout, Stop};
use crate::facade::external::ExternalModel;
use crate::facade::http::{serve_until, spawn_serve};
use crate::facade::server::{router_tracked, FacadeConfig};
use crate::swarm::{spawn_node, Multiaddr, PeerId, SwarmConfig, SwarmHandle};

/// Everything `--role client` is configured by (the binary builds it from its flags).
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub swarm: SwarmConfig,
    /// Identity key, card cache and run directories of this peer.
    pub data_dir: PathBuf,
    /// The trainable models to reach through the swarm.
    pub models: Vec<String>,
    /// How long to wait for a provider of each model at start.
    pub wait: Duration,
    /// Port of the proxy on 127.0.0.1 (0: a free one).
    pub proxy_port: u16,
    /// Models forwarded to other OpenAI-compatible endpoints (recorded, never trained).
    pub external: Vec<Arc<ExternalModel>>,
    /// The agent and tasks to run; `None`: only serve the proxy until stopped.
    pub job: Option<EpisodeJob>,
    /// How long the proxy's requests may take to finish once the client stops.
    pub drain_timeout: Duration,
    /// Serve the dashboard and `/metrics` at this `HOST:PORT` (none: no dashboard).
    pub dashboard: Option<String>,
    /// The effective configuration, written to the job's run directory as `config.json`.
    pub config_json: Option<serde_json::Value>,
    /// Also write the client's events ([`ClientEvent`]) to this file, as JSON lines.
    pub events_file: Option<PathBuf>,
}

/// An agent to run on tasks.
#[derive(Debug, Clone)]
pub struct EpisodeJob {
    /// `sh -c COMMAND`, once per episode.
    pub command: String,
    pub schedule: tasks::Schedule,
    pub grader: Option<String>,
    pub episode_timeout: Duration,
    /// Groups in all.
    pub groups: usize,
    pub num_repeat: usize,
    pub concurrency: usize,
    pub dry_run: bool,
    /// Start no new episode after this long.
    pub time_limit: Option<Duration>,
    /// Where episode logs and the journal go (default: `<data-dir>/runs/<run id>`).
    pub run_dir: Option<PathBuf>,
}

/// A running client.
pub struct Client {
    pub peer_id: PeerId,
    pub listen_addrs: Vec<Multiaddr>,
    /// The proxy's base URL (`http://127.0.0.1:PORT/v1`): what agents get as
    /// `OPENAI_BASE_URL`.
    pub proxy_url: String,
    /// Where the dashboard answers, with `--dashboard`.
    pub dashboard_addr: Option<std::net::SocketAddr>,
    /// What it did, as it happened (also in `ClientConfig::events_file`).
    pub events: Events<ClientEvent>,
    stop: Stop,
    proxy_stop: Stop,
    drain_timeout: Duration,
    swarm: SwarmHandle,
    tasks: TaskTracker,
    episodes: Option<tokio::task::JoinHandle<Result<episodes::Summary, ClientError>>>,
}

/// Seconds what still runs after an abort gets before the stop gives up on it.
const ABORT_GRACE: Duration = Duration::from_secs(5);

impl ClientConfig {
    /// Checks what can be checked before joining: external model names.
    pub fn validate(&self) -> Result<(), ClientError> {
        let mut names: Vec<&str> = Vec::new();
        for m in &self.external {
            if self.models.contains(&m.name) {
                return Err(ClientError::Config(format!(
                    "--external-model {:?} is also a --model (trained through the swarm); \
                     give the external one another name",
                    m.name
                )));
            }
            if names.contains(&m.name.as_str()) {
                return Err(ClientError::Config(format!(
                    "--external-model {:?} is given twice",
                    m.name
                )));
            }
            names.push(&m.name);
        }
        if self.models.is_empty() {
            return Err(ClientError::Config(
                "a client needs at least one --model".into(),
            ));
        }
        Ok(())
    }
}

/// Starts the client role on the current tokio runtime, stopping with `stop` (the role
/// takes a child of it). Returns once the proxy answers (and the job, if any, started).
pub async fn run(cfg: ClientConfig, stop: &Stop) -> Result<Client, ClientError> {
    cfg.validate()?;
    let stop = stop.child();
    let started = start(cfg, stop.clone()).await;
    if started.is_err() {
        // What did start (the provider refresh, the proxy) ends with the role.
        stop.request(crate::base::StopMode::Abort);
    }
    started
}

async fn start(cfg: ClientConfig, stop: Stop) -> Result<Client, ClientError> {
    // With a job the proxy outlives the role's drain (running episodes still call it);
    // it stops once the episodes are done, or with an abort.
    let events = Events::new(cfg.events_file.as_deref())
        .map_err(|e| ClientError::io(cfg.events_file.as_deref().unwrap_or(Path::new("")), e))?;
    let tasks = TaskTracker::new();
    let proxy_stop = match cfg.job {
        Some(_) => {
            // Not drained with the role, but aborted with it.
            let (proxy, role) = (Stop::new(), stop.clone());
            let p = proxy.clone();
            tasks.spawn(async move {
                tokio::select! {
                    _ = role.aborted() => p.request(crate::base::StopMode::Abort),
                    _ = p.requested() => {}
                }
            });
            proxy
        }
        None => stop.child(),
    };
    let swarm = spawn_node(cfg.swarm.clone()).await?;
    let listen_addrs = swarm.listen_addrs().await;
    println!("{}", swarm.introduction(&listen_addrs));
    events.emit(ClientEvent::Started {
        peer_id: swarm.peer_id.to_string(),
        listen: listen_addrs.iter().map(ToString::to_string).collect(),
    });
    let ev = events.clone();
    swarm.forward_net_events(move |e| {
        if let Some(l) = e.line() {
            println!("{l}");
        }
        ev.emit(ClientEvent::Network(e));
    });
    let backend = Arc::new(
        SwarmBackend::connect(
            swarm.clone(),
            &cfg.models,
            &cfg.data_dir,
            cfg.wait,
            tasks.clone(),
            proxy_stop.clone(),
        )
        .await?,
    );
    let (app, tracking) = router_tracked(
        backend.clone(),
        FacadeConfig {
            track_episodes: true,
            external: cfg.external.clone(),
            tasks: tasks.clone(),
            ..Default::default()
        },
    );
    let port = cfg.proxy_port;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .map_err(|source| ClientError::Proxy { port, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ClientError::Proxy { port, source })?;
    let proxy_url = format!("http://{local}/v1");
    println!(
        "proxy at {proxy_url} (OpenAI-compatible; models {:?})",
        cfg.models
    );
    events.emit(ClientEvent::Proxy {
        url: proxy_url.clone(),
        models: cfg.models.clone(),
    });
    for m in &cfg.external {
        println!(
            "external model {:?} -> {} (model {:?}; recorded, not trained)",
            m.name, m.base_url, m.remote_model
        );
    }
    flush_stdout();
    let ps = proxy_stop.clone();
    tasks.spawn(async move {
        if let Err(e) = serve_until(listener, app, ps).await {
            tracing::error!("the proxy stopped: {e}");
        }
    });
    let stats = Arc::new(episodes::Stats::default());
    // The job's run: its id and directory, with the effective configuration.
    let run = cfg.job.as_ref().map(|job| {
        let run_id = episodes::new_run_id();
        let run_dir = job
            .run_dir
            .clone()
            .unwrap_or_else(|| cfg.data_dir.join("runs").join(&run_id));
        (run_id, run_dir)
    });
    if let (Some((_, dir)), Some(c)) = (&run, &cfg.config_json) {
        let path = dir.join("config.json");
        std::fs::create_dir_all(dir)
            .and_then(|_| {
                let text = serde_json::to_string_pretty(c).unwrap_or_default() + "\n";
                crate::base::files::write_atomic(&path, text.as_bytes())
            })
            .map_err(|e| ClientError::io(&path, e))?;
    }
    let dashboard_addr = match &cfg.dashboard {
        None => None,
        Some(addr) => {
            let source = dash::ClientDash {
                backend: backend.clone(),
                tracker: tracking.as_ref().map(|t| t.tracker.clone()),
                stats: stats.clone(),
                run: run.as_ref().map(|(id, dir)| {
                    (
                        crate::dash::RunRef::new(dir, crate::dash::RunKind::Episodes),
                        id.clone(),
                    )
                }),
                data_dir: cfg.data_dir.clone(),
            };
            let app = crate::dash::router(
                Arc::new(source),
                swarm.clone(),
                "client",
                proxy_stop.clone(),
            );
            let local = spawn_serve(addr, app, proxy_stop.clone(), &tasks, "dashboard")
                .await
                .map_err(|source| ClientError::Dashboard {
                    addr: addr.clone(),
                    source,
                })?;
            println!("dashboard at http://{local}/");
            flush_stdout();
            events.emit(ClientEvent::Dashboard {
                addr: local.to_string(),
            });
            Some(local)
        }
    };
    let episodes = match cfg.job {
        None => None,
        Some(job) => {
            let tracking = tracking.ok_or(ClientError::Config(
                "the proxy does not track episodes".into(),
            ))?;
            let episodes_stop = stop.child();
            if let Some(limit) = job.time_limit {
                let s = episodes_stop.clone();
                let ev = events.clone();
                tasks.spawn(async move {
                    tokio::select! {
                        _ = tokio::time::sleep(limit) => {
                            println!(
                                "time limit ({:.0} s) reached: no new episodes",
                                limit.as_secs_f64()
                            );
                            ev.emit(ClientEvent::TimeLimit {
                                secs: limit.as_secs_f64(),
                            });
                            s.request(crate::base::StopMode::Drain);
                        }
                        _ = s.requested() => {}
                    }
                });
            }
            let (run_id, run_dir) = run
                .clone()
                .ok_or(ClientError::Config("a job without a run directory".into()))?;
            let run_cfg = episodes::RunConfig {
                agent: runner::AgentSpec {
                    command: job.command.clone(),
                    grader: job.grader.clone(),
                    timeout: job.episode_timeout,
                    base_url: proxy_url.clone(),
                    logs: run_dir.join("episodes"),
                },
                num_repeat: job.num_repeat.max(1),
                concurrency: job.concurrency.max(1),
                groups: job.groups,
                dry_run: job.dry_run,
                run_dir,
                models: cfg.models.clone(),
                run_id,
                progress_every: Duration::from_secs(2),
                time_limit: job.time_limit,
                events: events.clone(),
            };
            Some(tokio::spawn(episodes::run_episodes(
                run_cfg,
                job.schedule,
                backend,
                tracking,
                stats,
                episodes_stop,
            )))
        }
    };
    Ok(Client {
        peer_id: swarm.peer_id,
        listen_addrs,
        proxy_url,
        dashboard_addr,
        events,
        stop,
        proxy_stop,
        drain_timeout: cfg.drain_timeout,
        swarm,
        tasks,
        episodes,
    })
}

impl Client {
    /// Asks the client to stop.
    pub fn stop(&self, mode: crate::base::StopMode) {
        self.stop.request(mode);
    }

    /// The role's stop signal.
    pub fn stop_signal(&self) -> &Stop {
        &self.stop
    }

    /// Waits for the job to end (all its groups, or a stop) or, without one, for a stop;
    /// then stops the proxy and the node. The job's summary, if it ran.
    pub async fn finish(self) -> Result<Option<episodes::Summary>, ClientError> {
        let summary = match self.episodes {
            Some(job) => {
                let s = job
                    .await
                    .map_err(|e| ClientError::Panicked(e.to_string()))??;
                Some(s)
            }
            None => {
                self.stop.requested().await;
                None
            }
        };
        // The role is done: all of it stops, the proxy's requests finishing (a drain)
        // unless the role was aborted.
        let mode = self.stop.mode().unwrap_or(crate::base::StopMode::Drain);
        self.stop.request(mode);
        self.proxy_stop.request(mode);
        wind_down(
            &self.tasks,
            &self.proxy_stop,
            self.drain_timeout,
            ABORT_GRACE,
        )
        .await;
        self.swarm.shutdown(ABORT_GRACE).await;
        self.events.emit(ClientEvent::Stopped);
        Ok(summary)
    }
}
