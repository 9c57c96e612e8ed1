//! The group's control wire, `/agentjet/group/2`: one request and one reply per stream.
//!
//! - [`Request::Prepare`]: a proposer asks a candidate to promise a ballot; the candidate
//!   answers with its [`MemberState`] once it is out of any ring (it leaves its ring at
//!   the next heartbeat) and not fetching the group's state, or refuses (it promised a
//!   higher ballot, or it is stopping).
//! - [`Request::Start`]: the proposer's decision for a ballot the candidate promised: the
//!   members, the group's step and parameter hash, and what each member does first.
//!
//! The handler only records and answers; the member's training thread acts.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use tracing::warn;

use crate::base::lock;
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{PeerId, Stream, StreamProtocol};

pub const GROUP: StreamProtocol = StreamProtocol::new("/agentjet/group/2");

/// The refusal of a member that is leaving (the proposer leaves it out at once).
pub const STOPPING: &str = "stopping";

/// The largest control frame (a Start names every member; 64 KiB is thousands).
pub(super) const LIMIT: usize = 64 << 10;

/// The highest epoch a ballot may carry: a peer's ballot above it is refused, so `epoch
/// + 1` never overflows (a group forming an epoch a millisecond would take 8,900 years).
pub const MAX_EPOCH: u64 = 1 << 48;

/// How far above the ballot it promised a member accepts a new ballot's epoch (honest
/// proposers go one above what they saw): a peer cannot drive the epochs to the bound in
/// one message and so stop the group.
pub const MAX_EPOCH_STEP: u64 = 1 << 20;

/// The most members (or excluded candidates) one Start may name.
pub const MAX_MEMBERS: usize = 1024;

/// A proposal's number: epochs first, then the proposer's peer id breaks ties, so two
/// proposers never share a ballot.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Ballot {
    pub epoch: u64,
    pub proposer: Vec<u8>,
}

/// What a member tells a proposer about itself (at a step boundary, out of any ring).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberState {
    /// Optimizer steps applied (the trainer's step count).
    pub steps: u64,
    pub version: u64,
    /// blake3 of the parameters' bytes.
    pub hash: [u8; 32],
    /// Parameter values (a member of another shape can never join).
    pub values: u64,
    /// It holds the group's summed gradient of step `steps + 1` from a round whose commit
    /// it did not see finish: it applies it if any member did.
    pub pending: bool,
    /// It holds its own gradient of step `steps + 1` (a step that failed): the step is
    /// retried from it.
    pub held: bool,
}

/// What one member does first in a new epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Nothing to catch up.
    Ready,
    /// Apply the summed gradient it holds (another member applied that step).
    ApplyPending,
    /// Fetch the group's state (parameters, optimizer, counters) from the members that
    /// are `Ready`, before the ring is built: a joiner, or a member whose parameters
    /// differ from the group's.
    Sync,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Start {
    pub group: String,
    pub ballot: Ballot,
    /// Peer ids (bytes), sorted: the ring's order.
    pub members: Vec<Vec<u8>>,
    /// One per member.
    pub actions: Vec<Action>,
    /// The group's step count and parameter hash once the actions are done.
    pub steps: u64,
    pub hash: [u8; 32],
    /// How many parameter values the group's model has: a candidate with another count
    /// is excluded (another shape); one with this count is excluded only if declined.
    pub values: u64,
    /// Every member enters a step round at once, from the gradients held (zeros where
    /// none): the step that failed is retried.
    pub retry: bool,
    /// Candidates left out (no answer, or a state no member can reach): members do not
    /// count them as newcomers until they gossip again.
    pub excluded: Vec<Vec<u8>>,
    /// Of those, the ones the proposer does not train with for a while (they declined a
    /// ring, or sent it non-finite values): every member leaves them out as long, so no
    /// member dissolves the ring to take them in.
    pub declined: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    Prepare {
        group: String,
        ballot: Ballot,
        members: Vec<Vec<u8>>,
    },
    Start(Start),
    /// The state this member offers to joiners (while it is out of any ring).
    Manifest {
        group: String,
    },
    /// Chunk `index` of that state.
    Chunk {
        group: String,
        index: u32,
    },
}

/// A peer id's text from its bytes ("?" if they are not one).
pub(super) fn peer_name(b: &[u8]) -> String {
    PeerId::from_bytes(b).map_or_else(|_| "?".into(), |p| p.to_string())
}

