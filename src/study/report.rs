//! The study's report (`report.md` and `curves.svg` in its directory): the arms' curves
//! side by side, each arm's figures at each target, every decision with its reason, the
//! failures, and the winner with its checkpoint. `study status` prints the table alone.

use std::fmt::Write as _;
use std::path::Path;

use super::error::StudyError;
use super::journal::{Journal, Phase, Record, State};
use super::launch::ArmDir;
use super::policy::Policy;
use super::spec::{Goal, PolicyKind, Study};
use super::watch;
use crate::base::plot::{svg_plot, Series};

/// The journal of the study in `dir`, read back (an error when it has none).
pub fn load(study: &Study, dir: &Path) -> Result<(Vec<Record>, State), StudyError> {
    let journal = Journal::at(dir);
    let records = journal.read()?;
    if records.is_empty() {
        return Err(StudyError::Journal {
            path: journal.path,
            msg: "no journal: the study has not run in this directory".into(),
        });
    }
    if let Some(Record::Study { hash, .. }) = records.first() {
        if *hash != study.hash {
            return Err(StudyError::Journal {
                path: journal.path,
                msg: "it is the journal of another study file (it was edited since): \
                      give the file it ran with"
                    .into(),
            });
        }
    }
    let state =
        State::replay(&records, Policy::new(study).first()).map_err(|msg| StudyError::Journal {
            path: journal.path.clone(),
            msg,
        })?;
    Ok((records, state))
}

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Waiting => "waiting",
        Phase::Running => "running",
        Phase::Reached => "at its rung",
        Phase::Stopped => "stopped",
        Phase::Finished => "finished",
    }
}

fn shown(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.4}"))
}

