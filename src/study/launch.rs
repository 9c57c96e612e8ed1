//! An arm's processes: its server (`agentjet-peer --role server`, its own data directory
//! and its own swarm key, so arms never train as one group) and, once the server serves,
//! its client. Each arm lives in its own directory of the study's:
//!
//! - `server/`: the server's data directory (its run directory, `runs/<model>/`, holds
//!   `metrics.jsonl` and the checkpoint a restarted server resumes from);
//! - `client/`, `client-run/`: the client's data and run directories;
//! - `server.out`, `server.log`, `client.out`, `client.log`: stdout and stderr;
//! - `server.events.jsonl`, `client.events.jsonl`: their typed events (`--events`);
//! - `swarm.key`, `pids.json`.
//!
//! The processes run in their own process group (a Ctrl-C at the terminal reaches the
//! driver alone, which stops them in order) and get SIGTERM if the driver dies (Linux's
//! parent-death signal), so a killed driver's servers drain and save their checkpoints.

use std::io::{self, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::arms::ArmArgs;
use super::error::StudyError;
use super::spec::has_flag;

/// How long a server may take to drain and save its checkpoint before it is killed.
pub const SERVER_DRAIN: Duration = Duration::from_secs(300);
/// How long a client may take to stop before it is killed. Zero: it is killed at once
/// with its agents (its running episodes are beyond the arm's target, and a client that
/// drains submits them, so its server would train past the target on them).
const CLIENT_DRAIN: Duration = Duration::ZERO;

/// An arm's directory.
#[derive(Debug, Clone)]
pub struct ArmDir {
    pub dir: PathBuf,
}

impl ArmDir {
    pub fn new(study_dir: &Path, arm: usize) -> ArmDir {
        ArmDir {
            dir: study_dir.join("arms").join(format!("{arm:03}")),
        }
    }

    fn server_data(&self) -> PathBuf {
        self.dir.join("server")
    }

    /// The server's run directory (`server/runs/<model>`), once it has one.
    pub fn run_dir(&self) -> Option<PathBuf> {
        let runs = self.server_data().join("runs");
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&runs)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        dirs.into_iter()
            .find(|d| d.join("metrics.jsonl").exists() || d.join("checkpoint").exists())
    }

    pub fn metrics_path(&self) -> Option<PathBuf> {
        self.run_dir().map(|d| d.join("metrics.jsonl"))
    }

    /// The server's saved checkpoint (what a restart resumes from: `checkpoint/`, or
    /// `checkpoint.old/` when the server was killed between the two renames of a save).
    pub fn checkpoint(&self) -> Option<PathBuf> {
        let run = self.run_dir()?;
        ["checkpoint", "checkpoint.old"]
            .into_iter()
            .map(|n| run.join(n))
            .find(|c| c.join("state.json").is_file())
    }

    /// Whether this arm got its parent's checkpoint (or found it had none): see
    /// [`ArmDir::seed_from`].
    pub fn seeded(&self) -> bool {
        self.dir.join("seeded").exists()
    }

    /// The step of the server's saved checkpoint (on a worker: as of the driver's last
    /// look, see [`ArmDir::remote`]).
    pub fn checkpoint_step(&self) -> Option<u64> {
        match self.checkpoint() {
            Some(ck) => {
                let text = std::fs::read_to_string(ck.join("state.json")).ok()?;
                serde_json::from_str::<Value>(&text).ok()?["step"].as_u64()
            }
            None => self.remote()?.checkpoint_step,
        }
    }

    /// Where a worker of the swarm runs this arm (`remote.json`), if one does.
    pub fn remote(&self) -> Option<Remote> {
        let text = std::fs::read_to_string(self.dir.join("remote.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub fn set_remote(&self, r: &Remote) -> Result<(), StudyError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| StudyError::io(&self.dir, e))?;
        let path = self.dir.join("remote.json");
        let text = serde_json::to_string(r).expect("a remote record serializes");
        crate::base::files::write_atomic(&path, format!("{text}\n").as_bytes())
            .map_err(|e| StudyError::io(&path, e))
    }

    /// The arm's latest checkpoint, said for a person: its path in the study's
    /// directory, or on the worker that holds it.
    pub fn checkpoint_place(&self, study_dir: &Path) -> Option<String> {
        if let Some(p) = self.checkpoint() {
            return Some(
                p.strip_prefix(study_dir)
                    .unwrap_or(&p)
                    .display()
                    .to_string(),
            );
        }
        let r = self.remote()?;
        Some(format!("{} on worker {}", r.checkpoint?, r.worker))
    }

    fn pids_path(&self) -> PathBuf {
        self.dir.join("pids.json")
    }

    /// Marks this arm seeded (its copy is made, here or on its worker).
    pub fn mark_seeded(&self) -> Result<(), StudyError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| StudyError::io(&self.dir, e))?;
        let m = self.dir.join("seeded");
        crate::base::files::write_atomic(&m, b"").map_err(|e| StudyError::io(&m, e))
    }

    /// Gives this arm's server `parent`'s checkpoint and metrics so far (PBT's exploit):
    /// they are put together in `seeding.tmp/`, then renamed into place as this arm's
    /// run directory, so a driver killed midway leaves no half of them. Nothing is done
    /// once this arm has a run directory. Returns the step its server starts from
    /// (none: the parent has no checkpoint, and this arm starts from the base model).
    pub fn seed_from(&self, parent: &ArmDir) -> Result<Option<u64>, StudyError> {
        if self.seeded() || self.run_dir().is_some() {
            return Ok(self.checkpoint_step());
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| StudyError::io(&self.dir, e))?;
        // Once: a parent with nothing to give now may have something later, which
        // would not be what it had at the rung.
        let mark = || self.mark_seeded();
        let (Some(src), Some(ck)) = (parent.run_dir(), parent.checkpoint()) else {
            mark()?;
            return Ok(None);
        };
        let Some(name) = src.file_name() else {
            mark()?;
            return Ok(None);
        };
        let tmp = self.dir.join("seeding.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        link_tree(&ck, &tmp.join("checkpoint"))?;
        let metrics = src.join("metrics.jsonl");
        if metrics.is_file() {
            // Appended to in place by the server: a copy, never a link.
            std::fs::copy(&metrics, tmp.join("metrics.jsonl"))
                .map_err(|e| StudyError::io(&metrics, e))?;
        }
        let runs = self.server_data().join("runs");
        std::fs::create_dir_all(&runs).map_err(|e| StudyError::io(&runs, e))?;
        let to = runs.join(name);
        std::fs::rename(&tmp, &to).map_err(|e| StudyError::io(&to, e))?;
        mark()?;
        Ok(self.checkpoint_step())
    }
}

/// `from`'s files under `to`, hard-linked where the file system allows (a server writes
/// a new checkpoint beside the old one and renames it, never into the old one's files),
/// copied where it does not.
fn link_tree(from: &Path, to: &Path) -> Result<(), StudyError> {
    std::fs::create_dir_all(to).map_err(|e| StudyError::io(to, e))?;
    for e in std::fs::read_dir(from).map_err(|e| StudyError::io(from, e))? {
        let e = e.map_err(|e| StudyError::io(from, e))?;
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let kind = e.file_type().map_err(|e| StudyError::io(&src, e))?;
        if kind.is_dir() {
            link_tree(&src, &dst)?;
        } else if std::fs::hard_link(&src, &dst).is_err() {
            std::fs::copy(&src, &dst).map_err(|e| StudyError::io(&src, e))?;
        }
    }
    Ok(())
}

/// The driver's record of an arm that a worker of the swarm runs (its directory's
/// `remote.json`): the worker, and the arm's checkpoint there at the driver's last look.
/// Its metrics are mirrored into the arm's directory (`server/runs/<run>/metrics.jsonl`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Remote {
    /// The worker's peer id.
    pub worker: String,
    pub checkpoint_step: Option<u64>,
    /// The checkpoint's path on the worker.
    pub checkpoint: Option<String>,
    /// The inode of the worker's metrics file the mirror copies, and its run
    /// directory's name.
    #[serde(default)]
    pub metrics_file: u64,
    #[serde(default)]
    pub run: Option<String>,
}

