//! Scenario 6: a training group's policy versions reaching its rollout peers (followers)
//! over internet links, through the project's own weight broadcast
//! (`collective::broadcast`: the manifest, the delta codec, the version store, the chunk
//! protocol's handler and fetcher, and the follower's loop that shares each version's
//! chunks out among the followers, as `--follow` servers run it).
//!
//! One trainer and `followers` followers, all real swarm nodes (their statuses, with
//! the versions they hold, go by gossip; the trainer announces a version at once). The
//! model is scaled as scenario 4's: a snapshot of `model_bytes / scale` bfloat16 bytes
//! stands for `model_bytes`, and each byte a holder sends on the chunk protocol counts as
//! `scale` bytes on the links (the chunks are `chunk / scale` bytes, standing for
//! `chunk`). The trainer's update is synthetic: an f32 master copy moves by `lr` per value
//! each version (an Adam-like step: every value moves by about the learning rate, in a
//! random direction) and the snapshot is its bfloat16 rounding, so a version changes the
//! bytes that rounding lets through, and its delta is what that many changes encode to.
//!
//! Every follower starts holding version 0 (the checkpoint every peer loads: the same
//! bytes, so the same manifest). Per version: from the moment the trainer holds it (its
//! step committed; the manifest made, the version announced, then its deltas encoded)
//! to each follower holding it (fetched, checked, serving it on).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentjet::base::Rng;
use agentjet::collective::broadcast::follow::{followers_of, Failure, Fetched};
use agentjet::collective::broadcast::{
    FollowConfig, Follower, Held, Holder, VersionStore, WeightsNet,
};
use agentjet::swarm::{GroupStatus, ModelStatus, Role};
use serde_json::json;

use super::{gossip_interval, start_many, start_plain, Env};
use crate::cluster::{Cluster, LagProbe, PeerTiming, SimPeer, MODEL};
use crate::net::{lock, Network};
use crate::report::{cpu_seconds, quantile, rss_bytes, svg_plot, write_results, Series, Table};
use crate::routes::Snapshot;
use crate::weights::{SimWeights, WeightsPorts};

/// The default step: about the bytes a SmolLM2 step changes (see netsim/README.md).
pub const DEFAULT_LR: f32 = 3e-7;

/// The group's name.
const GROUP: &str = "sim-group";
/// Frame bytes a store keeps encoded (real bytes; scaled down as the chunks are).
const FRAME_CACHE: usize = 64 << 20;

#[derive(Debug, Clone)]
pub struct Args {
    pub followers: usize,
    /// Plain peers in the swarm besides the trainer and its followers.
    pub peers: usize,
    /// The bfloat16 snapshot's size the run stands for.
    pub model_bytes: u64,
    /// Real bytes are `model_bytes / scale`; each chunk byte counts `scale` on the links.
    pub scale: f64,
    /// The chunk size it stands for (`--weights-chunk-kib`).
    pub chunk: u64,
    pub versions: usize,
    /// How far the master copy moves per value per version.
    pub lr: f32,
    /// Chunk requests in flight per follower (`FollowConfig::parallel`).
    pub parallel: usize,
    /// A version not everywhere by then is reported as such.
    pub limit: Duration,
    /// Every peer's regular status interval (`None`: [`gossip_interval`] of the size).
    /// The peers announce themselves until every view is complete, and the trainer
    /// announces each version at once, so a long interval only spares the process the
    /// statuses nobody waits for.
    pub status_interval: Option<Duration>,
}