/// The arms as a markdown table: state, steps taken, score at each target, launches,
/// failures.
pub fn table(dir: &Path, state: &State) -> String {
    let mut out = String::from(
        "| arm | name | state | steps taken | score at each target | launches | failures |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for a in &state.arms {
        let d = ArmDir::new(dir, a.arm.id);
        let taken = d
            .metrics_path()
            .map(|p| watch::steps(&p))
            .and_then(|s| s.last().map(|s| s.step))
            .unwrap_or(0);
        let scores: Vec<String> = a
            .scores
            .iter()
            .map(|(k, v)| format!("{k}: {}", shown(*v)))
            .collect();
        let fails: Vec<String> = a.failures.iter().map(|(k, _)| k.clone()).collect();
        // Where its last launch ran, when a study worker ran it.
        let launches = match &a.host {
            Some(w) => {
                let tail: String = w
                    .chars()
                    .skip(w.chars().count().saturating_sub(8))
                    .collect();
                format!("{} (worker …{tail})", a.launches)
            }
            None => a.launches.to_string(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {taken} | {} | {} | {} |",
            a.arm.id,
            a.arm.name.replace('|', "\\|"),
            phase(a.phase),
            if scores.is_empty() {
                "-".into()
            } else {
                scores.join(", ")
            },
            launches,
            if fails.is_empty() {
                "-".into()
            } else {
                fails.join(", ")
            },
        );
    }
    out
}

/// Writes `report.md` and `curves.svg`; returns the report's path.
pub fn write(study: &Study, dir: &Path) -> Result<std::path::PathBuf, StudyError> {
    let (md, svg) = render(study, dir)?;
    let svg_path = dir.join("curves.svg");
    crate::base::files::write_atomic(&svg_path, svg.as_bytes())
        .map_err(|e| StudyError::io(&svg_path, e))?;
    let path = dir.join("report.md");
    crate::base::files::write_atomic(&path, md.as_bytes()).map_err(|e| StudyError::io(&path, e))?;
    Ok(path)
}

/// The report (markdown) and its curves (SVG), as the journal and the arms' metrics
/// are now.
pub fn render(study: &Study, dir: &Path) -> Result<(String, String), StudyError> {
    let (records, state) = load(study, dir)?;
    let policy = Policy::new(study);
    let series: Vec<Series> = state
        .arms
        .iter()
        .map(|a| Series {
            name: format!("{}: {}", a.arm.id, a.arm.name),
            points: ArmDir::new(dir, a.arm.id)
                .metrics_path()
                .map(|p| watch::steps(&p))
                .unwrap_or_default()
                .iter()
                .map(|s| (s.step as f64, s.get(&study.metric)))
                .collect(),
        })
        .collect();
    let svg = svg_plot(
        &format!("{}: {} by training step", study.name, study.metric),
        "step",
        &study.metric,
        &series,
    );
    let mut md = format!("# Study {}\n\n", study.name);
    let rungs: Vec<String> = policy.rungs().iter().map(u64::to_string).collect();
    let how = match &study.policy {
        PolicyKind::Grid => format!("grid: every arm runs {} steps", study.budget.steps),
        PolicyKind::Halving { eta, .. } => format!(
            "asha (successive halving): rungs at {} steps; the best 1/{eta} of a rung go on",
            rungs.join(", ")
        ),
        PolicyKind::Pbt(p) => format!(
            "pbt (population-based training): rungs at {} steps; the worst {} of a rung take \
             the best arms' checkpoints with {} explored",
            rungs.join(", "),
            p.quantile,
            p.explore.join(", ")
        ),
        PolicyKind::Researcher(r) => format!(
            "researcher: the model {} at {} runs the study through tools (step counts {})",
            r.model,
            r.endpoint,
            rungs.join(", ")
        ),
    };
    let first = records.first().map_or(0, unix_ms_of);
    let last = records.last().map_or(0, unix_ms_of);
    let _ = writeln!(
        md,
        "- policy: {how}\n- score: {} ({}), the mean of an arm's last {} steps up to a target\n\
         - seed {}; {} arms, at most {} at once; {:.1} minutes from the journal's first line to its last; \
         {} resume(s) of the driver\n- file: `{}` (hash {})\n",
        study.metric,
        if study.goal == Goal::Max { "higher is better" } else { "lower is better" },
        study.window,
        study.seed,
        state.arms.len(),
        study.budget.at_once,
        last.saturating_sub(first) as f64 / 60_000.0,
        state.resumes,
        study.file.display(),
        &study.hash[..12],
    );
    match &state.ended {
        None => md.push_str("**The study has not ended.**\n\n"),
        Some((winner, reason)) => {
            let _ = writeln!(md, "Ended: {reason}.\n");
            match winner {
                Some(w) => {
                    let a = &state.arms[*w];
                    let (at, score) = a
                        .scores
                        .iter()
                        .next_back()
                        .map_or((0, None), |(k, v)| (*k, *v));
                    let ck = ArmDir::new(dir, *w).checkpoint_place(dir);
                    let _ = writeln!(
                        md,
                        "**Winner: arm {w} ({})**, {} {} at {at} steps; its checkpoint: {}.\n",
                        a.arm.name,
                        study.metric,
                        shown(score),
                        ck.map_or("none saved".into(), |c| format!("`{c}`")),
                    );
                }
                None => md.push_str("No arm has a score: no winner.\n\n"),
            }
        }
    }
    md.push_str("![curves](curves.svg)\n\n## Arms\n\n");
    md.push_str(&table(dir, &state));
    md.push_str("\n## Decisions\n\n");
    let mut n = 0;
    for r in &records {
        if let Record::Decision {
            arm,
            action,
            steps,
            reason,
            ..
        } = r
        {
            n += 1;
            let what = match action {
                super::journal::Action::Continue => format!("continues to {steps} steps"),
                super::journal::Action::Stop => "stops".into(),
                super::journal::Action::Finish => "finished".into(),
            };
            let _ = writeln!(
                md,
                "{n}. arm {arm} ({}) {what}: {reason}",
                state.arms[*arm].arm.name
            );
        }
    }
    if n == 0 {
        md.push_str("None yet.\n");
    }
    let born: Vec<String> = records
        .iter()
        .filter_map(|r| match r {
            Record::Arm {
                arm, from, reason, ..
            } => Some(format!(
                "- arm {} ({}){}: {reason}",
                arm.id,
                arm.name,
                from.map_or(String::new(), |o| format!(
                    ", from arm {}'s checkpoint at rung {}",
                    o.arm, o.step
                ))
            )),
            _ => None,
        })
        .collect();
    if !born.is_empty() {
        md.push_str("\n## Arms started by the policy\n\n");
        md.push_str(&born.join("\n"));
        md.push('\n');
    }
    if matches!(study.policy, PolicyKind::Researcher(_)) {
        md.push_str(&actions(&state));
    }
    md.push_str("\n## Failures\n\n");
    let mut f = 0;
    for r in &records {
        if let Record::Failure {
            arm,
            kind,
            detail,
            restart,
            ..
        } = r
        {
            f += 1;
            let _ = writeln!(
                md,
                "- arm {arm} ({}): {kind}: {detail} ({})",
                state.arms[*arm].arm.name,
                if *restart {
                    "restarted from its checkpoint"
                } else {
                    "stopped"
                }
            );
        }
    }
    if f == 0 {
        md.push_str("None.\n");
    }
    Ok((md, svg))
}

/// The researcher's calls: how many, how many valid, and each with its reason and result.
pub fn actions(state: &State) -> String {
    let valid = state
        .actions
        .iter()
        .filter(|r| matches!(r, Record::Action { valid: true, .. }))
        .count();
    let mut md = format!(
        "\n## The researcher's tool calls\n\n{} call(s), {valid} valid, {} refused.\n\n",
        state.actions.len(),
        state.actions.len() - valid
    );
    for r in &state.actions {
        if let Record::Action {
            n,
            tool,
            args,
            valid,
            result,
            ..
        } = r
        {
            let result: String = result.chars().take(300).collect();
            let _ = writeln!(
                md,
                "{n}. `{tool}` {} {}: {}",
                serde_json::to_string(args).unwrap_or_default(),
                if *valid { "(valid)" } else { "(REFUSED)" },
                result.replace('\n', " ")
            );
        }
    }
    md
}

fn unix_ms_of(r: &Record) -> u64 {
    match r {
        Record::Arm { unix_ms, .. } | Record::Action { unix_ms, .. } => *unix_ms,
        Record::Study { unix_ms, .. }
        | Record::Resumed { unix_ms }
        | Record::Launch { unix_ms, .. }
        | Record::Reached { unix_ms, .. }
        | Record::Failure { unix_ms, .. }
        | Record::Decision { unix_ms, .. }
        | Record::End { unix_ms, .. } => *unix_ms,
    }
}
