//! `/agentjet/submit/2` on the server: an episode arrives as a manifest of content-
//! addressed fragments; the server answers which fragments it lacks (its cache holds
//! recent ones), takes only those, checks each against its hash and every sampled call
//! against a signature by a server of this model (each signature's nonce used in no other
//! episode: `server::calls`), and acknowledges the episode only once it is written and
//! synced under `<data-dir>/episodes/<model>/`. Then it goes to the training loop. The
//! same episode submitted again with the same content (its acknowledgement was lost) is
//! acknowledged again, neither stored nor trained twice; other content under a stored id
//! is refused.
//!
//! Owns: receiving, verifying and storing episodes. Never trains.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use tracing::info;

use super::calls::{content_digest, Claim};
use super::events::ServerEvent;
use super::served::ServedModel;
pub use super::stored::{read_stored_episodes, StoredEpisode};
use crate::base::files::write_atomic;
use crate::base::lock;
use crate::rpc::{FragmentBatch, SubmitManifest, SubmitReply};
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::sign::{join, verify, Nonce, SignatureError, MAX_SIGNATURE_BYTES};
use crate::swarm::{PeerId, Stream};
use crate::timeline::digest::{call_digest, rebuilt_calls};
use crate::timeline::fragment::{EpisodeManifest, Fragment, FragmentError, FragmentHash};
use crate::timeline::{EpisodeStatus, Timeline};

/// How long a submission waits for another submission of the same episode to be stored.
const STORING_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Why an episode was not stored.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The manifest breaks a rule (said in the message) or a bound.
    #[error("{0}")]
    Manifest(String),
    #[error("the submit exchange: {0}")]
    Protocol(&'static str),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Fragment(#[from] FragmentError),
    #[error("call {call}: {source}")]
    Signature {
        call: u32,
        #[source]
        source: SignatureError,
    },
    #[error(
        "call {call} is signed by {signer}, which this server does not trust to serve \
         {model:?} (trusting a run: not certified for it; with a swarm key only: not a key \
         holder serving it; in an open swarm: not this server)"
    )]
    NotAServer {
        call: u32,
        signer: PeerId,
        model: String,
    },
    #[error("encoding the episode: {0}")]
    Encode(String),
    #[error("over its quota: {0}")]
    Quota(String),
    /// A signed call already counted in another episode, or twice in this one.
    #[error("replayed call: {0}")]
    Replay(String),
    #[error("storing the episode at {}: {source}", path.display())]
    Store {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("rejected episode {episode:?}: {why}")]
    Rejected {
        episode: String,
        why: Box<SubmitError>,
    },
}

impl ServedModel {
    fn check_manifest(&self, m: &SubmitManifest) -> Result<(), SubmitError> {
        let bad = |m: &str| SubmitError::Manifest(m.to_string());
        let man = &m.manifest;
        if !super::ledger::valid_episode_id(&man.episode_id) {
            return Err(bad(
                "episode id must be 1..=256 bytes with no control character",
            ));
        }
        let aborted = matches!(man.status, EpisodeStatus::Aborted { .. });
        if man.timelines.is_empty() && !aborted {
            return Err(bad("the episode has no timeline"));
        }
        if aborted && !man.timelines.is_empty() {
            return Err(bad("an aborted episode is reported without its calls"));
        }
        if man.status == EpisodeStatus::Running {
            return Err(bad("the episode is still running"));
        }
        if man.status == EpisodeStatus::Finished
            && man.reward.is_none()
            && !man.rewards.contains_key(&self.name)
        {
            return Err(SubmitError::Manifest(format!(
                "the episode has no reward for model {:?}",
                self.name
            )));
        }
        for r in man.reward.iter().chain(man.rewards.values()) {
            if !r.is_finite() {
                return Err(SubmitError::Manifest(format!(
                    "reward {r} is not a finite number"
                )));
            }
        }
        if m.signatures.len() != man.timelines.len() {
            return Err(SubmitError::Manifest(format!(
                "{} signature lists for {} timelines",
                m.signatures.len(),
                man.timelines.len()
            )));
        }
        let refs: usize = man.timelines.iter().map(|t| t.hashes().count()).sum();
        if refs > self.limits.max_manifest_refs {
            return Err(SubmitError::Manifest(format!(
                "{refs} fragment references (limit {})",
                self.limits.max_manifest_refs
            )));
        }
        for (t, sigs) in man.timelines.iter().zip(&m.signatures) {
            if t.model != self.name {
                return Err(SubmitError::Manifest(format!(
                    "a timeline of model {:?} was sent to a server of {:?}",
                    t.model, self.name
                )));
            }
            if sigs.len() != t.calls as usize {
                return Err(SubmitError::Manifest(format!(
                    "{} signatures for {} calls",
                    sigs.len(),
                    t.calls
                )));
            }
        }
        let calls: usize = man.timelines.iter().map(|t| t.calls as usize).sum();
        if m.signers.len() > calls.max(1) {
            return Err(SubmitError::Manifest(format!(
                "{} signers for {calls} calls",
                m.signers.len()
            )));
        }
        if m.signers.iter().any(|k| k.len() > MAX_SIGNATURE_BYTES) {
            return Err(SubmitError::Manifest(format!(
                "a signer key over {MAX_SIGNATURE_BYTES} bytes"
            )));
        }
        Ok(())
    }

