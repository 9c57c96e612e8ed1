//! The swarm as the facade's backend: chat rendering and tokenisation happen in the
//! client's proxy (with the model card fetched from any provider), generation on a server
//! found through the DHT or the swarm's view.
//!
//! Routing: each model's providers come from the DHT (re-queried every couple of seconds)
//! and from the view (every server whose gossiped status serves the model and is not
//! stopping).
//! An episode's calls repeat each other's context, so they go where its first call ran
//! while that server is healthy (its prefix cache holds the context), and the episodes of
//! one group (one task prompt) go to the server their group started on while its gossiped
//! load leaves room. Other calls go to the provider with the best score (measured time to
//! first token, scaled by the load and queue depth it gossips, a little better for a
//! higher prefix-cache hit rate). A provider that fails is backed off (exponentially, up
//! to 30 s) and loses its episodes and groups to the server that takes over. A call that fails before any token is re-issued to another
//! provider; one that fails mid-call continues on another provider from the tokens already
//! streamed (prompt + those tokens), which is safe because a server holds no per-episode
//! state. The tokens before the fail-over stay signed by the first server and the rest by
//! the second, as two calls the trainer merges back into one timeline.
//!
//! Owns: routing calls and fetching cards. Never touches LibTorch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::{info, warn};

use super::error::ClientError;
use crate::base::lock;
use crate::base::prom::Prom;
use crate::base::stop::{Stop, TaskTracker};
use crate::engine::{EngineError, EngineEvent, GenerateRequest};
use crate::facade::{Backend, ChoiceEvent, ChoiceStream, Route, SignedPart};
use crate::model::{ModelCard, ModelError};
use crate::rpc::{CardBlob, CardReply, CardRequest, InferFrame, InferRequest, CARD, INFER};
use crate::swarm::frame::{read_frame, write_frame, FrameError};
use crate::swarm::{PeerId, Role, SwarmError, SwarmHandle};

/// Why a model card could not be had from a provider.
#[derive(Debug, thiserror::Error)]
pub enum CardError {
    #[error(transparent)]
    Swarm(#[from] SwarmError),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("{peer}: {reason}")]
    Unknown { peer: PeerId, reason: String },
    #[error("{0} sent a model card that does not match its hash")]
    HashMismatch(PeerId),
    #[error("malformed model card: {0}")]
    Malformed(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Calls re-issued at most (per call) before the call fails.
const MAX_ATTEMPTS: usize = 4;
/// A server silent this long in the middle of a call is taken as dead.
const FRAME_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Default, Clone)]
struct PeerScore {
    /// Exponentially weighted time to first token, ms.
    ttft_ms: Option<f64>,
    failures: u32,
    backoff_until: Option<Instant>,
}

/// Episodes remembered at most for routing (a proxy used without an episode runner may
/// see any number of bearer tokens; past this the oldest are forgotten).
const MAX_ROUTED_EPISODES: usize = 65_536;

/// Where calls that belong together last ran.
#[derive(Default)]
struct Affinity {
    /// Episode -> the server of its last call.
    episode_server: HashMap<String, PeerId>,
    /// Episode ids in the order first seen (to forget the oldest).
    order: std::collections::VecDeque<String>,
    /// Episode -> its group (registered by the episode runner).
    group_of: HashMap<String, String>,
    /// Group -> the server its episodes go to, and how many registered episodes it has.
    group_server: HashMap<String, PeerId>,
    group_size: HashMap<String, usize>,
}

/// What the swarm's gossip says of a provider, for routing.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerLoad {
    /// Running / max batch, plus queue depth.
    pub load: f64,
    /// Its prefix cache's hit rate (0..1).
    pub hit_rate: f64,
}

/// Per-model providers, per-peer scores, and where episodes and groups run.
#[derive(Default)]
pub struct Router {
    providers: Mutex<HashMap<String, Vec<PeerId>>>,
    scores: Mutex<HashMap<PeerId, PeerScore>>,
    affinity: Mutex<Affinity>,
}

