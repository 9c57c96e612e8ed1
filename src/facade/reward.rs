//! Rewards agents post for their episodes (`POST /v1/agentjet/reward` on a tracking
//! facade): `{"reward": r}` for every model of the episode, or `{"rewards": {model: r}}`.
//!
//! Owns: the reward's shape and its bounded per-episode store. Never decides what a
//! reward means for training (the client's run does).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::base::lock;

/// Episodes whose uncollected rewards are kept at most.
const MAX_PENDING_REWARDS: usize = 65536;

/// Rewards posted by agents, by episode.
#[derive(Default)]
pub struct Rewards {
    map: Mutex<HashMap<String, PostedReward>>,
}

/// A reward an agent posted for its episode.
#[derive(Debug, Clone, PartialEq)]
pub enum PostedReward {
    One(f64),
    PerModel(BTreeMap<String, f64>),
}

/// Why a posted reward was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RewardError {
    #[error("{what} must be a finite number, got {got}")]
    NotFinite { what: String, got: String },
    #[error("rewards must be an object of model name to number")]
    NotAnObject,
    #[error("rewards is empty")]
    Empty,
    #[error("expected {{\"reward\": number}} or {{\"rewards\": {{model: number}}}}")]
    Shape,
}

impl Rewards {
    /// The reward posted for `episode`, removing it.
    pub fn take(&self, episode: &str) -> Option<PostedReward> {
        lock(&self.map).remove(episode)
    }

    /// Keeps `r` as `episode`'s reward (a later post replaces it).
    pub fn put(&self, episode: &str, r: PostedReward) {
        let mut m = lock(&self.map);
        // Bounded like the tracker: a client forgets rewards nobody collects.
        if m.len() >= MAX_PENDING_REWARDS && !m.contains_key(episode) {
            m.clear();
        }
        m.insert(episode.to_string(), r);
    }
}

/// Parses `{"reward": r}` or `{"rewards": {"model": r, ...}}` (finite numbers only).
pub fn parse_reward(v: &serde_json::Value) -> Result<PostedReward, RewardError> {
    let num = |x: &serde_json::Value, what: &str| -> Result<f64, RewardError> {
        x.as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| RewardError::NotFinite {
                what: what.to_string(),
                got: x.to_string(),
            })
    };
    if let Some(r) = v.get("reward") {
        return Ok(PostedReward::One(num(r, "reward")?));
    }
    if let Some(rs) = v.get("rewards") {
        let obj = rs.as_object().ok_or(RewardError::NotAnObject)?;
        if obj.is_empty() {
            return Err(RewardError::Empty);
        }
        let mut out = BTreeMap::new();
        for (k, x) in obj {
            out.insert(k.clone(), num(x, &format!("rewards.{k}"))?);
        }
        return Ok(PostedReward::PerModel(out));
    }
    Err(RewardError::Shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rewards_parse_one_or_per_model_and_refuse_the_rest() {
        assert_eq!(
            parse_reward(&json!({"reward": 0.5})),
            Ok(PostedReward::One(0.5))
        );
        let per = parse_reward(&json!({"rewards": {"a": 1, "b": 0}})).unwrap();
        assert_eq!(
            per,
            PostedReward::PerModel([("a".into(), 1.0), ("b".into(), 0.0)].into())
        );
        assert_eq!(
            parse_reward(&json!({"rewards": {}})),
            Err(RewardError::Empty)
        );
        assert_eq!(
            parse_reward(&json!({"rewards": 3})),
            Err(RewardError::NotAnObject)
        );
        assert_eq!(parse_reward(&json!({"score": 1})), Err(RewardError::Shape));
        let e = parse_reward(&json!({"reward": "x"})).unwrap_err();
        assert_eq!(e.to_string(), "reward must be a finite number, got \"x\"");
        let r = Rewards::default();
        r.put("e1", PostedReward::One(1.0));
        assert_eq!(r.take("e1"), Some(PostedReward::One(1.0)));
        assert_eq!(r.take("e1"), None);
    }
}
