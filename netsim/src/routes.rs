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

use agentjet::swarm::{LinkKind, NetEvent, PeerId, Reachability};

use crate::cluster::SimPeer;
use crate::net::{lock, Nat};

/// A pair of classes, the lower first ("public-cone").
pub type ClassPair = (Nat, Nat);

fn class_pair(a: Nat, b: Nat) -> ClassPair {
    if a <= b {
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
}

/// The reports of one cluster's peers.
#[derive(Default)]
pub struct Routes {
    classes: Arc<Mutex<HashMap<PeerId, Nat>>>,
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
    /// Keeps `p`'s network events from now on (and those it already had).
    pub fn watch(&self, p: &Arc<SimPeer>) {
        lock(&self.classes).insert(p.peer_id, p.nat);
        let (classes, events) = (self.classes.clone(), self.events.clone());
        let (me, my_nat, started) = (p.peer_id, p.nat, Instant::now());
        p.handle.forward_net_events(move |e| {
            let mut ev = lock(&events);
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

    /// How the live peers among `peers` are connected now, and what their relays carry.
    pub fn snapshot(&self, peers: &[Arc<SimPeer>]) -> Snapshot {
        let class: HashMap<PeerId, Nat> = peers.iter().map(|p| (p.peer_id, p.nat)).collect();
        // Each side's kinds of each pair, merged: hole-punched if either side says so,
        // else direct if either has a direct connection, else relayed.
        let mut seen: HashMap<(PeerId, PeerId), (bool, bool)> = HashMap::new();
        for p in peers {
            for (q, kinds) in p.handle.links() {
                if !class.contains_key(&q) {
                    continue;
                }
                let key = if p.peer_id < q {
                    (p.peer_id, q)
                } else {
                    (q, p.peer_id)
                };
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
        for p in peers {
            if p.nat == Nat::Public {
                let l = p.handle.relay_load();
                s.relay_reservations.push(l.reservations);
                s.relay_circuits.push(l.circuits);
                s.relay_circuits_total.push(l.circuits_total);
                s.relay_refused += l.refused;
            } else {
                s.natted += 1;
                if p.handle.reachability() == Reachability::Relayed {
                    s.relayed_peers += 1;
                }
                if let Some(d) = ev.relayed_after.get(&p.peer_id) {
                    s.relayed_after.push(*d);
                }
            }
        }
        s
    }
}
