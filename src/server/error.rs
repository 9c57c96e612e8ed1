//! What can stop a server from starting or stopping cleanly ([`ServerError`]), and its
//! training ([`TrainingError`]), shared by the role's parts.

use std::path::{Path, PathBuf};

use crate::engine::EngineError;
use crate::model::ModelError;
use crate::swarm::SwarmError;
use crate::train::TrainError;

/// What can stop a server from starting or stopping cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("loading model {spec}: {source}")]
    Model {
        spec: String,
        #[source]
        source: ModelError,
    },
    #[error("starting the engine: {0}")]
    Engine(#[source] ModelError),
    #[error("trust: {0}")]
    Trust(String),
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error(transparent)]
    Training(#[from] TrainingError),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not an episode file ({problem})", path.display())]
    Corrupt { path: PathBuf, problem: String },
    #[error(transparent)]
    Card(#[from] ModelError),
    #[error("encoding the model card: {0}")]
    Encode(String),
    #[error("--dashboard {addr}: {source}")]
    Dashboard {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("--http {addr}: {source}")]
    Http {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("a task of the server panicked: {0}")]
    Panicked(String),
}

impl ServerError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> ServerError {
        ServerError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Why training stopped or could not start.
#[derive(Debug, thiserror::Error)]
pub enum TrainingError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("bringing the engine to the new weights: {0}")]
    Engine(#[from] EngineError),
    #[error("starting the training thread: {0}")]
    Thread(std::io::Error),
}
