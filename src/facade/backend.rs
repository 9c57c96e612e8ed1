//! The facade's one way to a model: the [`Backend`] trait. `serve` and a server's `--http`
//! plug in a local engine ([`LocalBackend`]); the client plugs in the swarm. The facade
//! hears each choice as a stream of [`ChoiceEvent`]s: the engine's tokens and finish,
//! and, from a remote server, the signatures that attest them ([`SignedPart`]), which the
//! tracker keeps with the call. The engine itself never signs anything.
//!
//! Owns: the backend contract. Never renders chat or touches HTTP.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::base::prom::Prom;
use crate::engine::{EngineError, EngineEvent, EngineHandle, GenerateRequest};
use crate::model::ModelCard;

/// Tokens `start..upto` of a choice as one call a server signed (the signature is
/// opaque here: the swarm's encoding of the server's signature over the call's digest).
#[derive(Debug, Clone, PartialEq)]
pub struct SignedPart {
    pub start: usize,
    pub upto: usize,
    pub policy_version: u64,
    pub signature: Vec<u8>,
}

/// What a requester hears about one choice, in order: the engine's events (tokens, then
/// one `Finished` or one `Failed`), each token possibly preceded by the signature that
/// covers it (from a remote server).
#[derive(Debug, Clone, PartialEq)]
pub enum ChoiceEvent {
    Engine(EngineEvent),
    /// From a remote server, just before the token it covers: its signature over the call
    /// whose prompt is the request's prompt plus this choice's tokens before `start`, and
    /// whose completion is the tokens `start..upto`.
    Signed(SignedPart),
}

/// One choice's events. Dropping it cancels the choice.
pub type ChoiceStream = Pin<Box<dyn Stream<Item = ChoiceEvent> + Send>>;

/// What the facade needs from whatever runs the model.
/// Which calls belong together, for a backend that picks a server per call: calls of one
/// episode repeat each other's context, so one server's prefix cache serves them best.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The episode the call belongs to (the bearer token of a tracking proxy).
    pub episode: Option<String>,
}

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
    /// events stream back, one stream per choice. Dropping a stream cancels its choice.
    /// `route` tells a backend that picks among servers which calls belong together.
    fn submit(
        &self,
        model: &str,
        req: GenerateRequest,
        n: usize,
        route: &Route,
    ) -> Result<Vec<ChoiceStream>, EngineError>;
    /// Its Prometheus metrics (engine gauges and counters).
    fn metrics(&self, p: &mut Prom);
}

/// One model served by a local engine thread (what `agentjet-peer serve` runs), and the
/// LoRA adapters of its engine's bank, each as a model of its own name.
pub struct LocalBackend {
    pub name: String,
    pub card: Arc<ModelCard>,
    pub engine: EngineHandle,
    pub max_context: usize,
    /// `(model name, bank index)` of each served adapter.
    pub adapters: Vec<(String, usize)>,
}

impl LocalBackend {
    /// Whether `model` is served, and with which adapter (`None`: the base).
    fn resolve(&self, model: &str) -> Option<Option<usize>> {
        if let Some(&(_, i)) = self.adapters.iter().find(|(n, _)| n == model) {
            return Some(Some(i));
        }
        (model == self.name).then_some(None)
    }
}

impl Backend for LocalBackend {
    fn model_ids(&self) -> Vec<String> {
        let mut ids = vec![self.name.clone()];
        for (n, _) in &self.adapters {
            if !ids.contains(n) {
                ids.push(n.clone());
            }
        }
        ids
    }
    fn card(&self, model: &str) -> Option<Arc<ModelCard>> {
        self.resolve(model).map(|_| self.card.clone())
    }
    fn max_context(&self, model: &str) -> Option<usize> {
        self.resolve(model).map(|_| self.max_context)
    }
    fn ready(&self) -> bool {
        true
    }
    fn submit(
        &self,
        model: &str,
        mut req: GenerateRequest,
        n: usize,
        _route: &Route,
    ) -> Result<Vec<ChoiceStream>, EngineError> {
        req.adapter = self.resolve(model).flatten();
        Ok(self
            .engine
            .submit_n(req, n)?
            .into_iter()
            .map(|rx| {
                Box::pin(UnboundedReceiverStream::new(rx).map(ChoiceEvent::Engine)) as ChoiceStream
            })
            .collect())
    }
    fn metrics(&self, p: &mut Prom) {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.engine.stats;
        let l = [("model", self.name.as_str())];
        let gauges = [
            (
                "agentjet_engine_running",
                "Sequences decoding.",
                s.running.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_waiting",
                "Requests waiting for a slot.",
                s.waiting.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_kv_bytes",
                "Bytes of keys and values in use.",
                s.kv_bytes.load(Relaxed) as f64,
            ),
            (
                "agentjet_policy_version",
                "The policy version served.",
                s.policy_version.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_kv_allocated_bytes",
                "Bytes of the KV pool allocated.",
                s.kv_allocated_bytes.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_bytes",
                "Bytes the prefix cache holds.",
                s.prefix_bytes.load(Relaxed) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            p.gauge(name, help, &l, v);
        }
        let counters = [
            (
                "agentjet_engine_completed_total",
                "Generations completed.",
                s.completed.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_cancelled_total",
                "Generations cancelled.",
                s.cancelled.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_generated_tokens_total",
                "Tokens generated.",
                s.generated_tokens.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_prefill_tokens_total",
                "Prompt tokens prefilled.",
                s.prefill_tokens.load(Relaxed) as f64,
            ),
            (
                "agentjet_engine_prefill_passes_total",
                "Prefill passes.",
                s.prefill_passes.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_lookups_total",
                "Prefix cache lookups.",
                s.prefix_lookups.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_hits_total",
                "Prefix cache lookups that found a prefix.",
                s.prefix_hits.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_reused_tokens_total",
                "Prompt tokens taken from the prefix cache.",
                s.prefix_reused_tokens.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_evictions_total",
                "Prefix cache evictions.",
                s.prefix_evictions.load(Relaxed) as f64,
            ),
            (
                "agentjet_prefix_cache_invalidated_tokens_total",
                "Cached positions invalidated by a new policy version.",
                s.prefix_invalidated_positions.load(Relaxed) as f64,
            ),
        ];
        for (name, help, v) in counters {
            p.counter(name, help, &l, v);
        }
    }
}