impl Request {
    /// The group it is for.
    pub fn group(&self) -> &str {
        match self {
            Request::Prepare { group, .. }
            | Request::Manifest { group }
            | Request::Chunk { group, .. } => group,
            Request::Start(s) => &s.group,
        }
    }

    /// Its name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Prepare { .. } => "prepare",
            Request::Start(_) => "start",
            Request::Manifest { .. } => "manifest",
            Request::Chunk { .. } => "chunk",
        }
    }
}

/// A member's state as content-addressed chunks: a joiner fetches them from several
/// members at once and checks each against its blake3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateManifest {
    pub len: u64,
    /// Bytes per chunk (the last one may be shorter).
    pub chunk: u64,
    pub chunks: Vec<[u8; 32]>,
    /// The step count and parameter hash the state holds.
    pub steps: u64,
    pub hash: [u8; 32],
}

/// A state offered: its manifest and bytes.
pub struct Snapshot {
    pub manifest: StateManifest,
    pub bytes: Vec<u8>,
}

/// Bytes per state chunk (under the swarm's 16 MiB frame limit).
pub const STATE_CHUNK: usize = 8 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    State(MemberState),
    Started,
    Manifest(StateManifest),
    Chunk(#[serde(with = "crate::base::bytes")] Vec<u8>),
    Refused { reason: String, promised: Ballot },
}

/// What the handler and the member's thread share.
pub(super) struct Shared {
    pub group: String,
    /// This member's peer id (bytes).
    pub me: Vec<u8>,
    pub inner: Mutex<Inner>,
    /// Signalled on every change of `inner` (the thread waits for a Start, handlers for
    /// the state).
    pub changed: Condvar,
    /// Members that sent this one non-finite values, and when: for [`BAN`] it does not
    /// train with them (no candidate, no ring, no request answered).
    pub banned: Mutex<HashMap<Vec<u8>, Instant>>,
    /// Members this one could not link with or reach (a link or a prepare that failed
    /// within the bound), and until when it declines a ring with them.
    pub unlinked: Mutex<HashMap<Vec<u8>, Instant>>,
    /// Peers this member leaves out for a while, whoever decided it (a Start's decline,
    /// its own), and until when: it promises no ballot they propose.
    pub declined: Mutex<HashMap<Vec<u8>, Instant>>,
}

/// How a member's refusal starts when a Prepare or Start names a member it does not train
/// with (the proposer then leaves the refuser out for a while, see `GroupNode`).
pub const DECLINES: &str = "declines a ring with";

/// How a member's refusal of a Prepare starts when it leaves the proposer itself out for
/// a while (a Start's decline): no accusation, the proposer waits instead.
pub const LEAVES_OUT: &str = "leaves out the proposer for a while";

/// How long a member that sent non-finite values is not trained with.
pub const BAN: Duration = Duration::from_secs(600);

#[derive(Default)]
pub(super) struct Inner {
    pub promised: Ballot,
    /// Set while the member is out of any ring (its state cannot change); None in a ring
    /// and while it fetches the group's state (a prepare waits for the state it will have).
    pub state: Option<MemberState>,
    pub start: Option<Start>,
    /// A higher ballot was promised while in a ring: leave it at the next heartbeat.
    pub reform: bool,
    pub stopping: bool,
    /// The state offered to joiners.
    pub snapshot: Option<Arc<Snapshot>>,
}

impl Shared {
    pub fn new(group: String, me: Vec<u8>) -> Shared {
        Shared {
            group,
            me,
            inner: Mutex::new(Inner::default()),
            changed: Condvar::new(),
            banned: Mutex::new(HashMap::new()),
            unlinked: Mutex::new(HashMap::new()),
            declined: Mutex::new(HashMap::new()),
        }
    }

    /// Declines a ring with `peer` (id bytes) for `wait`: this member could not link with
    /// it or reach it.
    pub fn unlink(&self, peer: Vec<u8>, wait: Duration) {
        lock(&self.unlinked).insert(peer, Instant::now() + wait);
    }

    /// Whether this member declines a ring with `peer` (id bytes) now, as one it could not
    /// link with or reach.
    pub fn is_unlinked(&self, peer: &[u8]) -> bool {
        let mut u = lock(&self.unlinked);
        u.retain(|_, until| *until > Instant::now());
        u.contains_key(peer)
    }

