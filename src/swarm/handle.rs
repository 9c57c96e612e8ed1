//! The handle the rest of the program holds: cheap to clone, it sends [`Command`]s to the
//! event loop (each with a oneshot for its answer) and opens streams through
//! `libp2p-stream`'s control, which needs no round trip through the loop. The node runs as
//! long as a handle exists, or until [`SwarmHandle::shutdown`].
//!
//! Owns: the request side of the node's API. Never touches the `Swarm` itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId, Stream, StreamProtocol};
use tokio::sync::{mpsc, oneshot};

use super::admission;
use super::admission::{retry_pause, OPEN_ATTEMPTS};
use super::auth::AuthTable;
use super::config::SwarmConfig;
use super::frame::{read_frame, FrameError};
use super::protocol::{Admission, ModelStatus, PeerStatus, Role};
use super::shared::{Command, ProviderLookup, Shared, ViewEntry};
use super::trust::{Certificate, Certified, Trust, TrustError, CERT_FIELD};
use super::usage::PeerStream;
use super::SwarmError;
use crate::base::lock;

/// The handle the rest of the program holds.
#[derive(Clone)]
pub struct SwarmHandle {
    pub peer_id: PeerId,
    pub cfg: Arc<SwarmConfig>,
    pub auth: Arc<AuthTable>,
    pub(super) shared: Arc<Shared>,
    pub(super) cmd: mpsc::Sender<Command>,
    pub(super) control: libp2p_stream::Control,
}

impl SwarmHandle {
    async fn send(&self, c: Command) -> Result<(), SwarmError> {
        self.cmd.send(c).await.map_err(|_| SwarmError::Stopped)
    }

