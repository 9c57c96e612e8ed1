//! The client running agents, with real processes on 127.0.0.1: a server of a tiny random
//! model (training on), a client running a shell agent on a task file. Episodes reach the
//! server, steps happen, the policy version advances and later calls carry it; agents that
//! crash or hang are aborted and never trained on.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentjet::client::episodes::read_journal;
use agentjet::client::ClientEvent;
use agentjet::server::ServerEvent;
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
pub(crate) const AGENT: &str = r#"#!/bin/sh
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

pub(crate) fn write_tasks(path: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// A test's tiny model, `script` written as its agent and `n` tasks:
/// (model directory, agent command, task file).
fn setup(dir: &Path, script: &str, n: usize) -> (String, String, PathBuf) {
    let model = tiny_model(dir).to_str().unwrap().to_string();
    let agent = dir.join("agent.sh");
    std::fs::write(&agent, script).unwrap();
    let tasks = dir.join("tasks.jsonl");
    write_tasks(&tasks, n);
    (model, format!("sh {}", agent.display()), tasks)
}

/// A client of model `tiny` running `agent` on `tasks`, groups of 4, `extra` flags appended.
pub(crate) fn client_args<'a>(
    boot: &'a str,
    agent: &'a str,
    tasks: &'a Path,
    run_dir: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut v = vec![
        "--role",
        "client",
        "--model",
        "tiny",
        "--bootstrap",
        boot,
        "--agent",
        agent,
        "--tasks",
        tasks.to_str().unwrap(),
        "--num-repeat",
        "4",
        "--run-dir",
        run_dir.to_str().unwrap(),
    ];
    v.extend(extra);
    v
}

pub(crate) fn metrics_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A step was trained (within `wait`), the server's engine serves policy version >= 1,
/// and some journaled episode's first call was sampled by a trained policy.
fn assert_trained_and_served(
    metrics: &Path,
    http: &str,
    model: &str,
    journal: &[Value],
    wait: Duration,
) {
    common::peer::wait_until("a training step", wait, || {
        metrics_lines(metrics).iter().any(|l| l["trained"] == true)
    });
    let version = metric(
        http,
        &format!("agentjet_policy_version{{model=\"{model}\"}}"),
    )
    .unwrap();
    assert!(version >= 1.0, "policy version {version}");
    let newer = journal
        .iter()
        .filter(|e| e["policy_versions"][0].as_u64().unwrap_or(0) >= 1)
        .count();
    println!(
        "{newer} of {} episodes were sampled by a trained policy; server at v{version}",
        journal.len()
    );
    assert!(newer > 0, "no call was served by a new policy version");
}

