//! The policies: which arms go on, decided from the journal's figures alone (so a driver
//! that resumes decides what an uninterrupted one would have).
//!
//! - `grid`: every arm runs the budget's steps; the best at the end wins.
//! - `asha` (successive halving, as ASHA's rungs: Li et al. 2018): every arm runs to the
//!   first rung; of the arms of a rung, the best `1/eta` (at least one) run on to the
//!   next rung, `eta` times more steps, up to the budget's. A rung is decided once none
//!   of its arms still runs, so the decisions do not depend on which arm got there first
//!   (ASHA's asynchronous promotions do; they buy a little wall-clock time with that).
//! - `pbt`: see `study::pbt`.
//! - `researcher`: an LLM's tool calls decide (see [`super::researcher`]); the policy
//!   gives only its step choices and the winner rule.

use std::collections::BTreeMap;

use serde_json::Value;

use super::journal::{Action, Origin, Phase, State};
use super::spec::{Goal, PolicyKind, Study};

/// One decision: the arm, what it does, its next target, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub arm: usize,
    pub action: Action,
    pub steps: u64,
    pub reason: String,
}

/// A new arm a policy starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Spawn {
    pub name: String,
    pub values: BTreeMap<String, Value>,
    /// The checkpoint it starts from.
    pub from: Option<Origin>,
    /// The steps it runs to.
    pub steps: u64,
    pub reason: String,
}

/// What a policy does next, in the order it is written to the journal.
#[derive(Debug, Clone, PartialEq)]
pub enum Move {
    Decide(Decision),
    Spawn(Spawn),
}

pub struct Policy {
    kind: PolicyKind,
    steps: u64,
    goal: Goal,
}

impl Policy {
    pub fn new(study: &Study) -> Policy {
        Policy {
            kind: study.policy.clone(),
            steps: study.budget.steps,
            goal: study.goal,
        }
    }

    /// The targets arms run to, in order: the rungs (grid: the budget's steps alone).
    pub fn rungs(&self) -> Vec<u64> {
        match &self.kind {
            PolicyKind::Grid => vec![self.steps],
            PolicyKind::Pbt(p) => {
                let mut out: Vec<u64> = (1..)
                    .map(|k| k * p.interval)
                    .take_while(|&r| r < self.steps)
                    .collect();
                out.push(self.steps);
                out
            }
            PolicyKind::Researcher(r) => r.steps.clone(),
            &PolicyKind::Halving { min_steps, eta } => {
                let mut out = Vec::new();
                let mut r = min_steps;
                while r < self.steps {
                    out.push(r);
                    r = r.saturating_mul(eta);
                }
                out.push(self.steps);
                out
            }
        }
    }

    /// The target every arm starts with.
    pub fn first(&self) -> u64 {
        self.rungs()[0]
    }

