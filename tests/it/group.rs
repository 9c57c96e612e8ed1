//! A training group's step is one trainer's step on the union of its members' groups:
//! each member computes its unnormalised gradient on the groups it holds (one holds none),
//! the ring all-reduce adds them up (sealed TCP links on loopback), and every member
//! applies the same bytes.

use crate::common;

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

/// DiLoCo's outer step as [`agentjet::train::outer`] runs it in a group: two members take
/// H = 2 inner steps each on their own groups, all-reduce their deltas (sealed ring on
/// loopback), and take the outer step; twice, so the momentum counts. Both members end
/// bit-identical, and the parameters equal a by-hand computation in f64 of
/// Δ = mean(θ - θ_i), b = Δ then b = μb + Δ, θ' = θ - lr (Δ + μ b).
#[test]
fn diloco_outer_steps_match_the_update_computed_by_hand_and_leave_members_identical() {
    diloco_by_hand(false);
}

/// The same with a LoRA adapter (rank 4 on every target): θ is the adapter alone, and the
/// frozen base does not move.
#[test]
fn diloco_outer_steps_of_a_lora_adapter_match_the_update_computed_by_hand() {
    diloco_by_hand(true);
}

fn diloco_by_hand(lora: bool) {
    use agentjet::model::llama::lora::LoraConfig;
    use agentjet::train::outer::{Outer, OuterConfig};
    let dir = tempfile::tempdir().unwrap();
    let cfg = OuterConfig {
        every: 2,
        lr: 0.7,
        momentum: 0.9,
        // The by-hand update below has no clip.
        max_norm: Some(f64::INFINITY),
    };
    // Member i's groups of outer step k, inner step j: all different.
    let tasks = |i: u32, k: u32, j: u32| vec![100 * i + 10 * k + j];
    // Written once here (the members' threads only read it).
    drop(tiny(dir.path()));
    let rings = Ring::loopback(2).unwrap();
    // Per member: per outer step, (anchor before, local after H inner steps, after).
    type Trace = Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>;
    let traces: Vec<Trace> = std::thread::scope(|s| {
        let hs: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(i, mut ring)| {
                let dir = dir.path();
                s.spawn(move || {
                    let mut m = tiny(dir);
                    if lora {
                        m.attach_adapter(LoraConfig::new(4), 0).unwrap();
                    }
                    let base: Vec<tch::Tensor> = m
                        .base_parameters()
                        .iter()
                        .map(|p| p.detach().copy())
                        .collect();
                    let mut t = trainer(m, Normalization::Token);
                    let mut outer = Outer::new(&t, cfg);
                    let mut trace = Vec::new();
                    for k in 0..2 {
                        let anchor = params(&t);
                        for j in 0..cfg.every as u32 {
                            let (g, r) = groups_of(&tasks(i as u32, k, j));
                            assert!(t.step(&g, &r).unwrap().trained);
                        }
                        let local = params(&t);
                        let mut sum = outer.delta(&t).unwrap();
                        ring.all_reduce(&mut sum, Wire::F32).unwrap();
                        outer.step(&mut t, &sum, 2).unwrap();
                        trace.push((anchor, local, params(&t)));
                    }
                    if lora {
                        for (a, b) in t.model.base_parameters().iter().zip(&base) {
                            assert!(a.equal(b), "the frozen base moved");
                        }
                    }
                    trace
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (a, b) = (&traces[0], &traces[1]);
    let mut momentum: Option<Vec<f64>> = None;
    for k in 0..2 {
        assert_eq!(
            a[k].2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b[k].2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "outer step {}: the members differ",
            k + 1
        );
        assert_eq!(a[k].0, b[k].0, "outer step {}: anchors differ", k + 1);
        assert_ne!(
            a[k].1, b[k].1,
            "the members' inner steps took the same data"
        );
        let theta = &a[k].0;
        let delta: Vec<f64> = (0..theta.len())
            .map(|x| ((theta[x] - a[k].1[x]) as f64 + (theta[x] - b[k].1[x]) as f64) / 2.0)
            .collect();
        let buf: Vec<f64> = match &momentum {
            None => delta.clone(),
            Some(m) => m.iter().zip(&delta).map(|(m, d)| 0.9 * m + d).collect(),
        };
        let want: Vec<f64> = (0..theta.len())
            .map(|x| theta[x] as f64 - 0.7 * (delta[x] + 0.9 * buf[x]))
            .collect();
        momentum = Some(buf);
        let moved = (0..theta.len())
            .map(|x| (a[k].2[x] as f64 - theta[x] as f64).abs())
            .fold(0f64, f64::max);
        let diff = (0..theta.len())
            .map(|x| (a[k].2[x] as f64 - want[x]).abs())
            .fold(0f64, f64::max);
        eprintln!(
            "outer step {}: moved parameters by up to {moved:e}; vs by hand {diff:e}",
            k + 1
        );
        assert!(moved > 1e-3, "the outer step barely moved: {moved}");
        // float32 arithmetic on values of magnitude ~0.1 against f64: a few ulps
        // (measured 5.9e-8).
        assert!(diff < 1e-6, "outer step {} vs by hand: {diff}", k + 1);
    }
}

/// DiLoCo's outer step with bad deltas: a sum holding one NaN is refused (the parameters
/// go back to the anchor and no momentum starts), a huge finite delta moves the model no
/// further than the honest bound, and an honest delta is not clipped by the default bound.
#[test]
fn diloco_outer_step_refuses_non_finite_deltas_and_clips_huge_ones() {
    use agentjet::train::outer::{Outer, OuterConfig};
    let dir = tempfile::tempdir().unwrap();
    let cfg = OuterConfig {
        every: 2,
        ..OuterConfig::default()
    };
    let mut t = trainer(tiny(dir.path()), Normalization::Token);
    let mut outer = Outer::new(&t, cfg);
    let anchor = params(&t);
    let inner = |t: &mut Trainer, k: u32| {
        for j in 0..2 {
            let (g, r) = groups_of(&[10 * k + j]);
            assert!(t.step(&g, &r).unwrap().trained);
        }
    };
    inner(&mut t, 0);
    let honest = outer.delta(&t).unwrap();
    assert_ne!(params(&t), anchor);

    let mut bad = honest.clone();
    bad[honest.len() / 2] = f32::NAN;
    let o = outer.step(&mut t, &bad, 1).unwrap();
    assert!(o.refused && !o.norm.is_finite(), "{o:?}");
    assert_eq!(params(&t), anchor, "a refused outer step moved the model");
    assert!(outer.momentum().is_none());

    let bound = outer.honest_bound(&t);
    let huge: Vec<f32> = honest.iter().map(|x| x * 1e6 + 1.0).collect();
    let o = outer.step(&mut t, &huge, 1).unwrap();
    assert_eq!(o.clipped_to, Some(bound), "{o:?}");
    assert!(!o.refused);
    // The first outer step moves by lr (Δ + μΔ): 0.7 x 1.9 x the clipped norm.
    let moved = params(&t)
        .iter()
        .zip(&anchor)
        .map(|(p, a)| ((p - a) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(
        (moved - 0.7 * 1.9 * bound).abs() < 1e-3 * bound,
        "moved {moved}, bound {bound}"
    );

    inner(&mut t, 1);
    let honest = outer.delta(&t).unwrap();
    let o = outer.step(&mut t, &honest, 1).unwrap();
    assert!(o.clipped_to.is_none() && !o.refused, "{o:?}, bound {bound}");
}

/// A group's summed gradient holding one NaN (or an infinity) is refused by `apply`:
/// the weights and version stay, the step counts, the metrics say so; the next good sum
/// trains as usual.
#[test]
fn a_non_finite_group_gradient_is_refused_and_changes_no_weight() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(tiny(dir.path()), Normalization::Token);
    let before = params(&t);
    for bad in [f32::NAN, f32::INFINITY] {
        let (g, r) = groups_of(&[1, 2]);
        let p = t.prepare(&g, &r).unwrap();
        let mut local = t.gradient(&p).unwrap();
        let at = local.grad.len() / 3;
        local.grad[at] = bad;
        let steps = t.steps();
        let m = t.apply(p, &local.grad, &local.stats).unwrap();
        assert!(!m.trained && m.nonfinite_updates == 1, "{bad}: {m:?}");
        assert!(
            m.line().contains("REFUSED 1 non-finite update"),
            "{}",
            m.line()
        );
        assert_eq!(params(&t), before, "{bad}: the weights moved");
        assert_eq!((t.steps(), t.version()), (steps + 1, 0));
    }
    let (g, r) = groups_of(&[3, 4]);
    let p = t.prepare(&g, &r).unwrap();
    let local = t.gradient(&p).unwrap();
    let m = t.apply(p, &local.grad, &local.stats).unwrap();
    assert!(m.trained && m.nonfinite_updates == 0 && m.grad_norm.is_finite());
    assert_ne!(params(&t), before);
}
