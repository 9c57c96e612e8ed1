//! Which connections carry our streams, and which ones the node closes when it holds too
//! many (the connection trimmer, as go-libp2p's connection manager and its low/high water
//! marks).
//!
//! Why a trimmer: gossipsub keeps a long-lived substream open to every peer that speaks it,
//! and libp2p keeps a connection alive while any substream is open, whatever the idle
//! timeout (rust-libp2p issue #5190), so without one a peer stays connected to every peer it
//! ever met in a Kademlia walk: all-to-all in a swarm of hundreds.
//!
//! The rule: when more than `max_connections` peers are connected, close the connections
//! of the least recently used peers until `min_connections` are left, never those of a peer
//! that is in the gossip mesh, has one of our streams open (either way), is being dialed on
//! request, or was connected or used within the grace period. A trimmed peer stays in the
//! routing table; the next stream to it dials again.
//!
//! Owns: the per-peer stream counts and last use, the [`PeerStream`] wrapper that holds an
//! outbound stream's count, and the choice of whom to trim. The event loop closes them.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{AsyncRead, AsyncWrite};
use libp2p::{PeerId, Stream};

use crate::base::lock;

/// Streams open with a peer (ours and theirs) and when one last opened or closed.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerUse {
    pub(super) open: usize,
    pub(super) last: Instant,
}

/// Per-peer stream use, shared by the event loop, the accept loops and every open stream.
#[derive(Default)]
pub(super) struct UseTable {
    peers: Mutex<HashMap<PeerId, PeerUse>>,
}

/// Above this many peers the table drops idle entries older than [`IDLE_KEEP`]: a peer
/// dialed for a stream that never connected (a dead server) gets no disconnect event to
/// forget it by.
const PRUNE_AT: usize = 1024;
/// How long an idle entry is kept once the table is over [`PRUNE_AT`] (far beyond any
/// trimmer grace, so the trimmer's choice is the same without it).
const IDLE_KEEP: Duration = Duration::from_secs(600);

impl UseTable {
    /// Counts a stream with `peer` as open until the guard drops.
    pub(super) fn open(self: &Arc<Self>, peer: PeerId) -> UseGuard {
        let now = Instant::now();
        let mut t = lock(&self.peers);
        if t.len() >= PRUNE_AT {
            prune(&mut t, now);
        }
        let u = t.entry(peer).or_insert(PeerUse { open: 0, last: now });
        u.open += 1;
        u.last = now;
        UseGuard {
            table: self.clone(),
            peer,
        }
    }

    pub(super) fn get(&self, peer: &PeerId) -> Option<PeerUse> {
        lock(&self.peers).get(peer).copied()
    }

    /// Forgets a peer that has nothing open (its last connection closed).
    pub(super) fn forget_idle(&self, peer: &PeerId) {
        let mut t = lock(&self.peers);
        if t.get(peer).is_some_and(|u| u.open == 0) {
            t.remove(peer);
        }
    }
}

/// Drops the entries with nothing open that were last used [`IDLE_KEEP`] before `now`.
fn prune(t: &mut HashMap<PeerId, PeerUse>, now: Instant) {
    t.retain(|_, u| u.open > 0 || now.saturating_duration_since(u.last) < IDLE_KEEP);
}

/// Holds one open stream's count (see [`UseTable::open`]).
pub(super) struct UseGuard {
    table: Arc<UseTable>,
    peer: PeerId,
}

impl Drop for UseGuard {
    fn drop(&mut self) {
        let mut t = lock(&self.table.peers);
        if let Some(u) = t.get_mut(&self.peer) {
            u.open = u.open.saturating_sub(1);
            u.last = Instant::now();
        }
    }
}

/// An outbound stream from [`super::SwarmHandle::open`]: a libp2p [`Stream`] whose
/// connection the trimmer leaves open while it exists.
pub struct PeerStream {
    inner: Stream,
    _use: UseGuard,
}

impl std::fmt::Debug for PeerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerStream")
            .field("peer", &self._use.peer)
            .field("inner", &self.inner)
            .finish()
    }
}

impl PeerStream {
    pub(super) fn new(inner: Stream, guard: UseGuard) -> PeerStream {
        PeerStream { inner, _use: guard }
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }

    fn poll_read_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [io::IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_read_vectored(cx, bufs)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// A connected peer as the trimmer sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub(super) peer: PeerId,
    /// When its current spell of connections began.
    pub(super) since: Instant,
    pub(super) usage: Option<PeerUse>,
    /// In the gossip mesh, being dialed on request, or otherwise not to be closed.
    pub(super) protected: bool,
}

/// The connection marks: trim above `max`, down to `min`, sparing anything newer than
/// `grace`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Marks {
    pub(super) max: usize,
    pub(super) min: usize,
    pub(super) grace: Duration,
}

