//! Leaving members out for a while: a member declines a ring with a peer it does not
//! train with (not trusted, or it sent it non-finite values), and the proposer decides
//! whom to leave out from who declined whom (see `GroupNode::propose`).

use super::proto;
use crate::swarm::PeerId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A decline: when, and how many in a row.
#[derive(Clone, Copy)]
pub(super) struct Decline {
    pub at: Instant,
    pub times: u32,
}

/// How long the `times`-th decline in a row lasts: `base`, doubled each time, at most
/// [`proto::BAN`].
pub(super) fn decline_len(base: Duration, times: u32) -> Duration {
    base.saturating_mul(1 << times.saturating_sub(1).min(16))
        .min(proto::BAN)
}

/// The next decline of a peer whose last one was `last`: one more in a row if it comes
/// within [`proto::BAN`] of the last one's end, else the first again.
pub(super) fn next_decline(base: Duration, last: Option<Decline>, now: Instant) -> Decline {
    let times = match last {
        Some(d)
            if now.saturating_duration_since(d.at) <= decline_len(base, d.times) + proto::BAN =>
        {
            d.times.saturating_add(1)
        }
        _ => 1,
    };
    Decline { at: now, times }
}

/// The member a refusal declines a ring with (see [`proto::DECLINES`]), if it is one.
pub(super) fn declined_peer(reason: &str) -> Option<PeerId> {
    let rest = reason.strip_prefix(proto::DECLINES)?.trim_start();
    let id: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    id.parse().ok()
}

/// Whom a proposer leaves out for a while, given who declined a ring with whom
/// (accuser, accused), repeatedly until no accusation among those still in remains:
/// - the word of an accuser that is not itself accused counts first: the candidates most
///   accused by such accusers go (a member that sent NaN is accused by the member that
///   saw it, and its own accusation of its left neighbour then no longer counts);
/// - if every accuser is accused too (a cycle), the candidates most accused go;
/// - if that is the proposer itself, its accusers go instead.
pub(super) fn left_out(me: PeerId, accusations: &[(PeerId, PeerId)]) -> Vec<PeerId> {
    let mut out: Vec<PeerId> = Vec::new();
    loop {
        let live: Vec<&(PeerId, PeerId)> = accusations
            .iter()
            .filter(|(a, b)| a != b && !out.contains(a) && !out.contains(b))
            .collect();
        let accused: Vec<PeerId> = live.iter().map(|(_, b)| *b).collect();
        let clean: Vec<&(PeerId, PeerId)> = live
            .iter()
            .copied()
            .filter(|(a, _)| !accused.contains(a))
            .collect();
        let counted = if clean.is_empty() { &live } else { &clean };
        let mut count: HashMap<PeerId, usize> = HashMap::new();
        for (_, b) in counted {
            *count.entry(*b).or_default() += 1;
        }
        let Some(&most) = count.values().max() else {
            return out;
        };
        let mut worst: Vec<PeerId> = count
            .iter()
            .filter(|(_, n)| **n == most)
            .map(|(p, _)| *p)
            .collect();
        if worst.contains(&me) {
            worst = live
                .iter()
                .filter(|(_, b)| *b == me)
                .map(|(a, _)| *a)
                .collect();
        }
        worst.sort_by_key(|p| p.to_bytes());
        worst.dedup();
        out.extend(worst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decline_soon_after_the_last_lasts_twice_as_long_up_to_the_ban() {
        let base = Duration::from_secs(10);
        let t0 = Instant::now();
        let first = next_decline(base, None, t0);
        assert_eq!(decline_len(base, first.times), base);
        let second = next_decline(base, Some(first), t0 + Duration::from_secs(11));
        assert_eq!(decline_len(base, second.times), Duration::from_secs(20));
        let mut d = second;
        for _ in 0..10 {
            d = next_decline(base, Some(d), d.at + decline_len(base, d.times));
        }
        assert_eq!(decline_len(base, d.times), proto::BAN);
        // Long after the last one ended: the first again.
        let later = d.at + decline_len(base, d.times) + proto::BAN + Duration::from_secs(1);
        assert_eq!(next_decline(base, Some(d), later).times, 1);
    }

    #[test]
    fn the_member_most_declined_is_left_out_and_its_own_accusations_then_do_not_count() {
        let id = || {
            crate::swarm::Keypair::generate_ed25519()
                .public()
                .to_peer_id()
        };
        let (me, h1, h2, rogue) = (id(), id(), id(), id());
        // Two members saw NaN from the rogue; the rogue declines the proposer.
        let acc = [(h1, rogue), (h2, rogue), (rogue, me)];
        assert_eq!(left_out(me, &acc), vec![rogue]);
        // One saw its NaN; the rogue accuses its own left neighbour back: the accusation
        // of an accuser that is not accused counts first, so only the rogue goes.
        assert_eq!(left_out(me, &[(h1, rogue), (rogue, h2)]), vec![rogue]);
        // Only the proposer is accused: its accuser goes.
        assert_eq!(left_out(me, &[(h1, me)]), vec![h1]);
        // One against one: both go.
        let mut both = left_out(me, &[(h1, h2), (h2, h1)]);
        both.sort_by_key(|p| p.to_bytes());
        let mut want = vec![h1, h2];
        want.sort_by_key(|p| p.to_bytes());
        assert_eq!(both, want);
        assert!(left_out(me, &[]).is_empty());
        // The refusal's text names the member declined.
        let reason = format!(
            "{} {rogue}, which sent this member non-finite values",
            proto::DECLINES
        );
        assert_eq!(declined_peer(&reason), Some(rogue));
        assert_eq!(declined_peer("promised an equal or higher ballot"), None);
    }
}
