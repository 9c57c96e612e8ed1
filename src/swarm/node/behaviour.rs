//! The node's protocols as one libp2p behaviour, configured from a [`SwarmConfig`].
//!
//! Owns: which protocols a node runs and their settings. Never handles their events
//! (the event loop does).

use std::num::NonZeroU32;
use std::time::Duration;

use libp2p::gossipsub;
use libp2p::identity::Keypair;
use libp2p::kad::{self, store::MemoryStore, BucketInserts, Mode, StoreInserts};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{autonat, dcutr, identify, ping, relay, upnp, PeerId};

use crate::swarm::admission::AuthCodec;
use crate::swarm::config::SwarmConfig;
use crate::swarm::protocol::{AUTH, IDENTIFY, KAD};

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    pub(super) identify: identify::Behaviour,
    pub(super) ping: ping::Behaviour,
    pub(super) gossipsub: gossipsub::Behaviour,
    pub(super) kad: kad::Behaviour<MemoryStore>,
    pub(super) stream: libp2p_stream::Behaviour,
    /// The swarm-key exchange (see [`crate::swarm::admission::AuthCodec`]).
    pub(super) auth: request_response::Behaviour<AuthCodec>,
    /// AutoNAT v2: asks connected peers to dial this one's address candidates back
    /// (is it publicly reachable?), and dials others back (both off in a swarm of one
    /// host). A dial-back is a connection of its own from a new port that must carry the
    /// nonce asked for, so a connection that happens to reach this peer through its
    /// NAT's mapping for the asked peer (the same ports) proves nothing, as it did in v1
    /// (a NAT that filters by IP alone still lets the asked peer's dial-back in).
    pub(super) autonat: Toggle<autonat::v2::client::Behaviour>,
    pub(super) autonat_server: Toggle<autonat::v2::server::Behaviour>,
    /// Relay service for peers behind NAT (on while this peer is public).
    pub(super) relay: Toggle<relay::Behaviour>,
    /// Reservations on relays and connections through them.
    pub(super) relay_client: relay::client::Behaviour,
    /// Hole punching over a relayed connection.
    pub(super) dcutr: Toggle<dcutr::Behaviour>,
    /// Port forwarding asked of a UPnP gateway.
    pub(super) upnp: Toggle<upnp::tokio::Behaviour>,
}

/// The relay service's settings from `c.relay` (see [`crate::swarm::RelayLimits`]).
fn relay_config(c: &SwarmConfig) -> relay::Config {
    let l = c.relay;
    let n = |x: u32| NonZeroU32::new(x).unwrap_or(NonZeroU32::MIN);
    relay::Config {
        max_reservations: l.reservations,
        // Two per peer: its renewal may arrive before the old one ends.
        max_reservations_per_peer: 2,
        reservation_duration: Duration::from_secs(3600),
        max_circuits: l.circuits,
        max_circuits_per_peer: l.circuits_per_peer,
        max_circuit_duration: l.circuit_duration,
        max_circuit_bytes: l.circuit_bytes,
        // Per peer only, none per IP address: many peers may sit behind one NAT gateway.
        reservation_rate_limiters: Vec::new(),
        circuit_src_rate_limiters: Vec::new(),
    }
    .reservation_rate_per_peer(n(16), Duration::from_secs(30))
    .circuit_src_per_peer(n(32), Duration::from_secs(5))
}

/// The node's behaviours, configured from `c`; `relay_client` comes from the transport
/// builder. `local_only`: every listen address is loopback (no NAT to traverse, no
/// gateway to ask).
pub(super) fn behaviour(
    key: &Keypair,
    peer_id: PeerId,
    c: &SwarmConfig,
    relay_client: relay::client::Behaviour,
    local_only: bool,
) -> Result<Behaviour, String> {
    let gs_cfg = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(Duration::from_millis(500))
        .validation_mode(gossipsub::ValidationMode::Strict)
        .validate_messages()
        .max_transmit_size(64 * 1024)
        .build()
        .map_err(|e| e.to_string())?;
    let gossipsub =
        gossipsub::Behaviour::new(gossipsub::MessageAuthenticity::Signed(key.clone()), gs_cfg)
            .map_err(|e| e.to_string())?;
    let mut kcfg = kad::Config::new(KAD);
    kcfg.set_provider_record_ttl(Some(c.provider_ttl))
        .set_provider_publication_interval(None)
        .set_record_filtering(StoreInserts::FilterBoth)
        .set_kbucket_inserts(BucketInserts::Manual)
        .set_query_timeout(Duration::from_secs(10))
        .set_periodic_bootstrap_interval(None);
    let mut kad = kad::Behaviour::with_config(peer_id, MemoryStore::new(peer_id), kcfg);
    // A server on one host or when told it is public; else a client until it learns it
    // is reachable (the event loop switches it).
    kad.set_mode(Some(
        if c.kad_server && (local_only || !c.external.is_empty()) {
            Mode::Server
        } else {
            Mode::Client
        },
    ));
    // Candidates are the addresses peers observe this one at (identify); each is tested
    // once, by a random connected peer that serves AutoNAT v2, every `autonat_every`.
    // Private addresses are tested too: a swarm on a LAN reaches its peers there.
    let autonat = (!local_only).then(|| {
        autonat::v2::client::Behaviour::new(
            rand::make_rng(),
            autonat::v2::client::Config::default().with_probe_interval(c.autonat_every),
        )
    });
    let autonat_server = (!local_only).then(autonat::v2::server::Behaviour::default);
    let relay = (c.relay_service && !local_only).then(|| {
        let mut r = relay::Behaviour::new(peer_id, relay_config(c));
        // Off until this peer is publicly reachable (the event loop turns it on).
        r.set_status(Some(relay::Status::Disable));
        r
    });
    Ok(Behaviour {
        identify: identify::Behaviour::new(
            identify::Config::new(IDENTIFY.into(), key.public())
                .with_agent_version(format!("agentjet/{}", env!("CARGO_PKG_VERSION")))
                .with_push_listen_addr_updates(true)
                // Only confirmed external addresses: never this host's loopback or LAN
                // addresses to a peer on another host (gossip carries the offered ones).
                .with_hide_listen_addrs(!local_only),
        ),
        ping: ping::Behaviour::new(ping::Config::new().with_interval(c.ping_interval)),
        gossipsub,
        kad,
        stream: libp2p_stream::Behaviour::new(),
        auth: request_response::Behaviour::with_codec(
            AuthCodec,
            [(AUTH, ProtocolSupport::Full)],
            request_response::Config::default().with_request_timeout(c.auth_timeout),
        ),
        autonat: autonat.into(),
        autonat_server: autonat_server.into(),
        relay: relay.into(),
        relay_client,
        dcutr: (c.nat_traversal && !local_only)
            .then(|| dcutr::Behaviour::new(peer_id))
            .into(),
        upnp: (c.upnp && !local_only)
            .then(upnp::tokio::Behaviour::default)
            .into(),
    })
}
