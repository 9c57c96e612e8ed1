//! A training-group member for the simulation: the project's own member loop
//! (`agentjet::collective::member::MemberLoop`, the code a server runs: ballots and
//! epochs, heartbeat rounds, a step's stats, values and commit rounds, the hash round,
//! the recovery rule, state transfer to joiners; `collective::ring` over sealed links)
//! over the simulated links, driving the trainer's stand-in
//! (`agentjet::collective::member::toy::ToyLearner`).
//!
//! Why a stand-in: the server's learner owns a LibTorch trainer, an engine and stored
//! episodes, which dozens of members in one two-core process cannot hold. The stand-in
//! keeps what the group sees (see its docs); every member always has a batch ready (the
//! clients keep up). What a member did is counted from the loop's events ([`Progress`]),
//! and a test can receive the events themselves ([`MemberSpec::events`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentjet::base::{Stop, StopMode};
use agentjet::collective::group::{GroupConfig, GroupNode};
use agentjet::collective::member::toy::{ToyConfig, ToyHooks, ToyLearner};
use agentjet::collective::member::{EventSink, Learner, LoopConfig, MemberEvent, MemberLoop};
use agentjet::collective::Wire;
use agentjet::swarm::{GroupStatus, ModelStatus, Role, SwarmHandle};

pub use agentjet::collective::member::Mode;

use crate::cluster::{Cluster, SimPeer, MODEL};
use crate::links::{LinkPorts, SimLinks};

/// The group's name in the swarm's status.
pub const GROUP: &str = "netsim";

/// A member's settings.
#[derive(Debug, Clone)]
pub struct MemberConfig {
    pub values: usize,
    pub compute: Duration,
    pub mode: Mode,
    pub wire: Wire,
    /// Every this many group steps the members compare parameter hashes (0: never).
    pub hash_every: u64,
    pub heartbeat: Duration,
    /// A round's bound (the group's): DiLoCo's heartbeat period stays under a quarter.
    pub timeout: Duration,
    pub lr: f32,
    /// Tests only: hold every value round this long mid-way.
    pub midway_pause: Option<Duration>,
    /// Tests only: from this group step on, the member sends NaN values (a rogue).
    pub send_nan_from: Option<u64>,
}

impl MemberConfig {
    pub fn loop_config(&self) -> LoopConfig {
        LoopConfig {
            mode: self.mode,
            groups_per_step: 1,
            wire: self.wire,
            hash_every: self.hash_every,
            midway_pause: self.midway_pause,
            send_nan_from: self.send_nan_from,
        }
    }

    pub fn toy(&self, seed: u64) -> ToyConfig {
        ToyConfig {
            values: self.values,
            seed,
            compute: self.compute,
            lr: self.lr,
            mode: self.mode,
            ..ToyConfig::default()
        }
    }
}

/// What a member did, read by the scenario while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Optimizer steps on this member's parameters (DiLoCo: inner steps, counted again
    /// from the outer step after a re-sync).
    pub steps: AtomicU64,
    /// Group steps (sync: steps; DiLoCo: outer steps).
    pub group_steps: AtomicU64,
    /// Bytes this member's links sent and received in value rounds.
    pub value_bytes: AtomicU64,
    /// Seconds spent in value rounds, in microseconds, and the rounds completed.
    pub value_micros: AtomicU64,
    pub value_rounds: AtomicU64,
    pub epochs: AtomicU64,
    /// Heartbeat rounds and their time, in microseconds.
    pub beats: AtomicU64,
    pub beat_micros: AtomicU64,
    /// Members of the ring it is in (0 before the first).
    pub ring_size: AtomicU64,
    pub failed_rounds: AtomicU64,
    pub syncs: AtomicU64,
    /// The member's loop ended with an error (its text is printed).
    pub failed: AtomicBool,
}

impl Progress {
    fn record(&self, e: &MemberEvent) {
        let add = |c: &AtomicU64, n: u64| {
            c.fetch_add(n, Ordering::Relaxed);
        };
        match e {
            MemberEvent::Formed { members, .. } => {
                add(&self.epochs, 1);
                self.ring_size.store(*members as u64, Ordering::Relaxed);
            }
            MemberEvent::Applied {
                steps,
                contributors,
                ..
            } => {
                self.group_steps.store(*steps, Ordering::Relaxed);
                if contributors.is_none() {
                    add(&self.steps, 1);
                }
            }
            MemberEvent::AppliedPending { steps } => {
                self.group_steps.store(*steps, Ordering::Relaxed)
            }
            MemberEvent::InnerStep { .. } => add(&self.steps, 1),
            MemberEvent::ValueRound { round, .. } => {
                add(&self.value_bytes, round.bytes_sent + round.bytes_received);
                add(&self.value_micros, (round.seconds * 1e6) as u64);
                add(&self.value_rounds, 1);
            }
            MemberEvent::Beat { seconds, .. } => {
                add(&self.beats, 1);
                add(&self.beat_micros, (seconds * 1e6) as u64);
            }
            MemberEvent::RoundFailed { .. } => add(&self.failed_rounds, 1),
            MemberEvent::Synced { steps, .. } => {
                add(&self.syncs, 1);
                self.group_steps.store(*steps, Ordering::Relaxed);
            }
            MemberEvent::Failed { .. } => self.failed.store(true, Ordering::Relaxed),
            _ => {}
        }
    }
}

/// Says in `p`'s status that it trains the model in the group (members see each other
/// as candidates from it).
pub fn announce(p: &SimPeer, mode: Mode) {
    let group = GroupStatus {
        name: GROUP.into(),
        mode: mode.name(),
        ..GroupStatus::default()
    };
    set_group(&p.handle, Some(group));
}

