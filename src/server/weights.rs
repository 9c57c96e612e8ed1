//! A served model's part in the weight broadcast (`collective::broadcast`): a trainer
//! publishes each policy version it serves (its snapshot in the serving dtype goes into
//! the server's [`VersionStore`], which serves its manifest and chunks, and the version is
//! gossiped); a follower (`--follow`, [`super::follow`]) installs the versions it fetches
//! the same way, so it serves them on in turn.
//!
//! Owns: turning parameters into a snapshot and back, the publishing thread, and the
//! model's [`WeightsStatus`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use crate::base::lock;
use crate::collective::broadcast::{Held, Manifest, VersionStore};
use crate::swarm::{SwarmHandle, WeightsStatus};

/// How this server takes part (each a flag of `--role server`).
#[derive(Debug, Clone)]
pub struct BroadcastSettings {
    /// Bytes per chunk of the versions this server publishes.
    pub chunk_bytes: u32,
    /// Versions held per model (2: a follower one version behind gets deltas).
    pub keep: usize,
    /// Tests only: serve every chunk with one byte changed.
    pub tamper: bool,
}

impl Default for BroadcastSettings {
    fn default() -> Self {
        BroadcastSettings {
            chunk_bytes: crate::collective::broadcast::CHUNK_BYTES,
            keep: 2,
            tamper: false,
        }
    }
}

/// A snapshot's layout: per tensor its name, dtype, shape and bytes.
pub type Layout = Vec<(String, String, Vec<i64>, u64)>;

/// `params` in `kind`, back to back (in [`crate::model::llama::Llama::parameters`]
/// order), with their layout.
pub fn snapshot(params: &[Tensor], kind: Kind) -> Result<(Layout, Vec<u8>), tch::TchError> {
    let total: usize = params
        .iter()
        .map(|p| p.numel() * kind.elt_size_in_bytes())
        .sum();
    let (mut layout, mut bytes) = (Vec::with_capacity(params.len()), vec![0u8; total]);
    let mut at = 0usize;
    tch::no_grad(|| -> Result<(), tch::TchError> {
        for (i, p) in params.iter().enumerate() {
            let t = p
                .detach()
                .f_to_kind(kind)?
                .f_to_device(tch::Device::Cpu)?
                .f_contiguous()?;
            let n = t.numel() * kind.elt_size_in_bytes();
            t.f_copy_data_u8(&mut bytes[at..at + n], t.numel())?;
            layout.push((format!("p{i}"), format!("{kind:?}"), t.size(), n as u64));
            at += n;
        }
        Ok(())
    })?;
    Ok((layout, bytes))
}

/// The dtype a manifest's tensors name (what [`snapshot`] wrote).
pub fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "Float" => Kind::Float,
        "BFloat16" => Kind::BFloat16,
        "Half" => Kind::Half,
        _ => return None,
    })
}

/// A snapshot's tensors again (on the CPU; the engine copies them to its device).
pub fn tensors_of(m: &Manifest, bytes: &[u8]) -> Result<Vec<Tensor>, String> {
    m.tensors
        .iter()
        .map(|t| {
            let kind = kind_of(&t.dtype)
                .ok_or_else(|| format!("tensor {} has dtype {:?}", t.name, t.dtype))?;
            let r = t.offset as usize..(t.offset + t.len) as usize;
            let want = t
                .shape
                .iter()
                .try_fold(kind.elt_size_in_bytes() as u64, |n, &d| {
                    u64::try_from(d).ok().and_then(|d| n.checked_mul(d))
                });
            if want != Some(t.len) {
                return Err(format!(
                    "tensor {} of shape {:?} is said to have {} bytes",
                    t.name, t.shape, t.len
                ));
            }
            Tensor::f_from_data_size(&bytes[r], &t.shape, kind).map_err(|e| e.to_string())
        })
        .collect()
}

