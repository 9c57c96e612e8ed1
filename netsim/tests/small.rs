//! A small simulated swarm (about 50 peers) over internet-like links, with the real swarm
//! code: the protocol properties the big scenarios measure hold at this size.

use std::time::Duration;

use agentjet_netsim::scenario::{discovery, partition, Env};
use agentjet_netsim::NetConfig;

fn env(seed: u64) -> Env {
    Env {
        net: NetConfig {
            seed,
            latency: (Duration::from_millis(20), Duration::from_millis(150)),
            bandwidth: 100e6 / 8.0,
            loss: 0.001,
            ..Default::default()
        },
        out: std::env::temp_dir(),
    }
}

/// Every newly started client finds a provider, each through a DHT lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_new_client_finds_a_provider_among_50_peers() {
    let a = discovery::Args {
        sizes: vec![50],
        servers: 3,
        clients: 5,
        idle: Duration::from_secs(120),
    };
    let o = discovery::run_size(&env(3), &a, 50).await.unwrap();
    assert_eq!(o.found, 5, "{o:?}");
    assert_eq!(o.times.len(), 5);
    assert!(o.requests.iter().all(|&r| r > 0), "{o:?}");
}

/// A partition splits every view in two; after the heal every view holds every peer and
/// every server's latest version again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_split_in_a_partition_and_converge_after_it_heals() {
    let a = partition::Args {
        sizes: vec![50],
        servers: 4,
        hold: Duration::from_secs(15),
        limit: Duration::from_secs(120),
    };
    let o = partition::run_size(&env(5), &a, 50).await.unwrap();
    assert_eq!(o.split_views, 50, "{o:?}");
    assert!(o.converged.is_some(), "{o:?}");
}