    /// Announces (and keeps re-announcing) that this peer serves `model`.
    pub async fn provide(&self, model: &str) -> Result<(), SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Provide(model.to_string(), tx)).await?;
        rx.await.map_err(|_| SwarmError::Stopped)
    }

    pub async fn stop_providing(&self, model: &str) -> Result<(), SwarmError> {
        self.send(Command::StopProviding(model.to_string())).await
    }

    /// The providers of `model` the DHT knows now (one whole query).
    pub async fn providers(&self, model: &str) -> Result<Vec<PeerId>, SwarmError> {
        Ok(self.lookup_providers(model, false).await?.providers)
    }

    /// A provider lookup with its cost (requests sent, time taken). With `first`, it ends
    /// at the first answer that names a provider (what a client needs to start); without,
    /// it asks until the closest peers to the key have all answered (every provider). A
    /// lookup asked before this node knows any peer waits for the first one (up to 2 s)
    /// instead of finding nothing at once.
    pub async fn lookup_providers(
        &self,
        model: &str,
        first: bool,
    ) -> Result<ProviderLookup, SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Providers {
            model: model.to_string(),
            first,
            reply: tx,
        })
        .await?;
        rx.await.map_err(|_| SwarmError::Stopped)
    }

    /// The addresses this peer offers other peers (what they pass as `--bootstrap`), each
    /// ending in `/p2p/<peer id>`, the one another host should use first: confirmed or
    /// given external addresses, then the interface addresses it listens on (loopback
    /// only when it listens on loopback alone), relayed ones last (see
    /// [`super::addrs::offered`]).
    pub async fn listen_addrs(&self) -> Vec<Multiaddr> {
        let (tx, rx) = oneshot::channel();
        if self.send(Command::ListenAddrs(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await
            .unwrap_or_default()
            .into_iter()
            .map(|a| a.with_p2p(self.peer_id).unwrap_or_else(|a| a))
            .collect()
    }

    pub async fn connected_peers(&self) -> Vec<PeerId> {
        let (tx, rx) = oneshot::channel();
        if self.send(Command::Connected(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Tells the address book where `peer` listens.
    pub async fn add_addresses(&self, peer: PeerId, addrs: Vec<Multiaddr>) {
        let _ = self.send(Command::Addresses(peer, addrs)).await;
    }

    /// The addresses the address book holds for `peer` (from identify, gossip and dials).
    pub async fn addresses_of(&self, peer: PeerId) -> Vec<Multiaddr> {
        let (tx, rx) = oneshot::channel();
        if self.send(Command::AddressesOf(peer, tx)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Connects to `peer` (through the address book) unless connected already.
    pub async fn connect(&self, peer: PeerId) -> Result<(), SwarmError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Connect(peer, tx)).await?;
        match tokio::time::timeout(self.cfg.open_timeout, rx).await {
            Err(_) => Err(SwarmError::Timeout(format!("connecting to {peer}"))),
            Ok(Err(_)) => Err(SwarmError::Stopped),
            Ok(Ok(r)) => r,
        }
    }

    /// Updates what this peer gossips.
    pub fn set_status(&self, f: impl FnOnce(&mut PeerStatus)) {
        f(&mut lock(&self.shared.status));
    }

    /// Gossips this peer's status now instead of at the next `status_interval` (news that
    /// others wait for: a new policy version to fetch). Never blocks; skipped if the
    /// node's queue is full (the next regular status carries it).
    pub fn announce(&self) {
        let _ = self.cmd.try_send(Command::Announce);
    }

    pub fn set_models(&self, models: Vec<ModelStatus>) {
        self.set_status(|s| s.models = models);
    }

    /// How many statuses the view has taken in so far: while it stays the same, only
    /// age changes the view (an entry expires after three status intervals). A loop
    /// that reads the view often reads it again only when this moved.
    pub fn view_changes(&self) -> u64 {
        self.shared
            .view_changes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many statuses this peer has gossiped (each reaches every peer of the swarm,
    /// several copies each: what it costs the swarm).
    pub fn statuses_published(&self) -> u64 {
        self.shared
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves at the next status the view takes in after it is made: a loop that acts
    /// on news (a new policy version) wakes at once instead of at its next poll. Make it
    /// before reading [`SwarmHandle::view_changes`]: a status taken in between is then
    /// not missed.
    pub fn view_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.shared.view_changed.notified()
    }

    /// The live view: every peer heard from within three status intervals (this one too).
    pub fn view(&self) -> Vec<ViewEntry> {
        let expiry = self.cfg.status_interval * 3;
        let v = lock(&self.shared.view);
        let mut out: Vec<ViewEntry> = v
            .iter()
            .filter(|(_, s)| s.at.elapsed() <= expiry)
            .map(|(p, s)| ViewEntry {
                peer: *p,
                status: s.status.clone(),
                addrs: s.addrs.clone(),
                age: s.at.elapsed(),
                is_self: *p == self.peer_id,
                published_unix_ms: s.published_unix_ms,
                received_unix_ms: s.received_unix_ms,
                cert: match &s.cert {
                    Some(Ok(c)) if !c.expired() => Some(c.clone()),
                    _ => None,
                },
                cert_problem: match &s.cert {
                    Some(Ok(c)) if c.expired() => Some("the certificate expired".into()),
                    Some(Err(e)) => Some(e.to_string()),
                    _ => None,
                },
            })
            .collect();
        // By peer id (the same order as their text for keys of one type), without
        // writing each id out: followers read the view ten times a second.
        out.sort_by_key(|e| e.peer);
        out
    }

    /// Whom this peer trusts (see the `swarm::trust` module).
    pub fn trust(&self) -> Trust {
        self.cfg.trust()
    }

    /// This peer's own certificate, verified against the run it trusts (None: it has
    /// none, or it trusts no run, or the certificate is not for it or this run).
    pub fn own_cert(&self) -> Option<Certified> {
        let run = self.cfg.run.as_ref()?;
        lock(&self.shared.cert)
            .as_ref()?
            .verify(run, &self.peer_id)
            .ok()
    }

    /// Replaces this peer's certificate (a renewed one), once it verifies against the run
    /// it trusts and this peer; the next status gossips it. On an error the current one
    /// stays.
    pub fn renew_cert(&self, cert: Certificate) -> Result<Certified, TrustError> {
        let Some(run) = self.cfg.run.as_ref() else {
            return Err(TrustError::Malformed(
                "this peer trusts no run: a certificate means nothing to it".into(),
            ));
        };
        let c = cert.verify(run, &self.peer_id)?;
        lock(&self.shared.status)
            .extra
            .insert(CERT_FIELD.to_string(), cert.encode());
        *lock(&self.shared.cert) = Some(cert);
        Ok(c)
    }

    /// Whether calls of `model` signed by the peer of `e` count (are trained on): a
    /// certified server of it (trusting a run), a key holder serving it (a closed swarm
    /// without a run), or this peer itself (open swarm).
    pub fn may_sign(&self, e: &ViewEntry, model: &str) -> bool {
        match self.trust() {
            Trust::Run(_) => e.cert.as_ref().is_some_and(|c| c.serves(model)),
            Trust::SwarmKey => {
                e.is_self
                    || (e.status.role == Role::Server
                        && e.status.models.iter().any(|m| m.name == model))
            }
            Trust::Open => e.is_self,
        }
    }

    /// Whether this peer's own calls of `model` count (see [`SwarmHandle::may_sign`]).
    pub fn may_sign_self(&self, model: &str) -> bool {
        match self.trust() {
            Trust::Run(_) => self.own_cert().is_some_and(|c| c.serves(model)),
            Trust::SwarmKey | Trust::Open => true,
        }
    }

    /// Whether the peer of `e` may train `model` in `group` with this one (be a group
    /// candidate, propose, send starts and state): certified for it (trusting a run), any
    /// key holder (a closed swarm without a run), nobody else (open swarm).
    pub fn may_train_with(&self, e: &ViewEntry, model: &str, group: &str) -> bool {
        match self.trust() {
            Trust::Run(_) => e.cert.as_ref().is_some_and(|c| c.trains(model, group)),
            Trust::SwarmKey => true,
            Trust::Open => e.is_self,
        }
    }

    /// [`SwarmHandle::may_train_with`] for a peer id (false if it is not in the view).
    pub fn may_train_with_peer(&self, peer: &PeerId, model: &str, group: &str) -> bool {
        match self.trust() {
            Trust::SwarmKey => true,
            Trust::Open => *peer == self.peer_id,
            Trust::Run(_) => self
                .view()
                .iter()
                .any(|e| e.peer == *peer && self.may_train_with(e, model, group)),
        }
    }

    /// Signs a digest with this peer's key and a generation's nonce.
    pub fn sign(&self, digest: &[u8; 32], nonce: &super::sign::Nonce) -> Vec<u8> {
        super::sign::sign(&self.shared.keypair, digest, nonce)
    }

    /// Opens a stream to `peer` and reads its [`Admission`].
    /// While the stream exists, the connection trimmer leaves its connection open.
    pub async fn open(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<PeerStream, SwarmError> {
        if peer == self.peer_id {
            return Err(SwarmError::Protocol(
                "a peer cannot open a stream to itself".into(),
            ));
        }
        let in_use = self.shared.usage.open(peer);
        // libp2p-stream dials a peer it has no connection to with only the addresses
        // libp2p's behaviours know (none for a peer learnt from gossip): when the
        // stream cannot be opened, this connect's error is the reason to report.
        let connected = self.connect(peer).await;
        let t = self.cfg.open_timeout;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut control = self.control.clone();
            let mut s = tokio::time::timeout(t, control.open_stream(peer, protocol.clone()))
                .await
                .map_err(|_| SwarmError::Timeout(format!("opening {protocol} to {peer}")))?
                .map_err(|e| SwarmError::Unreachable {
                    peer,
                    reason: match &connected {
                        Err(SwarmError::Unreachable { reason, .. }) => {
                            format!("{protocol}: {e} (connecting: {reason})")
                        }
                        Err(c) => format!("{protocol}: {e} (connecting: {c})"),
                        Ok(()) => format!("{protocol}: {e}"),
                    },
                })?;
            let adm = tokio::time::timeout(t + self.cfg.auth_timeout, read_frame(&mut s, 4096))
                .await
                .map_err(|_| SwarmError::Timeout(format!("admission on {protocol} from {peer}")))?;
            match adm {
                Ok(Admission::Accepted) => return Ok(PeerStream::new(s, in_use)),
                Ok(Admission::Refused(reason)) => return Err(SwarmError::Refused { peer, reason }),
                // Closed before the admission frame: no handler saw the stream (admission
                // comes first), so opening it again is safe. libp2p-stream hands inbound
                // streams to the accept loop through a channel with room for one and
                // drops the rest, so streams that arrive together while that loop waits
                // for the CPU are closed unread.
                Err(FrameError::Closed(_)) if attempt < OPEN_ATTEMPTS => {
                    tracing::debug!(%peer, %protocol, attempt, "the stream closed before its admission; opening it again");
                    tokio::time::sleep(retry_pause(attempt)).await;
                }
                Err(e) => {
                    return Err(SwarmError::Unreachable {
                        peer,
                        reason: e.to_string(),
                    })
                }
            }
        }
    }

    /// `stream` (an inbound one, from `peer`) as a [`PeerStream`]: the connection trimmer
    /// leaves its connection open while it exists (a long-lived stream a handler keeps
    /// after it returns).
    pub fn keep(&self, peer: PeerId, stream: Stream) -> PeerStream {
        PeerStream::new(stream, self.shared.usage.open(peer))
    }

    /// Serves `protocol`: every inbound stream is admitted (swarm key, concurrent streams
    /// per peer, request rate: a refusal is written to the stream and logged) and handed
    /// to `handler` on its own task; a handler's error is logged with the peer. The accept
    /// loop and the handlers run in the node's task tracker and end with the node.
    pub fn serve<H, F, E>(&self, protocol: StreamProtocol, handler: H) -> Result<(), SwarmError>
    where
        H: Fn(PeerId, Stream) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::fmt::Display + Send + 'static,
    {
        admission::serve(&self.shared, &self.control, protocol, handler)
    }

    /// Stops the node now: the event loop ends (connections close, listeners release
    /// their ports), every task of the node is cancelled, and this returns once they have
    /// ended (or after `timeout`). Other handles then answer [`SwarmError::Stopped`].
    /// Without it the node ends when its last handle is dropped.
    pub async fn shutdown(&self, timeout: Duration) {
        let _ = self.cmd.send(Command::Shutdown).await;
        self.shared.tasks.close();
        if tokio::time::timeout(timeout, self.shared.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.shared.tasks.len(),
                "swarm tasks still running after the shutdown timeout"
            );
        }
    }

    /// What a peer prints about itself at start: its id, each listen address (what others
    /// pass as `--bootstrap`), and whether the swarm is closed.
    pub fn introduction(&self, addrs: &[Multiaddr]) -> String {
        let mut lines = vec![format!("peer id: {}", self.peer_id)];
        lines.extend(addrs.iter().map(|a| format!("listening on {a}")));
        if addrs.is_empty() {
            lines.push("listening on no address other hosts can use (loopback only?)".into());
        }
        if self.auth.key().is_some() {
            lines.push("swarm key: set (a closed swarm)".into());
        }
        lines.join("\n")
    }

    /// What this peer knows of its reachability now (see [`super::reach`]).
    pub fn reachability(&self) -> super::Reachability {
        lock(&self.shared.net).reach
    }

    /// The addresses this peer offers other peers now, the one to give another host first
    /// (see [`super::addrs::offered`]).
    pub fn offered_addrs(&self) -> Vec<Multiaddr> {
        lock(&self.shared.net)
            .offered
            .iter()
            .map(|a| a.clone().with_p2p(self.peer_id).unwrap_or_else(|a| a))
            .collect()
    }

    /// How this peer is connected to `peer` now: one kind per connection (none when not
    /// connected).
    pub fn link_kinds(&self, peer: &PeerId) -> Vec<super::LinkKind> {
        lock(&self.shared.net)
            .links
            .get(peer)
            .map(|l| l.iter().map(|(_, k)| *k).collect())
            .unwrap_or_default()
    }

    /// Every connected peer and how: one kind per connection.
    pub fn links(&self) -> Vec<(PeerId, Vec<super::LinkKind>)> {
        lock(&self.shared.net)
            .links
            .iter()
            .map(|(p, l)| (*p, l.iter().map(|(_, k)| *k).collect()))
            .collect()
    }

    /// Connected peers by how they are connected: (direct, hole-punched, relayed).
    pub fn link_counts(&self) -> (usize, usize, usize) {
        let n = lock(&self.shared.net);
        let mut c = (0, 0, 0);
        for kinds in n.links.values() {
            if kinds.iter().any(|(_, k)| *k == super::LinkKind::Direct) {
                c.0 += 1;
            } else if kinds
                .iter()
                .any(|(_, k)| *k == super::LinkKind::HolePunched)
            {
                c.1 += 1;
            } else {
                c.2 += 1;
            }
        }
        c
    }

    /// What this peer's relay service carries now.
    pub fn relay_load(&self) -> super::RelayLoad {
        lock(&self.shared.net).relay
    }

    /// The network events so far (the last 1,024) and a receiver of the ones to come,
    /// with none missed or seen twice in between.
    pub fn net_events(
        &self,
    ) -> (
        Vec<super::NetEvent>,
        tokio::sync::broadcast::Receiver<super::NetEvent>,
    ) {
        let n = lock(&self.shared.net);
        (
            n.log.iter().cloned().collect(),
            self.shared.net_tx.subscribe(),
        )
    }

    /// Passes every network event (those so far, then each as it comes) to `f` on a task
    /// of the node, until the node ends. A receiver that falls more than 256 events behind
    /// skips the ones it missed (and says how many).
    pub fn forward_net_events(&self, f: impl Fn(super::NetEvent) + Send + 'static) {
        let (past, mut rx) = self.net_events();
        self.shared.spawn(async move {
            for e in past {
                f(e);
            }
            loop {
                match rx.recv().await {
                    Ok(e) => f(e),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!("{n} network events skipped (a slow reader)");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
    }

    /// A token cancelled when the node has ended (holding it does not keep the node up).
    pub fn ended(&self) -> crate::base::stop::CancellationToken {
        self.shared.ended.clone()
    }
}
