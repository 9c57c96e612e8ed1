//! A follower's long polls for its group's next version: one [`Request::Next`] kept
//! waiting at each member of the group ([`PeerSource::next_manifest`]; two for a moment
//! while one is renewed), so a new version's
//! manifest reaches the follower one way after the member holds it. Without them a
//! follower hears of the version by gossip, then asks the manifest (a round trip), by
//! which time the member's upload already queues the first followers' chunks: in
//! netsim's scenario 6 (100 followers, 50-150 ms links) the fetches started 0.41-0.46 s
//! after the trainer held a version at the median and up to 0.97 s at p99.
//!
//! A manifest that came so is the member's own word (its stream is authenticated as
//! that peer, polled because the view showed it a member of the group), as good as a
//! manifest checked against the id it gossiped.
//!
//! Owns: the polls' tasks and the newest manifest they brought.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::manifest::Manifest;
use super::store::VersionStore;
use super::wire::PeerSource;
#[cfg(doc)]
use super::wire::Request;
use crate::base::lock;
use crate::swarm::PeerId;

/// How long before a poll's wait at the member ends the next poll is sent: more than a
/// one-way trip (and a stream's opening, when the first poll holds the pooled one), so it
/// is there before the first one's wait ends. A version held in that second is sent to
/// both (one manifest more for that follower).
const OVERLAP: Duration = Duration::from_secs(1);

/// A manifest a member sent, with its id.
pub struct Offered {
    pub from: PeerId,
    pub manifest: Manifest,
    pub id: [u8; 32],
}

/// The polls of one follower and the newest manifest they brought.
#[derive(Default)]
pub struct NextPolls {
    newest: Mutex<Option<Offered>>,
    came: tokio::sync::Notify,
    polls: Mutex<HashMap<PeerId, tokio::task::AbortHandle>>,
}

impl NextPolls {
    /// Keeps a poll open at each of `members` (through `source`), and none at peers no
    /// longer among them. `store` holds the follower's versions of `model`: each poll
    /// asks for a version past the newest held and past the last it brought.
    pub fn keep_open(
        self: &Arc<Self>,
        members: &[PeerId],
        source: impl Fn(PeerId) -> Arc<PeerSource>,
        store: &Arc<VersionStore>,
        model: &str,
    ) {
        let mut polls = lock(&self.polls);
        polls.retain(|p, task| {
            let keep = members.contains(p) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for &p in members {
            if polls.contains_key(&p) {
                continue;
            }
            let (src, store, model, me) =
                (source(p), store.clone(), model.to_string(), self.clone());
            let task = tokio::spawn(async move { me.poll(src, store, model).await });
            polls.insert(p, task.abort_handle());
        }
    }

    /// One member's polls. A poll is renewed [`OVERLAP`] before the member's wait for it
    /// ends, so one is always waiting there: a version held just as a poll's wait ended
    /// was answered only to the poll asked after the "not yet", whose answer then queued
    /// behind the first followers' chunks on the member's upload (in netsim's scenario 6
    /// the polls of a hundred followers began together, and ended together with version
    /// 1: its fetches started up to 1.1 s late, against 0.6 s for version 2).
    async fn poll(&self, src: Arc<PeerSource>, store: Arc<VersionStore>, model: String) {
        use futures::stream::{FuturesUnordered, StreamExt};
        let mut last: Option<u64> = None;
        let mut pause = Duration::from_secs(1);
        let ask = |after: Option<u64>| {
            let src = src.clone();
            async move { (Instant::now(), src.next_manifest(after).await) }
        };
        let after = |last: Option<u64>| store.latest(&model).map(|h| h.version()).max(last);
        let mut polls = FuturesUnordered::new();
        let mut newest = Instant::now();
        loop {
            if polls.is_empty() {
                polls.push(ask(after(last)));
                newest = Instant::now();
            }
            let renew = newest + (super::wire::NEXT_WAIT.saturating_sub(OVERLAP));
            let (asked, answer) = tokio::select! {
                Some(done) = polls.next() => done,
                _ = tokio::time::sleep_until(renew.into()), if polls.len() == 1 => {
                    polls.push(ask(after(last)));
                    newest = Instant::now();
                    continue;
                }
            };
            match answer {
                Ok(Some((manifest, id))) => {
                    last = last.max(Some(manifest.version));
                    pause = Duration::from_secs(1);
                    self.offer(Offered {
                        from: src.peer,
                        manifest,
                        id,
                    });
                }
                // The other poll waits on.
                _ if !polls.is_empty() => continue,
                Ok(None) => {
                    pause = Duration::from_secs(1);
                    // "Not yet" long before the holder's wait ended: not a long poll
                    // there; asked again a second later, not at once.
                    if asked.elapsed() < super::wire::NEXT_WAIT / 2 {
                        tokio::time::sleep(pause).await;
                    }
                }
                // Gone, or a peer without long polls (an older version closes the
                // stream): the gossip and the view still bring its versions; asked
                // again later, up to every 5 minutes.
                Err(e) => {
                    tracing::debug!(peer = %src.peer, "long poll for the next version: {e}");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(300));
                }
            }
        }
    }

    fn offer(&self, o: Offered) {
        let mut newest = lock(&self.newest);
        if newest
            .as_ref()
            .is_none_or(|n| n.manifest.version < o.manifest.version)
        {
            *newest = Some(o);
            self.came.notify_one();
        }
    }

    /// The newest manifest brought and not taken yet.
    pub fn take(&self) -> Option<Offered> {
        lock(&self.newest).take()
    }

    /// [`Self::take`] if it is the manifest of id `id` (another stays for the loop).
    pub fn take_id(&self, id: &[u8; 32]) -> Option<Offered> {
        let mut newest = lock(&self.newest);
        match newest.as_ref().is_some_and(|o| o.id == *id) {
            true => newest.take(),
            false => None,
        }
    }

    /// Whether a manifest was brought and not taken yet.
    pub fn pending(&self) -> bool {
        lock(&self.newest).is_some()
    }

    /// Resolves when a poll brings a manifest (at once if one came since the last wait).
    pub async fn came(&self) {
        self.came.notified().await
    }

    /// Ends every poll.
    pub fn close(&self) {
        lock(&self.polls).drain().for_each(|(_, t)| t.abort());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offered(version: u64, id: u8) -> Offered {
        let layout = vec![("w".to_string(), "Float".to_string(), vec![4], 16)];
        Offered {
            from: PeerId::random(),
            manifest: Manifest::build_chunked("m", version, "h", &layout, &[0; 16], 16).unwrap(),
            id: [id; 32],
        }
    }

    #[tokio::test]
    async fn the_newest_manifest_brought_is_kept_and_taken_by_its_id() {
        let polls = NextPolls::default();
        assert!(!polls.pending());
        polls.offer(offered(2, 2));
        // An older one than the one kept is dropped.
        polls.offer(offered(1, 1));
        assert!(polls.pending());
        // The loop was told (a permit waits for it).
        tokio::time::timeout(Duration::from_secs(30), polls.came())
            .await
            .expect("told of the manifest");
        assert!(polls.take_id(&[1; 32]).is_none());
        assert!(polls.pending(), "another id leaves it for the loop");
        assert_eq!(polls.take_id(&[2; 32]).unwrap().manifest.version, 2);
        assert!(polls.take().is_none());
        polls.offer(offered(3, 3));
        assert_eq!(polls.take().unwrap().manifest.version, 3);
    }
}
