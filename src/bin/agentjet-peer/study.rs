//! `agentjet-peer study run|status|report STUDY.toml`: the study driver
//! (`agentjet::study`) with this binary as the arms' `agentjet-peer`, and the first
//! Ctrl-C or SIGTERM as its stop (the running arms' servers drain and save their
//! checkpoints; running the command again goes on). A second one exits at once.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use agentjet::study::{self, Outcome, Study};
use anyhow::{Context, Result};

use super::args::{StudyAction, StudyArgs};

fn open(a: &StudyArgs) -> Result<(Study, std::path::PathBuf)> {
    let s = Study::load(&a.file)?;
    let dir = a.dir.clone().unwrap_or_else(|| study::default_dir(&s));
    Ok((s, dir))
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
            let outcome = study::run(&s, &opts)?;
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
    }
}
