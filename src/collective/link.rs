//! Links: the data plane between two members, a TCP connection carrying sealed frames
//! (see [`super::seal`]). A link is set up through the swarm: the acceptor makes an offer
//! (a listening port, a fresh random key and a one-use token) and gives it to the dialer
//! over the swarm's authenticated, encrypted stream, so only that peer can use the link;
//! the dialer connects, presents the token, and both prove the key with a sealed hello
//! before any payload moves. A connection that presents an unknown token, or whose hello
//! does not open, is dropped.
//!
//! Links are blocking (std sockets, read and write timeouts): the collective runs on the
//! training thread and its helpers, never on the async runtime. A link splits into a
//! sending and a receiving half so both directions stream at once.
//!
//! Owns: connecting, the handshake, and moving frames. Never interprets payloads.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::seal::{random_secret, Direction, SealError, Sealer, TAG_LEN};

/// What the acceptor tells the dialer (over the swarm) to set a link up.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkOffer {
    pub port: u16,
    pub key: [u8; 32],
    pub token: [u8; 32],
}

/// Why a link failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("link i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Seal(#[from] SealError),
    #[error("timed out {0}")]
    Timeout(&'static str),
    #[error("the peer closed the link")]
    Closed,
    #[error("the peer's hello did not match the offer")]
    BadHello,
    #[error("a frame of {got} bytes where {want} were due")]
    Length { got: usize, want: usize },
}

/// `buf` with `len` bytes, keeping what it holds (no zeroing when it does not grow).
fn set_len(buf: &mut Vec<u8>, len: usize) {
    if buf.len() >= len {
        buf.truncate(len);
    } else {
        buf.resize(len, 0);
    }
}

fn io_err(e: std::io::Error, what: &'static str) -> LinkError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => LinkError::Timeout(what),
        std::io::ErrorKind::UnexpectedEof => LinkError::Closed,
        _ => LinkError::Io(e),
    }
}

/// The sending half of a link.
pub struct LinkTx {
    tcp: TcpStream,
    seal: Sealer,
    buf: Vec<u8>,
    /// Bytes written to the socket so far (frames with their headers and tags).
    pub bytes: u64,
}

/// The receiving half of a link.
pub struct LinkRx {
    tcp: TcpStream,
    open: Sealer,
    buf: Vec<u8>,
    /// Bytes read from the socket so far.
    pub bytes: u64,
}

