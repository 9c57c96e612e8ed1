//! # AgentJet-RS
//!
//! A peer-to-peer, elastic swarm for reinforcement learning of LLM agents.
//!
//! **Servers** (`agentjet-peer --role server`) host trainable models on LibTorch and do the
//! optimisation; **clients** (`agentjet-peer --role client`) run anyone's agent anywhere and
//! talk to the model through the OpenAI-compatible API every agent framework speaks. Peers
//! find each other over a libp2p gossip mesh and a DHT, with no central coordinator.
//!
//! The layers, arrows pointing down (nothing below imports anything above):
//!
//! ```text
//! main ─▶ server / client ─▶ openai / train / swarm / collective ─▶ engine / timeline ─▶ model / kernels
//! ```
//!
//! What exists today:
//! - [`model`]: the Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) with a KV cache,
//!   loaders for GGUF (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and HF
//!   safetensors directories, the tokenizer, chat templates, and HF-compatible checkpoints.
//! - [`engine`]: the engine thread (continuous batching, packed prefill, shared-prefill
//!   `n`, constrained decoding), sampling, and direct generation.
//! - [`openai`]: the OpenAI-compatible facade over any backend.
//! - [`timeline`]: calls, episodes, token-exact merged timelines, content-addressed
//!   fragments, and the per-call / linear / tree training layouts.
//!
//! Only `model`, `engine`, `train`, `collective` and `kernels` touch LibTorch, and only
//! behind the `torch` cargo feature (on by default): `cargo build --no-default-features`
//! builds a client without it.

pub mod model;
pub mod openai;

pub mod client;
pub mod engine;
#[cfg(feature = "torch")]
pub mod server;
pub mod swarm;
pub mod timeline;
#[cfg(feature = "torch")]
pub mod train;

/// `name` as one file-name component: ASCII letters, digits, `-`, `_` and `.` kept, any
/// other character `_` (model names and episode ids become directory and file names).
pub fn safe_file_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}
