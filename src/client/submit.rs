//! Episode submission: manifest → the server's want list → only the wanted fragments →
//! the server's verdict (stored only once verified and on disk).

use std::collections::HashMap;

use crate::rpc::{CompactSignature, FragmentBatch, SubmitManifest, SubmitReply, SUBMIT};
use crate::swarm::frame::FrameError;
use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::sign::{split, SignatureError};
use crate::swarm::{PeerId, SwarmError, SwarmHandle};
use crate::timeline::fragment::{fragment_timeline, EpisodeManifest, FragmentHash};
use crate::timeline::{Episode, EpisodeStatus, TimelineError};

/// Why an episode could not be handed to a server (a server's rejection is not one: it is
/// its verdict, in [`SubmitOutcome::reply`]).
#[derive(Debug, thiserror::Error)]
pub enum SubmitFailure {
    #[error(transparent)]
    Timeline(#[from] TimelineError),
    #[error("a call's signature: {0}")]
    Signature(#[from] SignatureError),
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("encoding: {0}")]
    Encode(String),
    #[error("the server asked for fragment {0}, which is not in this episode")]
    UnknownFragment(FragmentHash),
    #[error("no provider of {model:?} took episode {episode}{}", if errors.is_empty() {
        " (none found)".to_string()
    } else {
        format!(": {}", errors.join("; "))
    })]
    NoProvider {
        model: String,
        episode: String,
        errors: Vec<String>,
    },
}

/// What a submission cost and what the server said.
#[derive(Debug, Clone)]
pub struct SubmitOutcome {
    pub reply: SubmitReply,
    /// Encoded fragment bytes sent (what deduplication saves on).
    pub fragment_bytes_sent: usize,
    /// Frames' bytes sent in all, exactly as on the stream (manifest and length prefixes
    /// included).
    pub bytes_sent: usize,
}

/// The manifest (with signatures) and the encoded fragments of `episode`'s calls of `model`
/// (`group_size`: the episodes of its group; 0 if unknown). An aborted episode is
/// reported without its calls: the server only counts it, so its group can complete.
pub fn prepare(
    episode: &Episode,
    model: &str,
    group_size: u32,
) -> Result<(SubmitManifest, HashMap<FragmentHash, Vec<u8>>), SubmitFailure> {
    if let EpisodeStatus::Aborted { .. } = episode.status {
        let manifest = EpisodeManifest {
            episode_id: episode.id.clone(),
            task_id: episode.task_id.clone(),
            group_id: episode.group_id.clone(),
            group_size,
            reward: None,
            rewards: Default::default(),
            status: episode.status.clone(),
            timelines: Vec::new(),
        };
        return Ok((
            SubmitManifest {
                manifest,
                signers: Vec::new(),
                signatures: Vec::new(),
            },
            HashMap::new(),
        ));
    }
    let t = episode.timeline(model)?;
    let (tm, frags) = fragment_timeline(&t);
    let mut signers: Vec<Vec<u8>> = Vec::new();
    let mut sigs = Vec::new();
    for c in episode.calls_of(model) {
        if c.signature.is_empty() {
            sigs.push(None);
            continue;
        }
        let (key, signature) = split(&c.signature)?;
        let signer = match signers.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                signers.push(key);
                signers.len() - 1
            }
        };
        sigs.push(Some(CompactSignature {
            signer: signer as u32,
            signature,
        }));
    }
    let manifest = EpisodeManifest {
        episode_id: episode.id.clone(),
        task_id: episode.task_id.clone(),
        group_id: episode.group_id.clone(),
        group_size,
        reward: episode.reward_for(model),
        rewards: episode.rewards.clone(),
        status: episode.status.clone(),
        timelines: vec![tm],
    };
    let bytes = frags.into_iter().map(|(h, f)| (h, f.encode())).collect();
    Ok((
        SubmitManifest {
            manifest,
            signers,
            signatures: vec![sigs],
        },
        bytes,
    ))
}

/// Submits a prepared episode to `peer`. `fragments` must hold every fragment the server
/// may ask for.
pub async fn submit(
    swarm: &SwarmHandle,
    peer: PeerId,
    manifest: &SubmitManifest,
    fragments: &HashMap<FragmentHash, Vec<u8>>,
) -> Result<SubmitOutcome, SubmitFailure> {
    let limit = swarm.cfg.max_frame_bytes;
    let mut s = swarm.open(peer, SUBMIT).await?;
    let encode = |e: postcard::Error| SubmitFailure::Encode(e.to_string());
    let mut bytes_sent = postcard::to_allocvec(manifest).map_err(encode)?.len() + 4;
    write_frame(&mut s, manifest, limit).await?;
    let want = match read_frame::<_, SubmitReply>(&mut s, limit).await? {
        SubmitReply::Want(w) => w,
        other => {
            return Ok(SubmitOutcome {
                reply: other,
                fragment_bytes_sent: 0,
                bytes_sent,
            })
        }
    };
    let mut fragment_bytes_sent = 0;
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut batch_bytes = 0;
    let budget = limit / 2;
    for (i, h) in want.iter().enumerate() {
        let b = fragments.get(h).ok_or(SubmitFailure::UnknownFragment(*h))?;
        fragment_bytes_sent += b.len();
        batch_bytes += b.len() + 5;
        batch.push(b.clone());
        if batch_bytes >= budget || i + 1 == want.len() {
            let fb = FragmentBatch {
                fragments: std::mem::take(&mut batch),
            };
            bytes_sent += postcard::to_allocvec(&fb).map_err(encode)?.len() + 4;
            batch_bytes = 0;
            write_frame(&mut s, &fb, limit).await?;
        }
    }
    let reply: SubmitReply = read_frame(&mut s, limit).await?;
    Ok(SubmitOutcome {
        reply,
        fragment_bytes_sent,
        bytes_sent,
    })
}

/// Submits `episode`'s calls of `model` to one of the model's providers: the provider
/// chosen by rendezvous hashing on the group id (so a group's episodes meet on one server),
/// asked twice, then the others if it fails. A server's verdict (stored or rejected) is
/// final; only transport failures move on. Waits up to `wait` for a provider.
pub async fn submit_to_model(
    swarm: &SwarmHandle,
    providers: impl Fn() -> Vec<PeerId>,
    episode: &Episode,
    model: &str,
    group_size: u32,
    wait: std::time::Duration,
) -> Result<(PeerId, SubmitOutcome), SubmitFailure> {
    let (manifest, frags) = prepare(episode, model, group_size)?;
    let deadline = std::time::Instant::now() + wait;
    let mut errors = Vec::new();
    loop {
        let mut ps = providers();
        ps.sort_by_key(|p| {
            let mut h = blake3::Hasher::new();
            h.update(episode.group_id.as_bytes());
            h.update(&p.to_bytes());
            std::cmp::Reverse(*h.finalize().as_bytes())
        });
        for (i, p) in ps.into_iter().enumerate() {
            // The chosen provider is asked twice: a submission whose acknowledgement was
            // lost is then acknowledged by the server that stored it, not stored again
            // elsewhere (a server recognises the same episode; another would not).
            for attempt in 0..if i == 0 { 2 } else { 1 } {
                if attempt > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                }
                match submit(swarm, p, &manifest, &frags).await {
                    Ok(out) => return Ok((p, out)),
                    Err(e) => {
                        tracing::warn!(peer = %p, episode = episode.id, "submission failed: {e}");
                        errors.push(format!("{p}: {e}"));
                    }
                }
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(SubmitFailure::NoProvider {
                model: model.to_string(),
                episode: episode.id.clone(),
                errors,
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}
