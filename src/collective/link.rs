//! Links: the data plane between two members, a byte stream carrying sealed frames (see
//! [`super::seal`]). A link is set up through the swarm: the acceptor makes an offer (a
//! port, a fresh random key and a one-use token) and gives it to the dialer over the
//! swarm's authenticated, encrypted stream, so only that peer can use the link; the dialer
//! connects, presents the token, and both prove the key with a sealed hello before any
//! payload moves. A connection that presents an unknown token, or whose hello does not
//! open, is dropped.
//!
//! The byte stream comes from a [`LinkNet`]: TCP ([`TcpLinks`], what servers use where the
//! acceptor is reachable), or a network the caller simulates (netsim hands its own in);
//! or from a stream over the swarm's own connection to the peer (direct, hole-punched or
//! relayed), made blocking by [`Conn::blocking`] and handed to the acceptor's listener
//! with [`LinkListener::deliver`]. Everything above the stream (the token, the sealing,
//! the frames, the timeouts) is the same for all of them.
//!
//! Links are blocking (read and write timeouts): the collective runs on the training
//! thread and its helpers, never on the async runtime. A link splits into a sending and a
//! receiving half so both directions stream at once.
//!
//! Owns: connecting, the handshake, and moving frames. Never interprets payloads.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::seal::{random_secret, Direction, SealError, Sealer, TAG_LEN};
use crate::swarm::{Multiaddr, Protocol};

/// The receiving direction of the byte stream a link runs over.
pub trait LinkRead: Read + Send {
    /// Bounds every later read (a read that waits longer fails as timed out).
    fn set_timeout(&self, t: Duration) -> io::Result<()>;
}

/// The sending direction of the byte stream a link runs over.
pub trait LinkWrite: Write + Send {
    /// Bounds every later write.
    fn set_timeout(&self, t: Duration) -> io::Result<()>;
}

/// A connected byte stream, split in its two directions.
pub struct Conn {
    pub read: Box<dyn LinkRead>,
    pub write: Box<dyn LinkWrite>,
}

/// Where links run: the network a member listens on and dials through.
pub trait LinkNet: Send + Sync {
    /// A port for links on this member (`ip`: the address its swarm listens on).
    fn listen(&self, ip: IpAddr) -> io::Result<Box<dyn LinkPort>>;
    /// Connects to `port` of the peer reachable at `addrs` (its swarm addresses).
    fn connect(&self, addrs: &[Multiaddr], port: u16, timeout: Duration)
        -> Result<Conn, LinkError>;
    /// Whether this network finds its own way to every acceptor, reachable or not (netsim:
    /// its links follow the connection the two swarms have, direct, hole-punched or
    /// relayed), so `connect` is tried even where the acceptor cannot be dialed directly.
    /// TCP: no.
    fn routes_itself(&self) -> bool {
        false
    }
}

/// A member's listening port for links.
pub trait LinkPort: Send + Sync {
    fn port(&self) -> u16;
    /// The next connection, waiting up to `timeout` (None: none came).
    fn accept(&self, timeout: Duration) -> io::Result<Option<Conn>>;
}

/// What the acceptor tells the dialer (over the swarm) to set a link up.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkOffer {
    pub port: u16,
    pub key: [u8; 32],
    pub token: [u8; 32],
    /// The acceptor is reachable at its addresses (publicly, or all peers are on its
    /// host): a connection to `port` is worth trying. Otherwise the link runs over the
    /// swarm's connection.
    pub direct: bool,
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
    #[error("no address this network can dial among {0:?}")]
    NoAddress(Vec<Multiaddr>),
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
    stream: Box<dyn LinkWrite>,
    seal: Sealer,
    buf: Vec<u8>,
    /// Bytes written to the stream so far (frames with their headers and tags).
    pub bytes: u64,
}

/// The receiving half of a link.
pub struct LinkRx {
    stream: Box<dyn LinkRead>,
    open: Sealer,
    buf: Vec<u8>,
    /// Bytes read from the stream so far.
    pub bytes: u64,
}

