//! The 2026 model families as a user runs them, on tiny models transformers 5 built
//! (tests/fixtures/hf_family.py): Qwen3, Qwen3-MoE, Qwen3.5 and the released `qwen3_5`
//! wrapper each run under `generate`, `serve` and `--role server` (a client's agent, a
//! trained step), and a live thinking-mode agent (examples/thinking_agent) keeps every
//! later call continued on the real Qwen3 and Qwen3.5 templates.

use crate::client::{client_args, metrics_lines, named_server, write_tasks, AGENT};
use crate::common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use agentjet::client::episodes::read_journal;
use common::peer::{http, metric, Peer};
use serde_json::{json, Value};

/// `agentjet-peer serve` of `model`: one chat completion over HTTP answers, as the model
/// `/v1/models` lists.
fn serve_answers(model: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["serve", "--model", model, "--port", "0", "--device", "cpu"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(|w| w.trim_end_matches("/v1").to_string());
    let Some(base) = base else {
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        panic!(
            "serve {model}: no address in {line:?}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (code, body) = http(&base, "GET", "/v1/models", None);
    assert_eq!(code, 200, "{body}");
    let models: Value = serde_json::from_str(&body).unwrap();
    let name = models["data"][0]["id"].as_str().unwrap().to_string();
    let req = json!({"model": name, "max_tokens": 6, "temperature": 0.0,
                     "messages": [{"role": "user", "content": "hello"}]});
    let (code, body) = http(&base, "POST", "/v1/chat/completions", Some(&req));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(code, 200, "serve {model}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
}

/// Qwen3 (q/k norms), Qwen3-MoE (routed experts), Qwen3.5 (Gated DeltaNet and gated
/// attention) and the `qwen3_5` wrapper with its vision tower: `generate` runs each,
/// `serve` answers with each, and `--role server` serves each to a client's agent and
/// trains on the episodes, whose new weights its engine then serves (Qwen3.5 in the
/// linear layout, said in the step's metrics, the others in the tree layout; a LoRA
/// adapter on all but the wrapper, Qwen3's served merged).
#[test]
fn every_2026_family_generates_serves_and_trains_as_a_server() {
    let _lane = common::light();
    for family in ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_wrapped"] {
        let dir = tempfile::tempdir().unwrap();
        let (model, _) = common::hf_family_model(family, dir.path());
        let model = model.to_str().unwrap();
        let out = common::generate_cli(model, &["--prompt", "hello", "--max-tokens", "6"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && err.contains(" generated, "),
            "{family}: {err}"
        );
        if family == "qwen3_5_wrapped" {
            assert!(
                err.contains("vision"),
                "{family}: the load names what it ignores: {err}"
            );
        }
        serve_answers(model);
        let agent = dir.path().join("agent.sh");
        std::fs::write(&agent, AGENT).unwrap();
        let agent = format!("sh {}", agent.display());
        let tasks = dir.path().join("tasks.jsonl");
        write_tasks(&tasks, 4);
        // Qwen3, Qwen3-MoE and Qwen3.5 train a LoRA adapter (MoE's on its attention),
        // served merged into the weights (Qwen3's by name, MoE's by `auto` over float32)
        // or unmerged (Qwen3.5's); the wrapper trains every parameter.
        let lora: &[&str] = match family {
            "qwen3" => &["--lora-rank", "4", "--lora-serve", "merged"],
            "qwen3_moe" => &["--lora-rank", "4", "--lora-targets", "q,k,v,o"],
            "qwen3_5" => &["--lora-rank", "4", "--lora-serve", "unmerged"],
            _ => &[],
        };
        let mut args = vec!["--http", "127.0.0.1:0"];
        args.extend(lora);
        let mut s = named_server(dir.path(), model, "tiny", None, &args);
        let boot = s.addr();
        s.wait_serving(Duration::from_secs(120));
        if !lora.is_empty() {
            let how = match family {
                "qwen3_5" => "unmerged, beside the base",
                _ => "merged into its own copy",
            };
            assert!(s.log_text().contains(how), "{family}: {}", s.log_text());
        }
        let run = dir.path().join("run");
        let mut c = Peer::start(
            "client",
            dir.path(),
            &client_args(&boot, &agent, &tasks, &run, &[]),
        );
        assert!(
            c.child.wait().unwrap().success(),
            "{family}: {}",
            c.log_text()
        );
        let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
        assert_eq!(journal.len(), 16, "{family}");
        assert!(
            journal.iter().all(|e| e["status"] == "finished"),
            "{family}: {journal:?}"
        );
        let metrics = dir.path().join("tiny/runs/tiny/metrics.jsonl");
        common::peer::wait_until("a trained step", Duration::from_secs(60), || {
            metrics_lines(&metrics).iter().any(|l| l["trained"] == true)
        });
        let step = metrics_lines(&metrics)
            .into_iter()
            .find(|l| l["trained"] == true)
            .unwrap();
        let fallback = step["layout_fallback"].as_str().unwrap_or_default();
        if family.starts_with("qwen3_5") {
            assert!(fallback.contains("linear layout"), "{family}: {step}");
        } else {
            assert!(fallback.is_empty(), "{family}: {step}");
        }
        assert!(
            step["grad_norm"].as_f64().unwrap() > 0.0,
            "{family}: {step}"
        );
        // The engine serves the trained weights (a merged adapter merged again).
        let http = s.http_url(Duration::from_secs(10));
        let version = "agentjet_policy_version{model=\"tiny\"}";
        common::peer::wait_until("the new policy served", Duration::from_secs(60), || {
            metric(&http, version).is_some_and(|v| v >= 1.0)
        });
    }
}

/// examples/thinking_agent (OpenAI SDK, three turns, `enable_thinking` through
/// `chat_template_kwargs`, each answer sent back with its reasoning) against a server of
/// a tiny Qwen3 and a tiny Qwen3.5 that transformers taught to reason, on the families'
/// real chat templates, which drop earlier turns' reasoning: every answer reasons, and
/// 100% of the later calls continue the episode's timeline (no break).
#[test]
fn a_thinking_agent_keeps_every_later_call_continued_on_qwen3_and_qwen3_5() {
    let _lane = common::light();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let agent = format!(
        "{} {}",
        common::python().display(),
        root.join("examples/thinking_agent/agent.py").display()
    );
    let tasks = root.join("examples/thinking_agent/tasks.jsonl");
    for (family, template) in [
        ("qwen3", "qwen3_chat_template.jinja"),
        ("qwen3_5", "qwen3_5_chat_template.jinja"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = common::thinker_model(family, template, dir.path());
        let model = model.to_str().unwrap();
        let mut s = named_server(dir.path(), model, "tiny", None, &[]);
        let boot = s.addr();
        s.wait_serving(Duration::from_secs(120));
        let run = dir.path().join("run");
        let args = client_args(&boot, &agent, &tasks, &run, &["--groups", "2"]);
        // Greedy: the tiny model was taught one answer, and at the agent's default 0.7 a
        // low-probability token can garble one (CI once saw an answer with a second
        // `</think>`); continuation does not depend on how the tokens were drawn.
        let env = [("AGENTJET_MODEL", "tiny"), ("AGENT_TEMPERATURE", "0")];
        let mut c = Peer::start_env("client", dir.path(), &args, &env);
        assert!(
            c.child.wait().unwrap().success(),
            "{family}: {}",
            c.log_text()
        );
        let journal = read_journal(&run.join("episodes.jsonl")).unwrap();
        assert_eq!(journal.len(), 8, "{family}");
        for e in &journal {
            assert_eq!(e["status"], "finished", "{family}: {e}");
            assert_eq!(e["calls"], 3, "{family}: {e}");
            let t = &e["timeline"]["tiny"];
            assert_eq!(
                (&t["continued"], &t["breaks"]),
                (&json!(2), &json!(0)),
                "{family}: {e}"
            );
            let logs = e["logs"].as_array().unwrap();
            let mut stdout = logs.iter().filter_map(|l| l.as_str());
            let stdout = stdout.find(|l| l.ends_with(".stdout")).unwrap();
            let out = std::fs::read_to_string(run.join("episodes").join(stdout)).unwrap();
            assert_eq!(
                out.matches("</think>").count(),
                3,
                "{family}: every answer reasons: {out}"
            );
        }
        let log = c.stdout();
        assert!(
            log.contains("timeline tiny: 8 first calls, 16 continued, 0 breaks (100.0% of later calls continued)"),
            "{family}: {log}"
        );
    }
}
