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

/// Writes an adapter of SmolLM2 (rank 4 on every target, B random from `seed`) in PEFT's
/// format to `dir`.
fn smollm2_adapter(dir: &std::path::Path, seed: u64) {
    use agentjet::model::checkpoint::load_model;
    use agentjet::model::llama::{lora::LoraConfig, DType};
    let source = agentjet::model::ModelSource::resolve("smollm2").unwrap();
    let mut m = load_model(&source, tch::Device::Cpu, DType::F32)
        .unwrap()
        .model;
    m.attach_adapter(LoraConfig::new(4), seed).unwrap();
    common::randomize_lora_b(m.parameters(), seed, 0.5);
    agentjet::model::peft::write_adapter(dir, &m, "smollm2").unwrap();
}

#[test]
fn serve_with_adapters_lists_each_as_a_model_and_answers_with_it() {
    let _light = common::light();
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    smollm2_adapter(&a, 1);
    smollm2_adapter(&b, 2);
    let arg = |n: &str, p: &std::path::Path| format!("{n}={}", p.display());
    let s = serve(&[
        "--adapter",
        &arg("solver", &a),
        "--adapter",
        &arg("verifier", &b),
    ]);
    let (status, body) = common::peer::http(&s.base, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{body}");
    for id in ["smollm2", "solver", "verifier"] {
        assert!(body.contains(&format!("\"{id}\"")), "{id} in {body}");
    }
    // One prompt, greedy, to the base and each adapter, all at once (one engine batch):
    // three different answers, each the same when asked again alone.
    let ask = |model: &str| {
        let req = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": true,
        });
        let (status, body) =
            common::peer::http(&s.base, "POST", "/v1/chat/completions", Some(&req));
        assert_eq!(status, 200, "{model}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["token"].as_str().unwrap().to_string(),
                    t["logprob"].as_f64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let together: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = ["smollm2", "solver", "verifier"]
            .map(|m| sc.spawn(move || ask(m)))
            .into_iter()
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_ne!(
        together[0], together[1],
        "the solver adapter changes the answer"
    );
    assert_ne!(together[0], together[2], "so does the verifier");
    assert_ne!(together[1], together[2]);
    for (i, m) in ["smollm2", "solver", "verifier"].iter().enumerate() {
        let alone = ask(m);
        assert_eq!(alone.len(), together[i].len(), "{m}");
        for (x, y) in alone.iter().zip(&together[i]) {
            assert_eq!(x.0, y.0, "{m}: tokens");
            assert!((x.1 - y.1).abs() < 1e-4, "{m}: {} vs {}", x.1, y.1);
        }
    }
    // A model not served is refused.
    let req =
        serde_json::json!({"model": "critic", "messages": [{"role": "user", "content": "hi"}]});
    let (status, body) = common::peer::http(&s.base, "POST", "/v1/chat/completions", Some(&req));
    assert_eq!(status, 404, "{body}");
}

#[test]
fn serve_refuses_an_adapter_it_cannot_read_and_says_which() {
    let _light = common::light();
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["serve", "--model", "smollm2", "--port", "0", "--adapter"])
        .arg(format!("solver={}", missing.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--adapter solver="), "{stderr}");
    assert!(stderr.contains("adapter_config.json"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["serve", "--model", "smollm2", "--adapter", "solver"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("expected NAME=DIR"), "{stderr}");
}
