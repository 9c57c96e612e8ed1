//! Training layouts: the sampled tokens of a batch of episodes, packed into rows.
//!
//! - [`Layout::PerCall`]: every call on its own (prompt + completion): what training without
//!   merging costs, O(turns²) tokens for a multi-turn episode.
//! - [`Layout::Linear`]: every branch of every timeline once (AgentJet's merge): the calls
//!   that extend each other share one sequence.
//! - [`Layout::Tree`]: the branches of a row share their common prefixes (the group's prompt,
//!   and whatever else they have in common): a prefix trie, each shared token computed once.
//!
//! A row is a forest: every token has a parent (the token before it in its sequence) or
//! none, a position (its depth, for rotary embeddings), and attends to itself and its
//! ancestors only (see `Llama::forward_row`). So the three layouts run through one
//! forward pass and give each sampled token the same logprob: the same tokens precede it at
//! the same positions. A [`Target`] is one sampled token: predicted from its parent's
//! output, named by a [`SampleKey`], with its behaviour logprob and advantage (a shared tree
//! token that several episodes sampled carries one target per episode).
//!
//! Rows hold at most `token_budget` tokens, except that one sequence longer than the budget
//! gets a row of its own (a sequence is never split: its tokens need their context).

use std::collections::HashMap;

use super::{Episode, SamplingTransform, TimelineError};

/// One sampled token: the episode (index in the batch), the call (index among the
/// episode's calls of the model) and the token's index in that call's completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleKey {
    pub episode: u32,
    pub call: u32,
    pub index: u32,
}

/// A trained-on token in a row.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Row index of the token whose output predicts this one.
    pub from: u32,
    pub token: u32,
    pub key: SampleKey,
    pub behaviour_logprob: f32,
    pub version: u64,
    pub advantage: f32,
    /// The distribution the token was drawn from (the trainer scores it under the same).
    pub sampling: SamplingTransform,
}

/// Sequences packed into one row (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackedRow {
    pub tokens: Vec<u32>,
    /// Row index of each token's parent, or -1.
    pub parent: Vec<i32>,
    /// Each token's position (depth).
    pub positions: Vec<u32>,
    pub targets: Vec<Target>,
}

impl PackedRow {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    PerCall,
    Linear,
    Tree,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::PerCall => "per-call",
            Layout::Linear => "linear",
            Layout::Tree => "tree",
        }
    }
}

/// One sequence before packing: tokens and (position, target) pairs.
struct Seq {
    tokens: Vec<u32>,
    targets: Vec<(usize, Target)>,
}

fn sequences(
    model: &str,
    batch: &[(&Episode, f32)],
    layout: Layout,
) -> Result<Vec<Seq>, TimelineError> {
    let mut out = Vec::new();
    for (e, &(episode, advantage)) in batch.iter().enumerate() {
        let target = |call: usize,
                      index: usize,
                      token: u32,
                      lp: f32,
                      version: u64,
                      sampling: SamplingTransform| Target {
            from: 0,
            token,
            key: SampleKey {
                episode: e as u32,
                call: call as u32,
                index: index as u32,
            },
            behaviour_logprob: lp,
            version,
            advantage,
            sampling,
        };
        match layout {
            Layout::PerCall => {
                for (ci, c) in episode.calls_of(model).enumerate() {
                    c.check(ci)?;
                    let mut tokens = c.prompt_ids.clone();
                    tokens.extend_from_slice(&c.completion_ids);
                    let targets = (0..c.completion_ids.len())
                        .map(|k| {
                            (
                                c.prompt_ids.len() + k,
                                target(
                                    ci,
                                    k,
                                    c.completion_ids[k],
                                    c.logprobs[k],
                                    c.policy_version,
                                    c.sampling,
                                ),
                            )
                        })
                        .collect();
                    out.push(Seq { tokens, targets });
                }
            }
            Layout::Linear | Layout::Tree => {
                for b in &episode.timeline(model)?.branches {
                    let mut tokens = Vec::with_capacity(b.len());
                    let mut targets = Vec::new();
                    for s in &b.segments {
                        if s.sampled {
                            for (k, &t) in s.tokens.iter().enumerate() {
                                targets.push((
                                    tokens.len() + k,
                                    target(
                                        s.call as usize,
                                        k,
                                        t,
                                        s.logprobs[k],
                                        s.version,
                                        s.sampling,
                                    ),
                                ));
                            }
                        }
                        tokens.extend_from_slice(&s.tokens);
                    }
                    out.push(Seq { tokens, targets });
                }
            }
        }
    }
    Ok(out)
}

/// A row being filled; with `share`, sequences merge into a prefix trie.
struct RowBuilder {
    row: PackedRow,
    share: bool,
    children: HashMap<(i32, u32), u32>,
}

impl RowBuilder {
    fn new(share: bool) -> RowBuilder {
        RowBuilder {
            row: PackedRow::default(),
            share,
            children: HashMap::new(),
        }
    }

    /// Tokens `seq` would add.
    fn cost(&self, seq: &Seq) -> usize {
        if !self.share {
            return seq.tokens.len();
        }
        let mut parent = -1i32;
        for (p, &t) in seq.tokens.iter().enumerate() {
            match self.children.get(&(parent, t)) {
                Some(&node) => parent = node as i32,
                None => return seq.tokens.len() - p,
            }
        }
        0
    }

