//! On-policy corrections on a tiny random model: the trainer scores each token under the
//! distribution the engine drew it from (temperature and truncation), so with the same
//! weights on both sides the importance weights are 1; and PPO epochs make the clip bind,
//! with the loss of a two-token batch equal to the value computed by hand.

use crate::common;

use agentjet::engine::{spawn_engine, Completed, EngineConfig, GenerateRequest, SamplingParams};
use agentjet::facade::track::transform_of;
use agentjet::model::llama::{DType, Llama};
use agentjet::timeline::layout::{pack, Layout};
use agentjet::timeline::{Call, Episode};
use agentjet::train::groups::{advantages, AdvantageKind, Group, ReadyReport};
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{Trainer, TrainerConfig};
use common::*;
use tch::Device;

fn tiny(dir: &std::path::Path) -> Llama {
    Tiny {
        max_pos: 128,
        seed: 21,
        ..Tiny::default()
    }
    .load(dir, Device::Cpu, DType::F32)
}

fn trainer(model: Llama, lr: f64, ppo_epochs: usize) -> Trainer {
    Trainer::new(
        model,
        None,
        TrainerConfig {
            model_name: "m".into(),
            optim: AdamWConfig {
                lr,
                weight_decay: 0.0,
                ..Default::default()
            },
            ppo_epochs,
            ..TrainerConfig::default()
        },
    )
    .unwrap()
}

