//! How many bytes of episodes each submitting peer id has stored on this server (its
//! quota), against one peer filling the disk (new peer ids cost nothing: this bounds a
//! peer, not the disk).
//!
//! Owns: [`Quota`]. It lives in memory for the server's lifetime: a restarted server
//! counts each peer's bytes from the restart.
//!
//! Not done here: binding a signed call to its episode. Two episodes may legitimately
//! hold the same call (same prompt, tokens, logprobs and version: greedy sampling, or a
//! short likely answer), so a call's digest cannot tell a replay from a coincidence; the
//! server would have to sign a per-call nonce.

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
    }
}
