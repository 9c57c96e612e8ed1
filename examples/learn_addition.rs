//! `cargo run --release --example learn_addition [-- FLAGS]`: GRPO on 2-digit addition with
//! SmolLM2-135M-Instruct, through the same engine (continuous batching, policy versions)
//! and trainer (tree-packed timelines, chunked logprobs, AdamW) a server runs.
//!
//! Each step samples `--tasks` additions `a + b` (a, b in 10..=99, from `--seed`), asks each
//! `--group` times at `--temperature` / `--top-p` ("What is a + b? Answer with the number
//! only.", chat template, at most `--max-tokens`), rewards 1 when the last number in the
//! answer is a + b (else 0: the model tends to restate the operands before answering), and
//! takes one GRPO step on the groups with signal (`--ppo-epochs` passes over
//! `--mini-batches` mini-batches: one update each); the engine serves the new weights from
//! its next decode step. Every sampled token is trained under the distribution it was
//! drawn from (logits / T, the nucleus). With `--dynamic N` (DAPO's dynamic sampling), a
//! step whose groups all agreed (no signal) in more than what `--tasks` needs samples more
//! tasks, up to N extra rounds, so each step trains on `--tasks` groups with signal. With
//! `--replay F`, a fraction F of each round's tasks is drawn again from recent training
//! tasks that the model did not answer right in every sample (a curriculum on the
//! additions it still gets wrong: carries; never a held-out pair). A held-out set (`--eval` tasks, from
//! another seed, never trained on) is answered greedily before training, every
//! `--eval-every` steps and at the end: that accuracy is the result.
//!
//! The run directory (`--run-dir`, default `runs/learn_addition`) gets `metrics.jsonl`
//! (one line per step), `checkpoint/` (every `--checkpoint-every` steps and on SIGTERM;
//! `--resume` continues from it) and `reward.svg` (training reward and held-out accuracy
//! by step), `heldout.json` (the held-out pairs, for a side-by-side run of another
//! trainer) and `heldout_wrong.txt` (the last evaluation's wrong answers). Each
//! evaluation also prints `EVAL train_minutes=.. accuracy=.. step=..`, the
//! minutes counted from the first step without the evaluations' own time. The run stops
//! after `--steps` steps, `--minutes` of wall time or `--train-minutes` of training.
//!
//! ```text
//! --steps N [1000]  --minutes M [60]  --tasks N [8]  --group N [8]  --lr X [1e-5; 1e-4 with --lora-rank]
//! --max-tokens N [32]  --eval N [100]  --eval-every N [25]  --checkpoint-every N [25]
//! --eval-dense N [0]  (also evaluate after each of the first N steps, where the curve
//!   moves fastest)
//! --seed N [0]  --run-dir DIR  --resume  --loss grpo|dr_grpo|rloo [grpo]
//! --temperature X [1.2]  --top-p X [1.0]  --ppo-epochs N [2]  --mini-batches N [1]
//! --entropy-coef X [0]  --clip-high X [0.28]  --dynamic N [3]  --replay F [0]
//! --train-minutes M [11/12 of --minutes]  (stop after M minutes of training, held-out
//!   evaluations not counted)
//! --warmup-steps N [5]  (linear learning-rate warmup over the first N steps)
//! --lr-min-ratio R [0.1]  (cosine decay of the learning rate by training time, from --lr
//!   to R x --lr at the end of --train-minutes; 1: constant. Counted from this process's
//!   start, so a --resume decays again over its own budget)
//! --bf16  (train with bfloat16 matrix products over float32 master weights)
//! --engine-dtype f32|bf16 [f32]  (the sampling engine's weights, as `serve --dtype`; the
//!   trainer keeps float32 and its importance weights correct for the difference)
//! --lora-rank R  (train a LoRA adapter of rank R on the frozen base, which then stays in
//!   the engine's dtype; checkpoints hold the adapter in PEFT's format)
//! --lora-alpha A [2 x R]  --lora-targets LIST [all: q,k,v,o,gate,up,down]  --rslora
//! ```

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use agentjet::base::Rng;
use agentjet::engine::{
    spawn_engine, Completed, EngineConfig, EngineHandle, GenerateRequest, SamplingParams,
};
use agentjet::facade::track::transform_of;
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::lora::{LoraConfig, Target};
use agentjet::model::llama::DType;
use agentjet::model::{ChatRequest, ModelCard, ModelSource};
use agentjet::timeline::{Call, Episode};
use agentjet::train::checkpoint::RunDir;
use agentjet::train::groups::{AdvantageKind, GroupBuffer, GroupConfig};
use agentjet::train::loss::LossConfig;
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{StepMetrics, Trainer, TrainerConfig};
use serde_json::json;

