//! The group buffer and group advantages.
//!
//! Episodes arrive one by one (from clients, in any order); GRPO-family methods need a
//! group of episodes of the same task to compare. A group becomes trainable when
//! `num_repeat` of its episodes finished (or, when its client said how many it runs, once
//! that many arrived, finished or aborted), or, after `timeout` since its first episode
//! arrived, when at least `min_episodes` finished (stragglers are then left out). Aborted
//! episodes never count and are never trained on.
//!
//! Advantages per episode, from the group's rewards r_1..r_n (mean m, sample std s):
//! - GRPO: (r_i - m) / (s + eps)
//! - Dr. GRPO: r_i - m (no std: no bias toward low-variance groups)
//! - RLOO: r_i - mean of the others = n / (n - 1) * (r_i - m)
//!
//! A group whose rewards are all equal has every advantage 0: no signal, so it is skipped
//! and counted rather than trained on.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::timeline::{Episode, EpisodeStatus};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageKind {
    Grpo,
    DrGrpo,
    Rloo,
}

/// An advantage name that is none of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown advantage {0:?} (grpo, dr_grpo, rloo)")]
pub struct UnknownAdvantage(pub String);

impl std::str::FromStr for AdvantageKind {
    type Err = UnknownAdvantage;
    fn from_str(s: &str) -> Result<Self, UnknownAdvantage> {
        match s {
            "grpo" => Ok(AdvantageKind::Grpo),
            "dr_grpo" | "dr-grpo" => Ok(AdvantageKind::DrGrpo),
            "rloo" => Ok(AdvantageKind::Rloo),
            _ => Err(UnknownAdvantage(s.to_string())),
        }
    }
}

/// Why an episode was not buffered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    #[error("episode {0} is still running")]
    Running(String),
    #[error("episode {episode} is already in group {group}")]
    Duplicate { episode: String, group: String },
}

/// Rewards closer together than this count as equal (no signal).
pub const EQUAL_REWARDS: f64 = 1e-9;

/// The advantage of each reward in a group, or `None` when the group carries no signal
/// (fewer than two rewards, or all equal).
pub fn advantages(kind: AdvantageKind, rewards: &[f64]) -> Option<Vec<f64>> {
    let n = rewards.len();
    if n < 2 {
        return None;
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    let spread = rewards.iter().fold(0f64, |a, r| a.max((r - mean).abs()));
    if spread <= EQUAL_REWARDS {
        return None;
    }
    Some(match kind {
        AdvantageKind::Grpo => {
            let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let std = var.sqrt();
            rewards.iter().map(|r| (r - mean) / (std + 1e-6)).collect()
        }
        AdvantageKind::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        AdvantageKind::Rloo => {
            let k = n as f64 / (n - 1) as f64;
            rewards.iter().map(|r| k * (r - mean)).collect()
        }
    })
}

#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// Episodes per task (GRPO's group size).
    pub num_repeat: usize,
    /// After `timeout`, a group with at least this many finished episodes is trained.
    pub min_episodes: usize,
    pub timeout: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            num_repeat: 8,
            min_episodes: 2,
            timeout: Duration::from_secs(600),
        }
    }
}

/// A trainable group: its episodes (finished, with a reward) and their advantages.
#[derive(Debug, Clone)]
pub struct Group {
    pub group_id: String,
    pub episodes: Vec<Episode>,
    pub advantages: Vec<f64>,
}

/// What a call of [`GroupBuffer::take_ready`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadyReport {
    /// Groups whose rewards were all equal (skipped).
    pub skipped_equal: usize,
    /// Groups that timed out with too few finished episodes (dropped).
    pub dropped_short: usize,
    /// Aborted episodes seen in the groups taken or dropped.
    pub aborted: usize,
    /// Rewards of the skipped groups' episodes (reward metrics count every rollout).
    pub skipped_rewards: Vec<f64>,
    /// Ids of every episode the call took out of the buffer (trained, skipped, dropped or
    /// aborted): what a checkpoint after the next step has consumed.
    pub taken: Vec<String>,
}

