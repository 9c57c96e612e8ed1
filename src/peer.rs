//! `agentjet-peer --role server|client|peer` and `agentjet-peer status`: builds the swarm
//! configuration from the command line and runs the role until Ctrl-C / SIGTERM.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentjet::swarm::{self, Multiaddr, Role as WireRole, SwarmConfig, SwarmHandle, SwarmKey};
use anyhow::{anyhow, bail, Context, Result};

use super::{Role, RoleArgs, SwarmArgs};

fn data_dir(args: &SwarmArgs, role: &str) -> PathBuf {
    if let Some(d) = &args.data_dir {
        return d.clone();
    }
    let base = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("agentjet").join(role)
}

fn secs(name: &str, v: f64) -> Result<Duration> {
    if !(v.is_finite() && v > 0.0) {
        bail!("--{name} must be a positive number of seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

fn load_key(path: Option<&Path>) -> Result<Option<SwarmKey>> {
    path.map(|p| SwarmKey::load(p).map_err(|e| anyhow!(e)))
        .transpose()
}

fn swarm_config(role: WireRole, args: &SwarmArgs, dir: &Path) -> Result<SwarmConfig> {
    let key = swarm::load_or_create_identity(&dir.join("identity.key")).map_err(|e| anyhow!(e))?;
    let mut cfg = SwarmConfig::new(role, key);
    let port = if role == WireRole::Client { 0 } else { 4001 };
    cfg.listen = if args.listen.is_empty() {
        vec![
            format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?,
            format!("/ip4/0.0.0.0/tcp/{port}").parse()?,
        ]
    } else {
        args.listen
            .iter()
            .map(|a| swarm::parse_addr(a).map_err(|e| anyhow!("--listen: {e}")))
            .collect::<Result<_>>()?
    };
    let mut boot: Vec<Multiaddr> = args
        .bootstrap
        .iter()
        .map(|a| swarm::parse_addr(a).map_err(|e| anyhow!("--bootstrap: {e}")))
        .collect::<Result<_>>()?;
    let file = args.bootstrap_file.clone().or_else(|| {
        let d = PathBuf::from("bootstrap/peers.txt");
        (args.bootstrap.is_empty() && d.is_file()).then_some(d)
    });
    if let Some(f) = file {
        boot.extend(swarm::read_bootstrap_file(&f).map_err(|e| anyhow!(e))?);
    }
    cfg.bootstrap = boot;
    cfg.swarm_key = load_key(args.swarm_key.as_deref())?;
    cfg.provider_ttl = secs("provider-ttl", args.provider_ttl)?;
    cfg.status_interval = secs("status-interval", args.status_interval)?;
    cfg.quic_idle_timeout = secs("idle-timeout", args.idle_timeout)?;
    cfg.max_frame_bytes = args.max_message_bytes;
    cfg.max_streams_per_peer = args.max_streams_per_peer.max(1);
    cfg.max_requests_per_s = args.max_requests_per_s;
    cfg.request_burst = (args.max_requests_per_s * 2.0).max(1.0);
    Ok(cfg)
}

async fn start_node(cfg: SwarmConfig) -> Result<SwarmHandle> {
    let closed = cfg.swarm_key.is_some();
    let h = swarm::spawn_node(cfg).await?;
    println!("peer id: {}", h.peer_id);
    for a in h.listen_addrs().await {
        println!("listening on {a}");
    }
    if closed {
        println!("swarm key: set (a closed swarm)");
    }
    use std::io::Write as _;
    std::io::stdout().flush()?;
    Ok(h)
}

/// Waits for Ctrl-C or SIGTERM.
async fn until_stopped() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn run(role: Role, sargs: &SwarmArgs, rargs: &RoleArgs) -> Result<()> {
    match role {
        Role::Peer => {
            let dir = data_dir(sargs, "peer");
            let cfg = swarm_config(WireRole::Plain, sargs, &dir)?;
            runtime()?.block_on(async move {
                let _h = start_node(cfg).await?;
                until_stopped().await;
                Ok(())
            })
        }
        Role::Client => {
            let dir = data_dir(sargs, "client");
            let cfg = swarm_config(WireRole::Client, sargs, &dir)?;
            let models = if rargs.models.is_empty() {
                vec!["smollm2".to_string()]
            } else {
                rargs.models.clone()
            };
            let wait = secs("wait", rargs.wait)?;
            let port = rargs.proxy_port;
            let external = rargs
                .external_models
                .iter()
                .map(|spec| {
                    let m = agentjet::openai::external::ExternalModel::parse(spec, |k| {
                        std::env::var(k).ok()
                    })
                    .map_err(|e| anyhow!("--external-model {e}"))?;
                    if models.contains(&m.name) {
                        bail!(
                            "--external-model {}: {:?} is also a --model (trained through the \
                             swarm); give the external one another name",
                            spec,
                            m.name
                        );
                    }
                    Ok(Arc::new(m))
                })
                .collect::<Result<Vec<_>>>()?;
            let mut names: Vec<&str> = external.iter().map(|m| m.name.as_str()).collect();
            names.sort();
            if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
                bail!("--external-model {:?} is given twice", w[0]);
            }
            let job = match &rargs.agent {
                None => {
                    if !rargs.tasks.is_empty() {
                        bail!("--tasks needs --agent COMMAND (the agent to run on them)");
                    }
                    None
                }
                Some(cmd) => {
                    use agentjet::client::tasks::{load_source, Schedule};
                    if rargs.tasks.is_empty() {
                        bail!("--agent needs --tasks FILE (JSONL, one task per line)");
                    }
                    let sources = rargs
                        .tasks
                        .iter()
                        .map(|t| load_source(t).map_err(|e| anyhow!("--tasks: {e}")))
                        .collect::<Result<Vec<_>>>()?;
                    let schedule = Schedule::new(sources).map_err(|e| anyhow!(e))?;
                    Some((cmd.clone(), schedule))
                }
            };
            let timeout = secs("episode-timeout", rargs.episode_timeout)?;
            let time_limit = rargs
                .time_limit
                .map(|t| secs("time-limit", t))
                .transpose()?;
            let rargs = rargs.clone();
            runtime()?.block_on(async move {
                use agentjet::client::SwarmBackend;
                use agentjet::openai::server::{router_tracked, ServerConfig};
                let h = start_node(cfg).await?;
                let backend = Arc::new(
                    SwarmBackend::connect(h, &models, &dir, wait)
                        .await
                        .map_err(|e| anyhow!(e))?,
                );
                let (app, tracking) = router_tracked(
                    backend.clone(),
                    ServerConfig {
                        track_episodes: true,
                        external: external.clone(),
                        ..Default::default()
                    },
                );
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                    .await
                    .with_context(|| format!("binding 127.0.0.1:{port}"))?;
                let base_url = format!("http://{}/v1", listener.local_addr()?);
                println!("proxy at {base_url} (OpenAI-compatible; models {models:?})");
                for m in &external {
                    println!(
                        "external model {:?} -> {} (model {:?}; recorded, not trained)",
                        m.name, m.base_url, m.remote_model
                    );
                }
                use std::io::Write as _;
                std::io::stdout().flush()?;
                let Some((command, schedule)) = job else {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(until_stopped())
                        .await
                        .context("serving the proxy")?;
                    return Ok(());
                };
                tokio::spawn(async move { axum::serve(listener, app).await });
                let (stop_tx, stop_rx) = tokio::sync::watch::channel(0u8);
                let stop_tx = Arc::new(stop_tx);
                let tx = stop_tx.clone();
                tokio::spawn(async move {
                    until_stopped().await;
                    tx.send_modify(|l| *l = (*l).max(1));
                    until_stopped().await;
                    println!("aborting the running episodes");
                    tx.send_modify(|l| *l = 2);
                });
                if let Some(limit) = time_limit {
                    tokio::spawn(async move {
                        tokio::time::sleep(limit).await;
                        println!(
                            "time limit ({:.0} s) reached: no new episodes",
                            limit.as_secs_f64()
                        );
                        stop_tx.send_modify(|l| *l = (*l).max(1));
                    });
                }
                use agentjet::client::run::{default_groups, new_run_id, run_episodes, RunConfig};
                let run_id = new_run_id();
                let run_dir = rargs
                    .run_dir
                    .clone()
                    .unwrap_or_else(|| dir.join("runs").join(&run_id));
                let groups = rargs
                    .groups
                    .unwrap_or_else(|| default_groups(&schedule, rargs.epochs));
                let cfg = RunConfig {
                    agent: agentjet::client::runner::AgentSpec {
                        command,
                        grader: rargs.grader.clone(),
                        timeout,
                        base_url,
                        logs: run_dir.join("episodes"),
                    },
                    num_repeat: rargs.num_repeat.max(1),
                    concurrency: rargs.concurrency.max(1),
                    groups,
                    dry_run: rargs.dry_run,
                    run_dir,
                    models: models.clone(),
                    run_id,
                    progress_every: Duration::from_secs(2),
                    time_limit,
                };
                let tracking = tracking.context("the proxy tracks episodes")?;
                run_episodes(cfg, schedule, backend, tracking, stop_rx)
                    .await
                    .map_err(|e| anyhow!(e))?;
                Ok(())
            })
        }
        #[cfg(feature = "torch")]
        Role::Server => server(sargs, rargs),
        #[cfg(not(feature = "torch"))]
        Role::Server => bail!(
            "this agentjet-peer was built without LibTorch (`--no-default-features`): it can \
             be a client or a plain peer; rebuild with the default `torch` feature to serve models"
        ),
    }
}

#[cfg(feature = "torch")]
fn server(sargs: &SwarmArgs, rargs: &RoleArgs) -> Result<()> {
    use agentjet::openai::LocalBackend;
    use agentjet::server::{ServeLimits, ServedModel};
    use std::sync::Arc;
    let spec = match rargs.models.as_slice() {
        [] => "smollm2".to_string(),
        [m] => m.clone(),
        _ => bail!("a server hosts one model (one --model)"),
    };
    let dir = data_dir(sargs, "server");
    let cfg = swarm_config(WireRole::Server, sargs, &dir)?;
    let margs = super::ModelArgs {
        model: spec.clone(),
        device: rargs.device.clone(),
        dtype: rargs.dtype.clone(),
    };
    let loaded = super::torch_cmds::load(&margs)?;
    // The trainer's own float32 copy (the engine serves from the other).
    let train_model = if rargs.no_train {
        None
    } else {
        Some(
            super::torch_cmds::load(&super::ModelArgs {
                dtype: Some("f32".into()),
                ..margs.clone()
            })
            .context("loading the trainer's copy of the model")?
            .model,
        )
    };
    let advantage: agentjet::train::groups::AdvantageKind = rargs
        .advantage
        .parse()
        .map_err(|e: String| anyhow!("--advantage: {e}"))?;
    let name = rargs.served_model_name.clone().unwrap_or(spec);
    let model_context = loaded.model.max_positions();
    let engine = agentjet::engine::spawn_engine(
        loaded.model,
        agentjet::engine::EngineConfig {
            max_batch: rargs.engine.max_batch,
            max_queue: rargs.engine.max_queue,
            max_kv_positions: rargs.engine.max_kv_positions,
            ..Default::default()
        },
    )
    .context("starting the engine")?;
    let max_context = model_context.min(engine.max_sequence);
    let card = Arc::new(loaded.card);
    let http = rargs.http.clone();
    let max_batch = rargs.engine.max_batch;
    runtime()?.block_on(async move {
        let h = start_node(cfg).await?;
        let served = ServedModel::new(
            name.clone(),
            card.clone(),
            engine.clone(),
            max_context,
            max_batch,
            h,
            &dir,
            ServeLimits::default(),
        )
        .map_err(|e| anyhow!(e))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trainer = match train_model {
            None => None,
            Some(model) => {
                let settings = agentjet::server::train::TrainSettings {
                    run_dir: dir.join("runs").join(agentjet::safe_file_name(&name)),
                    learning_rate: rargs.learning_rate,
                    warmup_steps: rargs.warmup_steps,
                    groups_per_step: rargs.groups_per_step.max(1),
                    num_repeat: rargs.num_repeat.max(1),
                    group_timeout: secs("group-timeout", rargs.group_timeout)?,
                    min_episodes: 2,
                    advantage,
                    max_staleness: Some(rargs.max_staleness),
                    checkpoint_every: rargs.checkpoint_every.max(1),
                    micro_batch_tokens: 4096,
                };
                Some(
                    agentjet::server::train::start_training(
                        served.clone(),
                        model,
                        settings,
                        stop.clone(),
                    )
                    .map_err(|e| anyhow!(e))?,
                )
            }
        };
        served.start().await.map_err(|e| anyhow!(e))?;
        println!("serving model {name:?} to the swarm");
        if let Some(addr) = http {
            let app = agentjet::openai::server::router(
                Arc::new(LocalBackend {
                    name: name.clone(),
                    card,
                    engine,
                    max_context,
                }),
                Default::default(),
            );
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .with_context(|| format!("--http {addr}"))?;
            println!("http at http://{}/v1", listener.local_addr()?);
            tokio::spawn(async move { axum::serve(listener, app).await });
        }
        use std::io::Write as _;
        std::io::stdout().flush()?;
        until_stopped().await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = trainer {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        Ok(())
    })
}

/// `agentjet-peer status`: joins, listens to the status gossip, prints the table.
pub fn status(bootstrap: &[String], key: Option<&Path>, wait: f64) -> Result<()> {
    let mut cfg = SwarmConfig::new(WireRole::Client, swarm::Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/0.0.0.0/udp/0/quic-v1".parse()?];
    cfg.bootstrap = bootstrap
        .iter()
        .map(|a| swarm::parse_addr(a).map_err(|e| anyhow!("--bootstrap: {e}")))
        .collect::<Result<_>>()?;
    cfg.swarm_key = load_key(key)?;
    let wait = secs("wait", wait)?;
    runtime()?.block_on(async move {
        let h = swarm::spawn_node(cfg).await?;
        tokio::time::sleep(wait).await;
        let connected = h.connected_peers().await;
        if connected.is_empty() {
            bail!(
                "could not reach any bootstrap peer within {:.0} s",
                wait.as_secs_f64()
            );
        }
        let view: Vec<_> = h.view().into_iter().filter(|e| !e.is_self).collect();
        println!(
            "{:<54} {:<7} {:<28} {:>5} {:>6} {:>9} {:>8} {:>6}",
            "PEER", "ROLE", "MODELS (VERSION)", "LOAD", "QUEUE", "FREE KV", "EPISODES", "AGE"
        );
        for e in &view {
            let models: Vec<String> = e
                .status
                .models
                .iter()
                .map(|m| format!("{} (v{})", m.name, m.policy_version))
                .collect();
            println!(
                "{:<54} {:<7} {:<28} {:>5.2} {:>6} {:>9} {:>8} {:>5.1}s",
                e.peer.to_string(),
                e.status.role.as_str(),
                if models.is_empty() {
                    "-".to_string()
                } else {
                    models.join(", ")
                },
                e.status.load,
                e.status.queue_depth,
                e.status.free_kv_positions,
                e.status.episodes,
                e.age.as_secs_f64()
            );
        }
        println!("{} peers (this status probe not counted)", view.len());
        Ok(())
    })
}
