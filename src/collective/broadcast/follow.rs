//! A follower's loop, without the model: it watches the gossip for the versions its
//! training group's members announce, takes a new version's manifest from a member
//! (checked against the id the member announced, or sent by the member itself on a long
//! poll, see [`super::next`]), fetches the changed chunks
//! ([`fetch_version_with`]) and hands the version to its installer (the server's swaps it
//! into the engine between two decode steps; netsim's holds it). It then holds and
//! serves the version itself.
//!
//! The followers share each version's fetch (as BitTorrent peers do): its chunks are dealt
//! round-robin to the followers in peer-id order; each takes its own share from the
//! members and serves every chunk as soon as it has it, and takes the other shares from
//! their owners, turning to the members only for the share of a follower that has not
//! started the version within [`FollowConfig::grace`] or stays silent. The members so send
//! about one copy of the changed bytes, whatever the number of followers.
//!
//! A manifest is taken only from a peer the swarm's trust lets train the model in the
//! group (certified for it, trusting a run; a key holder in a closed swarm).
//!
//! Owns: choosing the version to follow and its sources, and the retry rules.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::fetch::{fetch_async, fetch_version_with, ChunkSource, FetchConfig, FetchReport, Share};
use super::holder::Holder;
use super::manifest::Manifest;
use super::manifest::INLINE_CHUNK_BYTES;
use super::next::NextPolls;
use super::store::Held;
use super::wire::{PeerSource, WeightsNet};
use crate::base::{lock, Stop};
use crate::collective::member::hex8;
use crate::swarm::{PeerId, Role, SwarmHandle};

/// A follower's timing and parallelism (the binary's defaults).
#[derive(Debug, Clone)]
pub struct FollowConfig {
    /// How often the follower looks at the gossip for a newer version.
    pub tick: Duration,
    /// How long a follower waits, with no chunk coming from another follower, before it
    /// asks the members for the chunks of that follower's share.
    pub patience: Duration,
    /// How long a follower waits for another to start fetching a version (it heard of it
    /// later) before taking that one's share from the members. In effect at least the
    /// holder's own wait for the version ([`super::wire::WAIT`], 2 s): it answers that it
    /// has not started only after it.
    pub grace: Duration,
    /// Chunk requests in flight at once.
    pub parallel: usize,
    /// One request's bound (a chunk of 1 MiB over a slow link takes seconds).
    pub request_timeout: Duration,
    /// How long to hear the others' statuses before the first fetch (`None`: two status
    /// intervals, so a starting follower knows the other holders, not only the members).
    pub listen: Option<Duration>,
    /// The shapes of the tensors this follower can serve (`None`: any): a version of
    /// another layout (another model, another adapter shape) is refused before it is
    /// fetched.
    pub shapes: Option<Vec<Vec<i64>>>,
}

impl Default for FollowConfig {
    fn default() -> Self {
        FollowConfig {
            tick: Duration::from_millis(100),
            patience: Duration::from_secs(3),
            grace: Duration::from_secs(1),
            // Requests are small and many (a delta chunk is a few kB): enough in flight
            // to fill a link with a round trip of 100 ms or more (netsim's scenario 6,
            // 100 followers on 50-150 ms links: with 16 a follower's fetch took 8.3-9.6 s,
            // with 64 4.4-4.8 s). They are futures, not threads.
            parallel: 64,
            request_timeout: Duration::from_secs(30),
            listen: None,
            shapes: None,
        }
    }
}

/// The newest version the group announces: its number and manifest id, the members that
/// announce it (whose manifest is believed), and every peer holding it.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub version: u64,
    pub id: [u8; 32],
    pub members: Vec<PeerId>,
    pub holders: Vec<PeerId>,
}

/// What the view says of `model`'s versions in `group`.
pub fn newest(swarm: &SwarmHandle, model: &str, group: &str) -> Option<Target> {
    let view = swarm.view();
    // (version, id) -> members announcing it
    let mut announced: BTreeMap<(u64, [u8; 32]), Vec<PeerId>> = BTreeMap::new();
    let mut holders: BTreeMap<(u64, [u8; 32]), Vec<PeerId>> = BTreeMap::new();
    for e in view
        .iter()
        .filter(|e| !e.is_self && e.status.role == Role::Server)
    {
        let Some(m) = e.status.models.iter().find(|m| m.name == model) else {
            continue;
        };
        let Some(w) = m.weights.as_ref().filter(|w| w.group == group) else {
            continue;
        };
        let key = (w.version, w.manifest);
        holders.entry(key).or_default().push(e.peer);
        let member = !w.follower
            && m.group.as_ref().is_some_and(|g| g.name == group)
            && swarm.may_train_with(e, model, group);
        if member {
            announced.entry(key).or_default().push(e.peer);
        }
    }
    // The newest version; of two manifests of one version, the one more members announce.
    let ((version, id), members) = announced
        .into_iter()
        .max_by_key(|((v, _), m)| (*v, m.len()))?;
    Some(Target {
        version,
        id,
        members,
        holders: holders.remove(&(version, id)).unwrap_or_default(),
    })
}

