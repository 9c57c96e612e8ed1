//! `--role server|client|peer`: builds the role's configuration from its flags, starts the
//! library's role on the one runtime, and stops it on Ctrl-C / SIGTERM (see `main`).

use std::time::Duration;

use agentjet::base::Stop;
use agentjet::swarm::{self, Role as WireRole};
use anyhow::Result;

use super::args::{ClientCli, PeerCli};

/// `--role client`: the proxy, and the agent on the tasks when given.
pub async fn client(cli: ClientCli, stop: Stop) -> Result<()> {
    let cfg = cli.config()?;
    let client = agentjet::client::run(cfg, &stop).await?;
    client.finish().await?;
    Ok(())
}

/// `--role peer`: only the node (gossip, DHT) until stopped.
pub async fn peer(cli: PeerCli, stop: Stop) -> Result<()> {
    let dir = cli.common.swarm.data_dir("peer");
    let cfg = cli.common.swarm.config(WireRole::Plain, &dir)?;
    let node = swarm::spawn_node(cfg).await?;
    println!("{}", node.introduction(&node.listen_addrs().await));
    agentjet::base::flush_stdout();
    node.forward_net_events(|e| {
        if let Some(l) = e.line() {
            println!("{l}");
            agentjet::base::flush_stdout();
        }
    });
    stop.requested().await;
    node.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

#[cfg(feature = "torch")]
pub use torch::server;

#[cfg(feature = "torch")]
mod torch {
    use super::*;
    use crate::args::{secs, LoraServe, ServerCli};
    use agentjet::collective::Wire;
    use agentjet::model::llama::lora::{LoraConfig, Target};
    use agentjet::server::train::CollectiveSettings;
    use agentjet::server::{CertRenewal, FollowSettings, ServeLimits, ServerConfig, TrainSettings};
    use agentjet::train::groups::AdvantageKind;
    use agentjet::train::outer::OuterConfig;
    use std::time::Duration;

    /// The default AdamW rate for full fine-tuning.
    const FULL_LEARNING_RATE: f64 = 1e-5;
    /// The default for an adapter: about 10x full fine-tuning's ("LoRA Without Regret",
    /// Thinking Machines 2025).
    const LORA_LEARNING_RATE: f64 = 1e-4;

    impl ServerCli {
        /// The adapter `--lora-rank` and its flags shape (trained here, or followed).
        fn lora(&self) -> Result<Option<LoraConfig>> {
            self.lora_rank
                .map(|rank| -> Result<LoraConfig> {
                    let c = LoraConfig {
                        rank,
                        alpha: self.lora_alpha.unwrap_or(2.0 * rank as f64),
                        targets: Target::parse_list(&self.lora_targets)
                            .map_err(|e| anyhow::anyhow!("--lora-targets: {e}"))?,
                        rslora: self.rslora,
                    };
                    c.validate()
                        .map_err(|e| anyhow::anyhow!("--lora-rank: {e}"))?;
                    Ok(c)
                })
                .transpose()
        }

        fn lora_serve(&self) -> agentjet::server::LoraServe {
            match self.lora_serve {
                LoraServe::Auto => agentjet::server::LoraServe::Auto,
                LoraServe::Merged => agentjet::server::LoraServe::Merged,
                LoraServe::Unmerged => agentjet::server::LoraServe::Unmerged,
            }
        }

        pub fn config(&self) -> Result<ServerConfig> {
            let data_dir = self.common.swarm.data_dir("server");
            let mut swarm = self.common.swarm.config(WireRole::Server, &data_dir)?;
            if let Some(path) = &self.run_key {
                self.certify_self(&mut swarm, path)?;
            }
            let advantage: AdvantageKind = self
                .advantage
                .parse()
                .map_err(|e| anyhow::anyhow!("--advantage: {e}"))?;
            if self.follow && self.no_train {
                anyhow::bail!(
                    "--follow serves the training group's versions without training: drop \
                     --no-train (implied)"
                );
            }
            if self.no_train && self.lora_rank.is_some() {
                anyhow::bail!(
                    "--lora-rank trains an adapter, and --no-train turns training off: drop one"
                );
            }
            let train = (!self.no_train && !self.follow)
                .then(|| -> Result<TrainSettings> {
                    Ok(TrainSettings {
                        learning_rate: self.learning_rate.unwrap_or(
                            match self.lora_rank {
                                Some(_) => LORA_LEARNING_RATE,
                                None => FULL_LEARNING_RATE,
                            },
                        ),
                        warmup_steps: self.warmup_steps,
                        groups_per_step: self.groups_per_step.max(1),
                        max_groups_per_step: self
                            .max_groups_per_step
                            .max(self.groups_per_step)
                            .max(1),
                        num_repeat: self.num_repeat.max(1),
                        group_timeout: secs("group-timeout", self.group_timeout)?,
                        min_episodes: 2,
                        advantage,
                        max_staleness: Some(self.max_staleness),
                        checkpoint_every: self.checkpoint_every.max(1),
                        micro_batch_tokens: 4096,
                        collective: CollectiveSettings {
                            timeout: secs("collective-timeout", self.collective_timeout)?,
                            wire: match self.allreduce_wire.as_str() {
                                "f32" => Wire::F32,
                                "bf16" => Wire::Bf16,
                                other => anyhow::bail!(
                                    "--allreduce-wire {other:?}: expected f32 or bf16"
                                ),
                            },
                            midway_pause: self.test_midway_pause_ms.map(Duration::from_millis),
                            hash_every: self.hash_every,
                            group: self.train_group.clone(),
                            perturb_at: self.test_perturb_at_step,
                            send_nan_from: self.test_send_nan_from_step,
                            direct_links: match self.group_links.as_str() {
                                "auto" => true,
                                "swarm" => false,
                                other => anyhow::bail!(
                                    "--group-links {other:?}: expected auto or swarm"
                                ),
                            },
                            ..CollectiveSettings::default()
                        },
                        outer: (self.sync_every > 0)
                            .then(|| -> Result<OuterConfig> {
                                anyhow::ensure!(
                                    self.outer_lr > 0.0
                                        && (0.0..1.0).contains(&self.outer_momentum)
                                        && self.outer_max_norm.is_none_or(|n| n > 0.0),
                                    "--outer-lr and --outer-max-norm must be above 0 and --outer-momentum in [0, 1)"
                                );
                                Ok(OuterConfig {
                                    every: self.sync_every,
                                    lr: self.outer_lr,
                                    momentum: self.outer_momentum,
                                    max_norm: self.outer_max_norm,
                                })
                            })
                            .transpose()?,
                        ppo_epochs: self.ppo_epochs.max(1),
                        mini_batches: self.mini_batches.max(1),
                        entropy_coef: self.entropy_coef,
                        lora: self.lora()?,
                        lora_serve: self.lora_serve(),
                    })
                })
                .transpose()?;
            Ok(ServerConfig {
                swarm,
                data_dir,
                model: self.model.clone(),
                served_model_name: self.served_model_name.clone(),
                adapters: self
                    .adapters
                    .iter()
                    .map(|a| match a.split_once('=') {
                        Some(_) => crate::args::named_adapter(a)
                            .map(|(n, d)| (n, Some(d)))
                            .map_err(|e| anyhow::anyhow!("--adapter {e}")),
                        None if a.trim().is_empty() => {
                            Err(anyhow::anyhow!("--adapter: an empty name"))
                        }
                        None => Ok((a.trim().to_string(), None)),
                    })
                    .collect::<Result<_>>()?,
                device: self.device.clone(),
                dtype: self.dtype.clone(),
                engine: self.engine.config(),
                http: self.http.clone(),
                dashboard: (!self.no_dashboard).then(|| self.dashboard.clone()),
                config_json: serde_json::to_value(self).ok(),
                train,
                limits: ServeLimits {
                    max_episode_bytes_per_peer: self.max_episode_bytes_per_peer,
                    ..ServeLimits::default()
                },
                drain_timeout: secs("drain-timeout", self.common.swarm.drain_timeout)?,
                events_file: self.events.clone(),
                follow: self
                    .follow
                    .then(|| -> Result<FollowSettings> {
                        Ok(FollowSettings {
                            group: self.train_group.clone().unwrap_or_else(|| {
                                self.served_model_name
                                    .clone()
                                    .unwrap_or_else(|| self.model.clone())
                            }),
                            lora: self.lora()?,
                            lora_serve: self.lora_serve(),
                        })
                    })
                    .transpose()?,
                broadcast: agentjet::server::BroadcastSettings {
                    chunk_bytes: self
                        .weights_chunk_kib
                        .checked_mul(1024)
                        .and_then(|b| u32::try_from(b).ok())
                        .filter(|&b| b > 0 && b <= 64 << 20)
                        .ok_or_else(|| {
                            anyhow::anyhow!("--weights-chunk-kib must be in 1..=65536")
                        })?,
                    tamper: self.test_tamper_chunks,
                    ..Default::default()
                },
                renew: match (&self.run_key, &self.common.swarm.cert) {
                    (Some(k), _) => Some(CertRenewal::RunKey(k.clone())),
                    (None, Some(f)) => Some(CertRenewal::File(f.clone())),
                    (None, None) => None,
                },
            })
        }
    }

    impl ServerCli {
        /// `--run-key`: trusts the run and certifies this server to serve its model and
        /// train it in its group, for a year (renewed at each start, and while it runs once
        /// half a year is left).
        fn certify_self(
            &self,
            swarm: &mut swarm::SwarmConfig,
            path: &std::path::Path,
        ) -> Result<()> {
            let key = swarm::RunKey::load(path).map_err(|e| anyhow::anyhow!("--run-key {e}"))?;
            if let Some(r) = swarm.run.filter(|r| *r != key.id()) {
                anyhow::bail!(
                    "--run names run {r}, but --run-key is the key of run {}",
                    key.id()
                );
            }
            let model = self.served_model_name.clone().unwrap_or(self.model.clone());
            let grant = swarm::Grant {
                group: self.train_group.clone().unwrap_or(model.clone()),
                model,
                serve: true,
                train: true,
            };
            let peer = swarm.keypair.public().to_peer_id();
            let until = swarm::trust::unix_now() + 365 * 24 * 3600;
            swarm.cert = Some(key.certify(&peer, grant, until));
            swarm.run = Some(key.id());
            Ok(())
        }
    }

    /// `--role server`: the model, served and trained, until stopped.
    pub async fn server(cli: ServerCli, stop: Stop) -> Result<()> {
        let cfg = cli.config()?;
        let server = agentjet::server::run(cfg, &stop).await?;
        server.finish().await?;
        Ok(())
    }
}
