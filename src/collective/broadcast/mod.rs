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
//! Owns: the manifest's layout, limits and diff, a chunk's encodings and checks, and the
//! multi-source fetch. Not built yet: the swarm protocol that gossips manifests and
//! serves chunks (a [`ChunkSource`] per peer), and the follower role (`--follow`).

pub mod codec;
pub mod fetch;
pub mod manifest;

pub use codec::{decode, encode, CodecError, Encoding};
pub use fetch::{fetch_version, ChunkSource, FetchConfig, FetchError, FetchReport};
pub use manifest::{Manifest, ManifestError, TensorMeta, CHUNK_BYTES};
