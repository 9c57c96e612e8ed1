//! One peer's part in the broadcast of one model's versions: the versions it holds (in
//! its [`VersionStore`], which serves them) and what its gossiped status says of them
//! ([`WeightsStatus`]). A trainer holds each version it publishes ([`Holder::hold`]: the
//! manifest is made, the version held and announced at once, then the deltas a follower
//! one version behind will ask for are encoded on every core); a follower holds each
//! version it fetched ([`Holder::install`]), and so serves it on in turn.
//!
//! Owns: a model's held versions as the swarm sees them. Not how a snapshot is taken
//! from a model (the server's, with LibTorch), nor the fetch ([`super::follow`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::manifest::{Layout, Manifest, ManifestError};
use super::store::{Held, VersionStore};
use crate::base::lock;
use crate::swarm::{SwarmHandle, WeightsStatus};

/// One model's broadcast state on one peer.
pub struct Holder {
    swarm: SwarmHandle,
    pub store: Arc<VersionStore>,
    pub model: String,
    /// The training group whose versions these are.
    pub group: String,
    /// Bytes per chunk of the versions this peer publishes.
    pub chunk_bytes: u32,
    /// A follower (holds the group's versions without training).
    pub follower: bool,
    /// Chunk bytes fetched from other peers.
    pub fetched: AtomicU64,
    /// What the model's status says of it (gossiped).
    pub status: Mutex<Option<WeightsStatus>>,
    /// Whether a follower gossips each version it holds at once (a member always does:
    /// the followers wait for it). Yes in the binary; netsim's hundred followers in one
    /// process leave it to their next status (one process verifies every copy of every
    /// message, what a hundred machines would share).
    pub announce_followed: std::sync::atomic::AtomicBool,
}

impl Holder {
    pub fn new(
        swarm: SwarmHandle,
        store: Arc<VersionStore>,
        model: &str,
        group: &str,
        chunk_bytes: u32,
        follower: bool,
    ) -> Holder {
        // A follower says so from its start (it holds no version yet): the others count
        // it in when they share a version's chunks out.
        let status = follower.then(|| WeightsStatus {
            group: group.to_string(),
            follower: true,
            ..Default::default()
        });
        Holder {
            swarm,
            store,
            model: model.to_string(),
            group: group.to_string(),
            chunk_bytes,
            follower,
            fetched: AtomicU64::new(0),
            status: Mutex::new(status),
            announce_followed: std::sync::atomic::AtomicBool::new(true),
        }
    }

    pub fn swarm(&self) -> &SwarmHandle {
        &self.swarm
    }

    /// Holds `bytes` (the tensors of `layout` back to back) as `version`, whose
    /// parameters hash to `hash` (hex), and announces it; then encodes the deltas against
    /// the version held before it (what every up-to-date follower asks for).
    pub fn hold(
        &self,
        layout: &Layout,
        bytes: Vec<u8>,
        version: u64,
        hash: &str,
    ) -> Result<Held, ManifestError> {
        let m =
            Manifest::build_chunked(&self.model, version, hash, layout, &bytes, self.chunk_bytes)?;
        let held = Held::new(m, bytes);
        self.install(&held, &hash[..hash.len().min(16)], 0);
        let t0 = std::time::Instant::now();
        let frames = self.store.prepare_deltas(&self.model, version);
        tracing::info!(
            model = self.model,
            version,
            frames,
            chunks = held.manifest.chunks.len(),
            encode_s = t0.elapsed().as_secs_f64(),
            "published policy version"
        );
        Ok(held)
    }

    /// Holds `held` (serves its chunks) and says so in the status, at once (see
    /// [`Holder::announce_followed`]): it serves parameters hashing to `param_hash`
    /// (hex8), `lag` versions behind its group.
    pub fn install(&self, held: &Held, param_hash: &str, lag: u64) {
        let (version, id) = (held.version(), held.id);
        self.store.put(held.clone());
        let status = WeightsStatus {
            group: self.group.clone(),
            version,
            manifest: id,
            param_hash: param_hash.to_string(),
            follower: self.follower,
            lag,
            fetched_bytes: self.fetched.load(Ordering::Relaxed),
            served_bytes: self.store.served_bytes.load(Ordering::Relaxed),
        };
        *lock(&self.status) = Some(status.clone());
        self.swarm.set_status(|st| {
            if let Some(m) = st.models.iter_mut().find(|m| m.name == self.model) {
                m.weights = Some(status);
            }
        });
        // Said at once (a member's: the followers wait for it).
        if !self.follower || self.announce_followed.load(Ordering::Relaxed) {
            self.swarm.announce();
        }
    }

    /// Says no more that this peer follows the group: a follower that holds no version
    /// and refused the group's (another layout, a wrong hash) has no share to give, and
    /// the others would wait for it each version. It still says it is a follower (of no
    /// group): clients submit no episodes to it, as to any follower. Its next installed
    /// version says the group again.
    pub fn withdraw(&self) {
        let status = WeightsStatus {
            follower: true,
            ..Default::default()
        };
        *lock(&self.status) = Some(status.clone());
        self.swarm.set_status(|st| {
            if let Some(m) = st.models.iter_mut().find(|m| m.name == self.model) {
                m.weights = Some(status);
            }
        });
        self.swarm.announce();
    }

    /// The status with the byte counters (and `lag`, for a follower) as they are now.
    pub fn current(&self, lag: Option<u64>) -> Option<WeightsStatus> {
        let mut s = lock(&self.status);
        let st = s.as_mut()?;
        st.fetched_bytes = self.fetched.load(Ordering::Relaxed);
        st.served_bytes = self.store.served_bytes.load(Ordering::Relaxed);
        if let Some(l) = lag {
            st.lag = l;
        }
        Some(st.clone())
    }
}
