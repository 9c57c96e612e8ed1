//! The tool subcommands: `generate`, `serve`, `export`, `info`, `status`.

use std::path::Path;

use agentjet::swarm::{self, Role as WireRole, SwarmConfig};
use anyhow::{bail, Context, Result};

use super::args::{load_key, parse_addrs, secs};

pub fn info(spec: &str) -> Result<()> {
    use agentjet::model::{ModelCard, ModelSource};
    let source = ModelSource::resolve(spec)?;
    let card = ModelCard::load(&source).with_context(|| format!("loading {spec}"))?;
    let c = &card.config;
    println!("name:        {}", card.name);
    println!("family:      {:?}", c.family);
    println!(
        "layers:      {}  hidden: {}  intermediate: {}  heads: {} (kv {})  head_dim: {}",
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim
    );
    println!(
        "vocab:       {}  context: {}  rope_theta: {}  tied head: {}",
        c.vocab_size, c.max_position_embeddings, c.rope_theta, c.tie_word_embeddings
    );
    println!(
        "bos: {:?}  eos: {:?}  stop ids: {:?}",
        card.tokenizer.bos.as_ref().map(|t| &t.content),
        card.tokenizer.eos.as_ref().map(|t| &t.content),
        card.generation.eos_token_ids
    );
    match &card.chat_template_source {
        Some(t) => println!("chat template ({} chars):\n{t}", t.len()),
        None => println!("chat template: none"),
    }
    Ok(())
}

/// `agentjet-peer status`: joins, listens to the status gossip, prints the table.
/// `runs`: every run under the data directories, with its last figures.
pub fn runs(data_dirs: &[std::path::PathBuf]) -> Result<()> {
    use agentjet::dash::runs::{scan, summary};
    use agentjet::dash::RunKind;
    let dirs: Vec<std::path::PathBuf> = if data_dirs.is_empty() {
        let default = crate::args::SwarmArgs::default_data_dir;
        vec![default("server"), default("client")]
    } else {
        data_dirs.to_vec()
    };
    let fmt = |v: &serde_json::Value, digits: usize| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{x:.digits$}"))
    };
    let mut any = false;
    for dir in &dirs {
        let runs = scan(dir);
        if runs.is_empty() {
            continue;
        }
        any = true;
        println!("{}", dir.display());
        println!(
            "  {:<28} {:<8} {:>8} {:>9} {:>9} {:>9} {:>9}  UPDATED",
            "RUN", "KIND", "STEPS", "REWARD", "LOSS", "ENTROPY", "ACCURACY"
        );
        for run in runs {
            let s = summary(&run);
            let updated = s["updated_unix"]
                .as_u64()
                .map(|t| {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(t, |d| d.as_secs());
                    format!("{} s ago", now.saturating_sub(t))
                })
                .unwrap_or_else(|| "-".into());
            match run.kind {
                RunKind::Train => println!(
                    "  {:<28} {:<8} {:>8} {:>9} {:>9} {:>9} {:>9}  {updated}",
                    run.name,
                    "train",
                    fmt(&s["steps"], 0),
                    fmt(&s["reward_mean"], 3),
                    fmt(&s["loss"], 4),
                    fmt(&s["entropy"], 3),
                    fmt(&s["accuracy"], 3),
                ),
                RunKind::Episodes => println!(
                    "  {:<28} {:<8} {:>8} {:>9} {:>9} {:>9} {:>9}  {updated} ({} episodes, {} aborted)",
                    run.name,
                    "client",
                    "-",
                    fmt(&s["reward_recent"], 3),
                    "-",
                    "-",
                    "-",
                    s["episodes"],
                    s["aborted"],
                ),
            }
        }
    }
    if !any {
        let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        println!("no runs in {}", list.join(", "));
    }
    Ok(())
}

