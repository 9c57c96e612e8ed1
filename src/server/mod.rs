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
pub mod follow;
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
pub mod weights;

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
pub use settings::{FollowSettings, LoraServe, TrainSettings};
pub use submit::{read_stored_episodes, StoredEpisode, SubmitError};
pub use weights::BroadcastSettings;

use crate::base::events::Events;
use crate::base::safe_file_name;
use crate::base::stop::{wind_down, TaskTracker};
use crate::base::{flush_stdout, Stop, StopMode};
use crate::collective::broadcast::VersionStore;
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
    /// LoRA adapters of the base, each served (and trained, with `train`) as a model of
    /// its own name on the one engine: `(name, directory in PEFT's format)`; without a
    /// directory, a new adapter of `train.lora`'s shape. The base itself is then not
    /// served to the swarm. Empty: the model as loaded.
    pub adapters: Vec<(String, Option<PathBuf>)>,
    /// Follow a training group's policy versions instead of training (`--follow`; then
    /// `train` is `None`): see [`follow`].
    pub follow: Option<FollowSettings>,
    /// How the server takes part in the weight broadcast.
    pub broadcast: BroadcastSettings,
}

impl ServerConfig {
    /// The names the swarm knows this server's models by, each with its training group.
    fn served_names(&self) -> Vec<(String, String)> {
        let group = match &self.follow {
            Some(f) => Some(f.group.clone()),
            None => self.train.as_ref().and_then(|t| t.collective.group.clone()),
        };
        if self.adapters.is_empty() {
            let name = self.served_model_name.clone().unwrap_or(self.model.clone());
            return vec![(name.clone(), group.unwrap_or(name))];
        }
        self.adapters
            .iter()
            .map(|(n, _)| (n.clone(), n.clone()))
            .collect()
    }
}

