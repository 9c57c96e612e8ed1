//! `cargo bench --bench recovery`: how long a training group takes to go on when a member
//! fails. Three servers of a tiny random model (real processes on 127.0.0.1, each its own
//! swarm node) train as one group with `--collective-timeout T` while a client runs a
//! shell agent; after a few three-member steps member c fails at an arbitrary moment, and
//! the bench times from the failure to the first step the other two complete without it.
//!
//! Two failures: `kill -9` (the OS closes c's connections, so rounds fail at once), and a
//! stall (SIGSTOP: c's connections stay open and silent, so the round in progress runs
//! into its timeout, and c's silence to the next epoch's prepare into another).
//!
//! `--timeout T` (seconds, default 5), `--trials N` (kill -9 trials, default 3; one stall
//! trial); `AGENTJET_BENCH_LOGS=1` prints a's and b's logs after each trial. Needs `curl` and `jq` (as the tests do). Ends with
//! `RESULT recovery kill9_to_step_s ours=<median s>` and `RESULT recovery stall_to_step_s
//! ours=<s>`. Goal: kill -9 under 2 x T. No peer runs beside it: torchft (the nearest,
//! with its central lighthouse) is not installable here.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::peer::Peer;
use serde_json::Value;

const AGENT: &str = r#"#!/bin/sh
set -eu
sleep 0.2
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

fn arg(name: &str, default: f64) -> Result<f64> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).context(name.to_string())?.parse()?),
        None => Ok(default),
    }
}

fn server(dir: &Path, model: &Path, name: &str, boot: Option<&str>, timeout: f64) -> Peer {
    let t = timeout.to_string();
    let mut args = vec![
        "--role",
        "server",
        "--model",
        model.to_str().unwrap_or_default(),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--learning-rate",
        "1e-3",
        "--group-timeout",
        "5",
        "--groups-per-step",
        "1",
        "--http",
        "127.0.0.1:0",
        "--collective-timeout",
        &t,
    ];
    if let Some(b) = boot {
        args.extend(["--bootstrap", b]);
    }
    Peer::start(name, dir, &args)
}

fn client(dir: &Path, boot: &str) -> Result<Peer> {
    let agent = dir.join("agent.sh");
    std::fs::write(&agent, AGENT)?;
    let tasks = dir.join("tasks.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n")?;
    let agent_cmd = format!("sh {}", agent.display());
    let run = dir.join("run");
    Ok(Peer::start(
        "client",
        dir,
        &[
            "--role",
            "client",
            "--model",
            "tiny",
            "--bootstrap",
            boot,
            "--agent",
            &agent_cmd,
            "--tasks",
            tasks.to_str().unwrap_or_default(),
            "--num-repeat",
            "4",
            "--groups",
            "400",
            "--concurrency",
            "8",
            "--run-dir",
            run.to_str().unwrap_or_default(),
        ],
    ))
}

/// (step, members) of each trained step in `name`'s metrics.
fn steps(dir: &Path, name: &str) -> Vec<(u64, u64)> {
    std::fs::read_to_string(dir.join(name).join("runs/tiny/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["trained"] == true)
        .filter_map(|l| Some((l["step"].as_u64()?, l["members"].as_u64()?)))
        .collect()
}

fn wait(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Result<Duration> {
    let t0 = Instant::now();
    while !f() {
        anyhow::ensure!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(t0.elapsed())
}

/// One trial: three members, c fails by `signal` after a few steps; seconds from the
/// failure to a two-member step at a.
fn trial(model: &Path, timeout: f64, signal: i32) -> Result<f64> {
    let tmp = tempfile::tempdir()?;
    let d = tmp.path();
    let mut a = server(d, model, "a", None, timeout);
    let boot = a.addr();
    let mut b = server(d, model, "b", Some(&boot), timeout);
    let mut c = server(d, model, "c", Some(&boot), timeout);
    for s in [&mut a, &mut b, &mut c] {
        s.wait_epoch(3, Duration::from_secs(120));
    }
    let mut cl = client(d, &boot)?;
    wait("three-member steps", Duration::from_secs(120), || {
        steps(d, "a").iter().filter(|s| s.1 == 3).count() >= 3
    })?;
    // An arbitrary moment: a random delay of up to half a second after the third step.
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos() as u64 / 1_000_000 % 500);
    std::thread::sleep(Duration::from_millis(jitter));
    let before = steps(d, "a").len();
    unsafe { libc::kill(c.child.id() as i32, signal) };
    let took = wait(
        "a two-member step",
        Duration::from_secs_f64(10.0 * timeout + 30.0),
        || steps(d, "a").iter().skip(before).any(|s| s.1 == 2),
    )?;
    if std::env::var_os("AGENTJET_BENCH_LOGS").is_some() {
        for (n, p) in [("a", &a), ("b", &b)] {
            println!("----- {n}");
            for l in p.log_text().lines().filter(|l| !l.contains("episode")) {
                println!("{l}");
            }
        }
    }
    if signal == libc::SIGSTOP {
        unsafe { libc::kill(c.child.id() as i32, libc::SIGKILL) };
    }
    let _ = cl.child.kill();
    for p in [&mut a, &mut b, &mut c, &mut cl] {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    Ok(took.as_secs_f64())
}

fn main() -> Result<()> {
    let timeout = arg("--timeout", 5.0)?;
    let trials = arg("--trials", 3.0)? as usize;
    let tmp = tempfile::tempdir()?;
    let model: PathBuf = common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&tmp.path().join("tiny-model"));
    println!(
        "recovery of a 3-member group (tiny model, loopback), --collective-timeout {timeout} s; \
         goal: kill -9 under {} s",
        2.0 * timeout
    );
    let mut kills = Vec::new();
    for i in 0..trials.max(1) {
        let s = trial(&model, timeout, libc::SIGKILL)?;
        println!("  kill -9, trial {}: next step {s:.2} s after", i + 1);
        kills.push(s);
    }
    let stall = trial(&model, timeout, libc::SIGSTOP)?;
    println!("  stall (SIGSTOP): next step {stall:.2} s after");
    kills.sort_by(f64::total_cmp);
    let median = kills[kills.len() / 2];
    println!(
        "kill -9: median {median:.2} s of {:?} ({:.2} x the timeout); stall {stall:.2} s ({:.2} x)",
        kills
            .iter()
            .map(|x| (x * 100.0).round() / 100.0)
            .collect::<Vec<_>>(),
        median / timeout,
        stall / timeout
    );
    println!("RESULT recovery kill9_to_step_s ours={median:.3}");
    println!("RESULT recovery stall_to_step_s ours={stall:.3}");
    Ok(())
}
