//! When a DiLoCo member takes its next heartbeat round.
//!
//! Between outer steps a member steps alone; the heartbeat is the only collective call
//! it makes there (it counts the members at `H` and carries reforms and stops). A
//! heartbeat is a round of the ring: on internet links with many members it costs
//! seconds (62 sequential hops at 32 members), so a heartbeat after every inner step
//! spent most of the time between outer steps waiting (measured in netsim's scenario 4:
//! 1 s steps, 6 s rounds). The pacer spaces them: a member that can go on stepping
//! heartbeats only once `period` has passed since its last one, where the period is four
//! times the last round's duration (heartbeats then take at most a fifth of the time),
//! at least the configured heartbeat interval and at most a quarter of the round timeout.
//! A member that cannot step (it is at `H`, or it has no data) heartbeats at once.
//!
//! Members stay in step without agreeing on anything: every member calls the rounds in
//! the same order, the k-th heartbeat of each pairing with the k-th of the others, and
//! all of them leave a round at about the same moment, so their clocks restart together.
//! A member that heartbeats early waits in the round for the others: at most a period
//! plus one inner step, which the round timeout must exceed already.

use std::time::{Duration, Instant};

/// How many times the last heartbeat round's duration a member steps before the next.
const ROUNDS_PER_PERIOD: u32 = 4;

/// The heartbeat schedule of one DiLoCo member (see the module docs).
#[derive(Debug, Clone)]
pub struct BeatPacer {
    last: Instant,
    round: Duration,
    min: Duration,
    max: Duration,
}

impl BeatPacer {
    /// A pacer whose period is at least `heartbeat` and at most a quarter of `timeout`.
    pub fn new(heartbeat: Duration, timeout: Duration, now: Instant) -> BeatPacer {
        BeatPacer {
            last: now,
            round: Duration::ZERO,
            min: heartbeat,
            max: (timeout / 4).max(heartbeat),
        }
    }

    /// The time between two heartbeats of a member that can step.
    pub fn period(&self) -> Duration {
        (self.round * ROUNDS_PER_PERIOD).clamp(self.min, self.max)
    }

    /// Whether the member heartbeats now: at once when it cannot step, else once the
    /// period since its last heartbeat has passed.
    pub fn due(&self, can_step: bool, now: Instant) -> bool {
        !can_step || now.saturating_duration_since(self.last) >= self.period()
    }

    /// A heartbeat round ran from `started` to `ended`.
    pub fn beat(&mut self, started: Instant, ended: Instant) {
        self.round = ended.saturating_duration_since(started);
        self.last = ended;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_member_that_can_step_waits_four_rounds_between_heartbeats() {
        let t0 = Instant::now();
        let mut p = BeatPacer::new(S / 2, 120 * S, t0);
        // Before any round: the configured interval.
        assert_eq!(p.period(), S / 2);
        assert!(!p.due(true, t0 + S / 4));
        assert!(p.due(true, t0 + S / 2));
        // A 6 s round: the next one after 24 s of steps.
        p.beat(t0 + S, t0 + 7 * S);
        assert_eq!(p.period(), 24 * S);
        assert!(!p.due(true, t0 + 30 * S));
        assert!(p.due(true, t0 + 31 * S));
    }

    #[test]
    fn a_member_that_cannot_step_heartbeats_at_once() {
        let t0 = Instant::now();
        let mut p = BeatPacer::new(S / 2, 60 * S, t0);
        p.beat(t0, t0 + 6 * S);
        assert!(p.due(false, t0 + 6 * S));
    }

    #[test]
    fn the_period_stays_within_the_interval_and_a_quarter_of_the_timeout() {
        let t0 = Instant::now();
        let mut p = BeatPacer::new(S / 2, 60 * S, t0);
        p.beat(t0, t0 + Duration::from_millis(10));
        assert_eq!(p.period(), S / 2);
        p.beat(t0, t0 + 40 * S);
        assert_eq!(p.period(), 15 * S);
        // A timeout shorter than four intervals: the interval wins.
        let q = BeatPacer::new(S, S, t0);
        assert_eq!(q.period(), S);
    }
}
