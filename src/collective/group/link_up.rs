//! The ring's links for an epoch: a direct TCP connection to a neighbour reachable at its
//! addresses, else a stream over the swarm's connection (direct, hole-punched or
//! relayed); a peer that cannot be linked is struck, then declined for a while.

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::proto::{AskError, Ballot, Start};
use super::{peer_of, short, unreachable_yet, GroupError, GroupNode, Membership};
use crate::base::lock;
use crate::collective::link::{self, Conn, LinkOffer};
use crate::collective::rendezvous::{ask_link, open_link_stream, LinkAsk};
use crate::collective::ring::Ring;
use crate::swarm::{PeerId, SwarmError};

/// How long a direct TCP connection to a neighbour that says it is reachable may take
/// before the link goes over the swarm's connection instead.
const DIRECT_WAIT: Duration = Duration::from_millis(1000);

/// A second failure to reach or link a peer within this declines it (see
/// `GroupNode::unlink`).
const STRIKE_WINDOW: Duration = Duration::from_secs(120);

/// How long after a direct connection to a neighbour failed its links go over the swarm
/// without trying again (a firewall that lets the swarm's port through and not others).
const DIRECT_RETRY: Duration = Duration::from_secs(600);

impl GroupNode {
    /// Sets the ring's links up for `start`: dial the right neighbour, accept the left
    /// one. On an error, agree on the next epoch.
    pub fn build(&self, start: Start) -> Result<Membership, GroupError> {
        let m = self.link_up(start)?;
        {
            let mut g = lock(&self.shared.inner);
            g.state = None;
            g.reform = g.promised != m.start.ballot;
            g.start = None;
            // The snapshot stays until the ring's first round: a member that built its
            // links early (no neighbour of the joiner) still serves the joiner's chunks.
        }
        info!(
            group = self.cfg.name,
            epoch = m.epoch(),
            members = m.size(),
            rank = m.ring.rank,
            "group epoch formed"
        );
        Ok(m)
    }

    /// `peer` could not be linked or reached. The first time (within
    /// [`STRIKE_WINDOW`]) it is only suspected (a candidate again at its next status: a
    /// peer that just became reachable may fail once); the second declines a ring with it
    /// for a decline period, doubled at each decline in a row. Returns that period.
    pub(super) fn unlink(&self, peer: PeerId) -> Option<Duration> {
        {
            let mut strikes = lock(&self.strikes);
            strikes.retain(|_, at| at.elapsed() < STRIKE_WINDOW);
            if strikes.remove(&peer).is_none() {
                strikes.insert(peer, Instant::now());
                return None;
            }
        }
        let wait = self.decline_with(peer, self.unlink_for());
        self.shared.unlink(peer.to_bytes(), wait);
        Some(wait)
    }

    /// Whether `peer` says it cannot be reached yet (behind NAT with no relay reservation,
    /// or it does not know yet: a peer just started): a Prepare it did not answer leaves
    /// it out until its next gossip only, not for a decline period.
    pub(super) fn reachable_later(&self, peer: &PeerId) -> bool {
        self.swarm
            .view()
            .iter()
            .any(|e| e.peer == *peer && unreachable_yet(e))
    }

    /// Whether a failed ask means `peer` could not be reached (not a refusal or a bad
    /// answer: those say it is alive).
    pub(super) fn unreachable(e: &AskError) -> bool {
        matches!(
            e,
            AskError::Timeout(_)
                | AskError::Swarm(SwarmError::Unreachable { .. } | SwarmError::Timeout(_))
        )
    }

    /// The byte stream of a link to `peer`'s `offer`: a direct TCP connection where it
    /// says it is reachable (within [`DIRECT_WAIT`], and not after one failed within
    /// [`DIRECT_RETRY`]), else a stream over the swarm's connection.
    async fn connect_link(
        &self,
        peer: PeerId,
        group: &str,
        addrs: Vec<crate::swarm::Multiaddr>,
        offer: &LinkOffer,
    ) -> Result<Conn, GroupError> {
        let failed_lately = lock(&self.direct_failed)
            .get(&peer)
            .is_some_and(|at| at.elapsed() < DIRECT_RETRY);
        let direct = offer.direct || self.links.routes_itself();
        if self.cfg.direct_links && direct && !failed_lately && !addrs.is_empty() {
            let (links, port) = (self.links.clone(), offer.port);
            let tried =
                tokio::task::spawn_blocking(move || links.connect(&addrs, port, DIRECT_WAIT)).await;
            match tried {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => {
                    info!(
                        group = self.cfg.name,
                        %peer,
                        "no direct link connection ({e}): the link runs over the swarm's connection"
                    );
                    lock(&self.direct_failed).insert(peer, Instant::now());
                }
                Err(_) => return Err(GroupError::Refused("the dialing thread panicked".into())),
            }
        }
        Ok(open_link_stream(&self.swarm, peer, group).await?)
    }

