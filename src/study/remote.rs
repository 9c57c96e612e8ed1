//! The driver's side of study workers: a swarm node of its own (its identity in the
//! study's directory, `identity.key`), the workers it found in the swarm's view (peers
//! that gossip [`wire::WORKER_FIELD`]) and their slots, and each arm a worker runs for it.
//!
//! What the driver reads of an arm stays a file of the arm's directory, wherever the arm
//! runs: a look at a remote arm appends the new lines of its metrics to a mirror
//! (`arms/NNN/server/runs/<run>/metrics.jsonl`) and writes where its checkpoint is
//! (`remote.json`), so the watch, the policies, the report and the researcher read a
//! remote arm as they read a local one. A background task tells every worker that runs
//! an arm of the study that the driver lives, every [`KEEPALIVE`]; a worker stops the
//! arms of a driver silent for its lease (as a dead driver's local arms get SIGTERM).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::arms::ArmArgs;
use super::error::StudyError;
use super::launch::{ArmDir, Exited, Launch, Procs, Remote, SERVER_DRAIN};
use super::spec::{self, Study};
use super::wire::{self, ArmKey, Look, Phase, Reply, Request, MAX_FRAME};
use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::{PeerId, SwarmConfig, SwarmHandle};

/// How often the driver tells its workers it lives.
pub const KEEPALIVE: Duration = Duration::from_secs(1);
/// The shortest lease a worker takes: a keepalive round is [`KEEPALIVE`] plus up to
/// [`LOOK_TIMEOUT`] for the slowest worker.
pub const LEASE_AT_LEAST: Duration = Duration::from_secs(10);
/// A request's time limit.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
/// A look's and a keepalive's time limit (a worker that does not answer costs the
/// driver's loop this much per arm).
pub const LOOK_TIMEOUT: Duration = Duration::from_secs(3);
/// Looks in a row a worker may miss before its arm counts as crashed.
pub const LOOK_MISSES: u32 = 6;
/// How often the swarm's view is searched for new workers.
pub const SCAN_EVERY: Duration = Duration::from_secs(2);

/// A worker the driver knows of.
#[derive(Debug, Clone)]
enum Known {
    Slots(u32),
    /// It refused this driver (not allowed), or did not answer its hello (asked again
    /// after [`ASK_AGAIN`]).
    Refused(String, Instant),
}

/// How long a worker that refused or did not answer is left before it is asked again.
const ASK_AGAIN: Duration = Duration::from_secs(30);

/// The driver's node and the workers it found.
pub struct Workers {
    rt: tokio::runtime::Runtime,
    node: SwarmHandle,
    /// The study's name on the workers (its name and hash).
    study: String,
    spec: spec::Workers,
    started: Instant,
    /// Changed by any request that fails to reach its worker (it is not picked for a
    /// new arm until it answers a hello again).
    known: std::cell::RefCell<BTreeMap<PeerId, Known>>,
    /// When the driver last said that an arm waits for a worker it cannot use.
    told_waiting: std::cell::RefCell<BTreeMap<usize, Instant>>,
    /// Whether any worker took this driver yet.
    ever_usable: std::cell::Cell<bool>,
    /// Workers that run an arm of this driver now (the keepalive's list).
    hosting: Arc<Mutex<BTreeSet<PeerId>>>,
    scanned: Option<Instant>,
}

/// The name a study has on its workers: its name (64 characters at most) and the first
/// 16 hex digits of its hash.
pub fn study_key(study: &Study) -> String {
    let name: String = study.name.chars().take(64).collect();
    format!("{name}-{}", study.hash.get(..16).unwrap_or(&study.hash))
}

