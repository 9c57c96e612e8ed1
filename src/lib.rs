//! # AgentJet-RS
//!
//! A peer-to-peer, elastic swarm for reinforcement learning of LLM agents.
//!
//! **Servers** (`agentjet-peer --role server`, [`server::run`]) host trainable models on
//! LibTorch and do the optimisation; **clients** (`agentjet-peer --role client`,
//! [`client::run`]) run anyone's agent anywhere and talk to the model through the
//! OpenAI-compatible API every agent framework speaks. Peers find each other over a libp2p
//! gossip mesh and a DHT, with no central coordinator.
//!
//! The layers, arrows pointing down (a module uses only lower layers; `tests/layering`
//! checks it against docs/ARCHITECTURE.md, which is the map of the whole system):
//!
//! ```text
//!  agentjet-peer (src/bin)        flags → configs, one runtime, Ctrl-C/SIGTERM → Stop
//!         │
//!  server     client              the roles, as a library: server::run / client::run
//!         │
//!  facade train rpc collective   HTTP APIs · RL trainer · role protocols on swarm streams ·
//!  dash                           the training group · the dashboard and /metrics
//!         │
//!  engine   timeline              model thread (batching, sampling) · token bookkeeping
//!         │
//!  model    swarm                 decoder, loaders, tokenizer · libp2p node (bytes, peers)
//!         │
//!  base                           Rng, Stop, lock policy, allocator and cores policy, files, plots
//!         │
//!  agentjet-kernels               fused compute kernels (a separate crate)
//! ```
//!
//! - [`base`]: the random generator, the stop signal (drain / abort) with task trackers,
//!   the lock policy, the allocator policy, the cores free for the process, atomic file
//!   writes.
//! - [`model`]: the Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) with its caches,
//!   loaders for GGUF and HF safetensors directories, the tokenizer, chat templates, and
//!   HF-compatible checkpoints.
//! - [`swarm`]: the libp2p node (QUIC/TCP, identify, gossip status, Kademlia providers,
//!   admission, the swarm key, signatures); it moves bytes and knows no models.
//! - [`engine`]: the engine handle and the engine thread (continuous batching, packed
//!   prefill, shared-prefill `n`, constrained decoding, weight updates), sampling, and
//!   direct generation.
//! - [`timeline`]: calls, episodes, token-exact merged timelines, content-addressed
//!   fragments, call digests, and the per-call / linear / tree training layouts.
//! - [`facade`]: the HTTP APIs agents speak (OpenAI chat completions and completions,
//!   OpenAI Responses, Anthropic Messages) over any backend, with token-in-token-out
//!   episode tracking.
//! - [`rpc`]: what servers and clients say over swarm streams (infer, card, submit).
//! - [`train`]: group buffer, advantages, GRPO-family losses, AdamW, the trainer,
//!   checkpoints.
//! - [`collective`]: the training group (membership epochs, ring all-reduce over sealed
//!   links, DiLoCo's heartbeat pacing) and the member loop that drives any learner
//!   through it (the server's trainer, netsim's stand-in).
//! - [`dash`]: the dashboard every peer serves (live view, curves, episodes, logs) and
//!   its Prometheus `/metrics`; run directories as the dashboard and `runs` read them.
//! - [`server`] and [`client`]: the roles.
//! - [`study`]: studies of many arms that a driver runs, watches and reports on
//!   (it runs the roles as processes).
//!
//! Only `model`, `engine`, `train`, `server` and `agentjet-kernels` touch LibTorch, and
//! only behind the `torch` cargo feature (on by default): `cargo build
//! --no-default-features` builds a client without it.

pub mod base;
pub mod client;
pub mod collective;
pub mod dash;
pub mod engine;
pub mod facade;
pub mod model;
pub mod rpc;
#[cfg(feature = "torch")]
pub mod server;
pub mod study;
pub mod swarm;
pub mod timeline;
#[cfg(feature = "torch")]
pub mod train;
