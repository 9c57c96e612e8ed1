//! How many cores this process should keep busy now, and how the engine and the trainer
//! share them.
//!
//! A server shares its machine: with its own trainer thread, with the agents of a local
//! client, with whatever else the user runs. Thread pools that assume they own every core
//! (OpenMP teams, our kernel pool) collapse when they do not: a fork-join step waits for
//! its slowest worker, and a worker that lost its core to another process holds up every
//! other. Measured on 2 cores with one busy process beside: decode fell to a quarter or a
//! sixth of its idle speed, though half the machine was still free. So the pools are sized
//! to the cores actually free:
//!
//! - [`Cores::allowed`]: what the process may run on (affinity, cgroup quota);
//! - [`Cores::available`]: that, minus the cores other processes kept busy over the last
//!   second (sampled from `/proc/stat` and `/proc/self/stat` every 250 ms; our own threads
//!   do not count against us), at least 1;
//! - while a trainer step runs ([`Cores::training`]) and the engine decodes
//!   ([`Cores::decoding`]), each gets half (the engine the odd core), so the two never run
//!   more threads than there are cores between them.
//!
//! `AGENTJET_THREADS=N` fixes the available count at N (no sampling): benchmarks that must
//! give two sides the same thread settings use it.
//!
//! Owns: the count, never a thread pool: the engine and the trainer size their own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Between two samples of the machine's load.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// Other processes' load, as a share of a core, at which a core counts as taken: a core
/// busy 65% of the time with another process is one a fork-join worker would keep losing.
const TAKEN_AT: f64 = 0.65;

/// The process's view of its cores (see the module docs).
pub struct Cores {
    allowed: usize,
    /// Set by the sampler (or the override).
    available: AtomicUsize,
    /// Trainer steps and engine steps in progress.
    training: AtomicUsize,
    decoding: AtomicUsize,
    fixed: bool,
}

/// The process's [`Cores`] (the sampler starts on first use).
pub fn cores() -> &'static Cores {
    static CORES: OnceLock<Cores> = OnceLock::new();
    CORES.get_or_init(|| {
        let allowed = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let fixed = std::env::var("AGENTJET_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0);
        let c = Cores {
            allowed,
            available: AtomicUsize::new(fixed.unwrap_or(allowed)),
            training: AtomicUsize::new(0),
            decoding: AtomicUsize::new(0),
            fixed: fixed.is_some(),
        };
        if fixed.is_none() && allowed > 1 && Load::read().is_some() {
            let spawned = std::thread::Builder::new()
                .name("agentjet-cores".into())
                .spawn(sample_forever);
            if let Err(e) = spawned {
                tracing::warn!(
                    "the core sampler did not start ({e}): pools keep {allowed} threads"
                );
            }
        }
        c
    })
}

/// Marks a step in progress while held.
pub struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Cores {
    /// Cores the process may run on.
    pub fn allowed(&self) -> usize {
        self.allowed
    }

    /// Cores free for this process now (at least 1).
    pub fn available(&self) -> usize {
        self.available
            .load(Ordering::Relaxed)
            .clamp(1, self.allowed.max(1))
    }

    /// Whether the count is fixed (`AGENTJET_THREADS`).
    pub fn fixed(&self) -> bool {
        self.fixed
    }

    /// A trainer step runs while the guard lives.
    pub fn training(&self) -> Busy<'_> {
        self.training.fetch_add(1, Ordering::Relaxed);
        Busy(&self.training)
    }

    /// An engine step runs while the guard lives.
    pub fn decoding(&self) -> Busy<'_> {
        self.decoding.fetch_add(1, Ordering::Relaxed);
        Busy(&self.decoding)
    }

    /// The engine's threads: all available cores, or the larger half while a trainer
    /// step runs.
    pub fn for_engine(&self) -> usize {
        let n = self.available();
        if self.training.load(Ordering::Relaxed) > 0 {
            (n - n / 2).max(1)
        } else {
            n
        }
    }

    /// The trainer's threads: all available cores, or the smaller half while the engine
    /// decodes.
    pub fn for_trainer(&self) -> usize {
        let n = self.available();
        if self.decoding.load(Ordering::Relaxed) > 0 {
            (n / 2).max(1)
        } else {
            n
        }
    }
}

/// Cumulative CPU time: the machine's busy and total ticks, and this process's.
#[derive(Debug, Clone, Copy)]
struct Load {
    busy: u64,
    total: u64,
    mine: u64,
}

