//! Timelines: an episode's model calls, token-exactly, and how they become training
//! sequences.
//!
//! A [`Call`] is what a server answered: the exact prompt ids, the sampled completion ids
//! with their behaviour logprobs, and the policy version. An [`Episode`] holds its calls (of
//! one or several models), its reward(s) and its status. Per (episode, model), the calls
//! merge into a [`Timeline`]: when a call's prompt starts with everything the previous call
//! saw and produced (prompt + completion), it extends the same [`Branch`] and only its new
//! tokens are added; when it does not (the chat template rewrote history, a client
//! re-tokenised, ...), a new branch starts and the break is counted. Nothing is ever
//! trained across a break: a branch is token-exact by construction.
//!
//! A branch is a list of [`Segment`]s: prompt/environment tokens (not trained on) and the
//! tokens one call sampled (trained on, with their logprobs and version). Segments are what
//! [`fragment`] cuts into content-addressed fragments, and what [`layout`] packs into
//! training rows (per call, linear, or as a prefix tree over a group).
//!
//! Owns: token bookkeeping. Plain data and algorithms: never touches LibTorch or the network.

pub mod digest;
pub mod fragment;
pub mod layout;
pub mod synth;
pub mod transform;

pub use transform::SamplingTransform;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Why calls or episodes cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TimelineError {
    #[error("call {call}: {problem}")]
    BadCall { call: usize, problem: String },
    #[error("{0}")]
    Invalid(String),
}

/// One model call as the server answered it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Call {
    pub model: String,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// Behaviour log-probability of each completion token: under the distribution it was
    /// drawn from (`sampling` applied to the policy that sampled it).
    pub logprobs: Vec<f32>,
    pub policy_version: u64,
    /// The serving peer's signature over the call (set by the swarm; empty until it is).
    pub signature: Vec<u8>,
    /// The distribution the completion was drawn from (absent in data from before it was
    /// recorded: the model's own).
    #[serde(default)]
    pub sampling: SamplingTransform,
}

impl Call {
    /// An unsigned call: what the engine sampled for `prompt_ids`.
    pub fn new(
        model: &str,
        prompt_ids: Vec<u32>,
        completion_ids: Vec<u32>,
        logprobs: Vec<f32>,
        policy_version: u64,
    ) -> Call {
        Call {
            model: model.to_string(),
            prompt_ids,
            completion_ids,
            logprobs,
            policy_version,
            signature: Vec::new(),
            sampling: SamplingTransform::RAW,
        }
    }

    /// The call, drawn with `sampling`.
    pub fn with_sampling(mut self, sampling: SamplingTransform) -> Call {
        self.sampling = sampling;
        self
    }

    fn check(&self, index: usize) -> Result<(), TimelineError> {
        let bad = |problem: String| TimelineError::BadCall {
            call: index,
            problem,
        };
        if self.prompt_ids.is_empty() {
            return Err(bad("empty prompt".into()));
        }
        if self.logprobs.len() != self.completion_ids.len() {
            return Err(bad(format!(
                "{} logprobs for {} completion tokens",
                self.logprobs.len(),
                self.completion_ids.len()
            )));
        }
        if let Some(lp) = self
            .logprobs
            .iter()
            .find(|l| !(l.is_finite() && **l <= 0.0))
        {
            return Err(bad(format!("logprob {lp} is not a finite value <= 0")));
        }
        self.sampling.check().map_err(bad)?;
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EpisodeStatus {
    Running,
    Finished,
    Aborted { reason: String },
}

/// One run of an agent on a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    pub id: String,
    pub task_id: String,
    /// Episodes of one group ran the same task (GRPO's group).
    pub group_id: String,
    pub calls: Vec<Call>,
    /// The reward for every model, unless `rewards` names the model.
    pub reward: Option<f64>,
    /// Per-model rewards (multi-model episodes).
    pub rewards: BTreeMap<String, f64>,
    pub status: EpisodeStatus,
}

impl Episode {
    /// A finished single-turn episode: one call and its reward.
    pub fn single_call(
        id: String,
        task_id: String,
        group_id: String,
        call: Call,
        reward: f64,
    ) -> Episode {
        Episode {
            id,
            task_id,
            group_id,
            calls: vec![call],
            reward: Some(reward),
            rewards: BTreeMap::new(),
            status: EpisodeStatus::Finished,
        }
    }

    /// The reward `model` gets for this episode.
    pub fn reward_for(&self, model: &str) -> Option<f64> {
        self.rewards.get(model).copied().or(self.reward)
    }

    /// Trainable: finished, with a reward for `model`. Aborted episodes never are.
    pub fn trainable_for(&self, model: &str) -> bool {
        self.status == EpisodeStatus::Finished && self.reward_for(model).is_some()
    }

    /// The calls of `model`, in order.
    pub fn calls_of<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Call> + 'a {
        self.calls.iter().filter(move |c| c.model == model)
    }

    /// The merged timeline of `model`'s calls.
    pub fn timeline(&self, model: &str) -> Result<Timeline, TimelineError> {
        let calls: Vec<Call> = self.calls_of(model).cloned().collect();
        Timeline::merge(model, &calls)
    }
}