/// `run-key --out FILE`.
pub fn run_key(out: &Path) -> Result<()> {
    if out.exists() {
        bail!("{} exists; not overwriting a run key", out.display());
    }
    let key = swarm::RunKey::generate();
    key.save(out).map_err(|e| anyhow::anyhow!(e))?;
    println!("wrote a new run key to {} (keep it secret)", out.display());
    println!("run id: {}", key.id());
    Ok(())
}

pub struct CertifyArgs<'a> {
    pub run_key: &'a Path,
    pub peer: &'a str,
    pub model: String,
    pub group: String,
    pub serve: bool,
    pub train: bool,
    pub days: f64,
    pub out: &'a Path,
}

/// `certify`: a certificate for one peer, written to a file.
pub fn certify(a: CertifyArgs) -> Result<()> {
    let key = swarm::RunKey::load(a.run_key).map_err(|e| anyhow::anyhow!("--run-key {e}"))?;
    let peer: swarm::PeerId = a
        .peer
        .parse()
        .map_err(|e| anyhow::anyhow!("--peer {:?} is not a peer id: {e}", a.peer))?;
    if !(a.days.is_finite() && a.days > 0.0 && a.days <= 3650.0) {
        bail!("--days must be in (0, 3650], got {}", a.days);
    }
    if a.model.is_empty() || a.model.len() > 256 || a.group.is_empty() || a.group.len() > 256 {
        bail!("--model and --group must be 1-256 bytes");
    }
    let until = swarm::trust::unix_now() + (a.days * 86400.0) as u64;
    let grant = swarm::Grant {
        model: a.model,
        group: a.group,
        serve: a.serve,
        train: a.train,
    };
    let cert = key.certify(&peer, grant, until);
    if a.out.exists() {
        bail!("{} exists; not overwriting a certificate", a.out.display());
    }
    agentjet::base::files::write_atomic(a.out, cert.to_file_text().as_bytes())
        .with_context(|| format!("writing {}", a.out.display()))?;
    print!("{}", cert.to_file_text().lines().next().unwrap_or_default());
    println!("\nwrote {}", a.out.display());
    Ok(())
}

