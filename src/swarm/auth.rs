//! Access control: the swarm key.
//!
//! A swarm may be closed by a 32-byte secret shared out of band (`--swarm-key FILE`).
//! libp2p's private-network transport only covers TCP, so the check is made above the
//! transport, for QUIC and TCP alike: when a connection comes up each side sends, as a
//! request of `/agentjet/auth/1` (answered with the verdict by the other's event loop), `blake3::keyed_hash(key, "agentjet-auth-1" ‖ its peer id ‖
//! the other's peer id)`. The connection's own handshake (TLS for QUIC, noise for TCP)
//! already proves both peer ids, so the proof cannot be replayed by anyone else or towards
//! anyone else, and no nonce is needed.
//!
//! Until a peer has proved the key it gets no service on any AgentJet protocol (every
//! stream is refused with a reason), its gossip is rejected (not forwarded either), it is
//! not put in the DHT's routing table and its provider records are not stored; a peer that
//! has not proved the key within the auth timeout is disconnected. A peer that proved the
//! key stays a member when its connections close (the proof is bound to the two peer
//! ids, which every new connection's handshake proves again, so a second proof would say
//! nothing new): the two ends of a connection do not see it close at the same moment, and
//! a peer that redials within that moment finds the other end still in its old spell of
//! connections, which does not prove again. Denied and pending peers are forgotten. Every
//! refusal is
//! logged with the peer id. Gossip is additionally MACed with the key, so a status relayed
//! through members still has to come from a key holder.
//!
//! A peer started without `--swarm-key` runs an open swarm: it accepts everyone (and is
//! refused by peers that have a key).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use tokio::sync::Notify;

use crate::base::lock;

/// Why a swarm key file was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "expected 64 hex digits, or the three lines `{KEY_HEADER}`, `/base16/`, 64 hex digits"
    )]
    Format,
    #[error("the key must be 64 hex digits (32 bytes), got {0} characters")]
    Length(usize),
    #[error("reading swarm key {}: {problem}", path.display())]
    Read { path: PathBuf, problem: String },
    #[error("swarm key {}: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<KeyError>,
    },
}

/// Why a peer gets no service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotMember {
    #[error("{0}")]
    Denied(String),
    #[error("no proof of the swarm key within {:.0} s", .0.as_secs_f64())]
    NoProof(Duration),
}

/// The shared secret of a closed swarm.
#[derive(Clone, PartialEq, Eq)]
pub struct SwarmKey([u8; 32]);

impl std::fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwarmKey(..)")
    }
}

const KEY_HEADER: &str = "/key/swarm/psk/1.0.0/";

impl SwarmKey {
    pub fn from_bytes(b: [u8; 32]) -> SwarmKey {
        SwarmKey(b)
    }

    /// A fresh random key.
    pub fn generate() -> SwarmKey {
        let mut b = [0u8; 32];
        getrandom(&mut b);
        SwarmKey(b)
    }

    /// Parses the text of a key file: IPFS's format (`/key/swarm/psk/1.0.0/`, `/base16/`,
    /// 64 hex digits) or the 64 hex digits alone.
    pub fn parse(text: &str) -> Result<SwarmKey, KeyError> {
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let hex = match lines.as_slice() {
            [h] => *h,
            [KEY_HEADER, "/base16/", h] => *h,
            _ => return Err(KeyError::Format),
        };
        let b: [u8; 32] = crate::base::hex::decode(hex)
            .and_then(|b| b.try_into().ok())
            .ok_or(KeyError::Length(hex.len()))?;
        Ok(SwarmKey(b))
    }

    pub fn load(path: &Path) -> Result<SwarmKey, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|e| KeyError::Read {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
        SwarmKey::parse(&text).map_err(|e| KeyError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// The key file text (IPFS's format).
    pub fn to_file_text(&self) -> String {
        let hex = crate::base::hex::encode(&self.0);
        format!("{KEY_HEADER}\n/base16/\n{hex}\n")
    }

    /// What `from` sends `to` to prove the key.
    pub fn proof(&self, from: &PeerId, to: &PeerId) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"agentjet-auth-1");
        h.update(&from.to_bytes());
        h.update(&to.to_bytes());
        *h.finalize().as_bytes()
    }

    /// The MAC of a gossip payload.
    pub fn mac(&self, payload: &[u8]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"agentjet-gossip-1");
        h.update(payload);
        *h.finalize().as_bytes()
    }
}

/// Fills `buf` with OS randomness (via the identity crate's key generation, which already
/// depends on the OS source).
fn getrandom(buf: &mut [u8]) {
    for chunk in buf.chunks_mut(32) {
        let k = libp2p::identity::Keypair::generate_ed25519();
        let seed = blake3::hash(&k.to_protobuf_encoding().unwrap_or_default());
        chunk.copy_from_slice(&seed.as_bytes()[..chunk.len()]);
    }
}

/// Where a connected peer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAuth {
    Pending,
    Member,
    Denied(String),
}

/// A peer's state, and since when it has had no connection (a member only: others are
/// forgotten when their last connection closes).
struct Entry {
    auth: PeerAuth,
    idle_since: Option<Instant>,
}

/// Above this many peers the table forgets the members that have been disconnected
/// longest (down to three quarters of it), so peer ids that come and go do not grow it; a
/// forgotten member proves the key again on its next connection.
const MAX_PEERS: usize = 4096;

/// Which peers proved the key; shared by the event loop and every protocol handler.
pub struct AuthTable {
    key: Option<SwarmKey>,
    peers: Mutex<HashMap<PeerId, Entry>>,
    changed: Notify,
}

