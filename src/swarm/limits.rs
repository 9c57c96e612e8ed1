//! The per-peer bounds of inbound streams: concurrent streams per protocol and a token
//! bucket of requests per peer.

use std::collections::HashMap;
use std::time::Instant;

use libp2p::PeerId;

use super::auth::NotMember;

/// Rate buckets kept before the refilled ones are pruned.
const MAX_IDLE_BUCKETS: usize = 1024;

/// Why an inbound stream was refused (sent to the opener as its first frame).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    NotMember(#[from] NotMember),
    #[error("over the request rate limit ({rate}/s, burst {burst})")]
    RateLimited { rate: f64, burst: f64 },
    #[error("too many concurrent {protocol} streams (limit {limit})")]
    TooManyStreams {
        protocol: &'static str,
        limit: usize,
    },
}

/// Per-peer admission bounds (concurrent streams, request rate).
#[derive(Default)]
pub(super) struct Limits {
    open: HashMap<(PeerId, &'static str), usize>,
    buckets: RateTable,
}

/// A token bucket per peer: `burst` requests at once, refilled at `rate` per second.
#[derive(Default)]
struct RateTable {
    buckets: HashMap<PeerId, (f64, Instant)>,
}

impl RateTable {
    /// Takes one request of `peer`'s bucket at `now`, or says why not.
    fn take(&mut self, peer: &PeerId, now: Instant, rate: f64, burst: f64) -> Result<(), Refusal> {
        let level =
            |b: &(f64, Instant)| b.0 + rate * now.saturating_duration_since(b.1).as_secs_f64();
        if self.buckets.len() >= MAX_IDLE_BUCKETS {
            // A bucket that has refilled is the same as none: forget those, so peers that
            // came and went (or a stream of fresh peer ids) do not grow the table.
            self.buckets.retain(|_, b| level(b) < burst);
        }
        let b = self.buckets.entry(*peer).or_insert((burst, now));
        b.0 = level(b).min(burst);
        b.1 = now;
        if b.0 < 1.0 {
            return Err(Refusal::RateLimited { rate, burst });
        }
        b.0 -= 1.0;
        Ok(())
    }
}

impl Limits {
    /// Admits one more stream of `name` from `peer` at `now`, or says why not.
    pub(super) fn take(
        &mut self,
        peer: &PeerId,
        name: &'static str,
        now: Instant,
        (rate, burst): (f64, f64),
        max_streams: usize,
    ) -> Result<(), Refusal> {
        self.buckets.take(peer, now, rate, burst)?;
        let open = self.open.entry((*peer, name)).or_insert(0);
        if *open >= max_streams {
            return Err(Refusal::TooManyStreams {
                protocol: name,
                limit: max_streams,
            });
        }
        *open += 1;
        Ok(())
    }

    /// A stream of `name` from `peer` ended.
    pub(super) fn release(&mut self, peer: &PeerId, name: &'static str) {
        let key = (*peer, name);
        if let Some(n) = self.open.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.open.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn buckets_refuse_past_the_burst_refill_and_idle_ones_are_forgotten() {
        let t0 = Instant::now();
        let mut t = RateTable::default();
        let p = PeerId::random();
        for _ in 0..3 {
            t.take(&p, t0, 1.0, 3.0).unwrap();
        }
        let e = t.take(&p, t0, 1.0, 3.0).unwrap_err();
        assert!(e.to_string().contains("rate limit (1/s, burst 3)"), "{e}");
        t.take(&p, t0 + Duration::from_millis(1100), 1.0, 3.0)
            .unwrap();
        // 3000 one-off peers: the table stays bounded once their buckets refilled.
        for i in 0..3000u64 {
            let now = t0 + Duration::from_secs(10 + i * 5);
            t.take(&PeerId::random(), now, 1.0, 3.0).unwrap();
        }
        assert!(t.buckets.len() <= MAX_IDLE_BUCKETS, "{}", t.buckets.len());
        // Buckets still draining are kept: a busy peer's survives the pruning.
        let busy = PeerId::random();
        let late = t0 + Duration::from_secs(100_000);
        for _ in 0..3 {
            t.take(&busy, late, 1.0, 3.0).unwrap();
        }
        for _ in 0..2 * MAX_IDLE_BUCKETS {
            t.take(&PeerId::random(), late, 1.0, 3.0).unwrap();
        }
        assert!(
            t.buckets.len() > 2 * MAX_IDLE_BUCKETS,
            "draining buckets are kept"
        );
        assert!(
            t.take(&busy, late, 1.0, 3.0).is_err(),
            "its bucket was not reset"
        );
    }
}
