//! Who gets served: the swarm-key exchange on `/agentjet/auth/1` (see [`super::auth`]),
//! and the admission of every inbound stream of a served protocol: the opener must have
//! proved the swarm key, be under its request rate, and have fewer than
//! `max_streams_per_peer` streams of that protocol open. A refused opener reads the reason
//! as the stream's first frame ([`Admission::Refused`]); an admitted one reads
//! [`Admission::Accepted`] and is handed to the protocol's handler.
//!
//! Owns: the per-peer bounds and the accept loops. Every task here runs in the node's
//! task tracker and ends with the node; none holds a command sender that would keep the
//! event loop alive.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use libp2p::{PeerId, Stream, StreamProtocol};
use tracing::{debug, info, warn};

use super::auth::{PeerAuth, SwarmKey};
use super::frame::{read_frame, write_frame, FrameError};
use super::limits::Refusal;
use super::protocol::{Admission, AuthProof, AuthVerdict, AUTH};
use super::shared::{Command, Shared};
use super::SwarmError;
use crate::base::lock;

/// How many times a stream that closed before its first frame (admission, or the verdict
/// on our proof) is opened again. libp2p-stream hands each inbound stream to the accept
/// loop through a channel with room for one and drops (closes unread) any that arrives
/// while the slot is taken, so streams that arrive together while the loop waits for the
/// CPU are lost; nothing has read them, so opening them again is safe.
pub(super) const OPEN_ATTEMPTS: u32 = 8;

/// The pause before attempt `attempt + 1`: 10, 20, 40, ... 640 ms, each plus up to as much
/// again (from the clock's nanoseconds), so streams dropped together do not arrive
/// together again.
pub(super) fn retry_pause(attempt: u32) -> std::time::Duration {
    let base = 10u64 << attempt.saturating_sub(1).min(6);
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()))
        % (base + 1);
    std::time::Duration::from_millis(base + jitter)
}

/// Why our proof of the swarm key did not reach a peer (logged).
#[derive(Debug, thiserror::Error)]
enum ProveError {
    #[error("timed out")]
    TimedOut,
    #[error("opening the stream: {0}")]
    Open(String),
    #[error(transparent)]
    Frame(#[from] super::frame::FrameError),
}

/// Releases a peer's concurrent-stream slot when a served stream ends (however it ends:
/// the handler returned, failed, or was cancelled with the node).
struct OpenGuard {
    shared: Arc<Shared>,
    peer: PeerId,
    name: &'static str,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        lock(&self.shared.limits).release(&self.peer, self.name);
    }
}

impl Shared {
    /// Spawns `fut` in the node's tracker, cancelled when the node ends.
    pub(super) fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        let ended = self.ended.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = ended.cancelled() => {}
                _ = fut => {}
            }
        });
    }

    async fn admit(&self, peer: &PeerId, name: &'static str) -> Result<(), Refusal> {
        self.auth.wait_member(peer, self.cfg.auth_timeout).await?;
        let rate = (self.cfg.max_requests_per_s, self.cfg.request_burst);
        lock(&self.limits).take(
            peer,
            name,
            Instant::now(),
            rate,
            self.cfg.max_streams_per_peer,
        )
    }
}

/// Serves `protocol` (see [`super::SwarmHandle::serve`]).
pub(super) fn serve<H, F, E>(
    shared: &Arc<Shared>,
    control: &libp2p_stream::Control,
    protocol: StreamProtocol,
    handler: H,
) -> Result<(), SwarmError>
where
    H: Fn(PeerId, Stream) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let mut incoming = control
        .clone()
        .accept(protocol.clone())
        .map_err(|e| SwarmError::Setup(format!("{protocol}: {e}")))?;
    let handler = Arc::new(handler);
    let name: &'static str = Box::leak(protocol.to_string().into_boxed_str());
    let sh = shared.clone();
    shared.spawn(async move {
        while let Some((peer, mut stream)) = incoming.next().await {
            let handler = handler.clone();
            let shared = sh.clone();
            sh.spawn(async move {
                let limit = shared.cfg.max_frame_bytes;
                if let Err(why) = shared.admit(&peer, name).await {
                    warn!(%peer, protocol = name, "refused: {why}");
                    let refused = Admission::Refused(why.to_string());
                    let _ = write_frame(&mut stream, &refused, limit).await;
                    return;
                }
                let _guard = OpenGuard {
                    shared: shared.clone(),
                    peer,
                    name,
                };
                let _in_use = shared.usage.open(peer);
                if write_frame(&mut stream, &Admission::Accepted, limit)
                    .await
                    .is_err()
                {
                    return;
                }
                if let Err(e) = handler(peer, stream).await {
                    warn!(%peer, protocol = name, "{e}");
                }
            });
        }
    });
    Ok(())
}

