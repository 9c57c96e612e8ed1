//! Scenario 2: how fast a status spreads through the gossip mesh, and what gossip costs.
//!
//! Per size: 3 bootstrap peers and plain peers, all publishing their status every
//! interval. After a warm-up, every peer's view is read every 250 ms for the measurement
//! window: each (observer, author, publication) seen counts once, with its delay (received
//! minus published; the peers share the process's clock). Coverage: the share of
//! (observer, author) pairs of live peers in the views at the end. Bytes: everything a
//! peer's access link carried in the window (gossip, Kademlia refreshes, ping, identify).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentjet::swarm::Role;
use serde_json::json;

use super::{gossip_interval, start_many, view_poll, Env};
use crate::cluster::{Cluster, LagProbe, PeerTiming};
use crate::net::Network;
use crate::report::{quantile, rss_bytes, svg_plot, write_results, Series, Table};

#[derive(Debug, Clone)]
pub struct Args {
    pub sizes: Vec<usize>,
    pub warmup: Duration,
    pub window: Duration,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub peers: usize,
    pub interval: Duration,
    pub delays_ms: Vec<f64>,
    pub coverage: f64,
    /// Bytes sent plus received per peer per second, mean over peers.
    pub bytes_per_peer_s: f64,
    pub lag_p99: Duration,
    pub rss: u64,
}

pub async fn run_size(env: &Env, a: &Args, n: usize) -> anyhow::Result<Outcome> {
    anyhow::ensure!(n >= 4, "the gossip scenario needs at least 4 peers");
    let interval = gossip_interval(n);
    let timing = PeerTiming {
        status_interval: interval,
        ..Default::default()
    };
    let c = Cluster::new(Network::new(env.net.clone()), timing, 3).await?;
    start_many(&c, Role::Plain, n - 3).await?;
    // Long enough for every peer to publish a few times.
    tokio::time::sleep(a.warmup.max(interval * 3)).await;
    let window = a.window.max(interval * 3);
    let lag = LagProbe::start(Duration::from_millis(100));
    let peers = c.live();
    let before: Vec<(u64, u64)> = peers.iter().map(|p| c.net.traffic(p.node)).collect();
    let t0 = Instant::now();
    let mut seen = HashSet::new();
    let mut delays_ms = Vec::new();
    while t0.elapsed() < window {
        for p in &peers {
            for e in p.handle.view() {
                if !e.is_self && seen.insert((p.node, e.peer, e.published_unix_ms)) {
                    delays_ms.push(e.received_unix_ms.saturating_sub(e.published_unix_ms) as f64);
                }
            }
        }
        tokio::time::sleep(view_poll(interval)).await;
    }
    let took = t0.elapsed().as_secs_f64();
    let moved: u64 = peers
        .iter()
        .zip(&before)
        .map(|(p, b)| {
            let (s, r) = c.net.traffic(p.node);
            (s - b.0) + (r - b.1)
        })
        .sum();
    let mut pairs = 0usize;
    for p in &peers {
        pairs += p.handle.view().iter().filter(|e| !e.is_self).count();
    }
    let coverage = pairs as f64 / (peers.len() * (peers.len() - 1)).max(1) as f64;
    let out = Outcome {
        peers: n,
        interval,
        delays_ms,
        coverage,
        bytes_per_peer_s: moved as f64 / peers.len() as f64 / took,
        lag_p99: lag.take_p99(),
        rss: rss_bytes(),
    };
    c.shutdown().await;
    Ok(out)
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Vec<Outcome>> {
    let mut table = Table::new(&[
        "peers",
        "status interval (s)",
        "deliveries",
        "delay p50 / p99 / max (ms)",
        "view coverage",
        "bytes per peer per s (in + out)",
        "timer lag p99 (ms)",
        "RSS (MB)",
    ]);
    let mut outs = Vec::new();
    for &n in &a.sizes {
        let o = run_size(env, a, n).await?;
        println!(
            "gossip: {n} peers: {} deliveries, p50 {:.0} ms, p99 {:.0} ms, coverage {:.3}, {:.0} B/peer/s, lag p99 {} ms",
            o.delays_ms.len(),
            quantile(&o.delays_ms, 0.5),
            quantile(&o.delays_ms, 0.99),
            o.coverage,
            o.bytes_per_peer_s,
            o.lag_p99.as_millis()
        );
        table.row(vec![
            n.to_string(),
            format!("{:.1}", o.interval.as_secs_f64()),
            o.delays_ms.len().to_string(),
            format!(
                "{:.0} / {:.0} / {:.0}",
                quantile(&o.delays_ms, 0.5),
                quantile(&o.delays_ms, 0.99),
                quantile(&o.delays_ms, 1.0)
            ),
            format!("{:.3}", o.coverage),
            format!("{:.0}", o.bytes_per_peer_s),
            o.lag_p99.as_millis().to_string(),
            format!("{:.0}", o.rss as f64 / 1e6),
        ]);
        outs.push(o);
    }
    let md = format!(
        "{}{}\nDelay: from a status's publication by its author to its arrival in another peer's view, every (observer, author, publication) counted once over a window of at least {} s (3 intervals) after a warm-up of at least {} s (3 intervals). Coverage: the share of (observer, author) pairs of live peers present in the views at the end. Bytes: all traffic of a peer's access link in the window, not only gossip.\n",
        env.preamble("Scenario 2: gossip propagation", command),
        table.markdown(),
        a.window.as_secs(),
        a.warmup.as_secs(),
    );
    let json = json!(outs
        .iter()
        .map(|o| json!({
            "peers": o.peers,
            "interval_s": o.interval.as_secs_f64(),
            "deliveries": o.delays_ms.len(),
            "delay_p50_ms": quantile(&o.delays_ms, 0.5),
            "delay_p99_ms": quantile(&o.delays_ms, 0.99),
            "delay_max_ms": quantile(&o.delays_ms, 1.0),
            "coverage": o.coverage,
            "bytes_per_peer_s": o.bytes_per_peer_s,
            "lag_p99_ms": o.lag_p99.as_millis() as u64,
            "rss_bytes": o.rss,
        }))
        .collect::<Vec<_>>());
    let series = [("p50", 0.5), ("p99", 0.99)]
        .iter()
        .map(|(name, q)| Series {
            name: format!("gossip delay, {name}"),
            points: outs
                .iter()
                .map(|o| (o.peers as f64, quantile(&o.delays_ms, *q) / 1000.0))
                .collect(),
        })
        .collect::<Vec<_>>();
    let svg = svg_plot("Gossip propagation delay", "peers", "seconds", &series);
    write_results(&env.out, "gossip", &md, &json, Some(&svg))?;
    Ok(outs)
}
