//! Scenario 1: how long a newly started client takes to find a provider of its model, and
//! what the DHT lookup cost, at several swarm sizes.
//!
//! Per size: 3 bootstrap peers, `servers` servers providing the model, plain peers up to
//! `n - clients`; once a lookup from a settled peer finds every server, `clients` new
//! clients start one after another, each looking the model up the way the client role does
//! (again every 500 ms until one provider is found). The time counts from the client's
//! start (its connection to a bootstrap peer and the swarm-key proof included).

use std::time::{Duration, Instant};

use agentjet::swarm::Role;
use serde_json::json;

use super::{gossip_interval, start_paced, Env};
use crate::cluster::{Cluster, LagProbe, PeerTiming, MODEL};
use crate::net::Network;
use crate::report::{quantile, rss_bytes, secs, svg_plot, write_results, Series, Table};
use crate::routes::Snapshot;

/// The status gossip interval at `n` peers. Discovery does not use gossip; one process
/// verifying every peer's status signatures would only slow the lookups it measures (see
/// `gossip_interval`): at least 600 s, and the n^2 scaling beyond (800 s at 1,000 peers).
/// With 120 s, 300 peers kept the process CPU-bound (timers 0.9 s late at p99) and 1,000
/// kept both cores verifying signatures.
fn gossip(n: usize) -> Duration {
    gossip_interval(n).max(Duration::from_secs(600))
}

/// The longest wait for a settled peer's lookup to find every server, by default
/// (`--settle-s`). At 1,000 peers every peer's first DHT walk runs at once and keeps both
/// cores busy; it took 64-147 s here.
pub const SETTLE_MAX: Duration = Duration::from_secs(300);
/// Quiet 2 s windows in a row before the clients start (see `run_size`).
const QUIET_WINDOWS: usize = 5;
/// The longest wait for them.
const QUIET_MAX: Duration = Duration::from_secs(180);

#[derive(Debug, Clone)]
pub struct Args {
    pub sizes: Vec<usize>,
    pub servers: usize,
    pub clients: usize,
    /// The peers' idle connection timeout (the binary's is 120 s). It closes only
    /// connections without an open substream, and gossipsub keeps one open to every peer
    /// that speaks it, so between AgentJet peers it closes nothing (see netsim/README.md,
    /// "Connections").
    pub idle: Duration,
    /// How often each peer walks the DHT again (the binary: 30 s). One process pays every
    /// peer's walks (about 300 Kademlia requests each at 1,000 peers), what n machines would
    /// share, so the largest sizes need a longer one.
    pub rebootstrap: Duration,
    /// The connection trimmer's high mark (the binary: 96); it trims down to two thirds.
    pub max_connections: usize,
    /// Connections newer (or used more recently) than this are not trimmed (the binary:
    /// 30 s).
    pub grace: Duration,
    /// How often each connection is pinged (the binary: 5 s).
    pub ping: Duration,
    /// The longest wait for the swarm to settle ([`SETTLE_MAX`] by default).
    pub settle_max: Duration,
}

/// What one size measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub peers: usize,
    pub found: usize,
    pub lookups: usize,
    /// Start to first provider, per client that found one.
    pub times: Vec<Duration>,
    /// Kademlia requests of each client's successful lookup, and its duration.
    pub requests: Vec<u32>,
    pub lookup_times: Vec<Duration>,
    /// Peers each peer is connected to, mean over peers, at the end: from the trimmer's
    /// grace after the last client's lookup, once at most the high mark (or 90 s more).
    pub connections: f64,
    /// How long after that grace the count took to reach the high mark.
    pub connections_wait: Duration,
    /// How long after settling the process took to be quiet (clients start then).
    pub quiet: Duration,
    pub settle: Duration,
    pub lag_p99: Duration,
    pub rss: u64,
    /// With a NAT mix: how the peers were connected at the end.
    pub routes: Option<Snapshot>,
}

