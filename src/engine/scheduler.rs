//! The engine thread: owns the model, takes requests from a bounded queue, and runs them
//! with continuous batching: between decode steps, waiting requests are admitted
//! (prefilled on their own, then they join the batch) while the batch has room and the KV
//! budget allows; finished and cancelled sequences leave at once and their KV cache is
//! freed. A requester that drops its event receiver cancels its request.
//!
//! Owns: scheduling and the per-sequence state. Never renders chat or parses text.

#[cfg(feature = "torch")]
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(feature = "torch")]
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::{FinishReason, GenerateRequest};
#[cfg(feature = "torch")]
use {
    super::{direct::row_to_vec, sampling, Rng},
    crate::model::llama::{Llama, Logits, SlotCache},
    crate::model::ModelError,
    tch::Tensor,
};

/// Bounds of one engine; every one is a config value with a default.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Requests waiting beyond the running batch; more are refused as overloaded.
    pub max_queue: usize,
    /// KV positions in all, split evenly into `max_batch` slots allocated at start; a
    /// request's prompt + max_tokens must fit one slot.
    pub max_kv_positions: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 32,
            max_queue: 256,
            max_kv_positions: 65_536,
        }
    }
}

/// What a requester hears about its request, in order: tokens, then one `Finished` (or
/// one `Failed`).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Token {
        id: u32,
        logprob: f64,
        /// The request's `top_logprobs` most likely tokens at this position.
        top: Vec<(u32, f64)>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        policy_version: u64,
    },
    Failed(String),
}

/// Why a request was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("overloaded: {0} requests are already waiting")]
    Overloaded(usize),
    #[error("the engine has stopped")]
    Stopped,
}

/// Live counters, readable from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Bytes of KV cache holding live positions (the slots themselves stay allocated).
    pub kv_bytes: AtomicUsize,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub policy_version: AtomicU64,
}

/// A request on its way to the engine thread (read there; a client-only build never
/// starts one).
#[cfg_attr(not(feature = "torch"), allow(dead_code))]
pub(crate) struct Submission {
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Submission>,
    max_queue: usize,
    /// The most positions (prompt + completion) one request can have: a KV slot's size.
    pub max_sequence: usize,
    pub stats: Arc<EngineStats>,
}

impl EngineHandle {
    /// Queues a request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(
        &self,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<EngineEvent>, EngineError> {
        let (events, rx) = unbounded_channel();
        match self.tx.try_send(Submission { req, events }) {
            Ok(()) => {
                self.stats.waiting.fetch_add(1, Ordering::Relaxed);
                Ok(rx)
            }
            Err(TrySendError::Full(_)) => Err(EngineError::Overloaded(self.max_queue)),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::Stopped),
        }
    }
}

#[cfg(feature = "torch")]
/// Starts the engine thread with `model`. The thread ends when every handle is dropped
/// and the running requests are done. The KV slots are allocated here, so a bad size is
/// an error now rather than at the first request.
pub fn spawn_engine(model: Llama, cfg: EngineConfig) -> Result<EngineHandle, ModelError> {
    let batch = cfg.max_batch.max(1);
    let per_slot = (cfg.max_kv_positions / batch)
        .max(2)
        .min(model.max_positions());
    let slots = {
        let _guard = tch::no_grad_guard();
        model.new_slot_cache(batch, per_slot)?
    };
    let (tx, rx) = mpsc::sync_channel(cfg.max_queue.max(1));
    let stats = Arc::new(EngineStats::default());
    let handle = EngineHandle {
        tx,
        max_queue: cfg.max_queue.max(1),
        max_sequence: slots.capacity(),
        stats: stats.clone(),
    };
    let bytes_per_position = slots.bytes() / (batch * slots.capacity()).max(1);
    tracing::info!(
        slots = batch,
        positions_per_slot = slots.capacity(),
        bytes = slots.bytes(),
        "KV slots allocated"
    );
    std::thread::Builder::new()
        .name("agentjet-engine".into())
        .spawn(move || {
            EngineLoop {
                model,
                cfg: EngineConfig {
                    max_batch: batch,
                    ..cfg
                },
                rx,
                stats,
                waiting: VecDeque::new(),
                running: Vec::new(),
                slots,
                bytes_per_position,
                disconnected: false,
            }
            .run()
        })
        .map_err(|e| ModelError::Invalid(format!("cannot start the engine thread: {e}")))?;
    Ok(handle)
}

