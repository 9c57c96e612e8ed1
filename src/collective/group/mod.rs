//! A training group: the servers of one model that train it together, with no fixed
//! master. This module decides who is in the group and runs the rounds; the member loop
//! ([`super::member`]) calls them in order, and its learner decides what they carry
//! (gradients, stats) and applies them.
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
//!    ([`super::rendezvous`]): a direct TCP connection where the neighbour is reachable at
//!    its addresses, else a stream over the swarm's connection to it (direct, hole-punched
//!    or relayed). A link that cannot be made within the control timeout fails the epoch;
//!    the member that dialed declines a ring with that neighbour for a decline period
//!    (doubled at each failure in a row, up to 10 minutes), so the next proposer
//!    leaves one of the two out (the one the others accuse) and the rest form a ring:
//!    the same membership is never tried again and again.
//!
//! # Step boundaries: heartbeats
//!
//! In a ring, members run a heartbeat round (a tiny all-reduce) every `heartbeat`: the
//! sums say how many trainable groups the whole group holds and whether any member wants
//! the ring dissolved (a newer ballot was promised, a newcomer is visible, it is
//! stopping). Every member sees the same sums, so every member decides the same thing at
//! the same round: take a step (when the group holds `groups_per_step` groups), dissolve,
//! or wait. (In DiLoCo mode the count is of members that finished their inner steps, and
//! the step is the outer one when all have: see `collective::member`.)
//!
//! A member waiting for a proposer's Start suspects it as soon as the swarm lost its
//! connection to it and cannot dial it again, not only after the wait.
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
//! Joiners: a candidate that is behind the group's step, or whose parameters differ from
//! the majority's at that step, is told to sync: it fetches the group's state (parameters,
//! optimizer state, counters) from the Ready members in blake3-checked chunks, checks the
//! parameter hash, and joins the ring at the group's step.
//!
//! # Consistency
//!
//! Every `hash_every` steps the ring runs one more round ([`GroupNode::hashes_agree`]):
//! every member learns whether all members' parameter hashes are equal. If not, the ring
//! dissolves at every member, and the next epoch's proposer sends the members whose hash
//! is not the majority's to sync (logged by them with both hashes).

mod ballot;
mod decline;
mod link_up;
mod proto;
mod serve;
mod state;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use decline::Decline;
use proto::Shared;
pub use proto::{
    Action, AskError, Ballot, MemberState, Reply, Request, Snapshot, Start, StateManifest, GROUP,
    STATE_CHUNK,
};
use serve::{serve_group, Trusted};

pub use ballot::decide;

use super::link::{LinkError, LinkListener, LinkNet, TcpLinks};
use super::rendezvous::{serve_group_links, LinkAdmit, OfferBook, RendezvousError};
use super::ring::{Ring, RingError, RoundStats, Wire};
use crate::base::lock;
use crate::swarm::{PeerId, Reachability, SwarmError, SwarmHandle};

