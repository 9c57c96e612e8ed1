//! The simulated network as a libp2p transport: a node listens on `/memory/<id + 1>`, a
//! dial takes one round trip (the TCP handshake) before the stream exists, and the stream
//! is upgraded with the same noise and yamux the real peers use. [`other_transport`] hands
//! it to the swarm's `SwarmConfig::other_transport`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentjet::swarm::{Keypair, Multiaddr, OtherTransport, Protocol};
use futures::channel::mpsc;
use futures::future::{BoxFuture, Ready};
use futures::{FutureExt, StreamExt};
use libp2p::core::transport::{DialOpts, ListenerId, TransportError, TransportEvent};
use libp2p::core::upgrade::Version;
use libp2p::core::Transport;
use libp2p::{noise, yamux};

use crate::net::{lock, Network, NodeId};
use crate::pipe::{pair, SimStream};

/// A connection offered to a listener: the stream and who dialed.
pub(crate) struct Incoming {
    stream: SimStream,
    from: NodeId,
}

/// Every node's listener on one simulated network (one registry per [`Network`]).
#[derive(Default)]
pub struct Listeners {
    map: std::sync::Mutex<std::collections::HashMap<NodeId, mpsc::UnboundedSender<Incoming>>>,
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
}

/// The address of a node.
pub fn addr_of(id: NodeId) -> Multiaddr {
    Multiaddr::empty().with(Protocol::Memory(id + 1))
}

/// The node a `/memory/<id + 1>` address (with or without its peer id) names.
pub fn node_of(addr: &Multiaddr) -> Option<NodeId> {
    let mut it = addr.iter();
    match (it.next(), it.next()) {
        (Some(Protocol::Memory(p)), None | Some(Protocol::P2p(_))) if p > 0 => Some(p - 1),
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
        _opts: DialOpts,
    ) -> Result<Self::Dial, TransportError<io::Error>> {
        let Some(to) = node_of(&addr) else {
            return Err(TransportError::MultiaddrNotSupported(addr));
        };
        let (net, listeners, from) = (self.net.clone(), self.listeners.clone(), self.id);
        Ok(async move {
            let rtt = net.latency(from, to) * 2;
            if net.cut(from, to) {
                // No answer: the dial times out.
                tokio::time::sleep(net.config().connect_timeout).await;
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{addr}: no answer"),
                ));
            }
            tokio::time::sleep(rtt).await;
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
