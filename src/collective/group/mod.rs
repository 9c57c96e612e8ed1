//! A training group: the servers of one model that train it together, with no fixed
//! master. This module decides who is in the group and runs the rounds; the server's
//! training loop decides what the rounds carry (gradients, stats) and applies them.
//!
//! # Epochs: how members agree who is in
//!
//! Candidates are the peers whose gossiped status says they train this model in a group
//! (the swarm's live view), plus this member. Membership comes in ballots
//! `(epoch, proposer)`, totally ordered. To form an epoch, the candidate with the smallest
//! peer id proposes (a rule, not a role: if it is dead or silent, the others suspect it
//! after a timeout and the next smallest proposes):
//!
//! 1. Prepare: it asks every candidate to promise its ballot. A candidate promises only a
//!    ballot higher than any it promised, leaves its ring at the next heartbeat, and
//!    answers with its state (steps applied, parameter hash, whether it holds a pending
//!    sum or its own gradient of the next step). A candidate that does not answer within
//!    the control timeout is left out and the proposer starts again with a higher ballot.
//! 2. Start: the proposer decides from the states (below) and sends every member the
//!    member list (sorted by peer id: the ring's order), the group's step and parameter
//!    hash, and what each member does first. Members accept a Start only for the ballot
//!    they promised last, so two proposers never both get a member.
//! 3. The members set up the ring's links for that ballot through the swarm
//!    ([`super::rendezvous`]); a link that cannot be made fails the epoch and everyone
//!    forms the next one.
//!
//! # Step boundaries: heartbeats
//!
//! In a ring, members run a heartbeat round (a tiny all-reduce) every `heartbeat`: the
//! sums say how many trainable groups the whole group holds and whether any member wants
//! the ring dissolved (a newer ballot was promised, a newcomer is visible, it is
//! stopping). Every member sees the same sums, so every member decides the same thing at
//! the same round: take a step (when the group holds `groups_per_step` groups), dissolve,
//! or wait.
//!
//! # Why no member applies a step another did not
//!
//! A step is three rounds on one ring: the stats, the gradients, then a commit round in
//! which each member contributes 1 if it still stands by this ring's ballot. A member
//! applies the summed gradient only when the commit round completes at it with a sum
//! equal to the ring's size. A round completes at a member only if every member
//! contributed to it, and a member contributes to the commit only after it holds the full
//! gradient sum. So when any member applies step s, every member of the ring holds the
//! same summed bytes of step s: a member whose commit round failed keeps them as
//! *pending*. The next epoch's proposer sees every survivor's state; if any survivor
//! applied step s, each survivor with a pending sum of step s applies it (and checks the
//! resulting parameter hash); if none did, pending sums are dropped and the step is
//! retried in the new ring from the gradients each member still holds (its own, before
//! the sum; zeros for a member that holds none), so the dead member's share is simply
//! not in it. A member that died after applying is gone; when it comes back it is a
//! joiner. No member ever applies a partial sum: a failed gradient round leaves nothing
//! to apply.
//!
//! Joiners: a candidate whose parameters or step cannot be reached from its state (a
//! fresh server of a group that has stepped, or one that differs) is left out with a
//! clear log line; fetching the group's state is not built yet.

mod proto;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use proto::{ask, serve_one, Shared};
pub use proto::{Action, AskError, Ballot, MemberState, Reply, Request, Start, GROUP};

use super::link::{self, LinkError, LinkListener};
use super::rendezvous::{ask_link, serve_links, LinkAsk, OfferBook, RendezvousError};
use super::ring::{Ring, RingError, RoundStats, Wire};
use crate::base::lock;
use crate::swarm::{PeerId, SwarmError, SwarmHandle};

/// How a group behaves.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The group's name: the model's.
    pub name: String,
    /// A round's bound: a member that stalls longer fails the round everywhere. It must
    /// exceed the slowest member's gradient computation (members wait for each other).
    pub timeout: Duration,
    /// Time between heartbeat rounds while no step is due.
    pub heartbeat: Duration,
}

