//! The engine's handle: what requesters hold (LibTorch-free, so the facade and a
//! client-only build use the same types): the bounds, the events a request streams, the
//! bounded queue into the engine thread, live counters, and the slot through which new
//! weights arrive. The thread that drains the queue is [`super::scheduler`].
//!
//! Owns: the requester's side of the engine. Never touches a model.

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::{FinishReason, GenerateRequest};
use crate::base::lock;

/// What a requester hears about its request, in order: tokens, then one `Finished` (or
/// one `Failed`).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Token {
        id: u32,
        /// Under the model's own distribution (what the OpenAI API reports).
        logprob: f64,
        /// Under the distribution the token was drawn from (temperature, truncation,
        /// penalties, constraint): what a trainer's importance weights compare against.
        behaviour: f64,
        /// The request's `top_logprobs` most likely tokens at this position.
        top: Vec<(u32, f64)>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// The policy version the request started on (the oldest that sampled any of
        /// its tokens; see [`EngineHandle::update_weights`]).
        policy_version: u64,
    },
    Failed(String),
}

/// A request's whole output, gathered from its event stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Completed {
    pub tokens: Vec<u32>,
    /// Each token's log-probability under the model that sampled it.
    pub logprobs: Vec<f64>,
    /// Each token's log-probability under the distribution it was drawn from.
    pub behaviour: Vec<f64>,
    pub reason: FinishReason,
    /// The policy version the request started on.
    pub policy_version: u64,
}

impl Completed {
    /// Blocks until the request's stream ends; a failed request is its error message.
    /// Not for async contexts (it blocks the thread).
    pub fn collect(rx: &mut UnboundedReceiver<EngineEvent>) -> Result<Completed, EngineError> {
        let (mut tokens, mut logprobs, mut drawn) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            match rx.blocking_recv() {
                Some(EngineEvent::Token {
                    id,
                    logprob,
                    behaviour,
                    ..
                }) => {
                    tokens.push(id);
                    logprobs.push(logprob);
                    drawn.push(behaviour);
                }
                Some(EngineEvent::Finished {
                    reason,
                    policy_version,
                    ..
                }) => {
                    return Ok(Completed {
                        tokens,
                        logprobs,
                        behaviour: drawn,
                        reason,
                        policy_version,
                    })
                }
                Some(EngineEvent::Failed(e)) => return Err(EngineError::Failed(e)),
                None => return Err(EngineError::Stopped),
            }
        }
    }
}

/// What goes wrong between a requester and the engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("overloaded: {0} requests are already waiting")]
    Overloaded(usize),
    #[error("the engine has stopped")]
    Stopped,
    /// The request ran and failed (the engine's message).
    #[error("{0}")]
    Failed(String),
    #[error("another weight update is in progress")]
    WeightUpdateBusy,
    /// New weights that do not fit the served model.
    #[error("{0}")]
    WeightsRejected(String),
}

/// Live counters, readable from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Bytes of KV cache holding the running sequences' positions.
    pub kv_bytes: AtomicUsize,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Prompt tokens run through the model (a prompt shared by `n` choices counts once).
    pub prefill_tokens: AtomicU64,
    /// Packed prefill passes (each takes every prompt admitted at that moment).
    pub prefill_passes: AtomicU64,
    pub policy_version: AtomicU64,
    /// The policy version of each served adapter of the bank, by index (see
    /// [`super::GenerateRequest::adapter`]); `policy_version` is the model's own.
    pub adapter_versions: Mutex<Vec<u64>>,
    /// KV memory held: the slots as allocated plus the prefix cache.
    pub kv_allocated_bytes: AtomicUsize,
    /// Requests admitted (each looks up its prompt in the prefix cache once).
    pub prefix_lookups: AtomicU64,
    /// Requests that took a cached prefix.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens taken from the prefix cache instead of prefilled.
    pub prefix_reused_tokens: AtomicU64,
    pub prefix_bytes: AtomicUsize,
    /// Cache nodes evicted to stay within the budget.
    pub prefix_evictions: AtomicU64,
    /// Cached positions dropped by weight updates.
    pub prefix_invalidated_positions: AtomicU64,
    /// Time spent in prefill passes, and copying keys and values into and out of the
    /// prefix cache (microseconds): what the cache costs against what it saves.
    pub prefill_micros: AtomicU64,
    pub prefix_copy_micros: AtomicU64,
}

