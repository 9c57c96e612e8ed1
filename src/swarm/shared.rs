//! What the event loop, the node's tasks and every handle share ([`Shared`]), and the
//! commands handles send the loop ([`Command`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::identity::Keypair;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use tokio::sync::oneshot;

use super::auth::AuthTable;
use super::config::SwarmConfig;
use super::limits::Limits;
use super::protocol::PeerStatus;
use super::reach::{LinkKind, NetEvent, Reachability};
use super::trust::{Certificate, Certified, TrustError, CERT_FIELD};
use super::usage::UseTable;
use super::SwarmError;
use crate::base::stop::{CancellationToken, TaskTracker};

/// What one provider lookup found, and what it cost.
#[derive(Debug, Clone, Default)]
pub struct ProviderLookup {
    pub providers: Vec<PeerId>,
    /// Kademlia requests the query sent (libp2p's query statistics), and how many were
    /// answered.
    pub requests: u32,
    pub answered: u32,
    /// From the query's start to its end.
    pub duration: Duration,
}

/// One peer in the live view.
#[derive(Debug, Clone)]
pub struct ViewEntry {
    pub peer: PeerId,
    pub status: PeerStatus,
    pub addrs: Vec<Multiaddr>,
    pub age: Duration,
    pub is_self: bool,
    /// The status's publication time by its author's clock, and when this peer received
    /// it (Unix milliseconds; peers in one process, as in netsim, share the clock).
    pub published_unix_ms: u64,
    pub received_unix_ms: u64,
    /// What the peer's certificate allows, when this peer trusts a run and the
    /// certificate verified (expiry: see [`Certified`]'s checks).
    pub cert: Option<Certified>,
    /// Why it is not certified (trusting a run): no certificate, or what was wrong.
    pub cert_problem: Option<String>,
}

pub(super) struct ViewSlot {
    pub(super) status: PeerStatus,
    pub(super) addrs: Vec<Multiaddr>,
    pub(super) seq: u64,
    pub(super) at: Instant,
    pub(super) published_unix_ms: u64,
    pub(super) received_unix_ms: u64,
    /// The certificate's verdict when the status arrived (None: this peer trusts no run).
    pub(super) cert: Option<Result<Certified, TrustError>>,
}

pub(super) type ProvidersReply = oneshot::Sender<ProviderLookup>;

/// What handles ask of the event loop.
pub(super) enum Command {
    Provide(String, oneshot::Sender<()>),
    StopProviding(String),
    /// A provider lookup; with `first`, answered at the first provider found.
    Providers {
        model: String,
        first: bool,
        reply: ProvidersReply,
    },
    Connect(PeerId, oneshot::Sender<Result<(), SwarmError>>),
    /// The auth timeout of the connection that opened a spell of connections to a peer.
    AuthDeadline(PeerId, ConnectionId),
    /// The addresses this peer offers others (first: the one to give another host).
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    /// Dial these (bootstrap addresses, resolved).
    Dial(Vec<Multiaddr>),
    /// Close the relayed connections to this peer (a hole punched a direct one).
    CloseRelayed(PeerId),
    Connected(oneshot::Sender<Vec<PeerId>>),
    Addresses(PeerId, Vec<Multiaddr>),
    /// The addresses the address book holds for a peer.
    AddressesOf(PeerId, oneshot::Sender<Vec<Multiaddr>>),
    /// Gossip this peer's status now (see [`SwarmHandle::announce`]).
    Announce,
    /// End the loop now (see [`SwarmHandle::shutdown`]).
    Shutdown,
}

/// What the event loop, the node's tasks and every handle share. It holds no command
/// sender, so holding it never keeps the loop alive.
pub(super) struct Shared {
    pub(super) peer_id: PeerId,
    pub(super) keypair: Keypair,
    pub(super) cfg: Arc<SwarmConfig>,
    pub(super) auth: Arc<AuthTable>,
    pub(super) view: Mutex<HashMap<PeerId, ViewSlot>>,
    /// Statuses taken into the view so far (see [`super::SwarmHandle::view_changes`]).
    pub(super) view_changes: std::sync::atomic::AtomicU64,
    /// Statuses this peer gossiped so far (see [`super::SwarmHandle::statuses_published`]).
    pub(super) published: std::sync::atomic::AtomicU64,
    /// Wakes whoever waits for the next status taken in ([`super::SwarmHandle::view_changed`]).
    pub(super) view_changed: tokio::sync::Notify,
    pub(super) status: Mutex<PeerStatus>,
    /// This peer's certificate (`cfg.cert` at start; [`super::SwarmHandle::renew_cert`]
    /// replaces it). Its encoding rides in `status`.
    pub(super) cert: Mutex<Option<Certificate>>,
    pub(super) limits: Mutex<Limits>,
    /// Streams open per peer, and their last use (what the trimmer spares).
    pub(super) usage: Arc<UseTable>,
    /// Cancelled when the event loop has ended.
    pub(super) ended: CancellationToken,
    /// Every task of the node, the event loop included.
    pub(super) tasks: TaskTracker,
    /// What the node knows of the network (written by the event loop).
    pub(super) net: Mutex<NetState>,
    pub(super) net_tx: tokio::sync::broadcast::Sender<NetEvent>,
}

/// Network events kept for a subscriber that comes late.
pub(super) const NET_LOG: usize = 1024;

/// What the node knows of the network: its reachability, the addresses it offers, its
/// connections by kind, and the last [`NET_LOG`] network events.
#[derive(Default)]
pub(super) struct NetState {
    pub(super) reach: Reachability,
    pub(super) offered: Vec<Multiaddr>,
    pub(super) links: HashMap<PeerId, Vec<(ConnectionId, LinkKind)>>,
    pub(super) log: std::collections::VecDeque<NetEvent>,
    /// Relay service: reservations held by others now, circuits relayed now and in all.
    pub(super) relay: RelayLoad,
}

/// What this peer's relay service carries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayLoad {
    pub reservations: u64,
    pub circuits: u64,
    pub circuits_total: u64,
    /// Reservations and circuits refused (limits).
    pub refused: u64,
}

impl Shared {
    /// Records a network event and hands it to subscribers.
    pub(super) fn net_event(&self, e: NetEvent) {
        let mut n = crate::base::lock(&self.net);
        if n.log.len() == NET_LOG {
            n.log.pop_front();
        }
        n.log.push_back(e.clone());
        // Sent under the lock, so a subscriber (which takes the log under it) misses
        // nothing and sees nothing twice.
        let _ = self.net_tx.send(e);
    }
}

/// The verdict on the certificate in `status`, presented by `peer`, for a peer that
/// trusts `cfg.run` (None when it trusts no run).
pub(super) fn check_cert(
    cfg: &SwarmConfig,
    peer: &PeerId,
    status: &PeerStatus,
) -> Option<Result<Certified, TrustError>> {
    let run = cfg.run.as_ref()?;
    Some(match status.extra.get(CERT_FIELD) {
        None => Err(TrustError::Malformed("no certificate".into())),
        Some(text) => Certificate::decode(text).and_then(|c| c.verify(run, peer)),
    })
}