struct Args {
    steps: u64,
    minutes: f64,
    tasks: usize,
    group: usize,
    lr: f64,
    max_tokens: usize,
    eval: usize,
    eval_every: u64,
    /// Evaluate after each of the first this many steps too.
    eval_dense: u64,
    checkpoint_every: u64,
    seed: u64,
    run_dir: PathBuf,
    resume: bool,
    advantage: AdvantageKind,
    temperature: f64,
    top_p: f64,
    ppo_epochs: usize,
    mini_batches: usize,
    entropy_coef: f64,
    clip_high: f64,
    dynamic: usize,
    /// Share of each round's tasks drawn again from recent tasks not always answered right.
    replay: f64,
    /// Stop once this much time went to training (held-out evaluations not counted).
    train_minutes: Option<f64>,
    /// The learning rate's cosine decays to this share of `lr` by the end of the budget.
    lr_min_ratio: f64,
    /// The sampling engine's weights.
    engine_dtype: DType,
    /// Steps of linear learning-rate warmup.
    warmup_steps: u64,
    /// Train a LoRA adapter on the frozen base instead of every weight.
    lora: Option<LoraConfig>,
}

fn parse_args() -> anyhow::Result<Args> {
    let v: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| {
        v.iter()
            .position(|a| a == name)
            .and_then(|i| v.get(i + 1).cloned())
    };
    fn num<T: std::str::FromStr>(name: &str, s: Option<String>, d: T) -> anyhow::Result<T> {
        match s {
            None => Ok(d),
            Some(s) => s
                .parse()
                .map_err(|_| anyhow::anyhow!("{name}: cannot parse {s:?}")),
        }
    }
    let known = [
        "--steps",
        "--minutes",
        "--tasks",
        "--group",
        "--lr",
        "--max-tokens",
        "--eval",
        "--eval-every",
        "--eval-dense",
        "--checkpoint-every",
        "--seed",
        "--run-dir",
        "--loss",
        "--temperature",
        "--top-p",
        "--ppo-epochs",
        "--mini-batches",
        "--entropy-coef",
        "--clip-high",
        "--dynamic",
        "--replay",
        "--train-minutes",
        "--lr-min-ratio",
        "--engine-dtype",
        "--warmup-steps",
        "--lora-rank",
        "--lora-alpha",
        "--lora-targets",
    ];
    let mut i = 0;
    while i < v.len() {
        if known.contains(&v[i].as_str()) {
            i += 2;
        } else if ["--resume", "--bench", "--bf16", "--rslora"].contains(&v[i].as_str()) {
            i += 1;
        } else {
            anyhow::bail!("unknown flag {:?} (see the example's docs)", v[i]);
        }
    }
    let minutes = num("--minutes", get("--minutes"), 60.0)?;
    Ok(Args {
        steps: num("--steps", get("--steps"), 1000)?,
        minutes,
        tasks: num("--tasks", get("--tasks"), 8)?,
        group: num("--group", get("--group"), 8)?,
        // An adapter learns at about 10x full fine-tuning's rate ("LoRA Without Regret").
        lr: num(
            "--lr",
            get("--lr"),
            if get("--lora-rank").is_some() {
                1e-4
            } else {
                1e-5
            },
        )?,
        max_tokens: num("--max-tokens", get("--max-tokens"), 32)?,
        eval: num("--eval", get("--eval"), 100)?,
        eval_every: num("--eval-every", get("--eval-every"), 25)?,
        eval_dense: num("--eval-dense", get("--eval-dense"), 0)?,
        checkpoint_every: num("--checkpoint-every", get("--checkpoint-every"), 25)?,
        seed: num("--seed", get("--seed"), 0)?,
        run_dir: get("--run-dir")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("runs/learn_addition")),
        resume: v.iter().any(|a| a == "--resume"),
        advantage: get("--loss")
            .map(|s| s.parse().map_err(anyhow::Error::msg))
            .transpose()?
            .unwrap_or(AdvantageKind::Grpo),
        temperature: num("--temperature", get("--temperature"), 1.2)?,
        top_p: num("--top-p", get("--top-p"), 1.0)?,
        ppo_epochs: num("--ppo-epochs", get("--ppo-epochs"), 2)?,
        mini_batches: num("--mini-batches", get("--mini-batches"), 1)?,
        entropy_coef: num("--entropy-coef", get("--entropy-coef"), 0.0)?,
        clip_high: num("--clip-high", get("--clip-high"), 0.28)?,
        dynamic: num("--dynamic", get("--dynamic"), 3)?,
        replay: num("--replay", get("--replay"), 0.0)?,
        // By default 11/12 of the wall time goes to training (the held-out evaluations
        // take the rest): 55 of 60 minutes.
        train_minutes: Some(num(
            "--train-minutes",
            get("--train-minutes"),
            minutes * 11.0 / 12.0,
        )?),
        lr_min_ratio: match num("--lr-min-ratio", get("--lr-min-ratio"), 0.1)? {
            r if (0.0..=1.0).contains(&r) => r,
            r => anyhow::bail!("--lr-min-ratio must be within 0..=1, got {r}"),
        },
        engine_dtype: match get("--engine-dtype").as_deref() {
            None | Some("f32") => DType::F32,
            Some("bf16") => DType::BF16,
            Some(d) => anyhow::bail!("--engine-dtype takes f32 or bf16, not {d:?}"),
        },
        warmup_steps: num("--warmup-steps", get("--warmup-steps"), 5)?,
        lora: match get("--lora-rank") {
            None => {
                for f in ["--lora-alpha", "--lora-targets", "--rslora"] {
                    if v.iter().any(|a| a == f) {
                        anyhow::bail!("{f} needs --lora-rank");
                    }
                }
                None
            }
            Some(r) => {
                let mut c = LoraConfig::new(num("--lora-rank", Some(r), 0)?);
                if let Some(a) = get("--lora-alpha") {
                    c.alpha = num("--lora-alpha", Some(a), 0.0)?;
                }
                if let Some(t) = get("--lora-targets") {
                    c.targets = Target::parse_list(&t).map_err(anyhow::Error::msg)?;
                }
                c.rslora = v.iter().any(|a| a == "--rslora");
                c.validate()?;
                Some(c)
            }
        },
    })
}

