//! The simulated network as a libp2p transport: a node listens on `/memory/<id + 1>`, a
//! dial takes one round trip (the TCP handshake) before the stream exists, and the stream
//! is upgraded with the same noise and yamux the real peers use. [`other_transport`] hands
//! it to the swarm's `SwarmConfig::other_transport`.
//!
//! NAT: a dial first opens its node's mapping toward the target
//! ([`Network::open_hole`]); the target's router lets it in or drops it
//! ([`Network::admits`]). A dropped dial waits [`crate::net::NetConfig::punch_window`] for
//! the target's own dial toward it with the opposite role (DCUtR's pair: one side
//! overrides its role to listener); when neither router is symmetric the two meet as one
//! connection, as a TCP simultaneous open does. Otherwise it times out.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentjet::swarm::{Keypair, Multiaddr, OtherTransport, Protocol};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::channel::mpsc;
use futures::future::{BoxFuture, Ready};
use futures::{FutureExt, StreamExt};
use libp2p::core::transport::{DialOpts, ListenerId, PortUse, TransportError, TransportEvent};
use libp2p::core::upgrade::Version;
use libp2p::core::Endpoint;
use libp2p::core::Transport;
use libp2p::{noise, yamux};
use tokio::sync::oneshot;

use crate::net::{lock, Network, NodeId};
use crate::pipe::{pair, SimStream};

/// A connection offered to a listener: the stream and who dialed.
pub(crate) struct Incoming {
    stream: SimStream,
    from: NodeId,
}

/// A dial its target's router dropped, waiting for the target's dial toward it.
struct Punch {
    id: u64,
    /// Whether this dial takes the listener's role on the connection it makes.
    as_listener: bool,
    meet: oneshot::Sender<SimStream>,
}

/// Every node's listener on one simulated network (one registry per [`Network`]), and
/// the dials waiting to meet their counterpart.
#[derive(Default)]
pub struct Listeners {
    map: std::sync::Mutex<HashMap<NodeId, mpsc::UnboundedSender<Incoming>>>,
    punches: std::sync::Mutex<HashMap<(NodeId, NodeId), Vec<Punch>>>,
    next_punch: AtomicU64,
    /// Hole punches met (simultaneous opens), for the reports.
    pub met: AtomicU64,
}

impl Listeners {
    fn listen(&self, id: NodeId) -> mpsc::UnboundedReceiver<Incoming> {
        let (tx, rx) = mpsc::unbounded();
        lock(&self.map).insert(id, tx);
        rx
    }

    fn unlisten(&self, id: NodeId) {
        lock(&self.map).remove(&id);
    }

    /// Hands a new connection to `to`'s listener; false when nothing listens there.
    fn offer(&self, to: NodeId, inc: Incoming) -> bool {
        match lock(&self.map).get(&to) {
            Some(tx) => tx.unbounded_send(inc).is_ok(),
            None => false,
        }
    }

    fn listening(&self, id: NodeId) -> bool {
        lock(&self.map).contains_key(&id)
    }

    /// Meets a dial of `to` toward `from` in flight with the opposite role (both SYNs
    /// crossed: a simultaneous open): hands it its end of a new connection and returns
    /// ours. `id`: this dial's own entry, withdrawn in the same step (so the two dials
    /// cannot each meet the other); None when another dial met this one first (its stream
    /// is on the way) or none waits.
    fn meet(
        &self,
        net: &Network,
        from: NodeId,
        to: NodeId,
        as_listener: bool,
        id: u64,
    ) -> Option<SimStream> {
        if from == to || !net.punchable(from, to) {
            return None;
        }
        let theirs = {
            let mut punches = lock(&self.punches);
            let i = punches
                .get(&(to, from))?
                .iter()
                .position(|p| p.as_listener != as_listener && !p.meet.is_closed())?;
            let mine = punches.get_mut(&(from, to))?;
            let j = mine.iter().position(|p| p.id == id)?;
            mine.swap_remove(j);
            if mine.is_empty() {
                punches.remove(&(from, to));
            }
            let waiting = punches.get_mut(&(to, from))?;
            let p = waiting.swap_remove(i);
            if waiting.is_empty() {
                punches.remove(&(to, from));
            }
            p
        };
        let (mine, other) = pair(net, from, to);
        // Their dial may have ended since (its future dropped): then nothing met.
        theirs.meet.send(other).ok()?;
        self.met.fetch_add(1, Ordering::Relaxed);
        Some(mine)
    }

