//! The server role (`agentjet-peer --role server`), as a library: [`run`] loads the model,
//! starts the engine thread, the swarm node, the protocol handlers, the training loop and
//! (optionally) the OpenAI-compatible HTTP API, and returns a [`Server`] with the peer id
//! and addresses; [`Server::finish`] waits for the stop and winds everything down.
//!
//! - announces the model in the DHT (provider record, re-provided) and gossips its status
//!   (policy version, load, queue depth, free KV positions, episodes stored);
//! - `/agentjet/infer/2` ([`infer`]): token-level generation; every streamed token comes
//!   with the server's signature over the call so far; a caller that goes away cancels its
//!   generation;
//! - `/agentjet/card/1`: the model card blob;
//! - `/agentjet/submit/2` ([`submit`]): episodes as fragment manifests, deduplicated,
//!   verified, acknowledged only once synced under `<data-dir>/episodes/<model>/`;
//! - the training loop ([`train`]) steps the trainer on its own copy of the model and
//!   brings the engine to each new policy version;
//! - optionally the OpenAI-compatible HTTP API on the same engine (`--http`).
//!
//! Stopping (docs/ARCHITECTURE.md, "Stopping"): on a drain the model's provider record is
//! withdrawn and new calls and submissions are refused with `retry` (clients go to another
//! provider); calls and submissions in flight and HTTP requests finish; the trainer ends
//! its step and saves its checkpoint; then the swarm node stops. Past the drain timeout,
//! or on an abort, what still runs is cancelled.

mod calls;
mod dash;
mod error;
pub mod events;
mod group_state;
pub mod infer;
mod learner;
mod ledger;
mod quota;
mod renew;
pub mod served;
mod settings;
mod stored;
pub mod submit;
pub mod train;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use error::ServerError;
pub use error::TrainingError;
pub use events::ServerEvent;
pub use infer::{BadCall, InferError};
pub use renew::CertRenewal;
pub use served::{card_blob, ServeLimits, ServedModel};
pub use settings::TrainSettings;
pub use submit::{read_stored_episodes, StoredEpisode, SubmitError};

use crate::base::events::Events;
use crate::base::safe_file_name;
use crate::base::stop::{wind_down, TaskTracker};
use crate::base::{flush_stdout, Stop, StopMode};
use crate::engine::{spawn_engine, EngineConfig};
use crate::facade::http::{serve_until, spawn_serve};
use crate::facade::server::{router, FacadeConfig};
use crate::facade::LocalBackend;
use crate::model::checkpoint::{load_model, parse_placement};
use crate::model::ModelSource;
use crate::swarm::{spawn_node, Certified, Multiaddr, PeerId, SwarmConfig, SwarmHandle};

/// Everything `--role server` is configured by (the binary builds it from its flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub swarm: SwarmConfig,
    /// Identity key, episodes, run directories and caches of this peer.
    pub data_dir: PathBuf,
    /// `smollm2`, a GGUF file, or an HF model directory.
    pub model: String,
    /// The name the swarm knows the model by (default: `model`).
    pub served_model_name: Option<String>,
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `f32` or `bf16` (default: f32 on the CPU, bf16 on CUDA).
    pub dtype: Option<String>,
    pub engine: EngineConfig,
    /// Also serve the OpenAI-compatible HTTP API at this `HOST:PORT`.
    pub http: Option<String>,
    /// Serve the dashboard and `/metrics` at this `HOST:PORT` (none: no dashboard).
    pub dashboard: Option<String>,
    /// The effective configuration, written to the run directory as `config.json`.
    pub config_json: Option<serde_json::Value>,
    /// Train on submitted episodes (`None`: serve only).
    pub train: Option<TrainSettings>,
    pub limits: ServeLimits,
    /// How long a drain may take before what still runs is aborted.
    pub drain_timeout: Duration,
    /// Also write the server's events ([`ServerEvent`]) to this file, as JSON lines.
    pub events_file: Option<PathBuf>,
    /// Where its certificate is renewed from while it runs (trusting a run).
    pub renew: Option<CertRenewal>,
}

