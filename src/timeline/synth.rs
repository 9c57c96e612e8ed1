//! Synthetic traces shaped like multi-turn agent episodes (AppWorld: a long system + task
//! prompt, then turns of environment output and a short model action), for benchmarks and
//! tests of the training layouts.
//!
//! A group's episodes share the prompt (`prompt_tokens`, the system + task), and each of
//! `turns` calls adds `env_tokens` of environment output (none before the first call) and
//! samples `gen_tokens`. With probability `break_p` a call's prompt drops the earlier
//! completions (a template that rewrites history), which breaks its timeline. Generated
//! tokens of sibling episodes differ; prompts and environment tokens are random ids below
//! `vocab` (special ids 0..16 are never used).

use super::{Call, Episode, EpisodeStatus};
use crate::base::Rng;

/// The shape of a synthetic trace.
#[derive(Debug, Clone)]
pub struct TraceShape {
    pub groups: usize,
    pub group_size: usize,
    pub turns: usize,
    pub prompt_tokens: usize,
    pub env_tokens: usize,
    pub gen_tokens: usize,
    pub break_p: f64,
    pub vocab: u32,
    pub seed: u64,
}

impl Default for TraceShape {
    /// AppWorld-like turns, scaled to what a 2-core CPU trains in minutes.
    fn default() -> Self {
        TraceShape {
            groups: 1,
            group_size: 4,
            turns: 12,
            prompt_tokens: 600,
            env_tokens: 30,
            gen_tokens: 10,
            break_p: 0.0,
            vocab: 49152,
            seed: 1,
        }
    }
}

/// Episodes of the given shape, group by group.
pub fn trace(shape: &TraceShape) -> Vec<Episode> {
    let mut rng = Rng::seeded(shape.seed);
    let vocab = shape.vocab.max(17);
    let ids = |rng: &mut Rng, n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| 16 + (rng.next_u64() % (vocab - 16) as u64) as u32)
            .collect()
    };
    let mut out = Vec::with_capacity(shape.groups * shape.group_size);
    for g in 0..shape.groups {
        let prompt = ids(&mut rng, shape.prompt_tokens.max(1));
        for e in 0..shape.group_size {
            let mut history = prompt.clone();
            let mut env_only = prompt.clone();
            let mut calls = Vec::with_capacity(shape.turns);
            for turn in 0..shape.turns {
                if turn > 0 {
                    let env = ids(&mut rng, shape.env_tokens);
                    history.extend_from_slice(&env);
                    env_only.extend_from_slice(&env);
                    if rng.next_f64() < shape.break_p {
                        history = env_only.clone();
                    }
                }
                let gen = ids(&mut rng, shape.gen_tokens.max(1));
                let logprobs = (0..gen.len())
                    .map(|_| -(rng.next_f64() as f32) * 2.0)
                    .collect();
                calls.push(Call::new(
                    "policy",
                    history.clone(),
                    gen.clone(),
                    logprobs,
                    0,
                ));
                history.extend_from_slice(&gen);
            }
            out.push(Episode {
                id: format!("g{g}-e{e}"),
                task_id: format!("task-{g}"),
                group_id: format!("g{g}"),
                calls,
                reward: Some(rng.next_f64()),
                rewards: Default::default(),
                status: EpisodeStatus::Finished,
            });
        }
    }
    out
}
