//! Agreeing on an epoch: the proposer's Prepare and Start, a candidate's wait for the
//! Start, and the proposer's decision from the states it gathered (see the module docs
//! of [`super`]).

use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::decline::{declined_peer, left_out};
use super::proto::{self, ask, Action, AskError, Ballot, MemberState, Reply, Request, Start};
use super::{peer_of, GroupError, GroupNode};
use crate::base::lock;
use crate::swarm::PeerId;

/// How long a waiting member's dial to a proposer it lost the connection to may take.
const PROBE: Duration = Duration::from_secs(2);

impl GroupNode {
    /// Agrees on the next epoch (blocking; `stopped` is polled): proposes when this member
    /// is the smallest live candidate, else waits for a proposer's Start. `state` is what
    /// this member reports (it cannot change until [`GroupNode::build`], but for a Sync
    /// member's fetch, during which it reports none). A Sync member
    /// fetches the state ([`GroupNode::fetch_state`]) and the others offer theirs
    /// ([`GroupNode::offer_state`]) before building the ring.
    pub fn agree(
        &mut self,
        state: &MemberState,
        stopped: &mut dyn FnMut() -> bool,
    ) -> Result<Start, GroupError> {
        loop {
            if stopped() {
                self.leave();
                return Err(GroupError::Stopped);
            }
            self.set_state(Some(state.clone()));
            let cands = self.candidates();
            let start = if cands[0] == self.me {
                match self.propose(&cands, state) {
                    Ok(s) => s,
                    // Left out by the others: the member loop waits (a new promise ends
                    // the wait).
                    Err(e @ GroupError::LeftOut { .. }) => return Err(e),
                    Err(e) => {
                        warn!(group = self.cfg.name, "proposal failed: {e}");
                        std::thread::sleep(Duration::from_millis(200));
                        continue;
                    }
                }
            } else {
                // The proposer's prepare round takes up to a round's timeout (members
                // leave their rings at a step boundary first), then its start round.
                let wait = 2 * self.cfg.timeout + Duration::from_secs(1);
                match self.wait_start(cands[0], wait, stopped) {
                    Some(s) => s,
                    None => {
                        if stopped() {
                            continue;
                        }
                        warn!(
                            group = self.cfg.name,
                            proposer = %cands[0],
                            "no proposal from the smallest candidate: suspected"
                        );
                        self.suspected.insert(cands[0], Instant::now());
                        continue;
                    }
                }
            };
            for p in &start.excluded {
                if let Ok(p) = peer_of(p) {
                    self.suspected.insert(p, Instant::now());
                }
            }
            // (A Start of another shape says nothing of whom this member's group may
            // train with: its declines are not taken.)
            for p in start
                .declined
                .iter()
                .filter(|_| start.values == state.values)
            {
                match peer_of(p) {
                    // A Start re-stating a decline does not prolong it: it ends when the
                    // first one does.
                    Ok(p) if p != self.me && !self.is_declined(&p) => {
                        self.decline(p);
                    }
                    _ => {}
                }
            }
            info!(
                group = self.cfg.name,
                epoch = start.ballot.epoch,
                members = start.members.len(),
                steps = start.steps,
                action = ?self.action_in(&start),
                "agreed"
            );
            let me = self.me.to_bytes();
            if !start.members.contains(&me) {
                if start.declined.contains(&me) && start.values == state.values {
                    // Declined (this member sent non-finite values, or refused a ring):
                    // left out for a while (as long as the others leave it out), then it
                    // asks again.
                    let wait = self.decline(self.me);
                    warn!(
                        group = self.cfg.name,
                        epoch = start.ballot.epoch,
                        proposer = %proto::peer_name(&start.ballot.proposer),
                        wait_s = wait.as_secs(),
                        "left out of the group for a while: declined"
                    );
                    // A new promise ends the wait: a proposer (one that did not see the
                    // decline) wants this member, and its ring would wait for it.
                    let until = Instant::now() + wait;
                    let at = self.promised();
                    while Instant::now() < until && !stopped() && self.promised() == at {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    continue;
                }
                // Left out as of another shape. The proposer's word is no proof (a
                // certified rogue could say it of anyone), so this does not end the loop:
                // the member asks again later, each time in a row twice as late.
                self.shape_exclusions = self.shape_exclusions.saturating_add(1);
                let retry_in = self.decline_len(self.shape_exclusions);
                return Err(GroupError::LeftOut {
                    reason: format!(
                        "left out of group {:?} epoch {} by {}: its model has another shape \
                         ({} parameter values, the group's {}); asking again in {} s",
                        self.cfg.name,
                        start.ballot.epoch,
                        proto::peer_name(&start.ballot.proposer),
                        state.values,
                        start.values,
                        retry_in.as_secs()
                    ),
                    retry_in,
                });
            }
            self.shape_exclusions = 0;
            return Ok(start);
        }
    }

    /// Waits up to `wait` for the Start of `proposer`'s ballot. Gives up early (`None`)
    /// when the swarm lost its connection to the proposer and cannot make a new one: a
    /// dead proposer is suspected as soon as its connection times out, not after `wait`.
    fn wait_start(
        &self,
        proposer: PeerId,
        wait: Duration,
        stopped: &mut dyn FnMut() -> bool,
    ) -> Option<Start> {
        let deadline = Instant::now() + wait;
        let mut probed = Instant::now();
        loop {
            if probed.elapsed() >= Duration::from_secs(1) {
                probed = Instant::now();
                let alive = self.rt.block_on(async {
                    self.swarm.connected_peers().await.contains(&proposer)
                        || matches!(
                            tokio::time::timeout(PROBE, self.swarm.connect(proposer)).await,
                            Ok(Ok(()))
                        )
                });
                if !alive {
                    return None;
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let g = lock(&self.shared.inner);
            let (mut g, _) = self
                .shared
                .changed
                .wait_timeout_while(g, left.min(Duration::from_millis(250)), |g| {
                    g.start.is_none() && !g.stopping
                })
                .unwrap_or_else(|e| e.into_inner());
            if let Some(s) = g.start.take() {
                // Checked again against the state this member reports now: a start that
                // came for a promise made on an older one (before a state fetch that
                // then failed to make its ring) is not this member's to build. The
                // proposer heard "started": its ring fails at the link to this member
                // (a strike against this one; two within `STRIKE_WINDOW` decline it for
                // a while) and it asks again. `fetch_state` leaves no such promise to
                // make; this stays as a net.
                match proto::start_fault(&s, &self.me.to_bytes(), g.state.as_ref()) {
                    Ok(()) => return Some(s),
                    Err(why) => warn!(
                        group = self.cfg.name,
                        epoch = s.ballot.epoch,
                        "a start for an older state of this member is dropped: {why}"
                    ),
                }
            }
            drop(g);
            if left.is_zero() || stopped() {
                return None;
            }
        }
    }

    /// One proposal over `cands` (this member first among them); the Start sent.
    fn propose(&mut self, cands: &[PeerId], mine: &MemberState) -> Result<Start, GroupError> {
        let ballot = {
            let mut g = lock(&self.shared.inner);
            if g.promised.epoch >= proto::MAX_EPOCH {
                return Err(GroupError::Refused(format!(
                    "epoch {} reached the bound of {}",
                    g.promised.epoch,
                    proto::MAX_EPOCH
                )));
            }
            let b = Ballot {
                epoch: g.promised.epoch + 1,
                proposer: self.me.to_bytes(),
            };
            g.promised = b.clone();
            g.start = None;
            b
        };
        info!(
            group = self.cfg.name,
            epoch = ballot.epoch,
            candidates = cands.len(),
            "proposing"
        );
        let members: Vec<Vec<u8>> = cands.iter().map(|p| p.to_bytes()).collect();
        let prepare = Request::Prepare {
            group: self.cfg.name.clone(),
            ballot: ballot.clone(),
            members: members.clone(),
        };
        let ctl = self.control_timeout();
        let others: Vec<PeerId> = cands.iter().copied().filter(|p| *p != self.me).collect();
        let replies: Vec<Result<Reply, AskError>> = self.rt.block_on(async {
            let asks = others.iter().map(|p| ask(&self.swarm, *p, &prepare, ctl));
            futures::future::join_all(asks).await
        });
        let mut states: Vec<(PeerId, MemberState)> = vec![(self.me, mine.clone())];
        let mut excluded = Vec::new();
        let mut refused = Vec::new();
        let mut accusations: Vec<(PeerId, PeerId)> = Vec::new();
        let mut left_out_by: Vec<PeerId> = Vec::new();
        for (p, r) in others.iter().zip(replies) {
            match r {
                Ok(Reply::State(st)) => states.push((*p, st)),
                Ok(Reply::Refused { reason, promised }) => {
                    // Alive: it promised another ballot (or stops). Not suspected; the
                    // next ballot goes above what it promised.
                    let mut g = lock(&self.shared.inner);
                    if promised.epoch > g.promised.epoch
                        && promised.epoch < proto::MAX_EPOCH
                        && promised.epoch <= g.promised.epoch.saturating_add(proto::MAX_EPOCH_STEP)
                    {
                        g.promised.epoch = promised.epoch;
                    }
                    drop(g);
                    info!(group = self.cfg.name, peer = %p, "refused the ballot: {reason}");
                    if reason == proto::LEAVES_OUT {
                        left_out_by.push(*p);
                        refused.push(*p);
                    } else if reason == proto::STOPPING {
                        excluded.push(*p);
                    } else if let Some(accused) = declined_peer(&reason) {
                        // Alive: only whom `left_out` names is left out.
                        accusations.push((*p, accused));
                        refused.push(*p);
                    } else {
                        refused.push(*p);
                    }
                }
                Ok(other) => {
                    warn!(group = self.cfg.name, peer = %p, "answered {other:?} to a prepare");
                    excluded.push(*p);
                }
                Err(e) if Self::unreachable(&e) && !self.reachable_later(p) => {
                    // Alive or not, it could not be reached within the bound: left out
                    // for a decline period (doubled in a row), not just until its next
                    // gossip (a peer that gossips but cannot be reached from here would
                    // be proposed to again and again).
                    match self.unlink(*p) {
                        Some(wait) => warn!(
                            group = self.cfg.name,
                            peer = %p,
                            wait_s = wait.as_secs(),
                            "no answer to the prepare again: left out for a while ({e})"
                        ),
                        None => warn!(
                            group = self.cfg.name,
                            peer = %p,
                            "no answer to the prepare: left out until its next status ({e})"
                        ),
                    }
                    excluded.push(*p);
                }
                Err(e) => {
                    warn!(group = self.cfg.name, peer = %p, "no answer to the prepare: {e}");
                    excluded.push(*p);
                }
            }
        }
        if !left_out_by.is_empty() {
            // Members that leave this one out (a Start declined it, and its own wait ended
            // first): it waits out a decline period of its own instead of proposing again
            // at once (or declining them back).
            let wait = self.decline(self.me);
            return Err(GroupError::LeftOut {
                reason: format!(
                    "{} member(s) of group {:?} leave this one out for a while; asking again in {} s",
                    left_out_by.len(),
                    self.cfg.name,
                    wait.as_secs()
                ),
                retry_in: wait,
            });
        }
        if !accusations.is_empty() {
            for p in left_out(self.me, &accusations) {
                info!(group = self.cfg.name, peer = %p, "left out for a while: declined by other members, or declining this one");
                self.decline(p);
            }
        }
        if !excluded.is_empty() || !refused.is_empty() {
            // The silent ones are left out; the next ballot goes to the others.
            for p in &excluded {
                self.suspected.insert(*p, Instant::now());
            }
            return Err(GroupError::Refused(format!(
                "{} of {} candidates did not promise ballot {} ({} refused)",
                excluded.len() + refused.len(),
                cands.len(),
                ballot.epoch,
                refused.len()
            )));
        }
        let mut start = decide(&self.cfg.name, ballot, states);
        // Members of another shape are declined too (every member leaves them out for a
        // decline period, doubled each time in a row): else each of their gossips would
        // make them a newcomer again and dissolve the ring.
        for p in start.excluded.clone() {
            match peer_of(&p) {
                Ok(peer) if peer != self.me && !self.is_declined(&peer) => {
                    self.decline(peer);
                }
                _ => {}
            }
        }
        // Visible peers this proposer does not train with for a while: every member
        // leaves them out as long (see `Start::declined`).
        for e in self.visible() {
            let b = e.peer.to_bytes();
            if self.shared.is_banned(&b) || self.shared.is_unlinked(&b) || self.is_declined(&e.peer)
            {
                if !start.declined.contains(&b) {
                    start.declined.push(b.clone());
                }
                if !start.excluded.contains(&b) {
                    start.excluded.push(b);
                }
            }
        }
        if lock(&self.shared.inner).promised != start.ballot {
            return Err(GroupError::Refused("a higher ballot came meanwhile".into()));
        }
        let req = Request::Start(start.clone());
        let to: Vec<PeerId> = start
            .members
            .iter()
            .filter_map(|b| peer_of(b).ok())
            .filter(|p| *p != self.me)
            // (Not to one this member just failed to reach: the Start would wait out the
            // same failure.)
            .chain(
                start
                    .excluded
                    .iter()
                    .filter(|b| !self.shared.is_unlinked(b))
                    .filter_map(|b| peer_of(b).ok()),
            )
            .collect();
        let sent: Vec<Result<Reply, AskError>> = self.rt.block_on(async {
            futures::future::join_all(to.iter().map(|p| ask(&self.swarm, *p, &req, ctl))).await
        });
        for (p, r) in to.iter().zip(sent) {
            let in_ring = start.members.contains(&p.to_bytes());
            match r {
                Ok(Reply::Started) => {}
                _ if !in_ring => {}
                Ok(other) => {
                    return Err(GroupError::Refused(format!(
                        "{p} answered {other:?} to start"
                    )))
                }
                Err(source) => {
                    return Err(GroupError::Ask {
                        peer: *p,
                        source: Box::new(source),
                    })
                }
            }
        }
        Ok(start)
    }
}

/// The proposer's decision from every candidate's state (its own included): who is in,
/// at which step and parameters, and what each does first. See the module docs.
pub fn decide(group: &str, ballot: Ballot, states: Vec<(PeerId, MemberState)>) -> Start {
    let values = states[0].1.values;
    let max_steps = states
        .iter()
        .filter(|(_, s)| s.values == values)
        .map(|(_, s)| s.steps)
        .max()
        .unwrap_or(0);
    // The group's parameters: the hash most members at the top step hold (ties: the one
    // of the smallest peer id, the first in order).
    let mut votes: Vec<([u8; 32], usize)> = Vec::new();
    let mut sorted = states.clone();
    sorted.sort_by_key(|(p, _)| p.to_bytes());
    for (_, s) in sorted
        .iter()
        .filter(|(_, s)| s.values == values && s.steps == max_steps)
    {
        match votes.iter_mut().find(|(h, _)| *h == s.hash) {
            Some(v) => v.1 += 1,
            None => votes.push((s.hash, 1)),
        }
    }
    let hash = votes
        .iter()
        .fold(None::<([u8; 32], usize)>, |best, v| match best {
            Some(b) if b.1 >= v.1 => Some(b),
            _ => Some(*v),
        })
        .map(|v| v.0)
        .unwrap_or_default();
    let mut members = Vec::new();
    let mut actions = Vec::new();
    let mut excluded = Vec::new();
    let mut retry = false;
    for (p, s) in sorted {
        let action = if s.values != values {
            None
        } else if s.steps == max_steps && s.hash == hash {
            retry |= s.held;
            Some(Action::Ready)
        } else if s.steps + 1 == max_steps && s.pending {
            Some(Action::ApplyPending)
        } else {
            // Behind, or different parameters: it fetches the group's state.
            Some(Action::Sync)
        };
        match action {
            Some(a) => {
                members.push(p.to_bytes());
                actions.push(a);
            }
            None => excluded.push(p.to_bytes()),
        }
    }
    Start {
        group: group.to_string(),
        ballot,
        members,
        actions,
        steps: max_steps,
        hash,
        values,
        retry,
        excluded,
        declined: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(steps: u64, hash: u8, pending: bool, held: bool) -> MemberState {
        MemberState {
            steps,
            version: steps,
            hash: [hash; 32],
            values: 100,
            pending,
            held,
        }
    }

    #[test]
    fn the_proposer_applies_the_recovery_rule_and_sends_joiners_to_sync() {
        let p: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        let b = Ballot {
            epoch: 7,
            proposer: p[0].to_bytes(),
        };
        let action_of = |s: &Start, peer: &PeerId| {
            let i = s.members.iter().position(|m| *m == peer.to_bytes());
            i.map(|i| s.actions[i])
        };
        // One survivor applied step 5 (its commit round finished); another holds the sum
        // as pending: it applies it. A fresh joiner syncs; a wrong shape stays out.
        let mut wrong_shape = st(0, 9, false, false);
        wrong_shape.values = 99;
        let s = decide(
            "g",
            b.clone(),
            vec![
                (p[0], st(5, 1, false, false)),
                (p[1], st(4, 2, true, true)),
                (p[2], st(0, 3, false, false)),
                (p[3], wrong_shape),
            ],
        );
        assert_eq!((s.steps, s.hash, s.retry), (5, [1; 32], false));
        assert_eq!(action_of(&s, &p[0]), Some(Action::Ready));
        assert_eq!(action_of(&s, &p[1]), Some(Action::ApplyPending));
        assert_eq!(action_of(&s, &p[2]), Some(Action::Sync));
        assert_eq!(action_of(&s, &p[3]), None);
        assert_eq!(s.excluded, vec![p[3].to_bytes()]);
        // Nobody applied step 5: pending sums are dropped and the step is retried from
        // the gradients held.
        let s = decide(
            "g",
            b.clone(),
            vec![(p[0], st(4, 1, true, true)), (p[1], st(4, 1, false, true))],
        );
        assert_eq!((s.steps, s.retry), (4, true));
        assert!(s.actions.iter().all(|a| *a == Action::Ready));
        // Members ordered by peer id (the ring's order) whatever the reply order.
        let mut sorted = s.members.clone();
        sorted.sort();
        assert_eq!(s.members, sorted);
        // A member whose parameters differ at the same step syncs to the majority's.
        let s = decide(
            "g",
            b,
            vec![
                (p[0], st(3, 1, false, false)),
                (p[1], st(3, 2, false, false)),
                (p[2], st(3, 2, false, false)),
            ],
        );
        assert_eq!(s.hash, [2; 32]);
        assert_eq!(action_of(&s, &p[0]), Some(Action::Sync));
    }
}
