//! Elastic data-parallel training with real processes on 127.0.0.1: several servers of one
//! tiny model train as one group (a ring all-reduce of their gradients each step), stay
//! bit-identical, and go on when one of them is killed in the middle of a round.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentjet::server::ServerEvent;
use common::peer::{metric, wait_until, Peer};
use serde_json::Value;

pub(crate) fn tiny_model(dir: &Path) -> PathBuf {
    common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&dir.join("tiny-model"))
}

/// One chat call (8 tokens, temperature 1); reward 1 when the reply has an even number of
/// characters (a coin flip for a random model: groups have signal). It thinks for 0.3 s
/// first, so episodes arrive over several heartbeats (several steps).
pub(crate) const AGENT: &str = r#"#!/bin/sh
set -eu
sleep 0.3
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

/// Server `name` of the tiny model served as "tiny" (data directory `dir/name`).
pub(crate) fn server(
    dir: &Path,
    model: &Path,
    name: &str,
    boot: Option<&str>,
    extra: &[&str],
) -> Peer {
    server_on(None, dir, model, name, boot, extra)
}

/// [`server`] on the host of namespace `ns` (with its default listen addresses), or on
/// loopback.
pub(crate) fn server_on(
    ns: Option<&str>,
    dir: &Path,
    model: &Path,
    name: &str,
    boot: Option<&str>,
    extra: &[&str],
) -> Peer {
    let mut args = vec![
        "--role",
        "server",
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--learning-rate",
        "1e-3",
        "--group-timeout",
        "5",
        "--http",
        "127.0.0.1:0",
    ];
    if let Some(b) = boot {
        args.extend(["--bootstrap", b]);
    }
    // A round that stalls fails (and is retried in a new epoch) well within the tests'
    // waits; the log then says which round failed and why.
    if !extra.contains(&"--collective-timeout") {
        args.extend(["--collective-timeout", "10"]);
    }
    args.extend(extra);
    // Servers of one group must trust each other: a run key, which each certifies itself
    // with (an open swarm's servers train alone).
    let (key, _) = common::run_key(dir);
    if !extra.contains(&"--swarm-key") && !extra.contains(&"--cert") {
        args.extend(["--run-key", &key]);
    }
    match ns {
        Some(ns) => Peer::start_on(ns, name, dir, &args),
        None => Peer::start(name, dir, &args),
    }
}

/// Servers a, b and c of the tiny model (b and c bootstrap from a), in one 3-member epoch;
/// with a's address.
fn three_servers(d: &Path, model: &Path, extra: &[&str]) -> (Peer, Peer, Peer, String) {
    let mut a = server(d, model, "a", None, extra);
    let boot = a.addr();
    let mut b = server(d, model, "b", Some(&boot), extra);
    let mut c = server(d, model, "c", Some(&boot), extra);
    for s in [&mut a, &mut b, &mut c] {
        s.wait_serving(Duration::from_secs(120));
        s.wait_epoch(3, Duration::from_secs(60));
    }
    (a, b, c, boot)
}

/// Servers a and b of the tiny model (b bootstraps from a), in one 2-member epoch; with
/// a's address.
pub(crate) fn two_servers(d: &Path, model: &Path, extra: &[&str]) -> (Peer, Peer, String) {
    let mut a = server(d, model, "a", None, extra);
    let boot = a.addr();
    let mut b = server(d, model, "b", Some(&boot), extra);
    for s in [&mut a, &mut b] {
        s.wait_epoch(2, Duration::from_secs(60));
    }
    (a, b, boot)
}

pub(crate) fn client(dir: &Path, boot: &str, groups: usize, run: &str) -> Peer {
    client_with(dir, boot, groups, run, AGENT)
}

/// [`client`] with the agent script `script`.
fn client_with(dir: &Path, boot: &str, groups: usize, run: &str, script: &str) -> Peer {
    client_on(None, dir, boot, groups, run, script)
}

/// [`client_with`] on the host of namespace `ns` (default listen addresses), or on
/// loopback.
pub(crate) fn client_on(
    ns: Option<&str>,
    dir: &Path,
    boot: &str,
    groups: usize,
    run: &str,
    script: &str,
) -> Peer {
    let agent = dir.join(format!("agent-{run}.sh"));
    std::fs::write(&agent, script).unwrap();
    let tasks = dir.join("tasks.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n").unwrap();
    let agent_cmd = format!("sh {}", agent.display());
    let groups = groups.to_string();
    let run_dir = dir.join(run);
    let run_id = common::run_key(dir).1;
    let args = [
        "--role",
        "client",
        "--model",
        "tiny",
        "--bootstrap",
        boot,
        "--agent",
        &agent_cmd,
        "--tasks",
        tasks.to_str().unwrap(),
        "--num-repeat",
        "4",
        "--groups",
        &groups,
        "--concurrency",
        "8",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--run",
        &run_id,
    ];
    match ns {
        Some(ns) => Peer::start_on(ns, run, dir, &args),
        None => Peer::start(run, dir, &args),
    }
}

