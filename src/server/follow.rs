//! The follower (`--role server --follow`): a server that serves its training group's
//! latest policy version without training. It watches the gossip for the versions the
//! group's members announce, takes a new version's manifest from a member (checked
//! against the id the member announced), fetches the changed chunks
//! ([`fetch_version_with`]) and hands the new weights to the engine, which swaps them in
//! between two decode steps (a request reports the version it started on). It then holds
//! and serves the version itself.
//!
//! The followers share each version's fetch (as BitTorrent peers do): its chunks are dealt
//! round-robin to the followers in peer-id order; each takes its own share from the
//! members and serves every chunk as soon as it has it, and takes the other shares from
//! their owners, turning to the members only for the share of a follower that has not
//! started the version within a second or stays silent. The members so send about one
//! copy of the changed bytes, whatever the number of followers.
//!
//! A manifest is taken only from a peer the swarm's trust lets train the model in the
//! group (certified for it, trusting a run; a key holder in a closed swarm): a follower
//! in an open swarm has nobody to believe, and refuses to start.
//!
//! Owns: choosing the version to follow and its sources, and installing it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::events::ServerEvent;
use super::weights::{hex8, tensors_of, Broadcast};
use super::ServedModel;
use crate::base::stop::TaskTracker;
use crate::base::Stop;
use crate::collective::broadcast::{
    fetch_version_with, ChunkSource, FetchConfig, Held, Manifest, PeerSource, Share,
};
use crate::swarm::{PeerId, Role, SwarmHandle, Trust};

/// How often the follower looks at the gossip for a newer version.
const TICK: Duration = Duration::from_millis(100);
/// How long a follower waits, with no chunk coming from the other followers, before it
/// asks the members for the chunks of a follower that went silent.
const SHARE_PATIENCE: Duration = Duration::from_secs(3);
/// How long a follower waits for another to start fetching a version (it heard of it
/// later) before taking that one's share from the members.
const SHARE_GRACE: Duration = Duration::from_secs(1);
/// Chunk requests in flight at once.
const FETCH_PARALLEL: usize = 16;
/// One request's bound (a chunk of 1 MiB over a slow link takes seconds).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a server cannot follow in this swarm, if it cannot.
pub fn untrusted(swarm: &SwarmHandle, model: &str) -> Option<String> {
    match swarm.trust() {
        Trust::Open => Some(
            "--follow takes weights only from the training group's members, and in an open \
             swarm (neither --run nor --swarm-key) no member can be checked: pass --swarm-key \
             or --run"
                .into(),
        ),
        _ if !swarm.may_sign_self(model) => Some(format!(
            "--follow serves {model:?} for the group to train on, and this server's \
             certificate does not let it serve {model:?}: its calls would be trained nowhere"
        )),
        _ => None,
    }
}

/// The newest version the group announces: its number and manifest id, the members that
/// announce it (whose manifest is believed), and every peer holding it.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    version: u64,
    id: [u8; 32],
    members: Vec<PeerId>,
    holders: Vec<PeerId>,
}

/// What the view says of `model`'s versions in `group`.
fn newest(swarm: &SwarmHandle, model: &str, group: &str) -> Option<Target> {
    let view = swarm.view();
    // (version, id) -> members announcing it
    let mut announced: BTreeMap<(u64, [u8; 32]), Vec<PeerId>> = BTreeMap::new();
    let mut holders: BTreeMap<(u64, [u8; 32]), Vec<PeerId>> = BTreeMap::new();
    for e in view
        .iter()
        .filter(|e| !e.is_self && e.status.role == Role::Server)
    {
        let Some(m) = e.status.models.iter().find(|m| m.name == model) else {
            continue;
        };
        let Some(w) = m.weights.as_ref().filter(|w| w.group == group) else {
            continue;
        };
        let key = (w.version, w.manifest);
        holders.entry(key).or_default().push(e.peer);
        let member = !w.follower
            && m.group.as_ref().is_some_and(|g| g.name == group)
            && swarm.may_train_with(e, model, group);
        if member {
            announced.entry(key).or_default().push(e.peer);
        }
    }
    // The newest version; of two manifests of one version, the one more members announce.
    let ((version, id), members) = announced
        .into_iter()
        .max_by_key(|((v, _), m)| (*v, m.len()))?;
    Some(Target {
        version,
        id,
        members,
        holders: holders.remove(&(version, id)).unwrap_or_default(),
    })
}