impl Load {
    fn read() -> Option<Load> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let (busy, total) = machine_ticks(stat.lines().next()?)?;
        let me = std::fs::read_to_string("/proc/self/stat").ok()?;
        Some(Load {
            busy,
            total,
            mine: process_ticks(&me)?,
        })
    }
}

/// `cpu  user nice system idle iowait irq softirq steal ...`: (busy, all) ticks.
fn machine_ticks(line: &str) -> Option<(u64, u64)> {
    let mut it = line.split_whitespace();
    if it.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = it.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    let idle = v[3] + v[4];
    let all: u64 = v.iter().sum();
    Some((all - idle, all))
}

/// utime + stime of `/proc/self/stat` (fields 14 and 15; the command name may hold
/// spaces, so count from its closing parenthesis).
fn process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Cores other processes keep busy, from two samples: (machine busy - ours) over the
/// machine's ticks, times its cores.
fn others(a: Load, b: Load, machine_cores: usize) -> Option<f64> {
    let total = b.total.checked_sub(a.total)?;
    if total == 0 {
        return None;
    }
    let busy = b.busy.saturating_sub(a.busy);
    let mine = b.mine.saturating_sub(a.mine);
    Some(busy.saturating_sub(mine) as f64 / total as f64 * machine_cores as f64)
}

/// The count a load of `others` cores leaves of `allowed`.
fn free_of(allowed: usize, others: f64) -> usize {
    let free = allowed as f64 - others + TAKEN_AT;
    (free.floor().max(1.0) as usize).min(allowed)
}

fn sample_forever() {
    let c = cores();
    // /proc/stat counts every core of the machine, not only the ones we may use.
    let machine = std::fs::read_to_string("/proc/stat")
        .map(|s| {
            s.lines()
                .filter(|l| {
                    l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit)
                })
                .count()
        })
        .unwrap_or(c.allowed)
        .max(1);
    let Some(mut last) = Load::read() else {
        return;
    };
    let mut smoothed: Option<f64> = None;
    loop {
        std::thread::sleep(SAMPLE_EVERY);
        let Some(now) = Load::read() else {
            return;
        };
        if let Some(o) = others(last, now, machine) {
            // About a second's memory: one busy sample does not shrink the pools.
            let s = smoothed.map_or(o, |s| 0.5 * s + 0.5 * o);
            smoothed = Some(s);
            c.available.store(free_of(c.allowed, s), Ordering::Relaxed);
        }
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_lines_parse_and_a_busy_core_is_taken_from_the_count() {
        let (busy, all) = machine_ticks("cpu  100 5 50 800 20 3 2 0 0 0").expect("a cpu line");
        assert_eq!((busy, all), (160, 980));
        assert!(
            machine_ticks("cpu0 1 2 3 4 5").is_none(),
            "the aggregate line only"
        );
        assert!(machine_ticks("intr 1 2").is_none());
        // A command name with spaces and a parenthesis.
        let stat = "4242 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 123 45 0 0 20 0 1";
        assert_eq!(process_ticks(stat), Some(168));

        let a = Load {
            busy: 0,
            total: 0,
            mine: 0,
        };
        // 2 cores, 1 s (200 ticks): the machine busy 150 ticks, ours 50 of them.
        let b = Load {
            busy: 150,
            total: 200,
            mine: 50,
        };
        assert_eq!(others(a, b, 2), Some(1.0));
        assert_eq!(free_of(2, 1.0), 1, "one core taken of two");
        assert_eq!(free_of(2, 0.05), 2, "an idle machine");
        assert_eq!(free_of(2, 0.5), 2, "a half-busy core is still ours");
        assert_eq!(free_of(2, 2.0), 1, "never below one");
        assert_eq!(free_of(16, 3.0), 13);
    }

    #[test]
    fn a_training_step_and_decoding_split_the_cores() {
        let c = Cores {
            allowed: 4,
            available: AtomicUsize::new(4),
            training: AtomicUsize::new(0),
            decoding: AtomicUsize::new(0),
            fixed: true,
        };
        assert_eq!((c.for_engine(), c.for_trainer()), (4, 4));
        {
            let _d = c.decoding();
            assert_eq!((c.for_engine(), c.for_trainer()), (4, 2));
            let _t = c.training();
            assert_eq!((c.for_engine(), c.for_trainer()), (2, 2));
        }
        assert_eq!((c.for_engine(), c.for_trainer()), (4, 4));
        c.available.store(1, Ordering::Relaxed);
        let _d = c.decoding();
        let _t = c.training();
        assert_eq!((c.for_engine(), c.for_trainer()), (1, 1), "never 0");
    }
}