struct Pending {
    first_seen: Instant,
    episodes: Vec<Episode>,
    /// The group's size as its client said (else `num_repeat`).
    size: Option<usize>,
}

/// Episodes by group id until their group is trainable.
pub struct GroupBuffer {
    cfg: GroupConfig,
    model: String,
    advantage: AdvantageKind,
    pending: BTreeMap<String, Pending>,
}

impl GroupBuffer {
    /// A buffer for `model`'s training (its rewards decide the advantages).
    pub fn new(cfg: GroupConfig, model: &str, advantage: AdvantageKind) -> GroupBuffer {
        GroupBuffer {
            cfg,
            model: model.to_string(),
            advantage,
            pending: BTreeMap::new(),
        }
    }

    /// Adds an episode (finished or aborted); running episodes are refused.
    pub fn add(&mut self, episode: Episode) -> Result<(), BufferError> {
        self.add_sized(episode, None)
    }

    /// Adds an episode of a group whose client runs `size` episodes: the group is complete
    /// (taken without waiting for the timeout) once `size` episodes arrived, finished or
    /// aborted, and trained on its finished ones (at most `size`) when there are at least
    /// `min_episodes`.
    pub fn add_sized(&mut self, episode: Episode, size: Option<usize>) -> Result<(), BufferError> {
        if episode.status == EpisodeStatus::Running {
            return Err(BufferError::Running(episode.id));
        }
        let p = self
            .pending
            .entry(episode.group_id.clone())
            .or_insert_with(|| Pending {
                first_seen: Instant::now(),
                episodes: Vec::new(),
                size: None,
            });
        if let Some(n) = size.filter(|&n| n > 0) {
            p.size = Some(n);
        }
        if p.episodes.iter().any(|e| e.id == episode.id) {
            return Err(BufferError::Duplicate {
                episode: episode.id,
                group: episode.group_id,
            });
        }
        p.episodes.push(episode);
        Ok(())
    }

    /// Groups still waiting.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes every group that is trainable at `now` (see the module docs), in group-id
    /// order, with advantages; groups without signal are skipped and counted.
    pub fn take_ready(&mut self, now: Instant) -> (Vec<Group>, ReadyReport) {
        let mut report = ReadyReport::default();
        let mut ready = Vec::new();
        let ids: Vec<String> = self.pending.keys().cloned().collect();
        for id in ids {
            let p = &self.pending[&id];
            let trainable: Vec<&Episode> = p
                .episodes
                .iter()
                .filter(|e| e.trainable_for(&self.model))
                .collect();
            let timed_out = now.duration_since(p.first_seen) >= self.cfg.timeout;
            let size = p.size.unwrap_or(self.cfg.num_repeat);
            let full = trainable.len() >= size || (p.size.is_some() && p.episodes.len() >= size);
            if !full && !timed_out {
                continue;
            }
            let p = self.pending.remove(&id).expect("listed above");
            report.taken.extend(p.episodes.iter().map(|e| e.id.clone()));
            report.aborted += p
                .episodes
                .iter()
                .filter(|e| matches!(e.status, EpisodeStatus::Aborted { .. }))
                .count();
            let episodes: Vec<Episode> = p
                .episodes
                .into_iter()
                .filter(|e| e.trainable_for(&self.model))
                .take(size)
                .collect();
            if episodes.len() < self.cfg.min_episodes.max(1) {
                report.dropped_short += 1;
                continue;
            }
            let rewards: Vec<f64> = episodes
                .iter()
                .map(|e| e.reward_for(&self.model).expect("trainable has a reward"))
                .collect();
            match advantages(self.advantage, &rewards) {
                Some(advantages) => ready.push(Group {
                    group_id: id,
                    episodes,
                    advantages,
                }),
                None => {
                    report.skipped_equal += 1;
                    report.skipped_rewards.extend(rewards);
                }
            }
        }
        (ready, report)
    }
}

