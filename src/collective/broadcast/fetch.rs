//! Fetching a policy version from several peers at once, as a follower does: only the
//! chunks that changed since the version it holds (all of them when it holds none or the
//! layout changed), each asked as a delta against the follower's copy, from the sources
//! in turn with bounded parallelism. Every chunk is checked against the manifest's hash
//! before it is kept; a source that sends a wrong or malformed chunk is backed off for
//! the rest of the fetch and named in the report, one that fails twice in a row (gone,
//! timing out) is backed off too, and the chunk is asked again elsewhere. Memory is the
//! target snapshot plus one frame per request in flight, whatever the sources send.
//!
//! Sharing a version with other followers, the chunks of each other follower's share
//! are asked of it in one batch request (it sends each the moment it has it, see
//! [`super::wire::Request::Chunks`]): on 100 ms links a follower taking 500 chunks
//! one request at a time is bound by round trips, not bytes (with 64 requests in flight
//! and 0.4 s per request, 160 chunks a second). What a batch does not give goes to the
//! single requests, which also take the follower's own share from the members.
//!
//! The requests in flight are futures on the calling thread, not threads: netsim runs a
//! hundred followers in one process.
//!
//! The transport is a [`ChunkSource`]: [`super::wire::PeerSource`] is a peer over the
//! swarm's chunk protocol; the tests use sources in memory.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::codec::{decode_into, encoding_of, CodecError, Encoding};
use super::manifest::Manifest;

/// Why a source gave no chunk.
#[derive(Debug, Clone, PartialEq)]
pub enum Miss {
    /// It is fetching that version itself and has not got this chunk yet (ask again
    /// later; not held against it).
    NotYet,
    /// It holds an earlier version and has not started fetching this one (it may soon:
    /// it saw the version later than the asker).
    NotStarted,
    /// Anything else (gone, timing out, not holding the version).
    Failed(String),
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Miss::NotYet => write!(f, "not fetched there yet"),
            Miss::NotStarted => write!(f, "that version's fetch has not started there"),
            Miss::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// The version a fetcher holds a chunk at and that chunk's hash (a delta is made
/// against it), if it holds one.
pub type ChunkBase = Option<(u64, [u8; 32])>;

/// A peer that serves chunks of the versions it holds (or is fetching).
pub trait ChunkSource: Send + Sync {
    /// The peer's name (its id), for reports and back-off.
    fn name(&self) -> String;
    /// The frame ([`super::codec::encode`]) of chunk `index` of `version`, encoded as a
    /// delta against the same chunk of version `base` when given: the version the fetcher
    /// holds and the hash of its chunk there (a delta is made only against a chunk of that
    /// hash; version numbers may repeat after a restart).
    fn fetch(
        &self,
        version: u64,
        index: usize,
        base: Option<(u64, [u8; 32])>,
    ) -> BoxFuture<'_, Result<Vec<u8>, Miss>>;

    /// Several chunks of `version` at once, each with its base as in [`Self::fetch`]:
    /// each answer goes to `each` as it comes (the wire asks them in one request and the
    /// holder sends each when it has it). By default one after another.
    fn fetch_many<'a>(
        &'a self,
        version: u64,
        asked: Vec<(usize, ChunkBase)>,
        each: &'a mut (dyn FnMut(usize, Result<Vec<u8>, Miss>) + Send),
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            for (i, base) in asked {
                let r = self.fetch(version, i, base).await;
                each(i, r);
            }
        })
    }
}

/// How the followers fetching one version share the work (a swarm, as BitTorrent's): the
/// chunks are dealt round-robin to the followers, each takes its own share from the
/// members and the rest from their owners, so the members send about one copy of the
/// changed bytes whatever the number of followers.
#[derive(Debug, Clone)]
pub struct Share {
    /// For each share in turn (chunk `i` is share `i % owners.len()`'s), the index in the
    /// sources of its owner, or `None` for this fetcher's own.
    pub owners: Vec<Option<usize>>,
    /// How long to wait for an owner that gives no chunk (since it was first asked, or
    /// last gave one) before asking the members for its share (it is dead, or stuck).
    pub patience: Duration,
    /// How long after this fetch starts an owner that has not started fetching the
    /// version is waited for (it heard of it later); after it, its share comes from the
    /// members.
    pub grace: Duration,
    /// Single requests for this follower's own share (what its batches to the members
    /// did not give) in flight to one member at most: each follower asking a few at a
    /// time, a member's upload serves every follower's first chunks before anyone's last.
    pub member_in_flight: usize,
}