impl LinkTx {
    /// Sends one frame of `len` plaintext bytes that `fill` writes.
    pub fn send_with(&mut self, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<(), LinkError> {
        // Reused without zeroing when the size repeats (`fill` writes every byte).
        set_len(&mut self.buf, 4 + len);
        fill(&mut self.buf[4..]);
        self.seal.seal(&mut self.buf)?;
        self.stream
            .write_all(&self.buf)
            .map_err(|e| io_err(e, "sending a frame"))?;
        self.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Sends `bytes` as one frame (sealed straight from them: no copy first).
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), LinkError> {
        self.seal.seal_from(bytes, &mut self.buf)?;
        self.stream
            .write_all(&self.buf)
            .map_err(|e| io_err(e, "sending a frame"))?;
        self.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Bounds every later write.
    pub fn set_timeout(&self, t: Duration) -> Result<(), LinkError> {
        Ok(self.stream.set_timeout(t)?)
    }
}

impl LinkRx {
    /// Receives one frame; its plaintext.
    pub fn recv(&mut self) -> Result<&[u8], LinkError> {
        let mut header = [0u8; 4];
        self.stream
            .read_exact(&mut header)
            .map_err(|e| io_err(e, "waiting for a frame"))?;
        let n = Sealer::frame_len(header)?;
        set_len(&mut self.buf, n);
        self.stream
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
        self.stream
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
        self.stream
            .read_exact(&mut self.buf)
            .map_err(|e| io_err(e, "reading a frame"))?;
        self.bytes += (n + 4) as u64;
        Ok(self.open.open_into(&self.buf, out)?)
    }

    /// Bounds every later read (a silent peer then fails the round).
    pub fn set_timeout(&self, t: Duration) -> Result<(), LinkError> {
        Ok(self.stream.set_timeout(t)?)
    }
}

fn halves(conn: Conn, key: &[u8; 32], mine: Direction, theirs: Direction) -> (LinkTx, LinkRx) {
    (
        LinkTx {
            stream: conn.write,
            seal: Sealer::new(key, mine),
            buf: Vec::new(),
            bytes: 0,
        },
        LinkRx {
            stream: conn.read,
            open: Sealer::new(key, theirs),
            buf: Vec::new(),
            bytes: 0,
        },
    )
}

/// The hello both sides seal first: the token, so a link proves it is this offer's.
fn hello(tx: &mut LinkTx, rx: &mut LinkRx, token: &[u8; 32]) -> Result<(), LinkError> {
    tx.send(token)?;
    if rx.recv()? != token {
        return Err(LinkError::BadHello);
    }
    Ok(())
}

/// Connects through `net` to an offer of the peer reachable at `addrs`.
pub fn dial(
    net: &dyn LinkNet,
    addrs: &[Multiaddr],
    offer: &LinkOffer,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), LinkError> {
    let conn = net.connect(addrs, offer.port, timeout)?;
    handshake(conn, offer, timeout)
}

/// The dialer's side of a link on a connection made to `offer`: the token, then the
/// sealed hello both ways.
pub fn handshake(
    mut conn: Conn,
    offer: &LinkOffer,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), LinkError> {
    conn.read.set_timeout(timeout)?;
    conn.write.set_timeout(timeout)?;
    conn.write
        .write_all(&offer.token)
        .map_err(|e| io_err(e, "sending the token"))?;
    let (mut tx, mut rx) = halves(
        conn,
        &offer.key,
        Direction::FromDialer,
        Direction::FromAcceptor,
    );
    hello(&mut tx, &mut rx, &offer.token)?;
    Ok((tx, rx))
}

/// Fills `buf` from `r` within `wait` in all, however the bytes are spread.
fn read_within(r: &mut dyn LinkRead, buf: &mut [u8], wait: Duration) -> io::Result<()> {
    let until = Instant::now() + wait;
    let mut got = 0;
    while got < buf.len() {
        let rest = until.saturating_duration_since(Instant::now());
        if rest.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{got} of {} bytes within {wait:?}", buf.len()),
            ));
        }
        r.set_timeout(rest)?;
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How long an accepted link connection may take to send its token.
pub const TOKEN_WAIT: Duration = Duration::from_secs(2);

/// How long one look at the port waits: an accept looks for a connection another accept
/// kept for it, or one delivered over the swarm, at least this often.
const ACCEPT_SLICE: Duration = Duration::from_millis(20);
/// Connections delivered over the swarm and not looked at yet, at most (the oldest go).
const INBOX: usize = 16;
/// Offers remembered as live (an offer whose accept never ran leaves this way).
const LIVE_OFFERS: usize = 64;
/// Connections kept for another offer's accept, at most.
const PARKED: usize = 16;

/// A member's listening port for links, and the offers it has made.
///
/// Several accepts may wait on one port at once (a ring build that a newer ballot
/// superseded leaves its accept waiting out its timeout on a blocking thread, beside the
/// next build's). Whichever takes a connection reads its token: its own goes on to the
/// hello, another live offer's is kept for that offer's accept, an unknown one is
/// dropped. Before, the stale accept dropped the next build's connection as a wrong
/// token, the next build failed, and its retry could be superseded the same way.
pub struct LinkListener {
    port: Box<dyn LinkPort>,
    /// Tokens of offers whose accept may still come (oldest first).
    live: std::sync::Mutex<std::collections::VecDeque<[u8; 32]>>,
    /// Connections that presented another live offer's token.
    parked: std::sync::Mutex<Vec<([u8; 32], Conn)>>,
    /// Connections delivered over the swarm (see [`LinkListener::deliver`]).
    inbox: std::sync::Mutex<std::collections::VecDeque<Conn>>,
}

impl LinkListener {
    /// Listens on TCP at `addr` (port 0: any free one).
    pub fn bind(addr: SocketAddr) -> Result<LinkListener, LinkError> {
        Ok(LinkListener::new(Box::new(TcpPort(TcpListener::bind(
            addr,
        )?))))
    }

