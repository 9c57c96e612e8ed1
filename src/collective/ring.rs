//! Ring all-reduce over links: reduce-scatter, then all-gather, in a fixed member order,
//! pipelined in chunks (while a member sends one segment to its right it receives another
//! from its left and adds it in).
//!
//! With `n` members the data is cut into `n` segments. Reduce-scatter step `k` (of `n-1`):
//! member `r` sends segment `r-k` and adds the segment `r-k-1` it receives; afterwards it
//! holds the whole sum of segment `r+1`. All-gather step `k`: it sends segment `r+1-k`
//! (complete) and stores the segment `r-k` it receives. Every member ends with the same
//! bytes: each segment's sum is made once, by its owner, and copied to the others as it
//! is. With a bf16 wire every hop carries bf16 and the owner rounds its sum to bf16 before
//! sending it, so the members still agree bit for bit.
//!
//! Each member sends and receives `2 (n-1)/n` times the data: the bus bandwidth of a round
//! is `2 (n-1)/n x bytes / seconds`, as NCCL and gloo report it.
//!
//! Owns: the schedule and the arithmetic. Never decides who the members are.

use std::time::{Duration, Instant};

use super::link::{dial, LinkError, LinkListener, LinkOffer, LinkRx, LinkTx, TcpLinks};

/// How values travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Wire {
    F32,
    /// bfloat16 (round to nearest even): half the bytes, sums rounded at every hop.
    Bf16,
}

impl Wire {
    pub fn bytes_per_value(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 => 2,
        }
    }
}

/// Why a round failed (the data is then partly reduced and must not be used).
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("sending to the right neighbour: {0}")]
    Send(LinkError),
    #[error("receiving from the left neighbour: {0}")]
    Recv(LinkError),
    #[error("a frame of {got} bytes where {want} were due")]
    Framing { got: usize, want: usize },
    #[error("the sending thread panicked")]
    Panicked,
    /// The left neighbour sent values that are not finite (or that overflowed when added
    /// in). Every member checks what it receives before it adds or forwards anything, so
    /// an honest member never passes a NaN on: the first to see one names its sender.
    #[error("non-finite values arrived from the left neighbour")]
    NonFinite,
}

/// A member's place in a ring: its rank, the ring's size, and its links.
pub struct Ring {
    pub rank: usize,
    pub size: usize,
    right: Option<LinkTx>,
    left: Option<LinkRx>,
    /// Values per frame (the pipeline's grain).
    pub chunk: usize,
    /// A pause between the reduce-scatter and the all-gather (tests hold a round there
    /// to kill a member mid-round). None in normal use.
    pub midway_pause: Option<Duration>,
}

/// What one round cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoundStats {
    pub seconds: f64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

impl RoundStats {
    /// NCCL's bus bandwidth, bytes/s, for `values` f32 values on `size` members.
    pub fn bus_bandwidth(&self, values: usize, size: usize) -> f64 {
        if size < 2 || self.seconds <= 0.0 {
            return 0.0;
        }
        let bytes = (values * 4) as f64;
        bytes * 2.0 * (size - 1) as f64 / size as f64 / self.seconds
    }
}

/// Default values per frame: 256 Ki (1 MiB of f32).
pub const DEFAULT_CHUNK: usize = 64 << 10;

fn segment(len: usize, size: usize, i: usize) -> std::ops::Range<usize> {
    (i * len / size)..((i + 1) * len / size)
}

/// Two disjoint segments of `data`: (`a` to read, `b` to write).
fn split_two(
    data: &mut [f32],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[f32], &mut [f32]) {
    // Empty segments (fewer values than members) may start where another does.
    if a.is_empty() {
        return (&[], &mut data[b]);
    }
    if b.is_empty() {
        return (&data[a], &mut []);
    }
    if a.start < b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// bfloat16 bits of `x`, rounded to nearest even (NaN stays NaN); branch-free so the
/// loops over it vectorize.
#[inline]
fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    let nan_mask = (((b & 0x7fff_ffff) > 0x7f80_0000) as u32).wrapping_neg();
    (rounded ^ ((rounded ^ quiet_nan) & nan_mask)) as u16
}

