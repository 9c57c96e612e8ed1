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

mod decline;
mod proto;
mod serve;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use decline::{declined_peer, left_out, Decline};
use proto::{ask, Shared};
pub use proto::{
    Action, AskError, Ballot, MemberState, Reply, Request, Snapshot, Start, StateManifest, GROUP,
    STATE_CHUNK,
};
use serve::{serve_group, Trusted};

use super::link::{self, Conn, LinkError, LinkListener, LinkNet, LinkOffer, TcpLinks};
use super::rendezvous::{
    ask_link, open_link_stream, serve_group_links, LinkAdmit, LinkAsk, OfferBook, RendezvousError,
};
use super::ring::{Ring, RingError, RoundStats, Wire};
use crate::base::lock;
use crate::swarm::{PeerId, Reachability, SwarmError, SwarmHandle};

/// How long a waiting member's dial to a proposer it lost the connection to may take.
const PROBE: Duration = Duration::from_secs(2);

/// How long a direct TCP connection to a neighbour that says it is reachable may take
/// before the link goes over the swarm's connection instead.
const DIRECT_WAIT: Duration = Duration::from_millis(1000);

/// A second failure to reach or link a peer within this declines it (see
/// `GroupNode::unlink`).
const STRIKE_WINDOW: Duration = Duration::from_secs(120);

