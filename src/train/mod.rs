//! Training. Today: the AdamW optimizer over a model's parameter tensors. The RL trainer
//! (group buffer, advantages, GRPO-family losses, policy versions, checkpoints) builds on it
//! in the trainer issue.

pub mod optim;