#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// Chunks in flight at once.
    pub parallel: usize,
    /// Tries per chunk (over all sources) before the fetch fails.
    pub attempts: usize,
    /// Without a [`Share`]: the first this many sources are asked first (the chunks
    /// spread over them), the others only for what those fail to give.
    pub preferred: usize,
    /// Share the work with the other followers fetching this version (see [`Share`]).
    pub share: Option<Share>,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            parallel: 4,
            attempts: 8,
            preferred: 0,
            share: None,
        }
    }
}

/// What a fetch moved and whom it backed off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FetchReport {
    /// Chunks fetched (the others were kept from the held version).
    pub chunks: usize,
    /// Frame bytes received and kept, per source.
    pub bytes_by_source: BTreeMap<String, u64>,
    /// Sources backed off, and why (a wrong chunk names its sender here).
    pub backed_off: Vec<(String, String)>,
}

impl FetchReport {
    pub fn bytes(&self) -> u64 {
        self.bytes_by_source.values().sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("chunk {chunk} of version {version} could not be fetched: {why}")]
    Unavailable {
        version: u64,
        chunk: usize,
        why: String,
    },
}

/// One source's standing during a fetch.
struct Standing {
    failures_in_a_row: AtomicUsize,
    backed_off: Mutex<Option<String>>,
}

/// What one fetch shares between its workers.
struct Run<'a> {
    target: &'a Manifest,
    sources: &'a [Arc<dyn ChunkSource>],
    standing: Vec<Standing>,
    cfg: &'a FetchConfig,
    report: Mutex<FetchReport>,
    /// Per source: when it was first asked, or last gave a chunk (see
    /// [`Share::patience`]).
    progress: Vec<Mutex<Option<Instant>>>,
    started: Instant,
    /// Owners found not fetching this version after the grace (see [`Share::grace`]).
    absent: Vec<std::sync::atomic::AtomicBool>,
    /// Per source, sharing: a member's room for requests in flight (see
    /// [`Share::member_in_flight`]); `None` for owners and without a share.
    room: Vec<Option<tokio::sync::Semaphore>>,
    /// Wakes the batches when a source is backed off or the fetch failed (each may end).
    ended: tokio::sync::Notify,
    /// The sources' names (asked once).
    names: Vec<String>,
    /// Each chunk's place in the snapshot being built: a frame is decoded there.
    slots: &'a [Mutex<&'a mut [u8]>],
}

/// What a fetch hands on of each chunk once it is checked: its index, the frame as it
/// came, and the hash of the chunk it is a delta against (the fetcher's: `None` without
/// one). A follower serves the frame as it is to a peer that holds that chunk too.
pub type OnChunk<'a> = dyn Fn(usize, Vec<u8>, Option<[u8; 32]>) + Sync + 'a;

/// How long a worker waits before asking the followers again for a chunk not yet there.
const POLL: Duration = Duration::from_millis(20);

/// The snapshot of `target`, starting from `have` (a held version and its snapshot) when
/// its layout is the same: the changed chunks fetched from `sources`, checked.
pub fn fetch_version(
    target: &Manifest,
    have: Option<(&Manifest, &[u8])>,
    sources: &[Arc<dyn ChunkSource>],
    cfg: &FetchConfig,
) -> Result<(Vec<u8>, FetchReport), FetchError> {
    fetch_version_with(target, have, sources, cfg, &|_, _, _| {}, Vec::new())
}

/// [`fetch_version`], calling `on_chunk` with each chunk once it is checked (a follower
/// serves it from then on, before the whole version is in), the snapshot
/// built in `buffer` (its allocation reused: see [`fetch_async`]). Blocks: on the tokio
/// runtime of the calling thread's context (a `spawn_blocking` thread's), else on a small
/// runtime of its own.
pub fn fetch_version_with(
    target: &Manifest,
    have: Option<(&Manifest, &[u8])>,
    sources: &[Arc<dyn ChunkSource>],
    cfg: &FetchConfig,
    on_chunk: &OnChunk<'_>,
    buffer: Vec<u8>,
) -> Result<(Vec<u8>, FetchReport), FetchError> {
    let fut = fetch_async(target, have, sources, cfg, on_chunk, buffer);
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => rt.block_on(fut),
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| FetchError::Unavailable {
                version: target.version,
                chunk: 0,
                why: format!("no runtime for the fetch: {e}"),
            })?
            .block_on(fut),
    }
}

