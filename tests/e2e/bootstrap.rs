//! bootstrap/setup.sh as a second run sees it: everything is in place (the README's
//! commands ran it first), so it installs and fetches nothing, leaves the model file
//! untouched, and keeps `.cargo/config.toml` pointing at the cache.

use std::path::Path;
use std::process::Command;

use crate::common;

#[test]
fn second_setup_run_changes_nothing() {
    let _lane = common::light();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cache = std::env::var("AGENTJET_CACHE")
        .expect("AGENTJET_CACHE (set by setup in .cargo/config.toml)");
    let model = Path::new(&cache)
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let before = std::fs::metadata(&model)
        .expect("model in cache")
        .modified()
        .unwrap();
    let out = Command::new("bash")
        .arg(root.join("bootstrap/setup.sh"))
        .env("AGENTJET_CACHE", &cache)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("ready"), "{stderr}");
    for busy in ["installing", "fetching", "wrote"] {
        assert!(
            !stderr.contains(busy),
            "second run did work ({busy}): {stderr}"
        );
    }
    assert_eq!(
        std::fs::metadata(&model).unwrap().modified().unwrap(),
        before
    );
    let config = std::fs::read_to_string(root.join(".cargo/config.toml")).unwrap();
    assert!(
        config.contains("LIBTORCH") && config.contains(&cache),
        "{config}"
    );
    // Unknown flags are refused with a clear message.
    let out = Command::new("bash")
        .arg(root.join("bootstrap/setup.sh"))
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument '--bogus'"));
}
