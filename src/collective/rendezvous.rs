//! Setting links up through the swarm: `/agentjet/collective/1`.
//!
//! The dialer sends a [`LinkAsk`] (which group, epoch and rank it is); the acceptor makes
//! an offer on its [`LinkListener`] (port, fresh key, one-use token), records it in its
//! [`OfferBook`] under the asker's peer id and the ask, and answers it. Only the peer the
//! swarm authenticated on this stream learns the key; the acceptor then waits for that
//! offer's connection ([`LinkListener::accept`]).
//!
//! Owns: the ask/offer exchange. Never carries tensor bytes (the links do).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

pub use super::link::ip_of;
use super::link::{LinkListener, LinkOffer};
use crate::base::lock;
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{Multiaddr, PeerId, StreamProtocol, SwarmError, SwarmHandle};

pub const COLLECTIVE: StreamProtocol = StreamProtocol::new("/agentjet/collective/1");

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
    #[error("no address known for {0}")]
    NoAddress(PeerId),
    #[error("timed out waiting for a link ask from {0}")]
    Timeout(PeerId),
}

/// The offers an acceptor has made, by (asker, ask), until it takes them.
#[derive(Default)]
pub struct OfferBook {
    offers: Mutex<HashMap<(PeerId, LinkAsk), LinkOffer>>,
    changed: Notify,
}

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
            if let Some(o) = lock(&self.offers).remove(&(peer, ask.clone())) {
                return Ok(o);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(RendezvousError::Timeout(peer));
            }
        }
    }

    fn put(&self, peer: PeerId, ask: LinkAsk, offer: LinkOffer) {
        let mut m = lock(&self.offers);
        // Bounded: asks nobody takes (a member that gave up) do not pile up.
        if m.len() >= 256 {
            m.clear();
        }
        m.insert((peer, ask), offer);
        drop(m);
        self.changed.notify_waiters();
    }
}

/// Answers link asks on this node: an offer on `listener` for each, recorded in `book`.
pub fn serve_links(
    swarm: &SwarmHandle,
    listener: Arc<LinkListener>,
    book: Arc<OfferBook>,
) -> Result<(), SwarmError> {
    swarm.serve(COLLECTIVE, move |peer, mut s| {
        let (listener, book) = (listener.clone(), book.clone());
        async move {
            let ask: LinkAsk = read_frame(&mut s, 4096).await?;
            let offer = listener.offer();
            book.put(peer, ask, offer.clone());
            write_frame(&mut s, &LinkAnswer::Offer(offer), 4096).await?;
            let _ = futures::io::AsyncWriteExt::close(&mut s).await;
            Ok::<(), FrameError>(())
        }
    })
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
    if addrs.is_empty() {
        return Err(RendezvousError::NoAddress(peer));
    }
    Ok((addrs, offer))
}