/// [`fetch_version_with`] as a future on the caller's task: every chunk is decoded and
/// checked on it, so callers use it for small chunks (see
/// [`super::manifest::INLINE_CHUNK_BYTES`]) and run bigger ones on a thread of their own.
///
/// The snapshot is built in `buffer` (`Vec::new()`: a new one). A follower passes one of
/// the snapshot's size whose pages it wrote ahead, between versions: a new snapshot's
/// first writes otherwise fault its pages in during the fetch (in netsim's scenario 6,
/// the first version's copy of the held snapshot took about twice the CPU of the
/// later ones', which reuse freed memory).
pub async fn fetch_async(
    target: &Manifest,
    have: Option<(&Manifest, &[u8])>,
    sources: &[Arc<dyn ChunkSource>],
    cfg: &FetchConfig,
    on_chunk: &OnChunk<'_>,
    buffer: Vec<u8>,
) -> Result<(Vec<u8>, FetchReport), FetchError> {
    let held = have.filter(|(m, b)| b.len() as u64 == m.total_bytes());
    let mut out = buffer;
    out.clear();
    let (mut needed, base) = match held.map(|(m, b)| (target.changed_since(m), m, b)) {
        Some((Ok(changed), m, b)) => {
            out.extend_from_slice(b);
            (changed, Some((m, b)))
        }
        _ => {
            out.resize(target.total_bytes() as usize, 0);
            ((0..target.chunks.len()).collect(), None)
        }
    };
    // Our own share first: the other followers wait for it. Then the others' in rounds
    // (one chunk of each owner per round), each round starting at the owner after us
    // (the order of the batches' chunks, and of single requests without batches).
    if let Some(share) = cfg.share.as_ref().filter(|s| !s.owners.is_empty()) {
        let n = share.owners.len();
        let me = share.owners.iter().position(Option::is_none).unwrap_or(0);
        needed.sort_by_key(|&i| (share.owners[i % n].is_some(), i / n, (i % n + n - me) % n));
    }
    let report = fetch_into(target, base, needed, &mut out, sources, cfg, on_chunk).await?;
    Ok((out, report))
}

