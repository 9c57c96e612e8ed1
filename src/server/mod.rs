//! The server role (`agentjet-peer --role server`): hosts a model on the engine thread and
//! serves it to the swarm.
//!
//! - announces the model in the DHT (provider record, re-provided) and gossips its status
//!   (policy version, load, queue depth, free KV positions, episodes stored);
//! - `/agentjet/infer/1`: token-level generation; every streamed token comes with the
//!   server's signature over the call so far (see [`crate::swarm::sign`]); a caller that
//!   goes away cancels its generation;
//! - `/agentjet/card/1`: the model card blob;
//! - `/agentjet/submit/1`: episodes as fragment manifests; fragments the server already
//!   has are not sent again; every fragment is checked against its hash and every sampled
//!   call against a signature by a server of this model; the episode is acknowledged only
//!   once written (and synced) under `<data-dir>/episodes/<model>/`;
//! - optionally the OpenAI-compatible HTTP API on the same engine (`--http`).
//!
//! Stored episodes go to the training loop ([`train`]), which steps the trainer on its own
//! copy of the model and brings the engine to each new policy version.

pub mod train;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::{info, Instrument};

use crate::engine::{
    Constraint, EngineError, EngineEvent, EngineHandle, GenerateRequest, TokenBytes,
};
use crate::model::ModelCard;
use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::protocol::{
    CardBlob, CardReply, CardRequest, FragmentBatch, InferFrame, InferRequest, ModelStatus,
    SubmitManifest, SubmitReply, CARD, INFER, SUBMIT,
};
use crate::swarm::sign::{join, rebuilt_calls, verify, CallHasher, MAX_SIGNATURE_BYTES};
use crate::swarm::{PeerId, Stream, SwarmHandle};
use crate::timeline::fragment::{EpisodeManifest, Fragment, FragmentHash};
use crate::timeline::{EpisodeStatus, Timeline};

/// Bounds on what a caller may ask.
#[derive(Debug, Clone)]
pub struct ServeLimits {
    pub max_n: u32,
    pub max_top_logprobs: u32,
    /// Fragments kept for deduplication at most (bytes); past it the cache restarts empty.
    pub fragment_cache_bytes: usize,
    /// Timelines, branches and fragment references one manifest may have at most.
    pub max_manifest_refs: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_n: 64,
            max_top_logprobs: 20,
            fragment_cache_bytes: 512 << 20,
            max_manifest_refs: 1 << 20,
        }
    }
}

#[derive(Default)]
struct FragmentCache {
    map: HashMap<FragmentHash, (Fragment, usize)>,
    bytes: usize,
}

/// One served model, shared by the protocol handlers.
pub struct ServedModel {
    pub name: String,
    pub card: Arc<ModelCard>,
    pub engine: EngineHandle,
    pub max_context: usize,
    pub max_batch: usize,
    vocab: Arc<TokenBytes>,
    card_blob: ([u8; 32], Vec<u8>),
    swarm: SwarmHandle,
    limits: ServeLimits,
    cache: Mutex<FragmentCache>,
    episodes_dir: PathBuf,
    pub episodes_stored: AtomicU64,
    /// Servers of this model ever seen in the swarm view (their signatures are accepted).
    servers: Mutex<HashSet<PeerId>>,
    /// Where stored episodes go to be trained on (none: serving only).
    trainer: Mutex<Option<std::sync::mpsc::Sender<StoredEpisode>>>,
    /// The trainer's step count, gossiped with the status.
    pub train_step: AtomicU64,
}

