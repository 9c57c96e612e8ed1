//! The command line: one flag set per role (`--role server|client|peer`) and the tool
//! subcommands, and their conversion into the library's configurations. Validation that
//! needs no I/O happens here; the roles validate the rest.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentjet::client::tasks::{load_source, Schedule};
use agentjet::client::{ClientConfig, EpisodeJob};
use agentjet::facade::external::ExternalModel;
use agentjet::swarm::{self, Multiaddr, Role as WireRole, SwarmConfig, SwarmKey};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

pub const EXAMPLES: &str = "\
Roles (each has its own flags: `agentjet-peer --role server --help`):
  --role server   host a model on this machine and train it (--model, --http, --no-train,
                  --follow, ...)
  --role client   run an agent on tasks against the swarm's models (--agent, --tasks, ...)
  --role peer     a bootstrap peer: gossip, the DHT, and (when publicly reachable) relay
                  service for peers behind NAT
  Every role: --bootstrap MULTIADDR (DNS names too), --listen MULTIADDR, --external-addr
  MULTIADDR, --no-relay, --data-dir DIR, --swarm-key FILE, --drain-timeout SECONDS
  (Ctrl-C or SIGTERM drains; a second one aborts).

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Host trainable models on this machine (GPU or CPU) and train them.
    Server,
    /// Run agents on tasks against the swarm's models.
    Client,
    /// A bootstrap peer any other can join through: gossip, the DHT, and relay service
    /// for peers behind NAT while it is publicly reachable.
    Peer,
}

/// The role named on a command line (`--role X` or `--role=X`), if any.
pub fn role_of(args: &[String]) -> Option<Role> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        let value = match a.strip_prefix("--role=") {
            Some(v) => Some(v.to_string()),
            None if a == "--role" => it.next().cloned(),
            None => None,
        };
        if let Some(v) = value {
            return Role::from_str(&v, true).ok();
        }
    }
    None
}

/// AgentJet-RS peer: a peer-to-peer elastic swarm for RL of LLM agents.
#[derive(Debug, Parser)]
#[command(name = "agentjet-peer", version, about, after_help = EXAMPLES)]
pub struct Cli {
    /// Join the swarm in this role (see "Roles" below; each role has its own flags).
    #[arg(long, value_enum)]
    pub role: Option<Role>,

    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `agentjet=debug`.
    #[arg(long, env = "AGENTJET_LOG", default_value = "warn", global = true)]
    pub log: String,

    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Flags every role has: where it listens, whom it joins, who it is.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct SwarmArgs {
    /// Address to listen on (repeatable). Default: QUIC and TCP on all interfaces, port
    /// 4001 for servers and plain peers, a free port for clients.
    #[arg(long = "listen", value_name = "MULTIADDR")]
    pub listen: Vec<String>,
    /// A peer to join through (repeatable), e.g. /ip4/10.0.0.5/udp/4001/quic-v1/p2p/12D3...
    #[arg(long = "bootstrap", value_name = "MULTIADDR")]
    pub bootstrap: Vec<String>,
    /// A file of bootstrap addresses, one per line (default: bootstrap/peers.txt if it exists).
    #[arg(long)]
    pub bootstrap_file: Option<PathBuf>,
    /// An address other hosts reach this peer at (repeatable): its public address, or a
    /// port forwarded to it, e.g. /ip4/203.0.113.7/udp/4001/quic-v1 or
    /// /dns4/gpu1.example.org/tcp/4001. Offered first; the peer counts as public.
    #[arg(long = "external-addr", value_name = "MULTIADDR")]
    pub external_addrs: Vec<String>,
    /// Offer no relay service (a publicly reachable peer relays for peers behind NAT by
    /// default, within the limits the README gives).
    #[arg(long)]
    pub no_relay: bool,
    /// Do not ask a UPnP gateway on the local network to forward the listen ports.
    #[arg(long)]
    pub no_upnp: bool,
    /// Identity key, episodes, caches: one directory per peer (default:
    /// ~/.local/share/agentjet/<role>). Peers side by side on one machine need their own.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The swarm key file (a closed swarm: peers without the key get no service).
    #[arg(long)]
    pub swarm_key: Option<PathBuf>,
    /// The run this peer trusts: its id (64 hex digits, printed by `agentjet-peer
    /// run-key`) or a file holding it. Only servers the run key certified then count:
    /// their calls are trained on, clients route to them, groups train with them. Implied
    /// by --cert and by a server's --run-key.
    #[arg(long, value_name = "ID|FILE")]
    pub run: Option<String>,
    /// This peer's certificate (`agentjet-peer certify`), presented to the swarm. A server
    /// reads the file again when it changes (a renewed certificate needs no restart).
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// Provider record lifetime in seconds (a dead server disappears within two).
    #[arg(long, default_value_t = 30.0)]
    pub provider_ttl: f64,
    /// Seconds between status gossip messages.
    #[arg(long, default_value_t = 2.0)]
    pub status_interval: f64,
    /// Seconds of silence after which a QUIC connection is dead.
    #[arg(long, default_value_t = 3.0)]
    pub idle_timeout: f64,
    /// Connected peers above which the least recently used connections are closed (gossip
    /// mesh peers and peers with an open stream are kept), down to two thirds of it.
    #[arg(long, default_value_t = 96)]
    pub max_connections: usize,
    /// Largest protocol message accepted, bytes.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_message_bytes: usize,
    /// Concurrent streams one peer may have open with this one, per protocol.
    #[arg(long, default_value_t = 256)]
    pub max_streams_per_peer: usize,
    /// New streams per second one peer may open (sustained).
    #[arg(long, default_value_t = 500.0)]
    pub max_requests_per_s: f64,
    /// Seconds a stop (Ctrl-C or SIGTERM) may take to let running work finish before
    /// what still runs is aborted.
    #[arg(long, default_value_t = 120.0)]
    pub drain_timeout: f64,
}

/// What every role's command line has: the role, the log filter, the swarm flags.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct RoleCommon {
    #[arg(long, value_enum)]
    pub role: Role,
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `agentjet=debug`.
    #[arg(long, env = "AGENTJET_LOG", default_value = "warn")]
    pub log: String,
    #[command(flatten)]
    pub swarm: SwarmArgs,
}

