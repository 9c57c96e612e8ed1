//! Population-based training (Jaderberg et al. 2017), in synchronous generations: the
//! population runs to a rung (`interval` steps, then every `interval` more, up to the
//! budget's steps); once none of it still runs there, the rung's arms are ranked, the worst
//! `quantile` stop, and as many new arms start from the best `quantile`'s checkpoints
//! (exploit) with the parent's settings explored (explore): each parameter of
//! `pbt.explore` is drawn again from the space with chance `resample`, or else moved: a
//! number times `1 - perturb` or `1 + perturb` (kept in its range), a value of a list to a
//! neighbour. The rest go on to the next rung.
//!
//! Everything is decided from the journal's figures and the study's seed (the parent and
//! the exploration of each replaced arm are drawn from a generator seeded by the seed, the
//! rung and the arm's place), so a driver killed halfway through writing a rung's moves
//! makes the rest of them the same.

use std::collections::BTreeMap;

use serde_json::Value;

use super::arms::{default_name, draw_one, fit};
use super::journal::{Action, Origin, Phase, State};
use super::policy::{Decision, Move, Policy, Spawn};
use super::spec::{Param, Pbt};
use crate::base::Rng;

/// The moves due at the rungs whose arms all got there.
pub fn decide(p: &Pbt, policy: &Policy, space: &[Param], seed: u64, s: &State) -> Vec<Move> {
    let rungs = policy.rungs();
    let mut out = Vec::new();
    for (k, &r) in rungs.iter().enumerate() {
        // The population at rung r: the arms that run (or ran) to it. Arms started at
        // r run to the next rung and are not of it.
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
        let mut ranked: Vec<usize> = at
            .iter()
            .copied()
            .filter(|&i| s.arms[i].scores.contains_key(&r))
            .collect();
        policy.rank(s, &mut ranked, r);
        let n = ranked.len();
        let shown = |i: usize| {
            s.arms[i]
                .scores
                .get(&r)
                .copied()
                .flatten()
                .map_or("none".into(), |x| format!("{x:.4}"))
        };
        if k + 1 == rungs.len() {
            for (place, &i) in ranked.iter().enumerate() {
                if undecided(i) {
                    out.push(Move::Decide(Decision {
                        arm: i,
                        action: Action::Finish,
                        steps: r,
                        reason: format!(
                            "ran the budget's {r} steps: score {}, {} of {n}",
                            shown(i),
                            place + 1
                        ),
                    }));
                }
            }
            continue;
        }
        let next = rungs[k + 1];
        // The worst q take the best q's places (none in a population of one).
        let q = if n >= 2 {
            ((n as f64 * p.quantile).floor() as usize).clamp(1, n / 2)
        } else {
            0
        };
        let top = &ranked[..q];
        for (place, &i) in ranked.iter().enumerate() {
            if place + q < n {
                if undecided(i) {
                    out.push(Move::Decide(Decision {
                        arm: i,
                        action: Action::Continue,
                        steps: next,
                        reason: format!(
                            "rung {r} steps: score {} ranks {} of {n}; goes on to {next} steps",
                            shown(i),
                            place + 1
                        ),
                    }));
                }
                continue;
            }
            let j = place + q - n;
            let mut rng = Rng::seeded(
                seed ^ r.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                    ^ (j as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9),
            );
            let parent = top[(rng.next_u64() % q as u64) as usize];
            let spawned = s
                .arms
                .iter()
                .any(|a| a.from.is_some_and(|o| o.replaces == Some(i) && o.step == r));
            if !spawned {
                let values = explore(&s.arms[parent].arm.values, space, p, &mut rng);
                out.push(Move::Spawn(Spawn {
                    name: format!("{} (from {parent})", default_name(&values)),
                    values,
                    from: Some(Origin {
                        arm: parent,
                        step: r,
                        replaces: Some(i),
                    }),
                    steps: next,
                    reason: format!(
                        "rung {r} steps: arm {i} (score {}) ranks {} of {n}, in the worst {q}: \
                         its place goes to arm {parent}'s checkpoint (score {}) with settings explored",
                        shown(i),
                        place + 1,
                        shown(parent)
                    ),
                }));
            }
            if undecided(i) {
                out.push(Move::Decide(Decision {
                    arm: i,
                    action: Action::Stop,
                    steps: r,
                    reason: format!(
                        "rung {r} steps: score {} ranks {} of {n}, in the worst {q}: replaced by a \
                         new arm from arm {parent}'s checkpoint",
                        shown(i),
                        place + 1
                    ),
                }));
            }
        }
    }
    out
}

