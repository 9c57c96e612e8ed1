//! Training: the group buffer and advantages ([`groups`]), GRPO-family losses ([`loss`]),
//! AdamW ([`optim`]), DiLoCo's outer optimizer ([`outer`]), the trainer that turns groups of episodes into optimizer steps and
//! policy versions ([`trainer`]), checkpoints and run directories ([`checkpoint`]), and
//! the reward curve ([`plot`]).
//!
//! Owns: the optimisation of one model copy. Never serves requests or moves bytes between
//! peers (the server role brings episodes in and the new weights to its engine).

pub mod checkpoint;
pub mod groups;
pub mod loss;
pub mod optim;
pub mod outer;
pub mod plot;
pub mod trainer;

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::model::llama::Llama;
use crate::model::ModelError;
use crate::timeline::layout::PackedRow;
use crate::timeline::TimelineError;

/// `ts`' values as one float32 vector on the host, in order.
pub fn flat_f32(ts: &[Tensor]) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::with_capacity(ts.iter().map(Tensor::numel).sum());
    for t in ts {
        let f = t
            .detach()
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .contiguous()
            .view([-1]);
        out.extend(Vec::<f32>::try_from(&f)?);
    }
    Ok(out)
}

/// What can go wrong while training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{}: {problem}", path.display())]
    File { path: PathBuf, problem: String },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// Inputs that do not fit together (shapes, settings, a checkpoint of another model).
    #[error("{0}")]
    Invalid(String),
    #[error("packing the batch: {0}")]
    Layout(#[from] TimelineError),
    #[error(transparent)]
    Kernel(#[from] agentjet_kernels::KernelError),
}

impl TrainError {
    /// A file error naming the file.
    pub fn file(path: &Path, e: impl std::fmt::Display) -> TrainError {
        TrainError::File {
            path: path.to_path_buf(),
            problem: e.to_string(),
        }
    }
}

/// The current policy's log-probability of every target of `row` (in `row.targets`
/// order), float32 `[targets]`, differentiable: one forward over the row
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
