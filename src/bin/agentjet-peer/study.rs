//! `agentjet-peer study run|status|report STUDY.toml`: the study driver
//! (`agentjet::study`) with this binary as the arms' `agentjet-peer`, and the first
//! Ctrl-C or SIGTERM as its stop (the running arms' servers drain and save their
//! checkpoints; running the command again goes on). A second one exits at once.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use agentjet::study::{self, Outcome, Study};
use anyhow::{Context, Result};

use super::args::{secs, StudyAction, StudyArgs, WorkerArgs};

fn open(a: &StudyArgs) -> Result<(Study, std::path::PathBuf)> {
    let s = Study::load(&a.file)?;
    let dir = a.dir.clone().unwrap_or_else(|| study::default_dir(&s));
    Ok((s, dir))
}

/// Serves the study's page at `addr` on a thread of its own until the process ends;
/// returns its URL.
fn dashboard(addr: &str, s: &Study, dir: &std::path::Path) -> Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("a runtime for the dashboard")?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("--dashboard {addr}"))?;
    let local = listener.local_addr()?;
    let app = study::dash::router(s.clone(), dir.to_path_buf());
    std::thread::Builder::new()
        .name("study-dashboard".into())
        .spawn(move || {
            let stop = agentjet::base::Stop::new();
            if let Err(e) = rt.block_on(agentjet::facade::http::serve_until(listener, app, stop)) {
                eprintln!("the study's dashboard stopped: {e}");
            }
        })
        .context("starting the dashboard's thread")?;
    Ok(format!("http://{local}/"))
}

pub fn run(action: StudyAction) -> Result<()> {
    match action {
        StudyAction::Run(a) => {
            let (s, dir) = open(&a)?;
            if !cfg!(feature = "torch") {
                anyhow::bail!(
                    "study run: this is the client-only build, whose binary cannot run the \
                     arms' servers; run the study with the full build"
                );
            }
            let stop = Arc::new(AtomicBool::new(false));
            for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
                // The second signal exits at once; the first sets the flag.
                signal_hook::flag::register_conditional_shutdown(sig, 130, stop.clone())
                    .context("installing the signal handlers")?;
                signal_hook::flag::register(sig, stop.clone())
                    .context("installing the signal handlers")?;
            }
            let opts = study::Options {
                exe: std::env::current_exe().context("finding this binary")?,
                dir: dir.clone(),
                stop,
                poll: Duration::from_millis(500),
            };
            println!("study {} in {}", s.name, dir.display());
            if let Some(addr) = &a.dashboard {
                let url = dashboard(addr, &s, &dir)?;
                println!("dashboard: {url}");
            }
            let outcome = match study::run(&s, &opts) {
                Ok(o) => o,
                Err(e) => {
                    // What the study did so far is still worth its report.
                    if let Ok(r) = study::report::write(&s, &dir) {
                        eprintln!("report so far: {}", r.display());
                    }
                    return Err(e.into());
                }
            };
            let report = study::report::write(&s, &dir)?;
            match outcome {
                Outcome::Ended { winner, reason } => {
                    match winner {
                        Some((id, name)) => {
                            println!(
                                "study {}: ended ({reason}); winner: arm {id} ({name})",
                                s.name
                            )
                        }
                        None => println!("study {}: ended ({reason}); no winner", s.name),
                    }
                    println!("report: {}", report.display());
                }
                Outcome::Paused => println!(
                    "study {}: paused; report so far: {}",
                    s.name,
                    report.display()
                ),
            }
            Ok(())
        }
        StudyAction::Status(a) | StudyAction::Report(a) if a.dashboard.is_some() => {
            anyhow::bail!("--dashboard is for `study run` (the page lives while the driver runs)")
        }
        StudyAction::Status(a) => {
            let (s, dir) = open(&a)?;
            print!("{}", study::status(&s, &dir)?);
            Ok(())
        }
        StudyAction::Report(a) => {
            let (s, dir) = open(&a)?;
            println!("{}", study::report::write(&s, &dir)?.display());
            Ok(())
        }
        StudyAction::Worker(a) => {
            if !cfg!(feature = "torch") {
                anyhow::bail!(
                    "study worker: this is the client-only build, whose binary cannot run \
                     the arms' servers; run the worker with the full build"
                );
            }
            super::run::with_signals(|stop| worker(*a, stop))
        }
    }
}

/// `study worker`: a node of the swarm that runs the allowed drivers' arms until stopped.
async fn worker(a: WorkerArgs, stop: agentjet::base::Stop) -> Result<()> {
    use agentjet::swarm;
    let allowed = a
        .allow_driver
        .iter()
        .map(|p| {
            p.parse::<swarm::PeerId>()
                .map_err(|e| anyhow::anyhow!("--allow-driver {p:?}: not a peer id: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    if a.slots == 0 {
        anyhow::bail!("--slots must be at least 1");
    }
    let lease = secs("lease-seconds", a.lease_seconds)?;
    let least = study::remote::LEASE_AT_LEAST;
    if lease < least {
        anyhow::bail!(
            "--lease-seconds must be at least {} (a driver's keepalive round takes up to 4)",
            least.as_secs_f64()
        );
    }
    let dir = a.swarm.data_dir("study-worker");
    let cfg = a.swarm.config(swarm::Role::Plain, &dir)?;
    if cfg.swarm_key.is_none() {
        anyhow::bail!(
            "study worker: give --swarm-key (a worker runs its drivers' programs: it joins \
             closed swarms only)"
        );
    }
    let node = swarm::spawn_node(cfg).await?;
    println!("{}", node.introduction(&node.listen_addrs().await));
    println!(
        "study worker: {} slot(s), arms in {}, drivers allowed: {}",
        a.slots,
        dir.join("studies").display(),
        a.allow_driver.join(", ")
    );
    agentjet::base::flush_stdout();
    let opts = study::worker::WorkerOptions {
        dir,
        exe: std::env::current_exe().context("finding this binary")?,
        allowed,
        slots: a.slots,
        lease,
    };
    let served = study::worker::serve(&node, opts, &stop).await;
    node.shutdown(Duration::from_secs(5)).await;
    Ok(served?)
}
