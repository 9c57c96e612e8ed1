//! `agentjet-peer`: the one binary of AgentJet-RS. CLI only: parse, build the config, hand
//! off to the role or tool that does the work.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

mod peer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Host trainable models on this machine (GPU or CPU) and train them.
    Server,
    /// Run agents on tasks against the swarm's models (today: the local OpenAI proxy).
    Client,
    /// Only relay gossip and the DHT: a bootstrap peer any other can join through.
    Peer,
}

/// Options of `--role`.
#[derive(Debug, Clone, clap::Args)]
struct SwarmArgs {
    /// Address to listen on (repeatable). Default: QUIC and TCP on all interfaces, port
    /// 4001 for servers and plain peers, a free port for clients.
    #[arg(long = "listen", value_name = "MULTIADDR")]
    listen: Vec<String>,
    /// A peer to join through (repeatable), e.g. /ip4/10.0.0.5/udp/4001/quic-v1/p2p/12D3...
    #[arg(long = "bootstrap", value_name = "MULTIADDR")]
    bootstrap: Vec<String>,
    /// A file of bootstrap addresses, one per line (default: bootstrap/peers.txt if it exists).
    #[arg(long)]
    bootstrap_file: Option<PathBuf>,
    /// Identity key, episodes, caches: one directory per peer (default:
    /// ~/.local/share/agentjet/<role>). Peers side by side on one machine need their own.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The swarm key file (a closed swarm: peers without the key get no service).
    #[arg(long)]
    swarm_key: Option<PathBuf>,
    /// Provider record lifetime in seconds (a dead server disappears within two).
    #[arg(long, default_value_t = 30.0)]
    provider_ttl: f64,
    /// Seconds between status gossip messages.
    #[arg(long, default_value_t = 2.0)]
    status_interval: f64,
    /// Seconds of silence after which a QUIC connection is dead.
    #[arg(long, default_value_t = 3.0)]
    idle_timeout: f64,
    /// Largest protocol message accepted, bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_message_bytes: usize,
    /// Concurrent streams one peer may have open with this one, per protocol.
    #[arg(long, default_value_t = 256)]
    max_streams_per_peer: usize,
    /// New streams per second one peer may open (sustained).
    #[arg(long, default_value_t = 500.0)]
    max_requests_per_s: f64,
}

/// Options of `--role server` and `--role client`.
#[derive(Debug, Clone, clap::Args)]
struct RoleArgs {
    /// Server: the model to host (`smollm2`, a GGUF file, or an HF directory). Client: the
    /// model name(s) to reach (repeatable).
    #[arg(long = "model")]
    models: Vec<String>,
    /// Server: the name the swarm knows the model by (default: the --model argument).
    #[arg(long)]
    served_model_name: Option<String>,
    /// `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N` (server).
    #[arg(long, default_value = "auto")]
    device: String,
    /// `f32` or `bf16` (server); default f32 on CPU, bf16 on CUDA.
    #[arg(long)]
    dtype: Option<String>,
    /// Server: also serve the OpenAI-compatible HTTP API at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    http: Option<String>,
    /// Server: the engine's bounds.
    #[command(flatten)]
    engine: EngineArgs,
    /// Client: port of the local OpenAI-compatible proxy on 127.0.0.1 (0 = a free one).
    #[arg(long, default_value_t = 0)]
    proxy_port: u16,
    /// Client: seconds to wait for a provider of each model at start.
    #[arg(long, default_value_t = 120.0)]
    wait: f64,

    /// Server: serve only, do not train on submitted episodes.
    #[arg(long)]
    no_train: bool,
    /// Server: AdamW learning rate.
    #[arg(long, default_value_t = 1e-5)]
    learning_rate: f64,
    /// Server: steps of linear learning-rate warmup.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// Server: trainable groups per optimizer step.
    #[arg(long, default_value_t = 4)]
    groups_per_step: usize,
    /// Episodes per task (GRPO's group). Client: how many it runs of each task. Server:
    /// the group size assumed when a client does not say it.
    #[arg(long, default_value_t = 4)]
    num_repeat: usize,
    /// Server: seconds a group waits for its missing episodes before training on what
    /// arrived (at least 2 finished).
    #[arg(long, default_value_t = 600.0)]
    group_timeout: f64,
    /// Server: group advantage: `grpo`, `dr_grpo` or `rloo`.
    #[arg(long, default_value = "grpo")]
    advantage: String,
    /// Server: calls sampled more than this many policy versions ago are not trained on.
    #[arg(long, default_value_t = 4)]
    max_staleness: u64,
    /// Server: save a checkpoint every N steps (and when stopped).
    #[arg(long, default_value_t = 20)]
    checkpoint_every: u64,