    /// Leaves `peer` (id bytes) out for `wait`: no ballot it proposes is promised.
    pub fn decline(&self, peer: Vec<u8>, wait: Duration) {
        if peer != self.me {
            lock(&self.declined).insert(peer, Instant::now() + wait);
        }
    }

    fn is_declined(&self, peer: &[u8]) -> bool {
        let mut d = lock(&self.declined);
        d.retain(|_, until| *until > Instant::now());
        d.contains_key(peer)
    }

    /// Why this member declines a ring of `members` (a member that sent it non-finite
    /// values, or one it could not link with), if it does.
    fn declines_among(&self, members: &[Vec<u8>]) -> Option<String> {
        if let Some(b) = self.banned_among(members) {
            return Some(format!(
                "{DECLINES} {}, which sent this member non-finite values",
                peer_name(b)
            ));
        }
        members.iter().find(|m| self.is_unlinked(m)).map(|b| {
            format!(
                "{DECLINES} {}, which this member could not link with or reach",
                peer_name(b)
            )
        })
    }

    /// Whether `peer` (id bytes) sent this member non-finite values within [`BAN`].
    pub fn is_banned(&self, peer: &[u8]) -> bool {
        let mut b = lock(&self.banned);
        b.retain(|_, at| at.elapsed() < BAN);
        b.contains_key(peer)
    }

    pub fn ban(&self, peer: Vec<u8>) {
        lock(&self.banned).insert(peer, Instant::now());
    }

    /// The first of `members` this member does not train with, if any.
    fn banned_among<'a>(&self, members: &'a [Vec<u8>]) -> Option<&'a [u8]> {
        members
            .iter()
            .find(|m| self.is_banned(m))
            .map(|m| m.as_slice())
    }

    fn refuse(&self, reason: impl Into<String>) -> Reply {
        Reply::Refused {
            reason: reason.into(),
            promised: lock(&self.inner).promised.clone(),
        }
    }

    /// A refusal of a malformed or forged request, logged with the sender's id.
    fn reject(&self, from: &[u8], why: String) -> Reply {
        let peer = peer_name(from);
        warn!(group = self.group, %peer, "refused a group message: {why}");
        self.refuse(why)
    }

    /// Answers one request from peer `from` (its id's bytes; blocking for up to `wait`:
    /// run off the async runtime). Requests that are not the sender's to make (a ballot or
    /// Start of another proposer) or are malformed are refused and logged.
    pub fn answer(&self, from: &[u8], req: Request, wait: Duration) -> Reply {
        match req {
            Request::Prepare {
                group,
                ballot,
                members,
            } => {
                if group != self.group {
                    return self.refuse(format!("not a member of group {group:?}"));
                }
                if ballot.proposer != from {
                    return self.reject(from, "a ballot whose proposer is not its sender".into());
                }
                if ballot.epoch >= MAX_EPOCH {
                    return self.reject(from, format!("epoch {} is above the bound", ballot.epoch));
                }
                if members.len() > MAX_MEMBERS
                    || !members.contains(&self.me)
                    || !members.iter().any(|m| m == from)
                {
                    return self.reject(
                        from,
                        format!(
                            "a prepare for {} candidates that leaves out this member or its proposer",
                            members.len()
                        ),
                    );
                }
                if let Some(why) = self.declines_among(&members) {
                    return self.refuse(why);
                }
                // A proposer this member leaves out (it could not be reached or linked by
                // a member, or sent non-finite values) does not pull it out of its ring:
                // two proposers would take it in turns.
                if self.is_declined(from) {
                    return self.refuse(LEAVES_OUT);
                }
                let mut g = lock(&self.inner);
                if g.stopping {
                    drop(g);
                    return self.refuse(STOPPING);
                }
                if ballot.epoch > g.promised.epoch.saturating_add(MAX_EPOCH_STEP) {
                    let promised = g.promised.epoch;
                    drop(g);
                    return self.reject(
                        from,
                        format!(
                            "epoch {} jumps more than {MAX_EPOCH_STEP} above the promised {promised}",
                            ballot.epoch
                        ),
                    );
                }
                if ballot <= g.promised {
                    drop(g);
                    return self.refuse("promised an equal or higher ballot");
                }
                g.promised = ballot.clone();
                g.start = None;
                g.reform = true;
                self.changed.notify_all();
                // Wait until the member is out of its ring (the next heartbeat).
                let (g, _) = self
                    .changed
                    .wait_timeout_while(g, wait, |g| {
                        g.state.is_none() && g.promised == ballot && !g.stopping
                    })
                    .unwrap_or_else(|e| e.into_inner());
                match (&g.state, g.promised == ballot) {
                    (Some(st), true) => Reply::State(st.clone()),
                    (_, false) => Reply::Refused {
                        reason: "promised a higher ballot meanwhile".into(),
                        promised: g.promised.clone(),
                    },
                    (None, true) => Reply::Refused {
                        reason: "still in a round, or fetching the group's state".into(),
                        promised: g.promised.clone(),
                    },
                }
            }
            Request::Manifest { group } => {
                // (The guard must be gone before `refuse` locks again.)
                let snap = lock(&self.inner).snapshot.clone();
                match snap {
                    Some(s) if group == self.group => Reply::Manifest(s.manifest.clone()),
                    _ => self.refuse("no state offered"),
                }
            }
            Request::Chunk { group, index } => {
                let snap = lock(&self.inner).snapshot.clone();
                match snap {
                    Some(s) if group == self.group => {
                        let at = index as usize * s.manifest.chunk as usize;
                        if at >= s.bytes.len() && !(at == 0 && s.bytes.is_empty()) {
                            return self.refuse(format!("no chunk {index}"));
                        }
                        let end = (at + s.manifest.chunk as usize).min(s.bytes.len());
                        Reply::Chunk(s.bytes[at..end].to_vec())
                    }
                    _ => self.refuse("no state offered"),
                }
            }
            Request::Start(start) => {
                if start.ballot.proposer != from {
                    return self.reject(from, "a start whose proposer is not its sender".into());
                }
                if let Some(why) = self.declines_among(&start.members) {
                    return self.refuse(why);
                }
                let mut g = lock(&self.inner);
                if start.group != self.group || start.ballot != g.promised || g.stopping {
                    drop(g);
                    return self.refuse("not the ballot promised");
                }
                if let Err(why) = start_fault(&start, &self.me, g.state.as_ref()) {
                    drop(g);
                    return self.reject(from, why);
                }
                g.start = Some(start);
                self.changed.notify_all();
                Reply::Started
            }
        }
    }
}

