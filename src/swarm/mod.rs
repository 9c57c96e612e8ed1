//! The swarm: one libp2p node per peer (QUIC, with TCP + noise + yamux as a fallback),
//! identify, ping, a gossipsub status mesh, Kademlia for model discovery, NAT traversal
//! (AutoNAT, circuit relay v2 as client and service, DCUtR hole punching, UPnP; see
//! [`reach`] and [`addrs`]), and AgentJet's own stream protocols (see [`protocol`]), all behind the swarm key (see [`auth`]), and who is trusted to serve and train (see
//! [`trust`]).
//!
//! Owns: moving bytes and typed messages between peers, discovery, membership, access
//! control and the per-peer bounds. Knows nothing of models or tensors (the server and
//! client roles give meaning to the messages, see `rpc`) and never touches LibTorch; it
//! imports nothing of the crate but `base` (the layering test checks it).

pub mod addrs;
mod admission;
pub mod auth;
mod config;
pub mod frame;
mod handle;
mod limits;
pub mod node;
pub mod protocol;
pub mod reach;
mod shared;
pub mod sign;
pub mod trust;
mod usage;

pub use auth::{KeyError, SwarmKey};
pub use config::{BoxedTransport, OtherTransport, RelayLimits, SwarmConfig};
pub use handle::SwarmHandle;
pub use libp2p::multiaddr::Protocol;
pub use libp2p::{identity::Keypair, Multiaddr, PeerId, Stream, StreamProtocol};
pub use limits::Refusal;
pub use node::spawn_node;
pub use protocol::{
    CacheSummary, GroupStatus, ModelStatus, PeerStatus, Role, WeightsStatus, STOPPING_FIELD,
};
pub use reach::{LinkKind, NetEvent, Reachability};
pub use shared::{ProviderLookup, RelayLoad, ViewEntry};
pub use trust::{Certificate, Certified, Grant, RunId, RunKey, Trust, TrustError};
pub use usage::PeerStream;

use std::path::{Path, PathBuf};

/// What can go wrong talking to the swarm.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SwarmError {
    #[error("starting the node: {0}")]
    Setup(String),
    #[error("the swarm node has stopped")]
    Stopped,
    #[error("{peer} is unreachable: {reason}")]
    Unreachable { peer: PeerId, reason: String },
    #[error("{peer} refused: {reason}")]
    Refused { peer: PeerId, reason: String },
    #[error("timed out {0}")]
    Timeout(String),
    #[error("protocol: {0}")]
    Protocol(String),
}

/// Why a peer's identity, address or bootstrap list could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PeerFileError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not an identity key: {problem}", path.display())]
    NotAKey { path: PathBuf, problem: String },
    #[error("{input:?} is not a multiaddr: {problem}")]
    NotAnAddr { input: String, problem: String },
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<PeerFileError>,
    },
}

fn io(path: &Path, source: std::io::Error) -> PeerFileError {
    PeerFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Loads this peer's identity from `path`, or creates one there (mode 0600) on first use,
/// so that its peer id and address survive restarts.
pub fn load_or_create_identity(path: &Path) -> Result<Keypair, PeerFileError> {
    if path.exists() {
        let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
        return Keypair::from_protobuf_encoding(&bytes).map_err(|e| PeerFileError::NotAKey {
            path: path.to_path_buf(),
            problem: e.to_string(),
        });
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let key = Keypair::generate_ed25519();
    let bytes = key.to_protobuf_encoding().expect("an ed25519 key encodes");
    crate::base::files::write_secret(path, &bytes).map_err(|e| io(path, e))?;
    Ok(key)
}

/// Parses a multiaddr given on the command line or in a bootstrap file.
pub fn parse_addr(s: &str) -> Result<Multiaddr, PeerFileError> {
    s.trim()
        .parse::<Multiaddr>()
        .map_err(|e| PeerFileError::NotAnAddr {
            input: s.to_string(),
            problem: e.to_string(),
        })
}

/// Reads a bootstrap list: one multiaddr per line, `#` comments and blank lines ignored.
pub fn read_bootstrap_file(path: &Path) -> Result<Vec<Multiaddr>, PeerFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| {
            parse_addr(l).map_err(|e| PeerFileError::InFile {
                path: path.to_path_buf(),
                source: Box::new(e),
            })
        })
        .collect()
}