    fn link_up(&self, start: Start) -> Result<Membership, GroupError> {
        let members = start
            .members
            .iter()
            .map(|b| peer_of(b))
            .collect::<Result<Vec<_>, _>>()?;
        let rank = members
            .iter()
            .position(|p| *p == self.me)
            .ok_or_else(|| GroupError::Refused("not a member".into()))?;
        let n = members.len();
        if n == 1 {
            return Ok(Membership {
                start,
                members,
                ring: Ring::solo(),
            });
        }
        let tag = format!(
            "{}@{}:{}",
            self.cfg.name,
            start.ballot.epoch,
            short(&start.ballot.proposer)
        );
        let (right, left) = (members[(rank + 1) % n], members[(rank + n - 1) % n]);
        let epoch = start.ballot.epoch;
        let ctl = self.control_timeout();
        let mine = LinkAsk {
            group: tag.clone(),
            epoch,
            from_rank: rank as u32,
        };
        let theirs = LinkAsk {
            group: tag,
            epoch,
            from_rank: ((rank + n - 1) % n) as u32,
        };
        let group = mine.group.clone();
        let (dialed, accepted) = self.rt.block_on(async {
            let dial = async {
                // The link bound: a neighbour this member cannot ask and connect to within
                // it is declined. (Its hello may come later: a neighbour that fetches the
                // group's state accepts once it has it; that failure declines nobody.)
                let connect = async {
                    let (addrs, offer) = ask_link(&self.swarm, right, &mine).await?;
                    let conn = self.connect_link(right, &group, addrs, &offer).await?;
                    Ok::<_, GroupError>((conn, offer))
                };
                let (conn, offer) = match tokio::time::timeout(ctl, connect).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        return Err(GroupError::Unlinked {
                            peer: right,
                            reason: e.to_string(),
                        })
                    }
                    Err(_) => {
                        return Err(GroupError::Unlinked {
                            peer: right,
                            reason: format!("no connection within {} s", ctl.as_secs_f64()),
                        })
                    }
                };
                tokio::task::spawn_blocking(move || link::handshake(conn, &offer, ctl))
                    .await
                    .map_err(|_| GroupError::Refused("the dialing thread panicked".into()))?
                    .map_err(GroupError::from)
            };
            let accept = async {
                let offer = self.book.take(left, &theirs, ctl).await?;
                let l = self.listener.clone();
                tokio::task::spawn_blocking(move || l.accept(&offer, ctl))
                    .await
                    .map_err(|_| GroupError::Refused("the accepting thread panicked".into()))?
                    .map_err(GroupError::from)
            };
            let both = async { tokio::join!(dial, accept) };
            tokio::select! {
                r = both => Ok(r),
                _ = self.superseded(&start.ballot) => Err(GroupError::Refused(
                    "a newer ballot was promised while building the ring".into(),
                )),
            }
        })?;
        let (tx, _) = match dialed {
            Ok(link) => link,
            Err(e @ GroupError::Unlinked { .. }) => {
                match self.unlink(right) {
                    Some(wait) => warn!(
                        group = self.cfg.name,
                        peer = %right,
                        epoch,
                        wait_s = wait.as_secs(),
                        "declining a ring with the right neighbour for a while: {e}"
                    ),
                    None => warn!(
                        group = self.cfg.name,
                        peer = %right,
                        epoch,
                        "could not link with the right neighbour (once: tried again): {e}"
                    ),
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let (_, rx) = accepted?;
        let ring = Ring::new(rank, n, tx, rx);
        ring.set_timeout(self.cfg.timeout)?;
        Ok(Membership {
            start,
            members,
            ring,
        })
    }

    /// Resolves once this member has promised a ballot other than `ballot` (a newer
    /// epoch is being formed: whatever waits for `ballot` is moot).
    async fn superseded(&self, ballot: &Ballot) {
        loop {
            if lock(&self.shared.inner).promised != *ballot {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
