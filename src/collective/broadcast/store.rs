//! The versions a peer holds and serves chunks of: per model, the latest few snapshots
//! (a trainer's after each step, a follower's after each fetch), with their manifests.
//! Beyond the latest `keep`, a version held for less than [`YOUNG`] stays while such
//! extra versions of the model take at most [`YOUNG_BYTES`] (and [`MAX_VERSIONS`] in all;
//! they go at the model's next version, so a group that stopped stepping leaves them): when steps
//! come faster than a loaded follower fetches (a small model or an adapter), the version
//! it is fetching is still there when it asks for its last chunks. A big model's
//! snapshots exceed the budget, and only `keep` are held.
//! A chunk asked as a delta against an older version is encoded once and kept (every
//! follower at that version asks the same frame) in a cache bounded in bytes.
//!
//! Owns: which versions are held, and the frames made of them. Not the transport.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::codec::{decode, encode};
use super::fetch::Miss;
use super::manifest::Manifest;
use crate::base::lock;

/// One held version: its manifest (and that manifest's bytes, id and layout id) and its
/// snapshot.
#[derive(Clone)]
pub struct Held {
    pub manifest: Arc<Manifest>,
    pub encoded: Arc<Vec<u8>>,
    pub id: [u8; 32],
    /// [`Manifest::layout_id`].
    pub layout: [u8; 32],
    pub snapshot: Arc<Vec<u8>>,
}

impl Held {
    pub fn new(manifest: Manifest, snapshot: Vec<u8>) -> Held {
        let encoded = manifest.encode();
        Held {
            id: *blake3::hash(&encoded).as_bytes(),
            layout: manifest.layout_id(),
            manifest: Arc::new(manifest),
            encoded: Arc::new(encoded),
            snapshot: Arc::new(snapshot),
        }
    }

    pub fn version(&self) -> u64 {
        self.manifest.version
    }
}

/// The bytes of one element of a snapshot's dtype (the XOR planes' width).
pub fn element_width(m: &Manifest) -> u8 {
    match m.tensors.first().map(|t| t.dtype.as_str()) {
        Some("BFloat16") | Some("Half") => 2,
        Some("Double") | Some("Int64") => 8,
        Some("Int8") | Some("Uint8") | Some("Bool") => 1,
        _ => 4,
    }
}

/// How long a version stays held beyond `keep` (see the module docs).
pub const YOUNG: Duration = Duration::from_secs(15);
/// The snapshot bytes of the versions held beyond `keep`, at most.
pub const YOUNG_BYTES: usize = 64 << 20;
/// Versions held per model, at most.
pub const MAX_VERSIONS: usize = 8;

type FrameKey = (String, u64, usize, Option<u64>);

/// A held version and when it was put.
struct Kept {
    held: Held,
    at: Instant,
}

/// A version being fetched: its chunks so far.
struct Partial {
    manifest: Arc<Manifest>,
    /// [`Manifest::layout_id`].
    layout: [u8; 32],
    /// The version the fetch began from, if of the same layout: the chunks kept from it,
    /// and the bases of the deltas that came.
    base: Option<Held>,
    chunks: Vec<OnceLock<Part>>,
    /// Per chunk: wakes the requests waiting for it (see [`VersionStore::wait_chunk`]).
    arrived: Vec<tokio::sync::Notify>,
}

impl Partial {
    /// Wakes every waiting request (the fetch ended).
    fn wake_all(&self) {
        self.arrived
            .iter()
            .for_each(tokio::sync::Notify::notify_waiters);
    }
}

/// A chunk of a version being fetched, once in.
#[derive(Clone)]
enum Part {
    /// Unchanged since the version the fetch began from ([`Partial::base`]).
    Kept,
    /// The frame the fetcher took and checked: a delta against the chunk of hash `base`
    /// (that of [`Partial::base`]), or whole (`None`). Served as it is to a peer holding
    /// that chunk, or to one holding none for a whole frame (what its sender made for
    /// it): not decoded again, nor encoded.
    Frame {
        frame: Arc<Vec<u8>>,
        base: Option<[u8; 32]>,
    },
}