/// One version's figures.
#[derive(Debug, Clone)]
pub struct VersionOutcome {
    pub version: u64,
    /// Seconds from the trainer holding it to each follower holding it (sorted; the ones
    /// that did not within the limit are missing).
    pub times: Vec<f64>,
    /// Bytes (as on the links) of one copy of the changed chunks, as a follower fetched
    /// them (median over followers).
    pub copy_bytes: f64,
    /// Bytes the trainer sent on the chunk protocol.
    pub trainer_bytes: f64,
    /// Of what the followers fetched, the share from other followers.
    pub from_followers: f64,
    /// Changed chunks and all chunks.
    pub changed: usize,
    pub chunks: usize,
    /// Followers that hold it under another manifest than the trainer's.
    pub wrong: usize,
    /// Per follower: seconds from the trainer holding it to the follower's fetch starting
    /// (the gossip, and the manifest), and the fetch's own seconds (sorted each).
    pub heard: Vec<f64>,
    pub fetching: Vec<f64>,
    /// How late a 100 ms timer fired during it (p99).
    pub lag_p99: Duration,
    /// Cores the process kept busy from the trainer holding it to the last follower
    /// holding it (CPU seconds / seconds; the machine has two).
    pub busy_cores: f64,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub followers: usize,
    pub versions: Vec<VersionOutcome>,
    pub settle_s: f64,
    pub quiet_s: f64,
    pub lag_p99: Duration,
    pub rss: u64,
    /// With a NAT mix: how the peers were connected at the end, and the chunk protocol's
    /// streams opened directly, through a relay, not opened (no connection between the
    /// swarms), and cut by a relay.
    pub routes: Option<Snapshot>,
    pub streams: [u64; 4],
}

/// What a follower did with a version: when it held it, and what it fetched from whom.
struct Arrival {
    version: u64,
    /// When its fetch started (it had heard of the version and taken the manifest).
    started: Instant,
    id: [u8; 32],
    at: Instant,
    bytes: u64,
    from_trainer: u64,
}

