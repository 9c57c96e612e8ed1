//! The broadcast bench's second part: real `agentjet-peer` processes on 127.0.0.1 (QUIC).
//! One trainer (`--role server`) and N followers (`--role server --follow`) of one model,
//! in bfloat16 (the serving dtype a follower holds); a client runs a one-call shell agent
//! (reward: a coin flip, so every group has signal) against all of them, and the trainer
//! takes a step per group. For each step after the first, from the events:
//!
//! - `commit_to_all_serving_s_{N}f`: from the trainer's step event (polled every 5 ms) to
//!   the last follower's `followed` event (the engine serves it; its Unix ms);
//! - `trainer_bytes_vs_star_{N}f`: the chunk bytes the followers took from the trainer for
//!   the version, against a star (the trainer sends the whole snapshot to each follower);
//! - `delta_bytes_vs_full_swarm`: the bytes one follower received for a version (from
//!   anyone), against the whole snapshot.

use crate::common;
use common::peer::Peer;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentjet::server::ServerEvent;

const AGENT: &str = r#"#!/bin/sh
set -eu
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "smollm2", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "Say a word."}]}')
test -n "$(printf '%s' "$reply" | jq -r '.choices[0].message.content')"
# A coin flip: every group has signal, so every group is a step (this bench measures the
# broadcast, not learning).
if [ $(( $(od -An -N1 -tu1 /dev/urandom) % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One version as the followers received it.
#[derive(Debug, Default)]
struct Version {
    commit_ms: Option<u64>,
    /// Per follower: when it served it, bytes received, bytes from the trainer.
    served: BTreeMap<usize, (u64, u64, u64)>,
    full: u64,
}

fn server_args<'a>(model: &'a str, key: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--role",
        "server",
        "--model",
        model,
        "--device",
        "cpu",
        "--dtype",
        "bf16",
        "--run-key",
        key,
        "--groups-per-step",
        "1",
        "--max-groups-per-step",
        "1",
        "--num-repeat",
        "4",
        "--max-batch",
        "8",
    ];
    a.extend(extra);
    a
}

/// One measured version.
pub struct Row {
    /// From the trainer's step to the last follower serving it.
    pub seconds: f64,
    /// Chunk bytes the followers took from the trainer.
    pub trainer_bytes: u64,
    /// What a star sends: the whole snapshot to each follower.
    pub star_bytes: u64,
    /// What one follower received (mean).
    pub delta_bytes: u64,
    pub full_bytes: u64,
}

/// One run: a trainer, `n` followers, `steps` steps measured.
pub fn run(n: usize, steps: usize, model: &str) -> anyhow::Result<Vec<Row>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let (key, run_id) = common::run_key(d);
    let mut trainer = Peer::start("trainer", d, &server_args(model, &key, &[]));
    let boot = trainer.addr();
    let trainer_id = trainer.peer_id();
    let mut followers: Vec<Peer> = (0..n)
        .map(|i| {
            Peer::start(
                &format!("f{i}"),
                d,
                &server_args(model, &key, &["--follow", "--bootstrap", &boot]),
            )
        })
        .collect();
    trainer.wait_serving(Duration::from_secs(600));
    for f in &mut followers {
        f.wait_serving(Duration::from_secs(600));
    }
    // Every follower holds the trainer's start version before the client runs.
    for f in &mut followers {
        f.wait_event("version 0", Duration::from_secs(600), |e| {
            matches!(e, ServerEvent::Followed { .. })
        });
    }
    let agent = d.join("agent.sh");
    std::fs::write(&agent, AGENT)?;
    let tasks = d.join("tasks.jsonl");
    let lines: Vec<String> = (0..8)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n")?;
    let agent_cmd = format!("sh {}", agent.display());
    // Groups without signal (every reward equal) take no step: plenty of groups, and the
    // client is stopped once the steps are in.
    let groups = (4 * (steps + 2)).to_string();
    let mut client = Peer::start(
        "client",
        d,
        &[
            "--role",
            "client",
            "--model",
            "smollm2",
            "--bootstrap",
            &boot,
            "--agent",
            &agent_cmd,
            "--tasks",
            tasks.to_str().unwrap_or_default(),
            "--num-repeat",
            "4",
            "--groups",
            &groups,
            "--concurrency",
            "4",
            "--run",
            &run_id,
        ],
    );
    // Steps 1..=steps+1: the first is not measured (its followers may still be warming).
    let last = steps as u64 + 1;
    let mut versions: BTreeMap<u64, Version> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{n} followers: not every version served within 30 minutes; trainer log:\n{}",
            trainer.log_text()
        );
        for e in trainer.events() {
            if let ServerEvent::TrainStep { version, .. } = e {
                let v = versions.entry(version).or_default();
                v.commit_ms.get_or_insert_with(unix_ms);
            }
        }
        for (i, f) in followers.iter().enumerate() {
            for e in f.events() {
                if let ServerEvent::Followed {
                    version,
                    bytes,
                    bytes_by_source,
                    full_bytes,
                    unix_ms,
                    ..
                } = e
                {
                    let v = versions.entry(version).or_default();
                    let from_trainer = bytes_by_source.get(&trainer_id).copied().unwrap_or(0);
                    v.served.insert(i, (unix_ms, bytes, from_trainer));
                    v.full = full_bytes;
                }
            }
        }
        if (2..=last).all(|k| versions.get(&k).is_some_and(|v| v.served.len() >= n)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    client.kill9();
    let mut out = Vec::new();
    for k in 2..=last {
        let v = &versions[&k];
        let commit = v.commit_ms.unwrap_or(0);
        let done = v.served.values().map(|s| s.0).max().unwrap_or(0);
        let trainer_bytes: u64 = v.served.values().map(|s| s.2).sum();
        let mean_delta = v.served.values().map(|s| s.1).sum::<u64>() / n.max(1) as u64;
        let secs = done.saturating_sub(commit) as f64 / 1e3;
        println!(
            "  {n} followers, version {k}: all serving {secs:.2} s after the step; trainer sent \
             {trainer_bytes} bytes (a star: {}), a follower received {mean_delta} of {} bytes",
            v.full * n as u64,
            v.full
        );
        out.push(Row {
            seconds: secs,
            trainer_bytes,
            star_bytes: v.full * n as u64,
            delta_bytes: mean_delta,
            full_bytes: v.full,
        });
    }
    for (i, f) in followers.iter_mut().enumerate() {
        for l in f.stdout_so_far() {
            if l.starts_with("following:") {
                println!("    f{i} {l}");
            }
        }
    }
    for mut p in followers.into_iter().chain([trainer]) {
        p.kill9();
    }
    Ok(out)
}
