//! The event loop's network-facing half: connections by kind, reachability (AutoNAT,
//! UPnP, `--external-addr`), relay reservations of a peer behind NAT, the relay service
//! of a public one, hole punches, and the bootstrap peers dialed again until they answer.
//! The decisions are [`crate::swarm::reach`]'s; this file carries them out on the swarm.
//!
//! Owns: turning libp2p's NAT events into state, typed [`NetEvent`]s and actions. Never
//! decides policy of its own (see `reach`).

use std::collections::HashSet;
use std::time::Instant;

use libp2p::core::transport::ListenerId;
use libp2p::kad::Mode;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{autonat, dcutr, relay, upnp, Multiaddr, PeerId, StreamProtocol};
use tracing::{debug, info, warn};

use super::{Conn, EventLoop};
use crate::base::lock;
use crate::swarm::addrs;
use crate::swarm::protocol::{REACH_FIELD, RELAY_FIELD};
use crate::swarm::reach::{
    reachability, LinkKind, NetEvent, Reachability, RELAY_SCAN, RESERVATIONS,
};
use crate::swarm::shared::Command;

/// How long the relayed connections to a peer stay after a hole punched a direct one.
const RELAYED_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The relay service's protocol (circuit relay v2, the relay's side).
const HOP: StreamProtocol = StreamProtocol::new("/libp2p/circuit/relay/0.2.0/hop");

impl EventLoop {
    /// The addresses this peer offers others (see `addrs::offered`).
    pub(super) fn offered(&self) -> Vec<Multiaddr> {
        let external: Vec<Multiaddr> = self
            .swarm
            .external_addresses()
            .map(addrs::without_peer)
            .collect();
        let listen: Vec<Multiaddr> = self.listen_addrs.iter().map(addrs::without_peer).collect();
        addrs::offered(&external, &listen, 16)
    }

    /// Whether this peer's relay service takes reservations now.
    pub(super) fn relaying(&self) -> bool {
        self.swarm.behaviour().relay.is_enabled()
            && self.nat.relay_enable.is_none()
            && lock(&self.shared.net).reach == Reachability::Public
    }

    /// Works out the reachability again; on a change says so, switches Kademlia's mode
    /// and the relay service, lets go of relay reservations a public peer does not need,
    /// and gossips the news.
    pub(super) fn update_reach(&mut self) {
        let told = !self.shared.cfg.external.is_empty();
        let reserved = !self.nat.relays.held_on().is_empty();
        let now = reachability(
            told || self.nat.upnp > 0,
            self.local_only,
            self.nat.autonat.verdict(),
            reserved,
        );
        let offered = self.offered();
        let changed = {
            let mut n = lock(&self.shared.net);
            let changed = n.reach != now || n.offered != offered;
            n.reach = now;
            n.offered = offered.clone();
            changed
        };
        if !changed {
            return;
        }
        let status_changed = self.nat.said != now;
        if status_changed {
            info!(
                reachability = now.as_str(),
                addrs = ?offered,
                "this peer's reachability"
            );
            self.nat.said = now;
            // A DHT server only once others can dial it: a peer behind NAT that served
            // it while it did not know yet would sit in routing tables where every
            // lookup's request to it times out.
            let dht = self.shared.cfg.kad_server
                && matches!(now, Reachability::Public | Reachability::Local);
            self.swarm.behaviour_mut().kad.set_mode(Some(if dht {
                Mode::Server
            } else {
                Mode::Client
            }));
            self.nat.relay_enable = Some(now == Reachability::Public);
            self.apply_relay_status();
            if now == Reachability::Public || now == Reachability::Local {
                self.release_relays();
            }
        }
        let addrs = offered.iter().map(ToString::to_string).collect();
        self.shared.net_event(if status_changed {
            NetEvent::Reachability { status: now, addrs }
        } else {
            NetEvent::Addresses { addrs }
        });
        let mut st = lock(&self.shared.status);
        st.extra
            .insert(REACH_FIELD.to_string(), now.as_str().to_string());
        drop(st);
        // Gossiped once for changes that come together (a peer behind NAT gets its verdict
        // and its two relay slots within seconds: one message through the whole swarm,
        // not three); see `reach::change_due`.
        self.nat.changed_at.get_or_insert(Instant::now());
    }

