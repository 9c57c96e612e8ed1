//! The process's one runtime and its stop: the first Ctrl-C or SIGTERM drains (running
//! work finishes, state is saved, exit 0), a second one aborts.

use agentjet::base::{Stop, StopMode};
use anyhow::{Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};

/// The one async runtime of the process.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Ctrl-C (SIGINT) and SIGTERM, registered as soon as a command starts, so that a signal
/// sent while a model is still loading is not missed (and does not kill the process).
struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
}

impl StopSignals {
    /// Registers both; call within the runtime.
    fn register() -> Result<StopSignals> {
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt()).context("listening for Ctrl-C")?,
            terminate: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
        })
    }

    /// Turns the signals into `stop`: the first drains, the second aborts.
    async fn watch(mut self, stop: Stop) {
        for mode in [StopMode::Drain, StopMode::Abort] {
            tokio::select! {
                _ = self.interrupt.recv() => {}
                _ = self.terminate.recv() => {}
            }
            if mode == StopMode::Abort {
                println!("aborting what still runs");
                agentjet::base::flush_stdout();
            }
            stop.request(mode);
        }
    }
}

/// Runs `body` on the runtime with a stop fed by the signals.
pub fn with_signals<F, Fut>(body: F) -> Result<()>
where
    F: FnOnce(Stop) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let rt = runtime()?;
    let stop = Stop::new();
    let signals = {
        let _in_runtime = rt.enter();
        StopSignals::register()?
    };
    rt.spawn(signals.watch(stop.clone()));
    let r = rt.block_on(body(stop));
    // Tasks that ignored the stop do not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    r
}

/// Runs blocking work (a model on this thread) with the same signals: `work` sees the stop
/// (a drain) and ends early where that makes sense; an abort ends the process at once.
#[cfg(feature = "torch")]
pub fn blocking_with_signals<F>(work: F) -> Result<()>
where
    F: FnOnce(Stop) -> Result<()> + Send + 'static,
{
    with_signals(|stop| async move {
        let s = stop.clone();
        let job = tokio::task::spawn_blocking(move || work(s));
        tokio::select! {
            r = job => r.context("the command's thread")?,
            _ = stop.aborted() => anyhow::bail!("aborted (a second Ctrl-C or SIGTERM)"),
        }
    })
}