/// The last integer in `text` (the model tends to restate the operands first).
fn last_number(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let end = b.iter().rposition(|c| c.is_ascii_digit())? + 1;
    let start = b[..end]
        .iter()
        .rposition(|c| !c.is_ascii_digit())
        .map_or(0, |s| s + 1);
    let n: i64 = text[start..end].parse().ok()?;
    Some(if start > 0 && b[start - 1] == b'-' {
        -n
    } else {
        n
    })
}

/// Whether the held-out set is answered after step `step` (counted from 1).
fn evaluates_after(args: &Args, step: u64) -> bool {
    (args.eval_every > 0 && step % args.eval_every == 0) || (step >= 1 && step <= args.eval_dense)
}

struct Task {
    a: i64,
    b: i64,
    prompt: Vec<u32>,
}

fn make_task(card: &ModelCard, a: i64, b: i64) -> anyhow::Result<Task> {
    let tmpl = card.chat_template("smollm2")?;
    let messages = vec![
        json!({"role": "user", "content": format!("What is {a} + {b}? Answer with the number only.")}),
    ];
    let text = tmpl.render(&ChatRequest {
        messages: &messages,
        add_generation_prompt: true,
        ..Default::default()
    })?;
    Ok(Task {
        a,
        b,
        prompt: card.tokenizer.encode(&text)?,
    })
}

