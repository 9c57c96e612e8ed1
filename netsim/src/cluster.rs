//! Many peers in one process: each a real swarm node (`agentjet::swarm::spawn_node`: the
//! same gossip, Kademlia, admission and swarm-key proof the binary runs), reaching the
//! others only through the simulated [`Network`].
//!
//! With a [`NatMix`], each peer sits where the mix says (bootstrap peers public) and runs
//! the binary's NAT traversal as on a real network: public peers are told their address
//! (as `--external-addr` does; AutoNAT cannot judge a `/memory` address) and offer relay
//! service, the others find no verdict, reserve relay slots and punch holes (DCUtR).
//! [`crate::routes::Routes`] keeps what they report.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::base::Rng;
use agentjet::swarm::{
    spawn_node, Keypair, ModelStatus, Multiaddr, PeerId, Protocol, Role, SwarmConfig, SwarmHandle,
    SwarmKey,
};
use anyhow::Context as _;

use crate::net::{lock, Nat, Network, NodeId};
use crate::routes::Routes;
use crate::transport::{addr_of, other_transport, Listeners};

/// The swarm's timers, as the scenarios set them.
#[derive(Debug, Clone)]
pub struct PeerTiming {
    pub status_interval: Duration,
    /// The servers' status interval where it differs from the others' (a training
    /// group's members keep the binary's 2 s while a thousand plain peers in one process
    /// gossip far less often, see `scenario::gossip_interval`).
    pub server_status_interval: Option<Duration>,
    pub provider_ttl: Duration,
    pub rebootstrap_interval: Duration,
    /// A connection with no open stream and no gossip mesh closes after this.
    pub idle_connection_timeout: Duration,
    /// The connection trimmer's marks (`SwarmConfig::max_connections`, `min_connections`).
    pub max_connections: usize,
    pub min_connections: usize,
    pub trim_grace: Duration,
    pub ping_interval: Duration,
}

impl Default for PeerTiming {
    fn default() -> Self {
        // The binary's defaults (`agentjet-peer --help`).
        let swarm = SwarmConfig::new(Role::Plain, Keypair::generate_ed25519());
        PeerTiming {
            status_interval: Duration::from_secs(2),
            server_status_interval: None,
            provider_ttl: Duration::from_secs(30),
            rebootstrap_interval: Duration::from_secs(30),
            idle_connection_timeout: Duration::from_secs(120),
            max_connections: swarm.max_connections,
            min_connections: swarm.min_connections,
            trim_grace: swarm.trim_grace,
            ping_interval: swarm.ping_interval,
        }
    }
}

/// What share of the peers sits where, in percent (bootstrap peers are public).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NatMix {
    pub public: u32,
    pub cone: u32,
    pub symmetric: u32,
}

impl NatMix {
    /// "30,50,20": percent public, behind cone NATs, behind symmetric NATs.
    pub fn parse(s: &str) -> anyhow::Result<NatMix> {
        let v: Vec<u32> = s
            .split(',')
            .map(|x| x.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|e| {
                anyhow::anyhow!("--nat {s:?}: {e} (want PUBLIC,CONE,SYMMETRIC in percent)")
            })?;
        anyhow::ensure!(
            v.len() == 3 && v.iter().sum::<u32>() == 100,
            "--nat {s:?}: want three percentages (public, cone, symmetric) that sum to 100"
        );
        Ok(NatMix {
            public: v[0],
            cone: v[1],
            symmetric: v[2],
        })
    }

    /// "30/50/20".
    pub fn label(&self) -> String {
        format!("{}/{}/{}", self.public, self.cone, self.symmetric)
    }

    /// The next peer's place, given how many of each its role has: the class furthest
    /// behind its share (so every role gets the mix, as closely as its count allows).
    fn pick(&self, placed: &[usize; 3]) -> Nat {
        let n = placed.iter().sum::<usize>() as f64 + 1.0;
        let want = [self.public, self.cone, self.symmetric];
        let classes = [Nat::Public, Nat::Cone, Nat::Symmetric];
        let mut best = (f64::MIN, Nat::Public);
        for i in 0..3 {
            let behind = want[i] as f64 / 100.0 * n - placed[i] as f64;
            if want[i] > 0 && behind > best.0 {
                best = (behind, classes[i]);
            }
        }
        best.1
    }
}

/// One running peer.
pub struct SimPeer {
    pub node: NodeId,
    pub nat: Nat,
    pub peer_id: PeerId,
    pub role: Role,
    pub handle: SwarmHandle,
}

