//! The collective's data plane over the simulated network: a [`LinkNet`] whose
//! connections are [`SimStream`] pairs (the same latency, access-link caps, loss, crashes
//! and partitions as the swarm's connections), read and written by the blocking threads
//! the ring runs on. A node's link ports are numbered from 1; a dial takes one round trip
//! (the handshake), fails after the connect timeout when the peer cannot be reached, and
//! is refused when nothing listens on the port.
//!
//! With peers behind NAT ([`SimLinks::routed`]), a link follows the connection the two
//! members' swarms have, as the product's link over a swarm stream does: to a public
//! acceptor directly (the product's TCP link); to one behind NAT over their direct or
//! hole-punched connection, or through the relay that carries their relayed one (the
//! relay's links carry every byte twice, and it cuts the circuit at its data limit).

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::collective::{Conn, LinkError, LinkNet, LinkPort};
use agentjet::swarm::{LinkKind, Multiaddr, RelayLimits, SwarmHandle};
use tokio::runtime::Handle;

use crate::net::{lock, Nat, Network, NodeId};
use crate::pipe::{relayed_pair, weighted_pair, SimStream};
use crate::routes::Routes;
use crate::transport::node_of;

/// Every node's listening link ports (one registry per simulated network), and how the
/// links went.
#[derive(Default)]
pub struct LinkPorts {
    ports: Mutex<HashMap<(NodeId, u16), Sender<Conn>>>,
    next: AtomicU16,
    /// Links made directly, through a relay, and not made here (no connection between
    /// the two swarms: the product then runs the link over a swarm stream, which this
    /// simulation does not weigh).
    pub direct: AtomicU64,
    pub relayed: AtomicU64,
    pub unrouted: AtomicU64,
    /// Relayed links the relay cut at its data limit.
    pub cut: Arc<AtomicU64>,
}

/// One node's links.
#[derive(Clone)]
pub struct SimLinks {
    net: Network,
    node: NodeId,
    rt: Handle,
    ports: Arc<LinkPorts>,
    weight: f64,
    /// This member's swarm and the cluster's routes (peers behind NAT).
    routing: Option<(SwarmHandle, Arc<Routes>)>,
}

/// How a stream from one node reaches another.
pub(crate) enum Route {
    Direct,
    Via(NodeId),
}

/// How `handle`'s node reaches the node `to`, following the swarms' connections as the
/// product's streams do: directly when `to` is public or the swarms have a direct
/// connection, else through the relay of their relayed one (connecting the swarms first,
/// within `wait`, when they are not).
pub(crate) async fn route(
    net: &Network,
    handle: &SwarmHandle,
    routes: &Routes,
    to: NodeId,
    wait: Duration,
) -> Result<Route, &'static str> {
    if net.nat(to) == Nat::Public {
        return Ok(Route::Direct);
    }
    let peer = routes.peer_at(to).ok_or("no such node")?;
    let mut kinds = handle.link_kinds(&peer);
    if kinds.is_empty() {
        // Not connected (the product's stream would dial now).
        let _ = tokio::time::timeout(wait, handle.connect(peer)).await;
        kinds = handle.link_kinds(&peer);
    }
    if kinds.iter().any(|k| *k != LinkKind::Relayed) {
        return Ok(Route::Direct);
    }
    if kinds.contains(&LinkKind::Relayed) {
        if let Some(r) = routes.relay_between(handle.peer_id, peer) {
            return Ok(Route::Via(r));
        }
    }
    Err("no connection between the swarms")
}

impl SimLinks {
    /// Links of `node` on `rt` (with time enabled), which drives the simulated streams.
    /// Each byte a link carries counts as `weight` bytes on the network (a scaled-down
    /// model standing for a bigger one).
    pub fn new(
        net: Network,
        node: NodeId,
        rt: Handle,
        ports: Arc<LinkPorts>,
        weight: f64,
    ) -> SimLinks {
        SimLinks {
            net,
            node,
            rt,
            ports,
            weight,
            routing: None,
        }
    }

