//! The libp2p node: one event loop task owns the `Swarm` (identify, ping, gossipsub,
//! Kademlia, raw streams); the rest of the program holds a cloneable [`SwarmHandle`] that
//! sends [`Command`]s over a bounded channel (each with a oneshot for its answer) and opens
//! or accepts streams through `libp2p-stream`'s control, which needs no round trip through
//! the loop. Nothing outside the loop touches the swarm.
//!
//! Discovery: Kademlia (protocol `/agentjet/kad/1`) in server mode, with manual routing
//! table inserts: a peer enters the table only after it proved the swarm key and identify
//! told us its listen addresses. A served model is a provider record under
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
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance};
use libp2p::identity::Keypair;
use libp2p::kad::{
    self, store::MemoryStore, store::RecordStore, BucketInserts, Mode, QueryId, QueryResult,
    StoreInserts,
};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{identify, noise, ping, tcp, yamux, Multiaddr, PeerId, Stream, StreamProtocol, Swarm};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::auth::{AuthTable, PeerAuth, SwarmKey};
use super::frame::{read_frame, write_frame, FrameError};
use super::protocol::{
    Admission, AuthProof, AuthVerdict, ModelStatus, PeerStatus, Role, StatusEnvelope, AUTH,
    IDENTIFY, KAD, STATUS_TOPIC,
};
use super::SwarmError;

/// Everything the node needs; every bound and timeout is here.
#[derive(Debug, Clone)]
pub struct SwarmConfig {
    pub role: Role,
    pub keypair: Keypair,
    pub listen: Vec<Multiaddr>,
    pub bootstrap: Vec<Multiaddr>,
    pub swarm_key: Option<SwarmKey>,
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
    /// Frames larger than this are refused.
    pub max_frame_bytes: usize,
    /// Streams one peer may have open with us at once, per protocol.
    pub max_streams_per_peer: usize,
    /// New streams per second one peer may open (sustained), and the burst above it.
    pub max_requests_per_s: f64,
    pub request_burst: f64,
    pub kad_server: bool,
}

impl SwarmConfig {
    pub fn new(role: Role, keypair: Keypair) -> SwarmConfig {
        SwarmConfig {
            role,
            keypair,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            swarm_key: None,
            provider_ttl: Duration::from_secs(30),
            status_interval: Duration::from_secs(2),
            rebootstrap_interval: Duration::from_secs(30),
            auth_timeout: Duration::from_secs(10),
            open_timeout: Duration::from_secs(15),
            quic_idle_timeout: Duration::from_secs(3),
            quic_stream_window: 16 << 20,
            quic_connection_window: 64 << 20,
            idle_connection_timeout: Duration::from_secs(120),
            max_frame_bytes: 16 << 20,
            max_streams_per_peer: 256,
            max_requests_per_s: 500.0,
            request_burst: 1000.0,
            kad_server: true,
        }
    }
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    gossipsub: gossipsub::Behaviour,
    kad: kad::Behaviour<MemoryStore>,
    stream: libp2p_stream::Behaviour,
}

/// One peer in the live view.
#[derive(Debug, Clone)]
pub struct ViewEntry {
    pub peer: PeerId,
    pub status: PeerStatus,
    pub addrs: Vec<Multiaddr>,
    pub age: Duration,
    pub is_self: bool,
}

struct ViewSlot {
    status: PeerStatus,
    addrs: Vec<Multiaddr>,
    seq: u64,
    at: Instant,
}

type ProvidersReply = oneshot::Sender<Result<Vec<PeerId>, String>>;

enum Command {
    Provide(String, oneshot::Sender<()>),
    StopProviding(String),
    Providers(String, oneshot::Sender<Result<Vec<PeerId>, String>>),
    Connect(PeerId, oneshot::Sender<Result<(), String>>),
    Authed(PeerId, PeerAuth),
    AuthDeadline(PeerId),
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Connected(oneshot::Sender<Vec<PeerId>>),
    Addresses(PeerId, Vec<Multiaddr>),
}

/// Rate buckets kept before the refilled ones are pruned.
const MAX_IDLE_BUCKETS: usize = 1024;