impl Router {
    pub fn set_providers(&self, model: &str, mut peers: Vec<PeerId>) {
        peers.sort_by_key(|p| p.to_string());
        let old = lock(&self.providers).insert(model.to_string(), peers.clone());
        if old.as_ref() != Some(&peers) {
            let list: Vec<String> = peers.iter().map(|p| p.to_string()).collect();
            info!(model, providers = ?list, "providers of the model (the DHT's and the view's)");
        }
    }

    pub fn providers(&self, model: &str) -> Vec<PeerId> {
        lock(&self.providers)
            .get(model)
            .cloned()
            .unwrap_or_default()
    }

    fn failed(&self, peer: PeerId) {
        let mut s = lock(&self.scores);
        let e = s.entry(peer).or_default();
        e.failures += 1;
        let secs = (1u64 << e.failures.min(5)).min(30);
        e.backoff_until = Some(Instant::now() + Duration::from_secs(secs));
    }

    fn succeeded(&self, peer: PeerId, ttft: Duration) {
        let mut s = lock(&self.scores);
        let e = s.entry(peer).or_default();
        e.failures = 0;
        e.backoff_until = None;
        let ms = ttft.as_secs_f64() * 1e3;
        e.ttft_ms = Some(e.ttft_ms.map_or(ms, |old| 0.8 * old + 0.2 * ms));
    }

    /// Episode `episode` belongs to group `group` (its calls may go where the group's do).
    pub fn register_episode(&self, episode: &str, group: &str) {
        let mut a = lock(&self.affinity);
        if a.group_of.insert(episode.into(), group.into()).is_none() {
            *a.group_size.entry(group.into()).or_default() += 1;
        }
    }

    /// The episode is over: forget where it ran (and its group, after its last episode).
    pub fn forget_episode(&self, episode: &str) {
        let mut a = lock(&self.affinity);
        a.episode_server.remove(episode);
        if let Some(g) = a.group_of.remove(episode) {
            let left = a.group_size.get_mut(&g).map(|n| {
                *n -= 1;
                *n
            });
            if left == Some(0) {
                a.group_size.remove(&g);
                a.group_server.remove(&g);
            }
        }
    }

    /// The server the episode's calls go to now, if it has one.
    pub fn server_of(&self, episode: &str) -> Option<PeerId> {
        lock(&self.affinity).episode_server.get(episode).copied()
    }

    /// A call of `route` ran on `peer`: its episode's next calls (and its group's new
    /// episodes, when the group has no server yet or lost it) go there too.
    fn bind(&self, route: &Route, peer: PeerId) {
        let Some(ep) = &route.episode else {
            return;
        };
        let mut a = lock(&self.affinity);
        if a.episode_server.insert(ep.clone(), peer).is_none() {
            a.order.push_back(ep.clone());
            while a.order.len() > MAX_ROUTED_EPISODES {
                if let Some(old) = a.order.pop_front() {
                    a.episode_server.remove(&old);
                }
            }
        }
        if let Some(g) = a.group_of.get(ep).cloned() {
            let moved = a.group_server.get(&g).is_none_or(|&s| self.backed_off(s));
            if moved {
                a.group_server.insert(g, peer);
            }
        }
    }

    fn backed_off(&self, peer: PeerId) -> bool {
        lock(&self.scores)
            .get(&peer)
            .and_then(|s| s.backoff_until)
            .is_some_and(|t| t > Instant::now())
    }

