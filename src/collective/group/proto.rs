//! The group's control wire, `/agentjet/group/1`: one request and one reply per stream.
//!
//! - [`Request::Prepare`]: a proposer asks a candidate to promise a ballot; the candidate
//!   answers with its [`MemberState`] once it is out of any ring (it leaves its ring at
//!   the next heartbeat), or refuses (it promised a higher ballot, or it is stopping).
//! - [`Request::Start`]: the proposer's decision for a ballot the candidate promised: the
//!   members, the group's step and parameter hash, and what each member does first.
//!
//! The handler only records and answers; the member's training thread acts.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::base::lock;
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{PeerId, Stream, StreamProtocol};

pub const GROUP: StreamProtocol = StreamProtocol::new("/agentjet/group/1");

/// The refusal of a member that is leaving (the proposer leaves it out at once).
pub const STOPPING: &str = "stopping";

/// The largest control frame (a Start names every member; 64 KiB is thousands).
pub(super) const LIMIT: usize = 64 << 10;

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
    /// Every member enters a step round at once, from the gradients held (zeros where
    /// none): the step that failed is retried.
    pub retry: bool,
    /// Candidates left out (no answer, or a state no member can reach): members do not
    /// count them as newcomers until they gossip again.
    pub excluded: Vec<Vec<u8>>,
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
    Chunk(Vec<u8>),
    Refused { reason: String, promised: Ballot },
}

/// What the handler and the member's thread share.
pub(super) struct Shared {
    pub group: String,
    pub inner: Mutex<Inner>,
    /// Signalled on every change of `inner` (the thread waits for a Start, handlers for
    /// the state).
    pub changed: Condvar,
}

#[derive(Default)]
pub(super) struct Inner {
    pub promised: Ballot,
    /// Set while the member is out of any ring (its state cannot change); None in a ring.
    pub state: Option<MemberState>,
    pub start: Option<Start>,
    /// A higher ballot was promised while in a ring: leave it at the next heartbeat.
    pub reform: bool,
    pub stopping: bool,
    /// The state offered to joiners.
    pub snapshot: Option<Arc<Snapshot>>,
}

impl Shared {
    pub fn new(group: String) -> Shared {
        Shared {
            group,
            inner: Mutex::new(Inner::default()),
            changed: Condvar::new(),
        }
    }

    fn refuse(&self, reason: impl Into<String>) -> Reply {
        Reply::Refused {
            reason: reason.into(),
            promised: lock(&self.inner).promised.clone(),
        }
    }

    /// Answers one request (blocking for up to `wait`: run off the async runtime).
    pub fn answer(&self, req: Request, wait: Duration) -> Reply {
        match req {
            Request::Prepare { group, ballot, .. } => {
                if group != self.group {
                    return self.refuse(format!("not a member of group {group:?}"));
                }
                let mut g = lock(&self.inner);
                if g.stopping {
                    drop(g);
                    return self.refuse(STOPPING);
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
                        reason: "still in a round".into(),
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
                let mut g = lock(&self.inner);
                if start.group != self.group || start.ballot != g.promised || g.stopping {
                    drop(g);
                    return self.refuse("not the ballot promised");
                }
                g.start = Some(start);
                self.changed.notify_all();
                Reply::Started
            }
        }
    }
}

/// Serves one control stream.
pub(super) async fn serve_one(
    shared: Arc<Shared>,
    _peer: PeerId,
    mut s: Stream,
    wait: Duration,
) -> Result<(), FrameError> {
    let req: Request = read_frame(&mut s, LIMIT).await?;
    let sh = shared.clone();
    let reply = tokio::task::spawn_blocking(move || sh.answer(req, wait))
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

    fn ballot(epoch: u64, who: u8) -> Ballot {
        Ballot {
            epoch,
            proposer: vec![who],
        }
    }

    #[test]
    fn promises_only_go_up_and_a_state_is_asked_before_it_is_offered() {
        let sh = Shared::new("g".into());
        let ask_manifest = || sh.answer(Request::Manifest { group: "g".into() }, Duration::ZERO);
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
        let st = MemberState {
            steps: 2,
            version: 2,
            hash: [7; 32],
            values: 10,
            pending: false,
            held: false,
        };
        lock(&sh.inner).state = Some(st.clone());
        let prepare = |b: Ballot| {
            sh.answer(
                Request::Prepare {
                    group: "g".into(),
                    ballot: b,
                    members: vec![],
                },
                Duration::from_millis(10),
            )
        };
        assert_eq!(prepare(ballot(3, 1)), Reply::State(st));
        assert!(matches!(prepare(ballot(3, 1)), Reply::Refused { .. }));
        assert!(matches!(prepare(ballot(2, 9)), Reply::Refused { .. }));
        let start = |b: Ballot| Start {
            group: "g".into(),
            ballot: b,
            members: vec![],
            actions: vec![],
            steps: 2,
            hash: [7; 32],
            retry: false,
            excluded: vec![],
        };
        assert!(matches!(
            sh.answer(Request::Start(start(ballot(2, 1))), Duration::ZERO),
            Reply::Refused { .. }
        ));
        assert_eq!(
            sh.answer(Request::Start(start(ballot(3, 1))), Duration::ZERO),
            Reply::Started
        );
        // Another group's requests are refused.
        assert!(matches!(
            sh.answer(Request::Manifest { group: "h".into() }, Duration::ZERO),
            Reply::Refused { .. }
        ));
    }
}
