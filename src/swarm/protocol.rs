//! The wire: every message AgentJet peers exchange, one postcard type per frame (see
//! [`super::frame`]), one versioned libp2p protocol per conversation.
//!
//! Every stream starts with the responder's [`Admission`]: it is written before anything
//! is read, so a refused caller (no swarm key, too many streams, over its request rate)
//! learns why at once, and an admitted one pays no extra round trip.
//!
//! - `/agentjet/auth/1`: the opener sends [`AuthProof`]; the responder answers
//!   [`AuthVerdict`]. Run once per connection by both sides (see [`super::auth`]).
//! - `/agentjet/infer/1`: [`InferRequest`] → [`InferFrame`]s: tokens of every choice as
//!   they are sampled, each with the server's signature over the call so far, then one
//!   `Finished` per choice. Dropping the stream cancels the generation.
//! - `/agentjet/card/1`: [`CardRequest`] → [`CardReply`]: the model card (tokenizer, chat
//!   template, config) as one content-addressed blob.
//! - `/agentjet/submit/1`: [`SubmitManifest`] → [`SubmitReply::Want`] (the fragments the
//!   server lacks) → [`FragmentBatch`]es → [`SubmitReply::Stored`] only once the episode
//!   is verified and on disk, or [`SubmitReply::Rejected`] with the reason.
//! - `/agentjet/collective/1`: reserved for the gradient all-reduce among the servers of a
//!   model (a later issue); nothing answers it yet.
//! - gossip topic `agentjet/status/1`: [`StatusEnvelope`]s, each peer's [`PeerStatus`].

use std::collections::BTreeMap;

use libp2p::StreamProtocol;
use serde::{Deserialize, Serialize};

use crate::engine::{ConstraintPattern, FinishReason, SamplingParams};
use crate::timeline::fragment::{EpisodeManifest, FragmentHash};

pub const AUTH: StreamProtocol = StreamProtocol::new("/agentjet/auth/1");
pub const INFER: StreamProtocol = StreamProtocol::new("/agentjet/infer/1");
pub const CARD: StreamProtocol = StreamProtocol::new("/agentjet/card/1");
pub const SUBMIT: StreamProtocol = StreamProtocol::new("/agentjet/submit/1");
/// Reserved for the collective (all-reduce) issue.
pub const COLLECTIVE: StreamProtocol = StreamProtocol::new("/agentjet/collective/1");
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

/// One generation (with `n` choices from one prompt).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferRequest {
    pub model: String,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: SamplingParams,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    pub top_logprobs: u32,
    pub constraint: Option<ConstraintPattern>,
    pub n: u32,
}

/// What a server streams back for an [`InferRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum InferFrame {
    Token {
        choice: u32,
        id: u32,
        logprob: f64,
        top: Vec<(u32, f64)>,
        /// The policy version the signature names (the one the choice started on).
        policy_version: u64,
        /// [`super::sign::CallSignature`] (postcard) over the call with the choice's
        /// tokens so far, this one included, as its completion.
        signature: Vec<u8>,
    },
    Finished {
        choice: u32,
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        /// The version the signatures name.
        policy_version: u64,
    },
    /// This choice failed on the server.
    Failed { choice: u32, message: String },
    /// The whole request was not taken. `retry`: another provider may take it (the server
    /// is overloaded or stopping); otherwise the request itself is wrong.
    Rejected { message: String, retry: bool },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardRequest {
    pub model: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CardReply {
    /// `blob` is a postcard [`CardBlob`]; `hash` its blake3.
    Card {
        hash: [u8; 32],
        blob: Vec<u8>,
    },
    Unknown(String),
}

/// A model card as files of an HF model directory (config.json, tokenizer.json,
/// tokenizer_config.json, generation_config.json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardBlob {
    pub model: String,
    pub files: Vec<(String, Vec<u8>)>,
}

/// An episode offered to a server: the manifest and, per timeline and call, the serving
/// peer's signature (`None` for a call that sampled nothing). Each signer's public key is
/// sent once, in `signers`; a signature names its signer by index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubmitManifest {
    pub manifest: EpisodeManifest,
    pub signers: Vec<Vec<u8>>,
    pub signatures: Vec<Vec<Option<CompactSignature>>>,
}

/// A call's signature without its signer's key: `signer` indexes
/// [`SubmitManifest::signers`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompactSignature {
    pub signer: u32,
    pub signature: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum SubmitReply {
    /// Send these fragments (the server has the others).
    Want(Vec<FragmentHash>),
    Stored {
        episode_id: String,
        fragments_received: u32,
        fragments_known: u32,
    },
    Rejected(String),
}

/// Fragments as encoded, in the order of the server's [`SubmitReply::Want`] list (so no
/// hash is sent twice); the server checks each against the hash it asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FragmentBatch {
    pub fragments: Vec<Vec<u8>>,
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
}

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
