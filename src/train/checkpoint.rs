//! Trainer checkpoints and the run directory.
//!
//! A run directory holds `metrics.jsonl` (one [`StepMetrics`] per line, appended after
//! each step) and `checkpoint/`, the latest checkpoint:
//!
//! - `model/`: the policy as an HF-compatible checkpoint (safetensors + config +
//!   tokenizer), loadable by transformers and by `agentjet-peer --model`;
//! - `optimizer.safetensors`: AdamW's moments (`m.<i>`, `v.<i>` in parameter order);
//! - `state.json`: step, policy version, optimizer step count, the trainer's settings and
//!   whatever the caller adds (its RNG state, data position, ...).
//!
//! A checkpoint is written to `checkpoint.tmp/` and renamed over the old one, so a kill at
//! any moment leaves either the old checkpoint or the new one, never half of one.
//! [`RunDir::resume`] restores a trainer and truncates `metrics.jsonl` to the steps the
//! checkpoint covers, so a resumed run appends exactly the steps that follow (none lost,
//! none repeated).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::trainer::{StepMetrics, Trainer};
use super::TrainError;
use crate::model::checkpoint::{load_model, save_checkpoint};
use crate::model::llama::DType;
use crate::model::peft::{read_adapter, read_config, write_adapter};
use crate::model::{ModelCard, ModelSource};

/// The adapter (PEFT's format) inside the checkpoint of a trainer with a LoRA adapter.
pub const ADAPTER_DIR: &str = "adapter";

/// The file of [`RunDir::save_with`]'s tensors inside a checkpoint.
const EXTRA_TENSORS: &str = "extra.safetensors";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedState {
    pub step: u64,
    pub version: u64,
    pub optimizer_steps: i64,
    /// The trainer's settings when saved (for the record; the resuming run's own apply).
    pub trainer: serde_json::Value,
    /// The caller's own state.
    pub extra: serde_json::Value,
}

pub struct RunDir {
    pub dir: PathBuf,
}

fn io(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::file(path, e)
}

