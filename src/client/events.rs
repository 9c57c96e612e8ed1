//! What a client tells a program watching it ([`ClientEvent`], in [`super::Client::events`]
//! and, with `--events FILE`, as JSON lines): that it listens, where its proxy and
//! dashboard answer, that its job runs, that it drains, and how the job ended. The lines
//! it prints say the same to a person.

use serde::{Deserialize, Serialize};

/// One thing a client did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ClientEvent {
    /// Its swarm node listens (each address ends in its peer id).
    Started {
        peer_id: String,
        listen: Vec<String>,
    },
    /// What happened to its network: reachability, connections and their kind (direct,
    /// hole-punched, relayed), relay reservations, hole punches, bootstrap failures.
    Network(crate::swarm::NetEvent),
    /// The OpenAI-compatible proxy answers at `url` (`http://127.0.0.1:PORT/v1`) for
    /// these trainable models.
    Proxy {
        url: String,
        models: Vec<String>,
    },
    Dashboard {
        addr: String,
    },
    /// The job runs: `groups` groups of `num_repeat` episodes, `concurrency` at once.
    Running {
        groups: usize,
        num_repeat: usize,
        concurrency: usize,
        run_dir: String,
    },
    /// The job's time limit passed: no new episodes.
    TimeLimit {
        secs: f64,
    },
    /// A stop came: no new episodes; `running` ones finish and are submitted.
    Draining {
        running: usize,
    },
    /// The job ended: episodes done and aborted.
    Finished {
        episodes: usize,
        aborted: usize,
    },
    /// The role stopped (proxy and node closed).
    Stopped,
}
