//! The client running agents, with real processes on 127.0.0.1: a server of a tiny random
//! model (training on), a client running a shell agent on a task file. Episodes reach the
//! server, steps happen, the policy version advances and later calls carry it; agents that
//! crash or hang are aborted and never trained on.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentjet::client::run::read_journal;
use agentjet::timeline::EpisodeStatus;
use common::peer::{metric, Peer};
use serde_json::Value;

fn tiny_model(dir: &Path) -> PathBuf {
    common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&dir.join("tiny-model"))
}

/// A shell agent: one chat call (8 tokens, temperature 1), reward 1 when the reply has an
/// even number of characters (a coin flip for a random model: groups have signal).
/// `AGENT_MODE=crash-e0,hang-e1` makes episodes e0 crash and e1 hang after their call.
const AGENT: &str = r#"#!/bin/sh
set -eu
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
case "${AGENT_MODE:-}:$AGENTJET_EPISODE_ID" in
  *crash*:*-e0) echo "crashing on purpose" >&2; exit 7 ;;
  *hang*:*-e1) sleep 1000 ;;
esac
echo "reply: $content"
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

fn write_tasks(path: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn server<'a>(dir: &Path, model: &'a str, boot: Option<&'a str>) -> Peer {
    let mut args = vec![
        "--role",
        "server",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--http",
        "127.0.0.1:0",
        "--groups-per-step",
        "1",
        "--learning-rate",
        "1e-3",
    ];
    if let Some(b) = boot {
        args.extend(["--bootstrap", b]);
    }
    Peer::start("server", dir, &args)
}

fn metrics_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn a_shell_agent_trains_the_server_and_bad_agents_are_aborted() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let model = model.to_str().unwrap();
    let agent = dir.path().join("agent.sh");
    std::fs::write(&agent, AGENT).unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    write_tasks(&tasks, 6);

    let mut s = server(dir.path(), model, None);
    let boot = s.addr();
    let http = s.wait_line("http at", Duration::from_secs(120));
    s.wait_line("serving model", Duration::from_secs(120));
    let run_dir = dir.path().join("run1");
    let agent_cmd = format!("sh {}", agent.display());
    let mut c = Peer::start(
        "client",
        dir.path(),
        &[
            "--role",
            "client",
            "--model",
            "tiny",
            "--bootstrap",
            &boot,
            "--agent",
            &agent_cmd,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "4",
            "--concurrency",
            "4",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
    );
    let status = c.child.wait().unwrap();
    assert!(status.success(), "client failed:\n{}", c.log_text());
    let out = c.stdout();
    println!("client:\n{out}");
    assert!(out.contains("summary: 24 episodes"), "{out}");
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 24, "6 tasks x 4 episodes");
    for e in &journal {
        assert_eq!(e["status"], "finished", "{e}");
        assert_eq!(e["calls"], 1, "{e}");
        assert_eq!(e["submitted"]["tiny"]["stored"], true, "{e}");
    }
    // Steps happened on the server; the engine serves the new version, and episodes that
    // ran after the first steps were sampled by it.
    let metrics = dir.path().join("server/runs/tiny/metrics.jsonl");
    let mut lines = Vec::new();
    common::peer::wait_until("a training step", Duration::from_secs(60), || {
        lines = metrics_lines(&metrics);
        lines.iter().any(|l| l["trained"] == true)
    });
    let version = metric(&http, "agentjet_policy_version{model=\"tiny\"}").unwrap();
    assert!(version >= 1.0, "policy version {version}");
    let later = journal
        .iter()
        .filter(|e| e["policy_versions"][0].as_u64().unwrap_or(0) >= 1)
        .count();
    assert!(later > 0, "no episode was sampled by a trained policy");
    s.wait_line("train step", Duration::from_secs(10));

    // Now agents that crash (e0) and hang (e1) in every group: aborted with the reason,
    // reported to the server (their groups complete), never trained on.
    let run2 = dir.path().join("run2");
    let mut c2 = Peer::start_env(
        "client2",
        dir.path(),
        &[
            "--role",
            "client",
            "--model",
            "tiny",
            "--bootstrap",
            &boot,
            "--agent",
            &agent_cmd,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "4",
            "--concurrency",
            "8",
            "--groups",
            "3",
            "--episode-timeout",
            "3",
            "--run-dir",
            run2.to_str().unwrap(),
        ],
        &[("AGENT_MODE", "crash-e0,hang-e1")],
    );
    let before = metrics_lines(&metrics);
    let status = c2.child.wait().unwrap();
    assert!(status.success(), "client failed:\n{}", c2.log_text());
    let journal = read_journal(&run2.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 12);
    let mut aborted = 0;
    for e in &journal {
        let id = e["episode"].as_str().unwrap();
        let reason = e["reason"].as_str().unwrap_or("");
        if id.ends_with("-e0") {
            assert!(
                reason.contains("exited with status 7") && reason.contains("crashing"),
                "{e}"
            );
        } else if id.ends_with("-e1") {
            assert!(reason.contains("timed out"), "{e}");
        } else {
            assert_eq!(e["status"], "finished", "{e}");
            continue;
        }
        aborted += 1;
        assert_eq!(e["status"], "aborted", "{e}");
        assert_eq!(e["submitted"]["tiny"]["stored"], true, "{e}");
    }
    assert_eq!(aborted, 6);
    // The server stored the 6 aborted episodes as reports without calls (so their groups
    // complete), and any step since trained at most the 2 finished episodes of a group.
    let stored =
        agentjet::server::read_stored_episodes(&dir.path().join("server/episodes/tiny")).unwrap();
    let aborted_stored: Vec<_> = stored
        .iter()
        .filter(|e| matches!(e.manifest.status, EpisodeStatus::Aborted { .. }))
        .collect();
    assert_eq!(aborted_stored.len(), 6);
    assert!(aborted_stored.iter().all(|e| e.timelines.is_empty()));
    std::thread::sleep(Duration::from_secs(1));
    let after = metrics_lines(&metrics);
    for l in &after[before.len()..] {
        assert!(
            l["episodes"].as_u64().unwrap() <= 2 * l["groups"].as_u64().unwrap(),
            "{l}"
        );
    }
    // The hung agent's process group is gone.
    let ps = std::process::Command::new("pgrep")
        .args(["-f", "sleep 1000"])
        .output()
        .unwrap();
    assert!(ps.stdout.is_empty(), "a hung agent survived its episode");
}