/// `parent`'s values with those of `p.explore` explored.
fn explore(
    parent: &BTreeMap<String, Value>,
    space: &[Param],
    p: &Pbt,
    rng: &mut Rng,
) -> BTreeMap<String, Value> {
    let mut out = parent.clone();
    for q in space.iter().filter(|q| p.explore.contains(&q.name)) {
        let old = parent.get(&q.name).cloned().unwrap_or(Value::Null);
        let resample = rng.next_f64() < p.resample;
        let up = rng.next_u64() % 2 == 0;
        let new = if resample {
            draw_one(q, rng)
        } else {
            match (&q.values, &q.range) {
                (Some(vs), _) if !vs.is_empty() => {
                    let at = vs.iter().position(|v| *v == old).unwrap_or(0);
                    let to = if up {
                        (at + 1).min(vs.len() - 1)
                    } else {
                        at.saturating_sub(1)
                    };
                    vs[to].clone()
                }
                (_, Some(range)) => match old.as_f64() {
                    Some(x) => {
                        let f = if up { 1.0 + p.perturb } else { 1.0 - p.perturb };
                        fit(range, (x * f).clamp(range.min, range.max))
                    }
                    None => draw_one(q, rng),
                },
                _ => old,
            }
        };
        out.insert(q.name.clone(), new);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::study::arms::Arm;
    use crate::study::journal::Record;
    use crate::study::spec::{PolicyKind, Study};
    use std::path::Path;

    const FILE: &str = r#"
name = "t"
seed = 9
policy = "pbt"
[base]
model = "m"
client = ["--agent", "a", "--tasks", "t"]
[budget]
steps = 6
[space.lr]
server = "--learning-rate"
min = 1e-4
max = 1e-2
log = true
[space.temp]
env = "T"
values = [0.5, 0.7, 1.0]
[pbt]
interval = 2
quantile = 0.25
explore = ["lr"]
samples = 4
"#;

    fn apply(s: &mut State, moves: &[Move]) {
        for m in moves {
            let r = match m {
                Move::Decide(d) => Record::Decision {
                    arm: d.arm,
                    action: d.action,
                    steps: d.steps,
                    reason: d.reason.clone(),
                    unix_ms: 0,
                },
                Move::Spawn(sp) => Record::Arm {
                    arm: Arm {
                        id: s.arms.len(),
                        name: sp.name.clone(),
                        values: sp.values.clone(),
                    },
                    from: sp.from,
                    steps: sp.steps,
                    reason: sp.reason.clone(),
                    unix_ms: 0,
                },
            };
            s.apply(&r).unwrap();
        }
    }

    fn reach(s: &mut State, arm: usize, steps: u64, score: f64) {
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
                score: Some(score),
                unix_ms: 0,
            },
        ] {
            s.apply(&r).unwrap();
        }
    }

    #[test]
    fn the_worst_quarter_takes_a_best_arms_checkpoint_with_its_lr_explored() {
        let study = Study::parse(Path::new("s.toml"), FILE).unwrap();
        let PolicyKind::Pbt(p) = &study.policy else {
            panic!()
        };
        let policy = Policy::new(&study);
        assert_eq!(policy.rungs(), vec![2, 4, 6]);
        let arms = crate::study::arms::arms(&study);
        let mut s = State::replay(
            &[Record::Study {
                name: "t".into(),
                hash: "h".into(),
                seed: 9,
                arms: arms.clone(),
                unix_ms: 0,
            }],
            policy.first(),
        )
        .unwrap();
        let decide = |s: &State| decide(p, &policy, &study.space, study.seed, s);
        for (i, score) in [0.4, 0.1, 0.9, 0.6].into_iter().enumerate().take(3) {
            reach(&mut s, i, 2, score);
        }
        assert!(decide(&s).is_empty(), "arm 3 still runs to the rung");
        reach(&mut s, 3, 2, 0.6);
        let moves = decide(&s);
        // 4 arms, quantile 0.25: arm 1 (0.1) is replaced by a child of arm 2 (0.9).
        let spawns: Vec<&Spawn> = moves
            .iter()
            .filter_map(|m| match m {
                Move::Spawn(sp) => Some(sp),
                _ => None,
            })
            .collect();
        assert_eq!(spawns.len(), 1);
        let child = spawns[0];
        assert_eq!(
            child.from,
            Some(Origin {
                arm: 2,
                step: 2,
                replaces: Some(1)
            })
        );
        assert_eq!(child.steps, 4);
        assert_eq!(child.values["temp"], arms[2].values["temp"], "not explored");
        let (lr, parent_lr) = (
            child.values["lr"].as_f64().unwrap(),
            arms[2].values["lr"].as_f64().unwrap(),
        );
        assert!(
            (1e-4..=1e-2).contains(&lr) && lr != parent_lr,
            "{lr} vs {parent_lr}"
        );
        let stopped: Vec<usize> = moves
            .iter()
            .filter_map(|m| match m {
                Move::Decide(d) if d.action == Action::Stop => Some(d.arm),
                _ => None,
            })
            .collect();
        assert_eq!(stopped, vec![1]);
        assert_eq!(moves.len(), 5, "3 go on, 1 stops, 1 new arm: {moves:#?}");
        // A driver killed after writing the new arm (before the replaced arm's stop)
        // makes the rest the same, and no second new arm.
        let at = moves
            .iter()
            .position(|m| matches!(m, Move::Spawn(_)))
            .unwrap();
        let mut partial = s.clone();
        apply(&mut partial, &moves[..=at]);
        assert_eq!(decide(&partial), moves[at + 1..].to_vec());
        apply(&mut s, &moves);
        assert!(decide(&s).is_empty(), "a rung is decided once");
        assert_eq!(s.arms.len(), 5);
        assert_eq!((s.arms[4].phase, s.arms[4].target), (Phase::Waiting, 4));
        // The next generation includes the child; the last rung finishes everyone.
        for (i, score) in [(0, 0.5), (2, 0.8), (3, 0.7), (4, 0.95)] {
            reach(&mut s, i, 4, score);
        }
        let moves = decide(&s);
        apply(&mut s, &moves);
        let born: Vec<_> = s.arms[5..].iter().map(|a| a.from.unwrap()).collect();
        assert_eq!(born.len(), 1);
        assert_eq!(born[0].replaces, Some(0), "arm 0 ranked last at rung 4");
        assert_eq!(born[0].step, 4);
        for i in [2, 3, 4, 5] {
            reach(&mut s, i, 6, i as f64);
        }
        let moves = decide(&s);
        assert!(moves
            .iter()
            .all(|m| matches!(m, Move::Decide(d) if d.action == Action::Finish)));
        apply(&mut s, &moves);
        assert_eq!(policy.winner(&s), Some(5));
    }
}
