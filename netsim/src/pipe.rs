//! One simulated connection: a pair of in-order byte pipes whose writes arrive when the
//! [`Network`] schedules them (upload cap, latency, loss, download cap), and wait while
//! the pair is cut (a crash, a partition). A writer whose bytes already queue more than
//! [`SEND_AHEAD`] on its upload link waits (a TCP window, roughly).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::channel::mpsc;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Stream};
use tokio::time::{Instant, Sleep};

use crate::net::{Network, NodeId, SEND_AHEAD};

/// Writes in flight one way before the writer waits (a window: 64 writes, which yamux
/// and noise keep under 64 KiB each).
const WINDOW: usize = 64;

/// While a pair is cut, the reader looks again this often.
const CUT_POLL: Duration = Duration::from_millis(50);

/// Bytes that arrive at `at` (an empty packet: the writer closed).
struct Packet {
    at: Instant,
    data: Vec<u8>,
}

/// One end of a simulated connection.
pub struct SimStream {
    net: Network,
    local: NodeId,
    remote: NodeId,
    tx: Option<mpsc::Sender<Packet>>,
    rx: mpsc::Receiver<Packet>,
    /// Arrived or arriving packets, and how far the head has been read.
    queue: VecDeque<Packet>,
    pos: usize,
    timer: Option<Pin<Box<Sleep>>>,
    /// No packet of this direction arrives before the previous one (one ordered stream).
    last_arrival: Instant,
    /// When this direction's last packet leaves the sender's link, and the writer's wait.
    last_departure: Instant,
    write_timer: Option<Pin<Box<Sleep>>>,
    /// Bytes on the links per byte written.
    weight: f64,
    eof: bool,
}

/// A connected pair: (the dialer's end, the listener's end).
pub fn pair(net: &Network, dialer: NodeId, listener: NodeId) -> (SimStream, SimStream) {
    weighted_pair(net, dialer, listener, 1.0)
}

/// A connection from `dialer` to `listener` through `relay` (a relay's circuit): two
/// pairs, a task at the relay copying between them on `rt`, so each byte crosses the
/// relay's download and upload too; the dialer's bytes count as `dialer_weight` each on
/// the links, the listener's as `listener_weight` (see [`weighted_pair_each_way`]). A
/// closed sending half closes that direction only. Like circuit relay v2's limits, the relay closes the circuit once more than `bytes` (as
/// weighted, both ways together) passed or after `duration`: both ends then read EOF,
/// and `cut` counts it.
pub fn relayed_pair(
    net: &Network,
    rt: &tokio::runtime::Handle,
    (dialer, relay, listener): (NodeId, NodeId, NodeId),
    (dialer_weight, listener_weight): (f64, f64),
    (bytes, duration): (u64, Duration),
    cut: Arc<AtomicU64>,
) -> (SimStream, SimStream) {
    let (a, r_in) = weighted_pair_each_way(net, dialer, relay, dialer_weight, listener_weight);
    let (r_out, b) = weighted_pair_each_way(net, relay, listener, dialer_weight, listener_weight);
    let (in_r, in_w) = r_in.split();
    let (out_r, out_w) = r_out.split();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stop = Arc::new(stop);
    let passed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    for (mut from, mut to, weight) in [(in_r, out_w, dialer_weight), (out_r, in_w, listener_weight)]
    {
        let (stop, mut stopped, cut, passed) =
            (stop.clone(), stopped.clone(), cut.clone(), passed.clone());
        rt.spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                // An end that closes its sending half closes this direction only (the
                // other goes on, as over a relay); the relay's limits close both.
                let n = tokio::select! {
                    r = from.read(&mut buf) => match r {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    },
                    _ = stopped.changed() => break,
                    _ = tokio::time::sleep_until(deadline) => {
                        cut.fetch_add(1, Ordering::Relaxed);
                        let _ = stop.send(true);
                        break;
                    }
                };
                let total = passed.fetch_add((n as f64 * weight) as u64, Ordering::Relaxed)
                    + (n as f64 * weight) as u64;
                if total > bytes {
                    cut.fetch_add(1, Ordering::Relaxed);
                    let _ = stop.send(true);
                    break;
                }
                if to.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = to.close().await;
        });
    }
    drop(stopped);
    (a, b)
}

/// A pair whose every byte counts as `weight` bytes on the links (a scaled-down payload
/// that stands for a bigger one: it takes the bigger one's time on the wire).
pub fn weighted_pair(
    net: &Network,
    dialer: NodeId,
    listener: NodeId,
    weight: f64,
) -> (SimStream, SimStream) {
    weighted_pair_each_way(net, dialer, listener, weight, weight)
}

