//! What the peers of a NAT mix report of their connections: how each connected pair is
//! connected (direct, hole-punched, relayed) by the classes of its two ends, hole punches
//! tried and met, relay reservations, how long a peer behind NAT took to be reachable
//! through a relay, and what the relays carry.
//!
//! Fed by each peer's own network events (`SwarmHandle::forward_net_events`) and read from
//! its connection table (`SwarmHandle::links`): the figures are the product's own account.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentjet::swarm::{LinkKind, NetEvent, PeerId, Protocol, Reachability, SwarmHandle};

use crate::net::{lock, Nat, NodeId};
use crate::transport::node_of;

/// A pair of classes, the lower first ("public-cone").
pub type ClassPair = (Nat, Nat);

fn class_pair(a: Nat, b: Nat) -> ClassPair {
    if a <= b {
        (a, b)
    } else {
        (b, a)
    }
}

/// The start of an error message, enough to tell causes apart in a tally.
fn short(e: &str) -> String {
    e.chars().take(120).collect()
}

fn ordered(a: PeerId, b: PeerId) -> (PeerId, PeerId) {
    if a < b {
        (a, b)
    } else {
        (b, a)
    }
}

/// "P-C" for (public, cone).
pub fn pair_label(p: ClassPair) -> String {
    let l = |n: Nat| n.as_str()[..1].to_uppercase();
    format!("{}-{}", l(p.0), l(p.1))
}

#[derive(Debug, Default, Clone)]
struct Events {
    /// Hole punches per class pair: (met, tried), as the punching side reported them.
    punches: BTreeMap<ClassPair, (u64, u64)>,
    reservations_ok: u64,
    reservations_refused: u64,
    /// Per peer behind NAT, start to its first "reachable through a relay".
    relayed_after: HashMap<PeerId, Duration>,
    /// The relay of the last relayed connection each pair opened (as its dialer said:
    /// the other end sees no relay in its address).
    relays: HashMap<(PeerId, PeerId), NodeId>,
    /// Events by kind (the first word of their debug form), over the run.
    counts: BTreeMap<String, u64>,
}

/// The reports of one cluster's peers.
#[derive(Default)]
pub struct Routes {
    classes: Arc<Mutex<HashMap<PeerId, Nat>>>,
    nodes: Mutex<HashMap<NodeId, PeerId>>,
    events: Arc<Mutex<Events>>,
}

/// Connected pairs of one class pair, by how they are connected.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Kinds {
    pub direct: usize,
    pub punched: usize,
    pub relayed: usize,
}

impl Kinds {
    pub fn total(&self) -> usize {
        self.direct + self.punched + self.relayed
    }

    fn add(&mut self, o: &Kinds) {
        self.direct += o.direct;
        self.punched += o.punched;
        self.relayed += o.relayed;
    }
}

/// A snapshot of the cluster's connections and relays.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    pub pairs: BTreeMap<ClassPair, Kinds>,
    pub punches: BTreeMap<ClassPair, (u64, u64)>,
    /// Peers behind NAT now reachable through a relay, and how many are behind NAT.
    pub relayed_peers: usize,
    pub natted: usize,
    /// Start to reachable-through-a-relay, per peer that got there.
    pub relayed_after: Vec<Duration>,
    pub reservations_ok: u64,
    pub reservations_refused: u64,
    /// Per public peer: reservations it holds now, circuits open now, circuits since start.
    pub relay_reservations: Vec<u64>,
    pub relay_circuits: Vec<u64>,
    pub relay_circuits_total: Vec<u64>,
    /// Reservations and circuits the relays refused (their limits).
    pub relay_refused: u64,
}

impl Snapshot {
    /// Every connected pair, by kind.
    pub fn all(&self) -> Kinds {
        let mut k = Kinds::default();
        for v in self.pairs.values() {
            k.add(v);
        }
        k
    }
}

