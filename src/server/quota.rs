//! How many bytes of episodes each submitting peer id has stored on this server (its
//! quota), against one peer filling the disk (new peer ids cost nothing: this bounds a
//! peer, not the disk).
//!
//! Owns: [`Quota`]. A restarted server counts again what each peer stored before (stored
//! episodes name their submitter; files of earlier layouts count for nobody). An
//! episode that is not written after all (a failed write) is given back.

use std::collections::HashMap;

use crate::swarm::PeerId;

/// Bytes of episodes each submitting peer stored on this server, against a limit.
pub struct Quota {
    limit: u64,
    used: HashMap<PeerId, u64>,
}

impl Quota {
    pub fn new(limit: u64) -> Quota {
        Quota {
            limit,
            used: HashMap::new(),
        }
    }

    /// Takes `bytes` from `peer`'s quota, or says how much it has left.
    pub fn take(&mut self, peer: PeerId, bytes: u64) -> Result<(), String> {
        let used = self.used.entry(peer).or_default();
        if used.saturating_add(bytes) > self.limit {
            return Err(format!(
                "{peer} has stored {} of its {} bytes of episodes on this server; this one takes {bytes}",
                used, self.limit
            ));
        }
        *used += bytes;
        Ok(())
    }

    /// Gives back bytes taken for an episode that was not stored after all.
    pub fn give_back(&mut self, peer: PeerId, bytes: u64) {
        if let Some(used) = self.used.get_mut(&peer) {
            *used = used.saturating_sub(bytes);
        }
    }

    /// Counts bytes `peer` stored before (at start, from the stored episodes).
    pub fn add_stored(&mut self, peer: PeerId, bytes: u64) {
        let used = self.used.entry(peer).or_default();
        *used = used.saturating_add(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_past_its_quota_is_refused_and_others_are_not() {
        let mut q = Quota::new(100);
        let p = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        let o = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        q.take(p, 60).unwrap();
        assert!(q.take(p, 41).unwrap_err().contains("60 of its 100"));
        q.take(p, 40).unwrap();
        q.take(o, 100).unwrap();
        // What a peer stored before a restart counts.
        let mut q = Quota::new(100);
        q.add_stored(p, 90);
        assert!(q.take(p, 11).unwrap_err().contains("90 of its 100"));
        q.take(p, 10).unwrap();
        // A failed write gives its bytes back.
        q.give_back(p, 30);
        q.take(p, 30).unwrap();
        assert!(q.take(p, 1).is_err());
    }
}