/// A pair whose dialer's bytes count as `dialer_weight` bytes each, the listener's as
/// `listener_weight` (requests at their size, scaled-down replies at the size they stand
/// for).
pub fn weighted_pair_each_way(
    net: &Network,
    dialer: NodeId,
    listener: NodeId,
    dialer_weight: f64,
    listener_weight: f64,
) -> (SimStream, SimStream) {
    let (a_tx, a_rx) = mpsc::channel(WINDOW);
    let (b_tx, b_rx) = mpsc::channel(WINDOW);
    let now = Instant::now();
    let end = |local, remote, tx, rx, weight| SimStream {
        net: net.clone(),
        local,
        remote,
        tx: Some(tx),
        rx,
        queue: VecDeque::new(),
        pos: 0,
        timer: None,
        last_arrival: now,
        last_departure: now,
        write_timer: None,
        eof: false,
        weight,
    };
    (
        end(dialer, listener, a_tx, b_rx, dialer_weight),
        end(listener, dialer, b_tx, a_rx, listener_weight),
    )
}

/// Polls `timer` (set, or reset, to fire at `at`): ready once `at` has passed.
fn wait_until(timer: &mut Option<Pin<Box<Sleep>>>, at: Instant, cx: &mut Context<'_>) -> Poll<()> {
    match timer {
        Some(t) => t.as_mut().reset(at),
        None => *timer = Some(Box::pin(tokio::time::sleep_until(at))),
    }
    match timer {
        Some(t) => t.as_mut().poll(cx),
        None => Poll::Ready(()),
    }
}