    /// Client: run this command once per episode (its own process group; see README).
    #[arg(long)]
    agent: Option<String>,
    /// Client: a task file (JSONL) or a directory of them, optionally `:WEIGHT` for its
    /// share when several are mixed (repeatable).
    #[arg(long = "tasks", value_name = "PATH[:WEIGHT]")]
    tasks: Vec<String>,
    /// Client: reward command given the task and the transcript (instead of the agent's).
    #[arg(long)]
    grader: Option<String>,
    /// Client: episodes running at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Client: seconds an episode may run before it is killed and aborted.
    #[arg(long, default_value_t = 300.0)]
    episode_timeout: f64,
    /// Client: groups to run in all (default: every task once, times --epochs).
    #[arg(long)]
    groups: Option<usize>,
    /// Client: start no new episode after this many seconds (running ones finish).
    #[arg(long, value_name = "SECONDS")]
    time_limit: Option<f64>,
    /// Client: passes over the task sources (when --groups is not given).
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Client: run episodes but submit nothing (debug an agent against the live model).
    #[arg(long)]
    dry_run: bool,
    /// Client: a model that is not trained, served by any OpenAI-compatible endpoint
    /// (`NAME=URL[#REMOTE]`, e.g. `judge=http://127.0.0.1:8000/v1`; repeatable). Its calls
    /// are forwarded as they are, recorded in the run dir, never submitted. API key:
    /// env AGENTJET_EXTERNAL_KEY_<NAME> or AGENTJET_EXTERNAL_KEY.
    #[arg(long = "external-model", value_name = "NAME=URL[#REMOTE]")]
    external_models: Vec<String>,
    /// Client: where episode logs and the summary go (default: <data-dir>/runs/<time>).
    #[arg(long)]
    run_dir: Option<std::path::PathBuf>,
}

const EXAMPLES: &str = "\
Examples:
  # chat with the default model (SmolLM2-135M-Instruct; fetched by bootstrap/setup.sh)
  agentjet-peer generate --model smollm2 --prompt \"What is the capital of France?\"

  # any Llama/Mistral/Qwen2 checkpoint: an HF directory or a GGUF file
  agentjet-peer generate --model ./Qwen2.5-0.5B-Instruct --prompt \"Hi\" --temperature 0.7 --seed 1

  # save as an HF checkpoint (loads in transformers and back here)
  agentjet-peer export --model smollm2 --out ./smollm2-hf

  # the swarm: a server prints its address; anyone joins through it
  agentjet-peer --role server --model smollm2
  agentjet-peer --role client --bootstrap /ip4/127.0.0.1/udp/4001/quic-v1/p2p/<peer id> --proxy-port 8080
  agentjet-peer status --bootstrap /ip4/127.0.0.1/udp/4001/quic-v1/p2p/<peer id>";

/// AgentJet-RS peer: a peer-to-peer elastic swarm for RL of LLM agents.
#[derive(Debug, Parser)]
#[command(name = "agentjet-peer", version, about, after_help = EXAMPLES)]
struct Cli {
    /// Join the swarm in this role.
    #[arg(long, value_enum)]
    role: Option<Role>,

    #[command(flatten)]
    swarm: SwarmArgs,

    #[command(flatten)]
    role_args: RoleArgs,

    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `agentjet=debug`.
    #[arg(long, env = "AGENTJET_LOG", default_value = "warn", global = true)]
    log: String,

    #[command(subcommand)]
    command: Option<Command>,
}

/// The engine's bounds (`serve` and `--role server`).
#[derive(Debug, Clone, clap::Args)]
struct EngineArgs {
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Requests waiting beyond the batch before refusing (429; a swarm client re-routes).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// KV-cache positions (prompt + max_tokens of running requests) at most.
    #[arg(long, default_value_t = 65536)]
    max_kv_positions: usize,
}

