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
    crate::model::llama::{KvCache, Llama, Logits},
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
    /// KV positions (prompt + max_tokens of every running sequence) at most.
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
/// and the running requests are done.
pub fn spawn_engine(model: Llama, cfg: EngineConfig) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::sync_channel(cfg.max_queue.max(1));
    let stats = Arc::new(EngineStats::default());
    let handle = EngineHandle {
        tx,
        max_queue: cfg.max_queue.max(1),
        stats: stats.clone(),
    };
    std::thread::Builder::new()
        .name("agentjet-engine".into())
        .spawn(move || EngineLoop::new(model, cfg, rx, stats).run())?;
    Ok(handle)
}

#[cfg(feature = "torch")]
struct Running {
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
    cache: KvCache,
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
    kv_positions: usize,
    disconnected: bool,
}

#[cfg(feature = "torch")]
impl EngineLoop {
    fn new(
        model: Llama,
        cfg: EngineConfig,
        rx: Receiver<Submission>,
        stats: Arc<EngineStats>,
    ) -> EngineLoop {
        EngineLoop {
            model,
            cfg,
            rx,
            stats,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv_positions: 0,
            disconnected: false,
        }
    }

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
                    self.kv_positions = 0;
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

    fn reservation(&self, req: &GenerateRequest) -> usize {
        (req.prompt.len() + req.max_tokens).min(self.model.max_positions())
    }

    /// Prefills waiting requests (FIFO) while the batch and the KV budget allow.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = self.reservation(&front.req);
            if need > self.cfg.max_kv_positions {
                let sub = self.waiting.pop_front().expect("front exists");
                self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
                let _ = sub.events.send(EngineEvent::Failed(format!(
                    "request needs {need} KV positions (prompt {} + max_tokens {}), more than the engine's budget of {}",
                    sub.req.prompt.len(),
                    sub.req.max_tokens,
                    self.cfg.max_kv_positions
                )));
                continue;
            }
            if self.kv_positions + need > self.cfg.max_kv_positions {
                break; // wait for running sequences to finish
            }
            let sub = self.waiting.pop_front().expect("front exists");
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            if sub.events.is_closed() {
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            match self.prefill(sub.req, sub.events.clone(), need) {
                Ok(Some(r)) => {
                    self.kv_positions += need;
                    self.running.push(r);
                }
                Ok(None) => {}
                Err(e) => {
                    let _ = sub.events.send(EngineEvent::Failed(e.to_string()));
                }
            }
        }
    }

    fn finish(
        &self,
        events: &UnboundedSender<EngineEvent>,
        req: &GenerateRequest,
        generated: usize,
        reason: FinishReason,
    ) {
        self.stats.completed.fetch_add(1, Ordering::Relaxed);
        let _ = events.send(EngineEvent::Finished {
            reason,
            prompt_tokens: req.prompt.len(),
            completion_tokens: generated,
            policy_version: self.stats.policy_version.load(Ordering::Relaxed),
        });
    }

    /// Prefills one request and samples its first token; `None` if it already finished.
    fn prefill(
        &mut self,
        req: GenerateRequest,
        events: UnboundedSender<EngineEvent>,
        capacity: usize,
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
            self.finish(&events, &req, 0, FinishReason::Length);
            return Ok(None);
        }
        let mut cache = self.model.new_cache(1, capacity)?;
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
            req,
            events,
            cache,
            rng,
            generated: 0,
            tokens: Vec::new(),
            last: id,
        };
        Ok(if self.emit(&mut r, id, lp, top) {
            None
        } else {
            Some(r)
        })
    }

    /// Sends one token; returns true (after sending `Finished`) if the sequence is done.
    fn emit(&self, r: &mut Running, id: u32, logprob: f64, top: Vec<(u32, f64)>) -> bool {
        r.generated += 1;
        r.last = id;
        r.tokens.push(id);
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let _ = r.events.send(EngineEvent::Token { id, logprob, top });
        let reason = if r.req.stop_token_ids.contains(&id) {
            Some(FinishReason::Stop)
        } else if r.generated >= r.req.max_tokens || r.cache.len() >= r.cache.capacity() {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            Some(reason) => {
                self.finish(&r.events, &r.req, r.generated, reason);
                true
            }
            None => false,
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.running.len();
        let mut freed = 0;
        self.running.retain(|r| {
            let keep = !r.events.is_closed();
            if !keep {
                freed += r.cache.capacity();
            }
            keep
        });
        let n = before - self.running.len();
        if n > 0 {
            self.kv_positions -= freed;
            self.stats.cancelled.fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(
                cancelled = n,
                "requesters went away; their sequences were dropped"
            );
        }
    }

    /// One batched decode step for every running sequence.
    fn step(&mut self) -> Result<(), ModelError> {
        let ids: Vec<u32> = self.running.iter().map(|r| r.last).collect();
        let logits = {
            let mut caches: Vec<&mut KvCache> =
                self.running.iter_mut().map(|r| &mut r.cache).collect();
            self.model.decode_rows(&ids, &mut caches)?
        };
        let logits = logits.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
        let mut running = std::mem::take(&mut self.running);
        let mut keep = Vec::with_capacity(running.len());
        for (i, mut r) in running.drain(..).enumerate() {
            let row = row_to_vec(&logits.f_get(i as i64)?)?;
            let (id, lp) =
                sampling::sample(&row, &r.req.sampling, &mut r.rng, &r.req.prompt, &r.tokens);
            let top = sampling::top_logprobs(&row, r.req.top_logprobs);
            if self.emit(&mut r, id, lp, top) {
                self.kv_positions -= r.cache.capacity();
            } else {
                keep.push(r);
            }
        }
        self.running = keep;
        Ok(())
    }

    fn publish(&self) {
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        let bytes: usize = self.running.iter().map(|r| r.cache.bytes()).sum();
        self.stats.kv_bytes.store(bytes, Ordering::Relaxed);
    }
}