    fn add(&mut self, seq: Seq) -> Result<(), TimelineError> {
        let mut nodes = Vec::with_capacity(seq.tokens.len());
        let mut parent = -1i32;
        for (p, &t) in seq.tokens.iter().enumerate() {
            let existing = if self.share {
                self.children.get(&(parent, t)).copied()
            } else {
                None
            };
            let node = match existing {
                Some(n) => n,
                None => {
                    let n = self.row.tokens.len() as u32;
                    self.row.tokens.push(t);
                    self.row.parent.push(parent);
                    self.row.positions.push(p as u32);
                    if self.share {
                        self.children.insert((parent, t), n);
                    }
                    n
                }
            };
            nodes.push(node);
            parent = node as i32;
        }
        for (pos, mut target) in seq.targets {
            if pos == 0 {
                return Err(TimelineError::Invalid(format!(
                    "sampled token {:?} has no context before it",
                    target.key
                )));
            }
            target.from = nodes[pos - 1];
            self.row.targets.push(target);
        }
        Ok(())
    }
}

/// Packs the sampled tokens of `batch` (episodes with their advantages) for `model` in
/// `layout`, into rows of at most `token_budget` tokens.
pub fn pack(
    model: &str,
    batch: &[(&Episode, f32)],
    layout: Layout,
    token_budget: usize,
) -> Result<Vec<PackedRow>, TimelineError> {
    let share = layout == Layout::Tree;
    let mut rows = Vec::new();
    let mut current = RowBuilder::new(share);
    for seq in sequences(model, batch, layout)? {
        if seq.targets.is_empty() {
            continue;
        }
        if !current.row.is_empty() && current.row.len() + current.cost(&seq) > token_budget {
            rows.push(std::mem::replace(&mut current, RowBuilder::new(share)).row);
        }
        current.add(seq)?;
    }
    if !current.row.is_empty() {
        rows.push(current.row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::super::{Call, EpisodeStatus};
    use super::*;

    fn episode(prefix: &[u32], turns: &[(&[u32], &[u32])]) -> Episode {
        let mut prompt = prefix.to_vec();
        let mut calls = Vec::new();
        for (env, gen) in turns {
            prompt.extend_from_slice(env);
            calls.push(Call::new(
                "m",
                prompt.clone(),
                gen.to_vec(),
                vec![-0.5; gen.len()],
                1,
            ));
            prompt.extend_from_slice(gen);
        }
        Episode {
            id: "e".into(),
            task_id: "t".into(),
            group_id: "g".into(),
            calls,
            reward: Some(1.0),
            rewards: Default::default(),
            status: EpisodeStatus::Finished,
        }
    }

    /// `mask[i * n + j]`: token `i` attends to token `j` (itself or an ancestor).
    fn attention_mask(row: &PackedRow) -> Vec<bool> {
        let n = row.len();
        let mut mask = vec![false; n * n];
        for i in 0..n {
            let mut j = i as i32;
            while j >= 0 {
                mask[i * n + j as usize] = true;
                j = row.parent[j as usize];
            }
        }
        mask
    }

    #[test]
    fn layouts_share_what_they_should_and_masks_follow_parents() {
        let a = episode(&[1, 2, 3], &[(&[4], &[5, 6]), (&[7], &[8])]);
        let b = episode(&[1, 2, 3], &[(&[4], &[5, 9])]);
        let batch = [(&a, 1.0), (&b, -1.0)];
        let per_call = pack("m", &batch, Layout::PerCall, 1000).unwrap();
        let linear = pack("m", &batch, Layout::Linear, 1000).unwrap();
        let tree = pack("m", &batch, Layout::Tree, 1000).unwrap();
        let len = |rows: &[PackedRow]| rows.iter().map(PackedRow::len).sum::<usize>();
        // per call: [1,2,3,4,5,6] + [1,2,3,4,5,6,7,8] + [1,2,3,4,5,9]
        assert_eq!(len(&per_call), 6 + 8 + 6);
        assert_eq!(len(&linear), 8 + 6);
        // tree: 1 2 3 4 5 shared, then 6 7 8 and 9
        assert_eq!(len(&tree), 5 + 3 + 1);
        let t = &tree[0];
        // 5 is sampled by both episodes: two targets from the same parent.
        let fives: Vec<_> = t.targets.iter().filter(|x| x.token == 5).collect();
        assert_eq!(fives.len(), 2);
        assert_eq!(fives[0].from, fives[1].from);
        assert_ne!(fives[0].advantage, fives[1].advantage);
        let mask = attention_mask(t);
        let n = t.len();
        let nine = t.tokens.iter().position(|&x| x == 9).unwrap();
        let six = t.tokens.iter().position(|&x| x == 6).unwrap();
        assert!(!mask[nine * n + six], "siblings do not see each other");
        assert!(mask[nine * n + 4], "but see their shared prefix");
        assert_eq!(t.positions[nine], 5);
        // A small budget splits rows, never sequences.
        let small = pack("m", &batch, Layout::Linear, 7).unwrap();
        assert_eq!(small.len(), 2);
        assert_eq!(small[0].len(), 8);
    }
}
