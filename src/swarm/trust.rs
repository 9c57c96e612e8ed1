//! Trust: who may serve a model (sign its calls), and who may train it in a group and
//! steer that group.
//!
//! A run is named by an ed25519 key pair, the run key (`agentjet-peer run-key`); its
//! public half, the run id (64 hex digits), is what every peer of the run is told. The
//! key's holder certifies peers (`agentjet-peer certify`): a [`Certificate`] says that one
//! peer id may serve a model and/or train it in a named group, until an expiry, signed by
//! the run key. A certified peer presents its certificate in its gossiped status (the
//! `cert` field of `PeerStatus::extra`); a peer that knows the run id checks it when the
//! status arrives (signature, run, peer id) and at every use (expiry), and the live view
//! says for what each peer is certified ([`super::ViewEntry::cert`]). A certificate is
//! bound to its peer id, which the connection's handshake and gossip's signatures prove,
//! so copying another peer's certificate gains nothing.
//!
//! Policy ([`Trust`]), by what the peer was started with:
//! - a run id (`--run ID`, or implied by `--run-key`/`--cert`): only certified peers
//!   count. A server stores an episode only if every call was signed by a peer certified
//!   to serve that model; a client routes calls only to such servers; a group member takes
//!   only peers certified to train that model in that group as candidates, and answers
//!   group requests only from them.
//! - only a swarm key: every key holder is trusted as what it says it is (the key's
//!   holders are the trust; this is how a closed swarm worked before run keys).
//! - neither: an open swarm. Nobody can be checked, so a server trusts no one but itself:
//!   it stores only calls it signed itself and trains alone (it says so at start). A
//!   client routes to any server; the server it submits to then checks the calls.
//!
//! Owns: run keys, certificates (their encoding, signature and bounds) and the policy
//! above. Knows nothing of models beyond their names.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use libp2p::identity::ed25519;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::base::files::write_secret;
use crate::base::hex::{decode as hex_decode, encode as hex};

/// The status field that carries a peer's certificate (hex).
pub const CERT_FIELD: &str = "cert";

/// Bytes an encoded certificate may take at most (checked before it is decoded).
pub const MAX_CERT_BYTES: usize = 1024;

const SIGNING_DOMAIN: &[u8] = b"agentjet-cert-1";
const RUN_KEY_HEADER: &str = "/key/agentjet/run/1/";

/// Why a run key, run id or certificate was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrustError {
    #[error("a run id is 64 hex digits (the public run key), got {0:?}")]
    RunId(String),
    #[error("{path}: {problem}")]
    File { path: String, problem: String },
    #[error("not a run key: {0}")]
    RunKey(String),
    #[error("certificate of {0} bytes (at most {MAX_CERT_BYTES})")]
    TooLarge(usize),
    #[error("malformed certificate: {0}")]
    Malformed(String),
    #[error("the certificate is for run {0}, not this run")]
    OtherRun(RunId),
    #[error("the certificate names peer {0}, not the peer that presents it")]
    OtherPeer(String),
    #[error("the certificate's signature does not verify (altered or forged)")]
    BadSignature,
    #[error("the certificate expired {0} s ago")]
    Expired(u64),
}

/// A run's public identity: the public half of its run key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RunId(pub [u8; 32]);

impl RunId {
    /// Parses 64 hex digits.
    pub fn parse(text: &str) -> Result<RunId, TrustError> {
        let t = text.trim();
        let bytes = hex_decode(t).ok_or_else(|| TrustError::RunId(t.chars().take(80).collect()))?;
        let b: [u8; 32] = bytes
            .try_into()
            .map_err(|_| TrustError::RunId(t.chars().take(80).collect()))?;
        ed25519::PublicKey::try_from_bytes(&b)
            .map_err(|e| TrustError::RunId(format!("{t}: {e}")))?;
        Ok(RunId(b))
    }

    fn key(&self) -> Result<ed25519::PublicKey, TrustError> {
        ed25519::PublicKey::try_from_bytes(&self.0)
            .map_err(|e| TrustError::Malformed(e.to_string()))
    }
}

impl std::fmt::Display for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl std::fmt::Debug for RunId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunId({})", &hex(&self.0)[..16])
    }
}

/// The run key: whoever holds it decides who serves and trains in the run.
#[derive(Clone)]
pub struct RunKey(ed25519::Keypair);

impl std::fmt::Debug for RunKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RunKey({:?})", self.id())
    }
}

impl RunKey {
    pub fn generate() -> RunKey {
        RunKey(ed25519::Keypair::generate())
    }

    pub fn id(&self) -> RunId {
        RunId(self.0.public().to_bytes())
    }

    /// The key file's text: a header line and the 32-byte secret in hex.
    pub fn to_file_text(&self) -> String {
        format!("{RUN_KEY_HEADER}\n{}\n", hex(self.0.secret().as_ref()))
    }