/// `agentjet-peer --role server`.
#[derive(Debug, Parser, serde::Serialize)]
#[command(
    name = "agentjet-peer --role server",
    about = "Host a model and train it"
)]
pub struct ServerCli {
    #[command(flatten)]
    pub common: RoleCommon,
    /// The model to host: `smollm2`, a GGUF file, or an HF directory.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// The name the swarm knows the model by (default: the --model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Serve (and train) a LoRA adapter of the base as model NAME, repeatable: `NAME` is a
    /// new adapter of --lora-rank's shape, `NAME=DIR` one in PEFT's format (a checkpoint's
    /// `adapter/`, or peft's save_pretrained). Every adapter shares the one frozen base
    /// and engine (one batch mixes them); each has its own trainer, run directory,
    /// episodes, steps and training group (named NAME). The base itself is then not served.
    #[arg(long = "adapter", value_name = "NAME[=DIR]")]
    pub adapters: Vec<String>,
    /// `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// `f32` or `bf16`; default f32 on CPU, bf16 on CUDA.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Also serve the OpenAI-compatible HTTP API at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub http: Option<String>,
    /// Serve the dashboard (and Prometheus /metrics) at HOST:PORT; port 0 takes a free
    /// one. The address is printed at start.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    pub dashboard: String,
    /// Serve no dashboard.
    #[arg(long)]
    pub no_dashboard: bool,
    /// Write what the server does (listening, serving, training steps, checkpoints, the
    /// training group's epochs and joins, the stop) to FILE as JSON lines, one typed
    /// event each, for programs that watch it.
    #[arg(long, value_name = "FILE")]
    pub events: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The run key (`agentjet-peer run-key`): this server trusts the run and certifies
    /// itself to serve its model and train it in its group, for a year from each start
    /// (implies --run).
    #[arg(long, value_name = "FILE", conflicts_with = "cert")]
    pub run_key: Option<PathBuf>,
    /// Bytes of episodes one submitting peer may store on this server (counting what it
    /// stored before a restart); past it its episodes are refused.
    #[arg(long, default_value_t = 8 << 30)]
    pub max_episode_bytes_per_peer: u64,
    /// Serve only, do not train on submitted episodes.
    #[arg(long)]
    pub no_train: bool,
    /// A rollout peer: serve the training group's latest policy version without training
    /// (--train-group names the group; default: the model's). Each version the group's
    /// members publish is fetched from every peer that holds it (members and other
    /// followers: only the chunks that changed, as deltas) and swapped in between two
    /// decode steps. Needs --swarm-key or --run (whom to believe). A group that trains a
    /// LoRA adapter is followed with the members' --lora-rank (and --lora-alpha,
    /// --lora-targets, --rslora); adapter groups (--adapter NAME, with that --lora-rank,
    /// or NAME=DIR) each by their name: only the adapter's versions travel.
    #[arg(long)]
    pub follow: bool,
    /// Chunk size (KiB) of the policy versions this server publishes to followers.
    #[arg(long, default_value_t = 1024)]
    pub weights_chunk_kib: u64,
    /// Tests only: serve every weight chunk with one byte changed (a lying peer).
    #[arg(long, hide = true)]
    pub test_tamper_chunks: bool,
    /// AdamW learning rate [default: 1e-5; 1e-4 with --lora-rank, since an adapter
    /// learns at about 10x full fine-tuning's rate ("LoRA Without Regret")].
    #[arg(long)]
    pub learning_rate: Option<f64>,
    /// Steps of linear learning-rate warmup.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// Trainable groups per optimizer step.
    #[arg(long, default_value_t = 4)]
    pub groups_per_step: usize,
    /// At most this many groups in one step (raised to --groups-per-step if lower): a
    /// backlog is trained over several steps, oldest first.
    #[arg(long, default_value_t = 16)]
    pub max_groups_per_step: usize,
    /// The group size assumed when a client does not say it.
    #[arg(long, default_value_t = 4)]
    pub num_repeat: usize,
    /// Seconds a group waits for its missing episodes before training on what arrived
    /// (at least 2 finished).
    #[arg(long, default_value_t = 600.0)]
    pub group_timeout: f64,
    /// Group advantage: `grpo`, `dr_grpo` or `rloo`.
    #[arg(long, default_value = "grpo")]
    pub advantage: String,
    /// Calls sampled more than this many policy versions ago are not trained on.
    #[arg(long, default_value_t = 4)]
    pub max_staleness: u64,
    /// PPO epochs: passes over each step's batch, against log-probabilities computed once
    /// before the first update (so the clip binds from the second update on).
    #[arg(long, default_value_t = 1)]
    pub ppo_epochs: usize,
    /// Mini-batches (of whole groups) per PPO epoch, one optimizer update each. A server
    /// taking more than one update per step trains alone unless --sync-every is set.
    #[arg(long, default_value_t = 1)]
    pub mini_batches: usize,
    /// Weight of the entropy bonus (of the distribution each token was sampled from).
    #[arg(long, default_value_t = 0.0)]
    pub entropy_coef: f64,
    /// Train a LoRA adapter of this rank on the frozen base (which stays in --dtype)
    /// instead of every weight: the optimizer, all-reduces and checkpoints hold only the
    /// adapter (checkpoints in PEFT's format). With --follow: the adapter the followed
    /// group trains (pass the members' --lora-* flags); only its versions travel.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// The adapter's alpha (scale alpha / rank). Default: 2 x rank.
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// The linear layers the adapter targets: `all`, or some of q,k,v,o,gate,up,down.
    #[arg(long, default_value = "all", requires = "lora_rank")]
    pub lora_targets: String,
    /// rsLoRA: scale alpha / sqrt(rank).
    #[arg(long, requires = "lora_rank")]
    pub rslora: bool,
    /// How the engine serves the trained adapter: `merged` (into its own copy of the
    /// base's weights, again after every step: faster decode, one more copy of those
    /// weights in memory; in bf16 the merged weights are rounded to bf16), `unmerged`
    /// (low-rank terms beside the base it shares with the trainer), or `auto`: merged for
    /// one adapter over a float32 base, else unmerged.
    #[arg(long, value_enum, default_value = "auto", requires = "lora_rank")]
    pub lora_serve: LoraServe,
    /// Save a checkpoint every N steps (outer steps with --sync-every) and when stopped.
    #[arg(long, default_value_t = 20)]
    pub checkpoint_every: u64,
    /// Seconds a training-group round may take: a member that stalls or dies longer fails
    /// the round at every member, and the others go on without it. Must exceed the
    /// slowest member's gradient computation.
    #[arg(long, default_value_t = 60.0)]
    pub collective_timeout: f64,
    /// How the training group's gradients travel: `f32` (exact) or `bf16` (half the bytes).
    #[arg(long, default_value = "f32")]
    pub allreduce_wire: String,
    /// How the training group's ring links run: `auto` (a direct TCP connection to a
    /// member reachable at its addresses, else a stream over the swarm's connection) or
    /// `swarm` (always a stream over the swarm's connection: only the swarm's port needs
    /// to be open).
    #[arg(long, default_value = "auto")]
    pub group_links: String,
    /// DiLoCo mode, for members far apart: each member takes N inner steps on its own
    /// episodes, then the group averages the parameter deltas and takes one outer step
    /// (Nesterov momentum). Policy versions count outer steps. 0: synchronous (every step
    /// all-reduces the gradients).
    #[arg(long, default_value_t = 0)]
    pub sync_every: u64,
    /// DiLoCo's outer learning rate.
    #[arg(long, default_value_t = 0.7)]
    pub outer_lr: f64,
    /// DiLoCo's outer Nesterov momentum.
    #[arg(long, default_value_t = 0.9)]
    pub outer_momentum: f64,
    /// DiLoCo: clip the members' mean parameter delta to this global L2 norm. Default: the
    /// most honest inner steps can move (4 lr N_inner sqrt(parameters), plus weight decay),
    /// so one member's huge delta moves the group no further than an honest one could.
    #[arg(long)]
    pub outer_max_norm: Option<f64>,
    /// The training group's name: servers of one model train together only when their
    /// group names (and modes) are equal, so two runs of one model in one swarm stay
    /// apart. Default: the served model's name.
    #[arg(long)]
    pub train_group: Option<String>,
    /// The training group's members compare their parameter hashes every N steps (outer
    /// steps in DiLoCo mode); a member that differs re-syncs from the others. 0: never.
    #[arg(long, default_value_t = 10)]
    pub hash_every: u64,
    /// Tests only: after this step this member's parameters silently drift.
    #[arg(long, hide = true)]
    pub test_perturb_at_step: Option<u64>,
    /// Tests only: from this group step on, send NaN values in every gradient round (a
    /// rogue member; the others must refuse them and name this peer).
    #[arg(long, hide = true)]
    pub test_send_nan_from_step: Option<u64>,
    /// Tests only: hold every gradient all-reduce this many milliseconds between its
    /// reduce-scatter and its all-gather.
    #[arg(long, hide = true)]
    pub test_midway_pause_ms: Option<u64>,
}