#[test]
fn a_shell_agent_trains_the_server_and_bad_agents_are_aborted() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let (model, agent_cmd, tasks) = setup(dir.path(), AGENT, 6);
    let model = model.as_str();

    let mut s = named_server(dir.path(), model, "tiny", None, &["--http", "127.0.0.1:0"]);
    let boot = s.addr();
    let http = s.http_url(Duration::from_secs(120));
    s.wait_serving(Duration::from_secs(120));
    let run_dir = dir.path().join("run1");
    let mut c = Peer::start(
        "client",
        dir.path(),
        &client_args(&boot, &agent_cmd, &tasks, &run_dir, &["--concurrency", "4"]),
    );
    let status = c.child.wait().unwrap();
    assert!(status.success(), "client failed:\n{}", c.log_text());
    println!("client:\n{}", c.stdout());
    let events = c.client_events();
    assert!(
        events.contains(&ClientEvent::Finished {
            episodes: 24,
            aborted: 0
        }),
        "{events:#?}"
    );
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 24, "6 tasks x 4 episodes");
    for e in &journal {
        assert_eq!(e["status"], "finished", "{e}");
        assert_eq!(e["calls"], 1, "{e}");
        assert_eq!(e["submitted"]["tiny"]["stored"], true, "{e}");
    }
    // Steps happened on the server; the engine serves the new version, and episodes that
    // ran after the first steps were sampled by it.
    let metrics = dir.path().join("tiny/runs/tiny/metrics.jsonl");
    assert_trained_and_served(&metrics, &http, "tiny", &journal, Duration::from_secs(60));
    s.wait_event("a step", Duration::from_secs(10), |e| {
        matches!(e, ServerEvent::TrainStep { trained: true, .. })
    });
    // Every group of this run is trained before the next run starts (the checks below
    // are about the next run's steps).
    let ledger = dir.path().join("tiny/runs/tiny/consumed.log");
    common::peer::wait_until("run 1 trained", Duration::from_secs(60), || {
        std::fs::read_to_string(&ledger)
            .unwrap_or_default()
            .lines()
            .count()
            == 24
    });

    // Now agents that crash (e0) and hang (e1) in every group: aborted with the reason,
    // reported to the server (their groups complete), never trained on.
    let run2 = dir.path().join("run2");
    let mut c2 = Peer::start_env(
        "client2",
        dir.path(),
        &client_args(
            &boot,
            &agent_cmd,
            &tasks,
            &run2,
            &[
                "--concurrency",
                "8",
                "--groups",
                "3",
                "--episode-timeout",
                "3",
            ],
        ),
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
        agentjet::server::read_stored_episodes(&dir.path().join("tiny/episodes/tiny")).unwrap();
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

/// Two models in one episode: each call's reward is its reply's length parity.
pub(crate) const TWO_MODEL_AGENT: &str = r#"#!/bin/sh
set -eu
call() {
  curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
    -d "{\"model\": \"$1\", \"max_tokens\": 6, \"temperature\": 1.0, \"messages\": [{\"role\": \"user\", \"content\": \"$2\"}]}" \
    | jq -r '.choices[0].message.content'
}
a=$(call tiny-a "solve")
b=$(call tiny-b "check: $(printf '%s' "$a" | tr -dc 'a-z' | head -c 10)")
echo "{\"rewards\": {\"tiny-a\": $(( ${#a} % 2 )), \"tiny-b\": $(( ${#b} % 2 ))}}"
"#;

/// A server of the tiny model as `name` (its data directory is `dir/name`), training a
/// step per complete group (unless `extra` says `--groups-per-step`) at a high learning rate;
/// `extra` flags appended.
pub(crate) fn named_server(
    dir: &Path,
    model: &str,
    name: &str,
    boot: Option<&str>,
    extra: &[&str],
) -> Peer {
    let mut args = vec![
        "--role",
        "server",
        "--model",
        model,
        "--served-model-name",
        name,
        "--device",
        "cpu",
        "--learning-rate",
        "1e-3",
        "--group-timeout",
        "5",
    ];
    if !extra.contains(&"--groups-per-step") {
        args.extend(["--groups-per-step", "1"]);
    }
    if let Some(b) = boot {
        args.extend(["--bootstrap", b]);
    }
    args.extend(extra);
    Peer::start(name, dir, &args)
}

#[test]
fn two_models_train_in_one_run_each_with_its_own_reward() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let (model, cmd, tasks) = setup(dir.path(), TWO_MODEL_AGENT, 5);
    let model = model.as_str();
    let mut a = named_server(dir.path(), model, "tiny-a", None, &[]);
    let boot = a.addr();
    let mut b = named_server(dir.path(), model, "tiny-b", Some(&boot), &[]);
    a.wait_serving(Duration::from_secs(120));
    b.wait_serving(Duration::from_secs(120));
    let run_dir = dir.path().join("run");
    let mut c = Peer::start(
        "client",
        dir.path(),
        &[
            "--role",
            "client",
            "--model",
            "tiny-a",
            "--model",
            "tiny-b",
            "--bootstrap",
            &boot,
            "--agent",
            &cmd,
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
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 20);
    let mut rewards: std::collections::HashMap<(String, String), f64> = Default::default();
    for e in &journal {
        assert_eq!(e["status"], "finished", "{e}");
        assert_eq!(e["calls"], 2, "{e}");
        for m in ["tiny-a", "tiny-b"] {
            assert_eq!(e["submitted"][m]["stored"], true, "{e}");
            let r = e["rewards"][m].as_f64().unwrap();
            rewards.insert(
                (m.to_string(), e["episode"].as_str().unwrap().to_string()),
                r,
            );
        }
    }
    // Each server stored every episode with its own model's calls and reward, and trained.
    for m in ["tiny-a", "tiny-b"] {
        let stored =
            agentjet::server::read_stored_episodes(&dir.path().join(m).join("episodes").join(m))
                .unwrap();
        assert_eq!(stored.len(), 20);
        for s in &stored {
            let want = rewards[&(m.to_string(), s.manifest.episode_id.clone())];
            assert_eq!(
                s.manifest.reward,
                Some(want),
                "{m} {}",
                s.manifest.episode_id
            );
            assert_eq!(s.timelines.len(), 1);
            assert_eq!(s.timelines[0].model, m);
        }
        let metrics = dir
            .path()
            .join(m)
            .join("runs")
            .join(m)
            .join("metrics.jsonl");
        common::peer::wait_until(&format!("{m} trained"), Duration::from_secs(30), || {
            metrics_lines(&metrics).iter().any(|l| l["trained"] == true)
        });
    }
    let differ = journal
        .iter()
        .filter(|e| e["rewards"]["tiny-a"] != e["rewards"]["tiny-b"])
        .count();
    assert!(
        differ > 0,
        "the two rewards never differed: the test would not tell them apart"
    );
}

/// Slow agent: one call, then a second's thought, then the reward. Just before the
/// reward it appends its episode id to @DONE@: the episodes whose agent finished.
const SLOW_AGENT: &str = r#"#!/bin/sh
set -eu
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hi"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
sleep 1
echo "$AGENTJET_EPISODE_ID" >> @DONE@
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

#[test]
fn killed_clients_leave_no_partial_episode_and_mixed_sources_keep_their_ratio() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let model = model.to_str().unwrap();
    let agent = dir.path().join("agent.sh");
    let done = dir.path().join("agents-done.txt");
    std::fs::write(&agent, SLOW_AGENT.replace("@DONE@", done.to_str().unwrap())).unwrap();
    let cmd = format!("sh {}", agent.display());
    for (name, n) in [("a", 4), ("b", 4), ("c", 3)] {
        let lines: Vec<String> = (0..n)
            .map(|i| format!("{{\"id\": \"{name}{i}\"}}"))
            .collect();
        std::fs::write(dir.path().join(format!("{name}.jsonl")), lines.join("\n")).unwrap();
    }
    let path = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let mut s = named_server(dir.path(), model, "tiny", None, &[]);
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(120));
    let client = |name: &str, extra: &[&str]| {
        let run = path(&format!("run-{name}"));
        let mut args = vec![
            "--role",
            "client",
            "--model",
            "tiny",
            "--bootstrap",
            &boot,
            "--agent",
            &cmd,
            "--num-repeat",
            "4",
            "--concurrency",
            "4",
            "--run-dir",
            &run,
        ];
        args.extend(extra);
        Peer::start(name, dir.path(), &args)
    };
    // A client killed with SIGKILL while its episodes run.
    let (a, b, c) = (path("a.jsonl"), path("b.jsonl"), path("c.jsonl"));
    let mut k = client("killed", &["--tasks", &a, "--groups", "4"]);
    let journal_k = dir.path().join("run-killed/episodes.jsonl");
    common::peer::wait_until("some episodes done", Duration::from_secs(60), || {
        read_journal(&journal_k)
            .map(|j| j.len() >= 5)
            .unwrap_or(false)
    });
    k.kill9();
    let finished_k = read_journal(&journal_k).unwrap();
    // Restarted, and a second client with another task file, side by side; the first
    // mixes its two sources 3:1.
    let ab = format!("{a}:3");
    let bb = format!("{b}:1");
    let mut r1 = client(
        "restarted",
        &["--tasks", &ab, "--tasks", &bb, "--groups", "8"],
    );
    let mut r2 = client("other", &["--tasks", &c, "--groups", "3"]);
    assert!(r1.child.wait().unwrap().success(), "{}", r1.log_text());
    assert!(r2.child.wait().unwrap().success(), "{}", r2.log_text());
    let j1 = read_journal(&dir.path().join("run-restarted/episodes.jsonl")).unwrap();
    let j2 = read_journal(&dir.path().join("run-other/episodes.jsonl")).unwrap();
    assert_eq!(j1.len(), 32);
    assert_eq!(j2.len(), 12);
    let from_a = j1
        .iter()
        .filter(|e| e["task"].as_str().unwrap().starts_with('a'))
        .count();
    assert_eq!(from_a, 24, "3:1 of 8 groups x 4 episodes");
    assert!(j2
        .iter()
        .all(|e| e["task"].as_str().unwrap().starts_with('c')));
    // The server stored only episodes whose agent ran to its end: nothing of the killed
    // client's running episodes. (An episode may be stored and not journaled: the
    // client journals it after the server's answer, and the kill can fall between.)
    let agents_done: std::collections::HashSet<String> = std::fs::read_to_string(&done)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    for e in finished_k.iter().chain(&j1).chain(&j2) {
        assert!(agents_done.contains(e["episode"].as_str().unwrap()) || e["status"] == "aborted");
    }
    let stored =
        agentjet::server::read_stored_episodes(&dir.path().join("tiny/episodes/tiny")).unwrap();
    let killed_prefix = finished_k[0]["episode"]
        .as_str()
        .unwrap()
        .split("-g")
        .next()
        .unwrap()
        .to_string();
    let mut from_killed = 0;
    for e in &stored {
        // A live client reports an episode whose agent failed (under load, say) as
        // aborted: stored without calls, only counted.
        let aborted = matches!(e.manifest.status, EpisodeStatus::Aborted { .. });
        assert!(
            agents_done.contains(&e.manifest.episode_id) || aborted,
            "{} was stored but its agent never finished",
            e.manifest.episode_id
        );
        if aborted {
            assert!(
                e.timelines.is_empty(),
                "aborted {} was stored with calls",
                e.manifest.episode_id
            );
        }
        if e.manifest.episode_id.starts_with(&killed_prefix) {
            from_killed += 1;
        }
        if e.manifest.status == EpisodeStatus::Finished {
            assert!(e.manifest.reward.is_some() && !e.timelines.is_empty());
        }
    }
    assert!(
        (4..16).contains(&from_killed),
        "{from_killed} episodes of the killed client"
    );
    // What reached the server from the two live clients is in the requested ratio: a:b
    // 3:1 from the restarted one, and the other's source c whole.
    let restarted_prefix = j1[0]["episode"]
        .as_str()
        .unwrap()
        .split("-g")
        .next()
        .unwrap();
    let other_prefix = j2[0]["episode"]
        .as_str()
        .unwrap()
        .split("-g")
        .next()
        .unwrap();
    let count = |prefix: &str, task: char| {
        stored
            .iter()
            .filter(|e| {
                e.manifest.episode_id.starts_with(prefix) && e.manifest.task_id.starts_with(task)
            })
            .count()
    };
    assert_eq!(
        (count(restarted_prefix, 'a'), count(restarted_prefix, 'b')),
        (24, 8)
    );
    assert_eq!(count(other_prefix, 'c'), 12);
    // The server kept training through it all: the killed client's incomplete groups
    // train after --group-timeout with the episodes that finished.
    let metrics = dir.path().join("tiny/runs/tiny/metrics.jsonl");
    common::peer::wait_until("steps after the restart", Duration::from_secs(30), || {
        metrics_lines(&metrics)
            .iter()
            .filter(|l| l["trained"] == true)
            .count()
            >= 3
    });
}

