//! The RL loop end to end on a tiny random model: the serving engine samples groups of
//! episodes, the group buffer computes advantages, the trainer takes GRPO steps, and the
//! engine serves each new policy version without a restart. The toy task: reward 1 when
//! the first sampled token is one of 30 target tokens (10% of the vocabulary), else 0.

use crate::common;

use std::time::Instant;

use agentjet::base::Rng;
use agentjet::engine::{
    spawn_engine, Completed, EngineConfig, EngineHandle, GenerateRequest, SamplingParams,
};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use agentjet::timeline::{Call, Episode};
use agentjet::train::groups::{AdvantageKind, GroupBuffer, GroupConfig};
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{StepMetrics, Trainer, TrainerConfig};
use common::*;
use tch::Device;

const TARGETS: std::ops::Range<u32> = 100..130;

fn tiny(dir: &std::path::Path) -> Llama {
    Tiny {
        max_pos: 128,
        seed: 11,
        ..Tiny::default()
    }
    .load(dir, Device::Cpu, DType::F32)
}

/// The toy run's pieces, shared by the learning test and the kill/resume child.
fn toy_trainer(model: Llama) -> Trainer {
    Trainer::new(
        model,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr: 1e-2,
                weight_decay: 0.0,
                ..Default::default()
            },
            max_staleness: Some(0),
            ..TrainerConfig::default()
        },
    )
    .unwrap()
}

