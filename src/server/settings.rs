//! How a server trains, as its flags set it, and the training thread's interface: what
//! it hears ([`TrainerInput`]; why it stops is [`super::error::TrainingError`]).

use std::time::Duration;

use super::stored::StoredEpisode;
use crate::base::StopMode;
use crate::collective::member::{LoopConfig, Mode};
use crate::collective::Wire;
use crate::model::llama::lora::LoraConfig;
use crate::swarm::PeerId;
use crate::train::groups::AdvantageKind;
use crate::train::outer::OuterConfig;

/// What the training thread hears, in order.
pub enum TrainerInput {
    /// An episode stored (and synced) by the submit protocol.
    Episode(Box<StoredEpisode>),
    /// The role is stopping.
    Stop(StopMode),
}

/// How the server trains (each a flag of `--role server`).
#[derive(Debug, Clone)]
pub struct TrainSettings {
    pub learning_rate: f64,
    pub warmup_steps: u64,
    /// Trainable groups per optimizer step: a step starts once this many are ready.
    pub groups_per_step: usize,
    /// At most this many groups in one step (at least `groups_per_step`): a backlog (a
    /// client faster than training) is trained over several steps, oldest groups first,
    /// instead of in one step that takes as long as all of it.
    pub max_groups_per_step: usize,
    /// Group size when a client does not say it.
    pub num_repeat: usize,
    /// A group waits this long for its stragglers, then trains with what arrived (if at
    /// least `min_episodes` finished).
    pub group_timeout: Duration,
    pub min_episodes: usize,
    pub advantage: AdvantageKind,
    /// Calls sampled more than this many versions ago are not trained on.
    pub max_staleness: Option<u64>,
    pub checkpoint_every: u64,
    pub micro_batch_tokens: usize,
    /// How the servers of the model train together.
    pub collective: CollectiveSettings,
    /// DiLoCo mode (none: synchronous): inner steps per outer step and the outer
    /// optimizer's settings.
    pub outer: Option<OuterConfig>,
    /// PPO epochs and mini-batches per step (see [`crate::train::trainer`]).
    pub ppo_epochs: usize,
    pub mini_batches: usize,
    /// Weight of the entropy bonus.
    pub entropy_coef: f64,
    /// Train a LoRA adapter on the frozen base (kept in the serving dtype) instead of
    /// every weight.
    pub lora: Option<LoraConfig>,
    /// How the engine serves that adapter (see [`LoraServe`]).
    pub lora_serve: LoraServe,
}

/// How a rollout peer follows (`--follow`): the training group, and the adapter its
/// members train if they train one (then only the adapter's versions travel, and the
/// engine serves them over its own frozen base).
#[derive(Debug, Clone)]
pub struct FollowSettings {
    pub group: String,
    /// The members' adapter shape (`--lora-rank` and friends, as the members pass them).
    pub lora: Option<LoraConfig>,
    pub lora_serve: LoraServe,
}

/// How the engine serves a trained LoRA adapter (`--lora-serve`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraServe {
    /// Merged for one adapter over a float32 base (it decodes faster, `cargo bench
    /// --bench lora`); unmerged over a bfloat16 base (a merged bfloat16 weight would
    /// round a small update of the adapter away) and for several adapters.
    #[default]
    Auto,
    /// Merged into a copy of the base's targeted weights after every update (see
    /// [`crate::model::llama::Llama::serve_merged_adapter`]): one more copy of them.
    Merged,
    /// Low-rank terms beside the base, which the trainer shares.
    Unmerged,
}

