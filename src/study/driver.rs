//! The driver: launches arms (at most the budget's at once, lowest id first), watches
//! them, stops each at its target, applies the policy's decisions, and restarts an arm
//! whose server crashed or stalled from its checkpoint. Every fact it acts on goes to
//! the journal first, so a driver killed anywhere and started again on the same
//! directory ends as an uninterrupted one would have. A new arm that starts from another
//! arm's checkpoint (PBT) gets its copy right after its journal line, before any launch.
//! With the `researcher` policy, the driver asks the researcher for a turn whenever the
//! study waits on it (see [`super::researcher`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arms::{arm_args, arms, default_name, Arm, ArmArgs};
use super::error::StudyError;
use super::journal::{unix_ms, Action, Journal, Phase, Record, State};
use super::launch::{note, stop_leftovers, ArmDir, Exited, Launch, Procs};
use super::policy::{Move, Policy, Spawn};
use super::remote::{Running, Workers};
use super::researcher::{self, tools, Effect, Reply, Researcher};
use super::spec::{PolicyKind, Study};
use super::watch;
use crate::swarm::PeerId;

/// Consecutive failed calls of the researcher's endpoint before the driver gives up, once
/// no arm runs (it waits 2, 4, 8, ... up to 60 s between them).
const ENDPOINT_TRIES: u32 = 8;

/// How long a driver waits before it asks a worker again to launch an arm it did not.
const RELAUNCH_PAUSE: Duration = Duration::from_secs(10);

/// Where an arm's checkpoint is, so where it runs.
enum Place {
    /// Nowhere yet: any worker with room, or the driver's machine.
    Free,
    Local,
    Worker(PeerId),
}

/// How a driver runs.
pub struct Options {
    /// The `agentjet-peer` binary the arms run.
    pub exe: PathBuf,
    /// The study's directory (journal, arms, report).
    pub dir: PathBuf,
    /// Set (by a signal) to stop: the running arms are stopped (their servers save their
    /// checkpoints) and the driver returns; run it again to go on.
    pub stop: Arc<AtomicBool>,
    /// How often running arms are looked at.
    pub poll: Duration,
}

/// How a driver's run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The study ended; its winner (id and name).
    Ended {
        winner: Option<(usize, String)>,
        reason: String,
    },
    /// Stopped on request before its end; running it again goes on.
    Paused,
}

/// A running arm.
struct Live {
    procs: Running,
    args: ArmArgs,
    /// When the count of steps last grew (or the arm started).
    progress_at: Instant,
    steps_seen: usize,
}

struct Driver<'a> {
    study: &'a Study,
    opts: &'a Options,
    journal: Journal,
    policy: Policy,
    state: State,
    live: BTreeMap<usize, Live>,
    researcher: Option<Arc<Researcher>>,
    /// Records written by this driver that are not a researcher's call: the study
    /// changed since `quiet_at` when this moved.
    changes: usize,
    /// `changes` when the researcher last passed a turn without changing the study.
    quiet_at: Option<usize>,
    endpoint_errors: u32,
    retry_at: Option<Instant>,
    /// Study workers of a swarm (the study's `[workers]`).
    workers: Option<Workers>,
    /// Arms of workers to launch again, and when (after a crash or a refused launch).
    relaunch: BTreeMap<usize, Instant>,
}

/// Runs (or resumes) the study in `opts.dir`.
pub fn run(study: &Study, opts: &Options) -> Result<Outcome, StudyError> {
    std::fs::create_dir_all(&opts.dir).map_err(|e| StudyError::io(&opts.dir, e))?;
    // One spelling of the directory (the processes' command lines are matched against it
    // when a later driver looks for what this one left), and one driver at a time.
    let dir = opts
        .dir
        .canonicalize()
        .map_err(|e| StudyError::io(&opts.dir, e))?;
    let _lock = lock_dir(&dir)?;
    let opts = &Options {
        exe: opts.exe.clone(),
        dir,
        stop: opts.stop.clone(),
        poll: opts.poll,
    };
    let journal = Journal::at(&opts.dir);
    let policy = Policy::new(study);
    let researcher = match &study.policy {
        PolicyKind::Researcher(r) => Some(Arc::new(Researcher::new(r)?)),
        _ => None,
    };
    let mut records = journal.read()?;
    if records.is_empty() {
        let r = Record::Study {
            name: study.name.clone(),
            hash: study.hash.clone(),
            seed: study.seed,
            arms: arms(study),
            unix_ms: unix_ms(),
        };
        journal.append(&r)?;
        records.push(r);
    } else {
        let r = Record::Resumed { unix_ms: unix_ms() };
        if let Some(Record::Study { hash, .. }) = records.first() {
            if *hash != study.hash {
                return Err(StudyError::Journal {
                    path: journal.path.clone(),
                    msg: format!(
                        "it is the journal of another study file (hash {}, this file's {}): \
                         give the study another --dir, or restore the file it ran with",
                        hash.get(..12).unwrap_or(hash),
                        study.hash.get(..12).unwrap_or(&study.hash)
                    ),
                });
            }
        }
        journal.append(&r)?;
        records.push(r);
    }
    let state = State::replay(&records, policy.first()).map_err(|msg| StudyError::Journal {
        path: journal.path.clone(),
        msg,
    })?;
    let workers = match &study.workers {
        Some(w) => Some(Workers::start(study, w, &opts.dir)?),
        None => None,
    };
    let mut d = Driver {
        study,
        opts,
        journal,
        policy,
        state,
        live: BTreeMap::new(),
        researcher,
        changes: 0,
        quiet_at: None,
        endpoint_errors: 0,
        retry_at: None,
        workers,
        relaunch: BTreeMap::new(),
    };
    let out = d.drive();
    // Whatever ended the loop, no arm is left running.
    let ids: Vec<usize> = d.live.keys().copied().collect();
    for id in ids {
        d.stop_live(id);
    }
    out
}

