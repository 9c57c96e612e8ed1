//! The group's state for a joiner: offered by the Ready members, fetched in
//! blake3-checked chunks spread over all of them.

use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::proto::{ask, Action, Reply, Request, Snapshot, Start, StateManifest, STATE_CHUNK};
use super::{peer_of, GroupError, GroupNode};
use crate::base::lock;
use crate::swarm::PeerId;

impl GroupNode {
    /// Offers `bytes` (this member's state at `steps`, parameters `hash`) to joiners
    /// until the next ring is built.
    pub fn offer_state(&self, bytes: Vec<u8>, steps: u64, hash: [u8; 32]) {
        let chunks = bytes
            .chunks(STATE_CHUNK)
            .map(|c| *blake3::hash(c).as_bytes())
            .collect();
        let manifest = StateManifest {
            len: bytes.len() as u64,
            chunk: STATE_CHUNK as u64,
            chunks,
            steps,
            hash,
        };
        lock(&self.shared.inner).snapshot = Some(Arc::new(Snapshot { manifest, bytes }));
    }

    /// Fetches the group's state for `start` from its Ready members, chunks spread over
    /// all of them (a chunk that fails or does not match its blake3 is asked of the next
    /// member). A manifest is used only if it is well-formed and announces at most
    /// `max_len` bytes (nothing is allocated from a peer's word before that). The caller
    /// checks the step and parameter hash of what it installs against `start`'s.
    pub fn fetch_state(&self, start: &Start, max_len: u64) -> Result<Vec<u8>, GroupError> {
        // This member's state is about to change: a prepare that comes meanwhile waits
        // for the state it will have (its next `agree`), not the one it leaves (a
        // promise made on that one would be followed by a start it no longer fits). A
        // prepare answered before this (with the state it still holds) ends the fetch.
        {
            let mut g = lock(&self.shared.inner);
            if g.promised != start.ballot {
                return Err(GroupError::Refused(
                    "a newer ballot was promised before fetching the state".into(),
                ));
            }
            g.state = None;
        }
        self.shared.changed.notify_all();
        let sources: Vec<PeerId> = start
            .members
            .iter()
            .zip(&start.actions)
            .filter(|(_, a)| **a == Action::Ready)
            .filter_map(|(p, _)| peer_of(p).ok())
            // State only from members this one may train with (see `swarm::trust`).
            .filter(|p| {
                let ok = self
                    .swarm
                    .may_train_with_peer(p, &self.cfg.model, &self.cfg.name);
                if !ok {
                    warn!(group = self.cfg.name, peer = %p, "not fetching the state from a member not trusted to train in this group");
                }
                ok
            })
            .collect();
        if sources.is_empty() {
            return Err(GroupError::Refused(
                "no member to fetch the state from".into(),
            ));
        }
        let ctl = self.control_timeout();
        let group = self.cfg.name.clone();
        self.rt.block_on(async {
            // The members offer their state once their Start arrives: ask until one has.
            let mut manifest = None;
            let deadline = tokio::time::Instant::now() + ctl;
            while manifest.is_none() && tokio::time::Instant::now() < deadline {
                if lock(&self.shared.inner).promised != start.ballot {
                    return Err(GroupError::Refused(
                        "a newer ballot was promised while fetching the state".into(),
                    ));
                }
                for p in &sources {
                    let req = Request::Manifest {
                        group: group.clone(),
                    };
                    match ask(&self.swarm, *p, &req, ctl).await {
                        Ok(Reply::Manifest(m))
                            if m.steps == start.steps && m.hash == start.hash =>
                        {
                            match manifest_fault(&m, max_len) {
                                None => {
                                    manifest = Some(m);
                                    break;
                                }
                                Some(why) => warn!(group, peer = %p, "a bad state manifest: {why}"),
                            }
                        }
                        Ok(other) => debug!(group, peer = %p, "no usable manifest yet: {other:?}"),
                        Err(e) => warn!(group, peer = %p, "no manifest: {e}"),
                    }
                }
                if manifest.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            let m = manifest.ok_or_else(|| {
                GroupError::Refused("no member offered the group's state".into())
            })?;
            let fetch = |i: usize| {
                let (group, sources, m) = (group.clone(), &sources, &m);
                async move {
                    let want = m.chunks[i];
                    for k in 0..sources.len() {
                        let p = sources[(i + k) % sources.len()];
                        let req = Request::Chunk {
                            group: group.clone(),
                            index: i as u32,
                        };
                        match ask(&self.swarm, p, &req, ctl).await {
                            Ok(Reply::Chunk(b)) if *blake3::hash(&b).as_bytes() == want => {
                                return Ok((i, b))
                            }
                            Ok(Reply::Chunk(_)) => {
                                warn!(group, peer = %p, chunk = i, "a chunk that does not match its hash")
                            }
                            Ok(other) => warn!(group, peer = %p, chunk = i, "{other:?}"),
                            Err(e) => warn!(group, peer = %p, chunk = i, "{e}"),
                        }
                    }
                    Err(GroupError::Refused(format!("no member gave chunk {i} of the state")))
                }
            };
            use futures::StreamExt;
            let mut bytes = vec![0u8; m.len as usize];
            let mut got = futures::stream::iter(0..m.chunks.len())
                .map(fetch)
                .buffer_unordered(4);
            while let Some(r) = got.next().await {
                let (i, b) = r?;
                let at = i * m.chunk as usize;
                if at + b.len() > bytes.len() {
                    return Err(GroupError::Refused(format!("chunk {i} overruns the state")));
                }
                bytes[at..at + b.len()].copy_from_slice(&b);
            }
            Ok(bytes)
        })
    }
}

/// Why a peer's state manifest cannot be used (None: it can): its chunking must be ours,
/// its chunk list must cover exactly its length, and the length must be at most `max_len`.
fn manifest_fault(m: &StateManifest, max_len: u64) -> Option<String> {
    if m.len > max_len {
        return Some(format!(
            "{} bytes announced, at most {max_len} expected",
            m.len
        ));
    }
    if m.chunk != STATE_CHUNK as u64 {
        return Some(format!("chunks of {} bytes, not {STATE_CHUNK}", m.chunk));
    }
    let want = m.len.div_ceil(m.chunk).max(1);
    if m.chunks.len() as u64 != want {
        return Some(format!(
            "{} chunk hashes for {} bytes ({want} chunks)",
            m.chunks.len(),
            m.len
        ));
    }
    None
}