/// The peers whose connections to close now: none while at most `max` are connected;
/// otherwise the least recently used of those that may be closed, oldest first, until
/// `min` would be left.
pub(super) fn to_trim(connected: &[Candidate], m: Marks, now: Instant) -> Vec<PeerId> {
    if connected.len() <= m.max {
        return Vec::new();
    }
    let recent = |c: &Candidate| {
        let last = c.usage.map_or(c.since, |u| u.last.max(c.since));
        (last, now.saturating_duration_since(last) < m.grace)
    };
    let mut closable: Vec<(Instant, PeerId)> = connected
        .iter()
        .filter(|c| !c.protected && c.usage.is_none_or(|u| u.open == 0))
        .filter_map(|c| match recent(c) {
            (_, true) => None,
            (last, false) => Some((last, c.peer)),
        })
        .collect();
    closable.sort();
    let excess = connected.len() - m.min.min(connected.len());
    closable.into_iter().take(excess).map(|(_, p)| p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marks() -> Marks {
        Marks {
            max: 4,
            min: 2,
            grace: Duration::from_secs(10),
        }
    }

    fn cand(t0: Instant, age_s: u64) -> Candidate {
        Candidate {
            peer: PeerId::random(),
            since: t0 - Duration::from_secs(age_s),
            usage: None,
            protected: false,
        }
    }

    #[test]
    fn idle_entries_of_peers_that_never_disconnect_are_pruned_past_the_size_bound() {
        let table = Arc::new(UseTable::default());
        let (held, recent) = (PeerId::random(), PeerId::random());
        let _g = table.open(held);
        let idle: Vec<PeerId> = (0..PRUNE_AT).map(|_| PeerId::random()).collect();
        for p in &idle {
            drop(table.open(*p));
        }
        let later = Instant::now() + IDLE_KEEP + Duration::from_secs(1);
        let mut t = lock(&table.peers);
        assert_eq!(t.len(), PRUNE_AT + 1, "nothing pruned below the bound");
        t.get_mut(&idle[0]).unwrap().last = later;
        t.insert(
            recent,
            PeerUse {
                open: 0,
                last: later,
            },
        );
        prune(&mut t, later);
        assert_eq!(
            t.len(),
            3,
            "the one held and the two used recently are left"
        );
        assert!(t.contains_key(&held) && t.contains_key(&recent) && t.contains_key(&idle[0]));
    }

    #[test]
    fn nothing_is_trimmed_up_to_the_high_mark_then_down_to_the_low_one_oldest_first() {
        let now = Instant::now() + Duration::from_secs(1000);
        let mut c: Vec<Candidate> = (0..4).map(|i| cand(now, 100 + i)).collect();
        assert!(to_trim(&c, marks(), now).is_empty());
        c.push(cand(now, 50));
        let t = to_trim(&c, marks(), now);
        // 5 connected, down to 2: the three least recently used.
        assert_eq!(t, vec![c[3].peer, c[2].peer, c[1].peer]);
    }

    #[test]
    fn protected_busy_and_recent_peers_are_spared_and_use_counts_as_recent() {
        let now = Instant::now() + Duration::from_secs(1000);
        let table = Arc::new(UseTable::default());
        let mut c: Vec<Candidate> = (0..6).map(|i| cand(now, 100 + i)).collect();
        c[0].protected = true;
        // An open stream, held by its guard.
        let g = table.open(c[1].peer);
        c[1].usage = table.get(&c[1].peer);
        // Connected just now.
        c[2].since = now - Duration::from_secs(2);
        // Connected long ago, but a stream ended 5 s ago: used recently.
        c[3].usage = Some(PeerUse {
            open: 0,
            last: now - Duration::from_secs(5),
        });
        // Used 20 s ago, and the oldest-connected of the rest.
        c[4].usage = Some(PeerUse {
            open: 0,
            last: now - Duration::from_secs(20),
        });
        let t = to_trim(&c, marks(), now);
        // 6 connected, 4 to close, only 2 may be: c[5] (unused, 105 s) before c[4] (20 s).
        assert_eq!(t, vec![c[5].peer, c[4].peer]);
        assert_eq!(table.get(&c[1].peer).unwrap().open, 1);
        drop(g);
        let u = table.get(&c[1].peer).unwrap();
        assert_eq!(u.open, 0, "the guard released the stream");
        table.forget_idle(&c[1].peer);
        assert!(
            table.get(&c[1].peer).is_none(),
            "forgotten once disconnected"
        );
    }
}