/// A bfloat16 of `x` (round to nearest even), little-endian.
fn bf16(x: f32) -> [u8; 2] {
    let b = x.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    (r as u16).to_le_bytes()
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut Rng) -> f32 {
    let u = rng.next_f64().max(1e-12);
    let v = rng.next_f64();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The synthetic model: an f32 master copy and its layout (tensors of 1 Mi values).
struct Model {
    master: Vec<f32>,
    layout: Vec<(String, String, Vec<i64>, u64)>,
    rng: Rng,
}

impl Model {
    fn new(values: usize, seed: u64) -> Model {
        let mut rng = Rng::seeded(seed ^ 0xb40a);
        let master = (0..values).map(|_| 0.02 * normal(&mut rng)).collect();
        let per = 1 << 20;
        let layout = (0..values.div_ceil(per))
            .map(|i| {
                let n = per.min(values - i * per);
                (
                    format!("p{i}"),
                    "BFloat16".to_string(),
                    vec![n as i64],
                    2 * n as u64,
                )
            })
            .collect();
        Model {
            master,
            layout,
            rng,
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        self.master.iter().flat_map(|&x| bf16(x)).collect()
    }

    /// One step: every value moves by `lr` up or down.
    fn step(&mut self, lr: f32) {
        for x in &mut self.master {
            let up = self.rng.next_u64() & 1 == 1;
            *x += if up { lr } else { -lr };
        }
    }
}

pub async fn run_once(env: &Env, a: &Args) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.followers >= 1, "the broadcast scenario needs a follower");
    let real = (a.model_bytes as f64 / a.scale) as usize / 4 * 4;
    let chunk = ((a.chunk as f64 / a.scale) as u32 / 4 * 4).max(4);
    anyhow::ensure!(
        real >= 4096,
        "--model-mb / --scale leaves under 4 kB of snapshot"
    );
    let weight = a.model_bytes as f64 / real as f64;
    let n = a.followers + 3 + a.peers;
    let interval = a.status_interval.unwrap_or_else(|| gossip_interval(n));
    // Pings every 30 s and a DHT walk every 600 s, as scenario 1 sets them: a hundred
    // peers' keep-alives every 5 s, or their walks every 30 s, keep both cores of one
    // process busy for seconds (a version timed then measures the CPU; nothing here
    // looks anything up in the DHT).
    let timing = PeerTiming {
        status_interval: interval,
        ping_interval: Duration::from_secs(30),
        rebootstrap_interval: Duration::from_secs(600),
        ..Default::default()
    };
    let t_start = Instant::now();
    let c = Cluster::behind_nat(Network::new(env.net.clone()), timing, 2, env.nat).await?;
    let trainer = c.start(Role::Server).await?;
    let followers = start_many(&c, Role::Server, a.followers).await?;
    let pace = LagProbe::start(Duration::from_millis(100));
    let plain_start = start_plain(&c, a.peers, &pace, "broadcast").await?;
    drop(pace);
    let ports = Arc::new(WeightsPorts::default());
    let holder = |p: &Arc<SimPeer>, follower: bool| {
        // The latest 2 versions alone: a hundred followers' extra snapshots would share
        // this one process's memory (one machine each would hold them).
        let store = Arc::new(VersionStore::new(2, FRAME_CACHE).with_young(Duration::ZERO));
        ports.serve(p.peer_id, p.node, store.clone());
        p.handle.set_models(vec![ModelStatus {
            name: MODEL.into(),
            policy_version: 0,
            train_step: 0,
            group: (!follower).then(|| GroupStatus {
                name: GROUP.into(),
                members: 1,
                mode: "sync".into(),
                ..Default::default()
            }),
            cache: Default::default(),
            weights: None,
        }]);
        Arc::new(Holder::new(
            p.handle.clone(),
            store,
            MODEL,
            GROUP,
            chunk,
            follower,
        ))
    };
    // Version 0, held by everyone.
    let mut model = Model::new(real / 2, env.net.seed);
    let trainer_holder = holder(&trainer, false);
    let snap = model.snapshot();
    let hash = hash_hex(&snap);
    let v0 = trainer_holder.hold(&model.layout, snap, 0, &hash)?;
    let mut prev = v0.clone();
    let arrivals: Arc<Mutex<Vec<(usize, Arrival)>>> = Arc::default();
    let stop = agentjet::base::Stop::new();
    let mut tasks = Vec::new();
    for (k, p) in followers.iter().enumerate() {
        let h = holder(p, true);
        // Their statuses wait for the next interval (see `Holder::announce_followed`).
        h.announce_followed
            .store(false, std::sync::atomic::Ordering::Relaxed);
        h.install(&v0, &v0.manifest.param_hash[..16], 0);
        let net: Arc<dyn WeightsNet> = Arc::new(SimWeights {
            net: c.net.clone(),
            node: p.node,
            peer: p.peer_id,
            ports: ports.clone(),
            weight,
            routing: env.nat.map(|_| (p.handle.clone(), c.routes.clone())),
        });
        // The scenario waits for complete views itself before the first version.
        let cfg = FollowConfig {
            parallel: a.parallel,
            listen: Some(Duration::ZERO),
            ..FollowConfig::default()
        };
        let f = Follower::new(h.clone(), net, cfg);
        let (arrivals, stop, trainer_id) = (arrivals.clone(), stop.clone(), trainer.peer_id);
        tasks.push(tokio::spawn(async move {
            f.run(stop, |got: Fetched| {
                h.install(&got.held, &got.param_hash, 0);
                let from_trainer = got
                    .report
                    .bytes_by_source
                    .get(&trainer_id.to_string())
                    .copied()
                    .unwrap_or(0);
                lock(&arrivals).push((
                    k,
                    Arrival {
                        version: got.held.version(),
                        started: got.started,
                        id: got.held.id,
                        at: Instant::now(),
                        bytes: got.report.bytes(),
                        from_trainer,
                    },
                ));
                std::future::ready(Ok::<(), Failure>(()))
            })
            .await
        }));
    }
    // Settled: every follower sees the trainer's version 0 and every other follower
    // (every peer says who it is every 10 s until then).
    let settle_limit = Duration::from_secs(300) + plain_start;
    let mut said = Instant::now() - Duration::from_secs(60);
    loop {
        if said.elapsed() >= Duration::from_secs(10) {
            trainer.handle.announce();
            followers.iter().for_each(|p| p.handle.announce());
            said = Instant::now();
        }
        let ready = followers.iter().all(|p| {
            followers_of(&p.handle, MODEL, GROUP).len() == a.followers - 1
                && agentjet::collective::broadcast::follow::newest(&p.handle, MODEL, GROUP)
                    .is_some()
        });
        if ready {
            break;
        }
        anyhow::ensure!(
            t_start.elapsed() < settle_limit,
            "the views did not settle within {settle_limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // From the start, the plain peers' paced start left out.
    let settle_s = (t_start.elapsed() - plain_start).as_secs_f64();
    // Then until the process is quiet (timers at most 50 ms late at p99 in 3 windows of
    // 2 s in a row, or 120 s): the gossip of the announcements can keep both cores busy
    // for a while, and a version timed then measures the CPU.
    let lag = LagProbe::start(Duration::from_millis(100));
    let t1 = Instant::now();
    let mut quiet_in_a_row = 0;
    while quiet_in_a_row < 3 && t1.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        match lag.take_p99() <= Duration::from_millis(50) {
            true => quiet_in_a_row += 1,
            false => quiet_in_a_row = 0,
        }
    }
    let quiet_s = t1.elapsed().as_secs_f64();
    lag.take();
    println!(
        "broadcast: {} followers settled in {settle_s:.1} s, quiet {quiet_s:.1} s later",
        a.followers
    );
    let mut versions = Vec::new();
    for v in 1..=a.versions as u64 {
        model.step(a.lr);
        let bytes = model.snapshot();
        let sent0 = trainer_holder
            .store
            .served_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        lag.take();
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let hash = hash_hex(&bytes);
        let (h, layout) = (trainer_holder.clone(), model.layout.clone());
        let held: Held =
            tokio::task::spawn_blocking(move || h.hold(&layout, bytes, v, &hash)).await??;
        let changed = held
            .manifest
            .changed_since(&prev.manifest)
            .map_or(held.manifest.chunks.len(), |c| c.len());
        prev = held.clone();
        loop {
            let got = lock(&arrivals)
                .iter()
                .filter(|(_, r)| r.version == v)
                .count();
            if got == a.followers || t0.elapsed() > a.limit {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let busy_cores = (cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64().max(1e-3);
        // The deltas a late request for them would still take.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let sent = trainer_holder
            .store
            .served_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
            - sent0;
        let mine: Vec<Arrival> = {
            let mut all = lock(&arrivals);
            let (this, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(_, r)| r.version == v);
            *all = rest;
            this.into_iter().map(|(_, r)| r).collect()
        };
        let mut times: Vec<f64> = mine
            .iter()
            .map(|r| r.at.saturating_duration_since(t0).as_secs_f64())
            .collect();
        times.sort_by(f64::total_cmp);
        let mut heard: Vec<f64> = mine
            .iter()
            .map(|r| r.started.saturating_duration_since(t0).as_secs_f64())
            .collect();
        heard.sort_by(f64::total_cmp);
        let mut fetching: Vec<f64> = mine
            .iter()
            .map(|r| r.at.saturating_duration_since(r.started).as_secs_f64())
            .collect();
        fetching.sort_by(f64::total_cmp);
        let mut copies: Vec<f64> = mine.iter().map(|r| r.bytes as f64).collect();
        copies.sort_by(f64::total_cmp);
        let fetched: u64 = mine.iter().map(|r| r.bytes).sum();
        let from_trainer: u64 = mine.iter().map(|r| r.from_trainer).sum();
        let o = VersionOutcome {
            version: v,
            times,
            copy_bytes: quantile(&copies, 0.5) * weight,
            trainer_bytes: sent as f64 * weight,
            from_followers: 1.0 - from_trainer as f64 / fetched.max(1) as f64,
            changed,
            chunks: held.manifest.chunks.len(),
            wrong: mine.iter().filter(|r| r.id != held.id).count(),
            heard,
            fetching,
            lag_p99: lag.take_p99(),
            busy_cores,
        };
        println!(
            "broadcast: version {v}: {}/{} followers, 50% {:.2} s, 99% {:.2} s (fetch started p50/p99 {:.2}/{:.2} s, took {:.2}/{:.2} s), one copy {:.1} MB, trainer sent {:.1} MB ({:.2} copies), timer lag p99 {} ms, {:.2} cores busy",
            o.times.len(),
            a.followers,
            quantile(&o.times, 0.5),
            quantile(&o.times, 0.99),
            quantile(&o.heard, 0.5),
            quantile(&o.heard, 0.99),
            quantile(&o.fetching, 0.5),
            quantile(&o.fetching, 0.99),
            o.copy_bytes / 1e6,
            o.trainer_bytes / 1e6,
            o.trainer_bytes / o.copy_bytes.max(1.0),
            o.lag_p99.as_millis(),
            o.busy_cores
        );
        versions.push(o);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    stop.request(agentjet::base::stop::StopMode::Abort);
    for t in tasks {
        let _ = t.await;
    }
    let lag_p99 = versions.iter().map(|v| v.lag_p99).max().unwrap_or_default();
    let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let out = Outcome {
        followers: a.followers,
        versions,
        settle_s,
        quiet_s,
        lag_p99,
        rss: rss_bytes(),
        routes: env.nat.map(|_| c.nat_snapshot(&c.live())),
        streams: [
            count(&ports.direct),
            count(&ports.relayed),
            count(&ports.unrouted),
            count(&ports.cut),
        ],
    };
    c.shutdown().await;
    Ok(out)
}

/// The parameter hash a version claims (hex of its snapshot's blake3, as a trainer's).
fn hash_hex(snapshot: &[u8]) -> String {
    blake3::hash(snapshot).to_hex().to_string()
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Outcome> {
    let o = run_once(env, a).await?;
    let rate = env.net.bandwidth;
    let mut table = Table::new(&[
        "version",
        "followers at it",
        "50% / 99% / all (s)",
        "fetch started, p50 / p99 (s)",
        "fetch took, p50 / p99 (s)",
        "one copy of the changed bytes (MB; chunks changed)",
        "one copy over one link (s)",
        "99% / one copy's time",
        "trainer sent (MB)",
        "trainer sent, in copies",
        "star (MB)",
        "star / trainer",
        "followers' bytes from followers",
        "timer lag p99 (ms); cores busy",
    ]);
    let one_copy_s = |v: &VersionOutcome| match rate > 0.0 {
        true => v.copy_bytes / rate,
        false => 0.0,
    };
    for v in &o.versions {
        let star = v.copy_bytes * o.followers as f64;
        let t = &v.times;
        let all = match t.len() == o.followers {
            true => format!("{:.2}", quantile(t, 1.0)),
            false => format!("> {}", a.limit.as_secs()),
        };
        table.row(vec![
            v.version.to_string(),
            format!("{} / {}", t.len(), o.followers),
            format!("{:.2} / {:.2} / {all}", quantile(t, 0.5), quantile(t, 0.99)),
            format!(
                "{:.2} / {:.2}",
                quantile(&v.heard, 0.5),
                quantile(&v.heard, 0.99)
            ),
            format!(
                "{:.2} / {:.2}",
                quantile(&v.fetching, 0.5),
                quantile(&v.fetching, 0.99)
            ),
            format!("{:.1} ({} of {})", v.copy_bytes / 1e6, v.changed, v.chunks),
            format!("{:.2}", one_copy_s(v)),
            format!("{:.2}", quantile(t, 0.99) / one_copy_s(v).max(1e-9)),
            format!("{:.1}", v.trainer_bytes / 1e6),
            format!("{:.2}", v.trainer_bytes / v.copy_bytes.max(1.0)),
            format!("{:.0}", star / 1e6),
            format!("{:.1}", star / v.trainer_bytes.max(1.0)),
            format!("{:.1}%", 100.0 * v.from_followers),
            format!("{}; {:.2}", v.lag_p99.as_millis(), v.busy_cores),
        ]);
    }
    let mut md = format!(
        "{}{}\nA {:.2} GB bfloat16 model scaled 1:{} (a {:.1} MB snapshot whose chunk-protocol replies count {}x on the links; chunks of {} KiB standing for {} KiB), 1 trainer and {} followers that start at version 0; each version moves every value of an f32 master copy by {} (a synthetic Adam-like step) and publishes its bfloat16 rounding. Times: from the trainer holding the version (its manifest made and announced; the deltas are encoded after) to each follower holding it (fetched, checked, served). One copy: the changed chunks as one follower fetched them (deltas), median over followers. Star: the trainer sending that copy to every follower. {} chunk requests in flight per follower. Settled after {:.0} s (every follower's view shows the trainer's version and every other follower), quiet {:.0} s later; timer lag p99 over the versions {} ms; RSS {:.0} MB.\n",
        env.preamble("Scenario 6: weight broadcast to rollout peers", command),
        table.markdown(),
        a.model_bytes as f64 / 1e9,
        a.scale,
        a.model_bytes as f64 / a.scale / 1e6,
        a.scale,
        a.chunk as f64 / a.scale / 1024.0,
        a.chunk / 1024,
        o.followers,
        a.lr,
        a.parallel,
        o.settle_s,
        o.quiet_s,
        o.lag_p99.as_millis(),
        o.rss as f64 / 1e6,
    );
    if a.peers > 0 {
        md.push_str(&format!(
            "\n{} plain peers besides them ({} peers in all).\n",
            a.peers,
            o.followers + 3 + a.peers
        ));
    }
    if let (Some(r), Some(m)) = (&o.routes, env.nat) {
        md.push_str(&format!(
            "\n## Weight streams behind NAT\n\nThe chunk protocol's streams opened directly: {}, through a relay: {}, not opened (no connection between the two swarms): {}; relayed streams the relay cut at its limits ({} GiB or {} s per circuit; here each stream is its own circuit, where the product's streams share their connection's): {}.\n\n",
            o.streams[0],
            o.streams[1],
            o.streams[2],
            agentjet::swarm::RelayLimits::default().circuit_bytes >> 30,
            agentjet::swarm::RelayLimits::default().circuit_duration.as_secs(),
            o.streams[3],
        ));
        md.push_str(&r.markdown(&m.label()));
    }
    let json = json!({
        "followers": o.followers,
        "peers": a.peers,
        "streams_direct_relayed_unrouted_cut": o.streams,
        "nat": o.routes.as_ref().map(Snapshot::json),
        "model_bytes": a.model_bytes,
        "scale": a.scale,
        "chunk_bytes": a.chunk,
        "lr": a.lr,
        "parallel": a.parallel,
        "settle_s": o.settle_s,
        "quiet_s": o.quiet_s,
        "lag_p99_ms": o.lag_p99.as_millis() as u64,
        "rss_bytes": o.rss,
        "versions": o.versions.iter().map(|v| json!({
            "version": v.version,
            "times_s": v.times,
            "t50_s": quantile(&v.times, 0.5),
            "t99_s": quantile(&v.times, 0.99),
            "fetch_started_s": v.heard,
            "fetch_took_s": v.fetching,
            "copy_bytes": v.copy_bytes,
            "one_copy_s": one_copy_s(v),
            "trainer_bytes": v.trainer_bytes,
            "from_followers": v.from_followers,
            "changed_chunks": v.changed,
            "chunks": v.chunks,
            "lag_p99_ms": v.lag_p99.as_millis() as u64,
            "busy_cores": v.busy_cores,
        })).collect::<Vec<_>>(),
    });
    let series = o
        .versions
        .iter()
        .map(|v| Series {
            name: format!("version {}", v.version),
            points: v
                .times
                .iter()
                .enumerate()
                .map(|(i, t)| (*t, (i + 1) as f64 * 100.0 / o.followers as f64))
                .collect(),
        })
        .collect::<Vec<_>>();
    let svg = svg_plot(
        "Followers at the new version",
        "seconds since the trainer held it",
        "% of followers",
        &series,
    );
    write_results(&env.out, "broadcast", &md, &json, Some(&svg))?;
    Ok(o)
}