fn toy_engine(model: Llama) -> EngineHandle {
    spawn_engine(
        model,
        EngineConfig {
            max_batch: 64,
            max_queue: 64,
            max_kv_positions: 64 * 16,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn toy_prompts() -> Vec<Vec<u32>> {
    let mut rng = Rng::seeded(3);
    (0..8)
        .map(|_| (0..6).map(|_| 3 + (rng.next_u64() % 290) as u32).collect())
        .collect()
}

fn toy_buffer() -> GroupBuffer {
    GroupBuffer::new(
        GroupConfig {
            num_repeat: 8,
            ..Default::default()
        },
        "policy",
        AdvantageKind::Grpo,
    )
}

/// Samples `per_task` episodes of each prompt through the engine.
fn rollouts(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    per_task: usize,
    step: u64,
) -> Vec<Episode> {
    let mut out = Vec::new();
    for (task, prompt) in prompts.iter().enumerate() {
        let rxs = engine
            .submit_n(
                GenerateRequest {
                    prompt: prompt.clone(),
                    max_tokens: 2,
                    sampling: SamplingParams {
                        temperature: 1.0,
                        ..Default::default()
                    },
                    seed: Some(step * 1000 + task as u64 * 10),
                    ..Default::default()
                },
                per_task,
            )
            .unwrap();
        for (i, mut rx) in rxs.into_iter().enumerate() {
            let c = Completed::collect(&mut rx).expect("rollout");
            let (ids, lps) = (c.tokens, c.behaviour.iter().map(|&l| l as f32).collect());
            let version = c.policy_version;
            let reward = if TARGETS.contains(&ids[0]) { 1.0 } else { 0.0 };
            out.push(Episode::single_call(
                format!("s{step}-t{task}-{i}"),
                format!("t{task}"),
                format!("s{step}-t{task}"),
                Call::new("policy", prompt.clone(), ids, lps, version),
                reward,
            ));
        }
    }
    out
}

#[test]
fn a_tiny_model_learns_the_toy_task_through_engine_and_trainer() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let engine = toy_engine(tiny(dir.path()));
    let mut trainer = toy_trainer(tiny(dir.path()));
    let prompts = toy_prompts();
    let mut buffer = toy_buffer();
    let mut history: Vec<StepMetrics> = Vec::new();
    for step in 0..60u64 {
        let episodes = rollouts(&engine, &prompts, 8, step);
        // Every call was sampled by the version the trainer last published.
        assert!(episodes
            .iter()
            .all(|e| e.calls[0].policy_version == trainer.version()));
        for e in episodes {
            buffer.add(e).unwrap();
        }
        let (groups, report) = buffer.take_ready(Instant::now());
        assert_eq!(buffer.pending(), 0);
        let m = trainer.step(&groups, &report).unwrap();
        eprintln!("{}", m.line());
        engine
            .update_weights(&trainer.model.parameters(), trainer.version())
            .unwrap();
        assert_eq!(
            engine
                .stats
                .policy_version
                .load(std::sync::atomic::Ordering::Relaxed),
            trainer.version()
        );
        let done = m.reward_mean >= 0.9;
        history.push(m);
        if done {
            break;
        }
    }
    let first = &history[0];
    let last = history.last().unwrap();
    eprintln!(
        "reward {:.3} -> {:.3} in {} steps, {:.1}s",
        first.reward_mean,
        last.reward_mean,
        history.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        first.reward_mean < 0.4,
        "starts high: {}",
        first.reward_mean
    );
    assert!(
        last.reward_mean >= 0.9,
        "did not learn: reward {:.3} after {} steps",
        last.reward_mean,
        history.len()
    );
    // The trainer trained (tokens, gradient, versions), and groups with no signal were
    // counted as skipped rather than trained.
    assert!(history.iter().filter(|m| m.trained).count() >= 2);
    assert!(history.iter().all(|m| m.grad_norm.is_finite()));
    assert_eq!(
        history
            .iter()
            .map(|m| m.groups + m.skipped_groups)
            .sum::<usize>(),
        8 * history.len()
    );
}

// ---- Kill and resume -------------------------------------------------------------------

const TOY_STEPS: u64 = 10;

/// The toy training run a child process does (see below): resumes from the run
/// directory's checkpoint if there is one, checkpoints every 3 steps and on SIGTERM.
fn toy_child(root: &std::path::Path) {
    let pause: u64 = std::env::var("AGENTJET_TOY_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let term = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, term.clone()).unwrap();
    let src = root.join("model");
    let loaded = load_model(&ModelSource::HfDir(src.clone()), Device::Cpu, DType::F32).unwrap();
    let card = loaded.card.clone();
    let mut trainer = toy_trainer(loaded.model);
    let run = agentjet::train::checkpoint::RunDir::open(&root.join("run")).unwrap();
    let resumed = run.resume(&mut trainer).unwrap();
    eprintln!(
        "child: start at step {} (resumed: {})",
        trainer.steps(),
        resumed.is_some()
    );
    let engine = toy_engine(tiny(&src));
    engine
        .update_weights(&trainer.model.parameters(), trainer.version())
        .unwrap();
    let prompts = toy_prompts();
    let mut buffer = toy_buffer();
    while trainer.steps() < TOY_STEPS {
        for e in rollouts(&engine, &prompts, 8, trainer.steps()) {
            buffer.add(e).unwrap();
        }
        let (groups, report) = buffer.take_ready(Instant::now());
        let m = trainer.step(&groups, &report).unwrap();
        run.append(&m).unwrap();
        engine
            .update_weights(&trainer.model.parameters(), trainer.version())
            .unwrap();
        let stop = term.load(std::sync::atomic::Ordering::Relaxed);
        if stop || trainer.steps() % 3 == 0 {
            run.save(&trainer, &card, serde_json::json!({"note": "toy"}))
                .unwrap();
        }
        if stop {
            eprintln!(
                "child: SIGTERM after step {}, checkpointed",
                trainer.steps()
            );
            std::process::exit(0);
        }
        std::thread::sleep(std::time::Duration::from_millis(pause));
    }
}

fn spawn_child(root: &std::path::Path, pause_ms: u64) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "trainer::training_killed_mid_run_resumes_without_losing_or_repeating_a_step",
            "--exact",
            "--nocapture",
        ])
        .env("AGENTJET_TOY_RUN", root)
        .env("AGENTJET_TOY_PAUSE_MS", pause_ms.to_string())
        .spawn()
        .unwrap()
}

fn metrics_of(root: &std::path::Path) -> Vec<StepMetrics> {
    agentjet::train::checkpoint::RunDir::open(&root.join("run"))
        .unwrap()
        .metrics()
        .unwrap()
}