/// Builds the client-only `agentjet-peer` (no LibTorch) once, in its own target folder,
/// and checks its dependency tree has no tch / torch-sys.
fn client_only_binary() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = root.join("target").join("client-only");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = std::process::Command::new(&cargo)
        .current_dir(root)
        .args([
            "tree",
            "--no-default-features",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .output()
        .unwrap();
    assert!(
        tree.status.success(),
        "{}",
        String::from_utf8_lossy(&tree.stderr)
    );
    let tree = String::from_utf8_lossy(&tree.stdout);
    for dep in ["tch ", "torch-sys ", "agentjet-kernels "] {
        assert!(
            !tree.lines().any(|l| l.starts_with(dep)),
            "{dep} in the client-only tree"
        );
    }
    // `bootstrap/test.sh` builds it before the tests, in the main target folder (the
    // dependencies are the main build's, so not built twice) and names it here.
    if let Some(bin) = std::env::var_os("AGENTJET_CLIENT_ONLY_BIN") {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "AGENTJET_CLIENT_ONLY_BIN={}: no such file",
            bin.display()
        );
        let bytes = std::fs::read(&bin).unwrap();
        assert!(
            !bytes.windows(8).any(|w| w == b"libtorch"),
            "{} links LibTorch: not a client-only build",
            bin.display()
        );
        return bin;
    }
    let out = std::process::Command::new(&cargo)
        .current_dir(root)
        .args([
            "build",
            "--release",
            "--no-default-features",
            "--bin",
            "agentjet-peer",
        ])
        .arg("--target-dir")
        .arg(&target)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    target.join("release").join("agentjet-peer")
}