impl SimStream {
    fn send(&mut self, cx: &mut Context<'_>, data: Vec<u8>) -> Poll<io::Result<()>> {
        if self.tx.is_none() {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        // More than SEND_AHEAD queued on the link already: wait until it drains to that.
        if self.net.config().bandwidth > 0.0 {
            let wake = self.last_departure.checked_sub(SEND_AHEAD);
            if let Some(wake) = wake.filter(|w| *w > Instant::now()) {
                if wait_until(&mut self.write_timer, wake, cx).is_pending() {
                    return Poll::Pending;
                }
            }
        }
        let Some(tx) = self.tx.as_mut() else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        match tx.poll_ready(cx) {
            Poll::Pending => return Poll::Pending,
            // The other end is gone: as a reset connection.
            Poll::Ready(Err(_)) => return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into())),
            Poll::Ready(Ok(())) => {}
        }
        let now = Instant::now();
        let on_wire = (data.len() as f64 * self.weight).round() as usize;
        let sched = self.net.schedule(self.local, self.remote, on_wire, now);
        let at = sched.arrives.max(self.last_arrival);
        self.last_arrival = at;
        self.last_departure = sched.departs;
        let _ = tx.start_send(Packet { at, data });
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        // A packet stands for at most 64 KiB on the wire (a weighted stream writes less
        // per packet), so a receiver gets bytes while the rest is still on the link.
        let packet = ((64.0 * 1024.0) / self.weight).max(1024.0) as usize;
        let n = buf.len().min(packet);
        match self.send(cx, buf[..n].to_vec()) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(n)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.tx.is_none() {
            return Poll::Ready(Ok(()));
        }
        // The close travels like data (after everything written before it).
        match self.send(cx, Vec::new()) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(_) => {}
        }
        self.tx = None;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for SimStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            if this.eof {
                return Poll::Ready(Ok(0));
            }
            // Take everything the writer has sent so far (arrival times are ordered).
            while let Poll::Ready(p) = Pin::new(&mut this.rx).poll_next(cx) {
                match p {
                    Some(p) => this.queue.push_back(p),
                    None => {
                        // The writer vanished without a close: as a reset.
                        if this.queue.is_empty() {
                            return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
                        }
                        break;
                    }
                }
            }
            let Some(head) = this.queue.front() else {
                return Poll::Pending;
            };
            let now = Instant::now();
            let due = if head.at > now {
                Some(head.at)
            } else if this.net.cut(this.local, this.remote) {
                Some(now + CUT_POLL)
            } else {
                None
            };
            if let Some(due) = due {
                if wait_until(&mut this.timer, due, cx).is_pending() {
                    return Poll::Pending;
                }
                continue;
            }
            if head.data.is_empty() {
                this.eof = true;
                continue;
            }
            let n = (head.data.len() - this.pos).min(buf.len());
            buf[..n].copy_from_slice(&head.data[this.pos..this.pos + n]);
            this.pos += n;
            if this.pos == head.data.len() {
                this.queue.pop_front();
                this.pos = 0;
            }
            return Poll::Ready(Ok(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::NetConfig;
    use futures::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_arrive_in_order_after_the_latency_and_close_is_eof() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(40), Duration::from_millis(40)),
            ..Default::default()
        });
        let (a, b) = (net.add_node(), net.add_node());
        let (mut x, mut y) = pair(&net, a, b);
        let t0 = Instant::now();
        x.write_all(b"hello ").await.unwrap();
        x.write_all(b"world").await.unwrap();
        x.close().await.unwrap();
        let mut got = Vec::new();
        y.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(40), "{took:?}");
        // And the other way.
        y.write_all(b"back").await.unwrap();
        let mut four = [0u8; 4];
        x.read_exact(&mut four).await.unwrap();
        assert_eq!(&four, b"back");
    }

    #[tokio::test]
    async fn a_relayed_pair_carries_bytes_through_the_relay_and_is_cut_at_its_limit() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(5), Duration::from_millis(5)),
            ..Default::default()
        });
        let (a, r, b) = (net.add_node(), net.add_node(), net.add_node());
        let cut = Arc::new(AtomicU64::new(0));
        let rt = tokio::runtime::Handle::current();
        let limits = (1000, Duration::from_secs(60));
        let (mut x, mut y) = relayed_pair(&net, &rt, (a, r, b), (1.0, 1.0), limits, cut.clone());
        x.write_all(&[7u8; 600]).await.unwrap();
        let mut got = [0u8; 600];
        y.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [7u8; 600]);
        assert_eq!(net.traffic(r), (600, 600));
        // A closed sending half closes that direction only.
        x.close().await.unwrap();
        let mut none = Vec::new();
        y.read_to_end(&mut none).await.unwrap();
        assert!(none.is_empty());
        y.write_all(&[2u8; 100]).await.unwrap();
        let mut back = [0u8; 100];
        x.read_exact(&mut back).await.unwrap();
        assert_eq!(back, [2u8; 100]);
        // 1,300 bytes both ways together pass the 1,000 the relay allows: it closes the
        // circuit instead of forwarding them.
        y.write_all(&[1u8; 600]).await.unwrap();
        let mut rest = Vec::new();
        x.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        assert_eq!(cut.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_partition_holds_bytes_until_it_heals() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(5), Duration::from_millis(5)),
            ..Default::default()
        });
        let (a, b) = (net.add_node(), net.add_node());
        let (mut x, mut y) = pair(&net, a, b);
        net.partition(vec![0, 1]);
        x.write_all(b"held").await.unwrap();
        let mut four = [0u8; 4];
        let early = tokio::time::timeout(Duration::from_millis(200), y.read_exact(&mut four)).await;
        assert!(early.is_err(), "nothing passes a partition");
        net.heal();
        tokio::time::timeout(Duration::from_secs(2), y.read_exact(&mut four))
            .await
            .expect("delivered after the heal")
            .unwrap();
        assert_eq!(&four, b"held");
    }

    #[tokio::test]
    async fn a_weighted_stream_takes_the_time_and_bytes_of_its_weight() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(10), Duration::from_millis(10)),
            bandwidth: 1e6,
            ..Default::default()
        });
        let (a, b) = (net.add_node(), net.add_node());
        let (mut x, mut y) = weighted_pair(&net, a, b, 10.0);
        let t0 = Instant::now();
        x.write_all(&[7u8; 10_000]).await.unwrap();
        let mut got = vec![0u8; 10_000];
        y.read_exact(&mut got).await.unwrap();
        // 10,000 bytes weigh 100,000 on the wire: 0.1 s at 1 MB/s, then 10 ms.
        assert!(
            t0.elapsed() >= Duration::from_millis(110),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(net.traffic(a).0, 100_000);
        assert!(got.iter().all(|&v| v == 7));
    }

    #[tokio::test]
    async fn a_bulk_transfer_delays_another_connection_by_about_the_send_ahead() {
        let net = Network::new(NetConfig {
            latency: (Duration::from_millis(5), Duration::from_millis(5)),
            bandwidth: 1e6,
            ..Default::default()
        });
        let (a, b, c) = (net.add_node(), net.add_node(), net.add_node());
        let (mut bulk, mut bulk_in) = pair(&net, a, b);
        let (mut small, mut small_in) = pair(&net, a, c);
        // One second of bytes on a's upload link, read as they come.
        let writer = tokio::spawn(async move {
            bulk.write_all(&vec![1u8; 1_000_000]).await.unwrap();
            bulk
        });
        let reader = tokio::spawn(async move {
            let mut sink = vec![0u8; 1_000_000];
            bulk_in.read_exact(&mut sink).await.unwrap();
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t0 = Instant::now();
        small.write_all(b"status").await.unwrap();
        let mut six = [0u8; 6];
        small_in.read_exact(&mut six).await.unwrap();
        let waited = t0.elapsed();
        // Behind at most SEND_AHEAD plus one 64 KiB packet of the bulk (65 ms), not
        // behind the 0.9 s of bulk bytes still to send.
        assert!(
            waited < SEND_AHEAD + Duration::from_millis(150),
            "{waited:?}"
        );
        let _ = writer.await.unwrap();
        reader.await.unwrap();
    }
}
