//! Reachability: whether other hosts can dial this peer, and what a peer behind NAT does
//! about it.
//!
//! - [`Reachability`] is what a peer knows of itself: public (another host dialed it
//!   back at an address, AutoNAT; or the user said so, `--external-addr`), relayed
//!   (behind NAT or a firewall, with a reservation on a relay), unreachable (behind NAT
//!   with no reservation yet), local (it listens on loopback alone), or not known yet.
//! - [`Relays`] decides where a peer that is not public reserves a relay slot (one on a
//!   bootstrap peer, then the public peers the view shows offering relay service, closest
//!   to its own id first), how many at once, and when it tries again after a refusal.
//! - [`LinkKind`] says how two peers are connected: directly, directly through a hole
//!   punched in both NATs (DCUtR), or through a relay.
//!
//! Owns: those decisions, as plain state a test can drive. Never touches the `Swarm`
//! (`swarm::node` carries them out).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

/// What a peer knows of its own reachability (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Reachability {
    #[default]
    Unknown,
    /// Listens on loopback only: a swarm of this host.
    Local,
    Public,
    Relayed,
    Unreachable,
}

impl Reachability {
    pub fn as_str(self) -> &'static str {
        match self {
            Reachability::Unknown => "unknown",
            Reachability::Local => "local",
            Reachability::Public => "public",
            Reachability::Relayed => "relayed",
            Reachability::Unreachable => "unreachable",
        }
    }

    pub fn parse(s: &str) -> Option<Reachability> {
        Some(match s {
            "unknown" => Reachability::Unknown,
            "local" => Reachability::Local,
            "public" => Reachability::Public,
            "relayed" => Reachability::Relayed,
            "unreachable" => Reachability::Unreachable,
            _ => return None,
        })
    }

    /// Whether other hosts can dial it at a direct address (so it may serve the DHT and
    /// relay for others).
    pub fn dialable(self) -> bool {
        matches!(self, Reachability::Public | Reachability::Local)
    }
}

/// How a connection between two peers runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// One peer dialed the other's address.
    Direct,
    /// Both dialed at once through their NATs, arranged over a relayed connection (DCUtR).
    HolePunched,
    /// Through a relay (circuit relay v2).
    Relayed,
}

impl LinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LinkKind::Direct => "direct",
            LinkKind::HolePunched => "hole_punched",
            LinkKind::Relayed => "relayed",
        }
    }
}

/// What happened to the node's network, for the roles to pass on as typed events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "net", rename_all = "snake_case")]
pub enum NetEvent {
    /// Its reachability changed; `addrs`: what it offers other peers now (first: the one
    /// to give another host).
    Reachability {
        status: Reachability,
        addrs: Vec<String>,
    },
    /// The addresses it offers other peers changed (its reachability did not).
    Addresses { addrs: Vec<String> },
    /// A connection to `peer` opened.
    Connected {
        peer: String,
        kind: LinkKind,
        addr: String,
    },
    /// A connection to `peer` closed.
    Closed { peer: String, kind: LinkKind },
    /// A relay took (or refused) this peer's reservation.
    Reservation {
        relay: String,
        ok: bool,
        error: Option<String>,
    },
    /// A hole punch to `peer` (over a relayed connection) ended; `addr`: the direct
    /// connection's other end when it worked (that connection is now hole-punched).
    HolePunch {
        peer: String,
        ok: bool,
        error: Option<String>,
        addr: Option<String>,
    },
    /// A bootstrap address resolved to nothing or could not be dialed (retried).
    Bootstrap { addr: String, error: String },
}

impl NetEvent {
    /// The line a person sees for this event, for those worth a line (connections opening
    /// and closing are not).
    pub fn line(&self) -> Option<String> {
        Some(match self {
            NetEvent::Reachability { status, addrs } => match (status, addrs.first()) {
                (Reachability::Public, Some(a)) => {
                    format!("reachability: public; other hosts reach this peer at {a}")
                }
                (Reachability::Relayed, _) => format!(
                    "reachability: behind NAT; other hosts reach this peer through a relay{}",
                    addrs
                        .iter()
                        .find(|a| a.contains("p2p-circuit"))
                        .map(|a| format!(" at {a}"))
                        .unwrap_or_default()
                ),
                (Reachability::Unreachable, _) => {
                    "reachability: behind NAT, no relay reservation yet (other hosts cannot dial this peer)".to_string()
                }
                _ => return None,
            },
            NetEvent::Reservation {
                relay,
                ok: false,
                error,
            } => format!(
                "relay {relay} refused a reservation: {} (asked again later)",
                error.as_deref().unwrap_or("no reason")
            ),
            NetEvent::HolePunch {
                peer, ok: true, ..
            } => format!("hole punched to {peer}: a direct connection"),
            NetEvent::Bootstrap { addr, error } => {
                format!("bootstrap peer {addr}: {error} (tried again)")
            }
            _ => return None,
        })
    }
}

/// Relay reservations kept at once by a peer behind NAT.
pub const RESERVATIONS: usize = 2;
/// The first wait before a refused reservation is asked again; doubled at each refusal
/// in a row, at most [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(2);
pub const RETRY_MAX: Duration = Duration::from_secs(60);