/// Acceptance of the client: example (a) (the Python agent on OpenAI's SDK, unchanged)
/// trains the real default model end to end, with the client-only binary as the client.
#[test]
fn example_a_trains_smollm2_through_a_client_only_binary() {
    let _heavy = common::heavy();
    common::smollm2_path();
    let client_bin = client_only_binary();
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut s = Peer::start(
        "server",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--http",
            "127.0.0.1:0",
            "--groups-per-step",
            "1",
            "--learning-rate",
            "2e-5",
        ],
    );
    let boot = s.addr();
    let http = s.http_url(Duration::from_secs(300));
    s.wait_serving(Duration::from_secs(300));
    let run_dir = dir.path().join("run");
    let agent = format!(
        "{} {}",
        common::python().display(),
        root.join("examples/math_agent/agent.py").display()
    );
    let tasks = root.join("examples/math_agent/tasks.jsonl");
    let mut c = Peer::start_bin(
        &client_bin,
        "client",
        dir.path(),
        &[
            "--role",
            "client",
            "--model",
            "smollm2",
            "--bootstrap",
            &boot,
            "--agent",
            &agent,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "8",
            "--concurrency",
            "8",
            "--groups",
            "6",
            "--run-dir",
            run_dir.to_str().unwrap(),
        ],
        &[],
    );
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    let out = c.stdout();
    println!("{out}");
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 48);
    assert!(journal
        .iter()
        .all(|e| e["status"] == "finished" && e["calls"] == 1));
    assert!(journal
        .iter()
        .all(|e| e["submitted"]["smollm2"]["stored"] == true));
    let metrics = dir.path().join("server/runs/smollm2/metrics.jsonl");
    assert_trained_and_served(
        &metrics,
        &http,
        "smollm2",
        &journal,
        Duration::from_secs(120),
    );
}

#[test]
fn ctrl_c_finishes_running_episodes_and_submits_them_a_second_aborts() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let done = dir.path().join("agents-done.txt");
    let script = SLOW_AGENT.replace("@DONE@", done.to_str().unwrap());
    let (model, cmd, tasks) = setup(dir.path(), &script.replace("sleep 1", "sleep 2"), 10);
    let model = model.as_str();
    let mut s = named_server(dir.path(), model, "tiny", None, &[]);
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(120));
    for (round, signals) in [(1, 1), (2, 2)] {
        let run = dir.path().join(format!("run{round}"));
        let mut c = Peer::start(
            &format!("client{round}"),
            dir.path(),
            &client_args(&boot, &cmd, &tasks, &run, &["--concurrency", "4"]),
        );
        c.wait_client_event("the job's start", Duration::from_secs(60), |e| {
            matches!(e, ClientEvent::Running { groups: 10, .. })
        });
        // Let the first episodes start (they take 2 s), then Ctrl-C once or twice.
        std::thread::sleep(Duration::from_millis(1000));
        let pid = c.child.id() as i32;
        for _ in 0..signals {
            unsafe { libc::kill(pid, libc::SIGINT) };
            std::thread::sleep(Duration::from_millis(300));
        }
        assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
        let events = c.client_events();
        assert!(
            events
                .iter()
                .any(|e| matches!(e, ClientEvent::Draining { .. })),
            "{events:#?}"
        );
        let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
        assert_eq!(
            journal.len(),
            4,
            "the 4 running episodes, nothing more: {journal:?}"
        );
        for e in &journal {
            if signals == 1 {
                assert_eq!(e["status"], "finished", "{e}");
                assert_eq!(e["submitted"]["tiny"]["stored"], true, "{e}");
            } else {
                assert_eq!(e["status"], "aborted", "{e}");
                assert!(e["reason"].as_str().unwrap().contains("stopped"), "{e}");
            }
        }
    }
}

/// An agent calling the trained model `tiny` once, then the external `judge` twice (plain
/// and streamed) and the external `down` (nothing listens there) once.
const EXTERNAL_AGENT: &str = r#"#!/bin/sh
set -eu
call() {
  curl -sS "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" -d "$1"
}
reply=$(call '{"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}')
printf '%s' "$reply" | jq -e '.choices[0].message.content' > /dev/null
verdict=$(call '{"model": "judge", "max_tokens": 4, "messages": [{"role": "user", "content": "judge this"}]}')
printf '%s' "$verdict" | jq -e '.choices[0].message.content' > /dev/null
echo "judge: $verdict"
streamed=$(call '{"model": "judge", "max_tokens": 4, "stream": true, "messages": [{"role": "user", "content": "again"}]}')
printf '%s' "$streamed" | grep -q 'data: \[DONE\]'
echo "down: $(call '{"model": "down", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}')"
echo '{"reward": 0.5}'
"#;

/// The grader: reward 1 when the transcript holds the two answered calls of `judge`,
/// marked external, and the one of `tiny`.
const EXTERNAL_GRADER: &str = r#"jq -e '([.transcript[] | select(.external == true and .model == "judge")] | length) == 2 and ([.transcript[] | select(.model == "tiny" and .external == null)] | length) == 1' > /dev/null && echo '{"reward": 1}' || echo '{"reward": 0}'"#;

