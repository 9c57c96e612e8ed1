//! The simulated internet: nodes, the link between every pair (one-way latency, loss), each
//! node's access link (upload and download caps), crashes and partitions.
//!
//! A link's latency is drawn once per pair from the seed (uniform in the configured range,
//! the same in both directions), so a seed fixes the topology. Loss is on a reliable
//! stream, as TCP sees it: a lost segment (1,400 bytes) costs one retransmission timeout
//! (max(200 ms, 2 x RTT)) and holds back what follows it on that connection. A crashed
//! node, or a pair on two sides of a partition, delivers nothing: bytes wait (as TCP keeps
//! retransmitting) and arrive if the partition heals before a timeout of the protocol
//! above closes the connection; dials to it fail after the connect timeout.
//!
//! Each node sits on the internet directly ([`Nat::Public`]) or behind its own NAT router
//! ([`Nat::Cone`]: one mapping per local port, inbound let in only from an endpoint the
//! node sent to; [`Nat::Symmetric`]: a new mapping per destination, so nothing it did not
//! dial gets in). A mapping ("hole") lasts [`NetConfig::hole_ttl`] from the node's last
//! dial toward that peer (traffic on a connection does not refresh it here); the
//! transport ([`crate::transport`]) asks [`Network::admits`] before a dial gets through.
//!
//! An access link is one queue, but a connection keeps at most [`SEND_AHEAD`] of bytes
//! queued on it (see [`crate::pipe`]): a bulk transfer delays the others by that, as a
//! TCP flow's window and the bottleneck's buffer would, not by everything it wrote.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::base::Rng;
use tokio::time::Instant;

/// The most a connection keeps queued on its sender's upload link, in time at the link's
/// rate (a writer with more ahead waits).
pub const SEND_AHEAD: Duration = Duration::from_millis(250);

/// A node's index in the network; its address is `/memory/<id + 1>`.
pub type NodeId = u64;

/// What the links are like.
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub seed: u64,
    /// One-way latency of each pair, drawn uniformly from this range.
    pub latency: (Duration, Duration),
    /// Each node's upload and download cap, bytes per second (0: unlimited).
    pub bandwidth: f64,
    /// Probability that one 1,400-byte segment is lost (and retransmitted).
    pub loss: f64,
    /// A dial to a node that does not answer (crashed, partitioned away, dropped by its
    /// NAT) fails after this.
    pub connect_timeout: Duration,
    /// How long a NAT router keeps a mapping after its node last sent through it (Linux
    /// conntrack keeps an established TCP flow far longer; an unanswered one, 120 s).
    pub hole_ttl: Duration,
    /// How long a dial its peer's NAT dropped waits for the peer's own dial to meet it (a
    /// simultaneous open, as a hole punch arranges).
    pub punch_window: Duration,
}

/// Where a node sits on the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Nat {
    /// A public address: any node can dial it.
    Public,
    /// Behind a cone NAT (Linux MASQUERADE): a node it has sent to can reach it back at
    /// the port it sent from, so two cone nodes dialing each other at once connect.
    Cone,
    /// Behind a symmetric NAT (MASQUERADE --random-fully): each destination sees another
    /// port, so only the peers it dials reach it, on those connections alone.
    Symmetric,
}

impl Nat {
    pub fn as_str(self) -> &'static str {
        match self {
            Nat::Public => "public",
            Nat::Cone => "cone",
            Nat::Symmetric => "symmetric",
        }
    }
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            seed: 1,
            latency: (Duration::from_millis(20), Duration::from_millis(200)),
            bandwidth: 0.0,
            loss: 0.0,
            connect_timeout: Duration::from_secs(3),
            hole_ttl: Duration::from_secs(120),
            punch_window: Duration::from_secs(2),
        }
    }
}

/// When a write leaves the sender's access link and when it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scheduled {
    pub departs: Instant,
    pub arrives: Instant,
}

/// Bytes a node sent and received (what crossed its access link).
#[derive(Debug, Default)]
pub struct Traffic {
    pub sent: AtomicU64,
    pub received: AtomicU64,
}

#[derive(Debug)]
struct Node {
    nat: Nat,
    /// When its upload and download links are next free.
    up_free: Mutex<Instant>,
    down_free: Mutex<Instant>,
    crashed: AtomicBool,
    traffic: Traffic,
}

/// The network every simulated transport shares. Cheap to clone.
#[derive(Clone)]
pub struct Network {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: NetConfig,
    nodes: Mutex<Vec<Arc<Node>>>,
    /// Each node's side while partitioned (None: no partition).
    sides: Mutex<Option<Vec<u8>>>,
    partitioned: AtomicBool,
    /// Draws of segment loss (in the order writes happen: not fixed by the seed).
    loss_rng: Mutex<Rng>,
    /// NAT mappings: (a, b) -> when a last sent to b through its router.
    holes: Mutex<HashMap<(NodeId, NodeId), Instant>>,
}