/// Sends our proof of the swarm key to `peer`.
pub(super) async fn prove(
    shared: Arc<Shared>,
    mut control: libp2p_stream::Control,
    peer: PeerId,
    key: SwarmKey,
) {
    let proof = AuthProof {
        proof: key.proof(&shared.peer_id, &peer),
    };
    let t = shared.cfg.auth_timeout;
    let started = std::time::Instant::now();
    let mut attempt = 0;
    let r = loop {
        attempt += 1;
        let r: Result<AuthVerdict, ProveError> = async {
            let mut s = tokio::time::timeout(t, control.open_stream(peer, AUTH))
                .await
                .map_err(|_| ProveError::TimedOut)?
                .map_err(|e| ProveError::Open(e.to_string()))?;
            write_frame(&mut s, &proof, 1024).await?;
            Ok(tokio::time::timeout(t, read_frame(&mut s, 4096))
                .await
                .map_err(|_| ProveError::TimedOut)??)
        }
        .await;
        match r {
            // Dropped unread by the other end's accept queue (see OPEN_ATTEMPTS), which
            // the reader sees as a close or a reset. A proof is proved again until the
            // other end's deadline (the auth timeout), not a count of attempts: a node
            // that many peers joined at once (a bootstrap peer) drops most of their
            // proofs for seconds, and one that gave up after 8 (about 2.5 s) was
            // disconnected at the deadline (netsim, 300 peers: 392 of them in 70 s).
            Err(ProveError::Frame(FrameError::Closed(_) | FrameError::Io(_)))
                if started.elapsed() + retry_pause(attempt) < t =>
            {
                debug!(%peer, attempt, "the auth stream closed before a verdict; proving again");
                tokio::time::sleep(retry_pause(attempt)).await;
            }
            r => break r,
        }
    };
    match r {
        Ok(AuthVerdict::Accepted) => debug!(%peer, "accepted our swarm key proof"),
        Ok(AuthVerdict::Denied(why)) => warn!(%peer, "denied our swarm key proof: {why}"),
        Err(e) => debug!(%peer, "sending swarm key proof: {e}"),
    }
}

/// Verifies the proofs peers send (closed swarm), or accepts everyone (open swarm), and
/// tells the event loop through `cmd` (a weak sender: this loop never keeps the node up).
pub(super) fn accept_auth(
    shared: &Arc<Shared>,
    control: &libp2p_stream::Control,
    cmd: tokio::sync::mpsc::WeakSender<Command>,
) -> Result<(), SwarmError> {
    let mut incoming = control
        .clone()
        .accept(AUTH)
        .map_err(|e| SwarmError::Setup(format!("{AUTH}: {e}")))?;
    let sh = shared.clone();
    shared.spawn(async move {
        while let Some((peer, mut stream)) = incoming.next().await {
            let h = sh.clone();
            let cmd = cmd.clone();
            sh.spawn(async move {
                let got = tokio::time::timeout(
                    h.cfg.auth_timeout,
                    read_frame::<_, AuthProof>(&mut stream, 1024),
                )
                .await;
                if let Ok(Err(FrameError::Closed(_) | FrameError::Io(_))) = &got {
                    // The connection went away mid-proof (closed by either end): nothing
                    // was proved or disproved. The peer stays pending; a peer that stays
                    // connected without a proof meets the auth deadline.
                    debug!(%peer, "the auth stream closed before a proof");
                    return;
                }
                let verdict = match (&got, h.auth.key()) {
                    (_, None) => AuthVerdict::Accepted,
                    (Ok(Ok(p)), Some(k)) if p.proof == k.proof(&peer, &h.peer_id) => {
                        AuthVerdict::Accepted
                    }
                    (Ok(Ok(_)), Some(_)) => AuthVerdict::Denied("wrong swarm key".into()),
                    (Ok(Err(e)), Some(_)) => AuthVerdict::Denied(format!("bad proof: {e}")),
                    (Err(_), Some(_)) => {
                        AuthVerdict::Denied("no proof within the auth timeout".into())
                    }
                };
                let state = match &verdict {
                    AuthVerdict::Accepted => {
                        if h.auth.key().is_some() {
                            info!(%peer, "proved the swarm key");
                        }
                        PeerAuth::Member
                    }
                    AuthVerdict::Denied(why) => PeerAuth::Denied(why.clone()),
                };
                // A member from now on, before the verdict is written and the event loop
                // hears of it: on a busy node either can take seconds, and the auth
                // deadline (which reads this table) must not disconnect a peer that proved
                // in time.
                if state == PeerAuth::Member {
                    h.auth.set(peer, PeerAuth::Member);
                }
                if let Some(tx) = cmd.upgrade() {
                    let _ = tx.send(Command::Authed(peer, state)).await;
                }
                let _ = write_frame(&mut stream, &verdict, 1024).await;
            });
        }
    });
    Ok(())
}