/// The card as the blob clients fetch: its HF files, postcard-encoded, and its blake3.
pub fn card_blob(name: &str, card: &ModelCard) -> Result<([u8; 32], Vec<u8>), String> {
    let dir = std::env::temp_dir().join(format!(
        "agentjet-card-{}-{}",
        std::process::id(),
        blake3::hash(name.as_bytes()).to_hex()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let r = (|| {
        card.write_card_files(&dir, "float32")
            .map_err(|e| e.to_string())?;
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
                std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?,
            ));
        }
        let blob = postcard::to_allocvec(&CardBlob {
            model: name.to_string(),
            files,
        })
        .map_err(|e| e.to_string())?;
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
    ) -> Result<Arc<ServedModel>, String> {
        let card_blob = card_blob(&name, &card)?;
        let vocab = Arc::new(card.tokenizer.token_bytes(card.config.vocab_size));
        let episodes_dir = data_dir.join("episodes").join(crate::safe_file_name(&name));
        std::fs::create_dir_all(&episodes_dir)
            .map_err(|e| format!("creating {}: {e}", episodes_dir.display()))?;
        let stored = std::fs::read_dir(&episodes_dir)
            .map(|d| d.count())
            .unwrap_or(0) as u64;
        Ok(Arc::new(ServedModel {
            name,
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
            servers: Mutex::new(HashSet::new()),
            trainer: Mutex::new(None),
            train_step: AtomicU64::new(0),
        }))
    }

    /// Sends every episode stored from now on to `tx` (the training loop).
    pub fn set_trainer(&self, tx: std::sync::mpsc::Sender<StoredEpisode>) {
        if let Ok(mut t) = self.trainer.lock() {
            *t = Some(tx);
        }
    }

    /// Registers the protocol handlers and announces the model.
    pub async fn start(self: &Arc<Self>) -> Result<(), String> {
        let m = self.clone();
        self.swarm
            .serve(INFER, move |peer, s| {
                let m = m.clone();
                async move {
                    m.infer(s)
                        .instrument(tracing::debug_span!("call", %peer))
                        .await
                }
            })
            .map_err(|e| e.to_string())?;
        let m = self.clone();
        self.swarm
            .serve(CARD, move |_peer, s| {
                let m = m.clone();
                async move { m.card(s).await }
            })
            .map_err(|e| e.to_string())?;
        let m = self.clone();
        self.swarm
            .serve(SUBMIT, move |peer, s| {
                let m = m.clone();
                async move {
                    m.submit(s)
                        .instrument(
                            tracing::info_span!("episode", %peer, id = tracing::field::Empty),
                        )
                        .await
                }
            })
            .map_err(|e| e.to_string())?;
        self.publish_status();
        self.swarm
            .provide(&self.name)
            .await
            .map_err(|e| e.to_string())?;
        let m = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(m.swarm.cfg.status_interval / 2);
            loop {
                tick.tick().await;
                m.publish_status();
            }
        });
        Ok(())
    }

    fn publish_status(&self) {
        let s = &self.engine.stats;
        let running = s.running.load(Ordering::Relaxed);
        let waiting = s.waiting.load(Ordering::Relaxed);
        let version = s.policy_version.load(Ordering::Relaxed);
        let free = (self.max_batch.saturating_sub(running) * self.engine.max_sequence) as u64;
        let episodes = self.episodes_stored.load(Ordering::Relaxed);
        let name = self.name.clone();
        let load = running as f32 / self.max_batch.max(1) as f32;
        self.swarm.set_status(|st| {
            st.models = vec![ModelStatus {
                name,
                policy_version: version,
                train_step: self.train_step.load(Ordering::Relaxed),
            }];
            st.load = load;
            st.queue_depth = waiting as u32;
            st.free_kv_positions = free;
            st.episodes = episodes;
        });
    }

    fn limit(&self) -> usize {
        self.swarm.cfg.max_frame_bytes
    }

    async fn card(&self, mut s: Stream) -> Result<(), String> {
        let req: CardRequest = read_frame(&mut s, 4096).await.map_err(|e| e.to_string())?;
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
        write_frame(&mut s, &reply, self.limit())
            .await
            .map_err(|e| e.to_string())
    }

    /// Checks a request; the engine request, or why not.
    fn engine_request(&self, r: InferRequest) -> Result<(GenerateRequest, usize), String> {
        if r.model != self.name {
            return Err(format!(
                "this server serves {:?}, not {:?}",
                self.name, r.model
            ));
        }
        if r.prompt.is_empty() {
            return Err("empty prompt".into());
        }
        let vocab = self.card.config.vocab_size;
        if let Some(t) = r
            .prompt
            .iter()
            .chain(&r.stop_token_ids)
            .find(|t| **t as usize >= vocab)
        {
            return Err(format!("token id {t} is outside the vocabulary ({vocab})"));
        }
        if r.prompt.len() + r.max_tokens as usize > self.max_context {
            return Err(format!(
                "context_length_exceeded: {} prompt + {} max tokens > {} positions",
                r.prompt.len(),
                r.max_tokens,
                self.max_context
            ));
        }
        if r.n == 0 || r.n > self.limits.max_n {
            return Err(format!("n must be 1..={}, got {}", self.limits.max_n, r.n));
        }
        if r.top_logprobs > self.limits.max_top_logprobs {
            return Err(format!(
                "top_logprobs must be <= {}",
                self.limits.max_top_logprobs
            ));
        }
        r.sampling.validate()?;
        let constraint = match r.constraint {
            Some(p) => Some(Constraint::from_pattern(p, self.vocab.clone())?),
            None => None,
        };
        Ok((
            GenerateRequest {
                prompt: r.prompt,
                max_tokens: r.max_tokens as usize,
                sampling: r.sampling,
                seed: r.seed,
                stop_token_ids: r.stop_token_ids,
                top_logprobs: r.top_logprobs as usize,
                constraint,
            },
            r.n as usize,
        ))
    }

    async fn infer(&self, mut s: Stream) -> Result<(), String> {
        let limit = self.limit();
        let r: InferRequest = read_frame(&mut s, limit).await.map_err(|e| e.to_string())?;
        let (req, n) = match self.engine_request(r) {
            Ok(x) => x,
            Err(e) => {
                let _ = write_frame(
                    &mut s,
                    &InferFrame::Rejected {
                        message: e.clone(),
                        retry: false,
                    },
                    limit,
                )
                .await;
                return Err(format!("rejected a request: {e}"));
            }
        };
        let prompt = req.prompt.clone();
        let rxs = match self.engine.submit_n(req, n) {
            Ok(r) => r,
            Err(e) => {
                let retry = matches!(e, EngineError::Overloaded(_) | EngineError::Stopped);
                let _ = write_frame(
                    &mut s,
                    &InferFrame::Rejected {
                        message: e.to_string(),
                        retry,
                    },
                    limit,
                )
                .await;
                return Ok(());
            }
        };
        // One hasher per choice, started on the first token's policy version.
        let mut hashers: Vec<Option<CallHasher>> = vec![None; n];
        let version_now = || self.engine.stats.policy_version.load(Ordering::Relaxed);
        let mut events = futures::stream::select_all(
            rxs.into_iter()
                .enumerate()
                .map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |e| (i, e))),
        );
        while let Some((i, ev)) = events.next().await {
            let frame = match ev {
                EngineEvent::Token { id, logprob, top } => {
                    let h = hashers[i]
                        .get_or_insert_with(|| CallHasher::new(&self.name, version_now(), &prompt));
                    h.push(id, logprob as f32);
                    vec![InferFrame::Token {
                        choice: i as u32,
                        id,
                        logprob,
                        top,
                        policy_version: h.version(),
                        signature: self.swarm.sign(&h.digest()),
                    }]
                }
                EngineEvent::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    policy_version,
                } => {
                    // The version signed is the one the hasher started with: the engine's
                    // version when the first token came (the request's start version
                    // unless weights changed during its prefill).
                    vec![InferFrame::Finished {
                        choice: i as u32,
                        reason,
                        prompt_tokens: prompt_tokens as u32,
                        completion_tokens: completion_tokens as u32,
                        policy_version: hashers[i].as_ref().map_or(policy_version, |h| h.version()),
                    }]
                }
                EngineEvent::Failed(message) => vec![InferFrame::Failed {
                    choice: i as u32,
                    message,
                }],
                EngineEvent::Signed { .. } => vec![],
            };
            for f in frame {
                if let Err(e) = write_frame(&mut s, &f, limit).await {
                    // The caller went away: dropping the receivers cancels the generation.
                    return Err(format!("caller gone mid-call ({e}); generation cancelled"));
                }
            }
        }
        let _ = futures::io::AsyncWriteExt::close(&mut s).await;
        Ok(())
    }

    /// The peers whose signatures count for this model: this server and every server the
    /// swarm view has shown serving it.
    fn known_servers(&self) -> HashSet<PeerId> {
        let mut set = self.servers.lock().map(|s| s.clone()).unwrap_or_default();
        for e in self.swarm.view() {
            if e.status.role == crate::swarm::Role::Server
                && e.status.models.iter().any(|m| m.name == self.name)
            {
                set.insert(e.peer);
            }
        }
        set.insert(self.swarm.peer_id);
        if let Ok(mut s) = self.servers.lock() {
            s.clone_from(&set);
        }
        set
    }

    fn check_manifest(&self, m: &SubmitManifest) -> Result<(), String> {
        let man = &m.manifest;
        if man.episode_id.is_empty() || man.episode_id.len() > 256 {
            return Err("episode id must be 1..=256 bytes".into());
        }
        let aborted = matches!(man.status, EpisodeStatus::Aborted { .. });
        if man.timelines.is_empty() && !aborted {
            return Err("the episode has no timeline".into());
        }
        if aborted && !man.timelines.is_empty() {
            return Err("an aborted episode is reported without its calls".into());
        }
        if man.status == EpisodeStatus::Running {
            return Err("the episode is still running".into());
        }
        if man.status == EpisodeStatus::Finished
            && man.reward.is_none()
            && !man.rewards.contains_key(&self.name)
        {
            return Err(format!(
                "the episode has no reward for model {:?}",
                self.name
            ));
        }
        for r in man.reward.iter().chain(man.rewards.values()) {
            if !r.is_finite() {
                return Err(format!("reward {r} is not a finite number"));
            }
        }
        if m.signatures.len() != man.timelines.len() {
            return Err(format!(
                "{} signature lists for {} timelines",
                m.signatures.len(),
                man.timelines.len()
            ));
        }
        let refs: usize = man.timelines.iter().map(|t| t.hashes().count()).sum();
        if refs > self.limits.max_manifest_refs {
            return Err(format!(
                "{refs} fragment references (limit {})",
                self.limits.max_manifest_refs
            ));
        }
        for (t, sigs) in man.timelines.iter().zip(&m.signatures) {
            if t.model != self.name {
                return Err(format!(
                    "a timeline of model {:?} was sent to a server of {:?}",
                    t.model, self.name
                ));
            }
            if sigs.len() != t.calls as usize {
                return Err(format!("{} signatures for {} calls", sigs.len(), t.calls));
            }
        }
        let calls: usize = man.timelines.iter().map(|t| t.calls as usize).sum();
        if m.signers.len() > calls.max(1) {
            return Err(format!("{} signers for {calls} calls", m.signers.len()));
        }
        if m.signers.iter().any(|k| k.len() > MAX_SIGNATURE_BYTES) {
            return Err(format!("a signer key over {MAX_SIGNATURE_BYTES} bytes"));
        }
        Ok(())
    }

    async fn submit(&self, mut s: Stream) -> Result<(), String> {
        let limit = self.limit();
        let m: SubmitManifest = read_frame(&mut s, limit).await.map_err(|e| e.to_string())?;
        let episode = m.manifest.episode_id.clone();
        tracing::Span::current().record("id", episode.as_str());
        match self.receive_episode(&mut s, m).await {
            Ok(reply) => {
                write_frame(&mut s, &reply, limit)
                    .await
                    .map_err(|e| e.to_string())?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                Ok(())
            }
            Err(why) => {
                let _ = write_frame(&mut s, &SubmitReply::Rejected(why.clone()), limit).await;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                Err(format!("rejected episode {episode:?}: {why}"))
            }
        }
    }

    async fn receive_episode(
        &self,
        s: &mut Stream,
        m: SubmitManifest,
    ) -> Result<SubmitReply, String> {
        let limit = self.limit();
        self.check_manifest(&m)?;
        let all: HashSet<FragmentHash> = m
            .manifest
            .timelines
            .iter()
            .flat_map(|t| t.hashes().copied())
            .collect();
        let mut have: HashMap<FragmentHash, Fragment> = HashMap::new();
        let mut want: HashSet<FragmentHash> = HashSet::new();
        {
            let cache = self.cache.lock().map_err(|_| "internal: cache lock")?;
            for h in &all {
                match cache.map.get(h) {
                    Some((f, _)) => {
                        have.insert(*h, f.clone());
                    }
                    None => {
                        want.insert(*h);
                    }
                }
            }
        }
        let known = have.len();
        let mut want_list: Vec<FragmentHash> = want.iter().copied().collect();
        want_list.sort();
        write_frame(s, &SubmitReply::Want(want_list.clone()), limit)
            .await
            .map_err(|e| e.to_string())?;
        let mut received = Vec::new();
        let mut next = want_list.iter();
        while received.len() < want_list.len() {
            let batch: FragmentBatch = read_frame(s, limit).await.map_err(|e| e.to_string())?;
            if batch.fragments.is_empty() {
                return Err("an empty fragment batch".into());
            }
            for bytes in batch.fragments {
                let hash = *next
                    .next()
                    .ok_or("more fragments were sent than asked for")?;
                let f = Fragment::decode(&hash, &bytes).map_err(|e| e.to_string())?;
                received.push((hash, f.clone(), bytes.len()));
                have.insert(hash, f);
            }
        }
        let timelines: Vec<Timeline> = m
            .manifest
            .timelines
            .iter()
            .map(|t| t.timeline(&have))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let servers = self.known_servers();
        for (ti, t) in timelines.iter().enumerate() {
            for c in rebuilt_calls(t) {
                let sig = match &m.signatures[ti][c.call as usize] {
                    None => Vec::new(),
                    Some(cs) => {
                        let key = m.signers.get(cs.signer as usize).ok_or_else(|| {
                            format!(
                                "call {} names signer {}, not in the list",
                                c.call, cs.signer
                            )
                        })?;
                        join(key, &cs.signature)
                    }
                };
                let digest = crate::swarm::sign::call_digest(
                    &t.model,
                    &c.prompt,
                    &c.completion,
                    &c.logprobs,
                    c.version,
                );
                let signer = verify(&sig, &digest).map_err(|e| format!("call {}: {e}", c.call))?;
                if !servers.contains(&signer) {
                    return Err(format!(
                        "call {} is signed by {signer}, which is not a server of {:?}",
                        c.call, self.name
                    ));
                }
            }
        }
        let stored = self.store_episode(&m.manifest, &timelines)?;
        {
            let mut cache = self.cache.lock().map_err(|_| "internal: cache lock")?;
            for (h, f, n) in received {
                if cache.bytes + n > self.limits.fragment_cache_bytes {
                    cache.map.clear();
                    cache.bytes = 0;
                }
                if cache.map.insert(h, (f, n)).is_none() {
                    cache.bytes += n;
                }
            }
        }
        self.episodes_stored.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut t) = self.trainer.lock() {
            if let Some(tx) = t.as_ref() {
                if tx.send(stored).is_err() {
                    tracing::error!("the training loop has stopped; episodes are stored only");
                    *t = None;
                }
            }
        }
        info!(
            fragments_received = all.len() - known,
            fragments_known = known,
            "stored episode"
        );
        Ok(SubmitReply::Stored {
            episode_id: m.manifest.episode_id.clone(),
            fragments_received: (all.len() - known) as u32,
            fragments_known: known as u32,
        })
    }

    /// The file an episode is stored in (named by a hash of its id).
    pub fn episode_file_name(episode_id: &str) -> String {
        let name = blake3::hash(episode_id.as_bytes()).to_hex();
        format!("{}.episode", &name[..32])
    }

    /// Writes the episode (manifest + rebuilt timelines) and syncs it before it is
    /// acknowledged. A resubmitted episode replaces the earlier copy.
    fn store_episode(
        &self,
        m: &EpisodeManifest,
        timelines: &[Timeline],
    ) -> Result<StoredEpisode, String> {
        let path = self
            .episodes_dir
            .join(ServedModel::episode_file_name(&m.episode_id));
        let tmp = path.with_extension("tmp");
        let stored = StoredEpisode {
            manifest: m.clone(),
            timelines: timelines.to_vec(),
        };
        let bytes = postcard::to_allocvec(&stored).map_err(|e| e.to_string())?;
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| format!("storing the episode at {}: {e}", path.display()))?;
        Ok(stored)
    }
}