impl RunDir {
    /// Opens (creating) a run directory.
    pub fn open(dir: &Path) -> Result<RunDir, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        Ok(RunDir {
            dir: dir.to_path_buf(),
        })
    }

    pub fn metrics_path(&self) -> PathBuf {
        self.dir.join("metrics.jsonl")
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    /// Appends one step's metrics (one JSON line, synced). Non-finite figures are written
    /// as `null` (JSON has no NaN) and read back as NaN.
    pub fn append(&self, m: &StepMetrics) -> Result<(), TrainError> {
        let path = self.metrics_path();
        let line = serde_json::to_string(m).map_err(|e| io(&path, e))?;
        crate::base::files::append_durable(&path, format!("{line}\n").as_bytes())
            .map_err(|e| io(&path, e))
    }

    /// Every step's metrics so far.
    pub fn metrics(&self) -> Result<Vec<StepMetrics>, TrainError> {
        let path = self.metrics_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&path, e)),
        };
        // A last line with no newline is torn (a kill mid-append): its step is lost with
        // the kill, as if never taken.
        crate::base::files::whole_lines(&text)
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| io(&path, format!("line {}: {e}", i + 1)))
            })
            .collect()
    }

    /// Writes the trainer's checkpoint (replacing the previous one atomically).
    pub fn save(
        &self,
        trainer: &Trainer,
        card: &ModelCard,
        extra: serde_json::Value,
    ) -> Result<(), TrainError> {
        self.save_with(trainer, card, extra, &[])
    }

    /// [`RunDir::save`], with named tensors of the caller's own (a DiLoCo outer
    /// optimizer's state) in the same atomic checkpoint, as `extra.safetensors`; read
    /// back with [`RunDir::saved_tensors`].
    pub fn save_with(
        &self,
        trainer: &Trainer,
        card: &ModelCard,
        extra: serde_json::Value,
        tensors: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        let tmp = self.dir.join("checkpoint.tmp");
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
        if trainer.model.adapter().is_some() {
            // The base is frozen and known: only the adapter, in PEFT's format.
            write_adapter(&tmp.join(ADAPTER_DIR), &trainer.model, &card.name)?;
        } else {
            save_checkpoint(&tmp.join("model"), card, &trainer.model, DType::F32)?;
        }
        let (m, v) = trainer.opt.moments();
        let named: Vec<(String, Tensor)> = m
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("m.{i}"), t.shallow_clone()))
            .chain(
                v.iter()
                    .enumerate()
                    .map(|(i, t)| (format!("v.{i}"), t.shallow_clone())),
            )
            .collect();
        let opt_path = tmp.join("optimizer.safetensors");
        Tensor::write_safetensors(&named, &opt_path).map_err(|e| io(&opt_path, e))?;
        if !tensors.is_empty() {
            let extra_path = tmp.join(EXTRA_TENSORS);
            Tensor::write_safetensors(tensors, &extra_path).map_err(|e| io(&extra_path, e))?;
        }
        let state = SavedState {
            step: trainer.steps(),
            version: trainer.version(),
            optimizer_steps: trainer.opt.steps(),
            trainer: serde_json::json!({
                "loss": trainer.cfg.loss,
                "lr": trainer.cfg.optim.lr,
                "warmup_steps": trainer.cfg.warmup_steps,
                "schedule": trainer.cfg.schedule,
                "layout": trainer.cfg.layout.name(),
                "micro_batch_tokens": trainer.cfg.micro_batch_tokens,
                "max_staleness": trainer.cfg.max_staleness,
                "bf16": trainer.cfg.bf16,
            }),
            extra,
        };
        let state_path = tmp.join("state.json");
        std::fs::write(
            &state_path,
            serde_json::to_vec_pretty(&state).map_err(|e| io(&state_path, e))?,
        )
        .map_err(|e| io(&state_path, e))?;
        // On disk before it replaces the old one: a power cut after the renames below
        // must not leave a checkpoint of empty files.
        crate::base::files::sync_tree(&tmp).map_err(|e| io(&tmp, e))?;
        let dst = self.checkpoint_path();
        let old = self.dir.join("checkpoint.old");
        if dst.exists() {
            if old.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
            }
            std::fs::rename(&dst, &old).map_err(|e| io(&dst, e))?;
        }
        std::fs::rename(&tmp, &dst).map_err(|e| io(&tmp, e))?;
        crate::base::files::sync_dir(&self.dir).map_err(|e| io(&self.dir, e))?;
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        Ok(())
    }

    /// The caller's tensors saved with the latest checkpoint by [`RunDir::save_with`]
    /// (none: no checkpoint, or it was saved without them).
    pub fn saved_tensors(&self) -> Result<Option<Vec<(String, Tensor)>>, TrainError> {
        let Some(ck) = self.latest() else {
            return Ok(None);
        };
        let path = ck.join(EXTRA_TENSORS);
        if !path.is_file() {
            return Ok(None);
        }
        Tensor::read_safetensors(&path)
            .map(Some)
            .map_err(|e| io(&path, e))
    }

    /// The trained parameters a checkpoint holds, in [`crate::model::llama::Llama::parameters`]'s order: its
    /// adapter's for a trainer with an adapter (of the same shape), its model's otherwise.
    fn saved_parameters(&self, ck: &Path, trainer: &Trainer) -> Result<Vec<Tensor>, TrainError> {
        let adapter_dir = ck.join(ADAPTER_DIR);
        match (trainer.model.adapter(), adapter_dir.is_dir()) {
            (Some(a), true) => {
                let saved = read_config(&adapter_dir)?;
                // alpha went through JSON: equal within rounding.
                let same = saved.rank == a.cfg.rank
                    && saved.targets == a.cfg.targets
                    && saved.rslora == a.cfg.rslora
                    && (saved.alpha - a.cfg.alpha).abs() <= 1e-9 * a.cfg.alpha.abs();
                if !same {
                    return Err(io(
                        &adapter_dir,
                        format!(
                            "the checkpoint's adapter is {saved:?}, the trainer's {:?}",
                            a.cfg
                        ),
                    ));
                }
                let copy =
                    read_adapter(&adapter_dir, &trainer.model.config, trainer.model.device())?;
                Ok(copy.tensors())
            }
            (None, false) => Ok(load_model(
                &ModelSource::HfDir(ck.join("model")),
                trainer.model.device(),
                DType::F32,
            )?
            .model
            .parameters()),
            (Some(_), false) => Err(io(
                ck,
                "holds a whole model, and this trainer trains a LoRA adapter: resume it \
                 without --lora-rank, or start a new run directory",
            )),
            (None, true) => Err(io(
                ck,
                "holds a LoRA adapter, and this trainer trains the whole model: resume it \
                 with the adapter's --lora-rank, or start a new run directory",
            )),
        }
    }

    /// The checkpoint to resume from: `checkpoint/`, or `checkpoint.old/` when a kill came
    /// between the two renames of [`RunDir::save`].
    fn latest(&self) -> Option<PathBuf> {
        [self.checkpoint_path(), self.dir.join("checkpoint.old")]
            .into_iter()
            .find(|p| p.join("state.json").is_file())
    }

    /// Restores `trainer` (weights, optimizer, step, version) from the latest checkpoint
    /// and cuts `metrics.jsonl` back to its steps. Returns the saved state (with the
    /// caller's `extra`), or `None` when the run has no checkpoint yet.
    pub fn resume(&self, trainer: &mut Trainer) -> Result<Option<SavedState>, TrainError> {
        let Some(ck) = self.latest() else {
            return Ok(None);
        };
        let state_path = ck.join("state.json");
        let state: SavedState =
            serde_json::from_slice(&std::fs::read(&state_path).map_err(|e| io(&state_path, e))?)
                .map_err(|e| io(&state_path, e))?;
        let theirs = self.saved_parameters(&ck, trainer)?;
        let mine = trainer.model.parameters();
        if mine.len() != theirs.len() {
            return Err(io(
                &ck,
                format!(
                    "the checkpoint's model has {} tensors, the trainer's {}",
                    theirs.len(),
                    mine.len()
                ),
            ));
        }
        tch::no_grad(|| -> Result<(), TrainError> {
            for (i, (mut d, s)) in mine.into_iter().zip(&theirs).enumerate() {
                if d.size() != s.size() {
                    return Err(io(
                        &ck,
                        format!("tensor {i} is {:?}, the trainer's {:?}", s.size(), d.size()),
                    ));
                }
                d.f_copy_(s)?;
            }
            Ok(())
        })?;
        let opt_path = ck.join("optimizer.safetensors");
        let named = Tensor::read_safetensors(&opt_path).map_err(|e| io(&opt_path, e))?;
        let n = trainer.model.parameters().len();
        let get = |prefix: &str| -> Result<Vec<Tensor>, TrainError> {
            (0..n)
                .map(|i| {
                    let key = format!("{prefix}.{i}");
                    named
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, t)| t.to_device(trainer.model.device()))
                        .ok_or_else(|| io(&opt_path, format!("{key} is missing")))
                })
                .collect()
        };
        let (m, v) = (get("m")?, get("v")?);
        trainer.opt.restore(&m, &v, state.optimizer_steps)?;
        trainer.set_counters(state.step, state.version);
        // Steps after the checkpoint will be run again: drop their lines.
        let kept: Vec<StepMetrics> = self
            .metrics()?
            .into_iter()
            .filter(|m| m.step <= state.step)
            .collect();
        let path = self.metrics_path();
        let mut text = String::new();
        for m in &kept {
            text.push_str(&serde_json::to_string(m).map_err(|e| io(&path, e))?);
            text.push('\n');
        }
        crate::base::files::write_atomic(&path, text.as_bytes()).map_err(|e| io(&path, e))?;
        Ok(Some(state))
    }
}
