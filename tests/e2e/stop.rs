//! Stopping, as a user sees it: SIGTERM in the middle of a training step and of a streamed
//! request drains the server (the stream ends cleanly, the step finishes, the checkpoint
//! is written, exit 0 within the drain timeout), and the roles run in-process as a library
//! (peer id and addresses from the handle, a call through the client's proxy, a stop that
//! releases the ports).

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentjet::base::{Stop, StopMode};
use agentjet::server::ServerEvent;
use agentjet::swarm::{Keypair, PeerId, Role, SwarmConfig};
use common::peer::{http, Peer};
use serde_json::{json, Value};

/// A tiny random model big enough that a training step on two long episodes takes
/// seconds on a CPU (so a signal can land in the middle of it).
fn slow_model(dir: &Path) -> PathBuf {
    common::Tiny {
        hidden: 256,
        inter: 768,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        max_pos: 4096,
        ..Default::default()
    }
    .write_hf_dir(&dir.join("slow-model"))
}

/// Starts a streamed chat completion of exactly `tokens` tokens (end-of-sequence banned)
/// on a thread; returns when the first chunk arrived. The thread yields the whole body
/// and when its `[DONE]` came.
fn start_stream(base: &str, tokens: usize) -> std::thread::JoinHandle<(String, Option<Instant>)> {
    let hostport = base
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string();
    let body = json!({
        "model": "tiny", "stream": true, "max_tokens": tokens, "temperature": 1.0,
        "logit_bias": {"2": -100},
        "messages": [{"role": "user", "content": "hello"}],
    })
    .to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&hostport).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut r = BufReader::new(s);
        let mut all = String::new();
        let mut done = None;
        let mut line = String::new();
        let mut first = true;
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            if first && line.starts_with("data: ") {
                first = false;
                let _ = tx.send(());
            }
            if line.starts_with("data: [DONE]") {
                done = Some(Instant::now());
            }
            all.push_str(&line);
            line.clear();
        }
        (all, done)
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the stream did not start");
    h
}