    /// Where a call of `route` should go: its episode's server while that is healthy, else
    /// its group's while that has room, else the best provider not in `exclude`
    /// (backed-off peers last, then by score).
    fn pick(
        &self,
        model: &str,
        exclude: &[PeerId],
        load: &HashMap<PeerId, PeerLoad>,
        route: &Route,
    ) -> Option<PeerId> {
        let providers = self.providers(model);
        let usable =
            |p: PeerId| providers.contains(&p) && !exclude.contains(&p) && !self.backed_off(p);
        if let Some(ep) = &route.episode {
            let (mine, group) = {
                let a = lock(&self.affinity);
                let group = a
                    .group_of
                    .get(ep)
                    .and_then(|g| a.group_server.get(g))
                    .copied();
                (a.episode_server.get(ep).copied(), group)
            };
            if let Some(p) = mine.filter(|&p| usable(p)) {
                return Some(p);
            }
            let room = |p: &PeerId| load.get(p).is_none_or(|l| l.load < 1.0);
            if let Some(p) = group.filter(|&p| usable(p) && room(&p)) {
                return Some(p);
            }
        }
        let now = Instant::now();
        let scores = lock(&self.scores);
        let mut c: Vec<(bool, f64, PeerId)> = providers
            .iter()
            .copied()
            .filter(|p| !exclude.contains(p))
            .map(|p| {
                let s = scores.get(&p).cloned().unwrap_or_default();
                let backed_off = s.backoff_until.is_some_and(|t| t > now);
                let l = load.get(&p).copied().unwrap_or_default();
                let busy = (1.0 + l.load) * (1.0 - 0.25 * l.hit_rate.clamp(0.0, 1.0));
                (backed_off, s.ttft_ms.unwrap_or(0.0) * busy + busy, p)
            })
            .collect();
        c.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        c.first().map(|x| x.2)
    }
}

/// The swarm as an OpenAI facade backend.
pub struct SwarmBackend {
    pub swarm: SwarmHandle,
    pub router: Arc<Router>,
    cards: HashMap<String, (Arc<ModelCard>, usize)>,
    /// Where calls in flight run (the role waits for them when it stops).
    tasks: TaskTracker,
}

impl SwarmBackend {
    /// Waits (up to `wait`) until each model has a provider in the DHT, fetches its card,
    /// and keeps the provider lists fresh in the background.
    pub async fn connect(
        swarm: SwarmHandle,
        models: &[String],
        data_dir: &Path,
        wait: Duration,
        tasks: TaskTracker,
        stop: Stop,
    ) -> Result<SwarmBackend, ClientError> {
        let router = Arc::new(Router::default());
        let deadline = Instant::now() + wait;
        let mut cards = HashMap::new();
        for model in models {
            let card = loop {
                // The first provider found is enough to start; the refresh below asks
                // for all of them.
                let found = swarm
                    .lookup_providers(model, true)
                    .await
                    .map(|l| l.providers)
                    .unwrap_or_default();
                let found = with_seen(&swarm, model, found);
                let all = found.len();
                let found = trusted_providers(&swarm, model, found);
                router.set_providers(model, found.clone());
                let mut last_err = (all > found.len()).then(|| {
                    format!(
                        "{} provider(s) found, {} of them not trusted ({})",
                        all,
                        all - found.len(),
                        swarm.trust().describe()
                    )
                });
                for p in found {
                    match fetch_card(&swarm, p, model, data_dir).await {
                        Ok(c) => {
                            last_err = None;
                            insert_card(&mut cards, model, c);
                            break;
                        }
                        Err(e) => last_err = Some(e.to_string()),
                    }
                }
                if let Some((c, _)) = cards.get(model) {
                    break c.clone();
                }
                if Instant::now() > deadline {
                    return Err(ClientError::NoProvider {
                        model: model.clone(),
                        waited: wait,
                        last_error: last_err,
                    });
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = stop.requested() => return Err(ClientError::Stopped),
                }
            };
            info!(
                model,
                vocab = card.config.vocab_size,
                "fetched the model card"
            );
        }
        let (s, r, ms) = (swarm.clone(), router.clone(), models.to_vec());
        let refresh_stop = stop.clone();
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = refresh_stop.requested() => return,
                }
                for m in &ms {
                    if let Ok(p) = s.providers(m).await.map(|p| with_seen(&s, m, p)) {
                        // Trusting a run, a list the filter emptied is the truth (a
                        // certificate expired): no call goes to the old providers.
                        let run = matches!(s.trust(), crate::swarm::Trust::Run(_));
                        let p = trusted_providers(&s, m, p);
                        if !p.is_empty() || run {
                            r.set_providers(m, p);
                        }
                    }
                }
            }
        });
        Ok(SwarmBackend {
            swarm,
            router,
            cards,
            tasks,
        })
    }

    fn loads(&self, model: &str) -> HashMap<PeerId, PeerLoad> {
        self.swarm
            .view()
            .into_iter()
            .map(|e| {
                let hit_rate = e
                    .status
                    .models
                    .iter()
                    .find(|m| m.name == model)
                    .map_or(0.0, |m| m.cache.hit_rate as f64);
                let load = PeerLoad {
                    load: e.status.load as f64 + e.status.queue_depth as f64,
                    hit_rate,
                };
                (e.peer, load)
            })
            .collect()
    }
}