fn pair(rng: &mut Rng) -> (i64, i64) {
    (
        10 + (rng.next_u64() % 90) as i64,
        10 + (rng.next_u64() % 90) as i64,
    )
}

/// Samples `n` answers of every task at once; returns per task (ids, behaviour logprobs,
/// version).
#[allow(clippy::type_complexity)]
fn sample(
    engine: &EngineHandle,
    tasks: &[Task],
    n: usize,
    sampling: &SamplingParams,
    max_tokens: usize,
    stop: &[u32],
    seed: u64,
) -> anyhow::Result<Vec<Vec<(Vec<u32>, Vec<f32>, u64)>>> {
    let mut all = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        all.push(engine.submit_n(
            GenerateRequest {
                prompt: t.prompt.clone(),
                max_tokens,
                sampling: sampling.clone(),
                seed: Some(seed.wrapping_mul(1_000_003).wrapping_add(i as u64 * 101)),
                stop_token_ids: stop.to_vec(),
                ..Default::default()
            },
            n,
        )?);
    }
    let mut out = Vec::new();
    for rxs in all {
        let mut task = Vec::new();
        for mut rx in rxs {
            let c = Completed::collect(&mut rx).map_err(anyhow::Error::msg)?;
            let lps = c.behaviour.iter().map(|&l| l as f32).collect();
            task.push((c.tokens, lps, c.policy_version));
        }
        out.push(task);
    }
    Ok(out)
}

fn correct(card: &ModelCard, t: &Task, ids: &[u32]) -> bool {
    let text = card.tokenizer.decode(ids, true).unwrap_or_default();
    last_number(&text) == Some(t.a + t.b)
}

/// Greedy accuracy on `tasks`; the wrong answers go to `wrong` (one line each, replaced at
/// every evaluation: what the model still gets wrong).
fn evaluate(
    engine: &EngineHandle,
    card: &ModelCard,
    tasks: &[Task],
    max_tokens: usize,
    stop: &[u32],
    wrong: &std::path::Path,
) -> anyhow::Result<f64> {
    let mut right = 0;
    let mut lines = String::new();
    for chunk in tasks.chunks(32) {
        let out = sample(
            engine,
            chunk,
            1,
            &SamplingParams::greedy(),
            max_tokens,
            stop,
            0,
        )?;
        for (t, o) in chunk.iter().zip(&out) {
            if correct(card, t, &o[0].0) {
                right += 1;
            } else {
                let text = card.tokenizer.decode(&o[0].0, true).unwrap_or_default();
                lines += &format!("{} + {} = {}: {text:?}\n", t.a, t.b, t.a + t.b);
            }
        }
    }
    std::fs::write(wrong, lines)?;
    Ok(right as f64 / tasks.len().max(1) as f64)
}

/// The reward curve (mean training reward per step, held-out accuracy where measured).
fn write_svg(path: &std::path::Path, metrics: &[StepMetrics], before: f64) -> anyhow::Result<()> {
    let svg = agentjet::train::plot::reward_svg(
        "learn_addition: SmolLM2-135M-Instruct, GRPO (reward: blue = training mean, red = held-out greedy accuracy)",
        metrics,
        Some(before),
    );
    std::fs::write(path, svg)?;
    Ok(())
}

