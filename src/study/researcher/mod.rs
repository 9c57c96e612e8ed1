//! The `researcher` policy: an LLM behind any OpenAI-compatible endpoint (a client's
//! proxy of a model served in this swarm, or anyone's) runs the study through tools:
//! list the runs, read a run's curve and notes, start a run with settings of the study's
//! space, let a run that reached its steps go on, stop a run, write a note, finish the
//! study naming the winner.
//!
//! Each call is `tool_choice: "required"` with the tools that apply now, their arguments
//! string enums (run numbers, the space's values, the step counts) and bounded strings,
//! so an engine with constrained decoding (ours does) can only produce a well-formed
//! call. Every call is checked again against the study as it is ([`tools::check`]), and
//! every call, valid or not, goes to the journal with its reason and what it did.
//!
//! The driver asks for a turn when nothing runs, or (a run reached its steps, or there
//! is room for a run) and the study changed since the researcher last passed; each call
//! runs on a thread of its own while the driver keeps watching the running arms. A turn is up to `calls_per_turn` calls and ends at the first
//! that changes the study. Each call's prompt is the study's description, its runs as a
//! table, the latest notes, and this turn's calls so far with their results: the prompt
//! does not grow with the study's length.

pub mod tools;

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use super::error::StudyError;
use super::journal::{Record, State};
use super::launch::ArmDir;
use super::spec::{Goal, Researcher as Spec, Study};
use super::watch;
use crate::facade::external::{post_json, ExternalModel};
pub use tools::Effect;

/// The most characters of a tool name, an answer's text or an endpoint's error kept
/// (in the journal, the report and the next prompt); arguments longer than this as JSON
/// are kept as a cut string.
pub const MAX_KEPT: usize = 2000;

/// `s` cut to `MAX_KEPT` characters, saying so.
pub fn cut(s: &str) -> String {
    if s.chars().count() <= MAX_KEPT {
        return s.to_string();
    }
    let head: String = s.chars().take(MAX_KEPT).collect();
    format!("{head}... (cut at {MAX_KEPT} characters)")
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// A tool call: its name and arguments (a string when they were not JSON).
    Call { tool: String, args: Value },
    /// No tool call (the answer's text and finish reason).
    Text { content: String, finish: String },
}

/// The researcher's connection to its model.
pub struct Researcher {
    pub spec: Spec,
    model: ExternalModel,
    rt: tokio::runtime::Runtime,
}