/// How a group behaves.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// The group's name (the model's unless a run names it): members of one model with
    /// another group name are another group.
    pub name: String,
    /// The model the group trains (as the swarm's status names it).
    pub model: String,
    /// How it trains (`sync`, `diloco/H`): members in another mode are not candidates.
    pub mode: String,
    /// A round's bound: a member that stalls longer fails the round everywhere. It must
    /// exceed the slowest member's gradient computation (members wait for each other).
    pub timeout: Duration,
    /// Time between heartbeat rounds while no step is due.
    pub heartbeat: Duration,
    /// Links may be direct TCP connections to a neighbour reachable at its addresses
    /// (false: every link is a stream over the swarm's connection).
    pub direct_links: bool,
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
    #[error("{0} sent non-finite values: it is not trained with")]
    NonFinite(PeerId),
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error("{peer}: {source}")]
    Ask { peer: PeerId, source: Box<AskError> },
    #[error("{0}")]
    Refused(String),
    /// The link to the right neighbour could not be made within the link bound: this
    /// member declines a ring with it for a while.
    #[error("could not link with {peer}: {reason}")]
    Unlinked { peer: PeerId, reason: String },
    /// Left out of an epoch as of another shape: the member waits `retry_in` and asks
    /// again (one proposer's word does not end its loop).
    #[error("{reason}")]
    LeftOut { reason: String, retry_in: Duration },
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
    /// What this member does first (a Start is checked to hold one action per member
    /// when it arrives; Sync, the safe one, if it did not).
    pub fn action(&self) -> Action {
        self.start
            .actions
            .get(self.ring.rank)
            .copied()
            .unwrap_or(Action::Sync)
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
    links: Arc<dyn LinkNet>,
    /// Candidates left out, and when: they count again once they gossip after that.
    suspected: HashMap<PeerId, Instant>,
    /// Candidates that declined a ring with a member that sent them non-finite values,
    /// or were declined: left out for [`GroupNode::decline_for`], so the others form a
    /// ring (where that member is found out too) instead of proposing to them again at
    /// once; twice as long at each decline that follows the last one's end within
    /// [`proto::BAN`] (so a member that keeps sending NaN costs the group a failed round
    /// less and less often). This member's own entry times its wait when declined.
    declined: std::sync::Mutex<HashMap<PeerId, (Decline, Instant)>>,
    /// Starts in a row that left this member out as of another shape: each doubles the
    /// wait before it asks again (up to [`proto::BAN`]).
    shape_exclusions: u32,
    /// Neighbours a direct TCP connection to failed, and when (see
    /// [`link_up::DIRECT_RETRY`]).
    direct_failed: std::sync::Mutex<HashMap<PeerId, Instant>>,
    /// Peers that could not be reached or linked once, and when (see
    /// [`GroupNode::unlink`]).
    strikes: std::sync::Mutex<HashMap<PeerId, Instant>>,
}

/// Whether the peer of `e` says other hosts cannot reach it yet (see
/// [`GroupNode::candidates`]).
fn unreachable_yet(e: &crate::swarm::ViewEntry) -> bool {
    matches!(
        e.status
            .extra
            .get(crate::swarm::protocol::REACH_FIELD)
            .map(String::as_str),
        Some("unreachable" | "unknown")
    )
}

fn peer_of(b: &[u8]) -> Result<PeerId, GroupError> {
    PeerId::from_bytes(b).map_err(|e| GroupError::Refused(format!("a bad peer id: {e}")))
}

fn short(b: &[u8]) -> String {
    let h = blake3::hash(b).to_hex();
    h[..8].to_string()
}

impl GroupNode {
    /// Joins the group `cfg.name` on `swarm`: link offers on a TCP listener at `ip` (the
    /// swarm's listen address), and the control protocol. `rt` runs the swarm calls.
    pub fn start(
        swarm: SwarmHandle,
        rt: tokio::runtime::Handle,
        cfg: GroupConfig,
        ip: IpAddr,
    ) -> Result<GroupNode, GroupError> {
        GroupNode::start_with(swarm, rt, cfg, ip, Arc::new(TcpLinks))
    }

    /// [`GroupNode::start`] with the links of `links` (netsim's simulated network).
    pub fn start_with(
        swarm: SwarmHandle,
        rt: tokio::runtime::Handle,
        cfg: GroupConfig,
        ip: IpAddr,
        links: Arc<dyn LinkNet>,
    ) -> Result<GroupNode, GroupError> {
        let listener = Arc::new(LinkListener::on(&*links, ip)?);
        let book = Arc::new(OfferBook::default());
        let (sw, model, name) = (swarm.clone(), cfg.model.clone(), cfg.name.clone());
        let shared = Arc::new(Shared::new(cfg.name.clone(), swarm.peer_id.to_bytes()));
        let sh = shared.clone();
        let admit: LinkAdmit = Arc::new(move |p: &PeerId| {
            sw.may_train_with_peer(p, &model, &name) && !sh.is_banned(&p.to_bytes())
        });
        serve_group_links(
            &swarm,
            Some(&cfg.name),
            listener.clone(),
            book.clone(),
            admit,
        )?;
        let sh = shared.clone();
        // Under the asker's timeout, so a member still in a round answers "refused".
        let wait = cfg.timeout.mul_f64(0.9);
        let (sw, model, name) = (swarm.clone(), cfg.model.clone(), cfg.name.clone());
        let trusted: Trusted = Arc::new(move |peer: &PeerId| {
            sw.may_train_with_peer(peer, &model, &name) && !sh.is_banned(&peer.to_bytes())
        });
        serve_group(&swarm, &cfg.name, shared.clone(), wait, trusted)?;
        Ok(GroupNode {
            me: swarm.peer_id,
            cfg,
            swarm,
            rt,
            shared,
            listener,
            book,
            links,
            suspected: HashMap::new(),
            shape_exclusions: 0,
            declined: Default::default(),
            direct_failed: Default::default(),
            strikes: Default::default(),
        })
    }

