//! `/agentjet/weights/1`: how peers ask each other for a policy version's manifest and
//! chunks. Every holder (trainer or follower) serves what its [`VersionStore`] holds; a
//! fetcher keeps a few streams per peer open and asks one request at a time on each.
//!
//! The wire is one postcard frame per message: [`Request`] from the asker, [`Reply`] from
//! the holder, any number of times per stream. Nothing a peer sends is trusted: a
//! manifest is checked against the id its group member announced (or comes from the
//! member itself, on a long poll the follower keeps open there), a chunk against the
//! manifest's hash (by the fetch, see [`super::fetch`]).
//!
//! A request for a chunk the holder is still fetching, or of a newer version it has not
//! started (it heard of the version later than the asker), waits there for it (up to
//! [`WAIT`]) instead of coming back empty: the asker gets it the moment it arrives,
//! without a round trip of asking again (on 100 ms links those round trips, not the
//! bytes, would bound a follower's fetch).
//!
//! The streams come from a [`WeightsNet`]: the swarm's (`/agentjet/weights/1` streams,
//! what servers use), or another byte network (netsim hands in simulated links weighted
//! as a bigger model's, as it does for the training group's links).
//!
//! Owns: the protocol's messages, its handler, [`WeightsNet`], and [`PeerSource`] (a peer
//! as a [`ChunkSource`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::io::{AsyncRead, AsyncWrite};
use serde::{Deserialize, Serialize};

use super::fetch::{ChunkBase, ChunkSource, Miss};
use super::manifest::{Manifest, MAX_MANIFEST_BYTES};
use super::store::{Held, VersionStore};
use crate::base::lock;
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{PeerId, StreamProtocol, SwarmError, SwarmHandle};

pub const WEIGHTS: StreamProtocol = StreamProtocol::new("/agentjet/weights/1");

/// The largest request frame (names and numbers).
const REQUEST_LIMIT: usize = 4096;
/// The largest reply: a manifest, or a chunk of at most 64 MiB and its header.
const REPLY_LIMIT: usize = MAX_MANIFEST_BYTES + 1024;
/// How long a served stream may sit idle between requests.
const IDLE: Duration = Duration::from_secs(60);
/// A fetcher drops a pooled stream idle this long (before the holder's [`IDLE`]: while it
/// exists the swarm keeps its connection open, and the trimmer spares it).
pub(super) const POOLED: Duration = Duration::from_secs(45);
/// How long a request for a chunk the holder is fetching waits there for it (for a
/// [`Request::Chunks`], for the next of its chunks).
pub const WAIT: Duration = Duration::from_secs(2);
/// The most chunks one [`Request::Chunks`] asks (its frame stays under the request
/// limit: an index, a version and a hash each).
pub const MAX_BATCH: usize = 64;
/// How long a [`Request::Next`] waits at the holder for a newer version before it
/// answers "not yet" (the asker waits this plus its request timeout for the answer, then
/// asks again). While one is open the swarm keeps the connection (a member's trimmer
/// spares its followers' connections).
pub const NEXT_WAIT: Duration = Duration::from_secs(20);

/// A byte stream of the chunk protocol.
pub trait WeightsStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> WeightsStream for T {}

/// Where a fetcher's streams to a peer come from (see the module docs).
pub trait WeightsNet: Send + Sync {
    /// A new stream to `peer`'s chunk protocol; `bulk`: for chunks (else for manifests,
    /// which netsim does not scale as it scales a model's chunks).
    fn open(
        &self,
        peer: PeerId,
        bulk: bool,
    ) -> BoxFuture<'_, Result<Box<dyn WeightsStream>, String>>;
}