    pub(super) async fn submit(
        &self,
        peer: PeerId,
        m: SubmitManifest,
        mut s: Stream,
    ) -> Result<(), SubmitError> {
        let limit = self.limit();
        let episode = m.manifest.episode_id.clone();
        tracing::Span::current().record("id", episode.as_str());
        // Taken while draining too: an episode is acknowledged only once it is on disk,
        // and a restarted trainer trains what it stored (consumed.log).
        match self.receive_episode(peer, &mut s, m).await {
            Ok(reply) => {
                write_frame(&mut s, &reply, limit).await?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                Ok(())
            }
            Err(why) => {
                let reply = SubmitReply::Rejected(why.to_string());
                let _ = write_frame(&mut s, &reply, limit).await;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                Err(SubmitError::Rejected {
                    episode,
                    why: Box::new(why),
                })
            }
        }
    }

    async fn receive_episode(
        &self,
        peer: PeerId,
        s: &mut Stream,
        m: SubmitManifest,
    ) -> Result<SubmitReply, SubmitError> {
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
            let cache = lock(&self.cache);
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
        write_frame(s, &SubmitReply::Want(want_list.clone()), limit).await?;
        let mut received = Vec::new();
        let mut next = want_list.iter();
        while received.len() < want_list.len() {
            let batch: FragmentBatch = read_frame(s, limit).await?;
            if batch.fragments.is_empty() {
                return Err(SubmitError::Protocol("an empty fragment batch"));
            }
            for bytes in batch.fragments {
                let hash = *next.next().ok_or(SubmitError::Protocol(
                    "more fragments were sent than asked for",
                ))?;
                let f = Fragment::decode(&hash, &bytes)?;
                received.push((hash, f.clone(), bytes.len()));
                have.insert(hash, f);
            }
        }
        let timelines: Vec<Timeline> = m
            .manifest
            .timelines
            .iter()
            .map(|t| t.timeline(&have))
            .collect::<Result<_, _>>()?;
        let servers = self.known_servers();
        let mut calls = Vec::new();
        let mut signed_by = Vec::new();
        for (ti, t) in timelines.iter().enumerate() {
            for c in rebuilt_calls(t) {
                let sig = match &m.signatures[ti][c.call as usize] {
                    None => Vec::new(),
                    Some(cs) => {
                        let key = m.signers.get(cs.signer as usize).ok_or_else(|| {
                            SubmitError::Manifest(format!(
                                "call {} names signer {}, not in the list",
                                c.call, cs.signer
                            ))
                        })?;
                        join(key, &cs.signature)
                    }
                };
                let digest = call_digest(
                    &t.model,
                    &c.prompt,
                    &c.completion,
                    &c.logprobs,
                    c.version,
                    &c.sampling,
                );
                let signed = verify(&sig, &digest).map_err(|e| SubmitError::Signature {
                    call: c.call,
                    source: e,
                })?;
                let signer = signed.signer;
                calls.push((c.call, signed.nonce));
                signed_by.push((signer.to_string(), c.version));
                if !servers.contains(&signer) {
                    return Err(SubmitError::NotAServer {
                        call: c.call,
                        signer,
                        model: self.name.clone(),
                    });
                }
            }
        }
        let id = &m.manifest.episode_id;
        let nonces: Vec<Nonce> = calls.iter().map(|(_, n)| *n).collect();
        let digest = content_digest(&m.manifest, &nonces);
        // The same episode being stored by another submission: wait for it (it is then
        // acknowledged again), or for its failure (then this one stores it).
        let t0 = std::time::Instant::now();
        loop {
            let claim = lock(&self.calls)
                .claim(id, digest, &calls)
                .map_err(SubmitError::Replay)?;
            match claim {
                Claim::New => break,
                Claim::Again if self.episodes_dir.join(Self::episode_file_name(id)).exists() => {
                    info!(
                        "episode already stored: acknowledged again, not stored or trained twice"
                    );
                    return Ok(SubmitReply::Stored {
                        episode_id: id.clone(),
                        fragments_received: 0,
                        fragments_known: all.len() as u32,
                    });
                }
                Claim::Again if t0.elapsed() < STORING_WAIT => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Claim::Again => {
                    return Err(SubmitError::Replay(format!(
                        "episode {id:?} is still being stored by another submission after {} s",
                        STORING_WAIT.as_secs()
                    )))
                }
            }
        }
        let stored = match self.store_episode(peer, &m.manifest, &timelines, nonces.clone()) {
            Ok(s) => s,
            Err(e) => {
                lock(&self.calls).release(id, &nonces);
                return Err(e);
            }
        };
        {
            let mut cache = lock(&self.cache);
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
        self.train_on(stored);
        self.events.emit(ServerEvent::EpisodeStored {
            model: self.name.clone(),
            episode: m.manifest.episode_id.clone(),
            calls: signed_by,
        });
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
    /// acknowledged. (An id is stored once: see `server::calls`.)
    fn store_episode(
        &self,
        peer: PeerId,
        m: &EpisodeManifest,
        timelines: &[Timeline],
        nonces: Vec<Nonce>,
    ) -> Result<StoredEpisode, SubmitError> {
        let path = self
            .episodes_dir
            .join(ServedModel::episode_file_name(&m.episode_id));
        let stored = StoredEpisode {
            manifest: m.clone(),
            timelines: timelines.to_vec(),
            nonces,
            submitter: peer.to_bytes(),
        };
        let bytes = stored.encode().map_err(SubmitError::Encode)?;
        let size = bytes.len() as u64;
        lock(&self.quota)
            .take(peer, size)
            .map_err(SubmitError::Quota)?;
        if let Err(source) = write_atomic(&path, &bytes) {
            // (A failure after the rename, syncing the folder, leaves the file in place:
            // it counts.)
            if !path.exists() {
                lock(&self.quota).give_back(peer, size);
            }
            return Err(SubmitError::Store { path, source });
        }
        Ok(stored)
    }
}