pub(crate) fn metrics_lines(dir: &Path, name: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join(name).join("runs/tiny/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The ledger of server `name`: episode ids by step.
pub(crate) fn consumed(dir: &Path, name: &str) -> BTreeMap<u64, Vec<String>> {
    let mut by_step: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let text =
        std::fs::read_to_string(dir.join(name).join("runs/tiny/consumed.log")).unwrap_or_default();
    for l in text.lines() {
        let (s, id) = l.split_once('\t').unwrap();
        by_step
            .entry(s.parse().unwrap())
            .or_default()
            .push(id.to_string());
    }
    by_step
}

fn stored_ids(dir: &Path, name: &str) -> HashSet<String> {
    agentjet::server::read_stored_episodes(&dir.join(name).join("episodes/tiny"))
        .unwrap()
        .into_iter()
        .map(|e| e.manifest.episode_id)
        .collect()
}

/// Waits (up to 60 s) until each named member consumed every episode it stored; on a
/// timeout, prints the members' logs and fails.
pub(crate) fn wait_all_consumed(d: &Path, names: &[&str], peers: &[&Peer]) {
    let t0 = std::time::Instant::now();
    loop {
        // (A step's metrics line is written before the ledger names its episodes.)
        let done = names.iter().all(|n| {
            let used: usize = consumed(d, n).values().map(Vec::len).sum();
            used == stored_ids(d, n).len()
        });
        if done {
            return;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            for (n, p) in names.iter().zip(peers) {
                let used: usize = consumed(d, n).values().map(Vec::len).sum();
                eprintln!(
                    "----- {n}: {used} of {} consumed\n{}",
                    stored_ids(d, n).len(),
                    p.log_text()
                );
            }
            panic!("stored episodes not trained within 60 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Each member's hash per trained step.
pub(crate) fn hashes(lines: &[Value]) -> BTreeMap<u64, String> {
    lines
        .iter()
        .filter(|l| l["trained"] == true)
        .map(|l| {
            (
                l["step"].as_u64().unwrap(),
                l["param_hash"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn three_servers_train_as_one_group_and_stay_bit_identical() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // All three in one epoch before any episode arrives.
    let (mut a, mut b, mut c, boot) = three_servers(d, &model, &["--groups-per-step", "1"]);
    let http: Vec<String> = [&mut a, &mut b, &mut c]
        .into_iter()
        .map(|s| s.http_url(Duration::from_secs(1)))
        .collect();
    let mut cl = client(d, &boot, 24, "run1");
    let st = cl.child.wait().unwrap();
    assert!(st.success(), "client failed:\n{}", cl.log_text());
    wait_all_consumed(d, &["a", "b", "c"], &[&a, &b, &c]);
    let per: Vec<Vec<Value>> = ["a", "b", "c"]
        .iter()
        .map(|n| metrics_lines(d, n))
        .collect();
    let h: Vec<BTreeMap<u64, String>> = per.iter().map(|l| hashes(l)).collect();
    println!(
        "steps: {:?}",
        per.iter()
            .map(|l| l
                .iter()
                .map(|m| (m["step"].clone(), m["members"].clone(), m["groups"].clone()))
                .collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    // Every member took every step, with the same parameters after each.
    assert!(h[0].len() >= 5, "only {} steps trained", h[0].len());
    assert_eq!(h[0], h[1], "members a and b differ");
    assert_eq!(h[0], h[2], "members a and c differ");
    for lines in &per {
        for l in lines.iter().filter(|l| l["trained"] == true) {
            assert_eq!(l["members"], 3, "{l}");
        }
    }
    // The same policy version served by the three engines.
    let versions: Vec<f64> = http
        .iter()
        .map(|u| metric(u, "agentjet_policy_version{model=\"tiny\"}").unwrap())
        .collect();
    assert!(
        versions[0] >= 5.0 && versions.iter().all(|v| *v == versions[0]),
        "{versions:?}"
    );
    // Each member trained the episodes it alone received: its ledger holds only its own
    // stored episodes, the ledgers are disjoint, and every member contributed.
    let mut all = HashSet::new();
    for n in ["a", "b", "c"] {
        let mine = stored_ids(d, n);
        let used: Vec<String> = consumed(d, n).into_values().flatten().collect();
        assert!(!used.is_empty(), "member {n} trained nothing of its own");
        for id in &used {
            assert!(
                mine.contains(id),
                "{n} consumed {id}, which it did not store"
            );
            assert!(all.insert(id.clone()), "{id} trained by two members");
        }
    }
    assert_eq!(all.len(), 96, "24 groups of 4 episodes, each trained once");

    // `status` shows the group: three members, one epoch, one parameter hash.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["status", "--bootstrap", &boot, "--wait", "3"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{table}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip_while(|l| !l.starts_with("GROUP"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{table}");
    let last = h[0].values().last().unwrap();
    for r in &rows {
        // GROUP MEMBER EPOCH MEMBERS STEP VERSION PARAMS ...
        assert_eq!(r[0], "tiny", "{table}");
        assert_eq!(r[2], rows[0][2], "one epoch: {table}");
        assert_eq!(r[3], "3", "{table}");
        assert_eq!(r[4], per[0].last().unwrap()["step"].to_string(), "{table}");
        assert!(last.starts_with(r[6]), "{table}");
    }
}

/// The `train` lines of a member's stdout so far, as (step, members).
fn train_lines(p: &mut Peer) -> Vec<String> {
    p.stdout_so_far()
        .into_iter()
        .filter(|l| l.starts_with("train step"))
        .collect()
}

#[test]
fn a_member_killed_mid_all_reduce_leaves_two_that_finish_the_step_and_go_on() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // Every gradient round holds 2.5 s between its reduce-scatter and its all-gather; a
    // round's timeout is 4 s.
    let extra = [
        "--groups-per-step",
        "1",
        "--collective-timeout",
        "4",
        "--test-midway-pause-ms",
        "2500",
        "--checkpoint-every",
        "1",
    ];
    let (mut a, b, mut c, boot) = three_servers(d, &model, &extra);
    let mut cl = client(d, &boot, 24, "run1");
    // The second step has started at c (the first completed with three members): c is
    // now inside the gradient round's pause. Kill it there.
    c.wait_event("c's second step", Duration::from_secs(120), |e| {
        matches!(e, ServerEvent::StepStarted { step: 2, .. })
    });
    std::thread::sleep(Duration::from_millis(800));
    let killed_in = metrics_lines(d, "c").len() as u64 + 1;
    c.kill9();
    let t_kill = std::time::Instant::now();
    println!("killed c in its step {killed_in}");
    // a and b finish that step, with two members.
    let recovered = wait_until("a two-member step", Duration::from_secs(60), || {
        metrics_lines(d, "a")
            .iter()
            .any(|l| l["trained"] == true && l["members"] == 2)
    });
    println!(
        "recovery: the first two-member step completed {:.2} s after the kill ({:?} polled)",
        t_kill.elapsed().as_secs_f64(),
        recovered
    );
    let st = cl.child.wait().unwrap();
    assert!(st.success(), "client failed:\n{}", cl.log_text());
    wait_all_consumed(d, &["a", "b"], &[&a, &b]);
    let (la, lb) = (metrics_lines(d, "a"), metrics_lines(d, "b"));
    let steps = |l: &[Value]| -> Vec<(u64, u64)> {
        l.iter()
            .filter(|l| l["trained"] == true)
            .map(|l| (l["step"].as_u64().unwrap(), l["members"].as_u64().unwrap()))
            .collect()
    };
    println!("a: {:?}\nb: {:?}", steps(&la), steps(&lb));
    println!("a's stdout: {:?}", train_lines(&mut a));
    // The same steps, the same parameters after each, at both survivors.
    assert_eq!(hashes(&la), hashes(&lb), "a and b differ");
    assert_eq!(steps(&la), steps(&lb));
    // Steps are numbered without a gap or a repeat: the killed step was taken once.
    let s = steps(&la);
    for (i, (step, _)) in s.iter().enumerate() {
        assert_eq!(*step, i as u64 + 1, "{s:?}");
    }
    // The step c died in was finished by a and b alone, on their own episodes, and
    // training went on after it.
    let (step, members) = s[killed_in as usize - 1];
    assert_eq!((step, members), (killed_in, 2), "{s:?}");
    assert!(
        s.len() > killed_in as usize,
        "no step after the recovery: {s:?}"
    );
    let l = &la[killed_in as usize - 1];
    let (ca, cb) = (consumed(d, "a"), consumed(d, "b"));
    let theirs = ca.get(&killed_in).map_or(0, Vec::len) + cb.get(&killed_in).map_or(0, Vec::len);
    // Its episodes (of trained groups; the ledgers also list skipped ones) are theirs:
    // c's share, summed before the kill, is not in the retried step.
    assert!(theirs > 0, "{l}");
    assert!(
        l["episodes"].as_u64().unwrap() as usize <= theirs,
        "{l} vs {theirs}"
    );
}

#[test]
fn a_fourth_server_joins_mid_run_and_is_bit_identical_from_its_first_step() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let gps = ["--groups-per-step", "1"];
    let (mut a, mut b, mut c, boot) = three_servers(d, &model, &gps);
    let mut cl = client(d, &boot, 12, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b", "c"], &[&a, &b, &c]);
    let k = metrics_lines(d, "a").last().unwrap()["step"]
        .as_u64()
        .unwrap();
    assert!(k >= 1);
    // A fresh server of the model: it fetches the group's state and joins at step k.
    let mut dd = server(d, &model, "d", Some(&boot), &gps);
    let http_d = dd.http_url(Duration::from_secs(120));
    let joined = dd.wait_event("the join", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::Joined { .. })
    });
    println!("{joined:?}");
    assert!(
        matches!(joined, ServerEvent::Joined { steps, .. } if steps == k),
        "{joined:?} (group at {k})"
    );
    for s in [&mut a, &mut b, &mut c, &mut dd] {
        s.wait_epoch(4, Duration::from_secs(60));
    }
    // Its engine serves the group's version at once.
    let va = metrics_lines(d, "a").last().unwrap()["version"]
        .as_f64()
        .unwrap();
    let vd = metric(&http_d, "agentjet_policy_version{model=\"tiny\"}").unwrap();
    assert_eq!(vd, va, "the joiner serves v{vd}, the group is at v{va}");
    let mut cl2 = client(d, &boot, 12, "run2");
    assert!(cl2.child.wait().unwrap().success(), "{}", cl2.log_text());
    wait_all_consumed(d, &["a", "b", "c", "d"], &[&a, &b, &c, &dd]);
    let ha = hashes(&metrics_lines(d, "a"));
    let hd = hashes(&metrics_lines(d, "d"));
    println!("a: {ha:?}\nd: {hd:?}");
    assert!(!hd.is_empty(), "the joiner took no step");
    for (step, h) in &hd {
        assert!(*step > k);
        assert_eq!(ha.get(step), Some(h), "step {step}");
    }
    for n in ["b", "c"] {
        let hn = hashes(&metrics_lines(d, n));
        assert_eq!(hn, ha, "{n} differs from a");
    }
    let versions: Vec<f64> = [&mut a, &mut b, &mut c, &mut dd]
        .into_iter()
        .map(|p| {
            let u = p.http_url(Duration::from_secs(1));
            metric(&u, "agentjet_policy_version{model=\"tiny\"}").unwrap()
        })
        .collect();
    assert!(versions.iter().all(|v| *v == versions[0]), "{versions:?}");
}

/// The step a member's first epoch line after a (re)start says it goes on from.
fn first_epoch_step(p: &mut Peer) -> u64 {
    match p.wait_epoch(2, Duration::from_secs(60)) {
        ServerEvent::Formed { steps, .. } => steps,
        _ => unreachable!(),
    }
}

#[test]
fn a_whole_group_restarted_from_its_checkpoints_resumes_at_one_step() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let extra = ["--groups-per-step", "1", "--checkpoint-every", "1"];
    let (mut a, mut b, boot) = two_servers(d, &model, &extra);
    let mut cl = client(d, &boot, 8, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b"], &[&a, &b]);
    // Both drain (SIGTERM): each saves its checkpoint.
    for p in [&a, &b] {
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    }
    for p in [&mut a, &mut b] {
        assert!(p.child.wait().unwrap().success());
    }
    let before = |n: &str| {
        metrics_lines(d, n).last().unwrap()["step"]
            .as_u64()
            .unwrap()
    };
    let (sa, sb) = (before("a"), before("b"));
    println!("stopped at steps a {sa}, b {sb}");
    // Restarted on the same data directories: one group, one step.
    let mut a = server(d, &model, "a", None, &extra);
    let boot = a.addr();
    let mut b = server(d, &model, "b", Some(&boot), &extra);
    let (ra, rb) = (first_epoch_step(&mut a), first_epoch_step(&mut b));
    println!("resumed at a {ra}, b {rb}");
    assert_eq!(ra, rb);
    assert_eq!(ra, sa.max(sb));
    let mut cl = client(d, &boot, 8, "run2");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b"], &[&a, &b]);
    let (la, lb) = (metrics_lines(d, "a"), metrics_lines(d, "b"));
    let (ha, hb) = (hashes(&la), hashes(&lb));
    assert!(
        ha.keys().any(|s| *s > ra),
        "no step after the restart: {ha:?}"
    );
    for (s, h) in &ha {
        if let Some(o) = hb.get(s) {
            assert_eq!(h, o, "step {s}");
        }
    }
    assert!(ha.keys().filter(|s| **s > ra).all(|s| hb.contains_key(s)));
    // Nothing trained twice: every stored episode is in exactly one ledger line.
    let mut seen = HashSet::new();
    for n in ["a", "b"] {
        for id in consumed(d, n).into_values().flatten() {
            assert!(seen.insert(id.clone()), "{id} consumed twice");
        }
    }
    assert_eq!(seen.len(), 64, "16 groups of 4 episodes");
}

/// The agent of [`AGENT`] with a constant reward: every group's rewards are equal.
const FLAT_AGENT: &str = r#"#!/bin/sh
set -eu
curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}' >/dev/null
echo '{"reward": 1.0}'
"#;

#[test]
fn groups_without_signal_reach_the_ledger_with_no_step_to_carry_them() {
    let _lane = common::light();
    // A group whose rewards are all equal is skipped, not trained: no step follows it
    // here, and its episodes must still be recorded as consumed (not held back forever,
    // nor fed to the trainer again after a restart).
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let mut a = server(d, &model, "a", None, &["--groups-per-step", "1"]);
    a.wait_epoch(1, Duration::from_secs(120));
    let boot = a.addr();
    let mut cl = client_with(d, &boot, 3, "run1", FLAT_AGENT);
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a"], &[&a]);
    assert_eq!(stored_ids(d, "a").len(), 12);
    assert!(
        metrics_lines(d, "a").is_empty(),
        "no group had signal, yet a step was taken"
    );
    // Each at the step it was taken after (none yet: 0).
    assert_eq!(consumed(d, "a").keys().collect::<Vec<_>>(), vec![&0]);
}

/// Each member's outer steps (`outer.jsonl`): (outer step, parameter hash, members).
fn outer_lines(dir: &Path, name: &str) -> Vec<(u64, String, u64)> {
    std::fs::read_to_string(dir.join(name).join("runs/tiny/outer.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["outer_step"].as_u64().unwrap(),
                v["param_hash"].as_str().unwrap().to_string(),
                v["members"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn diloco_members_take_their_own_inner_steps_and_are_identical_after_every_outer_step() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let extra = ["--groups-per-step", "1", "--sync-every", "4"];
    let (mut a, mut b, boot) = two_servers(d, &model, &extra);
    let http_a = a.http_url(Duration::from_secs(1));
    let http_b = b.http_url(Duration::from_secs(1));
    let mut cl = client(d, &boot, 48, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    // Each member's groups feed its inner steps, 4 per outer step (the rest wait for the
    // next): wait until the outer steps stop coming (nothing changes for 3 s).
    let t0 = std::time::Instant::now();
    let mut last = (Vec::new(), std::time::Instant::now());
    let (oa, ob) = loop {
        let now = (outer_lines(d, "a"), outer_lines(d, "b"));
        if now.0 != last.0 || now.0 != now.1 {
            last = (now.0.clone(), std::time::Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(3) {
            break now;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "outer steps still changing"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    println!("outer steps: a {oa:?}\nb {ob:?}");
    // 48 groups (about 7 in 8 with a signal) split between two members by the client's
    // hashing: at least 8 trainable ones each (all but certain), so two outer steps (the
    // second one with momentum).
    assert!(
        oa.len() >= 2,
        "{} outer steps:\n{}\n{}",
        oa.len(),
        a.log_text(),
        b.log_text()
    );
    // Bit-identical after every outer step, both in it.
    assert_eq!(oa, ob);
    for (i, (k, _, members)) in oa.iter().enumerate() {
        assert_eq!(*k, i as u64 + 1);
        assert_eq!(*members, 2);
    }
    // Inner steps are each member's own: between outer steps, 4 of them with no
    // parameter hash, at the last outer step's policy version.
    for n in ["a", "b"] {
        let lines = metrics_lines(d, n);
        let trained: Vec<&Value> = lines.iter().filter(|l| l["trained"] == true).collect();
        assert!(
            trained.len() >= 4 * oa.len(),
            "{n}: {} inner steps",
            trained.len()
        );
        for (i, l) in trained.iter().enumerate() {
            assert!(l["param_hash"].is_null(), "{l}");
            assert_eq!(l["version"].as_u64().unwrap(), i as u64 / 4, "{n}: {l}");
        }
    }
    // The engines serve the outer step's parameters under its version.
    let outer = oa.len() as f64;
    for u in [&http_a, &http_b] {
        let v = metric(u, "agentjet_policy_version{model=\"tiny\"}").unwrap();
        assert_eq!(v, outer, "{u}");
    }
}

#[test]
fn a_member_whose_parameters_drift_is_found_by_the_hash_round_and_resyncs() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let common = ["--groups-per-step", "1", "--hash-every", "2"];
    let mut a = server(d, &model, "a", None, &common);
    let boot = a.addr();
    let mut b = server(d, &model, "b", Some(&boot), &common);
    // c's parameters drift silently right after it applies step 2.
    let mut drifting = common.to_vec();
    drifting.extend(["--test-perturb-at-step", "2"]);
    let mut c = server(d, &model, "c", Some(&boot), &drifting);
    for s in [&mut a, &mut b, &mut c] {
        s.wait_epoch(3, Duration::from_secs(60));
    }
    let mut cl = client(d, &boot, 24, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b", "c"], &[&a, &b, &c]);
    // Every member learnt of it in the hash round after step 2; c re-synced and says why.
    a.wait_event("the hash round's verdict", Duration::from_secs(5), |e| {
        matches!(e, ServerEvent::HashesDiffer { steps: 2, .. })
    });
    let why = c.wait_event("the re-sync", Duration::from_secs(5), |e| {
        matches!(e, ServerEvent::Syncing { steps: 2, .. })
    });
    println!("{why:?}");
    assert!(
        matches!(&why, ServerEvent::Syncing { differ: Some((mine, group)), behind: None, .. } if mine != group),
        "{why:?}"
    );
    c.wait_event("the join at step 2", Duration::from_secs(5), |e| {
        matches!(e, ServerEvent::Joined { steps: 2, .. })
    });
    let (ha, hb, hc) = (
        hashes(&metrics_lines(d, "a")),
        hashes(&metrics_lines(d, "b")),
        hashes(&metrics_lines(d, "c")),
    );
    println!("a: {ha:?}\nc: {hc:?}");
    assert_eq!(ha, hb);
    assert_ne!(ha[&2], hc[&2], "c's step 2 did not drift");
    assert!(
        ha.keys().any(|s| *s > 2),
        "no step after the re-sync: {ha:?}"
    );
    for (s, h) in ha.iter().filter(|(s, _)| **s != 2) {
        assert_eq!(hc.get(s), Some(h), "step {s}");
    }
}

#[test]
fn a_diloco_joiner_fetches_the_outer_state_and_matches_from_the_next_outer_step() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let extra = ["--groups-per-step", "1", "--sync-every", "2"];
    let (mut a, mut b, boot) = two_servers(d, &model, &extra);
    // 32 groups: each member holds at least 4 with a signal (all but certain).
    let mut cl = client(d, &boot, 32, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    let t0 = std::time::Instant::now();
    while outer_lines(d, "a").len() < 2 {
        if t0.elapsed() > Duration::from_secs(60) {
            panic!(
                "no two outer steps:\n{}\n-----\n{}",
                a.log_text(),
                b.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // A third member joins: it fetches the anchor, the outer momentum and the counters.
    let mut c = server(d, &model, "c", Some(&boot), &extra);
    let k = match c.wait_event("the join", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::Joined { .. })
    }) {
        ServerEvent::Joined { steps, .. } => steps,
        _ => unreachable!(),
    };
    for s in [&mut a, &mut b, &mut c] {
        s.wait_epoch(3, Duration::from_secs(60));
    }
    // 48 groups: each of the three members holds at least 2 with a signal (an outer step
    // waits for every member's 2 inner steps; with 24, one member in CI once had too few).
    let mut cl2 = client(d, &boot, 48, "run2");
    assert!(cl2.child.wait().unwrap().success(), "{}", cl2.log_text());
    let t0 = std::time::Instant::now();
    while !outer_lines(d, "c").iter().any(|o| o.2 == 3) {
        if t0.elapsed() > Duration::from_secs(120) {
            panic!(
                "no outer step with three members:\n{}\n-----\n{}\n-----\n{}",
                a.log_text(),
                b.log_text(),
                c.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(1));
    let (oa, oc) = (outer_lines(d, "a"), outer_lines(d, "c"));
    println!("a: {oa:?}\nc: {oc:?}");
    // c's outer steps follow k, and each equals a's (the momentum came with the state:
    // without it c's first outer step would differ).
    assert!(!oc.is_empty());
    for (i, o) in oc.iter().enumerate() {
        assert_eq!(o.0, k + 1 + i as u64);
        assert_eq!(
            oa.iter().find(|x| x.0 == o.0),
            Some(o),
            "outer step {}",
            o.0
        );
    }
}

#[test]
fn servers_of_one_model_in_two_runs_train_as_two_groups() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let mut a = server(d, &model, "a", None, &["--train-group", "run-1"]);
    let boot = a.addr();
    let mut b = server(d, &model, "b", Some(&boot), &["--train-group", "run-2"]);
    let mut c = server(d, &model, "c", Some(&boot), &["--train-group", "run-1"]);
    for s in [&mut a, &mut c] {
        s.wait_epoch(2, Duration::from_secs(60));
    }
    b.wait_epoch(1, Duration::from_secs(60));
    // Gossip has long carried every status: b still trains alone, a and c together.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !b.events()
            .iter()
            .any(|e| matches!(e, ServerEvent::Formed { members: 2, .. })),
        "run-2 merged with run-1"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["status", "--bootstrap", &boot, "--wait", "3"])
        .args(["--run", &common::run_key(d).1])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{table}");
    let groups: Vec<(String, String)> = table
        .lines()
        .skip_while(|l| !l.starts_with("GROUP"))
        .skip(1)
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[0].to_string(), w[3].to_string())
        })
        .collect();
    let mut groups = groups;
    groups.sort();
    assert_eq!(
        groups,
        vec![
            ("run-1".to_string(), "2".to_string()),
            ("run-1".to_string(), "2".to_string()),
            ("run-2".to_string(), "1".to_string())
        ],
        "{table}"
    );
    // Each server is certified by the run (its own --run-key) for its group.
    for (s, group) in [(&mut a, "run-1"), (&mut b, "run-2"), (&mut c, "run-1")] {
        let id = s.peer_id();
        let line = table
            .lines()
            .find(|l| l.starts_with(&id))
            .unwrap_or_else(|| panic!("{id} not in the table:\n{table}"));
        assert!(
            line.ends_with(&format!("yes: tiny serve train in {group}")),
            "{line}"
        );
    }
}

/// A server whose certificate is about to expire takes the renewed one written over its
/// `--cert` file, without a restart: other peers of the run still see it certified after
/// the first certificate expired. A file that is no certificate is not taken.
#[test]
fn a_renewed_certificate_file_is_taken_without_a_restart() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let (key, run) = common::run_key(d);
    let run_key = agentjet::swarm::RunKey::load(Path::new(&key)).unwrap();
    let bin = env!("CARGO_BIN_EXE_agentjet-peer");
    let out = std::process::Command::new(bin)
        .args(["id", "--data-dir"])
        .arg(d.join("s"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let peer: agentjet::swarm::PeerId =
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let grant = agentjet::swarm::Grant {
        model: "tiny".into(),
        group: "tiny".into(),
        serve: true,
        train: true,
    };
    let now = agentjet::swarm::trust::unix_now();
    // Long enough for a loaded machine to start the server and look at the file twice.
    let first_until = now + 30;
    let cert = d.join("s.cert");
    std::fs::write(
        &cert,
        run_key.certify(&peer, grant.clone(), first_until).encode(),
    )
    .unwrap();
    let mut s = server(d, &model, "s", None, &["--cert", cert.to_str().unwrap()]);
    s.wait_serving(Duration::from_secs(60));
    assert_eq!(s.peer_id(), peer.to_string());
    // Not a certificate: not taken (the current one stays).
    std::fs::write(&cert, "not a certificate\n").unwrap();
    s.wait_event(
        "the bad file refused",
        Duration::from_secs(20),
        |e| matches!(e, ServerEvent::CertNotUsed { source, .. } if source.ends_with("s.cert")),
    );
    // The renewed certificate: taken.
    std::fs::write(&cert, run_key.certify(&peer, grant, now + 3600).encode()).unwrap();
    s.wait_event("the renewed certificate taken", Duration::from_secs(20), |e| {
        matches!(e, ServerEvent::CertRenewed { not_after_unix, .. } if *not_after_unix == now + 3600)
    });
    // Past the first certificate's expiry, the swarm sees the renewed one.
    while agentjet::swarm::trust::unix_now() <= first_until + 1 {
        std::thread::sleep(Duration::from_millis(500));
    }
    let boot = s.addr();
    let out = std::process::Command::new(bin)
        .args(["status", "--bootstrap", &boot, "--wait", "3", "--run", &run])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    let line = table
        .lines()
        .find(|l| l.starts_with(&peer.to_string()))
        .unwrap_or_else(|| panic!("{peer} not in the table:\n{table}"));
    assert!(line.ends_with("yes: tiny serve train in tiny"), "{line}");
    assert!(!s.log_text().contains("has expired"), "{}", s.log_text());
}

/// Two servers training a LoRA adapter (`--lora-rank`) form one group: every step
/// all-reduces the adapter's gradient only, both stay bit-identical and serve each new
/// version, the checkpoints hold the adapter in PEFT's format (not the frozen base), a
/// restart resumes from it, and `export --adapter --merge` writes a merged model.
#[test]
fn lora_servers_train_one_adapter_as_a_group_and_export_it_merged() {
    let _heavy = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let extra = [
        "--groups-per-step",
        "1",
        "--checkpoint-every",
        "1",
        "--lora-rank",
        "4",
        "--lora-targets",
        "q,v,down",
    ];
    let (mut a, mut b, boot) = two_servers(d, &model, &extra);
    let mode = a.wait_line("training: trainer memory", Duration::from_secs(5));
    assert!(mode.contains("frozen"), "{mode}");
    let http = a.http_url(Duration::from_secs(1));
    let mut cl = client(d, &boot, 16, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b"], &[&a, &b]);
    let (la, lb) = (metrics_lines(d, "a"), metrics_lines(d, "b"));
    let (ha, hb) = (hashes(&la), hashes(&lb));
    assert!(ha.len() >= 4, "only {} steps trained", ha.len());
    assert_eq!(ha, hb, "the members' adapters differ");
    assert!(la
        .iter()
        .filter(|l| l["trained"] == true)
        .all(|l| l["members"] == 2));
    let version = metric(&http, "agentjet_policy_version{model=\"tiny\"}").unwrap();
    assert!(version >= 4.0, "served version {version}");
    let ck = d.join("a/runs/tiny/checkpoint");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8.0);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["q_proj", "v_proj", "down_proj"])
    );
    assert!(
        !ck.join("model").exists(),
        "the frozen base was checkpointed"
    );

    // A third LoRA server joins by fetching the adapter and its moments only (the base's
    // float32 values alone would be about 324 KB); a full fine-tuning server beside them
    // is another group.
    let k = la.last().unwrap()["step"].as_u64().unwrap();
    let mut full = server(d, &model, "full", Some(&boot), &["--groups-per-step", "1"]);
    let mut c = server(d, &model, "c", Some(&boot), &extra);
    let joined = c.wait_event("the join", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::Joined { .. })
    });
    println!("{joined:?}");
    match joined {
        ServerEvent::Joined { steps, bytes, .. } => {
            assert_eq!(steps, k);
            assert!(bytes < 100_000, "the joiner fetched {bytes} bytes");
        }
        _ => unreachable!(),
    }
    for s in [&mut a, &mut b, &mut c] {
        s.wait_epoch(3, Duration::from_secs(60));
    }
    full.wait_serving(Duration::from_secs(60));
    // The client may route every group of a short run to the full fine-tuning server (the
    // one it found first, or the fastest): another run then, at most three in all.
    let mut client_log = String::new();
    for run in ["run2", "run3", "run4"] {
        let mut cl = client(d, &boot, 8, run);
        assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
        wait_all_consumed(d, &["a", "b", "c"], &[&a, &b, &c]);
        client_log = cl.log_text();
        if !hashes(&metrics_lines(d, "c")).is_empty() {
            break;
        }
        eprintln!("{run}: every group went to the full fine-tuning server; another run");
    }
    let (la, hc) = (metrics_lines(d, "a"), hashes(&metrics_lines(d, "c")));
    let ha = hashes(&la);
    if hc.is_empty() {
        let after: Vec<&u64> = ha.keys().filter(|s| **s > k).collect();
        let full_steps = hashes(&metrics_lines(d, "full")).len();
        panic!(
            "the joiner took no step (a's steps after {k}: {after:?}; the full server's \
             steps: {full_steps}); the client's log:\n{}\nthe joiner's log:\n{}",
            client_log,
            c.log_text()
        );
    }
    for (step, h) in &hc {
        assert!(*step > k);
        assert_eq!(ha.get(step), Some(h), "step {step}");
    }
    // The full fine-tuning server trained alone (the client routes some groups to it).
    assert!(metrics_lines(d, "full")
        .iter()
        .filter(|l| l["trained"] == true)
        .all(|l| l["members"] == 1));
    for p in [&a, &b, &c, &full] {
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    }
    for p in [&mut a, &mut b, &mut c, &mut full] {
        assert!(p.child.wait().unwrap().success());
    }
    let last = metrics_lines(d, "a").last().unwrap()["step"]
        .as_u64()
        .unwrap();
    // A restart resumes the adapter; one with another adapter shape refuses the run.
    let mut a = server(d, &model, "a", None, &extra);
    let resumed = a.wait_line("training: resumed", Duration::from_secs(60));
    assert!(resumed.contains(&format!("at step {last}")), "{resumed}");
    unsafe { libc::kill(a.child.id() as i32, libc::SIGTERM) };
    assert!(a.child.wait().unwrap().success());
    let mut wrong = extra.to_vec();
    wrong[5] = "8";
    let mut w = server(d, &model, "a", None, &wrong);
    assert!(!w.child.wait().unwrap().success());
    assert!(w.log_text().contains("rank: 4"), "{}", w.log_text());

    let merged = d.join("merged");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["export", "--device", "cpu", "--model"])
        .arg(&model)
        .arg("--adapter")
        .arg(ck.join("adapter"))
        .args(["--merge", "--out"])
        .arg(&merged)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let load = |p: &Path| {
        agentjet::model::checkpoint::load_model(
            &agentjet::model::ModelSource::HfDir(p.to_path_buf()),
            tch::Device::Cpu,
            agentjet::model::llama::DType::F32,
        )
        .unwrap()
        .model
    };
    let (base, m) = (load(&model), load(&merged));
    let moved = base
        .hf_tensors()
        .unwrap()
        .iter()
        .zip(m.hf_tensors().unwrap())
        .filter(|((n, x), (_, y))| {
            let changed = common::max_abs_diff(x, y) > 0.0;
            let targeted = ["q_proj", "v_proj", "down_proj"]
                .iter()
                .any(|t| n.contains(t));
            assert!(changed == targeted || !changed, "{n} changed, not a target");
            changed
        })
        .count();
    assert_eq!(moved, 3 * 2, "q, v and down of 2 layers merged");
}