/// The XOR of two peer ids' bytes, compared as a number (Kademlia compares the hashes of
/// its keys this way; the ids are already hashes of the peers' keys, or the keys).
fn distance(a: &PeerId, b: &PeerId) -> Vec<u8> {
    let (a, b) = (a.to_bytes(), b.to_bytes());
    a.iter().zip(b.iter()).map(|(x, y)| x ^ y).collect()
}

/// A relay this peer knows.
#[derive(Debug, Clone)]
struct Relay {
    addrs: Vec<Multiaddr>,
    /// A bootstrap peer (tried first).
    bootstrap: bool,
    state: SlotState,
    /// Refusals since the last reservation held.
    refusals: u32,
    /// It said it was full (its reservation limit) when last asked: a bootstrap peer that
    /// did is no longer asked first, so that the peers behind NAT of a large swarm spread
    /// over the other relays instead of asking the bootstrap peers again and again.
    full: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum SlotState {
    /// Not asked (or not to be asked before `at`).
    Idle { at: Instant },
    /// Asked; waiting for the relay's answer.
    Asked,
    /// Holds a reservation.
    Held,
}

/// Where a peer that is not public keeps its relay reservations (see the module docs).
#[derive(Debug, Default)]
pub struct Relays {
    relays: HashMap<PeerId, Relay>,
}

impl Relays {
    /// A relay candidate: `addrs` its direct addresses; `bootstrap` when the user named it.
    pub fn offer(&mut self, peer: PeerId, addrs: Vec<Multiaddr>, bootstrap: bool, now: Instant) {
        let r = self.relays.entry(peer).or_insert(Relay {
            addrs: Vec::new(),
            bootstrap,
            state: SlotState::Idle { at: now },
            refusals: 0,
            full: false,
        });
        r.bootstrap |= bootstrap;
        for a in addrs {
            if !r.addrs.contains(&a) {
                r.addrs.push(a);
            }
        }
        r.addrs.truncate(8);
    }

    /// Keeps the relays `keep` says (peer, whether a bootstrap peer) are still offered,
    /// and those asked or held (their listener's end says when they go).
    pub fn retain(&mut self, keep: impl Fn(&PeerId, bool) -> bool) {
        self.relays.retain(|p, r| {
            matches!(r.state, SlotState::Asked | SlotState::Held) || keep(p, r.bootstrap)
        });
    }

    /// The relays to ask now (at most enough to hold [`RESERVATIONS`] with those asked
    /// and held), each marked asked: one bootstrap peer first (known to be reachable), then
    /// the relays closest to `me` by XOR distance of their ids, so that the peers behind
    /// NAT of a large swarm spread over its relays instead of all asking the same ones;
    /// more bootstrap peers only when no other relay is known.
    pub fn to_ask(&mut self, me: &PeerId, now: Instant) -> Vec<(PeerId, Vec<Multiaddr>)> {
        let busy = |r: &Relay| matches!(r.state, SlotState::Asked | SlotState::Held);
        let want = RESERVATIONS.saturating_sub(self.relays.values().filter(|r| busy(r)).count());
        let mut on_bootstrap = self.relays.values().any(|r| r.bootstrap && busy(r));
        let mut ready: Vec<(&PeerId, &Relay)> = self
            .relays
            .iter()
            .filter(|(_, r)| matches!(r.state, SlotState::Idle { at, .. } if at <= now))
            .filter(|(_, r)| !r.addrs.is_empty())
            .collect();
        let first = |r: &Relay| r.bootstrap && !r.full;
        ready.sort_by_cached_key(|(p, r)| (!first(r), distance(me, p)));
        let mut pick: Vec<(PeerId, Vec<Multiaddr>)> = Vec::new();
        let mut spare = Vec::new();
        for (p, r) in ready {
            if first(r) && on_bootstrap {
                spare.push((*p, r.addrs.clone()));
                continue;
            }
            on_bootstrap |= r.bootstrap;
            pick.push((*p, r.addrs.clone()));
        }
        pick.extend(spare);
        pick.truncate(want);
        for (p, _) in &pick {
            if let Some(r) = self.relays.get_mut(p) {
                r.state = SlotState::Asked;
            }
        }
        pick
    }

    /// Relays asked or held now.
    pub fn busy(&self) -> usize {
        self.relays
            .values()
            .filter(|r| matches!(r.state, SlotState::Asked | SlotState::Held))
            .count()
    }

    /// The relay took the reservation.
    pub fn held(&mut self, peer: &PeerId) {
        if let Some(r) = self.relays.get_mut(peer) {
            r.state = SlotState::Held;
            r.refusals = 0;
            r.full = false;
        }
    }

    /// The reservation was refused (`full`: the relay said it holds all it may) or lost:
    /// asked again after a wait that doubles with each refusal in a row.
    pub fn refused(&mut self, peer: &PeerId, full: bool, now: Instant) {
        if let Some(r) = self.relays.get_mut(peer) {
            r.full = full;
            // Held, then lost: the first wait again.
            r.refusals = if r.state == SlotState::Held {
                1
            } else {
                r.refusals.saturating_add(1)
            };
            let wait = RETRY_FIRST
                .saturating_mul(1 << (r.refusals - 1).min(16))
                .min(RETRY_MAX);
            r.state = SlotState::Idle { at: now + wait };
        }
    }

