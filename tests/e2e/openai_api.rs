//! Runs tests/openai/test_api.py (the official `openai` Python package) against two live
//! `agentjet-peer serve` processes of the real default model, and
//! tests/openai/test_agent_apis.py (the Responses API with `openai`, the Messages API with
//! `anthropic`) against a live `serve` and through a client's proxy over the swarm.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::peer::{metric, wait_until, Peer};

struct Server {
    child: Child,
    base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["serve", "--model", "smollm2", "--port", "0"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "serving smollm2 at http://127.0.0.1:PORT/v1 (...)"
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    Server { child, base }
}

#[test]
fn openai_python_sdk_suite_passes_against_live_serve() {
    let _heavy = common::heavy();
    common::smollm2_path();
    let main = serve(&["--track-episodes"]);
    let tight = serve(&["--max-batch", "1", "--max-queue", "1"]);
    let out = Command::new(common::python())
        .args(["-m", "unittest", "-v"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai/test_api.py"
        ))
        .env("AGENTJET_BASE_URL", &main.base)
        .env("AGENTJET_TIGHT_BASE_URL", &tight.base)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "openai suite failed:\n{stderr}");
    assert!(stderr.contains("OK"), "{stderr}");
}

/// Runs the Responses / Messages suite against `base` (an endpoint's `.../v1`).
fn agent_api_suite(base: &str, what: &str) {
    let out = Command::new(common::python())
        .args(["-m", "unittest", "-v"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/openai/test_agent_apis.py"
        ))
        .env("AGENTJET_BASE_URL", base)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{what}:\n{stderr}");
    assert!(out.status.success(), "{what}: the suite failed:\n{stderr}");
    assert!(stderr.contains("OK"), "{stderr}");
}

#[test]
fn responses_and_messages_sdk_suites_pass_against_serve_and_through_a_proxy() {
    let _heavy = common::heavy();
    common::smollm2_path();
    let main = serve(&["--track-episodes"]);
    agent_api_suite(&main.base, "serve");
    drop(main);
    // The same suite through a client's proxy: the calls cross the swarm to a server.
    let dir = tempfile::tempdir().unwrap();
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
            "--no-train",
        ],
    );
    let boot = s.addr();
    s.wait_serving(Duration::from_secs(300));
    let mut c = Peer::start(
        "client",
        dir.path(),
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
    agent_api_suite(&proxy, "proxy");
}
