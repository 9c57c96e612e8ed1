//! Studies end to end: `agentjet-peer study run` driving real servers of a tiny model and
//! real clients on loopback. A driver killed with kill -9 twice mid-way and started again
//! ends with the arms, decisions and winner of an uninterrupted run, no arm run to a
//! target twice; a server killed mid-arm is restarted from its checkpoint and the arm
//! goes on.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// An agent whose reward is its arm's `BIAS` plus 0.1 for a reply of even length: arms
/// rank by their bias whatever the sampling, and every group has signal to train on.
const AGENT: &str = r#"#!/bin/sh
set -eu
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 4, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
if [ $(( ${#content} % 2 )) -eq 0 ]; then r=1; else r=0; fi
# A step takes about a second: the driver (which looks every 500 ms) stops an arm
# within a step or two of its target.
sleep "${AGENT_SLEEP:-0}"
echo "{\"reward\": ${BIAS}.${r}}"
"#;

/// Writes the tiny model, the agent, the tasks and a study file of `policy` (with
/// `extra` appended); returns the study file.
pub(crate) fn write_study(dir: &Path, policy: &str, extra: &str) -> PathBuf {
    let model = common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&dir.join("tiny-model"));
    std::fs::write(dir.join("agent.sh"), AGENT).unwrap();
    crate::client::write_tasks(&dir.join("tasks.jsonl"), 4);
    let text = format!(
        r#"name = "tiny-study"
seed = 5
policy = "{policy}"
window = 2

[base]
model = "{model}"
server = ["--served-model-name", "tiny", "--device", "cpu", "--learning-rate", "1e-3",
          "--group-timeout", "5", "--groups-per-step", "1", "--checkpoint-every", "1",
          "--provider-ttl", "4", "--status-interval", "0.5", "--no-dashboard"]
client = ["--agent", "sh {agent}", "--tasks", "{tasks}", "--num-repeat", "4",
          "--concurrency", "4", "--provider-ttl", "4", "--status-interval", "0.5"]

{extra}
"#,
        model = model.display(),
        agent = dir.join("agent.sh").display(),
        tasks = dir.join("tasks.jsonl").display(),
    );
    let file = dir.join("study.toml");
    std::fs::write(&file, text).unwrap();
    file
}

/// A driver process, killed if the test lets go of it early (a failed wait).
pub(crate) struct Driver(pub(crate) Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn start_driver(file: &Path, dir: &Path, log: &str) -> Driver {
    start_driver_with(file, dir, log, &[])
}

pub(crate) fn start_driver_with(file: &Path, dir: &Path, log: &str, extra: &[&str]) -> Driver {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.with_extension(format!("{log}.out")))
        .unwrap();
    Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["study", "run"])
        .arg(file)
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .map(Driver)
        .unwrap()
}

/// `study report`'s `report.md` for the study in `dir`.
pub(crate) fn study_report(file: &Path, dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["study", "report"])
        .arg(file)
        .arg("--dir")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.join("report.md")).unwrap()
}

pub(crate) fn driver_out(dir: &Path, log: &str) -> String {
    std::fs::read_to_string(dir.with_extension(format!("{log}.out"))).unwrap_or_default()
}

