//! The researcher's tools: what it may call now (OpenAI function tools, each argument a
//! JSON schema of string enums and bounded strings, so constrained decoding makes every
//! call well-formed), and the check of a call against the study as it is (a call is
//! valid only if it names a run and values the study has, and the run is where the tool
//! applies), which gives what it does.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::study::arms::render;
use crate::study::journal::{Phase, State};
use crate::study::spec::{Researcher, Study};

/// The longest reason or note (characters; the schema's `maxLength`).
pub const MAX_TEXT: u64 = 160;

/// The reason of a call that gave none (the engine enforces a string's `maxLength`,
/// not a `minLength`: an empty reason is well-formed).
pub const NO_REASON: &str = "(no reason given)";

/// Where a call stands in its turn: the read-only tools already called in it (the study
/// has not changed since, so they would show the same again), and whether this call must
/// change the study (the turn's last call while nothing runs or a run waits: only the
/// researcher can move the study then).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnSoFar {
    pub spent: Vec<String>,
    pub must_change: bool,
}

/// What a valid call does.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Shows the study's runs (changes nothing).
    ListRuns,
    /// Shows one run's curve and notes (changes nothing).
    ReadRun(usize),
    /// Keeps a note in the journal (changes nothing else).
    Note(String),
    /// A new run of these values, to these steps.
    Start {
        values: BTreeMap<String, Value>,
        steps: u64,
    },
    /// A run that reached its steps goes on to the next step count.
    Continue { arm: usize, steps: u64 },
    /// A waiting, running or reached run stops.
    Stop(usize),
    /// The study ends with this winner.
    Finish(Option<usize>),
}

impl Effect {
    /// Whether it changes the study (a turn ends at the first one that does).
    pub fn changes(&self) -> bool {
        !matches!(
            self,
            Effect::ListRuns | Effect::ReadRun(_) | Effect::Note(_)
        )
    }
}

fn ids(s: &State, f: impl Fn(usize) -> bool) -> Vec<String> {
    (0..s.arms.len())
        .filter(|&i| f(i))
        .map(|i| i.to_string())
        .collect()
}

/// Runs a `continue_run` may name: reached, with a step count above their target.
fn continuable(r: &Researcher, s: &State) -> Vec<String> {
    ids(s, |i| {
        s.arms[i].phase == Phase::Reached && r.steps.iter().any(|&x| x > s.arms[i].target)
    })
}

fn stoppable(s: &State) -> Vec<String> {
    ids(s, |i| {
        matches!(
            s.arms[i].phase,
            Phase::Waiting | Phase::Running | Phase::Reached
        )
    })
}

fn scored(s: &State) -> Vec<String> {
    ids(s, |i| s.arms[i].scores.values().any(Option::is_some))
}

/// A bounded string (no description: a small model copies a description as the value).
fn text() -> Value {
    json!({"type": "string", "maxLength": MAX_TEXT})
}

fn choice(values: &[String], desc: &str) -> Value {
    json!({"type": "string", "enum": values, "description": desc})
}

fn tool(name: &str, desc: &str, props: Vec<(&str, Value)>) -> Value {
    let mut p = Map::new();
    let required: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    for (k, v) in props {
        p.insert(k.to_string(), v);
    }
    json!({"type": "function", "function": {
        "name": name,
        "description": desc,
        "parameters": {"type": "object", "properties": p, "required": required},
    }})
}

