//! Weight broadcast to rollout peers (followers): how a training group's policy version
//! reaches servers that serve it without training. A version is a [`Manifest`]: the
//! serving weights as one flat snapshot in fixed-size chunks named by their blake3 hashes
//! (content addressed: any peer holding a chunk can serve it, the receiver checks it).
//! Between versions of one layout only changed chunks move, each in the smallest of its
//! [`codec`] encodings (raw, zstd, or an XOR delta against the previous version's chunk).
//!
//! Owns: the manifest's layout, limits and diff, and a chunk's encodings and checks.
//! Built so far: these two; not yet: the protocol that gossips manifests and fetches
//! chunks from several peers, and the follower role (`--follow`).

pub mod codec;
pub mod manifest;

pub use codec::{decode, encode, CodecError, Encoding};
pub use manifest::{Manifest, ManifestError, TensorMeta, CHUNK_BYTES};