pub(crate) fn journal(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("journal.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits for the driver to exit successfully.
pub(crate) fn finish(mut c: Driver, dir: &Path, log: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = c.0.try_wait().unwrap() {
            assert!(
                st.success(),
                "the driver failed ({st}):\n{}",
                driver_out(dir, log)
            );
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "the driver did not end within {within:?}:\n{}\njournal: {:#?}",
                driver_out(dir, log),
                journal(dir)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the journal satisfies `f`.
pub(crate) fn wait_journal(dir: &Path, what: &str, within: Duration, f: impl Fn(&[Value]) -> bool) {
    let deadline = Instant::now() + within;
    while !f(&journal(dir)) {
        assert!(
            Instant::now() < deadline,
            "no {what} within {within:?}; journal: {:#?}",
            journal(dir)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The first `training` event of a server's events file (it says whether the server
/// resumed, and at which step).
pub(crate) fn first_training(events: &Path) -> Value {
    std::fs::read_to_string(events)
        .unwrap_or_else(|e| panic!("{}: {e}", events.display()))
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["event"] == "training")
        .unwrap_or_else(|| panic!("no training event in {}", events.display()))
}

pub(crate) fn kind(r: &Value) -> &str {
    r["t"].as_str().unwrap_or("")
}

/// The arms the journal says run now.
pub(crate) fn running(j: &[Value]) -> std::collections::BTreeSet<u64> {
    let mut on = std::collections::BTreeSet::new();
    for r in j {
        let arm = r["arm"].as_u64().unwrap_or(u64::MAX);
        match kind(r) {
            "launch" => {
                on.insert(arm);
            }
            "reached" | "decision" => {
                on.remove(&arm);
            }
            "failure" if r["restart"] == false => {
                on.remove(&arm);
            }
            _ => {}
        }
    }
    on
}

/// The decisions as (arm, action, steps), in order, and the winner.
pub(crate) fn outcome(j: &[Value]) -> (Vec<(u64, String, u64)>, Option<u64>) {
    let decisions = j
        .iter()
        .filter(|r| kind(r) == "decision")
        .map(|r| {
            (
                r["arm"].as_u64().unwrap(),
                r["action"].as_str().unwrap().to_string(),
                r["steps"].as_u64().unwrap(),
            )
        })
        .collect();
    let end = j.iter().find(|r| kind(r) == "end").expect("an end record");
    (decisions, end["winner"].as_u64())
}

/// No arm reached a target twice, and none was launched to a target it had reached.
pub(crate) fn assert_no_arm_ran_twice(j: &[Value]) {
    let mut reached = std::collections::BTreeSet::new();
    for r in j {
        let key = (r["arm"].as_u64(), r["steps"].as_u64());
        match kind(r) {
            "reached" => assert!(reached.insert(key), "reached twice: {r}"),
            "launch" => assert!(
                !reached.contains(&key),
                "launched again after reaching: {r}"
            ),
            _ => {}
        }
    }
}

pub(crate) const HALVING: &str = r#"
[budget]
steps = 6
at_once = 2

[space.bias]
env = "BIAS"
values = [0, 3, 1, 2]

[asha]
min_steps = 3
eta = 2
"#;

#[test]
fn a_study_killed_twice_mid_way_ends_as_an_uninterrupted_one_and_no_arm_runs_twice() {
    // Two training servers and two clients at once, twice over.
    let _lane = common::heavy();
    let root = tempfile::tempdir().unwrap();
    let file = write_study(
        root.path(),
        "asha",
        &format!("{HALVING}\n[base.env]\nAGENT_SLEEP = \"0.5\"\n"),
    );

    // Uninterrupted.
    let a = root.path().join("a");
    finish(
        start_driver(&file, &a, "run"),
        &a,
        "run",
        Duration::from_secs(400),
    );
    let ja = journal(&a);
    let (decisions_a, winner_a) = outcome(&ja);
    println!("uninterrupted:\n{}", driver_out(&a, "run"));
    // The arm of bias 3 (id 1) wins; the rung at 2 steps keeps the two best (ids 1 and 3).
    assert_eq!(winner_a, Some(1), "{ja:#?}");
    let go: Vec<u64> = decisions_a
        .iter()
        .filter(|d| d.1 == "continue")
        .map(|d| d.0)
        .collect();
    assert_eq!(go, vec![1, 3], "{decisions_a:?}");
    assert_no_arm_ran_twice(&ja);

    // Killed with kill -9 twice while an arm runs, started again each time.
    let b = root.path().join("b");
    let mut d = start_driver(&file, &b, "run");
    wait_journal(
        &b,
        "a reached rung with an arm running",
        Duration::from_secs(200),
        |j| j.iter().any(|r| kind(r) == "reached") && !running(j).is_empty(),
    );
    d.0.kill().unwrap();
    d.0.wait().unwrap();
    let d = start_driver(&file, &b, "run");
    wait_journal(
        &b,
        "a decision with an arm running",
        Duration::from_secs(300),
        |j| {
            let resumed = j.iter().rposition(|r| kind(r) == "resumed").unwrap_or(0);
            j[resumed..].iter().any(|r| kind(r) == "decision") && !running(j).is_empty()
        },
    );
    let mut d = d;
    d.0.kill().unwrap();
    d.0.wait().unwrap();
    finish(
        start_driver(&file, &b, "run"),
        &b,
        "run",
        Duration::from_secs(400),
    );
    let jb = journal(&b);
    let out = driver_out(&b, "run");
    println!("interrupted twice:\n{out}");
    assert_eq!(jb.iter().filter(|r| kind(r) == "resumed").count(), 2);
    assert_eq!(jb[0]["arms"], ja[0]["arms"], "the same arms");
    let (decisions_b, winner_b) = outcome(&jb);
    assert_eq!(decisions_b, decisions_a, "the same decisions");
    assert_eq!(winner_b, winner_a, "the same winner");
    assert_no_arm_ran_twice(&jb);
    // Each time, the arm that was running was picked up: what the killed driver left of
    // it was stopped (its server saves its checkpoint on the parent-death signal) and it
    // went on from there.
    let picked = out
        .matches("was running when the last driver stopped")
        .count();
    assert!((2..=4).contains(&picked), "{picked} arms picked up:\n{out}");
    // An arm launched to the last rung resumed from its checkpoint (its server's last
    // start says so), at the step it had saved.
    let relaunched: std::collections::BTreeSet<u64> = jb
        .iter()
        .filter(|r| kind(r) == "launch" && r["steps"] == 6)
        .filter_map(|r| r["arm"].as_u64())
        .collect();
    for arm in relaunched {
        let training = first_training(&b.join(format!("arms/{arm:03}/server.events.jsonl")));
        assert_eq!(training["resumed"], true, "arm {arm}: {training}");
        assert!(
            training["step"].as_u64().unwrap() >= 3,
            "arm {arm}: {training}"
        );
    }
    // Each arm's server steps: 1, 2, ... with none taken twice.
    for arm in 0..4 {
        let metrics = b.join(format!("arms/{arm:03}/server/runs/tiny/metrics.jsonl"));
        let steps: Vec<u64> = crate::client::metrics_lines(&metrics)
            .iter()
            .map(|l| l["step"].as_u64().unwrap())
            .collect();
        assert!(!steps.is_empty(), "arm {arm} took no step");
        assert!(
            steps.iter().enumerate().all(|(i, &s)| s == i as u64 + 1),
            "arm {arm}: steps {steps:?}"
        );
    }
    // The report names the winner and every decision.
    let report = std::fs::read_to_string(b.join("report.md")).unwrap();
    assert!(report.contains("**Winner: arm 1 (bias=3)**"), "{report}");
    let listed = report
        .lines()
        .filter(|l| {
            l.split_once(". arm ")
                .is_some_and(|(n, _)| n.parse::<usize>().is_ok())
        })
        .count();
    assert_eq!(listed, decisions_b.len(), "{report}");
    assert!(b.join("curves.svg").is_file());
    // `study status` reads the same journal.
    let st = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["study", "status"])
        .arg(&file)
        .arg("--dir")
        .arg(&b)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&st.stdout);
    assert!(st.status.success(), "{text}");
    assert!(text.contains("winner arm 1 (bias=3)"), "{text}");
}

#[test]
fn a_server_killed_mid_arm_is_restarted_from_its_checkpoint_and_the_arm_goes_on() {
    let _lane = common::light();
    let root = tempfile::tempdir().unwrap();
    let file = write_study(
        root.path(),
        "grid",
        "[budget]\nsteps = 6\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [1]\n",
    );
    let dir = root.path().join("s");
    let d = start_driver(&file, &dir, "run");
    let arm = dir.join("arms/000");
    let metrics = arm.join("server/runs/tiny/metrics.jsonl");
    common::peer::wait_until("two steps", Duration::from_secs(200), || {
        crate::client::metrics_lines(&metrics).len() >= 2
    });
    let pids: Value =
        serde_json::from_str(&std::fs::read_to_string(arm.join("pids.json")).unwrap()).unwrap();
    let pid = pids["server"].as_i64().unwrap() as i32;
    // SAFETY: kill(2) of the arm's server, a process this test's driver started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    finish(d, &dir, "run", Duration::from_secs(300));
    let j = journal(&dir);
    println!("{}", driver_out(&dir, "run"));
    let failure = j
        .iter()
        .find(|r| kind(r) == "failure")
        .unwrap_or_else(|| panic!("no failure recorded: {j:#?}"));
    assert_eq!(failure["kind"], "crashed", "{failure}");
    assert_eq!(failure["restart"], true, "{failure}");
    assert!(
        j.iter().any(|r| kind(r) == "launch" && r["attempt"] == 2),
        "{j:#?}"
    );
    let (decisions, winner) = outcome(&j);
    assert_eq!(decisions, vec![(0, "finish".to_string(), 6)]);
    assert_eq!(winner, Some(0));
    // The restarted server resumed from its checkpoint, and its steps go on from there
    // (none lost from the metrics, none taken twice).
    let training = first_training(&arm.join("server.events.jsonl"));
    assert_eq!(training["resumed"], true, "{training}");
    assert!(training["step"].as_u64().unwrap() >= 1, "{training}");
    let steps: Vec<u64> = crate::client::metrics_lines(&metrics)
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert!(steps.len() >= 6, "{steps:?}");
    assert!(
        steps.iter().enumerate().all(|(i, &s)| s == i as u64 + 1),
        "{steps:?}"
    );
}

#[test]
fn a_bad_study_file_is_refused_with_the_field_named() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("s.toml");
    std::fs::write(
        &file,
        "name = \"s\"\npolicy = \"asha\"\n[base]\nmodel = \"m\"\nclient = [\"--agent\", \"a\", \"--tasks\", \"t\"]\n\
         [budget]\nsteps = 4\n[space.lr]\nserver = \"--learning-rate\"\nvalues = [1e-5]\n[asha]\nmin_steps = 9\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["study", "run"])
        .arg(&file)
        .arg("--dir")
        .arg(root.path().join("d"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("s.toml: asha.min_steps: 9: must be at least 1 and below budget.steps (4)"),
        "{err}"
    );
    assert!(!root.path().join("d").exists(), "nothing ran");
}

#[test]
fn pbt_replaces_the_worst_arm_with_a_copy_of_the_best_arms_checkpoint() {
    let _lane = common::light();
    let root = tempfile::tempdir().unwrap();
    let file = write_study(
        root.path(),
        "pbt",
        "[budget]\nsteps = 6\nat_once = 2\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [0, 3, 1, 2]\n\n\
         [pbt]\ninterval = 3\nquantile = 0.25\nexplore = [\"bias\"]\nresample = 0.0\n",
    );
    let dir = root.path().join("s");
    let d = start_driver_with(&file, &dir, "run", &["--dashboard", "127.0.0.1:0"]);
    // The study's page while it runs: the report so far, and its state as JSON.
    let url = {
        let mut url = String::new();
        common::peer::wait_until("the dashboard's address", Duration::from_secs(30), || {
            let out = driver_out(&dir, "run");
            match out.lines().find_map(|l| l.strip_prefix("dashboard: ")) {
                Some(u) => {
                    url = u.trim_end_matches('/').to_string();
                    true
                }
                None => false,
            }
        });
        url
    };
    common::peer::wait_until("a launch in the journal", Duration::from_secs(60), || {
        journal(&dir).iter().any(|r| kind(r) == "launch")
    });
    let (status, page) = common::peer::http(&url, "GET", "/", None);
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("# Study tiny-study") && page.contains("curves.svg"),
        "{page}"
    );
    let (status, api) = common::peer::http(&url, "GET", "/api/study", None);
    assert_eq!(status, 200, "{api}");
    let api: Value = serde_json::from_str(&api).unwrap();
    assert_eq!(api["arms"].as_array().unwrap().len(), 4, "{api}");
    let (status, svg) = common::peer::http(&url, "GET", "/curves.svg", None);
    assert!(status == 200 && svg.contains("<svg"), "{status} {svg}");
    finish(d, &dir, "run", Duration::from_secs(400));
    let j = journal(&dir);
    println!("{}", driver_out(&dir, "run"));
    assert_no_arm_ran_twice(&j);
    // Rung 3 of 4 arms: the worst (arm 0, bias 0) stops, and a new arm starts from the
    // best's (arm 1, bias 3) checkpoint with its bias moved to a neighbour in the list.
    let born: Vec<&Value> = j.iter().filter(|r| kind(r) == "arm").collect();
    assert_eq!(born.len(), 1, "{j:#?}");
    let child = born[0];
    assert_eq!(child["arm"]["id"], 4);
    assert_eq!(child["from"]["arm"], 1, "{child}");
    assert_eq!(child["from"]["replaces"], 0, "{child}");
    assert_eq!(child["from"]["step"], 3, "{child}");
    assert_eq!(child["steps"], 6);
    let bias = child["arm"]["values"]["bias"].as_u64().unwrap();
    assert!(
        bias == 0 || bias == 1,
        "a neighbour of 3 in [0, 3, 1, 2]: {bias}"
    );
    let (decisions, winner) = outcome(&j);
    assert!(
        decisions.contains(&(0, "stop".to_string(), 3)),
        "{decisions:?}"
    );
    for arm in [1, 2, 3] {
        assert!(
            decisions.contains(&(arm, "continue".to_string(), 6)),
            "{decisions:?}"
        );
    }
    assert_eq!(winner, Some(1), "bias 3 ranks first");
    // The new arm's server resumed from the parent's checkpoint: its first training
    // event says so, its metrics begin with the parent's steps, and go on from there.
    let arm4 = dir.join("arms/004");
    let training = first_training(&arm4.join("server.events.jsonl"));
    assert_eq!(training["resumed"], true, "{training}");
    let from = training["step"].as_u64().unwrap();
    assert!(from >= 3, "{training}");
    let mine = crate::client::metrics_lines(&arm4.join("server/runs/tiny/metrics.jsonl"));
    let parents =
        crate::client::metrics_lines(&dir.join("arms/001/server/runs/tiny/metrics.jsonl"));
    for s in 0..from as usize {
        assert_eq!(mine[s]["step"], parents[s]["step"]);
        assert_eq!(
            mine[s]["reward_mean"],
            parents[s]["reward_mean"],
            "step {}",
            s + 1
        );
    }
    let steps: Vec<u64> = mine.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert!(steps.len() >= 6, "{steps:?}");
    assert!(
        steps.iter().enumerate().all(|(i, &s)| s == i as u64 + 1),
        "{steps:?}"
    );
    let report = study_report(&file, &dir);
    assert!(
        report.contains("## Arms started by the policy")
            && report.contains("from arm 1's checkpoint at rung 3"),
        "{report}"
    );
}

/// The researcher policy against SmolLM2 served in a swarm (a server, and a client's
/// proxy the researcher calls): every call it makes is checked against the study, and
/// counted; the study ends, and the journal and the report hold every call.
#[test]
fn a_researcher_on_smollm2_in_the_swarm_runs_a_study_with_valid_calls_only() {
    use common::peer::{metric, wait_until, Peer};
    let _lane = common::heavy();
    common::smollm2_path();
    let root = tempfile::tempdir().unwrap();
    let mut s = Peer::start(
        "llm-server",
        root.path(),
        &[
            "--role",
            "server",
            "--model",
            "smollm2",
            "--device",
            "cpu",
            "--no-train",
        ],
    );
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(300));
    let mut c = Peer::start(
        "llm-client",
        root.path(),
        &[
            "--role",
            "client",
            "--model",
            "smollm2",
            "--bootstrap",
            &boot,
        ],
    );
    let proxy = c.proxy_url(Duration::from_secs(120));
    wait_until("the server in the DHT", Duration::from_secs(60), || {
        metric(&proxy, "agentjet_swarm_providers{model=\"smollm2\"}") == Some(1.0)
    });
    let file = write_study(
        root.path(),
        "researcher",
        &format!(
            "[budget]\nsteps = 4\nat_once = 1\nminutes = 20\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [0, 3]\n\n\
             [researcher]\nendpoint = \"{proxy}\"\nmodel = \"smollm2\"\nmax_actions = 10\nmax_arms = 3\n\
             steps = [2, 4]\ncalls_per_turn = 3\n"
        ),
    );
    let dir = root.path().join("s");
    let d = start_driver(&file, &dir, "run");
    finish(d, &dir, "run", Duration::from_secs(1200));
    let j = journal(&dir);
    println!("{}", driver_out(&dir, "run"));
    let calls: Vec<&Value> = j.iter().filter(|r| kind(r) == "action").collect();
    let valid = calls.iter().filter(|r| r["valid"] == true).count();
    println!("researcher: {} call(s), {valid} valid", calls.len());
    assert!(!calls.is_empty(), "{j:#?}");
    assert!(calls.len() <= 10, "max_actions holds: {}", calls.len());
    for (i, r) in calls.iter().enumerate() {
        assert_eq!(r["n"], i as u64 + 1, "{r}");
        assert_eq!(r["valid"], true, "every call is valid: {r}");
        // Its reason (a note's text) is in the journal (an empty one is allowed: the
        // engine bounds a string's length from above only).
        let text = if r["tool"] == "write_note" {
            "text"
        } else {
            "reason"
        };
        assert!(r["args"][text].is_string(), "{r}");
    }
    // What it started ran: each new arm's record follows a start_run call.
    let starts = calls.iter().filter(|r| r["tool"] == "start_run").count();
    assert_eq!(starts, j.iter().filter(|r| kind(r) == "arm").count());
    let end = j.iter().find(|r| kind(r) == "end").expect("an end record");
    assert!(
        end["reason"].as_str().unwrap().contains("researcher"),
        "{end}"
    );
    let report = study_report(&file, &dir);
    println!("{report}");
    assert!(
        report.contains(&format!(
            "{} call(s), {valid} valid, 0 refused",
            calls.len()
        )),
        "{report}"
    );
    for r in &calls {
        assert!(
            report.contains(&format!("{}. `{}`", r["n"], r["tool"].as_str().unwrap())),
            "{report}"
        );
    }
}