/// The training group's settings (see [`crate::collective::group`]).
#[derive(Debug, Clone)]
pub struct CollectiveSettings {
    /// A round's bound: a member that stalls or dies longer fails the round everywhere.
    /// It must exceed the slowest member's gradient time (members wait for each other).
    pub timeout: Duration,
    /// Between heartbeat rounds (step boundaries) while no step is due.
    pub heartbeat: Duration,
    /// How gradients travel.
    pub wire: Wire,
    /// Tests only: hold every gradient round this long between its reduce-scatter and
    /// its all-gather (to kill a member mid-round).
    pub midway_pause: Option<Duration>,
    /// The training group's name (none: the model's). Servers of one model train together
    /// only when their group names (and modes) are equal: one name per run.
    pub group: Option<String>,
    /// Members compare their parameter hashes every this many group steps (0: never).
    pub hash_every: u64,
    /// Tests only: after applying this group step, this member's parameters silently
    /// drift (one value moved by 1e-3), as a corrupted member's would.
    pub perturb_at: Option<u64>,
    /// Tests only: from this group step on, this member sends NaN values (see
    /// `LoopConfig::send_nan_from`).
    pub send_nan_from: Option<u64>,
    /// Ring links may be direct TCP connections (`--group-links auto`); false: streams
    /// over the swarm's connections only (`--group-links swarm`).
    pub direct_links: bool,
}

impl Default for CollectiveSettings {
    fn default() -> Self {
        CollectiveSettings {
            timeout: Duration::from_secs(60),
            heartbeat: Duration::from_millis(500),
            wire: Wire::F32,
            midway_pause: None,
            direct_links: true,
            group: None,
            hash_every: 10,
            perturb_at: None,
            send_nan_from: None,
        }
    }
}

impl Default for TrainSettings {
    fn default() -> Self {
        TrainSettings {
            learning_rate: 1e-5,
            warmup_steps: 0,
            groups_per_step: 4,
            max_groups_per_step: 16,
            num_repeat: 8,
            group_timeout: Duration::from_secs(600),
            min_episodes: 2,
            advantage: AdvantageKind::Grpo,
            max_staleness: Some(4),
            checkpoint_every: 20,
            micro_batch_tokens: 4096,
            collective: CollectiveSettings::default(),
            outer: None,
            ppo_epochs: 1,
            mini_batches: 1,
            entropy_coef: 0.0,
            lora: None,
            lora_serve: LoraServe::Auto,
        }
    }
}

/// The training mode as the group gossips it: `sync`, `diloco/H`, or `alone/<peer>`,
/// followed by `+lora/<rank>/<alpha>/<targets>[/rs]` for an adapter.
///
/// A synchronous group all-reduces one gradient per step, so a member that takes several
/// updates per step (PPO epochs, mini-batches) trains alone: its mode names it, and no
/// other member matches. In DiLoCo mode those updates are inner steps, which each member
/// takes on its own anyway. Members train together only with an adapter of the same
/// shape and scale (or none).
pub fn mode_name(
    outer: Option<&OuterConfig>,
    updates_per_step: usize,
    lora: Option<&LoraConfig>,
    me: &PeerId,
) -> String {
    let base = match outer {
        Some(o) => format!("diloco/{}", o.every),
        None if updates_per_step > 1 => format!("alone/{me}"),
        None => "sync".into(),
    };
    match lora {
        None => base,
        Some(c) => format!(
            "{base}+lora/{}/{}/{}{}",
            c.rank,
            c.alpha,
            c.targets
                .iter()
                .map(|t| t.name().trim_end_matches("_proj"))
                .collect::<Vec<_>>()
                .join(","),
            if c.rslora { "/rs" } else { "" }
        ),
    }
}

impl TrainSettings {
    /// The member loop's settings (the group's timeout and heartbeat go to its node).
    pub fn loop_config(&self) -> LoopConfig {
        LoopConfig {
            mode: match &self.outer {
                Some(o) => Mode::Diloco {
                    every: o.every.max(1),
                },
                None => Mode::Sync,
            },
            groups_per_step: self.groups_per_step.max(1),
            wire: self.collective.wire,
            hash_every: self.collective.hash_every,
            midway_pause: self.collective.midway_pause,
            send_nan_from: self.collective.send_nan_from,
        }
    }
}
