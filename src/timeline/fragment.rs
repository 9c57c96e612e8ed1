//! Content-addressed fragments: the unit a client ships to a server.
//!
//! Each branch segment is cut, from its start, into fragments of at most
//! [`MAX_FRAGMENT_TOKENS`] tokens. A fragment is its token ids, its loss-mask bit (sampled
//! or not), its behaviour logprobs, its policy version and its sampling transform, encoded
//! with postcard; its name
//! is the blake3 hash of that encoding. Because consecutive calls of an episode extend one
//! branch, and the episodes of a group start from the same prompt, the same fragments recur
//! and are stored and shipped once. An [`EpisodeManifest`] lists, per model and branch, the
//! fragment hashes in order with the call each came from; a receiver asks for the hashes it
//! lacks, verifies every fragment against its hash ([`Fragment::decode`]), and rebuilds the
//! timelines ([`EpisodeManifest::timelines`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Branch, EpisodeStatus, SamplingTransform, Segment, Timeline};

/// Tokens per fragment at most.
pub const MAX_FRAGMENT_TOKENS: usize = 1024;
/// Encoded bytes per fragment at most (ids and logprobs at their largest, plus headroom).
pub const MAX_FRAGMENT_BYTES: usize = MAX_FRAGMENT_TOKENS * 10 + 64;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FragmentError {
    #[error(
        "fragment {hash}: its content hashes to {actual}, not to its name (tampered or corrupt)"
    )]
    HashMismatch {
        hash: FragmentHash,
        actual: FragmentHash,
    },
    #[error("fragment {hash}: {size} bytes, over the limit of {limit}")]
    Oversize {
        hash: FragmentHash,
        size: usize,
        limit: usize,
    },
    #[error("fragment {hash}: cannot decode: {problem}")]
    Decode { hash: FragmentHash, problem: String },
    #[error("fragment {hash}: {problem}")]
    Invalid { hash: FragmentHash, problem: String },
    #[error("fragment {0} is missing")]
    Missing(FragmentHash),
    #[error("manifest: {0}")]
    Manifest(String),
}

/// A fragment's name: blake3 of its postcard encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FragmentHash(pub [u8; 32]);

impl fmt::Display for FragmentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for FragmentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FragmentHash({self})")
    }
}

/// A piece of one segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fragment {
    pub tokens: Vec<u32>,
    /// The loss-mask bit of every token here: sampled by the model or not.
    pub sampled: bool,
    /// One per token when sampled; empty otherwise.
    pub logprobs: Vec<f32>,
    pub version: u64,
    /// The distribution sampled tokens were drawn from.
    pub sampling: SamplingTransform,
}

impl Fragment {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a fragment always encodes")
    }

    pub fn hash(&self) -> FragmentHash {
        FragmentHash(*blake3::hash(&self.encode()).as_bytes())
    }

    /// Decodes bytes received under the name `hash`, refusing oversize, tampered and
    /// malformed fragments.
    pub fn decode(hash: &FragmentHash, bytes: &[u8]) -> Result<Fragment, FragmentError> {
        if bytes.len() > MAX_FRAGMENT_BYTES {
            return Err(FragmentError::Oversize {
                hash: *hash,
                size: bytes.len(),
                limit: MAX_FRAGMENT_BYTES,
            });
        }
        let actual = FragmentHash(*blake3::hash(bytes).as_bytes());
        if actual != *hash {
            return Err(FragmentError::HashMismatch {
                hash: *hash,
                actual,
            });
        }
        let f: Fragment = postcard::from_bytes(bytes).map_err(|e| FragmentError::Decode {
            hash: *hash,
            problem: e.to_string(),
        })?;
        let invalid = |problem: String| FragmentError::Invalid {
            hash: *hash,
            problem,
        };
        if f.tokens.is_empty() || f.tokens.len() > MAX_FRAGMENT_TOKENS {
            return Err(invalid(format!(
                "{} tokens (1..={MAX_FRAGMENT_TOKENS} allowed)",
                f.tokens.len()
            )));
        }
        let want = if f.sampled { f.tokens.len() } else { 0 };
        if f.logprobs.len() != want {
            return Err(invalid(format!(
                "{} logprobs for {} tokens (sampled: {})",
                f.logprobs.len(),
                f.tokens.len(),
                f.sampled
            )));
        }
        f.sampling.check().map_err(invalid)?;
        Ok(f)
    }
}

