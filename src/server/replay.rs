//! What a server remembers about the episodes it stored, against abuse by submitters:
//! which episode each signed call went into (a call replayed into another episode is
//! refused), and how many bytes each submitting peer has stored (its quota).
//!
//! Owns: [`CallLedger`] and [`Quota`]. Both live in memory for the server's lifetime (a
//! restarted server starts them empty: a call stored before the restart can be replayed
//! once after it, and a peer's quota counts from the restart); the ledger keeps the
//! latest [`CallLedger::CAPACITY`] calls.

use std::collections::{HashMap, VecDeque};

use crate::swarm::PeerId;

/// Signed calls' digests, and the episode each was stored in.
#[derive(Default)]
pub struct CallLedger {
    owner: HashMap<[u8; 32], String>,
    order: VecDeque<[u8; 32]>,
}

impl CallLedger {
    /// Calls remembered at most (oldest forgotten first): 32 + ~40 bytes each.
    pub const CAPACITY: usize = 1 << 20;

    /// The first of `digests` already stored in an episode other than `episode`, and that
    /// episode's id. A resubmitted episode (same id) may carry its own calls again.
    pub fn replayed<'a>(&'a self, episode: &str, digests: &[[u8; 32]]) -> Option<(usize, &'a str)> {
        digests.iter().enumerate().find_map(|(i, d)| {
            self.owner
                .get(d)
                .filter(|e| e.as_str() != episode)
                .map(|e| (i, e.as_str()))
        })
    }

    /// Records the calls of a stored episode.
    pub fn record(&mut self, episode: &str, digests: &[[u8; 32]]) {
        for d in digests {
            if self.owner.insert(*d, episode.to_string()).is_none() {
                self.order.push_back(*d);
            }
        }
        while self.order.len() > Self::CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.owner.remove(&old);
            }
        }
    }
}

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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_stored_in_one_episode_is_refused_in_another_but_not_on_resubmission() {
        let mut l = CallLedger::default();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert_eq!(l.replayed("ep-1", &[a, b]), None);
        l.record("ep-1", &[a, b]);
        assert_eq!(l.replayed("ep-1", &[a, b]), None);
        assert_eq!(l.replayed("ep-2", &[[3; 32], b]), Some((1, "ep-1")));
    }

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
    }
}