    /// Withdraws a dial from meeting others; false when one met it already (its stream
    /// is on its way).
    fn cancel_punch(&self, from: NodeId, to: NodeId, id: u64) -> bool {
        let mut punches = lock(&self.punches);
        let Some(w) = punches.get_mut(&(from, to)) else {
            return false;
        };
        let before = w.len();
        w.retain(|p| p.id != id);
        let found = w.len() < before;
        if w.is_empty() {
            punches.remove(&(from, to));
        }
        found
    }
}

/// A dial in flight, registered to meet its counterpart; withdrawn when dropped.
struct Punching {
    listeners: Arc<Listeners>,
    from: NodeId,
    to: NodeId,
    id: u64,
    withdrawn: bool,
}

impl Punching {
    fn start(
        listeners: &Arc<Listeners>,
        from: NodeId,
        to: NodeId,
        as_listener: bool,
    ) -> (Punching, oneshot::Receiver<SimStream>) {
        let (meet, rx) = oneshot::channel();
        let id = listeners.next_punch.fetch_add(1, Ordering::Relaxed);
        lock(&listeners.punches)
            .entry((from, to))
            .or_default()
            .push(Punch {
                id,
                as_listener,
                meet,
            });
        let p = Punching {
            listeners: listeners.clone(),
            from,
            to,
            id,
            withdrawn: false,
        };
        (p, rx)
    }

    /// Withdraws it; false when another dial met it first (its stream is on the way).
    fn withdraw(&mut self) -> bool {
        self.withdrawn = true;
        self.listeners.cancel_punch(self.from, self.to, self.id)
    }
}

impl Drop for Punching {
    fn drop(&mut self) {
        if !self.withdrawn {
            self.listeners.cancel_punch(self.from, self.to, self.id);
        }
    }
}

/// The address of a node.
pub fn addr_of(id: NodeId) -> Multiaddr {
    Multiaddr::empty().with(Protocol::Memory(id + 1))
}

/// The node a `/memory/<id + 1>` address (with or without its peer id) names; None for
/// anything longer (a relayed address names the relay first, not the node).
pub fn node_of(addr: &Multiaddr) -> Option<NodeId> {
    let mut it = addr.iter();
    match (it.next(), it.next(), it.next()) {
        (Some(Protocol::Memory(p)), None | Some(Protocol::P2p(_)), None) if p > 0 => Some(p - 1),
        _ => None,
    }
}

/// One node's side of the simulated network.
pub struct SimTransport {
    net: Network,
    listeners: Arc<Listeners>,
    id: NodeId,
    listener: Option<(ListenerId, mpsc::UnboundedReceiver<Incoming>, bool)>,
}

impl SimTransport {
    pub fn new(net: Network, listeners: Arc<Listeners>, id: NodeId) -> SimTransport {
        SimTransport {
            net,
            listeners,
            id,
            listener: None,
        }
    }
}

impl Drop for SimTransport {
    fn drop(&mut self) {
        if self.listener.is_some() {
            self.listeners.unlisten(self.id);
        }
    }
}

impl Transport for SimTransport {
    type Output = SimStream;
    type Error = io::Error;
    type ListenerUpgrade = Ready<Result<SimStream, io::Error>>;
    type Dial = BoxFuture<'static, Result<SimStream, io::Error>>;

    fn listen_on(
        &mut self,
        id: ListenerId,
        addr: Multiaddr,
    ) -> Result<(), TransportError<io::Error>> {
        match node_of(&addr) {
            Some(n) if n == self.id && self.listener.is_none() => {
                self.listener = Some((id, self.listeners.listen(self.id), true));
                Ok(())
            }
            Some(_) => Err(TransportError::Other(io::Error::new(
                io::ErrorKind::AddrNotAvailable,
                format!("node {} can only listen on {}", self.id, addr_of(self.id)),
            ))),
            None => Err(TransportError::MultiaddrNotSupported(addr)),
        }
    }