/// The followers of `model` in `group` the view shows (they fetch its versions too).
pub(super) fn followers_of(swarm: &SwarmHandle, model: &str, group: &str) -> Vec<PeerId> {
    swarm
        .view()
        .iter()
        .filter(|e| !e.is_self && e.status.role == Role::Server && swarm.may_sign(e, model))
        .filter(|e| {
            e.status.models.iter().any(|m| {
                m.name == model
                    && m.weights
                        .as_ref()
                        .is_some_and(|w| w.follower && w.group == group)
            })
        })
        .map(|e| e.peer)
        .collect()
}

/// Why a version was not followed.
enum Failure {
    /// A transfer failed: try again.
    Again(String),
    /// The version itself cannot be served here (another layout, a wrong hash).
    Refused(String),
}

impl From<String> for Failure {
    fn from(e: String) -> Failure {
        Failure::Again(e)
    }
}

/// Starts following: the loop runs until the role stops.
pub fn spawn(served: Arc<ServedModel>, bc: Arc<Broadcast>, tasks: &TaskTracker, stop: Stop) {
    let rt = tokio::runtime::Handle::current();
    tasks.spawn(async move {
        // Hear every peer's status once before the first fetch: a starting follower then
        // knows the other holders of the version, not only the members.
        tokio::select! {
            _ = tokio::time::sleep(served.swarm.cfg.status_interval * 2) => {}
            _ = stop.requested() => return,
        }
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0u32;
        // Versions this follower cannot serve (fetched again, they would be refused again).
        let mut refused = std::collections::HashSet::new();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.requested() => return,
            }
            let Some(target) = newest(&served.swarm, &served.name, &bc.group) else {
                continue;
            };
            let held = bc.store.latest(&served.name);
            let at = held.as_ref().map(Held::version);
            let lag = target.version.saturating_sub(at.unwrap_or(0));
            bc.current(Some(lag));
            if held.as_ref().is_some_and(|h| h.id == target.id) || refused.contains(&target.id) {
                continue;
            }
            match follow(&served, &bc, &target, held, &rt).await {
                Ok(()) => failures = 0,
                Err(Failure::Refused(why)) => {
                    tracing::warn!(
                        model = served.name,
                        version = target.version,
                        "following: not serving this version: {why}"
                    );
                    eprintln!("following: version {} not served: {why}", target.version);
                    refused.insert(target.id);
                }
                Err(Failure::Again(e)) => {
                    failures += 1;
                    tracing::warn!(
                        model = served.name,
                        version = target.version,
                        "following: {e}"
                    );
                    // Wait a little longer after each failure (at most 5 s).
                    let pause = TICK * (1u32 << failures.min(5)).min(25);
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stop.requested() => return,
                    }
                }
            }
        }
    });
}