/// Why the group could not go on.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Ring(#[from] RingError),
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error("{peer}: {source}")]
    Ask { peer: PeerId, source: Box<AskError> },
    #[error("{0}")]
    Refused(String),
    #[error("the group is stopping")]
    Stopped,
}

/// This member's epoch: the ballot, the members in ring order, and its ring.
pub struct Membership {
    pub start: Start,
    pub members: Vec<PeerId>,
    pub ring: Ring,
}

impl Membership {
    pub fn epoch(&self) -> u64 {
        self.start.ballot.epoch
    }
    pub fn size(&self) -> usize {
        self.members.len()
    }
    /// What this member does first.
    pub fn action(&self) -> Action {
        self.start.actions[self.ring.rank]
    }
}

/// What a heartbeat round said (the same at every member).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Beat {
    /// Trainable groups the whole group holds.
    pub ready: f64,
    /// Some member wants the ring dissolved (a newer ballot, a newcomer, a stop).
    pub dissolve: bool,
}

/// This server's part in its model's training group.
pub struct GroupNode {
    pub cfg: GroupConfig,
    me: PeerId,
    swarm: SwarmHandle,
    rt: tokio::runtime::Handle,
    shared: Arc<Shared>,
    listener: Arc<LinkListener>,
    book: Arc<OfferBook>,
    /// Candidates left out, and when: they count again once they gossip after that.
    suspected: HashMap<PeerId, Instant>,
}

fn peer_of(b: &[u8]) -> Result<PeerId, GroupError> {
    PeerId::from_bytes(b).map_err(|e| GroupError::Refused(format!("a bad peer id: {e}")))
}

fn short(b: &[u8]) -> String {
    let h = blake3::hash(b).to_hex();
    h[..8].to_string()
}

impl GroupNode {
    /// Joins the group `cfg.name` on `swarm`: link offers on a listener at `ip` (the
    /// swarm's listen address), and the control protocol. `rt` runs the swarm calls.
    pub fn start(
        swarm: SwarmHandle,
        rt: tokio::runtime::Handle,
        cfg: GroupConfig,
        ip: IpAddr,
    ) -> Result<GroupNode, GroupError> {
        let listener = Arc::new(LinkListener::bind(SocketAddr::new(ip, 0))?);
        let book = Arc::new(OfferBook::default());
        serve_links(&swarm, listener.clone(), book.clone())?;
        let shared = Arc::new(Shared::new(cfg.name.clone()));
        let sh = shared.clone();
        // Under the asker's timeout, so a member still in a round answers "refused".
        let wait = cfg.timeout.mul_f64(0.9);
        swarm.serve(GROUP, move |peer, s| serve_one(sh.clone(), peer, s, wait))?;
        Ok(GroupNode {
            me: swarm.peer_id,
            cfg,
            swarm,
            rt,
            shared,
            listener,
            book,
            suspected: HashMap::new(),
        })
    }

    pub fn peer_id(&self) -> PeerId {
        self.me
    }

    /// How long a control request may take: a prepared member first finishes the step
    /// it is in (bounded by a round's timeout).
    fn control_timeout(&self) -> Duration {
        self.cfg.timeout.max(Duration::from_secs(1))
    }

    /// The live candidates (this member included), in ring order.
    pub fn candidates(&self) -> Vec<PeerId> {
        let mut c: Vec<PeerId> = self
            .swarm
            .view()
            .into_iter()
            .filter(|e| !e.is_self)
            .filter(|e| {
                e.status
                    .models
                    .iter()
                    .any(|m| m.name == self.cfg.name && m.group.is_some())
            })
            .filter(|e| match self.suspected.get(&e.peer) {
                // Gossiped since it was left out: a candidate again.
                Some(at) => e.age < at.elapsed(),
                None => true,
            })
            .map(|e| e.peer)
            .collect();
        c.push(self.me);
        c.sort_by_key(|p| p.to_bytes());
        c.dedup();
        c
    }