impl Routes {
    /// Keeps the network events of the peer at `node` from now on (and those it already
    /// had).
    pub fn watch(&self, node: NodeId, me: PeerId, my_nat: Nat, handle: &SwarmHandle) {
        lock(&self.classes).insert(me, my_nat);
        lock(&self.nodes).insert(node, me);
        let (classes, events) = (self.classes.clone(), self.events.clone());
        let started = Instant::now();
        handle.forward_net_events(move |e| {
            let mut ev = lock(&events);
            let theirs = |peer: &str| {
                peer.parse::<PeerId>()
                    .ok()
                    .and_then(|p| lock(&classes).get(&p).copied())
            };
            let pair = |peer: &str| {
                theirs(peer).map_or_else(|| "?".to_string(), |t| pair_label(class_pair(my_nat, t)))
            };
            let key = match &e {
                NetEvent::Reachability { status, .. } => {
                    format!("Reachability {}", status.as_str())
                }
                NetEvent::Addresses { .. } => "Addresses".to_string(),
                NetEvent::Connected { peer, kind, .. } => {
                    format!("Connected {} {}", kind.as_str(), pair(peer))
                }
                NetEvent::Closed { peer, kind } => {
                    format!("Closed {} {}", kind.as_str(), pair(peer))
                }
                NetEvent::Reservation { ok: true, .. } => "Reservation taken".to_string(),
                NetEvent::Reservation { error, .. } => format!(
                    "Reservation refused: {}",
                    short(error.as_deref().unwrap_or("no reason"))
                ),
                NetEvent::HolePunch { ok, peer, .. } => format!(
                    "HolePunch {} {}",
                    if *ok { "met" } else { "failed" },
                    pair(peer)
                ),
                NetEvent::Bootstrap { error, .. } => format!("Bootstrap: {}", short(error)),
            };
            *ev.counts.entry(key).or_default() += 1;
            match e {
                NetEvent::HolePunch { peer, ok, .. } => {
                    let Ok(peer) = peer.parse::<PeerId>() else {
                        return;
                    };
                    let Some(theirs) = lock(&classes).get(&peer).copied() else {
                        return;
                    };
                    let c = ev.punches.entry(class_pair(my_nat, theirs)).or_default();
                    c.0 += ok as u64;
                    c.1 += 1;
                }
                NetEvent::Connected {
                    peer,
                    kind: LinkKind::Relayed,
                    addr,
                } => {
                    let relay = addr
                        .parse::<agentjet::swarm::Multiaddr>()
                        .ok()
                        .and_then(|a| {
                            let first: agentjet::swarm::Multiaddr = a
                                .iter()
                                .take_while(|p| !matches!(p, Protocol::P2p(_)))
                                .collect();
                            node_of(&first)
                        });
                    if let (Ok(peer), Some(r)) = (peer.parse::<PeerId>(), relay) {
                        ev.relays.insert(ordered(me, peer), r);
                    }
                }
                NetEvent::Reservation { ok: true, .. } => ev.reservations_ok += 1,
                NetEvent::Reservation { ok: false, .. } => ev.reservations_refused += 1,
                NetEvent::Reachability {
                    status: Reachability::Relayed,
                    ..
                } => {
                    ev.relayed_after.entry(me).or_insert(started.elapsed());
                }
                _ => {}
            }
        });
    }

    /// The network events so far, by kind (with the pair's classes, or why it failed).
    pub fn event_counts(&self) -> BTreeMap<String, u64> {
        lock(&self.events).counts.clone()
    }

    /// The peer at `node` (one this cluster watches).
    pub fn peer_at(&self, node: NodeId) -> Option<PeerId> {
        lock(&self.nodes).get(&node).copied()
    }

    /// The relay that carries the last relayed connection between `a` and `b`.
    pub fn relay_between(&self, a: PeerId, b: PeerId) -> Option<NodeId> {
        lock(&self.events).relays.get(&ordered(a, b)).copied()
    }

    /// How `peers` (id, class, swarm) are connected now, and what their relays carry.
    pub fn snapshot(&self, peers: &[(PeerId, Nat, &SwarmHandle)]) -> Snapshot {
        let class: HashMap<PeerId, Nat> = peers.iter().map(|p| (p.0, p.1)).collect();
        // Each side's kinds of each pair, merged: hole-punched if either side says so,
        // else direct if either has a direct connection, else relayed.
        let mut seen: HashMap<(PeerId, PeerId), (bool, bool)> = HashMap::new();
        for (me, _, handle) in peers {
            for (q, kinds) in handle.links() {
                if !class.contains_key(&q) {
                    continue;
                }
                let key = ordered(*me, q);
                let e = seen.entry(key).or_default();
                e.0 |= kinds.contains(&LinkKind::HolePunched);
                e.1 |= kinds.contains(&LinkKind::Direct);
            }
        }
        let mut s = Snapshot::default();
        for ((a, b), (punched, direct)) in seen {
            let k = s.pairs.entry(class_pair(class[&a], class[&b])).or_default();
            if punched {
                k.punched += 1;
            } else if direct {
                k.direct += 1;
            } else {
                k.relayed += 1;
            }
        }
        let ev = lock(&self.events).clone();
        s.punches = ev.punches;
        s.reservations_ok = ev.reservations_ok;
        s.reservations_refused = ev.reservations_refused;
        for (me, nat, handle) in peers {
            if *nat == Nat::Public {
                let l = handle.relay_load();
                s.relay_reservations.push(l.reservations);
                s.relay_circuits.push(l.circuits);
                s.relay_circuits_total.push(l.circuits_total);
                s.relay_refused += l.refused;
            } else {
                s.natted += 1;
                if handle.reachability() == Reachability::Relayed {
                    s.relayed_peers += 1;
                }
                if let Some(d) = ev.relayed_after.get(me) {
                    s.relayed_after.push(*d);
                }
            }
        }
        s
    }
}

