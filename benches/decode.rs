//! `cargo bench --bench decode`: single-stream greedy decode speed of `generate` on
//! SmolLM2-135M-Instruct against HF transformers (GGUF loader) on the same prompt ids, same
//! machine, same run, at two precisions:
//!
//! - float32 on both sides (our default on CPU; token-for-token equal to HF);
//! - bfloat16 weights on both sides: HF computes in bfloat16, we keep float32 activations
//!   and use agentjet-kernels' bf16 matmul (see src/model/llama.rs).
//!
//! Decode speed is (new tokens - 1) / (time of all tokens - time to the first token), the
//! median of several runs for each side. The bench also reports how many greedy tokens the
//! two sides share. Needs `bash bootstrap/setup.sh --reference` (transformers in the cached
//! venv). The float32 runs come first: loading a bfloat16 model on CPU sets LibTorch to one
//! intra-op thread for the rest of the process.

use std::time::Instant;

use agentjet::engine::{
    generate, spawn_engine, EngineConfig, EngineEvent, GenerateRequest, SamplingParams,
};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::{ChatRequest, ModelSource};
use serde_json::json;

mod peer;

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

struct Side {
    median: f64,
    runs: Vec<f64>,
    tokens: Vec<u32>,
}

fn ours(dtype: DType, prompt: &[u32]) -> anyhow::Result<Side> {
    let source = ModelSource::resolve("smollm2")?;
    let loaded = load_model(&source, tch::Device::cuda_if_available(), dtype)?;
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: NEW_TOKENS,
        sampling: SamplingParams::greedy(),
        seed: None,
        // Fixed length on both sides: EOS does not stop (HF: min_new_tokens).
        stop_token_ids: vec![],
        top_logprobs: 0,
        constraint: None,
    };
    generate(&loaded.model, &req, |_, _| true)?; // warm-up
    let mut runs = Vec::new();
    let mut tokens = Vec::new();
    for _ in 0..REPEATS {
        let g = generate(&loaded.model, &req, |_, _| true)?;
        runs.push(g.decode_tokens_per_s());
        tokens = g.tokens;
    }
    Ok(Side {
        median: median(runs.clone()),
        runs,
        tokens,
    })
}

/// One stream through the engine thread (what `serve` runs): decode speed from the first
/// token's event to the last one's.
fn engine(dtype: DType, prompt: &[u32]) -> anyhow::Result<Side> {
    let source = ModelSource::resolve("smollm2")?;
    let loaded = load_model(&source, tch::Device::cuda_if_available(), dtype)?;
    let engine = spawn_engine(loaded.model, EngineConfig::default())?;
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_tokens: NEW_TOKENS,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    let once = || -> anyhow::Result<(f64, Vec<u32>)> {
        let mut rx = engine.submit(req.clone())?;
        let (mut first, mut last, mut tokens) = (None, Instant::now(), Vec::new());
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                EngineEvent::Token { id, .. } => {
                    last = Instant::now();
                    first.get_or_insert(last);
                    tokens.push(id);
                }
                EngineEvent::Finished { .. } => break,
                EngineEvent::Failed(e) => anyhow::bail!("engine request failed: {e}"),
            }
        }
        let secs = first.map_or(0.0, |f| (last - f).as_secs_f64());
        Ok(((tokens.len().saturating_sub(1)) as f64 / secs, tokens))
    };
    once()?; // warm-up
    let mut runs = Vec::new();
    let mut tokens = Vec::new();
    for _ in 0..REPEATS {
        let (tps, t) = once()?;
        runs.push(tps);
        tokens = t;
    }
    Ok(Side {
        median: median(runs.clone()),
        runs,
        tokens,
    })
}