    /// Turns the relay service on or off as asked, once this peer has no relayed
    /// connection: libp2p-relay 0.22 tells every connection of its table about a change,
    /// relayed ones included, whose handler cannot take it (`unreachable!`, a panic that
    /// took the node down when a peer holding a circuit turned public). Until then the
    /// service stays as it was; `nat_tick` tries again.
    pub(super) fn apply_relay_status(&mut self) {
        let Some(enable) = self.nat.relay_enable else {
            return;
        };
        if self.conns.values().any(|c| c.kind == LinkKind::Relayed) {
            return;
        }
        self.nat.relay_enable = None;
        // Whether it relays is in the status.
        self.nat.changed_at.get_or_insert(Instant::now());
        if let Some(r) = self.swarm.behaviour_mut().relay.as_mut() {
            r.set_status(Some(if enable {
                relay::Status::Enable
            } else {
                relay::Status::Disable
            }));
        }
    }

    fn release_relays(&mut self) {
        let now = Instant::now();
        self.nat.relays.release_all(now);
        for (id, relay) in std::mem::take(&mut self.nat.circuits) {
            debug!(%relay, "releasing a relay reservation: this peer is reachable");
            self.swarm.remove_listener(id);
        }
    }

    pub(super) fn on_listen_addr(&mut self, id: ListenerId, address: Multiaddr) {
        if self.local_only {
            self.swarm.add_external_address(address.clone());
        }
        if let Some(relay) = self.nat.circuits.get(&id) {
            debug!(%relay, %address, "listening through a relay");
        }
        if !self.listen_addrs.contains(&address) {
            self.listen_addrs.push(address);
        }
        self.update_reach();
    }

    pub(super) fn on_listener_closed(&mut self, id: ListenerId, error: Option<String>) {
        let Some(relay) = self.nat.circuits.remove(&id) else {
            return;
        };
        let was_held = self.nat.relays.held_on().contains(&relay);
        // libp2p-relay's words for a relay at its reservation limit.
        let full = error
            .as_deref()
            .is_some_and(|e| e.contains("resource limit exceeded"));
        self.nat.relays.refused(&relay, full, Instant::now());
        self.listen_addrs
            .retain(|a| relay_of(a).is_none_or(|r| r != relay));
        warn!(
            %relay,
            me = %self.shared.peer_id,
            held = was_held,
            "relay reservation {}: {}",
            if was_held { "lost" } else { "refused" },
            error.as_deref().unwrap_or("closed")
        );
        self.shared.net_event(NetEvent::Reservation {
            relay: relay.to_string(),
            ok: false,
            error: Some(error.unwrap_or_else(|| "closed".into())),
        });
        self.update_reach();
    }

    /// Records a connection that opened.
    pub(super) fn opened(
        &mut self,
        id: ConnectionId,
        peer: PeerId,
        kind: LinkKind,
        remote: Multiaddr,
    ) {
        debug!(%peer, kind = kind.as_str(), %remote, "connection opened");
        self.conns.insert(
            id,
            Conn {
                peer,
                kind,
                remote: remote.clone(),
            },
        );
        lock(&self.shared.net)
            .links
            .entry(peer)
            .or_default()
            .push((id, kind));
        self.shared.net_event(NetEvent::Connected {
            peer: peer.to_string(),
            kind,
            addr: remote.to_string(),
        });
    }

