//! A role's typed events, as they happen: kept in memory (the last [`KEPT`]), handed to
//! whoever waits for one, and written as JSON lines to a file when asked (`--events
//! FILE`). Printed lines are for people; a program (a test, a script, a supervisor) waits
//! on these.
//!
//! Owns: the record of what happened. Never decides anything from it.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::lock;

/// Events kept in memory; older ones are only in the file.
pub const KEPT: usize = 4096;

/// A cloneable handle on one role's event record.
pub struct Events<E> {
    inner: Arc<Inner<E>>,
}

impl<E> Clone for Events<E> {
    fn clone(&self) -> Self {
        Events {
            inner: self.inner.clone(),
        }
    }
}

impl<E> std::fmt::Debug for Events<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("kept", &lock(&self.inner.kept).len())
            .finish_non_exhaustive()
    }
}

struct Inner<E> {
    kept: Mutex<VecDeque<E>>,
    changed: Condvar,
    file: Mutex<Option<std::fs::File>>,
}

impl<E: Clone + Serialize> Events<E> {
    /// A record, written to `file` too (created or truncated) when given.
    pub fn new(file: Option<&Path>) -> std::io::Result<Events<E>> {
        let file = match file {
            Some(p) => {
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                Some(std::fs::File::create(p)?)
            }
            None => None,
        };
        Ok(Events {
            inner: Arc::new(Inner {
                kept: Mutex::new(VecDeque::new()),
                changed: Condvar::new(),
                file: Mutex::new(file),
            }),
        })
    }

    /// Records `e`. A file that cannot be written is closed with a warning: the role goes
    /// on without it.
    pub fn emit(&self, e: E) {
        {
            let mut f = lock(&self.inner.file);
            if let Some(file) = f.as_mut() {
                let written = serde_json::to_string(&e)
                    .map_err(std::io::Error::other)
                    .and_then(|line| writeln!(file, "{line}"))
                    .and_then(|()| file.flush());
                if let Err(err) = written {
                    tracing::warn!("the events file: {err}; no more events are written to it");
                    *f = None;
                }
            }
        }
        let mut kept = lock(&self.inner.kept);
        if kept.len() >= KEPT {
            kept.pop_front();
        }
        kept.push_back(e);
        self.inner.changed.notify_all();
    }

    /// The events kept, oldest first.
    pub fn snapshot(&self) -> Vec<E> {
        lock(&self.inner.kept).iter().cloned().collect()
    }

    /// The first kept or coming event `f` accepts, waiting up to `timeout` (blocking).
    pub fn wait_for(&self, timeout: Duration, f: impl Fn(&E) -> bool) -> Option<E> {
        let deadline = Instant::now() + timeout;
        let mut kept = lock(&self.inner.kept);
        loop {
            if let Some(e) = kept.iter().find(|e| f(e)) {
                return Some(e.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            kept = self
                .inner
                .changed
                .wait_timeout(kept, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize)]
    #[serde(tag = "event", rename_all = "snake_case")]
    enum Ev {
        Step { n: u64 },
        Done,
    }

    #[test]
    fn events_are_kept_waited_for_and_written_as_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/events.jsonl");
        let ev: Events<Ev> = Events::new(Some(&path)).unwrap();
        ev.emit(Ev::Step { n: 1 });
        let e2 = ev.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            e2.emit(Ev::Step { n: 2 });
            e2.emit(Ev::Done);
        });
        // An event already kept, then one still to come.
        assert_eq!(
            ev.wait_for(Duration::ZERO, |e| matches!(e, Ev::Step { n: 1 })),
            Some(Ev::Step { n: 1 })
        );
        assert_eq!(
            ev.wait_for(Duration::from_secs(5), |e| *e == Ev::Done),
            Some(Ev::Done)
        );
        t.join().unwrap();
        assert_eq!(
            ev.wait_for(Duration::from_millis(20), |e| matches!(
                e,
                Ev::Step { n: 3 }
            )),
            None
        );
        assert_eq!(ev.snapshot().len(), 3);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"event\":\"step\",\"n\":1}\n{\"event\":\"step\",\"n\":2}\n{\"event\":\"done\"}\n"
        );
        for i in 0..KEPT as u64 + 10 {
            ev.emit(Ev::Step { n: i });
        }
        assert_eq!(ev.snapshot().len(), KEPT, "bounded");
    }
}