fn hf(python: &str, dtype: &str, prompt: &[u32]) -> anyhow::Result<Side> {
    let (dir, file) = peer::hf_model_args(&ModelSource::resolve("smollm2")?);
    let v = peer::run_peer(
        python,
        "hf_decode.py",
        &[
            dir,
            file,
            serde_json::to_string(prompt)?,
            NEW_TOKENS.to_string(),
            REPEATS.to_string(),
            dtype.to_string(),
        ],
    )?;
    let nums = |key: &str| -> Vec<f64> {
        v[key]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default()
    };
    Ok(Side {
        median: v["decode_tok_s"].as_f64().unwrap_or(0.0),
        runs: nums("all"),
        tokens: nums("tokens").iter().map(|&t| t as u32).collect(),
    })
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn run() -> anyhow::Result<()> {
    let python = peer::reference_python(true)?;
    let card = agentjet::model::ModelCard::load(&ModelSource::resolve("smollm2")?)?;
    let messages = vec![
        json!({"role": "user", "content": "Write a long story about a robot who learns to paint."}),
    ];
    let text = card.chat_template("smollm2")?.render(&ChatRequest {
        messages: &messages,
        add_generation_prompt: true,
        ..Default::default()
    })?;
    let prompt = card.tokenizer.encode(&text)?;
    println!(
        "decode bench: SmolLM2-135M-Instruct on {:?}, {} prompt tokens, {NEW_TOKENS} new tokens, median of {REPEATS} runs, {} torch threads at start, kernel SIMD {}",
        tch::Device::cuda_if_available(),
        prompt.len(),
        tch::get_num_threads(),
        agentjet_kernels::simd_level()
    );
    let ours_f32 = ours(DType::F32, &prompt)?;
    let engine_f32 = engine(DType::F32, &prompt)?;
    println!(
        "engine f32 single stream: {:.1} tok/s (runs {:?}); generate {:.1}",
        engine_f32.median, engine_f32.runs, ours_f32.median
    );
    if std::env::args().any(|a| a == "--engine-only") {
        return Ok(());
    }
    let hf_f32 = hf(&python, "float32", &prompt)?;
    let hf_bf16 = hf(&python, "bfloat16", &prompt)?;
    let ours_bf16 = ours(DType::BF16, &prompt)?;

    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!();
    println!("| precision | side             | decode tok/s (median) | runs                      | greedy tokens equal to HF f32 |");
    println!("|-----------|------------------|-----------------------|---------------------------|-------------------------------|");
    for (prec, side, s) in [
        ("f32", "agentjet", &ours_f32),
        ("f32", "agentjet engine", &engine_f32),
        ("f32", "HF transformers", &hf_f32),
        ("bf16", "agentjet", &ours_bf16),
        ("bf16", "HF transformers", &hf_bf16),
    ] {
        println!(
            "| {prec:<9} | {side:<16} | {:>21.1} | {:<25} | {:>22} of {NEW_TOKENS} |",
            s.median,
            fmt(&s.runs),
            shared_prefix(&s.tokens, &hf_f32.tokens)
        );
    }
    let ratio = |a: &Side, b: &Side| {
        if b.median > 0.0 {
            a.median / b.median
        } else {
            0.0
        }
    };
    let re = ratio(&engine_f32, &ours_f32);
    println!(
        "engine (one stream, f32) vs generate: {:.1} vs {:.1} tok/s, {re:.2}x (goal: within 10%, >= 0.90x)",
        engine_f32.median, ours_f32.median
    );
    println!(
        "RESULT decode engine_single_stream_tok_s_f32 ours={:.2} peer={:.2} ratio={re:.2}",
        engine_f32.median, ours_f32.median
    );
    let r32 = ratio(&ours_f32, &hf_f32);
    let r16 = ratio(&ours_bf16, &hf_bf16);
    let rx = ratio(&ours_bf16, &hf_f32);
    println!();
    println!("ratio f32 vs f32:  {r32:.2}x   ratio bf16 vs bf16: {r16:.2}x   ours bf16 vs HF f32: {rx:.2}x   (goal >= 1.5x)");
    println!(
        "RESULT decode single_stream_tok_s_f32 ours={:.2} peer={:.2} ratio={r32:.2}",
        ours_f32.median, hf_f32.median
    );
    println!(
        "RESULT decode single_stream_tok_s_bf16 ours={:.2} peer={:.2} ratio={r16:.2}",
        ours_bf16.median, hf_bf16.median
    );
    Ok(())
}
