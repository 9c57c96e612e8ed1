//! The roles end to end (one binary: one link of LibTorch for all of them): real
//! `agentjet-peer` processes on loopback where a process is the point (signals, kill -9,
//! the client-only binary, the CLI), roles in process elsewhere, real agents (shell,
//! Python SDKs and frameworks), the OpenAI and Anthropic SDKs' own test suites, the
//! dashboard in headless Chromium, and the bootstrap scripts.

#[path = "../common/mod.rs"]
mod common;

mod bootstrap;
mod cli;
mod client;
mod crash;
mod dashboard;
mod elastic;
mod families;
mod follow;
mod network;
mod openai_api;
mod rogue;
mod routing;
mod stop;
mod study;
mod study_workers;
mod swarm;