/// Per-peer admission bounds (concurrent streams, request rate).
#[derive(Default)]
struct Limits {
    open: HashMap<(PeerId, &'static str), usize>,
    buckets: RateTable,
}

/// A token bucket per peer: `burst` requests at once, refilled at `rate` per second.
#[derive(Default)]
struct RateTable {
    buckets: HashMap<PeerId, (f64, Instant)>,
}

impl RateTable {
    /// Takes one request of `peer`'s bucket at `now`, or says why not.
    fn take(&mut self, peer: &PeerId, now: Instant, rate: f64, burst: f64) -> Result<(), String> {
        let level =
            |b: &(f64, Instant)| b.0 + rate * now.saturating_duration_since(b.1).as_secs_f64();
        if self.buckets.len() >= MAX_IDLE_BUCKETS {
            // A bucket that has refilled is the same as none: forget those, so peers that
            // came and went (or a stream of fresh peer ids) do not grow the table.
            self.buckets.retain(|_, b| level(b) < burst);
        }
        let b = self.buckets.entry(*peer).or_insert((burst, now));
        b.0 = level(b).min(burst);
        b.1 = now;
        if b.0 < 1.0 {
            return Err(format!(
                "over the request rate limit ({rate}/s, burst {burst})"
            ));
        }
        b.0 -= 1.0;
        Ok(())
    }
}

#[cfg(test)]
mod rate_tests {
    use super::*;