/// The followers of `model` in `group` the view shows (they fetch its versions too).
pub fn followers_of(swarm: &SwarmHandle, model: &str, group: &str) -> Vec<PeerId> {
    swarm
        .view()
        .iter()
        .filter(|e| !e.is_self && e.status.role == Role::Server && swarm.may_sign(e, model))
        .filter(|e| {
            e.status.models.iter().any(|m| {
                m.name == model
                    && m.weights
                        .as_ref()
                        .is_some_and(|w| w.follower && w.group == group)
            })
        })
        .map(|e| e.peer)
        .collect()
}

/// Whether `m`'s tensors have the shapes `want` (the follower's model): the first
/// difference, if not.
pub fn layout_matches(m: &Manifest, want: &[Vec<i64>]) -> Result<(), String> {
    let theirs: Vec<&[i64]> = m.tensors.iter().map(|t| t.shape.as_slice()).collect();
    let first = theirs
        .iter()
        .zip(want)
        .position(|(a, b)| *a != b.as_slice());
    if theirs.len() == want.len() && first.is_none() {
        return Ok(());
    }
    // Saturating: a peer's manifest may claim any shape.
    let values = |shapes: &[&[i64]]| -> i64 {
        shapes.iter().fold(0i64, |n, s| {
            n.saturating_add(s.iter().fold(1i64, |m, &d| m.saturating_mul(d)))
        })
    };
    let mine: Vec<&[i64]> = want.iter().map(Vec::as_slice).collect();
    let mut detail = format!(
        "the group's version {} has {} tensors ({} values), this server's model {} ({} \
         values)",
        m.version,
        theirs.len(),
        values(&theirs),
        want.len(),
        values(&mine),
    );
    if let Some(i) = first {
        detail += &format!(
            "; tensor {i} is {:?} there and {:?} here",
            theirs[i], want[i]
        );
    }
    Err(format!(
        "{detail}: another model, or another adapter (a follower of a group that trains \
         one passes the members' --lora-rank, --lora-alpha and --lora-targets)"
    ))
}

/// Why a version was not followed.
#[derive(Debug)]
pub enum Failure {
    /// A transfer failed: try again.
    Again(String),
    /// The version itself cannot be served here (another layout, a wrong hash): it is
    /// not fetched again.
    Refused(String),
}

impl From<String> for Failure {
    fn from(e: String) -> Failure {
        Failure::Again(e)
    }
}

/// A version fetched and checked, for the installer.
pub struct Fetched {
    pub held: Held,
    /// Its parameter hash (hex8): computed here for a float32 snapshot, else the
    /// manifest's claim.
    pub param_hash: String,
    pub report: FetchReport,
    /// When the fetch started, and how long it took.
    pub started: Instant,
    pub fetch_s: f64,
}

/// One model's follower.
pub struct Follower {
    holder: Arc<Holder>,
    net: Arc<dyn WeightsNet>,
    cfg: FollowConfig,
    /// Every peer asked so far, with its open streams (kept from one version to the next:
    /// a new stream costs a round trip).
    sources: Mutex<HashMap<PeerId, Arc<PeerSource>>>,
    /// The long polls for the group's next version at its members.
    next: Arc<NextPolls>,
    /// A buffer of the held snapshot's size, its pages written ahead (between versions),
    /// for the next fetch to build its snapshot in (see [`fetch_async`]); `making` while
    /// a thread writes one.
    spare: Arc<Spare>,
}

/// The largest snapshot a follower writes a buffer for ahead (between versions):
/// the allocator keeps up to this much freed memory anyway (`base::alloc`'s trim
/// threshold, 1 GiB), so such a buffer holds about what the version freed before it
/// stayed resident as; a bigger one would be a snapshot's worth more memory between
/// versions.
pub const SPARE_MAX: usize = 1 << 30;

