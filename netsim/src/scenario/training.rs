//! Scenario 4: a training group on internet links, synchronous against DiLoCo.
//!
//! Per mode (`sync`, `diloco/H`, ...): one bootstrap peer and `members` servers, each a
//! real swarm node and a member of one training group ([`crate::member`]: the project's
//! `GroupNode` and ring over the simulated links, driven as the server drives it). The
//! members start their loops once they see each other in the swarm's view. Time runs from
//! the first epoch that holds every member, for `duration`; `crashes` members
//! crash at evenly spaced times (or every so many group steps), each replaced at once by
//! a new server (a new identity, which joins by fetching the group's state). At the end every member stops at the same
//! heartbeat and the table says whether their parameters are bit-identical.
//!
//! Scale: the full model (`model_values`, SmolLM2-135M's by default) does not fit dozens
//! of times in this process, so the members hold `values` parameters and every byte of
//! the collective's links counts as `model_values / values` bytes on the simulated
//! network: a transfer takes the full model's time and the byte counts are the full
//! model's, while the swarm's own traffic (gossip, Kademlia, control) is what it is.
//!
//! The modes run at once, each on its own simulated network (the process is mostly
//! waiting on the simulated links; the timer lag column says when it was not).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentjet::base::StopMode;
use agentjet::collective::member::toy::ToyHooks;
use agentjet::collective::Wire;
use serde_json::json;

use super::Env;
use crate::cluster::{Cluster, LagProbe, PeerTiming, SimPeer};
use crate::links::LinkPorts;
use crate::member::{
    agreed_hash, spawn, start_peer, wait_views, MemberConfig, MemberSpec, Mode, Progress, Running,
};
use crate::net::Network;
use crate::report::{svg_plot, write_results, Series, Table};
use crate::routes::Snapshot;

/// SmolLM2-135M's parameter count.
pub const SMOLLM2_VALUES: u64 = 134_515_008;

#[derive(Debug, Clone)]
pub struct Args {
    pub members: usize,
    /// Plain peers in the swarm besides the members (and one bootstrap peer).
    pub peers: usize,
    pub modes: Vec<Mode>,
    /// Measured per mode, from the first epoch that holds every member.
    pub duration: Duration,
    /// Parameters each simulated member holds.
    pub values: usize,
    /// The model the figures stand for.
    pub model_values: u64,
    /// One step's gradient computation (a GPU's time; slept).
    pub compute: Duration,
    pub crashes: usize,
    /// Crash once the group made this many steps since the last crash (or the start),
    /// instead of at evenly spaced times; and end once it made as many after the last
    /// crash, instead of at `duration` (which then only bounds the run).
    pub crash_every_steps: Option<u64>,
    pub wire: Wire,
    /// A round's bound (the server's `--collective-timeout`).
    pub timeout: Duration,
    /// Give up forming the first full epoch after this.
    pub form_limit: Duration,
    /// The members' status gossip interval (None: the binary's 2 s). The plain peers
    /// gossip at `gossip_interval` of the swarm's size (2 s up to 50 peers; a thousand
    /// peers in one process need far longer).
    pub status: Option<Duration>,
}

/// One mode's figures.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub mode: Mode,
    pub members: usize,
    pub seconds: f64,
    /// Optimizer steps per member per hour (DiLoCo: inner steps).
    pub steps_per_hour: f64,
    /// Group steps per hour (sync: steps; DiLoCo: outer steps).
    pub group_steps_per_hour: f64,
    /// Seconds to form the first epoch with every member.
    pub formed_s: f64,
    /// Bytes (sent + received) of one member's completed value round, full model.
    pub bytes_per_member_step: f64,
    /// Everything a member's access link carried (links at full model, swarm), per hour.
    pub bytes_per_member_hour: f64,
    /// A completed value round at one member, seconds (mean).
    pub round_s_mean: f64,
    /// Mean heartbeat round, seconds.
    pub beat_s_mean: f64,
    pub epochs: u64,
    pub failed_rounds: u64,
    pub syncs: u64,
    pub crashes: usize,
    /// Members whose loop ended with an error.
    pub member_errors: usize,
    /// Every live member's agreed parameters (and momentum) hash the same at the end.
    pub identical: bool,
    /// Why not, when not: distinct agreed hashes, and the lowest and highest group step.
    pub distinct_hashes: usize,
    pub steps_range: (u64, u64),
    /// Seconds the group took to stand in one ring at one step before the stop, or `None`
    /// when it did not within the form limit (members then stop where they are).
    pub settled_s: Option<f64>,
    pub final_group_steps: u64,
    /// Group steps made after the last crash.
    pub after_crash: u64,
    pub lag_p99: Duration,
    /// (seconds, group steps) while it ran.
    pub curve: Vec<(f64, f64)>,
    /// With peers behind NAT: ring links made directly, through a relay, not routed
    /// (over a swarm stream, unweighted), and relayed ones the relay cut at its limit.
    pub links: [u64; 4],
    pub routes: Option<Snapshot>,
}

