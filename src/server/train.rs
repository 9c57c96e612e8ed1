//! The server's training loop: episodes stored by the submit protocol are grouped (the
//! group buffer), and once `groups_per_step` groups are trainable the trainer takes one
//! optimizer step on its own copy of the model; the new weights go into the engine between
//! two decode steps (calls in flight continue on them) under the next policy version,
//! which every later signed call carries.
//!
//! The run directory (`<data-dir>/runs/<model>/`) holds `metrics.jsonl` (one line per
//! step), `reward.svg` (the reward curve, redrawn after every step), `consumed.log` (the
//! episodes each step consumed) and the latest checkpoint (every `checkpoint_every` steps
//! and when the server stops); a server restarted on the same data directory resumes from
//! it, so the swarm's policy keeps its version and optimizer state, and trains the stored
//! episodes that the checkpoint had not consumed.
//!
//! The loop runs on its own thread (LibTorch's tensors stay on it) and hears one input
//! channel: stored episodes, and the role's stop. A drain finishes the step in progress,
//! saves the checkpoint and ends; an abort ends after the step in progress without saving
//! (the episodes of unsaved steps are trained again after a restart, see above).

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use super::group_loop::MemberLoop;
use super::{ServedModel, StoredEpisode};
use crate::base::StopMode;
use crate::collective::group::{self, GroupNode};
use crate::collective::Wire;
use crate::engine::EngineError;
use crate::model::llama::Llama;
use crate::swarm::PeerId;
use crate::train::checkpoint::RunDir;
use crate::train::groups::{AdvantageKind, GroupBuffer, GroupConfig};
use crate::train::loss::LossConfig;
use crate::train::optim::AdamWConfig;
use crate::train::outer::OuterConfig;
use crate::train::trainer::{Trainer, TrainerConfig};
use crate::train::TrainError;

/// What the training thread hears, in order.
pub enum TrainerInput {
    /// An episode stored (and synced) by the submit protocol.
    Episode(Box<StoredEpisode>),
    /// The role is stopping.
    Stop(StopMode),
}

/// Why training stopped or could not start.
#[derive(Debug, thiserror::Error)]
pub enum TrainingError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("bringing the engine to the new weights: {0}")]
    Engine(#[from] EngineError),
    #[error("starting the training thread: {0}")]
    Thread(std::io::Error),
}

/// The running training loop: its input channel and thread.
pub struct TrainingHandle {
    tx: Sender<TrainerInput>,
    thread: std::thread::JoinHandle<Result<(), TrainingError>>,
}

impl TrainingHandle {
    /// Asks the loop to stop and waits for it (blocking: call it off the async runtime).
    /// A drain returns once the step in progress is done and the checkpoint saved.
    pub fn stop(self, mode: StopMode) -> Result<(), TrainingError> {
        let _ = self.tx.send(TrainerInput::Stop(mode));
        self.thread.join().unwrap_or_else(|_| {
            Err(TrainError::Invalid("the training thread panicked".into()).into())
        })
    }
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
}

impl Default for CollectiveSettings {
    fn default() -> Self {
        CollectiveSettings {
            timeout: Duration::from_secs(60),
            heartbeat: Duration::from_millis(500),
            wire: Wire::F32,
            midway_pause: None,
            group: None,
            hash_every: 10,
            perturb_at: None,
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
        }
    }
}

/// The training mode as the group gossips it: `sync`, `diloco/H`, or `alone/<peer>`.
///
/// A synchronous group all-reduces one gradient per step, so a member that takes several
/// updates per step (PPO epochs, mini-batches) trains alone: its mode names it, and no
/// other member matches. In DiLoCo mode those updates are inner steps, which each member
/// takes on its own anyway.
pub fn mode_name(outer: Option<&OuterConfig>, updates_per_step: usize, me: &PeerId) -> String {
    match outer {
        Some(o) => format!("diloco/{}", o.every),
        None if updates_per_step > 1 => format!("alone/{me}"),
        None => "sync".into(),
    }
}

/// The ledger of consumed episodes in a run directory: one `STEP<TAB>EPISODE ID` line per
/// episode the step took out of the group buffer (trained, skipped or dropped), appended
/// after each step. With the checkpoint it says which stored episodes a restarted server
/// has not trained on yet.
const CONSUMED: &str = "consumed.log";

/// The ids consumed by steps `1..=step` (the checkpoint's), cutting off later lines: their
/// steps are lost with the restart, so their episodes are trained again.
pub(super) fn consumed_upto(run_dir: &Path, step: u64) -> Result<HashSet<String>, TrainError> {
    let path = run_dir.join(CONSUMED);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(TrainError::file(&path, e)),
    };
    let mut kept = String::new();
    let mut ids = HashSet::new();
    let mut cut = false;
    for line in text.lines() {
        // A torn last line (a kill mid-append) has no tab or no valid step: dropped.
        let Some((st, id)) = line.split_once('\t') else {
            cut = true;
            continue;
        };
        match st.parse::<u64>() {
            Ok(n) if n <= step => {
                ids.insert(id.to_string());
                kept.push_str(line);
                kept.push('\n');
            }
            _ => cut = true,
        }
    }
    if cut {
        std::fs::write(&path, kept).map_err(|e| TrainError::file(&path, e))?;
    }
    Ok(ids)
}

pub(super) fn append_consumed(run_dir: &Path, step: u64, ids: &[String]) -> Result<(), TrainError> {
    use std::io::Write;
    let path = run_dir.join(CONSUMED);
    let text: String = ids.iter().map(|id| format!("{step}\t{id}\n")).collect();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| TrainError::file(&path, e))
}