/// `found` (the DHT's providers of `model`) and every server the view shows serving it:
/// a server's gossiped status can reach this client before its provider record does (a
/// first lookup stops at the first provider), and the calls would all go to the few found.
/// A stopping server (its status says so, as it withdraws its records) is left out, even
/// while other nodes' copies of its provider record live on.
fn with_seen(swarm: &SwarmHandle, model: &str, mut found: Vec<PeerId>) -> Vec<PeerId> {
    let view = swarm.view();
    let stopping = |p: &PeerId| {
        view.iter()
            .any(|e| e.peer == *p && e.status.extra.contains_key(crate::swarm::STOPPING_FIELD))
    };
    found.retain(|p| !stopping(p));
    for e in &view {
        let serves = !e.is_self
            && e.status.role == Role::Server
            && !stopping(&e.peer)
            && e.status.models.iter().any(|m| m.name == model);
        if serves && !found.contains(&e.peer) {
            found.push(e.peer);
        }
    }
    found
}

/// The providers a client may send calls of `model` to (trusting a run: its certified
/// servers of the model, as the view shows them; otherwise all).
fn trusted_providers(swarm: &SwarmHandle, model: &str, peers: Vec<PeerId>) -> Vec<PeerId> {
    if !matches!(swarm.trust(), crate::swarm::Trust::Run(_)) {
        return peers;
    }
    let view = swarm.view();
    peers
        .into_iter()
        .filter(|p| {
            view.iter()
                .any(|e| e.peer == *p && swarm.may_sign(e, model))
        })
        .collect()
}

fn insert_card(cards: &mut HashMap<String, (Arc<ModelCard>, usize)>, model: &str, c: ModelCard) {
    let ctx = c.config.max_position_embeddings;
    cards.insert(model.to_string(), (Arc::new(c), ctx));
}

/// Fetches a model card from `peer`, checks it against its hash, and loads it (cached
/// under `<data-dir>/cards/<hash>/`).
pub async fn fetch_card(
    swarm: &SwarmHandle,
    peer: PeerId,
    model: &str,
    data_dir: &Path,
) -> Result<ModelCard, CardError> {
    let mut s = swarm.open(peer, CARD).await?;
    let request = CardRequest {
        model: model.to_string(),
    };
    write_frame(&mut s, &request, 4096).await?;
    let reply: CardReply = read_frame(&mut s, swarm.cfg.max_frame_bytes).await?;
    let (hash, blob) = match reply {
        CardReply::Card { hash, blob } => (hash, blob),
        CardReply::Unknown(e) => return Err(CardError::Unknown { peer, reason: e }),
    };
    if *blake3::hash(&blob).as_bytes() != hash {
        return Err(CardError::HashMismatch(peer));
    }
    let card: CardBlob =
        postcard::from_bytes(&blob).map_err(|e| CardError::Malformed(e.to_string()))?;
    let dir = data_dir
        .join("cards")
        .join(blake3::Hash::from(hash).to_hex().as_str());
    if !dir.join("config.json").is_file() {
        let io = |path: &Path, e: std::io::Error| CardError::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let tmp = dir.with_extension("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        for (name, bytes) in &card.files {
            if name.contains('/') || name.contains('\\') || name.starts_with('.') {
                return Err(CardError::Malformed(format!(
                    "model card file name {name:?} is not allowed"
                )));
            }
            let path = tmp.join(name);
            std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
        }
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(|e| io(&dir, e))?;
    }
    let mut c = ModelCard::from_hf_dir(&dir)?;
    c.name = model.to_string();
    Ok(c)
}

