//! Training. Today: the AdamW optimizer over a model's parameter tensors. The RL trainer
//! (group buffer, advantages, GRPO-family losses, policy versions, checkpoints) builds on it
//! in the trainer issue.

pub mod checkpoint;
pub mod groups;
pub mod loss;
pub mod optim;
pub mod plot;
pub mod trainer;

use tch::{Kind, Tensor};

use crate::model::llama::Llama;
use crate::model::ModelError;
use crate::timeline::layout::PackedRow;

/// The current policy's log-probability of every target of `row` (in `row.targets`
/// order), float32 [targets], differentiable: one forward over the row
/// ([`Llama::forward_row`]), logits only where a target is predicted.
pub fn target_logprobs(model: &Llama, row: &PackedRow) -> Result<Tensor, ModelError> {
    let dev = model.device();
    let long = |v: Vec<i64>| -> Result<Tensor, ModelError> {
        Ok(Tensor::f_from_slice(&v)?.f_to_device(dev)?)
    };
    let ids = long(row.tokens.iter().map(|&t| t as i64).collect())?;
    let pos = long(row.positions.iter().map(|&p| p as i64).collect())?;
    let from = long(row.targets.iter().map(|t| t.from as i64).collect())?;
    let tok = long(row.targets.iter().map(|t| t.token as i64).collect())?;
    let logits = model.forward_row(&ids, &pos, &row.parent, Some(&from))?;
    Ok(logits
        .f_log_softmax(-1, Kind::Float)?
        .f_gather(1, &tok.f_unsqueeze(1)?, false)?
        .f_squeeze_dim(1)?)
}