    /// Whether score `a` is better than `b` (a missing or NaN score is worst).
    fn better(&self, a: Option<f64>, b: Option<f64>) -> bool {
        match (a.filter(|x| !x.is_nan()), b.filter(|x| !x.is_nan())) {
            (Some(a), Some(b)) => match self.goal {
                Goal::Max => a > b,
                Goal::Min => a < b,
            },
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// `ids` best first (ties: the lower id first).
    pub(super) fn rank(&self, s: &State, ids: &mut [usize], at: u64) {
        let score = |i: usize| s.arms[i].scores.get(&at).copied().flatten();
        ids.sort_by(|&a, &b| {
            if self.better(score(a), score(b)) {
                std::cmp::Ordering::Less
            } else if self.better(score(b), score(a)) {
                std::cmp::Ordering::Greater
            } else {
                a.cmp(&b)
            }
        });
    }

    /// What `grid` and `asha` make due now (`pbt`'s moves come from `study::pbt`, a
    /// researcher's from its tool calls: none here).
    pub fn moves(&self, s: &State) -> Vec<Move> {
        match &self.kind {
            PolicyKind::Pbt(_) | PolicyKind::Researcher(_) => Vec::new(),
            PolicyKind::Grid | PolicyKind::Halving { .. } => {
                self.decide(s).into_iter().map(Move::Decide).collect()
            }
        }
    }

    /// The decisions of `grid` and `asha` due now: about every arm waiting at a rung
    /// that no arm still runs to. A rung's arms are those that run (or ran) to it: the ones there now and the
    /// ones already sent on from it, so a driver killed halfway through writing a rung's
    /// decisions decides the rest as it would have.
    pub fn decide(&self, s: &State) -> Vec<Decision> {
        let rungs = self.rungs();
        let mut out = Vec::new();
        for (k, &r) in rungs.iter().enumerate() {
            let at: Vec<usize> = (0..s.arms.len())
                .filter(|&i| s.arms[i].target == r || s.arms[i].scores.contains_key(&r))
                .collect();
            let busy = at.iter().any(|&i| {
                s.arms[i].target == r && matches!(s.arms[i].phase, Phase::Waiting | Phase::Running)
            });
            let undecided = |i: usize| s.arms[i].target == r && s.arms[i].phase == Phase::Reached;
            if busy || !at.iter().any(|&i| undecided(i)) {
                continue;
            }
            // Every arm that got there, ranked (the ones decided already included).
            let mut ranked: Vec<usize> = at
                .iter()
                .copied()
                .filter(|&i| s.arms[i].scores.contains_key(&r))
                .collect();
            self.rank(s, &mut ranked, r);
            let n = at.len();
            let last = k + 1 == rungs.len();
            let keep = match self.kind {
                PolicyKind::Halving { eta, .. } if !last => (n / eta as usize).max(1),
                _ => n,
            };
            for (place, &i) in ranked.iter().enumerate() {
                if !undecided(i) {
                    continue;
                }
                let score = s.arms[i].scores.get(&r).copied().flatten();
                let shown = score.map_or("none".into(), |x| format!("{x:.4}"));
                let (action, steps, reason) = if last {
                    (
                        Action::Finish,
                        r,
                        format!(
                            "ran the budget's {r} steps: score {shown}, {} of {}",
                            place + 1,
                            ranked.len()
                        ),
                    )
                } else if place < keep {
                    (
                        Action::Continue,
                        rungs[k + 1],
                        format!(
                            "rung {r} steps: score {shown} ranks {} of {n}; the best {keep} go on to {} steps",
                            place + 1,
                            rungs[k + 1]
                        ),
                    )
                } else {
                    (
                        Action::Stop,
                        r,
                        format!(
                            "rung {r} steps: score {shown} ranks {} of {n}; only the best {keep} go on",
                            place + 1
                        ),
                    )
                };
                out.push(Decision {
                    arm: i,
                    action,
                    steps,
                    reason,
                });
            }
        }
        out
    }

    /// The best arm at the furthest target any arm reached with a score.
    pub fn winner(&self, s: &State) -> Option<usize> {
        let top = s
            .arms
            .iter()
            .flat_map(|a| {
                a.scores
                    .iter()
                    .filter(|(_, v)| v.is_some())
                    .map(|(k, _)| *k)
            })
            .max()?;
        let mut ids: Vec<usize> = (0..s.arms.len())
            .filter(|&i| s.arms[i].scores.get(&top).copied().flatten().is_some())
            .collect();
        self.rank(s, &mut ids, top);
        ids.first().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::study::arms::Arm;
    use crate::study::journal::Record;
    use std::collections::BTreeMap;
    use std::path::Path;

    fn study(policy: &str) -> Study {
        let text = format!(
            "name = \"t\"\npolicy = \"{policy}\"\n[base]\nmodel = \"m\"\nclient = [\"--agent\", \"a\", \"--tasks\", \"t\"]\n\
             [budget]\nsteps = 8\n[space.x]\nenv = \"X\"\nvalues = [0, 1, 2, 3, 4]\n{}",
            if policy == "asha" { "[asha]\nmin_steps = 2\neta = 2\n" } else { "" }
        );
        Study::parse(Path::new("s.toml"), &text).unwrap()
    }

    fn state(n: usize, first: u64) -> State {
        let arms = (0..n)
            .map(|id| Arm {
                id,
                name: format!("a{id}"),
                values: BTreeMap::new(),
            })
            .collect();
        State::replay(
            &[Record::Study {
                name: "t".into(),
                hash: "h".into(),
                seed: 0,
                arms,
                unix_ms: 0,
            }],
            first,
        )
        .unwrap()
    }

    fn reach(s: &mut State, arm: usize, steps: u64, score: Option<f64>) {
        for r in [
            Record::Launch {
                arm,
                steps,
                attempt: 1,
                host: None,
                unix_ms: 0,
            },
            Record::Reached {
                arm,
                steps,
                score,
                unix_ms: 0,
            },
        ] {
            s.apply(&r).unwrap();
        }
    }

    fn apply(s: &mut State, ds: &[Decision]) {
        for d in ds {
            s.apply(&Record::Decision {
                arm: d.arm,
                action: d.action,
                steps: d.steps,
                reason: d.reason.clone(),
                unix_ms: 0,
            })
            .unwrap();
        }
    }

    #[test]
    fn halving_waits_for_the_whole_rung_then_keeps_the_best_half() {
        let p = Policy::new(&study("asha"));
        assert_eq!(p.rungs(), vec![2, 4, 8]);
        let mut s = state(5, p.first());
        for (i, score) in [0.1, 0.9, 0.5, 0.7].into_iter().enumerate() {
            reach(&mut s, i, 2, Some(score));
        }
        assert!(p.decide(&s).is_empty(), "arm 4 has not reached the rung");
        // Arm 4 fails: it counts in the rung (5 arms: the best 2 go on).
        s.apply(&Record::Failure {
            arm: 4,
            kind: "crashed".into(),
            detail: "x".into(),
            restart: false,
            unix_ms: 0,
        })
        .unwrap();
        let ds = p.decide(&s);
        let go: Vec<usize> = ds
            .iter()
            .filter(|d| d.action == Action::Continue)
            .map(|d| d.arm)
            .collect();
        assert_eq!(go, vec![1, 3]);
        assert!(ds
            .iter()
            .all(|d| d.action != Action::Continue || d.steps == 4));
        assert_eq!(ds.len(), 4);
        // A driver killed after writing the first decision decides the rest the same.
        let mut partial = s.clone();
        apply(&mut partial, &ds[..1]);
        assert_eq!(p.decide(&partial), ds[1..].to_vec());
        apply(&mut s, &ds);
        assert!(p.decide(&s).is_empty(), "a rung is decided once");
        reach(&mut s, 1, 4, Some(0.2));
        reach(&mut s, 3, 4, Some(0.8));
        let ds = p.decide(&s);
        assert_eq!(ds.len(), 2);
        assert_eq!(
            (ds[0].arm, ds[0].action, ds[0].steps),
            (3, Action::Continue, 8)
        );
        assert_eq!((ds[1].arm, ds[1].action), (1, Action::Stop));
        apply(&mut s, &ds);
        reach(&mut s, 3, 8, Some(0.95));
        let ds = p.decide(&s);
        assert_eq!((ds[0].arm, ds[0].action), (3, Action::Finish));
        apply(&mut s, &ds);
        assert_eq!(p.winner(&s), Some(3));
    }

    #[test]
    fn grid_finishes_every_arm_and_a_missing_score_ranks_last() {
        let p = Policy::new(&study("grid"));
        assert_eq!(p.rungs(), vec![8]);
        let mut s = state(3, p.first());
        reach(&mut s, 0, 8, None);
        reach(&mut s, 1, 8, Some(-1.0));
        reach(&mut s, 2, 8, Some(f64::NAN));
        let ds = p.decide(&s);
        assert!(ds.iter().all(|d| d.action == Action::Finish));
        apply(&mut s, &ds);
        assert_eq!(p.winner(&s), Some(1));
    }
}