/// One choice as the call runs.
struct ChoiceRun {
    tx: UnboundedSender<ChoiceEvent>,
    tokens: Vec<u32>,
    done: bool,
    /// Where the current server's signed call starts in `tokens`.
    start: usize,
}

enum AttemptEnd {
    /// Every choice of the attempt finished (or failed on the server, already reported).
    Done,
    /// The caller went away.
    CallerGone,
    /// The request itself is wrong: no other provider would take it.
    Fatal(String),
    /// The provider failed; another may succeed.
    Retry(String),
}

impl Backend for SwarmBackend {
    fn model_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.cards.keys().cloned().collect();
        v.sort();
        v
    }
    fn card(&self, model: &str) -> Option<Arc<ModelCard>> {
        self.cards.get(model).map(|c| c.0.clone())
    }
    fn max_context(&self, model: &str) -> Option<usize> {
        self.cards.get(model).map(|c| c.1)
    }
    fn ready(&self) -> bool {
        true
    }
    fn submit(
        &self,
        model: &str,
        req: GenerateRequest,
        n: usize,
        route: &Route,
    ) -> Result<Vec<ChoiceStream>, EngineError> {
        let mut rxs = Vec::with_capacity(n);
        let mut runs = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = unbounded_channel();
            rxs.push(Box::pin(UnboundedReceiverStream::new(rx)) as ChoiceStream);
            runs.push(ChoiceRun {
                tx,
                tokens: Vec::new(),
                done: false,
                start: 0,
            });
        }
        let call = RemoteCall {
            swarm: self.swarm.clone(),
            router: self.router.clone(),
            model: model.to_string(),
            req,
            loads: self.loads(model),
            route: route.clone(),
        };
        self.tasks.spawn(call.run(runs));
        Ok(rxs)
    }
    fn metrics(&self, p: &mut Prom) {
        for m in self.model_ids() {
            p.gauge(
                "agentjet_swarm_providers",
                "Providers of the model this client knows.",
                &[("model", m.as_str())],
                self.router.providers(&m).len() as f64,
            );
        }
    }
}

struct RemoteCall {
    swarm: SwarmHandle,
    router: Arc<Router>,
    model: String,
    req: GenerateRequest,
    loads: HashMap<PeerId, PeerLoad>,
    route: Route,
}

