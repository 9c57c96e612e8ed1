//! The inference engine: token ids in, token ids and logprobs out.
//!
//! - [`handle`] (LibTorch-free): what requesters hold: [`EngineHandle`], the request and
//!   event types, the bounded queue, live counters, the weight-update slot;
//! - `scheduler` (LibTorch): the engine thread that owns the model and runs continuous
//!   batching (sequences join between decode steps, leave when done or cancelled), packed
//!   prefill, shared-prefill `n`, constrained decoding and weight updates;
//! - `direct` (LibTorch): generation without the thread (`agentjet-peer generate`,
//!   [`generate_batch`]);
//! - [`prefix`] (LibTorch-free): the prefix cache's radix tree; `memory` (LibTorch): the
//!   KV memory budget shared by the running sequences' slots and that cache;
//! - [`sampling`] and [`constraint`]: what token comes next, on plain `f32` rows.
//!
//! Owns: token ids in, token ids + logprobs out. Never renders chat or parses text beyond
//! the stop decision it is given.

pub mod constraint;
pub mod handle;
#[cfg(feature = "torch")]
mod memory;
pub mod prefix;
pub mod sampling;
#[cfg(feature = "torch")]
pub mod scheduler;

use std::time::Duration;

#[cfg(feature = "torch")]
mod direct;
pub use constraint::{Constraint, ConstraintError, ConstraintPattern, TokenBytes, ToolSpec};
#[cfg(feature = "torch")]
pub use direct::{generate, generate_batch};
pub use handle::{Completed, EngineError, EngineEvent, EngineHandle, EngineStats};
pub use sampling::{SamplingError, SamplingParams};
#[cfg(feature = "torch")]
pub use scheduler::spawn_engine;

/// Bounds of one engine; every one is a config value with a default.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests waiting beyond the running batch; more are refused as overloaded.
    pub max_queue: usize,
    /// KV positions in all, for the running sequences and the prefix cache together,
    /// taken as sequences grow; a request's prompt + max_tokens may hold this divided by
    /// `max_batch` (so a full batch always fits).
    pub max_kv_positions: usize,
    /// Bytes the prefix cache may hold at most (0: no prefix cache); it also gives way
    /// to the running sequences within `max_kv_positions`.
    pub prefix_cache_bytes: usize,
    /// Prompt tokens prefilled together in one packed pass at most (a longer single
    /// prompt still goes alone).
    pub max_prefill_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 32,
            max_queue: 256,
            max_kv_positions: 65_536,
            prefix_cache_bytes: 1 << 30,
            max_prefill_tokens: 8192,
        }
    }
}

/// Why a request cannot run on the model (told to its requester).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("prompt of {len} tokens does not fit the model's context of {limit}")]
    PromptSize { len: usize, limit: usize },
    #[error("prompt token id {id} is outside the vocabulary of {vocab}")]
    OutOfVocab { id: u32, vocab: u32 },
    #[error(
        "request needs {} KV positions (prompt {prompt} + max_tokens {max_tokens}), more than \
         the engine's per-request budget of {budget}",
        prompt + max_tokens
    )]
    OverBudget {
        prompt: usize,
        max_tokens: usize,
        budget: usize,
    },
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
    #[error("adapter {asked} is not served here ({served} adapters)")]
    UnknownAdapter { asked: usize, served: usize },
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FinishReason {
    /// A stop token was produced (it is included in the output).
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

#[derive(Debug, Clone, Default)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    /// How many of the most likely alternatives to report with each token (0 = none).
    pub top_logprobs: usize,
    /// A pattern the output must follow (JSON mode, forced tool calls); the output ends
    /// when the pattern is complete. Only the engine thread runs constraints.
    pub constraint: Option<Constraint>,
    /// The served adapter to generate with, by index in the engine model's bank (`None`:
    /// the model as loaded, with its own adapter if it has one). See
    /// [`crate::model::llama::bank`].
    pub adapter: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token under the model (untempered).
    pub logprobs: Vec<f64>,
    pub finish_reason: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    /// No tokens yet, after a prefill that took `prefill_time`.
    pub fn started(prefill_time: Duration) -> Generation {
        Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
            prefill_time,
            decode_time: Duration::ZERO,
        }
    }

    /// Decode speed: tokens after the first, per second of decode time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        let s = self.decode_time.as_secs_f64();
        if s > 0.0 {
            n / s
        } else {
            0.0
        }
    }
}
