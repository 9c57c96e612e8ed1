//! `cargo bench --bench nat [-- FLAGS]`: the swarm across networks, on hosts in network
//! namespaces this bench makes (the test harness's `common::netns`: a switch for the
//! internet, public hosts, home hosts behind cone or symmetric NAT routers; documentation
//! addresses only). Needs root, iproute2 and iptables (README command 2 installs them).
//!
//! For each topology, two servers of one model (a random Llama of `--hidden` x `--layers`,
//! its gradient `--hidden`-sized, some 17 MB of float32 by default) train as one group
//! with the README's keys and their default listen addresses, and a client on a public
//! host runs a short agent against them:
//!
//! 1. `public`: both servers on public hosts; the ring link is a direct TCP connection.
//! 2. `public-swarm`: the same hosts, the ring link a stream over the swarm's direct
//!    connection (`--group-links swarm`): what a stream costs against raw TCP.
//! 3. `public-cone`: one public server, one behind a cone NAT.
//! 4. `cone-cone`: both behind cone NATs, a public `--role peer` bootstrap: they meet
//!    through its relay and punch a hole (DCUtR).
//! 5. `cone-symmetric`: one behind a cone NAT, one behind a symmetric NAT: no hole can be
//!    punched, the link runs through the bootstrap's relay.
//!
//! Each prints the time from the servers' start to the group's first epoch of two members
//! and to its first step (the client starts once the epoch stands; the bench sees each
//! event, polling every 100 ms), how the two servers ended up connected, and the gradient
//! all-reduce's median time and bus bandwidth over the steps of two members.
//! Then `--punches` attempts (20) of topology 4 with fresh peers each: hole punches that
//! succeeded.
//!
//! `RESULT` lines: the all-reduce bandwidth over each link against the direct TCP link
//! (the peer: raw TCP between two public hosts, what every link was before), and the
//! hole punches (the peer: the in-the-wild DCUtR success rate of 70% measured over 4.4M
//! attempts, arXiv 2510.27500: not this machine's figure, printed for scale).
//!
//! Flags: `--only NAME[,NAME]`, `--hidden N` [512], `--layers N` [4], `--groups N` [24],
//! `--punches N` [20] (0: none), `--keep` (the peers' files and logs stay).

#[path = "../tests/common/mod.rs"]
mod common;
mod flags;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentjet::server::ServerEvent;
use agentjet::swarm::NetEvent;
use common::netns::{Host, Nat, Net};
use common::peer::Peer;

/// The agent: one chat call of 8 tokens; reward 1 when the reply's length is even.
const AGENT: &str = r#"#!/bin/sh
set -eu
sleep 0.3
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "bench", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

struct Setup {
    dir: PathBuf,
    model: PathBuf,
    /// Float32 values the group all-reduces each step.
    values: u64,
    groups: usize,
}

fn server(s: &Setup, host: &Host, name: &str, boot: Option<&str>, extra: &[&str]) -> Peer {
    let key = common::run_key(&s.dir).0;
    let mut args = vec![
        "--role",
        "server",
        "--model",
        s.model.to_str().unwrap(),
        "--served-model-name",
        "bench",
        "--device",
        "cpu",
        "--learning-rate",
        "1e-4",
        "--groups-per-step",
        "1",
        "--group-timeout",
        "5",
        "--collective-timeout",
        "30",
        "--run-key",
        &key,
    ];
    if let Some(b) = boot {
        args.extend(["--bootstrap", b]);
    }
    args.extend(extra);
    Peer::start_on(&host.ns, name, &s.dir, &args)
}

fn client(s: &Setup, host: &Host, boot: &str, run: &str) -> Peer {
    let agent = s.dir.join("agent.sh");
    std::fs::write(&agent, AGENT).unwrap();
    let tasks = s.dir.join("tasks.jsonl");
    let lines: Vec<String> = (0..12)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n").unwrap();
    let run_id = common::run_key(&s.dir).1;
    let (agent_cmd, groups) = (format!("sh {}", agent.display()), s.groups.to_string());
    let run_dir = s.dir.join(run);
    Peer::start_on(
        &host.ns,
        run,
        &s.dir,
        &[
            "--role",
            "client",
            "--model",
            "bench",
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
        ],
    )
}

