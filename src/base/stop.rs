//! How things stop: one tree of [`Stop`] signals with two levels, and
//! [`TaskTracker`]s for the tasks they stop.
//!
//! - [`StopMode::Drain`]: take no new work; finish what was accepted (running requests,
//!   streams, the training step in progress, episodes in flight), save, and end.
//! - [`StopMode::Abort`]: end now; work in progress is cancelled. What was acknowledged
//!   is already on disk (that is when it is acknowledged), so an abort loses only
//!   unacknowledged work, which its sender retries.
//!
//! A process has one root `Stop` (the binary turns the first Ctrl-C or SIGTERM into a
//! drain and a second, or the drain timeout, into an abort); each subsystem takes a
//! [`Stop::child`], which stops with its parent and can also be stopped alone. Every task
//! a subsystem spawns goes into its `TaskTracker`, which its owner closes and waits for.
//!
//! Owns: the stop signal. Never decides what a subsystem does when it hears it.

use std::time::Duration;

pub use tokio_util::sync::CancellationToken;
pub use tokio_util::task::TaskTracker;

/// How to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Finish what was accepted, save, end.
    Drain,
    /// End now, cancelling work in progress.
    Abort,
}

/// A stop signal: cheap to clone, waitable from async code, checkable from any thread.
#[derive(Debug, Clone, Default)]
pub struct Stop {
    drain: CancellationToken,
    abort: CancellationToken,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// A signal that stops with this one (same mode) and can also be stopped alone.
    pub fn child(&self) -> Stop {
        Stop {
            drain: self.drain.child_token(),
            abort: self.abort.child_token(),
        }
    }

    /// Asks for a stop. An abort also drains; a drain after an abort changes nothing.
    pub fn request(&self, mode: StopMode) {
        self.drain.cancel();
        if mode == StopMode::Abort {
            self.abort.cancel();
        }
    }

    /// The stop asked for so far, if any.
    pub fn mode(&self) -> Option<StopMode> {
        if self.abort.is_cancelled() {
            Some(StopMode::Abort)
        } else if self.drain.is_cancelled() {
            Some(StopMode::Drain)
        } else {
            None
        }
    }

    /// Resolves once any stop is asked for, with the mode at that moment.
    pub async fn requested(&self) -> StopMode {
        self.drain.cancelled().await;
        self.mode().unwrap_or(StopMode::Drain)
    }

    /// Resolves once an abort is asked for.
    pub async fn aborted(&self) {
        self.abort.cancelled().await
    }

    /// The token cancelled by any stop (for APIs that take a token or a future, such as a
    /// server's graceful shutdown).
    pub fn drain_token(&self) -> CancellationToken {
        self.drain.clone()
    }
}

/// Closes `tasks` and waits for them: up to `drain` after a drain was asked for; then (or
/// at once, on an abort) asks `stop` to abort and waits up to `abort_grace` more. True if
/// every task ended.
pub async fn wind_down(
    tasks: &TaskTracker,
    stop: &Stop,
    drain: Duration,
    abort_grace: Duration,
) -> bool {
    tasks.close();
    if stop.mode() != Some(StopMode::Abort) {
        tokio::select! {
            _ = tasks.wait() => return true,
            _ = tokio::time::sleep(drain) => {
                tracing::warn!(
                    running = tasks.len(),
                    "drain timeout ({:.0} s): aborting what still runs",
                    drain.as_secs_f64()
                );
            }
            _ = stop.aborted() => {}
        }
        stop.request(StopMode::Abort);
    }
    tokio::time::timeout(abort_grace, tasks.wait())
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn children_stop_with_their_parent_and_alone() {
        let root = Stop::new();
        let a = root.child();
        let b = root.child();
        assert_eq!(a.mode(), None);
        a.request(StopMode::Drain);
        assert_eq!(a.mode(), Some(StopMode::Drain));
        assert_eq!(b.mode(), None, "a sibling is not stopped");
        assert_eq!(root.mode(), None, "the parent is not stopped");
        root.request(StopMode::Abort);
        assert_eq!(b.requested().await, StopMode::Abort);
        a.aborted().await;
        root.request(StopMode::Drain);
        assert_eq!(
            root.mode(),
            Some(StopMode::Abort),
            "a drain does not undo an abort"
        );
    }

    #[tokio::test]
    async fn wind_down_drains_then_aborts_what_outlives_the_drain() {
        let stop = Stop::new();
        let tasks = TaskTracker::new();
        // One task finishes its work when asked to drain; one only ends on abort.
        let s = stop.clone();
        tasks.spawn(async move {
            s.requested().await;
        });
        let s = stop.clone();
        tasks.spawn(async move {
            s.aborted().await;
        });
        stop.request(StopMode::Drain);
        let ended = wind_down(
            &tasks,
            &stop,
            Duration::from_millis(200),
            Duration::from_millis(200),
        )
        .await;
        assert!(ended);
        assert_eq!(stop.mode(), Some(StopMode::Abort), "the drain timed out");
        // A task that ignores even the abort is reported.
        let stop = Stop::new();
        let tasks = TaskTracker::new();
        tasks.spawn(std::future::pending::<()>());
        stop.request(StopMode::Abort);
        assert!(
            !wind_down(
                &tasks,
                &stop,
                Duration::from_millis(200),
                Duration::from_millis(200)
            )
            .await
        );
    }
}