/// What to run an arm with.
pub struct Launch<'a> {
    /// The `agentjet-peer` binary.
    pub exe: &'a Path,
    /// The servers' `--model`.
    pub model: &'a str,
    pub args: &'a ArmArgs,
}

/// An arm's running processes.
pub struct Procs {
    pub dir: ArmDir,
    server: Child,
    client: Option<Child>,
    /// The served model's name, once the server serves.
    served: Option<String>,
    pub started: Instant,
}

/// A process of the arm that exited without being asked to (sent as is by a study
/// worker: see [`super::wire`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Exited {
    /// The server, with its status and the end of its log; `usage`: it refused its
    /// command line (exit code 2), which no restart mends.
    Server { detail: String, usage: bool },
    /// The client: `success` when it ran its tasks to the end; `usage` as above.
    Client {
        success: bool,
        usage: bool,
        detail: String,
    },
}

impl Exited {
    fn client(st: ExitStatus) -> Exited {
        Exited::Client {
            success: st.success(),
            usage: st.code() == Some(2),
            detail: st.to_string(),
        }
    }
}

fn open_append(path: &Path) -> Result<std::fs::File, StudyError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| StudyError::io(path, e))
}

/// A command in its own process group that gets SIGTERM when the driver dies.
fn command(exe: &Path, out: &Path, err: &Path) -> Result<Command, StudyError> {
    let mut c = Command::new(exe);
    c.stdin(Stdio::null())
        .stdout(open_append(out)?)
        .stderr(open_append(err)?)
        .process_group(0);
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid), no
    // allocation.
    unsafe {
        c.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            // The driver died before the prctl: run nothing (a signal raised here would
            // reach the driver's inherited handlers, not end the child).
            if libc::getppid() as u32 != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    Ok(c)
}