/// [`fetch_async`]'s work: the `needed` chunks (in the order asked) fetched, checked and
/// decoded into their places in `out` (built from `base`'s snapshot, if any).
async fn fetch_into(
    target: &Manifest,
    base: Option<(&Manifest, &[u8])>,
    mut needed: Vec<usize>,
    out: &mut [u8],
    sources: &[Arc<dyn ChunkSource>],
    cfg: &FetchConfig,
    on_chunk: &OnChunk<'_>,
) -> Result<FetchReport, FetchError> {
    let chunk = target.chunk_bytes as usize;
    let slots: Vec<Mutex<&mut [u8]>> = out.chunks_mut(chunk).map(Mutex::new).collect();
    let run = Run {
        target,
        sources,
        standing: sources
            .iter()
            .map(|_| Standing {
                failures_in_a_row: AtomicUsize::new(0),
                backed_off: Mutex::new(None),
            })
            .collect(),
        cfg,
        report: Mutex::new(FetchReport {
            chunks: needed.len(),
            ..Default::default()
        }),
        progress: sources.iter().map(|_| Mutex::new(None)).collect(),
        started: Instant::now(),
        absent: sources
            .iter()
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect(),
        room: (0..sources.len())
            .map(|j| match &cfg.share {
                Some(s) if !s.owners.contains(&Some(j)) => {
                    Some(tokio::sync::Semaphore::new(s.member_in_flight.max(1)))
                }
                _ => None,
            })
            .collect(),
        ended: tokio::sync::Notify::new(),
        names: sources.iter().map(|s| s.name()).collect(),
        slots: &slots,
    };
    let base_of = |i: usize| -> Option<Base<'_>> {
        base.map(|(m, b)| (m.version, m.chunks[i], &b[target.chunk_range(i)]))
    };
    // Decoded into its slot already; a delta is handed on with the hash of its base.
    let keep = |i: usize, frame: Vec<u8>| {
        let delta = matches!(
            encoding_of(&frame),
            Some(Encoding::XorZstd | Encoding::XorPlanesZstd)
        );
        let base = base_of(i).filter(|_| delta).map(|(_, h, _)| h);
        on_chunk(i, frame, base)
    };
    let total = needed.len();
    // Sharing, each other owner's chunks are asked of it in batches (it sends each the
    // moment it has it), and this follower's own share of the members, dealt over them;
    // what a batch does not give joins the queue of single requests.
    let mut batches: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    if let Some(share) = cfg.share.as_ref().filter(|s| !s.owners.is_empty()) {
        let n = share.owners.len();
        let members: Vec<usize> = (0..sources.len())
            .filter(|j| !share.owners.contains(&Some(*j)))
            .collect();
        let mut own = 0;
        needed.retain(
            |&i| match share.owners[i % n].filter(|&j| j < sources.len()) {
                Some(j) => {
                    batches.entry(j).or_default().push(i);
                    false
                }
                None if !members.is_empty() => {
                    batches
                        .entry(members[own % members.len()])
                        .or_default()
                        .push(i);
                    own += 1;
                    false
                }
                None => true,
            },
        );
    }
    let queue: Mutex<std::collections::VecDeque<usize>> = Mutex::new(needed.into());
    let batching = AtomicUsize::new(batches.len());
    let more = tokio::sync::Notify::new();
    let failed: Mutex<Option<FetchError>> = Mutex::new(None);
    let batch = |j: usize, chunks: Vec<usize>| {
        let (run, queue, more, batching, keep, failed) =
            (&run, &queue, &more, &batching, &keep, &failed);
        async move {
            let asked: Vec<_> = chunks
                .iter()
                .map(|&i| (i, base_of(i).map(|(v, h, _)| (v, h))))
                .collect();
            let take = |i: usize, r: Result<Vec<u8>, Miss>| {
                // An owner that has not started the version after the batch's wait (at
                // least the grace) is absent: its share comes from the members at once.
                let grace = run.cfg.share.as_ref().map_or(Duration::ZERO, |s| s.grace);
                if matches!(r, Err(Miss::NotStarted)) && run.started.elapsed() >= grace {
                    run.absent[j].store(true, Ordering::Relaxed);
                }
                let got = match r {
                    Ok(f) if !run.backed_off(j) => run.checked(j, i, base_of(i), Ok(f)),
                    _ => Asked::NotYet,
                };
                match got {
                    Asked::Got(bytes) => {
                        *lock(&run.progress[j]) = Some(Instant::now());
                        keep(i, bytes);
                    }
                    _ => {
                        lock(queue).push_back(i);
                        // One worker takes it (the others sleep on).
                        more.notify_one();
                    }
                }
            };
            let handled: Mutex<Vec<usize>> = Mutex::new(Vec::new());
            let mut each = |i: usize, r: Result<Vec<u8>, Miss>| {
                lock(&handled).push(i);
                take(i, r);
            };
            // The batch ends early when its source is backed off (a wrong chunk), an
            // owner makes no progress for the patience, or the fetch failed: what it has
            // not handed back joins the queue. Woken by those events and the patience's
            // deadline alone (a timer per batch ticking every 100 ms, with a hundred
            // followers each batching to every other, was a hundred thousand wake-ups a
            // second in netsim's one process).
            let started = Instant::now();
            let owner = run
                .cfg
                .share
                .as_ref()
                .filter(|s| s.owners.contains(&Some(j)));
            let watch = async {
                loop {
                    let ended = run.ended.notified();
                    tokio::pin!(ended);
                    ended.as_mut().enable();
                    if run.backed_off(j) || lock(failed).is_some() {
                        return;
                    }
                    match owner {
                        Some(s) => {
                            let last = lock(&run.progress[j]).map_or(started, |t| t.max(started));
                            let due = last + s.patience;
                            if Instant::now() >= due {
                                return;
                            }
                            tokio::select! {
                                _ = ended => {}
                                _ = tokio::time::sleep_until(due.into()) => {}
                            }
                        }
                        None => ended.await,
                    }
                }
            };
            {
                let asked_all = run.sources[j].fetch_many(run.target.version, asked, &mut each);
                futures::future::select(asked_all, Box::pin(watch)).await;
            }
            let handled = lock(&handled).clone();
            let left: Vec<usize> = chunks
                .into_iter()
                .filter(|i| !handled.contains(i))
                .collect();
            if !left.is_empty() {
                lock(queue).extend(left);
            }
            batching.fetch_sub(1, Ordering::Relaxed);
            more.notify_waiters();
        }
    };
    let workers = cfg.parallel.clamp(1, total.max(1));
    let worker = || async {
        loop {
            if lock(&failed).is_some() {
                return;
            }
            let next = lock(&queue).pop_front();
            let Some(i) = next else {
                // Only idle workers wait (a chunk put back wakes one of them, not one busy
                // with a chunk of its own), registered before looking again: a chunk
                // queued, or the last batch ending, in between still wakes it.
                let wait = more.notified();
                tokio::pin!(wait);
                wait.as_mut().enable();
                if !lock(&queue).is_empty() || lock(&failed).is_some() {
                    continue;
                }
                if batching.load(Ordering::Relaxed) == 0 {
                    return;
                }
                wait.await;
                continue;
            };
            match run.chunk(i, base_of(i)).await {
                Ok(bytes) => keep(i, bytes),
                Err(e) => {
                    lock(&failed).get_or_insert(e);
                    run.ended.notify_waiters();
                    more.notify_waiters();
                    return;
                }
            }
        }
    };
    let batches = futures::future::join_all(batches.into_iter().map(|(j, c)| batch(j, c)));
    let workers = futures::future::join_all((0..workers).map(|_| worker()));
    futures::future::join(batches, workers).await;
    if let Some(e) = lock(&failed).take() {
        return Err(e);
    }
    Ok(run.report.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// The fetcher's copy of a chunk: its version, its hash and its bytes.
type Base<'a> = (u64, [u8; 32], &'a [u8]);

