//! The engine thread: owns the model, takes requests from a bounded queue, and runs them
//! with continuous batching: between decode steps, waiting requests are admitted
//! (prefilled on their own, then they join the batch) while the batch has room and the KV
//! budget allows; finished and cancelled sequences leave at once and their KV cache is
//! freed. A requester that drops its event receiver cancels its request. The thread ends
//! when every handle is dropped and the running requests are done.
//!
//! Owns: scheduling and the per-sequence state. Never renders chat or parses text.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};

use tch::Tensor;
use tokio::sync::mpsc::UnboundedSender;

use super::constraint::{ConstraintError, ConstraintState};
use super::direct::check_request;
use super::handle::{EngineHandle, EngineStats, PendingWeights, Submission};
use super::memory::{KvMemory, MIN_REUSE};
use super::prefix::common_prefix;
use super::sampling::Picked;
use super::{
    sampling, EngineConfig, EngineError, EngineEvent, FinishReason, GenerateRequest, RequestError,
};
use crate::base::cores::{cores, Busy};
use crate::base::{lock, Rng};
use crate::model::llama::Llama;
use crate::model::ModelError;

impl EngineHandle {
    /// Serves new weights from the next decode step on, without a restart: the engine
    /// copies `params` (in [`Llama::parameters`] order, same shapes; any dtype or device)
    /// into its model between two steps, sets the policy version to `version`, and this
    /// returns once it has (requests in flight continue on the new weights). The caller
    /// must not change `params` until this returns.
    pub fn update_weights(&self, params: &[Tensor], version: u64) -> Result<(), EngineError> {
        self.update_weights_of(None, params, version)
    }

    /// [`EngineHandle::update_weights`] for the weights of `adapter`: the model's own
    /// (`None`) or bank adapter `Some(i)` (in [`crate::model::llama::lora::Adapter::tensors`]
    /// order), whose policy version becomes `version`.
    pub fn update_weights_of(
        &self,
        adapter: Option<usize>,
        params: &[Tensor],
        version: u64,
    ) -> Result<(), EngineError> {
        let (done, wait) = std::sync::mpsc::channel();
        self.offer_weights(PendingWeights {
            adapter,
            params: Box::new(
                params
                    .iter()
                    .map(|p| p.shallow_clone())
                    .collect::<Vec<Tensor>>(),
            ),
            version,
            done,
        })?;
        wait.recv().map_err(|_| EngineError::Stopped)?
    }
}

/// Starts the engine thread with `model`. The thread ends when every handle is dropped
/// and the running requests are done. KV memory is taken as sequences need it, within
/// `cfg.max_kv_positions` for slots and prefix cache together.
pub fn spawn_engine(model: Llama, cfg: EngineConfig) -> Result<EngineHandle, ModelError> {
    let batch = cfg.max_batch.max(1);
    let per_request = KvMemory::per_request(cfg.max_kv_positions, batch, model.max_positions());
    let slots = {
        let _guard = tch::no_grad_guard();
        model.new_slot_cache(0, 0)?
    };
    let bytes_per_position = slots.bytes_per_position();
    let mem = KvMemory::new(slots, cfg.max_kv_positions, cfg.prefix_cache_bytes, batch);
    let (handle, inbox) = EngineHandle::new(cfg.max_queue, batch, per_request);
    *lock(&inbox.stats.adapter_versions) = vec![0; model.served_adapters()];
    tracing::info!(
        max_batch = batch,
        positions_per_request = per_request,
        budget_bytes = cfg.max_kv_positions * bytes_per_position,
        prefix_cache_bytes = cfg.prefix_cache_bytes,
        "KV memory: taken as sequences grow"
    );
    std::thread::Builder::new()
        .name("agentjet-engine".into())
        .spawn(move || {
            EngineLoop {
                model,
                cfg: EngineConfig {
                    max_batch: batch,
                    max_prefill_tokens: cfg.max_prefill_tokens.max(1),
                    ..cfg
                },
                rx: inbox.rx,
                stats: inbox.stats,
                weights: inbox.weights,
                waiting: VecDeque::new(),
                running: Vec::new(),
                mem,
                per_request,
                bytes_per_position,
                disconnected: false,
                allowed: Vec::new(),
                decoding: None,
            }
            .run()
        })
        .map_err(|e| ModelError::Invalid(format!("cannot start the engine thread: {e}")))?;
    Ok(handle)
}