impl Snapshot {
    /// The markdown table: connected pairs by class pair and kind, punches, then a line on
    /// reservations and relays. `mix`: "30/50/20".
    pub fn markdown(&self, mix: &str) -> String {
        use crate::report::{quantile, secs, Table};
        let mut t = Table::new(&[
            "pair of ends",
            "connected pairs",
            "direct",
            "hole-punched",
            "relayed",
            "hole punches met / tried",
        ]);
        let pct = |x: usize, n: usize| format!("{:.1}%", 100.0 * x as f64 / n.max(1) as f64);
        let classes = [Nat::Public, Nat::Cone, Nat::Symmetric];
        let mut keys: Vec<ClassPair> = Vec::new();
        for (i, a) in classes.iter().enumerate() {
            for b in &classes[i..] {
                keys.push((*a, *b));
            }
        }
        for k in keys {
            let kinds = self.pairs.get(&k).copied().unwrap_or_default();
            let (met, tried) = self.punches.get(&k).copied().unwrap_or_default();
            t.row(vec![
                pair_label(k),
                kinds.total().to_string(),
                pct(kinds.direct, kinds.total()),
                pct(kinds.punched, kinds.total()),
                pct(kinds.relayed, kinds.total()),
                format!("{met} / {tried}"),
            ]);
        }
        let all = self.all();
        let (met, tried) = self
            .punches
            .values()
            .fold((0, 0), |a, p| (a.0 + p.0, a.1 + p.1));
        t.row(vec![
            "all".into(),
            all.total().to_string(),
            pct(all.direct, all.total()),
            pct(all.punched, all.total()),
            pct(all.relayed, all.total()),
            format!("{met} / {tried}"),
        ]);
        let u = |v: &[u64]| {
            let f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
            format!("{:.0} / {:.0}", quantile(&f, 0.5), quantile(&f, 1.0))
        };
        let after = secs(&self.relayed_after);
        format!(
            "Connections by where their ends sit (P public, C cone NAT, S symmetric NAT; mix {mix}), at the end of the run, as the peers' own connection tables say: the pairs connected then (a pair counts once; hole-punched if either end says so, else direct if either holds a direct connection), not the pairs that tried and failed or whose connection closed before. Punches as the punching side reported them, over the whole run.\n\n{}\nPeers behind NAT reachable through a relay: {} of {} (start to relayed p50 / p99: {:.1} / {:.1} s). Reservations taken / refused: {} / {}. Per relay ({} public peers): reservations held p50 / max {}, circuits open p50 / max {}, circuits since start p50 / max {}; refused by the relays' limits: {}.\n",
            t.markdown(),
            self.relayed_peers,
            self.natted,
            quantile(&after, 0.5),
            quantile(&after, 0.99),
            self.reservations_ok,
            self.reservations_refused,
            self.relay_reservations.len(),
            u(&self.relay_reservations),
            u(&self.relay_circuits),
            u(&self.relay_circuits_total),
            self.relay_refused,
        )
    }

    /// The same, for the results' JSON.
    pub fn json(&self) -> serde_json::Value {
        let pairs: serde_json::Map<String, serde_json::Value> = self
            .pairs
            .iter()
            .map(|(k, v)| {
                let (met, tried) = self.punches.get(k).copied().unwrap_or_default();
                (
                    pair_label(*k),
                    serde_json::json!({
                        "direct": v.direct, "hole_punched": v.punched, "relayed": v.relayed,
                        "punches_met": met, "punches_tried": tried,
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "pairs": pairs,
            "natted": self.natted,
            "relayed_peers": self.relayed_peers,
            "relayed_after_s": crate::report::secs(&self.relayed_after),
            "reservations_ok": self.reservations_ok,
            "reservations_refused": self.reservations_refused,
            "relay_reservations": self.relay_reservations,
            "relay_circuits": self.relay_circuits,
            "relay_circuits_total": self.relay_circuits_total,
            "relay_refused": self.relay_refused,
        })
    }
}