#[inline]
fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// The value `x` takes after a bf16 round trip.
pub fn round_bf16(x: f32) -> f32 {
    from_bf16(to_bf16(x))
}

/// The bf16 loops, compiled once more for AVX2 (8 lanes: the rounding's shifts and
/// compares then vectorize) and chosen at run time where the CPU has it.
mod bf16x {
    use super::{from_bf16, to_bf16};

    #[inline(always)]
    fn encode(o: &mut [u16], src: &[f32]) {
        for (o, x) in o.iter_mut().zip(src) {
            *o = to_bf16(*x);
        }
    }

    #[inline(always)]
    fn add(dst: &mut [f32], src: &[u16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += from_bf16(*s);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn encode_avx2(o: &mut [u16], src: &[f32]) {
        encode(o, src)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn add_avx2(dst: &mut [f32], src: &[u16]) {
        add(dst, src)
    }

    #[cfg(target_arch = "x86_64")]
    fn avx2() -> bool {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| std::is_x86_feature_detected!("avx2"))
    }

    /// `o[i] = bf16(src[i])`.
    pub fn encode_into(o: &mut [u16], src: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { encode_avx2(o, src) };
        }
        encode(o, src)
    }

    /// `dst[i] += f32(src[i])`.
    pub fn add_from(dst: &mut [f32], src: &[u16]) {
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { add_avx2(dst, src) };
        }
        add(dst, src)
    }
}

/// Writes `src` as wire values (little-endian) into `out`.
fn encode(src: &[f32], wire: Wire, out: &mut [u8]) {
    match wire {
        Wire::F32 if cfg!(target_endian = "little") => {
            out.copy_from_slice(bytemuck::cast_slice(src));
        }
        Wire::F32 => {
            for (o, x) in out.chunks_exact_mut(4).zip(src) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        Wire::Bf16 => match bytemuck::try_cast_slice_mut::<u8, u16>(out) {
            Ok(o) if cfg!(target_endian = "little") => bf16x::encode_into(o, src),
            _ => {
                for (o, x) in out.chunks_exact_mut(2).zip(src) {
                    o.copy_from_slice(&to_bf16(*x).to_le_bytes());
                }
            }
        },
    }
}

/// Adds (or, with `store`, writes) the wire values `bytes` into `dst`.
fn decode(bytes: &[u8], wire: Wire, dst: &mut [f32], store: bool) {
    let little = cfg!(target_endian = "little");
    match wire {
        Wire::F32 => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
            Ok(src) if little && store => dst.copy_from_slice(src),
            Ok(src) if little => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += *s;
                }
            }
            _ => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                    let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    *d = if store { v } else { *d + v };
                }
            }
        },
        Wire::Bf16 => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
            Ok(src) if little && store => {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = from_bf16(*s);
                }
            }
            Ok(src) if little => bf16x::add_from(dst, src),
            _ => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    let v = from_bf16(u16::from_le_bytes([b[0], b[1]]));
                    *d = if store { v } else { *d + v };
                }
            }
        },
    }
}

fn send_segment(tx: &mut LinkTx, seg: &[f32], wire: Wire, chunk: usize) -> Result<(), RingError> {
    let w = wire.bytes_per_value();
    for part in seg.chunks(chunk.max(1)) {
        let sent = if wire == Wire::F32 && cfg!(target_endian = "little") {
            // The values are the wire bytes: sealed straight from the data.
            tx.send(bytemuck::cast_slice(part))
        } else {
            tx.send_with(part.len() * w, |out| encode(part, wire, out))
        };
        sent.map_err(RingError::Send)?;
    }
    Ok(())
}

