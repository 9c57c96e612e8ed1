//! Runs an agent for one episode: `sh -c COMMAND` in its own process group, with
//!
//! - `OPENAI_BASE_URL`: the client's local proxy (`http://127.0.0.1:PORT/v1`);
//! - `OPENAI_API_KEY`: the episode id (the proxy tracks the calls under it);
//! - `ANTHROPIC_BASE_URL` (the proxy's root) and `ANTHROPIC_API_KEY` (the episode id), for
//!   agents on Anthropic's SDK (`/v1/messages`);
//! - `AGENTJET_EPISODE_ID`, `AGENTJET_TASK_ID`, `AGENTJET_TASK` (the task as JSON, also
//!   written to the agent's stdin);
//!
//! and its stdout/stderr in `<run-dir>/episodes/<episode>.stdout|.stderr`. The reward is
//! the agent's last stdout line (`{"reward": r}` or `{"rewards": {"model": r}}`), or what
//! it posted to the proxy's `/v1/agentjet/reward`, or, with a grader, the grader's last
//! stdout line (the grader gets the task and the transcript as JSON on stdin). An agent
//! that exits non-zero, exits without a reward, or passes the timeout is aborted with the
//! reason; its whole process group is killed (also after a normal exit, so background
//! children never outlive their episode).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use super::tasks::Task;
use crate::base::Stop;
use crate::facade::reward::{parse_reward, PostedReward, Rewards};

/// How agents are run.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    pub command: String,
    pub grader: Option<String>,
    pub timeout: Duration,
    /// The proxy's base URL (`http://127.0.0.1:PORT/v1`).
    pub base_url: String,
    /// Where the agents' stdout/stderr go.
    pub logs: PathBuf,
}

/// How an episode's agent ended.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentOutcome {
    Reward(PostedReward),
    Aborted(String),
}

/// How an agent's (or a grader's) process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ProcessEnd {
    Exited(i32),
    /// Killed, with the reason (a timeout, an abort, a failed wait).
    Killed(String),
}

/// Why an agent's process could not be started.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("{}: {source}", path.display())]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start `sh -c {command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
}

/// Sends SIGKILL to a whole process group (gone already: nothing to do).
fn kill_group(pgid: u32) {
    if pgid > 1 {
        // SAFETY: kill(2) with a negative pid signals the group; no memory is involved.
        unsafe {
            libc::kill(-(pgid as i32), libc::SIGKILL);
        }
    }
}

/// The last `max` bytes of a file, as text.
fn tail(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut b = Vec::new();
    let _ = f.read_to_end(&mut b);
    String::from_utf8_lossy(&b).into_owned()
}

fn last_line(text: &str) -> Option<&str> {
    text.lines().map(str::trim).rfind(|l| !l.is_empty())
}

/// A reward in a last stdout line: `{"reward": r}`, `{"rewards": {...}}` or, from a
/// grader, a bare number.
pub fn reward_from_line(line: &str, bare_number: bool) -> Option<PostedReward> {
    if bare_number {
        if let Ok(x) = line.parse::<f64>() {
            return x.is_finite().then_some(PostedReward::One(x));
        }
    }
    let v: Value = serde_json::from_str(line).ok()?;
    parse_reward(&v).ok()
}

/// Runs `sh -c command` in its own process group until it exits, the timeout passes or
/// an abort comes (a drain lets it run to its end).
async fn run_group(
    command: &str,
    env: &[(&str, String)],
    stdin: Vec<u8>,
    stdout: &Path,
    stderr: &Path,
    timeout: Duration,
    stop: &Stop,
) -> Result<ProcessEnd, StartError> {
    let log = |path: &Path| {
        std::fs::File::create(path).map_err(|source| StartError::Log {
            path: path.to_path_buf(),
            source,
        })
    };
    let (out, err) = (log(stdout)?, log(stderr)?);
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0)
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|source| StartError::Spawn {
        command: command.to_string(),
        source,
    })?;
    let pgid = child.id().unwrap_or(0);
    // The task goes to stdin beside the wait (an agent that never reads it, or exits
    // first, is fine); then this future idles until the select below ends.
    let pipe = child.stdin.take();
    let feed = async move {
        if let Some(mut sin) = pipe {
            let _ = sin.write_all(&stdin).await;
            let _ = sin.shutdown().await;
        }
        std::future::pending::<()>().await
    };
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline, feed);
    let r = tokio::select! {
        _ = &mut feed => unreachable!("feeding stdin never ends the wait"),
        st = child.wait() => match st {
            Ok(s) => ProcessEnd::Exited(s.code().unwrap_or(-1)),
            Err(e) => ProcessEnd::Killed(format!("could not be waited for: {e}")),
        },
        _ = &mut deadline => {
            ProcessEnd::Killed(format!("timed out after {:.0} s", timeout.as_secs_f64()))
        }
        _ = stop.aborted() => ProcessEnd::Killed("was stopped (Ctrl-C or SIGTERM, twice)".into()),
    };
    kill_group(pgid);
    let _ = child.wait().await;
    Ok(r)
}