    /// How long a control request may take: a prepared member first finishes the step
    /// it is in (bounded by a round's timeout).
    fn control_timeout(&self) -> Duration {
        self.cfg.timeout.max(Duration::from_secs(1))
    }

    /// How long a candidate that declined a ring is left out (see `declined`).
    fn decline_for(&self) -> Duration {
        (self.control_timeout() * 3).max(Duration::from_secs(10))
    }

    /// How long the `times`-th decline in a row lasts (see `declined`).
    fn decline_len(&self, times: u32) -> Duration {
        decline::decline_len(self.decline_for(), times)
    }

    /// Declines `p` from now (see `declined`); returns how long.
    fn decline(&self, p: PeerId) -> Duration {
        self.decline_with(p, self.decline_for())
    }

    /// Declines `p` from now for `base`, doubled at each decline in a row (up to
    /// [`proto::BAN`]); returns how long.
    fn decline_with(&self, p: PeerId, base: Duration) -> Duration {
        let now = Instant::now();
        let mut declined = lock(&self.declined);
        let d = decline::next_decline(base, declined.get(&p).map(|x| x.0), now);
        let wait = decline::decline_len(base, d.times);
        declined.insert(p, (d, now + wait));
        self.shared.decline(p.to_bytes(), wait);
        wait
    }

