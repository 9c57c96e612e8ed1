//! `cargo bench --bench models`: the 2026 families against HF transformers 5.x on the same
//! machine, in the same run, on random-weight models of the real shapes
//! (`benches/hf_models.py build`: Qwen3-0.6B's and Qwen3.5-0.8B's configs with their layer
//! counts, widths and vocabularies; a small Qwen3-MoE, since the real ones do not fit a
//! 2-core, 24 GB machine):
//!
//! - decode tok/s of Qwen3-0.6B and Qwen3.5-0.8B shapes at 1 and 8 streams, float32 and
//!   bfloat16 (ours: the engine, every stream greedy to its length; HF: `generate` on a
//!   batch of the same prompt lengths). Decode rate = streams x (new tokens - 1) / (time of
//!   the run - time of a one-token run), on both sides;
//! - the rollout bench's shape of multi-turn episodes (sessions of several turns, each
//!   turn's prompt the previous one, the answer and new environment tokens) on the
//!   Qwen3.5 shape: episodes/min with our prefix cache against without it (no HF peer:
//!   HF has no cross-request cache);
//! - a training step's tokens/s, forward + backward of the same rows (float32), ours
//!   against HF's autograd, for each family.
//!
//! The models are written under `$AGENTJET_BENCH_MODELS` (default: the system temp dir)
//! once and reused. float32 runs come first: a bfloat16 model on the CPU sets LibTorch to
//! one intra-op thread for the rest of the process. Needs `bash bootstrap/setup.sh
//! --reference`. `--quick` halves the lengths.

use std::path::{Path, PathBuf};
use std::time::Instant;

use agentjet::engine::{
    spawn_engine, EngineConfig, EngineEvent, EngineHandle, GenerateRequest, SamplingParams,
};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use tch::{Device, Kind, Tensor};

#[allow(dead_code)] // not its hf_model_args
mod peer;

struct Lengths {
    new_tokens: usize,
    prompt: usize,
    train_seqs: usize,
    train_tokens: usize,
    sessions: usize,
    turns: usize,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("models bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let len = if quick {
        Lengths {
            new_tokens: 8,
            prompt: 32,
            train_seqs: 2,
            train_tokens: 32,
            sessions: 2,
            turns: 3,
        }
    } else {
        Lengths {
            new_tokens: 16,
            prompt: 64,
            train_seqs: 2,
            train_tokens: 64,
            sessions: 4,
            turns: 4,
        }
    };
    let python = peer::reference_python(false)?;
    let root = std::env::var_os("AGENTJET_BENCH_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("agentjet-bench-models");
    let model = |family: &str| -> anyhow::Result<PathBuf> {
        let dir = root.join(family);
        if !dir.join("model.safetensors").is_file() {
            std::fs::create_dir_all(&dir)?;
            let out = peer::run_peer(
                &python,
                "hf_models.py",
                &["build".into(), family.into(), dir.display().to_string()],
            )?;
            println!("built {family}: {} parameters", out["parameters"]);
        }
        Ok(dir)
    };
    let mut results = Vec::new();
    let decoders = ["qwen3_0_6b", "qwen3_5_0_8b"];
    // float32 first (see the module doc).
    for family in decoders {
        let dir = model(family)?;
        for streams in [1, 8] {
            results.push(decode(&python, family, &dir, DType::F32, streams, &len)?);
        }
    }
    results.push(multi_turn(&model("qwen3_5_0_8b")?, &len)?);
    for family in ["qwen3_0_6b", "qwen3_moe_small", "qwen3_5_0_8b"] {
        results.push(train(&python, family, &model(family)?, &len)?);
    }
    for family in decoders {
        let dir = model(family)?;
        for streams in [1, 8] {
            results.push(decode(&python, family, &dir, DType::BF16, streams, &len)?);
        }
    }
    println!();
    for r in results {
        println!("{r}");
    }
    Ok(())
}

fn load(dir: &Path, dtype: DType) -> anyhow::Result<Llama> {
    Ok(load_model(&ModelSource::HfDir(dir.to_path_buf()), Device::Cpu, dtype)?.model)
}

/// Random prompt ids (the same on both sides is not needed: decode speed is the shape's).
fn prompt(seed: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|t| 300 + ((t * 7919 + seed * 104_729) % 100_000) as u32)
        .collect()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        seed: None,
        // Fixed lengths: no stop token (HF: min_new_tokens).
        stop_token_ids: vec![],
        top_logprobs: 0,
        constraint: None,
        adapter: None,
    }
}

/// Runs `reqs` at once on `engine` to their ends; returns the tokens generated.
fn run_all(engine: &EngineHandle, reqs: Vec<GenerateRequest>) -> anyhow::Result<Vec<Vec<u32>>> {
    let rxs = reqs
        .into_iter()
        .map(|r| engine.submit(r))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::new();
    for mut rx in rxs {
        let mut toks = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(EngineEvent::Token { id, .. }) => toks.push(id),
                Some(EngineEvent::Finished { .. }) | None => break,
                Some(EngineEvent::Failed(e)) => anyhow::bail!("request failed: {e}"),
            }
        }
        out.push(toks);
    }
    Ok(out)
}

fn engine(model: Llama, prefix_cache_bytes: usize) -> anyhow::Result<EngineHandle> {
    Ok(spawn_engine(
        model,
        EngineConfig {
            max_batch: 8,
            max_queue: 64,
            max_kv_positions: 8 * 1024,
            prefix_cache_bytes,
            ..EngineConfig::default()
        },
    )?)
}

