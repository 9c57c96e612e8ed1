//! The follower (`--role server --follow`): a server that serves its training group's
//! latest policy version without training. The loop that picks each version and fetches
//! it, sharing the work with the other followers, is the broadcast's
//! ([`crate::collective::broadcast::Follower`]); here each fetched version goes to the
//! engine, which swaps it in between two decode steps (a request reports the version it
//! started on), and the server then holds and serves it, and says so (events, stdout).
//!
//! A manifest is taken only from a peer the swarm's trust lets train the model in the
//! group: a follower in an open swarm has nobody to believe, and refuses to start.
//!
//! Owns: installing a followed version in the served model.

use std::sync::Arc;

use super::events::ServerEvent;
use super::weights::{tensors_of, Broadcast};
use super::ServedModel;
use crate::base::stop::TaskTracker;
use crate::base::Stop;
use crate::collective::broadcast::follow::{newest, Failure, Fetched};
use crate::collective::broadcast::{FollowConfig, Follower, WeightsNet};
use crate::swarm::{SwarmHandle, Trust};

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

/// Starts following: the loop runs until the role stops. A version whose tensors do not
/// have `shapes` (the served model's, or its adapter's) is refused before it is fetched.
pub fn spawn(
    served: Arc<ServedModel>,
    bc: Arc<Broadcast>,
    shapes: Vec<Vec<i64>>,
    tasks: &TaskTracker,
    stop: Stop,
) {
    let follower = Follower::new(
        bc.holder.clone(),
        Arc::new(served.swarm.clone()) as Arc<dyn WeightsNet>,
        FollowConfig {
            shapes: Some(shapes),
            ..FollowConfig::default()
        },
    );
    tasks.spawn(async move {
        follower
            .run(stop, |f| install(served.clone(), bc.clone(), f))
            .await
    });
}

/// Serves a fetched version: the engine swaps it in, then the server holds it.
async fn install(served: Arc<ServedModel>, bc: Arc<Broadcast>, f: Fetched) -> Result<(), Failure> {
    for (peer, why) in &f.report.backed_off {
        tracing::warn!(model = served.name, %peer, "backed off a weights source: {why}");
        served.events.emit(ServerEvent::SourceBackedOff {
            model: served.name.clone(),
            peer: peer.clone(),
            reason: why.clone(),
        });
    }
    let Fetched {
        held,
        param_hash: hash,
        report,
        started,
        fetch_s,
    } = f;
    let version = held.version();
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