    fn new(port: Box<dyn LinkPort>) -> LinkListener {
        LinkListener {
            port,
            live: Default::default(),
            parked: Default::default(),
            inbox: Default::default(),
        }
    }

    /// A connection that came over the swarm (a stream on the peer's connection): taken
    /// by the accepts as one that came to the port. At most 16 wait (the oldest go: an
    /// accept looks at them every 20 ms).
    pub fn deliver(&self, conn: Conn) {
        let mut inbox = crate::base::lock(&self.inbox);
        if inbox.len() >= INBOX {
            inbox.pop_front();
            tracing::warn!("dropped a link connection nobody took");
        }
        inbox.push_back(conn);
    }

    /// Listens through `net` (`ip`: the swarm's listen address).
    pub fn on(net: &dyn LinkNet, ip: IpAddr) -> Result<LinkListener, LinkError> {
        Ok(LinkListener::new(net.listen(ip)?))
    }

    pub fn port(&self) -> u16 {
        self.port.port()
    }

    /// A new offer on this listener (give it to exactly one peer, over the swarm);
    /// `direct`: this member is reachable at its addresses (see [`LinkOffer::direct`]).
    pub fn offer(&self, direct: bool) -> LinkOffer {
        let offer = LinkOffer {
            port: self.port(),
            key: random_secret(),
            token: random_secret(),
            direct,
        };
        let mut live = crate::base::lock(&self.live);
        live.push_back(offer.token);
        while live.len() > LIVE_OFFERS {
            live.pop_front();
        }
        offer
    }

    /// Waits (up to `timeout`) for the dialer of `offer`; connections with an unknown
    /// token or a hello that does not open are dropped and waiting goes on. The offer is
    /// spent when this returns.
    pub fn accept(
        &self,
        offer: &LinkOffer,
        timeout: Duration,
    ) -> Result<(LinkTx, LinkRx), LinkError> {
        let out = self.accept_until(offer, Instant::now() + timeout);
        crate::base::lock(&self.live).retain(|t| *t != offer.token);
        let live = crate::base::lock(&self.live).clone();
        crate::base::lock(&self.parked).retain(|(t, _)| live.contains(t));
        out
    }

