//! The server's ledger of the signed calls it has stored, by nonce, against one signed
//! call counted in more than one episode (a replay). Every signature carries its own
//! nonce (`swarm::sign`), so two equal calls are told apart and only the same signature
//! submitted twice is refused. Rebuilt at start from the stored episodes, which keep
//! their calls' nonces (`stored.rs`); it holds one entry per stored call.
//!
//! Owns: [`CallLedger`]. Never verifies signatures (submission did, before it asks).

use std::collections::HashMap;
use std::sync::Arc;

use crate::swarm::sign::Nonce;

/// The episode each stored (or being stored) signed call belongs to, by nonce.
#[derive(Default)]
pub struct CallLedger {
    used: HashMap<Nonce, Arc<str>>,
}

/// What a claim found.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// These nonces were not in the ledger and now are (give them back with
    /// [`CallLedger::release`] if the episode is not stored after all).
    New(Vec<Nonce>),
    /// Every call is already stored in this very episode: a resubmission (an
    /// acknowledgement that was lost), to acknowledge without storing or training again.
    Again,
}

impl CallLedger {
    /// Records the calls of an episode already on disk.
    pub fn add_stored(&mut self, episode: &str, nonces: &[Nonce]) {
        let id: Arc<str> = episode.into();
        for n in nonces {
            self.used.insert(*n, id.clone());
        }
    }

    /// How many signed calls the ledger holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.used.len()
    }

    /// Claims `calls` (call index, nonce) for `episode`, or says which call was already
    /// submitted, and in which episode. Nothing changes on an error.
    pub fn claim(&mut self, episode: &str, calls: &[(u32, Nonce)]) -> Result<Claim, String> {
        let mut seen: HashMap<Nonce, u32> = HashMap::with_capacity(calls.len());
        for (c, n) in calls {
            if let Some(first) = seen.insert(*n, *c) {
                return Err(format!(
                    "call {c} carries the signature of call {first} (one signed call counts once)"
                ));
            }
            if let Some(other) = self.used.get(n).filter(|o| &***o != episode) {
                return Err(format!(
                    "call {c} was already submitted in episode {other:?} (a signed call counts \
                     in one episode; make the call again for another)"
                ));
            }
        }
        if !calls.is_empty() && calls.iter().all(|(_, n)| self.used.contains_key(n)) {
            return Ok(Claim::Again);
        }
        let id: Arc<str> = episode.into();
        let mut new = Vec::new();
        for (_, n) in calls {
            if !self.used.contains_key(n) {
                self.used.insert(*n, id.clone());
                new.push(*n);
            }
        }
        Ok(Claim::New(new))
    }

    /// Gives back what a [`Claim::New`] took (the episode was not stored).
    pub fn release(&mut self, nonces: &[Nonce]) {
        for n in nonces {
            self.used.remove(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_counts_in_one_episode_and_a_resubmission_is_recognised() {
        let mut l = CallLedger::default();
        l.add_stored("ep-1", &[[1; 16], [2; 16]]);
        // The same signature in another episode: refused, naming the first.
        let e = l.claim("ep-2", &[(0, [3; 16]), (1, [1; 16])]).unwrap_err();
        assert!(
            e.contains("call 1 was already submitted in episode \"ep-1\""),
            "{e}"
        );
        assert_eq!(l.len(), 2, "a refused claim takes nothing");
        // The same episode again, whole: a resubmission.
        assert_eq!(
            l.claim("ep-1", &[(0, [1; 16]), (1, [2; 16])]),
            Ok(Claim::Again)
        );
        // New calls: claimed, and released when the store fails.
        assert_eq!(
            l.claim("ep-2", &[(0, [3; 16]), (1, [4; 16])]),
            Ok(Claim::New(vec![[3; 16], [4; 16]]))
        );
        let e = l.claim("ep-3", &[(0, [4; 16])]).unwrap_err();
        assert!(e.contains("episode \"ep-2\""), "{e}");
        l.release(&[[3; 16], [4; 16]]);
        assert_eq!(
            l.claim("ep-3", &[(0, [4; 16])]),
            Ok(Claim::New(vec![[4; 16]]))
        );
        // One signature twice in one episode.
        let e = l.claim("ep-4", &[(0, [5; 16]), (1, [5; 16])]).unwrap_err();
        assert!(e.contains("call 1 carries the signature of call 0"), "{e}");
        // An episode without signed calls (aborted) claims nothing.
        assert_eq!(l.claim("ep-5", &[]), Ok(Claim::New(vec![])));
        assert_eq!(l.len(), 3);
    }
}
