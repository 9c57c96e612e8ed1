//! The dashboard and `/metrics`, with real processes on 127.0.0.1: a server of a tiny
//! random model (training on) and a client running a shell agent, both serving their
//! dashboards. The page is opened in real headless Chromium (installed by the README's
//! test command from Debian's packages when missing) once a training step is done, and
//! the rendered page must show the peers, the model's policy version and a curve with a
//! point; a screenshot is saved in the server's run directory. Both peers' `/metrics`
//! parse as Prometheus text and their counters move; bad input gets a 4xx and the peers
//! keep serving; the run directories hold the effective config and a plot per curve.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use agentjet::client::ClientEvent;
use agentjet::server::ServerEvent;
use common::peer::{http, wait_until, Peer};
use serde_json::Value;

const AGENT: &str = r#"#!/bin/sh
set -eu
reply=$(curl -sS --fail-with-body "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "tiny", "max_tokens": 8, "temperature": 1.0, "messages": [{"role": "user", "content": "hello"}]}')
content=$(printf '%s' "$reply" | jq -r '.choices[0].message.content')
echo "reply: $content"
if [ $(( ${#content} % 2 )) -eq 0 ]; then echo '{"reward": 1.0}'; else echo '{"reward": 0.0}'; fi
"#;

/// Chromium from `AGENTJET_CHROMIUM` or the PATH; the README's test command installs it.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("AGENTJET_CHROMIUM") {
        return PathBuf::from(p);
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
        {
            let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if out.status.success() && !p.is_empty() {
                return PathBuf::from(p);
            }
        }
    }
    panic!(
        "no Chromium found (set AGENTJET_CHROMIUM or install Debian's `chromium`; \
         bootstrap/test.sh installs it when missing)"
    );
}

/// Chromium's common headless flags, with a profile directory of the test's own.
fn headless(profile: &Path) -> Command {
    let mut c = Command::new(chromium());
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

/// The page at `url` as Chromium rendered it once loaded: its script renders the state of
/// `/boot.js` before the load event (the event stream, opened after it, keeps a request
/// open, so Chromium's `--virtual-time-budget` would wait for it forever).
fn rendered_dom(url: &str, profile: &Path) -> String {
    let out = headless(profile)
        .args(["--dump-dom", url])
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium --dump-dom failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every sample line of a `/metrics` page, parsed by a Prometheus text parser; fails if
/// the parser left any line out.
fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("Prometheus text");
    let sample_lines = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .count();
    assert_eq!(
        scrape.samples.len(),
        sample_lines,
        "the parser left lines out of:\n{text}"
    );
    for l in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = l.split_whitespace().nth(2).unwrap();
        assert_eq!(
            text.matches(&format!("# TYPE {name} ")).count(),
            1,
            "family {name} declared twice"
        );
    }
    scrape
}

/// The value of the sample `name` whose labels include `labels`.
fn sample(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    s.samples
        .iter()
        .find(|x| {
            x.metric == name
                && labels
                    .iter()
                    .all(|(k, v)| x.labels.get(k).map(|l| l == *v).unwrap_or(false))
        })
        .map(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
}

fn scrape(base: &str) -> prometheus_parse::Scrape {
    let (status, body) = http(base, "GET", "/metrics", None);
    assert_eq!(status, 200, "{body}");
    parse_metrics(&body)
}

fn status_of(base: &str, path: &str) -> (u16, String) {
    http(base, "GET", path, None)
}

/// The first bytes of the event stream, until a `points` event has come (or 20 s).
fn first_events(base: &str) -> String {
    use std::io::{Read, Write};
    let hostport = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(hostport).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET /api/events HTTP/1.1\r\nHost: {hostport}\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while !String::from_utf8_lossy(&got).contains("event: points") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn the_dashboard_shows_the_swarm_and_a_curve_in_chromium_and_metrics_parse() {
    let _heavy = common::heavy();
    let chromium_bin = chromium();
    let dir = tempfile::tempdir().unwrap();
    let model = common::Tiny {
        max_pos: 1024,
        ..Default::default()
    }
    .write_hf_dir(&dir.path().join("tiny-model"));
    let agent = dir.path().join("agent.sh");
    std::fs::write(&agent, AGENT).unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n").unwrap();

    let mut s = Peer::start(
        "server",
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
            "--learning-rate",
            "1e-3",
            "--groups-per-step",
            "1",
            "--group-timeout",
            "5",
            "--dashboard",
            "127.0.0.1:0",
        ],
    );
    let boot = s.addr();
    let server_id = s.peer_id();
    let sdash = match s.wait_event("the dashboard", Duration::from_secs(120), |e| {
        matches!(e, ServerEvent::Dashboard { .. })
    }) {
        ServerEvent::Dashboard { addr } => format!("http://{addr}/"),
        _ => unreachable!(),
    };
    s.wait_serving(Duration::from_secs(120));
    let sdash = sdash.trim_end_matches('/').to_string();
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
            "--epochs",
            "1000",
            "--time-limit",
            "600",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--dashboard",
            "127.0.0.1:0",
        ],
    );
    let client_id = c.peer_id();
    let cdash = match c.wait_client_event("the dashboard", Duration::from_secs(120), |e| {
        matches!(e, ClientEvent::Dashboard { .. })
    }) {
        ClientEvent::Dashboard { addr } => format!("http://{addr}"),
        e => unreachable!("{e:?}"),
    };

    // Both /metrics parse from the start; the counters move once episodes and a step ran.
    let s0 = scrape(&sdash);
    let c0 = scrape(&cdash);
    let model_l = [("model", "tiny")];
    let steps0 = sample(&s0, "agentjet_train_steps_total", &model_l).unwrap();
    let tokens0 = sample(&s0, "agentjet_engine_generated_tokens_total", &model_l).unwrap();
    let done0 = sample(&c0, "agentjet_episodes_total", &[("status", "finished")]).unwrap();
    let metrics_file = dir.path().join("server/runs/tiny/metrics.jsonl");
    wait_until("a training step", Duration::from_secs(180), || {
        std::fs::read_to_string(&metrics_file)
            .unwrap_or_default()
            .contains("\"trained\":true")
    });
    wait_until(
        "the policy version in the gossip",
        Duration::from_secs(30),
        || {
            let (_, body) = status_of(&sdash, "/api/live");
            let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            v["view"].as_array().is_some_and(|peers| {
                peers.len() >= 2
                    && peers
                        .iter()
                        .any(|p| p["models"][0]["policy_version"].as_u64().unwrap_or(0) >= 1)
            })
        },
    );
    let s1 = scrape(&sdash);
    let c1 = scrape(&cdash);
    let steps1 = sample(&s1, "agentjet_train_steps_total", &model_l).unwrap();
    let tokens1 = sample(&s1, "agentjet_engine_generated_tokens_total", &model_l).unwrap();
    let done1 = sample(&c1, "agentjet_episodes_total", &[("status", "finished")]).unwrap();
    println!("server steps {steps0} -> {steps1}, tokens {tokens0} -> {tokens1}; client episodes {done0} -> {done1}");
    assert!(
        steps1 > steps0 && tokens1 > tokens0,
        "server counters did not move"
    );
    assert!(done1 > done0, "client counters did not move");
    assert!(sample(&s1, "agentjet_policy_version", &model_l).unwrap() >= 1.0);
    assert!(sample(&s1, "agentjet_train_reward_mean", &model_l).is_some());
    assert!(sample(&c1, "agentjet_swarm_providers", &model_l).unwrap() >= 1.0);
    assert!(sample(&s1, "agentjet_swarm_peers", &[("role", "client")]).unwrap() >= 1.0);

    // Bad input: a clear 4xx, and the peers keep serving.
    let (st, body) = status_of(&sdash, "/api/runs/nope/points");
    assert_eq!(st, 404, "{body}");
    assert!(body.contains("no run named"), "{body}");
    let long = format!("/api/live?q={}", "a".repeat(5000));
    assert_eq!(status_of(&sdash, &long).0, 414);
    assert_eq!(status_of(&sdash, "/api/runs/tiny/points?from=abc").0, 400);
    assert_eq!(status_of(&sdash, "/no/such/page").0, 404);
    let (st, body) = status_of(&cdash, "/api/runs/run1/logs/..%2Fconfig.json");
    assert_eq!(st, 400, "{body}");
    assert_eq!(
        status_of(&cdash, "/api/runs/run1/logs/..%2F..%2Fetc%2Fpasswd").0,
        400
    );
    assert_eq!(status_of(&cdash, "/api/runs/run1/logs/nope.stdout").0, 404);
    // A log the page links to is served.
    let (st, body) = status_of(&cdash, "/api/runs/run1/points");
    assert_eq!(st, 200, "{body}");
    let points: Value = serde_json::from_str(&body).unwrap();
    let first = &points["points"][0];
    assert_eq!(first["timeline"]["tiny"]["calls"], 1, "{first}");
    assert!(
        first["source"].as_str().unwrap().ends_with("tasks.jsonl"),
        "{first}"
    );
    let log = first["logs"][0].as_str().unwrap().to_string();
    let (st, text) = status_of(&cdash, &format!("/api/runs/run1/logs/{log}"));
    assert_eq!(st, 200);
    assert!(text.contains("reply:"), "the agent's stdout log: {text}");
    assert_eq!(status_of(&sdash, "/api/live").0, 200);
    assert_eq!(status_of(&cdash, "/api/live").0, 200);
    // The event stream: the live state, then the runs' points (the first has the tail).
    let events = first_events(&sdash);
    assert!(events.contains("text/event-stream"), "{events}");
    assert!(
        events.contains("event: live") && events.contains("event: points"),
        "{events}"
    );
    assert!(
        events.contains("\"reward_mean\""),
        "no points in the first event:\n{events}"
    );

    // The rendered page, in real Chromium.
    let profile = dir.path().join("chromium-profile");
    let dom = rendered_dom(&format!("{sdash}/"), &profile);
    assert!(
        dom.contains(&format!("data-peer=\"{server_id}\"")),
        "the server is not listed:\n{dom}"
    );
    assert!(
        dom.contains(&format!("data-peer=\"{client_id}\"")),
        "the client is not listed:\n{dom}"
    );
    assert!(
        dom.contains(&format!("data-client=\"{client_id}\"")) && dom.contains("tasks.jsonl: "),
        "the client's figures (by task source) are not shown:\n{dom}"
    );
    let versions: Vec<u64> = dom
        .match_indices("<span class=\"muted\">v")
        .filter_map(|(i, m)| {
            dom[i + m.len()..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        versions.iter().any(|&v| v >= 1),
        "no policy version >= 1 shown: {versions:?}\n{dom}"
    );
    let points_shown = dom
        .match_indices("data-metric=\"reward_mean\" data-points=\"")
        .filter_map(|(i, m)| dom[i + m.len()..].split('"').next()?.parse::<usize>().ok())
        .max()
        .unwrap_or(0);
    assert!(points_shown >= 1, "no reward curve with a point:\n{dom}");
    // The client's page: its run's episodes.
    let cdom = rendered_dom(&format!("{cdash}/"), &profile);
    assert!(cdom.contains("continued ·"), "no episode row:\n{cdom}");

    // A screenshot of the server's page, in its run directory.
    let shot = dir.path().join("server/runs/tiny/dashboard.png");
    let out = headless(&profile)
        .args(["--window-size=1280,1400"])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("{sdash}/"))
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).expect("the screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    if let Some(keep) = std::env::var_os("AGENTJET_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
    println!(
        "chromium {}: screenshot {} bytes",
        chromium_bin.display(),
        png.len()
    );

    // The run directories: the effective config and an SVG per curve.
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("server/runs/tiny/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["learning_rate"], 1e-3, "{cfg}");
    let ccfg: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(ccfg["num_repeat"], 4, "{ccfg}");
    assert!(dir
        .path()
        .join("server/runs/tiny/plots/reward.svg")
        .is_file());
    assert!(dir.path().join("server/runs/tiny/plots/loss.svg").is_file());

    // `agentjet-peer runs` lists both runs.
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["runs", "--data-dir"])
        .arg(dir.path().join("server"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("tiny") && text.contains("train"),
        "{text}"
    );

    c.kill9();
    s.kill9();
}