impl WeightsNet for SwarmHandle {
    fn open(
        &self,
        peer: PeerId,
        _bulk: bool,
    ) -> BoxFuture<'_, Result<Box<dyn WeightsStream>, String>> {
        Box::pin(async move {
            let s = SwarmHandle::open(self, peer, WEIGHTS)
                .await
                .map_err(|e| e.to_string())?;
            Ok(Box::new(s) as Box<dyn WeightsStream>)
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// The manifest of `model`'s `version` (its postcard bytes).
    Manifest { model: String, version: u64 },
    /// Chunk `index` of `model`'s `version`, as a delta against `base` when held.
    Chunk {
        model: String,
        version: u64,
        index: u32,
        /// The asker's version of the chunk and its hash.
        base: Option<(u64, [u8; 32])>,
    },
    /// Several chunks of `model`'s `version` (at most [`MAX_BATCH`]), each with the
    /// asker's base as in [`Request::Chunk`]. Answered by one [`Reply::Of`] per chunk, in
    /// the order they are ready: a chunk the holder is still fetching goes the moment it
    /// arrives, and those still missing [`WAIT`] after the last one went are answered
    /// with what is missing. A follower asks another for that one's whole share so: the
    /// chunks come at the links' pace, not one round trip per request in flight.
    Chunks {
        model: String,
        version: u64,
        asked: Vec<(u32, ChunkBase)>,
    },
    /// The manifest of the newest version of `model` held past `after` (any, with
    /// `None`): a long poll that waits up to [`NEXT_WAIT`] for it and is answered
    /// [`Reply::NotYet`] if none came. A follower keeps one open at each member of its
    /// group: a new version's manifest reaches it one way after the member holds it, not
    /// after the gossip and a round trip of asking (and before the first chunks queue on
    /// the member's upload).
    Next { model: String, after: Option<u64> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Manifest(#[serde(with = "crate::base::bytes")] Vec<u8>),
    Chunk(#[serde(with = "crate::base::bytes")] Vec<u8>),
    /// The holder is fetching that version itself and has not got the chunk yet.
    NotYet,
    /// The holder has not started fetching that version.
    NotStarted,
    NotHeld(String),
    /// The reply for chunk `.0` of a [`Request::Chunks`].
    Of(u32, ChunkReply),
}

/// One chunk's answer inside a batch (not a [`Reply`]: a type that nests itself would
/// let a peer send a frame whose decoding overflows the stack).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ChunkReply {
    Chunk(#[serde(with = "crate::base::bytes")] Vec<u8>),
    NotYet,
    NotStarted,
    NotHeld(String),
}

impl From<Reply> for ChunkReply {
    fn from(r: Reply) -> ChunkReply {
        match r {
            Reply::Chunk(f) => ChunkReply::Chunk(f),
            Reply::NotYet => ChunkReply::NotYet,
            Reply::NotStarted => ChunkReply::NotStarted,
            Reply::NotHeld(why) => ChunkReply::NotHeld(why),
            Reply::Manifest(_) | Reply::Of(..) => ChunkReply::NotHeld("not a chunk".into()),
        }
    }
}

/// Serves `store`'s versions on this node until it stops.
pub fn serve(swarm: &SwarmHandle, store: Arc<VersionStore>) -> Result<(), SwarmError> {
    swarm.serve(WEIGHTS, move |peer, s| serve_stream(store.clone(), peer, s))
}

/// Answers the requests of one inbound stream of the chunk protocol until the asker
/// closes it or leaves it idle.
pub async fn serve_stream<S: AsyncRead + AsyncWrite + Unpin>(
    store: Arc<VersionStore>,
    peer: PeerId,
    mut s: S,
) -> Result<(), FrameError> {
    loop {
        let req: Request = match tokio::time::timeout(IDLE, read_frame(&mut s, REQUEST_LIMIT)).await
        {
            Err(_) | Ok(Err(FrameError::Closed(_))) => return Ok(()),
            Ok(Err(e)) => {
                tracing::warn!(%peer, "dropped a bad weights request: {e}");
                return Err(e);
            }
            Ok(Ok(r)) => r,
        };
        if let Request::Chunks {
            model,
            version,
            asked,
        } = req
        {
            serve_batch(&store, &mut s, model, version, asked).await?;
            continue;
        }
        let mut reply = answered(&store, req.clone()).await;
        let waits = matches!(reply, Reply::NotYet | Reply::NotStarted);
        if let (
            true,
            Request::Chunk {
                model,
                version,
                index,
                ..
            },
        ) = (waits, &req)
        {
            store
                .wait_chunk(model, *version, *index as usize, WAIT)
                .await;
            reply = answered(&store, req).await;
        }
        write_frame(&mut s, &reply, REPLY_LIMIT).await?;
    }
}

/// Answers a [`Request::Chunks`]: each chunk as it is ready (see there). One frame is
/// made and written at a time (a batch holds no more than a single request does).
async fn serve_batch<S: AsyncRead + AsyncWrite + Unpin>(
    store: &Arc<VersionStore>,
    s: &mut S,
    model: String,
    version: u64,
    mut pending: Vec<(u32, ChunkBase)>,
) -> Result<(), FrameError> {
    pending.sort_by_key(|(i, _)| *i);
    pending.dedup_by_key(|(i, _)| *i);
    if pending.len() > MAX_BATCH {
        let why = format!(
            "{} chunks asked at once (at most {MAX_BATCH})",
            pending.len()
        );
        for (i, _) in pending {
            let r = Reply::Of(i, ChunkReply::NotHeld(why.clone()));
            write_frame(s, &r, REPLY_LIMIT).await?;
        }
        return Ok(());
    }
    let mut deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let last_chance = tokio::time::Instant::now() >= deadline;
        let mut sent = false;
        let mut k = 0;
        while k < pending.len() {
            let (i, base) = pending[k];
            let r = chunk_answered(store, &model, version, i, base).await;
            if matches!(r, Reply::NotYet | Reply::NotStarted) && !last_chance {
                k += 1;
                continue;
            }
            pending.remove(k);
            write_frame(s, &Reply::Of(i, ChunkReply::from(r)), REPLY_LIMIT).await?;
            sent = true;
            // The other batches this holder serves write theirs in between: its upload
            // goes round-robin over the askers (each follower gets its first chunks
            // early and serves them on), not one asker's whole batch after another's.
            tokio::task::yield_now().await;
        }
        if pending.is_empty() {
            return Ok(());
        }
        if sent {
            deadline = tokio::time::Instant::now() + WAIT;
        }
        // Until one of the others arrives (or the fetch there ends), at most to the
        // deadline.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let waits: Vec<_> = pending
            .iter()
            .map(|(i, _)| Box::pin(store.wait_chunk(&model, version, *i as usize, left)))
            .collect();
        futures::future::select_all(waits).await;
    }
}

/// The reply to `req`.
async fn answered(store: &Arc<VersionStore>, req: Request) -> Reply {
    match req {
        Request::Manifest { model, version } => match store.get(&model, version) {
            Some(h) => manifest_reply(h).await,
            None => Reply::NotHeld(format!("version {version} of {model:?} is not held here")),
        },
        Request::Chunk {
            model,
            version,
            index,
            base,
        } => chunk_answered(store, &model, version, index, base).await,
        // Answered chunk by chunk (`serve_batch`).
        Request::Chunks { .. } => Reply::NotHeld("a batch inside a batch".into()),
        Request::Next { model, after } => match store.newer(&model, after, NEXT_WAIT).await {
            Some(h) => manifest_reply(h).await,
            None => Reply::NotYet,
        },
    }
}

/// `h`'s manifest as a reply (a big model's is megabytes to copy: off the async threads).
async fn manifest_reply(h: Held) -> Reply {
    tokio::task::spawn_blocking(move || Reply::Manifest(h.encoded.to_vec()))
        .await
        .unwrap_or_else(|e| Reply::NotHeld(format!("the handler failed: {e}")))
}

/// The reply for chunk `index` of `model`'s `version`. Encoding a big chunk (or waiting
/// for another request's encoding of the same frame) is CPU work: off the async threads.
async fn chunk_answered(
    store: &Arc<VersionStore>,
    model: &str,
    version: u64,
    index: u32,
    base: ChunkBase,
) -> Reply {
    if store.small_chunks(model, version) {
        return chunk_reply(store, model, version, index, base);
    }
    let (st, model) = (store.clone(), model.to_string());
    tokio::task::spawn_blocking(move || chunk_reply(&st, &model, version, index, base))
        .await
        .unwrap_or_else(|e| Reply::NotHeld(format!("the handler failed: {e}")))
}

fn chunk_reply(
    store: &VersionStore,
    model: &str,
    version: u64,
    index: u32,
    base: ChunkBase,
) -> Reply {
    match store.frame(model, version, index as usize, base) {
        Ok(f) => Reply::Chunk(f.as_ref().clone()),
        Err(Miss::NotYet) => Reply::NotYet,
        Err(Miss::NotStarted) => Reply::NotStarted,
        Err(Miss::Failed(e)) => Reply::NotHeld(e),
    }
}

/// A peer that serves `model`'s versions, as a [`ChunkSource`]: requests go on streams
/// kept open between them (one per request in flight).
pub struct PeerSource {
    net: Arc<dyn WeightsNet>,
    pub peer: PeerId,
    /// The peer id as text (reports name sources by it).
    name: String,
    model: String,
    /// Open streams waiting for a request (and since when): for chunks, and for
    /// manifests.
    streams: Mutex<Vec<(Box<dyn WeightsStream>, Instant)>>,
    small: Mutex<Vec<(Box<dyn WeightsStream>, Instant)>>,
    timeout: Duration,
    /// The largest chunk reply read (a chunk of the version fetched, its header; a lying
    /// peer cannot make a fetch hold more per request in flight).
    chunk_limit: AtomicUsize,
}

impl PeerSource {
    pub fn new(
        net: Arc<dyn WeightsNet>,
        peer: PeerId,
        model: &str,
        timeout: Duration,
    ) -> PeerSource {
        PeerSource {
            net,
            peer,
            name: peer.to_string(),
            model: model.to_string(),
            streams: Mutex::new(Vec::new()),
            small: Mutex::new(Vec::new()),
            timeout,
            chunk_limit: AtomicUsize::new(REPLY_LIMIT),
        }
    }

    /// Opens a stream for chunks (`bulk`) or for manifests if none is open, for the
    /// next request (see [`super::Follower`]'s warm-up). A failure is left to that
    /// request (it opens one itself).
    pub async fn warm(&self, bulk: bool) {
        let pool = if bulk { &self.streams } else { &self.small };
        let open = {
            let mut p = lock(pool);
            p.retain(|(_, since)| since.elapsed() < POOLED);
            !p.is_empty()
        };
        if open {
            return;
        }
        if let Ok(Ok(s)) = tokio::time::timeout(self.timeout, self.net.open(self.peer, bulk)).await
        {
            lock(pool).push((s, Instant::now()));
        }
    }

    /// Chunks asked from now on are at most `chunk_bytes` (the manifest's chunk size).
    pub fn limit_chunks(&self, chunk_bytes: usize) {
        self.chunk_limit
            .store(chunk_bytes.saturating_add(1024), Ordering::Relaxed);
    }

    async fn ask(&self, req: &Request) -> Result<Reply, String> {
        self.ask_within(req, self.timeout).await
    }

    /// [`Self::ask`], the reply awaited at most `timeout`.
    async fn ask_within(&self, req: &Request, timeout: Duration) -> Result<Reply, String> {
        let bulk = matches!(req, Request::Chunk { .. });
        let pool = if bulk { &self.streams } else { &self.small };
        let pooled = {
            let mut p = lock(pool);
            p.retain(|(_, since)| since.elapsed() < POOLED);
            p.pop()
        };
        if let Some((mut s, _)) = pooled {
            match self.exchange(&mut s, req, timeout).await {
                Ok(reply) => {
                    lock(pool).push((s, Instant::now()));
                    return Ok(reply);
                }
                // The holder closed a stream left idle (or went away): once more, on a
                // new stream.
                Err((false, _)) => {}
                Err((true, e)) => return Err(e),
            }
        }
        let mut s = self.net.open(self.peer, bulk).await?;
        let reply = self
            .exchange(&mut s, req, timeout)
            .await
            .map_err(|(_, e)| e)?;
        lock(pool).push((s, Instant::now()));
        Ok(reply)
    }

    /// One request and its reply on `s`; an error says whether it timed out.
    async fn exchange(
        &self,
        s: &mut Box<dyn WeightsStream>,
        req: &Request,
        timeout: Duration,
    ) -> Result<Reply, (bool, String)> {
        let limit = match req {
            Request::Chunk { .. } | Request::Chunks { .. } => {
                self.chunk_limit.load(Ordering::Relaxed)
            }
            Request::Manifest { .. } | Request::Next { .. } => REPLY_LIMIT,
        };
        let exchange = async {
            write_frame(s, req, REQUEST_LIMIT).await?;
            read_frame::<_, Reply>(s, limit).await
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| (true, format!("no answer in {timeout:?}")))?
            .map_err(|e| (false, e.to_string()))
    }

    /// The manifest of the newest version this peer holds past `after` (any, with
    /// `None`), and its id: waits there for one up to [`NEXT_WAIT`] (see
    /// [`Request::Next`]). `None`: none came meanwhile.
    pub async fn next_manifest(
        &self,
        after: Option<u64>,
    ) -> Result<Option<(Manifest, [u8; 32])>, String> {
        let req = Request::Next {
            model: self.model.clone(),
            after,
        };
        match self.ask_within(&req, NEXT_WAIT + self.timeout).await? {
            Reply::Manifest(bytes) => {
                let id = *blake3::hash(&bytes).as_bytes();
                let m = Manifest::decode(&bytes).map_err(|e| e.to_string())?;
                if m.model != self.model || after.is_some_and(|a| m.version <= a) {
                    return Err(format!(
                        "{} answered a long poll past version {after:?} of {:?} with version \
                         {} of {:?}",
                        self.peer, self.model, m.version, m.model
                    ));
                }
                Ok(Some((m, id)))
            }
            Reply::NotYet => Ok(None),
            Reply::NotHeld(why) => Err(why),
            _ => Err("not a manifest where one was asked".into()),
        }
    }

    /// The manifest of `version`, decoded and validated, if its id is `id` (what a
    /// member of the group announced).
    pub async fn manifest(&self, version: u64, id: &[u8; 32]) -> Result<Manifest, String> {
        let req = Request::Manifest {
            model: self.model.clone(),
            version,
        };
        match self.ask(&req).await? {
            Reply::Manifest(bytes) => {
                if blake3::hash(&bytes).as_bytes() != id {
                    return Err(format!(
                        "{} sent a manifest of version {version} that is not the announced one",
                        self.peer
                    ));
                }
                let m = Manifest::decode(&bytes).map_err(|e| e.to_string())?;
                if m.model != self.model || m.version != version {
                    return Err(format!(
                        "the manifest is of {:?} version {}, not {:?} version {version}",
                        m.model, m.version, self.model
                    ));
                }
                Ok(m)
            }
            Reply::NotHeld(why) => Err(why),
            Reply::NotYet | Reply::NotStarted => Err("the manifest is not held yet".into()),
            Reply::Chunk(_) | Reply::Of(..) => Err("a chunk where a manifest was asked".into()),
        }
    }
}

impl ChunkSource for PeerSource {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn fetch_many<'a>(
        &'a self,
        version: u64,
        asked: Vec<(usize, ChunkBase)>,
        each: &'a mut (dyn FnMut(usize, Result<Vec<u8>, Miss>) + Send),
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            for batch in asked.chunks(MAX_BATCH) {
                self.chunks(version, batch, each).await;
            }
        })
    }

    fn fetch(
        &self,
        version: u64,
        index: usize,
        base: Option<(u64, [u8; 32])>,
    ) -> BoxFuture<'_, Result<Vec<u8>, Miss>> {
        Box::pin(self.chunk(version, index, base))
    }
}