/// A fragment's place in a branch: its hash and the call its tokens came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FragmentRef {
    pub hash: FragmentHash,
    pub call: u32,
}

/// One model's timeline as fragment references.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineManifest {
    pub model: String,
    pub calls: u32,
    pub breaks: u32,
    pub branches: Vec<Vec<FragmentRef>>,
}

/// What a client submits for an episode: everything but the fragments' contents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeManifest {
    pub episode_id: String,
    pub task_id: String,
    pub group_id: String,
    /// Episodes the client runs in this group (0: not said); a server trains a group once
    /// that many have arrived, finished or aborted.
    pub group_size: u32,
    pub reward: Option<f64>,
    pub rewards: BTreeMap<String, f64>,
    pub status: EpisodeStatus,
    /// Empty for an aborted episode (it is reported so its group completes, never trained).
    pub timelines: Vec<TimelineManifest>,
}

/// Cuts one segment into fragments (at most [`MAX_FRAGMENT_TOKENS`] each, from its start).
pub fn cut_segment(s: &Segment) -> Vec<Fragment> {
    let n = s.tokens.len();
    (0..n)
        .step_by(MAX_FRAGMENT_TOKENS)
        .map(|start| {
            let end = (start + MAX_FRAGMENT_TOKENS).min(n);
            Fragment {
                tokens: s.tokens[start..end].to_vec(),
                sampled: s.sampled,
                logprobs: if s.sampled {
                    s.logprobs[start..end].to_vec()
                } else {
                    Vec::new()
                },
                version: s.version,
                sampling: s.sampling,
            }
        })
        .collect()
}

/// Fragments of a timeline, and its manifest. Fragments come back keyed by hash, so
/// repeats (within the timeline) appear once.
pub fn fragment_timeline(t: &Timeline) -> (TimelineManifest, HashMap<FragmentHash, Fragment>) {
    let mut store = HashMap::new();
    let mut branches = Vec::with_capacity(t.branches.len());
    for b in &t.branches {
        let mut refs = Vec::new();
        for s in &b.segments {
            for f in cut_segment(s) {
                let hash = f.hash();
                refs.push(FragmentRef { hash, call: s.call });
                store.entry(hash).or_insert(f);
            }
        }
        branches.push(refs);
    }
    (
        TimelineManifest {
            model: t.model.clone(),
            calls: t.calls as u32,
            breaks: t.breaks as u32,
            branches,
        },
        store,
    )
}

impl TimelineManifest {
    /// Rebuilds the timeline from fragments (all must be present and already verified).
    pub fn timeline(
        &self,
        store: &HashMap<FragmentHash, Fragment>,
    ) -> Result<Timeline, FragmentError> {
        let mut branches = Vec::with_capacity(self.branches.len());
        for refs in &self.branches {
            let mut b = Branch::default();
            for r in refs {
                let f = store.get(&r.hash).ok_or(FragmentError::Missing(r.hash))?;
                if r.call >= self.calls {
                    return Err(FragmentError::Manifest(format!(
                        "fragment {} names call {} of {}",
                        r.hash, r.call, self.calls
                    )));
                }
                // Consecutive fragments of one segment join again.
                match b.segments.last_mut() {
                    Some(last)
                        if last.call == r.call
                            && last.sampled == f.sampled
                            && last.version == f.version
                            && last.sampling == f.sampling
                            && last.tokens.len() % MAX_FRAGMENT_TOKENS == 0 =>
                    {
                        last.tokens.extend_from_slice(&f.tokens);
                        last.logprobs.extend_from_slice(&f.logprobs);
                    }
                    _ => b.segments.push(Segment {
                        tokens: f.tokens.clone(),
                        sampled: f.sampled,
                        logprobs: f.logprobs.clone(),
                        version: f.version,
                        call: r.call,
                        sampling: f.sampling,
                    }),
                }
            }
            branches.push(b);
        }
        Ok(Timeline {
            model: self.model.clone(),
            branches,
            breaks: self.breaks as usize,
            calls: self.calls as usize,
        })
    }

    /// Every fragment hash, in order (with repeats).
    pub fn hashes(&self) -> impl Iterator<Item = &FragmentHash> {
        self.branches.iter().flatten().map(|r| &r.hash)
    }
}
