//! The inference engine. Today: sampling, single-stream generation with the KV cache
//! (what `agentjet-peer generate` runs), and [`generate_batch`], which decodes many
//! sequences of different lengths together and lets each leave when it finishes. The
//! engine thread with continuous batching (sequences joining between steps), the bounded
//! request queue and cancellation arrive with the engine issue and build on these.
//!
//! Owns: token ids in, token ids + logprobs out. Never renders chat or parses text beyond
//! the stop decision it is given.

pub mod constraint;
pub mod sampling;
pub mod scheduler;

use std::time::Duration;

#[cfg(feature = "torch")]
mod direct;
pub use constraint::{Constraint, ConstraintPattern, TokenBytes, ToolSpec};
#[cfg(feature = "torch")]
pub use direct::{generate, generate_batch};
pub use sampling::{Rng, SamplingParams};
#[cfg(feature = "torch")]
pub use scheduler::spawn_engine;
pub use scheduler::{Completed, EngineConfig, EngineError, EngineEvent, EngineHandle, EngineStats};

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
