//! A study worker (`agentjet-peer study worker`): a peer of a swarm that runs study arms
//! for the drivers it allows, on its own machine, as the driver would on its own (the
//! arm's server and client as processes, [`super::launch`]). Its arms live in
//! `<dir>/studies/<study>/arms/NNN/`, the same layout as a driver's.
//!
//! One thread (the host) owns every arm's processes: Linux sends an arm's processes
//! SIGTERM when the thread that started them ends, so they must not start on a pool's
//! threads. Requests reach it through a channel; nothing it does waits on a process (a
//! stop is begun and looked at on later ticks), so one arm's drain never holds another's
//! looks. An arm whose driver sent no look and no keepalive for the lease is stopped as a
//! dead driver's local arms are: its server drains and saves its checkpoint. Each driver
//! has its own space (`studies/<driver peer id>-<study>/`): it sees and touches its own
//! arms alone.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::arms::ArmArgs;
use super::error::StudyError;
use super::launch::{note, ArmDir, Exited, Launch, Procs, SERVER_DRAIN};
use super::wire::{self, ArmKey, Look, Phase, Reply, Request, MAX_FRAME, METRICS_CHUNK};
use crate::base::Stop;
use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::{PeerId, SwarmHandle};

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Its arms' directories (`studies/<study>/arms/NNN`).
    pub dir: PathBuf,
    /// The `agentjet-peer` binary the arms run.
    pub exe: PathBuf,
    /// The drivers whose requests it carries out.
    pub allowed: Vec<PeerId>,
    /// Arms at once.
    pub slots: u32,
    /// An arm whose driver said nothing for this long is stopped.
    pub lease: Duration,
}

enum Cmd {
    Req(PeerId, Box<Request>, tokio::sync::oneshot::Sender<Reply>),
    /// Stop every arm (their servers drain), then answer.
    Shutdown(tokio::sync::oneshot::Sender<()>),
}

/// Serves study arms on `node` until `stop`; then stops every arm it runs (their servers
/// save their checkpoints) and returns.
pub async fn serve(node: &SwarmHandle, opts: WorkerOptions, stop: &Stop) -> Result<(), StudyError> {
    std::fs::create_dir_all(&opts.dir).map_err(|e| StudyError::io(&opts.dir, e))?;
    let (tx, rx) = mpsc::channel::<Cmd>();
    let host = Host {
        opts: opts.clone(),
        arms: BTreeMap::new(),
        stopping: BTreeMap::new(),
    };
    let thread = std::thread::Builder::new()
        .name("study-worker-host".into())
        .spawn(move || host.run(rx))
        .map_err(|e| StudyError::io(&opts.dir, e))?;
    let allowed = opts.allowed.clone();
    let to_host = tx.clone();
    node.serve(wire::PROTOCOL, move |peer, mut s| {
        let allowed = allowed.clone();
        let to_host = to_host.clone();
        async move {
            // The request is read first (a reply to an unread stream is lost with it),
            // within a time limit; one of a peer not allowed, in a small frame.
            let ok = allowed.contains(&peer);
            let limit = if ok { MAX_FRAME } else { 4096 };
            let req: Request = tokio::time::timeout(READ_TIMEOUT, read_frame(&mut s, limit))
                .await
                .map_err(|_| {
                    crate::swarm::frame::FrameError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no request within 10 s",
                    ))
                })??;
            if !ok {
                tracing::warn!(%peer, "refused a study request: not an allowed driver");
                let reply = Reply::Refused(format!(
                    "peer {peer} is not a driver this worker allows (its --allow-driver)"
                ));
                write_frame(&mut s, &reply, MAX_FRAME).await?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                return Ok::<(), crate::swarm::frame::FrameError>(());
            }
            let (rtx, rrx) = tokio::sync::oneshot::channel();
            let reply = match to_host.send(Cmd::Req(peer, Box::new(req), rtx)) {
                Ok(()) => rrx
                    .await
                    .unwrap_or_else(|_| Reply::Refused("the worker is stopping".into())),
                Err(_) => Reply::Refused("the worker is stopping".into()),
            };
            write_frame(&mut s, &reply, MAX_FRAME).await?;
            let _ = futures::io::AsyncWriteExt::close(&mut s).await;
            Ok(())
        }
    })
    .map_err(|e| StudyError::Launch {
        arm: "worker".into(),
        msg: e.to_string(),
    })?;
    node.set_status(|st| {
        st.extra
            .insert(wire::WORKER_FIELD.into(), opts.slots.to_string());
    });
    node.announce();
    stop.requested().await;
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    if tx.send(Cmd::Shutdown(done_tx)).is_ok() {
        let _ = done_rx.await;
    }
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    Ok(())
}