/// Fetches `target` and serves it.
async fn follow(
    served: &Arc<ServedModel>,
    bc: &Arc<Broadcast>,
    target: &Target,
    held: Option<Held>,
    rt: &tokio::runtime::Handle,
) -> Result<(), Failure> {
    let source = |p: PeerId| {
        Arc::new(PeerSource::new(
            served.swarm.clone(),
            p,
            &served.name,
            rt.clone(),
            REQUEST_TIMEOUT,
        ))
    };
    let mut manifest: Option<Manifest> = None;
    let mut why = Vec::new();
    for &p in &target.members {
        match source(p).manifest(target.version, &target.id).await {
            Ok(m) => {
                manifest = Some(m);
                break;
            }
            Err(e) => why.push(format!("{p}: {e}")),
        }
    }
    let manifest = manifest.ok_or_else(|| {
        format!(
            "no member gave the manifest of version {}: {}",
            target.version,
            why.join("; ")
        )
    })?;
    // The followers share the work (each takes its share of the chunks from the members,
    // the rest from each other): the members' upload is what bounds the broadcast.
    let me = served.swarm.peer_id;
    let mut followers = followers_of(&served.swarm, &served.name, &bc.group);
    followers.retain(|p| *p != me);
    let members: Vec<PeerId> = target
        .members
        .iter()
        .copied()
        .filter(|p| target.holders.contains(p))
        .collect();
    let mut ranked: Vec<PeerId> = followers.iter().copied().chain([me]).collect();
    ranked.sort_by_key(|p| p.to_bytes());
    let cfg = FetchConfig {
        share: Some(Share {
            owners: ranked
                .iter()
                .map(|p| followers.iter().position(|f| f == p))
                .collect(),
            patience: SHARE_PATIENCE,
            grace: SHARE_GRACE,
        }),
        // Requests are small and many (a delta chunk is a few kB): enough in flight to
        // fill a link with a round trip of 100 ms or more.
        parallel: FETCH_PARALLEL,
        ..FetchConfig::default()
    };
    let sources: Vec<Arc<dyn ChunkSource>> = followers
        .iter()
        .chain(&members)
        .map(|&p| source(p) as Arc<dyn ChunkSource>)
        .collect();
    let started = std::time::Instant::now();
    let store = bc.store.clone();
    store.begin(Arc::new(manifest.clone()));
    let fetched = tokio::task::spawn_blocking(move || {
        let have = held
            .as_ref()
            .map(|h| (h.manifest.as_ref(), h.snapshot.as_slice()));
        let model = manifest.model.clone();
        let version = manifest.version;
        let on_chunk = |i: usize, b: &[u8]| store.received(&model, version, i, b);
        let r = fetch_version_with(&manifest, have, &sources, &cfg, &on_chunk);
        if r.is_err() {
            store.abandon(&model, version);
        }
        r.map(|(b, r)| (b, r, manifest))
    })
    .await
    .map_err(|e| e.to_string())?;
    let (bytes, report, manifest) = fetched.map_err(|e| e.to_string())?;
    for (peer, why) in &report.backed_off {
        tracing::warn!(model = served.name, %peer, "backed off a weights source: {why}");
        served.events.emit(ServerEvent::SourceBackedOff {
            model: served.name.clone(),
            peer: peer.clone(),
            reason: why.clone(),
        });
    }
    bc.fetched.fetch_add(report.bytes(), Ordering::Relaxed);
    // A float32 snapshot is hashed as the group hashes its parameters: check the claim.
    let claimed = manifest
        .param_hash
        .get(..16)
        .unwrap_or(&manifest.param_hash)
        .to_string();
    let float32 = manifest.tensors.iter().all(|t| t.dtype == "Float");
    let hash = if float32 {
        let own = hex8(blake3::hash(&bytes).as_bytes());
        if own != claimed {
            return Err(Failure::Refused(format!(
                "version {}'s parameters hash to {own}, not to the {claimed} its manifest says",
                manifest.version
            )));
        }
        own
    } else {
        claimed
    };
    let version = manifest.version;
    let fetch_s = started.elapsed().as_secs_f64();
    let held = Held::new(manifest, bytes);
    let install = held.clone();
    let s = served.clone();
    tokio::task::spawn_blocking(move || {
        let params = tensors_of(&install.manifest, &install.snapshot).map_err(Failure::Refused)?;
        s.serve_weights(&params, install.version())
            .map_err(|e| Failure::Refused(format!("the engine refused the weights: {e}")))
    })
    .await
    .map_err(|e| Failure::Again(e.to_string()))??;
    let lag = newest(&served.swarm, &served.name, &bc.group)
        .map_or(0, |t| t.version.saturating_sub(version));
    bc.install(&held, &hash, lag);
    served.publish_status();
    let seconds = started.elapsed().as_secs_f64();
    let by_source: Vec<String> = report
        .bytes_by_source
        .iter()
        .map(|(p, b)| format!("{}={b}", short(p)))
        .collect();
    println!(
        "following: version {version} ({} of {} chunks, {} bytes from {}; fetched in \
         {fetch_s:.2}s, serving after {seconds:.2}s), params {hash}",
        report.chunks,
        held.manifest.chunks.len(),
        report.bytes(),
        by_source.join(" ")
    );
    served.events.emit(ServerEvent::Followed {
        model: served.name.clone(),
        version,
        param_hash: hash,
        chunks: report.chunks,
        bytes: report.bytes(),
        bytes_by_source: report.bytes_by_source.clone(),
        full_bytes: held.manifest.total_bytes(),
        seconds,
        unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    });
    Ok(())
}

/// A peer id's last 8 characters (log lines).
fn short(p: &str) -> &str {
    &p[p.len().saturating_sub(8)..]
}
