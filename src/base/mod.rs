//! The base layer: small, LibTorch-free pieces every other layer may use and that use
//! nothing of the crate themselves: the allocator policy, byte strings in serde, the cores
//! free for the process and how its engine and trainer share them, the random generator,
//! the stop signal of a process and its tasks, the lock policy, file names and durable
//! writes, JSON's non-finite numbers, SVG line plots and Prometheus text.
//!
//! Owns: only these. Never imports another module of the crate (the layering test
//! checks it; see docs/ARCHITECTURE.md).

pub mod alloc;
pub mod bytes;
pub mod cores;
pub mod events;
pub mod files;
pub mod hex;
pub mod json;
pub mod plot;
pub mod prom;
pub mod rng;
pub mod stop;
pub mod sync;

pub use cores::cores;
pub use files::safe_file_name;
pub use rng::Rng;
pub use stop::{Stop, StopMode};
pub use sync::lock;

/// Writes what stdout holds now (lines other programs wait for, such as an address).
pub fn flush_stdout() {
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
}
