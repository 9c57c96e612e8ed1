//! The event loop's half of the swarm-key exchange: our proof sent to each peer on each of
//! its spells of connections, its proof judged and answered, and what a verdict does to
//! the peer (a member is served and enters the routing table; a denied peer is
//! disconnected once its verdict is sent).
//!
//! Owns: applying verdicts. The proof and its check are [`crate::swarm::auth`]'s and
//! [`admission::verdict`]'s.

use libp2p::request_response::{Event, Message, OutboundFailure};
use libp2p::PeerId;
use tracing::{debug, info, warn};

use super::EventLoop;
use crate::swarm::admission;
use crate::swarm::auth::{PeerAuth, SwarmKey};
use crate::swarm::protocol::{AuthProof, AuthVerdict};

impl EventLoop {
    /// Sends our proof of the swarm key to `peer`.
    pub(super) fn prove_to(&mut self, peer: PeerId, key: &SwarmKey) {
        let proof = AuthProof {
            proof: key.proof(&self.shared.peer_id, &peer),
        };
        self.swarm.behaviour_mut().auth.send_request(&peer, proof);
    }

    pub(super) fn on_auth(&mut self, e: Event<AuthProof, AuthVerdict>) {
        match e {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => {
                let verdict = admission::verdict(
                    self.shared.auth.key(),
                    &self.shared.peer_id,
                    &peer,
                    &request,
                );
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .auth
                    .send_response(channel, verdict.clone());
                match verdict {
                    AuthVerdict::Accepted => {
                        if self.shared.auth.key().is_some() {
                            info!(%peer, "proved the swarm key");
                        }
                        self.authed(peer, PeerAuth::Member);
                    }
                    AuthVerdict::Denied(why) => self.deny(peer, why),
                }
            }
            Event::Message {
                peer,
                message: Message::Response { response, .. },
                ..
            } => match response {
                AuthVerdict::Accepted => debug!(%peer, "accepted our swarm key proof"),
                AuthVerdict::Denied(why) => warn!(%peer, "denied our swarm key proof: {why}"),
            },
            // The connection the proof went on closed, or its stream failed (an older
            // peer's accept channel closes streams unread): sent again on a connection
            // still up, while the other end's deadline has not passed. A peer no longer
            // connected proves again on its next spell.
            Event::OutboundFailure { peer, error, .. } => {
                // Counted only for a connected peer: the entry goes with its last connection.
                let resent = self.proofs_resent.get(&peer).copied().unwrap_or(0);
                let again = matches!(
                    error,
                    OutboundFailure::ConnectionClosed | OutboundFailure::Io(_)
                ) && resent < admission::OPEN_ATTEMPTS
                    && self.swarm.is_connected(&peer)
                    && self
                        .first_connection
                        .get(&peer)
                        .is_some_and(|f| f.1.elapsed() < self.shared.cfg.auth_timeout);
                debug!(%peer, again, "sending swarm key proof: {error}");
                if again {
                    self.proofs_resent.insert(peer, resent + 1);
                    if let Some(key) = self.shared.auth.key().cloned() {
                        self.prove_to(peer, &key);
                    }
                }
            }
            // A denied peer is disconnected once it has its verdict (or it could not be
            // sent); one that left meanwhile is already forgotten.
            Event::ResponseSent { peer, .. } | Event::InboundFailure { peer, .. }
                if self.swarm.is_connected(&peer) =>
            {
                if let PeerAuth::Denied(why) = self.shared.auth.state(&peer) {
                    self.authed(peer, PeerAuth::Denied(why));
                }
            }
            Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, "answering a swarm key proof: {error}");
            }
            Event::ResponseSent { .. } => {}
        }
    }

    /// Refuses `peer`'s streams now; it is disconnected once its verdict is sent (see
    /// `on_auth`).
    fn deny(&mut self, peer: PeerId, why: String) {
        self.shared.auth.set(peer, PeerAuth::Denied(why));
    }

    /// What a verdict on `peer` does: a member's held records are released and it may
    /// enter the routing table; a denied peer leaves it and is disconnected.
    pub(super) fn authed(&mut self, peer: PeerId, state: PeerAuth) {
        self.shared.auth.set(peer, state.clone());
        self.release_held_records(&peer, state == PeerAuth::Member);
        match state {
            PeerAuth::Member => self.maybe_add_to_kad(peer),
            PeerAuth::Denied(why) => {
                warn!(%peer, "refused: {why}; disconnecting");
                if self.in_kad.remove(&peer) {
                    self.swarm.behaviour_mut().kad.remove_peer(&peer);
                }
                let _ = self.swarm.disconnect_peer_id(peer);
            }
            PeerAuth::Pending => {}
        }
    }
}