impl LinkTx {
    /// Sends one frame of `len` plaintext bytes that `fill` writes.
    pub fn send_with(&mut self, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<(), LinkError> {
        // Reused without zeroing when the size repeats (`fill` writes every byte).
        set_len(&mut self.buf, 4 + len);
        fill(&mut self.buf[4..]);
        self.seal.seal(&mut self.buf)?;
        self.tcp
            .write_all(&self.buf)
            .map_err(|e| io_err(e, "sending a frame"))?;
        self.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Sends `bytes` as one frame (sealed straight from them: no copy first).
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), LinkError> {
        self.seal.seal_from(bytes, &mut self.buf)?;
        self.tcp
            .write_all(&self.buf)
            .map_err(|e| io_err(e, "sending a frame"))?;
        self.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Bounds every later write.
    pub fn set_timeout(&self, t: Duration) -> Result<(), LinkError> {
        Ok(self.tcp.set_write_timeout(Some(t))?)
    }
}

impl LinkRx {
    /// Receives one frame; its plaintext.
    pub fn recv(&mut self) -> Result<&[u8], LinkError> {
        let mut header = [0u8; 4];
        self.tcp
            .read_exact(&mut header)
            .map_err(|e| io_err(e, "waiting for a frame"))?;
        let n = Sealer::frame_len(header)?;
        set_len(&mut self.buf, n);
        self.tcp
            .read_exact(&mut self.buf)
            .map_err(|e| io_err(e, "reading a frame"))?;
        self.bytes += (n + 4) as u64;
        let plain = self.open.open(&mut self.buf)?;
        Ok(&plain[..n - TAG_LEN])
    }

    /// Receives one frame whose plaintext must be exactly `out.len()` bytes, opened
    /// straight into `out` (no copy after). On an error `out` holds garbage.
    pub fn recv_into(&mut self, out: &mut [u8]) -> Result<(), LinkError> {
        let mut header = [0u8; 4];
        self.tcp
            .read_exact(&mut header)
            .map_err(|e| io_err(e, "waiting for a frame"))?;
        let n = Sealer::frame_len(header)?;
        if n != out.len() + TAG_LEN {
            return Err(LinkError::Length {
                got: n - TAG_LEN,
                want: out.len(),
            });
        }
        set_len(&mut self.buf, n);
        self.tcp
            .read_exact(&mut self.buf)
            .map_err(|e| io_err(e, "reading a frame"))?;
        self.bytes += (n + 4) as u64;
        Ok(self.open.open_into(&self.buf, out)?)
    }

    /// Bounds every later read (a silent peer then fails the round).
    pub fn set_timeout(&self, t: Duration) -> Result<(), LinkError> {
        Ok(self.tcp.set_read_timeout(Some(t))?)
    }
}

fn halves(
    tcp: TcpStream,
    key: &[u8; 32],
    mine: Direction,
    theirs: Direction,
) -> Result<(LinkTx, LinkRx), LinkError> {
    tcp.set_nodelay(true)?;
    let rx_tcp = tcp.try_clone()?;
    Ok((
        LinkTx {
            tcp,
            seal: Sealer::new(key, mine),
            buf: Vec::new(),
            bytes: 0,
        },
        LinkRx {
            tcp: rx_tcp,
            open: Sealer::new(key, theirs),
            buf: Vec::new(),
            bytes: 0,
        },
    ))
}

/// The hello both sides seal first: the token, so a link proves it is this offer's.
fn hello(tx: &mut LinkTx, rx: &mut LinkRx, token: &[u8; 32]) -> Result<(), LinkError> {
    tx.send(token)?;
    if rx.recv()? != token {
        return Err(LinkError::BadHello);
    }
    Ok(())
}

/// Connects to an offer at `addr` (the acceptor's host, the offer's port).
pub fn dial(
    addr: SocketAddr,
    offer: &LinkOffer,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), LinkError> {
    let mut tcp =
        TcpStream::connect_timeout(&addr, timeout).map_err(|e| io_err(e, "connecting"))?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_write_timeout(Some(timeout))?;
    tcp.write_all(&offer.token)
        .map_err(|e| io_err(e, "sending the token"))?;
    let (mut tx, mut rx) = halves(
        tcp,
        &offer.key,
        Direction::FromDialer,
        Direction::FromAcceptor,
    )?;
    hello(&mut tx, &mut rx, &offer.token)?;
    Ok((tx, rx))
}

/// A member's listening socket for links, and the offers it has made.
pub struct LinkListener {
    tcp: TcpListener,
}

impl LinkListener {
    /// Listens on `addr` (port 0: any free one).
    pub fn bind(addr: SocketAddr) -> Result<LinkListener, LinkError> {
        Ok(LinkListener {
            tcp: TcpListener::bind(addr)?,
        })
    }

    pub fn port(&self) -> u16 {
        self.tcp.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    /// A new offer on this listener (give it to exactly one peer, over the swarm).
    pub fn offer(&self) -> LinkOffer {
        LinkOffer {
            port: self.port(),
            key: random_secret(),
            token: random_secret(),
        }
    }

    /// Waits (up to `timeout`) for the dialer of `offer`; connections with another token
    /// or a hello that does not open are dropped and waiting goes on.
    pub fn accept(
        &self,
        offer: &LinkOffer,
        timeout: Duration,
    ) -> Result<(LinkTx, LinkRx), LinkError> {
        let deadline = Instant::now() + timeout;
        self.tcp.set_nonblocking(true)?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LinkError::Timeout("waiting for the dialer"));
            }
            let (mut tcp, _) = match self.tcp.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2).min(left));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            tcp.set_nonblocking(false)?;
            tcp.set_read_timeout(Some(left))?;
            tcp.set_write_timeout(Some(left))?;
            let mut token = [0u8; 32];
            if tcp.read_exact(&mut token).is_err() || token != offer.token {
                tracing::warn!("dropped a link connection with a wrong token");
                continue;
            }
            let (mut tx, mut rx) = halves(
                tcp,
                &offer.key,
                Direction::FromAcceptor,
                Direction::FromDialer,
            )?;
            match hello(&mut tx, &mut rx, &offer.token) {
                Ok(()) => return Ok((tx, rx)),
                Err(e) => tracing::warn!("dropped a link connection whose hello failed: {e}"),
            }
        }
    }
}
