//! The study's journal (`journal.jsonl` in the study directory): every fact the driver
//! acted on and every decision, one JSON line each, synced. A launch and a decision are
//! written before they are carried out; a target reached or a failure once the arm's
//! processes are stopped (a driver killed in between finds the arm running, and looks
//! at it again).
//! A driver killed at any moment and started again reads the journal back into the same
//! [`State`] and goes on from there: an arm that reached a rung is never run to it again,
//! and a decision once written is never taken again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::arms::Arm;
use super::error::StudyError;

/// What the policy decided about an arm that reached its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Run on to the decision's `steps`.
    Continue,
    /// Run no more (its figures ranked it out, or it failed).
    Stop,
    /// It ran the whole budget.
    Finish,
}

/// Where a new arm starts from: another arm's checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The arm whose checkpoint (and metrics so far) it starts from.
    pub arm: usize,
    /// The rung it was taken at.
    pub step: u64,
    /// The arm it takes the place of in the population (PBT's exploit).
    #[serde(default)]
    pub replaces: Option<usize>,
}

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum Record {
    /// The first line: which study (the hash of its file as parsed) and its arms.
    Study {
        name: String,
        hash: String,
        seed: u64,
        arms: Vec<Arm>,
        unix_ms: u64,
    },
    /// A driver started again on this journal.
    Resumed { unix_ms: u64 },
    /// An arm's processes start, to run to `steps` training steps (`attempt` 1 for a new
    /// target, one more after each restart).
    Launch {
        arm: usize,
        steps: u64,
        attempt: u32,
        /// The study worker that runs it (its peer id); none: the driver's machine.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host: Option<String>,
        unix_ms: u64,
    },
    /// An arm got to its target (its processes stopped, its checkpoint saved); its score
    /// there (none when no step had the metric).
    Reached {
        arm: usize,
        steps: u64,
        score: Option<f64>,
        unix_ms: u64,
    },
    /// Something went wrong with a running arm; `restart`: it is started again from its
    /// checkpoint (otherwise it stops).
    Failure {
        arm: usize,
        kind: String,
        detail: String,
        restart: bool,
        unix_ms: u64,
    },
    /// The policy's decision about an arm, and why.
    Decision {
        arm: usize,
        action: Action,
        steps: u64,
        reason: String,
        unix_ms: u64,
    },
    /// A new arm (PBT's exploit of a better arm, a researcher's new run), to run to
    /// `steps`; written before its directory is made.
    Arm {
        arm: Arm,
        from: Option<Origin>,
        steps: u64,
        reason: String,
        unix_ms: u64,
    },
    /// A researcher's tool call: its number (from 1), the tool, its arguments (the
    /// reason among them), whether it was valid and what it did or why not.
    Action {
        n: u32,
        tool: String,
        args: serde_json::Value,
        valid: bool,
        result: String,
        unix_ms: u64,
    },
    /// The study ended: its winner (best score at the furthest rung) and why it ended.
    End {
        winner: Option<usize>,
        reason: String,
        unix_ms: u64,
    },
}

/// Where an arm is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// To be launched towards its target.
    Waiting,
    Running,
    /// At its target, waiting for the policy.
    Reached,
    Stopped,
    Finished,
}

/// An arm as the journal tells it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmState {
    pub arm: Arm,
    pub phase: Phase,
    /// The steps it runs (or ran) to now.
    pub target: u64,
    /// Launches towards the current target.
    pub attempt: u32,
    /// Launches in all (restarts and resumes included).
    pub launches: u32,
    /// Its score at each target it reached.
    pub scores: BTreeMap<u64, Option<f64>>,
    /// Its failures: (kind, detail).
    pub failures: Vec<(String, String)>,
    /// Why it stopped, or the last decision about it.
    pub reason: Option<String>,
    /// The checkpoint it started from, if it started from another arm's.
    pub from: Option<Origin>,
    /// Where its last launch ran: a study worker's peer id, or none (the driver's
    /// machine). Its checkpoint is there: it runs there again.
    pub host: Option<String>,
}