/// A running server.
pub struct Server {
    pub peer_id: PeerId,
    /// Its listen addresses, each ending in `/p2p/<peer id>` (bootstrap addresses).
    pub listen_addrs: Vec<Multiaddr>,
    /// Where the OpenAI-compatible API answers, with `--http`.
    pub http_addr: Option<SocketAddr>,
    /// Where the dashboard answers.
    pub dashboard_addr: Option<SocketAddr>,
    /// The name the swarm knows the model by.
    pub model: String,
    pub served: Arc<ServedModel>,
    /// What it did, as it happened (also in `ServerConfig::events_file`).
    pub events: Events<ServerEvent>,
    stop: Stop,
    drain_timeout: Duration,
    swarm: SwarmHandle,
    tasks: TaskTracker,
    training: Option<train::TrainingHandle>,
}

/// Seconds what still runs after an abort gets before the stop gives up on it.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// Starts the server role on the current tokio runtime, stopping with `stop` (the role
/// takes a child of it). Returns once the model is served to the swarm.
pub async fn run(cfg: ServerConfig, stop: &Stop) -> Result<Server, ServerError> {
    let stop = stop.child();
    let tasks = TaskTracker::new();
    let started = start(cfg, stop.clone(), tasks.clone()).await;
    if started.is_err() {
        // What did start (status gossip, the HTTP task, the node) ends with the role.
        stop.request(StopMode::Abort);
        tasks.close();
    }
    started
}

/// Trusting a run, a server must be certified for its model: to serve it (its calls are
/// trained on, clients route to it), to train it in its group, or both. A train-only
/// server trains on the other certified servers' calls; its own calls count nowhere.
fn check_trust(cfg: &ServerConfig) -> Result<(), ServerError> {
    let Some(run) = &cfg.swarm.run else {
        return Ok(());
    };
    let name = cfg.served_model_name.clone().unwrap_or(cfg.model.clone());
    let me = cfg.swarm.keypair.public().to_peer_id();
    let Some(cert) = &cfg.swarm.cert else {
        return Err(ServerError::Trust(format!(
            "trusting run {run}, this server ({me}) needs a certificate to serve {name:?}: \
             --cert FILE (`agentjet-peer certify`) or --run-key FILE"
        )));
    };
    let c = cert
        .verify(run, &me)
        .map_err(|e| ServerError::Trust(format!("--cert: {e}")))?;
    cert_allows(cfg)(&c).map_err(ServerError::Trust)?;
    if !c.serves(&name) {
        println!(
            "trust: the certificate does not allow serving {name:?}: the calls this server \
             signs are trained on nowhere"
        );
    }
    Ok(())
}

/// Whether a certificate allows this server what it runs for: serving its model, or
/// training it in its group (or both).
fn cert_allows(cfg: &ServerConfig) -> impl Fn(&Certified) -> Result<(), String> {
    let name = cfg.served_model_name.clone().unwrap_or(cfg.model.clone());
    let group = cfg
        .train
        .as_ref()
        .and_then(|t| t.collective.group.clone())
        .unwrap_or(name.clone());
    move |c: &Certified| {
        if c.serves(&name) || c.trains(&name, &group) {
            return Ok(());
        }
        Err(format!(
            "the certificate is for model {:?}, group {:?}: it allows neither serving {name:?} \
             nor training it in group {group:?}",
            c.grant.model, c.grant.group
        ))
    }
}

