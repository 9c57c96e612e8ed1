//! A policy version's manifest: what a follower needs to know to fetch it. The serving
//! weights are laid out as one flat snapshot (each tensor's bytes in the serving dtype,
//! one after another, in a fixed order) cut into fixed-size chunks, each named by its
//! blake3 hash: content addressing, so any peer holding a chunk can serve it and the
//! receiver checks it without trusting the sender. Between two versions of the same
//! layout only the chunks whose hash moved need fetching.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Chunk size of a snapshot: big enough that per-chunk overheads (a request, a hash, a
/// compression frame) vanish, small enough to fetch one chunk from each of several peers.
pub const CHUNK_BYTES: u32 = 1 << 20;

/// Most tensors a manifest may list (a 1T-parameter model has a few thousand).
pub const MAX_TENSORS: usize = 1 << 16;
/// Most bytes a snapshot may have (a bound on what a manifest can make a peer allocate).
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 42;
/// Most bytes an encoded manifest may have.
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;

/// One tensor's place in the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    /// The serving dtype's name (`f32`, `bf16`, ...), as the publisher holds it.
    pub dtype: String,
    pub shape: Vec<i64>,
    /// Byte offset in the snapshot and byte length.
    pub offset: u64,
    pub len: u64,
}

/// What a policy version consists of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The served model (the group's name).
    pub model: String,
    pub version: u64,
    /// The group's parameter hash at this version (the trained parameters, as the hash
    /// round compares them), so a follower can say which policy it serves.
    pub param_hash: String,
    pub chunk_bytes: u32,
    pub tensors: Vec<TensorMeta>,
    /// blake3 of each chunk of the snapshot, in order; the last chunk may be short.
    pub chunks: Vec<[u8; 32]>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ManifestError {
    #[error("manifest: {0}")]
    Invalid(String),
    #[error("manifest of {got} bytes is over the limit of {limit}")]
    TooLarge { got: usize, limit: usize },
    #[error("the two versions' layouts differ ({0}): fetch the whole snapshot")]
    LayoutChanged(String),
}

/// A snapshot's layout: per tensor its name, dtype, shape and bytes, in order.
pub type Layout = [(String, String, Vec<i64>, u64)];

/// Chunks up to this size are encoded, decoded and hashed on the async thread that
/// moves them (tens of microseconds); bigger ones (the default 1 MiB: about a
/// millisecond) on blocking threads. netsim's scaled-down chunks take the first way: a
/// hundred followers' fetches on threads of their own kept its two cores switching.
pub const INLINE_CHUNK_BYTES: usize = 64 << 10;

impl Manifest {
    /// The manifest of `snapshot` (the tensors of `layout` back to back, each given as
    /// name, dtype and shape with its byte length) at `version`.
    pub fn build(
        model: &str,
        version: u64,
        param_hash: &str,
        layout: &Layout,
        snapshot: &[u8],
    ) -> Result<Manifest, ManifestError> {
        Self::build_chunked(model, version, param_hash, layout, snapshot, CHUNK_BYTES)
    }

    /// [`Manifest::build`] with chunks of `chunk_bytes` (a multiple of 4, so no element
    /// of a float32 or bfloat16 tensor straddles two chunks' byte planes).
    pub fn build_chunked(
        model: &str,
        version: u64,
        param_hash: &str,
        layout: &Layout,
        snapshot: &[u8],
        chunk_bytes: u32,
    ) -> Result<Manifest, ManifestError> {
        if chunk_bytes == 0 || chunk_bytes % 4 != 0 {
            return Err(ManifestError::Invalid(format!(
                "chunk size {chunk_bytes} is not a positive multiple of 4"
            )));
        }
        let mut tensors = Vec::with_capacity(layout.len());
        let mut offset = 0u64;
        for (name, dtype, shape, len) in layout {
            tensors.push(TensorMeta {
                name: name.clone(),
                dtype: dtype.clone(),
                shape: shape.clone(),
                offset,
                len: *len,
            });
            offset += len;
        }
        if offset != snapshot.len() as u64 {
            return Err(ManifestError::Invalid(format!(
                "the layout covers {offset} bytes, the snapshot has {}",
                snapshot.len()
            )));
        }
        let chunks = snapshot
            .chunks(chunk_bytes as usize)
            .map(|c| *blake3::hash(c).as_bytes())
            .collect();
        let m = Manifest {
            model: model.to_string(),
            version,
            param_hash: param_hash.to_string(),
            chunk_bytes,
            tensors,
            chunks,
        };
        m.validate()?;
        Ok(m)
    }

