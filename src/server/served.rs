//! One served model, shared by the protocol handlers: its card, engine, bounds, the
//! fragment cache, where episodes are stored, and what the server gossips about it.
//!
//! Owns: the served model's shared state and its registration with the swarm (handlers,
//! provider record, status). Never trains (see [`super::train`]).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tracing::Instrument;

use super::error::ServerError;
use super::events::ServerEvent;
use super::settings::TrainerInput;
use crate::base::events::Events;
use crate::base::stop::{Stop, TaskTracker};
use crate::base::{lock, safe_file_name};
use crate::engine::{EngineHandle, TokenBytes};
use crate::model::ModelCard;
use crate::rpc::{
    CardBlob, CardReply, CardRequest, InferRequest, SubmitManifest, CARD, INFER, SUBMIT,
};
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{CacheSummary, GroupStatus, ModelStatus, PeerId, Stream, SwarmHandle};
use crate::timeline::fragment::{Fragment, FragmentHash};

/// Bounds on what a caller may ask.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    pub max_n: u32,
    pub max_top_logprobs: u32,
    /// Fragments kept for deduplication at most (bytes); past it the cache restarts empty.
    pub fragment_cache_bytes: usize,
    /// Timelines, branches and fragment references one manifest may have at most.
    pub max_manifest_refs: usize,
    /// Bytes of episodes one submitting peer may store on this server.
    pub max_episode_bytes_per_peer: u64,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_n: 64,
            max_top_logprobs: 20,
            fragment_cache_bytes: 512 << 20,
            max_manifest_refs: 1 << 20,
            max_episode_bytes_per_peer: 8 << 30,
        }
    }
}

#[derive(Default)]
pub(super) struct FragmentCache {
    pub(super) map: HashMap<FragmentHash, (Fragment, usize)>,
    pub(super) bytes: usize,
}

/// One served model, shared by the protocol handlers.
pub struct ServedModel {
    pub name: String,
    /// The engine's bank adapter this model is (`None`: the engine's model as loaded).
    pub adapter: Option<usize>,
    pub card: Arc<ModelCard>,
    pub engine: EngineHandle,
    pub max_context: usize,
    pub max_batch: usize,
    pub(super) vocab: Arc<TokenBytes>,
    card_blob: ([u8; 32], Vec<u8>),
    pub(super) swarm: SwarmHandle,
    pub(super) limits: ServeLimits,
    pub(super) cache: Mutex<FragmentCache>,
    pub(super) episodes_dir: PathBuf,
    pub episodes_stored: AtomicU64,
    /// The server's events (see [`ServerEvent`]).
    pub events: Events<ServerEvent>,
    /// Servers whose signatures counted, with their certificate's expiry (Unix s).
    servers: Mutex<HashMap<PeerId, Option<u64>>>,
    /// Bytes stored per submitting peer.
    pub(super) quota: Mutex<super::quota::Quota>,
    /// The signed calls stored, by nonce (a call counts in one episode).
    pub(super) calls: Mutex<super::calls::CallLedger>,
    /// Where stored episodes go to be trained on (none: serving only, or stopped).
    trainer: Mutex<Option<std::sync::mpsc::Sender<TrainerInput>>>,
    /// The trainer's step count, gossiped with the status.
    pub train_step: AtomicU64,
    /// Its training group as this member sees it (gossiped; none: not in a group).
    pub group: Mutex<Option<GroupStatus>>,
    /// Its part in the weight broadcast (set before it starts: trainers publish, a
    /// follower fetches).
    pub broadcast: std::sync::OnceLock<Arc<super::weights::Broadcast>>,
    /// The role's stop: once asked, new calls and submissions are refused (with `retry`).
    pub(super) stop: Stop,
    /// The role's tasks: every handler holds a token of it while it runs.
    pub(super) tasks: TaskTracker,
}