/// The engine samples with four transforms; the trainer, holding the same weights,
/// scores every sampled token under its call's transform: the behaviour log-probability
/// the engine recorded is matched within 1e-5 (importance weight 1), while scoring under
/// the raw softmax (what the trainer did before transforms travelled with calls) is off.
#[test]
fn importance_weights_are_one_when_sampler_and_trainer_hold_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let engine = spawn_engine(
        tiny(dir.path()),
        EngineConfig {
            max_batch: 16,
            max_queue: 64,
            max_kv_positions: 16 * 64,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let transforms = [
        SamplingParams {
            temperature: 0.5,
            top_p: 0.9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            min_p: 0.05,
            top_p: 0.95,
            ..Default::default()
        },
        SamplingParams::default(),
    ];
    let mut episodes = Vec::new();
    for (i, sampling) in transforms.iter().enumerate() {
        let prompt: Vec<u32> = (0..8)
            .map(|k| 10 + (i * 37 + k * 11) as u32 % 280)
            .collect();
        let rxs = engine
            .submit_n(
                GenerateRequest {
                    prompt: prompt.clone(),
                    max_tokens: 12,
                    sampling: sampling.clone(),
                    seed: Some(7 + i as u64),
                    ..Default::default()
                },
                2,
            )
            .unwrap();
        for (j, mut rx) in rxs.into_iter().enumerate() {
            let c = Completed::collect(&mut rx).unwrap();
            let beh: Vec<f32> = c.behaviour.iter().map(|&l| l as f32).collect();
            let call = Call::new("m", prompt.clone(), c.tokens, beh, c.policy_version)
                .with_sampling(transform_of(sampling, false));
            episodes.push(Episode::single_call(
                format!("e{i}-{j}"),
                format!("t{i}"),
                format!("g{i}"),
                call,
                j as f64,
            ));
        }
    }
    let t = trainer(tiny(dir.path()), 1e-5, 1);
    let batch: Vec<(&Episode, f32)> = episodes.iter().map(|e| (e, 1.0)).collect();
    let rows = pack("m", &batch, Layout::Tree, 4096).unwrap();
    let (mut n, mut worst, mut raw_worst) = (0, 0f64, 0f64);
    for row in &rows {
        let scored = t.score_row(row).unwrap();
        let mut raw_row = row.clone();
        for target in &mut raw_row.targets {
            target.sampling = Default::default();
        }
        let raw = t.score_row(&raw_row).unwrap();
        for (k, target) in row.targets.iter().enumerate() {
            let w = (scored.double_value(&[k as i64]) - target.behaviour_logprob as f64).exp();
            worst = worst.max((w - 1.0).abs());
            if target.sampling.temperature != 1.0 {
                let wr = (raw.double_value(&[k as i64]) - target.behaviour_logprob as f64).exp();
                raw_worst = raw_worst.max((wr - 1.0).abs());
            }
            n += 1;
        }
    }
    eprintln!("{n} tokens: max |w - 1| = {worst:.2e}; scored raw instead: {raw_worst:.3}");
    assert_eq!(n, 8 * 12, "every sampled token is a target");
    assert!(worst < 1e-5, "importance weight off by {worst}");
    assert!(
        raw_worst > 0.1,
        "the raw softmax should not match ({raw_worst})"
    );

    // A training step reports the same: mean weight 1, none capped.
    let groups: Vec<Group> = episodes
        .chunks(2)
        .map(|eps| Group {
            group_id: eps[0].group_id.clone(),
            episodes: eps.to_vec(),
            advantages: advantages(AdvantageKind::Grpo, &[0.0, 1.0]).unwrap(),
        })
        .collect();
    let mut t = t;
    let m = t.step(&groups, &ReadyReport::default()).unwrap();
    assert!(m.trained);
    assert!(
        (m.is_weight_mean - 1.0).abs() < 1e-5,
        "{}",
        m.is_weight_mean
    );
    assert_eq!(m.is_capped_frac, 0.0);
}

/// Two episodes of one sampled token each (rewards 1 and 0), two PPO epochs of one
/// mini-batch at a large learning rate. The first update has ratio 1 (its loss is
/// -Σ w A / 2); the second scores the tokens under the once-updated weights (the same as
/// a one-update trainer's after its step), so its ratio moves past the clip range. The
/// step's loss is the mean of the two by-hand values and its clip fraction counts the
/// clipped tokens of both updates.
#[test]
fn ppo_epochs_bind_the_clip_and_the_loss_is_the_value_computed_by_hand() {
    let dir = tempfile::tempdir().unwrap();
    let lr = 0.05;
    let prompt = vec![5u32, 6, 7, 8];
    // Behaviour log-probabilities chosen so the truncated importance weights differ.
    let episodes: Vec<Episode> = [(41u32, -5.3f32, 1.0), (97, -6.1, 0.0)]
        .iter()
        .enumerate()
        .map(|(i, &(tok, beh, reward))| {
            Episode::single_call(
                format!("e{i}"),
                "t".into(),
                "g".into(),
                Call::new("m", prompt.clone(), vec![tok], vec![beh], 0),
                reward,
            )
        })
        .collect();
    let adv = advantages(AdvantageKind::Grpo, &[1.0, 0.0]).unwrap();
    let groups = vec![Group {
        group_id: "g".into(),
        episodes: episodes.clone(),
        advantages: adv.clone(),
    }];
    let batch: Vec<(&Episode, f32)> = episodes
        .iter()
        .zip(&adv)
        .map(|(e, &a)| (e, a as f32))
        .collect();
    let rows = pack("m", &batch, Layout::Tree, 4096).unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    let mut ppo = trainer(tiny(dir.path()), lr, 2);
    let mut once = trainer(tiny(dir.path()), lr, 1);
    let old = ppo.score_row(row).unwrap();
    once.step(&groups, &ReadyReport::default()).unwrap();
    let after_one = once.score_row(row).unwrap();
    let m = ppo.step(&groups, &ReadyReport::default()).unwrap();

    let cfg = agentjet::train::loss::LossConfig::default();
    let (mut loss1, mut loss2, mut clipped) = (0.0, 0.0, 0);
    for (k, target) in row.targets.iter().enumerate() {
        let a = target.advantage as f64;
        let o = old.double_value(&[k as i64]);
        let w = (o - target.behaviour_logprob as f64)
            .exp()
            .min(cfg.tis_cap.unwrap());
        loss1 += w * -a;
        let r = (after_one.double_value(&[k as i64]) - o).exp();
        let clip = r.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
        let mut pg = -(r * a).min(clip * a);
        if clip * a < r * a {
            clipped += 1;
        }
        if a < 0.0 {
            pg = pg.min(-cfg.dual_clip.unwrap() * a);
        }
        loss2 += w * pg;
    }
    let want = (loss1 / 2.0 + loss2 / 2.0) / 2.0;
    eprintln!(
        "loss {} (by hand {want}), clip fraction {} ({clipped} of 2 tokens at the second update)",
        m.loss, m.clip_frac
    );
    assert_eq!(m.updates, 2);
    assert_eq!(
        m.version, 1,
        "one policy version per step, whatever the updates"
    );
    assert!((m.loss - want).abs() < 1e-5, "loss {} vs {want}", m.loss);
    assert!(
        clipped > 0,
        "the second update's ratio stayed inside the clip range"
    );
    assert!((m.clip_frac - clipped as f64 / 4.0).abs() < 1e-9);
    assert_eq!(m.tokens_trained, 2);
}