/// A running sequence; `running[i]` lives in KV slot `i`.
struct Running {
    req: Arc<GenerateRequest>,
    events: UnboundedSender<EngineEvent>,
    /// Positions filled in its slot.
    len: usize,
    rng: Rng,
    generated: usize,
    /// The tokens generated so far (penalties look at them).
    tokens: Vec<u32>,
    last: u32,
    /// Where the output is in the request's constraint, if it has one.
    cstate: Option<ConstraintState>,
    /// The policy version when it started (weights updated mid-request sample the rest).
    version: u64,
    /// The KV memory's epoch when it started (its keys are cached only if unchanged).
    epoch: u64,
}

impl Running {
    /// The tokens whose keys and values its slot holds, as the prefix cache's key.
    fn computed(&self) -> Vec<u32> {
        let generated = self.len.saturating_sub(self.req.prompt.len());
        let mut t = Vec::with_capacity(self.len);
        t.extend_from_slice(&self.req.prompt);
        t.extend_from_slice(&self.tokens[..generated.min(self.tokens.len())]);
        keyed(self.req.adapter, t)
    }
}

/// The prefix cache's key for `tokens` computed with `adapter`: a bank adapter's first
/// token carries `adapter + 1` in its top 8 bits (token ids stay below
/// [`crate::model::llama::bank::MAX_BANK_VOCAB`]), so keys of different adapters share no
/// prefix. The base's (and the model's own adapter's) keys are the tokens.
fn keyed(adapter: Option<usize>, mut tokens: Vec<u32>) -> Vec<u32> {
    if let (Some(i), Some(first)) = (adapter, tokens.first_mut()) {
        // A bank holds at most 255 adapters (an index past it is refused by `check`).
        *first |= (i.min(254) as u32 + 1) << 24;
    }
    tokens
}

struct EngineLoop {
    model: Llama,
    cfg: EngineConfig,
    rx: Receiver<Submission>,
    stats: Arc<EngineStats>,
    weights: Arc<Mutex<Vec<PendingWeights>>>,
    waiting: VecDeque<Submission>,
    running: Vec<Running>,
    mem: KvMemory,
    /// Positions one request may hold (prompt + max_tokens).
    per_request: usize,
    bytes_per_position: usize,
    disconnected: bool,
    /// Scratch for constrained decoding's vocabulary mask.
    allowed: Vec<bool>,
    /// Held while sequences run: a trainer step in this process then takes only its
    /// share of the cores ([`crate::base::cores`]).
    decoding: Option<Busy<'static>>,
}

