//! A small simulated swarm (about 50 peers) over internet-like links, with the real swarm
//! code: the protocol properties the big scenarios measure hold at this size.

use std::time::Duration;

use agentjet_netsim::scenario::{discovery, partition, Env};
use agentjet_netsim::NetConfig;

use crate::one_at_a_time;

fn env(seed: u64) -> Env {
    // RUST_LOG=agentjet::collective=info (say) shows what the peers did; errors only by default.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()))
        .with_test_writer()
        .try_init();
    Env {
        net: NetConfig {
            seed,
            latency: (Duration::from_millis(20), Duration::from_millis(150)),
            bandwidth: 100e6 / 8.0,
            loss: 0.001,
            ..Default::default()
        },
        out: std::env::temp_dir(),
        nat: None,
    }
}

/// Every newly started client finds a provider, each through a DHT lookup, while every
/// peer trims its connections to 16 (without the trimmer each peer ends connected to
/// nearly all 49 others).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_new_client_finds_a_provider_among_50_peers_that_trim_connections() {
    let _one = one_at_a_time().await;
    let a = discovery::Args {
        sizes: vec![50],
        servers: 3,
        clients: 5,
        idle: Duration::from_secs(120),
        // As the scenario's command: a DHT walk per peer every 30 s (the binary's) would
        // keep opening fresh connections, each spared for the grace.
        rebootstrap: Duration::from_secs(300),
        max_connections: 16,
        grace: Duration::from_secs(5),
        ping: Duration::from_secs(5),
        settle_max: discovery::SETTLE_MAX,
    };
    let o = discovery::run_size(&env(3), &a, 50).await.unwrap();
    assert_eq!(o.found, 5, "{o:?}");
    assert_eq!(o.times.len(), 5);
    assert!(o.requests.iter().all(|&r| r > 0), "{o:?}");
    // Once the DHT walks of the start are over (the scenario waits up to 90 s for it),
    // at most the high mark.
    assert!(
        o.connections <= 16.0,
        "{} connections per peer after {:?}",
        o.connections,
        o.connections_wait
    );
}

/// A partition splits every view in two; after the heal every view holds every peer and
/// every server's latest version again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_split_in_a_partition_and_converge_after_it_heals() {
    let _one = one_at_a_time().await;
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

/// A four-member training group in a swarm of 50 trains with DiLoCo through a member's
/// crash over internet-like links (a new member joins by fetching the group's state, the
/// outer state included) and its members end with bit-identical parameters.
///
/// Synchronous mode through a crash is tested in process
/// (`member_loop::a_member_killed_mid_round_leaves_two_that_retry_the_step_once`) and with
/// real processes and the real trainer (`tests/e2e/elastic.rs`,
/// `a_member_killed_mid_all_reduce_leaves_two_that_finish_the_step_and_go_on`); this one
/// runs the mode whose crash path has neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_four_member_group_trains_through_a_crash_and_ends_bit_identical() {
    let _one = one_at_a_time().await;
    use agentjet::collective::Wire;
    use agentjet_netsim::member::Mode;
    use agentjet_netsim::scenario::training;
    let a = training::Args {
        members: 4,
        peers: 45,
        modes: vec![],
        // A bound: a member crashes after the group's third outer step, and the run ends
        // three outer steps after the crash. The group then needs a round's timeout, a
        // ballot, the joiner's state fetch and new links (20-26 s here on a busy process)
        // before its next step.
        duration: Duration::from_secs(150),
        values: 50_000,
        model_values: 50_000,
        compute: Duration::from_millis(100),
        crashes: 1,
        crash_every_steps: Some(3),
        wire: Wire::F32,
        timeout: Duration::from_secs(10),
        form_limit: Duration::from_secs(120),
        status: None,
    };
    let mode = Mode::Diloco { every: 3 };
    let o = training::run_mode(&env(7), &a, mode).await.unwrap();
    let name = mode.name();
    assert_eq!(o.member_errors, 0, "{name}: {o:?}");
    assert!(o.identical, "{name}: members differ at the end: {o:?}");
    assert_eq!(o.crashes, 1, "{name}: {o:?}");
    assert!(
        o.syncs >= 1,
        "{name}: the new member never fetched the state: {o:?}"
    );
    assert!(o.after_crash >= 1, "{name}: no step after the crash: {o:?}");
    assert!(o.final_group_steps >= 3, "{name}: {o:?}");
}