    #[test]
    fn buckets_refuse_past_the_burst_refill_and_idle_ones_are_forgotten() {
        let t0 = Instant::now();
        let mut t = RateTable::default();
        let p = PeerId::random();
        for _ in 0..3 {
            t.take(&p, t0, 1.0, 3.0).unwrap();
        }
        let e = t.take(&p, t0, 1.0, 3.0).unwrap_err();
        assert!(e.contains("rate limit (1/s, burst 3)"), "{e}");
        t.take(&p, t0 + Duration::from_millis(1100), 1.0, 3.0)
            .unwrap();
        // 3000 one-off peers: the table stays bounded once their buckets refilled.
        for i in 0..3000u64 {
            let now = t0 + Duration::from_secs(10 + i * 5);
            t.take(&PeerId::random(), now, 1.0, 3.0).unwrap();
        }
        assert!(t.buckets.len() <= MAX_IDLE_BUCKETS, "{}", t.buckets.len());
        // Buckets still draining are kept: a busy peer's survives the pruning.
        let busy = PeerId::random();
        let late = t0 + Duration::from_secs(100_000);
        for _ in 0..3 {
            t.take(&busy, late, 1.0, 3.0).unwrap();
        }
        for _ in 0..2 * MAX_IDLE_BUCKETS {
            t.take(&PeerId::random(), late, 1.0, 3.0).unwrap();
        }
        assert!(
            t.buckets.len() > 2 * MAX_IDLE_BUCKETS,
            "draining buckets are kept"
        );
        assert!(
            t.take(&busy, late, 1.0, 3.0).is_err(),
            "its bucket was not reset"
        );
    }
}

/// The handle the rest of the program holds.
#[derive(Clone)]
pub struct SwarmHandle {
    pub peer_id: PeerId,
    keypair: Keypair,
    cmd: mpsc::Sender<Command>,
    control: libp2p_stream::Control,
    pub auth: Arc<AuthTable>,
    view: Arc<Mutex<HashMap<PeerId, ViewSlot>>>,
    status: Arc<Mutex<PeerStatus>>,
    limits: Arc<Mutex<Limits>>,
    pub cfg: Arc<SwarmConfig>,
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

/// Starts the node on the current tokio runtime: binds every listen address (an error if
/// one cannot be bound), dials the bootstrap peers, and returns the handle.
pub async fn spawn_node(cfg: SwarmConfig) -> Result<SwarmHandle, SwarmError> {
    let cfg = Arc::new(cfg);
    let keypair = cfg.keypair.clone();
    let peer_id = keypair.public().to_peer_id();
    let c = cfg.clone();
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
        .with_behaviour(|key| {
            let gs_cfg = gossipsub::ConfigBuilder::default()
                .heartbeat_interval(Duration::from_millis(500))
                .validation_mode(gossipsub::ValidationMode::Strict)
                .validate_messages()
                .max_transmit_size(64 * 1024)
                .build()
                .map_err(|e| e.to_string())?;
            let gossipsub = gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Signed(key.clone()),
                gs_cfg,
            )
            .map_err(|e| e.to_string())?;
            let mut kcfg = kad::Config::new(KAD);
            kcfg.set_provider_record_ttl(Some(c.provider_ttl))
                .set_provider_publication_interval(None)
                .set_record_filtering(StoreInserts::FilterBoth)
                .set_kbucket_inserts(BucketInserts::Manual)
                .set_query_timeout(Duration::from_secs(10))
                .set_periodic_bootstrap_interval(None);
            let mut kad = kad::Behaviour::with_config(peer_id, MemoryStore::new(peer_id), kcfg);
            kad.set_mode(Some(if c.kad_server {
                Mode::Server
            } else {
                Mode::Client
            }));
            Ok(Behaviour {
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY.into(), key.public())
                        .with_agent_version(format!("agentjet/{}", env!("CARGO_PKG_VERSION")))
                        .with_push_listen_addr_updates(true),
                ),
                ping: ping::Behaviour::new(
                    ping::Config::new().with_interval(Duration::from_secs(5)),
                ),
                gossipsub,
                kad,
                stream: libp2p_stream::Behaviour::new(),
            })
        })
        .map_err(|e| SwarmError::Setup(format!("behaviour: {e}")))?
        .with_swarm_config(|s| s.with_idle_connection_timeout(c.idle_connection_timeout))
        .build();

    let topic = IdentTopic::new(STATUS_TOPIC);
    swarm
        .behaviour_mut()
        .gossipsub
        .subscribe(&topic)
        .map_err(|e| SwarmError::Setup(format!("subscribing to the status topic: {e}")))?;
    for addr in &cfg.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| SwarmError::Setup(format!("listening on {addr}: {e}")))?;
    }
    let control = swarm.behaviour().stream.new_control();
    let auth = Arc::new(AuthTable::new(cfg.swarm_key.clone()));
    let (tx, rx) = mpsc::channel(1024);
    let handle = SwarmHandle {
        peer_id,
        keypair,
        cmd: tx,
        control,
        auth,
        view: Arc::new(Mutex::new(HashMap::new())),
        status: Arc::new(Mutex::new(PeerStatus {
            role: cfg.role,
            models: Vec::new(),
            load: 0.0,
            queue_depth: 0,
            free_kv_positions: 0,
            episodes: 0,
            version: env!("CARGO_PKG_VERSION").to_string(),
            extra: Default::default(),
        })),
        limits: Arc::new(Mutex::new(Limits::default())),
        cfg: cfg.clone(),
    };
    handle.accept_auth()?;

    // Wait for every listener to report its address (or fail), so the caller can print them.
    let mut pending_listeners = cfg.listen.len();
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while pending_listeners > 0 {
        let ev = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| SwarmError::Setup("listeners did not come up within 10 s".into()))?;
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                swarm.add_external_address(address.clone());
                listen_addrs.push(address);
                pending_listeners -= 1;
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
    for addr in &cfg.bootstrap {
        if let Err(e) = swarm.dial(addr.clone()) {
            warn!(%addr, "dialing bootstrap peer: {e}");
        }
    }
    let ev = EventLoop {
        swarm,
        rx,
        handle: handle.clone(),
        topic,
        listen_addrs,
        addr_book: HashMap::new(),
        identified: HashMap::new(),
        in_kad: HashSet::new(),
        providing: HashSet::new(),
        provider_queries: HashMap::new(),
        connect_waiters: HashMap::new(),
        seq: 0,
        reprovide_soon: false,
    };
    tokio::spawn(ev.run());
    Ok(handle)
}

