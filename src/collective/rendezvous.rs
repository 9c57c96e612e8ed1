//! Setting links up through the swarm: `/agentjet/collective/2`, and links that run over
//! the swarm's connection: `/agentjet/link/1`.
//!
//! The dialer sends a [`LinkAsk`] (which group, epoch and rank it is); the acceptor makes
//! an offer on its [`LinkListener`] (port, fresh key, one-use token, and whether it is
//! reachable at its addresses), records it in its [`OfferBook`] under the asker's peer id
//! and the ask, and answers it. Only the peer the swarm authenticated on this stream
//! learns the key; the acceptor then waits for that offer's connection
//! ([`LinkListener::accept`]).
//!
//! The dialer connects to the offer's port where the acceptor said it is reachable; else
//! (or when that fails) it opens a `/agentjet/link/1` stream to the acceptor, over
//! whatever connection the swarm has to it (direct, hole-punched or relayed): the stream's
//! first frame names the group, and the rest of it is the link's bytes, handed to that
//! group's listener as a connection ([`LinkListener::deliver`]).
//!
//! Owns: the ask/offer exchange and the link streams' arrival. Never carries tensor bytes
//! itself (the links do).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

pub use super::link::ip_of;
use super::link::{Conn, LinkListener, LinkOffer};
use crate::base::lock;
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{Multiaddr, PeerId, StreamProtocol, SwarmError, SwarmHandle};

/// `/2`: offers say whether the acceptor is reachable at its addresses.
pub const COLLECTIVE: StreamProtocol = StreamProtocol::new("/agentjet/collective/2");
/// A link over the swarm's connection (see the module docs).
pub const LINK_STREAM: StreamProtocol = StreamProtocol::new("/agentjet/link/1");

/// A request for a link: who asks, for which group and membership epoch.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LinkAsk {
    pub group: String,
    pub epoch: u64,
    pub from_rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkAnswer {
    Offer(LinkOffer),
    Refused(String),
}

/// Why a link could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("{peer} refused the link: {reason}")]
    Refused { peer: PeerId, reason: String },
    #[error("timed out waiting for a link ask from {0}")]
    Timeout(PeerId),
    #[error("{peer} refused the link stream: {reason}")]
    StreamRefused { peer: PeerId, reason: String },
}

/// The offers an acceptor has made, by (asker, ask), until it takes them. Bounded so
/// that no peer can push out another's: at most [`PER_PEER`] untaken offers per asker
/// (its oldest goes first), [`OFFERS`] in all (the oldest goes first), and none older
/// than [`OFFER_TTL`]. (Many peer ids at once can still push out the oldest offers: peer
/// ids are free without a swarm key.)
#[derive(Default)]
pub struct OfferBook {
    offers: Mutex<HashMap<(PeerId, LinkAsk), (Instant, LinkOffer)>>,
    changed: Notify,
}

/// Untaken offers kept per asking peer (an honest member asks one link per epoch).
pub const PER_PEER: usize = 4;
/// Untaken offers kept in all.
pub const OFFERS: usize = 1024;
/// How long an untaken offer is kept (a ring is built within a control timeout).
pub const OFFER_TTL: Duration = Duration::from_secs(120);