#[derive(Default)]
struct Spare {
    buffer: Mutex<Option<Vec<u8>>>,
    making: std::sync::atomic::AtomicBool,
}

impl Spare {
    /// Whether `b` can hold a snapshot of `bytes` without holding much more.
    fn fits(b: &[u8], bytes: usize) -> bool {
        (bytes..=bytes.saturating_mul(2)).contains(&b.len())
    }
}

/// Ends a follower's long polls when its loop ends.
struct ClosePolls<'a>(&'a NextPolls);

impl Drop for ClosePolls<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl Follower {
    pub fn new(holder: Arc<Holder>, net: Arc<dyn WeightsNet>, cfg: FollowConfig) -> Follower {
        Follower {
            holder,
            net,
            cfg,
            sources: Mutex::new(HashMap::new()),
            next: Arc::default(),
            spare: Arc::default(),
        }
    }

    /// `peer` as a source (the same one each time).
    fn source(&self, peer: PeerId) -> Arc<PeerSource> {
        lock(&self.sources)
            .entry(peer)
            .or_insert_with(|| {
                Arc::new(PeerSource::new(
                    self.net.clone(),
                    peer,
                    &self.holder.model,
                    self.cfg.request_timeout,
                ))
            })
            .clone()
    }

    /// Follows until `stop`: each new version is fetched and handed to `install`, which
    /// serves it (then [`Holder::install`]s it) or refuses it.
    pub async fn run<F, Fut>(&self, stop: Stop, mut install: F)
    where
        F: FnMut(Fetched) -> Fut,
        Fut: Future<Output = Result<(), Failure>>,
    {
        let h = &self.holder;
        let _close = ClosePolls(&self.next);
        // Hear every peer's status once before the first fetch: a starting follower then
        // knows the other holders of the version, not only the members.
        let listen = self.cfg.listen.unwrap_or(h.swarm().cfg.status_interval * 2);
        tokio::select! {
            _ = tokio::time::sleep(listen) => {}
            _ = stop.requested() => return,
        }
        let mut tick = tokio::time::interval(self.cfg.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0u32;
        // Whether the last failure was retried at once (the group had moved on): a second
        // failure in a row pauses whatever the group did (see below).
        let mut retried_at_once = false;
        // Versions this follower cannot serve (fetched again, they would be refused again).
        let mut refused = HashSet::new();
        // The newest version, read again from the view when it took in a status, or a
        // second later (entries age out): a hundred followers each building the whole
        // view ten times a second kept netsim's two cores busy.
        let mut known: Option<(u64, Instant, Option<Target>)> = None;
        // When the streams to the group's peers were last opened ahead of a fetch (to
        // the peers the view then showed; then, once a second at most, to the followers
        // it shows since, since a follower starts before it sees the others, and again
        // to the members, whose streams age out between versions).
        let mut warmed: Option<Instant> = None;
        // When to write the next fetch's buffer (a second after a version is held: not
        // beside the other followers' fetches of it).
        let mut spare_at = Some(Instant::now());
        loop {
            {
                // Nothing new since the last read: until news (a status taken in: a new
                // version is read at once, not at the next tick), or the tick (entries
                // age out).
                let changed = h.swarm().view_changed();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let seen = known.as_ref().map(|k| k.0);
                if seen == Some(h.swarm().view_changes()) {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = changed => {}
                        _ = self.next.came() => {}
                        _ = stop.requested() => return,
                    }
                }
            }
            // One read of the view per tick at most, however often it changes (a
            // manifest a long poll brought is taken at once, against the last read).
            let read_at = known.as_ref().map(|k| k.1 + self.cfg.tick);
            if let Some(next) = read_at.filter(|_| !self.next.pending()) {
                tokio::select! {
                    _ = tokio::time::sleep_until(next.into()) => {}
                    _ = stop.requested() => return,
                }
            }
            let changes = h.swarm().view_changes();
            let stale = known
                .as_ref()
                .is_none_or(|(c, at, _)| *c != changes || at.elapsed() >= Duration::from_secs(1));
            if stale {
                known = Some((
                    changes,
                    Instant::now(),
                    newest(h.swarm(), &h.model, &h.group),
                ));
            }
            let seen = known.as_ref().and_then(|k| k.2.clone());
            if spare_at.is_some_and(|at| at <= Instant::now()) {
                spare_at = None;
                self.make_spare();
            }
            if let Some(t) = &seen {
                let due = warmed.is_none_or(|w| stale && w.elapsed() >= Duration::from_secs(1));
                if due {
                    // The first time every peer, then the members and the new followers.
                    self.warm(t, warmed.is_some());
                    warmed = Some(Instant::now());
                }
            }
            // A long poll at each member the view shows (none once the group is gone).
            let me = h.swarm().peer_id;
            let members: Vec<PeerId> = seen
                .iter()
                .flat_map(|t| t.members.iter().copied())
                .filter(|p| *p != me)
                .collect();
            self.next
                .keep_open(&members, |p| self.source(p), &h.store, &h.model);
            let held = h.store.latest(&h.model);
            let at = held.as_ref().map(Held::version);
            // A member's manifest from a long poll, newer than what the view shows (or
            // the view's own): fetched at once, its manifest not asked again.
            // Only from a peer the view still shows a member of the group.
            let offered = self.next.take().filter(|o| {
                seen.as_ref().is_some_and(|t| t.members.contains(&o.from))
                    && at.is_none_or(|a| o.manifest.version > a)
                    && seen.as_ref().is_none_or(|t| {
                        o.manifest.version > t.version
                            || (o.manifest.version == t.version && o.id == t.id)
                    })
            });
            let (target, manifest) = match (offered, seen) {
                (Some(o), Some(t)) if t.id == o.id => (t, Some(o.manifest)),
                (Some(o), seen) => {
                    // Its sender and the other members (they hold the version soon, if
                    // not yet: a request there waits for it): the own share is spread
                    // over them, as for a version the view shows.
                    let mut members = vec![o.from];
                    let others = seen.iter().flat_map(|t| t.members.iter().copied());
                    members.extend(others.filter(|p| *p != o.from));
                    let t = Target {
                        version: o.manifest.version,
                        id: o.id,
                        holders: members.clone(),
                        members,
                    };
                    (t, Some(o.manifest))
                }
                (None, Some(t)) => (t, None),
                (None, None) => {
                    tracing::trace!(model = h.model, "following: the view shows no version");
                    continue;
                }
            };
            h.current(Some(target.version.saturating_sub(at.unwrap_or(0))));
            if held.as_ref().is_some_and(|x| x.id == target.id) || refused.contains(&target.id) {
                continue;
            }
            tracing::debug!(
                model = h.model,
                version = target.version,
                holders = target.holders.len(),
                "following: fetching"
            );
            let done = match self.fetch(&target, held, manifest).await {
                Ok(f) => install(f).await,
                Err(e) => Err(e),
            };
            if done.is_err() {
                // Its chunks are not served on (a no-op once it is held).
                h.store.abandon(&h.model, target.version);
            }
            // The fetch took the buffer, whatever its end.
            spare_at = Some(Instant::now() + Duration::from_secs(1));
            match done {
                Ok(()) => {
                    failures = 0;
                    retried_at_once = false;
                    // Ready for the next version (its streams, and the peers that came
                    // since).
                    self.warm(&target, false);
                    warmed = Some(Instant::now());
                }
                Err(Failure::Refused(why)) => {
                    tracing::warn!(
                        model = h.model,
                        version = target.version,
                        "following: not serving this version: {why}"
                    );
                    eprintln!("following: version {} not served: {why}", target.version);
                    refused.insert(target.id);
                    retried_at_once = false;
                    if h.store.latest(&h.model).is_none() {
                        h.withdraw();
                    }
                }
                Err(Failure::Again(e)) => {
                    tracing::warn!(model = h.model, version = target.version, "following: {e}");
                    // The group moved on meanwhile: the newer version is fetched at once
                    // (its members hold it), not after a pause; once, so that a follower
                    // whose fetches fail for another reason (members out of reach) does
                    // not ask again every tick while the group steps.
                    let newer = newest(h.swarm(), &h.model, &h.group)
                        .is_some_and(|t| t.version > target.version);
                    if newer && !retried_at_once {
                        retried_at_once = true;
                        continue;
                    }
                    retried_at_once = false;
                    failures += 1;
                    // Wait a little longer after each failure (at most 25 ticks).
                    let pause = self.cfg.tick * (1u32 << failures.min(5)).min(25);
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stop.requested() => return,
                    }
                }
            }
        }
    }

    /// Opens a stream ahead to every peer a fetch of `target`'s next version asks (one for
    /// chunks to each member and follower, one for manifests to each member) that has
    /// none open (a pooled stream ages out: [`super::wire::POOLED`]), or only to the
    /// members and the followers not asked before (`new_only`): the first requests of a
    /// version then cost no round trip of opening. In netsim's scenario 6, a hundred
    /// followers' first version took a second longer than the next ones without this;
    /// with it done once, when each follower first saw its group, the fetches of the
    /// first version still opened 3,288 streams, a third of them (to the followers that
    /// came into view later), and none with the later ones warmed too. The members'
    /// streams are warmed again as they age out (versions may be minutes apart). In the
    /// background; a stream that fails to open is opened again when asked.
    fn warm(&self, target: &Target, new_only: bool) {
        let me = self.holder.swarm().peer_id;
        let followers = followers_of(self.holder.swarm(), &self.holder.model, &self.holder.group);
        let peers = target.members.iter().map(|&p| (p, true));
        let peers = peers.chain(followers.into_iter().map(|p| (p, false)));
        for (p, member) in peers.filter(|(p, _)| *p != me) {
            if new_only && !member && lock(&self.sources).contains_key(&p) {
                continue;
            }
            let s = self.source(p);
            tokio::spawn(async move {
                s.warm(true).await;
                if member {
                    s.warm(false).await;
                }
            });
        }
    }

    /// Writes a buffer of the held snapshot's size for the next fetch, on a thread, unless
    /// one is there (or being written), for a snapshot of at most [`SPARE_MAX`] bytes.
    fn make_spare(&self) {
        let h = &self.holder;
        let Some(bytes) = h.store.latest(&h.model).map(|x| x.snapshot.len()) else {
            return;
        };
        if bytes > SPARE_MAX {
            return;
        }
        let spare = self.spare.clone();
        let ready = lock(&spare.buffer)
            .as_ref()
            .is_some_and(|b| Spare::fits(b, bytes));
        if ready || spare.making.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::task::spawn_blocking(move || {
            // Written, not calloc'd: calloc leaves fresh pages unfaulted.
            let mut b = Vec::with_capacity(bytes);
            b.resize(bytes, 1u8);
            *lock(&spare.buffer) = Some(b);
            spare.making.store(false, Ordering::Release);
        });
    }

    /// Fetches `target` (from `held` on) and checks it; its `manifest` is asked of the
    /// members unless given (a member sent it on a long poll).
    async fn fetch(
        &self,
        target: &Target,
        held: Option<Held>,
        mut manifest: Option<Manifest>,
    ) -> Result<Fetched, Failure> {
        let h = &self.holder;
        let source = |p: PeerId| self.source(p);
        if manifest.is_none() {
            // Asked of the members, unless a long poll brings it first (the gossip and a
            // member's answer to the poll come about together).
            let asked = async {
                let mut why = Vec::new();
                for &p in &target.members {
                    match source(p).manifest(target.version, &target.id).await {
                        Ok(m) => return Ok(m),
                        Err(e) => why.push(format!("{p}: {e}")),
                    }
                }
                Err(format!(
                    "no member gave the manifest of version {}: {}",
                    target.version,
                    why.join("; ")
                ))
            };
            let polled = async {
                loop {
                    if let Some(o) = self.next.take_id(&target.id) {
                        return o.manifest;
                    }
                    self.next.came().await;
                }
            };
            manifest = Some(tokio::select! {
                m = asked => m?,
                m = polled => m,
            });
        }
        let Some(manifest) = manifest else {
            return Err(Failure::Again("no manifest".into()));
        };
        if let Some(want) = &self.cfg.shapes {
            layout_matches(&manifest, want).map_err(Failure::Refused)?;
        }
        // The followers share the work (each takes its share of the chunks from the
        // members, the rest from each other): the members' upload bounds the broadcast.
        let me = h.swarm().peer_id;
        let mut followers = followers_of(h.swarm(), &h.model, &h.group);
        followers.retain(|p| *p != me);
        let members: Vec<PeerId> = target
            .members
            .iter()
            .copied()
            .filter(|p| target.holders.contains(p))
            .collect();
        let mut ranked: Vec<PeerId> = followers.iter().copied().chain([me]).collect();
        ranked.sort_by_key(|p| p.to_bytes());
        let cfg = FetchConfig {
            share: Some(Share {
                owners: ranked
                    .iter()
                    .map(|p| followers.iter().position(|f| f == p))
                    .collect(),
                patience: self.cfg.patience,
                grace: self.cfg.grace,
                // For single requests of the own share (a batch's failures): the members'
                // upload in flight stays about 4 x `parallel` requests whatever the number
                // of followers, a few from each (enough to cover a 300 ms round trip at
                // 100 Mbit/s with delta chunks of some 30 kB).
                member_in_flight: (4 * self.cfg.parallel).div_ceil(ranked.len()).max(2),
            }),
            parallel: self.cfg.parallel,
            ..FetchConfig::default()
        };
        let sources: Vec<Arc<dyn ChunkSource>> = followers
            .iter()
            .chain(&members)
            .map(|&p| {
                let s = source(p);
                s.limit_chunks(manifest.chunk_bytes as usize);
                s as Arc<dyn ChunkSource>
            })
            .collect();
        // Peers no longer in view are forgotten, with their streams.
        lock(&self.sources).retain(|p, _| followers.contains(p) || target.members.contains(p));
        let started = Instant::now();
        let store = h.store.clone();
        store.begin(Arc::new(manifest.clone()), held.clone());
        let need = manifest.total_bytes() as usize;
        let buffer = lock(&self.spare.buffer)
            .take()
            .filter(|b| Spare::fits(b, need))
            .unwrap_or_default();
        let fetched = if manifest.chunk_bytes as usize <= INLINE_CHUNK_BYTES {
            // Decoded on this task (see INLINE_CHUNK_BYTES).
            let have = held
                .as_ref()
                .map(|h| (h.manifest.as_ref(), h.snapshot.as_slice()));
            let (model, version) = (manifest.model.clone(), manifest.version);
            let on_chunk = |i: usize, f: Vec<u8>, b: Option<[u8; 32]>| {
                store.received(&model, version, i, f, b)
            };
            let r = fetch_async(&manifest, have, &sources, &cfg, &on_chunk, buffer).await;
            if r.is_err() {
                store.abandon(&model, version);
            }
            r.map(|(b, r)| (b, r, manifest))
        } else {
            tokio::task::spawn_blocking(move || {
                let have = held
                    .as_ref()
                    .map(|h| (h.manifest.as_ref(), h.snapshot.as_slice()));
                let model = manifest.model.clone();
                let version = manifest.version;
                let on_chunk = |i: usize, f: Vec<u8>, b: Option<[u8; 32]>| {
                    store.received(&model, version, i, f, b)
                };
                let r = fetch_version_with(&manifest, have, &sources, &cfg, &on_chunk, buffer);
                if r.is_err() {
                    store.abandon(&model, version);
                }
                r.map(|(b, r)| (b, r, manifest))
            })
            .await
            .map_err(|e| e.to_string())?
        };
        let (bytes, report, manifest) = fetched.map_err(|e| e.to_string())?;
        h.fetched.fetch_add(report.bytes(), Ordering::Relaxed);
        // A float32 snapshot is hashed as the group hashes its parameters: check the claim.
        let claimed = manifest
            .param_hash
            .get(..16)
            .unwrap_or(&manifest.param_hash)
            .to_string();
        let float32 = manifest.tensors.iter().all(|t| t.dtype == "Float");
        let param_hash = if float32 {
            let own = hex8(blake3::hash(&bytes).as_bytes());
            if own != claimed {
                return Err(Failure::Refused(format!(
                    "version {}'s parameters hash to {own}, not to the {claimed} its manifest says",
                    manifest.version
                )));
            }
            own
        } else {
            claimed
        };
        Ok(Fetched {
            held: Held::new(manifest, bytes),
            param_hash,
            report,
            fetch_s: started.elapsed().as_secs_f64(),
            started,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_of_another_layout_is_refused_with_the_first_difference() {
        let layout = vec![
            ("p0".to_string(), "Float".to_string(), vec![4, 2], 32),
            ("p1".to_string(), "Float".to_string(), vec![2, 4], 32),
        ];
        let m = Manifest::build_chunked("m", 3, "h", &layout, &[0u8; 64], 16).unwrap();
        assert!(layout_matches(&m, &[vec![4, 2], vec![2, 4]]).is_ok());
        // Another rank: the second tensor differs.
        let e = layout_matches(&m, &[vec![4, 2], vec![4, 4]]).unwrap_err();
        assert!(
            e.contains("tensor 1 is [2, 4] there and [4, 4] here"),
            "{e}"
        );
        assert!(e.contains("--lora-rank"), "{e}");
        // Fewer tensors (other targets): the counts are said.
        let e = layout_matches(&m, &[vec![4, 2]]).unwrap_err();
        assert!(
            e.contains("has 2 tensors (16 values), this server's model 1 (8 values)"),
            "{e}"
        );
    }
}