/// `agentjet-peer --role client`.
#[derive(Debug, Parser, serde::Serialize)]
#[command(
    name = "agentjet-peer --role client",
    about = "Run an agent on tasks against the swarm's models"
)]
pub struct ClientCli {
    #[command(flatten)]
    pub common: RoleCommon,
    /// A model to reach through the swarm (repeatable; default smollm2).
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// Port of the local OpenAI-compatible proxy on 127.0.0.1 (0 = a free one).
    #[arg(long, default_value_t = 0)]
    pub proxy_port: u16,
    /// Seconds to wait for a provider of each model at start.
    #[arg(long, default_value_t = 120.0)]
    pub wait: f64,
    /// Run this command once per episode (its own process group; see README).
    #[arg(long)]
    pub agent: Option<String>,
    /// A task file (JSONL) or a directory of them, optionally `:WEIGHT` for its share when
    /// several are mixed (repeatable).
    #[arg(long = "tasks", value_name = "PATH[:WEIGHT]")]
    pub tasks: Vec<String>,
    /// Reward command given the task and the transcript (instead of the agent's).
    #[arg(long)]
    pub grader: Option<String>,
    /// Episodes per task (GRPO's group).
    #[arg(long, default_value_t = 4)]
    pub num_repeat: usize,
    /// Episodes running at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Seconds an episode may run before it is killed and aborted.
    #[arg(long, default_value_t = 300.0)]
    pub episode_timeout: f64,
    /// Groups to run in all (default: every task once, times --epochs).
    #[arg(long)]
    pub groups: Option<usize>,
    /// Start no new episode after this many seconds (running ones finish).
    #[arg(long, value_name = "SECONDS")]
    pub time_limit: Option<f64>,
    /// Passes over the task sources (when --groups is not given).
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Run episodes but submit nothing (debug an agent against the live model).
    #[arg(long)]
    pub dry_run: bool,
    /// A model that is not trained, served by any OpenAI-compatible endpoint
    /// (`NAME=URL[#REMOTE]`, e.g. `judge=http://127.0.0.1:8000/v1`; repeatable). Its calls
    /// are forwarded as they are, recorded in the run dir, never submitted. API key:
    /// env AGENTJET_EXTERNAL_KEY_<NAME> or AGENTJET_EXTERNAL_KEY.
    #[arg(long = "external-model", value_name = "NAME=URL[#REMOTE]")]
    pub external_models: Vec<String>,
    /// Where episode logs and the summary go (default: <data-dir>/runs/<time>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Serve the dashboard (and Prometheus /metrics) at HOST:PORT, e.g. 127.0.0.1:0
    /// (a free port; the address is printed at start).
    #[arg(long, value_name = "HOST:PORT")]
    pub dashboard: Option<String>,
    /// Write what the client does (listening, its proxy's and dashboard's addresses, the
    /// job's start, a drain, its end) to FILE as JSON lines, one typed event each, for
    /// programs that watch it.
    #[arg(long, value_name = "FILE")]
    pub events: Option<PathBuf>,
}

