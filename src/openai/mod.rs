//! The OpenAI-compatible facade: `POST /v1/chat/completions` (streaming and not, `n`,
//! logprobs with `top_logprobs`, `stop`, `seed`, `max_tokens` / `max_completion_tokens`,
//! tools -> `tool_calls`), `POST /v1/completions` (text or token-id prompts, `echo`,
//! logprobs), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! Owns: HTTP, request validation, chat rendering (token-in-token-out: the model's own
//! template, then the tokenizer, nothing else), detokenization, stop strings and tool-call
//! parsing. It reaches a model only through [`Backend`]: the server plugs in its engine,
//! the client (a later issue) plugs in the swarm. Never touches LibTorch.
//!
//! Extensions on every response (ignored by OpenAI SDKs, read by AgentJet's trainer):
//! `agentjet.prompt_token_ids`, `agentjet.policy_version`, and `choices[i].token_ids`.
//!
//! Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a
//! bad request (naming the field), 404 for an unknown model, 400 `context_length_exceeded`
//! (saying the limits), 429 when the engine's queue is full, 503 when not ready.

pub mod external;
pub mod server;
pub mod text;
pub mod track;
pub mod types;

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{EngineError, EngineEvent, EngineHandle, GenerateRequest};
use crate::model::ModelCard;

/// What the facade needs from whatever runs the model.
pub trait Backend: Send + Sync + 'static {
    /// Names of the models served, for `/v1/models` and routing.
    fn model_ids(&self) -> Vec<String>;
    /// The card (tokenizer, template, limits) of a served model.
    fn card(&self, model: &str) -> Option<Arc<ModelCard>>;
    /// The longest sequence (prompt + completion) a model takes.
    fn max_context(&self, model: &str) -> Option<usize>;
    /// False while starting up (answers 503).
    fn ready(&self) -> bool;
    /// Starts `n` generations from one prompt (choice `i` seeded with `seed + i`); their
    /// events stream back, one receiver per choice. Dropping a receiver cancels it.
    fn submit(
        &self,
        model: &str,
        req: GenerateRequest,
        n: usize,
    ) -> Result<Vec<UnboundedReceiver<EngineEvent>>, EngineError>;
    /// Extra Prometheus lines (engine gauges and counters).
    fn metrics(&self) -> String;
}

/// One model served by a local engine thread (what `agentjet-peer serve` runs).
pub struct LocalBackend {
    pub name: String,
    pub card: Arc<ModelCard>,
    pub engine: EngineHandle,
    pub max_context: usize,
}

impl Backend for LocalBackend {
    fn model_ids(&self) -> Vec<String> {
        vec![self.name.clone()]
    }
    fn card(&self, model: &str) -> Option<Arc<ModelCard>> {
        (model == self.name).then(|| self.card.clone())
    }
    fn max_context(&self, model: &str) -> Option<usize> {
        (model == self.name).then_some(self.max_context)
    }
    fn ready(&self) -> bool {
        true
    }
    fn submit(
        &self,
        _model: &str,
        req: GenerateRequest,
        n: usize,
    ) -> Result<Vec<UnboundedReceiver<EngineEvent>>, EngineError> {
        self.engine.submit_n(req, n)
    }
    fn metrics(&self) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.engine.stats;
        let m = &self.name;
        format!(
            "# TYPE agentjet_engine_running gauge\nagentjet_engine_running{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_waiting gauge\nagentjet_engine_waiting{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_kv_bytes gauge\nagentjet_engine_kv_bytes{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_completed_total counter\nagentjet_engine_completed_total{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_cancelled_total counter\nagentjet_engine_cancelled_total{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_generated_tokens_total counter\nagentjet_engine_generated_tokens_total{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_prefill_tokens_total counter\nagentjet_engine_prefill_tokens_total{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_engine_prefill_passes_total counter\nagentjet_engine_prefill_passes_total{{model=\"{m}\"}} {}\n\
             # TYPE agentjet_policy_version gauge\nagentjet_policy_version{{model=\"{m}\"}} {}\n",
            s.running.load(Relaxed),
            s.waiting.load(Relaxed),
            s.kv_bytes.load(Relaxed),
            s.completed.load(Relaxed),
            s.cancelled.load(Relaxed),
            s.generated_tokens.load(Relaxed),
            s.prefill_tokens.load(Relaxed),
            s.prefill_passes.load(Relaxed),
            s.policy_version.load(Relaxed),
        )
    }
}
