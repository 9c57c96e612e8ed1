//! What a member loop tells its owner, as it happens: the server prints some of these and
//! gossips its status from them, netsim counts them, tests wait on them.

use crate::base::StopMode;
use crate::collective::group::Action;
use crate::collective::RoundStats;
use crate::swarm::GroupStatus;

/// Why a member fetches the group's state.
#[derive(Debug, Clone, PartialEq)]
pub enum SyncReason {
    /// It is at group step `at`, behind the group's.
    Behind { at: u64 },
    /// At the group's step, its parameters differ from the majority's.
    Differs { mine: [u8; 32], group: [u8; 32] },
}

/// One thing the loop did.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberEvent {
    /// What to gossip as this member's group status (epoch 0 while forming).
    Status(GroupStatus),
    /// An epoch was agreed (its ring not built yet).
    Agreed {
        epoch: u64,
        members: usize,
        steps: u64,
        action: Action,
    },
    /// Fetching the group's state of group step `steps`.
    Syncing {
        steps: u64,
        reason: SyncReason,
    },
    /// Installed the group's state.
    Synced {
        steps: u64,
        version: u64,
        bytes: usize,
        seconds: f64,
    },
    /// Offers its state to the members that sync.
    Offered {
        steps: u64,
        bytes: usize,
    },
    /// The state transfer failed: the next epoch is formed.
    TransferFailed {
        error: String,
    },
    /// The ring could not be built: the next epoch is formed.
    BuildFailed {
        error: String,
    },
    /// Applied the sum another member applied (its commit was not seen here).
    AppliedPending {
        steps: u64,
    },
    /// No member applied the last step: the pending sum is dropped.
    DroppedPending,
    /// The epoch's ring stands, catch-up done.
    Formed {
        epoch: u64,
        members: usize,
        rank: usize,
        steps: u64,
        version: u64,
        hash: [u8; 32],
        retry: bool,
    },
    /// A heartbeat round.
    Beat {
        ready: f64,
        dissolve: bool,
        seconds: f64,
    },
    /// A group step's rounds start (a synchronous or an outer step), `step` the one to be.
    StepStarted {
        step: u64,
        members: usize,
        retried: bool,
    },
    /// A value round completed.
    ValueRound {
        round: RoundStats,
        values: usize,
        members: usize,
    },
    /// This member's own gradient (or DiLoCo delta) of group step `step` held a NaN or
    /// an infinity: it contributed zeros instead.
    NonFinite {
        step: u64,
    },
    /// A member did not commit: the step is retried.
    NotCommitted {
        step: u64,
    },
    /// A group step was applied (`contributors`: DiLoCo's outer step).
    Applied {
        steps: u64,
        version: u64,
        members: usize,
        contributors: Option<usize>,
        hash: [u8; 32],
    },
    /// A DiLoCo inner step.
    InnerStep {
        steps: u64,
        version: u64,
    },
    HashesAgree {
        steps: u64,
    },
    /// The members' hashes differ: the ring dissolves and the next epoch re-syncs.
    HashesDiffer {
        steps: u64,
        mine: [u8; 32],
    },
    Dissolved {
        epoch: u64,
    },
    /// A round failed: the next epoch is formed.
    RoundFailed {
        epoch: u64,
        error: String,
    },
    /// Left out of an epoch as of another shape: the member asks again later (the error
    /// says when), its loop goes on.
    LeftOut {
        error: String,
    },
    /// The loop ends with an error, after leaving the group.
    Failed {
        error: String,
    },
    /// The loop ends at a stop, after leaving the group.
    Stopped {
        mode: StopMode,
        steps: u64,
    },
}

/// Where a loop's events go.
pub type EventSink<'a> = Box<dyn FnMut(&MemberEvent) + Send + 'a>;

/// The first 8 bytes of a hash, hex (as statuses and logs show parameters).
pub fn hex8(h: &[u8; 32]) -> String {
    h[..8].iter().map(|b| format!("{b:02x}")).collect()
}