impl PeerSource {
    async fn chunk(
        &self,
        version: u64,
        index: usize,
        base: Option<(u64, [u8; 32])>,
    ) -> Result<Vec<u8>, Miss> {
        let req = Request::Chunk {
            model: self.model.clone(),
            version,
            index: u32::try_from(index)
                .map_err(|_| Miss::Failed(format!("chunk index {index}")))?,
            base,
        };
        match self.ask(&req).await.map_err(Miss::Failed)? {
            Reply::Chunk(f) => Ok(f),
            Reply::NotYet => Err(Miss::NotYet),
            Reply::NotStarted => Err(Miss::NotStarted),
            other => Err(miss(other)),
        }
    }

    /// Asks for the chunks `asked` of `version` in one [`Request::Chunks`] (at most
    /// [`MAX_BATCH`]) and hands each reply to `each` as it comes: a frame, or why not
    /// (every chunk not answered when the stream fails is a `Failed`).
    pub async fn chunks(
        &self,
        version: u64,
        asked: &[(usize, ChunkBase)],
        each: &mut (dyn FnMut(usize, Result<Vec<u8>, Miss>) + Send),
    ) {
        let mut left: Vec<usize> = asked.iter().map(|(i, _)| *i).collect();
        let req = Request::Chunks {
            model: self.model.clone(),
            version,
            asked: asked
                .iter()
                .filter_map(|(i, b)| Some((u32::try_from(*i).ok()?, *b)))
                .collect(),
        };
        let why = match self.batch(&req, &mut left, each).await {
            Ok(()) => return,
            Err(e) => e,
        };
        for i in left {
            each(i, Err(Miss::Failed(why.clone())));
        }
    }