/// How long a request may take to arrive once its stream is open.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// An arm the worker runs.
struct Hosted {
    procs: Procs,
    model: String,
    args: ArmArgs,
    /// The training steps it runs to: it is stopped there.
    target: u64,
    /// What exited on its own, said at every look until a stop or a client restart.
    exited: Option<Exited>,
    /// The driver's last word about it.
    seen: Instant,
}

struct Host {
    opts: WorkerOptions,
    arms: BTreeMap<ArmKey, Hosted>,
    /// Arms whose stop was begun, with its deadline.
    stopping: BTreeMap<ArmKey, (Procs, Instant)>,
}

impl Host {
    fn run(mut self, rx: mpsc::Receiver<Cmd>) {
        loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(Cmd::Req(peer, r, tx)) => {
                    let reply = self.handle(&peer, *r);
                    let _ = tx.send(reply);
                }
                Ok(Cmd::Shutdown(tx)) => {
                    self.shutdown();
                    let _ = tx.send(());
                    return;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    self.shutdown();
                    return;
                }
            }
            self.tick();
        }
    }

    fn dir(&self, key: &ArmKey) -> ArmDir {
        ArmDir::new(&self.opts.dir.join("studies").join(&key.study), key.arm)
    }

    fn handle(&mut self, driver: &PeerId, r: Request) -> Reply {
        let own = format!("{driver}-");
        let mut r = r.scoped(driver);
        if let Some(Err(e)) = r.key_mut().map(|k| k.check()) {
            return Reply::Refused(e);
        }
        match r {
            Request::Hello => Reply::Hello {
                slots: self.opts.slots,
                running: self
                    .arms
                    .keys()
                    .chain(self.stopping.keys())
                    .filter_map(|k| {
                        Some(ArmKey {
                            study: k.study.strip_prefix(&own)?.to_string(),
                            arm: k.arm,
                        })
                    })
                    .collect(),
            },
            Request::Keepalive { study } => {
                for (k, h) in self.arms.iter_mut() {
                    if k.study == study {
                        h.seen = Instant::now();
                    }
                }
                Reply::Done
            }
            Request::Seed { key, from } => self.seed(&key, from),
            Request::Launch {
                key,
                steps,
                model,
                server,
                client,
                env,
            } => self.launch(
                key,
                steps,
                model,
                ArmArgs {
                    server,
                    client,
                    env: env.into_iter().collect(),
                },
            ),
            Request::Look { key, metrics_from } => self.look(&key, metrics_from),
            Request::RestartClient { key } => {
                let exe = self.opts.exe.clone();
                let Some(h) = self.arms.get_mut(&key) else {
                    return Reply::Refused(format!("arm {} does not run here", key.arm));
                };
                h.seen = Instant::now();
                // Only a client that ran to its end (a running one would be orphaned).
                if !matches!(h.exited, Some(Exited::Client { success: true, .. })) {
                    return Reply::Refused(format!(
                        "arm {}'s client did not run to its end",
                        key.arm
                    ));
                }
                h.exited = None;
                let l = Launch {
                    exe: &exe,
                    model: &h.model,
                    args: &h.args,
                };
                match h.procs.restart_client(&l) {
                    Ok(()) => Reply::Done,
                    Err(e) => Reply::Refused(e.to_string()),
                }
            }
            Request::Stop { key } => {
                self.begin_stop(&key, "the driver stopped it");
                Reply::Done
            }
        }
    }

    fn seed(&mut self, key: &ArmKey, from: usize) -> Reply {
        if self.arms.contains_key(key) || self.stopping.contains_key(key) {
            return Reply::Refused(format!("arm {} runs here: it has its own state", key.arm));
        }
        let parent = ArmKey {
            study: key.study.clone(),
            arm: from,
        };
        if let Err(e) = parent.check() {
            return Reply::Refused(e);
        }
        if self.arms.contains_key(&parent) || self.stopping.contains_key(&parent) {
            return Reply::Refused(format!(
                "arm {from} runs here: a copy of its checkpoint would not be the one at its rung"
            ));
        }
        match self.dir(key).seed_from(&self.dir(&parent)) {
            Ok(step) => Reply::Seeded { step },
            Err(e) => Reply::Refused(e.to_string()),
        }
    }

    fn launch(&mut self, key: ArmKey, target: u64, model: String, args: ArmArgs) -> Reply {
        if let Some(h) = self.arms.get_mut(&key) {
            // A driver that lost the answer to its launch, or a resumed one: the arm
            // goes on, towards the target it is given now.
            h.target = target;
            h.seen = Instant::now();
            note(
                &h.procs.dir,
                &format!("taken up again by the driver, to {target} steps"),
            );
            return Reply::Done;
        }
        if self.stopping.contains_key(&key) {
            return Reply::Refused(format!(
                "arm {} is still stopping here (its server drains)",
                key.arm
            ));
        }
        let busy = self.arms.len() + self.stopping.len();
        if busy >= self.opts.slots as usize {
            return Reply::Refused(format!(
                "all {} slot(s) of this worker are taken",
                self.opts.slots
            ));
        }
        let dir = self.dir(&key);
        let started = Procs::start(
            &Launch {
                exe: &self.opts.exe,
                model: &model,
                args: &args,
            },
            dir.clone(),
        );
        match started {
            Ok(procs) => {
                note(&dir, "launched by the study's driver");
                tracing::info!(study = %key.study, arm = key.arm, "launched an arm");
                self.arms.insert(
                    key,
                    Hosted {
                        procs,
                        model,
                        args,
                        target,
                        exited: None,
                        seen: Instant::now(),
                    },
                );
                Reply::Done
            }
            Err(e) => Reply::Refused(e.to_string()),
        }
    }

    fn look(&mut self, key: &ArmKey, from: u64) -> Reply {
        let exe = self.opts.exe.clone();
        let phase = if let Some(h) = self.arms.get_mut(key) {
            h.seen = Instant::now();
            if h.exited.is_none() {
                let l = Launch {
                    exe: &exe,
                    model: &h.model,
                    args: &h.args,
                };
                match h.procs.poll(&l) {
                    Ok(e) => h.exited = e,
                    Err(e) => return Reply::Refused(e.to_string()),
                }
            }
            match &h.exited {
                Some(e) => Phase::Exited(e.clone()),
                None if h.procs.serving() => Phase::Serving,
                None => Phase::Starting,
            }
        } else if self.stopping.contains_key(key) {
            Phase::Stopping
        } else {
            Phase::Gone
        };
        let dir = self.dir(key);
        let (metrics_file, metrics_len, metrics) = dir
            .metrics_path()
            .map(|p| read_lines_from(&p, from))
            .unwrap_or((0, 0, Vec::new()));
        Reply::Look(Look {
            phase,
            run: dir
                .run_dir()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned())),
            metrics_len,
            metrics,
            metrics_file,
            checkpoint_step: dir.checkpoint_step(),
            checkpoint: dir.checkpoint().map(|p| p.display().to_string()),
        })
    }

    fn begin_stop(&mut self, key: &ArmKey, why: &str) {
        let Some(mut h) = self.arms.remove(key) else {
            return;
        };
        note(&h.procs.dir, &format!("stopping: {why}"));
        tracing::info!(study = %key.study, arm = key.arm, "stopping an arm: {why}");
        h.procs.begin_stop();
        self.stopping
            .insert(key.clone(), (h.procs, Instant::now() + SERVER_DRAIN));
    }

    /// Stops the arms at their targets and those of silent drivers; lets go of the arms
    /// that stopped.
    fn tick(&mut self) {
        let at_target: Vec<ArmKey> = self
            .arms
            .iter()
            .filter(|(_, h)| {
                h.procs
                    .dir
                    .metrics_path()
                    .and_then(|p| last_step(&p))
                    .is_some_and(|s| s >= h.target)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in at_target {
            self.begin_stop(&k, "it reached its target");
        }
        let lease = self.opts.lease;
        let silent: Vec<ArmKey> = self
            .arms
            .iter()
            .filter(|(_, h)| h.seen.elapsed() > lease)
            .map(|(k, _)| k.clone())
            .collect();
        for k in silent {
            let why = format!(
                "its driver said nothing for {:.0} s (the lease)",
                lease.as_secs_f64()
            );
            tracing::warn!(study = %k.study, arm = k.arm, "{why}");
            self.begin_stop(&k, &why);
        }
        self.stopping
            .retain(|_, (p, deadline)| !p.finish_stop(*deadline));
    }

    fn shutdown(&mut self) {
        let keys: Vec<ArmKey> = self.arms.keys().cloned().collect();
        for k in keys {
            self.begin_stop(&k, "the worker stops");
        }
        while !self.stopping.is_empty() {
            self.stopping
                .retain(|_, (p, deadline)| !p.finish_stop(*deadline));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The step of the last whole line of a metrics file (its last 8 KiB are read).
fn last_step(path: &std::path::Path) -> Option<u64> {
    use std::io::{Read as _, Seek as _};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(std::io::SeekFrom::Start(len.saturating_sub(8192)))
        .ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let whole = text.rsplit_once('\n')?.0;
    whole
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
}

/// A file's inode and length up to its last whole line (its whole length while more
/// than [`METRICS_CHUNK`] bytes are left), and its whole lines from byte `from` on (at
/// most [`METRICS_CHUNK`] bytes; none when `from` is past its end).
fn read_lines_from(path: &std::path::Path, from: u64) -> (u64, u64, Vec<u8>) {
    use std::io::{Read as _, Seek as _};
    use std::os::unix::fs::MetadataExt as _;
    let Ok(mut f) = std::fs::File::open(path) else {
        return (0, 0, Vec::new());
    };
    let (ino, len) = f.metadata().map(|m| (m.ino(), m.len())).unwrap_or((0, 0));
    if from >= len || f.seek(std::io::SeekFrom::Start(from)).is_err() {
        return (ino, len, Vec::new());
    }
    let mut buf = Vec::new();
    let _ = f.take(METRICS_CHUNK as u64).read_to_end(&mut buf);
    let to_end = from + buf.len() as u64 >= len;
    // A line the server is still writing comes with a later look.
    match buf.iter().rposition(|&b| b == b'\n') {
        Some(i) => buf.truncate(i + 1),
        None => buf.clear(),
    }
    // A partial last line (a server killed mid-write) is not waited for.
    let len = if to_end { from + buf.len() as u64 } else { len };
    (ino, len, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(arm: usize) -> ArmKey {
        ArmKey {
            study: "s-0123456789abcdef".into(),
            arm,
        }
    }

    static DRIVER: std::sync::LazyLock<PeerId> = std::sync::LazyLock::new(PeerId::random);

    fn ask(h: &mut Host, r: Request) -> Reply {
        h.handle(&DRIVER, r)
    }

    /// A key as it is in the driver's space on the worker.
    fn own(k: ArmKey) -> ArmKey {
        ArmKey {
            study: format!("{}-{}", *DRIVER, k.study),
            arm: k.arm,
        }
    }

    fn launch(arm: usize) -> Request {
        Request::Launch {
            key: key(arm),
            steps: 5,
            model: "m".into(),
            server: vec![],
            client: vec![],
            env: vec![],
        }
    }

    fn phase(h: &mut Host, arm: usize) -> Phase {
        match ask(
            h,
            Request::Look {
                key: key(arm),
                metrics_from: 0,
            },
        ) {
            Reply::Look(l) => l.phase,
            other => panic!("{other:?}"),
        }
    }

    /// A host whose arms' "server" is a process that runs until it is signalled.
    fn host(dir: &std::path::Path, lease: Duration) -> Host {
        let exe = dir.join("server.sh");
        std::fs::write(&exe, "#!/bin/sh\nexec sleep 60\n").unwrap();
        std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        Host {
            opts: WorkerOptions {
                dir: dir.join("w"),
                exe,
                allowed: vec![],
                slots: 2,
                lease,
            },
            arms: BTreeMap::new(),
            stopping: BTreeMap::new(),
        }
    }

    fn tick_until(h: &mut Host, arm: usize, want: Phase) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while phase(h, arm) != want {
            assert!(Instant::now() < deadline, "arm {arm} never {want:?}");
            h.tick();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn a_silent_drivers_arm_is_stopped_at_its_lease_and_slots_bound_the_arms() {
        let dir = tempfile::tempdir().unwrap();
        let lease = Duration::from_millis(1500);
        let mut h = host(dir.path(), lease);
        assert_eq!(ask(&mut h, launch(0)), Reply::Done);
        // Launched again (a lost answer, a resumed driver): taken up, not run twice.
        assert_eq!(ask(&mut h, launch(0)), Reply::Done);
        assert_eq!(h.arms.len(), 1);
        assert_eq!(ask(&mut h, launch(1)), Reply::Done);
        assert!(matches!(ask(&mut h, launch(2)), Reply::Refused(r) if r.contains("slot")));
        // A client restart while it runs would orphan it: refused.
        assert!(matches!(
            ask(&mut h, Request::RestartClient { key: key(1) }),
            Reply::Refused(r) if r.contains("did not run to its end")
        ));
        // Another driver sees none of this driver's arms, and cannot touch them.
        let other = PeerId::random();
        assert_eq!(
            h.handle(&other, Request::Hello),
            Reply::Hello {
                slots: 2,
                running: vec![]
            }
        );
        assert_eq!(h.handle(&other, Request::Stop { key: key(0) }), Reply::Done);
        match ask(&mut h, Request::Hello) {
            Reply::Hello { running, .. } => assert_eq!(running, vec![key(0), key(1)]),
            r => panic!("{r:?}"),
        }
        assert_eq!(phase(&mut h, 0), Phase::Starting);
        // Keepalives hold both arms past the lease; then arm 1 alone is looked at.
        let t = Instant::now();
        while t.elapsed() < lease * 2 {
            let study = key(0).study;
            assert_eq!(ask(&mut h, Request::Keepalive { study }), Reply::Done);
            h.tick();
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(phase(&mut h, 0), Phase::Starting, "kept alive");
        let t = Instant::now();
        while t.elapsed() < lease + Duration::from_millis(500) {
            assert_eq!(phase(&mut h, 1), Phase::Starting);
            h.tick();
            std::thread::sleep(Duration::from_millis(100));
        }
        // Arm 0's driver said nothing for the lease: stopped (its process too).
        tick_until(&mut h, 0, Phase::Gone);
        assert_eq!(phase(&mut h, 1), Phase::Starting);
        let log = std::fs::read_to_string(h.dir(&own(key(0))).dir.join("driver.log")).unwrap();
        assert!(
            log.contains("stopping: its driver said nothing for 2 s (the lease)"),
            "{log}"
        );
        // A stop by the driver; then the slots are free again.
        assert_eq!(ask(&mut h, Request::Stop { key: key(1) }), Reply::Done);
        tick_until(&mut h, 1, Phase::Gone);
        assert_eq!(ask(&mut h, launch(2)), Reply::Done);
        h.shutdown();
        assert!(h.arms.is_empty() && h.stopping.is_empty());
    }

    #[test]
    fn a_seed_copies_a_stopped_parents_checkpoint_here_once_and_bad_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = host(dir.path(), Duration::from_secs(60));
        // Arm 4 ran here: its run directory has a checkpoint at step 3 and its metrics.
        let run = h.dir(&own(key(4))).dir.join("server/runs/m");
        std::fs::create_dir_all(run.join("checkpoint")).unwrap();
        std::fs::write(run.join("checkpoint/state.json"), r#"{"step": 3}"#).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
        let seed = |from| Request::Seed { key: key(5), from };
        assert_eq!(ask(&mut h, seed(4)), Reply::Seeded { step: Some(3) });
        let copy = h.dir(&own(key(5))).dir.join("server/runs/m");
        assert!(copy.join("checkpoint/state.json").is_file());
        assert_eq!(
            std::fs::read_to_string(copy.join("metrics.jsonl")).unwrap(),
            "{\"step\":1}\n"
        );
        // Once: a parent that moved on (a server writes its checkpoints anew, never
        // into the old files) is not copied again.
        crate::base::files::write_atomic(&run.join("checkpoint/state.json"), br#"{"step": 6}"#)
            .unwrap();
        assert_eq!(ask(&mut h, seed(4)), Reply::Seeded { step: Some(3) });
        // A running parent (its checkpoint moves) and a running child are refused.
        assert_eq!(ask(&mut h, launch(6)), Reply::Done);
        assert!(matches!(
            ask(
                &mut h,
                Request::Seed {
                    key: key(7),
                    from: 6
                }
            ),
            Reply::Refused(_)
        ));
        assert!(matches!(
            ask(
                &mut h,
                Request::Seed {
                    key: key(6),
                    from: 4
                }
            ),
            Reply::Refused(_)
        ));
        // Keys that would leave the worker's directory.
        let bad = ArmKey {
            study: "../x".into(),
            arm: 0,
        };
        assert!(matches!(
            ask(
                &mut h,
                Request::Look {
                    key: bad,
                    metrics_from: 0
                }
            ),
            Reply::Refused(_)
        ));
        assert!(matches!(
            ask(
                &mut h,
                Request::Seed {
                    key: key(8),
                    from: usize::MAX
                }
            ),
            Reply::Refused(_)
        ));
        h.shutdown();
    }

    #[test]
    fn metrics_come_in_whole_lines_from_the_asked_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(&p, b"{\"step\":1}\n{\"step\":2}\n{\"st").unwrap();
        let (ino, len, bytes) = read_lines_from(&p, 0);
        assert_eq!(len, 22, "up to the last whole line");
        assert_eq!(bytes, b"{\"step\":1}\n{\"step\":2}\n");
        let (_, _, rest) = read_lines_from(&p, 11);
        assert_eq!(rest, b"{\"step\":2}\n");
        assert!(read_lines_from(&p, 22).2.is_empty(), "a line being written");
        assert!(read_lines_from(&p, 100).2.is_empty());
        assert_eq!(
            read_lines_from(&dir.path().join("none"), 0),
            (0, 0, Vec::new())
        );
        assert_eq!(
            last_step(&p),
            Some(2),
            "the line being written does not count"
        );
        assert_eq!(last_step(&dir.path().join("none")), None);
        // Written anew (as a resumed server does): another inode.
        crate::base::files::write_atomic(&p, b"{\"step\":1}\n").unwrap();
        assert_ne!(read_lines_from(&p, 0).0, ino);
    }
}