/// The member's group node and its loop, on its own thread.
fn start_loop(
    c: &Cluster,
    peer: Arc<SimPeer>,
    ports: &Arc<LinkPorts>,
    cfg: &MemberConfig,
    a: &Args,
    index: u64,
) -> anyhow::Result<Running> {
    let spec = MemberSpec {
        cfg: cfg.clone(),
        seed: index.wrapping_mul(0x51ed),
        hooks: ToyHooks::default(),
        resume: None,
        weight: a.model_values as f64 / a.values as f64,
        events: None,
    };
    spawn(c, peer, ports, spec)
}

fn total<F: Fn(&Progress) -> u64>(ms: &[Running], f: F) -> u64 {
    ms.iter().map(|m| f(&m.progress)).sum()
}

/// Runs one mode.
pub async fn run_mode(env: &Env, a: &Args, mode: Mode) -> anyhow::Result<Outcome> {
    anyhow::ensure!(a.members >= 2, "a group needs at least 2 members");
    let weight = a.model_values as f64 / a.values as f64;
    let net = Network::new(env.net.clone());
    let n = a.members + a.peers + 1;
    let mut timing = PeerTiming {
        status_interval: super::gossip_interval(n),
        server_status_interval: Some(a.status.unwrap_or(Duration::from_secs(2))),
        ..Default::default()
    };
    if n > 50 {
        // Pings every 30 s and a DHT walk every 600 s, as scenarios 1 and 6 set them for
        // hundreds of peers in one process (the binary's 5 s and 30 s keep both cores
        // busy; nothing here looks anything up in the DHT).
        timing.ping_interval = Duration::from_secs(30);
        timing.rebootstrap_interval = Duration::from_secs(600);
    }
    let c = Cluster::behind_nat(net.clone(), timing, 1, env.nat).await?;
    let ports = Arc::new(LinkPorts::default());
    let cfg = MemberConfig {
        values: a.values,
        compute: a.compute,
        mode,
        wire: a.wire,
        hash_every: 10,
        heartbeat: Duration::from_millis(500),
        timeout: a.timeout,
        lr: 1e-2,
        midway_pause: None,
        send_nan_from: None,
    };
    let lag = LagProbe::start(Duration::from_millis(100));
    super::start_plain(&c, a.peers, &lag, &mode.name()).await?;
    let mut peers = Vec::new();
    for _ in 0..a.members {
        peers.push(start_peer(&c, mode).await?);
    }
    // A member starts its loop once its view holds the group (a real server has no
    // batch to train alone on before clients find it; here a batch is always ready).
    let t_views = Instant::now();
    let seen = wait_views(&peers, a.form_limit).await;
    let lag_p99 = lag.take_p99();
    anyhow::ensure!(
        seen,
        "the members did not see each other within {:?} (timers {lag_p99:?} late at p99)",
        a.form_limit
    );
    if a.peers > 50 {
        println!(
            "{}: the members saw each other {:.1} s after their start (timers {} ms late \
             at p99)",
            mode.name(),
            t_views.elapsed().as_secs_f64(),
            lag_p99.as_millis()
        );
    }
    let mut ms = Vec::new();
    for (i, p) in peers.into_iter().enumerate() {
        ms.push(start_loop(&c, p, &ports, &cfg, a, i as u64 + 1)?);
    }
    // The first epoch with every member.
    let t0 = Instant::now();
    let formed = loop {
        let all_in = ms
            .iter()
            .all(|m| m.progress.ring_size.load(Ordering::Relaxed) == a.members as u64);
        if all_in {
            break t0.elapsed();
        }
        let ended = ms.iter().filter(|m| m.thread.is_finished()).count();
        anyhow::ensure!(
            t0.elapsed() < a.form_limit && ended == 0,
            "{}: no epoch held all {} members within {:?} ({ended} member loop(s) ended: \
             their error is logged)",
            mode.name(),
            a.members,
            a.form_limit
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    lag.take();
    let sent_at = |ms: &[Running]| -> u64 {
        ms.iter()
            .map(|m| {
                let (s, r) = net.traffic(m.peer.node);
                s + r
            })
            .sum()
    };
    let rounds0 = total(&ms, |p| p.value_rounds.load(Ordering::Relaxed));
    let (steps0, gsteps0, bytes0, micros0, traffic0) = (
        total(&ms, |p| p.steps.load(Ordering::Relaxed)),
        ms[0].progress.group_steps.load(Ordering::Relaxed),
        total(&ms, |p| p.value_bytes.load(Ordering::Relaxed)),
        total(&ms, |p| p.value_micros.load(Ordering::Relaxed)),
        sent_at(&ms),
    );
    let (mut retired_steps, mut retired_bytes, mut retired_micros, mut retired_traffic) =
        (0u64, 0u64, 0u64, 0u64);
    let mut retired_rounds = 0u64;
    let (mut retired_epochs, mut retired_failed, mut retired_syncs) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    let crash_at: Vec<Duration> = (1..=a.crashes)
        .map(|k| a.duration.mul_f64(k as f64 / (a.crashes + 1) as f64))
        .collect();
    let mut crashed = 0;
    let mut at_last_crash = gsteps0;
    let mut curve = Vec::new();
    let mut next_index = a.members as u64 + 1;
    let gsteps_now = |ms: &[Running]| {
        ms.iter()
            .map(|m| m.progress.group_steps.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    };
    while start.elapsed() < a.duration {
        if let Some(k) = a.crash_every_steps {
            if crashed == a.crashes && gsteps_now(&ms).saturating_sub(at_last_crash) >= k {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The curve: a point every 5 s (group steps take tens of seconds).
        let t = start.elapsed().as_secs_f64();
        if curve
            .last()
            .is_none_or(|&(t0, _): &(f64, f64)| t - t0 >= 5.0)
        {
            curve.push((t, gsteps_now(&ms).saturating_sub(gsteps0) as f64));
        }
        let due = match a.crash_every_steps {
            Some(k) => gsteps_now(&ms).saturating_sub(at_last_crash) >= k,
            None => crashed < crash_at.len() && start.elapsed() >= crash_at[crashed],
        };
        if crashed < a.crashes && due {
            // A member (not the first, by index: the seed picks which) dies without a
            // goodbye; a new server takes its place at once.
            at_last_crash = gsteps_now(&ms);
            let victim = 1 + (env.net.seed as usize + crashed * 7) % (ms.len() - 1);
            let gone = ms.remove(victim);
            retired_steps += gone.progress.steps.load(Ordering::Relaxed);
            retired_bytes += gone.progress.value_bytes.load(Ordering::Relaxed);
            retired_micros += gone.progress.value_micros.load(Ordering::Relaxed);
            retired_rounds += gone.progress.value_rounds.load(Ordering::Relaxed);
            let (s, r) = net.traffic(gone.peer.node);
            retired_traffic += s + r;
            retired_epochs += gone.progress.epochs.load(Ordering::Relaxed);
            retired_failed += gone.progress.failed_rounds.load(Ordering::Relaxed);
            retired_syncs += gone.progress.syncs.load(Ordering::Relaxed);
            gone.stop.request(StopMode::Abort);
            c.crash(&gone.peer).await;
            // Its thread ends once its rounds time out; not waited for.
            drop(gone.thread);
            let peer = start_peer(&c, mode).await?;
            let mut group: Vec<Arc<SimPeer>> = ms.iter().map(|m| m.peer.clone()).collect();
            group.push(peer.clone());
            wait_views(&group, a.form_limit).await;
            ms.push(start_loop(&c, peer, &ports, &cfg, a, next_index)?);
            next_index += 1;
            crashed += 1;
            println!(
                "training {}: member crashed at {:.0} s, a new one joins",
                mode.name(),
                start.elapsed().as_secs_f64()
            );
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let after_crash = gsteps_now(&ms).saturating_sub(at_last_crash);
    let steps = total(&ms, |p| p.steps.load(Ordering::Relaxed)) + retired_steps - steps0;
    let gsteps = gsteps_now(&ms).saturating_sub(gsteps0);
    let bytes = total(&ms, |p| p.value_bytes.load(Ordering::Relaxed)) + retired_bytes - bytes0;
    let micros = total(&ms, |p| p.value_micros.load(Ordering::Relaxed)) + retired_micros - micros0;
    let traffic = sent_at(&ms) + retired_traffic - traffic0;
    let rounds = (total(&ms, |p| p.value_rounds.load(Ordering::Relaxed)) + retired_rounds)
        .saturating_sub(rounds0)
        .max(1) as f64;
    let lag_p99 = lag.take_p99();
    // Before the stop, the group settles into one ring of every member at one step (a
    // joiner may still be fetching the state), so the members compared stand together.
    let settle = Instant::now();
    let mut settled_s = None;
    while settle.elapsed() < a.form_limit {
        let p: Vec<(u64, u64)> = ms
            .iter()
            .map(|m| {
                (
                    m.progress.ring_size.load(Ordering::Relaxed),
                    m.progress.group_steps.load(Ordering::Relaxed),
                )
            })
            .collect();
        if p.iter().all(|x| x.0 == a.members as u64 && x.1 == p[0].1) {
            settled_s = Some(settle.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Everyone stops at one heartbeat; the loops return their members.
    for m in &ms {
        m.stop.request(StopMode::Drain);
    }
    let mut hashes = Vec::new();
    let mut member_errors = 0;
    let (mut epochs, mut failed_rounds, mut syncs) =
        (retired_epochs, retired_failed, retired_syncs);
    let mut final_steps = Vec::new();
    let progresses: Vec<Arc<Progress>> = ms.iter().map(|m| m.progress.clone()).collect();
    let beat_s_mean = {
        let beats: u64 = progresses
            .iter()
            .map(|p| p.beats.load(Ordering::Relaxed))
            .sum();
        let micros: u64 = progresses
            .iter()
            .map(|p| p.beat_micros.load(Ordering::Relaxed))
            .sum();
        micros as f64 / 1e6 / beats.max(1) as f64
    };
    for m in ms {
        let joined = tokio::task::spawn_blocking(move || m.thread.join()).await?;
        match joined {
            Ok(Ok(learner)) => hashes.push(agreed_hash(&learner)),
            Ok(Err(e)) => {
                println!("training {}: a member failed: {e}", mode.name());
                member_errors += 1;
            }
            Err(_) => member_errors += 1,
        }
    }
    for p in &progresses {
        epochs += p.epochs.load(Ordering::Relaxed);
        failed_rounds += p.failed_rounds.load(Ordering::Relaxed);
        syncs += p.syncs.load(Ordering::Relaxed);
        final_steps.push(p.group_steps.load(Ordering::Relaxed));
    }
    let routes = env.nat.map(|_| c.nat_snapshot(&c.live()));
    let links = [
        ports.direct.load(Ordering::Relaxed),
        ports.relayed.load(Ordering::Relaxed),
        ports.unrouted.load(Ordering::Relaxed),
        ports.cut.load(Ordering::Relaxed),
    ];
    c.shutdown().await;
    let n = a.members as f64;
    Ok(Outcome {
        mode,
        members: a.members,
        seconds,
        steps_per_hour: steps as f64 / n / seconds * 3600.0,
        group_steps_per_hour: gsteps as f64 / seconds * 3600.0,
        formed_s: formed.as_secs_f64(),
        bytes_per_member_step: bytes as f64 / rounds * weight,
        bytes_per_member_hour: traffic as f64 / n / seconds * 3600.0,
        round_s_mean: micros as f64 / 1e6 / rounds,
        beat_s_mean,
        epochs,
        failed_rounds,
        syncs,
        crashes: crashed,
        member_errors,
        identical: !hashes.is_empty()
            && hashes.iter().all(|h| *h == hashes[0])
            && final_steps.iter().all(|s| *s == final_steps[0]),
        distinct_hashes: hashes
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len(),
        steps_range: (
            final_steps.iter().copied().min().unwrap_or(0),
            final_steps.iter().copied().max().unwrap_or(0),
        ),
        settled_s,
        final_group_steps: final_steps.first().copied().unwrap_or(0),
        after_crash,
        lag_p99,
        curve,
        links,
        routes,
    })
}

/// "yes", or what differed: member errors, distinct parameter hashes (a real
/// divergence), a spread of group steps, or a group that never stood in one ring at one
/// step before the stop (a slow recovery, not a divergence).
fn identical_cell(o: &Outcome) -> String {
    if o.identical {
        return "yes".into();
    }
    let mut why = vec![
        format!("{} member errors", o.member_errors),
        format!("{} distinct hashes", o.distinct_hashes),
        format!("group steps {}-{}", o.steps_range.0, o.steps_range.1),
    ];
    if o.settled_s.is_none() {
        why.push("not settled before the stop".into());
    }
    format!("NO ({})", why.join(", "))
}

fn gb(bytes: f64) -> String {
    format!("{:.2}", bytes / 1e9)
}

pub async fn run(env: &Env, a: &Args, command: &str) -> anyhow::Result<Vec<Outcome>> {
    let mut table = Table::new(&[
        "mode",
        "members",
        "steps/h per member",
        "group steps/h",
        "x sync",
        "value round (s)",
        "heartbeat round (s)",
        "GB per member per group step",
        "GB per member per hour",
        "crashes",
        "epochs formed",
        "failed rounds",
        "state fetches",
        "bit-identical at the end",
        "timer lag p99 (ms)",
    ]);
    let outs: Vec<Outcome> =
        futures::future::join_all(a.modes.iter().map(|&m| run_mode(env, a, m)))
            .await
            .into_iter()
            .collect::<anyhow::Result<_>>()?;
    let sync_rate = outs
        .iter()
        .find(|x| x.mode == Mode::Sync)
        .map(|x| x.steps_per_hour);
    for o in &outs {
        let mode = o.mode;
        println!(
            "training {}: {:.1} steps/h per member, {:.1} group steps/h, value round {:.1} s, heartbeat {:.2} s, identical {}",
            mode.name(),
            o.steps_per_hour,
            o.group_steps_per_hour,
            o.round_s_mean,
            o.beat_s_mean,
            identical_cell(o)
        );
        table.row(vec![
            mode.name(),
            o.members.to_string(),
            format!("{:.1}", o.steps_per_hour),
            format!("{:.1}", o.group_steps_per_hour),
            sync_rate.map_or("-".into(), |s| format!("{:.2}", o.steps_per_hour / s)),
            format!("{:.1}", o.round_s_mean),
            format!("{:.2}", o.beat_s_mean),
            gb(o.bytes_per_member_step),
            gb(o.bytes_per_member_hour),
            o.crashes.to_string(),
            o.epochs.to_string(),
            o.failed_rounds.to_string(),
            o.syncs.to_string(),
            identical_cell(o),
            o.lag_p99.as_millis().to_string(),
        ]);
    }
    let mut md = format!(
        "{}{}\n{} members per mode, measured for {} s from the first step with every member; one step's gradient takes {:.1} s (slept); {:?} wire; a round's timeout {} s. Members hold {} values; each byte of the group's links counts as {:.1} on the network, standing for a model of {} values (a transfer takes its time; bytes are its bytes). The modes ran at once, each on its own network. Steps per hour: each member's optimizer steps (DiLoCo: inner steps on its own batches; sync: steps on the whole group's). Every member always has a batch ready.\n",
        env.preamble("Scenario 4: a training group, synchronous against DiLoCo", command),
        table.markdown(),
        a.members,
        a.duration.as_secs(),
        a.compute.as_secs_f64(),
        a.wire,
        a.timeout.as_secs(),
        a.values,
        a.model_values as f64 / a.values as f64,
        a.model_values,
    );
    if let Some(m) = env.nat {
        for o in &outs {
            md.push_str(&format!(
                "\n## {}: the ring behind NAT\n\nRing links made directly: {}, through a relay: {}, not routed (run over a swarm stream, which this simulation does not weigh): {}; relayed links the relay cut at its data limit ({} GiB): {}.\n\n",
                o.mode.name(),
                o.links[0],
                o.links[1],
                o.links[2],
                agentjet::swarm::RelayLimits::default().circuit_bytes >> 30,
                o.links[3],
            ));
            if let Some(r) = &o.routes {
                md.push_str(&r.markdown(&m.label()));
            }
        }
    }
    let json = json!(outs
        .iter()
        .map(|o| json!({
            "mode": o.mode.name(),
            "members": o.members,
            "seconds": o.seconds,
            "steps_per_hour": o.steps_per_hour,
            "group_steps_per_hour": o.group_steps_per_hour,
            "formed_s": o.formed_s,
            "bytes_per_member_group_step": o.bytes_per_member_step,
            "bytes_per_member_hour": o.bytes_per_member_hour,
            "value_round_s": o.round_s_mean,
            "crashes": o.crashes,
            "epochs": o.epochs,
            "failed_rounds": o.failed_rounds,
            "state_fetches": o.syncs,
            "identical": o.identical,
            "distinct_hashes": o.distinct_hashes,
            "final_group_steps_min": o.steps_range.0,
            "final_group_steps_max": o.steps_range.1,
            "settled_s": o.settled_s,
            "member_errors": o.member_errors,
            "final_group_steps": o.final_group_steps,
            "links_direct_relayed_unrouted_cut": o.links,
            "nat": o.routes.as_ref().map(Snapshot::json),
        }))
        .collect::<Vec<_>>());
    let svg = svg_plot(
        "Group steps over time",
        "seconds",
        "group steps",
        &outs
            .iter()
            .map(|o| Series {
                name: o.mode.name(),
                points: o.curve.clone(),
            })
            .collect::<Vec<_>>(),
    );
    write_results(&env.out, "training", &md, &json, Some(&svg))?;
    Ok(outs)
}