    fn accept_until(
        &self,
        offer: &LinkOffer,
        deadline: Instant,
    ) -> Result<(LinkTx, LinkRx), LinkError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let kept = {
                let mut parked = crate::base::lock(&self.parked);
                let i = parked.iter().position(|(t, _)| *t == offer.token);
                i.map(|i| parked.swap_remove(i).1)
            };
            if let Some(conn) = kept {
                match open(conn, offer, left) {
                    Ok(link) => return Ok(link),
                    Err(e) => tracing::warn!("dropped a link connection whose hello failed: {e}"),
                }
                continue;
            }
            if left.is_zero() {
                return Err(LinkError::Timeout("waiting for the dialer"));
            }
            let delivered = crate::base::lock(&self.inbox).pop_front();
            let conn = match delivered {
                Some(c) => Some(c),
                None => self.port.accept(left.min(ACCEPT_SLICE))?,
            };
            let Some(mut conn) = conn else {
                continue;
            };
            // The dialer sends its token as soon as it is connected: a connection whose
            // 32 bytes do not all arrive within `TOKEN_WAIT` (silent, or trickling) is
            // dropped, not left to block the accept.
            conn.write.set_timeout(left.max(TOKEN_WAIT))?;
            let mut token = [0u8; 32];
            if let Err(e) = read_within(&mut *conn.read, &mut token, TOKEN_WAIT) {
                tracing::warn!("dropped a link connection that sent no token: {e}");
                continue;
            }
            if token == offer.token {
                match open(conn, offer, left.max(TOKEN_WAIT)) {
                    Ok(link) => return Ok(link),
                    Err(e) => tracing::warn!("dropped a link connection whose hello failed: {e}"),
                }
            } else if crate::base::lock(&self.live).contains(&token) {
                // Another accept's: keep it for that one.
                let mut parked = crate::base::lock(&self.parked);
                if parked.len() >= PARKED {
                    parked.remove(0);
                }
                parked.push((token, conn));
            } else {
                tracing::warn!("dropped a link connection with a wrong token");
            }
        }
    }
}

/// The hello on an accepted connection that presented `offer`'s token.
fn open(conn: Conn, offer: &LinkOffer, wait: Duration) -> Result<(LinkTx, LinkRx), LinkError> {
    let wait = wait.max(Duration::from_millis(1));
    conn.read.set_timeout(wait)?;
    conn.write.set_timeout(wait)?;
    let (mut tx, mut rx) = halves(
        conn,
        &offer.key,
        Direction::FromAcceptor,
        Direction::FromDialer,
    );
    hello(&mut tx, &mut rx, &offer.token)?;
    Ok((tx, rx))
}

/// The first IP address among `addrs` (a peer's listen addresses).
pub fn ip_of(addrs: &[Multiaddr]) -> Option<IpAddr> {
    addrs.iter().find_map(|a| {
        a.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
            _ => None,
        })
    })
}

/// Links over TCP: a listener on the swarm's IP, dials to the first IP of a peer's
/// swarm addresses.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpLinks;

struct TcpRead(TcpStream);
struct TcpWrite(TcpStream);
struct TcpPort(TcpListener);

impl Read for TcpRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl LinkRead for TcpRead {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.0.set_read_timeout(Some(t))
    }
}

impl Write for TcpWrite {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl LinkWrite for TcpWrite {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        self.0.set_write_timeout(Some(t))
    }
}

impl Conn {
    /// Both directions of a TCP connection (no Nagle delay: frames go out whole).
    pub fn tcp(tcp: TcpStream) -> io::Result<Conn> {
        tcp.set_nodelay(true)?;
        Ok(Conn {
            read: Box::new(TcpRead(tcp.try_clone()?)),
            write: Box::new(TcpWrite(tcp)),
        })
    }
}

