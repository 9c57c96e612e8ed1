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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use agentjet::collective::broadcast::wire::{serve_stream, WeightsStream};
use agentjet::collective::broadcast::{VersionStore, WeightsNet};
use agentjet::swarm::PeerId;
use futures::future::BoxFuture;

use crate::net::{lock, Network, NodeId};
use crate::pipe::weighted_pair_each_way;

/// Who serves the chunk protocol where (one registry per simulated network).
#[derive(Default)]
pub struct WeightsPorts {
    holders: Mutex<HashMap<PeerId, (NodeId, Arc<VersionStore>)>>,
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
            // The stream's admission: a round trip.
            tokio::time::sleep(self.net.latency(self.node, to) * 2).await;
            let weight = if bulk { self.weight } else { 1.0 };
            let (mine, theirs) = weighted_pair_each_way(&self.net, self.node, to, 1.0, weight);
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