/// Where a served chunk's bytes are.
enum Chunk {
    Held(Held),
    /// A chunk of a version being fetched.
    Part(Arc<Partial>, Part),
}

impl Chunk {
    /// Chunk `index`'s bytes (at `r` in the snapshot).
    fn bytes(&self, index: usize, r: std::ops::Range<usize>) -> Result<Cow<'_, [u8]>, Miss> {
        let gone = || Miss::Failed("the version this chunk was fetched against is gone".into());
        match self {
            Chunk::Held(h) => Ok(Cow::Borrowed(&h.snapshot[r])),
            Chunk::Part(p, Part::Kept) => match &p.base {
                Some(b) => Ok(Cow::Borrowed(&b.snapshot[r])),
                None => Err(gone()),
            },
            Chunk::Part(p, Part::Frame { frame, base }) => {
                let on = match base {
                    Some(hash) => match p.base.as_ref() {
                        Some(b) if b.manifest.chunks.get(index) == Some(hash) => {
                            Some(&b.snapshot[r.clone()])
                        }
                        _ => return Err(gone()),
                    },
                    None => None,
                };
                decode(frame, on, r.len(), &p.manifest.chunks[index])
                    .map(Cow::Owned)
                    .map_err(|e| Miss::Failed(format!("chunk {index} kept here: {e}")))
            }
        }
    }
}

#[derive(Default)]
struct Frames {
    /// A frame, or the cell one thread fills while the others asking for it wait (each
    /// frame is encoded once).
    map: HashMap<FrameKey, Arc<OnceLock<Arc<Vec<u8>>>>>,
    order: VecDeque<FrameKey>,
    bytes: usize,
}

/// Every model's held versions (at most `keep` each) and the frames made of them.
pub struct VersionStore {
    keep: usize,
    /// How long a version stays held beyond `keep` ([`YOUNG`]; see the module docs).
    young: Duration,
    models: Mutex<HashMap<String, VecDeque<Kept>>>,
    /// Per model, the version being fetched.
    partial: Mutex<HashMap<String, Arc<Partial>>>,
    frames: Mutex<Frames>,
    frame_budget: usize,
    /// Frame bytes served to other peers.
    pub served_bytes: AtomicU64,
    /// Wakes the requests waiting for a version to be started.
    began: tokio::sync::Notify,
    /// Wakes the requests waiting for a newer version to be held ([`VersionStore::newer`]).
    held_new: tokio::sync::Notify,
    /// Tests only: serve every chunk with one byte changed (a lying peer).
    pub tamper: AtomicBool,
}

impl VersionStore {
    /// A store keeping the latest `keep` versions of each model (at least 1; 2 lets a
    /// follower one version behind fetch deltas) and up to `frame_budget` bytes of frames.
    pub fn new(keep: usize, frame_budget: usize) -> VersionStore {
        VersionStore {
            keep: keep.max(1),
            young: YOUNG,
            models: Mutex::new(HashMap::new()),
            partial: Mutex::new(HashMap::new()),
            frames: Mutex::new(Frames::default()),
            frame_budget,
            served_bytes: AtomicU64::new(0),
            began: tokio::sync::Notify::new(),
            held_new: tokio::sync::Notify::new(),
            tamper: AtomicBool::new(false),
        }
    }

    /// The same store, holding a version beyond `keep` for `young` at most (zero: the
    /// latest `keep` alone; netsim's hundred followers share one process's memory).
    pub fn with_young(mut self, young: Duration) -> VersionStore {
        self.young = young;
        self
    }