    /// Relays whose reservation is held.
    pub fn held_on(&self) -> Vec<PeerId> {
        self.relays
            .iter()
            .filter(|(_, r)| r.state == SlotState::Held)
            .map(|(p, _)| *p)
            .collect()
    }

    /// Whether a reservation is asked and not answered yet.
    pub fn asking(&self) -> bool {
        self.relays.values().any(|r| r.state == SlotState::Asked)
    }

    /// Relays asked or holding a reservation: their connections are kept (the trimmer
    /// closing one while the relay answers loses the reservation the moment it is made).
    pub fn in_use(&self) -> Vec<PeerId> {
        self.relays
            .iter()
            .filter(|(_, r)| matches!(r.state, SlotState::Asked | SlotState::Held))
            .map(|(p, _)| *p)
            .collect()
    }

    /// Every relay asked or held (to release when the peer turns out public).
    pub fn release_all(&mut self, now: Instant) -> Vec<PeerId> {
        let out: Vec<PeerId> = self
            .relays
            .iter()
            .filter(|(_, r)| matches!(r.state, SlotState::Asked | SlotState::Held))
            .map(|(p, _)| *p)
            .collect();
        for r in self.relays.values_mut() {
            r.state = SlotState::Idle { at: now };
            r.refusals = 0;
        }
        out
    }
}

/// Address candidates remembered as failed at most (a symmetric NAT shows every peer
/// another port).
const FAILED_KEPT: usize = 64;

/// Peers and addresses remembered as dialed at most.
const DIALED_KEPT: usize = 100_000;

/// Whether this peer can be reached from outside its network, from two sources:
///
/// - AutoNAT v2: each address candidate (an address peers observe it at) is tested once,
///   by one peer dialing it back from a new port on a connection of its own. A v2 server
///   only tests a peer that dialed it (it must have observed the address), so a peer that
///   dials nobody, such as a bootstrap peer, is never tested this way.
/// - Connections that came in unasked: a direct inbound connection from a peer this one
///   never dialed, from an IP address it never dialed. A NAT lets such a connection in
///   only when the peer is reachable there; a connection from a peer or an address this
///   one dialed may have come through the NAT's mapping for that peer alone (libp2p
///   dials from its listen port, so a peer dialed back from its own port passes; AutoNAT
///   v1 counted such connections as dial-backs, and declared peers behind NAT public).
///
/// Evidence at a private address (a LAN, a VPC, a VPN: RFC 1918, shared address space,
/// link-local, unique local) says only that the peer's own network reaches it: it counts
/// only while the peer never dialed a public address (a cluster on one private network,
/// where private addresses are all there is). A peer behind a home router that a
/// neighbour on its LAN dialed is not public to the internet. Loopback counts as private
/// (peers of one host: a swarm on one machine with the default listen addresses).
#[derive(Debug, Default)]
pub struct Autonat {
    /// Candidates dialed back: reachable by others.
    pub confirmed: HashSet<Multiaddr>,
    /// Candidates a peer could not dial back.
    pub failed: HashSet<Multiaddr>,
    /// Connections that came in unasked (see above), from public and from private
    /// addresses.
    pub unasked: u64,
    pub unasked_private: u64,
    dialed_peers: HashSet<PeerId>,
    dialed_ips: HashSet<std::net::IpAddr>,
    /// Whether this peer ever dialed a public address.
    dialed_public: bool,
}

/// Whether `ip` is reachable only from its own network (see [`Autonat`]).
pub fn private_ip(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_private()
                || v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                // Shared address space (carrier-grade NAT), 100.64.0.0/10.
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
        }
        std::net::IpAddr::V6(v6) => {
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                // Unique local fc00::/7, link-local fe80::/10.
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some_and(|v4| private_ip(v4.into()))
        }
    }
}

/// The IP address of `a`, if it has one.
fn ip_of(a: &Multiaddr) -> Option<std::net::IpAddr> {
    a.iter().find_map(|p| match p {
        libp2p::multiaddr::Protocol::Ip4(ip) => Some(ip.into()),
        libp2p::multiaddr::Protocol::Ip6(ip) => Some(ip.into()),
        _ => None,
    })
}

impl Autonat {
    /// This peer began to dial `peer` (at addresses not known here).
    pub fn dialing(&mut self, peer: PeerId) {
        if self.dialed_peers.len() < DIALED_KEPT {
            self.dialed_peers.insert(peer);
        }
    }

    /// This peer dials or dialed `addr` (before the dial, or at its end). True when it is
    /// the first public address dialed: evidence at private addresses counts no more.
    pub fn dialed(&mut self, addr: &Multiaddr) -> bool {
        let before = self.dialed_public;
        if let Some(ip) = ip_of(addr) {
            self.dialed_public |= !private_ip(ip);
            if self.dialed_ips.len() < DIALED_KEPT {
                self.dialed_ips.insert(ip);
            }
        }
        !before && self.dialed_public
    }

