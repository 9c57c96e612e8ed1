//! A served model's part in the weight broadcast (`collective::broadcast`): a trainer
//! publishes each policy version it serves (its snapshot in the serving dtype goes into
//! the server's [`VersionStore`], which serves its manifest and chunks, and the version is
//! gossiped); a follower (`--follow`, [`super::follow`]) installs the versions it fetches
//! the same way, so it serves them on in turn.
//!
//! Owns: turning parameters into a snapshot and back, and the publishing thread (the
//! held versions and their gossiped status are the model's [`Holder`]).

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use crate::base::lock;
use crate::collective::broadcast::{Holder, Manifest, VersionStore};
use crate::swarm::SwarmHandle;

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

/// A snapshot to publish: its layout and bytes, version and parameter hash (hex).
type Publication = (Layout, Vec<u8>, u64, String);

/// One served model's broadcast state: its [`Holder`] (held versions, status), and how
/// it publishes a version from the model's tensors.
pub struct Broadcast {
    pub holder: Arc<Holder>,
    /// The snapshot's dtype (the serving dtype; float32 for an adapter).
    pub kind: Kind,
    pub settings: BroadcastSettings,
    publisher: Mutex<Option<SyncSender<Publication>>>,
}

impl std::ops::Deref for Broadcast {
    type Target = Holder;
    fn deref(&self) -> &Holder {
        &self.holder
    }
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
        let holder = Holder::new(swarm, store, model, group, settings.chunk_bytes, follower);
        Arc::new(Broadcast {
            holder: Arc::new(holder),
            kind,
            settings,
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
            let holder = self.holder.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("publish-{}", self.model))
                .spawn(move || {
                    while let Ok(mut job) = rx.recv() {
                        while let Ok(newer) = rx.try_recv() {
                            job = newer;
                        }
                        let (layout, bytes, version, hash) = job;
                        if let Err(e) = holder.hold(&layout, bytes, version, &hash) {
                            tracing::warn!(model = holder.model, "weights not published: {e}");
                        }
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