/// The tools that apply now: a tool with nothing to name is left out, a read-only tool
/// already called this turn too, and `finish_study` until a run has a score (or no run
/// can be started any more).
pub fn offer(study: &Study, r: &Researcher, s: &State, turn: &TurnSoFar) -> Vec<Value> {
    let reason = text;
    let fresh = |name: &str| !turn.must_change && !turn.spent.iter().any(|t| t == name);
    let mut out = Vec::new();
    if fresh("list_runs") {
        out.push(tool(
            "list_runs",
            "Show every run: its settings, where it is, its scores.",
            vec![("reason", reason())],
        ));
    }
    if !s.arms.is_empty() && fresh("read_run") {
        out.push(tool(
            "read_run",
            "Show one run's curve (the metric by step) and its notes.",
            vec![
                ("run", choice(&ids(s, |_| true), "the run's number")),
                ("reason", reason()),
            ],
        ));
    }
    if s.arms.len() < r.max_arms {
        let mut props: Vec<(&str, Value)> = study
            .space
            .iter()
            .map(|p| {
                let vs: Vec<String> = p.values.iter().flatten().map(render).collect();
                (p.name.as_str(), choice(&vs, "the value for this run"))
            })
            .collect();
        let steps: Vec<String> = r.steps.iter().map(u64::to_string).collect();
        props.push(("steps", choice(&steps, "training steps to run")));
        props.push(("reason", reason()));
        out.push(tool(
            "start_run",
            "Start a new run with these settings, to this many training steps.",
            props,
        ));
    }
    let c = continuable(r, s);
    if !c.is_empty() {
        out.push(tool(
            "continue_run",
            "A run that reached its steps trains on, to the next step count.",
            vec![
                ("run", choice(&c, "the run's number")),
                ("reason", reason()),
            ],
        ));
    }
    let st = stoppable(s);
    if !st.is_empty() {
        out.push(tool(
            "stop_run",
            "Stop a run for good.",
            vec![
                ("run", choice(&st, "the run's number")),
                ("reason", reason()),
            ],
        ));
    }
    if fresh("write_note") {
        out.push(tool(
            "write_note",
            "Keep a note in the study's journal.",
            vec![("text", text())],
        ));
    }
    let mut w = scored(s);
    if w.is_empty() && s.arms.len() < r.max_arms {
        return out;
    }
    w.push("none".into());
    out.push(tool(
        "finish_study",
        "End the study, naming the best run.",
        vec![
            ("winner", choice(&w, "the best run, or none")),
            ("reason", reason()),
        ],
    ));
    out
}

fn field<'a>(args: &'a Value, name: &str) -> Result<&'a str, String> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("argument {name:?} is missing or not a string"))
}

fn bounded(args: &Value, name: &str) -> Result<String, String> {
    let t = field(args, name)?.trim();
    if t.chars().count() as u64 > MAX_TEXT {
        return Err(format!("argument {name:?} is over {MAX_TEXT} characters"));
    }
    Ok(t.to_string())
}

fn run_of(args: &Value, s: &State, allowed: &[String]) -> Result<usize, String> {
    let run = field(args, "run")?;
    if !allowed.iter().any(|a| a == run) {
        return Err(format!(
            "run {run:?} is not one this tool applies to now ({})",
            if allowed.is_empty() {
                "none".into()
            } else {
                allowed.join(", ")
            }
        ));
    }
    run.parse::<usize>()
        .ok()
        .filter(|&i| i < s.arms.len())
        .ok_or_else(|| format!("run {run:?} does not exist"))
}