#[derive(Debug, Clone, clap::Args)]
struct ModelArgs {
    /// `smollm2` (the default model), a GGUF file, or an HF model directory.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    device: String,
    /// `f32` or `bf16`; default f32 on CPU, bf16 on CUDA.
    #[arg(long)]
    dtype: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Chat-formatted generation with the KV cache, streamed to the terminal.
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// The user message.
        #[arg(long)]
        prompt: String,
        /// A system message (otherwise the template's default, if it has one).
        #[arg(long)]
        system: Option<String>,
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Drop tokens less likely than this fraction of the most likely one.
        #[arg(long, default_value_t = 0.0)]
        min_p: f64,
        /// HF-style repetition penalty over prompt and output (1.0 = off).
        #[arg(long, default_value_t = 1.0)]
        repetition_penalty: f64,
        #[arg(long)]
        seed: Option<u64>,
        /// Print the token ids and logprobs after the text.
        #[arg(long)]
        show_tokens: bool,
    },
    /// Serve a model over the OpenAI-compatible API on this machine (no swarm).
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Address to listen on; loopback by default.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port (0 picks a free one and prints it).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// The model name clients use (default: the --model argument).
        #[arg(long)]
        served_model_name: Option<String>,
        #[command(flatten)]
        engine: EngineArgs,
        /// Prompt tokens prefilled together in one pass at most.
        #[arg(long, default_value_t = 8192)]
        max_prefill_tokens: usize,
        /// max_tokens for requests that give none.
        #[arg(long, default_value_t = 1024)]
        default_max_tokens: usize,
        /// Track chat calls per episode (the API key names the episode): each call
        /// extends the exact token ids of the episode's previous call (token-in-token-out),
        /// and breaks are counted in /metrics.
        #[arg(long)]
        track_episodes: bool,
    },
    /// Save a model as an HF-compatible checkpoint directory.
    Export {
        #[command(flatten)]
        model: ModelArgs,
        /// Output directory (must not exist, or be empty).
        #[arg(long)]
        out: PathBuf,
    },
    /// Join a swarm briefly and print its peers as a table.
    Status {
        /// A peer of the swarm (repeatable).
        #[arg(long = "bootstrap", value_name = "MULTIADDR", required = true)]
        bootstrap: Vec<String>,
        /// The swarm key file, for a closed swarm.
        #[arg(long)]
        swarm_key: Option<PathBuf>,
        /// Seconds to listen for status gossip.
        #[arg(long, default_value_t = 6.0)]
        wait: f64,
    },
    /// Write a new random swarm key to a file (share it with every peer of the swarm).
    SwarmKey {
        #[arg(long)]
        out: PathBuf,
    },
    /// Print what a model is: architecture, sizes, special tokens, chat template.
    Info {
        /// `smollm2`, a GGUF file, or an HF model directory.
        #[arg(long, default_value = "smollm2")]
        model: String,
    },
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(role) = cli.role {
        if cli.command.is_some() {
            bail!("--role runs a peer; it does not combine with a subcommand");
        }
        return peer::run(role, &cli.swarm, &cli.role_args);
    }
    match cli.command {
        Some(Command::Status {
            bootstrap,
            swarm_key,
            wait,
        }) => peer::status(&bootstrap, swarm_key.as_deref(), wait),
        Some(Command::SwarmKey { out }) => {
            if out.exists() {
                bail!("{} exists; not overwriting a swarm key", out.display());
            }
            std::fs::write(&out, agentjet::swarm::SwarmKey::generate().to_file_text())
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote a new swarm key to {}", out.display());
            Ok(())
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            println!();
            Ok(())
        }
        Some(Command::Info { model }) => info(&model),
        #[cfg(feature = "torch")]
        Some(Command::Generate {
            model,
            prompt,
            system,
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            seed,
            show_tokens,
        }) => torch_cmds::generate(
            &model,
            &prompt,
            system.as_deref(),
            max_tokens,
            agentjet::engine::SamplingParams {
                temperature,
                top_p,
                top_k,
                min_p,
                repetition_penalty,
                ..Default::default()
            },
            seed,
            show_tokens,
        ),
        #[cfg(feature = "torch")]
        Some(Command::Export { model, out }) => torch_cmds::export(&model, &out),
        #[cfg(feature = "torch")]
        Some(Command::Serve {
            model,
            host,
            port,
            served_model_name,
            engine,
            max_prefill_tokens,
            default_max_tokens,
            track_episodes,
        }) => torch_cmds::serve(
            &model,
            &host,
            port,
            served_model_name,
            agentjet::engine::EngineConfig {
                max_batch: engine.max_batch,
                max_queue: engine.max_queue,
                max_kv_positions: engine.max_kv_positions,
                max_prefill_tokens,
            },
            agentjet::openai::server::ServerConfig {
                default_max_tokens,
                track_episodes,
                ..Default::default()
            },
        ),
        #[cfg(not(feature = "torch"))]
        Some(Command::Generate { .. } | Command::Export { .. } | Command::Serve { .. }) => bail!(
            "this agentjet-peer was built without LibTorch (`--no-default-features`); \
             rebuild with the default `torch` feature to run models"
        ),
    }
}

