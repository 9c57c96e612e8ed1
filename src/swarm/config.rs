//! Everything a swarm node is configured by ([`SwarmConfig`]: every bound and timeout),
//! and the extra transport a node may dial through (netsim's simulated network).

use std::sync::Arc;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};

use super::auth::SwarmKey;
use super::protocol::Role;
use super::trust::{Certificate, RunId, Trust};

/// Everything the node needs; every bound and timeout is here.
#[derive(Debug, Clone)]
pub struct SwarmConfig {
    pub role: Role,
    pub keypair: Keypair,
    pub listen: Vec<Multiaddr>,
    pub bootstrap: Vec<Multiaddr>,
    pub swarm_key: Option<SwarmKey>,
    /// The run this peer trusts (see the `swarm::trust` module): only peers its key
    /// certified serve and train. None: the swarm key decides, or nobody (open swarm).
    pub run: Option<RunId>,
    /// This peer's own certificate, presented in its status.
    pub cert: Option<Certificate>,
    /// Lifetime of a provider record (re-provided every half of it).
    pub provider_ttl: Duration,
    pub status_interval: Duration,
    pub rebootstrap_interval: Duration,
    /// A connected peer must prove the swarm key within this.
    pub auth_timeout: Duration,
    /// Dial + protocol negotiation + admission for a new stream.
    pub open_timeout: Duration,
    /// A QUIC connection with no packets for this long is dead (keep-alives every third).
    pub quic_idle_timeout: Duration,
    /// QUIC flow-control windows (bulk fragments and tensors need large ones).
    pub quic_stream_window: u32,
    pub quic_connection_window: u32,
    /// Connections with no open stream close after this.
    pub idle_connection_timeout: Duration,
    /// The connection trimmer's marks (see the `swarm::usage` module): above `max_connections`
    /// connected peers, the least recently used are closed until `min_connections` are
    /// left, sparing gossip-mesh peers, peers with an open stream, and any connected or
    /// used within `trim_grace`.
    pub max_connections: usize,
    pub min_connections: usize,
    pub trim_grace: Duration,
    /// How often each connection is pinged (its round-trip time).
    pub ping_interval: Duration,
    /// Frames larger than this are refused.
    pub max_frame_bytes: usize,
    /// Streams one peer may have open with us at once, per protocol.
    pub max_streams_per_peer: usize,
    /// New streams per second one peer may open (sustained), and the burst above it.
    pub max_requests_per_s: f64,
    pub request_burst: f64,
    pub kad_server: bool,
    /// Addresses other hosts reach this peer at, as the user knows them (a public address,
    /// a forwarded port; `--external-addr`): offered first, and this peer counts as
    /// publicly reachable. A DNS name is resolved at start.
    pub external: Vec<Multiaddr>,
    /// Offer relay service (circuit relay v2) to peers behind NAT while this peer is
    /// publicly reachable, within `relay`'s limits.
    pub relay_service: bool,
    pub relay: RelayLimits,
    /// Behind NAT: reserve slots on relays and punch holes (DCUtR) to the peers met
    /// through them.
    pub nat_traversal: bool,
    /// Ask a UPnP gateway on the local network to forward the listen ports.
    pub upnp: bool,
    /// AutoNAT: how often an untested address candidate is given to another peer to
    /// dial back.
    pub autonat_every: Duration,
    /// A transport beside TCP and QUIC (dialed for the addresses it supports): netsim's
    /// simulated network. None in the peer binary.
    pub other_transport: Option<OtherTransport>,
    /// Whether every peer this one can meet is on its own host (no NAT to traverse, no
    /// relay, no AutoNAT, listen addresses shown to all). None: decided from `listen`
    /// (all loopback: yes). netsim says no, so its `/memory` nodes run the traversal.
    pub single_host: Option<bool>,
}

/// What a relay carries for the peers behind NAT that reserve a slot on it (see the
/// README's "Across networks" for why these sizes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelayLimits {
    /// Peers holding a reservation at once.
    pub reservations: usize,
    /// Connections relayed at once, in all and per peer.
    pub circuits: usize,
    pub circuits_per_peer: usize,
    /// A relayed connection closes after this many bytes (both ways together) or this
    /// long; the peers then connect again.
    pub circuit_bytes: u64,
    pub circuit_duration: Duration,
}

impl Default for RelayLimits {
    fn default() -> Self {
        RelayLimits {
            reservations: 128,
            circuits: 64,
            circuits_per_peer: 8,
            circuit_bytes: 4 << 30,
            circuit_duration: Duration::from_secs(30 * 60),
        }
    }
}

/// An authenticated, multiplexed transport, as libp2p's swarm takes one.
pub type BoxedTransport =
    libp2p::core::transport::Boxed<(PeerId, libp2p::core::muxing::StreamMuxerBox)>;

/// Builds the extra transport of a node from its identity (see
/// [`SwarmConfig::other_transport`]).
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct OtherTransport(
    pub Arc<dyn Fn(&Keypair) -> Result<BoxedTransport, String> + Send + Sync>,
);

impl std::fmt::Debug for OtherTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OtherTransport")
    }
}

impl SwarmConfig {
    pub fn new(role: Role, keypair: Keypair) -> SwarmConfig {
        SwarmConfig {
            role,
            keypair,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            swarm_key: None,
            run: None,
            cert: None,
            provider_ttl: Duration::from_secs(30),
            status_interval: Duration::from_secs(2),
            rebootstrap_interval: Duration::from_secs(30),
            auth_timeout: Duration::from_secs(10),
            open_timeout: Duration::from_secs(15),
            quic_idle_timeout: Duration::from_secs(3),
            quic_stream_window: 16 << 20,
            quic_connection_window: 64 << 20,
            idle_connection_timeout: Duration::from_secs(120),
            max_connections: 96,
            min_connections: 64,
            trim_grace: Duration::from_secs(30),
            ping_interval: Duration::from_secs(5),
            max_frame_bytes: 16 << 20,
            max_streams_per_peer: 256,
            max_requests_per_s: 500.0,
            request_burst: 1000.0,
            kad_server: true,
            external: Vec::new(),
            relay_service: true,
            relay: RelayLimits::default(),
            nat_traversal: true,
            upnp: true,
            // Only untested candidates are given out, so a short interval costs nothing
            // once they are tested, and a new one is tested within a second (a public
            // peer is a group candidate only once it knows it is public).
            autonat_every: Duration::from_secs(1),
            other_transport: None,
            single_host: None,
        }
    }
}

impl SwarmConfig {
    /// Whom this peer trusts: the run's certified peers, the swarm key's holders, or
    /// nobody but itself.
    pub fn trust(&self) -> Trust {
        match (&self.run, &self.swarm_key) {
            (Some(r), _) => Trust::Run(*r),
            (None, Some(_)) => Trust::SwarmKey,
            (None, None) => Trust::Open,
        }
    }
}