impl Workers {
    /// Starts the driver's node (its identity in `dir`, created on first use) and joins
    /// the workers' swarm.
    pub fn start(study: &Study, w: &spec::Workers, dir: &Path) -> Result<Workers, StudyError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("study-driver-node")
            .enable_all()
            .build()
            .map_err(|e| StudyError::io(dir, e))?;
        let id = dir.join("identity.key");
        let key = crate::swarm::load_or_create_identity(&id).map_err(|e| StudyError::io(&id, e))?;
        let mut cfg = SwarmConfig::new(crate::swarm::Role::Plain, key);
        let addr = |a: &str| {
            crate::swarm::parse_addr(a)
                .map_err(|e| StudyError::field(&study.file, "workers", e.to_string()))
        };
        cfg.listen = vec![addr(&w.listen)?];
        cfg.bootstrap = w
            .bootstrap
            .iter()
            .map(|a| addr(a.as_str()))
            .collect::<Result<_, _>>()?;
        cfg.swarm_key = Some(
            crate::swarm::SwarmKey::load(&w.swarm_key)
                .map_err(|e| StudyError::field(&study.file, "workers.swarm_key", e.to_string()))?,
        );
        cfg.status_interval = Duration::from_secs(1);
        cfg.kad_server = false;
        let node = rt
            .block_on(crate::swarm::spawn_node(cfg))
            .map_err(|e| StudyError::Launch {
                arm: "the driver's node".into(),
                msg: e.to_string(),
            })?;
        println!(
            "the study's driver is peer {} (a study worker runs its arms with --allow-driver {})",
            node.peer_id, node.peer_id
        );
        let hosting: Arc<Mutex<BTreeSet<PeerId>>> = Default::default();
        let study_name = study_key(study);
        {
            let (node, hosting, study) = (node.clone(), hosting.clone(), study_name.clone());
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(KEEPALIVE).await;
                    let peers: Vec<PeerId> = crate::base::lock(&hosting).iter().copied().collect();
                    let req = Request::Keepalive {
                        study: study.clone(),
                    };
                    // All at once: one silent worker does not hold the others' leases.
                    let asks = peers.iter().map(|p| ask_on(&node, *p, &req, LOOK_TIMEOUT));
                    for (p, r) in peers.iter().zip(futures::future::join_all(asks).await) {
                        if let Err(e) = r {
                            tracing::warn!(worker = %p, "a keepalive failed: {e}");
                        }
                    }
                }
            });
        }
        Ok(Workers {
            rt,
            node,
            study: study_name,
            spec: w.clone(),
            started: Instant::now(),
            known: Default::default(),
            told_waiting: Default::default(),
            ever_usable: Default::default(),
            hosting,
            scanned: None,
        })
    }

    pub fn peer_id(&self) -> PeerId {
        self.node.peer_id
    }

    /// The key of arm `id` on the workers.
    pub fn key(&self, arm: usize) -> ArmKey {
        ArmKey {
            study: self.study.clone(),
            arm,
        }
    }

    /// Arms at once on the driver's own machine.
    pub fn local_slots(&self) -> usize {
        self.spec.local
    }

    /// Whether the driver looked for workers long enough to put arms on its own machine.
    pub fn waited(&self) -> bool {
        self.started.elapsed().as_secs_f64() >= self.spec.wait_seconds
    }

    /// Looks for new workers in the swarm's view (every [`SCAN_EVERY`]) and asks each
    /// new one its slots.
    pub fn scan(&mut self) {
        if self.scanned.is_some_and(|t| t.elapsed() < SCAN_EVERY) {
            return;
        }
        self.scanned = Some(Instant::now());
        let allow = &self.spec.allow;
        let in_view: BTreeSet<PeerId> = self
            .node
            .view()
            .into_iter()
            .filter(|e| !e.is_self && e.status.extra.contains_key(wire::WORKER_FIELD))
            .map(|e| e.peer)
            .filter(|p| allow.is_empty() || allow.contains(p))
            .collect();
        // A worker gone from the view gets no new arm (its arms wait for it).
        self.known
            .borrow_mut()
            .retain(|p, k| in_view.contains(p) || matches!(k, Known::Refused(..)));
        let known = self.known.borrow().clone();
        let new: Vec<PeerId> = in_view
            .into_iter()
            .filter(|p| match known.get(p) {
                None => true,
                Some(Known::Slots(_)) => false,
                Some(Known::Refused(_, at)) => at.elapsed() >= ASK_AGAIN,
            })
            .collect();
        for p in new {
            let known = match self.ask(p, &Request::Hello, ASK_TIMEOUT) {
                Ok(Reply::Hello { slots, .. }) => {
                    println!("study worker {p}: {slots} slot(s)");
                    self.ever_usable.set(true);
                    Known::Slots(slots)
                }
                Ok(other) => {
                    Known::Refused(format!("answered {other:?} to a hello"), Instant::now())
                }
                Err(e) => {
                    println!("study worker {p} cannot be used: {e}");
                    Known::Refused(e, Instant::now())
                }
            };
            self.known.borrow_mut().insert(p, known);
        }
    }

    /// Says (once a minute at most for each arm) that an arm waits for a worker that is
    /// not usable now.
    pub fn tell_waiting(&self, arm: usize, worker: &PeerId) {
        let mut told = self.told_waiting.borrow_mut();
        if told
            .get(&arm)
            .is_some_and(|t| t.elapsed() < Duration::from_secs(60))
        {
            return;
        }
        told.insert(arm, Instant::now());
        println!(
            "arm {arm} waits for worker {worker}, which holds its checkpoint and is not usable now"
        );
    }

    /// Why no worker can run arms, once the driver looked for `wait_seconds`: none, or
    /// what each said.
    pub fn none_usable(&self) -> Option<String> {
        let known = self.known.borrow();
        // Once one took it, workers that come and go are waited for.
        if !self.waited()
            || self.ever_usable.get()
            || known.values().any(|k| matches!(k, Known::Slots(_)))
        {
            return None;
        }
        if known.is_empty() {
            return Some(format!(
                "no study worker in the swarm of {} within {} s",
                self.spec.bootstrap.join(", "),
                self.spec.wait_seconds
            ));
        }
        let said: Vec<String> = known
            .iter()
            .map(|(p, k)| match k {
                Known::Refused(why, _) => format!("{p}: {why}"),
                Known::Slots(n) => format!("{p}: {n} slot(s)"),
            })
            .collect();
        Some(format!(
            "no study worker takes this driver: {}",
            said.join("; ")
        ))
    }

    /// Looks for worker `w` until the driver waited its `wait_seconds`; whether it can
    /// be asked.
    pub fn wait_for(&mut self, w: &PeerId) -> bool {
        loop {
            self.scan();
            if matches!(self.known.borrow().get(w), Some(Known::Slots(_))) {
                return true;
            }
            if self.waited() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether `worker` took this driver and was reached since.
    pub fn usable(&self, worker: &PeerId) -> bool {
        matches!(self.known.borrow().get(worker), Some(Known::Slots(_)))
    }

    /// Whether `worker` has a slot free, with `busy` arms of this driver on it.
    pub fn has_room(&self, worker: &PeerId, busy: usize) -> bool {
        matches!(self.known.borrow().get(worker), Some(Known::Slots(n)) if (*n as usize) > busy)
    }

    /// A known worker with a slot free, given the arms of this driver on each.
    pub fn free(&self, busy: impl Fn(&PeerId) -> usize) -> Option<PeerId> {
        let known: Vec<PeerId> = self.known.borrow().keys().copied().collect();
        known.into_iter().find(|p| self.has_room(p, busy(p)))
    }

    /// One request; a worker that it does not reach (not a refusal) is not picked for
    /// a new arm until it answers a hello again.
    fn ask(&self, peer: PeerId, req: &Request, t: Duration) -> Result<Reply, String> {
        let r = self.rt.block_on(ask_on(&self.node, peer, req, t));
        if let Err(e) = &r {
            if !e.starts_with(REFUSED) {
                self.known
                    .borrow_mut()
                    .insert(peer, Known::Refused(e.clone(), Instant::now()));
            }
        }
        r
    }

    /// Gives arm `arm` the checkpoint of arm `from`, which ran on `worker`.
    pub fn seed(&self, worker: PeerId, arm: usize, from: usize) -> Result<Option<u64>, String> {
        let req = Request::Seed {
            key: self.key(arm),
            from,
        };
        match self.ask(worker, &req, ASK_TIMEOUT)? {
            Reply::Seeded { step } => Ok(step),
            other => Err(format!("answered {other:?} to a seed")),
        }
    }

    /// Starts arm `arm` on `worker`; its mirror in `dir` starts again from the worker's
    /// whole metrics.
    pub fn launch(
        &self,
        worker: PeerId,
        arm: usize,
        steps: u64,
        model: &str,
        args: &ArmArgs,
        dir: ArmDir,
    ) -> Result<RemoteArm, String> {
        // One that the worker still stops (its lease ran out, or a stop) first ends.
        let key = self.key(arm);
        let deadline = Instant::now() + SERVER_DRAIN + Duration::from_secs(30);
        while self.look(worker, &key, &dir)?.0 == Phase::Stopping {
            if Instant::now() > deadline {
                return Err(format!("arm {arm} still stopping on worker {worker}"));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let req = Request::Launch {
            key: self.key(arm),
            steps,
            model: model.into(),
            server: args.server.clone(),
            client: args.client.clone(),
            env: args.env.clone().into_iter().collect(),
        };
        match self.ask(worker, &req, ASK_TIMEOUT) {
            Ok(Reply::Done) => {}
            Ok(other) => return Err(format!("answered {other:?} to a launch")),
            Err(e) => {
                // Full, or another reason: no new arm goes there until it says hello.
                self.known
                    .borrow_mut()
                    .insert(worker, Known::Refused(e.clone(), Instant::now()));
                return Err(e);
            }
        }
        crate::base::lock(&self.hosting).insert(worker);
        // Its metrics come again from the start (a resumed server writes them anew).
        if let Some(m) = dir.metrics_path() {
            let _ = std::fs::remove_file(m);
        }
        let _ = dir.set_remote(&Remote {
            worker: worker.to_string(),
            ..dir.remote().unwrap_or_default()
        });
        Ok(RemoteArm {
            worker,
            key: self.key(arm),
            target: steps,
            dir,
            serving: false,
            misses: 0,
        })
    }

    /// One look at arm `key` on `worker`: its mirror in `dir` gets the new metrics.
    /// Returns the arm's phase and whether the mirror holds the worker's whole file.
    fn look(&self, worker: PeerId, key: &ArmKey, dir: &ArmDir) -> Result<(Phase, bool), String> {
        // Twice when the worker's file was written anew: the second from its start.
        for _ in 0..2 {
            let from = dir
                .remote()
                .and_then(|r| r.run)
                .and_then(|run| {
                    std::fs::metadata(dir.dir.join("server/runs").join(run).join("metrics.jsonl"))
                        .ok()
                })
                .map_or(0, |m| m.len());
            let req = Request::Look {
                key: key.clone(),
                metrics_from: from,
            };
            let look = match self.ask(worker, &req, LOOK_TIMEOUT)? {
                Reply::Look(l) => l,
                other => return Err(format!("answered {other:?} to a look")),
            };
            let anew = mirror_look(dir, worker, from, &look).map_err(|e| e.to_string())?;
            if !anew {
                let whole = from + look.metrics.len() as u64 >= look.metrics_len;
                return Ok((look.phase, whole));
            }
        }
        Err(format!(
            "worker {worker} wrote arm {}'s metrics anew twice in a row",
            key.arm
        ))
    }

    /// One look at arm `arm` on `worker` (its mirror brought a step closer).
    pub fn peek(&self, worker: PeerId, arm: usize, dir: &ArmDir) -> Result<Phase, String> {
        self.look(worker, &self.key(arm), dir).map(|(p, _)| p)
    }

    /// Stops arm `arm` on `worker` and waits until no process of it runs there (its
    /// server saved its checkpoint), the mirror brought up to date. Says whether any
    /// process of it ran there.
    pub fn stop(&self, worker: PeerId, arm: usize, dir: &ArmDir) -> Result<bool, String> {
        let key = self.key(arm);
        self.ask(worker, &Request::Stop { key: key.clone() }, ASK_TIMEOUT)?;
        let (was, _) = self.look(worker, &key, dir)?;
        let deadline = Instant::now() + SERVER_DRAIN + Duration::from_secs(30);
        let mut misses = 0;
        loop {
            match self.look(worker, &key, dir) {
                // Gone, and every line of its metrics here.
                Ok((Phase::Gone, true)) => break,
                Ok(_) => misses = 0,
                Err(e) => {
                    misses += 1;
                    if misses >= LOOK_MISSES {
                        return Err(e);
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(format!("arm {arm} still stopping on worker {worker}"));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Ok(was == Phase::Stopping)
    }

    /// The worker no arm of this driver runs on any more leaves the keepalive's list.
    pub fn released(&self, worker: &PeerId, still_busy: bool) {
        if !still_busy {
            crate::base::lock(&self.hosting).remove(worker);
        }
    }
}

/// Writes what a look brought: the new metrics lines and where the checkpoint is. Says
/// whether the worker's file was written anew (the mirror is emptied: look again).
fn mirror_look(dir: &ArmDir, worker: PeerId, from: u64, look: &Look) -> Result<bool, StudyError> {
    let mut anew = false;
    let was = dir.remote();
    if let Some(run) = look.run.as_deref() {
        if !wire::run_name_ok(run) {
            return Err(StudyError::io(
                &dir.dir,
                format!("a worker's run name {run:?}"),
            ));
        }
        // Another run directory than the one mirrored: the old mirror goes.
        if let Some(old) = was.as_ref().and_then(|r| r.run.as_deref()) {
            if old != run && wire::run_name_ok(old) {
                let _ = std::fs::remove_dir_all(dir.dir.join("server/runs").join(old));
            }
        }
        let runs = dir.dir.join("server").join("runs").join(run);
        std::fs::create_dir_all(&runs).map_err(|e| StudyError::io(&runs, e))?;
        let path = runs.join("metrics.jsonl");
        let (copied, same_run) = was.as_ref().map_or((0, false), |r| {
            (r.metrics_file, r.run.as_deref() == Some(run))
        });
        anew = from > 0 && (look.metrics_file != copied || !same_run || look.metrics_len < from);
        if anew {
            std::fs::write(&path, b"").map_err(|e| StudyError::io(&path, e))?;
        } else if !look.metrics.is_empty() {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| StudyError::io(&path, e))?;
            f.write_all(&look.metrics)
                .map_err(|e| StudyError::io(&path, e))?;
        }
    }
    let r = Remote {
        worker: worker.to_string(),
        checkpoint_step: look.checkpoint_step,
        checkpoint: look.checkpoint.clone(),
        metrics_file: look.metrics_file,
        run: look
            .run
            .clone()
            .or(was.as_ref().and_then(|r| r.run.clone())),
    };
    if was.as_ref() != Some(&r) {
        dir.set_remote(&r)?;
    }
    Ok(anew)
}

/// How the error of a request the worker refused begins (it was reached).
const REFUSED: &str = "refused: ";

async fn ask_on(
    node: &SwarmHandle,
    peer: PeerId,
    req: &Request,
    t: Duration,
) -> Result<Reply, String> {
    let talk = async {
        let mut s = node
            .open(peer, wire::PROTOCOL)
            .await
            .map_err(|e| e.to_string())?;
        write_frame(&mut s, req, MAX_FRAME)
            .await
            .map_err(|e| e.to_string())?;
        read_frame::<_, Reply>(&mut s, MAX_FRAME)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(t, talk).await {
        Ok(Ok(Reply::Refused(why))) => Err(format!("{REFUSED}{why}")),
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} s", t.as_secs())),
    }
}

/// An arm a worker runs.
pub struct RemoteArm {
    pub worker: PeerId,
    key: ArmKey,
    /// The steps it runs to (the worker stops it there).
    target: u64,
    pub dir: ArmDir,
    serving: bool,
    misses: u32,
}

/// A running arm: on the driver's machine, or on a worker.
pub enum Running {
    Local(Procs),
    Remote(RemoteArm),
}

impl Running {
    pub fn dir(&self) -> &ArmDir {
        match self {
            Running::Local(p) => &p.dir,
            Running::Remote(r) => &r.dir,
        }
    }

    /// The worker it runs on (none: the driver's machine).
    pub fn worker(&self) -> Option<PeerId> {
        match self {
            Running::Local(_) => None,
            Running::Remote(r) => Some(r.worker),
        }
    }

    pub fn serving(&self) -> bool {
        match self {
            Running::Local(p) => p.serving(),
            Running::Remote(r) => r.serving,
        }
    }

    /// One look (see [`Procs::poll`]); a worker that missed [`LOOK_MISSES`] looks in a
    /// row, or stopped the arm itself, counts as the arm's server gone.
    pub fn poll(
        &mut self,
        l: &Launch,
        workers: Option<&Workers>,
    ) -> Result<Option<Exited>, StudyError> {
        let (r, w) = match (self, workers) {
            (Running::Local(p), _) => return p.poll(l),
            (Running::Remote(r), Some(w)) => (r, w),
            (Running::Remote(_), None) => return Ok(None),
        };
        match w.look(r.worker, &r.key, &r.dir) {
            Ok((phase, whole)) => {
                r.misses = 0;
                match phase {
                    Phase::Starting => Ok(None),
                    // Stopped: judged once every line of its metrics is here.
                    Phase::Stopping | Phase::Gone if !whole => Ok(None),
                    Phase::Serving => {
                        r.serving = true;
                        Ok(None)
                    }
                    Phase::Exited(e) => Ok(Some(e)),
                    // At its target: the worker stopped it (the driver sees it reached
                    // at its next look).
                    Phase::Stopping | Phase::Gone
                        if r.dir
                            .metrics_path()
                            .and_then(|p| super::watch::steps(&p).last().map(|s| s.step))
                            .is_some_and(|s| s >= r.target) =>
                    {
                        Ok(None)
                    }
                    Phase::Stopping | Phase::Gone => Ok(Some(Exited::Server {
                        detail: format!(
                            "worker {} stopped it (see its arms/{:03}/driver.log there)",
                            r.worker, r.key.arm
                        ),
                        usage: false,
                    })),
                }
            }
            Err(e) => {
                r.misses += 1;
                if r.misses < LOOK_MISSES {
                    return Ok(None);
                }
                Ok(Some(Exited::Server {
                    detail: format!(
                        "worker {} missed {} looks in a row, the last: {e}",
                        r.worker, r.misses
                    ),
                    usage: false,
                }))
            }
        }
    }

    /// Starts the client again (it ran its tasks to the end).
    pub fn restart_client(
        &mut self,
        l: &Launch,
        workers: Option<&Workers>,
    ) -> Result<(), StudyError> {
        match (self, workers) {
            (Running::Local(p), _) => p.restart_client(l),
            (Running::Remote(r), Some(w)) => w
                .ask(
                    r.worker,
                    &Request::RestartClient { key: r.key.clone() },
                    ASK_TIMEOUT,
                )
                .map(|_| ())
                .map_err(|e| StudyError::Launch {
                    arm: r.dir.dir.display().to_string(),
                    msg: format!("restarting its client on worker {}: {e}", r.worker),
                }),
            (Running::Remote(_), None) => Ok(()),
        }
    }

    /// Stops it (its server saves its checkpoint); a worker that cannot be reached is
    /// left to stop the arm itself when its lease runs out.
    pub fn stop(self, workers: Option<&Workers>, busy_after: impl Fn(&PeerId) -> bool) {
        match (self, workers) {
            (Running::Local(p), _) => p.stop(),
            (Running::Remote(r), Some(w)) => {
                if let Err(e) = w.stop(r.worker, r.key.arm, &r.dir) {
                    println!(
                        "arm {}: stopping it on worker {}: {e} (the worker stops it when this driver's lease runs out)",
                        r.key.arm, r.worker
                    );
                }
                w.released(&r.worker, busy_after(&r.worker));
            }
            (Running::Remote(_), None) => {}
        }
    }
}
