//! A tiny fork-join pool for the decode kernels: the calling thread plus helper threads
//! that spin briefly between jobs, then park. A decode step calls a matmul every few tens
//! of microseconds; waking sleeping threads (futex) for each would cost as much as the
//! work.
//!
//! A job runs on as many workers as the caller asks ([`Pool::run_on`]; [`Pool::active`] is
//! the count the process's owner of the cores set): a fork-join step waits for its slowest
//! worker, so on a machine where another process holds a core, a job split over more
//! workers than there are free cores waits for a worker that lost its core. Workers not in
//! a job stay parked. The caller, waiting for its helpers, spins briefly and then yields
//! its core (a helper that was preempted gets it back sooner).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for every job; helpers run each generation once.
    generation: AtomicUsize,
    /// Workers in the current job (helpers from this index on sit it out).
    width: AtomicUsize,
    /// Helpers still working on the current job.
    pending: AtomicUsize,
    job: Mutex<Option<JobPtr>>,
    wake: Condvar,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the job outlives its run: `run` does not return until every helper is done.
unsafe impl Send for JobPtr {}

/// Spin this long for the next job before sleeping.
const SPIN: Duration = Duration::from_micros(500);
/// The caller spins this many rounds for its helpers before it yields between checks.
const WAIT_SPINS: u32 = 2000;

pub struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
    /// Workers a job should use now (see [`Pool::set_active`]).
    active: AtomicUsize,
    /// One job at a time; concurrent callers take turns.
    running: Mutex<()>,
}

impl Pool {
    fn new(helpers: usize) -> Pool {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            width: AtomicUsize::new(helpers + 1),
            pending: AtomicUsize::new(0),
            job: Mutex::new(None),
            wake: Condvar::new(),
        });
        for h in 0..helpers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("agentjet-kernel-{h}"))
                .spawn(move || helper(s, h + 1))
                .expect("spawn kernel helper thread");
        }
        Pool {
            shared,
            helpers,
            active: AtomicUsize::new(helpers + 1),
            running: Mutex::new(()),
        }
    }

    /// Workers in all (the caller included).
    pub fn workers(&self) -> usize {
        self.helpers + 1
    }

    /// Workers a job should use now: [`Pool::workers`] unless the owner of the cores set
    /// fewer.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed).clamp(1, self.workers())
    }

    /// Sets [`Pool::active`] (clamped to 1..=workers).
    pub fn set_active(&self, n: usize) {
        self.active
            .store(n.clamp(1, self.workers()), Ordering::Relaxed);
    }

    /// Runs `f(worker)` on every worker (0 is the caller) and returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        self.run_on(self.workers(), f)
    }

    /// Runs `f(worker)` for workers `0..n` (0 is the caller; `n` clamped to
    /// 1..=workers) and returns when all are done.
    pub fn run_on(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let n = n.clamp(1, self.workers());
        if n == 1 {
            f(0);
            return;
        }
        let _turn = self.running.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: lifetime erased; we wait below until no helper can touch `f`.
        let ptr: *const Job = unsafe { std::mem::transmute(f as *const (dyn Fn(usize) + Sync)) };
        {
            let mut job = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            *job = Some(JobPtr(ptr));
            self.shared.width.store(n, Ordering::SeqCst);
            self.shared.pending.store(n - 1, Ordering::SeqCst);
            self.shared.generation.fetch_add(1, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        f(0);
        let mut spins = 0u32;
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            if spins < WAIT_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

fn helper(s: Arc<Shared>, index: usize) {
    let mut seen = 0usize;
    // Left out of the last job: the pool runs narrower now, so wait without spinning.
    let mut left_out = false;
    loop {
        let start = Instant::now();
        while s.generation.load(Ordering::Acquire) == seen {
            if left_out || start.elapsed() > SPIN {
                let guard = s.job.lock().unwrap_or_else(|p| p.into_inner());
                let _guard = s
                    .wake
                    .wait_while(guard, |_| s.generation.load(Ordering::Acquire) == seen)
                    .unwrap_or_else(|p| p.into_inner());
                break;
            }
            std::hint::spin_loop();
        }
        // The job, its width and the generation are written together under `job`'s lock.
        let (job, width) = {
            let g = s.job.lock().unwrap_or_else(|p| p.into_inner());
            seen = s.generation.load(Ordering::Acquire);
            (*g, s.width.load(Ordering::Acquire))
        };
        left_out = index >= width;
        if left_out {
            continue;
        }
        if let Some(JobPtr(f)) = job {
            // SAFETY: `run` keeps the job alive until `pending` reaches zero. A panic in
            // the job must not leave `run` waiting forever.
            let _ =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*f)(index) }));
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

/// The process-wide pool: one worker per available core (`AGENTJET_KERNEL_THREADS`
/// overrides).
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("AGENTJET_KERNEL_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            })
            .max(1);
        Pool::new(n - 1)
    })
}