/// The seed of a new adapter named `name` (every member of its group draws the same).
fn adapter_seed(name: &str) -> u64 {
    let h = blake3::hash(name.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// One model this server serves (the base, or an adapter on the engine's bank).
struct Unit {
    name: String,
    adapter: Option<usize>,
    /// The trainer's model (with training on).
    train_model: Option<crate::model::llama::Llama>,
    lora: Option<crate::model::llama::lora::LoraConfig>,
    /// The shapes of the tensors its versions carry (the weight broadcast's layout: the
    /// whole model's, or its adapter's).
    shapes: Vec<Vec<i64>>,
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
    /// The name the swarm knows the model by (the first adapter's, with adapters).
    pub model: String,
    pub served: Arc<ServedModel>,
    /// Every model it serves (one, or one per adapter), `served` first.
    pub models: Vec<Arc<ServedModel>>,
    /// What it did, as it happened (also in `ServerConfig::events_file`).
    pub events: Events<ServerEvent>,
    stop: Stop,
    drain_timeout: Duration,
    swarm: SwarmHandle,
    tasks: TaskTracker,
    training: Vec<train::TrainingHandle>,
}

/// Bytes of encoded chunks a server keeps to serve again (every follower at one version
/// asks the same deltas).
const WEIGHT_FRAME_CACHE_BYTES: usize = 256 << 20;

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
    let names = cfg.served_names();
    let name = names
        .iter()
        .map(|n| n.0.as_str())
        .collect::<Vec<_>>()
        .join(", ");
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
    for (name, _) in &names {
        if !c.serves(name) {
            println!(
                "trust: the certificate does not allow serving {name:?}: the calls this \
                 server signs are trained on nowhere"
            );
        }
    }
    Ok(())
}

/// Whether a certificate allows this server what it runs for: serving its model, or
/// training it in its group (or both).
fn cert_allows(cfg: &ServerConfig) -> impl Fn(&Certified) -> Result<(), String> {
    let names = cfg.served_names();
    move |c: &Certified| {
        for (name, group) in &names {
            if !(c.serves(name) || c.trains(name, group)) {
                return Err(format!(
                    "the certificate is for model {:?}, group {:?}: it allows neither serving \
                     {name:?} nor training it in group {group:?}",
                    c.grant.model, c.grant.group
                ));
            }
        }
        Ok(())
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
    if !cfg.adapters.is_empty()
        && cfg
            .train
            .as_ref()
            .is_some_and(|t| t.collective.group.is_some())
    {
        return Err(ServerError::Config(
            "--group names the training group, and each --adapter trains in a group of its \
             own name: drop --group"
                .into(),
        ));
    }
    if cfg.adapters.len() > 1 && cfg.swarm.run.is_some() {
        return Err(ServerError::Config(
            "trusting a run, a certificate names one model: serve one --adapter per server \
             (several adapters on one server run in an open or swarm-key swarm)"
                .into(),
        ));
    }
    if cfg.follow.is_some() && cfg.train.is_some() {
        return Err(ServerError::Config(
            "--follow serves the training group's versions without training: no training \
             settings with it"
                .into(),
        ));
    }
    check_trust(&cfg)?;
    let spec = cfg.model.clone();
    let train = cfg.train.is_some();
    // The adapter trained here, or the one the followed group trains.
    let (lora, serve) = match (&cfg.train, &cfg.follow) {
        (Some(t), _) => (t.lora.clone(), t.lora_serve),
        (None, Some(f)) => (f.lora.clone(), f.lora_serve),
        (None, None) => (None, LoraServe::Auto),
    };
    let merged = match serve {
        LoraServe::Merged => true,
        LoraServe::Unmerged => false,
        LoraServe::Auto => dtype == crate::model::llama::DType::F32 && cfg.adapters.is_empty(),
    };
    if serve == LoraServe::Merged && dtype != crate::model::llama::DType::F32 {
        tracing::warn!(
            "--lora-serve merged over a {dtype:?} base: the merged weights are rounded to \
             {dtype:?}, which may round a small update of the adapter away"
        );
    }
    if serve == LoraServe::Merged && !cfg.adapters.is_empty() {
        return Err(ServerError::Config(
            "--lora-serve merged serves the server's own adapter merged into the base: \
             --adapter names share one unmerged base (use --lora-serve auto or unmerged)"
                .into(),
        ));
    }
    let names = cfg.served_names();
    let adapters = cfg.adapters.clone();
    // Loading takes seconds: off the async threads.
    let (loaded, units) = tokio::task::spawn_blocking(move || {
        let model_err = |source| ServerError::Model {
            spec: spec.clone(),
            source,
        };
        let source = ModelSource::resolve(&spec).map_err(model_err)?;
        let mut loaded = load_model(&source, device, dtype).map_err(model_err)?;
        if !adapters.is_empty() {
            let units = bank_units(&mut loaded.model, &adapters, train, lora.as_ref())
                .map_err(model_err)?;
            return Ok::<_, ServerError>((loaded, units));
        }
        // The trainer's own float32 copy (the engine serves from the other), or with an
        // adapter the engine's frozen base, shared.
        let train_model = match (train, &lora) {
            (false, None) => None,
            (true, None) => Some(
                load_model(&source, device, crate::model::llama::DType::F32)
                    .map_err(model_err)?
                    .model,
            ),
            // Training, the frozen base is shared with the engine (one copy in the
            // process); each side has its own adapter. Following, the engine's adapter is
            // updated by each fetched version. Seed 0 everywhere: every member of a group
            // (and its followers) starts from one adapter.
            (_, Some(c)) => {
                loaded
                    .model
                    .attach_adapter(c.clone(), 0)
                    .map_err(model_err)?;
                let twin = match train {
                    true => {
                        let mut m = loaded.model.frozen_twin().map_err(model_err)?;
                        m.attach_adapter(c.clone(), 0).map_err(model_err)?;
                        Some(m)
                    }
                    false => None,
                };
                if merged {
                    // After the twin: it keeps the base, the engine its merged copy.
                    loaded.model.serve_merged_adapter().map_err(model_err)?;
                }
                tracing::info!(
                    merged,
                    "the engine serves the adapter {}",
                    match (merged, train) {
                        (true, _) => "merged into its own copy of the base's weights",
                        (false, true) => "unmerged, beside the base it shares with the trainer",
                        (false, false) => "unmerged, beside the base",
                    }
                );
                twin
            }
        };
        let unit = Unit {
            name: names[0].0.clone(),
            adapter: None,
            train_model,
            lora,
            shapes: loaded.model.parameters().iter().map(|t| t.size()).collect(),
        };
        Ok::<_, ServerError>((loaded, vec![unit]))
    })
    .await
    .map_err(|e| ServerError::Panicked(e.to_string()))??;
    let name = units[0].name.clone();
    // The HTTP API and dashboard serve the base under its own name beside the adapters.
    let base_name = cfg.served_model_name.clone().unwrap_or(cfg.model.clone());
    let model_context = loaded.model.max_positions();
    let engine = spawn_engine(loaded.model, cfg.engine.clone()).map_err(ServerError::Engine)?;
    let max_context = model_context.min(engine.max_sequence);
    let card = Arc::new(loaded.card);
    let swarm = spawn_node(cfg.swarm.clone()).await?;
    let listen_addrs = swarm.listen_addrs().await;
    println!("{}", swarm.introduction(&listen_addrs));
    println!("trust: {}", swarm.trust().describe());
    if cfg.follow.is_some() {
        if let Some(why) = cfg
            .served_names()
            .iter()
            .find_map(|(name, _)| follow::untrusted(&swarm, name))
        {
            swarm.shutdown(Duration::from_secs(2)).await;
            return Err(ServerError::Config(why));
        }
    }
    // Every trainer and follower holds versions and serves their chunks.
    let store = Arc::new(VersionStore::new(
        cfg.broadcast.keep,
        WEIGHT_FRAME_CACHE_BYTES,
    ));
    store
        .tamper
        .store(cfg.broadcast.tamper, std::sync::atomic::Ordering::Relaxed);
    if train || cfg.follow.is_some() {
        crate::collective::broadcast::wire::serve(&swarm, store.clone())?;
    }
    events.emit(ServerEvent::Started {
        peer_id: swarm.peer_id.to_string(),
        listen: listen_addrs.iter().map(ToString::to_string).collect(),
    });
    let ev = events.clone();
    swarm.forward_net_events(move |e| {
        if let Some(l) = e.line() {
            println!("{l}");
        }
        ev.emit(ServerEvent::Network(e));
    });
    let mut models = Vec::with_capacity(units.len());
    // Each model's layout, which a followed version must have.
    let mut shapes = Vec::with_capacity(units.len());
    let mut training = Vec::new();
    let bank: Vec<(String, usize)> = units
        .iter()
        .filter_map(|u| u.adapter.map(|i| (u.name.clone(), i)))
        .collect();
    for unit in units {
        let mut served = ServedModel::new(
            unit.name.clone(),
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
        if let Some(i) = unit.adapter {
            served.set_adapter(i)?;
        }
        let group = cfg
            .served_names()
            .into_iter()
            .find(|(n, _)| *n == unit.name)
            .map_or(unit.name.clone(), |(_, g)| g);
        if unit.train_model.is_some() || cfg.follow.is_some() {
            let kind = match unit.lora {
                Some(_) => tch::Kind::Float,
                None => dtype.kind(),
            };
            let bc = weights::Broadcast::new(
                swarm.clone(),
                store.clone(),
                &unit.name,
                &group,
                kind,
                cfg.broadcast.clone(),
                cfg.follow.is_some(),
            );
            let _ = served.broadcast.set(bc);
        }
        let run_dir = cfg.data_dir.join("runs").join(safe_file_name(&unit.name));
        if let (Some(c), true) = (&cfg.config_json, train) {
            let path = run_dir.join("config.json");
            std::fs::create_dir_all(&run_dir)
                .and_then(|_| {
                    let text = serde_json::to_string_pretty(c).unwrap_or_default() + "\n";
                    crate::base::files::write_atomic(&path, text.as_bytes())
                })
                .map_err(|e| ServerError::io(&path, e))?;
        }
        if let (Some(mut settings), Some(model)) = (cfg.train.clone(), unit.train_model) {
            settings.lora = unit.lora;
            let served = served.clone();
            let rt = tokio::runtime::Handle::current();
            // Group links listen where the swarm was told to (every interface for the
            // default 0.0.0.0; its expansions include loopback, never the only one).
            let ip = crate::collective::rendezvous::ip_of(&cfg.swarm.listen)
                .unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into());
            training.push(
                tokio::task::spawn_blocking(move || {
                    train::start_training(served, model, settings, &run_dir, rt, ip)
                })
                .await
                .map_err(|e| ServerError::Panicked(e.to_string()))??,
            );
        }
        models.push(served);
        shapes.push(unit.shapes);
    }
    let served = models[0].clone();
    ServedModel::start_all(&models).await?;
    for (m, shapes) in models.iter().zip(shapes) {
        if let (Some(bc), Some(_)) = (m.broadcast.get(), &cfg.follow) {
            println!(
                "following the policy versions of training group {:?}",
                bc.group
            );
            follow::spawn(m.clone(), bc.clone(), shapes, &tasks, stop.clone());
        }
    }
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
    for m in &models {
        println!("serving model {:?} to the swarm", m.name);
        events.emit(ServerEvent::Serving {
            model: m.name.clone(),
        });
    }
    let dashboard_addr = match &cfg.dashboard {
        None => None,
        Some(addr) => {
            let source = dash::ServerDash {
                backend: LocalBackend {
                    name: base_name.clone(),
                    card: card.clone(),
                    engine: engine.clone(),
                    max_context,
                    adapters: bank.clone(),
                },
                models: models
                    .iter()
                    .map(|m| {
                        let run = cfg.data_dir.join("runs").join(safe_file_name(&m.name));
                        (
                            m.clone(),
                            train.then(|| dash::ServerDash::training_run(&run)),
                        )
                    })
                    .collect(),
                data_dir: cfg.data_dir.clone(),
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
                    name: base_name,
                    card,
                    engine,
                    max_context,
                    adapters: bank,
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
        models,
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
        // Clients see it in the status too (they take servers from their view as well).
        self.swarm.set_status(|st| {
            st.extra
                .insert(crate::swarm::STOPPING_FIELD.to_string(), "1".to_string());
        });
        self.swarm.announce();
        for m in &self.models {
            if let Err(e) = self.swarm.stop_providing(&m.name).await {
                tracing::warn!("withdrawing the provider record of {}: {e}", m.name);
            }
        }
        // The trainers hear the stop now: each finishes its step (and, on a drain, saves).
        let stop_mode = self.stop.mode().unwrap_or(mode);
        let training: Vec<_> = self
            .training
            .into_iter()
            .map(|t| tokio::task::spawn_blocking(move || t.stop(stop_mode)))
            .collect();
        let ended = wind_down(&self.tasks, &self.stop, self.drain_timeout, ABORT_GRACE).await;
        if !ended {
            tracing::warn!("some requests did not end within the abort grace; dropped");
        }
        let mut result = Ok(());
        for t in training {
            // On an abort the step in progress is not waited for (nothing unsaved is
            // acknowledged: its episodes are trained again after a restart).
            tokio::select! {
                r = t => {
                    let r = match r {
                        Ok(r) => r.map_err(ServerError::from),
                        Err(e) => Err(ServerError::Panicked(e.to_string())),
                    };
                    if result.is_ok() {
                        result = r;
                    }
                }
                _ = self.stop.aborted() => {
                    println!("training: aborted mid-step; the last checkpoint is kept");
                    break;
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

/// The engine model's bank for `adapters` (each read from its directory, or new of
/// shape `lora`), and with `train` each adapter's trainer model: a twin of the frozen base
/// with its own copy of the adapter.
fn bank_units(
    model: &mut crate::model::llama::Llama,
    adapters: &[(String, Option<PathBuf>)],
    train: bool,
    lora: Option<&crate::model::llama::lora::LoraConfig>,
) -> Result<Vec<Unit>, crate::model::ModelError> {
    use crate::model::llama::lora::{Adapter, LoraConfig};
    use crate::model::ModelError;
    for mut t in model.base_parameters() {
        let _ = t.requires_grad_(false);
    }
    // (name, bank index, (directory, shape, seed)) of each adapter added.
    type Added = (
        String,
        usize,
        (Option<PathBuf>, LoraConfig, u64, Vec<Vec<i64>>),
    );
    let mut pending: Vec<Added> = Vec::new();
    for (name, dir) in adapters {
        if let Some((other, _, _)) = pending
            .iter()
            .find(|(n, _, _)| safe_file_name(n) == safe_file_name(name))
        {
            return Err(ModelError::Invalid(format!(
                "--adapter {name}: its run directory and episodes would be {other:?}'s \
                 (the same name, or the same as a file name)"
            )));
        }
        let seed = adapter_seed(name);
        let a = match (dir, lora) {
            (Some(d), _) => crate::model::peft::read_adapter(d, &model.config, model.device())?,
            (None, Some(c)) => Adapter::new(&model.config, c.clone(), seed, model.device())?,
            (None, None) => {
                return Err(ModelError::Invalid(format!(
                    "--adapter {name}: a new adapter needs --lora-rank (or NAME=DIR to load one)"
                )))
            }
        };
        let cfg = a.cfg.clone();
        let shapes = a.tensors().iter().map(|t| t.size()).collect();
        let i = model.add_served_adapter(a)?;
        pending.push((name.clone(), i, (dir.clone(), cfg, seed, shapes)));
    }
    let mut units = Vec::with_capacity(pending.len());
    for (name, i, (dir, cfg, seed, shapes)) in pending {
        let train_model = if train {
            let mut m = model.frozen_twin()?;
            m.attach_adapter(cfg.clone(), seed)?;
            if let Some(d) = &dir {
                crate::model::peft::read_weights(d, &m)?;
            }
            Some(m)
        } else {
            None
        };
        units.push(Unit {
            name,
            adapter: Some(i),
            train_model,
            lora: Some(cfg),
            shapes,
        });
    }
    Ok(units)
}