    /// Holds `held` as its model's latest version (replacing a held one of the same
    /// version); the oldest beyond `keep` go, with their frames, unless young (see the
    /// module docs).
    pub fn put(&self, held: Held) {
        let model = held.manifest.model.clone();
        let version = held.version();
        let dropped: Vec<u64> = {
            let mut models = lock(&self.models);
            let list = models.entry(model.clone()).or_default();
            list.retain(|k| k.held.version() != version);
            list.push_back(Kept {
                held,
                at: Instant::now(),
            });
            list.make_contiguous().sort_by_key(|k| k.held.version());
            let mut gone = Vec::new();
            while list.len() > self.keep {
                let extra = list.len() - self.keep;
                let extra_bytes: usize =
                    list.iter().take(extra).map(|k| k.held.snapshot.len()).sum();
                // The oldest is the first: if it is young, so are the others.
                let young = list.front().is_some_and(|k| k.at.elapsed() < self.young);
                if young && list.len() <= MAX_VERSIONS && extra_bytes <= YOUNG_BYTES {
                    break;
                }
                if let Some(k) = list.pop_front() {
                    gone.push(k.held.version());
                }
            }
            gone.push(version);
            gone
        };
        // After it is held: an asker never finds it neither held nor being fetched.
        self.abandon(&model, version);
        self.held_new.notify_waiters();
        // Requests waiting for this version to start (see `wait_chunk`) take it now.
        self.began.notify_waiters();
        let mut f = lock(&self.frames);
        let Frames { map, order, bytes } = &mut *f;
        let stale = |k: &FrameKey| {
            k.0 == model && (dropped.contains(&k.1) || k.3.is_some_and(|b| dropped.contains(&b)))
        };
        order.retain(|k| {
            if stale(k) {
                if let Some(v) = map.remove(k).and_then(|c| c.get().map(|f| f.len())) {
                    *bytes -= v;
                }
            }
            !stale(k)
        });
        map.retain(|k, _| !stale(k));
    }

    /// The latest version of `model` held.
    pub fn latest(&self, model: &str) -> Option<Held> {
        lock(&self.models)
            .get(model)?
            .back()
            .map(|k| k.held.clone())
    }

    /// Whether the chunks of `model`'s `version` (held or being fetched) are small
    /// enough to encode on an async thread (see [`super::manifest::INLINE_CHUNK_BYTES`]).
    pub fn small_chunks(&self, model: &str, version: u64) -> bool {
        let bytes = match self.get(model, version) {
            Some(h) => Some(h.manifest.chunk_bytes),
            None => lock(&self.partial)
                .get(model)
                .filter(|p| p.manifest.version == version)
                .map(|p| p.manifest.chunk_bytes),
        };
        bytes.is_some_and(|b| b as usize <= super::manifest::INLINE_CHUNK_BYTES)
    }

    /// Version `version` of `model`, if held.
    pub fn get(&self, model: &str, version: u64) -> Option<Held> {
        lock(&self.models)
            .get(model)?
            .iter()
            .find(|k| k.held.version() == version)
            .map(|k| k.held.clone())
    }

    /// Starts fetching `manifest`'s version from `base` (the version the fetch decodes
    /// its deltas against, if any): its chunks are served as they arrive
    /// ([`VersionStore::received`]) until [`VersionStore::put`] or
    /// [`VersionStore::abandon`].
    pub fn begin(&self, manifest: Arc<Manifest>, base: Option<Held>) {
        let chunks: Vec<OnceLock<Part>> = (0..manifest.chunks.len())
            .map(|_| OnceLock::new())
            .collect();
        // The chunks it keeps from the version it holds are in from the start.
        let base = base.filter(|held| held.manifest.changed_since(&manifest).is_ok());
        if let Some(held) = &base {
            for (i, c) in chunks.iter().enumerate() {
                if held.manifest.chunks[i] == manifest.chunks[i] {
                    let _ = c.set(Part::Kept);
                }
            }
        }
        let arrived = chunks.iter().map(|_| tokio::sync::Notify::new()).collect();
        let old = lock(&self.partial).insert(
            manifest.model.clone(),
            Arc::new(Partial {
                layout: manifest.layout_id(),
                manifest,
                base,
                chunks,
                arrived,
            }),
        );
        old.iter().for_each(|p| p.wake_all());
        self.began.notify_waiters();
    }

