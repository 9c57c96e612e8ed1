//! The event loop's half of the swarm-key exchange: our proof sent to each peer on each of
//! its spells of connections, its proof judged and answered, and what a verdict does to
//! the peer (a member is served and enters the routing table; a denied peer is
//! disconnected once it has read why).
//!
//! Owns: applying verdicts. The proof and its check are [`crate::swarm::auth`]'s and
//! [`admission::verdict`]'s.

use std::time::Duration;

use libp2p::request_response::{Event, InboundFailure, Message};
use libp2p::PeerId;
use tracing::{debug, info, warn};

use super::EventLoop;
use crate::swarm::admission;
use crate::swarm::auth::{PeerAuth, SwarmKey};
use crate::swarm::protocol::{AuthProof, AuthVerdict};
use crate::swarm::shared::Command;

/// How long a denied peer stays connected to read its verdict.
const DENIED_GRACE: Duration = Duration::from_millis(500);

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
                    AuthVerdict::Denied(why) => self.deny_soon(peer, why),
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
            // The connection closed or the other end did not answer in time: the next
            // spell of connections proves again.
            Event::OutboundFailure { peer, error, .. } => {
                debug!(%peer, "sending swarm key proof: {error}");
            }
            Event::InboundFailure {
                peer,
                error: InboundFailure::Io(e),
                ..
            } if e.kind() == std::io::ErrorKind::InvalidData
                && self.shared.auth.state(&peer) == PeerAuth::Pending =>
            {
                self.authed(peer, PeerAuth::Denied(format!("bad proof: {e}")));
            }
            Event::InboundFailure { peer, error, .. } => {
                debug!(%peer, "reading a swarm key proof: {error}");
            }
            Event::ResponseSent { .. } => {}
        }
    }

    /// Refuses `peer`'s streams now and disconnects it after [`DENIED_GRACE`], so that its
    /// verdict reaches it.
    fn deny_soon(&mut self, peer: PeerId, why: String) {
        self.shared.auth.set(peer, PeerAuth::Denied(why.clone()));
        let cmd = self.cmd.clone();
        self.shared.spawn(async move {
            tokio::time::sleep(DENIED_GRACE).await;
            if let Some(tx) = cmd.upgrade() {
                let _ = tx.send(Command::Authed(peer, PeerAuth::Denied(why))).await;
            }
        });
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
