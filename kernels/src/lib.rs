//! # agentjet-kernels
//!
//! Compute kernels that LibTorch does not do well for us, on plain slices (the model code
//! wraps tensors around them).
//!
//! - [`matmul_bf16`]: `y = x · Wᵀ` for a few rows of float32 activations `x` against bfloat16
//!   weights `W` stored row-major `[n, k]`, accumulating in float32. Single-stream and
//!   small-batch decode are bound by reading the weights from memory; bfloat16 weights halve
//!   those bytes, and LibTorch's own bfloat16 matrix-vector path on CPU runs at float32
//!   speed (measured: 5.2 ms vs 5.7 ms for a 49152 x 576 head on a 2-core machine). AVX-512
//!   and AVX2+FMA paths are picked at run time, with a portable fallback; rows of `W` are
//!   split across a small fork-join pool whose helpers spin between jobs (a decode step
//!   calls a matmul every few tens of microseconds; a futex wake-up per call costs as much
//!   as the work). The pool assumes it has the cores: a process that uses it should run
//!   LibTorch with one intra-op thread (the model code does this for bfloat16 on CPU),
//!   otherwise OpenMP's spinning workers and ours fight over the same cores.
//!
//! - [`logprobs`] (feature `torch`): token log-probabilities and entropies of an output
//!   layer, forward and backward, a chunk of rows at a time, so training never holds a
//!   float32 [tokens x vocabulary] log-softmax (tch; runs on the tensors' device).
//!
//! Must never allocate per call beyond rayon's task bookkeeping, and never panic on shapes
//! a caller can get wrong: shape mismatches are [`KernelError`]s.

mod bf16_matmul;
#[cfg(feature = "torch")]
pub mod logprobs;
mod pool;

pub use bf16_matmul::{matmul_bf16, simd_level, MAX_ROWS};
pub use pool::{global as pool, Pool};

/// A kernel was called with slices that do not fit the shapes given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{kernel}: {problem}")]
    Shape {
        kernel: &'static str,
        problem: String,
    },
}
