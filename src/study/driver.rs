//! The driver: launches arms (at most the budget's at once, lowest id first), watches
//! them, stops each at its target, applies the policy's decisions, and restarts an arm
//! whose server crashed or stalled from its checkpoint. Every fact it acts on goes to
//! the journal first, so a driver killed anywhere and started again on the same
//! directory ends as an uninterrupted one would have.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arms::{arm_args, arms, ArmArgs};
use super::error::StudyError;
use super::journal::{unix_ms, Journal, Phase, Record, State};
use super::launch::{note, stop_leftovers, ArmDir, Exited, Launch, Procs};
use super::policy::Policy;
use super::spec::Study;
use super::watch;

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
    procs: Procs,
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
    let mut d = Driver {
        study,
        opts,
        journal,
        policy,
        state,
        live: BTreeMap::new(),
    };
    let out = d.drive();
    // Whatever ended the loop, no arm is left running.
    for (_, l) in std::mem::take(&mut d.live) {
        l.procs.stop();
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
            for dec in self.policy.decide(&self.state) {
                println!("{}: {:?}: {}", self.name(dec.arm), dec.action, dec.reason);
                self.record(Record::Decision {
                    arm: dec.arm,
                    action: dec.action,
                    steps: dec.steps,
                    reason: dec.reason,
                    unix_ms: unix_ms(),
                })?;
            }
            let done = self
                .state
                .arms
                .iter()
                .all(|a| matches!(a.phase, Phase::Stopped | Phase::Finished));
            if done {
                return self.end("every arm finished or stopped");
            }
            self.launch_waiting()?;
            let ids: Vec<usize> = self.live.keys().copied().collect();
            for id in ids {
                self.look_at(id)?;
            }
            std::thread::sleep(self.opts.poll);
        }
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
            let n = stop_leftovers(&dir);
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
            self.launch(id, attempt)?;
        }
        Ok(())
    }

    fn launch_waiting(&mut self) -> Result<(), StudyError> {
        while self.live.len() < self.study.budget.at_once {
            let Some(id) =
                (0..self.state.arms.len()).find(|&i| self.state.arms[i].phase == Phase::Waiting)
            else {
                return Ok(());
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
            self.launch(id, 1)?;
        }
        Ok(())
    }

    fn launch(&mut self, id: usize, attempt: u32) -> Result<(), StudyError> {
        let target = self.state.arms[id].target;
        self.record(Record::Launch {
            arm: id,
            steps: target,
            attempt,
            unix_ms: unix_ms(),
        })?;
        let dir = ArmDir::new(&self.opts.dir, id);
        let from = dir.checkpoint_step();
        println!(
            "{}: launched to {target} steps (attempt {attempt}{})",
            self.name(id),
            from.map_or(String::new(), |s| format!(
                ", from its checkpoint at step {s}"
            ))
        );
        note(
            &dir,
            &format!("launch to {target} steps, attempt {attempt}"),
        );
        let args = arm_args(self.study, &self.state.arms[id].arm);
        let procs = Procs::start(
            &Launch {
                exe: &self.opts.exe,
                model: &self.study.base.model,
                args: &args,
            },
            dir,
        )?;
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
        if let Some(l) = self.live.remove(&id) {
            l.procs.stop();
        }
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
        let dir = self.live[&id].procs.dir.clone();
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
        match l.procs.poll(&launch)? {
            None => {}
            Some(Exited::Client(st)) if st.success() => {
                // It ran every task for its epochs: again, the arm has steps to go.
                note(&dir, "the client ran its tasks to the end; started again");
                l.procs.restart_client(&launch)?;
            }
            Some(Exited::Client(st)) => {
                let detail = format!(
                    "the client exited ({st}); see {}",
                    dir.dir.join("client.log").display()
                );
                // Exit code 2: it refused its command line, which no restart mends.
                let usage = st.code() == Some(2);
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
        if let Some(l) = self.live.remove(&id) {
            l.procs.stop();
        }
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
            // launches it as this one would have).
            self.launch(id, self.state.arms[id].attempt)?;
        }
        Ok(())
    }

    fn out_of_time(&mut self) -> Result<Outcome, StudyError> {
        let open: Vec<usize> = (0..self.state.arms.len())
            .filter(|&i| {
                matches!(
                    self.state.arms[i].phase,
                    Phase::Waiting | Phase::Running | Phase::Reached
                )
            })
            .collect();
        for id in open {
            if let Some(l) = self.live.remove(&id) {
                l.procs.stop();
            }
            self.record(Record::Decision {
                arm: id,
                action: super::journal::Action::Stop,
                steps: self.state.arms[id].target,
                reason: "the study's wall-clock budget ran out".into(),
                unix_ms: unix_ms(),
            })?;
        }
        self.end("the study's wall-clock budget ran out")
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