/// The lines of an events file that parse.
fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The server's address to bootstrap from (a loopback one first), from its `started`
/// event.
fn bootstrap_addr(events: &[Value]) -> Option<String> {
    events
        .iter()
        .filter(|e| e["event"] == "started")
        .flat_map(|e| e["listen"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a.as_str().map(str::to_string))
        .min_by_key(|a| !a.contains("/127.0.0.1/"))
}

impl Procs {
    /// Starts the arm's server (the client follows once it serves: [`Procs::poll`]).
    pub fn start(l: &Launch, dir: ArmDir) -> Result<Procs, StudyError> {
        std::fs::create_dir_all(&dir.dir).map_err(|e| StudyError::io(&dir.dir, e))?;
        let key = dir.dir.join("swarm.key");
        if !key.exists() {
            crate::base::files::write_secret(
                &key,
                crate::swarm::SwarmKey::generate().to_file_text().as_bytes(),
            )
            .map_err(|e| StudyError::io(&key, e))?;
        }
        let events = dir.dir.join("server.events.jsonl");
        let _ = std::fs::remove_file(&events);
        let mut c = command(
            l.exe,
            &dir.dir.join("server.out"),
            &dir.dir.join("server.log"),
        )?;
        c.args(["--role", "server", "--model", l.model])
            .arg("--data-dir")
            .arg(dir.server_data())
            .arg("--events")
            .arg(&events)
            .arg("--swarm-key")
            .arg(&key);
        if !has_flag(&l.args.server, "--listen") {
            c.args(["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"]);
        }
        c.args(&l.args.server);
        let server = c.spawn().map_err(|e| StudyError::Launch {
            arm: dir.dir.display().to_string(),
            msg: format!("{}: {e}", l.exe.display()),
        })?;
        let p = Procs {
            dir,
            server,
            client: None,
            served: None,
            started: Instant::now(),
        };
        p.write_pids()?;
        Ok(p)
    }

    fn write_pids(&self) -> Result<(), StudyError> {
        let v = serde_json::json!({
            "server": self.server.id(),
            "client": self.client.as_ref().map(Child::id),
        });
        let path = self.dir.pids_path();
        crate::base::files::write_atomic(&path, format!("{v}\n").as_bytes())
            .map_err(|e| StudyError::io(&path, e))
    }

    /// Whether the client runs (the server served).
    pub fn serving(&self) -> bool {
        self.client.is_some()
    }

    /// Starts the client once the server serves; says which process exited on its own.
    pub fn poll(&mut self, l: &Launch) -> Result<Option<Exited>, StudyError> {
        if let Some(st) = self
            .server
            .try_wait()
            .map_err(|e| StudyError::io(&self.dir.dir, e))?
        {
            return Ok(Some(Exited::Server {
                detail: format!(
                    "{st}; the end of its log: {}",
                    tail(&self.dir.dir.join("server.log"))
                ),
                usage: st.code() == Some(2),
            }));
        }
        if let Some(c) = &mut self.client {
            if let Some(st) = c.try_wait().map_err(|e| StudyError::io(&self.dir.dir, e))? {
                self.client = None;
                return Ok(Some(Exited::client(st)));
            }
            return Ok(None);
        }
        let ev = events(&self.dir.dir.join("server.events.jsonl"));
        let addr = bootstrap_addr(&ev);
        let served = ev
            .iter()
            .find(|e| e["event"] == "serving")
            .and_then(|e| e["model"].as_str().map(str::to_string));
        if let (Some(addr), Some(served)) = (addr, served) {
            self.start_client(l, &addr, &served)?;
            self.served = Some(served);
        }
        Ok(None)
    }

    fn start_client(&mut self, l: &Launch, addr: &str, served: &str) -> Result<(), StudyError> {
        let d = &self.dir.dir;
        let events = d.join("client.events.jsonl");
        let _ = std::fs::remove_file(&events);
        let mut c = command(l.exe, &d.join("client.out"), &d.join("client.log"))?;
        c.args(["--role", "client", "--model", served, "--bootstrap", addr])
            .arg("--data-dir")
            .arg(d.join("client"))
            .arg("--run-dir")
            .arg(d.join("client-run"))
            .arg("--events")
            .arg(&events)
            .arg("--swarm-key")
            .arg(d.join("swarm.key"));
        if !has_flag(&l.args.client, "--listen") {
            c.args(["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"]);
        }
        c.args(&l.args.client).envs(&l.args.env);
        self.client = Some(c.spawn().map_err(|e| StudyError::Launch {
            arm: d.display().to_string(),
            msg: format!("client: {e}"),
        })?);
        self.write_pids()
    }

    /// Starts the client again (it ran its tasks to the end).
    pub fn restart_client(&mut self, l: &Launch) -> Result<(), StudyError> {
        self.client = None;
        let addr = bootstrap_addr(&events(&self.dir.dir.join("server.events.jsonl")));
        match (addr, self.served.clone()) {
            (Some(a), Some(s)) => self.start_client(l, &a, &s),
            _ => Ok(()),
        }
    }

    /// Stops the client, then the server (which drains and saves its checkpoint).
    pub fn stop(self) {
        drop(self)
    }

    /// Starts a stop without waiting for it: the client is killed at once, the server
    /// gets SIGTERM (it drains and saves its checkpoint). See [`Procs::finish_stop`].
    pub fn begin_stop(&mut self) {
        if let Some(c) = &mut self.client {
            stop_child(c, CLIENT_DRAIN);
        }
        self.client = None;
        if matches!(self.server.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child's pid (not yet waited for).
            unsafe {
                libc::kill(self.server.id() as i32, libc::SIGTERM);
            }
        }
    }

    /// Whether the server stopped, after [`Procs::begin_stop`]; one still running at
    /// `deadline` is killed with its process group.
    pub fn finish_stop(&mut self, deadline: Instant) -> bool {
        if matches!(self.server.try_wait(), Ok(Some(_))) {
            return true;
        }
        if Instant::now() < deadline {
            return false;
        }
        stop_child(&mut self.server, Duration::ZERO);
        true
    }
}

/// However the driver lets go of an arm (a stop, an error, a panic), its processes stop.
impl Drop for Procs {
    fn drop(&mut self) {
        if let Some(c) = &mut self.client {
            stop_child(c, CLIENT_DRAIN);
        }
        stop_child(&mut self.server, SERVER_DRAIN);
        let _ = std::fs::remove_file(self.dir.pids_path());
    }
}

/// The last lines of a log, on one line.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(3).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// SIGTERM, up to `drain` for the process to exit, then SIGKILL to its process group
/// (what it started there, a client's agents, goes with it).
fn stop_child(c: &mut Child, drain: Duration) {
    if matches!(c.try_wait(), Ok(Some(_))) {
        return;
    }
    if !drain.is_zero() {
        // SAFETY: kill(2) on our own child's pid (not yet waited for, so not reused).
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + drain;
    while Instant::now() < deadline {
        if matches!(c.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) of the child's own process group (it leads it: process_group(0)).
    unsafe {
        libc::kill(-(c.id() as i32), libc::SIGKILL);
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// Whether `pid` runs (a zombie does not) with `needle` on its command line.
fn alive_with(pid: i32, needle: &str) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command's closing parenthesis.
    let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start());
    if state.is_none_or(|s| s.starts_with('Z') || s.starts_with('X')) {
        return false;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline).contains(needle)
}

/// Stops what a previous driver left of an arm (its `pids.json`): a driver killed
/// mid-arm leaves its processes draining, and two servers must never share a data
/// directory. Returns how many it stopped.
pub fn stop_leftovers(dir: &ArmDir) -> usize {
    let Ok(text) = std::fs::read_to_string(dir.pids_path()) else {
        return 0;
    };
    let v: Value = serde_json::from_str(&text).unwrap_or_default();
    let needle = dir.dir.display().to_string();
    let mut stopped = 0;
    // The client first: it feeds the server.
    for (key, drain) in [("client", Duration::from_secs(5)), ("server", SERVER_DRAIN)] {
        let Some(pid) = v[key].as_u64().map(|p| p as i32) else {
            continue;
        };
        if !alive_with(pid, &needle) {
            continue;
        }
        stopped += 1;
        // SAFETY: kill(2); the pid was checked to be this arm's process just now.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + drain;
        while alive_with(pid, &needle) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        if alive_with(pid, &needle) {
            // SAFETY: as above.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while alive_with(pid, &needle) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let _ = std::fs::remove_file(dir.pids_path());
    stopped
}

/// Appends a line to the arm's own record of what the driver did to it.
pub fn note(dir: &ArmDir, line: &str) {
    if let Ok(mut f) = open_append(&dir.dir.join("driver.log")) {
        let _ = writeln!(f, "{} {line}", super::journal::unix_ms());
    }
}
