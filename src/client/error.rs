//! What can stop a client ([`ClientError`]), shared by the role's parts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::swarm::SwarmError;

/// What can stop a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error("no provider of model {model:?} answered within {:.0} s{}", waited.as_secs_f64(),
        last_error.as_ref().map(|e| format!(" (last error: {e})")).unwrap_or_default())]
    NoProvider {
        model: String,
        waited: Duration,
        last_error: Option<String>,
    },
    #[error("stopped before the swarm was ready")]
    Stopped,
    #[error("--dashboard {addr}: {source}")]
    Dashboard {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("binding the proxy on 127.0.0.1:{port}: {source}")]
    Proxy {
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a journal line ({problem})", path.display())]
    Journal { path: PathBuf, problem: String },
    #[error("the episode loop panicked: {0}")]
    Panicked(String),
}

impl ClientError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ClientError {
        ClientError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