/// A running sequence; `running[i]` lives in KV slot `i`.
#[cfg(feature = "torch")]
struct Running {
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
    /// Positions filled in its slot.
    len: usize,
    rng: Rng,
    generated: usize,
    /// The tokens generated so far (penalties look at them).
    tokens: Vec<u32>,
    last: u32,
}

#[cfg(feature = "torch")]
struct EngineLoop {
    model: Llama,
    cfg: EngineConfig,
    rx: Receiver<Submission>,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Submission>,
    running: Vec<Running>,
    slots: SlotCache,
    bytes_per_position: usize,
    disconnected: bool,
}

#[cfg(feature = "torch")]
impl EngineLoop {
    fn run(mut self) {
        let _guard = tch::no_grad_guard();
        loop {
            self.pull();
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.disconnected {
                    return;
                }
                // Idle: block for the next request.
                match self.rx.recv() {
                    Ok(sub) => self.waiting.push_back(sub),
                    Err(_) => return,
                }
            }
            self.admit();
            self.drop_cancelled();
            if !self.running.is_empty() {
                if let Err(e) = self.step() {
                    // A failed step fails the batch, not the engine.
                    for r in self.running.drain(..) {
                        let _ = r.events.send(EngineEvent::Failed(e.to_string()));
                    }
                }
            }
            self.publish();
        }
    }

    /// Moves queued submissions into the local waiting list while the batch has room.
    fn pull(&mut self) {
        while self.running.len() + self.waiting.len() < self.cfg.max_batch {
            match self.rx.try_recv() {
                Ok(sub) => self.waiting.push_back(sub),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    break;
                }
            }
        }
    }

    /// Prefills waiting requests (FIFO) into free slots.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(sub) = self.waiting.pop_front() else {
                break;
            };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if sub.events.is_closed() {
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let need = sub.req.prompt.len() + sub.req.max_tokens;
            if need > self.slots.capacity() {
                let _ = sub.events.send(EngineEvent::Failed(format!(
                    "request needs {need} KV positions (prompt {} + max_tokens {}), more than the engine's per-request budget of {}",
                    sub.req.prompt.len(),
                    sub.req.max_tokens,
                    self.slots.capacity()
                )));
                continue;
            }
            match self.prefill(sub.req, sub.events.clone()) {
                Ok(Some(r)) => self.running.push(r),
                Ok(None) => {}
                Err(e) => {
                    let _ = sub.events.send(EngineEvent::Failed(e.to_string()));
                }
            }
        }
    }

    /// Prefills one request into the next free slot and samples its first token; `None`
    /// if it already finished.
    fn prefill(
        &mut self,
        req: GenerateRequest,
        events: UnboundedSender<EngineEvent>,
    ) -> Result<Option<Running>, ModelError> {
        req.sampling.validate().map_err(ModelError::Invalid)?;
        let limit = self.model.max_positions();
        let vocab = self.model.config.vocab_size as u32;
        if req.prompt.is_empty() || req.prompt.len() >= limit {
            return Err(ModelError::Invalid(format!(
                "prompt of {} tokens does not fit the model's context of {limit}",
                req.prompt.len()
            )));
        }
        if let Some(bad) = req.prompt.iter().find(|&&t| t >= vocab) {
            return Err(ModelError::Invalid(format!(
                "prompt token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if req.max_tokens == 0 {
            finish(&self.stats, &events, &req, 0, FinishReason::Length);
            return Ok(None);
        }
        let mut cache = self.slots.slot_view(self.running.len())?;
        let ids: Vec<i64> = req.prompt.iter().map(|&t| t as i64).collect();
        let input = Tensor::f_from_slice(&ids)?
            .f_view([1, -1])?
            .f_to_device(self.model.device())?;
        let logits = self.model.forward(&input, &mut cache, Logits::Last)?;
        let row = row_to_vec(&logits.f_select(0, 0)?)?;
        let mut rng = match req.seed {
            Some(s) => Rng::seeded(s),
            None => Rng::from_entropy(),
        };
        let (id, lp) = sampling::sample(&row, &req.sampling, &mut rng, &req.prompt, &[]);
        let top = sampling::top_logprobs(&row, req.top_logprobs);
        let mut r = Running {
            len: req.prompt.len(),
            req,
            events,
            rng,
            generated: 0,
            tokens: Vec::new(),
            last: id,
        };
        Ok(
            if emit(&self.stats, self.slots.capacity(), &mut r, id, lp, top) {
                None
            } else {
                Some(r)
            },
        )
    }

    /// Removes the sequences at `gone` (any order), keeping slots `0..n` occupied by
    /// moving the last sequence's positions into each freed slot.
    fn remove(&mut self, mut gone: Vec<usize>) -> Result<(), ModelError> {
        gone.sort_unstable_by(|a, b| b.cmp(a));
        gone.dedup();
        for i in gone {
            let last = self.running.len() - 1;
            if i != last {
                self.slots.move_slot(last, i, self.running[last].len)?;
            }
            self.running.swap_remove(i);
        }
        Ok(())
    }

    fn drop_cancelled(&mut self) {
        let gone: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].events.is_closed())
            .collect();
        if gone.is_empty() {
            return;
        }
        self.stats
            .cancelled
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        tracing::debug!(
            cancelled = gone.len(),
            "requesters went away; their sequences were dropped"
        );
        if let Err(e) = self.remove(gone) {
            tracing::error!("compacting KV slots failed: {e}");
        }
    }

    /// One batched decode step for every running sequence.
    fn step(&mut self) -> Result<(), ModelError> {
        let ids: Vec<u32> = self.running.iter().map(|r| r.last).collect();
        let mut lens: Vec<usize> = self.running.iter().map(|r| r.len).collect();
        let logits = self.model.decode_slots(&ids, &mut lens, &self.slots)?;
        let logits = logits.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let mut done = Vec::new();
        let capacity = self.slots.capacity();
        for (i, r) in self.running.iter_mut().enumerate() {
            r.len = lens[i];
            let row = row_to_vec(&logits.f_get(i as i64)?)?;
            let (id, lp) =
                sampling::sample(&row, &r.req.sampling, &mut r.rng, &r.req.prompt, &r.tokens);
            let top = sampling::top_logprobs(&row, r.req.top_logprobs);
            if emit(&self.stats, capacity, r, id, lp, top) {
                done.push(i);
            }
        }
        self.remove(done)
    }

    fn publish(&self) {
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        let positions: usize = self.running.iter().map(|r| r.len).sum();
        self.stats
            .kv_bytes
            .store(positions * self.bytes_per_position, Ordering::Relaxed);
    }
}