fn decode(
    python: &str,
    family: &str,
    dir: &Path,
    dtype: DType,
    streams: usize,
    len: &Lengths,
) -> anyhow::Result<String> {
    let e = engine(load(dir, dtype)?, 0)?;
    let batch = |n: usize| -> Vec<GenerateRequest> {
        (0..streams)
            .map(|s| greedy(prompt(s, len.prompt), n))
            .collect()
    };
    run_all(&e, batch(2))?; // warm-up
    let t = Instant::now();
    run_all(&e, batch(1))?;
    let first = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let got = run_all(&e, batch(len.new_tokens))?;
    let all = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        got.iter().all(|g| g.len() == len.new_tokens),
        "a stream stopped early"
    );
    let ours = (streams * (len.new_tokens - 1)) as f64 / (all - first);
    drop(e);
    let name = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
    };
    let hf = peer::run_peer(
        python,
        "hf_models.py",
        &[
            "decode".into(),
            dir.display().to_string(),
            name.into(),
            streams.to_string(),
            len.new_tokens.to_string(),
            len.prompt.to_string(),
        ],
    )?["decode_tok_s"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let metric = format!(
        "decode_{family}_{}_{streams}",
        if dtype == DType::F32 { "f32" } else { "bf16" }
    );
    println!("{metric}: ours {ours:.2} tok/s, HF {hf:.2} tok/s");
    Ok(format!(
        "RESULT models {metric} ours={ours:.3} peer={hf:.3} ratio={:.3}",
        ours / hf
    ))
}

/// Sessions of `turns` turns side by side: each turn's prompt is the previous prompt, the
/// answer and 16 tokens of "environment". Episodes/min with the prefix cache and without.
fn multi_turn(dir: &Path, len: &Lengths) -> anyhow::Result<String> {
    let rate = |cache: usize| -> anyhow::Result<f64> {
        let e = engine(load(dir, DType::F32)?, cache)?;
        let t = Instant::now();
        let handles: Vec<_> = (0..len.sessions)
            .map(|s| {
                let e = e.clone();
                let (turns, new, first) =
                    (len.turns, len.new_tokens, prompt(s + 100, 4 * len.prompt));
                std::thread::spawn(move || -> anyhow::Result<()> {
                    let mut p = first;
                    for turn in 0..turns {
                        let answer = run_all(&e, vec![greedy(p.clone(), new)])?.remove(0);
                        p.extend(answer);
                        p.extend(prompt(1000 + 17 * s + turn, 16));
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a session panicked"))??;
        }
        Ok(len.sessions as f64 / (t.elapsed().as_secs_f64() / 60.0))
    };
    let cached = rate(1 << 30)?;
    let cold = rate(0)?;
    println!(
        "multi-turn on qwen3_5_0_8b ({} sessions x {} turns): {cached:.2} episodes/min with the prefix cache, {cold:.2} without",
        len.sessions, len.turns
    );
    Ok(format!(
        "RESULT models multi_turn_qwen3_5_0_8b_episodes_per_min ours={cached:.3} peer={cold:.3} ratio={:.3}",
        cached / cold
    ))
}

/// Timed training steps per side (after one warm-up); the median is reported.
const TRAIN_ROUNDS: usize = 3;

/// Forward + backward of `train_seqs` sequences of `train_tokens` tokens (one packed row),
/// the mean token log-likelihood's gradient, float32; tokens/s of the median of
/// `TRAIN_ROUNDS` steps (gradients zeroed outside the clock on both sides).
fn train(python: &str, family: &str, dir: &Path, len: &Lengths) -> anyhow::Result<String> {
    let mut m = load(dir, DType::F32)?;
    m.set_trainable(true);
    let (n, t) = (len.train_seqs, len.train_tokens as i64);
    let ids: Vec<i64> = (0..n)
        .flat_map(|s| prompt(s + 7, t as usize))
        .map(i64::from)
        .collect();
    let positions: Vec<i64> = (0..n).flat_map(|_| 0..t).collect();
    let parent: Vec<i32> = (0..n)
        .flat_map(|s| {
            (0..t as i32).map(move |i| {
                if i == 0 {
                    -1
                } else {
                    (s as i32) * t as i32 + i - 1
                }
            })
        })
        .collect();
    let ids_t = Tensor::from_slice(&ids);
    let pos_t = Tensor::from_slice(&positions);
    let zero = || {
        for p in m.parameters() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    };
    let step = || -> anyhow::Result<()> {
        let logits = m.forward_row(&ids_t, &pos_t, &parent, None)?;
        // Each sequence's tokens 1.. given the ones before.
        let rows: Vec<i64> = (0..n as i64)
            .flat_map(|s| (0..t - 1).map(move |i| s * t + i))
            .collect();
        let next: Vec<i64> = rows.iter().map(|&r| ids[r as usize + 1]).collect();
        let lp = logits
            .index_select(0, &Tensor::from_slice(&rows))
            .log_softmax(-1, Kind::Float)
            .gather(1, &Tensor::from_slice(&next).unsqueeze(1), false);
        (-lp.mean(Kind::Float)).backward();
        Ok(())
    };
    step()?; // warm-up
    let mut times = Vec::new();
    for _ in 0..TRAIN_ROUNDS {
        zero(); // outside the clock, as HF's zero_grad
        let t0 = Instant::now();
        step()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let ours = (n as i64 * t) as f64 / times[times.len() / 2];
    drop(m);
    let hf = peer::run_peer(
        python,
        "hf_models.py",
        &[
            "train".into(),
            dir.display().to_string(),
            n.to_string(),
            t.to_string(),
        ],
    )?["train_tok_s"]
        .as_f64()
        .unwrap_or(f64::NAN);
    println!("train step {family}: ours {ours:.1} tok/s, HF {hf:.1} tok/s");
    Ok(format!(
        "RESULT models train_{family}_tok_s ours={ours:.3} peer={hf:.3} ratio={:.3}",
        ours / hf
    ))
}
