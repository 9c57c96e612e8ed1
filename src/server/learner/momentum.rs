//! DiLoCo's outer state in a checkpoint: the outer momentum is saved beside the model (the
//! anchor is the checkpoint's model itself), and a resumed server takes it back.

use tch::Tensor;

use crate::train::checkpoint::RunDir;
use crate::train::outer::{Outer, OuterConfig};
use crate::train::trainer::Trainer;
use crate::train::TrainError;

/// The outer state's tensors in a checkpoint.
const MOMENTUM: &str = "outer.momentum";

/// The outer optimizer at the trainer's (resumed) parameters, with the momentum its
/// checkpoint saved.
pub(super) fn resume(t: &Trainer, cfg: OuterConfig, run_dir: &RunDir) -> Result<Outer, TrainError> {
    let mut o = Outer::new(t, cfg);
    let params = t.model.parameters();
    if let Some(named) = run_dir.saved_tensors()? {
        let momentum: Option<Vec<Tensor>> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let key = format!("{MOMENTUM}.{i}");
                named
                    .iter()
                    .find(|(k, v)| *k == key && v.size() == p.size())
                    .map(|(_, v)| v.to_device(p.device()))
            })
            .collect();
        if momentum.is_none() {
            return Err(TrainError::Invalid(format!(
                "the checkpoint in {} has an outer state of another model",
                run_dir.dir.display()
            )));
        }
        o.reanchor(t, momentum);
    }
    Ok(o)
}

/// The tensors a checkpoint keeps of `o` (its anchor is the checkpoint's model).
pub(super) fn saved(o: &Outer) -> Vec<(String, Tensor)> {
    o.momentum()
        .map(|m| {
            m.iter()
                .enumerate()
                .map(|(i, t)| (format!("{MOMENTUM}.{i}"), t.shallow_clone()))
                .collect()
        })
        .unwrap_or_default()
}