    fn remove_listener(&mut self, id: ListenerId) -> bool {
        if self.listener.as_ref().is_some_and(|l| l.0 == id) {
            self.listener = None;
            self.listeners.unlisten(self.id);
            return true;
        }
        false
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        opts: DialOpts,
    ) -> Result<Self::Dial, TransportError<io::Error>> {
        let Some(to) = node_of(&addr) else {
            return Err(TransportError::MultiaddrNotSupported(addr));
        };
        let (net, listeners, from) = (self.net.clone(), self.listeners.clone(), self.id);
        let as_listener = opts.role == Endpoint::Listener;
        let reuse = opts.port_use == PortUse::Reuse;
        Ok(async move {
            let cfg = net.config().clone();
            let one_way = net.latency(from, to);
            net.open_hole(from, to);
            if net.cut(from, to) {
                // No answer: the dial times out.
                tokio::time::sleep(cfg.connect_timeout).await;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{addr}: no answer"),
                ));
            }
            // In flight: `to`'s own dial toward us may meet this one on the way. The guard
            // withdraws it however this dial ends (libp2p drops the dials that lost a race).
            let (mut punch, rx) = Punching::start(&listeners, from, to, as_listener);
            let mut rx = rx;
            let early = tokio::select! {
                s = &mut rx => Some(s),
                _ = tokio::time::sleep(one_way) => None,
            };
            let mut rx = match early {
                Some(Ok(s)) => return Ok(s),
                Some(Err(_)) => None,
                None => Some(rx),
            };
            // The SYN reaches the target's router.
            if let Some(mine) = listeners.meet(&net, from, to, as_listener, punch.id) {
                punch.withdrawn = true;
                return Ok(mine);
            }
            if !net.admits(from, to, reuse) {
                // Dropped: only the target's own dial toward us can still meet this one.
                if let Some(r) = rx.as_mut() {
                    match tokio::time::timeout(cfg.punch_window, r).await {
                        Ok(Ok(s)) => return Ok(s),
                        Ok(Err(_)) => rx = None,
                        Err(_) => {}
                    }
                }
                if let (false, Some(r)) = (punch.withdraw(), rx.take()) {
                    // Met just now: its stream is on the way.
                    if let Ok(s) = r.await {
                        return Ok(s);
                    }
                }
                let waited = one_way + cfg.punch_window;
                tokio::time::sleep(cfg.connect_timeout.saturating_sub(waited)).await;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{addr}: no answer (dropped by its NAT)"),
                ));
            }
            if let (false, Some(r)) = (punch.withdraw(), rx.take()) {
                if let Ok(s) = r.await {
                    return Ok(s);
                }
            }
            tokio::time::sleep(one_way).await;
            if net.is_crashed(to) || !listeners.listening(to) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!("{addr}: nothing listens"),
                ));
            }
            let (mine, theirs) = pair(&net, from, to);
            if !listeners.offer(
                to,
                Incoming {
                    stream: theirs,
                    from,
                },
            ) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionRefused,
                    format!("{addr}: gone"),
                ));
            }
            Ok(mine)
        }
        .boxed())
    }

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<TransportEvent<Self::ListenerUpgrade, io::Error>> {
        let me = self.id;
        let Some((listener_id, rx, announce)) = self.listener.as_mut() else {
            return Poll::Pending;
        };
        let listener_id = *listener_id;
        if *announce {
            *announce = false;
            return Poll::Ready(TransportEvent::NewAddress {
                listener_id,
                listen_addr: addr_of(me),
            });
        }
        match rx.poll_next_unpin(cx) {
            Poll::Ready(Some(inc)) => Poll::Ready(TransportEvent::Incoming {
                listener_id,
                upgrade: futures::future::ready(Ok(inc.stream)),
                local_addr: addr_of(me),
                send_back_addr: addr_of(inc.from),
            }),
            Poll::Ready(None) => {
                self.listener = None;
                Poll::Ready(TransportEvent::ListenerClosed {
                    listener_id,
                    reason: Ok(()),
                })
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The swarm's extra transport for node `id`: the simulated network, with noise and yamux,
/// negotiated as the binary's TCP transport does (libp2p's builder: multistream-select
/// `V1Lazy`, so the dialer's noise and yamux negotiations cost no round trip of their own).
pub fn other_transport(net: &Network, listeners: &Arc<Listeners>, id: NodeId) -> OtherTransport {
    let (net, listeners) = (net.clone(), listeners.clone());
    OtherTransport(Arc::new(move |key: &Keypair| {
        let noise = noise::Config::new(key).map_err(|e| format!("noise: {e}"))?;
        Ok(SimTransport::new(net.clone(), listeners.clone(), id)
            .upgrade(Version::V1Lazy)
            .authenticate(noise)
            .multiplex(yamux::Config::default())
            .map(|(peer, muxer), _| (peer, libp2p::core::muxing::StreamMuxerBox::new(muxer)))
            .boxed())
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::net::{Nat, NetConfig};

    fn net() -> (Network, Arc<Listeners>) {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(5), Duration::from_millis(5)),
            connect_timeout: Duration::from_millis(400),
            punch_window: Duration::from_millis(200),
            ..Default::default()
        });
        (net, Arc::new(Listeners::default()))
    }

    fn node(net: &Network, l: &Arc<Listeners>, nat: Nat) -> SimTransport {
        let id = net.add_node_behind(nat);
        let mut t = SimTransport::new(net.clone(), l.clone(), id);
        t.listen_on(ListenerId::next(), addr_of(id)).unwrap();
        t
    }

    fn opts(as_listener: bool, port_use: PortUse) -> DialOpts {
        DialOpts {
            role: if as_listener {
                Endpoint::Listener
            } else {
                Endpoint::Dialer
            },
            port_use,
        }
    }

    fn dial(
        t: &mut SimTransport,
        to: NodeId,
        as_listener: bool,
    ) -> BoxFuture<'static, io::Result<SimStream>> {
        t.dial(addr_of(to), opts(as_listener, PortUse::Reuse))
            .unwrap()
    }

    #[test]
    fn a_relayed_address_names_no_node() {
        let relayed: Multiaddr =
            "/memory/3/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo/p2p-circuit"
                .parse()
                .unwrap();
        assert_eq!(node_of(&relayed), None);
        assert_eq!(node_of(&addr_of(2)), Some(2));
    }

    #[tokio::test]
    async fn a_nat_drops_what_its_node_did_not_ask_for_and_lets_replies_in() {
        let (net, l) = net();
        let mut p = node(&net, &l, Nat::Public);
        let mut c = node(&net, &l, Nat::Cone);
        let e = dial(&mut p, c.id, false).await.err().expect("dropped");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // The cone node dials out; the public one can dial back at that port, not another.
        dial(&mut c, p.id, false).await.expect("outbound");
        dial(&mut p, c.id, false)
            .await
            .expect("a reply through the mapping");
        let back = p
            .dial(addr_of(c.id), opts(false, PortUse::New))
            .unwrap()
            .await;
        assert!(back.is_err(), "a dial-back from a new port gets in");
    }

    #[tokio::test]
    async fn two_cone_nodes_dialing_each_other_at_once_meet_as_one_connection() {
        let (net, l) = net();
        let mut a = node(&net, &l, Nat::Cone);
        let mut b = node(&net, &l, Nat::Cone);
        let (da, db) = (dial(&mut a, b.id, false), dial(&mut b, a.id, true));
        let (x, y) = futures::join!(da, db);
        let (mut x, mut y) = (x.expect("a's punch"), y.expect("b's punch"));
        assert_eq!(l.met.load(Ordering::Relaxed), 1);
        x.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        y.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
    }

    #[tokio::test]
    async fn a_symmetric_nat_defeats_the_punch_and_same_roles_never_meet() {
        let (net, l) = net();
        let mut a = node(&net, &l, Nat::Cone);
        let mut s = node(&net, &l, Nat::Symmetric);
        let (x, y) = futures::join!(dial(&mut a, s.id, false), dial(&mut s, a.id, true));
        assert!(x.is_err() && y.is_err());
        let mut b = node(&net, &l, Nat::Cone);
        let mut c = node(&net, &l, Nat::Cone);
        let (x, y) = futures::join!(dial(&mut b, c.id, false), dial(&mut c, b.id, false));
        // Two dialers cannot share a connection (both would start noise): each finds the
        // other's mapping open and gets in on its own.
        assert_eq!(l.met.load(Ordering::Relaxed), 0);
        assert!(x.is_ok() && y.is_ok());
    }
}
