//! The process's allocator policy for tensor work on the CPU.
//!
//! A training step and a decode step allocate and free the same large blocks again and
//! again (activations, logits chunks, gradients: tens to hundreds of MB each). glibc's
//! malloc serves every block over 32 MB with a fresh `mmap` and returns it with `munmap`
//! on free, so the kernel zeroes every page of it again on its first touch: in a profile of
//! learn_addition (SmolLM2-135M, 2 cores) 15% of the samples were in the kernel, 6% in its
//! page clearing alone, and three training steps (the same tokens) took 53.0 s with glibc's
//! defaults and 40.0 s with freed memory kept for the next allocation.
//! PyTorch's CPU performance guides give the same advice (a caching allocator such as
//! jemalloc or tcmalloc); this keeps glibc and changes two of its settings.
//!
//! Where it holds: glibc's main arena (the main thread, where learn_addition trains). A
//! thread with an arena of its own (an engine thread, a server's trainer thread) gets
//! blocks up to 64 MB from that arena's heap, but one over 64 MB is still mapped on its
//! own (glibc's fallback), so there the gain is partial and has not been measured.
//! (`M_ARENA_MAX` 1 would put every thread on the main arena: in netsim's scenario 6, a
//! hundred followers in one process, it made the process slower, its timer lag p99
//! 391-471 ms against 160-261 ms with the top pad, one run each.)
//!
//! The cost: memory freed stays in the process (up to 1 GiB of free space at the top of
//! the heap before glibc trims it, and each thread arena's emptied heaps, up to 64 MB
//! each), so the resident size stays near its peak; for a process that trains or serves
//! a model that peak is what it needs anyway.

/// Keeps freed memory for the next allocations: no `mmap` for large blocks (they come from
/// the heap and go back to it), the heap's top trimmed only past 1 GiB of free space, and
/// a top pad of 64 MiB, which also keeps a thread's arena from unmapping a heap that fell
/// empty (glibc does that whatever the trim threshold; a follower frees a version's
/// chunks each version and would zero their pages again: netsim's scenario 6 showed
/// seconds of it).
/// Call it once at the start of a process that runs LibTorch; blocks already mapped stay
/// as they are. Returns whether the settings took (false where the C library is not
/// glibc).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets glibc's malloc parameters (under the arena's lock) and
        // touches no memory of ours.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30) == 1
                && libc::mallopt(libc::M_TOP_PAD, 64 << 20) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_blocks_still_allocate_and_hold_their_values_after_the_change() {
        let took = keep_freed_memory();
        assert_eq!(took, cfg!(all(target_os = "linux", target_env = "gnu")));
        // Blocks far over glibc's mmap threshold, freed and allocated again. (Whether they
        // come from the heap cannot be checked here: the test's thread has its own arena,
        // and such an arena still maps a block over 64 MB on its own; see the module docs.)
        for round in 0..3u8 {
            let mut v = vec![round; 200 << 20];
            v[123_456_789] = round.wrapping_add(1);
            assert_eq!(v[0], round);
            assert_eq!(v[123_456_789], round.wrapping_add(1));
            assert_eq!(v[(200 << 20) - 1], round);
        }
    }
}
