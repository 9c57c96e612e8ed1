//! The weight broadcast's chunk protocol over the simulated network: a [`WeightsNet`]
//! whose streams are [`crate::pipe::SimStream`] pairs between the two peers' nodes (the
//! same latency, access-link caps and loss as the swarm's connections), answered by the
//! protocol's own handler ([`serve_stream`]) on the holder's [`VersionStore`].
//!
//! Why not the swarm's streams: a scaled-down model stands for a bigger one, so its
//! chunk bytes must take the bigger one's time on the links (as scenario 4 weights the
//! training group's links), and every substream of a swarm connection shares one
//! simulated connection. Here a holder's replies on a stream for chunks count as `weight`
//! bytes per byte; the requests (names and numbers, the same size whatever the model)
//! and the manifests (the chunk hashes: as many as the bigger model's, since its chunks
//! are scaled down too) count as what they are. Opening a stream costs one round trip,
//! as the swarm's admission frame does.
//!
//! With peers behind NAT ([`SimWeights::routing`]), a stream follows the connection the
//! two peers' swarms have, as the product's streams do (see `links::route`):
//! directly, or through the relay that carries their relayed connection (each byte then
//! crosses the relay's links, and the relay cuts the circuit at its limits: here per
//! stream, where the product's streams share one circuit per connection); with no
//! connection between the swarms the open fails, as the product's does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use agentjet::collective::broadcast::wire::{serve_stream, WeightsStream};
use agentjet::collective::broadcast::{VersionStore, WeightsNet};
use agentjet::swarm::{PeerId, RelayLimits, SwarmHandle};
use futures::future::BoxFuture;

use crate::links::{route, Route};
use crate::net::{lock, Network, NodeId};
use crate::pipe::{relayed_pair, weighted_pair_each_way};
use crate::routes::Routes;

/// Who serves the chunk protocol where (one registry per simulated network).
#[derive(Default)]
pub struct WeightsPorts {
    holders: Mutex<HashMap<PeerId, (NodeId, Arc<VersionStore>)>>,
    /// Streams opened directly, through a relay, and not opened (no connection between
    /// the swarms), with peers behind NAT.
    pub direct: AtomicU64,
    pub relayed: AtomicU64,
    pub unrouted: AtomicU64,
    /// Relayed streams the relay cut at its limits.
    pub cut: Arc<AtomicU64>,
}

impl WeightsPorts {
    /// `peer` (on `node`) serves the versions `store` holds.
    pub fn serve(&self, peer: PeerId, node: NodeId, store: Arc<VersionStore>) {
        lock(&self.holders).insert(peer, (node, store));
    }
}

/// One peer's side of the chunk protocol's network.
pub struct SimWeights {
    pub net: Network,
    pub node: NodeId,
    pub peer: PeerId,
    pub ports: Arc<WeightsPorts>,
    /// Bytes on the links per byte a holder sends.
    pub weight: f64,
    /// This peer's swarm and the cluster's routes (peers behind NAT).
    pub routing: Option<(SwarmHandle, Arc<Routes>)>,
}

impl WeightsNet for SimWeights {
    fn open(
        &self,
        peer: PeerId,
        bulk: bool,
    ) -> BoxFuture<'_, Result<Box<dyn WeightsStream>, String>> {
        Box::pin(async move {
            let (to, store) = lock(&self.ports.holders)
                .get(&peer)
                .cloned()
                .ok_or_else(|| format!("{peer} serves no weights"))?;
            if self.net.is_crashed(to) || self.net.is_crashed(self.node) {
                tokio::time::sleep(self.net.config().connect_timeout).await;
                return Err(format!("{peer}: no answer"));
            }
            let via = match &self.routing {
                None => Route::Direct,
                Some((handle, routes)) => {
                    let wait = self.net.config().connect_timeout;
                    match route(&self.net, handle, routes, to, wait).await {
                        Ok(r) => r,
                        Err(e) => {
                            self.ports.unrouted.fetch_add(1, Ordering::Relaxed);
                            return Err(format!("{peer}: {e}"));
                        }
                    }
                }
            };
            let weight = if bulk { self.weight } else { 1.0 };
            let from = self.node;
            let (mine, theirs) = match via {
                Route::Direct => {
                    if self.routing.is_some() {
                        self.ports.direct.fetch_add(1, Ordering::Relaxed);
                    }
                    // The stream's admission: a round trip.
                    tokio::time::sleep(self.net.latency(from, to) * 2).await;
                    weighted_pair_each_way(&self.net, from, to, 1.0, weight)
                }
                Route::Via(r) => {
                    self.ports.relayed.fetch_add(1, Ordering::Relaxed);
                    let rtt = (self.net.latency(from, r) + self.net.latency(r, to)) * 2;
                    tokio::time::sleep(rtt).await;
                    let limits = RelayLimits::default();
                    relayed_pair(
                        &self.net,
                        &tokio::runtime::Handle::current(),
                        (from, r, to),
                        (1.0, weight),
                        (limits.circuit_bytes, limits.circuit_duration),
                        self.ports.cut.clone(),
                    )
                }
            };
            let asker = self.peer;
            tokio::spawn(async move {
                if let Err(e) = serve_stream(store, asker, theirs).await {
                    tracing::debug!(%asker, "a simulated weights stream ended: {e}");
                }
            });
            Ok(Box::new(mine) as Box<dyn WeightsStream>)
        })
    }
}
