//! Many peers in one process: each a real swarm node (`agentjet::swarm::spawn_node`: the
//! same gossip, Kademlia, admission and swarm-key proof the binary runs), reaching the
//! others only through the simulated [`Network`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentjet::base::Rng;
use agentjet::swarm::{
    spawn_node, Keypair, ModelStatus, Multiaddr, PeerId, Protocol, Role, SwarmConfig, SwarmHandle,
    SwarmKey,
};
use anyhow::Context as _;

use crate::net::{lock, Network, NodeId};
use crate::transport::{addr_of, other_transport, Listeners};

/// The swarm's timers, as the scenarios set them.
#[derive(Debug, Clone)]
pub struct PeerTiming {
    pub status_interval: Duration,
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

/// One running peer.
pub struct SimPeer {
    pub node: NodeId,
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
        };
        let mut addrs = Vec::new();
        for _ in 0..bootstraps {
            let p = c.start(Role::Plain).await?;
            addrs.push(addr_of(p.node).with(Protocol::P2p(p.peer_id)));
        }
        c.bootstrap = addrs;
        Ok(c)
    }

    /// Starts one more peer (joining through the bootstrap peers). Its identity comes
    /// from the seed and its index, so a seed fixes every peer id.
    pub async fn start(&self, role: Role) -> anyhow::Result<Arc<SimPeer>> {
        let node = self.net.add_node();
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
        cfg.status_interval = self.timing.status_interval;
        cfg.provider_ttl = self.timing.provider_ttl;
        cfg.rebootstrap_interval = self.timing.rebootstrap_interval;
        cfg.idle_connection_timeout = self.timing.idle_connection_timeout;
        cfg.max_connections = self.timing.max_connections;
        cfg.min_connections = self.timing.min_connections;
        cfg.trim_grace = self.timing.trim_grace;
        cfg.ping_interval = self.timing.ping_interval;
        cfg.other_transport = Some(other_transport(&self.net, &self.listeners, node));
        let handle = spawn_node(cfg)
            .await
            .with_context(|| format!("starting simulated peer {node}"))?;
        let p = Arc::new(SimPeer {
            node,
            peer_id,
            role,
            handle,
        });
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
