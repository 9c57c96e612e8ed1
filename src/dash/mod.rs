//! The dashboard every server (and, with `--dashboard`, every client) serves on a local
//! HTTP port: one page, its script and style embedded in the binary (nothing is loaded
//! from another site), fed by JSON endpoints and a server-sent event stream, plus the
//! peer's Prometheus `/metrics`.
//!
//! - `GET /`: the page. It shows the swarm as this peer's gossip view has it (peers,
//!   roles, models, policy versions, load, queue, prefix-cache hit rate), the training
//!   groups (members, epoch, mode, parameters, last all-reduce), the clients (episodes,
//!   per minute, aborted, recent reward by model and task source, from their gossip), this
//!   peer's runs as live curves (a training run: reward, loss, KL, entropy, clip
//!   fraction, tokens/s per step; a client's: reward by episode and task source,
//!   episodes per minute) and, on a client, its episodes in flight and recent (status,
//!   reward, calls, the merged timeline's continued calls and breaks, the agent's logs).
//! - `GET /boot.js`: the first state (as `/api/live`, and each run's last points), loaded
//!   by the page before its own script, so the page is rendered when it has loaded.
//! - `GET /api/live`: the view, the role's own figures and the runs (JSON).
//! - `GET /api/events`: server-sent events, every second: `live` (as `/api/live`) and
//!   `points` (each run's new lines since the last event; the first event has the tail).
//! - `GET /api/runs`, `GET /api/runs/{run}/points?from=OFFSET`,
//!   `GET /api/runs/{run}/logs/{file}` (an agent's log, the last 256 KiB).
//! - `GET /metrics`: Prometheus text (names in README.md, "Metrics").
//!
//! Bad input gets a 4xx with a JSON `error` and the peer keeps serving: an unknown run
//! (404), a log name that is not a plain file name (400: no path leaves the run's
//! `episodes/`), a query over [`MAX_QUERY_BYTES`] (414), a malformed offset (400), more
//! than [`MAX_EVENT_STREAMS`] event streams at once (503).
//!
//! Owns: the HTTP surface and its bounds. What it shows comes from the role through
//! [`DashSource`] (passed in: the roles are above this layer) and from the swarm's view.

mod api;
mod assets;
pub mod runs;
mod state;

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

pub use crate::base::prom::Prom;
pub use runs::{RunKind, RunRef};
pub use state::{DashSource, MAX_EVENT_STREAMS, MAX_QUERY_BYTES};

use crate::base::Stop;
use crate::swarm::SwarmHandle;
use state::DashState;

/// The dashboard's router for `source` (`role`: "server" or "client"); its event
/// streams end with `stop`.
pub fn router(
    source: Arc<dyn DashSource>,
    swarm: SwarmHandle,
    role: &'static str,
    stop: Stop,
) -> axum::Router {
    api::router(Arc::new(DashState {
        source,
        swarm,
        role,
        stop,
        requests: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        streams: AtomicUsize::new(0),
    }))
}
