//! Scenario 3: provider records under churn: how often a lookup returns a server that is
//! dead.
//!
//! Per churn rate: 3 bootstrap peers, `servers` servers, `clients` clients and plain
//! peers up to `peers`. Servers crash (no goodbye) at `rate` per server per hour, each
//! replaced at once by a new server with a new identity, so `servers` stay live. Every
//! client looks the model up every `lookup_every`; each provider a lookup returns counts as
//! dead if its node had crashed by then. A dead server's record lives on until its TTL
//! runs out (re-provided every half TTL): the expected dead share is about
//! rate x 0.75 TTL, which the table prints next to the measurement.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentjet::base::Rng;
use agentjet::swarm::{PeerId, Role};
use serde_json::json;

use super::{gossip_interval, start_many, Env};
use crate::cluster::{Cluster, LagProbe, PeerTiming, SimPeer, MODEL};
use crate::net::{lock, Network, NodeId};
use crate::report::{svg_plot, write_results, Series, Table};

#[derive(Debug, Clone)]
pub struct Args {
    pub peers: usize,
    pub servers: usize,
    pub clients: usize,
    /// Crashes per server per hour, one run each.
    pub rates: Vec<f64>,
    pub duration: Duration,
    pub lookup_every: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub rate: f64,
    pub crashes: usize,
    pub lookups: usize,
    pub empty_lookups: usize,
    pub returned: usize,
    pub dead: usize,
    pub lag_p99: Duration,
}

impl Outcome {
    pub fn dead_share(&self) -> f64 {
        self.dead as f64 / self.returned.max(1) as f64
    }
}

pub async fn run_rate(env: &Env, a: &Args, rate: f64) -> anyhow::Result<Outcome> {
    anyhow::ensure!(
        a.peers >= 3 + a.servers + a.clients,
        "{} peers are too few",
        a.peers
    );
    let timing = PeerTiming {
        status_interval: gossip_interval(a.peers),
        ..Default::default()
    };
    let c = Arc::new(Cluster::new(Network::new(env.net.clone()), timing, 3).await?);
    let nodes: Arc<Mutex<HashMap<PeerId, NodeId>>> = Default::default();
    let mut servers: Vec<Arc<SimPeer>> = Vec::new();
    for _ in 0..a.servers {
        let s = c.start_server(1).await?;
        lock(&nodes).insert(s.peer_id, s.node);
        servers.push(s);
    }
    let clients = start_many(&c, Role::Client, a.clients).await?;
    start_many(&c, Role::Plain, a.peers - 3 - a.servers - a.clients).await?;
    let t0 = Instant::now();
    while clients[0].handle.providers(MODEL).await?.len() < a.servers {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(180),
            "the swarm did not settle"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let lag = LagProbe::start(Duration::from_millis(100));
    let out = Arc::new(Mutex::new(Outcome {
        rate,
        ..Default::default()
    }));
    let start = Instant::now();
    let mut lookers = Vec::new();
    for cl in clients {
        let (c, nodes, out, a) = (c.clone(), nodes.clone(), out.clone(), a.clone());
        lookers.push(tokio::spawn(async move {
            while start.elapsed() < a.duration {
                if let Ok(found) = cl.handle.providers(MODEL).await {
                    let map = lock(&nodes);
                    let dead = found
                        .iter()
                        .filter(|p| map.get(p).is_none_or(|n| c.net.is_crashed(*n)))
                        .count();
                    let mut o = lock(&out);
                    o.lookups += 1;
                    o.empty_lookups += found.is_empty() as usize;
                    o.returned += found.len();
                    o.dead += dead;
                }
                tokio::time::sleep(a.lookup_every).await;
            }
        }));
    }
    // Crashes: a Poisson process over all servers, each replaced at once.
    let mut rng = Rng::seeded(env.net.seed ^ rate.to_bits());
    let per_s = rate * a.servers as f64 / 3600.0;
    let mut next = start + Duration::from_secs_f64(exp(&mut rng, per_s));
    while rate > 0.0 && next < start + a.duration {
        tokio::time::sleep_until(next.into()).await;
        let i = (rng.next_u64() % servers.len() as u64) as usize;
        let victim = servers[i].clone();
        c.crash(&victim).await;
        let s = c.start_server(1).await?;
        lock(&nodes).insert(s.peer_id, s.node);
        servers[i] = s;
        lock(&out).crashes += 1;
        next += Duration::from_secs_f64(exp(&mut rng, per_s));
    }
    for l in lookers {
        let _ = l.await;
    }
    let mut o = lock(&out).clone();
    o.lag_p99 = lag.take_p99();
    c.shutdown().await;
    Ok(o)
}

/// An exponential draw with rate `per_s` (seconds).
fn exp(rng: &mut Rng, per_s: f64) -> f64 {
    if per_s <= 0.0 {
        return f64::INFINITY;
    }
    -(1.0 - rng.next_f64()).ln() / per_s
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Vec<Outcome>> {
    let ttl = PeerTiming::default().provider_ttl;
    let mut table = Table::new(&[
        "churn (crashes per server per hour)",
        "crashes",
        "lookups",
        "providers returned",
        "dead among them",
        "dead share",
        "model: rate x 0.75 TTL",
        "lookups with no provider",
        "timer lag p99 (ms)",
    ]);
    let mut outs = Vec::new();
    for &rate in &a.rates {
        let o = run_rate(env, a, rate).await?;
        let model = rate / 3600.0 * 0.75 * ttl.as_secs_f64();
        println!(
            "churn {rate}/h: {} crashes, {} lookups, dead share {:.4} (model {model:.4})",
            o.crashes,
            o.lookups,
            o.dead_share()
        );
        table.row(vec![
            format!("{rate} ({:.0}%)", rate * 100.0),
            o.crashes.to_string(),
            o.lookups.to_string(),
            o.returned.to_string(),
            o.dead.to_string(),
            format!("{:.3}%", 100.0 * o.dead_share()),
            format!("{:.3}%", 100.0 * model),
            o.empty_lookups.to_string(),
            o.lag_p99.as_millis().to_string(),
        ]);
        outs.push(o);
    }
    let md = format!(
        "{}{}\n{} peers, {} servers (each crash replaced at once by a new server), {} clients looking up every {} ms for {} s per rate; provider TTL {} s, re-provided every half TTL.\n",
        env.preamble("Scenario 3: provider records under churn", command),
        table.markdown(),
        a.peers,
        a.servers,
        a.clients,
        a.lookup_every.as_millis(),
        a.duration.as_secs(),
        ttl.as_secs(),
    );
    let json = json!(outs
        .iter()
        .map(|o| json!({
            "rate_per_hour": o.rate,
            "crashes": o.crashes,
            "lookups": o.lookups,
            "returned": o.returned,
            "dead": o.dead,
            "dead_share": o.dead_share(),
            "empty_lookups": o.empty_lookups,
        }))
        .collect::<Vec<_>>());
    let svg = svg_plot(
        "Dead providers returned under churn",
        "crashes per server per hour",
        "share of returned providers that are dead",
        &[
            Series {
                name: "measured".into(),
                points: outs.iter().map(|o| (o.rate, o.dead_share())).collect(),
            },
            Series {
                name: "rate x 0.75 TTL".into(),
                points: outs
                    .iter()
                    .map(|o| (o.rate, o.rate / 3600.0 * 0.75 * ttl.as_secs_f64()))
                    .collect(),
            },
        ],
    );
    write_results(&env.out, "churn", &md, &json, Some(&svg))?;
    Ok(outs)
}
