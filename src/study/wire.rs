//! What a study's driver and a study worker (`agentjet-peer study worker`) say to each
//! other on `/agentjet/study/1`: one request and one reply per stream, postcard frames
//! (see `swarm::frame`). A worker runs the arms a driver sends it as its own processes
//! (the same [`super::launch`] code as the driver's machine), and answers each look with
//! the arm's state and the new bytes of its metrics.
//!
//! A worker takes requests only from the drivers it was told to (`--allow-driver PEER`):
//! an arm's client runs the study's agent command, so launching one is running a
//! program on the worker's machine.

use serde::{Deserialize, Serialize};

use super::launch::Exited;

pub const PROTOCOL: crate::swarm::StreamProtocol =
    crate::swarm::StreamProtocol::new("/agentjet/study/1");

/// The status field (`PeerStatus::extra`) a worker gossips: its slots, e.g. "2".
pub const WORKER_FIELD: &str = "study_worker";

/// The largest frame either side reads (a reply carries up to [`METRICS_CHUNK`] bytes of
/// metrics; a launch, an arm's flags and environment).
pub const MAX_FRAME: usize = 2 << 20;

/// The most bytes of an arm's metrics one reply carries.
pub const METRICS_CHUNK: usize = 1 << 20;

/// Which arm: the study (its name and the first 16 hex digits of its hash: a worker keeps
/// its arms in a directory of that name) and the arm's id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ArmKey {
    pub study: String,
    pub arm: usize,
}

impl ArmKey {
    /// Refuses what could leave the worker's directory or is not a study's arm.
    pub fn check(&self) -> Result<(), String> {
        let ok = !self.study.is_empty()
            && self.study.len() <= 160
            && !self.study.starts_with('.')
            && self
                .study
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !ok {
            return Err(format!("{:?} is not a study's name", self.study));
        }
        if self.arm >= super::spec::MAX_ARMS * 4 {
            return Err(format!("arm {} is out of range", self.arm));
        }
        Ok(())
    }
}

impl Request {
    /// The request with its study's name in `driver`'s own space on the worker
    /// (`<driver>-<study>`): a driver sees and touches its own arms alone, and a study
    /// run again from a new directory (a new driver identity) starts afresh.
    pub fn scoped(mut self, driver: &crate::swarm::PeerId) -> Request {
        let study = match &mut self {
            Request::Keepalive { study } => Some(study),
            r => r.key_mut().map(|k| &mut k.study),
        };
        if let Some(s) = study {
            *s = format!("{driver}-{s}");
        }
        self
    }

    /// The arm the request is about (none: a hello or a keepalive).
    pub fn key_mut(&mut self) -> Option<&mut ArmKey> {
        match self {
            Request::Seed { key, .. }
            | Request::Launch { key, .. }
            | Request::Look { key, .. }
            | Request::RestartClient { key }
            | Request::Stop { key } => Some(key),
            Request::Hello | Request::Keepalive { .. } => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// The worker's slots and the arms it runs now.
    Hello,
    /// Gives `key`'s arm the checkpoint (and metrics so far) of arm `from` of the same
    /// study, which ran on this worker (PBT's exploit); once.
    Seed { key: ArmKey, from: usize },
    /// Starts the arm's server (its client follows once it serves), to run to `steps`
    /// training steps: the worker stops it there itself (its driver may be away). An
    /// arm that runs there already is taken up again (its target set), not started
    /// twice; one still stopping, or no free slot, is refused.
    Launch {
        key: ArmKey,
        steps: u64,
        model: String,
        server: Vec<String>,
        client: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// The arm's state and its metrics from byte `metrics_from` on.
    Look { key: ArmKey, metrics_from: u64 },
    /// Starts the arm's client again once it ran its tasks to the end (refused while it
    /// runs).
    RestartClient { key: ArmKey },
    /// Stops the arm: the client at once, the server drains and saves its checkpoint.
    /// Answered at once; a later look says when it is gone.
    Stop { key: ArmKey },
    /// The driver of `study` is alive: its arms here go on (a worker stops the arms of a
    /// driver that sent no look or keepalive for its lease).
    Keepalive { study: String },
}

/// Where a worker's arm is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Phase {
    /// The server runs, its client not yet.
    Starting,
    Serving,
    /// A process exited on its own (said until the arm is stopped or its client
    /// restarted).
    Exited(Exited),
    /// Stopping (its server drains).
    Stopping,
    /// No process of it runs on the worker.
    Gone,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Hello {
        slots: u32,
        running: Vec<ArmKey>,
    },
    Seeded {
        step: Option<u64>,
    },
    Done,
    Look(Look),
    /// Why the request was not carried out.
    Refused(String),
}

/// One look at a worker's arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Look {
    pub phase: Phase,
    /// The server's run directory's name (`runs/<run>`), once it has one.
    pub run: Option<String>,
    /// The metrics file's length now, and its bytes from the asked offset (at most
    /// [`METRICS_CHUNK`]); a length below the offset: the file was written anew.
    pub metrics_len: u64,
    pub metrics: Vec<u8>,
    /// The metrics file's inode: a server that resumes from its checkpoint writes the
    /// file anew (cut back to the checkpoint's steps), and its mirror starts again.
    pub metrics_file: u64,
    /// The saved checkpoint's step and path on the worker.
    pub checkpoint_step: Option<u64>,
    pub checkpoint: Option<String>,
}

/// A run directory's name as a worker sends it, checked before the driver makes it a
/// directory of its own.
pub fn run_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_run_names_that_leave_their_directory_are_refused() {
        let k = |s: &str, arm| ArmKey {
            study: s.into(),
            arm,
        };
        assert!(k("tiny-study-0123456789abcdef", 3).check().is_ok());
        for bad in ["", "..", "../x", "a/b", ".hidden", "a b"] {
            assert!(k(bad, 0).check().is_err(), "{bad:?}");
        }
        assert!(k("s", usize::MAX).check().is_err());
        assert!(run_name_ok("tiny"));
        for bad in ["", ".", "..", "a/b", "x\0"] {
            assert!(!run_name_ok(bad), "{bad:?}");
        }
    }
}