async fn start(cfg: ServerConfig, stop: Stop, tasks: TaskTracker) -> Result<Server, ServerError> {
    let events = Events::new(cfg.events_file.as_deref())
        .map_err(|e| ServerError::io(cfg.events_file.as_deref().unwrap_or(Path::new("")), e))?;
    let (device, dtype) =
        parse_placement(&cfg.device, cfg.dtype.as_deref()).map_err(|e| ServerError::Model {
            spec: cfg.model.clone(),
            source: e,
        })?;
    check_trust(&cfg)?;
    let spec = cfg.model.clone();
    let train = cfg.train.is_some();
    let lora = cfg.train.as_ref().and_then(|t| t.lora.clone());
    // Loading takes seconds: off the async threads.
    let (loaded, train_model) = tokio::task::spawn_blocking(move || {
        let model_err = |source| ServerError::Model {
            spec: spec.clone(),
            source,
        };
        let source = ModelSource::resolve(&spec).map_err(model_err)?;
        let mut loaded = load_model(&source, device, dtype).map_err(model_err)?;
        // The trainer's own float32 copy (the engine serves from the other), or with an
        // adapter the engine's frozen base, shared.
        let train_model = match (train, &lora) {
            (false, _) => None,
            (true, None) => Some(
                load_model(&source, device, crate::model::llama::DType::F32)
                    .map_err(model_err)?
                    .model,
            ),
            // The frozen base is shared with the engine (one copy in the process); each
            // side has its own adapter. Seed 0 everywhere: every member of a group starts
            // from one adapter.
            (true, Some(c)) => {
                loaded
                    .model
                    .attach_adapter(c.clone(), 0)
                    .map_err(model_err)?;
                let mut m = loaded.model.frozen_twin().map_err(model_err)?;
                m.attach_adapter(c.clone(), 0).map_err(model_err)?;
                Some(m)
            }
        };
        Ok::<_, ServerError>((loaded, train_model))
    })
    .await
    .map_err(|e| ServerError::Panicked(e.to_string()))??;
    let name = cfg.served_model_name.clone().unwrap_or(cfg.model.clone());
    let model_context = loaded.model.max_positions();
    let engine = spawn_engine(loaded.model, cfg.engine.clone()).map_err(ServerError::Engine)?;
    let max_context = model_context.min(engine.max_sequence);
    let card = Arc::new(loaded.card);
    let swarm = spawn_node(cfg.swarm.clone()).await?;
    let listen_addrs = swarm.listen_addrs().await;
    println!("{}", swarm.introduction(&listen_addrs));
    println!("trust: {}", swarm.trust().describe());
    events.emit(ServerEvent::Started {
        peer_id: swarm.peer_id.to_string(),
        listen: listen_addrs.iter().map(ToString::to_string).collect(),
    });
    let served = ServedModel::new(
        name.clone(),
        card.clone(),
        engine.clone(),
        max_context,
        cfg.engine.max_batch,
        swarm.clone(),
        &cfg.data_dir,
        cfg.limits.clone(),
        stop.clone(),
        tasks.clone(),
        events.clone(),
    )?;
    let run_dir = cfg.data_dir.join("runs").join(safe_file_name(&name));
    if let (Some(c), true) = (&cfg.config_json, train) {
        let path = run_dir.join("config.json");
        std::fs::create_dir_all(&run_dir)
            .and_then(|_| {
                let text = serde_json::to_string_pretty(c).unwrap_or_default() + "\n";
                crate::base::files::write_atomic(&path, text.as_bytes())
            })
            .map_err(|e| ServerError::io(&path, e))?;
    }
    let training = match (cfg.train.clone(), train_model) {
        (Some(settings), Some(model)) => {
            let run_dir = run_dir.clone();
            let served = served.clone();
            let rt = tokio::runtime::Handle::current();
            // Group links listen where the swarm does.
            let ip = crate::collective::rendezvous::ip_of(&listen_addrs)
                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
            Some(
                tokio::task::spawn_blocking(move || {
                    train::start_training(served, model, settings, &run_dir, rt, ip)
                })
                .await
                .map_err(|e| ServerError::Panicked(e.to_string()))??,
            )
        }
        _ => None,
    };
    served.start().await?;
    if let Some(r) = cfg.renew.clone() {
        renew::spawn(
            r,
            swarm.clone(),
            cert_allows(&cfg),
            stop.clone(),
            &tasks,
            events.clone(),
        );
    }
    println!("serving model {name:?} to the swarm");
    events.emit(ServerEvent::Serving {
        model: name.clone(),
    });
    let dashboard_addr = match &cfg.dashboard {
        None => None,
        Some(addr) => {
            let source = dash::ServerDash {
                backend: LocalBackend {
                    name: name.clone(),
                    card: card.clone(),
                    engine: engine.clone(),
                    max_context,
                    adapters: Vec::new(),
                },
                served: served.clone(),
                data_dir: cfg.data_dir.clone(),
                run: train.then(|| dash::ServerDash::training_run(&run_dir)),
            };
            let app = crate::dash::router(Arc::new(source), swarm.clone(), "server", stop.clone());
            let local = spawn_serve(addr, app, stop.clone(), &tasks, "dashboard")
                .await
                .map_err(|source| ServerError::Dashboard {
                    addr: addr.clone(),
                    source,
                })?;
            println!("dashboard at http://{local}/");
            events.emit(ServerEvent::Dashboard {
                addr: local.to_string(),
            });
            Some(local)
        }
    };
    let http_addr = match &cfg.http {
        None => None,
        Some(addr) => {
            let app = router(
                Arc::new(LocalBackend {
                    name: name.clone(),
                    card,
                    engine,
                    max_context,
                    adapters: Vec::new(),
                }),
                FacadeConfig {
                    tasks: tasks.clone(),
                    ..Default::default()
                },
            );
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Http {
                    addr: addr.clone(),
                    source,
                })?;
            let local = listener.local_addr().map_err(|source| ServerError::Http {
                addr: addr.clone(),
                source,
            })?;
            println!("http at http://{local}/v1");
            events.emit(ServerEvent::Http {
                addr: local.to_string(),
            });
            let stop = stop.clone();
            tasks.spawn(async move {
                if let Err(e) = serve_until(listener, app, stop).await {
                    tracing::error!("the HTTP API stopped: {e}");
                }
            });
            Some(local)
        }
    };
    flush_stdout();
    Ok(Server {
        peer_id: swarm.peer_id,
        listen_addrs,
        http_addr,
        dashboard_addr,
        model: name,
        served,
        events,
        stop,
        drain_timeout: cfg.drain_timeout,
        swarm,
        tasks,
        training,
    })
}