    /// Waits at most `wait` for chunk `index` of `model`'s `version` while this store is
    /// fetching that version and the chunk is not in, or the version is newer than any
    /// held or fetched (this peer may start it any moment): a request for it is answered
    /// the moment it arrives (a long poll: no round trips of asking again).
    pub async fn wait_chunk(&self, model: &str, version: u64, index: usize, wait: Duration) {
        let deadline = tokio::time::Instant::now() + wait;
        let p = loop {
            let began = self.began.notified();
            tokio::pin!(began);
            began.as_mut().enable();
            let p = lock(&self.partial).get(model).cloned();
            match p.filter(|p| p.manifest.version == version) {
                Some(p) => break p,
                None if self.latest(model).is_none_or(|h| h.version() < version) => {
                    if tokio::time::timeout_at(deadline, began).await.is_err() {
                        return;
                    }
                }
                None => return,
            }
        };
        let (Some(cell), Some(n)) = (p.chunks.get(index), p.arrived.get(index)) else {
            return;
        };
        let notified = n.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if cell.get().is_none() && self.fetching(model, version) {
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// The newest version of `model` held, once one newer than `after` (any, with `None`)
    /// is: waits at most `wait` for it (a follower's long poll for its group's next
    /// version, see [`super::wire::Request::Next`]).
    pub async fn newer(&self, model: &str, after: Option<u64>, wait: Duration) -> Option<Held> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let held = self.held_new.notified();
            tokio::pin!(held);
            held.as_mut().enable();
            let newest = self.latest(model);
            if let Some(h) = newest.filter(|h| after.is_none_or(|a| h.version() > a)) {
                return Some(h);
            }
            if tokio::time::timeout_at(deadline, held).await.is_err() {
                return None;
            }
        }
    }

    /// Whether `model`'s `version` is the one being fetched.
    fn fetching(&self, model: &str, version: u64) -> bool {
        lock(&self.partial)
            .get(model)
            .is_some_and(|p| p.manifest.version == version)
    }

    /// Chunk `index` of the version being fetched arrived (checked) as `frame`: a delta
    /// against the chunk of hash `base` (the version the fetch began from has it), or
    /// whole (`None`).
    pub fn received(
        &self,
        model: &str,
        version: u64,
        index: usize,
        frame: Vec<u8>,
        base: Option<[u8; 32]>,
    ) {
        let p = lock(&self.partial).get(model).cloned();
        if let Some(p) = p.filter(|p| p.manifest.version == version) {
            if let Some(c) = p.chunks.get(index) {
                let frame = Arc::new(frame);
                let _ = c.set(Part::Frame { frame, base });
                p.arrived[index].notify_waiters();
            }
        }
    }

    /// The fetch of `model`'s `version` ended without it.
    pub fn abandon(&self, model: &str, version: u64) {
        let gone = {
            let mut p = lock(&self.partial);
            match p.get(model).is_some_and(|p| p.manifest.version == version) {
                true => p.remove(model),
                false => None,
            }
        };
        gone.iter().for_each(|p| p.wake_all());
    }