/// The card as the blob clients fetch: its HF files, postcard-encoded, and its blake3.
pub fn card_blob(name: &str, card: &ModelCard) -> Result<([u8; 32], Vec<u8>), ServerError> {
    let dir = std::env::temp_dir().join(format!(
        "agentjet-card-{}-{}",
        std::process::id(),
        blake3::hash(name.as_bytes()).to_hex()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| ServerError::io(&dir, e))?;
    let r = (|| {
        card.write_card_files(&dir, "float32")?;
        let mut files = Vec::new();
        for f in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            let p = dir.join(f);
            files.push((
                f.to_string(),
                std::fs::read(&p).map_err(|e| ServerError::io(&p, e))?,
            ));
        }
        let blob = postcard::to_allocvec(&CardBlob {
            model: name.to_string(),
            files,
        })
        .map_err(|e| ServerError::Encode(e.to_string()))?;
        Ok((*blake3::hash(&blob).as_bytes(), blob))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    r
}

impl ServedModel {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        card: Arc<ModelCard>,
        engine: EngineHandle,
        max_context: usize,
        max_batch: usize,
        swarm: SwarmHandle,
        data_dir: &Path,
        limits: ServeLimits,
        stop: Stop,
        tasks: TaskTracker,
        events: Events<ServerEvent>,
    ) -> Result<Arc<ServedModel>, ServerError> {
        let card_blob = card_blob(&name, &card)?;
        let vocab = Arc::new(card.tokenizer.token_bytes(card.config.vocab_size));
        let episodes_dir = data_dir.join("episodes").join(safe_file_name(&name));
        std::fs::create_dir_all(&episodes_dir).map_err(|e| ServerError::io(&episodes_dir, e))?;
        // What is on disk: the calls already stored (replays are refused) and each
        // submitter's bytes (its quota).
        let mut stored = 0u64;
        let mut calls = super::calls::CallLedger::default();
        let mut quota = super::quota::Quota::new(limits.max_episode_bytes_per_peer);
        super::stored::for_each_stored(&episodes_dir, true, |e, size| {
            stored += 1;
            let digest = super::calls::content_digest(&e.manifest, &e.nonces);
            calls.add_stored(&e.manifest.episode_id, digest, &e.nonces);
            if let Ok(peer) = PeerId::from_bytes(&e.submitter) {
                quota.add_stored(peer, size);
            }
        })?;
        Ok(Arc::new(ServedModel {
            name,
            adapter: None,
            card,
            engine,
            max_context,
            max_batch,
            vocab,
            card_blob,
            swarm,
            limits,
            cache: Mutex::new(FragmentCache::default()),
            episodes_dir,
            episodes_stored: AtomicU64::new(stored),
            servers: Mutex::new(HashMap::new()),
            quota: Mutex::new(quota),
            calls: Mutex::new(calls),
            trainer: Mutex::new(None),
            train_step: AtomicU64::new(0),
            group: Mutex::new(None),
            broadcast: std::sync::OnceLock::new(),
            stop,
            tasks,
            events,
        }))
    }

    /// This model as the engine's bank adapter `i` (see [`crate::model::llama::bank`]).
    pub fn set_adapter(self: &mut Arc<Self>, i: usize) -> Result<(), ServerError> {
        Arc::get_mut(self)
            .ok_or_else(|| ServerError::Panicked("the served model is already shared".into()))?
            .adapter = Some(i);
        Ok(())
    }

    /// The policy version the engine serves this model at.
    pub fn policy_version(&self) -> u64 {
        let s = &self.engine.stats;
        match self.adapter {
            None => s.policy_version.load(Ordering::Relaxed),
            Some(i) => lock(&s.adapter_versions).get(i).copied().unwrap_or(0),
        }
    }

    /// Serves `params` (the trainer's parameters) as this model's `version`.
    pub(super) fn serve_weights(
        &self,
        params: &[tch::Tensor],
        version: u64,
    ) -> Result<(), crate::engine::EngineError> {
        self.engine.update_weights_of(self.adapter, params, version)
    }

    /// Sends every episode stored from now on to `tx` (the training loop).
    pub fn set_trainer(&self, tx: std::sync::mpsc::Sender<TrainerInput>) {
        *lock(&self.trainer) = Some(tx);
    }

    /// Hands a stored episode to the training loop, if one runs.
    pub(super) fn train_on(&self, stored: super::StoredEpisode) {
        let mut t = lock(&self.trainer);
        if let Some(tx) = t.as_ref() {
            if tx.send(TrainerInput::Episode(Box::new(stored))).is_err() {
                // Stored on disk all the same: a restarted trainer takes it (consumed.log).
                tracing::warn!("the training loop has stopped; episodes are stored only");
                *t = None;
            }
        }
    }

    /// The directory episodes are stored in.
    pub fn episodes_dir(&self) -> &Path {
        &self.episodes_dir
    }

    /// True once the role was asked to stop: new work is refused.
    pub(super) fn stopping(&self) -> bool {
        self.stop.mode().is_some()
    }

    /// Registers the protocol handlers, announces the model, and keeps its status fresh
    /// (until the role stops).
    pub async fn start(self: &Arc<Self>) -> Result<(), ServerError> {
        Self::start_all(std::slice::from_ref(self)).await
    }

    /// [`ServedModel::start`] for several models of one server (adapters on one engine):
    /// one handler per protocol takes each call, card request and submission to the model
    /// it names (an unknown name goes to the first model, which refuses it and says why).
    pub async fn start_all(models: &[Arc<Self>]) -> Result<(), ServerError> {
        let Some(first) = models.first().cloned() else {
            return Err(ServerError::Panicked("no model to serve".into()));
        };
        let all: Arc<Vec<Arc<Self>>> = Arc::new(models.to_vec());
        let pick = |all: &[Arc<Self>], name: &str| -> Arc<Self> {
            all.iter()
                .find(|m| m.name == name)
                .unwrap_or(&all[0])
                .clone()
        };
        let ms = all.clone();
        first.swarm.serve(INFER, move |peer, mut s| {
            let ms = ms.clone();
            let running = ms[0].tasks.token();
            async move {
                let _running = running;
                let r: InferRequest = read_frame(&mut s, ms[0].limit()).await?;
                pick(&ms, &r.model)
                    .infer(r, s)
                    .instrument(tracing::debug_span!("call", %peer))
                    .await
            }
        })?;
        let ms = all.clone();
        first.swarm.serve(CARD, move |_peer, mut s| {
            let ms = ms.clone();
            async move {
                let req: CardRequest = read_frame(&mut s, 4096).await?;
                pick(&ms, &req.model).card(req, s).await
            }
        })?;
        let ms = all.clone();
        first.swarm.serve(SUBMIT, move |peer, mut s| {
            let ms = ms.clone();
            let running = ms[0].tasks.token();
            async move {
                let _running = running;
                let m: SubmitManifest = read_frame(&mut s, ms[0].limit()).await?;
                let model = m
                    .manifest
                    .timelines
                    .first()
                    .map(|t| t.model.clone())
                    .unwrap_or_default();
                pick(&ms, &model)
                    .submit(peer, m, s)
                    .instrument(tracing::info_span!("episode", %peer, id = tracing::field::Empty))
                    .await
            }
        })?;
        for m in models {
            m.publish_status();
            m.swarm.provide(&m.name).await?;
            let m = m.clone();
            let stop = m.stop.clone();
            let tasks = m.tasks.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(m.swarm.cfg.status_interval / 2);
                loop {
                    tokio::select! {
                        _ = tick.tick() => m.publish_status(),
                        _ = stop.requested() => return,
                    }
                }
            });
        }
        Ok(())
    }

    pub(super) fn publish_status(&self) {
        let s = &self.engine.stats;
        let running = s.running.load(Ordering::Relaxed);
        let waiting = s.waiting.load(Ordering::Relaxed);
        let version = self.policy_version();
        let free = (self.max_batch.saturating_sub(running) * self.engine.max_sequence) as u64;
        let episodes = self.episodes_stored.load(Ordering::Relaxed);
        let name = self.name.clone();
        let load = running as f32 / self.max_batch.max(1) as f32;
        let lookups = s.prefix_lookups.load(Ordering::Relaxed);
        let cache = CacheSummary {
            bytes: s.prefix_bytes.load(Ordering::Relaxed) as u64,
            hit_rate: if lookups == 0 {
                0.0
            } else {
                s.prefix_hits.load(Ordering::Relaxed) as f32 / lookups as f32
            },
            reused_tokens: s.prefix_reused_tokens.load(Ordering::Relaxed),
            prefilled_tokens: s.prefill_tokens.load(Ordering::Relaxed),
        };
        self.swarm.set_status(|st| {
            let me = ModelStatus {
                name,
                policy_version: version,
                train_step: self.train_step.load(Ordering::Relaxed),
                group: lock(&self.group).clone(),
                cache,
                weights: self.broadcast.get().and_then(|b| b.current(None)),
            };
            // The server's other models (adapters on the same engine) keep their entries.
            match st.models.iter_mut().find(|m| m.name == me.name) {
                Some(m) => *m = me,
                None => st.models.push(me),
            }
            st.load = load;
            st.queue_depth = waiting as u32;
            st.free_kv_positions = free;
            st.episodes = episodes;
        });
    }

    pub(super) fn limit(&self) -> usize {
        self.swarm.cfg.max_frame_bytes
    }

    async fn card(&self, req: CardRequest, mut s: Stream) -> Result<(), FrameError> {
        let reply = if req.model == self.name {
            CardReply::Card {
                hash: self.card_blob.0,
                blob: self.card_blob.1.clone(),
            }
        } else {
            CardReply::Unknown(format!(
                "this server serves {:?}, not {:?}",
                self.name, req.model
            ))
        };
        write_frame(&mut s, &reply, self.limit()).await
    }

    /// The peers whose signatures count for this model, by the swarm's trust (see
    /// `swarm::trust`): trusting a run, its certified servers of the model; with only a
    /// swarm key, every key holder the view has shown serving it; in an open swarm, this
    /// server alone. A server once seen stays counted (its calls may arrive after it
    /// left) until its certificate expires.
    pub(super) fn known_servers(&self) -> HashSet<PeerId> {
        let mut seen = lock(&self.servers);
        for e in self.swarm.view() {
            if self.swarm.may_sign(&e, &self.name) {
                seen.insert(e.peer, e.cert.as_ref().map(|c| c.not_after_unix));
            }
        }
        if self.swarm.may_sign_self(&self.name) {
            let until = self.swarm.own_cert().map(|c| c.not_after_unix);
            seen.insert(self.swarm.peer_id, until);
        }
        let now = crate::swarm::trust::unix_now();
        seen.retain(|_, until| until.is_none_or(|u| now <= u));
        seen.keys().copied().collect()
    }
}
