//! The libp2p node: one event loop task owns the `Swarm` (identify, ping, gossipsub,
//! Kademlia, the swarm-key exchange, raw streams); the rest of the program holds a
//! cloneable [`SwarmHandle`] that sends `Command`s over a bounded channel (each with a
//! oneshot for its answer) and opens or accepts streams through `libp2p-stream`'s
//! control, which needs no round trip through the loop. Nothing outside the loop touches the swarm.
//!
//! Lifetime: the loop holds no handle of its own, so it ends when the last
//! [`SwarmHandle`] is dropped (or on [`SwarmHandle::shutdown`]); the node's other tasks
//! (accept loops, stream handlers, auth timers) run in its task tracker, hold at most a
//! weak command sender, and are cancelled when the loop ends. Then the `Swarm` is dropped:
//! connections close and the listen ports are free again.
//!
//! Discovery: Kademlia (protocol `/agentjet/kad/1`), a server once the peer is public or
//! on one host (a client before and behind NAT, see `nat`), with manual routing
//! table inserts: a peer enters the table only after it proved the swarm key and identify
//! told us its listen addresses; it stays there when its connections close (idle ones
//! close after `idle_connection_timeout`) and leaves when a dial to it fails or it fails
//! the proof on a later connection. A provider record a peer sends before its proof has
//! arrived is held until the proof decides. A served model is a provider record under
//! `agentjet/model/<name>` with a TTL of `provider_ttl`; the server re-provides every half
//! TTL (and soon after a new member joins), so the record of a server that died expires at
//! every peer within one TTL of its last refresh. Peers re-bootstrap periodically.
//!
//! Status: every `status_interval` each peer publishes a [`StatusEnvelope`] on the gossip
//! topic; every peer keeps the live view (entries expire after three intervals). Gossip is
//! validated before it is forwarded: the envelope's author must be the gossip message's
//! signed source, the forwarder a member, and (closed swarm) the MAC must verify.
//!
//! Addresses: the loop's address book takes identify's listen addresses and the addresses
//! peers gossip with their status; [`SwarmHandle::connect`] dials a peer through it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use libp2p::core::transport::OptionalTransport;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::identity::Keypair;
use libp2p::kad::{self, store::RecordStore, QueryId, QueryResult};
use libp2p::swarm::{ConnectionId, DialError, SwarmEvent};
use libp2p::{identify, noise, tcp, yamux, Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::addrs;
use super::auth::{AuthTable, PeerAuth};
use super::config::SwarmConfig;
use super::handle::SwarmHandle;
use super::limits::Limits;
use super::protocol::{
    PeerStatus, StatusEnvelope, IDENTIFY, KAD, REACH_FIELD, RELAY_FIELD, STATUS_TOPIC,
};
use super::reach::{
    change_due, unheard_retry, Bootstrap, LinkKind, NatState, NetEvent, STATUS_GAP,
};
use super::shared::{
    check_cert, Command, NetState, ProviderLookup, ProvidersReply, Shared, ViewSlot,
};
use super::trust::CERT_FIELD;
use super::usage::{self, Candidate, Marks, UseTable};
use super::SwarmError;
use crate::base::lock;
use crate::base::stop::{CancellationToken, TaskTracker};
use behaviour::{behaviour, Behaviour, BehaviourEvent};

mod auth;
mod behaviour;
mod nat;

/// How long a provider lookup asked before the routing table has any entry waits for the
/// first one (a node just started is still proving the swarm key to its bootstrap peers).
const FIRST_ENTRY_WAIT: Duration = Duration::from_secs(2);

/// Kademlia's replication factor (k): a record is stored at the k closest peers to its key.
const K_CLOSE: usize = 20;
/// Provider records held while their providers' proofs are on the way (see `on_kad`).
const MAX_HELD_RECORDS: usize = 256;

/// A provider lookup in flight.
struct ProviderQuery {
    found: HashSet<PeerId>,
    /// Answer at the first provider found (and end the query).
    first: bool,
    reply: ProvidersReply,
}

/// Why a gossiped status was dropped (and not forwarded).
#[derive(Debug, thiserror::Error)]
enum BadGossip {
    #[error("forwarded by {0}, which has not proved the swarm key")]
    NotMember(PeerId),
    #[error("malformed status: {0}")]
    Malformed(String),
    #[error("status of {author} not signed by it (signed by {signer})")]
    NotSignedByAuthor { author: PeerId, signer: String },
    #[error("status of {0}: {1} swarm key MAC")]
    Mac(PeerId, &'static str),
}

fn model_key(model: &str) -> kad::RecordKey {
    kad::RecordKey::new(&format!("agentjet/model/{model}"))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// How long a dial may take to connect (transport, security and multiplexing).
const DIAL_TIMEOUT: Duration = Duration::from_secs(8);

/// How long, after the first address of each listener, the others of a listener on every
/// interface (`0.0.0.0`) may take to come up before the node reports its addresses.
const MORE_ADDRS: Duration = Duration::from_millis(150);

/// Starts the node on the current tokio runtime: binds every listen address (an error if
/// one cannot be bound: a taken port says which and what to pass instead), dials the
/// bootstrap peers (DNS names resolved; one that fails is said and tried again), and
/// returns the handle.
pub async fn spawn_node(cfg: SwarmConfig) -> Result<SwarmHandle, SwarmError> {
    if let Some(taken) = addrs::taken_port(&cfg.listen) {
        return Err(SwarmError::Setup(taken.to_string()));
    }
    let mut cfg = cfg;
    // The addresses the user gave this peer, DNS names resolved once here.
    let mut external = Vec::new();
    for a in &cfg.external {
        match tokio::time::timeout(Duration::from_secs(10), addrs::resolve(a)).await {
            Ok(Ok(r)) => external.extend(r),
            Ok(Err(e)) => return Err(SwarmError::Setup(format!("--external-addr {e}"))),
            Err(_) => {
                return Err(SwarmError::Setup(format!(
                    "--external-addr {a}: resolving took over 10 s"
                )))
            }
        }
    }
    cfg.external = external;
    let cfg = Arc::new(cfg);
    let keypair = cfg.keypair.clone();
    let peer_id = keypair.public().to_peer_id();
    let local_only = cfg
        .single_host
        .unwrap_or_else(|| addrs::all_loopback(&cfg.listen));
    let c = cfg.clone();
    let other = cfg.other_transport.clone();
    let behaviour = |key: &Keypair, relay_client| {
        behaviour(key, peer_id, &c, relay_client, local_only)
            .map_err(Box::<dyn std::error::Error + Send + Sync>::from)
    };
    let idle = c.idle_connection_timeout;
    // Every substream negotiates its protocol lazily: the opener sends the protocol's name
    // and its first bytes together instead of waiting a round trip for the echo (the
    // builder's TCP transport does the same for noise and yamux). A Kademlia request on a
    // new connection, a call stream or the swarm-key proof is one round trip shorter. The
    // wire is multistream-select 1.0 either way; a peer that does not serve the protocol
    // answers "na" and the opener's first read fails instead of the open.
    let swarm_config = move |s: libp2p::swarm::Config| {
        s.with_idle_connection_timeout(idle)
            .with_substream_upgrade_protocol_override(libp2p::core::upgrade::Version::V1Lazy)
    };
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(keypair.clone())
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .map_err(|e| SwarmError::Setup(format!("TCP transport: {e}")))?
        .with_quic_config(|mut q| {
            q.max_idle_timeout = c.quic_idle_timeout.as_millis() as u32;
            q.keep_alive_interval = c.quic_idle_timeout / 3;
            q.max_stream_data = c.quic_stream_window;
            q.max_connection_data = c.quic_connection_window;
            q.max_concurrent_stream_limit = (c.max_streams_per_peer * 4) as u32;
            q
        })
        .with_other_transport(|key| match &other {
            Some(o) => (o.0)(key)
                .map(OptionalTransport::some)
                .map_err(Box::<dyn std::error::Error + Send + Sync>::from),
            None => Ok(OptionalTransport::none()),
        })
        .map_err(|e| SwarmError::Setup(format!("other transport: {e}")))?
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .map_err(|e| SwarmError::Setup(format!("relay client: {e}")))?
        .with_behaviour(behaviour)
        .map_err(|e| SwarmError::Setup(format!("behaviour: {e}")))?
        .with_swarm_config(swarm_config)
        // A dial that has not connected in this long fails (an AutoNAT dial-back to a
        // peer behind NAT among them: its verdict waits for it).
        .with_connection_timeout(DIAL_TIMEOUT)
        .build();

    let topic = IdentTopic::new(STATUS_TOPIC);
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&topic)
        .map_err(|e| SwarmError::Setup(format!("subscribing to the status topic: {e}")))?;
    let mut listeners = HashSet::new();
    for addr in &cfg.listen {
        let id = swarm
            .listen_on(addr.clone())
            .map_err(|e| SwarmError::Setup(format!("listening on {addr}: {e}")))?;
        listeners.insert(id);
    }
    for a in &cfg.external {
        swarm.add_external_address(a.clone());
    }
    let control = swarm.behaviour().stream.new_control();
    let auth = Arc::new(AuthTable::new(cfg.swarm_key.clone()));
    let (tx, rx) = mpsc::channel(1024);
    let shared = Arc::new(Shared {
        peer_id,
        keypair,
        cfg: cfg.clone(),
        auth: auth.clone(),
        view: Mutex::new(HashMap::new()),
        view_changes: Default::default(),
        published: Default::default(),
        view_changed: Default::default(),
        status: Mutex::new(PeerStatus {
            role: cfg.role,
            models: Vec::new(),
            load: 0.0,
            queue_depth: 0,
            free_kv_positions: 0,
            episodes: 0,
            version: env!("CARGO_PKG_VERSION").to_string(),
            extra: cfg
                .cert
                .iter()
                .map(|c| (CERT_FIELD.to_string(), c.encode()))
                .collect(),
        }),
        cert: Mutex::new(cfg.cert.clone()),
        limits: Mutex::new(Limits::default()),
        usage: Arc::new(UseTable::default()),
        ended: CancellationToken::new(),
        tasks: TaskTracker::new(),
        net: Mutex::new(NetState::default()),
        net_tx: tokio::sync::broadcast::channel(256).0,
    });
    let handle = SwarmHandle {
        peer_id,
        cfg: cfg.clone(),
        auth,
        shared: shared.clone(),
        cmd: tx.clone(),
        control,
    };

    // Wait for every listener to report an address (or fail), and for a listener on every
    // interface to report the rest, so the caller can print them.
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut all_up: Option<tokio::time::Instant> = None;
    loop {
        let until = all_up.map_or(deadline, |t| t + MORE_ADDRS);
        let ev = match tokio::time::timeout_at(until, swarm.select_next_some()).await {
            Ok(ev) => ev,
            Err(_) if all_up.is_some() => break,
            Err(_) => {
                return Err(SwarmError::Setup(
                    "listeners did not come up within 10 s".into(),
                ))
            }
        };
        match ev {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                if local_only {
                    swarm.add_external_address(address.clone());
                }
                listen_addrs.push(address);
                listeners.remove(&listener_id);
                if listeners.is_empty() && all_up.is_none() {
                    all_up = Some(tokio::time::Instant::now());
                }
            }
            SwarmEvent::ListenerClosed {
                addresses, reason, ..
            } => {
                return Err(SwarmError::Setup(format!(
                    "listener {addresses:?} closed: {reason:?}"
                )))
            }
            SwarmEvent::ListenerError { error, .. } => {
                return Err(SwarmError::Setup(format!("listener error: {error}")))
            }
            _ => {}
        }
    }
    let mut ev = EventLoop {
        swarm,
        rx,
        cmd: tx.downgrade(),
        shared: shared.clone(),
        topic,
        listen_addrs,
        addr_book: HashMap::new(),
        identified: HashMap::new(),
        in_kad: HashSet::new(),
        first_connection: HashMap::new(),
        proofs_resent: HashMap::new(),
        providing: HashSet::new(),
        provider_queries: HashMap::new(),
        waiting_lookups: Vec::new(),
        connect_waiters: HashMap::new(),
        seq: 0,
        reprovide_soon: false,
        held_records: Vec::new(),
        local_only,
        conns: HashMap::new(),
        nat: NatState::new(Instant::now()),
        bootstrap: Bootstrap::new(&cfg.bootstrap),
    };
    ev.update_reach();
    ev.dial_bootstrap().await;
    // Not `Shared::spawn`: the loop ends by itself (and then cancels the rest).
    shared.tasks.spawn(ev.run());
    Ok(handle)
}

/// A live connection: its peer, how it runs and where the other end is.
#[derive(Debug, Clone)]
struct Conn {
    peer: PeerId,
    kind: LinkKind,
    remote: Multiaddr,
}

struct EventLoop {
    swarm: Swarm<Behaviour>,
    rx: mpsc::Receiver<Command>,
    /// For the loop's own timers; weak, so the loop never keeps itself alive.
    cmd: mpsc::WeakSender<Command>,
    shared: Arc<Shared>,
    topic: IdentTopic,
    listen_addrs: Vec<Multiaddr>,
    addr_book: HashMap<PeerId, Vec<Multiaddr>>,
    /// Peers identify told about (AgentJet peers), and whether each serves the DHT.
    identified: HashMap<PeerId, bool>,
    in_kad: HashSet<PeerId>,
    /// Per connected peer, the connection that opened the current spell of connections
    /// (its auth deadline applies), and when.
    first_connection: HashMap<PeerId, (ConnectionId, Instant)>,
    /// Per connected peer, how many times our swarm-key proof was sent again this spell
    /// (see `node::auth`).
    proofs_resent: HashMap<PeerId, u32>,
    providing: HashSet<String>,
    provider_queries: HashMap<QueryId, ProviderQuery>,
    /// Lookups asked before any peer was in the routing table: they start at the first
    /// entry, or answer empty after [`FIRST_ENTRY_WAIT`].
    waiting_lookups: Vec<(String, bool, ProvidersReply, Instant)>,
    connect_waiters: HashMap<PeerId, Vec<oneshot::Sender<Result<(), SwarmError>>>>,
    seq: u64,
    reprovide_soon: bool,
    /// Provider records from peers whose proof had not arrived yet (at most
    /// [`MAX_HELD_RECORDS`]).
    held_records: Vec<kad::ProviderRecord>,
    /// Every listen address is loopback: a swarm of this host alone.
    local_only: bool,
    /// Live connections.
    conns: HashMap<ConnectionId, Conn>,
    /// Reachability, relay reservations, hole punches (see `nat`).
    nat: NatState,
    /// The bootstrap peers, resolved and dialed (again) until they answer.
    bootstrap: Bootstrap,
}

impl EventLoop {
    async fn run(mut self) {
        self.run_until_stopped().await;
        // Dropping `self` drops the Swarm: connections close, listen ports are released.
        debug!(peer = %self.shared.peer_id, "the swarm node has stopped");
        self.shared.ended.cancel();
        self.shared.tasks.close();
    }

    async fn run_until_stopped(&mut self) {
        let cfg = self.shared.cfg.clone();
        let mut status_tick = tokio::time::interval(cfg.status_interval);
        let mut reprovide_tick = tokio::time::interval(cfg.provider_ttl / 2);
        let mut bootstrap_tick = tokio::time::interval(cfg.rebootstrap_interval);
        let mut soon_tick = tokio::time::interval(Duration::from_millis(500));
        let mut trim_tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                ev = self.swarm.select_next_some() => self.on_swarm_event(ev),
                cmd = self.rx.recv() => match cmd {
                    Some(Command::Shutdown) | None => return,
                    Some(c) => self.on_command(c),
                },
                _ = status_tick.tick() => self.publish_status(),
                _ = reprovide_tick.tick() => self.reprovide(),
                _ = soon_tick.tick() => {
                    if !self.waiting_lookups.is_empty() {
                        self.run_waiting_lookups();
                    }
                    if self.reprovide_soon {
                        self.reprovide_soon = false;
                        self.reprovide();
                    }
                    if self.status_due(Instant::now()) {
                        self.publish_status();
                        // The regular status counts from this one.
                        status_tick.reset();
                    }
                    self.nat_tick();
                }
                _ = trim_tick.tick() => self.trim(),
                _ = bootstrap_tick.tick() => {
                    if !self.in_kad.is_empty() {
                        let _ = self.swarm.behaviour_mut().kad.bootstrap();
                    }
                }
            }
        }
    }

    /// Closes the least recently used connections when too many peers are connected (see
    /// [`usage`]).
    fn trim(&mut self) {
        let cfg = &self.shared.cfg;
        let n = self.swarm.connected_peers().count();
        if n <= cfg.max_connections {
            return;
        }
        let mesh: HashSet<PeerId> = self
            .swarm
            .behaviour()
            .gossipsub
            .all_mesh_peers()
            .copied()
            .collect();
        let now = Instant::now();
        let relays = self.nat.relays.in_use();
        let candidates: Vec<Candidate> = self
            .swarm
            .connected_peers()
            .map(|p| Candidate {
                peer: *p,
                since: self.first_connection.get(p).map_or(now, |f| f.1),
                usage: self.shared.usage.get(p),
                protected: mesh.contains(p)
                    || self.connect_waiters.contains_key(p)
                    || self.shared.auth.state(p) == PeerAuth::Pending
                    // A relay this peer holds (or asked for) a reservation on, or a peer
                    // holding one here: closing it drops the reservation.
                    || relays.contains(p)
                    || self.nat.holders.contains(p),
            })
            .collect();
        let marks = Marks {
            max: cfg.max_connections,
            min: cfg.min_connections,
            grace: cfg.trim_grace,
        };
        let close = usage::to_trim(&candidates, marks, now);
        if !close.is_empty() {
            debug!(
                connected = n,
                mesh = mesh.len(),
                protected = candidates.iter().filter(|c| c.protected).count(),
                busy = candidates
                    .iter()
                    .filter(|c| c.usage.is_some_and(|u| u.open > 0))
                    .count(),
                closing = close.len(),
                "trimming connections"
            );
        }
        for p in close {
            debug!(me = %self.shared.peer_id, peer = %p, "trimmed");
            let _ = self.swarm.disconnect_peer_id(p);
        }
    }

    fn reprovide(&mut self) {
        for m in self.providing.clone() {
            if let Err(e) = self
                .swarm
                .behaviour_mut()
                .kad
                .start_providing(model_key(&m))
            {
                warn!(model = %m, "providing: {e}");
            }
        }
    }

    /// Whether the status is gossiped now, before the regular interval: the last one
    /// reached no peer, or a change asked for it (see [`change_due`]).
    fn status_due(&self, now: Instant) -> bool {
        let n = &self.nat;
        n.publish_at.is_some_and(|t| now >= t)
            || n.changed_at
                .is_some_and(|f| change_due(f, n.published_at, n.relays.asking(), now))
    }

    fn publish_status(&mut self) {
        self.nat.publish_at = None;
        self.nat.changed_at = None;
        let mut status = lock(&self.shared.status).clone();
        let reach = lock(&self.shared.net).reach;
        status
            .extra
            .insert(REACH_FIELD.to_string(), reach.as_str().to_string());
        if self.relaying() {
            status
                .extra
                .insert(RELAY_FIELD.to_string(), "1".to_string());
        }
        let offered = self.offered();
        self.seq += 1;
        let mut env = StatusEnvelope {
            author: self.shared.peer_id.to_bytes(),
            seq: self.seq,
            unix_ms: unix_ms(),
            status: status.clone(),
            addrs: offered.iter().map(|a| a.to_vec()).collect(),
            mac: None,
        };
        if let Some(k) = self.shared.auth.key() {
            env.mac = Some(k.mac(&env.mac_payload()));
        }
        let cert = check_cert(&self.shared.cfg, &self.shared.peer_id, &status);
        lock(&self.shared.view).insert(
            self.shared.peer_id,
            ViewSlot {
                cert,
                status,
                addrs: offered,
                seq: self.seq,
                at: Instant::now(),
                published_unix_ms: env.unix_ms,
                received_unix_ms: env.unix_ms,
            },
        );
        self.shared
            .view_changes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.shared.view_changed.notify_waiters();
        let Ok(bytes) = postcard::to_allocvec(&env) else {
            return;
        };
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.topic.clone(), bytes)
        {
            Ok(_) => {
                self.nat.unheard = 0;
                self.nat.published_at = Some(Instant::now());
                self.shared
                    .published
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {
                self.nat.unheard += 1;
                let wait = unheard_retry(self.nat.unheard, self.shared.cfg.status_interval);
                self.nat.publish_at.get_or_insert(Instant::now() + wait);
            }
            // Queues full (a peer far behind) or the like: said again after the gap, not
            // at the next interval (minutes in a large swarm).
            Err(e) => {
                debug!("publishing status: {e}");
                self.nat
                    .publish_at
                    .get_or_insert(Instant::now() + STATUS_GAP);
            }
        }
    }

    fn on_command(&mut self, c: Command) {
        match c {
            Command::Provide(model, reply) => {
                self.providing.insert(model.clone());
                if let Err(e) = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .start_providing(model_key(&model))
                {
                    warn!(%model, "providing: {e}");
                }
                let _ = reply.send(());
            }
            Command::StopProviding(model) => {
                self.providing.remove(&model);
                self.swarm
                    .behaviour_mut()
                    .kad
                    .stop_providing(&model_key(&model));
            }
            Command::Providers {
                model,
                first,
                reply,
            } => {
                if self.in_kad.is_empty() {
                    let deadline = Instant::now() + FIRST_ENTRY_WAIT;
                    self.waiting_lookups.push((model, first, reply, deadline));
                } else {
                    self.start_lookup(&model, first, reply);
                }
            }
            Command::Connect(peer, reply) => {
                if self.swarm.is_connected(&peer) {
                    let _ = reply.send(Ok(()));
                    return;
                }
                let addrs = self.addr_book.get(&peer).cloned().unwrap_or_default();
                if addrs.is_empty() {
                    let _ = reply.send(Err(SwarmError::Unreachable {
                        peer,
                        reason: "no known address".into(),
                    }));
                    return;
                }
                self.nat.autonat.dialing(peer);
                for a in &addrs {
                    self.note_dialed(a);
                }
                let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                    .addresses(addrs)
                    .build();
                match self.swarm.dial(opts) {
                    Ok(()) => self.connect_waiters.entry(peer).or_default().push(reply),
                    Err(e) => {
                        let _ = reply.send(Err(SwarmError::Unreachable {
                            peer,
                            reason: format!("dialing: {e}"),
                        }));
                    }
                }
            }
            Command::AuthDeadline(peer, conn) => {
                // Only for the spell it was set for: a peer that disconnected and came back
                // has its own deadline.
                if self.first_connection.get(&peer).map(|f| f.0) == Some(conn)
                    && self.shared.auth.state(&peer) == PeerAuth::Pending
                {
                    if self.in_kad.remove(&peer) {
                        self.swarm.behaviour_mut().kad.remove_peer(&peer);
                    }
                    warn!(%peer, "did not prove the swarm key within the auth timeout; disconnecting");
                    self.release_held_records(&peer, false);
                    self.shared
                        .auth
                        .set(peer, PeerAuth::Denied("no proof of the swarm key".into()));
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
            }
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.offered());
            }
            Command::CloseRelayed(peer) => self.close_relayed(peer),
            Command::Dial(addrs) => {
                for a in addrs {
                    self.note_dialed(&a);
                    if let Err(e) = self.swarm.dial(a.clone()) {
                        warn!(addr = %a, "dialing a bootstrap peer: {e}");
                    }
                }
            }
            Command::Connected(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Addresses(peer, addrs) => self.learn(peer, addrs),
            Command::AddressesOf(peer, reply) => {
                let _ = reply.send(self.addr_book.get(&peer).cloned().unwrap_or_default());
            }
            Command::Announce => self.publish_status(),
            Command::Shutdown => {}
        }
    }

    fn learn(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        if peer == self.shared.peer_id {
            return;
        }
        let book = self.addr_book.entry(peer).or_default();
        for a in addrs {
            // Kept without the peer's own id (dials add it); the newest first (a peer
            // behind NAT gains its relayed address after the others), at most 16.
            let a = addrs::without_peer(&a);
            book.retain(|b| *b != a);
            book.insert(0, a);
        }
        book.truncate(16);
    }

    fn start_lookup(&mut self, model: &str, first: bool, reply: ProvidersReply) {
        let id = self
            .swarm
            .behaviour_mut()
            .kad
            .get_providers(model_key(model));
        self.provider_queries.insert(
            id,
            ProviderQuery {
                found: HashSet::new(),
                first,
                reply,
            },
        );
    }

    /// Starts the waiting lookups once the routing table has an entry; answers those past
    /// their deadline with nothing found.
    fn run_waiting_lookups(&mut self) {
        let now = Instant::now();
        for (model, first, reply, deadline) in std::mem::take(&mut self.waiting_lookups) {
            if !self.in_kad.is_empty() {
                self.start_lookup(&model, first, reply);
            } else if now >= deadline {
                let _ = reply.send(ProviderLookup::default());
            } else {
                self.waiting_lookups.push((model, first, reply, deadline));
            }
        }
    }

    fn maybe_add_to_kad(&mut self, peer: PeerId) {
        if !self.shared.auth.is_member(&peer) || self.in_kad.contains(&peer) {
            return;
        }
        // An AgentJet peer (identify said so) that serves the DHT (a peer behind NAT is a
        // Kademlia client: asking it would fail), at addresses other peers can dial.
        if self.identified.get(&peer) != Some(&true) {
            return;
        }
        let addrs: Vec<Multiaddr> = self
            .addr_book
            .get(&peer)
            .map(|b| {
                b.iter()
                    .filter(|a| !addrs::is_relayed(a))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if addrs.is_empty() {
            return;
        }
        for a in addrs {
            self.swarm.behaviour_mut().kad.add_address(&peer, a);
        }
        let first = self.in_kad.is_empty();
        self.in_kad.insert(peer);
        if first {
            let _ = self.swarm.behaviour_mut().kad.bootstrap();
            self.run_waiting_lookups();
        }
        // A small table: the new member may be among the closest peers to our records'
        // keys, and they may not be stored anywhere yet (a swarm just started). In a larger
        // one, the periodic refresh (every half TTL) reaches it; re-providing at every join
        // would cost a DHT walk per join per provider.
        if !self.providing.is_empty() && self.in_kad.len() <= K_CLOSE {
            self.reprovide_soon = true;
        }
    }

    fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => self.on_listen_addr(listener_id, address),
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|a| *a != address);
                self.update_reach();
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                addresses,
                reason,
            } => {
                self.listen_addrs.retain(|a| !addresses.contains(a));
                self.on_listener_closed(listener_id, reason.err().map(|e| with_causes(&e)));
                self.update_reach();
            }
            SwarmEvent::ExternalAddrConfirmed { .. } | SwarmEvent::ExternalAddrExpired { .. } => {
                self.update_reach()
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                let kind = if endpoint.is_relayed() {
                    LinkKind::Relayed
                } else {
                    LinkKind::Direct
                };
                let remote = endpoint.get_remote_address().clone();
                self.opened(connection_id, peer_id, kind, remote.clone());
                if endpoint.is_dialer() {
                    self.note_dialed(&remote);
                    self.learn(peer_id, vec![remote]);
                } else if kind == LinkKind::Direct {
                    self.came_in(connection_id, peer_id, &endpoint);
                }
                if let Some(ws) = self.connect_waiters.remove(&peer_id) {
                    for w in ws {
                        let _ = w.send(Ok(()));
                    }
                }
                if num_established.get() == 1 {
                    debug!(me = %self.shared.peer_id, peer = %peer_id, dialer = endpoint.is_dialer(), "connected");
                    self.first_connection
                        .insert(peer_id, (connection_id, Instant::now()));
                    self.shared.auth.connected(&peer_id);
                    if let Some(key) = self.shared.auth.key().cloned() {
                        // We prove on every spell (a peer that forgot us needs it); a
                        // remembered member needs no deadline.
                        self.prove_to(peer_id, &key);
                        if !self.shared.auth.is_member(&peer_id) {
                            let cmd = self.cmd.clone();
                            let t = self.shared.cfg.auth_timeout;
                            self.shared.spawn(async move {
                                tokio::time::sleep(t).await;
                                if let Some(tx) = cmd.upgrade() {
                                    let _ = tx
                                        .send(Command::AuthDeadline(peer_id, connection_id))
                                        .await;
                                }
                            });
                        }
                    }
                }
            }
            SwarmEvent::ConnectionClosed {
                connection_id,
                num_established,
                ..
            } if num_established > 0 => self.closed(connection_id),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                cause,
                ..
            } => {
                self.closed(connection_id);
                // The peer stays in the routing table: a closed connection (idle, or the
                // other end's choice) says nothing of whether it is alive, and a table
                // that emptied with its connections would make every idle timeout a
                // re-bootstrap. It stays a member too (see `auth`: the other end may still
                // be in its old spell of connections when we redial, and would not prove
                // again); it leaves the table when a dial to it fails (below).
                debug!(me = %self.shared.peer_id, peer = %peer_id, ?cause, "disconnected");
                self.shared.auth.disconnected(&peer_id);
                if !self.shared.auth.is_member(&peer_id) {
                    self.release_held_records(&peer_id, false);
                }
                self.first_connection.remove(&peer_id);
                self.proofs_resent.remove(&peer_id);
                self.shared.usage.forget_idle(&peer_id);
            }
            SwarmEvent::Dialing {
                peer_id: Some(peer),
                ..
            } => self.nat.autonat.dialing(peer),
            SwarmEvent::OutgoingConnectionError {
                peer_id: Some(peer),
                error,
                ..
            } => {
                match &error {
                    DialError::Transport(tried) => {
                        for (addr, _) in tried {
                            self.note_dialed(addr);
                        }
                    }
                    DialError::WrongPeerId { address, .. } => self.note_dialed(address),
                    _ => {}
                }
                // Unreachable at every address it gave: out of the routing table, so
                // lookups stop trying it (libp2p's Kademlia alone would keep it until its
                // bucket needed the room).
                // (A failed hole punch or AutoNAT dial-back to a peer still connected says
                // nothing of its addresses.)
                if matches!(
                    error,
                    DialError::Transport(_) | DialError::WrongPeerId { .. }
                ) && !self.swarm.is_connected(&peer)
                    && self.in_kad.remove(&peer)
                {
                    debug!(%peer, "dropped from the routing table: {error}");
                    self.swarm.behaviour_mut().kad.remove_peer(&peer);
                }
                if self.bootstrap.peers().contains(&peer) && !self.swarm.is_connected(&peer) {
                    warn!(%peer, "cannot reach a bootstrap peer (tried again): {error}");
                    self.shared.net_event(NetEvent::Bootstrap {
                        addr: peer.to_string(),
                        error: error.to_string(),
                    });
                }
                if let Some(ws) = self.connect_waiters.remove(&peer) {
                    for w in ws {
                        let _ = w.send(Err(SwarmError::Unreachable {
                            peer,
                            reason: format!("dialing: {error}"),
                        }));
                    }
                }
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id: None,
                error,
                connection_id,
            } => {
                // A bootstrap address without a peer id.
                warn!(
                    ?connection_id,
                    "a dial failed (tried again if a bootstrap peer): {error}"
                );
            }
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                connection_id,
                info,
            })) => {
                if info.protocol_version != IDENTIFY {
                    warn!(peer = %peer_id, protocol = %info.protocol_version, "not an AgentJet peer");
                    return;
                }
                let local = self.local_only
                    || self
                        .conns
                        .get(&connection_id)
                        .is_some_and(|c| addrs::is_local(&c.remote));
                let addrs = addrs::usable(info.listen_addrs, local);
                self.learn(peer_id, addrs);
                let serves_dht = info.protocols.contains(&KAD);
                let was = self.identified.insert(peer_id, serves_dht);
                if was == Some(true) && !serves_dht && self.in_kad.remove(&peer_id) {
                    // It went behind NAT (a Kademlia client now): out of the table.
                    self.swarm.behaviour_mut().kad.remove_peer(&peer_id);
                }
                self.on_identified(peer_id, &info.protocols);
                self.observed_unasked(connection_id, &info.observed_addr);
                self.maybe_add_to_kad(peer_id);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Auth(e)) => self.on_auth(e),
            SwarmEvent::Behaviour(BehaviourEvent::Autonat(e)) => self.on_autonat(e),
            SwarmEvent::Behaviour(BehaviourEvent::AutonatServer(e)) => self.on_autonat_server(e),
            SwarmEvent::Behaviour(BehaviourEvent::RelayClient(e)) => self.on_relay_client(e),
            SwarmEvent::Behaviour(BehaviourEvent::Relay(e)) => self.on_relay(e),
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(e)) => self.on_dcutr(e),
            SwarmEvent::Behaviour(BehaviourEvent::Upnp(e)) => self.on_upnp(e),
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            })) => {
                let verdict = self.check_gossip(&propagation_source, &message);
                let acceptance = match verdict {
                    Ok(()) => MessageAcceptance::Accept,
                    Err(why) => {
                        warn!(from = %propagation_source, "dropped gossip: {why}");
                        MessageAcceptance::Reject
                    }
                };
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .report_message_validation_result(&message_id, &propagation_source, acceptance);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => self.on_kad(e),
            _ => {}
        }
    }

    fn check_gossip(&mut self, from: &PeerId, m: &gossipsub::Message) -> Result<(), BadGossip> {
        if !self.shared.auth.is_member(from) {
            return Err(BadGossip::NotMember(*from));
        }
        let env: StatusEnvelope =
            postcard::from_bytes(&m.data).map_err(|e| BadGossip::Malformed(e.to_string()))?;
        let author =
            PeerId::from_bytes(&env.author).map_err(|e| BadGossip::Malformed(e.to_string()))?;
        if m.source != Some(author) {
            return Err(BadGossip::NotSignedByAuthor {
                author,
                signer: m.source.map_or_else(|| "nobody".into(), |p| p.to_string()),
            });
        }
        if let Some(k) = self.shared.auth.key() {
            match env.mac {
                Some(mac) if mac == k.mac(&env.mac_payload()) => {}
                Some(_) => return Err(BadGossip::Mac(author, "wrong")),
                None => return Err(BadGossip::Mac(author, "no")),
            }
        }
        if author == self.shared.peer_id {
            return Ok(());
        }
        let local = self.local_only
            || self
                .conns
                .values()
                .any(|c| c.peer == author && addrs::is_local(&c.remote));
        let addrs = addrs::usable(
            env.addrs
                .iter()
                .take(16)
                .filter_map(|a| Multiaddr::try_from(a.clone()).ok()),
            local,
        );
        self.learn(author, addrs.clone());
        // Its addresses may be what the routing table waited for (identify carries only
        // confirmed external addresses between hosts).
        if !self.in_kad.contains(&author) {
            self.maybe_add_to_kad(author);
        }
        // Checked before the view's lock is taken (a signature check per status).
        let cert = check_cert(&self.shared.cfg, &author, &env.status);
        let mut v = lock(&self.shared.view);
        let newer = v
            .get(&author)
            .is_none_or(|s| env.seq > s.seq || env.seq == 1);
        if newer {
            v.insert(
                author,
                ViewSlot {
                    cert,
                    status: env.status,
                    addrs,
                    seq: env.seq,
                    at: Instant::now(),
                    published_unix_ms: env.unix_ms,
                    received_unix_ms: unix_ms(),
                },
            );
            self.shared
                .view_changes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.shared.view_changed.notify_waiters();
        }
        Ok(())
    }

    fn store_provider(&mut self, r: kad::ProviderRecord) {
        if let Err(e) = self.swarm.behaviour_mut().kad.store_mut().add_provider(r) {
            warn!("storing a provider record: {e}");
        }
    }

    /// Stores the held provider records of `peer` (it proved the key) or drops them.
    fn release_held_records(&mut self, peer: &PeerId, store: bool) {
        if self.held_records.iter().all(|r| r.provider != *peer) {
            return;
        }
        let (mine, rest) = std::mem::take(&mut self.held_records)
            .into_iter()
            .partition(|r| r.provider == *peer);
        self.held_records = rest;
        for r in mine {
            if store {
                self.store_provider(r);
            } else {
                warn!(provider = %peer, "dropped a provider record from a peer that did not prove the swarm key");
            }
        }
    }

    fn on_kad(&mut self, e: kad::Event) {
        match e {
            kad::Event::InboundRequest {
                request: kad::InboundRequest::AddProvider { record: Some(r) },
            } => {
                match self.shared.auth.state(&r.provider) {
                    PeerAuth::Member => self.store_provider(r),
                    // Its proof may still be on the way: a provider's ADD_PROVIDER to a
                    // peer it just dialed travels beside it. Held until the proof (or
                    // the deadline) decides.
                    PeerAuth::Pending if self.held_records.len() < MAX_HELD_RECORDS => {
                        self.held_records.push(r);
                    }
                    _ => {
                        warn!(provider = %r.provider, "dropped a provider record from a peer that has not proved the swarm key");
                    }
                }
            }
            kad::Event::InboundRequest {
                request: kad::InboundRequest::PutRecord { source, .. },
            } => {
                debug!(%source, "ignored a put-record (AgentJet stores only provider records)");
            }
            kad::Event::OutboundQueryProgressed {
                id,
                result: QueryResult::GetProviders(r),
                step,
                stats,
            } => {
                let Some(entry) = self.provider_queries.get_mut(&id) else {
                    return;
                };
                let mut done = step.last;
                match r {
                    Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) => {
                        entry.found.extend(providers);
                        if entry.first && !entry.found.is_empty() && !done {
                            done = true;
                            if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                                q.finish();
                            }
                        }
                    }
                    Ok(kad::GetProvidersOk::FinishedWithNoAdditionalRecord { .. }) => done = true,
                    Err(e) => {
                        debug!("provider query: {e}");
                        done = true;
                    }
                }
                if done {
                    if let Some(q) = self.provider_queries.remove(&id) {
                        let _ = q.reply.send(ProviderLookup {
                            providers: q.found.into_iter().collect(),
                            requests: stats.num_requests(),
                            answered: stats.num_successes(),
                            duration: stats.duration().unwrap_or_default(),
                        });
                    }
                }
            }
            kad::Event::OutboundQueryProgressed { result, step, .. } if step.last => {
                let kind = match result {
                    QueryResult::Bootstrap(_) => "bootstrap",
                    QueryResult::GetClosestPeers(_) => "closest",
                    QueryResult::StartProviding(_) => "provide",
                    QueryResult::RepublishProvider(_) => "republish-provider",
                    _ => "other",
                };
                tracing::trace!(kind, "kad query done");
            }
            _ => {}
        }
    }
}

impl StatusEnvelope {
    /// The bytes the MAC covers: everything but the MAC.
    pub fn mac_payload(&self) -> Vec<u8> {
        postcard::to_allocvec(&(
            &self.author,
            self.seq,
            self.unix_ms,
            &self.status,
            &self.addrs,
        ))
        .unwrap_or_default()
    }
}

/// An error and its causes, "outer: inner: ...": libp2p's outer messages alone ("Failed to
/// get Reservation.") do not say why.
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
