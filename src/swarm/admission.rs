//! Who gets served: the swarm-key exchange on `/agentjet/auth/1` ([`AuthCodec`], answered
//! by the event loop; see [`super::auth`]), and the admission of every inbound stream of a served protocol: the opener must have
//! proved the swarm key, be under its request rate, and have fewer than
//! `max_streams_per_peer` streams of that protocol open. A refused opener reads the reason
//! as the stream's first frame ([`Admission::Refused`]); an admitted one reads
//! [`Admission::Accepted`] and is handed to the protocol's handler.
//!
//! Owns: the per-peer bounds and the accept loops. Every task here runs in the node's
//! task tracker and ends with the node; none holds a command sender that would keep the
//! event loop alive.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use libp2p::{PeerId, Stream, StreamProtocol};
use tracing::warn;

use super::auth::SwarmKey;
use super::frame::{read_frame, write_frame, FrameError};
use super::limits::Refusal;
use super::protocol::{Admission, AuthProof, AuthVerdict};
use super::shared::Shared;
use super::SwarmError;
use crate::base::lock;

/// How many times a stream that closed before its first frame (the admission) is opened
/// again. libp2p-stream hands each inbound stream to the accept
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

/// The swarm-key exchange as a request-response protocol: the prover's request is one
/// framed [`AuthProof`], the answer one framed [`AuthVerdict`] (the same bytes as the
/// stream of `/agentjet/auth/1` carried before). libp2p-request-response queues inbound
/// requests in the node's event loop; libp2p-stream's accept channel held one stream and
/// dropped the others, so a node that many peers joined at once (a bootstrap peer)
/// dropped their proofs for seconds and disconnected them at the auth deadline (netsim,
/// 300 peers behind NAT: 392 honest peers in 70 s, each taking its relay reservations
/// with it).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AuthCodec;

/// A frame error as the codec's I/O error (its kind kept where it has one).
fn frame_io(e: FrameError) -> io::Error {
    match e {
        FrameError::Io(e) => e,
        // Closed unread (an older peer's accept channel drops streams): sent again.
        FrameError::Closed(_) => io::Error::new(io::ErrorKind::UnexpectedEof, e.to_string()),
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

impl libp2p::request_response::Codec for AuthCodec {
    type Protocol = StreamProtocol;
    type Request = AuthProof;
    type Response = AuthVerdict;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<AuthProof>
    where
        T: futures::AsyncRead + Unpin + Send,
    {
        read_frame(io, 1024).await.map_err(frame_io)
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<AuthVerdict>
    where
        T: futures::AsyncRead + Unpin + Send,
    {
        read_frame(io, 4096).await.map_err(frame_io)
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: AuthProof,
    ) -> io::Result<()>
    where
        T: futures::AsyncWrite + Unpin + Send,
    {
        write_frame(io, &req, 1024).await.map_err(frame_io)
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: AuthVerdict,
    ) -> io::Result<()>
    where
        T: futures::AsyncWrite + Unpin + Send,
    {
        write_frame(io, &res, 4096).await.map_err(frame_io)
    }
}

/// The verdict on the proof `peer` sent `me`: with no swarm key (an open swarm) everyone
/// is accepted. Compared in constant time.
pub(super) fn verdict(
    key: Option<&SwarmKey>,
    me: &PeerId,
    peer: &PeerId,
    got: &AuthProof,
) -> AuthVerdict {
    match key {
        None => AuthVerdict::Accepted,
        Some(k) if blake3::Hash::from(got.proof) == blake3::Hash::from(k.proof(peer, me)) => {
            AuthVerdict::Accepted
        }
        Some(_) => AuthVerdict::Denied("wrong swarm key".into()),
    }
}