#[test]
fn sigterm_mid_step_and_mid_stream_drains_checkpoints_and_exits_0() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let mut s = Peer::start(
        "tiny",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            model.to_str().unwrap(),
            "--served-model-name",
            "tiny",
            "--device",
            "cpu",
            "--http",
            "127.0.0.1:0",
            "--groups-per-step",
            "1",
            "--num-repeat",
            "2",
            "--max-batch",
            "4",
            "--max-kv-positions",
            "16384",
            "--drain-timeout",
            "120",
        ],
    );
    let boot = s.addr();
    let server: PeerId = s.peer_id().parse().unwrap();
    let base = format!("http://{}", s.http_url(Duration::from_secs(120)));
    s.wait_serving(Duration::from_secs(120));

    // Two long signed calls of one group, rewards 1 and 0: the group trains at once.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let calls = rt.block_on(async {
        let mut cfg = SwarmConfig::new(Role::Client, Keypair::generate_ed25519());
        cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
        cfg.bootstrap = vec![boot.parse().unwrap()];
        let h = agentjet::swarm::spawn_node(cfg).await.unwrap();
        let mut calls = Vec::new();
        for seed in 0..2 {
            let prompt = (10..40).map(|t| t + seed as u32).collect();
            let c = common::peer::signed_call(&h, server, prompt, 1500, seed)
                .await
                .unwrap();
            calls.push(c);
        }
        (h, calls)
    });
    let (h, calls) = calls;
    let stream = start_stream(&base, 2500);
    rt.block_on(async {
        use agentjet::client::submit::{prepare, submit};
        for (i, c) in calls.into_iter().enumerate() {
            let mut e = agentjet::timeline::Episode::single_call(
                format!("ep{i}"),
                "t".into(),
                "g".into(),
                c,
                i as f64,
            );
            e.reward = Some(if i == 0 { 1.0 } else { 0.0 });
            let (m, frags) = prepare(&e, "tiny", 2).unwrap();
            let out = submit(&h, server, &m, &frags).await.unwrap();
            assert!(
                matches!(out.reply, agentjet::rpc::SubmitReply::Stored { .. }),
                "{:?}",
                out.reply
            );
        }
    });
    // The step has started: SIGTERM now, while it runs and while the stream streams.
    s.wait_event("the training step to start", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::StepStarted { .. })
    });
    let signalled = Instant::now();
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = s.child.wait().unwrap();
    let took = signalled.elapsed();
    assert!(status.success(), "exit {status:?}; log:\n{}", s.log_text());
    assert!(took < Duration::from_secs(120), "the drain took {took:?}");
    let out = s.stdout();
    println!("{out}\n(stopped {:.1} s after SIGTERM)", took.as_secs_f64());

    // The step was in progress when the stop came, and it finished and was saved.
    let events = s.events();
    let at = |f: &dyn Fn(&ServerEvent) -> bool| events.iter().position(f);
    let stopping = at(&|e| matches!(e, ServerEvent::Stopping { drain: true }))
        .unwrap_or_else(|| panic!("no drain: {events:#?}"));
    let stepped = at(&|e| matches!(e, ServerEvent::TrainStep { step: 1, .. }))
        .unwrap_or_else(|| panic!("the step did not finish: {events:#?}"));
    let saved = at(&|e| {
        matches!(
            e,
            ServerEvent::CheckpointSaved {
                step: 1,
                on_stop: true
            }
        )
    });
    assert!(
        stopping < stepped,
        "the step ended before the signal: {events:#?}"
    );
    assert!(saved > Some(stepped), "no checkpoint on stop: {events:#?}");
    assert_eq!(events.last(), Some(&ServerEvent::Stopped), "{events:#?}");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tiny/runs/tiny/checkpoint/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["step"], 1, "{state}");

    // The stream was still running at the signal, and ended cleanly with every token.
    let (body, done) = stream.join().unwrap();
    let done = done.expect("the stream ended without [DONE]");
    assert!(done > signalled, "the stream had ended before the signal");
    let chunks: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("length")], "{body}");
    let last_event = body.lines().rfind(|l| l.starts_with("data: "));
    assert_eq!(last_event, Some("data: [DONE]"), "{body}");
    drop(h);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_run_in_process_and_a_stop_releases_them() {
    let _lane = tokio::task::block_in_place(common::light);
    let dir = tempfile::tempdir().unwrap();
    let model = common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&dir.path().join("tiny-model"));
    let stop = Stop::new();
    let swarm = |role| {
        let mut cfg = SwarmConfig::new(role, Keypair::generate_ed25519());
        cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
        cfg.status_interval = Duration::from_millis(500);
        cfg.provider_ttl = Duration::from_secs(4);
        cfg
    };
    let server = agentjet::server::run(
        agentjet::server::ServerConfig {
            swarm: swarm(Role::Server),
            data_dir: dir.path().join("server"),
            model: model.to_str().unwrap().into(),
            served_model_name: Some("tiny".into()),
            device: "cpu".into(),
            dtype: None,
            engine: Default::default(),
            http: None,
            dashboard: None,
            config_json: None,
            train: Some(Default::default()),
            limits: Default::default(),
            drain_timeout: Duration::from_secs(30),
            events_file: None,
            renew: None,
            adapters: Vec::new(),
            follow: None,
            broadcast: Default::default(),
        },
        &stop,
    )
    .await
    .unwrap();
    assert_eq!(server.model, "tiny");
    let addr = server.listen_addrs[0].clone();
    assert!(
        addr.to_string().ends_with(&server.peer_id.to_string()),
        "{addr}"
    );
    let mut ccfg = swarm(Role::Client);
    ccfg.bootstrap = vec![addr.clone()];
    let client = agentjet::client::run(
        agentjet::client::ClientConfig {
            swarm: ccfg,
            data_dir: dir.path().join("client"),
            models: vec!["tiny".into()],
            wait: Duration::from_secs(60),
            proxy_port: 0,
            external: Vec::new(),
            job: None,
            drain_timeout: Duration::from_secs(30),
            dashboard: None,
            config_json: None,
            events_file: None,
        },
        &stop,
    )
    .await
    .unwrap();
    assert_ne!(client.peer_id, server.peer_id);
    let url = client.proxy_url.clone();
    let (status, body) = tokio::task::spawn_blocking(move || {
        http(
            &url,
            "POST",
            "/v1/chat/completions",
            Some(&json!({"model": "tiny", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]})),
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");

    // One stop for both; each winds down and returns.
    stop.request(StopMode::Drain);
    let t0 = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), client.finish())
        .await
        .expect("the client did not stop")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), server.finish())
        .await
        .expect("the server did not stop")
        .unwrap();
    println!("both stopped in {:.2} s", t0.elapsed().as_secs_f64());
    // The server's QUIC port is free again: its node really ended.
    let port: u16 = addr
        .iter()
        .find_map(|p| match p {
            agentjet::swarm::Protocol::Udp(p) => Some(p),
            _ => None,
        })
        .unwrap();
    // The QUIC endpoint lets its connections close first (at most the idle timeout).
    let t0 = Instant::now();
    while std::net::UdpSocket::bind(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the server's port {port} is still bound"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swarm_node_ends_when_its_last_handle_is_dropped() {
    let _lane = tokio::task::block_in_place(common::light);
    let mut cfg = SwarmConfig::new(Role::Plain, Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
    let h = agentjet::swarm::spawn_node(cfg).await.unwrap();
    let addr = h.listen_addrs().await.remove(0);
    let ended = h.ended();
    let h2 = h.clone();
    drop(h);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!ended.is_cancelled(), "a handle is still held");
    drop(h2);
    tokio::time::timeout(Duration::from_secs(10), ended.cancelled())
        .await
        .expect("the event loop did not end when its last handle was dropped");
    let port = addr
        .iter()
        .find_map(|p| match p {
            agentjet::swarm::Protocol::Udp(p) => Some(p),
            _ => None,
        })
        .unwrap();
    // Its listener is gone (the Swarm was dropped): the port binds again.
    let mut bound = false;
    for _ in 0..20 {
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            bound = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(bound, "port {port} is still bound");
}

/// A command run as a user runs it, with its stdout lines collected.
fn spawn_peer(args: &[&str]) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    (child, rx)
}

