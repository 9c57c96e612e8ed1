//! Runs tests/openai/test_api.py (the official `openai` Python package) against two live
//! `agentjet-peer serve` processes of the real default model.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

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
