//! What the dashboard's endpoints share: the role's source, the swarm, the stop, the
//! counters, and the bounds on what a request may ask.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use serde_json::Value;

use super::runs::RunRef;
use crate::base::prom::Prom;
use crate::base::Stop;
use crate::swarm::SwarmHandle;

/// A query string longer than this is refused (414).
pub const MAX_QUERY_BYTES: usize = 2048;
/// Event streams open at once, at most.
pub const MAX_EVENT_STREAMS: usize = 32;

/// What a role shows on its dashboard (the server's and the client's implement it).
pub trait DashSource: Send + Sync + 'static {
    /// This peer's own live figures (a JSON object the page knows by its `kind`).
    fn live(&self) -> Value;
    /// The runs it shows.
    fn runs(&self) -> Vec<RunRef>;
    /// Its metrics for `/metrics` (beside the dashboard's own and the swarm's).
    fn metrics(&self, p: &mut Prom);
}

pub(crate) struct DashState {
    pub source: Arc<dyn DashSource>,
    pub swarm: SwarmHandle,
    pub role: &'static str,
    pub stop: Stop,
    pub requests: AtomicU64,
    pub refused: AtomicU64,
    pub streams: AtomicUsize,
}
