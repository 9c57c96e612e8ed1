//! Studies: long-running RL experiments that a driver runs, watches, repairs and reports
//! on (`agentjet-peer study run STUDY.toml`). A study is a base configuration (the
//! servers' and the client's flags, the agent, its tasks, the model), arms (a list, or a
//! space of parameters as a grid or draws), a budget and a policy that decides which
//! arms go on (`grid`, `asha`, `pbt`) or an LLM that runs the study through tools
//! (`researcher`).
//!
//! - [`spec`]: the study file, checked with the field of every mistake named;
//! - [`arms`]: the arms and each arm's flags;
//! - [`launch`]: an arm's processes, each arm its own swarm;
//! - [`watch`]: what the driver reads of a running arm: steps, score, failures;
//! - [`policy`]: the decisions, from the journal's figures alone; [`pbt`] its
//!   population-based training;
//! - [`researcher`]: the LLM policy, its tools and its calls;
//! - [`journal`]: every fact and decision, synced before it is acted on;
//! - [`driver`]: the loop; a driver killed anywhere resumes where it was;
//! - [`remote`], [`wire`], [`worker`]: arms on other machines of a swarm (study
//!   workers), read by the driver as its own;
//! - [`report`]: the report, with the arms' curves; [`dash`] the same on a web page
//!   while the driver runs.
//!
//! The study runs arms as processes of the `agentjet-peer` binary it is given (on its
//! own machine, or on a worker's): it never uses the roles' code itself.

pub mod arms;
pub mod dash;
pub mod driver;
pub mod error;
pub mod journal;
pub mod launch;
pub mod pbt;
pub mod policy;
pub mod remote;
pub mod report;
pub mod researcher;
pub mod spec;
pub mod watch;
pub mod wire;
pub mod worker;

pub use driver::{run, Options, Outcome};
pub use error::StudyError;
pub use spec::Study;

/// A study's directory when none is given: `runs/<name>` under the current directory.
pub fn default_dir(study: &Study) -> std::path::PathBuf {
    std::path::Path::new("runs").join(&study.name)
}

/// What `study status` prints: where the study is, each arm's state, and the last
/// decisions.
pub fn status(study: &Study, dir: &std::path::Path) -> Result<String, StudyError> {
    let (records, state) = report::load(study, dir)?;
    let mut out = format!(
        "study {} in {}: {}\n",
        study.name,
        dir.display(),
        match &state.ended {
            Some((Some(w), reason)) => format!(
                "ended ({reason}); winner arm {w} ({})",
                state.arms[*w].arm.name
            ),
            Some((None, reason)) => format!("ended ({reason}); no winner"),
            None => format!(
                "not ended ({} record(s), {} resume(s))",
                records.len(),
                state.resumes
            ),
        }
    );
    out.push_str(&report::table(dir, &state));
    let last: Vec<&journal::Record> = state.decisions.iter().rev().take(5).collect();
    if !last.is_empty() {
        out.push_str("last decisions:\n");
        for r in last.into_iter().rev() {
            if let journal::Record::Decision {
                arm,
                action,
                reason,
                ..
            } = r
            {
                out.push_str(&format!("  arm {arm}: {action:?}: {reason}\n"));
            }
        }
    }
    Ok(out)
}