    /// Records a connection that closed.
    pub(super) fn closed(&mut self, id: ConnectionId) {
        self.nat.unasked_conns.remove(&id);
        let Some(c) = self.conns.remove(&id) else {
            return;
        };
        {
            let mut n = lock(&self.shared.net);
            if let Some(l) = n.links.get_mut(&c.peer) {
                l.retain(|(i, _)| *i != id);
                if l.is_empty() {
                    n.links.remove(&c.peer);
                }
            }
        }
        self.shared.net_event(NetEvent::Closed {
            peer: c.peer.to_string(),
            kind: c.kind,
        });
    }

    /// A bootstrap peer that offers relay service is the first relay a peer behind NAT
    /// asks (it is known to be reachable: this peer dialed it).
    pub(super) fn on_identified(&mut self, peer: PeerId, protocols: &[StreamProtocol]) {
        if !self.shared.cfg.nat_traversal || self.local_only {
            return;
        }
        if protocols.contains(&HOP) && self.bootstrap.peers().contains(&peer) {
            let addrs = self.direct_addrs(&peer);
            self.nat.relays.offer(peer, addrs, true, Instant::now());
        }
    }

    /// The addresses of `peer` another host can dial directly.
    fn direct_addrs(&self, peer: &PeerId) -> Vec<Multiaddr> {
        self.addr_book
            .get(peer)
            .map(|b| {
                b.iter()
                    .filter(|a| !addrs::is_relayed(a) && !addrs::is_local(a))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every half second: the bootstrap peers dialed again while none answers; relay
    /// reservations asked, kept or let go.
    pub(super) fn nat_tick(&mut self) {
        let now = Instant::now();
        let boot = self.bootstrap.peers();
        let any = self.swarm.connected_peers().next().is_some();
        let to_bootstrap = if boot.is_empty() {
            any
        } else {
            boot.iter().any(|p| self.swarm.is_connected(p))
        };
        if self.bootstrap.due(to_bootstrap, any, now) {
            self.redial_bootstrap();
        }
        self.apply_relay_status();
        if !self.shared.cfg.nat_traversal || self.local_only {
            return;
        }
        let told = !self.shared.cfg.external.is_empty();
        if !self.nat.wants_relays(told, now) {
            if !self.nat.circuits.is_empty() {
                self.release_relays();
            }
            return;
        }
        // Holding (or asking) its slots: nothing to do. Else the view's relays are read
        // again at most every few seconds (a peer of a large swarm knows hundreds).
        if self.nat.relays.busy() >= RESERVATIONS {
            return;
        }
        if now >= self.nat.next_scan {
            self.nat.next_scan = now + RELAY_SCAN;
            // Public peers of the view that offer relay service.
            let offers: HashSet<PeerId> = lock(&self.shared.view)
                .iter()
                .filter(|(p, s)| {
                    **p != self.shared.peer_id
                        && s.status.extra.get(RELAY_FIELD).is_some_and(|v| v == "1")
                })
                .map(|(p, _)| *p)
                .collect();
            // Relays that left the view (or stopped relaying) are no longer asked.
            self.nat
                .relays
                .retain(|p, bootstrap| bootstrap || offers.contains(p));
            for p in offers {
                let addrs = self.direct_addrs(&p);
                self.nat.relays.offer(p, addrs, false, now);
            }
        }
        for (relay, addrs) in self.nat.relays.to_ask(&self.shared.peer_id, now) {
            let Some(a) = addrs.first() else { continue };
            let circuit = a
                .clone()
                .with(Protocol::P2p(relay))
                .with(Protocol::P2pCircuit);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(id) => {
                    debug!(%relay, %circuit, "asking for a relay reservation");
                    self.nat.circuits.insert(id, relay);
                }
                Err(e) => {
                    warn!(%relay, "asking for a relay reservation: {e}");
                    self.nat.relays.refused(&relay, false, now);
                }
            }
        }
    }

    /// Closes the relayed connections to `peer` (a direct one stands).
    pub(super) fn close_relayed(&mut self, peer: PeerId) {
        let relayed: Vec<ConnectionId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.peer == peer && c.kind == LinkKind::Relayed)
            .map(|(i, _)| *i)
            .collect();
        let direct = self
            .conns
            .values()
            .any(|c| c.peer == peer && c.kind != LinkKind::Relayed);
        if direct {
            for i in relayed {
                self.swarm.close_connection(i);
            }
        }
    }

    /// Resolves the bootstrap addresses (DNS names anew) on a task of the node and has
    /// the loop dial what they resolve to; each that fails is said (and tried again).
    fn redial_bootstrap(&mut self) {
        let addrs = self.bootstrap.addrs.clone();
        let (shared, cmd) = (self.shared.clone(), self.cmd.clone());
        self.shared.spawn(async move {
            let resolved = resolve_all(&shared, &addrs).await;
            if let (false, Some(tx)) = (resolved.is_empty(), cmd.upgrade()) {
                let _ = tx.send(Command::Dial(resolved)).await;
            }
        });
    }

    /// At start: the bootstrap peers dialed (see [`EventLoop::redial_bootstrap`]).
    pub(super) async fn dial_bootstrap(&mut self) {
        let addrs = self.bootstrap.addrs.clone();
        if addrs.is_empty() {
            return;
        }
        self.bootstrap.due(false, false, Instant::now());
        for a in resolve_all(&self.shared, &addrs).await {
            self.note_dialed(&a);
            if let Err(e) = self.swarm.dial(a.clone()) {
                warn!(addr = %a, "dialing a bootstrap peer: {e}");
                self.shared.net_event(NetEvent::Bootstrap {
                    addr: a.to_string(),
                    error: e.to_string(),
                });
            }
        }
    }

    /// Another peer dialed one of this peer's address candidates back, or could not
    /// (AutoNAT v2; a confirmed address is one of the swarm's external addresses now).
    pub(super) fn on_autonat(&mut self, e: autonat::v2::client::Event) {
        let ok = e.result.is_ok();
        debug!(
            addr = %e.tested_addr,
            server = %e.server,
            ok,
            error = ?e.result.err().map(|x| x.to_string()),
            "AutoNAT dial-back"
        );
        // Dialed back over loopback (a peer of this host), through a relay (a candidate
        // from a peer that reached this one over a circuit), or at an address without an
        // IP: says nothing of whether other hosts can dial this one directly.
        let has_ip = e
            .tested_addr
            .iter()
            .any(|p| matches!(p, Protocol::Ip4(_) | Protocol::Ip6(_)));
        if addrs::is_local(&e.tested_addr) || addrs::is_relayed(&e.tested_addr) || !has_ip {
            if ok {
                self.swarm.remove_external_address(&e.tested_addr);
            }
            return;
        }
        let before = self.nat.autonat.verdict();
        let tested = e.tested_addr.clone();
        self.nat.autonat.tested(e.tested_addr, ok);
        // A LAN address confirmed by a LAN peer is no external address for the peers on
        // the internet (see `reach::Autonat`).
        if ok && !self.nat.autonat.counts(&tested) {
            self.swarm.remove_external_address(&tested);
        }
        if self.nat.autonat.verdict() != before {
            debug!(verdict = ?self.nat.autonat.verdict(), "AutoNAT verdict");
        }
        self.update_reach();
    }

    /// A direct connection came in: unasked, it proves this peer reachable at the address
    /// it came to (see [`crate::swarm::reach::Autonat`]).
    pub(super) fn came_in(
        &mut self,
        id: ConnectionId,
        peer: PeerId,
        endpoint: &libp2p::core::ConnectedPoint,
    ) {
        let libp2p::core::ConnectedPoint::Listener {
            local_addr,
            send_back_addr,
        } = endpoint
        else {
            return;
        };
        if self.local_only || !self.nat.autonat.inbound(&peer, send_back_addr) {
            return;
        }
        if self.nat.autonat.unasked == 1 {
            debug!(%peer, from = %send_back_addr, to = %local_addr, "a connection came in unasked: reachable");
        }
        // The address it reached this one at is judged when its identify says it.
        if self.nat.unasked_conns.len() < 1024 {
            self.nat
                .unasked_conns
                .insert(id, (peer, addrs::without_peer(local_addr)));
        }
        self.update_reach();
    }

    /// The address a peer whose connection came in unasked dialed this one at (as its
    /// identify observed it): reachable, so an external address (the relay service
    /// refuses reservations while it has none to give).
    pub(super) fn observed_unasked(&mut self, id: ConnectionId, observed: &Multiaddr) {
        let Some((peer, local)) = self.nat.unasked_conns.remove(&id) else {
            return;
        };
        if addrs::is_local(observed) || addrs::is_relayed(observed) {
            return;
        }
        let observed = addrs::without_peer(observed);
        if self.nat.observed.said(peer, &local, &observed) {
            debug!(addr = %observed, "reached from outside at this address");
            self.swarm.add_external_address(observed);
            self.update_reach();
        } else {
            debug!(addr = %observed, %peer, to = %local, "one peer says it reached this one at this address: taken once another says so too");
        }
    }

    /// This peer dials or dialed `addr` (see [`crate::swarm::reach::Autonat::dialed`]).
    /// At its first public address, what private evidence made it public counts no
    /// more: the private external addresses it learned go (not `--external-addr`'s), and
    /// the reachability is judged again.
    pub(super) fn note_dialed(&mut self, addr: &Multiaddr) {
        if !self.nat.autonat.dialed(addr) {
            return;
        }
        let private: Vec<Multiaddr> = self
            .swarm
            .external_addresses()
            .filter(|a| {
                !self.nat.autonat.counts(a)
                    && !addrs::is_relayed(a)
                    // What the user said stays.
                    && !self.shared.cfg.external.contains(a)
            })
            .cloned()
            .collect();
        for a in private {
            self.swarm.remove_external_address(&a);
        }
        self.update_reach();
    }

    /// This peer dialed another's candidate back (AutoNAT v2's server side).
    pub(super) fn on_autonat_server(&mut self, e: autonat::v2::server::Event) {
        debug!(
            client = %e.client,
            addr = %e.tested_addr,
            ok = e.result.is_ok(),
            "AutoNAT: dialed a peer back"
        );
    }

    pub(super) fn on_relay_client(&mut self, e: relay::client::Event) {
        match e {
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            } => {
                self.nat.relays.held(&relay_peer_id);
                if !renewal {
                    info!(relay = %relay_peer_id, "holding a relay reservation");
                    self.shared.net_event(NetEvent::Reservation {
                        relay: relay_peer_id.to_string(),
                        ok: true,
                        error: None,
                    });
                }
                self.update_reach();
            }
            other => debug!(?other, "relay client"),
        }
    }