pub async fn status(
    bootstrap: &[String],
    key: Option<&Path>,
    run: Option<&str>,
    wait: f64,
) -> Result<()> {
    let mut cfg = SwarmConfig::new(WireRole::Client, swarm::Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/0.0.0.0/udp/0/quic-v1".parse()?];
    cfg.bootstrap = parse_addrs("bootstrap", bootstrap)?;
    cfg.swarm_key = load_key(key)?;
    cfg.run = super::args::run_id(run)?;
    // A short look: no relay service, reservations or gateway to ask.
    cfg.relay_service = false;
    cfg.nat_traversal = false;
    cfg.upnp = false;
    let wait = secs("wait", wait)?;
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
    println!("trust: {}", h.trust().describe());
    println!(
        "{:<54} {:<7} {:<17} {:<28} {:>5} {:>6} {:>9} {:>13} {:>8} {:>6}  CERTIFIED",
        "PEER",
        "ROLE",
        "REACH",
        "MODELS (VERSION)",
        "LOAD",
        "QUEUE",
        "FREE KV",
        "PREFIX CACHE",
        "EPISODES",
        "AGE"
    );
    for e in &view {
        let models: Vec<String> = e
            .status
            .models
            .iter()
            .map(|m| format!("{} (v{})", m.name, m.policy_version))
            .collect();
        let cache = match (e.status.role, e.status.models.first()) {
            (swarm::Role::Server, Some(m)) => m.cache.brief(),
            _ => "-".to_string(),
        };
        let certified = match (&e.cert, &e.cert_problem) {
            (Some(c), _) => format!(
                "yes: {}{}{}",
                c.grant.model,
                if c.grant.serve { " serve" } else { "" },
                if c.grant.train {
                    format!(" train in {}", c.grant.group)
                } else {
                    String::new()
                }
            ),
            (None, Some(why)) => format!("NO ({why})"),
            (None, None) => "- (no --run)".into(),
        };
        // Its reachability (public, relayed, unreachable, local, unknown), and whether it
        // relays for peers behind NAT.
        let reach = format!(
            "{}{}",
            e.status
                .extra
                .get(swarm::protocol::REACH_FIELD)
                .map_or("-", String::as_str),
            if e.status.extra.contains_key(swarm::protocol::RELAY_FIELD) {
                "+relay"
            } else {
                ""
            }
        );
        println!(
            "{:<54} {:<7} {:<17} {:<28} {:>5.2} {:>6} {:>9} {:>13} {:>8} {:>5.1}s  {certified}",
            e.peer.to_string(),
            e.status.role.as_str(),
            reach,
            if models.is_empty() {
                "-".to_string()
            } else {
                models.join(", ")
            },
            e.status.load,
            e.status.queue_depth,
            e.status.free_kv_positions,
            cache,
            e.status.episodes,
            e.age.as_secs_f64()
        );
    }
    println!("{} peers (this status probe not counted)", view.len());
    // Training groups: one line per member, grouped by model.
    let mut members: Vec<(&str, String, &swarm::ModelStatus, &swarm::GroupStatus)> = view
        .iter()
        .flat_map(|e| {
            e.status.models.iter().filter_map(move |m| {
                m.group
                    .as_ref()
                    .map(|g| (g.name.as_str(), e.peer.to_string(), m, g))
            })
        })
        .collect();
    if !members.is_empty() {
        members.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        println!();
        println!(
            "{:<20} {:<54} {:>6} {:>7} {:>6} {:>7} {:<16} {:>10} {:>8} {:<6}",
            "GROUP",
            "MEMBER",
            "EPOCH",
            "MEMBERS",
            "STEP",
            "VERSION",
            "PARAMS",
            "ALLREDUCE",
            "GB/S",
            "MODE"
        );
        for (name, peer, m, g) in &members {
            println!(
                "{:<20} {:<54} {:>6} {:>7} {:>6} {:>7} {:<16} {:>8.1}ms {:>8.3} {:<6}",
                name,
                peer,
                g.epoch,
                g.members,
                m.train_step,
                m.policy_version,
                g.param_hash,
                g.allreduce_ms,
                g.allreduce_gbps,
                g.mode
            );
        }
    }
    // Weight broadcast: every holder of a group's versions, members and followers.
    let mut holders: Vec<(String, &str, &swarm::WeightsStatus)> = view
        .iter()
        .flat_map(|e| {
            e.status.models.iter().filter_map(move |m| {
                m.weights
                    .as_ref()
                    .map(|w| (e.peer.to_string(), m.name.as_str(), w))
            })
        })
        .collect();
    if !holders.is_empty() {
        holders.sort_by(|a, b| {
            (&a.2.group, a.2.follower, &a.0).cmp(&(&b.2.group, b.2.follower, &b.0))
        });
        println!();
        println!(
            "{:<20} {:<54} {:<9} {:>7} {:>4} {:<16} {:>12} {:>12}",
            "WEIGHTS OF GROUP", "HOLDER", "AS", "VERSION", "LAG", "PARAMS", "FETCHED", "SERVED"
        );
        for (peer, _model, w) in &holders {
            println!(
                "{:<20} {:<54} {:<9} {:>7} {:>4} {:<16} {:>10.1}MB {:>10.1}MB",
                w.group,
                peer,
                if w.follower { "follower" } else { "member" },
                w.version,
                w.lag,
                if w.param_hash.is_empty() {
                    "-"
                } else {
                    &w.param_hash
                },
                w.fetched_bytes as f64 / 1e6,
                w.served_bytes as f64 / 1e6
            );
        }
    }
    Ok(())
}

#[cfg(feature = "torch")]
pub mod torch_cmds {
    use super::*;
    use crate::args::ModelArgs;
    use agentjet::base::Stop;
    use agentjet::engine::{self, GenerateRequest, SamplingParams};
    use agentjet::model::checkpoint::{load_model, parse_placement, save_checkpoint, LoadedModel};
    use agentjet::model::{ChatRequest, ModelSource, StreamDecoder};
    use serde_json::json;
    use std::io::Write;

    pub fn load(args: &ModelArgs) -> Result<LoadedModel> {
        let (device, dtype) = parse_placement(&args.device, args.dtype.as_deref())?;
        let source = ModelSource::resolve(&args.model)?;
        load_model(&source, device, dtype).with_context(|| format!("loading model {}", args.model))
    }

    /// What `generate` is asked.
    pub struct Ask {
        pub prompt: String,
        pub system: Option<String>,
        pub max_tokens: usize,
        pub sampling: SamplingParams,
        pub seed: Option<u64>,
        pub show_tokens: bool,
    }

    pub fn generate(args: &ModelArgs, ask: Ask, stop: &Stop) -> Result<()> {
        let Ask {
            prompt,
            system,
            max_tokens,
            sampling,
            seed,
            show_tokens,
        } = ask;
        sampling.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
        let loaded = load(args)?;
        let card = &loaded.card;
        let mut messages = Vec::new();
        if let Some(s) = &system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        let text = match &card.chat_template_source {
            Some(_) => card.chat_template(&args.model)?.render(&ChatRequest {
                messages: &messages,
                add_generation_prompt: true,
                ..Default::default()
            })?,
            None => {
                eprintln!(
                    "note: {} has no chat template; using the prompt as raw text",
                    args.model
                );
                prompt.clone()
            }
        };
        let ids = if card.chat_template_source.is_some() {
            card.tokenizer.encode(&text)?
        } else {
            card.tokenizer.encode_with_bos(&text)?
        };
        let req = GenerateRequest {
            prompt: ids,
            max_tokens,
            sampling,
            seed,
            stop_token_ids: card.generation.eos_token_ids.clone(),
            top_logprobs: 0,
            constraint: None,
            adapter: None,
        };
        let mut decoder = StreamDecoder::new();
        let stdout = std::io::stdout();
        let mut write_err = None;
        let gen = engine::generate(&loaded.model, &req, |id, _lp| {
            // A stop (Ctrl-C or SIGTERM) ends the answer here; the report still comes.
            if stop.mode().is_some() {
                return false;
            }
            if card.is_stop_token(id) {
                return true;
            }
            match decoder.push(&card.tokenizer, id) {
                Ok(Some(piece)) => {
                    let mut out = stdout.lock();
                    if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                        write_err = Some(e);
                        return false;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    write_err = Some(std::io::Error::other(e.to_string()));
                    return false;
                }
            }
            true
        })?;
        if let Some(e) = write_err {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                return Err(e).context("writing generated text");
            }
            return Ok(());
        }
        println!();
        if show_tokens {
            println!("prompt ids: {:?}", req.prompt);
            println!("generated ids: {:?}", gen.tokens);
            let lps: Vec<String> = gen.logprobs.iter().map(|l| format!("{l:.4}")).collect();
            println!("logprobs: [{}]", lps.join(", "));
        }
        eprintln!(
            "[{} prompt tokens in {:.2}s, {} generated, {:.1} tokens/s decode, finish: {:?}, device {:?} {:?}]",
            req.prompt.len(),
            gen.prefill_time.as_secs_f64(),
            gen.tokens.len(),
            gen.decode_tokens_per_s(),
            gen.finish_reason,
            loaded.model.device(),
            loaded.model.dtype(),
        );
        Ok(())
    }

    /// `serve`: the OpenAI-compatible API on one engine, until stopped (a drain lets the
    /// requests in flight finish, streams included, within `drain_timeout`).
    #[allow(clippy::too_many_arguments)]
    pub async fn serve(
        args: &ModelArgs,
        host: &str,
        port: u16,
        served_model_name: Option<String>,
        adapters: &[(String, std::path::PathBuf)],
        engine_cfg: agentjet::engine::EngineConfig,
        facade: agentjet::facade::server::FacadeConfig,
        drain_timeout: std::time::Duration,
        stop: Stop,
    ) -> Result<()> {
        use agentjet::base::stop::wind_down;
        use agentjet::facade::http::serve_until;
        use agentjet::facade::server::router;
        use agentjet::facade::LocalBackend;
        use std::sync::Arc;
        let args2 = args.clone();
        let name = served_model_name.unwrap_or_else(|| args.model.clone());
        let named = adapters.to_vec();
        let base_name = name.clone();
        let (loaded, adapters) = tokio::task::spawn_blocking(move || {
            let mut loaded = load(&args2)?;
            let mut served: Vec<(String, usize, std::path::PathBuf)> = Vec::new();
            for (n, dir) in named {
                if n == base_name || served.iter().any(|(m, _, _)| *m == n) {
                    bail!(
                        "--adapter {n}={}: the name {n:?} is already served",
                        dir.display()
                    );
                }
                let m = &mut loaded.model;
                let a = agentjet::model::peft::read_adapter(&dir, &m.config, m.device())
                    .with_context(|| format!("--adapter {n}={}", dir.display()))?;
                let i = m.add_served_adapter(a)?;
                served.push((n, i, dir));
            }
            Ok((loaded, served))
        })
        .await??;
        let model_context = loaded.model.max_positions();
        let engine = agentjet::engine::spawn_engine(loaded.model, engine_cfg)
            .context("starting the engine")?;
        // A request must fit one KV slot of the engine.
        let max_context = model_context.min(engine.max_sequence);
        let backend = Arc::new(LocalBackend {
            name: name.clone(),
            card: Arc::new(loaded.card),
            engine,
            max_context,
            adapters: adapters.iter().map(|(n, i, _)| (n.clone(), *i)).collect(),
        });
        let tasks = facade.tasks.clone();
        let app = router(backend, facade);
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .with_context(|| format!("binding {host}:{port}"))?;
        let addr = listener.local_addr()?;
        // One line (a caller may read only the first).
        let with: Vec<String> = adapters
            .iter()
            .map(|(n, _, dir)| format!("{n} (adapter {})", dir.display()))
            .collect();
        let with = if with.is_empty() {
            String::new()
        } else {
            format!(" and {}", with.join(", "))
        };
        println!(
            "serving {name}{with} at http://{addr}/v1 (OpenAI-compatible; Ctrl-C or SIGTERM stops)"
        );
        agentjet::base::flush_stdout();
        let http = tasks.spawn(serve_until(listener, app, stop.clone()));
        stop.requested().await;
        println!("stopping: running requests finish (a second Ctrl-C or SIGTERM aborts)");
        agentjet::base::flush_stdout();
        if !wind_down(
            &tasks,
            &stop,
            drain_timeout,
            std::time::Duration::from_secs(5),
        )
        .await
        {
            tracing::warn!("requests still running after the abort; dropped");
        }
        if let Ok(Err(e)) = http.await {
            return Err(e).context("serving HTTP");
        }
        println!("stopped");
        Ok(())
    }

    pub fn export(
        args: &ModelArgs,
        adapter: Option<&std::path::Path>,
        out: &std::path::Path,
    ) -> Result<()> {
        let mut loaded = load(args)?;
        if let Some(dir) = adapter {
            agentjet::model::peft::load_adapter(dir, &mut loaded.model)
                .with_context(|| format!("loading the adapter in {}", dir.display()))?;
            println!("merging the adapter in {} into the base", dir.display());
        }
        let dtype = loaded.model.dtype();
        save_checkpoint(out, &loaded.card, &loaded.model, dtype)
            .with_context(|| format!("saving checkpoint to {}", out.display()))?;
        println!(
            "saved {} ({:?}) to {}",
            loaded.card.name,
            dtype,
            out.display()
        );
        Ok(())
    }
}
