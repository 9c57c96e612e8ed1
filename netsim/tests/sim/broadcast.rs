//! The weight broadcast over internet-like links (scenario 6, small): a trainer and 6
//! followers, real swarm nodes running the broadcast's own follower loop, chunk protocol
//! and version store.

use std::time::Duration;

use agentjet_netsim::scenario::{broadcast, Env};
use agentjet_netsim::{NatMix, NetConfig};

use crate::one_at_a_time;

/// Every follower holds each new version, checked against the manifest the trainer
/// announced; the followers take most of it from each other, so the trainer sends about
/// one copy of the changed bytes (at most two) whatever their number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_followers_reach_every_version_and_the_trainer_sends_about_one_copy() {
    let _one = one_at_a_time().await;
    let env = Env {
        net: NetConfig {
            seed: 6,
            latency: (Duration::from_millis(20), Duration::from_millis(60)),
            bandwidth: 100e6 / 8.0,
            loss: 0.001,
            ..Default::default()
        },
        out: std::env::temp_dir(),
        nat: None,
    };
    let a = six_followers_two_versions();
    let o = broadcast::run_once(&env, &a).await.unwrap();
    assert_eq!(o.versions.len(), 2);
    for v in &o.versions {
        assert_eq!(v.times.len(), 6, "version {}: {v:?}", v.version);
        assert_eq!(v.wrong, 0, "a follower holds another manifest: {v:?}");
        // Every chunk changes (a step moves values all over each chunk), each as a delta.
        assert_eq!(v.changed, v.chunks, "{v:?}");
        assert!(
            v.copy_bytes > 0.0 && v.copy_bytes < 0.2 * a.model_bytes as f64,
            "{v:?}"
        );
        assert!(v.trainer_bytes <= 2.0 * v.copy_bytes, "{v:?}");
        assert!(v.from_followers > 0.5, "{v:?}");
    }
}

/// Followers behind cone and symmetric NATs (the mix 30/40/30, the trainer placed by it
/// too) hold every version: their chunk streams follow the swarms' connections (direct,
/// hole-punched, or through a relay), and the followers still take most of each version
/// from each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_behind_nats_reach_every_version_over_direct_and_relayed_streams() {
    let _one = one_at_a_time().await;
    let env = Env {
        net: NetConfig {
            seed: 7,
            latency: (Duration::from_millis(20), Duration::from_millis(60)),
            bandwidth: 100e6 / 8.0,
            ..Default::default()
        },
        out: std::env::temp_dir(),
        nat: Some(NatMix::parse("30,40,30").unwrap()),
    };
    let a = six_followers_two_versions();
    let o = broadcast::run_once(&env, &a).await.unwrap();
    for v in &o.versions {
        assert_eq!(v.times.len(), 6, "version {}: {v:?}", v.version);
        assert_eq!(v.wrong, 0, "a follower holds another manifest: {v:?}");
        assert!(v.from_followers > 0.5, "{v:?}");
    }
    // Streams to a peer its swarm could not connect to in time fail to open, as the
    // product's do (the follower backs that source off and fetches from the others).
    let [direct, relayed, _unrouted, cut] = o.streams;
    assert!(direct > 0 && relayed > 0, "{:?}", o.streams);
    assert_eq!(cut, 0, "{:?}", o.streams);
    let r = o.routes.expect("routes");
    assert_eq!(r.relayed_peers, r.natted, "{r:?}");
}

/// Six followers of a 50 MB model (scaled from 1 MB), two versions, 1 MiB chunks.
fn six_followers_two_versions() -> broadcast::Args {
    broadcast::Args {
        followers: 6,
        peers: 0,
        model_bytes: 50_000_000,
        scale: 50.0,
        chunk: 1 << 20,
        versions: 2,
        lr: broadcast::DEFAULT_LR,
        parallel: 16,
        limit: Duration::from_secs(60),
        status_interval: None,
    }
}