    pub fn parse(text: &str) -> Result<RunKey, TrustError> {
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let [RUN_KEY_HEADER, secret] = lines.as_slice() else {
            return Err(TrustError::RunKey(format!(
                "expected the two lines `{RUN_KEY_HEADER}` and 64 hex digits"
            )));
        };
        let mut bytes = hex_decode(secret)
            .filter(|b| b.len() == 32)
            .ok_or_else(|| TrustError::RunKey("the secret must be 64 hex digits".into()))?;
        let sk = ed25519::SecretKey::try_from_bytes(&mut bytes)
            .map_err(|e| TrustError::RunKey(e.to_string()))?;
        Ok(RunKey(ed25519::Keypair::from(sk)))
    }

    pub fn load(path: &Path) -> Result<RunKey, TrustError> {
        let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
        RunKey::parse(&text).map_err(|e| TrustError::File {
            path: path.display().to_string(),
            problem: e.to_string(),
        })
    }

    /// Writes the key file, readable by its owner only.
    pub fn save(&self, path: &Path) -> Result<(), TrustError> {
        write_secret(path, self.to_file_text().as_bytes()).map_err(|e| file_error(path, e))
    }

    /// Certifies `peer` for `grant` until `not_after_unix` (seconds).
    pub fn certify(&self, peer: &PeerId, grant: Grant, not_after_unix: u64) -> Certificate {
        let body = CertBody {
            run: self.id().0,
            peer: peer.to_bytes(),
            grant,
            not_after_unix,
        };
        let signature = self.0.sign(&signed_bytes(&body));
        Certificate { body, signature }
    }
}

/// What a certificate allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The model's name as the swarm knows it.
    pub model: String,
    /// The training group the peer may train the model in (a server's `--train-group`,
    /// by default the model's name).
    pub group: String,
    /// May serve the model: its signed calls are trained on.
    pub serve: bool,
    /// May train the model in the group, and steer the group (propose, serve its state).
    pub train: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct CertBody {
    run: [u8; 32],
    peer: Vec<u8>,
    grant: Grant,
    not_after_unix: u64,
}

/// A run key's statement that one peer may serve and/or train one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Certificate {
    body: CertBody,
    signature: Vec<u8>,
}

/// A certificate that verified for the peer that presented it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certified {
    pub grant: Grant,
    pub not_after_unix: u64,
}

impl Certified {
    pub fn expired(&self) -> bool {
        unix_now() > self.not_after_unix
    }

    /// Whether it (still) allows serving `model`.
    pub fn serves(&self, model: &str) -> bool {
        !self.expired() && self.grant.serve && self.grant.model == model
    }

    /// Whether it (still) allows training `model` in `group`.
    pub fn trains(&self, model: &str, group: &str) -> bool {
        !self.expired()
            && self.grant.train
            && self.grant.model == model
            && self.grant.group == group
    }
}

impl Certificate {
    pub fn grant(&self) -> &Grant {
        &self.body.grant
    }

    pub fn not_after_unix(&self) -> u64 {
        self.body.not_after_unix
    }

    pub fn run(&self) -> RunId {
        RunId(self.body.run)
    }

    /// The peer it certifies (None if its bytes are not a peer id).
    pub fn peer(&self) -> Option<PeerId> {
        PeerId::from_bytes(&self.body.peer).ok()
    }

    /// Hex of the encoding (what the status field and the certificate file hold).
    pub fn encode(&self) -> String {
        hex(&postcard::to_allocvec(self).expect("a certificate encodes"))
    }

    /// Decodes hex text, bounded before anything is decoded.
    pub fn decode(text: &str) -> Result<Certificate, TrustError> {
        let t = text.trim();
        if t.len() > 2 * MAX_CERT_BYTES {
            return Err(TrustError::TooLarge(t.len() / 2));
        }
        let bytes = hex_decode(t).ok_or_else(|| TrustError::Malformed("not hex".into()))?;
        postcard::from_bytes(&bytes).map_err(|e| TrustError::Malformed(e.to_string()))
    }

    /// A certificate file's text: a comment saying what it grants, then the encoding.
    pub fn to_file_text(&self) -> String {
        let g = &self.body.grant;
        format!(
            "# agentjet certificate: run {} certifies {} for model {:?}, group {:?}{}{}, until unix {}\n{}\n",
            self.run(),
            self.peer().map_or_else(|| "?".into(), |p| p.to_string()),
            g.model,
            g.group,
            if g.serve { ", serve" } else { "" },
            if g.train { ", train" } else { "" },
            self.body.not_after_unix,
            self.encode()
        )
    }

    pub fn load(path: &Path) -> Result<Certificate, TrustError> {
        let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
        let body: String = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        Certificate::decode(&body).map_err(|e| TrustError::File {
            path: path.display().to_string(),
            problem: e.to_string(),
        })
    }

    /// Checks it against the run `run`, for the peer `presenter`: signature, run and
    /// peer id (the expiry is checked at each use, [`Certified::serves`] and
    /// [`Certified::trains`], and here).
    pub fn verify(&self, run: &RunId, presenter: &PeerId) -> Result<Certified, TrustError> {
        if self.body.run != run.0 {
            return Err(TrustError::OtherRun(self.run()));
        }
        if self.body.peer != presenter.to_bytes() {
            return Err(TrustError::OtherPeer(
                self.peer()
                    .map_or_else(|| "(not a peer id)".into(), |p| p.to_string()),
            ));
        }
        if !run
            .key()?
            .verify(&signed_bytes(&self.body), &self.signature)
        {
            return Err(TrustError::BadSignature);
        }
        let now = unix_now();
        if now > self.body.not_after_unix {
            return Err(TrustError::Expired(now - self.body.not_after_unix));
        }
        Ok(Certified {
            grant: self.body.grant.clone(),
            not_after_unix: self.body.not_after_unix,
        })
    }
}

