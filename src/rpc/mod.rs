//! What servers and clients say to each other over the swarm's streams: the role
//! protocols. The swarm admits each stream (swarm key, per-peer bounds) and moves the
//! frames; the meaning is here. One postcard type per frame (`swarm::frame`), one
//! versioned libp2p protocol per conversation.
//!
//! - `/agentjet/infer/2`: [`InferRequest`] → [`InferFrame`]s: tokens of every choice as
//!   they are sampled (the model's logprob, for the agent, and the behaviour logprob under
//!   the distribution drawn from, for training), each with the server's signature over
//!   the call so far, then one
//!   `Finished` per choice. Dropping the stream cancels the generation.
//! - `/agentjet/card/1`: [`CardRequest`] → [`CardReply`]: the model card (tokenizer, chat
//!   template, config) as one content-addressed blob.
//! - `/agentjet/submit/2`: [`SubmitManifest`] → [`SubmitReply::Want`] (the fragments the
//!   server lacks) → [`FragmentBatch`]es → [`SubmitReply::Stored`] only once the episode
//!   is verified and on disk, or [`SubmitReply::Rejected`] with the reason.
//!
//! The engine's [`SamplingParams`], [`FinishReason`] and [`ConstraintPattern`] and the
//! timeline's [`EpisodeManifest`] are carried as they are: their postcard encoding is part
//! of these protocols (the test below pins it), so a change to their fields is a change of
//! protocol version (`/2`), never a silent one.
//!
//! Owns: the messages and protocol names. Never runs a model, never opens a stream.

use libp2p::StreamProtocol;
use serde::{Deserialize, Serialize};

use crate::engine::{ConstraintPattern, FinishReason, SamplingParams};
use crate::timeline::fragment::{EpisodeManifest, FragmentHash};

pub const INFER: StreamProtocol = StreamProtocol::new("/agentjet/infer/2");
pub const CARD: StreamProtocol = StreamProtocol::new("/agentjet/card/1");
pub const SUBMIT: StreamProtocol = StreamProtocol::new("/agentjet/submit/2");

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
        /// Under the model's own distribution.
        logprob: f64,
        /// Under the distribution the token was drawn from (what the signature covers).
        behaviour: f64,
        top: Vec<(u32, f64)>,
        /// The policy version the signature names (the one the choice started on).
        policy_version: u64,
        /// `[`super::sign::CallSignature`]` (postcard) over the call with the choice's
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
        #[serde(with = "crate::base::bytes")]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of an infer request are the protocol: if this fails, a field of
    /// `SamplingParams` (or of the request) changed, and `/agentjet/infer/2` must become
    /// `/3` together with the new expected bytes.
    #[test]
    fn an_infer_request_encodes_as_protocol_version_2() {
        let r = InferRequest {
            model: "m".into(),
            prompt: vec![1, 300],
            max_tokens: 5,
            sampling: SamplingParams {
                temperature: 0.5,
                top_k: 3,
                logit_bias: vec![(7, -1.0)],
                ..SamplingParams::default()
            },
            seed: Some(9),
            stop_token_ids: vec![2],
            top_logprobs: 1,
            constraint: None,
            n: 2,
        };
        let bytes = postcard::to_allocvec(&r).unwrap();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, EXPECTED_INFER_V2, "the infer wire format changed");
        let back: InferRequest = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, r);
        let f = InferFrame::Finished {
            choice: 1,
            reason: FinishReason::Length,
            prompt_tokens: 2,
            completion_tokens: 5,
            policy_version: 3,
        };
        let fb = postcard::to_allocvec(&f).unwrap();
        assert_eq!(
            fb,
            [1, 1, 1, 2, 5, 3],
            "the finish frame's wire format changed"
        );
    }

    const EXPECTED_INFER_V2: &str = concat!(
        "016d0201ac0205",                     // model "m", prompt [1, 300], max_tokens 5
        "000000000000e03f000000000000f03f03", // temperature 0.5, top_p 1, top_k 3
        "0000000000000000",                   // min_p 0
        "00000000000000000000000000000000",   // presence, frequency penalties 0
        "000000000000f03f",                   // repetition penalty 1
        "0107000080bf",                       // logit_bias [(7, -1.0)]
        "010901020100", // seed Some(9), stop [2], top_logprobs 1, no constraint
        "02",           // n
    );
}