impl OfferBook {
    /// Waits (up to `timeout`) for `peer`'s ask `ask`, and takes its offer.
    pub async fn take(
        &self,
        peer: PeerId,
        ask: &LinkAsk,
        timeout: Duration,
    ) -> Result<LinkOffer, RendezvousError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.changed.notified();
            if let Some((_, o)) = lock(&self.offers).remove(&(peer, ask.clone())) {
                return Ok(o);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(RendezvousError::Timeout(peer));
            }
        }
    }

    fn put(&self, peer: PeerId, ask: LinkAsk, offer: LinkOffer) {
        let mut m = lock(&self.offers);
        // Bounded: asks nobody takes (a member that gave up, a peer that floods) do not
        // pile up, and cannot push out other peers' offers.
        m.retain(|_, (at, _)| at.elapsed() < OFFER_TTL);
        let oldest = |m: &HashMap<(PeerId, LinkAsk), (Instant, LinkOffer)>, of: Option<PeerId>| {
            m.iter()
                .filter(|((p, _), _)| of.is_none_or(|of| *p == of))
                .min_by_key(|(_, (at, _))| *at)
                .map(|(k, _)| k.clone())
        };
        if m.keys().filter(|(p, _)| *p == peer).count() >= PER_PEER {
            if let Some(k) = oldest(&m, Some(peer)) {
                tracing::info!(%peer, "too many untaken link asks from one peer: its oldest dropped");
                m.remove(&k);
            }
        }
        if m.len() >= OFFERS {
            if let Some(k) = oldest(&m, None) {
                m.remove(&k);
            }
        }
        m.insert((peer, ask), (Instant::now(), offer));
        drop(m);
        self.changed.notify_waiters();
    }

    /// Untaken offers, in all.
    pub fn len(&self) -> usize {
        lock(&self.offers).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Answers link asks on this node: an offer on `listener` for each, recorded in `book`.
pub fn serve_links(
    swarm: &SwarmHandle,
    listener: Arc<LinkListener>,
    book: Arc<OfferBook>,
) -> Result<(), SwarmError> {
    serve_links_to(swarm, listener, book, Arc::new(|_: &PeerId| true))
}

/// Who may ask for a link (trusting a run: the group's certified members).
pub type LinkAdmit = Arc<dyn Fn(&PeerId) -> bool + Send + Sync>;

/// [`serve_links`] for the peers `admit` lets in only; the others are refused (and
/// logged with their ids) before anything is put in the book.
pub fn serve_links_to(
    swarm: &SwarmHandle,
    listener: Arc<LinkListener>,
    book: Arc<OfferBook>,
    admit: LinkAdmit,
) -> Result<(), SwarmError> {
    serve_group_links(swarm, None, listener, book, admit)
}

/// [`serve_links_to`] for the asks of group `group` only (`None`: every group without an
/// entry of its own).
///
/// A node may be a member of several groups (a server training several adapters): the
/// protocol is registered once per node and each ask goes to its group's listener and
/// book (an ask for a group this node does not serve is refused). Serving a group again
/// replaces its entry.
pub fn serve_group_links(
    swarm: &SwarmHandle,
    group: Option<&str>,
    listener: Arc<LinkListener>,
    book: Arc<OfferBook>,
    admit: LinkAdmit,
) -> Result<(), SwarmError> {
    // Weak: the handler (which ends with its node) holds the table.
    static NODES: Mutex<Vec<(PeerId, std::sync::Weak<GroupLinks>)>> = Mutex::new(Vec::new());
    // Held across the registration, so two groups of one node cannot both find no table.
    let mut nodes = lock(&NODES);
    nodes.retain(|(_, t)| t.strong_count() > 0);
    // A node of this swarm registers the protocol once: the first group registers it with
    // a table of its own; later groups (the registration refused) join that table.
    let entry: GroupEntry = (listener, book, admit);
    let links = Arc::new(GroupLinks::default());
    lock(&links.groups).insert(group.map(str::to_string), entry.clone());
    let table = links.clone();
    // Reachable at its addresses: publicly, or a swarm of one host (read at each ask).
    let sw = swarm.clone();
    let direct = move || sw.reachability().dialable();
    let (streams, keeper) = (links.clone(), swarm.clone());
    let registered = swarm.serve(COLLECTIVE, move |peer, mut s| {
        let links = links.clone();
        let direct = direct.clone();
        async move {
            let ask: LinkAsk = read_frame(&mut s, 4096).await?;
            // A group's asks carry `NAME@EPOCH:PROPOSER` (see `collective::group`).
            let entry = links.entry(&ask.group);
            let Some((listener, book, admit)) = entry else {
                let no = LinkAnswer::Refused(format!("this peer is not in group {:?}", ask.group));
                write_frame(&mut s, &no, 4096).await?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                return Ok(());
            };
            if !admit(&peer) {
                tracing::warn!(%peer, "refused a link ask from a peer not trusted to train in this group");
                let no = LinkAnswer::Refused("not trusted to train in this group".into());
                write_frame(&mut s, &no, 4096).await?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                return Ok(());
            }
            let offer = listener.offer(direct());
            book.put(peer, ask, offer.clone());
            write_frame(&mut s, &LinkAnswer::Offer(offer), 4096).await?;
            let _ = futures::io::AsyncWriteExt::close(&mut s).await;
            Ok::<(), FrameError>(())
        }
    });
    let registered = registered.and_then(|()| {
        swarm.serve(LINK_STREAM, move |peer, s| {
            let links = streams.clone();
            // Held as an open stream while the link lives (the trimmer spares its
            // connection).
            let s = keeper.keep(peer, s);
            async move { take_link_stream(&links, peer, s).await }
        })
    });
    match registered {
        Ok(()) => {
            nodes.retain(|(p, _)| *p != swarm.peer_id);
            nodes.push((swarm.peer_id, Arc::downgrade(&table)));
            Ok(())
        }
        Err(e) => match nodes
            .iter()
            .find(|(p, _)| *p == swarm.peer_id)
            .and_then(|(_, t)| t.upgrade())
        {
            Some(l) => {
                lock(&l.groups).insert(group.map(str::to_string), entry);
                Ok(())
            }
            None => Err(e),
        },
    }
}

type GroupEntry = (Arc<LinkListener>, Arc<OfferBook>, LinkAdmit);

/// One node's link servers, by group (`None`: the default).
#[derive(Default)]
struct GroupLinks {
    groups: Mutex<HashMap<Option<String>, GroupEntry>>,
}

impl GroupLinks {
    /// The entry serving the link asks of `group` (`NAME@EPOCH:PROPOSER` or `NAME`).
    fn entry(&self, group: &str) -> Option<GroupEntry> {
        let name = group.rsplit_once('@').map_or(group, |(n, _)| n);
        let g = lock(&self.groups);
        g.get(&Some(group.to_string()))
            .or_else(|| g.get(&Some(name.to_string())))
            .or_else(|| g.get(&None))
            .cloned()
    }
}

/// How long the group's frame may take to arrive on a link stream.
const GROUP_FRAME_WAIT: Duration = Duration::from_secs(5);

/// An inbound link stream: its group frame, then the stream handed to that group's
/// listener as a connection (answered with `Ok(())` first, or with the refusal).
async fn take_link_stream(
    links: &GroupLinks,
    peer: PeerId,
    mut s: crate::swarm::PeerStream,
) -> Result<(), FrameError> {
    let group: String = match tokio::time::timeout(GROUP_FRAME_WAIT, read_frame(&mut s, 4096)).await
    {
        Ok(g) => g?,
        Err(_) => return Ok(()),
    };
    let refusal = match links.entry(&group) {
        None => Some(format!("this peer is not in group {group:?}")),
        Some((_, _, admit)) if !admit(&peer) => {
            tracing::warn!(%peer, "refused a link stream from a peer not trusted to train in this group");
            Some("not trusted to train in this group".to_string())
        }
        Some(_) => None,
    };
    let answer: Result<(), String> = refusal.clone().map_or(Ok(()), Err);
    write_frame(&mut s, &answer, 4096).await?;
    if refusal.is_some() {
        let _ = futures::io::AsyncWriteExt::close(&mut s).await;
        return Ok(());
    }
    if let Some((listener, _, _)) = links.entry(&group) {
        listener.deliver(Conn::blocking(tokio::runtime::Handle::current(), s));
    }
    Ok(())
}

/// Opens a link stream to `peer` for group `group` (the ask's `group`): a connection for
/// [`super::link::handshake`] over the swarm's connection to it.
pub async fn open_link_stream(
    swarm: &SwarmHandle,
    peer: PeerId,
    group: &str,
) -> Result<Conn, RendezvousError> {
    let mut s = swarm.open(peer, LINK_STREAM).await?;
    write_frame(&mut s, &group.to_string(), 4096).await?;
    match read_frame::<_, Result<(), String>>(&mut s, 4096).await? {
        Ok(()) => Ok(Conn::blocking(tokio::runtime::Handle::current(), s)),
        Err(reason) => Err(RendezvousError::StreamRefused { peer, reason }),
    }
}

/// Asks `peer` for a link: the offer, and the addresses the swarm knows for `peer` (its
/// gossiped listen addresses first) for a [`super::link::LinkNet`] to dial.
pub async fn ask_link(
    swarm: &SwarmHandle,
    peer: PeerId,
    ask: &LinkAsk,
) -> Result<(Vec<Multiaddr>, LinkOffer), RendezvousError> {
    let mut s = swarm.open(peer, COLLECTIVE).await?;
    write_frame(&mut s, ask, 4096).await?;
    let offer = match read_frame::<_, LinkAnswer>(&mut s, 4096).await? {
        LinkAnswer::Offer(o) => o,
        LinkAnswer::Refused(reason) => return Err(RendezvousError::Refused { peer, reason }),
    };
    let mut addrs: Vec<Multiaddr> = swarm
        .view()
        .into_iter()
        .find(|e| e.peer == peer)
        .map(|e| e.addrs)
        .unwrap_or_default();
    addrs.extend(swarm.addresses_of(peer).await);
    // (No address: the link runs over the swarm's connection.)
    Ok((addrs, offer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(group: &str, epoch: u64) -> LinkAsk {
        LinkAsk {
            group: group.into(),
            epoch,
            from_rank: 0,
        }
    }

    fn offer(port: u16) -> LinkOffer {
        LinkOffer {
            port,
            key: [1; 32],
            token: [2; 32],
            direct: true,
        }
    }

    /// A peer that floods link asks keeps at most `PER_PEER` of its own and never pushes
    /// out another peer's offer; asks of many peers at once are bounded in all.
    #[tokio::test]
    async fn a_flood_of_link_asks_from_one_peer_never_drops_another_peers_offer() {
        let book = OfferBook::default();
        let (honest, rogue) = (PeerId::random(), PeerId::random());
        book.put(honest, ask("g@3", 3), offer(7));
        for i in 0..10_000 {
            book.put(rogue, ask("g@3", i), offer(9));
        }
        assert_eq!(book.len(), 1 + PER_PEER);
        let got = book
            .take(honest, &ask("g@3", 3), Duration::from_millis(100))
            .await
            .unwrap();
        assert_eq!(got.port, 7);
        assert!(book
            .take(honest, &ask("g@3", 3), Duration::from_millis(10))
            .await
            .is_err());
        for _ in 0..2 * OFFERS {
            book.put(PeerId::random(), ask("x", 1), offer(9));
        }
        assert_eq!(book.len(), OFFERS);
    }
}
