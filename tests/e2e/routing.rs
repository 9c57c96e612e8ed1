//! Cache-aware routing with real processes on 127.0.0.1: two servers of a tiny model and
//! a client running a multi-turn shell agent. The episode's calls all land on one server
//! (whose prefix cache then reuses the repeated context); when that server is killed with
//! SIGKILL mid-episode, the rest of the episode runs on the other one and finishes.

use crate::common;

use std::time::Duration;

use agentjet::client::episodes::read_journal;
use common::peer::{metric, wait_until, Peer};

/// Six chat turns, each the whole conversation so far; after the third it marks
/// `$MARK_DIR/half` and waits for `$MARK_DIR/go`.
const AGENT: &str = r#"#!/bin/sh
set -eu
sys="You are a careful assistant. Answer in one short line, plainly, and never repeat the question."
msgs=$(jq -n --arg s "$sys" '[{"role":"system","content":$s},{"role":"user","content":"turn 0"}]')
for t in 1 2 3 4 5 6; do
  body=$(jq -n --argjson m "$msgs" '{model:"tiny",max_tokens:6,temperature:1.0,messages:$m}')
  reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
    -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" -d "$body")
  content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
  msgs=$(printf '%s' "$msgs" | jq --arg c "$content" --arg u "turn $t" \
    '. + [{"role":"assistant","content":$c},{"role":"user","content":$u}]')
  if [ "$t" -eq 3 ]; then
    touch "$MARK_DIR/half"
    while [ ! -f "$MARK_DIR/go" ]; do sleep 0.1; done
  fi
done
echo '{"reward": 1.0}'
"#;

fn server<'a>(model: &'a str, boot: &'a str, key: &'a str) -> Vec<&'a str> {
    vec![
        "--role",
        "server",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--bootstrap",
        boot,
        "--http",
        "127.0.0.1:0",
        // Both servers certified by one run: an episode's calls may run on either and
        // be submitted to the other (see `swarm::trust`).
        "--run-key",
        key,
    ]
}

fn completed(http: &str) -> f64 {
    metric(http, "agentjet_engine_completed_total{model=\"tiny\"}").unwrap_or(0.0)
}

fn reused(http: &str) -> f64 {
    metric(
        http,
        "agentjet_prefix_cache_reused_tokens_total{model=\"tiny\"}",
    )
    .unwrap_or(0.0)
}

#[test]
fn an_episodes_calls_stay_on_one_server_and_fail_over_when_it_is_killed() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = common::Tiny {
        max_pos: 4096,
        ..Default::default()
    }
    .write_hf_dir(&dir.path().join("tiny-model"));
    let model = model.to_str().unwrap();
    let mut plain = Peer::start("plain", dir.path(), &["--role", "peer"]);
    let boot = plain.addr();
    let (key, run) = common::run_key(dir.path());
    let mut servers = [
        Peer::start("server1", dir.path(), &server(model, &boot, &key)),
        Peer::start("server2", dir.path(), &server(model, &boot, &key)),
    ];
    let http: Vec<String> = servers
        .iter_mut()
        .map(|s| s.http_url(Duration::from_secs(120)))
        .collect();
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    let agent = dir.path().join("agent.sh");
    std::fs::write(&agent, AGENT).unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    std::fs::write(&tasks, "{\"id\": \"t0\", \"data\": {}}\n").unwrap();
    let run_dir = dir.path().join("run");
    let agent_cmd = format!("sh {}", agent.display());
    let mut client = Peer::start_env(
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
            "1",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--wait",
            "60",
            "--run",
            &run,
        ],
        &[("MARK_DIR", marks.to_str().unwrap())],
    );
    wait_until("three turns done", Duration::from_secs(120), || {
        marks.join("half").exists() || client.child.try_wait().unwrap().is_some()
    });
    assert!(marks.join("half").exists(), "{}", client.log_text());
    // All three calls ran on one server, and its prefix cache reused the conversation.
    let done: Vec<f64> = http.iter().map(|h| completed(h)).collect();
    println!("calls per server after three turns: {done:?}");
    let (busy, idle) = if done[0] > 0.0 { (0, 1) } else { (1, 0) };
    assert_eq!(done[busy], 3.0, "{done:?}");
    assert_eq!(done[idle], 0.0, "{done:?}");
    assert!(
        reused(&http[busy]) > 0.0,
        "no tokens reused on the episode's server"
    );
    // That server dies; the episode goes on on the other one.
    servers[busy].kill9();
    std::fs::write(marks.join("go"), "").unwrap();
    let status = client.child.wait().unwrap();
    assert!(status.success(), "client failed:\n{}", client.log_text());
    let journal = read_journal(&run_dir.join("episodes.jsonl")).unwrap();
    assert_eq!(journal.len(), 1);
    assert_eq!(journal[0]["status"], "finished", "{}", journal[0]);
    assert_eq!(journal[0]["calls"], 6, "{}", journal[0]);
    assert_eq!(completed(&http[idle]), 3.0);
    // After the first call there, the rest reused its context on the new server too.
    assert!(reused(&http[idle]) > 0.0);
}
