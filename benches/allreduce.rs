//! `cargo bench --bench allreduce`: the bus bandwidth of an all-reduce of 64 MiB of float32
//! with 2, 3 and 4 peers on loopback: ours (each peer its own process with its own swarm
//! node; links set up over the swarm's authenticated stream; AES-256-GCM on every byte)
//! against torch.distributed's gloo backend (unencrypted) in the same run, plus a
//! single-thread memcpy of the same bytes for scale.
//!
//! `--mib N` (default 64), `--iters N` (timed rounds, default 5; two warm-up rounds
//! first), `--peers 2,3,4`, `--no-gloo`. Ours runs with an f32 wire and, for the record,
//! a bf16 wire (half the bytes; its bandwidth is stated in f32 bytes reduced).
//!
//! Ends with `RESULT allreduce busbw_<n>peers ours=<GB/s> peer=<GB/s> ratio=<ours/peer>`.

#[allow(dead_code)]
#[path = "peer/mod.rs"]
mod peer;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentjet::collective::{
    ask_link, link, serve_links, LinkAsk, LinkListener, OfferBook, Ring, TcpLinks, Wire,
};
use agentjet::swarm::{spawn_node, Keypair, Multiaddr, PeerId, Role, SwarmConfig};
use anyhow::{bail, Context, Result};

