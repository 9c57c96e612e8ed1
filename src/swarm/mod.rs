//! The swarm: one libp2p node per peer (QUIC, with TCP + noise + yamux as a fallback),
//! identify, ping, a gossipsub status mesh, Kademlia for model discovery, and AgentJet's
//! own stream protocols (see [`protocol`]), all behind the swarm key (see [`auth`]).
//!
//! Owns: moving bytes and typed messages between peers, discovery, membership, access
//! control and the per-peer bounds. Knows nothing of models or tensors (the server and
//! client roles give meaning to the messages) and never touches LibTorch.

pub mod auth;
pub mod frame;
pub mod node;
pub mod protocol;
pub mod sign;

pub use auth::SwarmKey;
pub use libp2p::{identity::Keypair, Multiaddr, PeerId, Stream};
pub use node::{spawn_node, SwarmConfig, SwarmHandle, ViewEntry};
pub use protocol::{ModelStatus, PeerStatus, Role};

use std::path::Path;

/// What can go wrong talking to the swarm.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SwarmError {
    #[error("starting the node: {0}")]
    Setup(String),
    #[error("the swarm node has stopped")]
    Stopped,
    #[error("DHT: {0}")]
    Dht(String),
    #[error("{peer} is unreachable: {reason}")]
    Unreachable { peer: PeerId, reason: String },
    #[error("{peer} refused: {reason}")]
    Refused { peer: PeerId, reason: String },
    #[error("timed out {0}")]
    Timeout(String),
    #[error("protocol: {0}")]
    Protocol(String),
}

/// Loads this peer's identity from `path`, or creates one there (mode 0600) on first use,
/// so that its peer id and address survive restarts.
pub fn load_or_create_identity(path: &Path) -> Result<Keypair, String> {
    if path.exists() {
        let bytes = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        return Keypair::from_protobuf_encoding(&bytes)
            .map_err(|e| format!("{} is not an identity key: {e}", path.display()));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let key = Keypair::generate_ed25519();
    let bytes = key
        .to_protobuf_encoding()
        .map_err(|e| format!("encoding a new identity: {e}"))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &bytes).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600));
    }
    std::fs::rename(&tmp, path).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(key)
}

/// Parses a multiaddr given on the command line or in a bootstrap file.
pub fn parse_addr(s: &str) -> Result<Multiaddr, String> {
    s.trim()
        .parse::<Multiaddr>()
        .map_err(|e| format!("{s:?} is not a multiaddr: {e}"))
}

/// Reads a bootstrap list: one multiaddr per line, `#` comments and blank lines ignored.
pub fn read_bootstrap_file(path: &Path) -> Result<Vec<Multiaddr>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| parse_addr(l).map_err(|e| format!("{}: {e}", path.display())))
        .collect()
}
