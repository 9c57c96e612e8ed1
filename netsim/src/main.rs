//! `netsim <scenario> [flags]`: one scenario, its table printed and written to the results
//! folder. See netsim/README.md for the commands that made the published tables.

use std::path::PathBuf;
use std::time::Duration;

use agentjet::collective::Wire;
use agentjet_netsim::member::Mode;
use agentjet_netsim::scenario::{broadcast, churn, discovery, gossip, partition, training, Env};
use agentjet_netsim::{NatMix, NetConfig};

const USAGE: &str = "usage: netsim <discovery|gossip|churn|partition|training|broadcast> [--peers N,N,..] [--servers N] [--clients N]
  [--seed N] [--latency-ms LO-HI] [--bandwidth-mbit X] [--loss P] [--out DIR]
  [--nat P,C,S (discovery, training, broadcast: percent of peers public, behind cone NATs, behind symmetric NATs)]
  [--rates R,R,.. (churn: crashes per server per hour)] [--seconds S (churn: per rate; gossip: window)]
  [--hold S (partition)] [--idle-s S (discovery: idle connection timeout, default 120)]
  [--rebootstrap-s S (discovery: DHT walk interval, default 30)]
  [--max-conns N (discovery: connection trimmer's high mark, default 96)] [--grace-s S (discovery: trimmer's grace, default 30)]
  [--ping-s S (discovery: default 5)] [--settle-s S (discovery: the longest wait to settle, default 300)]
  training: [--members N] [--peers N (plain peers besides them)] [--modes sync,diloco/H,..] [--seconds S (per mode)] [--values N]
  [--model-values N] [--step-s X] [--crashes N] [--wire f32|bf16] [--timeout-s S] [--status-s S (the members'; default 2, plain peers max(2, n^2/1250) s)]
  broadcast: [--followers N] [--peers N (plain peers besides them)] [--model-mb X (bfloat16 bytes it stands for, default 500)] [--scale X (default 100)]
  [--chunk-kib N (default 1024)] [--versions N] [--lr X] [--parallel N (requests in flight per follower)] [--timeout-s S]
  [--status-s S (regular status interval; default n^2/1250 s)]";

/// glibc's malloc keeps what is freed for reuse instead of handing big blocks back to
/// the system (and zeroing fresh pages again): a hundred peers in one process each copy
/// a snapshot per version, and with the defaults page faults took a sixth of the CPU.
/// The top pad keeps a thread's arena from unmapping a heap that fell empty (glibc does
/// that whatever the trim threshold): scenario 6's followers free a version's chunks
/// and snapshot each version, and without it a version now and then spent seconds of
/// CPU zeroing the same memory again (timer lag p99 0.9-1.7 s, 99% of the followers
/// after 4.3-5.7 s against 2.6-2.9 s for the other versions of the same runs).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 512 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

fn main() -> std::process::ExitCode {
    keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("{USAGE}");
        return std::process::ExitCode::from(2);
    }
    if args
        .iter()
        .any(|a| a == "--help" || a == "-h" || a == "help")
    {
        println!("{USAGE}");
        return std::process::ExitCode::SUCCESS;
    }
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The message alone (anyhow's `Debug` adds a backtrace when RUST_BACKTRACE is set).
            eprintln!("netsim: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> anyhow::Result<()> {
    let name = args[0].clone();
    let get = |flag: &str| -> Option<String> {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let known = [
        "--peers",
        "--servers",
        "--clients",
        "--seed",
        "--latency-ms",
        "--bandwidth-mbit",
        "--loss",
        "--out",
        "--rates",
        "--seconds",
        "--hold",
        "--idle-s",
        "--rebootstrap-s",
        "--max-conns",
        "--grace-s",
        "--ping-s",
        "--members",
        "--modes",
        "--values",
        "--model-values",
        "--step-s",
        "--crashes",
        "--wire",
        "--timeout-s",
        "--followers",
        "--model-mb",
        "--scale",
        "--chunk-kib",
        "--versions",
        "--lr",
        "--parallel",
        "--status-s",
        "--nat",
        "--settle-s",
    ];
    let mut i = 1;
    while i < args.len() {
        anyhow::ensure!(
            known.contains(&args[i].as_str()),
            "unknown flag {:?}\n{USAGE}",
            args[i]
        );
        anyhow::ensure!(i + 1 < args.len(), "{} needs a value", args[i]);
        i += 2;
    }
    fn list<T: std::str::FromStr>(flag: &str, s: &str) -> anyhow::Result<Vec<T>> {
        s.split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .map_err(|_| anyhow::anyhow!("{flag}: cannot parse {x:?}"))
            })
            .collect()
    }
    fn one<T: std::str::FromStr>(flag: &str, s: Option<String>, d: T) -> anyhow::Result<T> {
        match s {
            None => Ok(d),
            Some(s) => s
                .parse()
                .map_err(|_| anyhow::anyhow!("{flag}: cannot parse {s:?}")),
        }
    }
    let latency = match get("--latency-ms") {
        None => (20, 200),
        Some(s) => {
            let v: Vec<u64> = list("--latency-ms", &s.replace('-', ","))?;
            match v[..] {
                [x] => (x, x),
                [lo, hi] if lo <= hi => (lo, hi),
                _ => {
                    anyhow::bail!("--latency-ms takes LO-HI (milliseconds, LO <= HI) or one value")
                }
            }
        }
    };
    let loss: f64 = one("--loss", get("--loss"), 0.0)?;
    anyhow::ensure!((0.0..0.5).contains(&loss), "--loss must be within 0..0.5");
    let mbit: f64 = one("--bandwidth-mbit", get("--bandwidth-mbit"), 0.0)?;
    anyhow::ensure!(mbit >= 0.0, "--bandwidth-mbit must not be negative");
    let env = Env {
        net: NetConfig {
            seed: one("--seed", get("--seed"), 1)?,
            latency: (
                Duration::from_millis(latency.0),
                Duration::from_millis(latency.1),
            ),
            bandwidth: mbit * 1e6 / 8.0,
            loss,
            ..Default::default()
        },
        out: get("--out").map_or_else(|| PathBuf::from("netsim/results"), PathBuf::from),
        nat: get("--nat").map(|m| NatMix::parse(&m)).transpose()?,
    };
    let sizes = |d: &[usize]| -> anyhow::Result<Vec<usize>> {
        get("--peers").map_or(Ok(d.to_vec()), |s| list("--peers", &s))
    };
    let command = format!(
        "cargo run --release -p agentjet-netsim -- {}",
        args.join(" ")
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let _log = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()))
        .with_writer(std::io::stderr)
        .try_init();
    if env.nat.is_some() && !matches!(name.as_str(), "discovery" | "training" | "broadcast") {
        anyhow::bail!(
            "--nat: only the discovery, training and broadcast scenarios place peers behind NAT so far"
        );
    }
    rt.block_on(async {
        match name.as_str() {
            "discovery" => {
                let a = discovery::Args {
                    sizes: sizes(&[100, 300, 1000])?,
                    servers: one("--servers", get("--servers"), 5)?,
                    clients: one("--clients", get("--clients"), 20)?,
                    idle: Duration::from_secs(one("--idle-s", get("--idle-s"), 120)?),
                    rebootstrap: Duration::from_secs(one(
                        "--rebootstrap-s",
                        get("--rebootstrap-s"),
                        30,
                    )?),
                    max_connections: one("--max-conns", get("--max-conns"), 96)?,
                    grace: Duration::from_secs(one("--grace-s", get("--grace-s"), 30)?),
                    ping: Duration::from_secs(one("--ping-s", get("--ping-s"), 5)?),
                    settle_max: Duration::from_secs(one(
                        "--settle-s",
                        get("--settle-s"),
                        discovery::SETTLE_MAX.as_secs(),
                    )?),
                };
                discovery::run(&env, &a, &command).await.map(drop)
            }
            "gossip" => {
                let a = gossip::Args {
                    sizes: sizes(&[100, 300])?,
                    warmup: Duration::from_secs(20),
                    window: Duration::from_secs(one("--seconds", get("--seconds"), 30)?),
                };
                gossip::run(&env, &a, &command).await.map(drop)
            }
            "churn" => {
                let a = churn::Args {
                    peers: one("--peers", get("--peers"), 100)?,
                    servers: one("--servers", get("--servers"), 10)?,
                    clients: one("--clients", get("--clients"), 10)?,
                    rates: get("--rates")
                        .map_or(Ok(vec![0.1, 10.0, 60.0, 240.0]), |s| list("--rates", &s))?,
                    duration: Duration::from_secs(one("--seconds", get("--seconds"), 150)?),
                    lookup_every: Duration::from_secs(2),
                };
                churn::run(&env, &a, &command).await.map(drop)
            }
            "partition" => {
                let a = partition::Args {
                    sizes: sizes(&[50, 200])?,
                    servers: one("--servers", get("--servers"), 4)?,
                    hold: Duration::from_secs(one("--hold", get("--hold"), 20)?),
                    limit: Duration::from_secs(180),
                };
                partition::run(&env, &a, &command).await.map(drop)
            }
            "training" => {
                let modes = get("--modes")
                    .unwrap_or_else(|| "sync,diloco/8,diloco/32".into())
                    .split(',')
                    .map(|m| match m.trim() {
                        "sync" => Ok(Mode::Sync),
                        d => d
                            .strip_prefix("diloco/")
                            .and_then(|h| h.parse().ok())
                            .filter(|h: &u64| *h >= 1)
                            .map(|every| Mode::Diloco { every })
                            .ok_or_else(|| {
                                anyhow::anyhow!("--modes: {d:?} is neither sync nor diloco/H")
                            }),
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let a = training::Args {
                    members: one("--members", get("--members"), 32)?,
                    peers: one("--peers", get("--peers"), 0)?,
                    modes,
                    duration: Duration::from_secs(one("--seconds", get("--seconds"), 240)?),
                    values: one("--values", get("--values"), 2_000_000)?,
                    model_values: one(
                        "--model-values",
                        get("--model-values"),
                        training::SMOLLM2_VALUES,
                    )?,
                    compute: Duration::from_secs_f64(one("--step-s", get("--step-s"), 1.0)?),
                    crashes: one("--crashes", get("--crashes"), 1)?,
                    crash_every_steps: None,
                    wire: match get("--wire").as_deref() {
                        None | Some("f32") => Wire::F32,
                        Some("bf16") => Wire::Bf16,
                        Some(w) => anyhow::bail!("--wire takes f32 or bf16, not {w:?}"),
                    },
                    timeout: Duration::from_secs(one("--timeout-s", get("--timeout-s"), 60)?),
                    form_limit: Duration::from_secs(300),
                    status: get("--status-s")
                        .map(|v| one("--status-s", Some(v), 2.0f64))
                        .transpose()?
                        .map(Duration::from_secs_f64),
                };
                anyhow::ensure!(
                    a.values >= 1 && a.model_values >= a.values as u64,
                    "--values must be within 1..=--model-values"
                );
                training::run(&env, &a, &command).await.map(drop)
            }
            "broadcast" => {
                let a = broadcast::Args {
                    followers: one("--followers", get("--followers"), 100)?,
                    peers: one("--peers", get("--peers"), 0)?,
                    model_bytes: (one("--model-mb", get("--model-mb"), 500.0f64)? * 1e6) as u64,
                    scale: one("--scale", get("--scale"), 100.0)?,
                    chunk: one("--chunk-kib", get("--chunk-kib"), 1024u64)? * 1024,
                    versions: one("--versions", get("--versions"), 3)?,
                    lr: one("--lr", get("--lr"), broadcast::DEFAULT_LR)?,
                    parallel: one(
                        "--parallel",
                        get("--parallel"),
                        agentjet::collective::broadcast::FollowConfig::default().parallel,
                    )?,
                    limit: Duration::from_secs(one("--timeout-s", get("--timeout-s"), 120)?),
                    status_interval: get("--status-s")
                        .map(|s| one("--status-s", Some(s), 0.0f64))
                        .transpose()?
                        .map(Duration::from_secs_f64),
                };
                anyhow::ensure!(a.scale >= 1.0, "--scale must be at least 1");
                anyhow::ensure!(a.parallel >= 1, "--parallel must be at least 1");
                broadcast::run(&env, &a, &command).await.map(drop)
            }
            other => anyhow::bail!("no scenario {other:?}\n{USAGE}"),
        }
    })
}