    /// A direct (not relayed) connection came in from `peer` at `from`; true when it
    /// counts as evidence that this peer is reachable (it was not asked for; see the
    /// type's docs).
    pub fn inbound(&mut self, peer: &PeerId, from: &Multiaddr) -> bool {
        let Some(ip) = ip_of(from) else {
            return false;
        };
        let unasked = !self.dialed_peers.contains(peer)
            && !self.dialed_ips.contains(&ip)
            && self.dialed_peers.len() < DIALED_KEPT
            && self.dialed_ips.len() < DIALED_KEPT;
        if !unasked {
            return false;
        }
        if private_ip(ip) {
            self.unasked_private += 1;
            !self.dialed_public
        } else {
            self.unasked += 1;
            true
        }
    }

    /// A dial-back of `addr` worked (`ok`) or did not.
    pub fn tested(&mut self, addr: Multiaddr, ok: bool) {
        if ok {
            self.failed.remove(&addr);
            self.confirmed.insert(addr);
        } else if !self.confirmed.contains(&addr) && self.failed.len() < FAILED_KEPT {
            self.failed.insert(addr);
        }
    }

    /// Whether a dial-back of `addr` counts as evidence (see the type's docs).
    pub fn counts(&self, addr: &Multiaddr) -> bool {
        ip_of(addr).is_some_and(|ip| !private_ip(ip) || !self.dialed_public)
    }

    /// Some(true): publicly reachable (one address dialed back, or one connection that
    /// came in unasked, is enough); Some(false): every candidate tested failed; None:
    /// nothing known yet.
    pub fn verdict(&self) -> Option<bool> {
        let on_its_network = !self.dialed_public && self.unasked_private > 0;
        if self.unasked > 0 || on_its_network || self.confirmed.iter().any(|a| self.counts(a)) {
            Some(true)
        } else if !self.failed.is_empty() {
            Some(false)
        } else {
            None
        }
    }
}

/// The addresses that peers whose connections came in unasked say they dialed this one
/// at (identify's observed address). One such peer's word alone could name any address
/// (a peer that lies would have this one advertise it): an address is taken as external
/// when it is the very address the connection came to (no NAT between), or once two
/// peers said it.
#[derive(Debug, Default)]
pub struct Observed {
    by: HashMap<Multiaddr, HashSet<PeerId>>,
}

/// Addresses [`Observed`] keeps (those beyond are not counted).
const OBSERVED_KEPT: usize = 64;

impl Observed {
    /// `peer`, whose connection came to `local`, says it dialed `observed`: whether
    /// `observed` is confirmed now.
    pub fn said(&mut self, peer: PeerId, local: &Multiaddr, observed: &Multiaddr) -> bool {
        if ip_of(observed).is_some() && observed == local {
            return true;
        }
        if !self.by.contains_key(observed) && self.by.len() >= OBSERVED_KEPT {
            return false;
        }
        let peers = self.by.entry(observed.clone()).or_default();
        peers.insert(peer);
        peers.len() >= 2
    }
}

/// What the event loop knows of this peer's reachability (the inputs of
/// [`reachability`]) and what it does about it.
#[derive(Debug)]
pub struct NatState {
    /// What AutoNAT's dial-backs said.
    pub autonat: Autonat,
    /// Listen ports a UPnP gateway forwards now.
    pub upnp: u32,
    pub relays: Relays,
    /// Relay reservations asked or held, by their listener.
    pub circuits: HashMap<libp2p::core::transport::ListenerId, PeerId>,
    /// The reachability said last.
    pub said: Reachability,
    /// When the node started (a peer with no verdict for a while reserves anyway).
    pub started: Instant,
    /// Peers holding a reservation on this peer's relay service.
    pub holders: std::collections::HashSet<PeerId>,
    /// Connections that came in unasked whose peer has not said yet at which address it
    /// reached this one (its identify's observed address, judged then by
    /// [`Observed`]): the peer and the local address the connection came to.
    pub unasked_conns: HashMap<libp2p::swarm::ConnectionId, (PeerId, Multiaddr)>,
    /// What those peers said.
    pub observed: Observed,
    /// When the view's relays are read again (see [`RELAY_SCAN`]).
    pub next_scan: Instant,
    /// When to gossip the status again because the last one reached no peer (see
    /// [`unheard_retry`]).
    pub publish_at: Option<Instant>,
    /// The first change of reachability, addresses or relay service not gossiped yet
    /// (see [`change_due`]).
    pub changed_at: Option<Instant>,
    /// When this peer last gossiped its status.
    pub published_at: Option<Instant>,
    /// A relay service status not applied yet (see `EventLoop::apply_relay_status`).
    pub relay_enable: Option<bool>,
    /// Status publications in a row that reached no peer (see [`unheard_retry`]).
    pub unheard: u32,
}

/// When a status that reached no peer (no gossip peer subscribed yet: a peer's first
/// statuses, its public verdict and relay service among them, come before its mesh) is
/// published again: 2 s after the first, doubling, at most `interval` (the regular
/// publication). Without it, what such a status said waited for the next interval: in
/// netsim, whose interval is minutes at 1,000 peers, peers behind NAT learned of no relay
/// but the bootstrap peers and all asked those.
pub fn unheard_retry(unheard: u32, interval: Duration) -> Duration {
    Duration::from_secs(2)
        .saturating_mul(1 << unheard.saturating_sub(1).min(16))
        .min(interval)
}

