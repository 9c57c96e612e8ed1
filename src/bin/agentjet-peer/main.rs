//! `agentjet-peer`: the one binary of AgentJet-RS. CLI only: parse the role's or the
//! tool's flags, build one runtime, turn Ctrl-C and SIGTERM into the library's stop, and
//! hand off to the role (`agentjet::server::run`, `agentjet::client::run`) or tool.
//!
//! Stopping is the same in every command: the first Ctrl-C or SIGTERM drains (running
//! work finishes, state is saved, exit 0), a second one aborts.

// The flags' doc comments are `--help` text, where `<role>` is a placeholder, not HTML.
#![allow(rustdoc::invalid_html_tags)]

mod args;
mod roles;
mod run;
mod study;
mod tools;

use anyhow::{bail, Context, Result};
use clap::Parser;
#[cfg(feature = "torch")]
use run::blocking_with_signals;
use run::{runtime, with_signals};

use args::{Cli, ClientCli, Command, PeerCli, Role};

/// A parsed command line: a role with its own flags, or a tool (the large flag sets
/// boxed).
enum Parsed {
    Server(Box<args::ServerCli>),
    Client(Box<ClientCli>),
    Peer(PeerCli),
    Tool(Cli),
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let parsed = match args::role_of(&argv) {
        Some(Role::Server) => Parsed::Server(Box::new(args::ServerCli::parse_from(&argv))),
        Some(Role::Client) => Parsed::Client(Box::new(ClientCli::parse_from(&argv))),
        Some(Role::Peer) => Parsed::Peer(PeerCli::parse_from(&argv)),
        None => Parsed::Tool(Cli::parse_from(&argv)),
    };
    // Roles and tools that may run LibTorch keep freed memory for their next tensors
    // (see `agentjet::base::alloc`); a client runs none.
    if !matches!(parsed, Parsed::Client(_)) {
        agentjet::base::alloc::keep_freed_memory();
    }
    let filter = match &parsed {
        Parsed::Server(c) => &c.common.log,
        Parsed::Client(c) => &c.common.log,
        Parsed::Peer(c) => &c.common.log,
        Parsed::Tool(c) => &c.log,
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match parsed {
        Parsed::Server(cli) => run_server(*cli),
        Parsed::Client(cli) => with_signals(|stop| roles::client(*cli, stop)),
        Parsed::Peer(cli) => with_signals(|stop| roles::peer(cli, stop)),
        Parsed::Tool(cli) => run_tool(cli),
    };
    if let Err(e) = result {
        eprintln!("error: {}", report(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, each cause said once (the library's errors
/// already name their cause in their own message).
fn report(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg
}

#[cfg(feature = "torch")]
fn run_server(cli: args::ServerCli) -> Result<()> {
    with_signals(|stop| roles::server(cli, stop))
}

#[cfg(not(feature = "torch"))]
fn run_server(_cli: args::ServerCli) -> Result<()> {
    bail!(
        "this agentjet-peer was built without LibTorch (`--no-default-features`): it can be a \
         client or a plain peer; rebuild with the default `torch` feature to serve models"
    )
}

fn run_tool(cli: Cli) -> Result<()> {
    match cli.command {
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            println!();
            Ok(())
        }
        Some(Command::Status {
            bootstrap,
            swarm_key,
            run,
            wait,
        }) => runtime()?.block_on(tools::status(
            &bootstrap,
            swarm_key.as_deref(),
            run.as_deref(),
            wait,
        )),
        Some(Command::RunKey { out }) => tools::run_key(&out),
        Some(Command::Certify {
            run_key,
            peer,
            model,
            group,
            serve_only,
            train_only,
            days,
            out,
        }) => tools::certify(tools::CertifyArgs {
            run_key: &run_key,
            peer: &peer,
            group: group.unwrap_or(model.clone()),
            model,
            serve: !train_only,
            train: !serve_only,
            days,
            out: &out,
        }),
        Some(Command::Id { data_dir }) => {
            let key = agentjet::swarm::load_or_create_identity(&data_dir.join("identity.key"))?;
            println!("{}", key.public().to_peer_id());
            Ok(())
        }
        Some(Command::SwarmKey { out }) => {
            if out.exists() {
                bail!("{} exists; not overwriting a swarm key", out.display());
            }
            // Owner-only from its creation (0600): the key admits peers to the swarm.
            agentjet::base::files::write_secret(
                &out,
                agentjet::swarm::SwarmKey::generate()
                    .to_file_text()
                    .as_bytes(),
            )
            .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote a new swarm key to {}", out.display());
            Ok(())
        }
        Some(Command::Study { action }) => study::run(action),
        Some(Command::Info { model }) => tools::info(&model),
        Some(Command::Runs { data_dirs }) => tools::runs(&data_dirs),
        #[cfg(feature = "torch")]
        Some(Command::Generate {
            model,
            prompt,
            system,
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            seed,
            show_tokens,
        }) => blocking_with_signals(move |stop| {
            let ask = tools::torch_cmds::Ask {
                prompt,
                system,
                max_tokens,
                sampling: agentjet::engine::SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    min_p,
                    repetition_penalty,
                    ..Default::default()
                },
                seed,
                show_tokens,
            };
            tools::torch_cmds::generate(&model, ask, &stop)
        }),
        #[cfg(feature = "torch")]
        Some(Command::Export {
            model,
            adapter,
            merge: _,
            out,
        }) => {
            // A drain lets the checkpoint be written to its end (it is renamed into place
            // only when whole); an abort leaves no checkpoint.
            blocking_with_signals(move |_| {
                tools::torch_cmds::export(&model, adapter.as_deref(), &out)
            })
        }
        #[cfg(feature = "torch")]
        Some(Command::Serve {
            model,
            host,
            port,
            served_model_name,
            adapters,
            engine,
            default_max_tokens,
            track_episodes,
            drain_timeout,
        }) => {
            let drain = args::secs("drain-timeout", drain_timeout)?;
            with_signals(|stop| async move {
                tools::torch_cmds::serve(
                    &model,
                    &host,
                    port,
                    served_model_name,
                    &adapters,
                    engine.config(),
                    agentjet::facade::server::FacadeConfig {
                        default_max_tokens,
                        track_episodes,
                        ..Default::default()
                    },
                    drain,
                    stop,
                )
                .await
            })
        }
        #[cfg(not(feature = "torch"))]
        Some(Command::Generate { .. } | Command::Export { .. } | Command::Serve { .. }) => bail!(
            "this agentjet-peer was built without LibTorch (`--no-default-features`); \
             rebuild with the default `torch` feature to run models"
        ),
    }
}
