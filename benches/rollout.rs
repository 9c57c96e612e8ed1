//! `cargo bench --bench rollout`: agentic rollouts as live episodes, the AppWorld-shaped
//! trace of `actor_update` replayed through the engine: groups of 8 episodes that share a
//! 600-token task prompt, 12 turns each, 30 environment tokens and 10 generated tokens
//! per turn (greedy, fixed length: no stop token, so every side does the same work), 16
//! episodes at once (two groups). SmolLM2-135M-Instruct, float32, same machine, same run:
//!
//! - ours with the prefix cache (the engine's defaults);
//! - ours with it off (`prefix_cache_bytes: 0`);
//! - ours with the cache and one weight update half-way (what a training step costs the
//!   cache: everything cached is dropped and recomputed on the next calls);
//! - HF transformers running the same episode loop by hand: each turn, the 16 prompts
//!   left-padded into one batch and `generate` (benches/hf_rollout.py).
//!
//! Ours runs one thread per episode, each submitting its calls to the engine (the same
//! engine `serve` and `--role server` run, without HTTP) as an agent does: the next call
//! only after the last answer. Reports episodes per minute, prompt tokens computed by
//! prefill (against the trace's unique prompt tokens), and p50/p99 time per call; the
//! greedy answers of every side are compared token by token.
//!
//! Flags (after `--`): `--turns N` (default 12), `--skip-hf`, `--skip-nocache`,
//! `--model SPEC` (default smollm2).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use agentjet::base::Rng;
use agentjet::engine::prefix::{PrefixTree, Span};
use agentjet::engine::{spawn_engine, EngineConfig, EngineEvent, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::ModelSource;

mod peer;

const GROUPS: usize = 2;
const GROUP_SIZE: usize = 8;
const TASK_TOKENS: usize = 600;
const ENV_TOKENS: usize = 30;
const NEW_TOKENS: usize = 10;

#[derive(serde::Serialize)]
struct Episode {
    task: Vec<u32>,
    env: Vec<Vec<u32>>,
}

fn trace(turns: usize) -> Vec<Episode> {
    let mut rng = Rng::seeded(2026);
    let mut ids = |n: usize| -> Vec<u32> {
        // Ordinary text tokens of SmolLM2's vocabulary (no special ids).
        (0..n)
            .map(|_| 1000 + (rng.next_u64() % 39_000) as u32)
            .collect()
    };
    let mut out = Vec::new();
    for _ in 0..GROUPS {
        let task = ids(TASK_TOKENS);
        for _ in 0..GROUP_SIZE {
            out.push(Episode {
                task: task.clone(),
                env: (0..turns).map(|_| ids(ENV_TOKENS)).collect(),
            });
        }
    }
    out
}

/// Counts positions only (to size the trace's prompt tree).
struct Count(usize);
impl Span for Count {
    type Error = ();
    fn bytes(&self) -> usize {
        self.0
    }
    fn split_off(&mut self, at: usize) -> Result<Count, ()> {
        let tail = Count(self.0 - at);
        self.0 = at;
        Ok(tail)
    }
}

/// Distinct prompt tokens of the episodes as run: every prompt is a prefix of its
/// episode's last one, so that is the size of the tree of last prompts.
fn unique_prompt_tokens(trace: &[Episode], answers: &[Vec<Vec<u32>>]) -> usize {
    let mut tree = PrefixTree::new(usize::MAX);
    for (ep, ans) in trace.iter().zip(answers) {
        let last = last_prompt(ep, ans);
        let _ = tree.insert(&last, |_, n| Ok(Count(n)));
    }
    tree.positions()
}

fn last_prompt(ep: &Episode, ans: &[Vec<u32>]) -> Vec<u32> {
    let mut p = ep.task.clone();
    for (t, env) in ep.env.iter().enumerate() {
        if t > 0 {
            p.extend(&ans[t - 1]);
        }
        p.extend(env);
    }
    p
}

struct Side {
    name: String,
    wall_s: f64,
    call_s: Vec<f64>,
    prefill_tokens: u64,
    reused_tokens: u64,
    answers: Vec<Vec<Vec<u32>>>,
}

impl Side {
    fn episodes_per_min(&self) -> f64 {
        self.answers.len() as f64 / (self.wall_s / 60.0)
    }
    fn call(&self, p: f64) -> f64 {
        let mut v = self.call_s.clone();
        v.sort_by(f64::total_cmp);
        v[(((v.len() - 1) as f64) * p).round() as usize]
    }
}

fn ours(
    source: &ModelSource,
    trace: &Arc<Vec<Episode>>,
    name: &str,
    prefix_cache_bytes: usize,
    update_half_way: bool,
) -> anyhow::Result<Side> {
    let device = tch::Device::cuda_if_available();
    let engine = spawn_engine(
        load_model(source, device, DType::F32)?.model,
        EngineConfig {
            prefix_cache_bytes,
            ..EngineConfig::default()
        },
    )?;
    // Warm-up, on tokens the trace never uses.
    let mut rx = engine.submit(GenerateRequest {
        prompt: (5..40).collect(),
        max_tokens: 2,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    })?;
    while let Some(EngineEvent::Token { .. }) = rx.blocking_recv() {}
    // The same weights again, as a training step would hand over new ones.
    let params = if update_half_way {
        Some(load_model(source, device, DType::F32)?.model)
    } else {
        None
    };
    let s = &engine.stats;
    let (prefill0, reused0) = (
        s.prefill_tokens.load(Relaxed),
        s.prefix_reused_tokens.load(Relaxed),
    );
    let (prefill_us0, copy_us0) = (
        s.prefill_micros.load(Relaxed),
        s.prefix_copy_micros.load(Relaxed),
    );
    let turns = trace[0].env.len();
    let t0 = Instant::now();
    let threads: Vec<_> = (0..trace.len())
        .map(|e| {
            let (engine, trace) = (engine.clone(), trace.clone());
            std::thread::spawn(move || -> anyhow::Result<(Vec<Vec<u32>>, Vec<f64>)> {
                let ep = &trace[e];
                let mut prompt = ep.task.clone();
                let (mut answers, mut times) = (Vec::new(), Vec::new());
                for t in 0..turns {
                    prompt.extend(&ep.env[t]);
                    let t1 = Instant::now();
                    let mut rx = engine.submit(GenerateRequest {
                        prompt: prompt.clone(),
                        max_tokens: NEW_TOKENS,
                        sampling: SamplingParams::greedy(),
                        ..Default::default()
                    })?;
                    let mut got = Vec::new();
                    loop {
                        match rx.blocking_recv() {
                            Some(EngineEvent::Token { id, .. }) => got.push(id),
                            Some(EngineEvent::Finished { .. }) => break,
                            Some(EngineEvent::Failed(m)) => anyhow::bail!("call failed: {m}"),
                            None => anyhow::bail!("the engine stopped"),
                        }
                    }
                    times.push(t1.elapsed().as_secs_f64());
                    prompt.extend(&got);
                    answers.push(got);
                }
                Ok((answers, times))
            })
        })
        .collect();
    if let Some(model) = &params {
        // Half the calls done: new weights arrive.
        let half = (trace.len() * turns / 2) as u64;
        while s.completed.load(Relaxed) < half + 1 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let t = Instant::now();
        engine.update_weights(&model.parameters(), 1)?;
        println!(
            "  {name}: weight update after {half} calls took {:.3}s and dropped {} cached positions",
            t.elapsed().as_secs_f64(),
            s.prefix_invalidated_positions.load(Relaxed)
        );
    }
    let mut answers = Vec::new();
    let mut call_s = Vec::new();
    for h in threads {
        let (a, t) = h
            .join()
            .map_err(|_| anyhow::anyhow!("an episode thread panicked"))??;
        answers.push(a);
        call_s.extend(t);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let side = Side {
        name: name.into(),
        wall_s,
        call_s,
        prefill_tokens: s.prefill_tokens.load(Relaxed) - prefill0,
        reused_tokens: s.prefix_reused_tokens.load(Relaxed) - reused0,
        answers,
    };
    // The engine publishes its memory after the last step's answers went out.
    std::thread::sleep(std::time::Duration::from_millis(200));
    println!(
        "  {name}: prefill passes took {:.2}s; copying keys and values into and out of the prefix cache {:.2}s",
        (s.prefill_micros.load(Relaxed) - prefill_us0) as f64 / 1e6,
        (s.prefix_copy_micros.load(Relaxed) - copy_us0) as f64 / 1e6
    );
    println!(
        "  {name}: {} episodes in {wall_s:.1}s, {} prompt tokens prefilled, {} reused; KV held \
         idle after: {:.1} MB (prefix cache {:.1} MB)",
        side.answers.len(),
        side.prefill_tokens,
        side.reused_tokens,
        s.kv_allocated_bytes.load(Relaxed) as f64 / 1e6,
        s.prefix_bytes.load(Relaxed) as f64 / 1e6
    );
    Ok(side)
}

fn hf(python: &str, source: &ModelSource, trace: &[Episode]) -> anyhow::Result<Side> {
    let (dir, file) = peer::hf_model_args(source);
    let path = std::env::temp_dir().join(format!("agentjet-rollout-{}.json", std::process::id()));
    std::fs::write(
        &path,
        serde_json::to_vec(&serde_json::json!({
            "episodes": trace,
            "new_tokens": NEW_TOKENS,
            "concurrency": trace.len(),
        }))?,
    )?;
    let out = peer::run_peer(
        python,
        "hf_rollout.py",
        &[dir, file, path.display().to_string(), "float32".into()],
    );
    let _ = std::fs::remove_file(&path);
    let v = out?;
    let side = Side {
        name: "HF generate".into(),
        wall_s: v["wall_s"].as_f64().unwrap_or(f64::NAN),
        call_s: serde_json::from_value(v["call_s"].clone())?,
        prefill_tokens: v["prefill_tokens"].as_u64().unwrap_or(0),
        reused_tokens: 0,
        answers: serde_json::from_value(v["answers"].clone())?,
    };
    println!(
        "  HF: {} episodes in {:.1}s, {} prompt positions computed (padded batches)",
        side.answers.len(),
        side.wall_s,
        side.prefill_tokens
    );
    Ok(side)
}

/// Answer tokens equal between two sides, of all.
fn agreement(a: &Side, b: &Side) -> (usize, usize) {
    let mut same = 0;
    let mut all = 0;
    for (x, y) in a.answers.iter().zip(&b.answers) {
        for (p, q) in x.iter().zip(y) {
            all += p.len();
            // Count up to the first difference of each call: later tokens follow from it.
            same += p.iter().zip(q).take_while(|(i, j)| i == j).count();
        }
    }
    (same, all)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("rollout bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let turns: usize = value("--turns")
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(12);
    let spec = value("--model").unwrap_or_else(|| "smollm2".into());
    let source = ModelSource::resolve(&spec)?;
    let python = if flag("--skip-hf") {
        None
    } else {
        Some(peer::reference_python(matches!(
            source,
            ModelSource::Gguf(_)
        ))?)
    };
    let trace = Arc::new(trace(turns));
    println!(
        "rollout bench: {} on {:?}; {GROUPS} groups x {GROUP_SIZE} episodes at once, {turns} turns, \
         task prompt {TASK_TOKENS}, {ENV_TOKENS} env + {NEW_TOKENS} generated tokens per turn",
        source.display_name(),
        tch::Device::cuda_if_available()
    );
    let cached = ours(&source, &trace, "ours, prefix cache", 1 << 30, false)?;
    let updated = ours(
        &source,
        &trace,
        "ours, cache + 1 weight update",
        1 << 30,
        true,
    )?;
    let cold = if flag("--skip-nocache") {
        None
    } else {
        Some(ours(&source, &trace, "ours, no cache", 0, false)?)
    };
    let hf = match &python {
        Some(p) => Some(hf(p, &source, &trace)?),
        None => None,
    };
    let unique = unique_prompt_tokens(&trace, &cached.answers);
    println!("\nunique prompt tokens in the trace: {unique}");
    println!("| side | episodes/min | prefill tokens | x unique | call p50 (s) | call p99 (s) |");
    println!("|------|--------------|----------------|----------|--------------|--------------|");
    let sides: Vec<&Side> = [Some(&cached), Some(&updated), cold.as_ref(), hf.as_ref()]
        .into_iter()
        .flatten()
        .collect();
    for s in &sides {
        println!(
            "| {} | {:.2} | {} | {:.2} | {:.3} | {:.3} |",
            s.name,
            s.episodes_per_min(),
            s.prefill_tokens,
            s.prefill_tokens as f64 / unique as f64,
            s.call(0.5),
            s.call(0.99)
        );
    }
    for s in &sides[1..] {
        let (same, all) = agreement(&cached, s);
        println!(
            "greedy answer tokens equal to '{}': {same} of {all}",
            s.name
        );
    }
    println!("\ngoals: >= 5x HF's episodes/min, >= 3x ours without the cache, prefill within 1.2x of unique");
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let e = cached.episodes_per_min();
    if let Some(h) = &hf {
        let p = h.episodes_per_min();
        println!(
            "RESULT rollout episodes_per_min_vs_hf ours={e:.3} peer={p:.3} ratio={:.2}",
            ratio(e, p)
        );
        println!(
            "RESULT rollout call_p50_s_vs_hf ours={:.4} peer={:.4} ratio={:.2}",
            cached.call(0.5),
            h.call(0.5),
            ratio(h.call(0.5), cached.call(0.5))
        );
        println!(
            "RESULT rollout call_p99_s_vs_hf ours={:.4} peer={:.4} ratio={:.2}",
            cached.call(0.99),
            h.call(0.99),
            ratio(h.call(0.99), cached.call(0.99))
        );
        println!(
            "RESULT rollout prefill_tokens_vs_hf ours={} peer={} ratio={:.2}",
            cached.prefill_tokens,
            h.prefill_tokens,
            ratio(h.prefill_tokens as f64, cached.prefill_tokens as f64)
        );
    }
    if let Some(c) = &cold {
        let p = c.episodes_per_min();
        println!(
            "RESULT rollout episodes_per_min_vs_nocache ours={e:.3} peer={p:.3} ratio={:.2}",
            ratio(e, p)
        );
        println!(
            "RESULT rollout prefill_tokens_vs_nocache ours={} peer={} ratio={:.2}",
            cached.prefill_tokens,
            c.prefill_tokens,
            ratio(c.prefill_tokens as f64, cached.prefill_tokens as f64)
        );
    }
    println!(
        "RESULT rollout prefill_over_unique ours={:.3}",
        cached.prefill_tokens as f64 / unique as f64
    );
    println!(
        "RESULT rollout weight_update_extra_s ours={:.3}",
        updated.wall_s - cached.wall_s
    );
    println!(
        "RESULT rollout weight_update_extra_prefill_tokens ours={}",
        updated.prefill_tokens as i64 - cached.prefill_tokens as i64
    );
    Ok(())
}