    pub(super) fn on_relay(&mut self, e: relay::Event) {
        // (libp2p says "reservation closed" at every close of a connection of a peer it
        // knows: a holder counts until its last connection closes or its slot times out.)
        match &e {
            relay::Event::ReservationReqAccepted { src_peer_id, .. } => {
                self.nat.holders.insert(*src_peer_id);
            }
            relay::Event::ReservationClosed { src_peer_id }
                if !self.swarm.is_connected(src_peer_id) =>
            {
                self.nat.holders.remove(src_peer_id);
            }
            relay::Event::ReservationTimedOut { src_peer_id } => {
                self.nat.holders.remove(src_peer_id);
            }
            _ => {}
        }
        let mut n = lock(&self.shared.net);
        let load = &mut n.relay;
        load.reservations = self.nat.holders.len() as u64;
        match e {
            relay::Event::CircuitReqAccepted { .. } => {
                load.circuits += 1;
                load.circuits_total += 1;
            }
            relay::Event::CircuitClosed { .. } => load.circuits = load.circuits.saturating_sub(1),
            relay::Event::CircuitReqDenied { .. } | relay::Event::ReservationReqDenied { .. } => {
                load.refused += 1
            }
            _ => {}
        }
    }

    pub(super) fn on_dcutr(&mut self, e: dcutr::Event) {
        let peer = e.remote_peer_id;
        match e.result {
            Ok(id) => {
                info!(%peer, "hole punched: a direct connection");
                if let Some(c) = self.conns.get_mut(&id) {
                    c.kind = LinkKind::HolePunched;
                    let remote = c.remote.to_string();
                    if let Some(l) = lock(&self.shared.net).links.get_mut(&peer) {
                        for (i, k) in l.iter_mut() {
                            if *i == id {
                                *k = LinkKind::HolePunched;
                            }
                        }
                    }
                    self.shared.net_event(NetEvent::HolePunch {
                        peer: peer.to_string(),
                        ok: true,
                        error: None,
                        addr: Some(remote),
                    });
                }
                // Streams pick one of a peer's connections at random: the relayed ones
                // are closed, so bulk streams run on the direct connection; after a
                // grace, so what runs on them now (often the very request that made the
                // connection) can end.
                let cmd = self.cmd.clone();
                self.shared.spawn(async move {
                    tokio::time::sleep(RELAYED_GRACE).await;
                    if let Some(tx) = cmd.upgrade() {
                        let _ = tx.send(Command::CloseRelayed(peer)).await;
                    }
                });
            }
            Err(error) => {
                debug!(%peer, "hole punch failed: {error}");
                self.shared.net_event(NetEvent::HolePunch {
                    peer: peer.to_string(),
                    ok: false,
                    error: Some(error.to_string()),
                    addr: None,
                });
            }
        }
    }

