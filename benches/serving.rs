//! `cargo bench --bench serving`: generation throughput of the engine (continuous
//! batching, SmolLM2-135M-Instruct) at concurrency 1, 8, 32 and 64, 128 new tokens per
//! request, against HF transformers' batched `generate` on the same prompt ids, same
//! machine, same run; plus time to first token (p50, p99) at each concurrency. Two
//! precisions: float32 on both sides, then bfloat16 weights on both sides (ours keeps
//! float32 activations; see src/model/llama.rs). float32 runs first: a bfloat16 model on
//! CPU sets LibTorch to one intra-op thread for the rest of the process.
//!
//! Ours: all requests of a level are submitted at once to the engine thread (the same
//! engine `agentjet-peer serve` runs, without HTTP); tokens/s is (requests x 128) / wall
//! time until the last one finishes. HF: one batch of the same prompts, left-padded;
//! its first token arrives for the whole batch at once, so its p50 and p99 are the same.
//!
//! `-- --model SPEC` runs another model on both sides (a GGUF file or an HF directory;
//! default `smollm2`), e.g. a random-weight copy of SmolLM2 made by
//! `benches/random_model.py` where the real weights cannot be copied.

use std::time::{Duration, Instant};

use agentjet::engine::{spawn_engine, EngineConfig, EngineEvent, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::{ChatRequest, ModelSource};
use serde_json::json;

mod peer;

const NEW_TOKENS: usize = 128;
const LEVELS: [usize; 4] = [1, 8, 32, 64];

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn main() {
    if let Err(e) = run() {
        eprintln!("serving bench failed: {e:#}");
        std::process::exit(1);
    }
}

type Level = (usize, f64, f64, f64);

/// Our engine at every level: (concurrency, tok/s, ttft p50, ttft p99).
fn ours(source: &ModelSource, dtype: DType, prompts: &[Vec<u32>]) -> anyhow::Result<Vec<Level>> {
    let loaded = load_model(source, tch::Device::cuda_if_available(), dtype)?;
    let engine = spawn_engine(
        loaded.model,
        EngineConfig {
            max_batch: 64,
            max_queue: 256,
            max_kv_positions: 64 * 256,
            ..EngineConfig::default()
        },
    )?;
    // Warm-up.
    let mut rx = engine.submit(GenerateRequest {
        prompt: prompts[0].clone(),
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    })?;
    while let Some(ev) = rx.blocking_recv() {
        if !matches!(ev, EngineEvent::Token { .. }) {
            break;
        }
    }
    let mut out = Vec::new();
    for &c in &LEVELS {
        let t0 = Instant::now();
        let rxs: Vec<_> = (0..c)
            .map(|i| {
                engine.submit(GenerateRequest {
                    prompt: prompts[i].clone(),
                    max_tokens: NEW_TOKENS,
                    sampling: SamplingParams::greedy(),
                    ..Default::default()
                })
            })
            .collect::<Result<_, _>>()?;
        let handles: Vec<_> = rxs
            .into_iter()
            .map(|mut rx| {
                std::thread::spawn(move || {
                    let mut first = None;
                    let mut n = 0;
                    while let Some(ev) = rx.blocking_recv() {
                        match ev {
                            EngineEvent::Token { .. } => {
                                n += 1;
                                first.get_or_insert_with(|| t0.elapsed());
                            }
                            EngineEvent::Finished { .. } => break,
                            EngineEvent::Failed(e) => panic!("request failed: {e}"),
                        }
                    }
                    (first.unwrap_or(Duration::ZERO), n)
                })
            })
            .collect();
        let res: Vec<(Duration, usize)> = handles
            .into_iter()
            .map(|h| h.join().expect("collector"))
            .collect();
        let wall = t0.elapsed().as_secs_f64();
        let tokens: usize = res.iter().map(|r| r.1).sum();
        anyhow::ensure!(
            tokens == c * NEW_TOKENS,
            "got {tokens} tokens, expected {}",
            c * NEW_TOKENS
        );
        let mut ttft: Vec<f64> = res.iter().map(|r| r.0.as_secs_f64()).collect();
        out.push((
            c,
            tokens as f64 / wall,
            percentile(&mut ttft, 0.5),
            percentile(&mut ttft, 0.99),
        ));
        println!(
            "  ours {dtype:?} c={c}: {:.1} tok/s in {wall:.1}s",
            tokens as f64 / wall
        );
    }
    Ok(out)
}

fn hf(
    python: &str,
    source: &ModelSource,
    prompts: &[Vec<u32>],
    dtype: &str,
) -> anyhow::Result<serde_json::Value> {
    let (dir, file) = peer::hf_model_args(source);
    peer::run_peer(
        python,
        "hf_serving.py",
        &[
            dir,
            file,
            serde_json::to_string(prompts)?,
            NEW_TOKENS.to_string(),
            serde_json::to_string(&LEVELS)?,
            dtype.to_string(),
        ],
    )
}

fn report(prec: &str, ours: &[Level], hf: &serde_json::Value) {
    println!("\n{prec}:");
    println!(
        "| concurrency | ours tok/s | HF tok/s | ratio | ours TTFT p50 / p99 (s) | HF TTFT (s) |"
    );
    println!(
        "|-------------|------------|----------|-------|-------------------------|-------------|"
    );
    let mut lines = Vec::new();
    for &(c, tps, p50, p99) in ours {
        let h = &hf[c.to_string()];
        let htps = h["tok_s"].as_f64().unwrap_or(0.0);
        let httft = h["ttft_s"].as_f64().unwrap_or(0.0);
        let ratio = if htps > 0.0 { tps / htps } else { 0.0 };
        println!(
            "| {c:>11} | {tps:>10.1} | {htps:>8.1} | {ratio:>4.2}x | {p50:>11.3} / {p99:<11.3} | {httft:>11.3} |"
        );
        let r50 = if p50 > 0.0 { httft / p50 } else { 0.0 };
        let r99 = if p99 > 0.0 { httft / p99 } else { 0.0 };
        lines.push(format!(
            "RESULT serving tok_s_{prec}_c{c} ours={tps:.2} peer={htps:.2} ratio={ratio:.2}"
        ));
        lines.push(format!(
            "RESULT serving ttft_p50_s_{prec}_c{c} ours={p50:.4} peer={httft:.4} ratio={r50:.2}"
        ));
        lines.push(format!(
            "RESULT serving ttft_p99_s_{prec}_c{c} ours={p99:.4} peer={httft:.4} ratio={r99:.2}"
        ));
    }
    for l in lines {
        println!("{l}");
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let spec = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| "smollm2".into());
    let source = ModelSource::resolve(&spec)?;
    let python = peer::reference_python(matches!(source, ModelSource::Gguf(_)))?;
    let card = agentjet::model::ModelCard::load(&source)?;
    let tmpl = card.chat_template("smollm2")?;
    let topics = [
        "a robot",
        "the sea",
        "a lost key",
        "autumn",
        "a small town",
        "a violin",
        "the moon",
        "a train",
    ];
    let prompts: Vec<Vec<u32>> = (0..64)
        .map(|i| {
            let m = vec![json!({"role": "user", "content": format!("Write a story about {} (number {i}).", topics[i % topics.len()])})];
            let text = tmpl.render(&ChatRequest {
                messages: &m,
                add_generation_prompt: true,
                ..Default::default()
            })?;
            Ok(card.tokenizer.encode(&text)?)
        })
        .collect::<anyhow::Result<_>>()?;
    println!(
        "serving bench: {} on {:?}, {NEW_TOKENS} new tokens per request, prompts of {}-{} tokens",
        source.display_name(),
        tch::Device::cuda_if_available(),
        prompts.iter().map(|p| p.len()).min().unwrap_or(0),
        prompts.iter().map(|p| p.len()).max().unwrap_or(0)
    );
    let ours_f32 = ours(&source, DType::F32, &prompts)?;
    let hf_f32 = hf(&python, &source, &prompts, "float32")?;
    let hf_bf16 = hf(&python, &source, &prompts, "bfloat16")?;
    let ours_bf16 = ours(&source, DType::BF16, &prompts)?;
    println!("\ngoals: >= 3x HF at concurrency 32, >= 1.5x at concurrency 1");
    report("f32", &ours_f32, &hf_f32);
    report("bf16", &ours_bf16, &hf_bf16);
    let vs = |c: usize| {
        let o = ours_bf16
            .iter()
            .find(|l| l.0 == c)
            .map(|l| l.1)
            .unwrap_or(0.0);
        let h = hf_f32[c.to_string()]["tok_s"].as_f64().unwrap_or(0.0);
        if h > 0.0 {
            o / h
        } else {
            0.0
        }
    };
    println!(
        "\nours bf16 vs HF f32: c1 {:.2}x, c8 {:.2}x, c32 {:.2}x, c64 {:.2}x",
        vs(1),
        vs(8),
        vs(32),
        vs(64)
    );
    Ok(())
}
