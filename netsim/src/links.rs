//! The collective's data plane over the simulated network: a [`LinkNet`] whose
//! connections are [`SimStream`] pairs (the same latency, access-link caps, loss, crashes
//! and partitions as the swarm's connections), read and written by the blocking threads
//! the ring runs on. A node's link ports are numbered from 1; a dial takes one round trip
//! (the handshake), fails after the connect timeout when the peer cannot be reached, and
//! is refused when nothing listens on the port.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::collective::{Conn, LinkError, LinkNet, LinkPort};
use agentjet::swarm::Multiaddr;
use tokio::runtime::Handle;

use crate::net::{lock, Network, NodeId};
use crate::pipe::{weighted_pair, SimStream};
use crate::transport::node_of;

/// Every node's listening link ports (one registry per simulated network).
#[derive(Default)]
pub struct LinkPorts {
    ports: Mutex<HashMap<(NodeId, u16), Sender<Conn>>>,
    next: AtomicU16,
}

/// One node's links.
#[derive(Clone)]
pub struct SimLinks {
    net: Network,
    node: NodeId,
    rt: Handle,
    ports: Arc<LinkPorts>,
    weight: f64,
}

impl SimLinks {
    /// The links of `node`; `rt` (with time enabled) drives the simulated streams. Each
    /// byte a link carries counts as `weight` bytes on the network (a scaled-down model
    /// standing for a bigger one).
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
        }
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
        std::thread::sleep(self.net.latency(from, to) * 2);
        let Some(listener) = lock(&self.ports.ports).get(&(to, port)).cloned() else {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("no link port {port} on node {to}"),
            )
            .into());
        };
        let (mine, theirs) = weighted_pair(&self.net, from, to, self.weight);
        listener
            .send(self.blocking(theirs))
            .map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
        Ok(self.blocking(mine))
    }
}