#[test]
fn external_models_are_forwarded_and_recorded_never_trained() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let (model, agent_cmd, tasks) = setup(dir.path(), EXTERNAL_AGENT, 2);
    let model = model.as_str();
    let mut s = named_server(dir.path(), model, "tiny", None, &[]);
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(120));
    // The external endpoint: another OpenAI-compatible server (ours, outside the swarm,
    // not training), serving the same weights as "judge-remote".
    let mut j = named_server(
        dir.path(),
        model,
        "judge-remote",
        None,
        &["--no-train", "--http", "127.0.0.1:0"],
    );
    let judge_http = j.http_url(Duration::from_secs(120));
    j.wait_serving(Duration::from_secs(120));
    let judge_spec = format!("judge={judge_http}#judge-remote");
    let run_dir = dir.path().join("run");
    let mut c = Peer::start(
        "client",
        dir.path(),
        &client_args(
            &boot,
            &agent_cmd,
            &tasks,
            &run_dir,
            &[
                "--external-model",
                &judge_spec,
                "--external-model",
                "down=http://127.0.0.1:9/v1",
                "--grader",
                EXTERNAL_GRADER,
            ],
        ),
    );
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    let out = c.stdout();
    println!("client:\n{out}");
    assert!(out.contains("external model \"judge\""), "{out}");
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 8);
    for e in &journal {
        assert_eq!(e["status"], "finished", "{e}");
        assert_eq!(e["reward"], 1.0, "the grader saw the external calls: {e}");
        assert_eq!(
            e["calls"], 1,
            "only tiny's call is tracked for training: {e}"
        );
        assert_eq!(e["external_calls"], 3, "{e}");
        assert_eq!(e["submitted"]["tiny"]["stored"], true, "{e}");
        let log = std::fs::read_to_string(e["external_log"].as_str().unwrap()).unwrap();
        let calls: Vec<Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(calls.len(), 3);
        let (plain, streamed, down) = (&calls[0], &calls[1], &calls[2]);
        assert_eq!(plain["model"], "judge");
        assert_eq!(plain["status"], 200);
        assert_eq!(plain["request"]["model"], "judge", "as the agent sent it");
        assert_eq!(
            plain["response"]["model"], "judge-remote",
            "as the endpoint served it"
        );
        assert!(plain["response"]["choices"][0]["message"].is_object());
        assert_eq!(streamed["status"], 200);
        assert!(streamed["response"]
            .as_str()
            .unwrap()
            .contains("data: [DONE]"));
        assert_eq!(down["status"], 0);
        assert!(
            down["error"].as_str().unwrap().contains("cannot connect"),
            "{down}"
        );
        // The agent got the failure in OpenAI's error shape.
        let stdout = std::fs::read_to_string(
            run_dir
                .join("episodes")
                .join(format!("{}.stdout", e["episode"].as_str().unwrap())),
        )
        .unwrap();
        assert!(
            stdout.contains("external_model_unreachable")
                && stdout.contains("external model 'down'"),
            "{stdout}"
        );
    }
    // The judge answered every external call; the trained server got only tiny's calls.
    let requests = metric(&judge_http, "agentjet_http_requests_total");
    assert_eq!(requests, Some(16.0));
    let stored =
        agentjet::server::read_stored_episodes(&dir.path().join("tiny/episodes/tiny")).unwrap();
    assert_eq!(stored.len(), 8);
    for e in &stored {
        assert_eq!(e.timelines.len(), 1);
    }
    // Nothing reached the judge's own store: it is not part of the swarm run.
    let judged = agentjet::server::read_stored_episodes(
        &dir.path().join("judge-remote/episodes/judge-remote"),
    )
    .map(|v| v.len())
    .unwrap_or(0);
    assert_eq!(judged, 0);
    // A --model and an external model of one name is refused at start.
    let mut bad = Peer::start(
        "bad",
        dir.path(),
        &client_args(
            &boot,
            &agent_cmd,
            &tasks,
            &run_dir,
            &["--external-model", "tiny=http://127.0.0.1:9/v1"],
        ),
    );
    assert!(!bad.child.wait().unwrap().success());
    assert!(
        bad.log_text().contains("is also a --model"),
        "{}",
        bad.log_text()
    );
}

/// Episodes e0 and e1 of a group get reward 1, the others 0: every group has signal.
const HALF_AGENT: &str = r#"#!/bin/sh
set -eu
curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}' > /dev/null
case "$AGENTJET_EPISODE_ID" in
  *-e0|*-e1) echo '{"reward": 1.0}' ;;
  *) echo '{"reward": 0.0}' ;;
esac
"#;