impl Network {
    pub fn new(cfg: NetConfig) -> Network {
        Network {
            inner: Arc::new(Inner {
                cfg: cfg.clone(),
                nodes: Mutex::new(Vec::new()),
                sides: Mutex::new(None),
                partitioned: AtomicBool::new(false),
                loss_rng: Mutex::new(Rng::seeded(cfg.seed ^ 0x5eed)),
                holes: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn config(&self) -> &NetConfig {
        &self.inner.cfg
    }

    /// A new node with a public address (its id is the next index).
    pub fn add_node(&self) -> NodeId {
        self.add_node_behind(Nat::Public)
    }

    /// A new node where `nat` says.
    pub fn add_node_behind(&self, nat: Nat) -> NodeId {
        let now = Instant::now();
        let mut nodes = lock(&self.inner.nodes);
        nodes.push(Arc::new(Node {
            nat,
            up_free: Mutex::new(now),
            down_free: Mutex::new(now),
            crashed: AtomicBool::new(false),
            traffic: Traffic::default(),
        }));
        nodes.len() as NodeId - 1
    }

    fn node(&self, id: NodeId) -> Option<Arc<Node>> {
        lock(&self.inner.nodes).get(id as usize).cloned()
    }

    /// Where node `id` sits (an unknown node: public).
    pub fn nat(&self, id: NodeId) -> Nat {
        self.node(id).map_or(Nat::Public, |n| n.nat)
    }

    /// `from` sends to `to`: its router (if any) maps the flow for [`NetConfig::hole_ttl`].
    pub fn open_hole(&self, from: NodeId, to: NodeId) {
        if self.nat(from) != Nat::Public {
            lock(&self.inner.holes).insert((from, to), Instant::now());
        }
    }

    /// Whether a dial from `from` to `to` gets through `to`'s router (if it has one).
    /// `reuse`: the dial leaves from the port `from` listens on (libp2p's default; AutoNAT's
    /// dial-back uses a new port). A cone router lets it in when `to` sent to `from` lately
    /// and `from` is not behind a symmetric NAT (whose port for `to` nobody knows); a
    /// symmetric router never does.
    pub fn admits(&self, from: NodeId, to: NodeId, reuse: bool) -> bool {
        match self.nat(to) {
            Nat::Public => true,
            Nat::Symmetric => false,
            Nat::Cone => {
                reuse && self.nat(from) != Nat::Symmetric && {
                    let ttl = self.inner.cfg.hole_ttl;
                    lock(&self.inner.holes)
                        .get(&(to, from))
                        .is_some_and(|t| t.elapsed() < ttl)
                }
            }
        }
    }

    /// Whether two nodes dialing each other at once meet (a hole punch): neither router
    /// is symmetric.
    pub fn punchable(&self, a: NodeId, b: NodeId) -> bool {
        self.nat(a) != Nat::Symmetric && self.nat(b) != Nat::Symmetric
    }

    /// The one-way latency between two nodes (drawn from the seed and the pair).
    pub fn latency(&self, a: NodeId, b: NodeId) -> Duration {
        let (lo, hi) = self.inner.cfg.latency;
        if hi <= lo {
            return lo;
        }
        let (x, y) = if a <= b { (a, b) } else { (b, a) };
        let mut rng = Rng::seeded(
            self.inner.cfg.seed ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ y.rotate_left(29),
        );
        lo + (hi - lo).mul_f64(rng.next_f64())
    }

    /// The node stops: nothing reaches it or leaves it from now on.
    pub fn crash(&self, id: NodeId) {
        if let Some(n) = self.node(id) {
            n.crashed.store(true, Ordering::SeqCst);
        }
    }

    pub fn is_crashed(&self, id: NodeId) -> bool {
        self.node(id)
            .is_none_or(|n| n.crashed.load(Ordering::SeqCst))
    }

    /// Splits the nodes: `side[i]` is node i's side; pairs on different sides are cut.
    pub fn partition(&self, side: Vec<u8>) {
        *lock(&self.inner.sides) = Some(side);
        self.inner.partitioned.store(true, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        *lock(&self.inner.sides) = None;
        self.inner.partitioned.store(false, Ordering::SeqCst);
    }

    /// Whether nothing passes between `a` and `b` now.
    pub fn cut(&self, a: NodeId, b: NodeId) -> bool {
        if self.is_crashed(a) || self.is_crashed(b) {
            return true;
        }
        if !self.inner.partitioned.load(Ordering::Relaxed) {
            return false;
        }
        match &*lock(&self.inner.sides) {
            Some(s) => s.get(a as usize) != s.get(b as usize),
            None => false,
        }
    }

    /// When `len` bytes written now by `from` leave its upload link and when they arrive
    /// at `to`: the sender's upload link, the latency, retransmissions of lost segments,
    /// then the receiver's download link.
    pub(crate) fn schedule(&self, from: NodeId, to: NodeId, len: usize, now: Instant) -> Scheduled {
        let cfg = &self.inner.cfg;
        let (Some(src), Some(dst)) = (self.node(from), self.node(to)) else {
            return Scheduled {
                departs: now,
                arrives: now,
            };
        };
        src.traffic.sent.fetch_add(len as u64, Ordering::Relaxed);
        dst.traffic
            .received
            .fetch_add(len as u64, Ordering::Relaxed);
        let serialise = if cfg.bandwidth > 0.0 {
            Duration::from_secs_f64(len as f64 / cfg.bandwidth)
        } else {
            Duration::ZERO
        };
        let departed = {
            let mut free = lock(&src.up_free);
            let start = (*free).max(now);
            *free = start + serialise;
            *free
        };
        let latency = self.latency(from, to);
        let mut arrive = departed + latency;
        if cfg.loss > 0.0 {
            let segments = len.div_ceil(1400).max(1);
            let rto = (latency * 4).max(Duration::from_millis(200));
            let mut rng = lock(&self.inner.loss_rng);
            for _ in 0..segments {
                if rng.next_f64() < cfg.loss {
                    arrive += rto;
                }
            }
        }
        // The download link: bytes from several senders queue behind each other.
        let mut free = lock(&dst.down_free);
        *free = (*free).max(arrive - serialise) + serialise;
        Scheduled {
            departs: departed,
            arrives: *free,
        }
    }

    /// Bytes a node sent and received so far.
    pub fn traffic(&self, id: NodeId) -> (u64, u64) {
        self.node(id).map_or((0, 0), |n| {
            (
                n.traffic.sent.load(Ordering::Relaxed),
                n.traffic.received.load(Ordering::Relaxed),
            )
        })
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn latency_is_symmetric_within_range_and_fixed_by_the_seed() {
        let cfg = NetConfig {
            seed: 7,
            ..Default::default()
        };
        let a = Network::new(cfg.clone());
        let b = Network::new(cfg);
        for (x, y) in [(0, 1), (3, 9), (100, 2)] {
            let l = a.latency(x, y);
            assert_eq!(l, a.latency(y, x));
            assert_eq!(l, b.latency(x, y));
            assert!(l >= Duration::from_millis(20) && l <= Duration::from_millis(200));
        }
        assert_ne!(a.latency(0, 1), a.latency(0, 2));
    }

    #[tokio::test]
    async fn bandwidth_queues_writes_behind_each_other() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(50), Duration::from_millis(50)),
            bandwidth: 1e6,
            ..Default::default()
        });
        let (a, b) = (net.add_node(), net.add_node());
        let now = Instant::now();
        let first = net.schedule(a, b, 100_000, now).arrives;
        let second = net.schedule(a, b, 100_000, now).arrives;
        // 0.1 s on the wire each, then 50 ms of latency; the second waits for the first.
        assert_eq!(first - now, Duration::from_millis(150));
        assert_eq!(second - now, Duration::from_millis(250));
        assert_eq!(net.traffic(a), (200_000, 0));
        assert_eq!(net.traffic(b), (0, 200_000));
    }

    #[tokio::test]
    async fn routers_let_in_only_what_their_node_asked_for() {
        let net = Network::new(NetConfig::default());
        let p = net.add_node();
        let (c, d) = (
            net.add_node_behind(Nat::Cone),
            net.add_node_behind(Nat::Cone),
        );
        let s = net.add_node_behind(Nat::Symmetric);
        // Anyone reaches a public node; nobody reaches a NAT'd one unasked.
        assert!(net.admits(c, p, true) && net.admits(s, p, true));
        assert!(!net.admits(p, c, true) && !net.admits(d, c, true) && !net.admits(p, s, true));
        // c sent to p and to d: both may answer at that port, not from a new one.
        net.open_hole(c, p);
        net.open_hole(c, d);
        assert!(net.admits(p, c, true) && net.admits(d, c, true));
        assert!(!net.admits(p, c, false));
        // A symmetric node's port for c is not the one c sent to.
        net.open_hole(c, s);
        assert!(!net.admits(s, c, true));
        net.open_hole(s, p);
        assert!(!net.admits(p, s, true));
        assert!(net.punchable(c, d) && !net.punchable(c, s) && net.punchable(p, c));
    }

    #[tokio::test]
    async fn a_hole_closes_after_its_ttl() {
        let net = Network::new(NetConfig {
            hole_ttl: Duration::from_millis(100),
            ..Default::default()
        });
        let (p, c) = (net.add_node(), net.add_node_behind(Nat::Cone));
        net.open_hole(c, p);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!net.admits(p, c, true));
        net.open_hole(c, p);
        assert!(net.admits(p, c, true));
    }

    #[tokio::test]
    async fn partitions_and_crashes_cut_pairs() {
        let net = Network::new(NetConfig::default());
        let ids: Vec<_> = (0..3).map(|_| net.add_node()).collect();
        assert!(!net.cut(ids[0], ids[1]));
        net.partition(vec![0, 0, 1]);
        assert!(!net.cut(0, 1) && net.cut(0, 2) && net.cut(2, 1));
        net.heal();
        assert!(!net.cut(0, 2));
        net.crash(1);
        assert!(net.cut(0, 1) && !net.cut(0, 2));
    }
}
