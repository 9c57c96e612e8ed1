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
//!
//! Every figure is measured twice: on an idle machine, and contended, with one busy
//! process beside both sides (`sh -c 'while :; do :; done'`, one core's worth), as a
//! server's machine is when its trainer, a local client's agents or anything else of the
//! user's runs. The table says what share of its idle speed each side keeps (the limit on
//! a 2-core machine is about half). Both sides run at their defaults: ours sizes its pools
//! to the cores other processes leave free (`base::cores`, sampled every 250 ms); HF's
//! PyTorch keeps its intra-op threads at the machine's cores.

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

/// One busy process beside the bench while it lives (a core's worth of load).
struct Busy(std::process::Child);

impl Busy {
    fn start() -> anyhow::Result<Busy> {
        let child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()?;
        // Long enough for the core sampler's second of memory to see it.
        std::thread::sleep(std::time::Duration::from_millis(1500));
        Ok(Busy(child))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A figure idle and contended.
struct Both {
    idle: Side,
    busy: Side,
}

impl Both {
    fn measure(mut f: impl FnMut() -> anyhow::Result<Side>) -> anyhow::Result<Both> {
        let idle = f()?;
        let busy = {
            let _b = Busy::start()?;
            f()?
        };
        Ok(Both { idle, busy })
    }

    /// The share of its idle speed kept when contended.
    fn kept(&self) -> f64 {
        if self.idle.median > 0.0 {
            self.busy.median / self.idle.median
        } else {
            0.0
        }
    }
}

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
        adapter: None,
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
    // f32 first (a bfloat16 load sets one LibTorch thread for the rest of the process).
    let ours_f32 = Both::measure(|| ours(DType::F32, &prompt))?;
    let engine_f32 = Both::measure(|| engine(DType::F32, &prompt))?;
    println!(
        "engine f32 single stream: {:.1} tok/s (runs {:?}); generate {:.1}; contended: {:.1} / {:.1}",
        engine_f32.idle.median,
        engine_f32.idle.runs,
        ours_f32.idle.median,
        engine_f32.busy.median,
        ours_f32.busy.median
    );
    if std::env::args().any(|a| a == "--engine-only") {
        return Ok(());
    }
    let hf_f32 = Both::measure(|| hf(&python, "float32", &prompt))?;
    let hf_bf16 = Both::measure(|| hf(&python, "bfloat16", &prompt))?;
    let ours_bf16 = Both::measure(|| ours(DType::BF16, &prompt))?;

    let fmt = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let rows = [
        ("f32", "agentjet", &ours_f32),
        ("f32", "agentjet engine", &engine_f32),
        ("f32", "HF transformers", &hf_f32),
        ("bf16", "agentjet", &ours_bf16),
        ("bf16", "HF transformers", &hf_bf16),
    ];
    for (mode, pick) in [
        ("idle machine", (|b: &Both| &b.idle) as fn(&Both) -> &Side),
        ("one busy process beside", |b: &Both| &b.busy),
    ] {
        println!();
        println!("{mode}:");
        println!("| precision | side             | decode tok/s (median) | runs                      | greedy tokens equal to HF f32 |");
        println!("|-----------|------------------|-----------------------|---------------------------|-------------------------------|");
        for (prec, side, b) in rows {
            let s = pick(b);
            println!(
                "| {prec:<9} | {side:<16} | {:>21.1} | {:<25} | {:>22} of {NEW_TOKENS} |",
                s.median,
                fmt(&s.runs),
                shared_prefix(&s.tokens, &hf_f32.idle.tokens)
            );
        }
    }
    println!();
    println!("| precision | side             | idle tok/s | contended tok/s | kept (goal: ours >= 0.40) |");
    println!("|-----------|------------------|------------|-----------------|---------------------------|");
    for (prec, side, b) in rows {
        println!(
            "| {prec:<9} | {side:<16} | {:>10.1} | {:>15.1} | {:>25.2} |",
            b.idle.median,
            b.busy.median,
            b.kept()
        );
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let re = ratio(engine_f32.idle.median, ours_f32.idle.median);
    println!(
        "engine (one stream, f32) vs generate: {:.1} vs {:.1} tok/s, {re:.2}x (goal: within 10%, >= 0.90x)",
        engine_f32.idle.median, ours_f32.idle.median
    );
    println!(
        "RESULT decode engine_single_stream_tok_s_f32 ours={:.2} peer={:.2} ratio={re:.2}",
        engine_f32.idle.median, ours_f32.idle.median
    );
    let r32 = ratio(ours_f32.idle.median, hf_f32.idle.median);
    let r16 = ratio(ours_bf16.idle.median, hf_bf16.idle.median);
    let rx = ratio(ours_bf16.idle.median, hf_f32.idle.median);
    println!();
    println!("ratio f32 vs f32:  {r32:.2}x   ratio bf16 vs bf16: {r16:.2}x   ours bf16 vs HF f32: {rx:.2}x   (goal >= 1.5x)");
    println!(
        "RESULT decode single_stream_tok_s_f32 ours={:.2} peer={:.2} ratio={r32:.2}",
        ours_f32.idle.median, hf_f32.idle.median
    );
    println!(
        "RESULT decode single_stream_tok_s_bf16 ours={:.2} peer={:.2} ratio={r16:.2}",
        ours_bf16.idle.median, hf_bf16.idle.median
    );
    for (name, o, p) in [
        ("f32", &ours_f32, &hf_f32),
        ("bf16", &ours_bf16, &hf_bf16),
        ("engine_f32", &engine_f32, &ours_f32),
    ] {
        println!(
            "RESULT decode contended_tok_s_{name} ours={:.2} peer={:.2} ratio={:.2}",
            o.busy.median,
            p.busy.median,
            ratio(o.busy.median, p.busy.median)
        );
        println!(
            "RESULT decode contended_kept_{name} ours={:.3} peer={:.3} ratio={:.2}",
            o.kept(),
            p.kept(),
            ratio(o.kept(), p.kept())
        );
    }
    Ok(())
}