/// The next step's share of a backlog: the first `cap` groups of `ready` (oldest first;
/// the rest stay in `ready`) and the report that goes with them. The ids of the episodes
/// of the groups left behind stay in `pending.taken`, to be recorded with the step that
/// trains them; the counts (skipped, dropped, aborted) and every other id go with this one.
pub fn next_batch(
    ready: &mut Vec<Group>,
    pending: &mut ReadyReport,
    cap: usize,
) -> (Vec<Group>, ReadyReport) {
    let n = ready.len().min(cap.max(1));
    let groups: Vec<Group> = ready.drain(..n).collect();
    if ready.is_empty() {
        return (groups, std::mem::take(pending));
    }
    let left: std::collections::HashSet<&str> = ready
        .iter()
        .flat_map(|g| g.episodes.iter().map(|e| e.id.as_str()))
        .collect();
    let (later, now): (Vec<String>, Vec<String>) = std::mem::take(&mut pending.taken)
        .into_iter()
        .partition(|id| left.contains(id.as_str()));
    let mut report = std::mem::take(pending);
    report.taken = now;
    pending.taken = later;
    (groups, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlog_is_split_into_capped_steps_and_every_taken_id_goes_with_its_groups_step() {
        let fin = EpisodeStatus::Finished;
        let mut b = GroupBuffer::new(
            GroupConfig {
                num_repeat: 2,
                min_episodes: 2,
                timeout: Duration::from_secs(600),
            },
            "policy",
            AdvantageKind::Grpo,
        );
        // Five groups with signal and one without (skipped: its ids are taken at once).
        for g in 0..6 {
            for i in 0..2 {
                let r = if g == 5 { 1.0 } else { i as f64 };
                b.add(ep(
                    &format!("g{g}"),
                    &format!("g{g}-{i}"),
                    Some(r),
                    fin.clone(),
                ))
                .unwrap();
            }
        }
        let (mut ready, mut pending) = b.take_ready(Instant::now());
        assert_eq!((ready.len(), pending.skipped_equal), (5, 1));
        let mut steps = Vec::new();
        while !ready.is_empty() {
            steps.push(next_batch(&mut ready, &mut pending, 2));
        }
        assert_eq!(
            steps.iter().map(|(g, _)| g.len()).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        assert_eq!(pending, ReadyReport::default(), "nothing left behind");
        // The skipped group's count and ids go with the first step; each trained id with
        // the step that trains it; no id twice, none lost.
        assert_eq!(steps[0].1.skipped_equal, 1);
        assert_eq!(steps[1].1.skipped_equal + steps[2].1.skipped_equal, 0);
        let mut all = Vec::new();
        for (groups, report) in &steps {
            let trained: Vec<&str> = groups
                .iter()
                .flat_map(|g| g.episodes.iter().map(|e| e.id.as_str()))
                .collect();
            for id in &trained {
                assert!(report.taken.iter().any(|t| t == id), "{id} not in its step");
            }
            all.extend(report.taken.iter().cloned());
        }
        assert!(steps[0].1.taken.iter().any(|t| t == "g5-0"));
        all.sort();
        let mut want: Vec<String> = (0..6)
            .flat_map(|g| (0..2).map(move |i| format!("g{g}-{i}")))
            .collect();
        want.sort();
        assert_eq!(all, want);
    }

    fn ep(group: &str, id: &str, reward: Option<f64>, status: EpisodeStatus) -> Episode {
        Episode {
            id: id.into(),
            task_id: group.into(),
            group_id: group.into(),
            calls: vec![],
            reward,
            rewards: Default::default(),
            status,
        }
    }

    #[test]
    fn a_sized_group_completes_when_all_its_episodes_arrived_aborted_or_not() {
        let cfg = GroupConfig {
            num_repeat: 8,
            min_episodes: 2,
            timeout: Duration::from_secs(600),
        };
        let mut b = GroupBuffer::new(cfg, "policy", AdvantageKind::Grpo);
        let fin = EpisodeStatus::Finished;
        let aborted = EpisodeStatus::Aborted {
            reason: "timed out".into(),
        };
        b.add_sized(ep("g", "1", Some(1.0), fin.clone()), Some(4))
            .unwrap();
        b.add_sized(ep("g", "2", None, aborted.clone()), Some(4))
            .unwrap();
        b.add_sized(ep("g", "3", Some(0.0), fin.clone()), Some(4))
            .unwrap();
        let now = Instant::now();
        assert!(b.take_ready(now).0.is_empty(), "3 of 4 arrived: waits");
        b.add_sized(ep("g", "4", None, aborted), Some(4)).unwrap();
        let (ready, report) = b.take_ready(now);
        assert_eq!(ready.len(), 1);
        assert_eq!(ready[0].episodes.len(), 2);
        assert_eq!(report.aborted, 2);
        // Four of four arrived finished, without waiting for num_repeat = 8.
        for i in 0..4 {
            b.add_sized(
                ep("h", &i.to_string(), Some(i as f64), fin.clone()),
                Some(4),
            )
            .unwrap();
        }
        assert_eq!(b.take_ready(now).0[0].episodes.len(), 4);
    }

    #[test]
    fn advantages_by_hand() {
        // rewards 1, 0, 0, 1: mean 0.5, sample std sqrt(1/3) = 0.57735.
        let r = [1.0, 0.0, 0.0, 1.0];
        let g = advantages(AdvantageKind::Grpo, &r).unwrap();
        assert!((g[0] - 0.5 / (0.5773503 + 1e-6)).abs() < 1e-6);
        assert!((g[1] + 0.5 / (0.5773503 + 1e-6)).abs() < 1e-6);
        assert_eq!(
            advantages(AdvantageKind::DrGrpo, &r).unwrap(),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        // RLOO: 1 - mean(0, 0, 1) = 2/3.
        let l = advantages(AdvantageKind::Rloo, &r).unwrap();
        assert!((l[0] - 2.0 / 3.0).abs() < 1e-12 && (l[1] + 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(advantages(AdvantageKind::Grpo, &[0.3, 0.3, 0.3]), None);
        assert_eq!(advantages(AdvantageKind::Grpo, &[1.0]), None);
    }

    #[test]
    fn groups_wait_for_num_repeat_or_timeout_and_never_train_aborted() {
        let cfg = GroupConfig {
            num_repeat: 3,
            min_episodes: 2,
            timeout: Duration::from_secs(60),
        };
        let mut b = GroupBuffer::new(cfg, "policy", AdvantageKind::Grpo);
        let fin = EpisodeStatus::Finished;
        b.add(ep("a", "a1", Some(1.0), fin.clone())).unwrap();
        b.add(ep("a", "a2", Some(0.0), fin.clone())).unwrap();
        assert!(b.add(ep("a", "a2", Some(0.0), fin.clone())).is_err());
        let aborted = EpisodeStatus::Aborted {
            reason: "tool crashed".into(),
        };
        b.add(ep("a", "a3", Some(1.0), aborted.clone())).unwrap();
        b.add(ep("b", "b1", Some(1.0), fin.clone())).unwrap();
        b.add(ep("b", "b2", Some(1.0), fin.clone())).unwrap();
        b.add(ep("b", "b3", Some(1.0), fin.clone())).unwrap();
        assert!(b.add(ep("c", "c1", None, EpisodeStatus::Running)).is_err());
        let now = Instant::now();
        let (ready, report) = b.take_ready(now);
        // a: 2 trainable of 3 (one aborted), not timed out: waits. b: full but all equal.
        assert!(ready.is_empty());
        assert_eq!(report.skipped_equal, 1);
        assert_eq!(b.pending(), 1);
        let (ready, report) = b.take_ready(now + Duration::from_secs(61));
        assert_eq!(ready.len(), 1);
        assert_eq!(ready[0].episodes.len(), 2);
        assert!(ready[0].episodes.iter().all(|e| e.id != "a3"));
        assert_eq!(report.aborted, 1);
        assert!(ready[0].advantages[0] > 0.0 && ready[0].advantages[1] < 0.0);
        // A timed-out group below the minimum is dropped and counted.
        b.add(ep("d", "d1", Some(1.0), fin)).unwrap();
        let (ready, report) = b.take_ready(now + Duration::from_secs(3600));
        assert!(ready.is_empty() && report.dropped_short == 1);
    }
}