    /// The frame of chunk `index` of `model`'s `version` (held, or being fetched and
    /// that chunk in): a delta against version `base` when it is held with the same
    /// layout, else the chunk on its own. A chunk of the version being fetched goes as
    /// the frame it came in when `base`'s chunk is the one that frame needs (or neither
    /// has one), else decoded here and encoded as above. A chunk of the version being
    /// fetched that is not in yet is [`Miss::NotYet`]; a version newer than any held or
    /// fetched, [`Miss::NotStarted`]; a chunk whose frame needs a base this peer no
    /// longer holds, [`Miss::Failed`].
    pub fn frame(
        &self,
        model: &str,
        version: u64,
        index: usize,
        base: Option<(u64, [u8; 32])>,
    ) -> Result<Arc<Vec<u8>>, Miss> {
        let (manifest, layout, chunk) = match self.get(model, version) {
            Some(h) => (h.manifest.clone(), h.layout, Chunk::Held(h)),
            None => {
                let p = lock(&self.partial).get(model).cloned();
                match p.filter(|p| p.manifest.version == version) {
                    Some(p) => match p.chunks.get(index).and_then(|c| c.get()).cloned() {
                        Some(c) => (p.manifest.clone(), p.layout, Chunk::Part(p, c)),
                        None if index < p.chunks.len() => return Err(Miss::NotYet),
                        None => return Err(Miss::Failed(format!("no chunk {index}"))),
                    },
                    None if self.latest(model).is_none_or(|h| h.version() < version) => {
                        return Err(Miss::NotStarted)
                    }
                    None => {
                        return Err(Miss::Failed(format!(
                            "version {version} of {model:?} is not held here"
                        )))
                    }
                }
            }
        };
        if index >= manifest.chunks.len() {
            return Err(Miss::Failed(format!(
                "chunk {index} of a version with {} chunks",
                manifest.chunks.len()
            )));
        }
        let r = manifest.chunk_range(index);
        let tamper = self.tamper.load(Ordering::Relaxed);
        // A frame as it came, to a peer holding the chunk it is a delta against.
        if let Chunk::Part(
            _,
            Part::Frame {
                frame,
                base: against,
            },
        ) = &chunk
        {
            if !tamper && base.map(|(_, hash)| hash) == *against {
                self.served_bytes
                    .fetch_add(frame.len() as u64, Ordering::Relaxed);
                return Ok(frame.clone());
            }
        }
        let width = element_width(&manifest);
        // Against the asker's chunk only if this peer holds the same bytes under that
        // version (numbers may repeat after a restart).
        let base = base
            .and_then(|(b, hash)| {
                self.get(model, b)
                    .filter(|h| h.manifest.chunks.get(index) == Some(&hash))
            })
            .filter(|b| b.layout == layout);
        let key: FrameKey = (
            model.to_string(),
            version,
            index,
            base.as_ref().map(Held::version),
        );
        // Made before: a chunk kept as its frame is not decoded again for it.
        if let Some(frame) = self.made(&key).filter(|_| !tamper) {
            self.served_bytes
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            return Ok(frame);
        }
        let bytes = chunk.bytes(index, r.clone())?;
        let bytes = bytes.as_ref();
        if tamper {
            // A well-formed frame of the chunk with one byte changed: only its hash
            // tells.
            let mut bad = bytes.to_vec();
            if let Some(b) = bad.first_mut() {
                *b ^= 0x5a;
            }
            return Ok(Arc::new(encode(&bad, None, width)));
        }
        let frame = self.cached(key, || {
            encode(bytes, base.as_ref().map(|b| &b.snapshot[r]), width)
        });
        self.served_bytes
            .fetch_add(frame.len() as u64, Ordering::Relaxed);
        Ok(frame)
    }