/// `agentjet-peer --role peer`.
#[derive(Debug, Parser)]
#[command(
    name = "agentjet-peer --role peer",
    about = "A bootstrap peer: gossip, the DHT, and relay service for peers behind NAT"
)]
pub struct PeerCli {
    #[command(flatten)]
    pub common: RoleCommon,
}

/// The engine's bounds (`serve` and `--role server`).
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct EngineArgs {
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// Requests waiting beyond the batch before refusing (429; a swarm client re-routes).
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// KV-cache positions in all, for running requests and the prefix cache together,
    /// taken as sequences grow; one request (prompt + max_tokens) may hold this divided
    /// by --max-batch.
    #[arg(long, default_value_t = 65536)]
    pub max_kv_positions: usize,
    /// Bytes the prefix cache (keys and values of earlier prompts and answers, reused by
    /// requests that repeat them) may hold at most; 0 turns it off.
    #[arg(long, default_value_t = 1 << 30)]
    pub prefix_cache_bytes: usize,
    /// Prompt tokens prefilled together in one pass at most.
    #[arg(long, default_value_t = 8192)]
    pub max_prefill_tokens: usize,
}

#[cfg(feature = "torch")]
impl EngineArgs {
    pub fn config(&self) -> agentjet::engine::EngineConfig {
        agentjet::engine::EngineConfig {
            max_batch: self.max_batch,
            max_queue: self.max_queue,
            max_kv_positions: self.max_kv_positions,
            prefix_cache_bytes: self.prefix_cache_bytes,
            max_prefill_tokens: self.max_prefill_tokens,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// `smollm2` (the default model), a GGUF file, or an HF model directory.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// `f32` or `bf16`; default f32 on CPU, bf16 on CUDA.
    #[arg(long)]
    pub dtype: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
        /// Also serve a LoRA adapter of the base, in PEFT's format (a training checkpoint's
        /// `adapter/` or peft's save_pretrained), as model NAME: `NAME=DIR`, repeatable.
        /// One batch mixes the base's and every adapter's requests.
        #[arg(long = "adapter", value_name = "NAME=DIR", value_parser = named_adapter)]
        adapters: Vec<(String, PathBuf)>,
        #[command(flatten)]
        engine: EngineArgs,
        /// max_tokens for requests that give none.
        #[arg(long, default_value_t = 1024)]
        default_max_tokens: usize,
        /// Track chat calls per episode (the API key names the episode): each call
        /// extends the exact token ids of the episode's previous call (token-in-token-out),
        /// and breaks are counted in /metrics.
        #[arg(long)]
        track_episodes: bool,
        /// Seconds a stop (Ctrl-C or SIGTERM) lets running requests finish.
        #[arg(long, default_value_t = 120.0)]
        drain_timeout: f64,
    },
    /// Save a model as an HF-compatible checkpoint directory (with --adapter DIR --merge:
    /// the base with a LoRA adapter merged into its weights).
    Export {
        #[command(flatten)]
        model: ModelArgs,
        /// A LoRA adapter directory in PEFT's format (adapter_config.json and
        /// adapter_model.safetensors: a training checkpoint's `adapter/`, or what
        /// peft's save_pretrained writes), merged into the base.
        #[arg(long, requires = "merge")]
        adapter: Option<PathBuf>,
        /// Merge --adapter into the base's weights (W + scale * B * A).
        #[arg(long, requires = "adapter")]
        merge: bool,
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
        /// The run whose certificates are checked (id or file): the CERTIFIED column.
        #[arg(long, value_name = "ID|FILE")]
        run: Option<String>,
        /// Seconds to listen for status gossip.
        #[arg(long, default_value_t = 6.0)]
        wait: f64,
    },
    /// Write a new random swarm key to a file (share it with every peer of the swarm).
    SwarmKey {
        #[arg(long)]
        out: PathBuf,
    },
    /// Write a new run key to a file (mode 0600) and print the run's id: the key's holder
    /// decides which servers serve and train in the run (`certify`, or a server's
    /// `--run-key`); every other peer is told the id (`--run`).
    RunKey {
        #[arg(long)]
        out: PathBuf,
    },
    /// Certify a peer with a run key: it may serve a model (its signed calls are trained
    /// on) and train it in a group, until the expiry.
    Certify {
        /// The run key file.
        #[arg(long)]
        run_key: PathBuf,
        /// The peer id to certify (`agentjet-peer id --data-dir DIR` prints a data
        /// directory's; a server also prints its own at start).
        #[arg(long)]
        peer: String,
        /// The model's name as the swarm knows it (a server's --served-model-name).
        #[arg(long)]
        model: String,
        /// The training group (a server's --train-group; default the model's name).
        #[arg(long)]
        group: Option<String>,
        /// Serve only: its calls count, but it does not train in the group.
        #[arg(long, conflicts_with = "train_only")]
        serve_only: bool,
        /// Train only: it trains in the group, but its calls do not count.
        #[arg(long)]
        train_only: bool,
        /// Days until the certificate expires.
        #[arg(long, default_value_t = 30.0)]
        days: f64,
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the peer id of a data directory's identity (created on first use).
    Id {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// List the runs in data directories (training runs and client jobs) with their
    /// last figures.
    Runs {
        /// A peer's data directory (repeatable; default: the server's and the client's).
        #[arg(long = "data-dir")]
        data_dirs: Vec<PathBuf>,
    },
    /// Run a study: many arms of one training setup (a grid, or successive halving),
    /// launched, watched, repaired and reported on by a driver (`study run`,
    /// `study status`, `study report`).
    Study {
        #[command(subcommand)]
        action: StudyAction,
    },
    /// Print what a model is: architecture, sizes, special tokens, chat template.
    Info {
        /// `smollm2`, a GGUF file, or an HF model directory.
        #[arg(long, default_value = "smollm2")]
        model: String,
    },
}

/// What `agentjet-peer study` does.
#[derive(Debug, Subcommand)]
pub enum StudyAction {
    /// Run the study (or go on with it: its journal says where it was).
    Run(StudyArgs),
    /// Print where the study is: each arm's state and figures, the last decisions.
    Status(StudyArgs),
    /// Write the study's report (report.md and curves.svg in its directory).
    Report(StudyArgs),
    /// Run study arms on this machine for the drivers named (a peer of a closed swarm:
    /// a study file's `[workers]` finds it there).
    Worker(Box<WorkerArgs>),
}

#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub swarm: SwarmArgs,
    /// A driver whose arms this worker runs (repeatable): its peer id, which
    /// `agentjet-peer id --data-dir <the study's directory>` prints. An arm's client runs
    /// the study's agent command: allow only drivers you would let run programs here.
    #[arg(long = "allow-driver", value_name = "PEER_ID", required = true)]
    pub allow_driver: Vec<String>,
    /// Arms at once.
    #[arg(long, default_value_t = 1)]
    pub slots: u32,
    /// Seconds a driver may say nothing before its arms here are stopped (their servers
    /// save their checkpoints); it says it lives every second. At least 10.
    #[arg(long, default_value_t = 30.0)]
    pub lease_seconds: f64,
}

#[derive(Debug, clap::Args)]
pub struct StudyArgs {
    /// The study file (TOML; see examples/study/).
    pub file: PathBuf,
    /// The study's directory: its journal, arms and report (default: runs/<name>).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// `study run`: show the study on a web page at HOST:PORT while it runs (port 0: a
    /// free one; the address is printed).
    #[arg(long, value_name = "HOST:PORT")]
    pub dashboard: Option<String>,
}

/// A positive number of seconds.
pub fn secs(name: &str, v: f64) -> Result<Duration> {
    match Duration::try_from_secs_f64(v) {
        Ok(d) if v > 0.0 => Ok(d),
        _ => bail!("--{name} must be a positive number of seconds, got {v}"),
    }
}

pub fn load_key(path: Option<&Path>) -> Result<Option<SwarmKey>> {
    path.map(|p| SwarmKey::load(p).map_err(|e| anyhow!(e)))
        .transpose()
}

/// `--run`: a run id, or a file holding one.
pub fn run_id(arg: Option<&str>) -> Result<Option<swarm::RunId>> {
    let Some(a) = arg else { return Ok(None) };
    if let Ok(id) = swarm::RunId::parse(a) {
        return Ok(Some(id));
    }
    let text = std::fs::read_to_string(a).map_err(|e| {
        anyhow!("--run {a:?} is neither a run id (64 hex digits) nor a readable file: {e}")
    })?;
    swarm::RunId::parse(&text)
        .map(Some)
        .map_err(|e| anyhow!("--run {a}: {e}"))
}

pub fn parse_addrs(flag: &str, addrs: &[String]) -> Result<Vec<Multiaddr>> {
    addrs
        .iter()
        .map(|a| swarm::parse_addr(a).map_err(|e| anyhow!("--{flag}: {e}")))
        .collect()
}

impl SwarmArgs {
    /// The peer's data directory (`--data-dir`, else `~/.local/share/agentjet/<role>`).
    pub fn data_dir(&self, role: &str) -> PathBuf {
        match &self.data_dir {
            Some(d) => d.clone(),
            None => SwarmArgs::default_data_dir(role),
        }
    }

    /// A role's data directory when `--data-dir` is not given.
    pub fn default_data_dir(role: &str) -> PathBuf {
        let base = std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
            .unwrap_or_else(|| PathBuf::from("."));
        base.join("agentjet").join(role)
    }

    /// The node's configuration; the identity key lives in `dir`.
    pub fn config(&self, role: WireRole, dir: &Path) -> Result<SwarmConfig> {
        let key = swarm::load_or_create_identity(&dir.join("identity.key"))?;
        let mut cfg = SwarmConfig::new(role, key);
        let port = if role == WireRole::Client { 0 } else { 4001 };
        cfg.listen = if self.listen.is_empty() {
            vec![
                format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?,
                format!("/ip4/0.0.0.0/tcp/{port}").parse()?,
            ]
        } else {
            parse_addrs("listen", &self.listen)?
        };
        let mut boot = parse_addrs("bootstrap", &self.bootstrap)?;
        let file = self.bootstrap_file.clone().or_else(|| {
            let d = PathBuf::from("bootstrap/peers.txt");
            (self.bootstrap.is_empty() && d.is_file()).then_some(d)
        });
        if let Some(f) = file {
            boot.extend(swarm::read_bootstrap_file(&f)?);
        }
        cfg.bootstrap = boot;
        cfg.external = parse_addrs("external-addr", &self.external_addrs)?;
        // Servers and plain peers relay (long-lived); a client never does (it comes and
        // goes with its job).
        cfg.relay_service = !self.no_relay && role != WireRole::Client;
        cfg.upnp = !self.no_upnp;
        cfg.swarm_key = load_key(self.swarm_key.as_deref())?;
        cfg.cert = self
            .cert
            .as_deref()
            .map(swarm::Certificate::load)
            .transpose()
            .map_err(|e| anyhow!("--cert {e}"))?;
        cfg.run = run_id(self.run.as_deref())?;
        if let Some(c) = &cfg.cert {
            match cfg.run {
                None => cfg.run = Some(c.run()),
                Some(r) if r != c.run() => bail!(
                    "--cert is a certificate of run {}, but --run names run {r}",
                    c.run()
                ),
                Some(_) => {}
            }
            if c.peer() != Some(cfg.keypair.public().to_peer_id()) {
                bail!(
                    "--cert certifies peer {}, but this peer (identity in {}) is {}",
                    c.peer().map_or_else(|| "?".into(), |p| p.to_string()),
                    dir.display(),
                    cfg.keypair.public().to_peer_id()
                );
            }
        }
        cfg.provider_ttl = secs("provider-ttl", self.provider_ttl)?;
        cfg.status_interval = secs("status-interval", self.status_interval)?;
        cfg.quic_idle_timeout = secs("idle-timeout", self.idle_timeout)?;
        cfg.max_frame_bytes = self.max_message_bytes;
        if self.max_connections < 8 {
            bail!(
                "--max-connections {} is below 8 (the gossip mesh alone keeps up to 12)",
                self.max_connections
            );
        }
        cfg.max_connections = self.max_connections;
        cfg.min_connections = self.max_connections * 2 / 3;
        cfg.max_streams_per_peer = self.max_streams_per_peer.max(1);
        cfg.max_requests_per_s = self.max_requests_per_s;
        cfg.request_burst = (self.max_requests_per_s * 2.0).max(1.0);
        Ok(cfg)
    }
}

impl ClientCli {
    pub fn config(&self) -> Result<ClientConfig> {
        let data_dir = self.common.swarm.data_dir("client");
        let swarm = self.common.swarm.config(WireRole::Client, &data_dir)?;
        let models = if self.models.is_empty() {
            vec!["smollm2".to_string()]
        } else {
            self.models.clone()
        };
        let external = self
            .external_models
            .iter()
            .map(|spec| {
                ExternalModel::parse(spec, |k| std::env::var(k).ok())
                    .map(Arc::new)
                    .map_err(|e| anyhow!("--external-model {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let job = match &self.agent {
            None => {
                if !self.tasks.is_empty() {
                    bail!("--tasks needs --agent COMMAND (the agent to run on them)");
                }
                None
            }
            Some(command) => {
                if self.tasks.is_empty() {
                    bail!("--agent needs --tasks FILE (JSONL, one task per line)");
                }
                let sources = self
                    .tasks
                    .iter()
                    .map(|t| load_source(t).context("--tasks"))
                    .collect::<Result<Vec<_>>>()?;
                let schedule = Schedule::new(sources)?;
                let groups = self.groups.unwrap_or_else(|| {
                    agentjet::client::episodes::default_groups(&schedule, self.epochs)
                });
                Some(EpisodeJob {
                    command: command.clone(),
                    schedule,
                    grader: self.grader.clone(),
                    episode_timeout: secs("episode-timeout", self.episode_timeout)?,
                    groups,
                    num_repeat: self.num_repeat,
                    concurrency: self.concurrency,
                    dry_run: self.dry_run,
                    time_limit: self.time_limit.map(|t| secs("time-limit", t)).transpose()?,
                    run_dir: self.run_dir.clone(),
                })
            }
        };
        Ok(ClientConfig {
            swarm,
            data_dir,
            models,
            wait: secs("wait", self.wait)?,
            proxy_port: self.proxy_port,
            external,
            job,
            drain_timeout: secs("drain-timeout", self.common.swarm.drain_timeout)?,
            dashboard: self.dashboard.clone(),
            config_json: serde_json::to_value(self).ok(),
            events_file: self.events.clone(),
        })
    }
}

/// `NAME=DIR` of `--adapter`.
pub fn named_adapter(s: &str) -> Result<(String, PathBuf), String> {
    let Some((name, dir)) = s.split_once('=') else {
        return Err(format!(
            "{s:?}: expected NAME=DIR (the adapter's model name and its directory)"
        ));
    };
    let name = name.trim();
    if name.is_empty() || dir.trim().is_empty() {
        return Err(format!("{s:?}: expected NAME=DIR, both non-empty"));
    }
    Ok((name.to_string(), PathBuf::from(dir.trim())))
}

/// `--lora-serve`: how the engine serves a trained adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoraServe {
    Auto,
    Merged,
    Unmerged,
}