/// The first 8 bytes of a hash, hex (as the group gossips parameter hashes).
pub fn hex8(h: &[u8]) -> String {
    h.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// A snapshot to publish: its layout and bytes, version and parameter hash (hex).
type Publication = (Layout, Vec<u8>, u64, String);

/// One served model's broadcast state.
pub struct Broadcast {
    swarm: SwarmHandle,
    pub store: Arc<VersionStore>,
    pub model: String,
    /// The training group whose versions these are.
    pub group: String,
    /// The snapshot's dtype (the serving dtype; float32 for an adapter).
    pub kind: Kind,
    pub settings: BroadcastSettings,
    pub follower: bool,
    /// Chunk bytes fetched from other peers.
    pub fetched: AtomicU64,
    /// What the model's status says of it (gossiped).
    pub status: Mutex<Option<WeightsStatus>>,
    publisher: Mutex<Option<SyncSender<Publication>>>,
}

impl Broadcast {
    pub fn new(
        swarm: SwarmHandle,
        store: Arc<VersionStore>,
        model: &str,
        group: &str,
        kind: Kind,
        settings: BroadcastSettings,
        follower: bool,
    ) -> Arc<Broadcast> {
        // A follower says so from its start (it holds no version yet): the others count
        // it in when they share a version's chunks out.
        let status = follower.then(|| WeightsStatus {
            group: group.to_string(),
            follower: true,
            ..Default::default()
        });
        Arc::new(Broadcast {
            swarm,
            store,
            model: model.to_string(),
            group: group.to_string(),
            kind,
            settings,
            follower,
            fetched: AtomicU64::new(0),
            status: Mutex::new(status),
            publisher: Mutex::new(None),
        })
    }

    /// Publishes `params` as `version` (the group's parameters hash to `hash`): the
    /// snapshot is taken now, hashed and held by the publishing thread (the trainer goes
    /// on). A version still waiting to be hashed is replaced by a newer one.
    pub fn publish(self: &Arc<Self>, params: &[Tensor], version: u64, hash: &[u8; 32]) {
        let (layout, bytes) = match snapshot(params, self.kind) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(model = self.model, "weights not published: {e}");
                return;
            }
        };
        let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
        let mut p = lock(&self.publisher);
        if p.is_none() {
            // Room for one waiting snapshot: memory stays bounded (a trainer faster than
            // the hashing waits for it).
            let (tx, rx) = sync_channel::<Publication>(1);
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("publish-{}", self.model))
                .spawn(move || {
                    while let Ok(mut job) = rx.recv() {
                        while let Ok(newer) = rx.try_recv() {
                            job = newer;
                        }
                        let (layout, bytes, version, hash) = job;
                        me.hold(&layout, bytes, version, &hash);
                    }
                });
            match spawned {
                Ok(_) => *p = Some(tx),
                Err(e) => {
                    tracing::warn!("the publishing thread did not start: {e}");
                    return;
                }
            }
        }
        if let Some(tx) = p.as_ref() {
            let _ = tx.send((layout, bytes, version, hex));
        }
    }

    /// Holds a snapshot as `version` and gossips it.
    fn hold(&self, layout: &Layout, bytes: Vec<u8>, version: u64, hash: &str) {
        let m = match Manifest::build_chunked(
            &self.model,
            version,
            hash,
            layout,
            &bytes,
            self.settings.chunk_bytes,
        ) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(model = self.model, "weights not published: {e}");
                return;
            }
        };
        let held = Held::new(m, bytes);
        self.install(&held, &hash[..hash.len().min(16)], 0);
        // The deltas every up-to-date follower will ask for, encoded now (in parallel).
        let t0 = std::time::Instant::now();
        let frames = self.store.prepare_deltas(&self.model, version);
        tracing::info!(
            model = self.model,
            version,
            frames,
            seconds = t0.elapsed().as_secs_f64(),
            "encoded the version's deltas"
        );
        tracing::info!(
            model = self.model,
            version,
            chunks = held.manifest.chunks.len(),
            "published policy version"
        );
    }

    /// Holds `held` (serves its chunks) and says so in the status: it serves parameters
    /// hashing to `param_hash` (hex8), `lag` versions behind its group.
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
        // Said at once: the followers wait for it.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_gives_back_its_tensors_and_hashes_as_the_group_does() {
        let params = vec![
            Tensor::from_slice(&[1.0f32, -2.5, 3.25]).reshape([3, 1]),
            Tensor::from_slice(&[0.5f32, 7.0]),
        ];
        let (layout, bytes) = snapshot(&params, Kind::Float).unwrap();
        let m = Manifest::build_chunked("m", 1, "h", &layout, &bytes, 8).unwrap();
        let back = tensors_of(&m, &bytes).unwrap();
        for (a, b) in params.iter().zip(&back) {
            assert_eq!(a.size(), b.size());
            assert!(a.equal(b));
        }
        // A float32 snapshot's blake3 is the group's parameter hash.
        let group = super::super::group_state::hash_of(&params);
        assert_eq!(blake3::hash(&bytes).as_bytes(), &group);
        let (_, half) = snapshot(&params, Kind::BFloat16).unwrap();
        assert_eq!(half.len(), 10);
    }
}