/// A run of tokens in a branch: prompt/environment tokens, or what one call sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub tokens: Vec<u32>,
    /// Sampled by the model (trained on), or not (prompt, environment, tool output).
    pub sampled: bool,
    /// Behaviour logprobs, one per token when sampled; empty otherwise.
    pub logprobs: Vec<f32>,
    /// The policy version that sampled it (0 when not sampled).
    pub version: u64,
    /// The call (index among the timeline's calls) whose prompt or completion this is.
    pub call: u32,
    /// The distribution a sampled segment was drawn from ([`SamplingTransform::RAW`] for
    /// the others).
    #[serde(default)]
    pub sampling: SamplingTransform,
}

/// One token-exact merged sequence.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Branch {
    pub segments: Vec<Segment>,
}

impl Branch {
    pub fn len(&self) -> usize {
        self.segments.iter().map(|s| s.tokens.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn tokens(&self) -> Vec<u32> {
        self.segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect()
    }

    /// Sampled tokens in the branch.
    pub fn sampled_tokens(&self) -> usize {
        self.segments
            .iter()
            .filter(|s| s.sampled)
            .map(|s| s.tokens.len())
            .sum()
    }
}

/// An episode's calls of one model, merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub model: String,
    pub branches: Vec<Branch>,
    /// Calls whose prompt did not extend what came before (each started a branch).
    pub breaks: usize,
    pub calls: usize,
}

impl Timeline {
    /// Merges `calls` (in order): a call whose prompt starts with the current branch's
    /// tokens extends it; any other call starts a new branch (a break).
    pub fn merge(model: &str, calls: &[Call]) -> Result<Timeline, TimelineError> {
        let mut branches: Vec<Branch> = Vec::new();
        let mut current: Vec<u32> = Vec::new();
        let mut breaks = 0;
        for (i, call) in calls.iter().enumerate() {
            call.check(i)?;
            let extends = !branches.is_empty() && call.prompt_ids.starts_with(&current);
            if !extends {
                if !branches.is_empty() {
                    breaks += 1;
                }
                branches.push(Branch::default());
                current.clear();
            }
            let branch = branches.last_mut().expect("a branch was just ensured");
            let new_prompt = &call.prompt_ids[current.len()..];
            if !new_prompt.is_empty() {
                branch.segments.push(Segment {
                    tokens: new_prompt.to_vec(),
                    sampled: false,
                    logprobs: Vec::new(),
                    version: 0,
                    call: i as u32,
                    sampling: SamplingTransform::RAW,
                });
            }
            if !call.completion_ids.is_empty() {
                branch.segments.push(Segment {
                    tokens: call.completion_ids.clone(),
                    sampled: true,
                    logprobs: call.logprobs.clone(),
                    version: call.policy_version,
                    call: i as u32,
                    sampling: call.sampling,
                });
            }
            current.extend_from_slice(new_prompt);
            current.extend_from_slice(&call.completion_ids);
        }
        Ok(Timeline {
            model: model.to_string(),
            branches,
            breaks,
            calls: calls.len(),
        })
    }

    /// Tokens sampled across all branches (each call's completion exactly once).
    pub fn sampled_tokens(&self) -> usize {
        self.branches.iter().map(Branch::sampled_tokens).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn call(prompt: &[u32], completion: &[u32]) -> Call {
        Call {
            model: "m".into(),
            prompt_ids: prompt.to_vec(),
            completion_ids: completion.to_vec(),
            logprobs: completion.iter().map(|&t| -(t as f32) / 100.0).collect(),
            policy_version: 3,
            signature: vec![],
            sampling: SamplingTransform::RAW,
        }
    }

    #[test]
    fn calls_that_extend_merge_and_a_rewrite_breaks() {
        let calls = [
            call(&[1, 2, 3], &[10, 11]),
            call(&[1, 2, 3, 10, 11, 4, 5], &[12]),
            // The template dropped the earlier completion: a new branch.
            call(&[1, 2, 3, 4, 5, 12, 6], &[13, 14]),
            call(&[1, 2, 3, 4, 5, 12, 6, 13, 14, 7], &[15]),
        ];
        let t = Timeline::merge("m", &calls).unwrap();
        assert_eq!(t.breaks, 1);
        assert_eq!(t.branches.len(), 2);
        assert_eq!(t.branches[0].tokens(), vec![1, 2, 3, 10, 11, 4, 5, 12]);
        assert_eq!(
            t.branches[1].tokens(),
            vec![1, 2, 3, 4, 5, 12, 6, 13, 14, 7, 15]
        );
        assert_eq!(t.sampled_tokens(), 6);
        let sampled: Vec<_> = t.branches[0]
            .segments
            .iter()
            .map(|s| (s.sampled, s.call))
            .collect();
        assert_eq!(sampled, vec![(false, 0), (true, 0), (false, 1), (true, 1)]);
        let mut bad = call(&[1], &[2, 3]);
        bad.logprobs.pop();
        assert!(matches!(
            Timeline::merge("m", &[bad]),
            Err(TimelineError::BadCall { call: 0, .. })
        ));
    }
}
