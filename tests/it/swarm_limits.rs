//! The bounds a serving peer puts on every other peer: concurrent streams per peer and
//! protocol, and the rate of new streams. Two in-process nodes on 127.0.0.1 (QUIC); the
//! refused side gets the reason, and the serving side keeps serving once the peer is back
//! under the limit.

use std::time::Duration;

use agentjet::swarm::frame::{read_frame, write_frame};
use agentjet::swarm::{spawn_node, Keypair, Role, SwarmConfig, SwarmError, SwarmHandle};
use libp2p::StreamProtocol;

const HOLD: StreamProtocol = StreamProtocol::new("/agentjet/test-hold/1");

async fn node(
    role: Role,
    boot: Option<String>,
    streams: usize,
    rate: f64,
    burst: f64,
) -> SwarmHandle {
    let mut cfg = SwarmConfig::new(role, Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
    cfg.bootstrap = boot.into_iter().map(|b| b.parse().unwrap()).collect();
    cfg.max_streams_per_peer = streams;
    cfg.max_requests_per_s = rate;
    cfg.request_burst = burst;
    spawn_node(cfg).await.unwrap()
}

/// A stream that the serving side holds open until the opener sends a byte-sized frame.
async fn hold(
    h: &SwarmHandle,
    server: &SwarmHandle,
) -> Result<agentjet::swarm::PeerStream, String> {
    h.open(server.peer_id, HOLD).await.map_err(|e| match e {
        SwarmError::Refused { reason, .. } => reason,
        other => format!("not a refusal: {other}"),
    })
}

/// Serves HOLD: reads one byte-sized frame, answers it plus one.
fn serve_hold(server: &SwarmHandle) {
    server
        .serve(HOLD, |_peer, mut s| async move {
            let x: u8 = read_frame(&mut s, 64).await.map_err(|e| e.to_string())?;
            write_frame(&mut s, &(x + 1), 64)
                .await
                .map_err(|e| e.to_string())
        })
        .unwrap();
}

async fn release(mut s: agentjet::swarm::PeerStream) {
    write_frame(&mut s, &1u8, 64).await.unwrap();
    let echoed: u8 = read_frame(&mut s, 64).await.unwrap();
    assert_eq!(echoed, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_streams_and_too_fast_requests_are_refused_with_the_reason() {
    // Two streams at once per peer; one new stream every 200 ms after a burst of 4.
    let server = node(Role::Server, None, 2, 5.0, 4.0).await;
    serve_hold(&server);
    let addr = server.listen_addrs().await[0].to_string();
    let client = node(Role::Client, Some(addr), 256, 500.0, 1000.0).await;

    // The concurrency bound: a third stream while two are open is refused.
    let a = hold(&client, &server).await.expect("first stream");
    let b = hold(&client, &server).await.expect("second stream");
    let refused = hold(&client, &server).await.expect_err("a third stream");
    assert!(
        refused.contains("too many concurrent") && refused.contains("limit 2"),
        "{refused}"
    );
    // Once one closes, a new one is admitted (this is the burst's fourth token).
    release(a).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let c = hold(&client, &server)
        .await
        .expect("a stream after one closed");
    release(b).await;
    release(c).await;

    // The rate bound: the burst is spent; the next streams within the same instant are
    // refused for the rate, and after a pause the peer is served again.
    let mut rate_refusals = 0;
    for _ in 0..3 {
        match hold(&client, &server).await {
            Ok(s) => release(s).await,
            Err(why) => {
                assert!(why.contains("over the request rate limit (5/s"), "{why}");
                rate_refusals += 1;
            }
        }
    }
    assert!(rate_refusals >= 2, "{rate_refusals} rate refusals");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let d = hold(&client, &server)
        .await
        .expect("served again after a pause");
    release(d).await;

    // Other peers are not affected by one peer's limits.
    let other = node(
        Role::Client,
        Some(server.listen_addrs().await[0].to_string()),
        256,
        500.0,
        1000.0,
    )
    .await;
    let e = hold(&other, &server).await.expect("another peer is served");
    release(e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_that_only_listen_on_tcp_still_talk_and_find_providers() {
    let tcp = |boot: Option<String>| {
        let mut cfg = SwarmConfig::new(Role::Server, Keypair::generate_ed25519());
        cfg.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
        cfg.bootstrap = boot.into_iter().map(|b| b.parse().unwrap()).collect();
        spawn_node(cfg)
    };
    let server = tcp(None).await.unwrap();
    serve_hold(&server);
    server.provide("over-tcp").await.unwrap();
    let addr = server.listen_addrs().await[0].to_string();
    assert!(addr.contains("/tcp/"), "{addr}");
    let client = tcp(Some(addr)).await.unwrap();
    let t0 = std::time::Instant::now();
    while !client
        .providers("over-tcp")
        .await
        .unwrap()
        .contains(&server.peer_id)
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the provider was not found over TCP"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let s = hold(&client, &server).await.expect("a stream over TCP");
    release(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_streams_opened_at_once_is_served_whole() {
    // libp2p-stream hands inbound streams to the accept loop through a channel with room
    // for one and closes the rest unread; 96 streams opened at once arrive faster than
    // the loop takes them, and every one must still be served (opened again by `open`).
    let server = node(Role::Server, None, 256, 1000.0, 1000.0).await;
    serve_hold(&server);
    let addr = server.listen_addrs().await[0].to_string();
    let client = node(Role::Client, Some(addr), 256, 1000.0, 1000.0).await;
    let first = hold(&client, &server).await.expect("one stream");
    release(first).await;
    let opens = (0..96).map(|_| hold(&client, &server));
    let streams = futures::future::join_all(opens).await;
    let failed: Vec<&String> = streams.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 96 failed: {failed:?}",
        failed.len()
    );
    for s in streams {
        release(s.unwrap()).await;
    }
}