#[cfg(feature = "torch")]
fn finish(
    stats: &EngineStats,
    events: &UnboundedSender<EngineEvent>,
    req: &GenerateRequest,
    generated: usize,
    reason: FinishReason,
) {
    stats.completed.fetch_add(1, Ordering::Relaxed);
    let _ = events.send(EngineEvent::Finished {
        reason,
        prompt_tokens: req.prompt.len(),
        completion_tokens: generated,
        policy_version: stats.policy_version.load(Ordering::Relaxed),
    });
}

/// Sends one token; returns true (after sending `Finished`) if the sequence is done.
#[cfg(feature = "torch")]
fn emit(
    stats: &EngineStats,
    capacity: usize,
    r: &mut Running,
    id: u32,
    logprob: f64,
    top: Vec<(u32, f64)>,
) -> bool {
    r.generated += 1;
    r.last = id;
    r.tokens.push(id);
    stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let _ = r.events.send(EngineEvent::Token { id, logprob, top });
    let reason = if r.req.stop_token_ids.contains(&id) {
        Some(FinishReason::Stop)
    } else if r.generated >= r.req.max_tokens || r.len >= capacity {
        Some(FinishReason::Length)
    } else {
        None
    };
    match reason {
        Some(reason) => {
            finish(stats, &r.events, &r.req, r.generated, reason);
            true
        }
        None => false,
    }
}