fn recv_segment(
    rx: &mut LinkRx,
    seg: &mut [f32],
    wire: Wire,
    chunk: usize,
    store: bool,
) -> Result<(), RingError> {
    let w = wire.bytes_per_value();
    for part in seg.chunks_mut(chunk.max(1)) {
        if store && wire == Wire::F32 && cfg!(target_endian = "little") {
            // The wire bytes are the values: opened straight into the data.
            rx.recv_into(bytemuck::cast_slice_mut(part))
                .map_err(RingError::Recv)?;
        } else {
            let bytes = rx.recv().map_err(RingError::Recv)?;
            if bytes.len() != part.len() * w {
                return Err(RingError::Framing {
                    got: bytes.len(),
                    want: part.len() * w,
                });
            }
            decode(bytes, wire, part, store);
        }
        // This member's own values are finite (the member loop zeroes its own NaN), so a
        // non-finite result came from the left.
        if !part.iter().all(|x| x.is_finite()) {
            return Err(RingError::NonFinite);
        }
    }
    Ok(())
}

/// One step: sends segment `s` of `data` to the right while receiving segment `g` from
/// the left (added in, or with `store` written).
#[allow(clippy::too_many_arguments)]
fn exchange(
    tx: &mut LinkTx,
    rx: &mut LinkRx,
    data: &mut [f32],
    s: std::ops::Range<usize>,
    g: std::ops::Range<usize>,
    wire: Wire,
    chunk: usize,
    store: bool,
) -> Result<(), RingError> {
    let (send, recv) = split_two(data, s, g);
    std::thread::scope(|scope| {
        let sender = scope.spawn(move || send_segment(tx, send, wire, chunk));
        let received = recv_segment(rx, recv, wire, chunk, store);
        let sent = sender.join().map_err(|_| RingError::Panicked)?;
        received.and(sent)
    })
}

impl Ring {
    /// A ring of one: every reduction is the identity.
    pub fn solo() -> Ring {
        Ring {
            rank: 0,
            size: 1,
            right: None,
            left: None,
            chunk: DEFAULT_CHUNK,
            midway_pause: None,
        }
    }

    /// Member `rank` of a ring of `size`, sending to its right neighbour and receiving
    /// from its left one.
    /// `n` rings over loopback TCP in this process, linked directly (no swarm: member r
    /// dials r+1 with the offer r+1 made). For tests and benchmarks of the data plane.
    pub fn loopback(n: usize) -> Result<Vec<Ring>, LinkError> {
        if n == 1 {
            return Ok(vec![Ring::solo()]);
        }
        let loopback: std::net::IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
        let listeners = (0..n)
            .map(|_| LinkListener::bind(std::net::SocketAddr::new(loopback, 0)))
            .collect::<Result<Vec<_>, _>>()?;
        let offers: Vec<LinkOffer> = listeners.iter().map(|l| l.offer(true)).collect();
        let t = Duration::from_secs(10);
        std::thread::scope(|s| {
            let accepts: Vec<_> = (0..n)
                .map(|r| {
                    let (l, o) = (&listeners[r], &offers[r]);
                    s.spawn(move || l.accept(o, t))
                })
                .collect();
            let dials: Vec<_> = (0..n)
                .map(|r| {
                    let o = offers[(r + 1) % n].clone();
                    let at = [crate::swarm::Multiaddr::empty()
                        .with(crate::swarm::Protocol::Ip4(std::net::Ipv4Addr::LOCALHOST))];
                    s.spawn(move || dial(&TcpLinks, &at, &o, t))
                })
                .collect();
            let joined = |h: std::thread::ScopedJoinHandle<
                '_,
                Result<(LinkTx, LinkRx), LinkError>,
            >| { h.join().unwrap_or_else(|_| Err(LinkError::Closed)) };
            // Member r's sending half is its link to the right; its receiving half is what
            // its left neighbour's dial reached (r's accept). The other halves go unused.
            let txs = dials
                .into_iter()
                .map(|h| joined(h).map(|l| l.0))
                .collect::<Result<Vec<_>, _>>()?;
            let rxs = accepts
                .into_iter()
                .map(|h| joined(h).map(|l| l.1))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(txs
                .into_iter()
                .zip(rxs)
                .enumerate()
                .map(|(r, (tx, rx))| Ring::new(r, n, tx, rx))
                .collect())
        })
    }