struct EventLoop {
    swarm: Swarm<Behaviour>,
    rx: mpsc::Receiver<Command>,
    handle: SwarmHandle,
    topic: IdentTopic,
    listen_addrs: Vec<Multiaddr>,
    addr_book: HashMap<PeerId, Vec<Multiaddr>>,
    identified: HashMap<PeerId, Vec<Multiaddr>>,
    in_kad: HashSet<PeerId>,
    providing: HashSet<String>,
    provider_queries: HashMap<QueryId, (HashSet<PeerId>, ProvidersReply)>,
    connect_waiters: HashMap<PeerId, Vec<oneshot::Sender<Result<(), String>>>>,
    seq: u64,
    reprovide_soon: bool,
}

impl EventLoop {
    async fn run(mut self) {
        let cfg = self.handle.cfg.clone();
        let mut status_tick = tokio::time::interval(cfg.status_interval);
        let mut reprovide_tick = tokio::time::interval(cfg.provider_ttl / 2);
        let mut bootstrap_tick = tokio::time::interval(cfg.rebootstrap_interval);
        let mut soon_tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                ev = self.swarm.select_next_some() => self.on_swarm_event(ev),
                cmd = self.rx.recv() => match cmd {
                    Some(c) => self.on_command(c),
                    None => return,
                },
                _ = status_tick.tick() => self.publish_status(),
                _ = reprovide_tick.tick() => self.reprovide(),
                _ = soon_tick.tick() => {
                    if self.reprovide_soon {
                        self.reprovide_soon = false;
                        self.reprovide();
                    }
                }
                _ = bootstrap_tick.tick() => {
                    if !self.in_kad.is_empty() {
                        let _ = self.swarm.behaviour_mut().kad.bootstrap();
                    }
                }
            }
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

