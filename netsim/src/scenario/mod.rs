//! The scenarios, each one command (`netsim <name> [flags]`, see `main.rs`), each writing
//! its table, JSON and plot into the results folder.

pub mod broadcast;
pub mod churn;
pub mod discovery;
pub mod gossip;
pub mod partition;
pub mod training;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentjet::swarm::Role;

use crate::cluster::{Cluster, LagProbe, NatMix, SimPeer};
use crate::net::NetConfig;

/// What every scenario shares: the network's settings and where results go.
#[derive(Debug, Clone)]
pub struct Env {
    pub net: NetConfig,
    pub out: PathBuf,
    /// Where the peers sit (`--nat P,C,S`): None, all public without NAT traversal (the
    /// swarm as on one host); with a mix, every peer runs the binary's traversal.
    pub nat: Option<NatMix>,
}

impl Env {
    /// "20-200 ms one-way, 100 Mbit/s, loss 0.1%" (what the tables print).
    pub fn links(&self) -> String {
        let (lo, hi) = self.net.latency;
        let mut s = if lo == hi {
            format!("{} ms one-way", lo.as_millis())
        } else {
            format!("{}-{} ms one-way", lo.as_millis(), hi.as_millis())
        };
        if self.net.bandwidth > 0.0 {
            s.push_str(&format!(", {} Mbit/s", self.net.bandwidth * 8.0 / 1e6));
        }
        if self.net.loss > 0.0 {
            s.push_str(&format!(", loss {}%", self.net.loss * 100.0));
        }
        if let Some(m) = self.nat {
            s.push_str(&format!(
                "; peers public / behind cone NAT / behind symmetric NAT: {}%",
                m.label()
            ));
        }
        s
    }

    /// The markdown preamble: the command's settings and the machine.
    pub fn preamble(&self, title: &str, command: &str) -> String {
        format!(
            "# {title}\n\nCommand: `{command}` (seed {}; links {}). Machine: {} CPU cores, one process, real time.\n\n",
            self.net.seed,
            self.links(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
        )
    }
}

/// The gossip interval for `n` peers in one process. Gossipsub verifies the signature of
/// every copy of a message it receives, duplicates included (about 8 per message with the
/// default mesh), so one process running n peers verifies about 8 n^2 / interval
/// signatures per second, what n machines would share. The binary's 2 s while that stays
/// under about 10,000 per second (half a core), longer beyond: n^2 / 1,250 seconds.
pub fn gossip_interval(n: usize) -> Duration {
    Duration::from_secs_f64((n as f64 * n as f64 / 1_250.0).max(2.0))
}

/// How often a scenario reads every peer's view: twice per gossip interval, at most once
/// per 250 ms (reading n views of n entries costs the process too).
pub fn view_poll(interval: Duration) -> Duration {
    (interval / 2).clamp(Duration::from_millis(250), Duration::from_secs(2))
}

/// Starts `count` peers of `role`, 50 at a time, each batch once the process has caught
/// up with the last (see [`LagProbe::caught_up`]: timers at most `PACE_LAG` late at p99
/// over 2 s, or after `PACE_MAX`). Each new peer gossips its status to every peer
/// (several copies each, a signature check per copy): 1,000 peers started at once leave
/// one process seconds behind for minutes, which a swarm of machines started over
/// minutes never is. The wait after the last batch is part of the start.
pub async fn start_paced(
    c: &Cluster,
    role: Role,
    count: usize,
    lag: &LagProbe,
) -> anyhow::Result<Vec<Arc<SimPeer>>> {
    start_batches(c, role, count, Some(lag)).await
}

/// Starts `count` plain peers for `scenario`: above 50 paced ([`start_paced`]) and said
/// with the time it took, at most 50 at once ([`start_many`]). Returns that time.
pub async fn start_plain(
    c: &Cluster,
    count: usize,
    lag: &LagProbe,
    scenario: &str,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    if count <= 50 {
        start_many(c, Role::Plain, count).await?;
        return Ok(t.elapsed());
    }
    start_paced(c, Role::Plain, count, lag).await?;
    println!(
        "{scenario}: {count} plain peers started in {:.0} s (50 at a time, each batch once \
         the process caught up)",
        t.elapsed().as_secs_f64()
    );
    Ok(t.elapsed())
}

/// See [`start_paced`].
pub const PACE_LAG: Duration = Duration::from_millis(200);
pub const PACE_MAX: Duration = Duration::from_secs(60);

/// Starts `count` peers of `role`, 50 at a time.
pub async fn start_many(
    c: &Cluster,
    role: Role,
    count: usize,
) -> anyhow::Result<Vec<Arc<SimPeer>>> {
    start_batches(c, role, count, None).await
}

async fn start_batches(
    c: &Cluster,
    role: Role,
    count: usize,
    pace: Option<&LagProbe>,
) -> anyhow::Result<Vec<Arc<SimPeer>>> {
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let k = (count - out.len()).min(50);
        let batch = futures::future::try_join_all((0..k).map(|_| c.start(role))).await?;
        out.extend(batch);
        let Some(lag) = pace else { continue };
        let t = Instant::now();
        lag.take();
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            if lag.caught_up(PACE_LAG) || t.elapsed() >= PACE_MAX {
                break;
            }
        }
    }
    Ok(out)
}