    pub fn new(rank: usize, size: usize, right: LinkTx, left: LinkRx) -> Ring {
        Ring {
            rank,
            size,
            right: Some(right),
            left: Some(left),
            chunk: DEFAULT_CHUNK,
            midway_pause: None,
        }
    }

    /// Bounds every send and receive of later rounds: a member that stalls or dies fails
    /// the round at its neighbours within this.
    pub fn set_timeout(&self, t: Duration) -> Result<(), LinkError> {
        if let Some(tx) = &self.right {
            tx.set_timeout(t)?;
        }
        if let Some(rx) = &self.left {
            rx.set_timeout(t)?;
        }
        Ok(())
    }

    /// Sums `data` element-wise across the ring's members; every member ends with the
    /// same values. On an error the data is partly reduced and must be discarded.
    pub fn all_reduce(&mut self, data: &mut [f32], wire: Wire) -> Result<RoundStats, RingError> {
        let t0 = Instant::now();
        let (n, r, len, chunk) = (self.size, self.rank, data.len(), self.chunk);
        let (Some(tx), Some(rx)) = (self.right.as_mut(), self.left.as_mut()) else {
            return Ok(RoundStats::default());
        };
        let (sent0, recv0) = (tx.bytes, rx.bytes);
        let at = |i: usize| segment(len, n, i % n);
        for k in 0..n - 1 {
            let (s, g) = (at(r + n - k), at(r + 2 * n - k - 1));
            exchange(tx, rx, data, s, g, wire, chunk, false)?;
        }
        if let Some(p) = self.midway_pause {
            std::thread::sleep(p);
        }
        if wire == Wire::Bf16 {
            // The owner's sum as everyone else will receive it.
            for x in &mut data[at(r + 1)] {
                *x = round_bf16(*x);
            }
        }
        for k in 0..n - 1 {
            let (s, g) = (at(r + 1 + n - k), at(r + n - k));
            exchange(tx, rx, data, s, g, wire, chunk, true)?;
        }
        Ok(RoundStats {
            seconds: t0.elapsed().as_secs_f64(),
            bytes_sent: tx.bytes - sent0,
            bytes_received: rx.bytes - recv0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_and_wire_round_trips() {
        let mut rng = crate::base::Rng::seeded(5);
        let mut xs: Vec<f32> = (0..100_000)
            .map(|_| f32::from_bits(rng.next_u64() as u32))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ]);
        // Ties: exactly halfway between two bf16 values, both parities.
        xs.extend([f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)]);
        for &x in &xs {
            let ours = to_bf16(x);
            let theirs = half::bf16::from_f32(x);
            if x.is_nan() {
                assert!(from_bf16(ours).is_nan());
            } else {
                assert_eq!(ours, theirs.to_bits(), "{x:e}");
            }
        }
        // The vectorised wire encoding (AVX2 where the CPU has it) gives the same bits.
        let mut wire_bytes = vec![0u8; xs.len() * 2];
        encode(&xs, Wire::Bf16, &mut wire_bytes);
        for (x, b) in xs.iter().zip(wire_bytes.chunks_exact(2)) {
            assert_eq!(u16::from_le_bytes([b[0], b[1]]), to_bf16(*x), "{x:e}");
        }
        for wire in [Wire::F32, Wire::Bf16] {
            let src: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut bytes = vec![0u8; src.len() * wire.bytes_per_value()];
            encode(&src, wire, &mut bytes);
            let mut got = vec![1.0f32; src.len()];
            decode(&bytes, wire, &mut got, false);
            let want: Vec<f32> = src.iter().map(|x| 1.0 + round_bf16(*x)).collect();
            if wire == Wire::Bf16 {
                assert_eq!(got, want);
            } else {
                assert_eq!(got, src.iter().map(|x| 1.0 + x).collect::<Vec<_>>());
            }
            // Misaligned bytes take the portable path, with the same values.
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            let mut again = vec![1.0f32; src.len()];
            decode(&shifted[1..], wire, &mut again, false);
            assert_eq!(again, got);
        }
    }
}