/// Whom this peer trusts (see the module's text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Only peers certified by this run count.
    Run(RunId),
    /// Every holder of the swarm key counts as what it says it is.
    SwarmKey,
    /// Nobody but this peer.
    Open,
}

impl Trust {
    /// One line for logs and `status`: what this peer trusts.
    pub fn describe(&self) -> String {
        match self {
            Trust::Run(id) => format!("run {id}: only peers its key certified"),
            Trust::SwarmKey => "the swarm key: every peer holding it".into(),
            Trust::Open => "open swarm, no run id and no swarm key: nobody but itself".into(),
        }
    }
}

fn signed_bytes(body: &CertBody) -> Vec<u8> {
    let mut b = SIGNING_DOMAIN.to_vec();
    b.extend(postcard::to_allocvec(body).expect("a certificate encodes"));
    b
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn file_error(path: &Path, e: std::io::Error) -> TrustError {
    TrustError::File {
        path: path.display().to_string(),
        problem: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::identity::Keypair;

    fn grant() -> Grant {
        Grant {
            model: "m".into(),
            group: "m".into(),
            serve: true,
            train: true,
        }
    }

    #[test]
    fn a_certificate_verifies_only_for_its_run_its_peer_and_its_grant() {
        let run = RunKey::generate();
        let peer = Keypair::generate_ed25519().public().to_peer_id();
        let other = Keypair::generate_ed25519().public().to_peer_id();
        let c = run.certify(&peer, grant(), unix_now() + 60);
        let back = Certificate::decode(&c.encode()).unwrap();
        assert_eq!(back, c);
        let ok = back.verify(&run.id(), &peer).unwrap();
        assert!(ok.serves("m") && ok.trains("m", "m"));
        assert!(!ok.serves("n") && !ok.trains("m", "other group"));
        // Presented by another peer (a copied certificate).
        assert!(matches!(
            back.verify(&run.id(), &other),
            Err(TrustError::OtherPeer(_))
        ));
        // Another run.
        let stranger = RunKey::generate();
        assert!(matches!(
            back.verify(&stranger.id(), &peer),
            Err(TrustError::OtherRun(_))
        ));
        // Signed by another key under this run's name: the grant widened after signing.
        let mut forged = stranger.certify(&peer, grant(), unix_now() + 60);
        forged.body.run = run.id().0;
        assert_eq!(
            forged.verify(&run.id(), &peer),
            Err(TrustError::BadSignature)
        );
        let mut widened = c.clone();
        widened.body.grant.model = "n".into();
        assert_eq!(
            widened.verify(&run.id(), &peer),
            Err(TrustError::BadSignature)
        );
        // Expired.
        let old = run.certify(&peer, grant(), unix_now() - 10);
        assert!(matches!(
            old.verify(&run.id(), &peer),
            Err(TrustError::Expired(_))
        ));
        // A serve-only certificate does not let its peer train.
        let serve_only = run.certify(
            &peer,
            Grant {
                train: false,
                ..grant()
            },
            unix_now() + 60,
        );
        let s = serve_only.verify(&run.id(), &peer).unwrap();
        assert!(s.serves("m") && !s.trains("m", "m"));
    }

    #[test]
    fn malformed_and_oversize_certificates_and_keys_are_refused() {
        assert!(matches!(
            Certificate::decode("zz"),
            Err(TrustError::Malformed(_))
        ));
        assert!(matches!(
            Certificate::decode("abcd"),
            Err(TrustError::Malformed(_))
        ));
        let huge = "00".repeat(MAX_CERT_BYTES + 1);
        assert!(matches!(
            Certificate::decode(&huge),
            Err(TrustError::TooLarge(_))
        ));
        assert!(RunId::parse("12").is_err());
        assert!(RunId::parse(&"g".repeat(64)).is_err());
        assert!(RunKey::parse("not a key").is_err());
        assert!(RunKey::parse(&format!("{RUN_KEY_HEADER}\n1234\n")).is_err());
    }

    #[test]
    fn run_keys_and_certificates_round_trip_through_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunKey::generate();
        let path = dir.path().join("run.key");
        run.save(&path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let back = RunKey::load(&path).unwrap();
        assert_eq!(back.id(), run.id());
        assert_eq!(RunId::parse(&run.id().to_string()).unwrap(), run.id());
        let peer = Keypair::generate_ed25519().public().to_peer_id();
        let c = run.certify(&peer, grant(), unix_now() + 60);
        let cp = dir.path().join("peer.cert");
        std::fs::write(&cp, c.to_file_text()).unwrap();
        assert_eq!(Certificate::load(&cp).unwrap(), c);
    }
}
