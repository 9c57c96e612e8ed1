//! The collective's data plane over the simulated network: a [`LinkNet`] whose
//! connections are [`SimStream`] pairs (the same latency, access-link caps, loss, crashes
//! and partitions as the swarm's connections), read and written by the blocking threads
//! the ring runs on. A node's link ports are numbered from 1; a dial takes one round trip
//! (the handshake), fails after the connect timeout when the peer cannot be reached, and
//! is refused when nothing listens on the port.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::collective::{Conn, LinkError, LinkNet, LinkPort, LinkRead, LinkWrite};
use agentjet::swarm::Multiaddr;
use futures::io::{ReadHalf, WriteHalf};
use futures::{AsyncReadExt, AsyncWriteExt};
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

    fn blocking(&self, s: SimStream) -> Conn {
        let (r, w) = s.split();
        Conn {
            read: Box::new(SimRead {
                rt: self.rt.clone(),
                half: r,
                timeout: Mutex::new(None),
            }),
            write: Box::new(SimWrite {
                rt: self.rt.clone(),
                half: Some(w),
                timeout: Mutex::new(None),
            }),
        }
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

/// Reads a simulated stream from a blocking thread (never from the runtime's own).
struct SimRead {
    rt: Handle,
    half: ReadHalf<SimStream>,
    timeout: Mutex<Option<Duration>>,
}

struct SimWrite {
    rt: Handle,
    /// Taken by the drop, which closes it.
    half: Option<WriteHalf<SimStream>>,
    timeout: Mutex<Option<Duration>>,
}

/// Runs `fut` on `rt`, failing as timed out after `t`.
fn bounded<T>(
    rt: &Handle,
    t: Option<Duration>,
    fut: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    rt.block_on(async move {
        match t {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())),
            None => fut.await,
        }
    })
}

impl Read for SimRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let t = *lock(&self.timeout);
        bounded(&self.rt, t, self.half.read(buf))
    }
}

impl LinkRead for SimRead {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        *lock(&self.timeout) = Some(t);
        Ok(())
    }
}

impl Write for SimWrite {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let t = *lock(&self.timeout);
        match self.half.as_mut() {
            Some(h) => bounded(&self.rt, t, h.write(buf)),
            None => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl LinkWrite for SimWrite {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        *lock(&self.timeout) = Some(t);
        Ok(())
    }
}

impl Drop for SimWrite {
    fn drop(&mut self) {
        // The close travels like data, so the reader sees the end after what was sent.
        // Spawned, not waited for: a drop may happen on any thread.
        if let Some(mut h) = self.half.take() {
            self.rt.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), h.close()).await;
            });
        }
    }
}
