//! Running the Python peer of a benchmark (HF transformers in the cached venv) in the same
//! run: find the venv's Python, check the reference packages, run a script, read its last
//! stdout line as JSON.

use std::process::Command;

/// The cached venv's Python, with transformers importable (and gguf-py, which HF's GGUF
/// loader needs, when `gguf` is true).
pub fn reference_python(gguf: bool) -> anyhow::Result<String> {
    let python = std::env::var("AGENTJET_PYTHON").map_err(|_| {
        anyhow::anyhow!(
            "AGENTJET_PYTHON is not set: run `bash bootstrap/setup.sh --reference` first"
        )
    })?;
    let imports = if gguf {
        "import transformers, accelerate, gguf"
    } else {
        "import transformers, accelerate"
    };
    let check = Command::new(&python).args(["-c", imports]).status()?;
    anyhow::ensure!(
        check.success(),
        "transformers is not installed in {python}: run `bash bootstrap/setup.sh --reference`"
    );
    Ok(python)
}

/// The model directory and GGUF file name HF's `from_pretrained` takes for `source`
/// (an empty file name for an HF directory).
pub fn hf_model_args(source: &agentjet::model::ModelSource) -> (String, String) {
    use agentjet::model::ModelSource;
    match source {
        ModelSource::Gguf(p) => (
            p.parent()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            p.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ),
        ModelSource::HfDir(p) => (p.display().to_string(), String::new()),
    }
}

/// Runs `benches/<script>` with `args` and parses the last line it printed. The script is
/// looked up under `$AGENTJET_BENCH_DIR` when set (a bench binary run away from its
/// checkout), else in this checkout.
pub fn run_peer(python: &str, script: &str, args: &[String]) -> anyhow::Result<serde_json::Value> {
    let dir = std::env::var("AGENTJET_BENCH_DIR")
        .unwrap_or_else(|_| format!("{}/benches", env!("CARGO_MANIFEST_DIR")));
    let out = Command::new(python)
        .arg(format!("{dir}/{script}"))
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
