//! Keeps a server's certificate current while it runs. With `--cert FILE` the file is
//! read again when it changes, so a renewed certificate is gossiped without a restart;
//! with `--run-key` the server certifies itself again (for a year, same grant) once less
//! than half a year is left. A day before its certificate expires, and once it has, the
//! server says so (expired: its calls count nowhere and clients stop routing to it).
//!
//! Owns: [`CertRenewal`] and its task. Never decides what a certificate allows
//! (`swarm::trust`; the server's own check is passed in).

use std::path::PathBuf;
use std::time::Duration;

use tracing::warn;

use super::events::ServerEvent;
use crate::base::events::Events;
use crate::base::stop::{Stop, TaskTracker};
use crate::swarm::trust::{unix_now, Certified};
use crate::swarm::{Certificate, Grant, RunKey, SwarmHandle};

/// Where a server's certificate is renewed from while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertRenewal {
    /// `--cert FILE`: read again whenever its bytes change.
    File(PathBuf),
    /// `--run-key FILE`: the server certifies itself again before its certificate is
    /// half way to expiry.
    RunKey(PathBuf),
}

/// How often the source is looked at.
const EVERY: Duration = Duration::from_secs(2);
/// A self-certificate's validity, and when it is renewed.
const SELF_VALID_S: u64 = 365 * 24 * 3600;
const SELF_RENEW_S: u64 = SELF_VALID_S / 2;
/// When an expiring certificate is announced.
const WARN_S: u64 = 24 * 3600;

/// Runs the renewal until `stop`. `check` says whether a certificate allows this server
/// what it was started for (serving or training its model).
pub(super) fn spawn(
    renewal: CertRenewal,
    swarm: SwarmHandle,
    check: impl Fn(&Certified) -> Result<(), String> + Send + 'static,
    stop: Stop,
    tasks: &TaskTracker,
    events: Events<ServerEvent>,
) {
    tasks.spawn(async move {
        // What a self-certificate grants: what the one made at start granted.
        let grant = swarm.cfg.cert.as_ref().map(|c| c.grant().clone());
        let mut r = Renewer {
            renewal,
            swarm,
            check: Box::new(check),
            grant,
            last: None,
            warned_soon: false,
            warned_expired: false,
            warned_key: false,
            events,
        };
        // The file as it was at start is the certificate in use.
        if let CertRenewal::File(p) = &r.renewal {
            r.last = std::fs::read(p).ok();
        }
        let mut tick = tokio::time::interval(EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => r.tick(),
                _ = stop.requested() => return,
            }
        }
    });
}

/// Whether a certificate allows what this server runs for.
type Allows = Box<dyn Fn(&Certified) -> Result<(), String> + Send>;

struct Renewer {
    renewal: CertRenewal,
    swarm: SwarmHandle,
    check: Allows,
    grant: Option<Grant>,
    /// The file's bytes last looked at.
    last: Option<Vec<u8>>,
    warned_soon: bool,
    warned_expired: bool,
    warned_key: bool,
    events: Events<ServerEvent>,
}

impl Renewer {
    fn tick(&mut self) {
        let now = unix_now();
        let current = self.swarm.own_cert();
        match &self.renewal {
            CertRenewal::File(path) => {
                let bytes = std::fs::read(path).ok();
                if bytes.is_some() && bytes != self.last {
                    self.last = bytes;
                    let source = path.display().to_string();
                    match Certificate::load(path).map_err(|e| e.to_string()) {
                        Ok(c) => self.install(c, &source),
                        Err(e) => {
                            warn!(
                                "trust: {source} changed but is not used: {e}; the current \
                                 certificate stays"
                            );
                            self.events
                                .emit(ServerEvent::CertNotUsed { source, error: e });
                        }
                    }
                }
            }
            CertRenewal::RunKey(path) => {
                let due = current.is_none_or(|c| c.not_after_unix < now + SELF_RENEW_S);
                if let (true, Some(grant)) = (due, self.grant.clone()) {
                    match RunKey::load(path) {
                        Ok(key) => {
                            let cert = key.certify(&self.swarm.peer_id, grant, now + SELF_VALID_S);
                            self.install(cert, "the run key");
                        }
                        Err(e) if !self.warned_key => {
                            self.warned_key = true;
                            warn!("trust: renewing the certificate: --run-key {e}");
                        }
                        Err(_) => {}
                    }
                }
            }
        }
        self.announce_expiry(now);
    }

    /// Checks a new certificate and, if it verifies and allows what this server does,
    /// puts it in use.
    fn install(&mut self, cert: Certificate, source: &str) {
        let r = self
            .swarm
            .cfg
            .run
            .as_ref()
            .ok_or_else(|| "this server trusts no run".to_string())
            .and_then(|run| {
                cert.verify(run, &self.swarm.peer_id)
                    .map_err(|e| e.to_string())
            })
            .and_then(|c| (self.check)(&c))
            .and_then(|()| self.swarm.renew_cert(cert).map_err(|e| e.to_string()));
        match r {
            Ok(c) => {
                println!(
                    "trust: certificate renewed from {source}: valid for {} more s \
                     (until Unix time {})",
                    c.not_after_unix.saturating_sub(unix_now()),
                    c.not_after_unix
                );
                self.warned_soon = false;
                self.warned_expired = false;
                self.warned_key = false;
                self.events.emit(ServerEvent::CertRenewed {
                    source: source.to_string(),
                    not_after_unix: c.not_after_unix,
                });
            }
            Err(e) => {
                warn!("trust: a new certificate from {source} is not used: {e}");
                self.events.emit(ServerEvent::CertNotUsed {
                    source: source.to_string(),
                    error: e,
                });
            }
        }
    }

    fn announce_expiry(&mut self, now: u64) {
        let how = match &self.renewal {
            CertRenewal::File(p) => {
                format!("renew it (`agentjet-peer certify`) into {}", p.display())
            }
            CertRenewal::RunKey(p) => format!("check the run key {}", p.display()),
        };
        match self.swarm.own_cert() {
            Some(c) if c.not_after_unix < now + WARN_S && !self.warned_soon => {
                self.warned_soon = true;
                warn!(
                    "trust: this server's certificate expires in {} s: {how}",
                    c.not_after_unix.saturating_sub(now)
                );
            }
            None if !self.warned_expired => {
                self.warned_expired = true;
                warn!(
                    "trust: this server's certificate has expired: the calls it signs count \
                     nowhere and clients do not route to it; {how}"
                );
            }
            _ => {}
        }
    }
}