    /// Candidates visible that are not in `m` (the ring then dissolves to take them in).
    pub fn newcomers(&self, m: &Membership) -> Vec<PeerId> {
        self.candidates()
            .into_iter()
            .filter(|p| !m.members.contains(p))
            .collect()
    }

    /// Says the member is stopping: control requests are refused from now on.
    pub fn leave(&self) {
        lock(&self.shared.inner).stopping = true;
        self.shared.changed.notify_all();
    }

    fn set_state(&self, st: Option<MemberState>) {
        lock(&self.shared.inner).state = st;
        self.shared.changed.notify_all();
    }

    /// A heartbeat round: `ready` groups here, `stop` when this member is leaving.
    pub fn heartbeat(
        &self,
        m: &mut Membership,
        ready: usize,
        stop: bool,
    ) -> Result<Beat, GroupError> {
        let newcomer = !self.newcomers(m).is_empty();
        let reform = lock(&self.shared.inner).reform;
        let mut v = [ready as f32, (reform || newcomer || stop) as u8 as f32];
        m.ring.all_reduce(&mut v, Wire::F32)?;
        Ok(Beat {
            ready: v[0] as f64,
            dissolve: v[1] > 0.0,
        })
    }

    /// A sum round over `data` (stats or gradients).
    pub fn sum(
        &self,
        m: &mut Membership,
        data: &mut [f32],
        wire: Wire,
    ) -> Result<RoundStats, GroupError> {
        Ok(m.ring.all_reduce(data, wire)?)
    }

    /// The commit round: true when every member stands by this ring (apply the sum).
    /// An error means the outcome is unknown here: keep the sum as pending.
    pub fn commit(&self, m: &mut Membership) -> Result<bool, GroupError> {
        let stands = {
            let g = lock(&self.shared.inner);
            g.promised == m.start.ballot && !g.reform && !g.stopping
        };
        let mut v = [stands as u8 as f32];
        m.ring.all_reduce(&mut v, Wire::F32)?;
        Ok(v[0] as usize == m.size())
    }

