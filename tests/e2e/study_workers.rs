//! Studies whose arms run on a study worker of a swarm (`agentjet-peer study worker`),
//! a real worker process and a real driver on loopback: the arms run on the worker, the
//! driver reads them as its own, a driver killed with kill -9 has its running arm stopped
//! by the worker (at its target, or at the lease) and the resumed driver takes it up
//! there, and a worker refuses a driver it was not told of. (The lease alone, re-attach
//! and seeding on a worker: `study::worker`'s unit tests.)

use crate::common;
use crate::study::{
    assert_no_arm_ran_twice, driver_out, finish, first_training, journal, kind, outcome, running,
    start_driver, study_report, wait_journal, write_study, HALVING,
};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_agentjet-peer")
}

/// A new swarm key file.
pub(crate) fn swarm_key(root: &Path) -> PathBuf {
    let key = root.join("study.key");
    let out = Command::new(bin())
        .args(["swarm-key", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    key
}

/// The peer id of the driver of the study in `dir` (`agentjet-peer id`).
pub(crate) fn driver_id(dir: &Path) -> String {
    let out = Command::new(bin())
        .args(["id", "--data-dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn start_worker(root: &Path, key: &Path, allow: &str, lease: &str) -> common::peer::Peer {
    common::peer::Peer::start(
        "worker",
        root,
        &[
            "study",
            "worker",
            "--swarm-key",
            key.to_str().unwrap(),
            "--allow-driver",
            allow,
            "--slots",
            "2",
            "--lease-seconds",
            lease,
        ],
    )
}

fn workers_table(key: &Path, addr: &str, wait: u32) -> String {
    format!(
        "[workers]\nswarm_key = \"{}\"\nbootstrap = [\"{addr}\"]\nlocal = 0\nlisten = \"/ip4/127.0.0.1/udp/0/quic-v1\"\nwait_seconds = {wait}\n",
        key.display()
    )
}

/// The worker's directory of the one study it ran.
fn worker_study(root: &Path) -> PathBuf {
    let studies = root.join("worker/studies");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&studies)
        .unwrap_or_else(|e| panic!("{}: {e}", studies.display()))
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.pop().unwrap()
}

fn steps_of(metrics: &Path) -> Vec<u64> {
    crate::client::metrics_lines(metrics)
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect()
}

/// A study in `root/s` whose arms run on a worker process (lease `lease` seconds) that
/// allows its driver: (the study file, its directory, the worker, the worker's peer id).
fn on_a_worker(
    root: &Path,
    policy: &str,
    study: &str,
    lease: &str,
) -> (PathBuf, PathBuf, common::peer::Peer, String) {
    let key = swarm_key(root);
    let dir = root.join("s");
    let me = driver_id(&dir);
    let mut worker = start_worker(root, &key, &me, lease);
    let worker_id = worker.peer_id();
    let addr = worker.addr();
    let file = write_study(
        root,
        policy,
        &format!("{study}\n\n{}", workers_table(&key, &addr, 30)),
    );
    (file, dir, worker, worker_id)
}

#[test]
fn arms_run_on_a_study_worker_and_a_killed_driver_resumes_them_there() {
    // Two training servers and two clients at once, on the worker.
    let _lane = common::heavy();
    let root = tempfile::tempdir().unwrap();
    let (file, dir, mut worker, worker_id) = on_a_worker(
        root.path(),
        "asha",
        &format!("{HALVING}\n[base.env]\nAGENT_SLEEP = \"0.5\""),
        "10",
    );
    let me = driver_id(&dir);

    let mut d = start_driver(&file, &dir, "run");
    wait_journal(
        &dir,
        "a reached rung with an arm running",
        Duration::from_secs(300),
        |j| j.iter().any(|r| kind(r) == "reached") && !running(j).is_empty(),
    );
    d.0.kill().unwrap();
    d.0.wait().unwrap();
    // The worker stops the killed driver's arm at its target, or once its lease (10 s)
    // runs out (whichever comes first): its server drains and saves its checkpoint. (The
    // lease alone: `study::worker::tests`.)
    let ws = worker_study(root.path());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !(0..4).any(|a| {
        std::fs::read_to_string(ws.join(format!("arms/{a:03}/driver.log")))
            .unwrap_or_default()
            .lines()
            .any(|l| {
                l.ends_with("stopping: its driver said nothing for 10 s (the lease)")
                    || l.ends_with("stopping: it reached its target")
            })
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's lease stopped no arm within 60 s\ndriver:\n{}\njournal: {:#?}\nworker:\n{}\n{}",
            driver_out(&dir, "run"),
            journal(&dir),
            worker.stdout(),
            worker.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    finish(
        start_driver(&file, &dir, "run"),
        &dir,
        "run",
        Duration::from_secs(400),
    );
    let j = journal(&dir);
    let out = driver_out(&dir, "run");
    println!("{out}");
    assert!(
        out.contains(&format!("the study's driver is peer {me}")),
        "{out}"
    );
    // The same arms, decisions and winner as the uninterrupted run on the driver's own
    // machine (study::a_study_killed_twice_mid_way...).
    let (decisions, winner) = outcome(&j);
    assert_eq!(winner, Some(1), "{j:#?}");
    let go: Vec<u64> = decisions
        .iter()
        .filter(|d| d.1 == "continue")
        .map(|d| d.0)
        .collect();
    assert_eq!(go, vec![1, 3], "{decisions:?}");
    assert_no_arm_ran_twice(&j);
    assert_eq!(j.iter().filter(|r| kind(r) == "resumed").count(), 1);
    // Every launch ran on the worker, and the arm the killed driver left running was
    // picked up there.
    let launches: Vec<&Value> = j.iter().filter(|r| kind(r) == "launch").collect();
    assert!(launches.len() >= 6, "{launches:#?}");
    for l in &launches {
        assert_eq!(l["host"].as_str(), Some(worker_id.as_str()), "{l}");
    }
    assert!(
        out.contains("was running when the last driver stopped"),
        "{out}"
    );
    for arm in 0..4u64 {
        // The worker's own files: steps 1, 2, ... with none taken twice, and the arms
        // relaunched to the last rung resumed from their checkpoints.
        let theirs = ws.join(format!("arms/{arm:03}/server/runs/tiny/metrics.jsonl"));
        let steps = steps_of(&theirs);
        assert!(!steps.is_empty(), "arm {arm} took no step on the worker");
        assert!(
            steps.iter().enumerate().all(|(i, &s)| s == i as u64 + 1),
            "arm {arm}: steps {steps:?}"
        );
        // The driver's mirror of them, what it scored the arm by.
        let mirror = dir.join(format!("arms/{arm:03}/server/runs/tiny/metrics.jsonl"));
        assert_eq!(
            std::fs::read_to_string(&mirror).unwrap(),
            std::fs::read_to_string(&theirs).unwrap(),
            "arm {arm}: the mirror is the worker's file"
        );
        assert!(
            !dir.join(format!("arms/{arm:03}/server.log")).exists(),
            "arm {arm} ran a process on the driver's machine"
        );
    }
    let last_rung: std::collections::BTreeSet<u64> = j
        .iter()
        .filter(|r| kind(r) == "launch" && r["steps"] == 6)
        .filter_map(|r| r["arm"].as_u64())
        .collect();
    for arm in last_rung {
        let training = first_training(&ws.join(format!("arms/{arm:03}/server.events.jsonl")));
        assert_eq!(training["resumed"], true, "arm {arm}: {training}");
    }
    let report = study_report(&file, &dir);
    assert!(report.contains("**Winner: arm 1 (bias=3)**"), "{report}");
    assert!(
        report.contains(&format!("on worker {worker_id}")),
        "the winner's checkpoint is named on its worker:\n{report}"
    );
    let tail: String = worker_id.chars().skip(worker_id.len() - 8).collect();
    assert!(report.contains(&format!("(worker …{tail})")), "{report}");
}

#[test]
fn a_worker_refuses_a_driver_it_was_not_told_of() {
    let _lane = common::light();
    let root = tempfile::tempdir().unwrap();
    let key = swarm_key(root.path());
    // The worker allows another driver.
    let other = driver_id(&root.path().join("other"));
    let mut worker = start_worker(root.path(), &key, &other, "30");
    let addr = worker.addr();
    let file = write_study(
        root.path(),
        "grid",
        &format!(
            "[budget]\nsteps = 2\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [1]\n\n{}",
            workers_table(&key, &addr, 10)
        ),
    );
    let dir = root.path().join("s");
    let out = Command::new(bin())
        .args(["study", "run"])
        .arg(&file)
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("no study worker takes this driver"), "{text}");
    assert!(
        text.contains("is not a driver this worker allows"),
        "{text}"
    );
    assert!(
        !journal(&dir).iter().any(|r| kind(r) == "launch"),
        "nothing launched"
    );
    assert!(
        worker.log_text().contains("not an allowed driver"),
        "{}",
        worker.log_text()
    );
}

#[test]
fn pbt_on_a_worker_copies_the_best_arms_checkpoint_there() {
    let _lane = common::light();
    let root = tempfile::tempdir().unwrap();
    let (file, dir, _worker, worker_id) = on_a_worker(
        root.path(),
        "pbt",
        "[budget]\nsteps = 6\nat_once = 2\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [0, 3, 1, 2]\n\n\
         [pbt]\ninterval = 3\nquantile = 0.25\nexplore = [\"bias\"]\nresample = 0.0",
        "30",
    );
    finish(
        start_driver(&file, &dir, "run"),
        &dir,
        "run",
        Duration::from_secs(400),
    );
    let j = journal(&dir);
    println!("{}", driver_out(&dir, "run"));
    assert_no_arm_ran_twice(&j);
    let born: Vec<&Value> = j.iter().filter(|r| kind(r) == "arm").collect();
    assert_eq!(born.len(), 1, "{j:#?}");
    assert_eq!(born[0]["arm"]["id"], 4);
    assert_eq!(born[0]["from"]["arm"], 1, "{}", born[0]);
    assert_eq!(outcome(&j).1, Some(1), "bias 3 ranks first");
    for l in j.iter().filter(|r| kind(r) == "launch") {
        assert_eq!(l["host"].as_str(), Some(worker_id.as_str()), "{l}");
    }
    // The copy was made on the worker, where the parent ran: the new arm's server
    // resumed from the parent's checkpoint, its metrics begin with the parent's, and the
    // driver's mirror is the worker's file.
    let ws = worker_study(root.path());
    let training = first_training(&ws.join("arms/004/server.events.jsonl"));
    assert_eq!(training["resumed"], true, "{training}");
    assert!(training["step"].as_u64().unwrap() >= 3, "{training}");
    let child = ws.join("arms/004/server/runs/tiny/metrics.jsonl");
    let parent = ws.join("arms/001/server/runs/tiny/metrics.jsonl");
    let first = |p: &Path| {
        crate::client::metrics_lines(p)
            .first()
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(first(&child), first(&parent));
    assert!(steps_of(&child).len() >= 6, "{:?}", steps_of(&child));
    assert_eq!(
        std::fs::read_to_string(dir.join("arms/004/server/runs/tiny/metrics.jsonl")).unwrap(),
        std::fs::read_to_string(&child).unwrap()
    );
}