fn line_starting(rx: &std::sync::mpsc::Receiver<String>, prefix: &str) -> String {
    loop {
        let l = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no line {prefix:?}"));
        if let Some(rest) = l.strip_prefix(prefix) {
            return rest.to_string();
        }
    }
}

#[test]
fn serve_drains_a_stream_on_sigterm_and_generate_stops_its_answer() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let model = model.to_str().unwrap();
    let (mut serve, lines) = spawn_peer(&[
        "serve",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--port",
        "0",
        "--max-batch",
        "2",
        "--max-kv-positions",
        "8192",
    ]);
    let at = line_starting(&lines, "serving tiny at ");
    let base = at
        .split_whitespace()
        .next()
        .unwrap()
        .trim_end_matches("/v1");
    let stream = start_stream(base, 1500);
    let signalled = Instant::now();
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    let status = serve.wait().unwrap();
    assert!(status.success(), "serve exited {status:?}");
    let (body, done) = stream.join().unwrap();
    assert!(done.expect("no [DONE]") > signalled);
    // The last chunk of the choice: finish reason "length" with all 1500 token ids.
    let last: Value = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| l.contains("\"finish_reason\":\"length\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .next()
        .expect("no finish chunk");
    let ids = last["choices"][0]["token_ids"].as_array().map(Vec::len);
    assert_eq!(ids, Some(1500), "the stream was cut short: {last}");

    // generate: a stop ends the answer where it is (once it has begun), reports, exits 0.
    let mut gen = std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args([
            "generate", "--model", model, "--device", "cpu", "--prompt", "hello",
        ])
        .args(["--max-tokens", "3500"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(gen.stdout.as_mut().unwrap(), &mut first).unwrap();
    unsafe { libc::kill(gen.id() as i32, libc::SIGINT) };
    let out = gen.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("finish: Cancelled"), "{stderr}");
}