/// The peers of one simulation.
pub struct Cluster {
    pub net: Network,
    /// The libp2p listeners of its nodes.
    listeners: Arc<Listeners>,
    pub timing: PeerTiming,
    key: SwarmKey,
    rng: Mutex<Rng>,
    peers: Mutex<Vec<Arc<SimPeer>>>,
    bootstrap: Vec<Multiaddr>,
    nat: Option<NatMix>,
    /// Peers placed so far per role (public, cone, symmetric).
    placed: Mutex<Vec<(Role, [usize; 3])>>,
    /// What the peers reported of their connections (with a mix).
    pub routes: Arc<Routes>,
}

/// Model name the servers provide.
pub const MODEL: &str = "sim-model";

impl Cluster {
    /// A cluster whose first `bootstraps` peers are plain bootstrap peers (started now).
    pub async fn new(
        net: Network,
        timing: PeerTiming,
        bootstraps: usize,
    ) -> anyhow::Result<Cluster> {
        Cluster::behind_nat(net, timing, bootstraps, None).await
    }

    /// [`Cluster::new`], with each later peer placed where `nat` says (none: all public,
    /// without the NAT traversal, as on one host).
    pub async fn behind_nat(
        net: Network,
        timing: PeerTiming,
        bootstraps: usize,
        nat: Option<NatMix>,
    ) -> anyhow::Result<Cluster> {
        let mut rng = Rng::seeded(net.config().seed ^ 0xc1u64);
        let mut key = [0u8; 32];
        for chunk in key.chunks_mut(8) {
            chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let mut c = Cluster {
            net,
            listeners: Arc::new(Listeners::default()),
            timing,
            key: SwarmKey::from_bytes(key),
            rng: Mutex::new(rng),
            peers: Mutex::new(Vec::new()),
            bootstrap: Vec::new(),
            nat,
            placed: Mutex::new(Vec::new()),
            routes: Arc::new(Routes::default()),
        };
        let mut addrs = Vec::new();
        for _ in 0..bootstraps {
            let p = c.start_at(Role::Plain, Some(Nat::Public)).await?;
            addrs.push(addr_of(p.node).with(Protocol::P2p(p.peer_id)));
        }
        c.bootstrap = addrs;
        Ok(c)
    }

    /// Starts one more peer (joining through the bootstrap peers). Its identity comes
    /// from the seed and its index, so a seed fixes every peer id.
    pub async fn start(&self, role: Role) -> anyhow::Result<Arc<SimPeer>> {
        self.start_at(role, None).await
    }

    /// Whether the peers run the NAT traversal (a mix was given).
    pub fn nat_mix(&self) -> Option<NatMix> {
        self.nat
    }

    /// [`Cluster::start`] at a given place (None: where the mix says next).
    pub async fn start_at(&self, role: Role, at: Option<Nat>) -> anyhow::Result<Arc<SimPeer>> {
        let nat = match (at, self.nat) {
            (Some(n), _) => n,
            (None, None) => Nat::Public,
            (None, Some(mix)) => {
                let mut placed = lock(&self.placed);
                let i = match placed.iter().position(|(r, _)| *r == role) {
                    Some(i) => i,
                    None => {
                        placed.push((role, [0; 3]));
                        placed.len() - 1
                    }
                };
                let n = mix.pick(&placed[i].1);
                placed[i].1[n as usize] += 1;
                n
            }
        };
        let node = self.net.add_node_behind(nat);
        let mut seed = [0u8; 32];
        {
            let mut rng = lock(&self.rng);
            for chunk in seed.chunks_mut(8) {
                chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
        }
        let keypair = Keypair::ed25519_from_bytes(seed).context("identity")?;
        let peer_id = keypair.public().to_peer_id();
        let mut cfg = SwarmConfig::new(role, keypair);
        cfg.listen = vec![addr_of(node)];
        cfg.bootstrap = self.bootstrap.clone();
        cfg.swarm_key = Some(self.key.clone());
        cfg.status_interval = match (role, self.timing.server_status_interval) {
            (Role::Server, Some(interval)) => interval,
            _ => self.timing.status_interval,
        };
        cfg.provider_ttl = self.timing.provider_ttl;
        cfg.rebootstrap_interval = self.timing.rebootstrap_interval;
        cfg.idle_connection_timeout = self.timing.idle_connection_timeout;
        cfg.max_connections = self.timing.max_connections;
        cfg.min_connections = self.timing.min_connections;
        cfg.trim_grace = self.timing.trim_grace;
        cfg.ping_interval = self.timing.ping_interval;
        cfg.other_transport = Some(other_transport(&self.net, &self.listeners, node));
        if self.nat.is_some() {
            cfg.single_host = Some(false);
            // No gateway to ask, and AutoNAT's servers refuse addresses without an IP.
            cfg.upnp = false;
            cfg.autonat_every = Duration::from_secs(24 * 3600);
            if nat == Nat::Public {
                cfg.external = vec![addr_of(node)];
            }
        }
        let handle = spawn_node(cfg)
            .await
            .with_context(|| format!("starting simulated peer {node}"))?;
        let p = Arc::new(SimPeer {
            node,
            nat,
            peer_id,
            role,
            handle,
        });
        if self.nat.is_some() {
            self.routes.watch(p.node, p.peer_id, p.nat, &p.handle);
        }
        lock(&self.peers).push(p.clone());
        Ok(p)
    }

    /// A server: announces the model with a policy version in its status and provides it
    /// in the DHT, as `--role server` does.
    pub async fn start_server(&self, version: u64) -> anyhow::Result<Arc<SimPeer>> {
        let p = self.start(Role::Server).await?;
        set_version(&p, version);
        p.handle.provide(MODEL).await?;
        Ok(p)
    }

    /// Every peer started (crashed ones too).
    pub fn peers(&self) -> Vec<Arc<SimPeer>> {
        lock(&self.peers).clone()
    }

    /// The peers not crashed.
    pub fn live(&self) -> Vec<Arc<SimPeer>> {
        self.peers()
            .into_iter()
            .filter(|p| !self.net.is_crashed(p.node))
            .collect()
    }

    /// How `peers` are connected now (see [`Routes::snapshot`]).
    pub fn nat_snapshot(&self, peers: &[Arc<SimPeer>]) -> crate::routes::Snapshot {
        let list: Vec<_> = peers
            .iter()
            .map(|p| (p.peer_id, p.nat, &p.handle))
            .collect();
        self.routes.snapshot(&list)
    }

    /// A hard crash: the network drops the peer (nothing in or out, no goodbye), then its
    /// node is stopped to free its memory.
    pub async fn crash(&self, p: &SimPeer) {
        self.net.crash(p.node);
        p.handle.shutdown(Duration::from_secs(1)).await;
    }

    /// Stops every peer.
    pub async fn shutdown(&self) {
        for p in self.peers() {
            self.net.crash(p.node);
            p.handle.shutdown(Duration::from_millis(200)).await;
        }
    }
}

/// Sets the policy version a server gossips for [`MODEL`].
pub fn set_version(p: &SimPeer, version: u64) {
    p.handle.set_models(vec![ModelStatus {
        name: MODEL.into(),
        policy_version: version,
        train_step: version,
        group: None,
        cache: Default::default(),
        weights: None,
    }]);
}

/// How late the runtime's timers fire (the simulation is CPU-bound when this grows):
/// a task that sleeps `tick` again and again records each overshoot.
pub struct LagProbe {
    samples: Arc<Mutex<Vec<Duration>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LagProbe {
    pub fn start(tick: Duration) -> LagProbe {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let s = samples.clone();
        let task = tokio::spawn(async move {
            loop {
                let t = tokio::time::Instant::now();
                tokio::time::sleep(tick).await;
                lock(&s).push(t.elapsed().saturating_sub(tick));
            }
        });
        LagProbe { samples, task }
    }

    /// The overshoots so far (and clears them).
    pub fn take(&self) -> Vec<Duration> {
        std::mem::take(&mut *lock(&self.samples))
    }

    /// Whether the overshoots so far (cleared) were at most `limit` at p99; none at all
    /// is not caught up (the probe's timer never got its turn).
    pub fn caught_up(&self, limit: Duration) -> bool {
        let lags = self.take();
        !lags.is_empty()
            && crate::report::quantile(&crate::report::secs(&lags), 0.99) <= limit.as_secs_f64()
    }

    /// The 99th percentile of the overshoots so far (and clears them).
    pub fn take_p99(&self) -> Duration {
        let lags = crate::report::secs(&self.take());
        Duration::from_secs_f64(crate::report::quantile(&lags, 0.99))
    }
}

impl Drop for LagProbe {
    fn drop(&mut self) {
        self.task.abort();
    }
}