/// Why `start` cannot be this member's next epoch (`me`; `state`: what it reported to the
/// proposer): members sorted and unique, one action each, bounded lists, and for this
/// member an action its state allows (Ready only at the group's step and hash,
/// ApplyPending only with a pending sum of the next step, never a step behind its own).
pub(super) fn start_fault(
    start: &Start,
    me: &[u8],
    state: Option<&MemberState>,
) -> Result<(), String> {
    let n = start.members.len();
    if n == 0
        || n > MAX_MEMBERS
        || start.excluded.len() > MAX_MEMBERS
        || start.declined.len() > MAX_MEMBERS
    {
        return Err(format!(
            "a start of {n} members and {} excluded",
            start.excluded.len()
        ));
    }
    if let Some(d) = start.declined.iter().find(|d| !start.excluded.contains(d)) {
        return Err(format!("{} declined but not excluded", peer_name(d)));
    }
    if start.actions.len() != n {
        return Err(format!("{} actions for {n} members", start.actions.len()));
    }
    if start.members.windows(2).any(|w| w[0] >= w[1]) {
        return Err("members not sorted or repeated".into());
    }
    if let Some(bad) = start
        .members
        .iter()
        .chain(&start.excluded)
        .find(|p| PeerId::from_bytes(p).is_err())
    {
        return Err(format!(
            "a member id of {} bytes that is no peer id",
            bad.len()
        ));
    }
    if !start.members.contains(&start.ballot.proposer) {
        return Err("a start that leaves out its proposer".into());
    }
    let Some(i) = start.members.iter().position(|p| p == me) else {
        // Left out: the proposer must say so, and why: declined (for a while), or of
        // another shape (checked against its own count; the member asks again later).
        if !start.excluded.iter().any(|p| p == me) {
            return Err("a start that neither lists nor excludes this member".into());
        }
        if start.declined.iter().any(|p| p == me) {
            return Ok(());
        }
        return match state {
            Some(st) if st.values == start.values => Err(format!(
                "a start that excludes this member as of another shape, but its {} \
                 parameter values are the group's",
                st.values
            )),
            Some(_) => Ok(()),
            None => Err(
                "a start that excludes this member as of another shape while it \
                 reported no state"
                    .into(),
            ),
        };
    };
    let Some(st) = state else {
        return Err("a start for a member in a round".into());
    };
    if start.steps < st.steps {
        return Err(format!(
            "the group's step {} is behind this member's {}",
            start.steps, st.steps
        ));
    }
    match start.actions[i] {
        Action::Ready if start.steps != st.steps || start.hash != st.hash => Err(format!(
            "ready at step {}, but this member is at step {} with other parameters or steps",
            start.steps, st.steps
        )),
        Action::ApplyPending if !st.pending || st.steps.checked_add(1) != Some(start.steps) => {
            Err(format!(
                "apply a pending sum of step {}: this member holds none for it (at step {})",
                start.steps, st.steps
            ))
        }
        _ => Ok(()),
    }
}

