//! Peers behind NAT in the simulation, running the binary's traversal over it: relay
//! reservations on public peers, DCUtR hole punches between cone NATs, relayed connections
//! where a symmetric NAT defeats the punch.

use std::time::{Duration, Instant};

use agentjet::swarm::{LinkKind, Reachability, Role};
use agentjet_netsim::cluster::{Cluster, NatMix, PeerTiming, SimPeer};
use agentjet_netsim::{Nat, NetConfig, Network};

use crate::one_at_a_time;

async fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `a` connects to `b` (through whatever address `b` offers), retried while `a` has not
/// learned `b`'s relayed address yet.
async fn connect(a: &SimPeer, b: &SimPeer) {
    let t0 = Instant::now();
    loop {
        match a.handle.connect(b.peer_id).await {
            Ok(()) => return,
            Err(e) if t0.elapsed() > Duration::from_secs(60) => {
                panic!("node {} -> node {}: {e}", a.node, b.node)
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nat_peers_reserve_relays_punch_through_cone_nats_and_stay_relayed_behind_symmetric_ones() {
    let _one = one_at_a_time().await;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()))
        .with_test_writer()
        .try_init();
    let net = Network::new(NetConfig {
        seed: 21,
        latency: (Duration::from_millis(10), Duration::from_millis(60)),
        bandwidth: 100e6 / 8.0,
        ..Default::default()
    });
    let mix = NatMix::parse("30,50,20").unwrap();
    let c = Cluster::behind_nat(net, PeerTiming::default(), 2, Some(mix))
        .await
        .unwrap();
    let public = c.start_at(Role::Plain, Some(Nat::Public)).await.unwrap();
    let (c1, c2) = (
        c.start_at(Role::Plain, Some(Nat::Cone)).await.unwrap(),
        c.start_at(Role::Plain, Some(Nat::Cone)).await.unwrap(),
    );
    let (s1, s2) = (
        c.start_at(Role::Plain, Some(Nat::Symmetric)).await.unwrap(),
        c.start_at(Role::Plain, Some(Nat::Symmetric)).await.unwrap(),
    );
    assert_eq!(public.handle.reachability(), Reachability::Public);
    for p in [&c1, &c2, &s1, &s2] {
        wait_for(
            &format!("node {} reachable through a relay", p.node),
            Duration::from_secs(60),
            || p.handle.reachability() == Reachability::Relayed,
        )
        .await;
    }
    // A cone NAT to a cone NAT: relayed first, then hole-punched.
    connect(&c1, &c2).await;
    wait_for("c1-c2 hole-punched", Duration::from_secs(60), || {
        c1.handle
            .link_kinds(&c2.peer_id)
            .contains(&LinkKind::HolePunched)
            || c2
                .handle
                .link_kinds(&c1.peer_id)
                .contains(&LinkKind::HolePunched)
    })
    .await;
    // A symmetric NAT defeats the punch: the pair stays relayed.
    connect(&s1, &c1).await;
    connect(&s1, &s2).await;
    let snap = || c.nat_snapshot(&c.peers());
    wait_for(
        "punches with a symmetric end tried",
        Duration::from_secs(60),
        || {
            let s = snap();
            s.punches
                .get(&(Nat::Cone, Nat::Symmetric))
                .is_some_and(|p| p.1 > 0)
                && s.punches
                    .get(&(Nat::Symmetric, Nat::Symmetric))
                    .is_some_and(|p| p.1 > 0)
        },
    )
    .await;
    let s = snap();
    assert_eq!(s.punches[&(Nat::Cone, Nat::Symmetric)].0, 0, "{s:?}");
    assert_eq!(s.punches[&(Nat::Symmetric, Nat::Symmetric)].0, 0, "{s:?}");
    assert!(s.punches[&(Nat::Cone, Nat::Cone)].0 >= 1, "{s:?}");
    for (a, b) in [(&s1, &c1), (&s1, &s2)] {
        let kinds = a.handle.link_kinds(&b.peer_id);
        assert!(
            !kinds.is_empty() && kinds.iter().all(|k| *k == LinkKind::Relayed),
            "node {} - node {}: {kinds:?}",
            a.node,
            b.node
        );
    }
    // A public peer and a peer behind NAT are never relayed; the relays hold the
    // reservations (two per peer behind NAT, at most).
    assert_eq!(
        s.pairs
            .get(&(Nat::Public, Nat::Cone))
            .map_or(0, |k| k.relayed),
        0,
        "{s:?}"
    );
    assert_eq!(s.natted, 4);
    assert_eq!(s.relayed_peers, 4);
    let held: u64 = s.relay_reservations.iter().sum();
    assert!((4..=8).contains(&held), "{s:?}");
    c.shutdown().await;
}

/// A four-member group whose members sit public, behind a cone NAT, behind a symmetric
/// NAT and public (the mix 50/25/25 in start order) trains over ring links that follow
/// the swarms' connections (direct, hole-punched or through a relay: none left unrouted)
/// and ends bit-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_members_behind_cone_and_symmetric_nats_trains_and_ends_bit_identical() {
    let _one = one_at_a_time().await;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()))
        .with_test_writer()
        .try_init();
    use agentjet::collective::Wire;
    use agentjet_netsim::member::Mode;
    use agentjet_netsim::scenario::{training, Env};
    let env = Env {
        net: NetConfig {
            seed: 8,
            latency: (Duration::from_millis(10), Duration::from_millis(60)),
            bandwidth: 100e6 / 8.0,
            ..Default::default()
        },
        out: std::env::temp_dir(),
        nat: Some(NatMix::parse("50,25,25").unwrap()),
    };
    let a = training::Args {
        members: 4,
        peers: 12,
        modes: vec![],
        duration: Duration::from_secs(60),
        values: 50_000,
        model_values: 5_000_000,
        compute: Duration::from_millis(100),
        crashes: 0,
        crash_every_steps: None,
        wire: Wire::F32,
        timeout: Duration::from_secs(10),
        form_limit: Duration::from_secs(120),
        status: None,
    };
    let mode = Mode::Diloco { every: 3 };
    let o = training::run_mode(&env, &a, mode).await.unwrap();
    assert_eq!(o.member_errors, 0, "{o:?}");
    assert!(o.identical, "members differ at the end: {o:?}");
    assert!(o.final_group_steps >= 2, "{o:?}");
    let [direct, relayed, unrouted, _cut] = o.links;
    assert!(direct + relayed >= 4, "{o:?}");
    assert_eq!(unrouted, 0, "{o:?}");
    let r = o.routes.expect("routes");
    assert_eq!(r.relayed_peers, r.natted, "{r:?}");
}