    async fn batch(
        &self,
        req: &Request,
        left: &mut Vec<usize>,
        each: &mut (dyn FnMut(usize, Result<Vec<u8>, Miss>) + Send),
    ) -> Result<(), String> {
        let pooled = {
            let mut p = lock(&self.streams);
            p.retain(|(_, since)| since.elapsed() < POOLED);
            p.pop()
        };
        if let Some((mut s, _)) = pooled {
            let asked = left.len();
            match self.batch_on(&mut s, req, left, each).await {
                Ok(()) => {
                    lock(&self.streams).push((s, Instant::now()));
                    return Ok(());
                }
                // The holder closed a stream left idle (or went away) before answering:
                // once more, on a new stream.
                Err(e) if left.len() == asked && !e.starts_with("no answer") => {}
                Err(e) => return Err(e),
            }
        }
        let mut s = self.net.open(self.peer, true).await?;
        self.batch_on(&mut s, req, left, each).await?;
        lock(&self.streams).push((s, Instant::now()));
        Ok(())
    }

    /// [`Self::batch`] on stream `s`: `left` keeps the chunks not answered yet.
    async fn batch_on(
        &self,
        s: &mut Box<dyn WeightsStream>,
        req: &Request,
        left: &mut Vec<usize>,
        each: &mut (dyn FnMut(usize, Result<Vec<u8>, Miss>) + Send),
    ) -> Result<(), String> {
        let limit = self.chunk_limit.load(Ordering::Relaxed);
        let late = || format!("no answer in {:?}", self.timeout);
        tokio::time::timeout(self.timeout, write_frame(s, req, REQUEST_LIMIT))
            .await
            .map_err(|_| late())?
            .map_err(|e| e.to_string())?;
        while !left.is_empty() {
            let reply = tokio::time::timeout(self.timeout, read_frame::<_, Reply>(s, limit))
                .await
                .map_err(|_| late())?
                .map_err(|e| e.to_string())?;
            let Reply::Of(i, r) = reply else {
                return Err("a batch answered with something else".into());
            };
            let i = i as usize;
            let Some(k) = left.iter().position(|&j| j == i) else {
                return Err(format!("chunk {i} was not asked, or answered twice"));
            };
            left.swap_remove(k);
            each(
                i,
                match r {
                    ChunkReply::Chunk(f) => Ok(f),
                    ChunkReply::NotYet => Err(Miss::NotYet),
                    ChunkReply::NotStarted => Err(Miss::NotStarted),
                    ChunkReply::NotHeld(why) => Err(Miss::Failed(why)),
                },
            );
        }
        Ok(())
    }
}

