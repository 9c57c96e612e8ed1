//! A tiny fork-join pool for the decode kernels: the calling thread plus helper threads
//! that spin briefly between jobs. A decode step calls a matmul every few tens of
//! microseconds; waking sleeping threads (futex) for each would cost as much as the work.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for every job; helpers run each generation once.
    generation: AtomicUsize,
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

pub struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
    /// One job at a time; concurrent callers take turns.
    running: Mutex<()>,
}

impl Pool {
    fn new(helpers: usize) -> Pool {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
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
            running: Mutex::new(()),
        }
    }

    /// Workers in all (the caller included).
    pub fn workers(&self) -> usize {
        self.helpers + 1
    }

    /// Runs `f(worker)` on every worker (0 is the caller) and returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.helpers == 0 {
            f(0);
            return;
        }
        let _turn = self.running.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: lifetime erased; we wait below until no helper can touch `f`.
        let ptr: *const Job = unsafe { std::mem::transmute(f as *const (dyn Fn(usize) + Sync)) };
        {
            let mut job = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            *job = Some(JobPtr(ptr));
            self.shared.pending.store(self.helpers, Ordering::SeqCst);
            self.shared.generation.fetch_add(1, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        f(0);
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
    }
}

fn helper(s: Arc<Shared>, index: usize) {
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        while s.generation.load(Ordering::Acquire) == seen {
            if start.elapsed() > SPIN {
                let guard = s.job.lock().unwrap_or_else(|p| p.into_inner());
                let _guard = s
                    .wake
                    .wait_while(guard, |_| s.generation.load(Ordering::Acquire) == seen)
                    .unwrap_or_else(|p| p.into_inner());
                break;
            }
            std::hint::spin_loop();
        }
        seen = s.generation.load(Ordering::Acquire);
        let job = *s.job.lock().unwrap_or_else(|p| p.into_inner());
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
