//! netsim: many AgentJet peers in one process, running the project's own swarm code
//! (`agentjet::swarm`: gossip, Kademlia, admission, the swarm-key proof, noise and yamux)
//! over a simulated internet (see [`net`]): per-pair latency, access-link bandwidth, loss,
//! crashes and partitions, shaped in the transport ([`transport`]) because the kernel's
//! traffic shaping is not available here.
//!
//! Time is real, not virtual: libp2p's timers (Kademlia's query timeouts, gossipsub's
//! heartbeat, ping, idle connections) run on `futures-timer`, which tokio's paused clock
//! does not drive, so a 200 ms link costs 200 ms of wall clock. A seed fixes the links'
//! latencies, every peer's identity and the churn schedule; the interleaving of tasks,
//! and with it the exact figures, varies from run to run. Every scenario reports how late
//! its timers fired (`timer lag`): when one process runs a thousand peers on two cores,
//! a figure measured while the lag is high is an upper bound.
//!
//! Peers may sit behind NAT routers (`net::Nat`, obeyed by the transport) and run the
//! binary's traversal over them (relays, hole punches); `routes` keeps what they report.
//!
//! Layers: `net` (links, NAT routers) -> `pipe` (one shaped connection) -> `transport`
//! (libp2p) -> `routes` (what NAT'd peers report) -> `links` (the collective's data
//! plane) and `weights` (the weight broadcast's) -> `cluster`
//! (peers) and `member` (a training-group member) -> `scenario` (the measurements) ->
//! `report`.

pub mod cluster;
pub mod links;
pub mod member;
pub mod net;
pub mod pipe;
pub mod report;
pub mod routes;
pub mod scenario;
pub mod transport;
pub mod weights;

pub use cluster::{Cluster, NatMix, PeerTiming, SimPeer, MODEL};
pub use net::{Nat, NetConfig, Network, NodeId};