    /// Forms the next epoch (blocking; `stopped` is polled): proposes when this member is
    /// the smallest live candidate, else waits for a proposer's Start. Returns once a ring
    /// is built. `state` is what this member reports (it cannot change while forming).
    pub fn form(
        &mut self,
        state: &MemberState,
        stopped: &mut dyn FnMut() -> bool,
    ) -> Result<Membership, GroupError> {
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
                match self.wait_start(wait, stopped) {
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
            if !start.members.contains(&self.me.to_bytes()) {
                // Left out by the proposer (a state no member can reach).
                return Err(GroupError::Refused(format!(
                    "left out of group {:?} epoch {}: its state (step {}) cannot join the group's (step {}); fetching the group's state is not built yet",
                    self.cfg.name, start.ballot.epoch, state.steps, start.steps
                )));
            }
            match self.build(start) {
                Ok(m) => {
                    {
                        let mut g = lock(&self.shared.inner);
                        g.state = None;
                        g.reform = g.promised != m.start.ballot;
                        g.start = None;
                    }
                    info!(
                        group = self.cfg.name,
                        epoch = m.epoch(),
                        members = m.size(),
                        rank = m.ring.rank,
                        "group epoch formed"
                    );
                    return Ok(m);
                }
                Err(e) => {
                    warn!(group = self.cfg.name, "building the ring failed: {e}");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    /// Waits for a Start of the ballot promised, polling `stopped` 4 times a second.
    fn wait_start(&self, wait: Duration, stopped: &mut dyn FnMut() -> bool) -> Option<Start> {
        let deadline = Instant::now() + wait;
        loop {
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
                return Some(s);
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
            let b = Ballot {
                epoch: g.promised.epoch + 1,
                proposer: self.me.to_bytes(),
            };
            g.promised = b.clone();
            g.start = None;
            b
        };
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
        for (p, r) in others.iter().zip(replies) {
            match r {
                Ok(Reply::State(st)) => states.push((*p, st)),
                Ok(Reply::Refused { reason, promised }) => {
                    if promised > ballot {
                        let mut g = lock(&self.shared.inner);
                        if promised > g.promised {
                            g.promised.epoch = promised.epoch;
                        }
                    }
                    warn!(group = self.cfg.name, peer = %p, "refused the ballot: {reason}");
                    excluded.push(*p);
                }
                Ok(other) => {
                    warn!(group = self.cfg.name, peer = %p, "answered {other:?} to a prepare");
                    excluded.push(*p);
                }
                Err(e) => {
                    warn!(group = self.cfg.name, peer = %p, "no answer to the prepare: {e}");
                    excluded.push(*p);
                }
            }
        }
        if !excluded.is_empty() {
            // Left out now; the next ballot goes to the others.
            for p in &excluded {
                self.suspected.insert(*p, Instant::now());
            }
            return Err(GroupError::Refused(format!(
                "{} of {} candidates did not promise ballot {}",
                excluded.len(),
                cands.len(),
                ballot.epoch
            )));
        }
        let start = decide(&self.cfg.name, ballot, states);
        if lock(&self.shared.inner).promised != start.ballot {
            return Err(GroupError::Refused("a higher ballot came meanwhile".into()));
        }
        let req = Request::Start(start.clone());
        let to: Vec<PeerId> = start
            .members
            .iter()
            .filter_map(|b| peer_of(b).ok())
            .filter(|p| *p != self.me)
            .chain(start.excluded.iter().filter_map(|b| peer_of(b).ok()))
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

    /// Sets the ring's links up: dial the right neighbour, accept the left one.
    fn build(&self, start: Start) -> Result<Membership, GroupError> {
        let members = start
            .members
            .iter()
            .map(|b| peer_of(b))
            .collect::<Result<Vec<_>, _>>()?;
        let rank = members
            .iter()
            .position(|p| *p == self.me)
            .ok_or_else(|| GroupError::Refused("not a member".into()))?;
        let n = members.len();
        if n == 1 {
            return Ok(Membership {
                start,
                members,
                ring: Ring::solo(),
            });
        }
        let tag = format!(
            "{}@{}:{}",
            self.cfg.name,
            start.ballot.epoch,
            short(&start.ballot.proposer)
        );
        let (right, left) = (members[(rank + 1) % n], members[(rank + n - 1) % n]);
        let epoch = start.ballot.epoch;
        let ctl = self.control_timeout();
        let mine = LinkAsk {
            group: tag.clone(),
            epoch,
            from_rank: rank as u32,
        };
        let theirs = LinkAsk {
            group: tag,
            epoch,
            from_rank: ((rank + n - 1) % n) as u32,
        };
        let (dialed, accepted) = self.rt.block_on(async {
            let dial = async {
                let (addr, offer) = ask_link(&self.swarm, right, &mine).await?;
                tokio::task::spawn_blocking(move || link::dial(addr, &offer, ctl))
                    .await
                    .map_err(|_| GroupError::Refused("the dialing thread panicked".into()))?
                    .map_err(GroupError::from)
            };
            let accept = async {
                let offer = self.book.take(left, &theirs, ctl).await?;
                let l = self.listener.clone();
                tokio::task::spawn_blocking(move || l.accept(&offer, ctl))
                    .await
                    .map_err(|_| GroupError::Refused("the accepting thread panicked".into()))?
                    .map_err(GroupError::from)
            };
            tokio::join!(dial, accept)
        });
        let (tx, _) = dialed?;
        let (_, rx) = accepted?;
        let ring = Ring::new(rank, n, tx, rx);
        ring.set_timeout(self.cfg.timeout)?;
        Ok(Membership {
            start,
            members,
            ring,
        })
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
            None
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
        retry,
        excluded,
    }
}