    /// Encodes now, on every core, each chunk of `model`'s `version` that changed since
    /// the version held before it, as the delta against it (what a follower that holds
    /// that one asks for): the frames wait in the cache. Returns how many.
    pub fn prepare_deltas(&self, model: &str, version: u64) -> usize {
        let (Some(new), Some(old)) = (self.get(model, version), {
            let models = lock(&self.models);
            models.get(model).and_then(|l| {
                l.iter()
                    .rev()
                    .find(|k| k.held.version() < version)
                    .map(|k| k.held.clone())
            })
        }) else {
            return 0;
        };
        let Ok(changed) = new.manifest.changed_since(&old.manifest) else {
            return 0;
        };
        let width = element_width(&new.manifest);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads.min(changed.len()) {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = changed.get(k) else { return };
                    let r = new.manifest.chunk_range(i);
                    let key = (model.to_string(), version, i, Some(old.version()));
                    self.cached(key, || {
                        encode(&new.snapshot[r.clone()], Some(&old.snapshot[r]), width)
                    });
                });
            }
        });
        changed.len()
    }

    /// The frame of `key` if it is made and cached.
    fn made(&self, key: &FrameKey) -> Option<Arc<Vec<u8>>> {
        let cell = lock(&self.frames).map.get(key).cloned()?;
        cell.get().cloned()
    }

    /// The frame of `key`, made by `make` once: a thread asking while another makes it
    /// waits for that one. Kept within the byte budget, oldest out first.
    fn cached(&self, key: FrameKey, make: impl FnOnce() -> Vec<u8>) -> Arc<Vec<u8>> {
        let cell = lock(&self.frames)
            .map
            .entry(key.clone())
            .or_insert_with(|| Arc::new(OnceLock::new()))
            .clone();
        let mut made = false;
        let frame = cell
            .get_or_init(|| {
                made = true;
                Arc::new(make())
            })
            .clone();
        if made {
            let mut f = lock(&self.frames);
            let Frames { map, order, bytes } = &mut *f;
            if frame.len() > self.frame_budget {
                map.remove(&key);
                return frame;
            }
            while *bytes + frame.len() > self.frame_budget {
                let Some(k) = order.pop_front() else { break };
                if let Some(v) = map.remove(&k).and_then(|c| c.get().map(|f| f.len())) {
                    *bytes -= v;
                }
            }
            // Still wanted (a newer version may have dropped it meanwhile).
            if map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                *bytes += frame.len();
                order.push_back(key);
            }
        }
        frame
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::broadcast::decode;

    fn version(v: u64, fill: u8) -> Held {
        let bytes: Vec<u8> = (0..40u32).map(|i| (i as u8).wrapping_mul(fill)).collect();
        let layout = vec![("w".to_string(), "Float".to_string(), vec![10], 40)];
        Held::new(
            Manifest::build_chunked("m", v, "h", &layout, &bytes, 16).unwrap(),
            bytes,
        )
    }

    #[test]
    fn keeps_the_latest_versions_and_serves_deltas_that_decode() {
        let s = VersionStore::new(2, 1 << 20).with_young(Duration::ZERO);
        s.put(version(1, 3));
        s.put(version(2, 5));
        s.put(version(3, 7));
        assert!(s.get("m", 1).is_none(), "only the latest 2 are kept");
        assert_eq!(s.latest("m").unwrap().version(), 3);
        let (old, new) = (s.get("m", 2).unwrap(), s.get("m", 3).unwrap());
        for i in 0..new.manifest.chunks.len() {
            let r = new.manifest.chunk_range(i);
            let f = s
                .frame("m", 3, i, Some((2, old.manifest.chunks[i])))
                .unwrap();
            let got = decode(
                &f,
                Some(&old.snapshot[r.clone()]),
                r.len(),
                &new.manifest.chunks[i],
            );
            assert_eq!(got.unwrap(), new.snapshot[r.clone()].to_vec());
            // Against a version no longer held: the chunk on its own.
            let f = s.frame("m", 3, i, Some((1, [0; 32]))).unwrap();
            assert_eq!(
                decode(&f, None, r.len(), &new.manifest.chunks[i]).unwrap(),
                new.snapshot[r].to_vec()
            );
        }
        assert!(matches!(s.frame("m", 1, 0, None), Err(Miss::Failed(e)) if e.contains("not held")));
        assert!(
            matches!(s.frame("m", 3, 99, None), Err(Miss::Failed(e)) if e.contains("chunk 99"))
        );
        // A newer version: not yet (this peer will fetch it).
        assert_eq!(s.frame("m", 4, 0, None), Err(Miss::NotStarted));
        assert!(s.served_bytes.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn young_versions_stay_beyond_keep_within_the_budget_and_the_count() {
        // Small snapshots put in a burst: all stay, up to MAX_VERSIONS.
        let s = VersionStore::new(2, 1 << 20);
        for v in 1..=10 {
            s.put(version(v, v as u8));
        }
        let held: Vec<u64> = (1..=10).filter(|&v| s.get("m", v).is_some()).collect();
        assert_eq!(held, (3..=10).collect::<Vec<_>>());
        // Once they are older than `young`, the next put leaves the latest `keep`.
        let s = VersionStore::new(2, 1 << 20).with_young(Duration::from_secs(1));
        for v in 1..=4 {
            s.put(version(v, v as u8));
        }
        assert!(
            s.get("m", 1).is_some(),
            "a young version is held beyond keep"
        );
        std::thread::sleep(Duration::from_millis(1100));
        s.put(version(5, 5));
        let held: Vec<u64> = (1..=5).filter(|&v| s.get("m", v).is_some()).collect();
        assert_eq!(held, vec![4, 5]);
        // Snapshots bigger than the budget: only `keep`, however young.
        let big = |v: u64| {
            let bytes = vec![v as u8; YOUNG_BYTES / 2 + 8];
            let layout = vec![(
                "w".to_string(),
                "Uint8".to_string(),
                vec![bytes.len() as i64],
                bytes.len() as u64,
            )];
            Held::new(
                Manifest::build("m", v, "h", &layout, &bytes).unwrap(),
                bytes,
            )
        };
        let s = VersionStore::new(1, 1 << 20);
        for v in 1..=3 {
            s.put(big(v));
        }
        // (One extra of half the budget fits, a second does not.)
        let held: Vec<u64> = (1..=3).filter(|&v| s.get("m", v).is_some()).collect();
        assert_eq!(held, vec![2, 3]);
    }

    #[tokio::test]
    async fn a_long_poll_gets_the_next_version_once_it_is_held_and_nothing_before() {
        let s = Arc::new(VersionStore::new(2, 1 << 20));
        let short = Duration::from_millis(50);
        // Nothing held: `None` takes any version; past 1, or of another model, nothing
        // comes within the wait.
        assert!(s.newer("m", None, short).await.is_none());
        s.put(version(1, 3));
        assert_eq!(
            s.newer("m", None, Duration::ZERO).await.unwrap().version(),
            1
        );
        assert!(s.newer("m", Some(1), short).await.is_none());
        assert!(s.newer("other", None, short).await.is_none());
        // A poll waiting past version 1 (for up to 60 s) is answered when version 2 is
        // held, not at the end of its wait.
        let poll = {
            let s = s.clone();
            tokio::spawn(async move { s.newer("m", Some(1), Duration::from_secs(60)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!poll.is_finished(), "nothing newer is held yet");
        s.put(version(2, 5));
        let got = tokio::time::timeout(Duration::from_secs(30), poll)
            .await
            .expect("woken by the put")
            .unwrap();
        assert_eq!(got.unwrap().version(), 2);
    }

    #[test]
    fn a_tampering_store_serves_chunks_that_fail_their_hash() {
        let s = VersionStore::new(2, 1 << 20);
        s.put(version(1, 3));
        s.tamper.store(true, Ordering::Relaxed);
        let h = s.get("m", 1).unwrap();
        let f = s.frame("m", 1, 0, None).unwrap();
        let r = h.manifest.chunk_range(0);
        assert_eq!(
            decode(&f, None, r.len(), &h.manifest.chunks[0]),
            Err(crate::collective::broadcast::CodecError::HashMismatch)
        );
    }

    #[test]
    fn a_version_being_fetched_serves_the_chunks_already_in() {
        let s = VersionStore::new(2, 1 << 20);
        s.put(version(1, 3));
        let next = version(2, 5);
        s.begin(next.manifest.clone(), s.latest("m"));
        let base = |i: usize| Some((1, s.get("m", 1).unwrap().manifest.chunks[i]));
        assert_eq!(s.frame("m", 2, 1, base(1)), Err(Miss::NotYet));
        let r = next.manifest.chunk_range(1);
        s.received("m", 2, 1, encode(&next.snapshot[r.clone()], None, 1), None);
        let f = s.frame("m", 2, 1, base(1)).unwrap();
        let old = s.get("m", 1).unwrap();
        let got = decode(
            &f,
            Some(&old.snapshot[r.clone()]),
            r.len(),
            &next.manifest.chunks[1],
        );
        assert_eq!(got.unwrap(), next.snapshot[r].to_vec());
        // A delta that came against the held chunk goes as it came to a peer that holds
        // that chunk too; to one without it, decoded here and sent whole.
        let r2 = next.manifest.chunk_range(2);
        // (A delta frame made by hand: a chunk this small goes raw from `encode`.)
        let xor: Vec<u8> = next.snapshot[r2.clone()]
            .iter()
            .zip(&old.snapshot[r2.clone()])
            .map(|(a, b)| a ^ b)
            .collect();
        let mut delta = vec![crate::collective::broadcast::Encoding::XorZstd as u8, 4];
        delta.extend(zstd::bulk::compress(&xor, 3).unwrap());
        let (old2, want2) = (&old.snapshot[r2.clone()], &next.manifest.chunks[2]);
        assert!(decode(&delta, Some(old2), r2.len(), want2).is_ok());
        assert!(decode(&delta, None, r2.len(), want2).is_err());
        s.received("m", 2, 2, delta.clone(), Some(old.manifest.chunks[2]));
        assert_eq!(*s.frame("m", 2, 2, base(2)).unwrap(), delta);
        let whole = s.frame("m", 2, 2, None).unwrap();
        assert_eq!(
            decode(&whole, None, r2.len(), &next.manifest.chunks[2]).unwrap(),
            next.snapshot[r2].to_vec()
        );
        assert_eq!(s.frame("m", 2, 0, base(0)), Err(Miss::NotYet));
        // A whole frame goes as it came to a peer without a base, and as a delta
        // against the held chunk to one that holds it (no base needed to decode it here).
        let r0 = next.manifest.chunk_range(0);
        let whole0 = encode(&next.snapshot[r0.clone()], None, 4);
        s.received("m", 2, 0, whole0.clone(), None);
        assert_eq!(*s.frame("m", 2, 0, None).unwrap(), whole0);
        let f0 = s.frame("m", 2, 0, base(0)).unwrap();
        assert_eq!(
            decode(
                &f0,
                Some(&old.snapshot[r0.clone()]),
                r0.len(),
                &next.manifest.chunks[0]
            )
            .unwrap(),
            next.snapshot[r0].to_vec()
        );
        s.put(next);
        assert!(s.frame("m", 2, 0, base(0)).is_ok());
    }

    /// A request for a chunk not in yet waits for it (a long poll), and is let go when
    /// the chunk arrives or the fetch ends, not at the end of its wait; one for a version
    /// not started yet waits for its start too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wait_for_a_chunk_ends_when_it_arrives_or_the_fetch_ends() {
        let s = Arc::new(VersionStore::new(2, 1 << 20));
        s.put(version(1, 3));
        let next = version(2, 5);
        s.begin(next.manifest.clone(), s.latest("m"));
        let long = Duration::from_secs(600);
        let waiting = |i: usize| {
            let s = s.clone();
            tokio::spawn(async move { s.wait_chunk("m", 2, i, long).await })
        };
        let (w1, w0) = (waiting(1), waiting(0));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!w1.is_finished() && !w0.is_finished());
        s.received(
            "m",
            2,
            1,
            encode(&next.snapshot[next.manifest.chunk_range(1)], None, 1),
            None,
        );
        tokio::time::timeout(Duration::from_secs(60), w1)
            .await
            .expect("the wait ends when its chunk arrives")
            .unwrap();
        assert!(!w0.is_finished(), "another chunk's wait goes on");
        s.abandon("m", 2);
        tokio::time::timeout(Duration::from_secs(60), w0)
            .await
            .expect("the wait ends with the fetch")
            .unwrap();
        assert_eq!(s.frame("m", 2, 0, None), Err(Miss::NotStarted));
        // A version this peer has not started (it heard of it later than the asker): the
        // wait goes on through its start to the chunk's arrival.
        let w = waiting(0);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!w.is_finished());
        s.begin(next.manifest.clone(), s.latest("m"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!w.is_finished(), "begun, but chunk 0 is not in");
        s.received(
            "m",
            2,
            0,
            encode(&next.snapshot[next.manifest.chunk_range(0)], None, 1),
            None,
        );
        tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("the wait ends when its chunk arrives")
            .unwrap();
        // Nothing to wait for (a version held, or older): at once.
        s.put(next);
        for v in [1, 2] {
            tokio::time::timeout(Duration::from_secs(60), s.wait_chunk("m", v, 0, long))
                .await
                .unwrap();
        }
    }
}