/// Checks a call (`tool` with `args`) against the study as it is now: what it does and
/// its reason (a note's reason is its text), or why it is not valid.
pub fn check(
    study: &Study,
    r: &Researcher,
    s: &State,
    turn: &TurnSoFar,
    tool: &str,
    args: &Value,
) -> Result<(Effect, String), String> {
    let known: Vec<String> = offer(study, r, s, turn)
        .iter()
        .filter_map(|t| t.pointer("/function/name")?.as_str().map(str::to_string))
        .collect();
    if !known.iter().any(|k| k == tool) {
        return Err(format!(
            "{tool:?} is not a tool that applies now ({})",
            known.join(", ")
        ));
    }
    let Some(obj) = args.as_object() else {
        return Err("the arguments are not a JSON object".into());
    };
    let expected: Vec<String> = match tool {
        "write_note" => vec!["text".into()],
        "list_runs" => vec!["reason".into()],
        "read_run" | "continue_run" | "stop_run" => vec!["run".into(), "reason".into()],
        "finish_study" => vec!["winner".into(), "reason".into()],
        _ => study
            .space
            .iter()
            .map(|p| p.name.clone())
            .chain(["steps".into(), "reason".into()])
            .collect(),
    };
    if let Some(extra) = obj.keys().find(|k| !expected.contains(k)) {
        return Err(format!("unknown argument {extra:?}"));
    }
    if tool == "write_note" {
        let t = bounded(args, "text")?;
        return Ok((Effect::Note(t.clone()), t));
    }
    let reason = Some(bounded(args, "reason")?)
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| NO_REASON.to_string());
    let effect = match tool {
        "list_runs" => Effect::ListRuns,
        "read_run" => Effect::ReadRun(run_of(args, s, &ids(s, |_| true))?),
        "continue_run" => {
            let arm = run_of(args, s, &continuable(r, s))?;
            let target = s.arms[arm].target;
            let steps = r
                .steps
                .iter()
                .copied()
                .find(|&x| x > target)
                .ok_or_else(|| format!("run {arm} already ran the most steps"))?;
            Effect::Continue { arm, steps }
        }
        "stop_run" => Effect::Stop(run_of(args, s, &stoppable(s))?),
        "finish_study" => {
            let w = field(args, "winner")?;
            if w == "none" {
                Effect::Finish(None)
            } else {
                Effect::Finish(Some(run_of(&json!({"run": w}), s, &scored(s))?))
            }
        }
        _ => {
            // start_run
            let mut values = BTreeMap::new();
            for p in &study.space {
                let given = field(args, &p.name)?;
                let v = p
                    .values
                    .iter()
                    .flatten()
                    .find(|v| render(v) == given)
                    .ok_or_else(|| format!("{given:?} is not a value of {}", p.name))?;
                values.insert(p.name.clone(), v.clone());
            }
            let given = field(args, "steps")?;
            let steps = r
                .steps
                .iter()
                .copied()
                .find(|x| x.to_string() == given)
                .ok_or_else(|| format!("steps {given:?} is not one of the study's step counts"))?;
            Effect::Start { values, steps }
        }
    };
    Ok((effect, reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::study::arms::Arm;
    use crate::study::journal::Record;
    use crate::study::spec::PolicyKind;
    use std::path::Path;

    const FILE: &str = r#"
name = "t"
policy = "researcher"
[base]
model = "m"
client = ["--agent", "a", "--tasks", "t"]
[budget]
steps = 8
[space.lr]
server = "--learning-rate"
values = [1e-4, 3e-4]
[space.rank]
server = "--lora-rank"
values = [8, 32]
[researcher]
endpoint = "http://127.0.0.1:9/v1"
max_arms = 2
steps = [2, 8]
"#;

    fn setup() -> (Study, Researcher, State) {
        let study = Study::parse(Path::new("s.toml"), FILE).unwrap();
        let PolicyKind::Researcher(r) = study.policy.clone() else {
            panic!()
        };
        let s = State::replay(
            &[Record::Study {
                name: "t".into(),
                hash: "h".into(),
                seed: 0,
                arms: Vec::new(),
                unix_ms: 0,
            }],
            2,
        )
        .unwrap();
        (study, r, s)
    }

    fn names(tools: &[Value]) -> Vec<&str> {
        tools
            .iter()
            .map(|t| t.pointer("/function/name").unwrap().as_str().unwrap())
            .collect()
    }

    #[test]
    fn calls_are_checked_against_the_study_as_it_is() {
        let (study, r, mut s) = setup();
        assert_eq!(
            names(&offer(&study, &r, &s, &TurnSoFar::default())),
            ["list_runs", "start_run", "write_note"],
            "no finish before a run has a score"
        );
        let last = TurnSoFar {
            spent: vec!["list_runs".into()],
            must_change: true,
        };
        assert_eq!(names(&offer(&study, &r, &s, &last)), ["start_run"]);
        let again = TurnSoFar {
            spent: vec!["list_runs".into()],
            must_change: false,
        };
        assert_eq!(
            names(&offer(&study, &r, &s, &again)),
            ["start_run", "write_note"]
        );
        let e = check(&study, &r, &s, &again, "list_runs", &json!({"reason": "x"}));
        assert!(e.unwrap_err().contains("not a tool that applies now"));
        let start = json!({"lr": "3e-4", "rank": "32", "steps": "2", "reason": "try it"});
        let (e, why) = check(&study, &r, &s, &TurnSoFar::default(), "start_run", &start).unwrap();
        assert_eq!(why, "try it");
        let Effect::Start { values, steps } = e else {
            panic!("{e:?}")
        };
        assert_eq!((values["rank"].as_u64(), steps), (Some(32), 2));
        // Values, steps, runs and tools that the study does not have are refused.
        for (tool, args, says) in [
            (
                "start_run",
                json!({"lr": "5e-4", "rank": "32", "steps": "2", "reason": "x"}),
                "not a value of lr",
            ),
            (
                "start_run",
                json!({"lr": "3e-4", "rank": "32", "steps": "4", "reason": "x"}),
                "step counts",
            ),
            (
                "start_run",
                json!({"lr": "3e-4", "rank": "32", "steps": "2", "reason": "x", "y": 1}),
                "unknown argument",
            ),
            (
                "stop_run",
                json!({"run": "0", "reason": "x"}),
                "not a tool that applies now",
            ),
            (
                "finish_study",
                json!({"winner": "none", "reason": "x"}),
                "not a tool that applies now",
            ),
            ("rm_rf", json!({}), "not a tool"),
            ("write_note", json!({"text": "x".repeat(300)}), "over 160"),
        ] {
            let e = check(&study, &r, &s, &TurnSoFar::default(), tool, &args).unwrap_err();
            assert!(e.contains(says), "{tool} {args}: {e}");
        }
        // Two runs: one reached 2 steps with a score, one running.
        for id in 0..2 {
            s.apply(&Record::Arm {
                arm: Arm {
                    id,
                    name: format!("a{id}"),
                    values: values.clone(),
                },
                from: None,
                steps: 2,
                reason: "r".into(),
                unix_ms: 0,
            })
            .unwrap();
            s.apply(&Record::Launch {
                arm: id,
                steps: 2,
                attempt: 1,
                host: None,
                unix_ms: 0,
            })
            .unwrap();
        }
        s.apply(&Record::Reached {
            arm: 1,
            steps: 2,
            score: Some(0.5),
            unix_ms: 0,
        })
        .unwrap();
        assert_eq!(
            names(&offer(&study, &r, &s, &TurnSoFar::default())),
            [
                "list_runs",
                "read_run",
                "continue_run",
                "stop_run",
                "write_note",
                "finish_study"
            ],
            "max_arms reached: no start_run"
        );
        let go = check(
            &study,
            &r,
            &s,
            &TurnSoFar::default(),
            "continue_run",
            &json!({"run": "1", "reason": "good"}),
        );
        assert_eq!(go.unwrap().0, Effect::Continue { arm: 1, steps: 8 });
        let e = check(
            &study,
            &r,
            &s,
            &TurnSoFar::default(),
            "continue_run",
            &json!({"run": "0", "reason": "x"}),
        );
        assert!(e.unwrap_err().contains("not one this tool applies to"));
        let fin = check(
            &study,
            &r,
            &s,
            &TurnSoFar::default(),
            "finish_study",
            &json!({"winner": "1", "reason": "best"}),
        );
        assert_eq!(fin.unwrap().0, Effect::Finish(Some(1)));
        assert!(!Effect::ReadRun(0).changes() && Effect::Stop(0).changes());
        let quiet = check(
            &study,
            &r,
            &s,
            &TurnSoFar::default(),
            "stop_run",
            &json!({"run": "0", "reason": ""}),
        );
        assert_eq!(quiet.unwrap(), (Effect::Stop(0), NO_REASON.to_string()));
    }
}