fn main() {
    // Freed tensors' memory is kept for the next ones (see `agentjet::base::alloc`), as the
    // server does.
    agentjet::base::alloc::keep_freed_memory();
    if let Err(e) = run() {
        eprintln!("learn_addition failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = parse_args()?;
    let t0 = Instant::now();
    let term = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, term.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, term.clone())?;
    let source = ModelSource::resolve("smollm2")?;
    // With an adapter the base stays in the engine's dtype (frozen): no float32 copy.
    let trainer_dtype = match args.lora {
        Some(_) => args.engine_dtype,
        None => DType::F32,
    };
    if args.lora.is_some()
        && args.engine_dtype == DType::BF16
        && std::env::args().any(|a| a == "--bf16")
    {
        anyhow::bail!(
            "--bf16 runs products in bfloat16 over float32 master weights; a LoRA adapter over \
             a bfloat16 base (--engine-dtype bf16) already does: drop --bf16"
        );
    }
    let mut loaded = load_model(&source, tch::Device::cuda_if_available(), trainer_dtype)?;
    if let Some(c) = &args.lora {
        loaded.model.attach_adapter(c.clone(), args.seed)?;
    }
    let card = loaded.card.clone();
    let stop = card.generation.eos_token_ids.clone();
    let run_dir = RunDir::open(&args.run_dir).map_err(anyhow::Error::msg)?;
    if !args.resume && run_dir.checkpoint_path().exists() {
        anyhow::bail!(
            "{} already has a checkpoint: pass --resume to continue it, or another --run-dir",
            args.run_dir.display()
        );
    }
    if !args.resume {
        let _ = std::fs::remove_file(run_dir.metrics_path());
    }
    let mut trainer = Trainer::new(
        loaded.model,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr: args.lr,
                weight_decay: 0.0,
                ..Default::default()
            },
            warmup_steps: args.warmup_steps,
            max_staleness: Some(1),
            micro_batch_tokens: 2048,
            bf16: std::env::args().any(|a| a == "--bf16"),
            ppo_epochs: args.ppo_epochs.max(1),
            mini_batches: args.mini_batches.max(1),
            loss: LossConfig {
                entropy_coef: args.entropy_coef,
                clip_high: args.clip_high,
                ..LossConfig::default()
            },
            ..TrainerConfig::default()
        },
    )
    .map_err(anyhow::Error::msg)?;
    let mut rng = Rng::seeded(args.seed);
    // Recent training tasks not answered right in every sample (`--replay`), oldest first.
    let mut pool: std::collections::VecDeque<(i64, i64)> = Default::default();
    // The accuracy before any training, kept in the checkpoint so a resumed run reports it.
    let mut before: Option<f64> = None;
    if args.resume {
        match run_dir.resume(&mut trainer).map_err(anyhow::Error::msg)? {
            Some(state) => {
                let s: [u64; 4] = serde_json::from_value(state.extra["rng"].clone())
                    .map_err(|e| anyhow::anyhow!("checkpoint state.json: rng: {e}"))?;
                rng = Rng::from_state(s);
                before = state.extra["before"].as_f64();
                pool = serde_json::from_value(state.extra["pool"].clone()).unwrap_or_default();
                println!("resumed at step {} (version {})", state.step, state.version);
            }
            None => println!(
                "--resume: no checkpoint in {}, starting fresh",
                args.run_dir.display()
            ),
        }
    }
    println!("trainer memory: {}", trainer.memory());
    let engine_model = match &args.lora {
        None => load_model(&source, tch::Device::cuda_if_available(), args.engine_dtype)?.model,
        // The engine reads the trainer's frozen base (one copy); its own adapter follows
        // the trainer's through weight updates.
        Some(c) => {
            let mut m = trainer.model.frozen_twin()?;
            m.attach_adapter(c.clone(), args.seed)?;
            m
        }
    };
    let engine = spawn_engine(
        engine_model,
        EngineConfig {
            max_batch: 64,
            max_queue: 256,
            max_kv_positions: 64 * 128,
            ..EngineConfig::default()
        },
    )?;
    engine
        .update_weights(&trainer.model.parameters(), trainer.version())
        .map_err(anyhow::Error::msg)?;
    // The held-out set: its own seed; training never draws one of its pairs.
    let mut eval_rng = Rng::seeded(args.seed ^ 0x5eed_e7a1);
    let mut held: HashSet<(i64, i64)> = HashSet::new();
    let mut eval_tasks = Vec::new();
    while eval_tasks.len() < args.eval {
        let (a, b) = pair(&mut eval_rng);
        if held.insert((a, b)) {
            eval_tasks.push(make_task(&card, a, b)?);
        }
    }
    let wrong = args.run_dir.join("heldout_wrong.txt");
    let pairs: Vec<[i64; 2]> = eval_tasks.iter().map(|t| [t.a, t.b]).collect();
    std::fs::write(
        args.run_dir.join("heldout.json"),
        serde_json::to_string(&pairs)?,
    )?;
    println!(
        "learn_addition: SmolLM2-135M-Instruct on {:?} (engine {:?}); {} tasks x {} samples per step (T {}, top_p {}, dynamic rounds {}, replay {}), lr {} (warmup {} steps, cosine to {} x by the end), {} PPO epochs x {} mini-batches, entropy coef {}, clip high {}, held-out {} tasks; run dir {}",
        trainer.model.device(),
        args.engine_dtype,
        args.tasks,
        args.group,
        args.temperature,
        args.top_p,
        args.dynamic,
        args.replay,
        args.lr,
        args.warmup_steps,
        args.lr_min_ratio,
        args.ppo_epochs,
        args.mini_batches,
        args.entropy_coef,
        args.clip_high,
        args.eval,
        args.run_dir.display()
    );
    let before = match before {
        Some(b) => {
            println!(
                "held-out greedy accuracy before training (from the checkpoint): {:.1}%",
                100.0 * b
            );
            b
        }
        None => {
            let b = evaluate(&engine, &card, &eval_tasks, args.max_tokens, &stop, &wrong)?;
            println!(
                "EVAL train_minutes=0.000 accuracy={b:.4} step={}",
                trainer.steps()
            );
            println!(
                "held-out greedy accuracy at step {} (before this run's training): {:.1}%",
                trainer.steps(),
                100.0 * b
            );
            b
        }
    };
    // A checkpoint carries the task RNG, the replay pool and the pre-training accuracy
    // with the trainer.
    let save = |trainer: &Trainer,
                rng: &Rng,
                pool: &std::collections::VecDeque<(i64, i64)>|
     -> anyhow::Result<()> {
        run_dir
            .save(
                trainer,
                &card,
                json!({"rng": rng.state(), "before": before, "pool": pool}),
            )
            .map_err(anyhow::Error::msg)
    };
    let mut buffer = GroupBuffer::new(
        GroupConfig {
            num_repeat: args.group,
            min_episodes: 2,
            timeout: std::time::Duration::from_secs(3600),
        },
        "policy",
        args.advantage,
    );
    let mut last_acc = before;
    // Training time: from here, less the held-out evaluations.
    let train_t0 = Instant::now();
    let mut eval_secs = 0.0;
    let train_minutes =
        |eval_secs: f64| (train_t0.elapsed().as_secs_f64() - eval_secs).max(0.0) / 60.0;
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        ..Default::default()
    };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let drawn = transform_of(&sampling, false);
    while trainer.steps() < args.steps
        && t0.elapsed().as_secs_f64() < args.minutes * 60.0
        && args
            .train_minutes
            .is_none_or(|m| train_minutes(eval_secs) < m)
    {
        let step = trainer.steps();
        // Dynamic sampling: more rounds of fresh tasks while fewer than --tasks groups
        // have signal (their answers differ in reward).
        let mut with_signal = 0;
        for round in 0..=args.dynamic {
            let want = if round == 0 {
                args.tasks
            } else {
                args.tasks - with_signal
            };
            let mut tasks = Vec::new();
            let replayed = ((want as f64 * args.replay).round() as usize).min(pool.len());
            for (a, b) in pool.drain(..replayed) {
                tasks.push(make_task(&card, a, b)?);
            }
            while tasks.len() < want {
                let (a, b) = pair(&mut rng);
                if !held.contains(&(a, b)) {
                    tasks.push(make_task(&card, a, b)?);
                }
            }
            let out = sample(
                &engine,
                &tasks,
                args.group,
                &sampling,
                args.max_tokens,
                &stop,
                rng.next_u64(),
            )?;
            for (ti, (t, samples)) in tasks.iter().zip(out).enumerate() {
                let mut rewards = Vec::new();
                for (si, (ids, lps, version)) in samples.into_iter().enumerate() {
                    let reward = if correct(&card, t, &ids) { 1.0 } else { 0.0 };
                    rewards.push(reward);
                    buffer
                        .add(Episode::single_call(
                            format!("s{step}-r{round}-t{ti}-{si}"),
                            format!("{}+{}", t.a, t.b),
                            format!("s{step}-r{round}-t{ti}"),
                            Call::new("policy", t.prompt.clone(), ids, lps, version)
                                .with_sampling(drawn),
                            reward,
                        ))
                        .map_err(anyhow::Error::msg)?;
                }
                with_signal += rewards.iter().any(|&r| r != rewards[0]) as usize;
                if args.replay > 0.0 && rewards.iter().any(|&r| r < 1.0) {
                    pool.push_back((t.a, t.b));
                    if pool.len() > 512 {
                        pool.pop_front();
                    }
                }
            }
            if with_signal >= args.tasks {
                break;
            }
        }
        let (groups, report) = buffer.take_ready(Instant::now());
        if args.lr_min_ratio < 1.0 {
            let budget = args.train_minutes.unwrap_or(args.minutes).max(1e-9);
            let t = (train_minutes(eval_secs) / budget).min(1.0);
            let cos = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
            trainer.cfg.optim.lr = args.lr * (args.lr_min_ratio + (1.0 - args.lr_min_ratio) * cos);
        }
        let mut m = trainer.step(&groups, &report).map_err(anyhow::Error::msg)?;
        engine
            .update_weights(&trainer.model.parameters(), trainer.version())
            .map_err(anyhow::Error::msg)?;
        if evaluates_after(&args, trainer.steps()) {
            let at = train_minutes(eval_secs);
            let e0 = Instant::now();
            last_acc = evaluate(&engine, &card, &eval_tasks, args.max_tokens, &stop, &wrong)?;
            eval_secs += e0.elapsed().as_secs_f64();
            m.accuracy = Some(last_acc);
            println!(
                "EVAL train_minutes={at:.3} accuracy={last_acc:.4} step={}",
                trainer.steps()
            );
        }
        println!(
            "{} | {:.1} min",
            m.line(),
            t0.elapsed().as_secs_f64() / 60.0
        );
        run_dir.append(&m).map_err(anyhow::Error::msg)?;
        let stop_now = term.load(Ordering::Relaxed);
        if stop_now || trainer.steps() % args.checkpoint_every.max(1) == 0 {
            save(&trainer, &rng, &pool)?;
        }
        if stop_now {
            println!(
                "stopped by signal after step {}; checkpoint saved",
                trainer.steps()
            );
            return Ok(());
        }
    }
    let after = if evaluates_after(&args, trainer.steps()) {
        last_acc
    } else {
        let at = train_minutes(eval_secs);
        let a = evaluate(&engine, &card, &eval_tasks, args.max_tokens, &stop, &wrong)?;
        println!(
            "EVAL train_minutes={at:.3} accuracy={a:.4} step={}",
            trainer.steps()
        );
        a
    };
    save(&trainer, &rng, &pool)?;
    let mut metrics = run_dir.metrics().map_err(anyhow::Error::msg)?;
    if let Some(last) = metrics.last_mut() {
        last.accuracy = Some(after);
    }
    let svg = args.run_dir.join("reward.svg");
    write_svg(&svg, &metrics, before)?;
    println!(
        "held-out greedy accuracy: before {:.1}%, after {:.1}% ({} steps, {:.1} min); curve: {}",
        100.0 * before,
        100.0 * after,
        trainer.steps(),
        t0.elapsed().as_secs_f64() / 60.0,
        svg.display()
    );
    // The "peer" is the model before training; no ratio when it scored 0.
    if before > 0.0 {
        println!(
            "RESULT learn_addition heldout_accuracy ours={after:.3} peer={before:.3} ratio={:.2}",
            after / before
        );
    } else {
        println!("RESULT learn_addition heldout_accuracy ours={after:.3} peer={before:.3}");
    }
    Ok(())
}