/// The study as its journal tells it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    pub name: String,
    pub hash: String,
    pub seed: u64,
    pub arms: Vec<ArmState>,
    pub started_unix_ms: u64,
    pub resumes: u32,
    /// (winner, why), once the study ended.
    pub ended: Option<(Option<usize>, String)>,
    pub decisions: Vec<Record>,
    /// A researcher's tool calls.
    pub actions: Vec<Record>,
    /// A valid call that changes the study, written, whose effect is not (yet) in the
    /// journal: a driver killed between the two carries it out when it resumes.
    pub pending: Option<Record>,
}

/// The researcher's tools that change the study (their effects follow their lines).
pub const CHANGING_TOOLS: &[&str] = &["start_run", "continue_run", "stop_run", "finish_study"];

impl State {
    /// Replays `records` (the first must be the study's); each new arm's first target
    /// is `first`.
    pub fn replay(records: &[Record], first: u64) -> Result<State, String> {
        let Some(Record::Study {
            name,
            hash,
            seed,
            arms,
            unix_ms,
        }) = records.first()
        else {
            return Err("the first line is not the study's".into());
        };
        let mut s = State {
            name: name.clone(),
            hash: hash.clone(),
            seed: *seed,
            arms: arms
                .iter()
                .map(|a| ArmState {
                    arm: a.clone(),
                    phase: Phase::Waiting,
                    target: first,
                    attempt: 0,
                    launches: 0,
                    scores: BTreeMap::new(),
                    failures: Vec::new(),
                    reason: None,
                    from: None,
                    host: None,
                })
                .collect(),
            started_unix_ms: *unix_ms,
            resumes: 0,
            ended: None,
            decisions: Vec::new(),
            actions: Vec::new(),
            pending: None,
        };
        for (i, r) in records.iter().enumerate().skip(1) {
            s.apply(r).map_err(|e| format!("line {}: {e}", i + 1))?;
        }
        Ok(s)
    }

    /// An effect's record was written: the pending call is done (a `finish_study`'s
    /// only with the end: its stops come first).
    fn clear_pending(&mut self, end: bool) {
        let finish =
            matches!(&self.pending, Some(Record::Action { tool, .. }) if tool == "finish_study");
        if end || !finish {
            self.pending = None;
        }
    }

    fn arm_mut(&mut self, arm: usize) -> Result<&mut ArmState, String> {
        let n = self.arms.len();
        self.arms
            .get_mut(arm)
            .ok_or_else(|| format!("arm {arm} of {n}"))
    }