impl EngineLoop {
    fn run(mut self) {
        let _guard = tch::no_grad_guard();
        self.model.prepare_thread();
        self.model.serve_stacked_adapter();
        if self.model.serve_on_kernel_pool() {
            tracing::debug!("engine: matrix products on the kernel pool");
        }
        loop {
            self.take_weights();
            self.pull();
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.disconnected {
                    return;
                }
                // A weight update offered since `take_weights` looked: its wake-up may
                // have been taken by `pull` (the slot is filled before the wake-up is sent).
                if !lock(&self.weights).is_empty() {
                    continue;
                }
                // Idle: block for the next request (or a weight update's wake-up).
                match self.rx.recv() {
                    Ok(sub) if sub.choices.is_empty() => continue,
                    Ok(sub) => self.waiting.push_back(sub),
                    Err(_) => return,
                }
            }
            self.admit();
            self.drop_cancelled();
            if self.running.is_empty() {
                self.decoding = None;
            } else {
                let c = cores();
                self.decoding.get_or_insert_with(|| c.decoding());
                // The cores free now: other processes' load, and a trainer step here.
                self.model.fit_threads(c.for_engine());
                if let Err(e) = self.step() {
                    // A failed step fails the batch, not the engine.
                    for r in self.running.drain(..) {
                        let _ = r.events.send(EngineEvent::Failed(e.to_string()));
                    }
                }
            }
            let live: Vec<usize> = self.running.iter().map(|r| r.len).collect();
            if let Err(e) = self.mem.trim(&live) {
                tracing::warn!("giving KV memory back failed: {e}");
            }
            self.publish();
        }
    }

    /// Applies the pending weight updates (between two steps), in the order offered.
    fn take_weights(&mut self) {
        let pending = std::mem::take(&mut *lock(&self.weights));
        for update in pending {
            self.take_update(update);
        }
    }

    fn take_update(&mut self, update: PendingWeights) {
        let result = match update.params.downcast::<Vec<Tensor>>() {
            Ok(params) => self.copy_weights(update.adapter, &params),
            Err(_) => Err(EngineError::WeightsRejected(
                "the update is not a list of LibTorch tensors".into(),
            )),
        };
        if result.is_ok() {
            // Every cached prefix goes, whichever adapter computed it (simple and safe;
            // a new version's requests would miss the old keys anyway).
            self.mem.invalidate(&self.stats);
            self.mem.publish(&self.stats);
            match update.adapter {
                None => self
                    .stats
                    .policy_version
                    .store(update.version, Ordering::Relaxed),
                Some(i) => {
                    if let Some(v) = lock(&self.stats.adapter_versions).get_mut(i) {
                        *v = update.version;
                    }
                }
            }
            tracing::info!(version = update.version, adapter = ?update.adapter, "serving new weights");
        }
        let _ = update.done.send(result);
    }

    fn copy_weights(
        &mut self,
        adapter: Option<usize>,
        params: &[Tensor],
    ) -> Result<(), EngineError> {
        let mine = match adapter {
            None => self.model.parameters(),
            Some(i) => match self.model.served_adapter(i) {
                Some(a) => a.tensors(),
                None => {
                    return Err(EngineError::WeightsRejected(format!(
                        "adapter {i} is not served ({} adapters)",
                        self.model.served_adapters()
                    )))
                }
            },
        };
        if mine.len() != params.len() {
            return Err(EngineError::WeightsRejected(format!(
                "weight update has {} tensors, the served model {}",
                params.len(),
                mine.len()
            )));
        }
        if let Some(i) = (0..mine.len()).find(|&i| mine[i].size() != params[i].size()) {
            return Err(EngineError::WeightsRejected(format!(
                "weight update tensor {i} is {:?}, the served model's {:?}",
                params[i].size(),
                mine[i].size()
            )));
        }
        let copied = (|| -> Result<(), tch::TchError> {
            for (mut dst, src) in mine.into_iter().zip(params) {
                dst.f_copy_(&src.f_detach()?)?;
            }
            Ok(())
        })();
        let merged = match adapter.and_then(|i| self.model.served_adapter(i)) {
            Some(a) => {
                a.changed();
                Ok(())
            }
            None => self.model.parameters_changed(),
        };
        copied.map_err(|e| {
            EngineError::WeightsRejected(format!("copying the new weights failed: {e}"))
        })?;
        merged.map_err(|e| {
            EngineError::WeightsRejected(format!("merging the new adapter failed: {e}"))
        })
    }

    /// Moves queued submissions into the local waiting list while the batch has room.
    fn pull(&mut self) {
        while self.running.len() + self.waiting.len() < self.cfg.max_batch {
            match self.rx.try_recv() {
                Ok(sub) if sub.choices.is_empty() => {}
                Ok(sub) => self.waiting.push_back(sub),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    break;
                }
            }
        }
    }

    /// Why `req` cannot run here, if it cannot.
    fn check(&self, req: &GenerateRequest) -> Result<(), RequestError> {
        check_request(&self.model, req)?;
        let need = req.prompt.len() + req.max_tokens;
        if need > self.per_request {
            return Err(RequestError::OverBudget {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                budget: self.per_request,
            });
        }
        Ok(())
    }

    /// Admits waiting requests (FIFO) while free slots last: all admitted prompts are
    /// prefilled together in one packed pass (each after its cached prefix), then each
    /// request's choices fork from its prefilled slot and sample their first tokens. A
    /// request that shares an uncached prefix with one already in the pass waits for the
    /// next pass, where it finds that prefix cached.
    fn admit(&mut self) {
        let mut free = self.cfg.max_batch - self.running.len();
        let mut tokens = 0usize;
        let mut group: Vec<Submission> = Vec::new();
        let caching = self.mem.caching();
        while let Some(front) = self.waiting.front() {
            let wanted = front.choices.iter().filter(|c| !c.1.is_closed()).count();
            if wanted > free
                || (!group.is_empty()
                    && tokens + front.req.prompt.len() > self.cfg.max_prefill_tokens)
            {
                break;
            }
            if caching && !group.is_empty() {
                let prompt = &front.req.prompt;
                let shared = group
                    .iter()
                    .filter(|g| g.req.adapter == front.req.adapter)
                    .map(|g| common_prefix(&g.req.prompt, prompt))
                    .max()
                    .unwrap_or(0)
                    .min(prompt.len().saturating_sub(1));
                if shared >= MIN_REUSE
                    && shared
                        > self.mem.cached(&keyed(front.req.adapter, prompt.clone())) + MIN_REUSE
                {
                    break;
                }
            }
            let Some(mut sub) = self.waiting.pop_front() else {
                break;
            };
            self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
            let before = sub.choices.len();
            sub.choices.retain(|c| !c.1.is_closed());
            self.stats
                .cancelled
                .fetch_add((before - sub.choices.len()) as u64, Ordering::Relaxed);
            if sub.choices.is_empty() {
                continue;
            }
            if let Err(e) = self.check(&sub.req) {
                for (_, events) in &sub.choices {
                    let _ = events.send(EngineEvent::Failed(e.to_string()));
                }
                continue;
            }
            if sub.req.max_tokens == 0 {
                for (_, events) in &sub.choices {
                    let version = self.version(sub.req.adapter);
                    finish(
                        &self.stats,
                        events,
                        &sub.req,
                        0,
                        FinishReason::Length,
                        version,
                    );
                }
                continue;
            }
            free -= sub.choices.len();
            tokens += sub.req.prompt.len();
            group.push(sub);
        }
        if group.is_empty() {
            return;
        }
        if let Err(e) = self.prefill(&group) {
            for sub in &group {
                for (_, events) in &sub.choices {
                    let _ = events.send(EngineEvent::Failed(e.to_string()));
                }
            }
        }
    }

    /// Prefills `group` (which fits the free slots) and starts its choices running.
    fn prefill(&mut self, group: &[Submission]) -> Result<(), ModelError> {
        // Request j's prompt goes into the first slot of its block of choices.
        let mut base = Vec::with_capacity(group.len());
        let mut next = self.running.len();
        for sub in group {
            base.push(next);
            next += sub.choices.len();
        }
        let live: Vec<usize> = self.running.iter().map(|r| r.len).collect();
        let longest = group.iter().map(|s| s.req.prompt.len()).max().unwrap_or(0);
        self.mem.fit(next, longest + 1, &live)?;
        let t0 = std::time::Instant::now();
        let mut reused = Vec::with_capacity(group.len());
        let keys: Vec<Vec<u32>> = group
            .iter()
            .map(|sub| keyed(sub.req.adapter, sub.req.prompt.clone()))
            .collect();
        for (key, &slot) in keys.iter().zip(&base) {
            reused.push(self.mem.reuse(slot, key)?);
        }
        let copy_in = t0.elapsed();
        let seqs: Vec<(usize, usize, &[u32])> = group
            .iter()
            .zip(&base)
            .zip(&reused)
            .map(|((sub, &slot), &start)| (slot, start, &sub.req.prompt[start..]))
            .collect();
        let t1 = std::time::Instant::now();
        let logits = if group.iter().all(|sub| sub.req.adapter.is_none()) {
            self.model.prefill_slots(&seqs, &self.mem.slots)?
        } else {
            // Each packed token takes its request's adapter.
            let rows: Vec<Option<usize>> = group
                .iter()
                .zip(&seqs)
                .flat_map(|(sub, s)| std::iter::repeat_n(sub.req.adapter, s.2.len()))
                .collect();
            self.model
                .with_adapter_rows(&rows, || self.model.prefill_slots(&seqs, &self.mem.slots))?
        };
        let logits = Rows::new(&logits)?;
        let t2 = std::time::Instant::now();
        let epoch = self.mem.epoch;
        for (key, &slot) in keys.iter().zip(&base) {
            self.mem.remember(slot, key, epoch);
        }
        let s = &self.stats;
        s.prefill_micros
            .fetch_add((t2 - t1).as_micros() as u64, Ordering::Relaxed);
        s.prefix_copy_micros.fetch_add(
            (copy_in + t2.elapsed()).as_micros() as u64,
            Ordering::Relaxed,
        );
        s.prefill_passes.fetch_add(1, Ordering::Relaxed);
        s.prefill_tokens.fetch_add(
            seqs.iter().map(|s| s.2.len() as u64).sum(),
            Ordering::Relaxed,
        );
        s.prefix_lookups
            .fetch_add(group.len() as u64, Ordering::Relaxed);
        s.prefix_hits.fetch_add(
            reused.iter().filter(|&&r| r > 0).count() as u64,
            Ordering::Relaxed,
        );
        s.prefix_reused_tokens
            .fetch_add(reused.iter().map(|&r| r as u64).sum(), Ordering::Relaxed);
        for (j, sub) in group.iter().enumerate() {
            let (row, log_z) = logits.row(j);
            let top = sampling::top_logprobs_given(row, sub.req.top_logprobs, log_z);
            let len = sub.req.prompt.len();
            for (index, events) in &sub.choices {
                // Slots between running.len() and base[j] belong to choices that already
                // finished, so the next running sequence's slot never holds data still
                // needed.
                let slot = self.running.len();
                if slot != base[j] {
                    self.mem.slots.copy_slot(base[j], slot, len)?;
                }
                let rng = match sub.req.seed {
                    Some(s) => Rng::seeded(s.wrapping_add(*index)),
                    None => Rng::from_entropy(),
                };
                let mut r = Running {
                    len,
                    req: sub.req.clone(),
                    events: events.clone(),
                    rng,
                    generated: 0,
                    tokens: Vec::new(),
                    last: 0,
                    cstate: sub.req.constraint.as_ref().map(|c| c.start()),
                    version: self.version(sub.req.adapter),
                    epoch,
                };
                match pick(row, log_z, &mut r, &mut self.allowed) {
                    Ok(picked) => {
                        if !emit(&self.stats, self.per_request, &mut r, picked, top.clone()) {
                            self.running.push(r);
                        }
                    }
                    Err(e) => {
                        let _ = r.events.send(EngineEvent::Failed(e.to_string()));
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes the sequences at `gone` (any order), keeping slots `0..n` occupied by
    /// moving the last sequence's positions into each freed slot.
    fn remove(&mut self, mut gone: Vec<usize>) -> Result<(), ModelError> {
        gone.sort_unstable_by(|a, b| b.cmp(a));
        gone.dedup();
        for i in gone {
            let last = self.running.len() - 1;
            if i != last {
                self.mem.slots.copy_slot(last, i, self.running[last].len)?;
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
        let longest = lens.iter().copied().max().unwrap_or(0);
        self.mem.fit(self.running.len(), longest + 1, &lens)?;
        let logits = if self.running.iter().all(|r| r.req.adapter.is_none()) {
            self.model.decode_slots(&ids, &mut lens, &self.mem.slots)?
        } else {
            let rows: Vec<Option<usize>> = self.running.iter().map(|r| r.req.adapter).collect();
            self.model.with_adapter_rows(&rows, || {
                self.model.decode_slots(&ids, &mut lens, &self.mem.slots)
            })?
        };
        let logits = Rows::new(&logits)?;
        let mut done = Vec::new();
        let capacity = self.per_request;
        for (i, r) in self.running.iter_mut().enumerate() {
            r.len = lens[i];
            let (row, log_z) = logits.row(i);
            match pick(row, log_z, r, &mut self.allowed) {
                Ok(picked) => {
                    let top = sampling::top_logprobs_given(row, r.req.top_logprobs, log_z);
                    if emit(&self.stats, capacity, r, picked, top) {
                        done.push(i);
                    }
                }
                Err(e) => {
                    let _ = r.events.send(EngineEvent::Failed(e.to_string()));
                    done.push(i);
                }
            }
        }
        // What finished sequences computed is cached before their slots are reused.
        let t0 = std::time::Instant::now();
        for &i in &done {
            let r = &self.running[i];
            let computed = r.computed();
            self.mem.remember(i, &computed, r.epoch);
        }
        self.stats
            .prefix_copy_micros
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.remove(done)
    }

    /// The policy version of `adapter` (`None`: the model's own).
    fn version(&self, adapter: Option<usize>) -> u64 {
        match adapter {
            None => self.stats.policy_version.load(Ordering::Relaxed),
            Some(i) => lock(&self.stats.adapter_versions)
                .get(i)
                .copied()
                .unwrap_or(0),
        }
    }

    fn publish(&self) {
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        let positions: usize = self.running.iter().map(|r| r.len).sum();
        self.stats
            .kv_bytes
            .store(positions * self.bytes_per_position, Ordering::Relaxed);
        self.mem.publish(&self.stats);
    }
}

fn finish(
    stats: &EngineStats,
    events: &UnboundedSender<EngineEvent>,
    req: &GenerateRequest,
    generated: usize,
    reason: FinishReason,
    version: u64,
) {
    stats.completed.fetch_add(1, Ordering::Relaxed);
    let _ = events.send(EngineEvent::Finished {
        reason,
        prompt_tokens: req.prompt.len(),
        completion_tokens: generated,
        policy_version: version,
    });
}

/// A step's logits on the host, one copy for all rows, with each row's log-sum-exp
/// (computed by LibTorch for all rows at once, vectorised, in float64).
struct Rows {
    data: Vec<f32>,
    log_z: Vec<f64>,
    vocab: usize,
}

impl Rows {
    fn new(logits: &tch::Tensor) -> Result<Rows, ModelError> {
        // log Z where the logits are (on a GPU: one small copy back, no host pass).
        let lz = logits
            .f_to_kind(tch::Kind::Double)?
            .f_logsumexp([-1i64].as_slice(), false)?
            .f_to_device(tch::Device::Cpu)?;
        let logits = logits
            .f_to_device(tch::Device::Cpu)?
            .f_to_kind(tch::Kind::Float)?
            .f_contiguous()?;
        let size = logits.size();
        let [rows, vocab] = size[..] else {
            return Err(ModelError::Invalid(format!(
                "logits of shape {size:?}, wanted [rows, vocab]"
            )));
        };
        let (rows, vocab) = (rows as usize, vocab as usize);
        let mut data = vec![0f32; rows * vocab];
        logits.f_copy_data(&mut data, rows * vocab)?;
        let mut log_z = vec![0f64; rows];
        lz.f_copy_data(&mut log_z, rows)?;
        Ok(Rows { data, log_z, vocab })
    }

    fn row(&self, i: usize) -> (&[f32], f64) {
        (
            &self.data[i * self.vocab..(i + 1) * self.vocab],
            self.log_z[i],
        )
    }
}

/// Samples `r`'s next token from `row`, within its constraint if it has one.
fn pick(
    row: &[f32],
    log_z: f64,
    r: &mut Running,
    allowed: &mut Vec<bool>,
) -> Result<Picked, ConstraintError> {
    let req = &r.req;
    match (&req.constraint, &mut r.cstate) {
        (Some(c), Some(st)) => {
            if c.mask(st, row.len(), allowed) == 0 {
                return Err(ConstraintError::OffPattern {
                    token: None,
                    describe: c.describe.clone(),
                });
            }
            let picked = sampling::sample_within(
                row,
                Some(log_z),
                Some(allowed),
                &req.sampling,
                &mut r.rng,
                &req.prompt,
                &r.tokens,
            );
            c.advance(st, picked.id)?;
            Ok(picked)
        }
        _ => Ok(sampling::sample_within(
            row,
            Some(log_z),
            None,
            &req.sampling,
            &mut r.rng,
            &req.prompt,
            &r.tokens,
        )),
    }
}

/// Sends one token; returns true (after sending `Finished`) if the sequence is done.
fn emit(
    stats: &EngineStats,
    capacity: usize,
    r: &mut Running,
    picked: Picked,
    top: Vec<(u32, f64)>,
) -> bool {
    let Picked {
        id,
        logprob,
        behaviour,
    } = picked;
    r.generated += 1;
    r.last = id;
    r.tokens.push(id);
    stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let _ = r.events.send(EngineEvent::Token {
        id,
        logprob,
        behaviour,
        top,
    });
    let complete = match (&r.req.constraint, &r.cstate) {
        (Some(c), Some(st)) => c.is_complete(st),
        _ => false,
    };
    let reason = if complete || r.req.stop_token_ids.contains(&id) {
        Some(FinishReason::Stop)
    } else if r.generated >= r.req.max_tokens || r.len >= capacity {
        Some(FinishReason::Length)
    } else {
        None
    };
    match reason {
        Some(reason) => {
            finish(stats, &r.events, &r.req, r.generated, reason, r.version);
            true
        }
        None => false,
    }
}