#[test]
fn a_restarted_server_trains_the_episodes_it_stored_but_had_not_trained() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let (model, agent_cmd, tasks) = setup(dir.path(), HALF_AGENT, 2);
    let server = |per_step: &str| {
        named_server(
            dir.path(),
            &model,
            "tiny",
            None,
            &["--groups-per-step", per_step],
        )
    };
    // A server that waits for 100 groups per step stores the client's 2 groups and trains
    // nothing; it is killed.
    let mut s = server("100");
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(120));
    let run_dir = dir.path().join("run");
    let mut c = Peer::start(
        "client",
        dir.path(),
        &client_args(&boot, &agent_cmd, &tasks, &run_dir, &[]),
    );
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert!(journal
        .iter()
        .all(|e| e["submitted"]["tiny"]["stored"] == true));
    s.kill9();
    let metrics = dir.path().join("tiny/runs/tiny/metrics.jsonl");
    assert!(
        metrics_lines(&metrics).is_empty(),
        "no step before the kill"
    );
    // Restarted (2 groups per step): the 8 stored episodes are trained in one step.
    let mut s = server("2");
    s.wait_event(
        "8 stored episodes fed again",
        Duration::from_secs(120),
        |e| *e == ServerEvent::Refed { episodes: 8 },
    );
    common::peer::wait_until(
        "the step on the stored episodes",
        Duration::from_secs(60),
        || !metrics_lines(&metrics).is_empty(),
    );
    let m = &metrics_lines(&metrics)[0];
    assert_eq!(
        (m["step"].as_u64(), m["episodes"].as_u64()),
        (Some(1), Some(8)),
        "{m}"
    );
    // A graceful stop saves a checkpoint at step 1; the next start resumes there and has
    // nothing left to feed again.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    s.wait_event("the checkpoint on stop", Duration::from_secs(60), |e| {
        matches!(
            e,
            ServerEvent::CheckpointSaved {
                step: 1,
                on_stop: true
            }
        )
    });
    let _ = s.child.wait();
    let mut s = server("2");
    let start = s.wait_event("the training's start", Duration::from_secs(120), |e| {
        matches!(e, ServerEvent::Training { .. })
    });
    assert!(
        matches!(
            start,
            ServerEvent::Training {
                step: 1,
                resumed: true,
                ..
            }
        ),
        "{start:?}"
    );
    s.wait_serving(Duration::from_secs(120));
    let events = s.events();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ServerEvent::Refed { .. })),
        "{events:#?}"
    );
}

/// Example (c) (Python, OpenAI SDK, two trainable models) and example (d) (sh + curl), as
/// they are in examples/, with their task files, against servers of a tiny random model
/// started under the names the examples use. Each model's server stores every episode with
/// that model's own reward.
#[test]
fn examples_c_and_d_run_unchanged() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let model = model.to_str().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut solver = named_server(dir.path(), model, "solver", None, &[]);
    let boot = solver.addr();
    let mut verifier = named_server(dir.path(), model, "verifier", Some(&boot), &[]);
    let mut plain = named_server(dir.path(), model, "smollm2", Some(&boot), &[]);
    for s in [&mut solver, &mut verifier, &mut plain] {
        s.wait_serving(Duration::from_secs(120));
    }
    let example = |name: &str, models: &[&str], agent: String, tasks: &str| {
        let run = dir.path().join(format!("run-{name}"));
        let tasks = root.join(tasks);
        let mut args = vec!["--role", "client", "--bootstrap", &boot];
        for m in models {
            args.extend(["--model", m]);
        }
        args.extend([
            "--agent",
            &agent,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "4",
            "--groups",
            "2",
            "--concurrency",
            "4",
            "--run-dir",
            run.to_str().unwrap(),
        ]);
        let mut c = Peer::start(name, dir.path(), &args);
        assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
        println!("{}", c.stdout());
        read_journal(&run.join("episodes.jsonl")).unwrap()
    };
    let python = common::python();
    let c = example(
        "client-c",
        &["solver", "verifier"],
        format!(
            "{} {}",
            python.display(),
            root.join("examples/two_model_agent/agent.py").display()
        ),
        "examples/two_model_agent/tasks.jsonl",
    );
    assert_eq!(c.len(), 8);
    let stored_of = |m: &str| {
        agentjet::server::read_stored_episodes(&dir.path().join(m).join("episodes").join(m))
            .unwrap()
    };
    for m in ["solver", "verifier"] {
        let stored = stored_of(m);
        assert_eq!(stored.len(), 8, "{m}");
        for e in &c {
            assert_eq!(e["status"], "finished", "{e}");
            assert_eq!(e["calls"], 2, "{e}");
            assert_eq!(e["submitted"][m]["stored"], true, "{e}");
            let s = stored
                .iter()
                .find(|s| s.manifest.episode_id == e["episode"].as_str().unwrap())
                .unwrap();
            assert_eq!(s.timelines.len(), 1);
            assert_eq!(s.timelines[0].model, m);
            assert_eq!(
                s.manifest.rewards.get(m).copied(),
                e["rewards"][m].as_f64(),
                "{m} got its own reward"
            );
        }
    }
    let d = example(
        "client-d",
        &["smollm2"],
        format!(
            "sh {}",
            root.join("examples/shell_agent/agent.sh").display()
        ),
        "examples/shell_agent/tasks.jsonl",
    );
    assert_eq!(d.len(), 8);
    for e in &d {
        assert_eq!(e["status"], "finished", "{e}");
        assert_eq!(e["calls"], 1, "{e}");
        assert_eq!(e["submitted"]["smollm2"]["stored"], true, "{e}");
    }
    assert_eq!(stored_of("smollm2").len(), 8);
}