struct Args {
    mib: usize,
    iters: usize,
    peers: Vec<usize>,
    gloo: bool,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        mib: 64,
        iters: 5,
        peers: vec![2, 3, 4],
        gloo: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(f) = it.next() {
        match f.as_str() {
            "--bench" => {}
            "--mib" => a.mib = it.next().context("--mib N")?.parse()?,
            "--iters" => a.iters = it.next().context("--iters N")?.parse()?,
            "--peers" => {
                a.peers = it
                    .next()
                    .context("--peers 2,3")?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--no-gloo" => a.gloo = false,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

const WARMUP: usize = 2;

/// One peer: a swarm node, links to its neighbours through the swarm, timed rounds.
/// Talks to the parent over stdin/stdout: prints `ready <peer id> <addr>`, reads every
/// peer's line (rank order), prints `round <wire> <seconds>` per timed round (rank 0).
fn worker(rank: usize, n: usize, mib: usize, iters: usize) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut cfg = SwarmConfig::new(Role::Server, Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse()?];
    let (node, listener, book) = rt.block_on(async {
        let node = spawn_node(cfg).await?;
        let listener = Arc::new(LinkListener::bind("127.0.0.1:0".parse()?)?);
        let book = Arc::new(OfferBook::default());
        serve_links(&node, listener.clone(), book.clone())?;
        anyhow::Ok((node, listener, book))
    })?;
    let addr = rt.block_on(node.listen_addrs())[0].clone();
    println!("ready {} {addr}", node.peer_id);
    std::io::stdout().flush()?;
    let mut peers: Vec<(PeerId, Multiaddr)> = Vec::new();
    for line in std::io::stdin().lock().lines().take(n) {
        let line = line?;
        let mut w = line.split_whitespace();
        let id: PeerId = w.next().context("peer id")?.parse()?;
        let a: Multiaddr = w.next().context("addr")?.parse()?;
        peers.push((id, a));
    }
    let (right, left) = (peers[(rank + 1) % n].0, peers[(rank + n - 1) % n].0);
    let timeout = Duration::from_secs(60);
    let (tx, rx) = rt.block_on(async {
        for (id, a) in &peers {
            if *id != node.peer_id {
                node.add_addresses(*id, vec![a.clone()]).await;
            }
        }
        let ask = |from: usize| LinkAsk {
            group: "bench".into(),
            epoch: 1,
            from_rank: from as u32,
        };
        // Dial the right neighbour (over the swarm for the offer), accept the left one.
        let (at, offer) = ask_link(&node, right, &ask(rank)).await?;
        let dialed =
            tokio::task::spawn_blocking(move || link::dial(&TcpLinks, &at, &offer, timeout));
        let left_offer = book.take(left, &ask((rank + n - 1) % n), timeout).await?;
        let l = listener.clone();
        let accepted = tokio::task::spawn_blocking(move || l.accept(&left_offer, timeout));
        let (tx, _) = dialed.await??;
        let (_, rx) = accepted.await??;
        anyhow::Ok((tx, rx))
    })?;
    let mut ring = Ring::new(rank, n, tx, rx);
    ring.set_timeout(timeout)?;
    let numel = mib * (1 << 20) / 4;
    for wire in [Wire::F32, Wire::Bf16] {
        // Not refilled between rounds (that would be work beside the other members' timed
        // rounds): round 1 makes every value n(n+1)/2, each later one multiplies it by n.
        let mut data = vec![rank as f32 + 1.0; numel];
        for i in 0..WARMUP + iters {
            let stats = ring.all_reduce(&mut data, wire)?;
            if i >= WARMUP && rank == 0 {
                println!("round {wire:?} {}", stats.seconds);
                std::io::stdout().flush()?;
            }
        }
        let first = data[0];
        anyhow::ensure!(data.iter().all(|&x| x == first), "members' values differ");
        let want = (n * (n + 1) / 2) as f64 * (n as f64).powi((WARMUP + iters - 1) as i32);
        // Exact while the integers stay within f32's 24-bit significand.
        if wire == Wire::F32 && want < (1u64 << 24) as f64 {
            anyhow::ensure!(first as f64 == want, "wrong sum {first} (want {want})");
        }
    }
    println!("done");
    std::io::stdout().flush()?;
    drop(node);
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Our all-reduce with `n` peer processes: median seconds per wire (f32, bf16).
fn ours(n: usize, mib: usize, iters: usize) -> Result<(f64, f64)> {
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for r in 0..n {
        let child = Command::new(&exe)
            .args(["--worker", &r.to_string(), &n.to_string()])
            .args([&mib.to_string(), &iters.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        children.push(child);
    }
    let mut outs: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().unwrap()).lines())
        .collect();
    let mut ready = Vec::new();
    for o in &mut outs {
        let l = o.next().context("a worker died")??;
        ready.push(
            l.strip_prefix("ready ")
                .context("no ready line")?
                .to_string(),
        );
    }
    for c in &mut children {
        let mut stdin = c.stdin.take().unwrap();
        for r in &ready {
            writeln!(stdin, "{r}")?;
        }
    }
    let (mut f32s, mut bf16s) = (Vec::new(), Vec::new());
    for l in &mut outs[0] {
        let l = l?;
        if l == "done" {
            break;
        }
        let mut w = l.split_whitespace().skip(1);
        let wire = w.next().context("wire")?;
        let s: f64 = w.next().context("seconds")?.parse()?;
        if wire == "F32" {
            f32s.push(s);
        } else {
            bf16s.push(s);
        }
    }
    for mut c in children {
        let st = c.wait()?;
        anyhow::ensure!(st.success(), "a worker failed: {st}");
    }
    anyhow::ensure!(!f32s.is_empty(), "no timed rounds");
    Ok((median(f32s), median(bf16s)))
}

fn busbw(bytes: f64, n: usize, seconds: f64) -> f64 {
    bytes * 2.0 * (n - 1) as f64 / n as f64 / seconds
}

fn memcpy_gbs(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t0.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    bytes as f64 / best / 1e9
}

/// AES-256-GCM sealing speed of one core on 64 KiB frames (what every byte of ours pays
/// twice: sealed by the sender, opened by the receiver), GB/s.
fn seal_gbs() -> f64 {
    use agentjet::collective::seal::{Direction, Sealer};
    let mut s = Sealer::new(&[7; 32], Direction::FromDialer);
    let plain = vec![1u8; 64 << 10];
    let mut frame = Vec::new();
    let t0 = Instant::now();
    for _ in 0..1024 {
        s.seal_from(&plain, &mut frame).expect("sealing");
    }
    (1024 * plain.len()) as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn main() -> Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--worker") {
        let num = |i: usize| -> Result<usize> { Ok(argv.get(i).context("worker args")?.parse()?) };
        return worker(num(2)?, num(3)?, num(4)?, num(5)?);
    }
    let a = parse_args()?;
    let bytes = (a.mib << 20) as f64;
    let python = if a.gloo {
        Some(std::env::var("AGENTJET_PYTHON").context(
            "AGENTJET_PYTHON is not set: run `bash bootstrap/setup.sh` first (or pass --no-gloo)",
        )?)
    } else {
        None
    };
    let mem = memcpy_gbs(a.mib << 20);
    let aes = seal_gbs();
    println!(
        "all-reduce of {} MiB float32 on loopback, median of {} rounds after {WARMUP} warm-up; \
         one core: memcpy of the same bytes {mem:.2} GB/s, AES-256-GCM sealing {aes:.2} GB/s",
        a.mib, a.iters
    );
    println!(
        "{:>6} {:>22} {:>22} {:>20} {:>8}",
        "peers", "ours f32 (encrypted)", "ours bf16 wire", "gloo f32 (plain)", "ratio"
    );
    let mut results = Vec::new();
    for &n in &a.peers {
        let (f, b) = ours(n, a.mib, a.iters)?;
        let ours_bw = busbw(bytes, n, f) / 1e9;
        let bf_bw = busbw(bytes, n, b) / 1e9;
        let gloo_bw = match &python {
            Some(py) => {
                let v = peer::run_peer(
                    py,
                    "gloo_allreduce.py",
                    &[
                        "--world".into(),
                        n.to_string(),
                        "--mib".into(),
                        a.mib.to_string(),
                        "--iters".into(),
                        a.iters.to_string(),
                    ],
                )?;
                v["busbw"].as_f64().map(|x| x / 1e9)
            }
            None => None,
        };
        println!(
            "{n:>6} {:>13.3} GB/s {:>6.1}ms {:>13.3} GB/s {:>6.1}ms {:>20} {:>8}",
            ours_bw,
            f * 1e3,
            bf_bw,
            b * 1e3,
            gloo_bw.map_or("-".into(), |g| format!("{g:.3} GB/s")),
            gloo_bw.map_or("-".into(), |g| format!("{:.2}x", ours_bw / g)),
        );
        results.push((n, ours_bw, gloo_bw));
    }
    println!(
        "(bus bandwidth = 2 (n-1)/n x bytes / seconds; memcpy {mem:.2} GB/s is one core's \
         ceiling for touching the bytes once)"
    );
    for (n, o, g) in results {
        match g {
            Some(g) => println!(
                "RESULT allreduce busbw_{n}peers ours={o:.3} peer={g:.3} ratio={:.3}",
                o / g
            ),
            None => println!("RESULT allreduce busbw_{n}peers ours={o:.3}"),
        }
    }
    Ok(())
}
