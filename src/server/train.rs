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

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;

pub use super::error::TrainingError;
use super::events::ServerEvent;
use super::learner::{events, ServerLearner};
use super::ledger::{consumed_upto, unconsumed_episodes};
pub use super::settings::{mode_name, CollectiveSettings, TrainSettings, TrainerInput};
use super::ServedModel;
use crate::base::StopMode;
use crate::collective::group::{self, GroupNode};
use crate::collective::member::{EventSink, MemberError, MemberLoop};
use crate::model::llama::Llama;
use crate::swarm::{SwarmHandle, Trust};
use crate::train::checkpoint::RunDir;
use crate::train::groups::{GroupBuffer, GroupConfig};
use crate::train::loss::LossConfig;
use crate::train::optim::AdamWConfig;
use crate::train::trainer::{Trainer, TrainerConfig};
use crate::train::TrainError;

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
        settings.lora.as_ref(),
        &served.swarm.peer_id,
    );
    println!("training: trainer memory {}", trainer.memory());
    if mode.starts_with("alone/") {
        println!(
            "training: {} updates per step (--ppo-epochs x --mini-batches): this server trains alone \
             (a synchronous group all-reduces one gradient per step; with --sync-every the \
             updates are DiLoCo inner steps and servers train together)",
            trainer.updates_per_step()
        );
    }
    let group_name = settings
        .collective
        .group
        .clone()
        .unwrap_or_else(|| served.name.clone());
    let mode = match untrusted_group(&served.swarm, &served.name, &group_name) {
        Some(why) if !mode.starts_with("alone/") => {
            println!("training: this server trains alone: {why}");
            format!("alone/{}", served.swarm.peer_id)
        }
        _ => mode,
    };
    let resumed = run_dir.resume(&mut trainer)?;
    served.events.emit(ServerEvent::Training {
        model: served.name.clone(),
        step: trainer.steps(),
        version: trainer.version(),
        resumed: resumed.is_some(),
    });
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
    served.serve_weights(&trainer.model.parameters(), trainer.version())?;
    served.train_step.store(trainer.steps(), Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::channel();
    // Episodes stored before this start that the checkpoint has not consumed (pending in
    // a group, trained by steps after the checkpoint, or stored while no trainer ran) are
    // trained now: an acknowledged episode is never lost to a restart.
    //
    // Episodes consumed by steps after the checkpoint are settled once the group's first
    // epoch says at which step this member goes on (see `ServerLearner::settle`): trained
    // again if those steps are lost, kept if the group's state (fetched) includes them.
    let consumed = consumed_upto(&run_dir.dir, u64::MAX)?;
    let again = unconsumed_episodes(&served, &consumed)?;
    if !again.is_empty() {
        println!(
            "training: {} stored episodes not trained yet are fed to the trainer again",
            again.len()
        );
        served.events.emit(ServerEvent::Refed {
            episodes: again.len(),
        });
    }
    for ep in again {
        let _ = tx.send(TrainerInput::Episode(Box::new(ep)));
    }
    let node = GroupNode::start(
        served.swarm.clone(),
        rt,
        group::GroupConfig {
            name: group_name,
            model: served.name.clone(),
            mode,
            timeout: settings.collective.timeout,
            heartbeat: settings.collective.heartbeat,
            direct_links: settings.collective.direct_links,
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
            let r = ServerLearner::new(&served, trainer, &run_dir, &settings, rx, buffer, consumed)
                .and_then(|learner| {
                    let sink: EventSink = Box::new(|e| events::on_event(&served, e));
                    MemberLoop::new(node, settings.loop_config(), learner, sink)
                        .run()
                        .map(drop)
                        .map_err(|e| match e {
                            MemberError::Learner(e) => e,
                            other => TrainError::Invalid(other.to_string()).into(),
                        })
                });
            if let Err(e) = &r {
                tracing::error!(model = served.name, "the training loop stopped: {e}");
                eprintln!("training of {:?} stopped: {e}", served.name);
            }
            r
        })
        .map_err(TrainingError::Thread)?;
    Ok(TrainingHandle { tx, thread })
}

/// Why this server may not train `model` in `group` with other servers (see
/// `swarm::trust`), if it may not.
fn untrusted_group(swarm: &SwarmHandle, model: &str, group: &str) -> Option<String> {
    match swarm.trust() {
        Trust::Open => Some(
            "an open swarm (neither --run nor --swarm-key): no other server can be checked, \
             so none is trusted with this model's weights"
                .into(),
        ),
        Trust::Run(id) if !swarm.own_cert().is_some_and(|c| c.trains(model, group)) => {
            Some(format!(
                "its certificate of run {id} does not allow training {model:?} in group {group:?}"
            ))
        }
        Trust::Run(_) | Trust::SwarmKey => None,
    }
}