impl RemoteCall {
    async fn run(self, mut runs: Vec<ChoiceRun>) {
        let mut tried: Vec<PeerId> = Vec::new();
        let mut last_err = String::from("no provider of the model is known");
        for attempt in 0..MAX_ATTEMPTS {
            let pending: Vec<usize> = (0..runs.len()).filter(|i| !runs[*i].done).collect();
            if pending.is_empty() {
                return;
            }
            let Some(peer) = self
                .router
                .pick(&self.model, &tried, &self.loads, &self.route)
                .or_else(|| {
                    // Every provider was tried: allow the least bad one again.
                    tried.clear();
                    self.router.pick(&self.model, &[], &self.loads, &self.route)
                })
            else {
                break;
            };
            tried.push(peer);
            // A fresh request for all choices when none has a token yet; otherwise each
            // unfinished choice continues from its tokens (one request per choice).
            let fresh = pending.len() == runs.len() && runs.iter().all(|r| r.tokens.is_empty());
            let groups: Vec<Vec<usize>> = if fresh {
                vec![pending]
            } else {
                pending.into_iter().map(|i| vec![i]).collect()
            };
            let mut retry = None;
            for g in groups {
                match self.attempt(peer, &mut runs, &g).await {
                    AttemptEnd::Done => {}
                    AttemptEnd::CallerGone => return,
                    AttemptEnd::Fatal(e) => {
                        for i in g {
                            let _ = runs[i]
                                .tx
                                .send(ChoiceEvent::Engine(EngineEvent::Failed(e.clone())));
                            runs[i].done = true;
                        }
                    }
                    AttemptEnd::Retry(e) => {
                        warn!(%peer, model = %self.model, attempt, "call failed on this provider, re-issuing: {e}");
                        self.router.failed(peer);
                        retry = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = retry {
                last_err = e;
                continue;
            }
            return;
        }
        for r in runs.iter().filter(|r| !r.done) {
            let _ = r.tx.send(ChoiceEvent::Engine(EngineEvent::Failed(format!(
                "no provider could serve the call: {last_err}"
            ))));
        }
    }

    /// Runs choices `which` on `peer` (several only for a fresh request).
    async fn attempt(&self, peer: PeerId, runs: &mut [ChoiceRun], which: &[usize]) -> AttemptEnd {
        let started = Instant::now();
        let limit = self.swarm.cfg.max_frame_bytes;
        let mut s = match self.swarm.open(peer, INFER).await {
            Ok(s) => s,
            Err(e) => return AttemptEnd::Retry(e.to_string()),
        };
        let first = which[0];
        let done_tokens = runs[first].tokens.len();
        let mut prompt = self.req.prompt.clone();
        prompt.extend_from_slice(&runs[first].tokens);
        let max_tokens = self.req.max_tokens.saturating_sub(done_tokens);
        if max_tokens == 0 {
            return AttemptEnd::Fatal(
                "the call used its max_tokens before the server failed".into(),
            );
        }
        let seed = self.req.seed.map(|s| {
            s.wrapping_add(first as u64)
                .wrapping_add(done_tokens as u64 * 7919)
        });
        let r = InferRequest {
            model: self.model.clone(),
            prompt,
            max_tokens: max_tokens as u32,
            sampling: self.req.sampling.clone(),
            seed: if which.len() == 1 && runs.len() > 1 {
                seed
            } else {
                self.req.seed
            },
            stop_token_ids: self.req.stop_token_ids.clone(),
            top_logprobs: self.req.top_logprobs as u32,
            constraint: self.req.constraint.as_ref().map(|c| c.pattern()),
            n: which.len() as u32,
        };
        if done_tokens > 0 && r.constraint.is_some() {
            return AttemptEnd::Fatal(
                "the server failed mid-way through a constrained call".into(),
            );
        }
        if let Err(e) = write_frame(&mut s, &r, limit).await {
            return AttemptEnd::Retry(e.to_string());
        }
        for &i in which {
            runs[i].start = runs[i].tokens.len();
        }
        let mut finished = 0;
        let mut first_token = true;
        while finished < which.len() {
            let frame = match tokio::time::timeout(
                FRAME_TIMEOUT,
                read_frame::<_, InferFrame>(&mut s, limit),
            )
            .await
            {
                Err(_) => {
                    return AttemptEnd::Retry(format!(
                        "no answer for {} s",
                        FRAME_TIMEOUT.as_secs()
                    ))
                }
                Ok(Err(e)) => return AttemptEnd::Retry(e.to_string()),
                Ok(Ok(f)) => f,
            };
            let choice_of = |c: u32| which.get(c as usize).copied();
            match frame {
                InferFrame::Token {
                    choice,
                    id,
                    logprob,
                    behaviour,
                    top,
                    policy_version,
                    signature,
                } => {
                    let Some(i) = choice_of(choice) else {
                        return AttemptEnd::Retry(format!(
                            "token for choice {choice} of {}",
                            which.len()
                        ));
                    };
                    if first_token {
                        first_token = false;
                        self.router.succeeded(peer, started.elapsed());
                        self.router.bind(&self.route, peer);
                    }
                    let run = &mut runs[i];
                    run.tokens.push(id);
                    let signed = ChoiceEvent::Signed(SignedPart {
                        start: run.start,
                        upto: run.tokens.len(),
                        policy_version,
                        signature,
                    });
                    if run.tx.send(signed).is_err()
                        || run
                            .tx
                            .send(ChoiceEvent::Engine(EngineEvent::Token {
                                id,
                                logprob,
                                behaviour,
                                top,
                            }))
                            .is_err()
                    {
                        return AttemptEnd::CallerGone;
                    }
                }
                InferFrame::Finished {
                    choice,
                    reason,
                    completion_tokens: _,
                    prompt_tokens: _,
                    policy_version,
                } => {
                    let Some(i) = choice_of(choice) else {
                        return AttemptEnd::Retry(format!(
                            "finish for choice {choice} of {}",
                            which.len()
                        ));
                    };
                    let run = &mut runs[i];
                    let ev = ChoiceEvent::Engine(EngineEvent::Finished {
                        reason,
                        prompt_tokens: self.req.prompt.len(),
                        completion_tokens: run.tokens.len(),
                        policy_version,
                    });
                    run.done = true;
                    finished += 1;
                    let _ = run.tx.send(ev);
                }
                InferFrame::Failed { choice, message } => {
                    if let Some(i) = choice_of(choice) {
                        runs[i].done = true;
                        finished += 1;
                        let _ = runs[i]
                            .tx
                            .send(ChoiceEvent::Engine(EngineEvent::Failed(message)));
                    }
                }
                InferFrame::Rejected { message, retry } => {
                    return if retry {
                        AttemptEnd::Retry(message)
                    } else {
                        AttemptEnd::Fatal(message)
                    };
                }
            }
        }
        AttemptEnd::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(ep: &str) -> Route {
        Route {
            episode: Some(ep.into()),
        }
    }

    #[test]
    fn episodes_stick_to_their_server_and_groups_share_one_while_it_has_room() {
        let r = Router::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        r.set_providers("m", vec![a, b]);
        for e in ["e0", "e1", "e2"] {
            r.register_episode(e, "g");
        }
        let idle: HashMap<PeerId, PeerLoad> = HashMap::new();
        // e0's first call ran on whichever server; make it b's for the check.
        r.bind(&route("e0"), b);
        assert_eq!(r.pick("m", &[], &idle, &route("e0")), Some(b));
        // A sibling with no server yet goes to the group's server while it has room...
        assert_eq!(r.pick("m", &[], &idle, &route("e1")), Some(b));
        // ...and elsewhere when b is full; it then stays where it ran.
        let full = HashMap::from([(
            b,
            PeerLoad {
                load: 1.5,
                hit_rate: 0.0,
            },
        )]);
        assert_eq!(r.pick("m", &[], &full, &route("e1")), Some(a));
        r.bind(&route("e1"), a);
        assert_eq!(r.pick("m", &[], &idle, &route("e1")), Some(a));
        // An episode's own server is kept even when busy, until it fails.
        assert_eq!(r.pick("m", &[], &full, &route("e0")), Some(b));
        r.failed(b);
        assert_eq!(r.pick("m", &[], &idle, &route("e0")), Some(a));
        r.bind(&route("e0"), a);
        assert_eq!(r.server_of("e0"), Some(a));
        // Over: forgotten, and the group with its last episode.
        for e in ["e0", "e1", "e2"] {
            r.forget_episode(e);
        }
        assert_eq!(r.server_of("e0"), None);
        assert!(lock(&r.affinity).group_server.is_empty());
        assert!(lock(&r.affinity).group_size.is_empty());
    }
}
