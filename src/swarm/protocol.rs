//! The swarm's own wire: the messages of the swarm itself (admission, swarm-key proofs,
//! status gossip), one postcard type per frame (see [`super::frame`]). What servers and
//! clients say to each other over the swarm's streams (inference, model cards, episode
//! submission) is theirs: `rpc` defines it, on streams this module only admits.
//!
//! Every stream starts with the responder's [`Admission`]: it is written before anything
//! is read, so a refused caller (no swarm key, too many streams, over its request rate)
//! learns why at once, and an admitted one pays no extra round trip.
//!
//! - `/agentjet/auth/1`: the opener sends [`AuthProof`]; the responder answers
//!   [`AuthVerdict`]. Run once per connection by both sides (see [`super::auth`]).
//! - `/agentjet/kad/1`, `/agentjet/id/1`: Kademlia and identify under our own names, so an
//!   AgentJet swarm never mixes with another libp2p network.
//! - gossip topic `agentjet/status/1`: [`StatusEnvelope`]s, each peer's [`PeerStatus`].

use std::collections::BTreeMap;

use libp2p::StreamProtocol;
use serde::{Deserialize, Serialize};

pub const AUTH: StreamProtocol = StreamProtocol::new("/agentjet/auth/1");
pub const KAD: StreamProtocol = StreamProtocol::new("/agentjet/kad/1");
pub const IDENTIFY: &str = "/agentjet/id/1";
pub const STATUS_TOPIC: &str = "agentjet/status/1";

/// The responder's first frame on every stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Admission {
    Accepted,
    Refused(String),
}

/// Proof of the swarm key, bound to both ends of the connection (see [`super::auth`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthProof {
    pub proof: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AuthVerdict {
    Accepted,
    Denied(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Server,
    Client,
    /// A peer that only relays gossip and DHT (a bootstrap).
    Plain,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Client => "client",
            Role::Plain => "peer",
        }
    }
}

/// One served model's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStatus {
    pub name: String,
    pub policy_version: u64,
    pub train_step: u64,
    /// Set when this server trains the model as a member of its training group.
    pub group: Option<GroupStatus>,
    /// The server's prefix cache for this model (clients route an episode's calls by it).
    pub cache: CacheSummary,
    /// The policy version it holds and serves chunks of (weight broadcast), if any.
    pub weights: Option<WeightsStatus>,
}

/// A holder of a training group's policy versions (a trainer, or a follower: `--follow`):
/// the latest it holds, whose manifest and chunks it serves on `/agentjet/weights/1`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WeightsStatus {
    /// The training group the versions are of.
    pub group: String,
    pub version: u64,
    /// The version's manifest id (blake3 of its bytes).
    pub manifest: [u8; 32],
    /// The first 8 bytes of the blake3 of the parameters it serves, hex.
    pub param_hash: String,
    /// A follower (serves the group's versions without training).
    pub follower: bool,
    /// Versions behind the newest its group announces (followers).
    pub lag: u64,
    /// Bytes of chunks fetched from others and served to others, since start.
    pub fetched_bytes: u64,
    pub served_bytes: u64,
}

/// A server's prefix cache in brief (gossiped with its status).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheSummary {
    /// Bytes of keys and values it holds.
    pub bytes: u64,
    /// Requests that found a cached prefix, of all admitted (0..1).
    pub hit_rate: f32,
    /// Prompt tokens taken from the cache / prefilled, since start.
    pub reused_tokens: u64,
    pub prefilled_tokens: u64,
}

impl CacheSummary {
    /// "12.3MB 45%": bytes held and hit rate.
    pub fn brief(&self) -> String {
        format!(
            "{:.1}MB {:.0}%",
            self.bytes as f64 / 1e6,
            100.0 * self.hit_rate as f64
        )
    }
}

/// A training-group member's view of its group (gossiped; shown by `status`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    /// The group's name (`--train-group`; the model's by default).
    pub name: String,
    /// The membership epoch it is in (0: forming, not in a ring yet).
    pub epoch: u64,
    pub members: u32,
    /// The first 8 bytes of the blake3 of its parameters, hex.
    pub param_hash: String,
    /// The last gradient all-reduce: milliseconds and bus bandwidth (GB/s).
    pub allreduce_ms: f64,
    pub allreduce_gbps: f64,
    /// "sync" or "diloco/H".
    pub mode: String,
}

/// The [`PeerStatus::extra`] field a server sets when it stops (it withdraws its provider
/// records then): clients route no new calls to it.
pub const STOPPING_FIELD: &str = "stopping";

/// The [`PeerStatus::extra`] field that says a peer's reachability (see
/// [`super::Reachability`]: `public`, `relayed`, `unreachable`, `local`, `unknown`).
pub const REACH_FIELD: &str = "reach";

/// The [`PeerStatus::extra`] field a publicly reachable peer sets ("1") while it offers
/// relay service.
pub const RELAY_FIELD: &str = "relay";

/// What every peer gossips about itself every few seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerStatus {
    pub role: Role,
    pub models: Vec<ModelStatus>,
    /// Sequences running / max batch (0..1, servers).
    pub load: f32,
    pub queue_depth: u32,
    pub free_kv_positions: u64,
    /// Episodes this peer completed (clients) or stored (servers).
    pub episodes: u64,
    pub version: String,
    pub extra: BTreeMap<String, String>,
}

/// A gossiped status: `payload` is the postcard [`PeerStatus`] stamped with its author,
/// `mac` the swarm key's keyed blake3 over it (absent in an open swarm).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusEnvelope {
    pub author: Vec<u8>,
    pub seq: u64,
    pub unix_ms: u64,
    pub status: PeerStatus,
    /// The author's listen addresses (multiaddr bytes), so peers can dial it.
    pub addrs: Vec<Vec<u8>>,
    pub mac: Option<[u8; 32]>,
}