/// How long a change of reachability or addresses waits to be gossiped, so that those
/// that come together go out in one message.
pub const STATUS_COALESCE: Duration = Duration::from_secs(1);
/// The longest a change waits for a relay's answer to a reservation asked (so that a
/// peer behind NAT says its verdict and both relay slots in one message, not three).
pub const STATUS_HOLD: Duration = Duration::from_secs(10);
/// The least time between two statuses gossiped for changes: every status reaches every
/// peer of the swarm (several copies each, each copy's signature checked), so a peer
/// whose relay slots come and go must not make the whole swarm pay for each.
pub const STATUS_GAP: Duration = Duration::from_secs(5);

/// Whether the status that changes since `first` asked for is gossiped now: after
/// [`STATUS_COALESCE`], at least [`STATUS_GAP`] after the last status (`last`), and, while
/// a relay reservation is asked (`asking`), once it is answered or [`STATUS_HOLD`] after
/// the first change.
pub fn change_due(first: Instant, last: Option<Instant>, asking: bool, now: Instant) -> bool {
    let waited = now.saturating_duration_since(first);
    if waited < STATUS_COALESCE {
        return false;
    }
    if last.is_some_and(|l| now.saturating_duration_since(l) < STATUS_GAP) {
        return false;
    }
    !asking || waited >= STATUS_HOLD
}

/// How often a peer short of relay slots reads the view for relays (netsim: every peer
/// behind NAT reading hundreds of relays twice a second took a core at 1,000 peers).
pub const RELAY_SCAN: Duration = Duration::from_secs(5);

/// How long a peer with no AutoNAT verdict waits before it reserves relay slots anyway.
pub const NO_VERDICT: Duration = Duration::from_secs(8);

impl NatState {
    pub fn new(now: Instant) -> NatState {
        NatState {
            autonat: Autonat::default(),
            upnp: 0,
            relays: Relays::default(),
            circuits: HashMap::new(),
            said: Reachability::Unknown,
            started: now,
            holders: Default::default(),
            unasked_conns: Default::default(),
            observed: Observed::default(),
            next_scan: now,
            publish_at: None,
            changed_at: None,
            published_at: None,
            relay_enable: None,
            unheard: 0,
        }
    }

    /// Whether a peer in this state should hold relay reservations: not public (AutoNAT
    /// said private, or said nothing for [`NO_VERDICT`]).
    pub fn wants_relays(&self, told: bool, now: Instant) -> bool {
        !told
            && self.upnp == 0
            && match self.autonat.verdict() {
                Some(public) => !public,
                None => now.saturating_duration_since(self.started) >= NO_VERDICT,
            }
    }
}

/// The bootstrap peers: resolved and dialed at start, and again (resolving DNS names
/// anew) while none of them has answered yet, each time twice as late up to
/// [`BOOT_MAX`]. Once one has, only a peer left with no connection at all dials them
/// again: a connection to a bootstrap peer that its trimmer closed is no failure, and
/// redialing it then would have every peer of a large swarm hammer the bootstrap peers
/// (netsim at 1,000 peers: both cores busy with the handshakes).
#[derive(Debug)]
pub struct Bootstrap {
    pub addrs: Vec<Multiaddr>,
    pub next: Instant,
    pub wait: Duration,
    /// A bootstrap peer answered once.
    pub reached: bool,
}

pub const BOOT_FIRST: Duration = Duration::from_secs(2);
pub const BOOT_MAX: Duration = Duration::from_secs(30);

impl Bootstrap {
    pub fn new(addrs: &[Multiaddr]) -> Bootstrap {
        Bootstrap {
            addrs: addrs.to_vec(),
            next: Instant::now(),
            wait: BOOT_FIRST,
            reached: false,
        }
    }

    /// The peer ids the bootstrap addresses name.
    pub fn peers(&self) -> Vec<PeerId> {
        self.addrs
            .iter()
            .filter_map(|a| {
                a.iter().find_map(|p| match p {
                    libp2p::multiaddr::Protocol::P2p(id) => Some(id),
                    _ => None,
                })
            })
            .collect()
    }

    /// Whether to dial again now (see the type's docs; `bootstrap_connected`: one of them
    /// is connected now, `any_connected`: any peer is), after the wait; if so the next
    /// wait doubles.
    pub fn due(&mut self, bootstrap_connected: bool, any_connected: bool, now: Instant) -> bool {
        self.reached |= bootstrap_connected;
        let fine = if self.reached {
            any_connected
        } else {
            bootstrap_connected
        };
        if self.addrs.is_empty() || fine {
            self.wait = BOOT_FIRST;
            return false;
        }
        if now < self.next {
            return false;
        }
        self.next = now + self.wait;
        self.wait = (self.wait * 2).min(BOOT_MAX);
        true
    }
}

