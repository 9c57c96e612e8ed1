//! `cargo bench --bench decode`: single-stream greedy decode speed of `generate` on
//! SmolLM2-135M-Instruct (float32, CPU or CUDA as LibTorch finds) against HF transformers
//! (GGUF loader, float32) on the same prompt ids, same machine, same run.
//!
//! Decode speed is (new tokens - 1) / (time of all tokens - time to the first token), the
//! median of several runs for each side. The bench also checks that both sides produced
//! the same greedy tokens. Needs `bash bootstrap/setup.sh --reference` (transformers in the
//! cached venv).

use std::process::Command;
use std::time::Instant;

use agentjet::engine::{generate, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::{cache_dir, ChatRequest, ModelSource, SMOLLM2_FILE};
use serde_json::json;

const NEW_TOKENS: usize = 128;
const REPEATS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if let Err(e) = run() {
        eprintln!("decode bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
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
    let source = ModelSource::resolve("smollm2")?;
    let device = tch::Device::cuda_if_available();
    let loaded = load_model(&source, device, DType::F32)?;
    let card = &loaded.card;
    let messages = vec![
        json!({"role": "user", "content": "Write a long story about a robot who learns to paint."}),
    ];
    let text = card.chat_template("smollm2")?.render(&ChatRequest {
        messages: &messages,
        add_generation_prompt: true,
        ..Default::default()
    })?;
    let prompt = card.tokenizer.encode(&text)?;
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: NEW_TOKENS,
        sampling: SamplingParams::greedy(),
        seed: None,
        // Fixed length on both sides: EOS does not stop (HF: min_new_tokens).
        stop_token_ids: vec![],
    };
    println!(
        "decode bench: SmolLM2-135M-Instruct f32 on {device:?}, {} prompt tokens, {NEW_TOKENS} new tokens, median of {REPEATS}, {} torch threads",
        prompt.len(),
        tch::get_num_threads()
    );
    generate(&loaded.model, &req, |_, _| true)?; // warm-up
    let mut ours = Vec::new();
    let mut our_tokens = Vec::new();
    let t = Instant::now();
    for _ in 0..REPEATS {
        let g = generate(&loaded.model, &req, |_, _| true)?;
        ours.push(g.decode_tokens_per_s());
        our_tokens = g.tokens;
    }
    let ours_s = t.elapsed().as_secs_f64();

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/hf_decode.py");
    let out = Command::new(&python)
        .arg(script)
        .arg(cache_dir().join("models"))
        .arg(SMOLLM2_FILE)
        .arg(serde_json::to_string(&prompt)?)
        .arg(NEW_TOKENS.to_string())
        .arg(REPEATS.to_string())
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("TQDM_DISABLE", "1")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "HF transformers run failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let hf: serde_json::Value = serde_json::from_str(
        stdout
            .lines()
            .last()
            .ok_or_else(|| anyhow::anyhow!("no output from hf_decode.py"))?,
    )?;
    let peer = hf["decode_tok_s"].as_f64().unwrap_or(0.0);
    let hf_tokens: Vec<u32> = hf["tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect()
        })
        .unwrap_or_default();
    let same = our_tokens
        .iter()
        .zip(&hf_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let ours_med = median(ours.clone());
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!();
    println!("| side                          | decode tok/s (median) | runs                 |");
    println!("|-------------------------------|-----------------------|----------------------|");
    println!(
        "| agentjet generate (tch, f32)  | {ours_med:>21.1} | {:<20} |",
        fmt(&ours)
    );
    let hf_runs: Vec<f64> = hf["all"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default();
    println!(
        "| HF transformers generate (f32)| {peer:>21.1} | {:<20} |",
        fmt(&hf_runs)
    );
    println!();
    println!(
        "greedy tokens identical for the first {same} of {NEW_TOKENS}; our {REPEATS} runs took {ours_s:.1}s"
    );
    let ratio = if peer > 0.0 { ours_med / peer } else { 0.0 };
    println!("ratio (ours / HF): {ratio:.2}x (goal >= 1.5x)");
    println!(
        "RESULT decode single_stream_tok_s ours={ours_med:.2} peer={peer:.2} ratio={ratio:.2}"
    );
    Ok(())
}
