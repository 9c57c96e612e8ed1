//! Episodes on a server's disk: the manifest and the rebuilt timelines, one file each.
//!
//! The file is a format tag (`STORED_TAG`) and the postcard encoding of
//! [`StoredEpisode`]: the manifest, the rebuilt timelines, the nonces of its signed calls
//! (the server's replay ledger is rebuilt from them at start) and who submitted it (its
//! quota likewise). Files of the layout before nonces (tag `\x02`) load with neither.
//! Files written before the sampling transform travelled with calls have no tag; they
//! are read with the earlier segment layout and their calls taken as drawn from the
//! model's own distribution ([`SamplingTransform::RAW`]).
//!
//! Owns: the stored episode's byte layout and its earlier versions. Never verifies
//! signatures (that happened before the episode was stored).

use std::path::Path;

use serde::{Deserialize, Serialize};
use tracing::warn;

use super::error::ServerError;
use crate::swarm::sign::Nonce;
use crate::timeline::digest::rebuilt_calls;
use crate::timeline::fragment::EpisodeManifest;
use crate::timeline::{Branch, Call, Episode, SamplingTransform, Segment, Timeline};

/// The first bytes of a stored episode in the current layout. An untagged file starts
/// with the varint length of its episode id; 0xff would need an id of more than 16 KB.
const STORED_TAG: &[u8] = b"\xffAJEP\x03";

/// What [`StoredEpisode::decode`] says of a file of a later layout than this version's.
const NEWER: &str = "written by a newer version of agentjet";

/// The layout before nonces and the submitter were stored.
const STORED_TAG_2: &[u8] = b"\xffAJEP\x02";

/// An episode as a server stores it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredEpisode {
    pub manifest: EpisodeManifest,
    pub timelines: Vec<Timeline>,
    /// The nonces of its signed calls (empty in files of earlier layouts).
    pub nonces: Vec<Nonce>,
    /// The submitting peer's id (its bytes; empty in files of earlier layouts).
    pub submitter: Vec<u8>,
}

/// The layout with the sampling transform, before nonces (tag `\x02`).
#[derive(Deserialize)]
struct StoredEpisode2 {
    manifest: EpisodeManifest,
    timelines: Vec<Timeline>,
}

impl StoredEpisode {
    /// The file's bytes.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut out = STORED_TAG.to_vec();
        out.extend(postcard::to_allocvec(self).map_err(|e| e.to_string())?);
        Ok(out)
    }

    /// Reads a file's bytes, in the current layout or the untagged earlier one.
    pub fn decode(bytes: &[u8]) -> Result<StoredEpisode, String> {
        if let Some(rest) = bytes.strip_prefix(STORED_TAG) {
            return postcard::from_bytes(rest).map_err(|e| e.to_string());
        }
        if let Some(&version) = bytes
            .strip_prefix(&STORED_TAG[..STORED_TAG.len() - 1])
            .and_then(|r| r.first())
        {
            if version > STORED_TAG[STORED_TAG.len() - 1] {
                return Err(format!(
                    "{NEWER} (layout {version}; this version reads up to {})",
                    STORED_TAG[STORED_TAG.len() - 1]
                ));
            }
        }
        match bytes.strip_prefix(STORED_TAG_2) {
            Some(rest) => postcard::from_bytes::<StoredEpisode2>(rest)
                .map(|e| StoredEpisode {
                    manifest: e.manifest,
                    timelines: e.timelines,
                    nonces: Vec::new(),
                    submitter: Vec::new(),
                })
                .map_err(|e| e.to_string()),
            None => postcard::from_bytes::<legacy::StoredEpisode>(bytes)
                .map(legacy::StoredEpisode::upgrade)
                .map_err(|e| format!("{e} (neither the current nor the earlier layout)")),
        }
    }

    /// The episode with its calls rebuilt from the timelines (sampled calls only: what
    /// training uses), as the trainer takes it.
    pub fn episode(&self) -> Episode {
        let m = &self.manifest;
        let mut calls = Vec::new();
        for t in &self.timelines {
            for c in rebuilt_calls(t) {
                calls.push(
                    Call::new(&t.model, c.prompt, c.completion, c.logprobs, c.version)
                        .with_sampling(c.sampling),
                );
            }
        }
        Episode {
            id: m.episode_id.clone(),
            task_id: m.task_id.clone(),
            group_id: m.group_id.clone(),
            calls,
            reward: m.reward,
            rewards: m.rewards.clone(),
            status: m.status.clone(),
        }
    }
}

/// Reads every episode stored for a model (in no particular order); a file that does not
/// decode is an error.
pub fn read_stored_episodes(dir: &Path) -> Result<Vec<StoredEpisode>, ServerError> {
    let mut out = Vec::new();
    for_each_stored(dir, false, |e, _| out.push(e))?;
    Ok(out)
}

/// Calls `f` with every episode stored for a model and its file's size, one at a time.
///
/// With `set_aside` (a server's start), a file that does not decode (damaged on disk:
/// episodes are written whole and synced before they are acknowledged) is renamed
/// `NAME.episode.corrupt`, with a warning that names it, and skipped: its submitter may
/// store the episode again (if it was trained before the damage, it may then be trained
/// again). Without, or for a file of a newer layout, or one that cannot be read at all,
/// it is an error.
pub fn for_each_stored(
    dir: &Path,
    set_aside: bool,
    mut f: impl FnMut(StoredEpisode, u64),
) -> Result<(), ServerError> {
    let rd = std::fs::read_dir(dir).map_err(|e| ServerError::io(dir, e))?;
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "episode") {
            let b = std::fs::read(&p).map_err(|e| ServerError::io(&p, e))?;
            let size = b.len() as u64;
            match StoredEpisode::decode(&b) {
                Ok(episode) => f(episode, size),
                Err(problem) if set_aside && !problem.starts_with(NEWER) => {
                    let aside = p.with_extension("episode.corrupt");
                    warn!(
                        "{}: not a stored episode ({problem}); set aside as {}",
                        p.display(),
                        aside.display()
                    );
                    std::fs::rename(&p, &aside).map_err(|e| ServerError::io(&p, e))?;
                }
                Err(problem) => return Err(ServerError::Corrupt { path: p, problem }),
            }
        }
    }
    Ok(())
}