    fn publish_status(&mut self) {
        let status = match self.handle.status.lock() {
            Ok(s) => s.clone(),
            Err(_) => return,
        };
        self.seq += 1;
        let mut env = StatusEnvelope {
            author: self.handle.peer_id.to_bytes(),
            seq: self.seq,
            unix_ms: unix_ms(),
            status: status.clone(),
            addrs: self.listen_addrs.iter().map(|a| a.to_vec()).collect(),
            mac: None,
        };
        if let Some(k) = self.handle.auth.key() {
            env.mac = Some(k.mac(&env.mac_payload()));
        }
        if let Ok(mut v) = self.handle.view.lock() {
            v.insert(
                self.handle.peer_id,
                ViewSlot {
                    status,
                    addrs: self.listen_addrs.clone(),
                    seq: self.seq,
                    at: Instant::now(),
                },
            );
        }
        let Ok(bytes) = postcard::to_allocvec(&env) else {
            return;
        };
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.topic.clone(), bytes)
        {
            Ok(_) | Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {}
            Err(e) => debug!("publishing status: {e}"),
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
            Command::Providers(model, reply) => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_providers(model_key(&model));
                self.provider_queries.insert(id, (HashSet::new(), reply));
            }
            Command::Connect(peer, reply) => {
                if self.swarm.is_connected(&peer) {
                    let _ = reply.send(Ok(()));
                    return;
                }
                let addrs = self.addr_book.get(&peer).cloned().unwrap_or_default();
                if addrs.is_empty() {
                    let _ = reply.send(Err(format!("no known address for {peer}")));
                    return;
                }
                let opts = libp2p::swarm::dial_opts::DialOpts::peer_id(peer)
                    .addresses(addrs)
                    .build();
                match self.swarm.dial(opts) {
                    Ok(()) => self.connect_waiters.entry(peer).or_default().push(reply),
                    Err(e) => {
                        let _ = reply.send(Err(format!("dialing {peer}: {e}")));
                    }
                }
            }
            Command::Authed(peer, state) => {
                self.handle.auth.set(peer, state.clone());
                match state {
                    PeerAuth::Member => self.maybe_add_to_kad(peer),
                    PeerAuth::Denied(why) => {
                        warn!(%peer, "refused: {why}; disconnecting");
                        let _ = self.swarm.disconnect_peer_id(peer);
                    }
                    PeerAuth::Pending => {}
                }
            }
            Command::AuthDeadline(peer) => {
                if self.swarm.is_connected(&peer)
                    && self.handle.auth.state(&peer) == PeerAuth::Pending
                {
                    warn!(%peer, "did not prove the swarm key within the auth timeout; disconnecting");
                    self.handle
                        .auth
                        .set(peer, PeerAuth::Denied("no proof of the swarm key".into()));
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
            }
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.listen_addrs.clone());
            }
            Command::Connected(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Addresses(peer, addrs) => self.learn(peer, addrs),
        }
    }

    fn learn(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        if peer == self.handle.peer_id {
            return;
        }
        let book = self.addr_book.entry(peer).or_default();
        for a in addrs {
            if !book.contains(&a) {
                book.push(a);
            }
        }
        book.truncate(16);
    }

    fn maybe_add_to_kad(&mut self, peer: PeerId) {
        if !self.handle.auth.is_member(&peer) || self.in_kad.contains(&peer) {
            return;
        }
        let Some(addrs) = self.identified.get(&peer).cloned() else {
            return;
        };
        for a in addrs {
            self.swarm.behaviour_mut().kad.add_address(&peer, a);
        }
        let first = self.in_kad.is_empty();
        self.in_kad.insert(peer);
        if first {
            let _ = self.swarm.behaviour_mut().kad.bootstrap();
        }
        if !self.providing.is_empty() {
            self.reprovide_soon = true;
        }
    }

    fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                self.swarm.add_external_address(address.clone());
                if !self.listen_addrs.contains(&address) {
                    self.listen_addrs.push(address);
                }
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                endpoint,
                num_established,
                ..
            } => {
                if endpoint.is_dialer() {
                    self.learn(peer_id, vec![endpoint.get_remote_address().clone()]);
                }
                if let Some(ws) = self.connect_waiters.remove(&peer_id) {
                    for w in ws {
                        let _ = w.send(Ok(()));
                    }
                }
                if num_established.get() == 1 {
                    debug!(peer = %peer_id, "connected");
                    if let Some(key) = self.handle.auth.key().cloned() {
                        let h = self.handle.clone();
                        tokio::spawn(async move { h.prove(peer_id, key).await });
                        let tx = self.handle.cmd.clone();
                        let t = self.handle.cfg.auth_timeout;
                        tokio::spawn(async move {
                            tokio::time::sleep(t).await;
                            let _ = tx.send(Command::AuthDeadline(peer_id)).await;
                        });
                    }
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                cause,
                ..
            } => {
                debug!(peer = %peer_id, ?cause, "disconnected");
                self.handle.auth.forget(&peer_id);
                if self.in_kad.remove(&peer_id) {
                    self.swarm.behaviour_mut().kad.remove_peer(&peer_id);
                }
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id: Some(peer),
                error,
                ..
            } => {
                if let Some(ws) = self.connect_waiters.remove(&peer) {
                    for w in ws {
                        let _ = w.send(Err(format!("dialing {peer}: {error}")));
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                if info.protocol_version != IDENTIFY {
                    warn!(peer = %peer_id, protocol = %info.protocol_version, "not an AgentJet peer");
                    return;
                }
                let addrs: Vec<Multiaddr> = info.listen_addrs.into_iter().take(16).collect();
                self.learn(peer_id, addrs.clone());
                self.identified.insert(peer_id, addrs);
                self.maybe_add_to_kad(peer_id);
            }
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

    fn check_gossip(&mut self, from: &PeerId, m: &gossipsub::Message) -> Result<(), String> {
        if !self.handle.auth.is_member(from) {
            return Err(format!(
                "forwarded by {from}, which has not proved the swarm key"
            ));
        }
        let env: StatusEnvelope =
            postcard::from_bytes(&m.data).map_err(|e| format!("malformed status: {e}"))?;
        let author = PeerId::from_bytes(&env.author).map_err(|e| format!("bad author: {e}"))?;
        if m.source != Some(author) {
            return Err(format!(
                "status of {author} not signed by it ({:?})",
                m.source
            ));
        }
        if let Some(k) = self.handle.auth.key() {
            match env.mac {
                Some(mac) if mac == k.mac(&env.mac_payload()) => {}
                Some(_) => return Err(format!("status of {author}: wrong swarm key MAC")),
                None => return Err(format!("status of {author}: no swarm key MAC")),
            }
        }
        if author == self.handle.peer_id {
            return Ok(());
        }
        let addrs: Vec<Multiaddr> = env
            .addrs
            .iter()
            .take(16)
            .filter_map(|a| Multiaddr::try_from(a.clone()).ok())
            .collect();
        self.learn(author, addrs.clone());
        if let Ok(mut v) = self.handle.view.lock() {
            let newer = v
                .get(&author)
                .is_none_or(|s| env.seq > s.seq || env.seq == 1);
            if newer {
                v.insert(
                    author,
                    ViewSlot {
                        status: env.status,
                        addrs,
                        seq: env.seq,
                        at: Instant::now(),
                    },
                );
            }
        }
        Ok(())
    }

    fn on_kad(&mut self, e: kad::Event) {
        match e {
            kad::Event::InboundRequest {
                request: kad::InboundRequest::AddProvider { record: Some(r) },
            } => {
                if self.handle.auth.is_member(&r.provider) {
                    if let Err(e) = self.swarm.behaviour_mut().kad.store_mut().add_provider(r) {
                        warn!("storing a provider record: {e}");
                    }
                } else {
                    warn!(provider = %r.provider, "dropped a provider record from a peer that has not proved the swarm key");
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
                ..
            } => {
                let Some(entry) = self.provider_queries.get_mut(&id) else {
                    return;
                };
                let mut done = step.last;
                match r {
                    Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) => {
                        entry.0.extend(providers)
                    }
                    Ok(kad::GetProvidersOk::FinishedWithNoAdditionalRecord { .. }) => done = true,
                    Err(e) => {
                        debug!("provider query: {e}");
                        done = true;
                    }
                }
                if done {
                    if let Some((found, reply)) = self.provider_queries.remove(&id) {
                        let _ = reply.send(Ok(found.into_iter().collect()));
                    }
                }
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

impl SwarmHandle {
    async fn send(&self, c: Command) -> Result<(), SwarmError> {
        self.cmd.send(c).await.map_err(|_| SwarmError::Stopped)
    }

    /// Announces (and keeps re-announcing) that this peer serves `model`.
    pub async fn provide(&self, model: &str) -> Result<(), SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Provide(model.to_string(), tx)).await?;
        rx.await.map_err(|_| SwarmError::Stopped)
    }

    pub async fn stop_providing(&self, model: &str) -> Result<(), SwarmError> {
        self.send(Command::StopProviding(model.to_string())).await
    }

    /// The providers of `model` the DHT knows now (one query).
    pub async fn providers(&self, model: &str) -> Result<Vec<PeerId>, SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Providers(model.to_string(), tx)).await?;
        rx.await
            .map_err(|_| SwarmError::Stopped)?
            .map_err(SwarmError::Dht)
    }

    /// This peer's listen addresses, each ending in `/p2p/<peer id>`.
    pub async fn listen_addrs(&self) -> Vec<Multiaddr> {
        let (tx, rx) = oneshot::channel();
        if self.send(Command::ListenAddrs(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await
            .unwrap_or_default()
            .into_iter()
            .map(|a| a.with_p2p(self.peer_id).unwrap_or_else(|a| a))
            .collect()
    }

    pub async fn connected_peers(&self) -> Vec<PeerId> {
        let (tx, rx) = oneshot::channel();
        if self.send(Command::Connected(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Tells the address book where `peer` listens.
    pub async fn add_addresses(&self, peer: PeerId, addrs: Vec<Multiaddr>) {
        let _ = self.send(Command::Addresses(peer, addrs)).await;
    }

    /// Connects to `peer` (through the address book) unless connected already.
    pub async fn connect(&self, peer: PeerId) -> Result<(), SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Connect(peer, tx)).await?;
        match tokio::time::timeout(self.cfg.open_timeout, rx).await {
            Err(_) => Err(SwarmError::Timeout(format!("connecting to {peer}"))),
            Ok(Err(_)) => Err(SwarmError::Stopped),
            Ok(Ok(r)) => r.map_err(|e| SwarmError::Unreachable { peer, reason: e }),
        }
    }

    /// Updates what this peer gossips.
    pub fn set_status(&self, f: impl FnOnce(&mut PeerStatus)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }

    pub fn set_models(&self, models: Vec<ModelStatus>) {
        self.set_status(|s| s.models = models);
    }

    /// The live view: every peer heard from within three status intervals (this one too).
    pub fn view(&self) -> Vec<ViewEntry> {
        let expiry = self.cfg.status_interval * 3;
        let Ok(v) = self.view.lock() else {
            return Vec::new();
        };
        let mut out: Vec<ViewEntry> = v
            .iter()
            .filter(|(_, s)| s.at.elapsed() <= expiry)
            .map(|(p, s)| ViewEntry {
                peer: *p,
                status: s.status.clone(),
                addrs: s.addrs.clone(),
                age: s.at.elapsed(),
                is_self: *p == self.peer_id,
            })
            .collect();
        out.sort_by_key(|e| e.peer.to_string());
        out
    }

    /// Signs a digest with this peer's key.
    pub fn sign(&self, digest: &[u8; 32]) -> Vec<u8> {
        super::sign::sign(&self.keypair, digest)
    }

    /// Opens a stream to `peer` and reads its [`Admission`].
    pub async fn open(&self, peer: PeerId, protocol: StreamProtocol) -> Result<Stream, SwarmError> {
        if peer == self.peer_id {
            return Err(SwarmError::Protocol(
                "a peer cannot open a stream to itself".into(),
            ));
        }
        let _ = self.connect(peer).await;
        let mut control = self.control.clone();
        let t = self.cfg.open_timeout;
        let mut s = tokio::time::timeout(t, control.open_stream(peer, protocol.clone()))
            .await
            .map_err(|_| SwarmError::Timeout(format!("opening {protocol} to {peer}")))?
            .map_err(|e| SwarmError::Unreachable {
                peer,
                reason: format!("{protocol}: {e}"),
            })?;
        let adm: Admission =
            tokio::time::timeout(t + self.cfg.auth_timeout, read_frame(&mut s, 4096))
                .await
                .map_err(|_| SwarmError::Timeout(format!("admission on {protocol} from {peer}")))?
                .map_err(|e| SwarmError::Unreachable {
                    peer,
                    reason: e.to_string(),
                })?;
        match adm {
            Admission::Accepted => Ok(s),
            Admission::Refused(reason) => Err(SwarmError::Refused { peer, reason }),
        }
    }

    /// Serves `protocol`: every inbound stream is admitted (swarm key, concurrent streams
    /// per peer, request rate: a refusal is written to the stream and logged) and handed
    /// to `handler` on its own task; a handler's error is logged with the peer.
    pub fn serve<H, F>(&self, protocol: StreamProtocol, handler: H) -> Result<(), SwarmError>
    where
        H: Fn(PeerId, Stream) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), String>> + Send + 'static,
    {
        let mut control = self.control.clone();
        let mut incoming = control
            .accept(protocol.clone())
            .map_err(|e| SwarmError::Setup(format!("{protocol}: {e}")))?;
        let h = self.clone();
        let handler = Arc::new(handler);
        let name: &'static str = Box::leak(protocol.to_string().into_boxed_str());
        tokio::spawn(async move {
            while let Some((peer, mut stream)) = incoming.next().await {
                let h = h.clone();
                let handler = handler.clone();
                tokio::spawn(async move {
                    let limit = h.cfg.max_frame_bytes;
                    if let Err(why) = h.admit(&peer, name).await {
                        warn!(%peer, protocol = name, "refused: {why}");
                        let _ = write_frame(&mut stream, &Admission::Refused(why), limit).await;
                        return;
                    }
                    let _guard = OpenGuard {
                        h: h.clone(),
                        peer,
                        name,
                    };
                    if write_frame(&mut stream, &Admission::Accepted, limit)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    if let Err(e) = handler(peer, stream).await {
                        warn!(%peer, protocol = name, "{e}");
                    }
                });
            }
        });
        Ok(())
    }

    async fn admit(&self, peer: &PeerId, name: &'static str) -> Result<(), String> {
        self.auth.wait_member(peer, self.cfg.auth_timeout).await?;
        let mut l = self
            .limits
            .lock()
            .map_err(|_| "internal: limits lock".to_string())?;
        let now = Instant::now();
        let (rate, burst) = (self.cfg.max_requests_per_s, self.cfg.request_burst);
        l.buckets.take(peer, now, rate, burst)?;
        let open = l.open.entry((*peer, name)).or_insert(0);
        if *open >= self.cfg.max_streams_per_peer {
            return Err(format!(
                "too many concurrent {name} streams (limit {})",
                self.cfg.max_streams_per_peer
            ));
        }
        *open += 1;
        Ok(())
    }

    /// Sends our proof of the swarm key to `peer`.
    async fn prove(&self, peer: PeerId, key: SwarmKey) {
        let proof = AuthProof {
            proof: key.proof(&self.peer_id, &peer),
        };
        let mut control = self.control.clone();
        let r: Result<AuthVerdict, String> = async {
            let mut s =
                tokio::time::timeout(self.cfg.auth_timeout, control.open_stream(peer, AUTH))
                    .await
                    .map_err(|_| "timed out".to_string())?
                    .map_err(|e| e.to_string())?;
            write_frame(&mut s, &proof, 1024)
                .await
                .map_err(|e| e.to_string())?;
            tokio::time::timeout(self.cfg.auth_timeout, read_frame(&mut s, 4096))
                .await
                .map_err(|_| "timed out".to_string())?
                .map_err(|e: FrameError| e.to_string())
        }
        .await;
        match r {
            Ok(AuthVerdict::Accepted) => debug!(%peer, "accepted our swarm key proof"),
            Ok(AuthVerdict::Denied(why)) => warn!(%peer, "denied our swarm key proof: {why}"),
            Err(e) => debug!(%peer, "sending swarm key proof: {e}"),
        }
    }

    /// Verifies the proofs peers send (closed swarm), or accepts everyone (open swarm).
    fn accept_auth(&self) -> Result<(), SwarmError> {
        let mut control = self.control.clone();
        let mut incoming = control
            .accept(AUTH)
            .map_err(|e| SwarmError::Setup(format!("{AUTH}: {e}")))?;
        let h = self.clone();
        tokio::spawn(async move {
            while let Some((peer, mut stream)) = incoming.next().await {
                let h = h.clone();
                tokio::spawn(async move {
                    let got = tokio::time::timeout(
                        h.cfg.auth_timeout,
                        read_frame::<_, AuthProof>(&mut stream, 1024),
                    )
                    .await;
                    let verdict = match (&got, h.auth.key()) {
                        (_, None) => AuthVerdict::Accepted,
                        (Ok(Ok(p)), Some(k)) if p.proof == k.proof(&peer, &h.peer_id) => {
                            AuthVerdict::Accepted
                        }
                        (Ok(Ok(_)), Some(_)) => AuthVerdict::Denied("wrong swarm key".into()),
                        (Ok(Err(e)), Some(_)) => AuthVerdict::Denied(format!("bad proof: {e}")),
                        (Err(_), Some(_)) => {
                            AuthVerdict::Denied("no proof within the auth timeout".into())
                        }
                    };
                    let _ = write_frame(&mut stream, &verdict, 1024).await;
                    if h.auth.key().is_some() {
                        let state = match verdict {
                            AuthVerdict::Accepted => {
                                info!(%peer, "proved the swarm key");
                                PeerAuth::Member
                            }
                            AuthVerdict::Denied(why) => PeerAuth::Denied(why),
                        };
                        let _ = h.send(Command::Authed(peer, state)).await;
                    } else {
                        let _ = h.send(Command::Authed(peer, PeerAuth::Member)).await;
                    }
                });
            }
        });
        Ok(())
    }
}

/// Releases a peer's concurrent-stream slot when a served stream ends.
struct OpenGuard {
    h: SwarmHandle,
    peer: PeerId,
    name: &'static str,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if let Ok(mut l) = self.h.limits.lock() {
            let key = (self.peer, self.name);
            if let Some(n) = l.open.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    l.open.remove(&key);
                }
            }
        }
    }
}