impl AuthTable {
    pub fn new(key: Option<SwarmKey>) -> AuthTable {
        AuthTable {
            key,
            peers: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    pub fn key(&self) -> Option<&SwarmKey> {
        self.key.as_ref()
    }

    pub fn is_open(&self) -> bool {
        self.key.is_none()
    }

    pub fn state(&self, peer: &PeerId) -> PeerAuth {
        if self.key.is_none() {
            return PeerAuth::Member;
        }
        lock(&self.peers)
            .get(peer)
            .map_or(PeerAuth::Pending, |e| e.auth.clone())
    }

    pub fn is_member(&self, peer: &PeerId) -> bool {
        self.state(peer) == PeerAuth::Member
    }

    pub fn set(&self, peer: PeerId, state: PeerAuth) {
        let mut t = lock(&self.peers);
        t.insert(
            peer,
            Entry {
                auth: state,
                idle_since: None,
            },
        );
        if t.len() > MAX_PEERS {
            forget_longest_idle(&mut t);
        }
        drop(t);
        self.changed.notify_waiters();
    }

    /// `peer` has a connection again: a remembered member is not forgotten while connected.
    pub fn connected(&self, peer: &PeerId) {
        if let Some(e) = lock(&self.peers).get_mut(peer) {
            e.idle_since = None;
        }
    }

    /// `peer`'s last connection closed: a member is kept (see the module docs), anyone
    /// else forgotten.
    pub fn disconnected(&self, peer: &PeerId) {
        let mut t = lock(&self.peers);
        match t.get_mut(peer) {
            Some(e) if e.auth == PeerAuth::Member => e.idle_since = Some(Instant::now()),
            Some(_) => {
                t.remove(peer);
            }
            None => {}
        }
    }

    pub async fn wait_member(&self, peer: &PeerId, timeout: Duration) -> Result<(), NotMember> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            match self.state(peer) {
                PeerAuth::Member => return Ok(()),
                PeerAuth::Denied(why) => return Err(NotMember::Denied(why)),
                PeerAuth::Pending => {}
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(NotMember::NoProof(timeout));
            }
        }
    }
}

/// Forgets the members disconnected longest until three quarters of [`MAX_PEERS`] are
/// left (connected peers are never forgotten).
fn forget_longest_idle(t: &mut HashMap<PeerId, Entry>) {
    let mut idle: Vec<(Instant, PeerId)> = t
        .iter()
        .filter_map(|(p, e)| e.idle_since.map(|s| (s, *p)))
        .collect();
    idle.sort_unstable();
    let over = t.len().saturating_sub(MAX_PEERS * 3 / 4);
    for (_, p) in idle.into_iter().take(over) {
        t.remove(&p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_parse_and_proofs_bind_both_peers() {
        let k = SwarmKey::generate();
        assert_eq!(SwarmKey::parse(&k.to_file_text()).unwrap(), k);
        let hex = k.to_file_text().lines().nth(2).unwrap().to_string();
        assert_eq!(SwarmKey::parse(&hex).unwrap(), k);
        assert!(SwarmKey::parse("abc")
            .unwrap_err()
            .to_string()
            .contains("64 hex digits"));
        assert!(SwarmKey::parse(&"zz".repeat(32)).is_err());
        assert_ne!(SwarmKey::generate(), k);
        let (a, b) = (PeerId::random(), PeerId::random());
        assert_ne!(k.proof(&a, &b), k.proof(&b, &a));
        assert_ne!(k.proof(&a, &b), SwarmKey::generate().proof(&a, &b));
        assert_eq!(k.proof(&a, &b), k.proof(&a, &b));
    }

    #[test]
    fn members_outlive_their_connections_others_are_forgotten_and_the_table_is_bounded() {
        let t = AuthTable::new(Some(SwarmKey::generate()));
        let (m, d, p) = (PeerId::random(), PeerId::random(), PeerId::random());
        t.set(m, PeerAuth::Member);
        t.set(d, PeerAuth::Denied("wrong swarm key".into()));
        t.set(p, PeerAuth::Pending);
        for peer in [&m, &d, &p] {
            t.disconnected(peer);
        }
        assert_eq!(t.state(&m), PeerAuth::Member, "a member is remembered");
        assert_eq!(
            t.state(&d),
            PeerAuth::Pending,
            "a denied peer may try again"
        );
        assert_eq!(t.state(&p), PeerAuth::Pending);
        // Peer ids that come and go: the disconnected members longest gone are forgotten,
        // a connected member never.
        let connected = PeerId::random();
        t.set(connected, PeerAuth::Member);
        for _ in 0..2 * MAX_PEERS {
            let q = PeerId::random();
            t.set(q, PeerAuth::Member);
            t.disconnected(&q);
        }
        let len = lock(&t.peers).len();
        assert!(len <= MAX_PEERS, "{len} entries");
        assert_eq!(t.state(&connected), PeerAuth::Member);
        assert_eq!(
            t.state(&m),
            PeerAuth::Pending,
            "the oldest idle member was forgotten"
        );
        // A remembered member that reconnects is not forgotten while connected.
        let back = PeerId::random();
        t.set(back, PeerAuth::Member);
        t.disconnected(&back);
        t.connected(&back);
        for _ in 0..2 * MAX_PEERS {
            let q = PeerId::random();
            t.set(q, PeerAuth::Member);
            t.disconnected(&q);
        }
        assert_eq!(t.state(&back), PeerAuth::Member);
    }
}