fn info(spec: &str) -> Result<()> {
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

#[cfg(feature = "torch")]
pub(crate) mod torch_cmds {
    use super::*;
    use agentjet::engine::{self, GenerateRequest, SamplingParams};
    use agentjet::model::checkpoint::{load_model, save_checkpoint, LoadedModel};
    use agentjet::model::llama::DType;
    use agentjet::model::{ChatRequest, ModelSource, StreamDecoder};
    use serde_json::json;
    use std::io::Write;
    use tch::Device;

    fn parse_device(s: &str) -> Result<Device> {
        Ok(match s {
            "auto" => Device::cuda_if_available(),
            "cpu" => Device::Cpu,
            "cuda" => {
                if !tch::Cuda::is_available() {
                    bail!("--device cuda: no CUDA device is available to LibTorch");
                }
                Device::Cuda(0)
            }
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => {
                    if (n as i64) >= tch::Cuda::device_count() {
                        bail!(
                            "--device {other}: only {} CUDA devices",
                            tch::Cuda::device_count()
                        );
                    }
                    Device::Cuda(n)
                }
                _ => bail!("--device {other:?}: expected auto, cpu, cuda or cuda:N"),
            },
        })
    }

    pub fn load(args: &ModelArgs) -> Result<LoadedModel> {
        let device = parse_device(&args.device)?;
        let dtype = match &args.dtype {
            Some(d) => {
                DType::parse(d).with_context(|| format!("--dtype {d:?}: expected f32 or bf16"))?
            }
            None if device.is_cuda() => DType::BF16,
            None => DType::F32,
        };
        let source = ModelSource::resolve(&args.model)?;
        load_model(&source, device, dtype).with_context(|| format!("loading model {}", args.model))
    }

    pub fn generate(
        args: &ModelArgs,
        prompt: &str,
        system: Option<&str>,
        max_tokens: usize,
        sampling: SamplingParams,
        seed: Option<u64>,
        show_tokens: bool,
    ) -> Result<()> {
        sampling.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
        let loaded = load(args)?;
        let card = &loaded.card;
        let mut messages = Vec::new();
        if let Some(s) = system {
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
                prompt.to_string()
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
        };
        let mut decoder = StreamDecoder::new();
        let stdout = std::io::stdout();
        let mut write_err = None;
        let gen = engine::generate(&loaded.model, &req, |id, _lp| {
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

    pub fn serve(
        args: &ModelArgs,
        host: &str,
        port: u16,
        served_model_name: Option<String>,
        engine_cfg: agentjet::engine::EngineConfig,
        server_cfg: agentjet::openai::server::ServerConfig,
    ) -> Result<()> {
        use agentjet::openai::server::router;
        use agentjet::openai::LocalBackend;
        use std::sync::Arc;
        let loaded = load(args)?;
        let model_context = loaded.model.max_positions();
        let name = served_model_name.unwrap_or_else(|| args.model.clone());
        let engine = agentjet::engine::spawn_engine(loaded.model, engine_cfg)
            .context("starting the engine")?;
        // A request must fit one KV slot of the engine.
        let max_context = model_context.min(engine.max_sequence);
        let backend = Arc::new(LocalBackend {
            name: name.clone(),
            card: Arc::new(loaded.card),
            engine,
            max_context,
        });
        let app = router(backend, server_cfg);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind((host, port))
                .await
                .with_context(|| format!("binding {host}:{port}"))?;
            let addr = listener.local_addr()?;
            println!("serving {name} at http://{addr}/v1 (OpenAI-compatible; Ctrl-C stops)");
            use std::io::Write as _;
            std::io::stdout().flush()?;
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await
                .context("serving HTTP")?;
            Ok::<(), anyhow::Error>(())
        })
    }

    pub fn export(args: &ModelArgs, out: &std::path::Path) -> Result<()> {
        let loaded = load(args)?;
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