    pub(super) fn on_upnp(&mut self, e: upnp::Event) {
        match e {
            upnp::Event::NewExternalAddr { external_addr, .. } => {
                info!(%external_addr, "a UPnP gateway forwards a listen port");
                self.nat.upnp += 1;
                self.update_reach();
            }
            upnp::Event::ExpiredExternalAddr { external_addr, .. } => {
                warn!(%external_addr, "the UPnP gateway's port forwarding expired");
                self.nat.upnp = self.nat.upnp.saturating_sub(1);
                self.update_reach();
            }
            upnp::Event::GatewayNotFound => debug!("no UPnP gateway"),
            upnp::Event::NonRoutableGateway => debug!("the UPnP gateway is behind NAT too"),
        }
    }
}

/// The relay a relayed address goes through.
fn relay_of(a: &Multiaddr) -> Option<PeerId> {
    let mut last = None;
    for p in a.iter() {
        match p {
            Protocol::P2p(id) => last = Some(id),
            Protocol::P2pCircuit => return last,
            _ => {}
        }
    }
    None
}

/// Every address of `addrs` resolved (see `addrs::resolve`); each that fails is said,
/// logged and recorded as a network event.
async fn resolve_all(shared: &crate::swarm::shared::Shared, addrs: &[Multiaddr]) -> Vec<Multiaddr> {
    let mut out = Vec::new();
    for a in addrs {
        match tokio::time::timeout(std::time::Duration::from_secs(5), addrs::resolve(a)).await {
            Ok(Ok(r)) => out.extend(r),
            Ok(Err(e)) => {
                warn!("bootstrap peer {e} (tried again)");
                shared.net_event(NetEvent::Bootstrap {
                    addr: a.to_string(),
                    error: e.to_string(),
                });
            }
            Err(_) => {
                warn!(addr = %a, "bootstrap peer: resolving took over 5 s (tried again)");
                shared.net_event(NetEvent::Bootstrap {
                    addr: a.to_string(),
                    error: "resolving took over 5 s".into(),
                });
            }
        }
    }
    out
}