    /// Links that follow the swarm's connections (see the module docs).
    pub fn routed(mut self, handle: SwarmHandle, routes: Arc<Routes>) -> SimLinks {
        self.routing = Some((handle, routes));
        self
    }

    /// How to reach `to` (see [`route`]; connecting within a few seconds at least).
    fn route(&self, to: NodeId, timeout: Duration) -> Result<Route, LinkError> {
        let Some((handle, routes)) = &self.routing else {
            return Ok(Route::Direct);
        };
        let wait = timeout.max(Duration::from_secs(5));
        self.rt
            .block_on(route(&self.net, handle, routes, to, wait))
            .map_err(LinkError::Timeout)
    }

    /// Read and written from the blocking threads the ring runs on.
    fn blocking(&self, s: SimStream) -> Conn {
        Conn::blocking(self.rt.clone(), s)
    }
}

struct SimPort {
    node: NodeId,
    port: u16,
    incoming: Mutex<Receiver<Conn>>,
    ports: Arc<LinkPorts>,
}

impl Drop for SimPort {
    fn drop(&mut self) {
        lock(&self.ports.ports).remove(&(self.node, self.port));
    }
}

impl LinkPort for SimPort {
    fn port(&self) -> u16 {
        self.port
    }

    fn accept(&self, timeout: Duration) -> io::Result<Option<Conn>> {
        match lock(&self.incoming).recv_timeout(timeout) {
            Ok(c) => Ok(Some(c)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(io::ErrorKind::NotConnected.into()),
        }
    }
}

impl LinkNet for SimLinks {
    fn listen(&self, _ip: IpAddr) -> io::Result<Box<dyn LinkPort>> {
        let port = self
            .ports
            .next
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        let (tx, rx) = channel();
        lock(&self.ports.ports).insert((self.node, port), tx);
        Ok(Box::new(SimPort {
            node: self.node,
            port,
            incoming: Mutex::new(rx),
            ports: self.ports.clone(),
        }))
    }

    fn routes_itself(&self) -> bool {
        self.routing.is_some()
    }

    fn connect(
        &self,
        addrs: &[Multiaddr],
        port: u16,
        timeout: Duration,
    ) -> Result<Conn, LinkError> {
        let to = addrs
            .iter()
            .find_map(node_of)
            .ok_or_else(|| LinkError::NoAddress(addrs.to_vec()))?;
        let from = self.node;
        if self.net.cut(from, to) {
            std::thread::sleep(self.net.config().connect_timeout.min(timeout));
            return Err(LinkError::Timeout("connecting"));
        }
        let route = match self.route(to, timeout) {
            Ok(r) => r,
            Err(e) => {
                self.ports.unrouted.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        if let Route::Via(r) = route {
            if self.net.cut(from, r) || self.net.cut(r, to) {
                std::thread::sleep(self.net.config().connect_timeout.min(timeout));
                return Err(LinkError::Timeout("connecting through the relay"));
            }
        }
        let rtt = match route {
            Route::Direct => self.net.latency(from, to) * 2,
            Route::Via(r) => (self.net.latency(from, r) + self.net.latency(r, to)) * 2,
        };
        std::thread::sleep(rtt);
        let Some(listener) = lock(&self.ports.ports).get(&(to, port)).cloned() else {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("no link port {port} on node {to}"),
            )
            .into());
        };
        let (mine, theirs) = match route {
            Route::Direct => {
                self.ports.direct.fetch_add(1, Ordering::Relaxed);
                weighted_pair(&self.net, from, to, self.weight)
            }
            Route::Via(r) => {
                self.ports.relayed.fetch_add(1, Ordering::Relaxed);
                // The relay peers' own limits (netsim's peers keep the binary's).
                let limits = RelayLimits::default();
                relayed_pair(
                    &self.net,
                    &self.rt,
                    (from, r, to),
                    (self.weight, self.weight),
                    (limits.circuit_bytes, limits.circuit_duration),
                    self.ports.cut.clone(),
                )
            }
        };
        listener
            .send(self.blocking(theirs))
            .map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
        Ok(self.blocking(mine))
    }
}