fn metrics(dir: &Path, name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join(name).join("runs/bench/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// What one topology measured.
struct Measured {
    epoch_s: f64,
    first_step_s: f64,
    links: String,
    allreduce_s: f64,
    gbps: f64,
    steps: usize,
}

/// The hosts of topology `name`: (servers' hosts, the bootstrap `--role peer` host if
/// any, the client's host), and the servers' extra flags.
fn topology(net: &mut Net, name: &str) -> (Vec<Host>, Option<Host>, Host, Vec<&'static str>) {
    let c = net.public("client");
    match name {
        "public" => (vec![net.public("a"), net.public("b")], None, c, vec![]),
        "public-swarm" => (
            vec![net.public("a"), net.public("b")],
            None,
            c,
            vec!["--group-links", "swarm"],
        ),
        "public-cone" => (
            vec![net.public("a"), net.home("b", Nat::Cone)],
            None,
            c,
            vec![],
        ),
        "cone-cone" => (
            vec![net.home("a", Nat::Cone), net.home("b", Nat::Cone)],
            Some(net.public("boot")),
            c,
            vec![],
        ),
        "cone-symmetric" => (
            vec![net.home("a", Nat::Cone), net.home("b", Nat::Symmetric)],
            Some(net.public("boot")),
            c,
            vec![],
        ),
        other => panic!("no topology {other}"),
    }
}

fn measure(s: &Setup, name: &str) -> Measured {
    let mut net = Net::new();
    let (servers, boot_host, client_host, extra) = topology(&mut net, name);
    if let Some(h) = &boot_host {
        net.name("boot.agentjet.test", h.ip);
    }
    let _ = std::fs::remove_dir_all(s.dir.join("a"));
    let _ = std::fs::remove_dir_all(s.dir.join("b"));
    let t0 = Instant::now();
    let mut boot_peer = boot_host
        .as_ref()
        .map(|h| Peer::start_on(&h.ns, "boot", &s.dir, &["--role", "peer"]));
    let boot = match &mut boot_peer {
        Some(p) => format!(
            "/dns4/boot.agentjet.test/udp/4001/quic-v1/p2p/{}",
            p.peer_id()
        ),
        None => String::new(),
    };
    let mut a = server(
        s,
        &servers[0],
        "a",
        (!boot.is_empty()).then_some(boot.as_str()),
        &extra,
    );
    let boot = if boot.is_empty() { a.addr() } else { boot };
    let mut b = server(s, &servers[1], "b", Some(&boot), &extra);
    let (ida, idb) = (a.peer_id(), b.peer_id());
    a.wait_event("an epoch of two", Duration::from_secs(300), |e| {
        matches!(e, ServerEvent::Formed { members: 2, .. })
    });
    let epoch_s = t0.elapsed().as_secs_f64();
    // The client starts once the group stands, so its episodes make steps of two.
    let mut cl = client(s, &client_host, &boot, "run");
    a.wait_event("the first step of two", Duration::from_secs(300), |e| {
        matches!(
            e,
            ServerEvent::TrainStep {
                members: 2,
                trained: true,
                ..
            }
        )
    });
    let first_step_s = t0.elapsed().as_secs_f64();
    let st = cl.child.wait().unwrap();
    assert!(st.success(), "client: {}", cl.log_text());
    std::thread::sleep(Duration::from_secs(2));
    let ar: Vec<f64> = metrics(&s.dir, "a")
        .iter()
        .filter(|l| l["trained"] == true && l["members"] == 2)
        .filter_map(|l| l["allreduce_seconds"].as_f64())
        .filter(|t| *t > 0.0)
        .collect();
    let steps = ar.len();
    let allreduce_s = median(ar);
    // Bus bandwidth of a ring of two: each member sends (and receives) the whole
    // gradient once.
    let gbps = s.values as f64 * 4.0 / allreduce_s / 1e9;
    let la = a.links_to(&idb);
    let lb = b.links_to(&ida);
    let links = format!("a->b {la:?}, b->a {lb:?}");
    for p in [&mut a, &mut b] {
        p.kill9();
    }
    drop(boot_peer);
    Measured {
        epoch_s,
        first_step_s,
        links,
        allreduce_s,
        gbps,
        steps,
    }
}

/// One hole punch attempt with fresh peers (topology `cone-cone`, no client): whether
/// the two servers ended up hole-punched, and the time from their start to it.
fn punch(s: &Setup) -> (bool, f64, String) {
    let mut net = Net::new();
    let (servers, boot_host, _, _) = topology(&mut net, "cone-cone");
    let bh = boot_host.unwrap();
    net.name("boot.agentjet.test", bh.ip);
    for n in ["a", "b", "boot"] {
        let _ = std::fs::remove_dir_all(s.dir.join(n));
    }
    let mut boot_peer = Peer::start_on(&bh.ns, "boot", &s.dir, &["--role", "peer"]);
    let boot = format!(
        "/dns4/boot.agentjet.test/udp/4001/quic-v1/p2p/{}",
        boot_peer.peer_id()
    );
    let t0 = Instant::now();
    let mut a = server(s, &servers[0], "a", Some(&boot), &[]);
    let mut b = server(s, &servers[1], "b", Some(&boot), &[]);
    let idb = b.peer_id();
    let _ = a.peer_id();
    let deadline = Instant::now() + Duration::from_secs(90);
    let outcome = loop {
        let ev: Vec<NetEvent> = a
            .net_events()
            .into_iter()
            .chain(b.net_events())
            .filter(|e| matches!(e, NetEvent::HolePunch { .. }))
            .collect();
        if let Some(NetEvent::HolePunch { ok, error, .. }) = ev
            .iter()
            .find(|e| matches!(e, NetEvent::HolePunch { ok: true, .. }))
        {
            break (*ok, error.clone().unwrap_or_default());
        }
        if Instant::now() > deadline {
            let why = ev
                .iter()
                .filter_map(|e| match e {
                    NetEvent::HolePunch { error, .. } => error.clone(),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("; ");
            break (
                false,
                format!(
                    "no hole punched within 90 s: {why}; links {:?}",
                    a.links_to(&idb)
                ),
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let t = t0.elapsed().as_secs_f64();
    for p in [&mut a, &mut b, &mut boot_peer] {
        p.kill9();
    }
    (outcome.0, t, outcome.1)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let only: Option<Vec<String>> =
        flags::flag(&args, "--only").map(|s| s.split(',').map(String::from).collect());
    let hidden: i64 = flags::parse(&args, "--hidden", 512)?;
    let layers: i64 = flags::parse(&args, "--layers", 4)?;
    let groups: usize = flags::parse(&args, "--groups", 24)?;
    let punches: usize = flags::parse(&args, "--punches", 20)?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().to_path_buf();
    // `--keep`: the peers' directories and logs stay (their path is printed).
    let _tmp = if args.iter().any(|a| a == "--keep") {
        println!("peers' files in {}", dir.display());
        let _ = tmp.keep();
        None
    } else {
        Some(tmp)
    };
    let tiny = common::Tiny {
        hidden,
        inter: hidden * 4,
        layers,
        heads: 8,
        kv_heads: 8,
        max_pos: 1024,
        ..Default::default()
    };
    let model = tiny.write_hf_dir(&dir.join("model"));
    let weights: u64 = std::fs::read_dir(&model)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let s = Setup {
        dir,
        model,
        values: weights / 4,
        groups,
    };
    println!(
        "model: hidden {hidden}, {layers} layers: {} float32 values ({:.1} MB all-reduced per step)",
        s.values,
        s.values as f64 * 4.0 / 1e6
    );
    let names = [
        "public",
        "public-swarm",
        "public-cone",
        "cone-cone",
        "cone-symmetric",
    ];
    let mut rows: Vec<(&str, Measured)> = Vec::new();
    for n in names {
        if only.as_ref().is_some_and(|o| !o.iter().any(|x| x == n)) {
            continue;
        }
        let m = measure(&s, n);
        println!(
            "{n:<15} epoch of two {:>6.1} s  first step {:>6.1} s  all-reduce median {:>7.1} ms ({:.3} GB/s bus, {} steps)  {}",
            m.epoch_s,
            m.first_step_s,
            m.allreduce_s * 1e3,
            m.gbps,
            m.steps,
            m.links
        );
        rows.push((n, m));
    }
    println!();
    println!("| topology | start to the group's first epoch of two (s) | start to its first step (s) | connection between the servers | all-reduce median (ms) | bus GB/s | steps |");
    println!("|---|---|---|---|---|---|---|");
    for (n, m) in &rows {
        println!(
            "| {n} | {:.1} | {:.1} | {} | {:.1} | {:.3} | {} |",
            m.epoch_s,
            m.first_step_s,
            m.links,
            m.allreduce_s * 1e3,
            m.gbps,
            m.steps
        );
    }
    let direct = rows.iter().find(|(n, _)| *n == "public").map(|r| r.1.gbps);
    let mut punched = 0;
    if punches > 0 && only.as_ref().is_none_or(|o| o.iter().any(|x| x == "punch")) {
        println!();
        for i in 0..punches {
            let (ok, t, why) = punch(&s);
            punched += usize::from(ok);
            println!(
                "hole punch {}: {} after {t:.1} s {why}",
                i + 1,
                if ok { "direct" } else { "FAILED" }
            );
        }
        println!("hole punches between two cone NATs: {punched} of {punches}");
    }
    println!();
    for (n, m) in &rows {
        if let Some(d) = direct.filter(|_| *n != "public") {
            println!(
                "RESULT nat allreduce_gbps_{} ours={:.3} peer={d:.3} ratio={:.3}",
                n.replace('-', "_"),
                m.gbps,
                m.gbps / d
            );
        }
        println!(
            "RESULT nat first_epoch_s_{} ours={:.1}",
            n.replace('-', "_"),
            m.epoch_s
        );
    }
    if punches > 0 {
        let rate = punched as f64 / punches as f64;
        println!(
            "RESULT nat hole_punch_success ours={rate:.2} peer=0.70 ratio={:.2}",
            rate / 0.70
        );
    }
    Ok(())
}