/// Two trainable models in one episode (example (c)'s shape: a solver's call, then a
/// checker's on its answer, each model with its own reward), now two LoRA adapters
/// (`--adapter tiny-a --adapter tiny-b`) on one server of the tiny model: one engine and one
/// frozen base serve both, each stores its own episodes with its own reward, and both
/// adapters train (each its own steps, run directory, group and checkpoint). The agent is
/// the shell one of `two_models_train_in_one_run_each_with_its_own_reward` (rewards by
/// reply length, so a random model's groups differ; examples/two_model_agent's arithmetic
/// rewards are all zero on a random model and train nothing).
#[test]
fn the_two_model_example_trains_two_adapters_on_one_server() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let mut s = Peer::start(
        "duo",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--learning-rate",
            "1e-3",
            "--group-timeout",
            "5",
            "--groups-per-step",
            "1",
            "--lora-rank",
            "4",
            "--adapter",
            "tiny-a",
            "--adapter",
            "tiny-b",
            "--dashboard",
            "127.0.0.1:0",
        ],
    );
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(120));
    let dash = match s.wait_event("the dashboard", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::Dashboard { .. })
    }) {
        ServerEvent::Dashboard { addr } => format!("http://{addr}"),
        _ => unreachable!(),
    };
    let run = dir.path().join("run");
    let (_, agent, tasks) = setup(dir.path(), TWO_MODEL_AGENT, 5);
    let mut c = Peer::start(
        "client",
        dir.path(),
        &[
            "--role",
            "client",
            "--bootstrap",
            &boot,
            "--model",
            "tiny-a",
            "--model",
            "tiny-b",
            "--agent",
            &agent,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "4",
            "--concurrency",
            "4",
            "--run-dir",
            run.to_str().unwrap(),
        ],
    );
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 20);
    for m in ["tiny-a", "tiny-b"] {
        let stored = agentjet::server::read_stored_episodes(
            &dir.path().join("duo").join("episodes").join(m),
        )
        .unwrap();
        assert_eq!(stored.len(), 20, "{m}");
        for e in &journal {
            assert_eq!(e["status"], "finished", "{e}");
            assert_eq!(e["calls"], 2, "{e}");
            let st = stored
                .iter()
                .find(|s| s.manifest.episode_id == e["episode"].as_str().unwrap())
                .unwrap();
            assert_eq!(st.timelines.len(), 1);
            assert_eq!(st.timelines[0].model, m);
            assert_eq!(
                st.manifest.rewards.get(m).copied(),
                e["rewards"][m].as_f64(),
                "{m} got its own reward"
            );
        }
        let metrics = dir
            .path()
            .join("duo")
            .join("runs")
            .join(m)
            .join("metrics.jsonl");
        let t0 = std::time::Instant::now();
        while !metrics_lines(&metrics).iter().any(|l| l["trained"] == true) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{m} did not train within 60 s:\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    // The dashboard shows both: each adapter's run and its steps in /metrics.
    let (status, live) = common::peer::http(&dash, "GET", "/api/live", None);
    assert_eq!(status, 200, "{live}");
    let live: Value = serde_json::from_str(&live).unwrap();
    let names: Vec<&str> = live["live"]["models"]
        .as_array()
        .unwrap_or_else(|| panic!("{live}"))
        .iter()
        .map(|m| m["model"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["tiny-a", "tiny-b"], "{live}");
    let (_, metrics) = common::peer::http(&dash, "GET", "/metrics", None);
    for m in ["tiny-a", "tiny-b"] {
        let line = format!("agentjet_train_steps_total{{model=\"{m}\"}}");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }
    // Stopped, each adapter's checkpoint is its own, in PEFT's format.
    // SAFETY: a plain signal to our own child process.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    assert!(s.child.wait().unwrap().success(), "{}", s.log_text());
    let adapters: Vec<Vec<u8>> = ["tiny-a", "tiny-b"]
        .iter()
        .map(|m| {
            let runs = dir.path().join("duo").join("runs").join(m);
            let file = walk(&runs)
                .into_iter()
                .find(|p| p.ends_with("adapter/adapter_model.safetensors"))
                .unwrap_or_else(|| panic!("{m}: no adapter checkpoint under {}", runs.display()));
            std::fs::read(file).unwrap()
        })
        .collect();
    assert_ne!(adapters[0], adapters[1], "two adapters, not one");
}

/// examples/two_model_agent itself (Python, OpenAI SDK), unchanged, on one server of the real
/// default model with two adapters, `solver` and `verifier` (`--lora-rank 8 --adapter solver
/// --adapter verifier`): both adapters train on the example's own rewards. SmolLM2 answers
/// some additions right and its verdicts vary, so groups carry a signal; the client runs
/// until each adapter has taken a step (or 400 s pass, a failure).
#[test]
fn the_two_model_example_itself_trains_two_adapters_of_smollm2_on_one_server() {
    let _heavy = common::heavy();
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut s = Peer::start(
        "duo",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--lora-rank",
            "8",
            "--adapter",
            "solver",
            "--adapter",
            "verifier",
            "--groups-per-step",
            "1",
            "--num-repeat",
            "8",
            "--group-timeout",
            "120",
        ],
    );
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(300));
    let run = dir.path().join("run");
    let agent = format!(
        "{} {}",
        common::python().display(),
        root.join("examples/two_model_agent/agent.py").display()
    );
    let tasks = root.join("examples/two_model_agent/tasks.jsonl");
    let mut c = Peer::start(
        "client",
        dir.path(),
        &[
            "--role",
            "client",
            "--bootstrap",
            &boot,
            "--model",
            "solver",
            "--model",
            "verifier",
            "--agent",
            &agent,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "8",
            "--concurrency",
            "8",
            "--time-limit",
            "400",
            "--run-dir",
            run.to_str().unwrap(),
        ],
    );
    let metrics =
        |m: &str| metrics_lines(&dir.path().join("duo/runs").join(m).join("metrics.jsonl"));
    let trained = |m: &str| metrics(m).into_iter().find(|l| l["trained"] == true);
    while trained("solver").is_none() || trained("verifier").is_none() {
        assert!(
            c.child.try_wait().unwrap().is_none(),
            "the client ended before both adapters trained:\n{}\n{}",
            c.log_text(),
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // SAFETY: a plain signal to our own child process.
    unsafe { libc::kill(c.child.id() as i32, libc::SIGTERM) };
    let _ = c.child.wait();
    for m in ["solver", "verifier"] {
        let step = trained(m).unwrap();
        assert!(step["grad_norm"].as_f64().unwrap() > 0.0, "{m}: {step}");
        // Each adapter's steps are its own: the server's line names it.
        let line = s.wait_line_containing(&format!(" [{m}]"), Duration::from_secs(30));
        assert!(line.starts_with("train step"), "{line}");
    }
    let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
    let finished: Vec<&Value> = journal
        .iter()
        .filter(|e| e["status"] == "finished")
        .collect();
    assert!(!finished.is_empty());
    for e in &finished {
        assert_eq!(e["calls"], 2, "{e}");
        for m in ["solver", "verifier"] {
            assert!(e["rewards"][m].as_f64().is_some(), "{m}: {e}");
        }
    }
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Three agents written against real frameworks from PyPI, each with a function tool, run
/// unmodified as `--agent` commands against a server of the real default model: OpenAI's
/// Agents SDK with its default model (the Responses API), LangChain's `ChatOpenAI` with a
/// bound tool (chat completions), and Anthropic's SDK (the Messages API). Their episodes
/// finish with at least two calls, are stored, and are taken by the server's trainer.
#[test]
fn framework_agents_on_three_apis_run_unmodified_and_train() {
    let _heavy = common::heavy();
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut s = Peer::start(
        "server",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--groups-per-step",
            "1",
            "--num-repeat",
            "4",
            "--group-timeout",
            "120",
        ],
    );
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(300));
    let python = common::python();
    let tasks = root.join("examples/tool_agent/tasks.jsonl");
    let mut all = Vec::new();
    let mut rewards: std::collections::BTreeMap<String, Vec<Option<f64>>> = Default::default();
    // LangChain's episodes are graded by a grader that draws a random reward, so at least
    // one group carries a signal and a training step must follow (an untrained model often
    // scores a whole group alike, which would leave nothing to train).
    let grader = format!(
        "{} -c \"import json, random, sys; sys.stdin.read(); print(json.dumps({{'reward': random.random()}}))\"",
        python.display()
    );
    for agent in ["agents_sdk_agent", "langchain_agent", "anthropic_agent"] {
        let run = dir.path().join(format!("run-{agent}"));
        let cmd = format!(
            "{} {}",
            python.display(),
            root.join(format!("examples/framework_agents/{agent}.py"))
                .display()
        );
        let graded: &[&str] = if agent == "langchain_agent" {
            &["--grader", &grader]
        } else {
            &[]
        };
        let mut c = Peer::start(
            agent,
            dir.path(),
            &[
                &[
                    "--role",
                    "client",
                    "--model",
                    "smollm2",
                    "--bootstrap",
                    &boot,
                    "--agent",
                    &cmd,
                    "--tasks",
                    tasks.to_str().unwrap(),
                    "--num-repeat",
                    "4",
                    "--groups",
                    "1",
                    "--concurrency",
                    "4",
                    "--run-dir",
                    run.to_str().unwrap(),
                ][..],
                graded,
            ]
            .concat(),
        );
        assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
        println!("{agent}:\n{}", c.stdout());
        let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
        assert_eq!(journal.len(), 4, "{agent}");
        for e in &journal {
            let logs = run.join("episodes");
            // The agent's own output (its turns, its final answer) and its errors.
            let why = || {
                let id = e["episode"].as_str().unwrap_or_default();
                let safe = agentjet::base::safe_file_name(id);
                let read = |ext: &str| {
                    std::fs::read_to_string(logs.join(format!("{safe}.{ext}"))).unwrap_or_default()
                };
                format!("stdout:\n{}\nstderr:\n{}", read("stdout"), read("stderr"))
            };
            assert_eq!(e["status"], "finished", "{agent}: {e}\n{}", why());
            // The first turn forces a tool call, so a second call always follows.
            assert!(e["calls"].as_u64().unwrap() >= 2, "{agent}: {e}\n{}", why());
            assert_eq!(e["submitted"]["smollm2"]["stored"], true, "{agent}: {e}");
            all.push(e["episode"].as_str().unwrap().to_string());
            let group = format!("{agent}/{}", e["group"]);
            rewards.entry(group).or_default().push(e["reward"].as_f64());
        }
    }
    // The trainer takes every stored episode (trained, or skipped when its group's rewards
    // were all equal).
    let ledger = dir.path().join("server/runs/smollm2/consumed.log");
    common::peer::wait_until("every episode taken", Duration::from_secs(600), || {
        let text = std::fs::read_to_string(&ledger).unwrap_or_default();
        all.iter().all(|id| text.contains(id.as_str()))
    });
    // The server writes a step's metrics line before the ledger names its episodes. (It
    // wrote the ledger first, and the new weights went to the engine in between: this
    // test failed about 1 run in 4 when it read the metrics in that moment.)
    // A group whose rewards differ carries a signal, and a step trains on it. (An untrained
    // 135M model often scores every episode of a group alike: such a group is skipped, as
    // GRPO skips it, and that alone is no failure.)
    let metrics = metrics_lines(&dir.path().join("server/runs/smollm2/metrics.jsonl"));
    let with_signal = rewards
        .values()
        .filter(|r| r.windows(2).any(|w| w[0] != w[1]))
        .count();
    let trained: u64 = metrics
        .iter()
        .filter(|m| m["trained"] == true)
        .map(|m| m["groups"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        with_signal >= 1,
        "the graded group has no signal: {rewards:?}"
    );
    assert_eq!(
        trained as usize, with_signal,
        "groups with a signal {with_signal} ({rewards:?}), groups trained {trained}: {metrics:?}"
    );
}
