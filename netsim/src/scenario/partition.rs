//! Scenario 5: the network splits in two, each half goes on alone, the split heals.
//!
//! 3 bootstrap peers, `servers` servers of the model (policy version 1) and plain peers;
//! once every view holds every peer, the nodes split by the parity of their index (pairs
//! across the split deliver nothing). The servers of each half move to a version of their
//! own (2 and 3: each half trained alone) and the partition holds for `hold`, longer than a
//! view's expiry, so each half forgets the other. At the heal every server moves to
//! version 4 (the one policy the group agrees on; the agreement itself is the training
//! group's, scenario 4) and the clock runs until every live peer's view holds every live
//! peer and every server at version 4: one consistent view.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use agentjet::swarm::{PeerId, Role};
use serde_json::json;

use super::{gossip_interval, start_many, view_poll, Env};
use crate::cluster::{set_version, Cluster, LagProbe, PeerTiming, SimPeer, MODEL};
use crate::net::Network;
use crate::report::{rss_bytes, write_results, Table};

#[derive(Debug, Clone)]
pub struct Args {
    pub sizes: Vec<usize>,
    pub servers: usize,
    pub hold: Duration,
    /// Give up waiting for convergence after this.
    pub limit: Duration,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub peers: usize,
    /// Until every view held every peer, from the last start.
    pub formed: Duration,
    /// Peers whose view held only their own half at the end of the hold.
    pub split_views: usize,
    /// From the heal to one consistent view (None: not within the limit).
    pub converged: Option<Duration>,
    pub lag_p99: Duration,
    pub rss: u64,
}

/// Whether every live peer's view holds exactly the live peers, each server at `version`.
fn consistent(live: &[std::sync::Arc<SimPeer>], servers: &HashSet<PeerId>, version: u64) -> bool {
    let want: HashSet<PeerId> = live.iter().map(|p| p.peer_id).collect();
    live.iter().all(|p| {
        let view: HashMap<PeerId, u64> = p
            .handle
            .view()
            .into_iter()
            .map(|e| {
                let v = e
                    .status
                    .models
                    .iter()
                    .find(|m| m.name == MODEL)
                    .map_or(0, |m| m.policy_version);
                (e.peer, v)
            })
            .collect();
        view.len() == want.len()
            && want.iter().all(|id| match view.get(id) {
                None => false,
                Some(v) => !servers.contains(id) || *v == version,
            })
    })
}

pub async fn run_size(env: &Env, a: &Args, n: usize) -> anyhow::Result<Outcome> {
    anyhow::ensure!(n >= 4 + a.servers, "{n} peers are too few");
    let interval = gossip_interval(n);
    let timing = PeerTiming {
        status_interval: interval,
        ..Default::default()
    };
    // Longer than a view entry lives (three intervals), so each half forgets the other.
    let hold = a.hold.max(interval * 4);
    let c = Cluster::new(Network::new(env.net.clone()), timing, 3).await?;
    let mut servers = Vec::new();
    for _ in 0..a.servers {
        servers.push(c.start_server(1).await?);
    }
    start_many(&c, Role::Plain, n - 3 - a.servers).await?;
    let ids: HashSet<PeerId> = servers.iter().map(|s| s.peer_id).collect();
    let t0 = Instant::now();
    while !consistent(&c.live(), &ids, 1) {
        anyhow::ensure!(
            t0.elapsed() < a.limit,
            "{n} peers: views did not fill within {:?}",
            a.limit
        );
        tokio::time::sleep(view_poll(interval)).await;
    }
    let formed = t0.elapsed();
    let lag = LagProbe::start(Duration::from_millis(100));
    let side = |node: u64| (node % 2) as u8;
    let nodes = c.peers().len();
    c.net.partition((0..nodes as u64).map(side).collect());
    for s in &servers {
        set_version(s, 2 + side(s.node) as u64);
    }
    tokio::time::sleep(hold).await;
    let live = c.live();
    let split_views = live
        .iter()
        .filter(|p| {
            p.handle.view().iter().all(|e| {
                live.iter()
                    .find(|q| q.peer_id == e.peer)
                    .is_some_and(|q| side(q.node) == side(p.node))
            })
        })
        .count();
    c.net.heal();
    let healed = Instant::now();
    for s in &servers {
        set_version(s, 4);
    }
    let mut converged = None;
    while healed.elapsed() < a.limit {
        if consistent(&live, &ids, 4) {
            converged = Some(healed.elapsed());
            break;
        }
        tokio::time::sleep(view_poll(interval)).await;
    }
    let out = Outcome {
        peers: n,
        formed,
        split_views,
        converged,
        lag_p99: lag.take_p99(),
        rss: rss_bytes(),
    };
    c.shutdown().await;
    Ok(out)
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Vec<Outcome>> {
    let mut table = Table::new(&[
        "peers",
        "views full after start (s)",
        "views split during the partition",
        "heal to one consistent view (s)",
        "timer lag p99 (ms)",
        "RSS (MB)",
    ]);
    let mut outs = Vec::new();
    for &n in &a.sizes {
        let o = run_size(env, a, n).await?;
        let conv = o
            .converged
            .map_or(format!("not within {} s", a.limit.as_secs()), |d| {
                format!("{:.1}", d.as_secs_f64())
            });
        println!(
            "partition: {n} peers: split views {}/{}, converged after heal: {conv}",
            o.split_views, n
        );
        table.row(vec![
            n.to_string(),
            format!("{:.1}", o.formed.as_secs_f64()),
            format!("{} / {}", o.split_views, n),
            conv,
            o.lag_p99.as_millis().to_string(),
            format!("{:.0}", o.rss as f64 / 1e6),
        ]);
        outs.push(o);
    }
    let md = format!(
        "{}{}\nThe partition (by node parity) holds {} s or four gossip intervals, whichever is longer; {} servers. Consistent: every live peer's view holds every live peer and every server at the version all servers took at the heal.\n",
        env.preamble("Scenario 5: a partition heals", command),
        table.markdown(),
        a.hold.as_secs(),
        a.servers,
    );
    let json = json!(outs
        .iter()
        .map(|o| json!({
            "peers": o.peers,
            "formed_s": o.formed.as_secs_f64(),
            "split_views": o.split_views,
            "converged_s": o.converged.map(|d| d.as_secs_f64()),
            "lag_p99_ms": o.lag_p99.as_millis() as u64,
            "rss_bytes": o.rss,
        }))
        .collect::<Vec<_>>());
    write_results(&env.out, "partition", &md, &json, None)?;
    Ok(outs)
}