/// How long after a direct connection to a neighbour failed its links go over the swarm
/// without trying again (a firewall that lets the swarm's port through and not others).
const DIRECT_RETRY: Duration = Duration::from_secs(600);

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
    /// Neighbours a direct TCP connection to failed, and when (see [`DIRECT_RETRY`]).
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

    /// Agrees on the next epoch (blocking; `stopped` is polled): proposes when this member
    /// is the smallest live candidate, else waits for a proposer's Start. `state` is what
    /// this member reports (it cannot change until [`GroupNode::build`]). A Sync member
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

    /// Resolves once this member has promised a ballot other than `ballot` (a newer
    /// epoch is being formed: whatever waits for `ballot` is moot).
    async fn superseded(&self, ballot: &Ballot) {
        loop {
            if lock(&self.shared.inner).promised != *ballot {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// This member's action in `start`.
    pub fn action_in(&self, start: &Start) -> Option<Action> {
        let me = self.me.to_bytes();
        let i = start.members.iter().position(|p| *p == me)?;
        start.actions.get(i).copied()
    }

    /// Offers `bytes` (this member's state at `steps`, parameters `hash`) to joiners
    /// until the next ring is built.
    pub fn offer_state(&self, bytes: Vec<u8>, steps: u64, hash: [u8; 32]) {
        let chunks = bytes
            .chunks(STATE_CHUNK)
            .map(|c| *blake3::hash(c).as_bytes())
            .collect();
        let manifest = StateManifest {
            len: bytes.len() as u64,
            chunk: STATE_CHUNK as u64,
            chunks,
            steps,
            hash,
        };
        lock(&self.shared.inner).snapshot = Some(Arc::new(Snapshot { manifest, bytes }));
    }

    /// Fetches the group's state for `start` from its Ready members, chunks spread over
    /// all of them (a chunk that fails or does not match its blake3 is asked of the next
    /// member). A manifest is used only if it is well-formed and announces at most
    /// `max_len` bytes (nothing is allocated from a peer's word before that). The caller
    /// checks the step and parameter hash of what it installs against `start`'s.
    pub fn fetch_state(&self, start: &Start, max_len: u64) -> Result<Vec<u8>, GroupError> {
        let sources: Vec<PeerId> = start
            .members
            .iter()
            .zip(&start.actions)
            .filter(|(_, a)| **a == Action::Ready)
            .filter_map(|(p, _)| peer_of(p).ok())
            // State only from members this one may train with (see `swarm::trust`).
            .filter(|p| {
                let ok = self
                    .swarm
                    .may_train_with_peer(p, &self.cfg.model, &self.cfg.name);
                if !ok {
                    warn!(group = self.cfg.name, peer = %p, "not fetching the state from a member not trusted to train in this group");
                }
                ok
            })
            .collect();
        if sources.is_empty() {
            return Err(GroupError::Refused(
                "no member to fetch the state from".into(),
            ));
        }
        let ctl = self.control_timeout();
        let group = self.cfg.name.clone();
        self.rt.block_on(async {
            // The members offer their state once their Start arrives: ask until one has.
            let mut manifest = None;
            let deadline = tokio::time::Instant::now() + ctl;
            while manifest.is_none() && tokio::time::Instant::now() < deadline {
                if lock(&self.shared.inner).promised != start.ballot {
                    return Err(GroupError::Refused(
                        "a newer ballot was promised while fetching the state".into(),
                    ));
                }
                for p in &sources {
                    let req = Request::Manifest {
                        group: group.clone(),
                    };
                    match ask(&self.swarm, *p, &req, ctl).await {
                        Ok(Reply::Manifest(m))
                            if m.steps == start.steps && m.hash == start.hash =>
                        {
                            match manifest_fault(&m, max_len) {
                                None => {
                                    manifest = Some(m);
                                    break;
                                }
                                Some(why) => warn!(group, peer = %p, "a bad state manifest: {why}"),
                            }
                        }
                        Ok(other) => debug!(group, peer = %p, "no usable manifest yet: {other:?}"),
                        Err(e) => warn!(group, peer = %p, "no manifest: {e}"),
                    }
                }
                if manifest.is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            let m = manifest.ok_or_else(|| {
                GroupError::Refused("no member offered the group's state".into())
            })?;
            let fetch = |i: usize| {
                let (group, sources, m) = (group.clone(), &sources, &m);
                async move {
                    let want = m.chunks[i];
                    for k in 0..sources.len() {
                        let p = sources[(i + k) % sources.len()];
                        let req = Request::Chunk {
                            group: group.clone(),
                            index: i as u32,
                        };
                        match ask(&self.swarm, p, &req, ctl).await {
                            Ok(Reply::Chunk(b)) if *blake3::hash(&b).as_bytes() == want => {
                                return Ok((i, b))
                            }
                            Ok(Reply::Chunk(_)) => {
                                warn!(group, peer = %p, chunk = i, "a chunk that does not match its hash")
                            }
                            Ok(other) => warn!(group, peer = %p, chunk = i, "{other:?}"),
                            Err(e) => warn!(group, peer = %p, chunk = i, "{e}"),
                        }
                    }
                    Err(GroupError::Refused(format!("no member gave chunk {i} of the state")))
                }
            };
            use futures::StreamExt;
            let mut bytes = vec![0u8; m.len as usize];
            let mut got = futures::stream::iter(0..m.chunks.len())
                .map(fetch)
                .buffer_unordered(4);
            while let Some(r) = got.next().await {
                let (i, b) = r?;
                let at = i * m.chunk as usize;
                if at + b.len() > bytes.len() {
                    return Err(GroupError::Refused(format!("chunk {i} overruns the state")));
                }
                bytes[at..at + b.len()].copy_from_slice(&b);
            }
            Ok(bytes)
        })
    }

    /// Waits for a Start of the ballot promised, polling `stopped` 4 times a second.
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

    /// Sets the ring's links up for `start`: dial the right neighbour, accept the left
    /// one. On an error, agree on the next epoch.
    pub fn build(&self, start: Start) -> Result<Membership, GroupError> {
        let m = self.link_up(start)?;
        {
            let mut g = lock(&self.shared.inner);
            g.state = None;
            g.reform = g.promised != m.start.ballot;
            g.start = None;
            // The snapshot stays until the ring's first round: a member that built its
            // links early (no neighbour of the joiner) still serves the joiner's chunks.
        }
        info!(
            group = self.cfg.name,
            epoch = m.epoch(),
            members = m.size(),
            rank = m.ring.rank,
            "group epoch formed"
        );
        Ok(m)
    }

    /// `peer` could not be linked or reached. The first time (within
    /// [`STRIKE_WINDOW`]) it is only suspected (a candidate again at its next status: a
    /// peer that just became reachable may fail once); the second declines a ring with it
    /// for a decline period, doubled at each decline in a row. Returns that period.
    fn unlink(&self, peer: PeerId) -> Option<Duration> {
        {
            let mut strikes = lock(&self.strikes);
            strikes.retain(|_, at| at.elapsed() < STRIKE_WINDOW);
            if strikes.remove(&peer).is_none() {
                strikes.insert(peer, Instant::now());
                return None;
            }
        }
        let wait = self.decline_with(peer, self.unlink_for());
        self.shared.unlink(peer.to_bytes(), wait);
        Some(wait)
    }

    /// Whether `peer` says it cannot be reached yet (behind NAT with no relay reservation,
    /// or it does not know yet: a peer just started): a Prepare it did not answer leaves
    /// it out until its next gossip only, not for a decline period.
    fn reachable_later(&self, peer: &PeerId) -> bool {
        self.swarm
            .view()
            .iter()
            .any(|e| e.peer == *peer && unreachable_yet(e))
    }

    /// Whether a failed ask means `peer` could not be reached (not a refusal or a bad
    /// answer: those say it is alive).
    fn unreachable(e: &AskError) -> bool {
        matches!(
            e,
            AskError::Timeout(_)
                | AskError::Swarm(SwarmError::Unreachable { .. } | SwarmError::Timeout(_))
        )
    }

    /// The byte stream of a link to `peer`'s `offer`: a direct TCP connection where it
    /// says it is reachable (within [`DIRECT_WAIT`], and not after one failed within
    /// [`DIRECT_RETRY`]), else a stream over the swarm's connection.
    async fn connect_link(
        &self,
        peer: PeerId,
        group: &str,
        addrs: Vec<crate::swarm::Multiaddr>,
        offer: &LinkOffer,
    ) -> Result<Conn, GroupError> {
        let failed_lately = lock(&self.direct_failed)
            .get(&peer)
            .is_some_and(|at| at.elapsed() < DIRECT_RETRY);
        let direct = offer.direct || self.links.routes_itself();
        if self.cfg.direct_links && direct && !failed_lately && !addrs.is_empty() {
            let (links, port) = (self.links.clone(), offer.port);
            let tried =
                tokio::task::spawn_blocking(move || links.connect(&addrs, port, DIRECT_WAIT)).await;
            match tried {
                Ok(Ok(conn)) => return Ok(conn),
                Ok(Err(e)) => {
                    info!(
                        group = self.cfg.name,
                        %peer,
                        "no direct link connection ({e}): the link runs over the swarm's connection"
                    );
                    lock(&self.direct_failed).insert(peer, Instant::now());
                }
                Err(_) => return Err(GroupError::Refused("the dialing thread panicked".into())),
            }
        }
        Ok(open_link_stream(&self.swarm, peer, group).await?)
    }

    fn link_up(&self, start: Start) -> Result<Membership, GroupError> {
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
        let group = mine.group.clone();
        let (dialed, accepted) = self.rt.block_on(async {
            let dial = async {
                // The link bound: a neighbour this member cannot ask and connect to within
                // it is declined. (Its hello may come later: a neighbour that fetches the
                // group's state accepts once it has it; that failure declines nobody.)
                let connect = async {
                    let (addrs, offer) = ask_link(&self.swarm, right, &mine).await?;
                    let conn = self.connect_link(right, &group, addrs, &offer).await?;
                    Ok::<_, GroupError>((conn, offer))
                };
                let (conn, offer) = match tokio::time::timeout(ctl, connect).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        return Err(GroupError::Unlinked {
                            peer: right,
                            reason: e.to_string(),
                        })
                    }
                    Err(_) => {
                        return Err(GroupError::Unlinked {
                            peer: right,
                            reason: format!("no connection within {} s", ctl.as_secs_f64()),
                        })
                    }
                };
                tokio::task::spawn_blocking(move || link::handshake(conn, &offer, ctl))
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
            let both = async { tokio::join!(dial, accept) };
            tokio::select! {
                r = both => Ok(r),
                _ = self.superseded(&start.ballot) => Err(GroupError::Refused(
                    "a newer ballot was promised while building the ring".into(),
                )),
            }
        })?;
        let (tx, _) = match dialed {
            Ok(link) => link,
            Err(e @ GroupError::Unlinked { .. }) => {
                match self.unlink(right) {
                    Some(wait) => warn!(
                        group = self.cfg.name,
                        peer = %right,
                        epoch,
                        wait_s = wait.as_secs(),
                        "declining a ring with the right neighbour for a while: {e}"
                    ),
                    None => warn!(
                        group = self.cfg.name,
                        peer = %right,
                        epoch,
                        "could not link with the right neighbour (once: tried again): {e}"
                    ),
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        };
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

/// Why a peer's state manifest cannot be used (None: it can): its chunking must be ours,
/// its chunk list must cover exactly its length, and the length must be at most `max_len`.
fn manifest_fault(m: &StateManifest, max_len: u64) -> Option<String> {
    if m.len > max_len {
        return Some(format!(
            "{} bytes announced, at most {max_len} expected",
            m.len
        ));
    }
    if m.chunk != STATE_CHUNK as u64 {
        return Some(format!("chunks of {} bytes, not {STATE_CHUNK}", m.chunk));
    }
    let want = m.len.div_ceil(m.chunk).max(1);
    if m.chunks.len() as u64 != want {
        return Some(format!(
            "{} chunk hashes for {} bytes ({want} chunks)",
            m.chunks.len(),
            m.len
        ));
    }
    None
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