/// The layout before calls carried their sampling transform.
mod legacy {
    use super::*;

    #[derive(Deserialize)]
    pub struct StoredEpisode {
        manifest: EpisodeManifest,
        timelines: Vec<Timeline>,
    }

    #[derive(Deserialize)]
    struct Timeline {
        model: String,
        branches: Vec<Vec<Segment>>,
        breaks: usize,
        calls: usize,
    }

    #[derive(Deserialize)]
    struct Segment {
        tokens: Vec<u32>,
        sampled: bool,
        logprobs: Vec<f32>,
        version: u64,
        call: u32,
    }

    impl StoredEpisode {
        pub fn upgrade(self) -> super::StoredEpisode {
            let timelines = self
                .timelines
                .into_iter()
                .map(|t| super::Timeline {
                    model: t.model,
                    branches: t
                        .branches
                        .into_iter()
                        .map(|b| Branch {
                            segments: b
                                .into_iter()
                                .map(|s| super::Segment {
                                    tokens: s.tokens,
                                    sampled: s.sampled,
                                    logprobs: s.logprobs,
                                    version: s.version,
                                    call: s.call,
                                    sampling: SamplingTransform::RAW,
                                })
                                .collect(),
                        })
                        .collect(),
                    breaks: t.breaks,
                    calls: t.calls,
                })
                .collect();
            super::StoredEpisode {
                manifest: self.manifest,
                timelines,
                nonces: Vec::new(),
                submitter: Vec::new(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::EpisodeStatus;

    /// The earlier layout, as it was written (its serialisation, for this test only).
    #[derive(Serialize)]
    struct OldSegment {
        tokens: Vec<u32>,
        sampled: bool,
        logprobs: Vec<f32>,
        version: u64,
        call: u32,
    }

    #[test]
    fn untagged_episodes_of_the_earlier_layout_load_as_raw_sampling() {
        let manifest = EpisodeManifest {
            episode_id: "ep".into(),
            task_id: "t".into(),
            group_id: "g".into(),
            group_size: 2,
            reward: Some(1.0),
            rewards: Default::default(),
            status: EpisodeStatus::Finished,
            timelines: vec![],
        };
        let segments = vec![
            OldSegment {
                tokens: vec![1, 2],
                sampled: false,
                logprobs: vec![],
                version: 0,
                call: 0,
            },
            OldSegment {
                tokens: vec![3],
                sampled: true,
                logprobs: vec![-0.5],
                version: 4,
                call: 0,
            },
        ];
        let old = postcard::to_allocvec(&(
            &manifest,
            vec![("m".to_string(), vec![segments], 0usize, 1usize)],
        ))
        .unwrap();
        let back = StoredEpisode::decode(&old).unwrap();
        let ep = back.episode();
        assert_eq!(ep.calls.len(), 1);
        assert_eq!(ep.calls[0].prompt_ids, vec![1, 2]);
        assert_eq!(ep.calls[0].logprobs, vec![-0.5]);
        assert_eq!(ep.calls[0].sampling, SamplingTransform::RAW);
        // The current layout round-trips, transform included.
        let mut now = back.clone();
        now.timelines[0].branches[0].segments[1]
            .sampling
            .temperature = 0.7;
        now.nonces = vec![[7; 16]];
        now.submitter = vec![1, 2, 3];
        let again = StoredEpisode::decode(&now.encode().unwrap()).unwrap();
        assert_eq!(again.episode().calls[0].sampling.temperature, 0.7);
        assert_eq!(again.nonces, vec![[7; 16]]);
        assert_eq!(again.submitter, vec![1, 2, 3]);
        // The layout before nonces (tag 2) loads with none.
        let mut two = STORED_TAG_2.to_vec();
        two.extend(postcard::to_allocvec(&(&now.manifest, &now.timelines)).unwrap());
        let two = StoredEpisode::decode(&two).unwrap();
        assert!(two.nonces.is_empty() && two.submitter.is_empty());
        assert_eq!(two.episode().calls[0].sampling.temperature, 0.7);
        assert!(StoredEpisode::decode(b"\xffAJEP\x02garbage").is_err());
        assert!(StoredEpisode::decode(b"\xffAJEP\x03garbage").is_err());

        // A damaged file is set aside, the others are read.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.episode"), now.encode().unwrap()).unwrap();
        std::fs::write(dir.path().join("b.episode"), b"\xffAJEP\x03garbage").unwrap();
        let mut read = Vec::new();
        assert!(for_each_stored(dir.path(), false, |_, _| {}).is_err());
        for_each_stored(dir.path(), true, |e, _| read.push(e.manifest.episode_id)).unwrap();
        assert_eq!(read, vec!["ep".to_string()]);
        assert!(!dir.path().join("b.episode").exists());
        assert!(dir.path().join("b.episode.corrupt").exists());
        // A newer layout is not set aside: it is an error, and the file stays.
        std::fs::write(dir.path().join("c.episode"), b"\xffAJEP\x04later").unwrap();
        let e = for_each_stored(dir.path(), true, |_, _| {}).unwrap_err();
        assert!(e.to_string().contains("newer version"), "{e}");
        assert!(dir.path().join("c.episode").exists());
    }
}