/// An exclusive lock on the study's directory (`driver.lock`), held while the returned
/// file is open: a second driver of the same study is refused.
fn lock_dir(dir: &Path) -> Result<std::fs::File, StudyError> {
    use std::os::fd::AsRawFd as _;
    let path = dir.join("driver.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StudyError::io(&path, e))?;
    // SAFETY: flock(2) on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(StudyError::io(
            &path,
            "another driver runs this study now (its lock is held)",
        ));
    }
    Ok(f)
}

impl Driver<'_> {
    fn record(&mut self, r: Record) -> Result<(), StudyError> {
        if !matches!(r, Record::Action { .. }) {
            self.changes += 1;
        }
        self.journal.append(&r)?;
        self.state.apply(&r).map_err(|msg| StudyError::Journal {
            path: self.journal.path.clone(),
            msg,
        })
    }

    fn name(&self, arm: usize) -> String {
        format!("arm {arm} ({})", self.state.arms[arm].arm.name)
    }

    fn drive(&mut self) -> Result<Outcome, StudyError> {
        if let Some((winner, reason)) = self.state.ended.clone() {
            println!("study {}: ended before ({reason})", self.study.name);
            return Ok(self.ended(winner, reason));
        }
        let deadline = self.study.budget.minutes.map(|m| {
            let started = std::time::UNIX_EPOCH + Duration::from_millis(self.state.started_unix_ms);
            started + Duration::from_secs_f64(m * 60.0)
        });
        let out_of_time = || deadline.is_some_and(|d| std::time::SystemTime::now() >= d);
        if out_of_time() {
            return self.out_of_time();
        }
        // New arms whose copy of their parent's checkpoint a killed driver did not make.
        for id in 0..self.state.arms.len() {
            self.seed(id)?;
        }
        if let Some(out) = self.finish_pending()? {
            return Ok(out);
        }
        self.pick_up_running()?;
        loop {
            if self.opts.stop.load(Ordering::SeqCst) {
                println!(
                    "study {}: stopping its arms; run the same command again to go on",
                    self.study.name
                );
                return Ok(Outcome::Paused);
            }
            // Before any decision: a decision the budget would end is not taken.
            if out_of_time() {
                return self.out_of_time();
            }
            let moves = match &self.study.policy {
                PolicyKind::Pbt(p) => super::pbt::decide(
                    p,
                    &self.policy,
                    &self.study.space,
                    self.study.seed,
                    &self.state,
                ),
                _ => self.policy.moves(&self.state),
            };
            for m in moves {
                match m {
                    Move::Decide(dec) => {
                        println!("{}: {:?}: {}", self.name(dec.arm), dec.action, dec.reason);
                        self.record(Record::Decision {
                            arm: dec.arm,
                            action: dec.action,
                            steps: dec.steps,
                            reason: dec.reason,
                            unix_ms: unix_ms(),
                        })?;
                    }
                    Move::Spawn(sp) => {
                        self.spawn(sp)?;
                    }
                }
            }
            if self.researcher.is_some() {
                if let Some(out) = self.researcher_step()? {
                    return Ok(out);
                }
            } else {
                let done = self
                    .state
                    .arms
                    .iter()
                    .all(|a| matches!(a.phase, Phase::Stopped | Phase::Finished));
                if done {
                    return self.end("every arm finished or stopped");
                }
            }
            self.launch_waiting()?;
            let ids: Vec<usize> = self.live.keys().copied().collect();
            for id in ids {
                self.look_at(id)?;
            }
            std::thread::sleep(self.opts.poll);
        }
    }

    /// Writes a new arm to the journal, then gives it its parent's checkpoint.
    fn spawn(&mut self, sp: Spawn) -> Result<usize, StudyError> {
        let id = self.state.arms.len();
        println!(
            "arm {id} ({}): new, to {} steps: {}",
            sp.name, sp.steps, sp.reason
        );
        self.record(Record::Arm {
            arm: Arm {
                id,
                name: sp.name,
                values: sp.values,
            },
            from: sp.from,
            steps: sp.steps,
            reason: sp.reason,
            unix_ms: unix_ms(),
        })?;
        self.seed(id)?;
        Ok(id)
    }

    /// Gives a new arm that starts from another's checkpoint its copy (once, before its
    /// first launch; the parent does not run in between: a rung's moves are all written
    /// before any launch).
    fn seed(&mut self, id: usize) -> Result<(), StudyError> {
        let a = &self.state.arms[id];
        let Some(o) = a.from else { return Ok(()) };
        if a.launches > 0 || a.phase != Phase::Waiting {
            return Ok(());
        }
        let dir = ArmDir::new(&self.opts.dir, id);
        if dir.seeded() || dir.run_dir().is_some() {
            return Ok(());
        }
        let at = match self.home_worker(o.arm) {
            // The parent's checkpoint is on a worker: the copy is made there, and the
            // new arm runs there.
            Some(w) => {
                let Some(ws) = &self.workers else {
                    return Err(self.no_workers(o.arm));
                };
                if !ws.usable(&w) {
                    ws.tell_waiting(id, &w);
                    return Ok(());
                }
                match ws.seed(w, id, o.arm) {
                    Ok(at) => {
                        dir.mark_seeded()?;
                        at
                    }
                    // Tried again before its launch (it waits for the copy).
                    Err(e) => {
                        println!(
                            "{}: copying arm {}'s checkpoint on worker {w}: {e}; trying again later",
                            self.name(id),
                            o.arm
                        );
                        return Ok(());
                    }
                }
            }
            None => dir.seed_from(&ArmDir::new(&self.opts.dir, o.arm))?,
        };
        let line = match at {
            Some(s) => format!("starts from arm {}'s checkpoint at step {s}", o.arm),
            None => format!(
                "arm {} has no checkpoint: starts from the base model",
                o.arm
            ),
        };
        println!("{}: {line}", self.name(id));
        note(&dir, &line);
        Ok(())
    }

    /// Carries out the researcher's last call if a killed driver wrote it but not its
    /// effect (nothing was written in between, so the check gives what it gave then).
    fn finish_pending(&mut self) -> Result<Option<Outcome>, StudyError> {
        let Some(Record::Action { n, tool, args, .. }) = self.state.pending.clone() else {
            return Ok(None);
        };
        let Some(spec) = self.researcher.as_ref().map(|r| r.spec.clone()) else {
            return Ok(None);
        };
        let turn = tools::TurnSoFar::default();
        match tools::check(self.study, &spec, &self.state, &turn, &tool, &args) {
            Ok((effect, reason)) => {
                println!("researcher call {n} ({tool}): carried out after the resume");
                self.carry_out(effect, &reason)
            }
            Err(why) => {
                println!(
                    "researcher call {n} ({tool}) cannot be carried out after the resume: {why}"
                );
                self.state.pending = None;
                Ok(None)
            }
        }
    }

    /// The researcher's part of a loop: a turn when the study waits on it; once its
    /// calls ran out, arms at their steps finish and the study ends when none runs.
    fn researcher_step(&mut self) -> Result<Option<Outcome>, StudyError> {
        let Some((max, max_arms, most)) = self.researcher.as_ref().map(|r| {
            (
                r.spec.max_actions as usize,
                r.spec.max_arms,
                r.spec.steps.last().copied().unwrap_or(0),
            )
        }) else {
            return Ok(None);
        };
        // A run at the most steps a run may take has nothing left to decide.
        let done: Vec<usize> = (0..self.state.arms.len())
            .filter(|&i| {
                self.state.arms[i].phase == Phase::Reached && self.state.arms[i].target >= most
            })
            .collect();
        for id in done {
            self.record(Record::Decision {
                arm: id,
                action: Action::Finish,
                steps: self.state.arms[id].target,
                reason: format!("ran the most steps a run may take ({most})"),
                unix_ms: unix_ms(),
            })?;
        }
        let arms = &self.state.arms;
        let running = arms
            .iter()
            .filter(|a| matches!(a.phase, Phase::Waiting | Phase::Running))
            .count();
        if self.state.actions.len() >= max {
            let reached: Vec<usize> = (0..arms.len())
                .filter(|&i| arms[i].phase == Phase::Reached)
                .collect();
            for id in reached {
                self.record(Record::Decision {
                    arm: id,
                    action: Action::Finish,
                    steps: self.state.arms[id].target,
                    reason: "the researcher's tool calls ran out".into(),
                    unix_ms: unix_ms(),
                })?;
            }
            if running == 0 {
                return self.end("the researcher's tool calls ran out").map(Some);
            }
            return Ok(None);
        }
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return Ok(None);
        }
        let arms = &self.state.arms;
        let waits = arms.iter().any(|a| a.phase == Phase::Reached);
        let room = running < self.study.budget.at_once && arms.len() < max_arms;
        // Nothing runs: only the researcher can move the study. Otherwise it is asked
        // again once the study changed since it last passed.
        if running == 0 || ((waits || room) && self.quiet_at != Some(self.changes)) {
            return self.researcher_turn();
        }
        Ok(None)
    }

    /// Up to `calls_per_turn` calls of the researcher; the turn ends at the first call
    /// that changes the study.
    fn researcher_turn(&mut self) -> Result<Option<Outcome>, StudyError> {
        let Some(r) = self.researcher.take() else {
            return Ok(None);
        };
        let out = self.turn(&r);
        self.researcher = Some(r);
        out
    }

    /// One call of the researcher on a thread of its own, the running arms looked at
    /// every poll meanwhile; `None` when a stop came first (the call is left to end on
    /// its own, its answer dropped, nothing journaled).
    fn ask_watching(
        &mut self,
        r: &Arc<Researcher>,
        prompt: (String, String),
        tools: Vec<serde_json::Value>,
    ) -> Result<Option<Result<Reply, String>>, StudyError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let r = r.clone();
        std::thread::Builder::new()
            .name("researcher-call".into())
            .spawn(move || {
                let _ = tx.send(r.ask(prompt, &tools));
            })
            .map_err(|e| StudyError::Researcher(format!("a thread for its call: {e}")))?;
        loop {
            match rx.recv_timeout(self.opts.poll) {
                Ok(answer) => return Ok(Some(answer)),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Ok(Some(
                        Err("the call's thread ended without an answer".into()),
                    ))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            }
            if self.opts.stop.load(Ordering::SeqCst) {
                return Ok(None);
            }
            let ids: Vec<usize> = self.live.keys().copied().collect();
            for id in ids {
                self.look_at(id)?;
            }
        }
    }

    fn turn(&mut self, r: &Arc<Researcher>) -> Result<Option<Outcome>, StudyError> {
        let mut calls: Vec<(String, String)> = Vec::new();
        let mut spent: Vec<String> = Vec::new();
        for k in 0..r.spec.calls_per_turn {
            if self.state.actions.len() >= r.spec.max_actions as usize
                || self.opts.stop.load(Ordering::SeqCst)
            {
                break;
            }
            // The turn's last call while the study waits on the researcher must move it.
            let stuck = self
                .state
                .arms
                .iter()
                .all(|a| !matches!(a.phase, Phase::Waiting | Phase::Running))
                || self.state.arms.iter().any(|a| a.phase == Phase::Reached);
            let turn = tools::TurnSoFar {
                spent: spent.clone(),
                must_change: stuck && k + 1 == r.spec.calls_per_turn,
            };
            let offered = tools::offer(self.study, &r.spec, &self.state, &turn);
            let prompt =
                researcher::prompt(self.study, &r.spec, &self.opts.dir, &self.state, &calls);
            let Some(answer) = self.ask_watching(r, prompt, offered)? else {
                return Ok(None);
            };
            let reply = match answer {
                Ok(x) => {
                    self.endpoint_errors = 0;
                    x
                }
                Err(e) => {
                    self.endpoint_errors += 1;
                    // Running arms go on meanwhile; with none, the driver gives up.
                    if self.endpoint_errors >= ENDPOINT_TRIES && self.live.is_empty() {
                        return Err(StudyError::Researcher(format!(
                            "{} calls in a row failed, the last: {e}; \
                             run the study again once its endpoint answers",
                            self.endpoint_errors
                        )));
                    }
                    let wait = Duration::from_secs((1u64 << self.endpoint_errors.min(6)).min(60));
                    println!(
                        "the researcher's endpoint failed ({e}); trying again in {} s",
                        wait.as_secs()
                    );
                    self.retry_at = Some(Instant::now() + wait);
                    return Ok(None);
                }
            };
            let n = self.state.actions.len() as u32 + 1;
            let (tool, args, checked) = match reply {
                Reply::Call { tool, args } => {
                    let c = tools::check(self.study, &r.spec, &self.state, &turn, &tool, &args);
                    (tool, args, c)
                }
                Reply::Text { content, finish } => (
                    String::new(),
                    serde_json::json!({ "text": content }),
                    Err(format!(
                        "an answer in text, not a tool call (finish reason {finish:?})"
                    )),
                ),
            };
            let result = match &checked {
                Ok((e, _)) => self.describe(e),
                Err(why) => format!("refused: {why}"),
            };
            println!("researcher call {n}: {tool} {args} -> {result}");
            self.record(Record::Action {
                n,
                tool: tool.clone(),
                args: args.clone(),
                valid: checked.is_ok(),
                result: result.clone(),
                unix_ms: unix_ms(),
            })?;
            calls.push((format!("{tool} {args}"), result));
            if let Ok((effect, reason)) = checked {
                let changes = effect.changes();
                if !changes {
                    spent.push(tool.clone());
                }
                if let Some(out) = self.carry_out(effect, &reason)? {
                    return Ok(Some(out));
                }
                if changes {
                    self.quiet_at = None;
                    return Ok(None);
                }
            }
        }
        self.quiet_at = Some(self.changes);
        Ok(None)
    }

    /// What a valid call does, in words (a list or a read: the text it shows).
    fn describe(&self, e: &Effect) -> String {
        let dir = &self.opts.dir;
        match e {
            Effect::ListRuns => researcher::runs_table(self.study, dir, &self.state),
            Effect::ReadRun(arm) => researcher::read_run(self.study, dir, &self.state, *arm),
            Effect::Note(_) => "noted".into(),
            Effect::Start { values, steps } => format!(
                "starts run {} ({}) to {steps} steps",
                self.state.arms.len(),
                default_name(values)
            ),
            Effect::Continue { arm, steps } => format!("run {arm} goes on to {steps} steps"),
            Effect::Stop(arm) => format!("run {arm} stops"),
            Effect::Finish(w) => match w {
                Some(w) => format!("the study ends; the winner is run {w}"),
                None => "the study ends without a winner".into(),
            },
        }
    }

    /// Carries out a valid call (the call is in the journal already).
    fn carry_out(&mut self, e: Effect, reason: &str) -> Result<Option<Outcome>, StudyError> {
        let why = format!("the researcher: {reason}");
        match e {
            Effect::ListRuns | Effect::ReadRun(_) | Effect::Note(_) => {}
            Effect::Start { values, steps } => {
                self.spawn(Spawn {
                    name: default_name(&values),
                    values,
                    from: None,
                    steps,
                    reason: why,
                })?;
            }
            Effect::Continue { arm, steps } => self.record(Record::Decision {
                arm,
                action: Action::Continue,
                steps,
                reason: why,
                unix_ms: unix_ms(),
            })?,
            Effect::Stop(arm) => {
                self.record(Record::Decision {
                    arm,
                    action: Action::Stop,
                    steps: self.state.arms[arm].target,
                    reason: why,
                    unix_ms: unix_ms(),
                })?;
                if self.live.contains_key(&arm) {
                    self.stop_live(arm);
                } else {
                    // A call carried out after a resume: what the last driver left runs.
                    self.stop_left(arm)?;
                }
            }
            Effect::Finish(winner) => {
                self.stop_open(&why)?;
                let reason = format!("the researcher finished the study: {reason}");
                self.record(Record::End {
                    winner,
                    reason: reason.clone(),
                    unix_ms: unix_ms(),
                })?;
                return Ok(Some(self.ended(winner, reason)));
            }
        }
        Ok(None)
    }

    /// Arms the journal says were running when the last driver stopped: whatever is
    /// left of their processes is stopped (their servers save their checkpoints), and
    /// they are launched again from there.
    fn pick_up_running(&mut self) -> Result<(), StudyError> {
        let running: Vec<usize> = (0..self.state.arms.len())
            .filter(|&i| self.state.arms[i].phase == Phase::Running)
            .collect();
        for id in running {
            let dir = ArmDir::new(&self.opts.dir, id);
            if let Some(w) = self.home_worker(id) {
                self.pick_up_remote(id, w)?;
                continue;
            }
            let n = self.stop_left(id)?;
            println!(
                "{}: was running when the last driver stopped; {n} of its processes were left and are stopped now",
                self.name(id)
            );
            note(
                &dir,
                &format!("picked up; stopped {n} leftover process(es)"),
            );
            let target = self.state.arms[id].target;
            if dir.checkpoint_step().is_some_and(|s| s >= target) {
                // It got there before the last driver could write so.
                self.reached(id, &dir)?;
                continue;
            }
            let attempt = self.state.arms[id].attempt.max(1);
            self.launch(id, attempt, self.home_worker(id))?;
        }
        Ok(())
    }

    /// Picks up an arm that was running on worker `w`: taken up again there (the worker
    /// has it still running, or resumes it from its checkpoint), once the worker is in
    /// the view; an arm already at its target there is stopped and has reached it.
    fn pick_up_remote(&mut self, id: usize, w: PeerId) -> Result<(), StudyError> {
        let missing = self.no_workers(id);
        let name = self.name(id);
        let dir = ArmDir::new(&self.opts.dir, id);
        let target = self.state.arms[id].target;
        let Some(ws) = self.workers.as_mut() else {
            return Err(missing);
        };
        if !ws.wait_for(&w) {
            println!("{name}: was running when the last driver stopped, on worker {w}, which is not in the swarm's view: it is taken up once it is");
            self.relaunch.insert(id, Instant::now());
            return Ok(());
        }
        let phase = ws.peek(w, id, &dir);
        println!(
            "{name}: was running when the last driver stopped; on worker {w} it is {}",
            match &phase {
                Ok(p) => format!("{p:?}"),
                Err(e) => format!("not known ({e})"),
            }
        );
        note(&dir, &format!("picked up on worker {w}: {phase:?}"));
        if matches!(phase, Ok(super::wire::Phase::Stopping)) {
            // Its checkpoint is saved once it is gone.
            self.stop_left(id)?;
        }
        if dir.checkpoint_step().is_some_and(|s| s >= target) {
            // It got there before the last driver could write so.
            self.stop_left(id)?;
            return self.reached(id, &dir);
        }
        let attempt = self.state.arms[id].attempt.max(1);
        self.launch(id, attempt, Some(w))
    }

    /// Stops what is left of arm `id` that this driver does not hold (a killed driver's
    /// processes, here or on the arm's worker); returns how many processes were left.
    fn stop_left(&mut self, id: usize) -> Result<usize, StudyError> {
        self.relaunch.remove(&id);
        let dir = ArmDir::new(&self.opts.dir, id);
        let Some(w) = self.home_worker(id) else {
            return Ok(stop_leftovers(&dir));
        };
        let missing = self.no_workers(id);
        let Some(ws) = self.workers.as_mut() else {
            return Err(missing);
        };
        if !ws.wait_for(&w) {
            println!(
                "arm {id}: its worker {w} is not in the swarm's view; whatever runs of it there stops when this driver's lease runs out"
            );
            return Ok(0);
        }
        match ws.stop(w, id, &dir) {
            Ok(was) => Ok(usize::from(was)),
            Err(e) => {
                println!("arm {id}: stopping it on worker {w}: {e}");
                Ok(0)
            }
        }
    }

    /// Stops a running arm of this driver (its server saves its checkpoint).
    fn stop_live(&mut self, id: usize) {
        self.relaunch.remove(&id);
        let Some(l) = self.live.remove(&id) else {
            return;
        };
        let busy: std::collections::BTreeSet<PeerId> = self
            .live
            .values()
            .filter_map(|l| l.procs.worker())
            .collect();
        l.procs.stop(self.workers.as_ref(), |w| busy.contains(w));
    }

    /// Whether arm `id` is the parent of a new arm whose copy of its checkpoint is not
    /// made yet.
    fn awaits_copy(&self, id: usize) -> bool {
        self.state.arms.iter().enumerate().any(|(c, a)| {
            a.from.is_some_and(|o| o.arm == id)
                && a.launches == 0
                && a.phase == Phase::Waiting
                && !ArmDir::new(&self.opts.dir, c).seeded()
                && ArmDir::new(&self.opts.dir, c).run_dir().is_none()
        })
    }

    fn no_workers(&self, id: usize) -> StudyError {
        StudyError::Launch {
            arm: format!("{id}"),
            msg: "it ran on a study worker (its checkpoint is there), and the study file \
                  has no [workers] now: put them back to go on"
                .into(),
        }
    }

    /// The worker that holds arm `id`'s checkpoint: where its last launch ran or, never
    /// launched, where its parent's did (none: the driver's machine, or nowhere yet).
    fn home_worker(&self, id: usize) -> Option<PeerId> {
        match self.home(id) {
            Place::Worker(w) => Some(w),
            _ => None,
        }
    }

    fn home(&self, id: usize) -> Place {
        let a = &self.state.arms[id];
        if a.launches > 0 {
            return match a.host.as_deref().map(str::parse::<PeerId>) {
                // Once it ran there (the worker took its launch): its checkpoint is there.
                Some(Ok(w))
                    if ArmDir::new(&self.opts.dir, id)
                        .remote()
                        .is_some_and(|r| r.worker == w.to_string()) =>
                {
                    Place::Worker(w)
                }
                // Its launches there were refused: it has no state anywhere yet.
                Some(Ok(_)) if ArmDir::new(&self.opts.dir, id).checkpoint().is_none() => {
                    Place::Free
                }
                _ => Place::Local,
            };
        }
        match a.from {
            Some(o) if o.arm != id => match self.home(o.arm) {
                Place::Free => Place::Free,
                p => p,
            },
            _ => Place::Free,
        }
    }

    /// Where arm `id` launches now: `Some(None)` the driver's machine, `Some(Some(w))`
    /// worker `w`; none when its place has no room now.
    fn placement(&self, id: usize) -> Option<Option<PeerId>> {
        let local_cap = self
            .workers
            .as_ref()
            .map_or(self.study.budget.at_once, Workers::local_slots);
        let local_busy = self
            .live
            .values()
            .filter(|l| l.procs.worker().is_none())
            .count();
        let busy_on = |w: &PeerId| {
            self.live
                .values()
                .filter(|l| l.procs.worker() == Some(*w))
                .count()
        };
        match self.home(id) {
            Place::Local => (local_busy < local_cap).then_some(None),
            Place::Worker(w) => {
                let ws = self.workers.as_ref()?;
                ws.has_room(&w, busy_on(&w)).then_some(Some(w))
            }
            Place::Free => {
                if let Some(ws) = &self.workers {
                    if let Some(w) = ws.free(busy_on) {
                        return Some(Some(w));
                    }
                    if !ws.waited() {
                        return None;
                    }
                }
                (local_busy < local_cap).then_some(None)
            }
        }
    }

    fn launch_waiting(&mut self) -> Result<(), StudyError> {
        if let Some(ws) = &mut self.workers {
            ws.scan();
        }
        // Arms of workers to launch again (after a crash or a refused launch there).
        let due: Vec<usize> = self
            .relaunch
            .iter()
            .filter(|(_, t)| Instant::now() >= **t)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let Some(host) = self.placement(id) else {
                if let (Some(w), Some(ws)) = (self.home_worker(id), &self.workers) {
                    ws.tell_waiting(id, &w);
                }
                continue;
            };
            self.relaunch.remove(&id);
            let attempt = self.state.arms[id].attempt.max(1);
            self.launch(id, attempt, host)?;
        }
        // Arms whose place has no room now.
        let mut no_room = std::collections::BTreeSet::new();
        while self.live.len() + self.relaunch.len() < self.study.budget.at_once {
            let Some(id) = (0..self.state.arms.len())
                .find(|&i| self.state.arms[i].phase == Phase::Waiting && !no_room.contains(&i))
            else {
                break;
            };
            let dir = ArmDir::new(&self.opts.dir, id);
            if dir
                .checkpoint_step()
                .is_some_and(|s| s >= self.state.arms[id].target)
            {
                // Already there: its server took more steps than its last target.
                self.reached(id, &dir)?;
                continue;
            }
            if let (Place::Worker(_), None) = (self.home(id), &self.workers) {
                return Err(self.no_workers(id));
            }
            // A parent whose new arm's copy is not made yet does not run (its checkpoint
            // would move on before the copy).
            if self.awaits_copy(id) {
                no_room.insert(id);
                continue;
            }
            // A new arm from a checkpoint on a worker waits for its copy there.
            let a = &self.state.arms[id];
            if a.from.is_some() && a.launches == 0 && !dir.seeded() && dir.run_dir().is_none() {
                self.seed(id)?;
                if !dir.seeded() {
                    no_room.insert(id);
                    continue;
                }
            }
            match self.placement(id) {
                Some(host) => self.launch(id, 1, host)?,
                None => {
                    if let (Some(w), Some(ws)) = (self.home_worker(id), &self.workers) {
                        ws.tell_waiting(id, &w);
                    }
                    no_room.insert(id);
                }
            }
        }
        // Arms wait, none runs, and the workers they wait for will not come: say why.
        if self.live.is_empty() && self.relaunch.is_empty() && !no_room.is_empty() {
            if let Some(why) = self.workers.as_ref().and_then(Workers::none_usable) {
                return Err(StudyError::Launch {
                    arm: no_room
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    msg: format!(
                        "{why} (the study's [workers] local = {}: no arm waits for this machine)",
                        self.workers.as_ref().map_or(0, Workers::local_slots)
                    ),
                });
            }
        }
        Ok(())
    }

    fn launch(&mut self, id: usize, attempt: u32, host: Option<PeerId>) -> Result<(), StudyError> {
        let target = self.state.arms[id].target;
        self.record(Record::Launch {
            arm: id,
            steps: target,
            attempt,
            host: host.map(|h| h.to_string()),
            unix_ms: unix_ms(),
        })?;
        let dir = ArmDir::new(&self.opts.dir, id);
        let from = dir.checkpoint_step();
        println!(
            "{}: launched to {target} steps (attempt {attempt}{}{})",
            self.name(id),
            from.map_or(String::new(), |s| format!(
                ", from its checkpoint at step {s}"
            )),
            host.map_or(String::new(), |w| format!(", on worker {w}"))
        );
        note(
            &dir,
            &format!("launch to {target} steps, attempt {attempt}"),
        );
        let args = arm_args(self.study, &self.state.arms[id].arm);
        let procs = match host {
            None => Running::Local(Procs::start(
                &Launch {
                    exe: &self.opts.exe,
                    model: &self.study.base.model,
                    args: &args,
                },
                dir,
            )?),
            Some(w) => {
                let Some(ws) = &self.workers else {
                    return Err(self.no_workers(id));
                };
                match ws.launch(w, id, target, &self.study.base.model, &args, dir) {
                    Ok(r) => Running::Remote(r),
                    // Nothing ran: no failure of the arm's. Tried again after a pause
                    // (where its checkpoint is, or anywhere when it has none).
                    Err(e) => {
                        println!(
                            "{}: worker {w} did not launch it: {e}; trying again in {} s",
                            self.name(id),
                            RELAUNCH_PAUSE.as_secs()
                        );
                        self.relaunch.insert(id, Instant::now() + RELAUNCH_PAUSE);
                        return Ok(());
                    }
                }
            }
        };
        self.live.insert(
            id,
            Live {
                procs,
                args,
                progress_at: Instant::now(),
                steps_seen: 0,
            },
        );
        Ok(())
    }

    /// Stops arm `id`'s processes and records its score at its target.
    fn reached(&mut self, id: usize, dir: &ArmDir) -> Result<(), StudyError> {
        self.stop_live(id);
        let target = self.state.arms[id].target;
        let steps = dir
            .metrics_path()
            .map(|p| watch::steps(&p))
            .unwrap_or_default();
        let score = watch::score(&steps, &self.study.metric, target, self.study.window);
        println!(
            "{}: reached {target} steps, {} {}",
            self.name(id),
            self.study.metric,
            score.map_or("none".into(), |s| format!("{s:.4}"))
        );
        note(dir, &format!("reached {target} steps, score {score:?}"));
        self.record(Record::Reached {
            arm: id,
            steps: target,
            score,
            unix_ms: unix_ms(),
        })
    }

    /// One look at a running arm.
    fn look_at(&mut self, id: usize) -> Result<(), StudyError> {
        let target = self.state.arms[id].target;
        let dir = self.live[&id].procs.dir().clone();
        let steps = dir
            .metrics_path()
            .map(|p| watch::steps(&p))
            .unwrap_or_default();
        if steps.last().is_some_and(|s| s.step >= target) {
            return self.reached(id, &dir);
        }
        if let Some((kind, detail)) = watch::failure(&steps, &self.study.watch) {
            return self.fail(id, &kind, &detail, false);
        }
        let exe = self.opts.exe.clone();
        let model = self.study.base.model.clone();
        let workers = self.workers.as_ref();
        let l = self.live.get_mut(&id).expect("a live arm");
        if steps.len() != l.steps_seen {
            l.steps_seen = steps.len();
            l.progress_at = Instant::now();
        }
        let launch = Launch {
            exe: &exe,
            model: &model,
            args: &l.args,
        };
        match l.procs.poll(&launch, workers)? {
            None => {}
            Some(Exited::Client { success: true, .. }) => {
                // It ran every task for its epochs: again, the arm has steps to go.
                note(&dir, "the client ran its tasks to the end; started again");
                if let Err(e) = l.procs.restart_client(&launch, workers) {
                    return self.fail(id, "worker", &e.to_string(), true);
                }
            }
            Some(Exited::Client { usage, detail, .. }) => {
                let detail = format!(
                    "the client exited ({detail}); see {}",
                    dir.dir.join("client.log").display()
                );
                // Exit code 2: it refused its command line, which no restart mends.
                let kind = if usage {
                    "refused_flags"
                } else {
                    "client_crashed"
                };
                return self.fail(id, kind, &detail, !usage);
            }
            Some(Exited::Server { detail, usage }) => {
                let kind = if usage { "refused_flags" } else { "crashed" };
                return self.fail(id, kind, &format!("the server exited: {detail}"), !usage);
            }
        }
        let stall = Duration::from_secs_f64(self.study.watch.stall_seconds);
        let l = &self.live[&id];
        if l.progress_at.elapsed() > stall {
            let what = if l.procs.serving() {
                format!("no training step for {:.0} s", stall.as_secs_f64())
            } else {
                format!(
                    "the server did not serve within {:.0} s",
                    stall.as_secs_f64()
                )
            };
            return self.fail(id, "stalled", &what, true);
        }
        Ok(())
    }

    /// Records a failure; a crash or a stall within the restarts allowed starts the arm
    /// again from its checkpoint, anything else stops it.
    fn fail(
        &mut self,
        id: usize,
        kind: &str,
        detail: &str,
        restartable: bool,
    ) -> Result<(), StudyError> {
        self.stop_live(id);
        let attempt = self.state.arms[id].attempt;
        let restart = restartable && attempt <= self.study.watch.restarts;
        println!(
            "{}: {kind}: {detail}{}",
            self.name(id),
            if restart {
                "; restarting from its checkpoint"
            } else {
                "; stopped"
            }
        );
        note(
            &ArmDir::new(&self.opts.dir, id),
            &format!("{kind}: {detail}"),
        );
        self.record(Record::Failure {
            arm: id,
            kind: kind.into(),
            detail: detail.into(),
            restart,
            unix_ms: unix_ms(),
        })?;
        if restart {
            // The failure's record counted the attempt (a driver killed right here
            // launches it as this one would have), where its checkpoint is: on a worker
            // after a pause (one that vanished gets time to come back).
            match self.home_worker(id) {
                Some(_) => {
                    let attempt = u64::from(self.state.arms[id].attempt);
                    let pause = Duration::from_secs((5 * attempt).min(60));
                    self.relaunch.insert(id, Instant::now() + pause);
                }
                None => self.launch(id, self.state.arms[id].attempt, None)?,
            }
        }
        Ok(())
    }

    fn out_of_time(&mut self) -> Result<Outcome, StudyError> {
        self.stop_open("the study's wall-clock budget ran out")?;
        self.end("the study's wall-clock budget ran out")
    }

    /// Stops every arm that is not done, with `reason`.
    fn stop_open(&mut self, reason: &str) -> Result<(), StudyError> {
        let open: Vec<usize> = (0..self.state.arms.len())
            .filter(|&i| {
                matches!(
                    self.state.arms[i].phase,
                    Phase::Waiting | Phase::Running | Phase::Reached
                )
            })
            .collect();
        for id in open {
            if self.live.contains_key(&id) {
                self.stop_live(id);
            } else if self.state.arms[id].phase == Phase::Running {
                // Running by the journal but not by this driver (a finish carried out
                // after a resume): what the last driver left is stopped.
                self.stop_left(id)?;
            }
            self.record(Record::Decision {
                arm: id,
                action: Action::Stop,
                steps: self.state.arms[id].target,
                reason: reason.into(),
                unix_ms: unix_ms(),
            })?;
        }
        Ok(())
    }

    fn end(&mut self, reason: &str) -> Result<Outcome, StudyError> {
        let winner = self.policy.winner(&self.state);
        self.record(Record::End {
            winner,
            reason: reason.into(),
            unix_ms: unix_ms(),
        })?;
        Ok(self.ended(winner, reason.into()))
    }

    fn ended(&self, winner: Option<usize>, reason: String) -> Outcome {
        Outcome::Ended {
            winner: winner.map(|w| (w, self.state.arms[w].arm.name.clone())),
            reason,
        }
    }
}

/// The directory of arm `id`'s latest checkpoint in the study at `dir`, if it has one.
pub fn checkpoint_of(dir: &Path, id: usize) -> Option<PathBuf> {
    ArmDir::new(dir, id).checkpoint()
}