/// Serves one control stream; a stream that is not one request of ours is dropped and
/// logged with the sender's id.
pub(super) async fn serve_one(
    shared: Arc<Shared>,
    peer: PeerId,
    mut s: Stream,
    req: Request,
    wait: Duration,
    trusted: bool,
) -> Result<(), FrameError> {
    if !trusted {
        // Not a peer this member may train with (see `swarm::trust`): nothing it sends
        // is looked at.
        warn!(
            group = shared.group,
            %peer,
            request = req.kind(),
            "refused a group request from a peer not trusted to train in this group"
        );
        // In the form a proposer recognises: it leaves this member out for a while
        // instead of proposing to it again at once.
        let reply = Reply::Refused {
            reason: format!(
                "{DECLINES} {peer}: not trusted to train in this group (not certified for it, \
                 or it sent this member non-finite values)"
            ),
            promised: Ballot::default(),
        };
        write_frame(&mut s, &reply, LIMIT).await?;
        let _ = futures::io::AsyncWriteExt::close(&mut s).await;
        return Ok(());
    }
    let sh = shared.clone();
    let from = peer.to_bytes();
    let reply = tokio::task::spawn_blocking(move || sh.answer(&from, req, wait))
        .await
        .unwrap_or_else(|_| Reply::Refused {
            reason: "the handler panicked".into(),
            promised: Ballot::default(),
        });
    write_frame(&mut s, &reply, STATE_CHUNK + 1024).await?;
    let _ = futures::io::AsyncWriteExt::close(&mut s).await;
    Ok(())
}

/// Sends one request and reads its reply, within `timeout`.
pub(super) async fn ask(
    swarm: &crate::swarm::SwarmHandle,
    peer: PeerId,
    req: &Request,
    timeout: Duration,
) -> Result<Reply, AskError> {
    let limit = match req {
        Request::Chunk { .. } => STATE_CHUNK + 1024,
        _ => LIMIT,
    };
    let go = async {
        let mut s = swarm.open(peer, GROUP).await?;
        write_frame(&mut s, req, LIMIT).await?;
        Ok(read_frame::<_, Reply>(&mut s, limit).await?)
    };
    tokio::time::timeout(timeout, go)
        .await
        .unwrap_or(Err(AskError::Timeout(timeout)))
}