/// An episode as a server stores it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StoredEpisode {
    pub manifest: EpisodeManifest,
    pub timelines: Vec<Timeline>,
}

impl StoredEpisode {
    /// The episode with its calls rebuilt from the timelines (sampled calls only: what
    /// training uses), as the trainer takes it.
    pub fn episode(&self) -> crate::timeline::Episode {
        let m = &self.manifest;
        let mut calls = Vec::new();
        for t in &self.timelines {
            for c in rebuilt_calls(t) {
                calls.push(crate::timeline::Call::new(
                    &t.model,
                    c.prompt,
                    c.completion,
                    c.logprobs,
                    c.version,
                ));
            }
        }
        crate::timeline::Episode {
            id: m.episode_id.clone(),
            task_id: m.task_id.clone(),
            group_id: m.group_id.clone(),
            calls,
            reward: m.reward,
            rewards: m.rewards.clone(),
            status: m.status.clone(),
        }
    }
}

/// Reads every episode stored for a model (in no particular order).
pub fn read_stored_episodes(dir: &Path) -> Result<Vec<StoredEpisode>, String> {
    let mut out = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "episode") {
            let b = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            out.push(postcard::from_bytes(&b).map_err(|e| format!("{}: {e}", p.display()))?);
        }
    }
    Ok(out)
}