/// Waits until the run has at least `n` steps in metrics.jsonl.
fn wait_for_steps(root: &std::path::Path, n: usize, child: &mut std::process::Child) {
    let t0 = Instant::now();
    while metrics_of(root).len() < n {
        assert!(child.try_wait().unwrap().is_none(), "child ended early");
        assert!(t0.elapsed().as_secs() < 120, "child made no progress");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn training_killed_mid_run_resumes_without_losing_or_repeating_a_step() {
    if let Ok(root) = std::env::var("AGENTJET_TOY_RUN") {
        toy_child(std::path::Path::new(&root));
        return;
    }
    let base = tempfile::tempdir().unwrap();
    let setup = |name: &str| {
        let root = base.path().join(name);
        tiny(&root.join("model"));
        root
    };
    // Uninterrupted.
    let straight = setup("straight");
    assert!(spawn_child(&straight, 0).wait().unwrap().success());
    let want = metrics_of(&straight);
    assert_eq!(want.len() as u64, TOY_STEPS);

    // SIGTERM mid-run: the child finishes its step, checkpoints and exits; a second run
    // resumes. Then SIGKILL (no chance to checkpoint): the third run resumes from the
    // last periodic checkpoint and reruns the steps after it.
    let killed = setup("killed");
    let mut c = spawn_child(&killed, 150);
    wait_for_steps(&killed, 2, &mut c);
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    assert!(c.wait().unwrap().success());
    let after_term = metrics_of(&killed).len();
    assert!(
        after_term < TOY_STEPS as usize,
        "SIGTERM came too late to test anything"
    );
    let mut c = spawn_child(&killed, 150);
    wait_for_steps(&killed, after_term + 2, &mut c);
    unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
    let _ = c.wait();
    let after_kill = metrics_of(&killed).len();
    assert!(spawn_child(&killed, 0).wait().unwrap().success());
    let got = metrics_of(&killed);
    eprintln!(
        "SIGTERM after {after_term} steps, SIGKILL after {after_kill}; resumed to {}",
        got.len()
    );

    let steps: Vec<u64> = got.iter().map(|m| m.step).collect();
    assert_eq!(
        steps,
        (1..=TOY_STEPS).collect::<Vec<_>>(),
        "steps lost or repeated"
    );
    for (a, b) in want.iter().zip(&got) {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * (1.0 + x.abs());
        assert!(
            close(a.loss, b.loss)
                && close(a.reward_mean, b.reward_mean)
                && close(a.grad_norm, b.grad_norm)
                && close(a.entropy, b.entropy)
                && a.version == b.version
                && a.tokens_trained == b.tokens_trained
                && a.groups == b.groups,
            "step {}: resumed run differs:\n{a:?}\n{b:?}",
            a.step
        );
    }
}

/// The bf16 option: matrix products in bfloat16 over float32 master weights give the
/// float32 step's entropy and gradient norm to within bfloat16 rounding, and update the
/// float32 weights.
#[test]
fn bf16_option_trains_float32_weights_close_to_the_float32_step() {
    use agentjet::timeline::synth::{trace, TraceShape};
    use agentjet::train::groups::{advantages, Group, ReadyReport};
    let dir = tempfile::tempdir().unwrap();
    let episodes = trace(&TraceShape {
        groups: 2,
        group_size: 4,
        turns: 3,
        prompt_tokens: 20,
        env_tokens: 5,
        gen_tokens: 4,
        break_p: 0.0,
        vocab: 290,
        seed: 9,
    });
    let groups: Vec<Group> = episodes
        .chunks(4)
        .enumerate()
        .map(|(g, eps)| Group {
            group_id: format!("g{g}"),
            episodes: eps.to_vec(),
            advantages: advantages(AdvantageKind::Grpo, &[1.0, 0.0, 0.5, 0.0]).unwrap(),
        })
        .collect();
    let mut results = Vec::new();
    for bf16 in [false, true] {
        let mut t = Trainer::new(
            tiny(dir.path()),
            None,
            TrainerConfig {
                bf16,
                ..TrainerConfig::default()
            },
        )
        .unwrap();
        let before: Vec<tch::Tensor> = t
            .model
            .parameters()
            .iter()
            .map(|p| p.detach().copy())
            .collect();
        let m = t.step(&groups, &ReadyReport::default()).unwrap();
        assert!(m.trained && m.tokens_trained > 0);
        let moved = t
            .model
            .parameters()
            .iter()
            .zip(&before)
            .filter(|(p, b)| max_abs_diff(p, b) > 0.0)
            .count();
        assert!(moved > 0 && t.model.parameters()[0].kind() == tch::Kind::Float);
        results.push(m);
    }
    let (a, b) = (&results[0], &results[1]);
    eprintln!(
        "f32 step: entropy {} grad norm {}; bf16: {} / {}",
        a.entropy, a.grad_norm, b.entropy, b.grad_norm
    );
    // Not the same arithmetic (the option is on), yet close.
    assert_ne!(a.grad_norm, b.grad_norm, "bf16 compute changed nothing");
    assert!(
        (a.entropy - b.entropy).abs() < 0.02 * a.entropy.max(1.0),
        "entropy {} vs {}",
        a.entropy,
        b.entropy
    );
    assert!(
        (a.grad_norm - b.grad_norm).abs() < 0.05 * a.grad_norm,
        "grad norm {} vs {}",
        a.grad_norm,
        b.grad_norm
    );
}
