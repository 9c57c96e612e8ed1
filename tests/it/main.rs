//! The library's tests, in process (one binary: one link of LibTorch for all of them):
//! the model and its loaders against HF's references, the engine, timelines and their
//! training layouts, the trainer, the training group's arithmetic, the swarm's limits and
//! the prefix cache. The roles, real processes, Python and a browser are in `tests/e2e`.

#[path = "../common/mod.rs"]
mod common;

mod engine;
mod families;
mod family_lora;
mod gguf_files;
mod group;
mod hf_dir_errors;
mod lora;
mod model_tiny;
mod multi_adapter;
mod on_policy;
mod prefix_cache;
mod smollm2_reference;
mod swarm_limits;
mod timeline;
mod tracking;
mod trainer;