/// Runs one size and returns what it measured.
pub async fn run_size(env: &Env, a: &Args, n: usize) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        n >= 3 + a.servers + a.clients,
        "{n} peers cannot hold 3 bootstrap peers, {} servers and {} clients",
        a.servers,
        a.clients
    );
    let timing = PeerTiming {
        status_interval: gossip(n),
        idle_connection_timeout: a.idle,
        rebootstrap_interval: a.rebootstrap,
        max_connections: a.max_connections,
        min_connections: a.max_connections * 2 / 3,
        trim_grace: a.grace,
        ping_interval: a.ping,
        ..Default::default()
    };
    let c = Cluster::behind_nat(Network::new(env.net.clone()), timing, 3, env.nat).await?;
    let lag = LagProbe::start(Duration::from_millis(100));
    for _ in 0..a.servers {
        c.start_server(1).await?;
    }
    let started = Instant::now();
    let plain = start_paced(&c, Role::Plain, n - 3 - a.servers - a.clients, &lag).await?;
    println!(
        "discovery: {n} peers started in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    // Settled: a plain peer's lookup finds every server.
    let t0 = Instant::now();
    let probe = plain.last().cloned();
    let mut said = Instant::now();
    loop {
        let lookup = match &probe {
            Some(p) => Some(p.handle.lookup_providers(MODEL, false).await?),
            None => None,
        };
        let found = lookup.as_ref().map_or(a.servers, |l| l.providers.len());
        if found >= a.servers {
            break;
        }
        if said.elapsed() > Duration::from_secs(30) {
            said = Instant::now();
            let p = probe.as_ref().expect("a probe");
            let l = lookup.expect("a lookup");
            println!(
                "discovery: {n} peers, {:.0} s: the probe (node {}, {}, {}) found {found} of {} servers ({} requests, {} answered, {:.1} s); {} connected {:?}; timer lag p99 {} ms",
                t0.elapsed().as_secs_f64(),
                p.node,
                p.nat.as_str(),
                p.handle.reachability().as_str(),
                a.servers,
                l.requests,
                l.answered,
                l.duration.as_secs_f64(),
                p.handle.connected_peers().await.len(),
                p.handle.link_counts(),
                lag.take_p99().as_millis(),
            );
            if c.nat_mix().is_some() {
                let published: u64 = c
                    .peers()
                    .iter()
                    .map(|p| p.handle.statuses_published())
                    .sum();
                println!("  statuses gossiped so far: {published}");
                println!("  network events so far: {:?}", c.routes.event_counts());
            }
        }
        anyhow::ensure!(
            t0.elapsed() < a.settle_max,
            "{n} peers: the swarm did not settle in {} s ({found} of {} servers found)",
            a.settle_max.as_secs(),
            a.servers
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let settle = t0.elapsed();
    // Clients start once the process is quiet again (timers at most 50 ms late at p99 in
    // each of QUIET_WINDOWS 2 s windows in a row, or after QUIET_MAX): the peers' first DHT
    // walks can keep both cores busy for a minute or two after the swarm finds its
    // servers, and a client timed then measures the CPU. One quiet window was not enough:
    // at 1,000 peers it passed between two bursts of walks and the clients then ran with
    // timers 206 ms late.
    let t1 = Instant::now();
    lag.take();
    let mut quiet_in_a_row = 0;
    while quiet_in_a_row < QUIET_WINDOWS && t1.elapsed() < QUIET_MAX {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if lag.take_p99() <= Duration::from_millis(50) {
            quiet_in_a_row += 1;
        } else {
            quiet_in_a_row = 0;
        }
    }
    let quiet = t1.elapsed();
    lag.take();
    let mut out = Outcome {
        peers: n,
        found: 0,
        lookups: 0,
        times: Vec::new(),
        requests: Vec::new(),
        lookup_times: Vec::new(),
        connections: 0.0,
        connections_wait: Duration::ZERO,
        quiet,
        settle,
        lag_p99: Duration::ZERO,
        rss: 0,
        routes: None,
    };
    for _ in 0..a.clients {
        let t = Instant::now();
        let client = c.start(Role::Client).await?;
        loop {
            let l = client.handle.lookup_providers(MODEL, true).await?;
            out.lookups += 1;
            if !l.providers.is_empty() {
                out.found += 1;
                out.times.push(t.elapsed());
                out.requests.push(l.requests);
                out.lookup_times.push(l.duration);
                break;
            }
            if t.elapsed() > Duration::from_secs(30) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    out.lag_p99 = lag.take_p99();
    // Connections are counted once the trimmer may close the clients' lookups' ones, then
    // every 2 s until at most the high mark are left, for at most 90 s more: DHT walks
    // that began before (a peer's first walk over 100 ms links dials peer after peer for
    // 30-60 s) keep reopening trimmed connections, each spared for the grace.
    tokio::time::sleep(a.grace + Duration::from_secs(3)).await;
    out.rss = rss_bytes();
    let live = c.live();
    let count = || async {
        let mut links = 0usize;
        for p in &live {
            links += p.handle.connected_peers().await.len();
        }
        links as f64 / live.len().max(1) as f64
    };
    let t = Instant::now();
    let mut samples = vec![count().await];
    while samples
        .last()
        .is_some_and(|&c| c > a.max_connections as f64)
        && t.elapsed() < Duration::from_secs(90)
    {
        tokio::time::sleep(Duration::from_secs(2)).await;
        samples.push(count().await);
    }
    tracing::info!(?samples, "connections per peer, every 2 s");
    out.connections = samples.last().copied().unwrap_or_default();
    out.connections_wait = t.elapsed();
    if env.nat.is_some() {
        out.routes = Some(c.nat_snapshot(&live));
        println!(
            "discovery: {n} peers: network events over the run: {:?}",
            c.routes.event_counts()
        );
    }
    c.shutdown().await;
    Ok(out)
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Vec<Outcome>> {
    let mut table = Table::new(&[
        "peers",
        "clients that found a provider",
        "time to first provider p50 / p99 / max (s)",
        "lookups per client",
        "the successful lookup alone p50 / p99 (s)",
        "Kademlia requests per lookup p50 / p99",
        "connections per peer (s to reach it)",
        "settle, then quiet (s)",
        "timer lag p99 (ms)",
        "RSS (MB)",
    ]);
    let mut outcomes = Vec::new();
    for &n in &a.sizes {
        let o = run_size(env, a, n).await?;
        let t = secs(&o.times);
        let r: Vec<f64> = o.requests.iter().map(|&x| x as f64).collect();
        println!(
            "discovery: {n} peers: {}/{} found, p50 {:.3} s, p99 {:.3} s, requests p50 {:.0}, lag p99 {} ms",
            o.found,
            a.clients,
            quantile(&t, 0.5),
            quantile(&t, 0.99),
            quantile(&r, 0.5),
            o.lag_p99.as_millis()
        );
        table.row(vec![
            n.to_string(),
            format!("{} / {}", o.found, a.clients),
            format!(
                "{:.2} / {:.2} / {:.2}",
                quantile(&t, 0.5),
                quantile(&t, 0.99),
                quantile(&t, 1.0)
            ),
            format!("{:.1}", o.lookups as f64 / a.clients.max(1) as f64),
            format!(
                "{:.2} / {:.2}",
                quantile(&secs(&o.lookup_times), 0.5),
                quantile(&secs(&o.lookup_times), 0.99)
            ),
            format!("{:.0} / {:.0}", quantile(&r, 0.5), quantile(&r, 0.99)),
            format!(
                "{:.1} ({:.0})",
                o.connections,
                o.connections_wait.as_secs_f64()
            ),
            format!(
                "{:.1}, {:.0}",
                o.settle.as_secs_f64(),
                o.quiet.as_secs_f64()
            ),
            o.lag_p99.as_millis().to_string(),
            format!("{:.0}", o.rss as f64 / 1e6),
        ]);
        outcomes.push(o);
    }
    let mut md = format!(
        "{}{}\nPeers start 50 at a time, each batch once the process caught up with the last (timers at most 200 ms late at p99 over 2 s, or after 60 s); settling counts from the end of the last batch's wait. Clients start once the process is quiet after the swarm settled (timers at most 50 ms late at p99 in each of {} 2 s windows in a row, or after {} s). A client counts from its start (connecting to a bootstrap peer and proving the swarm key included) to the first lookup that returns a provider, looking again every 500 ms as the client role does. {} servers provide the model; gossip runs every max(600 s, n^2 / 1,250 s) (discovery does not use it). The idle connection timeout is {} s (the binary: 120 s; gossipsub's substreams keep connections between peers open regardless); above {} connected peers a peer closes its least recently used connections down to {}, sparing those used within {} s (the binary: 96, 64 and 30 s), pings each connection every {} s (the binary: 5 s), and walks the DHT again every {} s (the binary: 30 s); connections per peer are counted from the trimmer's grace plus 3 s after the last client's lookup, every 2 s until at most the high mark are left (at most 90 s; in brackets, how long that took): a DHT walk that started before keeps reopening trimmed connections. A client's lookup ends at the first answer that names a provider (the client role's start; its refresh every 2 s asks for all). Timer lag: how late a 100 ms timer fired while clients looked up (large: CPU-bound, the times are then upper bounds).\n",
        env.preamble("Scenario 1: finding a provider", command),
        table.markdown(),
        QUIET_WINDOWS,
        QUIET_MAX.as_secs(),
        a.servers,
        a.idle.as_secs(),
        a.max_connections,
        a.max_connections * 2 / 3,
        a.grace.as_secs(),
        a.ping.as_secs(),
        a.rebootstrap.as_secs(),
    );
    for o in &outcomes {
        if let (Some(r), Some(m)) = (&o.routes, env.nat) {
            md.push_str(&format!(
                "\n## {} peers: connections through NAT\n\n",
                o.peers
            ));
            md.push_str(&r.markdown(&m.label()));
        }
    }
    let json = json!(outcomes
        .iter()
        .map(|o| json!({
            "peers": o.peers,
            "found": o.found,
            "clients": a.clients,
            "times_s": secs(&o.times),
            "requests": o.requests,
            "lookup_s": secs(&o.lookup_times),
            "connections_per_peer": o.connections,
            "connections_wait_s": o.connections_wait.as_secs_f64(),
            "settle_s": o.settle.as_secs_f64(),
            "quiet_s": o.quiet.as_secs_f64(),
            "lag_p99_ms": o.lag_p99.as_millis() as u64,
            "rss_bytes": o.rss,
            "nat": o.routes.as_ref().map(Snapshot::json),
        }))
        .collect::<Vec<_>>());
    let series = ["p50", "p99"]
        .iter()
        .zip([0.5, 0.99])
        .map(|(name, q)| Series {
            name: format!("time to first provider, {name}"),
            points: outcomes
                .iter()
                .map(|o| (o.peers as f64, quantile(&secs(&o.times), q)))
                .collect(),
        })
        .collect::<Vec<_>>();
    let svg = svg_plot("Finding a provider", "peers", "seconds", &series);
    write_results(&env.out, "discovery", &md, &json, Some(&svg))?;
    Ok(outcomes)
}