impl Researcher {
    /// The model of `spec`; its API key from `AGENTJET_EXTERNAL_KEY_RESEARCHER` or
    /// `AGENTJET_EXTERNAL_KEY` (never from the study file).
    pub fn new(spec: &Spec) -> Result<Researcher, StudyError> {
        let model = ExternalModel::parse(
            &format!("researcher={}#{}", spec.endpoint, spec.model),
            |k| std::env::var(k).ok(),
        )
        .map_err(|e| StudyError::Researcher(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StudyError::Researcher(format!("a runtime for its calls: {e}")))?;
        Ok(Researcher {
            spec: spec.clone(),
            model,
            rt,
        })
    }

    /// One call of the model with `prompt` (system, user) and `tools`. An error is the
    /// endpoint's (not reached, not 200, not an answer), not the model's.
    pub fn ask(&self, prompt: (String, String), tools: &[Value]) -> Result<Reply, String> {
        let body = json!({
            "messages": [
                {"role": "system", "content": prompt.0},
                {"role": "user", "content": prompt.1},
            ],
            "tools": tools,
            "tool_choice": "required",
            "temperature": self.spec.temperature,
            "max_tokens": self.spec.max_tokens,
        });
        let timeout = Duration::from_secs_f64(self.spec.timeout_seconds);
        let (status, answer) = self
            .rt
            .block_on(post_json(&self.model, "chat/completions", &body, timeout))
            .map_err(|e| cut(&e.to_string()))?;
        if status != 200 {
            return Err(cut(&format!(
                "{}: HTTP {status}: {}",
                self.model.base_url,
                answer.pointer("/error/message").unwrap_or(&answer)
            )));
        }
        let choice = answer
            .pointer("/choices/0")
            .ok_or_else(|| cut(&format!("an answer without choices: {answer}")))?;
        if let Some(call) = choice.pointer("/message/tool_calls/0/function") {
            let tool = cut(call.get("name").and_then(Value::as_str).unwrap_or_default());
            let raw = call.get("arguments").cloned().unwrap_or(Value::Null);
            let args = match &raw {
                Value::String(s) => serde_json::from_str(s).unwrap_or(raw.clone()),
                _ => raw,
            };
            let args = if args.to_string().len() > MAX_KEPT {
                Value::String(cut(&args.to_string()))
            } else {
                args
            };
            return Ok(Reply::Call { tool, args });
        }
        Ok(Reply::Text {
            content: cut(choice
                .pointer("/message/content")
                .and_then(Value::as_str)
                .unwrap_or_default()),
            finish: cut(choice
                .get("finish_reason")
                .and_then(Value::as_str)
                .unwrap_or_default()),
        })
    }
}

/// The system and user messages of a call: the study, its runs, the latest notes, and
/// this turn's calls so far (`turn`: a call and its result each).
pub fn prompt(
    study: &Study,
    spec: &Spec,
    dir: &std::path::Path,
    s: &State,
    turn: &[(String, String)],
) -> (String, String) {
    let goal = match study.goal {
        Goal::Max => "as high as possible",
        Goal::Min => "as low as possible",
    };
    let mut sys = format!(
        "You run a reinforcement-learning study named {}. Each run trains the model {} \
         with one value of each setting below. A run's score is its {} averaged over its \
         last {} steps; the goal is a score {goal}.\nSettings and their values:\n",
        study.name, study.base.model, study.metric, study.window
    );
    for p in &study.space {
        let vs: Vec<String> = p.values.iter().flatten().map(super::arms::render).collect();
        let _ = writeln!(sys, "- {}: {}", p.name, vs.join(", "));
    }
    let used = s.actions.len() as u32;
    let _ = write!(
        sys,
        "A run trains to a step count you choose ({}); then it waits for you: continue it \
         to the next step count, or stop it. At most {} runs train at once, {} runs in all; \
         you have {} tool calls left. Call exactly one tool, and give a short reason. When \
         you know the best run, call finish_study.",
        spec.steps
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        study.budget.at_once,
        spec.max_arms,
        spec.max_actions.saturating_sub(used)
    );
    let mut user = runs_table(study, dir, s);
    let notes: Vec<&str> = s
        .actions
        .iter()
        .filter_map(|r| match r {
            Record::Action {
                tool, args, valid, ..
            } if tool == "write_note" && *valid => args.get("text").and_then(Value::as_str),
            _ => None,
        })
        .collect();
    if !notes.is_empty() {
        user.push_str("\nYour notes:\n");
        for n in &notes[notes.len().saturating_sub(5)..] {
            let _ = writeln!(user, "- {n}");
        }
    }
    if !turn.is_empty() {
        user.push_str("\nThis turn so far:\n");
        for (call, result) in turn {
            let _ = writeln!(user, "- {call} -> {result}");
        }
    }
    user.push_str("\nWhat do you do next?");
    (sys, user)
}

/// The runs, one line each: settings, where it is, scores at each step count, failures.
pub fn runs_table(study: &Study, dir: &std::path::Path, s: &State) -> String {
    if s.arms.is_empty() {
        return "No run yet (start_run starts one).\n".into();
    }
    let mut out = String::from("Runs:\n");
    for a in &s.arms {
        let settings: Vec<String> = study
            .space
            .iter()
            .filter_map(|p| {
                a.arm
                    .values
                    .get(&p.name)
                    .map(|v| format!("{}={}", p.name, super::arms::render(v)))
            })
            .collect();
        let scores: Vec<String> = a
            .scores
            .iter()
            .map(|(k, v)| match v {
                Some(x) => format!("{x:.3} at {k} steps"),
                None => format!("none at {k} steps"),
            })
            .collect();
        let taken = ArmDir::new(dir, a.arm.id)
            .metrics_path()
            .map(|p| watch::steps(&p))
            .and_then(|st| st.last().map(|x| x.step))
            .unwrap_or(0);
        let _ = writeln!(
            out,
            "- run {}: {}; {} (to {} steps, {taken} taken); score: {}{}",
            a.arm.id,
            settings.join(" "),
            match a.phase {
                super::journal::Phase::Waiting => "waiting to start",
                super::journal::Phase::Running => "running",
                super::journal::Phase::Reached => "reached its steps, waiting for you",
                super::journal::Phase::Stopped => "stopped",
                super::journal::Phase::Finished => "finished",
            },
            a.target,
            if scores.is_empty() {
                "none yet".into()
            } else {
                scores.join(", ")
            },
            if a.failures.is_empty() {
                String::new()
            } else {
                format!("; failures: {}", a.failures.len())
            }
        );
    }
    out
}

/// What `read_run` shows: the run's metric by step (the last 20 steps) and its notes'
/// last lines.
pub fn read_run(study: &Study, dir: &std::path::Path, s: &State, arm: usize) -> String {
    let d = ArmDir::new(dir, arm);
    let steps = d
        .metrics_path()
        .map(|p| watch::steps(&p))
        .unwrap_or_default();
    let curve: Vec<String> = steps[steps.len().saturating_sub(20)..]
        .iter()
        .map(|x| format!("{}:{:.3}", x.step, x.get(&study.metric)))
        .collect();
    let notes = std::fs::read_to_string(d.dir.join("driver.log")).unwrap_or_default();
    let last: Vec<&str> = notes.lines().rev().take(3).collect();
    let a = &s.arms[arm];
    format!(
        "run {arm} ({}): {} by step: {}; failures: {}; last notes: {}",
        a.arm.name,
        study.metric,
        if curve.is_empty() {
            "no step yet".into()
        } else {
            curve.join(" ")
        },
        if a.failures.is_empty() {
            "none".into()
        } else {
            a.failures
                .iter()
                .map(|(k, d)| format!("{k} ({d})"))
                .collect::<Vec<_>>()
                .join("; ")
        },
        last.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )
}