/// Stored episodes of `served` that the resumed trainer has not consumed, oldest first.
pub(super) fn unconsumed_episodes(
    served: &ServedModel,
    consumed: &HashSet<String>,
) -> Result<Vec<StoredEpisode>, TrainError> {
    let consumed_files: HashSet<String> = consumed
        .iter()
        .map(|id| ServedModel::episode_file_name(id))
        .collect();
    let dir = served.episodes_dir();
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| TrainError::file(dir, e))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".episode") && !consumed_files.contains(&name) {
            let t = e.metadata().and_then(|m| m.modified()).ok();
            files.push((t, e.path()));
        }
    }
    files.sort();
    let mut out = Vec::new();
    for (_, p) in files {
        let b = std::fs::read(&p).map_err(|e| TrainError::file(&p, e))?;
        match StoredEpisode::decode(&b) {
            Ok(ep) => out.push(ep),
            Err(e) => warn!("{}: not an episode ({e}); not trained", p.display()),
        }
    }
    Ok(out)
}

/// The trainer for `served`'s model: `model` is its own copy (the engine keeps serving
/// from another). Resumes from the run directory's checkpoint if there is one, and brings
/// the engine to the trainer's weights and version before returning.
pub fn start_training(
    served: Arc<ServedModel>,
    model: Llama,
    settings: TrainSettings,
    run_dir: &Path,
    rt: tokio::runtime::Handle,
    ip: IpAddr,
) -> Result<TrainingHandle, TrainingError> {
    let run_dir = RunDir::open(run_dir)?;
    let mut trainer = Trainer::new(
        model,
        None,
        TrainerConfig {
            model_name: served.name.clone(),
            optim: AdamWConfig {
                lr: settings.learning_rate,
                weight_decay: 0.0,
                ..Default::default()
            },
            warmup_steps: settings.warmup_steps,
            max_staleness: settings.max_staleness,
            micro_batch_tokens: settings.micro_batch_tokens,
            ppo_epochs: settings.ppo_epochs.max(1),
            mini_batches: settings.mini_batches.max(1),
            loss: LossConfig {
                entropy_coef: settings.entropy_coef,
                ..LossConfig::default()
            },
            ..TrainerConfig::default()
        },
    )?;
    let mode = mode_name(
        settings.outer.as_ref(),
        trainer.updates_per_step(),
        &served.swarm.peer_id,
    );
    if mode.starts_with("alone/") {
        println!(
            "training: {} updates per step (--ppo-epochs x --mini-batches): this server trains alone \
             (a synchronous group all-reduces one gradient per step; with --sync-every the \
             updates are DiLoCo inner steps and servers train together)",
            trainer.updates_per_step()
        );
    }
    let resumed = run_dir.resume(&mut trainer)?;
    match &resumed {
        Some(s) => println!(
            "training: resumed {:?} at step {} (policy version {}) from {}",
            served.name,
            s.step,
            s.version,
            run_dir.dir.display()
        ),
        None => println!(
            "training: {:?} from step 0; run directory {}",
            served.name,
            run_dir.dir.display()
        ),
    }
    served
        .engine
        .update_weights(&trainer.model.parameters(), trainer.version())?;
    served.train_step.store(trainer.steps(), Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::channel();
    // Episodes stored before this start that the checkpoint has not consumed (pending in
    // a group, trained by steps after the checkpoint, or stored while no trainer ran) are
    // trained now: an acknowledged episode is never lost to a restart.
    //
    // Episodes consumed by steps after the checkpoint are settled once the group's first
    // epoch says at which step this member goes on (see `MemberLoop::settle`): trained
    // again if those steps are lost, kept if the group's state (fetched) includes them.
    let consumed = consumed_upto(&run_dir.dir, u64::MAX)?;
    let again = unconsumed_episodes(&served, &consumed)?;
    if !again.is_empty() {
        println!(
            "training: {} stored episodes not trained yet are fed to the trainer again",
            again.len()
        );
    }
    for ep in again {
        let _ = tx.send(TrainerInput::Episode(Box::new(ep)));
    }
    let node = GroupNode::start(
        served.swarm.clone(),
        rt,
        group::GroupConfig {
            name: settings
                .collective
                .group
                .clone()
                .unwrap_or_else(|| served.name.clone()),
            model: served.name.clone(),
            mode,
            timeout: settings.collective.timeout,
            heartbeat: settings.collective.heartbeat,
        },
        ip,
    )
    .map_err(|e| TrainError::Invalid(format!("joining the training group: {e}")))?;
    served.set_trainer(tx.clone());
    let thread = std::thread::Builder::new()
        .name(format!("trainer-{}", served.name))
        .spawn(move || {
            let buffer = GroupBuffer::new(
                GroupConfig {
                    num_repeat: settings.num_repeat,
                    min_episodes: settings.min_episodes,
                    timeout: settings.group_timeout,
                },
                &served.name,
                settings.advantage,
            );
            let r = MemberLoop::new(&served, trainer, &run_dir, &settings, rx, buffer, node)
                .and_then(|l| l.settle_after_first_epoch(consumed).run());
            if let Err(e) = &r {
                tracing::error!(model = served.name, "the training loop stopped: {e}");
                eprintln!("training of {:?} stopped: {e}", served.name);
            }
            r
        })
        .map_err(TrainingError::Thread)?;
    Ok(TrainingHandle { tx, thread })
}