/// A request on its way to the engine thread (the loop's side of the queue).
pub struct Submission {
    pub req: Arc<GenerateRequest>,
    /// One sender per choice, with the choice's index (its seed is `seed + index`). The
    /// choices share one prefill.
    pub choices: Vec<(u64, UnboundedSender<EngineEvent>)>,
}

impl Submission {
    /// No request: only wakes an idle engine thread (for a weight update).
    pub fn wake() -> Submission {
        Submission {
            req: Arc::new(GenerateRequest::default()),
            choices: Vec::new(),
        }
    }
}

/// New weights for the engine's model, applied between two decode steps. `params` is
/// the model code's own parameter list (the LibTorch loop knows its type; this side of
/// the engine does not need to).
pub struct PendingWeights {
    /// Whose weights: the model's own (`None`) or the bank adapter's.
    pub adapter: Option<usize>,
    pub params: Box<dyn Any + Send>,
    pub version: u64,
    pub done: std::sync::mpsc::Sender<Result<(), EngineError>>,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Submission>,
    max_queue: usize,
    max_batch: usize,
    /// The most positions (prompt + completion) one request can have: a KV slot's size.
    pub max_sequence: usize,
    pub stats: Arc<EngineStats>,
    weights: Arc<Mutex<Vec<PendingWeights>>>,
}

/// What the engine thread holds: the receiving side of a handle's queue and slots.
pub struct EngineInbox {
    pub rx: Receiver<Submission>,
    pub stats: Arc<EngineStats>,
    pub weights: Arc<Mutex<Vec<PendingWeights>>>,
}

impl EngineHandle {
    /// A handle and the inbox of the engine thread that serves it: a queue of
    /// `max_queue` requests, batches of `max_batch`, `max_sequence` positions per request.
    pub fn new(
        max_queue: usize,
        max_batch: usize,
        max_sequence: usize,
    ) -> (EngineHandle, EngineInbox) {
        let (tx, rx) = mpsc::sync_channel(max_queue.max(1));
        let stats = Arc::new(EngineStats::default());
        let weights = Arc::new(Mutex::new(Vec::new()));
        let handle = EngineHandle {
            tx,
            max_queue: max_queue.max(1),
            max_batch: max_batch.max(1),
            max_sequence,
            stats: stats.clone(),
            weights: weights.clone(),
        };
        (handle, EngineInbox { rx, stats, weights })
    }

    /// Hands new weights to the engine thread (applied between two steps; `done` hears
    /// the outcome). One update at a time per model (the engine's own, or a bank adapter);
    /// updates of different adapters queue.
    pub fn offer_weights(&self, update: PendingWeights) -> Result<(), EngineError> {
        {
            let mut slot = lock(&self.weights);
            if slot.iter().any(|u| u.adapter == update.adapter) {
                return Err(EngineError::WeightUpdateBusy);
            }
            slot.push(update);
        }
        // Wake an idle engine (it also looks between steps).
        let _ = self.tx.try_send(Submission::wake());
        Ok(())
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<EngineEvent>, EngineError> {
        let mut rx = self.submit_n(req, 1)?;
        Ok(rx.remove(0))
    }

    /// Queues `n` samples of one prompt (OpenAI's `n`): the prompt is prefilled once and
    /// its KV cache shared; choice `i` samples with seed `seed + i`. Each receiver cancels
    /// its own choice when dropped. Choices beyond the batch size go in further groups.
    pub fn submit_n(
        &self,
        req: GenerateRequest,
        n: usize,
    ) -> Result<Vec<UnboundedReceiver<EngineEvent>>, EngineError> {
        let req = Arc::new(req);
        let mut out = Vec::with_capacity(n);
        let mut index = 0u64;
        while (index as usize) < n {
            let take = (n - index as usize).min(self.max_batch);
            let mut choices = Vec::with_capacity(take);
            for i in 0..take as u64 {
                let (events, rx) = unbounded_channel();
                choices.push((index + i, events));
                out.push(rx);
            }
            index += take as u64;
            // On a refusal, the receivers already made are dropped: those groups cancel.
            match self.tx.try_send(Submission {
                req: req.clone(),
                choices,
            }) {
                Ok(()) => {
                    self.stats.waiting.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Full(_)) => return Err(EngineError::Overloaded(self.max_queue)),
                Err(TrySendError::Disconnected(_)) => return Err(EngineError::Stopped),
            }
        }
        Ok(out)
    }
}
