//! What a server tells a program watching it ([`ServerEvent`], in [`super::Server::events`]
//! and, with `--events FILE`, as JSON lines): that it listens and serves, its training's
//! steps and checkpoints, its training group's epochs, joins and faults, its stop. The
//! lines it prints say the same to a person.

use serde::{Deserialize, Serialize};

use crate::collective::member::{hex8, MemberEvent, SyncReason};

/// One thing a server did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ServerEvent {
    /// Its swarm node listens (each address ends in its peer id: a bootstrap address).
    Started {
        peer_id: String,
        listen: Vec<String>,
    },
    /// What happened to its network: reachability, connections and their kind (direct,
    /// hole-punched, relayed), relay reservations, hole punches, bootstrap failures.
    Network(crate::swarm::NetEvent),
    /// Its model is announced to the swarm.
    Serving {
        model: String,
    },
    /// The OpenAI-compatible HTTP API answers at `http://{addr}/v1`.
    Http {
        addr: String,
    },
    Dashboard {
        addr: String,
    },
    /// Training starts at `step` (a resumed checkpoint's, or 0).
    Training {
        model: String,
        step: u64,
        version: u64,
        resumed: bool,
    },
    /// An episode was stored (and synced): each signed call's signing server (peer id)
    /// and the policy version it was sampled at.
    EpisodeStored {
        model: String,
        episode: String,
        calls: Vec<(String, u64)>,
    },
    /// Stored episodes not trained yet were handed to the trainer again.
    Refed {
        episodes: usize,
    },
    /// A step's computation starts here (its rounds follow in a group).
    StepStarted {
        step: u64,
        members: usize,
    },
    /// A step ended (`trained`: false when nothing was trainable); its line is in
    /// `metrics.jsonl` (and, a moment later, its episodes in the ledger, `consumed.log`).
    TrainStep {
        /// The model (with `--adapter`, one of several in this server) that stepped.
        #[serde(default)]
        model: String,
        step: u64,
        version: u64,
        trained: bool,
        members: usize,
        reward_mean: f64,
        params: Option<String>,
    },
    /// A follower serves a policy version of its group, fetched from its holders:
    /// `chunks` fetched, `bytes` received (by peer id), parameters hashing to
    /// `param_hash` (hex8).
    Followed {
        model: String,
        version: u64,
        param_hash: String,
        chunks: usize,
        bytes: u64,
        bytes_by_source: std::collections::BTreeMap<String, u64>,
        /// The whole snapshot's bytes (what sending it in full costs).
        full_bytes: u64,
        seconds: f64,
        /// When the engine started serving it (Unix milliseconds).
        unix_ms: u64,
    },
    /// A follower stopped asking `peer` for chunks: it sent a wrong or malformed one, or
    /// failed twice in a row.
    SourceBackedOff {
        model: String,
        peer: String,
        reason: String,
    },
    /// DiLoCo: an outer step applied.
    OuterStep {
        version: u64,
        members: usize,
        contributors: usize,
        params: String,
    },
    /// Its training group's epoch stands (parameters: the first 8 bytes of their hash).
    Formed {
        epoch: u64,
        members: usize,
        steps: u64,
        params: String,
    },
    /// It fetches the group's state of group step `steps`: it is `behind` at that step,
    /// or its parameters `differ` from the group's.
    Syncing {
        steps: u64,
        behind: Option<u64>,
        differ: Option<(String, String)>,
    },
    /// It installed the group's state.
    Joined {
        steps: u64,
        version: u64,
        bytes: usize,
    },
    /// The group's members found their parameter hashes differ at `steps`.
    HashesDiffer {
        steps: u64,
        mine: String,
    },
    RoundFailed {
        epoch: u64,
        error: String,
    },
    /// The ring of an epoch could not be built (a link that was not made within the link
    /// bound: the error names the neighbour); the next epoch is formed without the member
    /// that could not be linked.
    BuildFailed {
        error: String,
    },
    /// Its training ended with an error (it left its group).
    TrainingFailed {
        error: String,
    },
    /// A Start left it out of its group's epoch as of another shape; it asks again
    /// later (the error says when).
    LeftOut {
        error: String,
    },
    /// A new certificate (from `source`: its file, or the run key) is in use.
    CertRenewed {
        source: String,
        not_after_unix: u64,
    },
    /// A new certificate from `source` is not used (the current one stays).
    CertNotUsed {
        source: String,
        error: String,
    },
    CheckpointSaved {
        step: u64,
        on_stop: bool,
    },
    /// A stop began (`drain`: work in flight finishes).
    Stopping {
        drain: bool,
    },
    Stopped,
}

impl ServerEvent {
    /// The server's event for a member loop's, when a watcher would care.
    pub fn of_member(e: &MemberEvent) -> Option<ServerEvent> {
        Some(match e {
            MemberEvent::Formed {
                epoch,
                members,
                steps,
                hash,
                ..
            } => ServerEvent::Formed {
                epoch: *epoch,
                members: *members,
                steps: *steps,
                params: hex8(hash),
            },
            MemberEvent::Syncing { steps, reason } => ServerEvent::Syncing {
                steps: *steps,
                behind: match reason {
                    SyncReason::Behind { at } => Some(*at),
                    SyncReason::Differs { .. } => None,
                },
                differ: match reason {
                    SyncReason::Differs { mine, group } => Some((hex8(mine), hex8(group))),
                    SyncReason::Behind { .. } => None,
                },
            },
            MemberEvent::Synced {
                steps,
                version,
                bytes,
                ..
            } => ServerEvent::Joined {
                steps: *steps,
                version: *version,
                bytes: *bytes,
            },
            MemberEvent::HashesDiffer { steps, mine } => ServerEvent::HashesDiffer {
                steps: *steps,
                mine: hex8(mine),
            },
            MemberEvent::RoundFailed { epoch, error } => ServerEvent::RoundFailed {
                epoch: *epoch,
                error: error.clone(),
            },
            MemberEvent::BuildFailed { error } => ServerEvent::BuildFailed {
                error: error.clone(),
            },
            MemberEvent::Failed { error } => ServerEvent::TrainingFailed {
                error: error.clone(),
            },
            MemberEvent::LeftOut { error } => ServerEvent::LeftOut {
                error: error.clone(),
            },
            _ => return None,
        })
    }
}