/// Runs the agent for `episode` on `task`; the reward or why the episode is aborted.
/// `transcript` gives the grader what the model said (called once the agent exited).
pub async fn run_agent(
    spec: &AgentSpec,
    episode: &str,
    task: &Task,
    rewards: &Rewards,
    transcript: impl FnOnce() -> Value,
    stop: &Stop,
) -> AgentOutcome {
    let t0 = Instant::now();
    let task_json = json!({"id": task.id, "data": task.data}).to_string();
    // Anthropic's SDK appends /v1/messages to its base URL: the proxy's root.
    let root = spec
        .base_url
        .strip_suffix("/v1")
        .unwrap_or(&spec.base_url)
        .to_string();
    let env = [
        ("OPENAI_BASE_URL", spec.base_url.clone()),
        ("OPENAI_API_KEY", episode.to_string()),
        ("ANTHROPIC_BASE_URL", root),
        ("ANTHROPIC_API_KEY", episode.to_string()),
        ("AGENTJET_EPISODE_ID", episode.to_string()),
        ("AGENTJET_TASK_ID", task.id.clone()),
        ("AGENTJET_TASK", task_json.clone()),
    ];
    let safe = crate::base::safe_file_name(episode);
    let stdout = spec.logs.join(format!("{safe}.stdout"));
    let stderr = spec.logs.join(format!("{safe}.stderr"));
    let code = match run_group(
        &spec.command,
        &env,
        format!("{task_json}\n").into_bytes(),
        &stdout,
        &stderr,
        spec.timeout,
        stop,
    )
    .await
    {
        Err(e) => return AgentOutcome::Aborted(e.to_string()),
        Ok(ProcessEnd::Killed(why)) => {
            rewards.take(episode);
            return AgentOutcome::Aborted(format!("the agent {why}"));
        }
        Ok(ProcessEnd::Exited(code)) => code,
    };
    let posted = rewards.take(episode);
    if code != 0 {
        let last_err = last_line(&tail(&stderr, 4096))
            .map(|l| format!("; last stderr line: {l}"))
            .unwrap_or_default();
        return AgentOutcome::Aborted(format!("the agent exited with status {code}{last_err}"));
    }
    let out_text = tail(&stdout, 64 << 10);
    let grader = task.grader.clone().or_else(|| spec.grader.clone());
    if let Some(g) = grader {
        let input = json!({
            "task": {"id": task.id, "data": task.data},
            "episode_id": episode,
            "stdout": out_text,
            "transcript": transcript(),
        });
        let left = spec
            .timeout
            .saturating_sub(t0.elapsed())
            .max(Duration::from_secs(5));
        let gout = spec.logs.join(format!("{safe}.grader.stdout"));
        let gerr = spec.logs.join(format!("{safe}.grader.stderr"));
        let r = run_group(
            &g,
            &env,
            format!("{input}\n").into_bytes(),
            &gout,
            &gerr,
            left,
            stop,
        )
        .await;
        return match r {
            Err(e) => AgentOutcome::Aborted(format!("grader: {e}")),
            Ok(ProcessEnd::Killed(why)) => AgentOutcome::Aborted(format!("the grader {why}")),
            Ok(ProcessEnd::Exited(c)) if c != 0 => {
                AgentOutcome::Aborted(format!("the grader exited with status {c}"))
            }
            Ok(ProcessEnd::Exited(_)) => match last_line(&tail(&gout, 4096)).and_then(|l| reward_from_line(l, true)) {
                Some(r) => AgentOutcome::Reward(r),
                None => AgentOutcome::Aborted(
                    "the grader printed no reward (its last stdout line must be a number or {\"reward\": r})"
                        .into(),
                ),
            },
        };
    }
    if let Some(r) = last_line(&out_text).and_then(|l| reward_from_line(l, false)) {
        return AgentOutcome::Reward(r);
    }
    match posted {
        Some(r) => AgentOutcome::Reward(r),
        None => AgentOutcome::Aborted(
            "the agent exited without a reward (its last stdout line must be {\"reward\": r} or {\"rewards\": {...}}, or it POSTs to /v1/agentjet/reward)"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, cmd: &str, timeout: f64) -> AgentSpec {
        AgentSpec {
            command: cmd.into(),
            grader: None,
            timeout: Duration::from_secs_f64(timeout),
            base_url: "http://127.0.0.1:9/v1".into(),
            logs: dir.to_path_buf(),
        }
    }

    fn task() -> Task {
        Task {
            id: "t1".into(),
            data: json!({"a": 2, "b": 3}),
            grader: None,
        }
    }

    async fn run(s: &AgentSpec) -> AgentOutcome {
        let stop = Stop::new();
        run_agent(s, "ep-1", &task(), &Rewards::default(), || json!([]), &stop).await
    }

    #[tokio::test]
    async fn rewards_from_stdout_env_and_stdin_and_every_way_to_fail() {
        let d = tempfile::tempdir().unwrap();
        // The task arrives on stdin and in the environment; the reward is the last line.
        let s = spec(
            d.path(),
            r#"read line; test "$AGENTJET_TASK" = "$line" && test "$OPENAI_API_KEY" = ep-1 && echo working && echo '{"reward": 0.5}'"#,
            10.0,
        );
        assert_eq!(run(&s).await, AgentOutcome::Reward(PostedReward::One(0.5)));
        let s = spec(d.path(), r#"echo '{"rewards": {"a": 1, "b": 0}}'"#, 10.0);
        match run(&s).await {
            AgentOutcome::Reward(PostedReward::PerModel(m)) => assert_eq!(m["a"], 1.0),
            other => panic!("{other:?}"),
        }
        // Crash, no reward, timeout.
        let s = spec(d.path(), "echo oops >&2; exit 3", 10.0);
        match run(&s).await {
            AgentOutcome::Aborted(why) => {
                assert!(why.contains("status 3") && why.contains("oops"), "{why}")
            }
            other => panic!("{other:?}"),
        }
        let s = spec(d.path(), "echo done", 10.0);
        assert!(
            matches!(run(&s).await, AgentOutcome::Aborted(w) if w.contains("without a reward"))
        );
        // A hung agent with a background child: both killed at the timeout.
        let marker = d.path().join("child-alive");
        let cmd = format!("(sleep 3; touch {}) & sleep 100", marker.display());
        let t0 = Instant::now();
        let s = spec(d.path(), &cmd, 0.5);
        assert!(matches!(run(&s).await, AgentOutcome::Aborted(w) if w.contains("timed out")));
        assert!(t0.elapsed() < Duration::from_secs(3));
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert!(
            !marker.exists(),
            "the agent's background child outlived the episode"
        );
        // A grader decides the reward from the transcript.
        let mut s = spec(d.path(), "echo 5", 10.0);
        s.grader = Some(
            r#"python3 -c 'import json,sys; d=json.load(sys.stdin); print(1.0 if d["stdout"].strip()=="5" else 0.0)'"#
                .into(),
        );
        assert_eq!(run(&s).await, AgentOutcome::Reward(PostedReward::One(1.0)));
    }

    #[test]
    fn reward_lines() {
        assert_eq!(
            reward_from_line(r#"{"reward": 1}"#, false),
            Some(PostedReward::One(1.0))
        );
        assert_eq!(
            reward_from_line("0.25", true),
            Some(PostedReward::One(0.25))
        );
        assert_eq!(reward_from_line("0.25", false), None);
        assert_eq!(reward_from_line(r#"{"reward": "x"}"#, false), None);
        assert_eq!(reward_from_line("nan", true), None);
    }
}
