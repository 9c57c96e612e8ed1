//! A training group's step is one trainer's step on the union of its members' groups:
//! each member computes its unnormalised gradient on the groups it holds (one holds none),
//! the ring all-reduce adds them up (sealed TCP links on loopback), and every member
//! applies the same bytes.

mod common;

use std::time::Instant;

use agentjet::collective::{Ring, Wire};
use agentjet::model::llama::{DType, Llama};
use agentjet::timeline::{Call, Episode};
use agentjet::train::groups::{AdvantageKind, Group, GroupBuffer, GroupConfig, ReadyReport};
use agentjet::train::loss::{LossConfig, Normalization};
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{Trainer, TrainerConfig};
use common::*;
use tch::Device;

fn tiny(dir: &std::path::Path) -> Llama {
    Tiny {
        max_pos: 128,
        seed: 5,
        ..Tiny::default()
    }
    .load(dir, Device::Cpu, DType::F32)
}

fn trainer(model: Llama, normalization: Normalization) -> Trainer {
    Trainer::new(
        model,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr: 1e-2,
                weight_decay: 0.01,
                ..Default::default()
            },
            loss: LossConfig {
                normalization,
                ..LossConfig::default()
            },
            ..TrainerConfig::default()
        },
    )
    .unwrap()
}

/// Task `t`'s group of 4 episodes: distinct prompts, answers and rewards, so every group
/// has a signal and the gradients differ from group to group.
fn group_episodes(t: u32) -> Vec<Episode> {
    (0..4u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..5 + t % 3)
                .map(|k| 3 + (t * 37 + k * 11) % 290)
                .collect();
            let answer: Vec<u32> = (0..2 + i % 3)
                .map(|k| 3 + (t * 13 + i * 7 + k) % 290)
                .collect();
            let lps = vec![-2.0 - 0.1 * i as f32; answer.len()];
            Episode::single_call(
                format!("t{t}-{i}"),
                format!("task{t}"),
                format!("g{t}"),
                Call::new("policy", prompt, answer, lps, 0),
                if i % 2 == 0 { 1.0 } else { 0.25 * i as f64 },
            )
        })
        .collect()
}

fn groups_of(tasks: &[u32]) -> (Vec<Group>, ReadyReport) {
    let mut b = GroupBuffer::new(
        GroupConfig {
            num_repeat: 4,
            ..Default::default()
        },
        "policy",
        AdvantageKind::Grpo,
    );
    for &t in tasks {
        for e in group_episodes(t) {
            b.add(e).unwrap();
        }
    }
    let (g, r) = b.take_ready(Instant::now());
    assert_eq!(g.len(), tasks.len());
    (g, r)
}

fn params(t: &Trainer) -> Vec<f32> {
    t.model
        .parameters()
        .iter()
        .flat_map(|p| Vec::<f32>::try_from(p.detach().view([-1])).unwrap())
        .collect()
}

#[test]
fn the_same_groups_split_across_three_members_step_like_one_trainer_on_their_union() {
    let dir = tempfile::tempdir().unwrap();
    for normalization in [Normalization::Token, Normalization::Sequence] {
        let split: [&[u32]; 3] = [&[0, 1, 2, 3], &[4, 5], &[]];
        let all: Vec<u32> = split.iter().flat_map(|s| s.iter().copied()).collect();
        let before = params(&trainer(tiny(dir.path()), normalization));

        let mut union = trainer(tiny(dir.path()), normalization);
        let (g, r) = groups_of(&all);
        let m_union = union.step(&g, &r).unwrap();
        assert!(m_union.trained);
        let want = params(&union);

        let rings = Ring::loopback(3).unwrap();
        let results: Vec<(Vec<f32>, u64, f64, usize)> = std::thread::scope(|s| {
            let hs: Vec<_> = rings
                .into_iter()
                .zip(split)
                .map(|(mut ring, tasks)| {
                    let dir = dir.path();
                    s.spawn(move || {
                        let mut t = trainer(tiny(dir), normalization);
                        let (g, r) = if tasks.is_empty() {
                            (Vec::new(), ReadyReport::default())
                        } else {
                            groups_of(tasks)
                        };
                        let p = t.prepare(&g, &r).unwrap();
                        let mut local = t.gradient(&p).unwrap();
                        ring.all_reduce(&mut local.stats, Wire::F32).unwrap();
                        ring.all_reduce(&mut local.grad, Wire::F32).unwrap();
                        let m = t.apply(p, &local.grad, &local.stats).unwrap();
                        assert!(m.trained);
                        (params(&t), t.version(), m.loss, m.tokens_trained)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (p, version, loss, tokens)) in results.iter().enumerate() {
            // Every member: the same bytes, the same version, the group's whole batch.
            assert_eq!(
                p.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                results[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "member {i} differs from member 0"
            );
            assert_eq!(*version, 1);
            assert_eq!(*tokens, m_union.tokens_trained);
            assert!(
                (loss - m_union.loss).abs() < 1e-5,
                "{loss} vs {}",
                m_union.loss
            );
        }
        // Equal to the union's step within the reduction order's rounding. The step moved
        // the parameters by up to lr = 1e-2. AdamW's first step is lr * g / (|g| + eps)
        // with eps = 1e-8, so a gradient entry that is rounding noise (a cancellation,
        // ~1e-12, different in another summation order) moves its parameter by up to
        // lr * 1e-4: the tolerance is 5e-4 * lr (measured: 2.0e-6 token-normalised, 2.8e-6
        // sequence-normalised).
        let moved = before
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let diff = results[0]
            .0
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{normalization:?}: the step moved parameters by up to {moved:e}; group vs union differ by up to {diff:e}");
        assert!(moved > 1e-3, "{moved}");
        assert!(diff <= 5e-6, "group vs union: {diff}");
    }
}