/// Why a control request got no reply.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error(transparent)]
    Swarm(#[from] crate::swarm::SwarmError),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three peers' ids, sorted: the member under test is `ids[1]`.
    fn ids() -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = (0..3).map(|_| PeerId::random().to_bytes()).collect();
        v.sort();
        v
    }

    fn ballot(epoch: u64, who: &[u8]) -> Ballot {
        Ballot {
            epoch,
            proposer: who.to_vec(),
        }
    }

    fn state(steps: u64, pending: bool) -> MemberState {
        MemberState {
            steps,
            version: steps,
            hash: [7; 32],
            values: 10,
            pending,
            held: false,
        }
    }

    #[test]
    fn promises_only_go_up_and_a_state_is_asked_before_it_is_offered() {
        let id = ids();
        let (a, me, c) = (&id[0], &id[1], &id[2]);
        let sh = Shared::new("g".into(), me.clone());
        let ask_manifest = || sh.answer(a, Request::Manifest { group: "g".into() }, Duration::ZERO);
        // Nothing offered yet: refused (and the lock released: asking again answers).
        assert!(matches!(ask_manifest(), Reply::Refused { .. }));
        assert!(matches!(ask_manifest(), Reply::Refused { .. }));
        lock(&sh.inner).snapshot = Some(Arc::new(Snapshot {
            manifest: StateManifest {
                len: 3,
                chunk: STATE_CHUNK as u64,
                chunks: vec![*blake3::hash(b"abc").as_bytes()],
                steps: 2,
                hash: [7; 32],
            },
            bytes: b"abc".to_vec(),
        }));
        assert!(matches!(ask_manifest(), Reply::Manifest(m) if m.steps == 2));
        let chunk = |index| {
            sh.answer(
                a,
                Request::Chunk {
                    group: "g".into(),
                    index,
                },
                Duration::ZERO,
            )
        };
        assert_eq!(chunk(0), Reply::Chunk(b"abc".to_vec()));
        assert!(matches!(chunk(1), Reply::Refused { .. }));
        // A member out of any ring answers a prepare with its state; a lower or equal
        // ballot is refused; a Start counts only for the ballot promised.
        let st = state(2, false);
        lock(&sh.inner).state = Some(st.clone());
        let prepare = |b: Ballot| {
            let from = b.proposer.clone();
            sh.answer(
                &from,
                Request::Prepare {
                    group: "g".into(),
                    ballot: b,
                    members: id.clone(),
                },
                Duration::from_millis(10),
            )
        };
        assert_eq!(prepare(ballot(3, a)), Reply::State(st));
        assert!(matches!(prepare(ballot(3, a)), Reply::Refused { .. }));
        assert!(matches!(prepare(ballot(2, c)), Reply::Refused { .. }));
        let start = |b: Ballot| Start {
            group: "g".into(),
            ballot: b,
            members: id.clone(),
            actions: vec![Action::Ready; 3],
            steps: 2,
            hash: [7; 32],
            values: 10,
            retry: false,
            excluded: vec![],
            declined: vec![],
        };
        assert!(matches!(
            sh.answer(a, Request::Start(start(ballot(2, a))), Duration::ZERO),
            Reply::Refused { .. }
        ));
        assert_eq!(
            sh.answer(a, Request::Start(start(ballot(3, a))), Duration::ZERO),
            Reply::Started
        );
        // Another group's requests are refused.
        assert!(matches!(
            sh.answer(a, Request::Manifest { group: "h".into() }, Duration::ZERO),
            Reply::Refused { .. }
        ));
    }

    type Edit = Box<dyn Fn(&mut Start)>;

    /// What a rogue peer sends: ballots and Starts in another's name, an epoch at the
    /// bound, an empty or short actions list, unsorted members, a Start that would send
    /// this member back or have it "apply" a sum it does not hold. Each is refused, and
    /// none changes what the member promised or will act on.
    #[test]
    fn forged_and_malformed_prepares_and_starts_are_refused_and_change_nothing() {
        let id = ids();
        let (a, me, rogue) = (&id[0], &id[1], &id[2]);
        let sh = Shared::new("g".into(), me.clone());
        lock(&sh.inner).state = Some(state(5, false));
        let prepare = |from: &[u8], b: Ballot, members: Vec<Vec<u8>>| {
            sh.answer(
                from,
                Request::Prepare {
                    group: "g".into(),
                    ballot: b,
                    members,
                },
                Duration::from_millis(10),
            )
        };
        let refused = |r: Reply| matches!(r, Reply::Refused { .. });
        // In another's name, at the bound, or leaving out the member or the proposer.
        assert!(refused(prepare(rogue, ballot(9, a), id.clone())));
        assert!(refused(prepare(rogue, ballot(u64::MAX, rogue), id.clone())));
        assert!(refused(prepare(
            rogue,
            ballot(MAX_EPOCH, rogue),
            id.clone()
        )));
        assert!(refused(prepare(
            rogue,
            ballot(MAX_EPOCH - 1, rogue),
            id.clone()
        )));
        assert!(refused(prepare(
            rogue,
            ballot(MAX_EPOCH_STEP + 1, rogue),
            id.clone()
        )));
        assert!(refused(prepare(
            rogue,
            ballot(9, rogue),
            vec![rogue.clone()]
        )));
        assert!(refused(prepare(rogue, ballot(9, rogue), vec![me.clone()])));
        assert_eq!(lock(&sh.inner).promised, Ballot::default());
        assert!(!lock(&sh.inner).reform);
        // The honest proposer's ballot is promised.
        assert!(matches!(
            prepare(a, ballot(4, a), id.clone()),
            Reply::State(_)
        ));
        let good = Start {
            group: "g".into(),
            ballot: ballot(4, a),
            members: id.clone(),
            actions: vec![Action::Ready; 3],
            steps: 5,
            hash: [7; 32],
            values: 10,
            retry: false,
            excluded: vec![],
            declined: vec![],
        };
        let start = |from: &[u8], f: &dyn Fn(&mut Start)| {
            let mut s = good.clone();
            f(&mut s);
            sh.answer(from, Request::Start(s), Duration::ZERO)
        };
        let a = a.as_slice();
        let bad: Vec<(&str, &[u8], Edit)> = vec![
            (
                "the rogue sends it",
                rogue.as_slice(),
                Box::new(|_: &mut Start| {}),
            ),
            ("no actions", a, Box::new(|s: &mut Start| s.actions.clear())),
            (
                "no members",
                a,
                Box::new(|s: &mut Start| {
                    s.members.clear();
                    s.actions.clear();
                }),
            ),
            (
                "unsorted",
                a,
                Box::new(|s: &mut Start| s.members.swap(0, 2)),
            ),
            (
                "repeated",
                a,
                Box::new(|s: &mut Start| s.members[2] = s.members[1].clone()),
            ),
            (
                "a member id that is no peer id",
                a,
                Box::new(|s: &mut Start| s.members[2] = vec![0xff; 3]),
            ),
            (
                "a wrong step for a ready member",
                a,
                Box::new(|s: &mut Start| s.steps = 6),
            ),
            (
                "a wrong hash for a ready member",
                a,
                Box::new(|s: &mut Start| s.hash = [8; 32]),
            ),
            (
                "a step behind",
                a,
                Box::new(|s: &mut Start| {
                    s.steps = 4;
                    s.actions[1] = Action::Sync;
                }),
            ),
            (
                "a pending sum it does not hold",
                a,
                Box::new(|s: &mut Start| {
                    s.steps = 6;
                    s.actions[1] = Action::ApplyPending;
                }),
            ),
            (
                "a two-member start at a wrong step",
                a,
                Box::new(|s: &mut Start| {
                    s.members = vec![s.members[0].clone(), s.members[1].clone()];
                    s.actions = vec![Action::Ready; 2];
                    s.steps = 7;
                }),
            ),
            (
                "a one-member start of this member alone at a wrong step",
                a,
                Box::new(|s: &mut Start| {
                    s.members = vec![s.members[1].clone()];
                    s.actions = vec![Action::Ready];
                    s.steps = 7;
                }),
            ),
            (
                "a start that leaves this member out without excluding it",
                a,
                Box::new(|s: &mut Start| {
                    s.members = vec![s.members[0].clone()];
                    s.actions = vec![Action::Ready];
                }),
            ),
            (
                "excluded as of another shape, with the group's shape",
                a,
                Box::new(|s: &mut Start| {
                    s.excluded = vec![s.members[1].clone()];
                    s.members = vec![s.members[0].clone(), s.members[2].clone()];
                    s.actions = vec![Action::Ready; 2];
                }),
            ),
            (
                "declined without being excluded",
                a,
                Box::new(|s: &mut Start| s.declined = vec![s.members[2].clone()]),
            ),
            (
                "too many excluded",
                a,
                Box::new(|s: &mut Start| s.excluded = vec![s.members[0].clone(); MAX_MEMBERS + 1]),
            ),
        ];
        for (what, from, f) in bad.iter() {
            let from: &[u8] = from;
            assert!(refused(start(from, f.as_ref())), "{what}: accepted");
            assert!(lock(&sh.inner).start.is_none(), "{what}: recorded");
        }
        assert_eq!(lock(&sh.inner).promised, ballot(4, a));
        // Left out and declined (for a while), or left out with another shape: well-formed.
        let mut out = good.clone();
        out.excluded = vec![me.clone()];
        out.members = vec![id[0].clone(), id[2].clone()];
        out.actions = vec![Action::Ready; 2];
        let mut declined = out.clone();
        declined.declined = vec![me.clone()];
        let st = state(5, false);
        assert_eq!(start_fault(&declined, me, Some(&st)), Ok(()));
        let mut other_shape = out.clone();
        other_shape.values = 11;
        assert_eq!(start_fault(&other_shape, me, Some(&st)), Ok(()));
        assert!(start_fault(&out, me, Some(&st)).is_err());
        // Another shape said of a member that reported no state: no proof of either.
        assert!(start_fault(&other_shape, me, None).is_err());
        assert_eq!(start_fault(&declined, me, None), Ok(()));
        assert_eq!(start(a, &|_| {}), Reply::Started);
    }
}