/// The group status `handle` gossips (none: not in a group), as a server's.
fn set_group(handle: &SwarmHandle, group: Option<GroupStatus>) {
    handle.set_models(vec![ModelStatus {
        name: MODEL.into(),
        policy_version: 0,
        train_step: 0,
        group,
        cache: Default::default(),
        weights: None,
    }]);
}

/// A new server that announces the group in its status.
pub async fn start_peer(c: &Cluster, mode: Mode) -> anyhow::Result<Arc<SimPeer>> {
    let peer = c.start(Role::Server).await?;
    announce(&peer, mode);
    Ok(peer)
}

/// Waits (up to `limit`) until every one of `peers` sees every other in its view. Every
/// 30 s, and when it gives up, it prints how many of the ordered pairs were seen.
pub async fn wait_views(peers: &[Arc<SimPeer>], limit: Duration) -> bool {
    let t0 = Instant::now();
    let mut said = Instant::now();
    let pairs = peers.len() * peers.len().saturating_sub(1);
    loop {
        let seen: usize = peers
            .iter()
            .map(|p| {
                let view: Vec<_> = p.handle.view().into_iter().map(|e| e.peer).collect();
                peers
                    .iter()
                    .filter(|q| q.peer_id != p.peer_id && view.contains(&q.peer_id))
                    .count()
            })
            .sum();
        if seen == pairs {
            return true;
        }
        let out = t0.elapsed() >= limit;
        if out || said.elapsed() >= Duration::from_secs(30) {
            said = Instant::now();
            println!(
                "  {:.0} s: the members' views hold {seen} of their {pairs} pairs",
                t0.elapsed().as_secs_f64()
            );
        }
        if out {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One member to start.
pub struct MemberSpec {
    pub cfg: MemberConfig,
    /// Draws its gradients.
    pub seed: u64,
    pub hooks: ToyHooks,
    /// Resume from this state (a checkpoint the stand-in saved).
    pub resume: Option<Vec<u8>>,
    /// Every byte of its links counts this many times on the simulated network.
    pub weight: f64,
    /// Where its events go too (tests).
    pub events: Option<Sender<MemberEvent>>,
}

/// A member running on its own thread.
pub struct Running {
    pub peer: Arc<SimPeer>,
    pub stop: Stop,
    pub progress: Arc<Progress>,
    pub thread: std::thread::JoinHandle<Result<ToyLearner, String>>,
}

impl Running {
    /// Stops the loop (a drain: it leaves at the next heartbeat) and waits for it.
    pub fn stop_and_join(self, mode: StopMode) -> Result<ToyLearner, String> {
        self.stop.request(mode);
        self.thread
            .join()
            .unwrap_or_else(|_| Err("the member's thread panicked".into()))
    }
}

/// Starts `spec`'s group node on `peer` and its loop on its own thread (call it on the
/// cluster's runtime).
pub fn spawn(
    c: &Cluster,
    peer: Arc<SimPeer>,
    ports: &Arc<LinkPorts>,
    spec: MemberSpec,
) -> anyhow::Result<Running> {
    let rt = tokio::runtime::Handle::current();
    let mut links = SimLinks::new(
        c.net.clone(),
        peer.node,
        rt.clone(),
        ports.clone(),
        spec.weight,
    );
    if c.nat_mix().is_some() {
        links = links.routed(peer.handle.clone(), c.routes.clone());
    }
    let cfg = spec.cfg;
    let node = GroupNode::start_with(
        peer.handle.clone(),
        rt,
        GroupConfig {
            name: GROUP.into(),
            model: MODEL.into(),
            mode: cfg.mode.name(),
            timeout: cfg.timeout,
            heartbeat: cfg.heartbeat,
            direct_links: true,
        },
        std::net::Ipv4Addr::LOCALHOST.into(),
        Arc::new(links),
    )?;
    let stop = Stop::new();
    let progress = Arc::new(Progress::default());
    let learner = match &spec.resume {
        Some(state) => ToyLearner::resume(cfg.toy(spec.seed), spec.hooks, stop.clone(), state)
            .map_err(|e| anyhow::anyhow!("resuming a member: {e}"))?,
        None => ToyLearner::new(cfg.toy(spec.seed), spec.hooks, stop.clone()),
    };
    let sink: EventSink<'static> = {
        let progress = progress.clone();
        let tx = spec.events;
        let handle = peer.handle.clone();
        Box::new(move |e| {
            progress.record(e);
            // Gossiped as a server gossips it: a member that stopped is no candidate.
            match e {
                MemberEvent::Status(s) => set_group(&handle, Some(s.clone())),
                MemberEvent::Stopped { .. } | MemberEvent::Failed { .. } => {
                    set_group(&handle, None)
                }
                _ => {}
            }
            if let Some(tx) = &tx {
                let _ = tx.send(e.clone());
            }
        })
    };
    let looped = MemberLoop::new(node, cfg.loop_config(), learner, sink);
    let me = peer.peer_id.to_string();
    let thread = std::thread::Builder::new()
        .name(format!("member-{}", spec.seed))
        .spawn(move || {
            // Each member's lines name it (its peer id's last characters).
            let _span =
                tracing::info_span!("member", id = &me[me.len().saturating_sub(6)..]).entered();
            let ended = looped.run().map_err(|e| e.to_string());
            if let Err(e) = &ended {
                tracing::error!("the member's loop ended: {e}");
            }
            ended
        })?;
    Ok(Running {
        peer,
        stop,
        progress,
        thread,
    })
}

/// The parameters' hash a finished member agreed on.
pub fn agreed_hash(l: &ToyLearner) -> [u8; 32] {
    l.hash()
}
