//! Episode submission: manifest → the server's want list → only the wanted fragments →
//! the server's verdict (stored only once verified and on disk).

use std::collections::HashMap;

use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::protocol::{
    CompactSignature, FragmentBatch, SubmitManifest, SubmitReply, SUBMIT,
};
use crate::swarm::sign::split;
use crate::swarm::{PeerId, SwarmHandle};
use crate::timeline::fragment::{fragment_timeline, EpisodeManifest, FragmentHash};
use crate::timeline::Episode;

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

/// The manifest (with signatures) and the encoded fragments of `episode`'s calls of `model`.
pub fn prepare(
    episode: &Episode,
    model: &str,
) -> Result<(SubmitManifest, HashMap<FragmentHash, Vec<u8>>), String> {
    let t = episode.timeline(model).map_err(|e| e.to_string())?;
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
) -> Result<SubmitOutcome, String> {
    let limit = swarm.cfg.max_frame_bytes;
    let mut s = swarm.open(peer, SUBMIT).await.map_err(|e| e.to_string())?;
    let mut bytes_sent = postcard::to_allocvec(manifest)
        .map_err(|e| e.to_string())?
        .len()
        + 4;
    write_frame(&mut s, manifest, limit)
        .await
        .map_err(|e| e.to_string())?;
    let want = match read_frame::<_, SubmitReply>(&mut s, limit)
        .await
        .map_err(|e| e.to_string())?
    {
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
        let b = fragments.get(h).ok_or_else(|| {
            format!("the server asked for fragment {h}, which is not in this episode")
        })?;
        fragment_bytes_sent += b.len();
        batch_bytes += b.len() + 5;
        batch.push(b.clone());
        if batch_bytes >= budget || i + 1 == want.len() {
            let fb = FragmentBatch {
                fragments: std::mem::take(&mut batch),
            };
            bytes_sent += postcard::to_allocvec(&fb).map_err(|e| e.to_string())?.len() + 4;
            batch_bytes = 0;
            write_frame(&mut s, &fb, limit)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    let reply: SubmitReply = read_frame(&mut s, limit).await.map_err(|e| e.to_string())?;
    Ok(SubmitOutcome {
        reply,
        fragment_bytes_sent,
        bytes_sent,
    })
}
