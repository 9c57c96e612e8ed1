//! Weight broadcast to rollout peers (followers): how a training group's policy version
//! reaches servers that serve it without training. A version is a [`Manifest`]: the
//! serving weights as one flat snapshot in fixed-size chunks named by their blake3 hashes
//! (content addressed: any peer holding a chunk can serve it, the receiver checks it).
//! Between versions of one layout only changed chunks move, each in the smallest of its
//! [`codec`] encodings (raw, zstd, or an XOR delta against the previous version's chunk).
//!
//! A follower fetches a version's changed chunks from several peers at once
//! ([`fetch_version`] over [`ChunkSource`]s), checking each and backing off a peer that
//! sends a wrong one.
//!
//! Every holder of a version (a trainer after its step, a follower after its fetch) keeps
//! it in its [`VersionStore`] and serves its manifest and chunks on `/agentjet/weights/1`
//! ([`wire`]); which versions a peer holds is in its gossiped status
//! ([`crate::swarm::WeightsStatus`], see [`Holder`]). A follower's loop ([`Follower`]:
//! which version to follow, from whom, sharing the work with the other followers) is
//! here too, without the model: the server's `--follow` installs each fetched version in
//! its engine, netsim's followers hold them.
//!
//! Owns: the manifest's layout, limits and diff, a chunk's encodings and checks, the held
//! versions, the chunk protocol, and the multi-source fetch.

pub mod codec;
pub mod fetch;
pub mod follow;
pub mod holder;
pub mod manifest;
pub mod next;
pub mod store;
pub mod wire;

pub use codec::{decode, encode, CodecError, Encoding};
pub use fetch::{
    fetch_version, fetch_version_with, ChunkSource, FetchConfig, FetchError, FetchReport, Miss,
    Share,
};
pub use follow::{FollowConfig, Follower};
pub use holder::Holder;
pub use manifest::{Layout, Manifest, ManifestError, TensorMeta, CHUNK_BYTES};
pub use store::{Held, VersionStore};
pub use wire::{PeerSource, WeightsNet};
