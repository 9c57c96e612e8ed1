//! Running the Python peer of a benchmark (HF transformers in the cached venv) in the same
//! run: find the venv's Python, check the reference packages, run a script, read its last
//! stdout line as JSON.

use std::process::Command;

/// The cached venv's Python, with transformers importable.
pub fn reference_python() -> anyhow::Result<String> {
    let python = std::env::var("AGENTJET_PYTHON").map_err(|_| {
        anyhow::anyhow!(
            "AGENTJET_PYTHON is not set: run `bash bootstrap/setup.sh --reference` first"
        )
    })?;
    let check = Command::new(&python)
        .args(["-c", "import transformers, gguf, accelerate"])
        .status()?;
    anyhow::ensure!(
        check.success(),
        "transformers is not installed in {python}: run `bash bootstrap/setup.sh --reference`"
    );
    Ok(python)
}

/// Runs `benches/<script>` with `args` and parses the last line it printed.
pub fn run_peer(python: &str, script: &str, args: &[String]) -> anyhow::Result<serde_json::Value> {
    let out = Command::new(python)
        .arg(format!("{}/benches/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("TQDM_DISABLE", "1")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .last()
        .ok_or_else(|| anyhow::anyhow!("no output from {script}"))?;
    Ok(serde_json::from_str(last)?)
}
