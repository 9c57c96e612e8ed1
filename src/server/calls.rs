//! The server's ledger of the episodes and signed calls it has stored, against one signed
//! call counted twice (a replay) and one episode trained twice. Every generation's
//! signatures carry its own random nonce (`swarm::sign`), so two equal calls are told
//! apart, and only a signature submitted again (or a prefix of the same generation) is
//! refused. An episode id is stored once: the same episode submitted again (its
//! acknowledgement was lost) is recognised by its content digest and acknowledged without
//! being stored or trained again; other content under a stored id is refused. Rebuilt at
//! start from the stored episodes, which keep their calls' nonces (`stored.rs`); it holds
//! one entry per stored call and one per stored episode.
//!
//! Owns: [`CallLedger`] and [`content_digest`]. Never verifies signatures (submission
//! did, before it asks).

use std::collections::HashMap;
use std::sync::Arc;

use crate::swarm::sign::Nonce;
use crate::timeline::fragment::EpisodeManifest;

/// Each stored (or being stored) episode's content digest, and the episode each signed
/// call belongs to, by nonce.
#[derive(Default)]
pub struct CallLedger {
    used: HashMap<Nonce, Arc<str>>,
    episodes: HashMap<Arc<str>, [u8; 32]>,
}

/// What a claim found.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// The episode and its calls are new, and now claimed (give them back with
    /// [`CallLedger::release`] if the episode is not stored after all).
    New,
    /// This very episode, with the same content, is stored (or being stored): a
    /// resubmission, to acknowledge without storing or training again.
    Again,
}

/// What identifies an episode's content: its manifest (fragments, rewards, status) and
/// its calls' nonces.
pub fn content_digest(m: &EpisodeManifest, nonces: &[Nonce]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&postcard::to_allocvec(m).expect("a manifest encodes"));
    for n in nonces {
        h.update(n);
    }
    *h.finalize().as_bytes()
}

impl CallLedger {
    /// Records an episode already on disk.
    pub fn add_stored(&mut self, episode: &str, digest: [u8; 32], nonces: &[Nonce]) {
        let id: Arc<str> = episode.into();
        for n in nonces {
            self.used.insert(*n, id.clone());
        }
        self.episodes.insert(id, digest);
    }

    /// How many signed calls the ledger holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.used.len()
    }

    /// Claims `episode` (content `digest`) and its `calls` (call index, nonce), or says
    /// why not: the id is stored with other content, or a call was already submitted (in
    /// which episode). Nothing changes on an error.
    pub fn claim(
        &mut self,
        episode: &str,
        digest: [u8; 32],
        calls: &[(u32, Nonce)],
    ) -> Result<Claim, String> {
        let mut seen: HashMap<Nonce, u32> = HashMap::with_capacity(calls.len());
        for (c, n) in calls {
            if let Some(first) = seen.insert(*n, *c) {
                return Err(format!(
                    "call {c} carries the signature of call {first}'s generation (one signed \
                     call counts once)"
                ));
            }
        }
        if let Some(d) = self.episodes.get(episode) {
            return if *d == digest {
                Ok(Claim::Again)
            } else {
                Err(format!(
                    "episode {episode:?} is already stored with other content (an episode id \
                     is stored once; new calls go under a new id)"
                ))
            };
        }
        for (c, n) in calls {
            if let Some(other) = self.used.get(n) {
                return Err(format!(
                    "call {c} was already submitted in episode {other:?} (a signed call counts \
                     in one episode; make the call again for another)"
                ));
            }
        }
        let nonces: Vec<Nonce> = calls.iter().map(|(_, n)| *n).collect();
        self.add_stored(episode, digest, &nonces);
        Ok(Claim::New)
    }

    /// Gives back what a [`Claim::New`] took (the episode was not stored).
    pub fn release(&mut self, episode: &str, nonces: &[Nonce]) {
        self.episodes.remove(episode);
        for n in nonces {
            self.used.remove(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_counts_in_one_episode_and_an_episode_is_stored_once() {
        let mut l = CallLedger::default();
        l.add_stored("ep-1", [1; 32], &[[1; 16], [2; 16]]);
        // The same signature in another episode: refused, naming the first.
        let e = l
            .claim("ep-2", [2; 32], &[(0, [3; 16]), (1, [1; 16])])
            .unwrap_err();
        assert!(
            e.contains("call 1 was already submitted in episode \"ep-1\""),
            "{e}"
        );
        assert_eq!(l.len(), 2, "a refused claim takes nothing");
        // The same episode again, same content: a resubmission.
        assert_eq!(
            l.claim("ep-1", [1; 32], &[(0, [1; 16]), (1, [2; 16])]),
            Ok(Claim::Again)
        );
        // The same id with other content (another reward, or a call more): refused.
        let e = l
            .claim("ep-1", [9; 32], &[(0, [1; 16]), (1, [2; 16]), (2, [7; 16])])
            .unwrap_err();
        assert!(e.contains("already stored with other content"), "{e}");
        // New calls: claimed, and released when the store fails.
        assert_eq!(
            l.claim("ep-2", [2; 32], &[(0, [3; 16]), (1, [4; 16])]),
            Ok(Claim::New)
        );
        let e = l.claim("ep-3", [3; 32], &[(0, [4; 16])]).unwrap_err();
        assert!(e.contains("episode \"ep-2\""), "{e}");
        l.release("ep-2", &[[3; 16], [4; 16]]);
        assert_eq!(l.claim("ep-3", [3; 32], &[(0, [4; 16])]), Ok(Claim::New));
        assert_eq!(
            l.claim("ep-2", [2; 32], &[(0, [3; 16])]),
            Ok(Claim::New),
            "a released id is free again"
        );
        // One generation's signature twice in one episode.
        let e = l
            .claim("ep-4", [4; 32], &[(0, [5; 16]), (1, [5; 16])])
            .unwrap_err();
        assert!(e.contains("call 1 carries the signature of call 0"), "{e}");
        // An episode without signed calls (aborted): stored once too.
        assert_eq!(l.claim("ep-5", [5; 32], &[]), Ok(Claim::New));
        assert_eq!(l.claim("ep-5", [5; 32], &[]), Ok(Claim::Again));
        assert_eq!(l.len(), 4);
    }
}