/// A peer's reachability from what it knows: `told` (`--external-addr`), whether it listens
/// on loopback alone, AutoNAT's verdict (Some(true): public, Some(false): private, None:
/// none yet) and whether it holds a relay reservation.
pub fn reachability(
    told: bool,
    local_only: bool,
    autonat: Option<bool>,
    reserved: bool,
) -> Reachability {
    if local_only {
        return Reachability::Local;
    }
    if told || autonat == Some(true) {
        return Reachability::Public;
    }
    if reserved {
        return Reachability::Relayed;
    }
    match autonat {
        Some(false) => Reachability::Unreachable,
        _ => Reachability::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn one_address_dialed_back_makes_a_peer_public_and_only_failures_make_it_private() {
        let mut a = Autonat::default();
        assert_eq!(a.verdict(), None);
        let quic: Multiaddr = "/ip4/198.51.100.7/udp/4001/quic-v1".parse().unwrap();
        let tcp: Multiaddr = "/ip4/198.51.100.7/tcp/4001".parse().unwrap();
        a.tested(tcp.clone(), false);
        assert_eq!(a.verdict(), Some(false));
        a.tested(quic.clone(), true);
        assert_eq!(a.verdict(), Some(true));
        // A later failure of a confirmed address does not undo it.
        a.tested(quic, false);
        assert_eq!(a.verdict(), Some(true));
        // Behind a symmetric NAT every peer sees another port: failures are kept bounded.
        let mut s = Autonat::default();
        for port in 0..1000u16 {
            let addr: Multiaddr = format!("/ip4/198.51.100.9/udp/{}/quic-v1", 20000 + port)
                .parse()
                .unwrap();
            s.tested(addr, false);
        }
        assert_eq!(s.verdict(), Some(false));
        assert!(s.failed.len() <= FAILED_KEPT);
        // A connection from a peer it dialed, or from an address it dialed, may have come
        // through its NAT's mapping: no proof. One from anyone else is.
        let (boot, other, stranger) = (PeerId::random(), PeerId::random(), PeerId::random());
        s.dialing(boot);
        let boot_addr: Multiaddr = "/ip4/198.51.100.10/udp/4001/quic-v1".parse().unwrap();
        s.dialed(&boot_addr);
        assert!(!s.inbound(
            &boot,
            &"/ip4/198.51.100.10/udp/4001/quic-v1".parse().unwrap()
        ));
        assert!(!s.inbound(&other, &"/ip4/198.51.100.10/tcp/4001".parse().unwrap()));
        assert_eq!(s.verdict(), Some(false));
        assert!(s.inbound(&stranger, &"/ip4/198.51.100.77/tcp/4001".parse().unwrap()));
        assert_eq!(s.verdict(), Some(true));
    }

    #[test]
    fn an_observed_address_is_taken_when_it_is_the_local_one_or_two_peers_say_it() {
        let mut o = Observed::default();
        let local: Multiaddr = "/ip4/198.51.100.7/tcp/4001".parse().unwrap();
        // No NAT between: the address the connection came to.
        assert!(o.said(PeerId::random(), &local, &local));
        // A forwarded port (the connection came to a private address): one peer's word is
        // not enough, the same peer twice neither; a second peer's is.
        let lan: Multiaddr = "/ip4/10.0.0.7/tcp/4001".parse().unwrap();
        let public: Multiaddr = "/ip4/203.0.113.5/tcp/4001".parse().unwrap();
        let (p1, p2) = (PeerId::random(), PeerId::random());
        assert!(!o.said(p1, &lan, &public));
        assert!(!o.said(p1, &lan, &public));
        assert!(o.said(p2, &lan, &public));
        // A liar's address stays one peer's word.
        let made_up: Multiaddr = "/ip4/192.0.2.66/tcp/1".parse().unwrap();
        assert!(!o.said(PeerId::random(), &lan, &made_up));
    }

    #[test]
    fn a_lan_neighbour_makes_no_peer_public_unless_the_private_network_is_all_there_is() {
        // Behind a home router: it dialed a public bootstrap peer; a neighbour dials its
        // LAN address, and a LAN peer dials it back there.
        let mut home = Autonat::default();
        home.dialing(PeerId::random());
        home.dialed(&"/ip4/198.51.100.10/udp/4001/quic-v1".parse().unwrap());
        let lan: Multiaddr = "/ip4/192.168.1.7/tcp/4001".parse().unwrap();
        assert!(!home.inbound(&PeerId::random(), &lan));
        home.tested("/ip4/192.168.1.5/tcp/4001".parse().unwrap(), true);
        assert_eq!(home.verdict(), None);
        // Loopback is private too.
        assert!(!home.inbound(
            &PeerId::random(),
            &"/ip4/127.0.0.1/tcp/4001".parse().unwrap()
        ));
        // A cluster on one private network (a bootstrap peer that dials nobody).
        let mut cluster = Autonat::default();
        assert!(cluster.inbound(
            &PeerId::random(),
            &"/ip4/10.0.0.8/tcp/4001".parse().unwrap()
        ));
        assert_eq!(cluster.verdict(), Some(true));
        // It dials a public peer: the private evidence counts no more.
        assert!(cluster.dialed(&"/ip4/198.51.100.3/tcp/4001".parse().unwrap()));
        assert!(!cluster.dialed(&"/ip4/198.51.100.4/tcp/4001".parse().unwrap()));
        assert_eq!(cluster.verdict(), None);
        // Peers of one host, on loopback (its bootstrap peer: the others dialed it).
        let mut host = Autonat::default();
        assert!(host.inbound(
            &PeerId::random(),
            &"/ip4/127.0.0.1/tcp/4002".parse().unwrap()
        ));
        assert_eq!(host.verdict(), Some(true));
        for (ip, private) in [
            ("10.1.2.3", true),
            ("172.16.0.1", true),
            ("192.168.0.1", true),
            ("100.64.0.1", true),
            ("169.254.1.1", true),
            ("198.51.100.7", false),
            ("203.0.113.9", false),
            ("8.8.8.8", false),
            ("fd00::1", true),
            ("fe80::1", true),
            ("2001:db8::1", false),
        ] {
            assert_eq!(private_ip(ip.parse().unwrap()), private, "{ip}");
        }
    }

    #[test]
    fn reservations_go_to_bootstrap_peers_first_and_refusals_back_off() {
        let t0 = Instant::now();
        let me = PeerId::random();
        let mut r = Relays::default();
        let (boot, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
        let addr: Multiaddr = "/ip4/198.51.100.1/tcp/4001".parse().unwrap();
        r.offer(a, vec![addr.clone()], false, t0);
        r.offer(b, vec![addr.clone()], false, t0);
        r.offer(boot, vec![addr.clone()], true, t0);
        let first = r.to_ask(&me, t0);
        assert_eq!(first.len(), RESERVATIONS);
        assert_eq!(first[0].0, boot);
        // Nothing more while two are asked.
        assert!(r.to_ask(&me, t0).is_empty());
        // Relays asked are kept connected as those held are.
        let mut asked = r.in_use();
        asked.sort();
        let mut want: Vec<PeerId> = first.iter().map(|f| f.0).collect();
        want.sort();
        assert_eq!(asked, want);
        r.held(&boot);
        let other = first[1].0;
        r.refused(&other, false, t0);
        assert_eq!(r.in_use(), vec![boot], "a refused relay is no longer kept");
        // The third relay is asked in its place; the refused one waits.
        let next = r.to_ask(&me, t0);
        assert_eq!(next.len(), 1);
        assert_ne!(next[0].0, other);
        r.refused(&next[0].0, false, t0);
        assert!(r.to_ask(&me, t0 + Duration::from_secs(1)).is_empty());
        // One relay alone: each refusal in a row waits twice as long.
        let mut one = Relays::default();
        one.offer(a, vec![addr.clone()], false, t0);
        assert_eq!(one.to_ask(&me, t0).len(), 1);
        one.refused(&a, false, t0);
        assert!(one.to_ask(&me, t0 + RETRY_FIRST / 2).is_empty());
        assert_eq!(one.to_ask(&me, t0 + RETRY_FIRST).len(), 1);
        one.refused(&a, false, t0);
        assert!(one.to_ask(&me, t0 + RETRY_FIRST).is_empty());
        assert_eq!(one.to_ask(&me, t0 + RETRY_FIRST * 2).len(), 1);
        assert_eq!(r.held_on(), vec![boot]);
        assert_eq!(r.release_all(t0), vec![boot]);
        assert!(r.held_on().is_empty());
    }

    #[test]
    fn a_status_nobody_heard_is_said_again_soon_then_less_often_up_to_the_interval() {
        let interval = Duration::from_secs(30);
        let waits: Vec<u64> = (1..=6)
            .map(|n| unheard_retry(n, interval).as_secs())
            .collect();
        assert_eq!(waits, vec![2, 4, 8, 16, 30, 30]);
        assert_eq!(unheard_retry(u32::MAX, interval), interval);
    }

    #[test]
    fn changes_go_out_together_waiting_for_a_relays_answer_but_not_for_long() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // A change alone: out after the coalescing second.
        assert!(!change_due(t0, None, false, t0));
        assert!(change_due(t0, None, false, t0 + s(1)));
        // A reservation asked: held until it is answered, at most STATUS_HOLD.
        assert!(!change_due(t0, None, true, t0 + s(9)));
        assert!(change_due(t0, None, true, t0 + STATUS_HOLD));
        // Never two statuses for changes within STATUS_GAP of each other.
        let last = Some(t0);
        assert!(!change_due(t0, last, false, t0 + s(4)));
        assert!(change_due(t0, last, false, t0 + STATUS_GAP));
        // The hold over but the last status 2 s old: the gap still holds it.
        assert!(!change_due(t0, Some(t0 + s(8)), true, t0 + STATUS_HOLD));
        assert!(change_due(
            t0,
            Some(t0 + s(8)),
            true,
            t0 + s(8) + STATUS_GAP
        ));
        // Answered: what a relay slot brought goes out with the verdict at once.
        let mut r = Relays::default();
        let relay = seeded(7);
        r.offer(relay, vec!["/memory/7".parse().unwrap()], true, t0);
        assert!(!r.asking());
        r.to_ask(&seeded(1), t0);
        assert!(r.asking());
        r.held(&relay);
        assert!(!r.asking());
        // A refusal, or letting go of every relay, is an answer too.
        let other = seeded(8);
        r.offer(other, vec!["/memory/8".parse().unwrap()], false, t0);
        r.to_ask(&seeded(1), t0);
        assert!(r.asking());
        r.refused(&other, true, t0);
        assert!(!r.asking());
        r.refused(&relay, false, t0);
        r.to_ask(&seeded(1), t0 + s(3600));
        assert!(r.asking());
        r.release_all(t0);
        assert!(!r.asking());
    }

    fn seeded(i: u8) -> PeerId {
        libp2p::identity::Keypair::ed25519_from_bytes([i; 32])
            .unwrap()
            .public()
            .to_peer_id()
    }

    #[test]
    fn peers_behind_nat_take_one_bootstrap_slot_and_spread_the_other_over_the_relays() {
        let t0 = Instant::now();
        let addr: Multiaddr = "/ip4/198.51.100.1/tcp/4001".parse().unwrap();
        let boots: Vec<PeerId> = (1..=3).map(seeded).collect();
        let relays: Vec<PeerId> = (10..30).map(seeded).collect();
        let mut second = HashSet::new();
        for i in 100..160 {
            let me = seeded(i);
            let mut r = Relays::default();
            for b in &boots {
                r.offer(*b, vec![addr.clone()], true, t0);
            }
            for p in &relays {
                r.offer(*p, vec![addr.clone()], false, t0);
            }
            let pick = r.to_ask(&me, t0);
            assert_eq!(pick.len(), RESERVATIONS);
            assert!(boots.contains(&pick[0].0));
            assert!(relays.contains(&pick[1].0), "one bootstrap slot only");
            second.insert(pick[1].0);
        }
        // 60 peers over 20 relays: not all on the same few.
        assert!(second.len() >= 10, "{} relays used", second.len());
        // Bootstrap peers alone: both slots on them.
        let mut r = Relays::default();
        for b in &boots {
            r.offer(*b, vec![addr.clone()], true, t0);
        }
        let pick = r.to_ask(&seeded(99), t0);
        assert!(pick.len() == 2 && pick.iter().all(|(p, _)| boots.contains(p)));
    }

    #[test]
    fn a_bootstrap_peer_that_said_it_is_full_is_asked_no_sooner_than_other_relays() {
        let t0 = Instant::now();
        let addr: Multiaddr = "/ip4/198.51.100.1/tcp/4001".parse().unwrap();
        let boot = seeded(1);
        let relays: Vec<PeerId> = (10..30).map(seeded).collect();
        for i in 100..120 {
            let me = seeded(i);
            let mut r = Relays::default();
            r.offer(boot, vec![addr.clone()], true, t0);
            for p in &relays {
                r.offer(*p, vec![addr.clone()], false, t0);
            }
            let pick = r.to_ask(&me, t0);
            assert_eq!(pick[0].0, boot);
            r.held(&pick[1].0);
            r.refused(&boot, true, t0);
            // Once the wait is over the free slot goes to the relay closest to this peer,
            // which is the bootstrap peer only when it is the closest.
            let later = t0 + RETRY_MAX;
            let closest = std::iter::once(boot)
                .chain(relays.iter().copied().filter(|p| *p != pick[1].0))
                .min_by_key(|p| distance(&me, p))
                .unwrap();
            let next = r.to_ask(&me, later);
            assert_eq!(next.len(), 1);
            assert_eq!(next[0].0, closest);
            // A bootstrap peer refused for another reason (a lost connection) stays first.
            let mut r2 = Relays::default();
            r2.offer(boot, vec![addr.clone()], true, t0);
            for p in &relays {
                r2.offer(*p, vec![addr.clone()], false, t0);
            }
            let pick = r2.to_ask(&me, t0);
            r2.held(&pick[1].0);
            r2.refused(&boot, false, t0);
            assert_eq!(r2.to_ask(&me, later)[0].0, boot);
        }
    }

    #[test]
    fn bootstrap_peers_are_redialed_until_one_answers_then_only_when_alone() {
        let addr: Multiaddr = "/dns4/boot.example/tcp/4001".parse().unwrap();
        let mut b = Bootstrap::new(&[addr]);
        let t0 = b.next;
        // Not reached: dialed again after 2 s, then 4 s, whatever else is connected.
        assert!(b.due(false, true, t0));
        assert!(!b.due(false, true, t0 + BOOT_FIRST / 2));
        assert!(b.due(false, true, t0 + BOOT_FIRST));
        assert!(!b.due(false, true, t0 + BOOT_FIRST * 2));
        assert!(b.due(false, true, t0 + BOOT_FIRST * 3));
        // It answered; its connection is trimmed later: no redial while others are
        // connected, one once this peer is alone.
        assert!(!b.due(true, true, t0 + BOOT_FIRST * 4));
        assert!(!b.due(false, true, t0 + BOOT_FIRST * 10));
        assert!(b.due(false, false, t0 + BOOT_FIRST * 10));
        assert!(!b.due(false, false, t0 + BOOT_FIRST * 10 + BOOT_FIRST / 2));
    }

    #[test]
    fn reachability_follows_what_the_peer_knows() {
        use Reachability::*;
        assert_eq!(reachability(false, true, None, false), Local);
        assert_eq!(reachability(true, false, None, false), Public);
        assert_eq!(reachability(false, false, Some(true), true), Public);
        assert_eq!(reachability(false, false, Some(false), true), Relayed);
        assert_eq!(reachability(false, false, Some(false), false), Unreachable);
        assert_eq!(reachability(false, false, None, false), Unknown);
        assert_eq!(Reachability::parse(Relayed.as_str()), Some(Relayed));
    }
}