    /// The snapshot's length in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.offset + t.len)
    }

    /// The byte range of chunk `i` in the snapshot.
    pub fn chunk_range(&self, i: usize) -> Range<usize> {
        let c = self.chunk_bytes as u64;
        let start = i as u64 * c;
        let end = (start + c).min(self.total_bytes());
        start as usize..end as usize
    }

    /// Checks what a peer's manifest claims before anything is allocated for it: bounded
    /// counts and sizes, tensors back to back from 0, and one hash per chunk.
    pub fn validate(&self) -> Result<(), ManifestError> {
        let bad = |m: String| Err(ManifestError::Invalid(m));
        if self.chunk_bytes == 0 || self.chunk_bytes > 64 << 20 {
            return bad(format!(
                "chunk size {} is not in 1..=64 MiB",
                self.chunk_bytes
            ));
        }
        if self.tensors.len() > MAX_TENSORS {
            return bad(format!(
                "{} tensors, more than {MAX_TENSORS}",
                self.tensors.len()
            ));
        }
        let mut at = 0u64;
        for t in &self.tensors {
            if t.offset != at {
                return bad(format!(
                    "tensor {} starts at byte {}, not {at}",
                    t.name, t.offset
                ));
            }
            at = at
                .checked_add(t.len)
                .filter(|&a| a <= MAX_SNAPSHOT_BYTES)
                .ok_or_else(|| {
                    ManifestError::Invalid(format!(
                        "the snapshot is over {MAX_SNAPSHOT_BYTES} bytes"
                    ))
                })?;
        }
        let want = at.div_ceil(self.chunk_bytes as u64);
        if self.chunks.len() as u64 != want {
            return bad(format!(
                "{} chunk hashes for {at} bytes in chunks of {} ({want} chunks)",
                self.chunks.len(),
                self.chunk_bytes
            ));
        }
        Ok(())
    }

    /// A hash of the layout (chunk size and tensors): two manifests of one id have the same
    /// layout, so a chunk of one is a delta's base for the same chunk of the other (what
    /// [`Manifest::changed_since`] checks, without comparing every tensor each time).
    pub fn layout_id(&self) -> [u8; 32] {
        let bytes =
            postcard::to_allocvec(&(self.chunk_bytes, &self.tensors)).expect("a layout encodes");
        *blake3::hash(&bytes).as_bytes()
    }

    /// The chunks of this version whose content differs from `prev`'s (same layout), in
    /// order: what a follower at `prev` fetches. A different layout (tensor names,
    /// dtypes, shapes or chunk size) is [`ManifestError::LayoutChanged`].
    pub fn changed_since(&self, prev: &Manifest) -> Result<Vec<usize>, ManifestError> {
        if self.chunk_bytes != prev.chunk_bytes {
            return Err(ManifestError::LayoutChanged(format!(
                "chunks of {} bytes, before {}",
                self.chunk_bytes, prev.chunk_bytes
            )));
        }
        if self.tensors != prev.tensors {
            let why = match self.tensors.iter().zip(&prev.tensors).find(|(a, b)| a != b) {
                Some((a, _)) => format!("tensor {} differs", a.name),
                None => format!(
                    "{} tensors, before {}",
                    self.tensors.len(),
                    prev.tensors.len()
                ),
            };
            return Err(ManifestError::LayoutChanged(why));
        }
        Ok((0..self.chunks.len())
            .filter(|&i| self.chunks[i] != prev.chunks[i])
            .collect())
    }

    /// The manifest's bytes (postcard).
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a manifest encodes")
    }

    /// A manifest from a peer's bytes: bounded, then validated.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge {
                got: bytes.len(),
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let m: Manifest = postcard::from_bytes(bytes)
            .map_err(|e| ManifestError::Invalid(format!("undecodable: {e}")))?;
        m.validate()?;
        Ok(m)
    }

    /// The manifest's content address: blake3 of its bytes.
    pub fn id(&self) -> [u8; 32] {
        *blake3::hash(&self.encode()).as_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(sizes: &[u64]) -> Vec<(String, String, Vec<i64>, u64)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("t{i}"), "bf16".to_string(), vec![n as i64 / 2], n))
            .collect()
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn chunks_are_hashed_and_only_changed_ones_are_listed() {
        let c = CHUNK_BYTES as usize;
        let sizes = [c as u64 + 10, 2 * c as u64, 6];
        let n: u64 = sizes.iter().sum();
        let a = bytes(n as usize, 1);
        let m1 = Manifest::build("m", 1, "h1", &layout(&sizes), &a).unwrap();
        assert_eq!(m1.chunks.len(), 4);
        assert_eq!(m1.chunk_range(3), 3 * c..n as usize);
        assert_eq!(m1.total_bytes(), n);
        let mut b = a.clone();
        b[c + 5] ^= 1; // chunk 1
        b[n as usize - 1] ^= 0x80; // chunk 3 (the short last one)
        let m2 = Manifest::build("m", 2, "h2", &layout(&sizes), &b).unwrap();
        assert_eq!(m2.changed_since(&m1).unwrap(), vec![1, 3]);
        assert_eq!(m1.changed_since(&m1).unwrap(), Vec::<usize>::new());
        // Round trip, and the id moves with the content.
        let back = Manifest::decode(&m2.encode()).unwrap();
        assert_eq!(back, m2);
        assert_ne!(m1.id(), m2.id());
    }

    #[test]
    fn another_layout_is_a_full_fetch_and_lies_are_refused() {
        let a = bytes(100, 2);
        let m1 = Manifest::build("m", 1, "h", &layout(&[60, 40]), &a).unwrap();
        let m2 = Manifest::build("m", 2, "h", &layout(&[40, 60]), &a).unwrap();
        assert!(matches!(
            m2.changed_since(&m1),
            Err(ManifestError::LayoutChanged(w)) if w.contains("t0")
        ));
        // The layout's id tells the same: another split (or chunk size) is another id,
        // another version or other bytes of one layout the same id.
        assert_ne!(m1.layout_id(), m2.layout_id());
        let b = bytes(100, 3);
        let m3 = Manifest::build("m", 7, "h2", &layout(&[60, 40]), &b).unwrap();
        assert_eq!(m1.layout_id(), m3.layout_id());
        let smaller = Manifest::build_chunked("m", 1, "h", &layout(&[60, 40]), &a, 16).unwrap();
        assert_ne!(m1.layout_id(), smaller.layout_id());
        assert!(Manifest::build("m", 1, "h", &layout(&[60]), &a).is_err());
        // A peer's manifest that claims a gap, too many bytes, or the wrong chunk count.
        let mut gap = m1.clone();
        gap.tensors[1].offset += 1;
        assert!(Manifest::decode(&gap.encode()).is_err());
        let mut huge = m1.clone();
        huge.tensors[1].len = u64::MAX - 10;
        assert!(Manifest::decode(&huge.encode()).is_err());
        let mut short = m1.clone();
        short.chunks.push([0; 32]);
        assert!(Manifest::decode(&short.encode())
            .unwrap_err()
            .to_string()
            .contains("chunk hashes"));
        assert!(Manifest::decode(&[0xff; 16]).is_err());
        assert!(matches!(
            Manifest::decode(&vec![0; MAX_MANIFEST_BYTES + 1]),
            Err(ManifestError::TooLarge { .. })
        ));
    }
}