/// What asking one source for a chunk gave.
enum Asked {
    /// The frame (its chunk decoded into its slot).
    Got(Vec<u8>),
    NotYet,
    NotStarted,
    Failed(String),
}

impl Run<'_> {
    fn backed_off(&self, j: usize) -> bool {
        lock(&self.standing[j].backed_off).is_some()
    }

    /// Chunk `i`: with a share and another owner, from the followers while they make
    /// progress; then from the sources in turn (the preferred first, from `i` on, so the
    /// chunks spread), checked; backs off sources that lie or keep failing.
    async fn chunk(&self, i: usize, base: Option<Base<'_>>) -> Result<Vec<u8>, FetchError> {
        let n = self.sources.len();
        let mut why = String::from("no source");
        if let Some(share) = self.cfg.share.as_ref().filter(|s| !s.owners.is_empty()) {
            // Another follower's share: from that follower, while it makes progress.
            if let Some(owner) = share.owners[i % share.owners.len()].filter(|&j| j < n) {
                loop {
                    if self.backed_off(owner) || self.absent[owner].load(Ordering::Relaxed) {
                        break;
                    }
                    match self.ask(owner, i, base).await {
                        Asked::Got(b) => {
                            *lock(&self.progress[owner]) = Some(Instant::now());
                            return Ok(b);
                        }
                        Asked::NotYet => {}
                        Asked::NotStarted if self.started.elapsed() >= share.grace => {
                            self.absent[owner].store(true, Ordering::Relaxed);
                            break;
                        }
                        Asked::NotStarted => {}
                        Asked::Failed(e) => why = e,
                    }
                    let since = *lock(&self.progress[owner]).get_or_insert_with(Instant::now);
                    if since.elapsed() >= share.patience {
                        break;
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
        // The preferred sources first, from `i` on (so the chunks spread), then the others;
        // sharing, the members first (the followers had their turn).
        let (first, then): (Vec<usize>, Vec<usize>) = match &self.cfg.share {
            Some(share) => (0..n).partition(|j| !share.owners.contains(&Some(*j))),
            None => (0..n).partition(|&j| j < self.cfg.preferred),
        };
        let rotated =
            |v: &[usize]| -> Vec<usize> { (0..v.len()).map(|k| v[(i + k) % v.len()]).collect() };
        let order: Vec<usize> = rotated(&first).into_iter().chain(rotated(&then)).collect();
        let attempts = self.cfg.attempts.max(1);
        let mut tries = 0;
        for k in 0..n * attempts {
            if tries >= attempts {
                break;
            }
            let j = order[k % n];
            if self.backed_off(j) {
                continue;
            }
            tries += 1;
            // Only this follower's own share waits for room at a member: the shares of
            // owners found absent or silent come as fast as the members give them.
            let own = self
                .cfg
                .share
                .as_ref()
                .is_some_and(|s| s.owners[i % s.owners.len()].is_none());
            let _room = match (&self.room[j], own) {
                (Some(r), true) => r.acquire().await.ok(),
                _ => None,
            };
            let asked = self.ask(j, i, base).await;
            match asked {
                Asked::Got(b) => return Ok(b),
                Asked::NotYet | Asked::NotStarted => {
                    why = format!("{}: not fetched there yet", self.sources[j].name())
                }
                Asked::Failed(e) => why = e,
            }
        }
        Err(FetchError::Unavailable {
            version: self.target.version,
            chunk: i,
            why,
        })
    }

    /// Asks source `j` for chunk `i` and checks what it sends.
    async fn ask(&self, j: usize, i: usize, base: Option<Base<'_>>) -> Asked {
        let r = self.sources[j]
            .fetch(self.target.version, i, base.map(|(v, h, _)| (v, h)))
            .await;
        self.checked(j, i, base, r)
    }

    /// What source `j` answered for chunk `i`, checked (a wrong chunk backs it off).
    fn checked(
        &self,
        j: usize,
        i: usize,
        base: Option<Base<'_>>,
        answer: Result<Vec<u8>, Miss>,
    ) -> Asked {
        let target = self.target;
        let len = target.chunk_range(i).len();
        let standing = &self.standing[j];
        let frame = match answer {
            Ok(f) => f,
            Err(Miss::NotYet) => return Asked::NotYet,
            Err(Miss::NotStarted) => return Asked::NotStarted,
            Err(Miss::Failed(e)) => {
                if standing.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= 2 {
                    self.back_off(j, format!("failed twice in a row: {e}"));
                }
                return Asked::Failed(format!("{}: {e}", self.names[j]));
            }
        };
        standing.failures_in_a_row.store(0, Ordering::Relaxed);
        // A frame is at most the chunk plus its two header bytes.
        let checked = if frame.len() > len + 2 {
            Err(CodecError::Malformed(format!(
                "a frame of {} bytes for a chunk of {len}",
                frame.len()
            )))
        } else {
            let mut slot = lock(&self.slots[i]);
            decode_into(
                &frame,
                base.map(|(_, _, b)| b),
                &mut slot,
                &target.chunks[i],
            )
        };
        match checked {
            Ok(()) => {
                let name = &self.names[j];
                let mut report = lock(&self.report);
                match report.bytes_by_source.get_mut(name) {
                    Some(n) => *n += frame.len() as u64,
                    None => {
                        report
                            .bytes_by_source
                            .insert(name.clone(), frame.len() as u64);
                    }
                }
                Asked::Got(frame)
            }
            Err(e) => {
                self.back_off(
                    j,
                    format!("sent chunk {i} of version {}: {e}", target.version),
                );
                Asked::Failed(format!("{}: {e}", self.names[j]))
            }
        }
    }

    /// Backs source `j` off for the rest of the fetch (once; the first reason is kept).
    fn back_off(&self, j: usize, why: String) {
        let mut b = lock(&self.standing[j].backed_off);
        if b.is_none() {
            *b = Some(why.clone());
            lock(&self.report)
                .backed_off
                .push((self.names[j].clone(), why));
            // Its batch ends (see `fetch_async`).
            self.ended.notify_waiters();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::super::codec::encode;
    use super::super::manifest::CHUNK_BYTES;
    use super::*;
    use std::collections::HashMap;

    /// A peer holding some versions' snapshots.
    struct Peer {
        name: String,
        versions: HashMap<u64, Vec<u8>>,
        /// Flip a byte of every frame it sends.
        tamper: bool,
        /// Answers with an error (a peer that went away).
        gone: bool,
        served: AtomicUsize,
    }

    impl ChunkSource for Peer {
        fn name(&self) -> String {
            self.name.clone()
        }
        fn fetch(
            &self,
            version: u64,
            index: usize,
            base: Option<(u64, [u8; 32])>,
        ) -> BoxFuture<'_, Result<Vec<u8>, Miss>> {
            Box::pin(std::future::ready(self.serve(version, index, base)))
        }
    }

    impl Peer {
        fn serve(
            &self,
            version: u64,
            index: usize,
            base: Option<(u64, [u8; 32])>,
        ) -> Result<Vec<u8>, Miss> {
            if self.gone {
                return Err(Miss::Failed("connection reset".into()));
            }
            let c = CHUNK_BYTES as usize;
            let snap = self
                .versions
                .get(&version)
                .ok_or(Miss::Failed("no such version".into()))?;
            let r = index * c..((index + 1) * c).min(snap.len());
            let b = base
                .and_then(|(v, _)| self.versions.get(&v))
                .map(|b| &b[r.clone()]);
            let mut f = encode(&snap[r], b, 2);
            if self.tamper {
                let last = f.len() - 1;
                f[last] ^= 0x40;
            }
            self.served.fetch_add(1, Ordering::Relaxed);
            Ok(f)
        }
    }

    fn peer(name: &str, versions: &[(u64, &Vec<u8>)], tamper: bool, gone: bool) -> Arc<Peer> {
        Arc::new(Peer {
            name: name.into(),
            versions: versions.iter().map(|(v, b)| (*v, (*b).clone())).collect(),
            tamper,
            gone,
            served: AtomicUsize::new(0),
        })
    }

    /// Two versions of a 5.5-chunk bf16 snapshot; the second changes chunks 1 and 4.
    fn versions() -> (Manifest, Vec<u8>, Manifest, Vec<u8>) {
        let c = CHUNK_BYTES as u64;
        let n = 5 * c + c / 2;
        let layout = vec![("w".to_string(), "bf16".to_string(), vec![n as i64 / 2], n)];
        let a: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(7)).collect();
        let mut b = a.clone();
        for k in (c as usize + 10..c as usize + 5000).step_by(97) {
            b[k] ^= 1;
        }
        b[4 * c as usize + 3] ^= 2;
        let ma = Manifest::build("m", 1, "h1", &layout, &a).unwrap();
        let mb = Manifest::build("m", 2, "h2", &layout, &b).unwrap();
        (ma, a, mb, b)
    }

    fn sources(ps: &[&Arc<Peer>]) -> Vec<Arc<dyn ChunkSource>> {
        ps.iter()
            .map(|p| Arc::clone(p) as Arc<dyn ChunkSource>)
            .collect()
    }

    #[test]
    fn a_follower_fetches_only_changed_chunks_as_deltas_from_several_peers() {
        let (ma, a, mb, b) = versions();
        let t = peer("trainer", &[(1, &a), (2, &b)], false, false);
        let f = peer("follower", &[(1, &a), (2, &b)], false, false);
        let (got, r) = fetch_version(
            &mb,
            Some((&ma, &a)),
            &sources(&[&t, &f]),
            &FetchConfig::default(),
        )
        .unwrap();
        assert!(got == b, "the fetched snapshot differs");
        assert_eq!(r.chunks, 2);
        assert!(
            r.bytes() < 2 * CHUNK_BYTES as u64 / 10,
            "{} bytes",
            r.bytes()
        );
        // Chunk 1 from one peer, chunk 4 from the other.
        assert_eq!(r.bytes_by_source.len(), 2, "{r:?}");
        assert!(r.backed_off.is_empty());
        // Holding nothing: every chunk, in full.
        let (got, r) = fetch_version(&mb, None, &sources(&[&t]), &FetchConfig::default()).unwrap();
        assert!(got == b);
        assert_eq!(r.chunks, 6);
    }

    #[test]
    fn a_lying_or_vanished_peer_is_backed_off_and_named_and_the_fetch_goes_on() {
        let (ma, a, mb, b) = versions();
        let liar = peer("liar", &[(1, &a), (2, &b)], true, false);
        let gone = peer("gone", &[], false, true);
        let honest = peer("honest", &[(1, &a), (2, &b)], false, false);
        let (got, r) = fetch_version(
            &mb,
            Some((&ma, &a)),
            // Chunk 1 is asked of the liar first (the sources in turn from its index).
            &sources(&[&gone, &liar, &honest]),
            &FetchConfig::default(),
        )
        .unwrap();
        assert!(got == b);
        let named: Vec<&str> = r.backed_off.iter().map(|(n, _)| n.as_str()).collect();
        assert!(named.contains(&"liar"), "{r:?}");
        assert!(
            r.backed_off
                .iter()
                .any(|(n, why)| n == "liar" && why.contains("sent chunk")),
            "{r:?}"
        );
        assert!(!r.bytes_by_source.contains_key("liar"));
        assert_eq!(r.bytes_by_source.keys().collect::<Vec<_>>(), vec!["honest"]);
        // Nobody honest: a clear error naming the chunk, no panic, no hang.
        let e = fetch_version(
            &mb,
            Some((&ma, &a)),
            &sources(&[&liar, &gone]),
            &FetchConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("could not be fetched"), "{e}");
        let e = fetch_version(&mb, None, &[], &FetchConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no source"), "{e}");
    }

    /// A peer whose store serves what it holds and what it is fetching.
    struct Local {
        name: String,
        store: Arc<crate::collective::broadcast::VersionStore>,
        served: AtomicUsize,
    }

    impl ChunkSource for Local {
        fn name(&self) -> String {
            self.name.clone()
        }
        fn fetch(
            &self,
            version: u64,
            index: usize,
            base: Option<(u64, [u8; 32])>,
        ) -> BoxFuture<'_, Result<Vec<u8>, Miss>> {
            let f = self.store.frame("m", version, index, base).map(|f| {
                self.served.fetch_add(1, Ordering::Relaxed);
                f.to_vec()
            });
            Box::pin(std::future::ready(f))
        }
    }

    #[test]
    fn followers_sharing_a_version_take_each_chunk_from_the_trainer_once() {
        use crate::collective::broadcast::{Held, VersionStore};
        let (ma, a, _, _) = versions();
        // Every chunk changes.
        let b: Vec<u8> = a.iter().map(|x| x ^ 1).collect();
        let layout: Vec<_> = ma
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.dtype.clone(), t.shape.clone(), t.len))
            .collect();
        let mb = Manifest::build("m", 2, "h2", &layout, &b).unwrap();
        let local = |name: &str, versions: &[(&Manifest, &Vec<u8>)]| {
            let store = Arc::new(VersionStore::new(2, 1 << 30));
            for (m, bytes) in versions {
                store.put(Held::new((*m).clone(), (*bytes).clone()));
            }
            Arc::new(Local {
                name: name.into(),
                store,
                served: AtomicUsize::new(0),
            })
        };
        let trainer = local("trainer", &[(&ma, &a), (&mb, &b)]);
        let followers: Vec<Arc<Local>> = (0..3)
            .map(|k| local(&format!("f{k}"), &[(&ma, &a)]))
            .collect();
        for f in &followers {
            f.store.begin(Arc::new(mb.clone()), f.store.latest("m"));
        }
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|me| {
                    let (followers, trainer, mb, ma, a) = (&followers, &trainer, &mb, &ma, &a);
                    s.spawn(move || {
                        // Sources: the other followers, then the trainer.
                        let others: Vec<usize> = (0..3).filter(|&k| k != me).collect();
                        let mut srcs: Vec<Arc<dyn ChunkSource>> = others
                            .iter()
                            .map(|&k| followers[k].clone() as Arc<dyn ChunkSource>)
                            .collect();
                        srcs.push(trainer.clone());
                        let cfg = FetchConfig {
                            share: Some(Share {
                                owners: (0..3)
                                    .map(|k| others.iter().position(|&o| o == k))
                                    .collect(),
                                patience: Duration::from_secs(10),
                                grace: Duration::from_secs(10),
                                member_in_flight: 2,
                            }),
                            ..FetchConfig::default()
                        };
                        let store = &followers[me].store;
                        let on = |i: usize, f: Vec<u8>, b: Option<[u8; 32]>| {
                            store.received("m", 2, i, f, b)
                        };
                        fetch_version_with(mb, Some((ma, a)), &srcs, &cfg, &on, Vec::new()).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (got, r) in &results {
            assert!(got == &b);
            assert!(r.backed_off.is_empty(), "{r:?}");
        }
        // Six chunks: the trainer sent each once, not once per follower.
        assert_eq!(trainer.served.load(Ordering::Relaxed), 6);
        let from_peers: usize = followers
            .iter()
            .map(|f| f.served.load(Ordering::Relaxed))
            .sum();
        assert_eq!(from_peers, 12);
    }
}