    /// How long a peer that could not be reached or linked is left out at first: a
    /// retry costs the group up to a control timeout, so about half its time at worst,
    /// less at each doubling.
    fn unlink_for(&self) -> Duration {
        self.control_timeout().max(Duration::from_secs(10))
    }

    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }

    /// The live candidates (this member included), in ring order.
    ///
    /// Only peers that say other hosts can reach them count (their gossiped
    /// reachability: public, relayed or local; every member reads the same): a peer behind
    /// NAT with no relay reservation yet, or one that does not know yet (just started),
    /// would only fail a Prepare. A member that says so of itself trains alone until it
    /// can be reached (the others do not count it either, and it asks nobody).
    pub fn candidates(&self) -> Vec<PeerId> {
        if matches!(
            self.swarm.reachability(),
            Reachability::Unknown | Reachability::Unreachable
        ) {
            return vec![self.me];
        }
        let mut c: Vec<PeerId> = self
            .visible()
            .into_iter()
            .filter(|e| !unreachable_yet(e))
            .filter(|e| !self.shared.is_banned(&e.peer.to_bytes()))
            .filter(|e| !self.shared.is_unlinked(&e.peer.to_bytes()))
            .filter(|e| !self.is_declined(&e.peer))
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

    fn is_declined(&self, p: &PeerId) -> bool {
        lock(&self.declined)
            .get(p)
            .is_some_and(|(_, until)| *until > Instant::now())
    }

    /// The peers the view shows training this model in this group, that this member may
    /// train with by the swarm's trust (this member not included).
    fn visible(&self) -> Vec<crate::swarm::ViewEntry> {
        self.swarm
            .view()
            .into_iter()
            .filter(|e| !e.is_self)
            .filter(|e| {
                e.status.models.iter().any(|m| {
                    m.name == self.cfg.model
                        && m.group
                            .as_ref()
                            .is_some_and(|g| g.name == self.cfg.name && g.mode == self.cfg.mode)
                })
            })
            // Trusting a run: certified to train this model in this group (see
            // `swarm::trust`); a closed swarm: any key holder; an open one: nobody.
            .filter(|e| {
                self.swarm
                    .may_train_with(e, &self.cfg.model, &self.cfg.name)
            })
            .collect()
    }

    /// Candidates visible that are not in `m` (the ring then dissolves to take them in).
    pub fn newcomers(&self, m: &Membership) -> Vec<PeerId> {
        self.candidates()
            .into_iter()
            .filter(|p| !m.members.contains(p))
            .collect()
    }

    /// Says the member is stopping: control requests are refused from now on.
    /// The ballot this member promised last: a wait that sees it change ends (a
    /// proposer wants this member in its next epoch).
    pub fn promised(&self) -> Ballot {
        lock(&self.shared.inner).promised.clone()
    }

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
        self.reduce(m, &mut v, Wire::F32)?;
        self.state_fetched();
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
        let r = self.reduce(m, data, wire)?;
        self.state_fetched();
        Ok(r)
    }

    /// One all-reduce on `m`'s ring. Non-finite values from the left neighbour name it:
    /// logged with its peer id, and this member does not train with it for [`proto::BAN`]
    /// (it is no candidate, its requests and link asks are refused, and a Prepare or
    /// Start naming it is refused).
    fn reduce(
        &self,
        m: &mut Membership,
        data: &mut [f32],
        wire: Wire,
    ) -> Result<RoundStats, GroupError> {
        match m.ring.all_reduce(data, wire) {
            Err(RingError::NonFinite) => {
                let n = m.size();
                let left = m.members[(m.ring.rank + n - 1) % n];
                warn!(
                    group = self.cfg.name,
                    peer = %left,
                    epoch = m.epoch(),
                    "non-finite values arrived from this member: the round fails, and it is not trained with for {} s",
                    proto::BAN.as_secs()
                );
                self.shared.ban(left.to_bytes());
                Err(GroupError::NonFinite(left))
            }
            r => Ok(r?),
        }
    }

    /// A round of the ring completed, so every member built it: a member that fetched
    /// the group's state is done with it, and the snapshot offered goes.
    fn state_fetched(&self) {
        let mut g = lock(&self.shared.inner);
        if g.snapshot.is_some() {
            g.snapshot = None;
        }
    }

    /// The commit round: true when every member stands by this ring (apply the sum).
    /// An error means the outcome is unknown here: keep the sum as pending.
    pub fn commit(&self, m: &mut Membership) -> Result<bool, GroupError> {
        let stands = {
            let g = lock(&self.shared.inner);
            g.promised == m.start.ballot && !g.reform && !g.stopping
        };
        let mut v = [stands as u8 as f32];
        self.reduce(m, &mut v, Wire::F32)?;
        Ok(v[0] as usize == m.size())
    }

    /// The consistency round: do all members hold parameters with `hash`? Each adds its
    /// hash's 32 bytes and their squares; `Σ(x - mine)² = Σx² - 2·mine·Σx + n·mine²` is 0
    /// at every byte exactly when every member's byte equals this one's, so every member
    /// reaches the same verdict (the sums are exact in float32 up to 256 members).
    pub fn hashes_agree(&self, m: &mut Membership, hash: &[u8; 32]) -> Result<bool, GroupError> {
        let mut v: Vec<f32> = hash
            .iter()
            .map(|&b| b as f32)
            .chain(hash.iter().map(|&b| (b as f32) * (b as f32)))
            .collect();
        self.reduce(m, &mut v, Wire::F32)?;
        let n = m.size() as f64;
        Ok(hash.iter().enumerate().all(|(i, &b)| {
            let (x, sum, sq) = (b as f64, v[i] as f64, v[32 + i] as f64);
            sq - 2.0 * x * sum + n * x * x == 0.0
        }))
    }

    /// This member's action in `start`.
    pub fn action_in(&self, start: &Start) -> Option<Action> {
        let me = self.me.to_bytes();
        let i = start.members.iter().position(|p| *p == me)?;
        start.actions.get(i).copied()
    }
}