    /// Applies one record (after the study's).
    pub fn apply(&mut self, r: &Record) -> Result<(), String> {
        match r {
            Record::Study { .. } => return Err("a second study line".into()),
            Record::Resumed { .. } => self.resumes += 1,
            Record::Launch {
                arm,
                steps,
                attempt,
                host,
                ..
            } => {
                let a = self.arm_mut(*arm)?;
                a.host = host.clone();
                a.phase = Phase::Running;
                a.target = *steps;
                a.attempt = *attempt;
                a.launches += 1;
            }
            Record::Reached {
                arm, steps, score, ..
            } => {
                let a = self.arm_mut(*arm)?;
                a.phase = Phase::Reached;
                a.target = *steps;
                a.scores.insert(*steps, *score);
            }
            Record::Failure {
                arm,
                kind,
                detail,
                restart,
                ..
            } => {
                let a = self.arm_mut(*arm)?;
                a.failures.push((kind.clone(), detail.clone()));
                if *restart {
                    // The launch that follows is the next attempt.
                    a.attempt += 1;
                } else {
                    a.phase = Phase::Stopped;
                    a.reason = Some(format!("failed: {kind}: {detail}"));
                }
            }
            Record::Decision {
                arm,
                action,
                steps,
                reason,
                ..
            } => {
                self.clear_pending(false);
                let a = self.arm_mut(*arm)?;
                a.reason = Some(reason.clone());
                match action {
                    Action::Continue => {
                        a.phase = Phase::Waiting;
                        a.target = *steps;
                        a.attempt = 0;
                    }
                    Action::Stop => a.phase = Phase::Stopped,
                    Action::Finish => a.phase = Phase::Finished,
                }
                self.decisions.push(r.clone());
            }
            Record::Arm {
                arm,
                from,
                steps,
                reason,
                ..
            } => {
                if arm.id != self.arms.len() {
                    return Err(format!(
                        "a new arm numbered {} after {} arms",
                        arm.id,
                        self.arms.len()
                    ));
                }
                if let Some(o) = from {
                    self.arm_mut(o.arm)?;
                    if let Some(r) = o.replaces {
                        self.arm_mut(r)?;
                    }
                }
                self.clear_pending(false);
                self.arms.push(ArmState {
                    arm: arm.clone(),
                    phase: Phase::Waiting,
                    target: *steps,
                    attempt: 0,
                    launches: 0,
                    scores: BTreeMap::new(),
                    failures: Vec::new(),
                    reason: Some(reason.clone()),
                    from: *from,
                    host: None,
                });
            }
            Record::Action { tool, valid, .. } => {
                if *valid && CHANGING_TOOLS.contains(&tool.as_str()) {
                    self.pending = Some(r.clone());
                }
                self.actions.push(r.clone());
            }
            Record::End { winner, reason, .. } => {
                if let Some(w) = winner {
                    self.arm_mut(*w)?;
                }
                self.ended = Some((*winner, reason.clone()));
                self.clear_pending(true);
            }
        }
        Ok(())
    }
}

/// The journal file.
pub struct Journal {
    pub path: PathBuf,
}

impl Journal {
    pub fn at(dir: &Path) -> Journal {
        Journal {
            path: dir.join("journal.jsonl"),
        }
    }

    /// Appends `r` and syncs it to disk.
    pub fn append(&self, r: &Record) -> Result<(), StudyError> {
        let line = serde_json::to_string(r).map_err(|e| StudyError::io(&self.path, e))?;
        crate::base::files::append_durable(&self.path, format!("{line}\n").as_bytes())
            .map_err(|e| StudyError::io(&self.path, e))
    }