/// What a reply other than a chunk says.
fn miss(r: Reply) -> Miss {
    match r {
        Reply::NotYet => Miss::NotYet,
        Reply::NotStarted => Miss::NotStarted,
        Reply::NotHeld(why) => Miss::Failed(why),
        Reply::Chunk(_) => Miss::Failed("a chunk where none was expected".into()),
        Reply::Manifest(_) => Miss::Failed("a manifest where a chunk was asked".into()),
        Reply::Of(..) => Miss::Failed("a batch's reply where a chunk was asked".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::broadcast::Manifest;
    use tokio_util::compat::TokioAsyncReadCompatExt;

    /// `store`'s chunk protocol over in-memory streams, each answered by [`serve_stream`].
    struct InMemory(Arc<VersionStore>);

    impl WeightsNet for InMemory {
        fn open(
            &self,
            _peer: PeerId,
            _bulk: bool,
        ) -> BoxFuture<'_, Result<Box<dyn WeightsStream>, String>> {
            let store = self.0.clone();
            Box::pin(async move {
                let (mine, theirs) = tokio::io::duplex(1 << 20);
                tokio::spawn(serve_stream(store, PeerId::random(), theirs.compat()));
                Ok(Box::new(mine.compat()) as Box<dyn WeightsStream>)
            })
        }
    }

    fn version(v: u64) -> Held {
        let bytes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(v as u8 + 3)).collect();
        let layout = vec![("w".to_string(), "Float".to_string(), vec![16], 64)];
        Held::new(
            Manifest::build_chunked("m", v, "h", &layout, &bytes, 16).unwrap(),
            bytes,
        )
    }

    #[tokio::test]
    async fn a_long_poll_brings_the_next_versions_manifest_the_moment_it_is_held() {
        let store = Arc::new(VersionStore::new(2, 1 << 20));
        store.put(version(1));
        let net = Arc::new(InMemory(store.clone()));
        let src = PeerSource::new(net, PeerId::random(), "m", Duration::from_secs(30));
        // Past nothing: the version held, at once, with its id.
        let (m, id) = src.next_manifest(None).await.unwrap().unwrap();
        assert_eq!((m.version, id), (1, store.get("m", 1).unwrap().id));
        // Past version 1: the poll waits there, and version 2 comes when it is held.
        let poll = tokio::spawn(async move { src.next_manifest(Some(1)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!poll.is_finished(), "nothing past version 1 is held yet");
        let next = version(2);
        store.put(next.clone());
        let got = tokio::time::timeout(Duration::from_secs(30), poll)
            .await
            .expect("answered when version 2 was held")
            .unwrap();
        let (m, id) = got.unwrap().unwrap();
        assert_eq!((m.version, id), (2, next.id));
        assert_eq!(m, *next.manifest);
    }
}