/// The blocking read half of an async byte stream (see [`Conn::blocking`]).
struct AsyncRead<S> {
    rt: tokio::runtime::Handle,
    half: futures::io::ReadHalf<S>,
    timeout: std::sync::Mutex<Option<Duration>>,
}

/// The blocking write half of an async byte stream (see [`Conn::blocking`]).
struct AsyncWrite<S: futures::AsyncWrite + Send + Unpin + 'static> {
    rt: tokio::runtime::Handle,
    /// Taken by the drop, which closes it.
    half: Option<futures::io::WriteHalf<S>>,
    timeout: std::sync::Mutex<Option<Duration>>,
}

/// Runs `fut` on `rt`, failing as timed out after `t`.
fn bounded<T>(
    rt: &tokio::runtime::Handle,
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

impl<S: futures::AsyncRead + Send + Unpin> Read for AsyncRead<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let t = *crate::base::lock(&self.timeout);
        bounded(
            &self.rt,
            t,
            futures::AsyncReadExt::read(&mut self.half, buf),
        )
    }
}

impl<S: futures::AsyncRead + Send + Unpin> LinkRead for AsyncRead<S> {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        *crate::base::lock(&self.timeout) = Some(t);
        Ok(())
    }
}

impl<S: futures::AsyncWrite + Send + Unpin + 'static> Write for AsyncWrite<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let t = *crate::base::lock(&self.timeout);
        match self.half.as_mut() {
            Some(h) => bounded(&self.rt, t, futures::AsyncWriteExt::write(h, buf)),
            None => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        let t = *crate::base::lock(&self.timeout);
        match self.half.as_mut() {
            Some(h) => bounded(&self.rt, t, futures::AsyncWriteExt::flush(h)),
            None => Err(io::ErrorKind::BrokenPipe.into()),
        }
    }
}

impl<S: futures::AsyncWrite + Send + Unpin + 'static> LinkWrite for AsyncWrite<S> {
    fn set_timeout(&self, t: Duration) -> io::Result<()> {
        *crate::base::lock(&self.timeout) = Some(t);
        Ok(())
    }
}

impl<S: futures::AsyncWrite + Send + Unpin + 'static> Drop for AsyncWrite<S> {
    fn drop(&mut self) {
        // The close travels like data, so the reader sees the end after what was sent.
        // Spawned, not waited for: a drop may happen on any thread.
        if let Some(mut h) = self.half.take() {
            self.rt.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    futures::AsyncWriteExt::close(&mut h),
                )
                .await;
            });
        }
    }
}

impl Conn {
    /// Both directions of an async byte stream (a libp2p stream, a simulated one), read
    /// and written from blocking threads (never from `rt`'s own: each call waits on `rt`).
    pub fn blocking<S>(rt: tokio::runtime::Handle, stream: S) -> Conn
    where
        S: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
    {
        let (r, w) = futures::AsyncReadExt::split(stream);
        Conn {
            read: Box::new(AsyncRead {
                rt: rt.clone(),
                half: r,
                timeout: Default::default(),
            }),
            write: Box::new(AsyncWrite {
                rt,
                half: Some(w),
                timeout: Default::default(),
            }),
        }
    }
}

