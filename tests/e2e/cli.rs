//! `agentjet-peer` as a user runs it: generate on the default model, export and reload,
//! help, and honest errors for what is not built yet.

use crate::common;

use std::process::Command;

fn peer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
}

#[test]
fn generate_streams_an_answer_and_reports_speed() {
    let _lane = common::light();
    common::smollm2_path();
    let out = peer()
        .args([
            "generate",
            "--model",
            "smollm2",
            "--prompt",
            "What is the capital of France?",
        ])
        .args(["--max-tokens", "24"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "The capital of France is Paris.");
    assert!(stderr.contains("tokens/s decode"), "{stderr}");
    assert!(stderr.contains("finish: Stop"), "{stderr}");
}

#[test]
fn seeded_sampling_is_reproducible_and_differs_across_seeds() {
    let _lane = common::light();
    common::smollm2_path();
    let run = |seed: &str| {
        common::generate_ok(
            "smollm2",
            &[
                "--prompt",
                "Write a short poem about rain.",
                "--max-tokens",
                "20",
                "--temperature",
                "1.0",
                "--top-p",
                "0.95",
                "--seed",
                seed,
            ],
        )
    };
    let a = run("11");
    assert_eq!(a, run("11"));
    assert_ne!(a, run("12"));
}

#[test]
fn exported_checkpoint_generates_the_same_text() {
    let _lane = common::light();
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("smollm2-hf");
    let out = peer()
        .args(["export", "--model", "smollm2", "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let args = [
        "--prompt",
        "Name three colors.",
        "--max-tokens",
        "16",
        "--show-tokens",
    ];
    assert_eq!(
        common::generate_ok("smollm2", &args),
        common::generate_ok(&out_dir, &args)
    );
}

#[test]
fn help_has_examples_and_bad_role_options_say_what_is_wrong() {
    let _lane = common::light();
    let out = peer().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--role") && help.contains("generate") && help.contains("Examples:"));
    assert!(help.contains("--bootstrap") && help.contains("--swarm-key"));
    let dir = tempfile::tempdir().unwrap();
    let out = peer()
        .args(["--role", "peer", "--listen", "not-an-address", "--data-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("--listen") && e.contains("not a multiaddr"),
        "{e}"
    );
    let key = dir.path().join("bad.key");
    std::fs::write(&key, "nope").unwrap();
    let out = peer()
        .args(["--role", "peer", "--swarm-key"])
        .arg(&key)
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("swarm key") && e.contains("64 hex digits"),
        "{e}"
    );
    let out = peer()
        .args(["generate", "--prompt", "x", "--top-p", "1.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("top_p"));
}