impl Server {
    /// The role's stop signal (a child of the one `run` was given).
    pub fn stop_signal(&self) -> &Stop {
        &self.stop
    }

    /// Asks the server to stop (see the module docs for what each mode does).
    pub fn stop(&self, mode: StopMode) {
        self.stop.request(mode);
    }

    /// Runs until a stop is asked for, then stops: returns once everything has ended (a
    /// drain: within the drain timeout, plus the trainer's step in progress and its
    /// checkpoint).
    pub async fn finish(self) -> Result<(), ServerError> {
        let mode = self.stop.requested().await;
        println!(
            "stopping ({}): the model is withdrawn from the swarm; running calls, \
             submissions and the training step finish{}",
            match mode {
                StopMode::Drain => "drain",
                StopMode::Abort => "abort",
            },
            match mode {
                StopMode::Drain => " (a second Ctrl-C or SIGTERM aborts)",
                StopMode::Abort => "",
            }
        );
        flush_stdout();
        self.events.emit(ServerEvent::Stopping {
            drain: mode == StopMode::Drain,
        });
        if let Err(e) = self.swarm.stop_providing(&self.model).await {
            tracing::warn!("withdrawing the provider record: {e}");
        }
        // The trainer hears the stop now: it finishes its step (and, on a drain, saves).
        let training = self.training.map(|t| {
            let mode = self.stop.mode().unwrap_or(mode);
            tokio::task::spawn_blocking(move || t.stop(mode))
        });
        let ended = wind_down(&self.tasks, &self.stop, self.drain_timeout, ABORT_GRACE).await;
        if !ended {
            tracing::warn!("some requests did not end within the abort grace; dropped");
        }
        let mut result = Ok(());
        if let Some(t) = training {
            // On an abort the step in progress is not waited for (nothing unsaved is
            // acknowledged: its episodes are trained again after a restart).
            tokio::select! {
                r = t => {
                    result = match r {
                        Ok(r) => r.map_err(ServerError::from),
                        Err(e) => Err(ServerError::Panicked(e.to_string())),
                    };
                }
                _ = self.stop.aborted() => {
                    println!("training: aborted mid-step; the last checkpoint is kept");
                }
            }
        }
        self.swarm.shutdown(ABORT_GRACE).await;
        println!("stopped");
        flush_stdout();
        self.events.emit(ServerEvent::Stopped);
        result
    }
}