impl LinkPort for TcpPort {
    fn port(&self) -> u16 {
        self.0.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    fn accept(&self, timeout: Duration) -> io::Result<Option<Conn>> {
        let deadline = Instant::now() + timeout;
        self.0.set_nonblocking(true)?;
        loop {
            match self.0.accept() {
                Ok((tcp, _)) => {
                    tcp.set_nonblocking(false)?;
                    return Conn::tcp(tcp).map(Some);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(2).min(left));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl LinkNet for TcpLinks {
    fn listen(&self, ip: IpAddr) -> io::Result<Box<dyn LinkPort>> {
        Ok(Box::new(TcpPort(TcpListener::bind(SocketAddr::new(
            ip, 0,
        ))?)))
    }

    fn connect(
        &self,
        addrs: &[Multiaddr],
        port: u16,
        timeout: Duration,
    ) -> Result<Conn, LinkError> {
        // Each distinct IP of a direct address, in the order given (the peer's offered
        // order: the one other hosts should use first), at most three.
        let mut ips: Vec<IpAddr> = Vec::new();
        for a in addrs.iter().filter(|a| !crate::swarm::addrs::is_relayed(a)) {
            if let Some(ip) = ip_of(std::slice::from_ref(a)) {
                if !ips.contains(&ip) {
                    ips.push(ip);
                }
            }
        }
        ips.truncate(2);
        let mut last = LinkError::NoAddress(addrs.to_vec());
        for ip in ips {
            match TcpStream::connect_timeout(&SocketAddr::new(ip, port), timeout) {
                Ok(tcp) => return Ok(Conn::tcp(tcp)?),
                Err(e) => last = io_err(e, "connecting"),
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Silent connections, one trickling its bytes and a wrong token in front of the
    /// member's dialer: each is dropped (a silent or trickling one after `TOKEN_WAIT`) and
    /// the dialer's link is made.
    #[test]
    fn silent_connections_do_not_block_the_dialer_behind_them() {
        let ip = std::net::Ipv4Addr::LOCALHOST;
        let l = LinkListener::bind(SocketAddr::new(ip.into(), 0)).unwrap();
        let offer = l.offer(true);
        let to = SocketAddr::new(ip.into(), l.port());
        let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(to).unwrap()).collect();
        // One that trickles its token a byte a second (each read within the wait).
        let mut trickle = TcpStream::connect(to).unwrap();
        let trickler = std::thread::spawn(move || {
            for _ in 0..32 {
                if trickle.write_all(&[9]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1000));
            }
        });
        let mut wrong = TcpStream::connect(to).unwrap();
        wrong.write_all(&[9u8; 32]).unwrap();
        let t = Duration::from_secs(20);
        std::thread::scope(|s| {
            let dialer = s.spawn(|| {
                let at = [Multiaddr::empty().with(Protocol::Ip4(ip))];
                dial(&TcpLinks, &at, &offer, t)
            });
            let accepted = l.accept(&offer, t);
            assert!(accepted.is_ok(), "{:?}", accepted.err());
            assert!(dialer.join().unwrap().is_ok());
        });
        drop(silent);
        let _ = trickler.join();
    }

    /// Two accepts wait on one port (a superseded build's and the next one's): the older
    /// one takes the newer offer's connection first, and keeps it for the newer accept
    /// instead of dropping it as a wrong token.
    #[test]
    fn a_connection_for_another_waiting_offer_is_kept_for_it() {
        let ip = std::net::Ipv4Addr::LOCALHOST;
        let l = LinkListener::bind(SocketAddr::new(ip.into(), 0)).unwrap();
        let (stale, next) = (l.offer(true), l.offer(true));
        std::thread::scope(|s| {
            let first = s.spawn(|| l.accept(&stale, Duration::from_secs(3)));
            // It looks at the port alone now.
            std::thread::sleep(Duration::from_millis(300));
            let dialer = s.spawn(|| {
                let at = [Multiaddr::empty().with(Protocol::Ip4(ip))];
                dial(&TcpLinks, &at, &next, Duration::from_secs(10))
            });
            // The stale accept takes the connection before this one looks.
            std::thread::sleep(Duration::from_millis(700));
            let accepted = l.accept(&next, Duration::from_secs(5));
            assert!(accepted.is_ok(), "{:?}", accepted.err());
            assert!(dialer.join().unwrap().is_ok());
            assert!(matches!(first.join().unwrap(), Err(LinkError::Timeout(_))));
        });
        assert!(crate::base::lock(&l.parked).is_empty());
        assert!(crate::base::lock(&l.live).is_empty());
    }
}