    /// Every whole line (none when there is no journal yet). A torn last line (a kill
    /// mid-append) is not a record: what it said was not acted on.
    pub fn read(&self) -> Result<Vec<Record>, StudyError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StudyError::io(&self.path, e)),
        };
        crate::base::files::whole_lines(&text)
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| StudyError::Journal {
                    path: self.path.clone(),
                    msg: format!("line {}: {e}", i + 1),
                })
            })
            .collect()
    }
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(id: usize) -> Arm {
        Arm {
            id,
            name: format!("a{id}"),
            values: BTreeMap::new(),
        }
    }

    #[test]
    fn a_journal_torn_mid_line_reads_back_to_the_state_before_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::at(dir.path());
        let study = Record::Study {
            name: "s".into(),
            hash: "h".into(),
            seed: 1,
            arms: vec![arm(0), arm(1)],
            unix_ms: 5,
        };
        j.append(&study).unwrap();
        j.append(&Record::Launch {
            arm: 1,
            steps: 2,
            attempt: 1,
            host: None,
            unix_ms: 6,
        })
        .unwrap();
        let whole = std::fs::read_to_string(&j.path).unwrap();
        // A kill in the middle of the next line.
        std::fs::write(
            &j.path,
            format!("{whole}{{\"t\":\"reached\",\"arm\":1,\"st"),
        )
        .unwrap();
        let records = j.read().unwrap();
        assert_eq!(records.len(), 2);
        let s = State::replay(&records, 2).unwrap();
        assert_eq!(s.arms[1].phase, Phase::Running);
        assert_eq!(s.arms[0].phase, Phase::Waiting);
        // The next append replaces the torn line.
        j.append(&Record::Reached {
            arm: 1,
            steps: 2,
            score: Some(0.5),
            unix_ms: 7,
        })
        .unwrap();
        let s = State::replay(&j.read().unwrap(), 2).unwrap();
        assert_eq!(s.arms[1].phase, Phase::Reached);
        assert_eq!(s.arms[1].scores[&2], Some(0.5));
    }

    #[test]
    fn a_journal_of_an_unknown_arm_is_refused_with_its_line() {
        let records = vec![
            Record::Study {
                name: "s".into(),
                hash: "h".into(),
                seed: 1,
                arms: vec![arm(0)],
                unix_ms: 5,
            },
            Record::Launch {
                arm: 3,
                steps: 2,
                attempt: 1,
                host: None,
                unix_ms: 6,
            },
        ];
        let e = State::replay(&records, 2).unwrap_err();
        assert!(e.contains("line 2") && e.contains("arm 3"), "{e}");
    }

    #[test]
    fn a_researchers_call_is_pending_until_its_effect_is_written() {
        let study = Record::Study {
            name: "s".into(),
            hash: "h".into(),
            seed: 1,
            arms: vec![arm(0), arm(1)],
            unix_ms: 5,
        };
        let call = |tool: &str, valid: bool| Record::Action {
            n: 1,
            tool: tool.into(),
            args: serde_json::json!({"reason": "r"}),
            valid,
            result: "x".into(),
            unix_ms: 6,
        };
        let stop = |arm: usize| Record::Decision {
            arm,
            action: Action::Stop,
            steps: 2,
            reason: "r".into(),
            unix_ms: 7,
        };
        let end = Record::End {
            winner: None,
            reason: "r".into(),
            unix_ms: 8,
        };
        // Read-only and refused calls leave nothing to carry out.
        for c in [call("list_runs", true), call("stop_run", false)] {
            let s = State::replay(&[study.clone(), c], 2).unwrap();
            assert!(s.pending.is_none());
        }
        // A stop is done once its decision is written.
        let s = State::replay(&[study.clone(), call("stop_run", true)], 2).unwrap();
        assert!(s.pending.is_some());
        let s = State::replay(&[study.clone(), call("stop_run", true), stop(0)], 2).unwrap();
        assert!(s.pending.is_none());
        // A finish stops the open arms first: it is done only with the end.
        let f = [study.clone(), call("finish_study", true), stop(0), stop(1)];
        assert!(State::replay(&f, 2).unwrap().pending.is_some());
        let mut done = f.to_vec();
        done.push(end);
        assert!(State::replay(&done, 2).unwrap().pending.is_none());
    }

    #[test]
    fn a_new_arm_joins_waiting_with_its_origin_and_must_be_numbered_next() {
        let study = Record::Study {
            name: "s".into(),
            hash: "h".into(),
            seed: 1,
            arms: vec![arm(0), arm(1)],
            unix_ms: 5,
        };
        let new = |id: usize| Record::Arm {
            arm: arm(id),
            from: Some(Origin {
                arm: 0,
                step: 2,
                replaces: Some(1),
            }),
            steps: 4,
            reason: "exploit".into(),
            unix_ms: 6,
        };
        let s = State::replay(&[study.clone(), new(2)], 2).unwrap();
        assert_eq!(s.arms.len(), 3);
        assert_eq!((s.arms[2].phase, s.arms[2].target), (Phase::Waiting, 4));
        assert_eq!(s.arms[2].from.map(|o| o.arm), Some(0));
        let e = State::replay(&[study, new(5)], 2).unwrap_err();
        assert!(e.contains("numbered 5 after 2"), "{e}");
    }
}
