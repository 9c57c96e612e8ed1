//! `cargo bench --bench swarm [-- FLAGS]`: what the swarm costs and saves, with real
//! `agentjet-peer` processes on 127.0.0.1 (QUIC), one run, everything printed side by side.
//!
//! 1. Per-call latency: the same completion request, one at a time, alternately through a
//!    client's local proxy (HTTP on loopback → libp2p stream → the server's engine) and
//!    directly to the same server's `--http` API (HTTP on loopback → the same engine).
//!    p50 and p99 of each; the overhead is the difference of the p50s (goal < 5 ms).
//! 2. Episode submission: AppWorld-shaped episodes (one group sharing a system + task
//!    prompt, every turn adds environment tokens and samples a short action; `--turns`
//!    20 by default) generated for real by the server over `/agentjet/infer/2`, so every
//!    call is signed; then submitted with fragment deduplication (`client::submit`: the
//!    manifest, only the fragments the server lacks, the server's verdict once stored).
//!    The peer figure is what sending every call whole costs (each call's postcard
//!    encoding: prompt, completion, logprobs, signature), the way per-call tracing
//!    uploads them. Goal: at most one fifth of the naive bytes. MB/s is the wire bytes
//!    we sent per second of submission (from the manifest to the server's "stored"),
//!    and the naive-equivalent bytes delivered per second.
//! 3. Fail-over: a second server joins; long streaming calls run through the client; the
//!    server running them is killed with SIGKILL; for each call, the time from the kill
//!    to its next streamed token (the call continues on the other server). The fail-over
//!    time is the longest of them (goal < 5 s). Also: a new call made right after the kill.
//!
//! The model is a tiny random Llama written by the bench (the overhead, bytes and fail-over
//! do not depend on the model's size; a real model only adds the same compute on both
//! sides). Flags (defaults in brackets):
//!
//! ```text
//! --calls N [200]  --max-tokens N [16]  --turns N [20]  --group-size N [4]
//! --prompt N [600]  --env N [30]  --gen N [10]  --failover-calls N [4]
//! --model DIR  (an HF directory instead of the tiny random model)
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use common::peer::{http, metric, signed_call, wait_until, Peer};

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use agentjet::base::Rng;
use agentjet::client::submit::{prepare, submit};
use agentjet::rpc::SubmitReply;
use agentjet::swarm::{spawn_node, Keypair, PeerId, Role, SwarmConfig};
use agentjet::timeline::{Episode, EpisodeStatus};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

const MODEL: &str = "tiny";
const WAIT: Duration = Duration::from_secs(180);

struct Args {
    calls: usize,
    max_tokens: usize,
    turns: usize,
    group_size: usize,
    prompt: usize,
    env: usize,
    gen: usize,
    failover_calls: usize,
    model: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        calls: 200,
        max_tokens: 16,
        turns: 20,
        group_size: 4,
        prompt: 600,
        env: 30,
        gen: 10,
        failover_calls: 4,
        model: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue;
        }
        let mut val = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        let num = |v: String| -> Result<usize> {
            v.parse()
                .map_err(|_| anyhow!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--calls" => a.calls = num(val()?)?,
            "--max-tokens" => a.max_tokens = num(val()?)?,
            "--turns" => a.turns = num(val()?)?,
            "--group-size" => a.group_size = num(val()?)?,
            "--prompt" => a.prompt = num(val()?)?,
            "--env" => a.env = num(val()?)?,
            "--gen" => a.gen = num(val()?)?,
            "--failover-calls" => a.failover_calls = num(val()?)?,
            "--model" => a.model = Some(PathBuf::from(val()?)),
            other => bail!("unknown flag {other:?} (see the top of benches/swarm.rs)"),
        }
    }
    if a.calls == 0 || a.turns == 0 || a.group_size == 0 || a.failover_calls == 0 {
        bail!("--calls, --turns, --group-size and --failover-calls must be at least 1");
    }
    Ok(a)
}

fn send_request(base: &str, method: &str, path: &str, body: Option<&Value>) -> Result<TcpStream> {
    let hostport = base
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let mut s = TcpStream::connect(&hostport).with_context(|| format!("connecting {hostport}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let b = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nAuthorization: Bearer bench-episode\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )?;
    Ok(s)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn completion(max_tokens: usize, seed: u64, stream: bool) -> Value {
    json!({
        "model": MODEL, "prompt": "hello swarm, how are you today?", "max_tokens": max_tokens,
        "temperature": 0.0, "seed": seed, "logit_bias": {"2": -100}, "stream": stream,
    })
}

/// One timed completion: seconds, checking it produced `max_tokens` tokens.
fn timed_call(base: &str, max_tokens: usize) -> Result<f64> {
    let t0 = Instant::now();
    let (st, body) = http(
        base,
        "POST",
        "/v1/completions",
        Some(&completion(max_tokens, 1, false)),
    );
    let dt = t0.elapsed().as_secs_f64();
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    if st != 200 || v["usage"]["completion_tokens"] != max_tokens {
        bail!("call to {base} failed: {st} {body}");
    }
    Ok(dt)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("swarm bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    let dir = tempfile::tempdir()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => common::Tiny {
            max_pos: 4096,
            ..Default::default()
        }
        .write_hf_dir(&dir.path().join("tiny-model")),
    };
    let model = model.to_str().context("model path")?.to_string();
    let server_args = |boot: Option<&str>| {
        let mut v = vec![
            "--role".to_string(),
            "server".into(),
            "--model".into(),
            model.clone(),
            "--served-model-name".into(),
            MODEL.into(),
            "--device".into(),
            "cpu".into(),
            "--http".into(),
            "127.0.0.1:0".into(),
        ];
        if let Some(b) = boot {
            v.extend(["--bootstrap".to_string(), b.to_string()]);
        }
        v
    };
    let strs = |v: &[String]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    let a1 = strs(&server_args(None));
    let mut s1 = Peer::start(
        "server1",
        dir.path(),
        &a1.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    );
    let boot = s1.addr();
    let id1: PeerId = s1.peer_id().parse()?;
    let http1 = s1.http_url(WAIT);
    let mut client = Peer::start(
        "client",
        dir.path(),
        &["--role", "client", "--model", MODEL, "--bootstrap", &boot],
    );
    let proxy = client.wait_line("proxy at", WAIT);
    let proxy = proxy
        .split_whitespace()
        .next()
        .context("proxy address")?
        .to_string();
    let proxy_ref = &proxy;
    let providers =
        |n: f64| move || metric(proxy_ref, "agentjet_swarm_providers{model=\"tiny\"}") == Some(n);
    wait_until(
        "the client finds the server",
        Duration::from_secs(60),
        providers(1.0),
    );

    // 1. Latency, alternating, after a warm-up of each path.
    println!(
        "== per-call latency: {} calls of {} tokens each way, alternating ==",
        args.calls, args.max_tokens
    );
    for _ in 0..5 {
        timed_call(&proxy, args.max_tokens)?;
        timed_call(&http1, args.max_tokens)?;
    }
    let (mut swarm_t, mut direct_t) = (Vec::new(), Vec::new());
    for i in 0..args.calls {
        if i % 2 == 0 {
            swarm_t.push(timed_call(&proxy, args.max_tokens)? * 1e3);
            direct_t.push(timed_call(&http1, args.max_tokens)? * 1e3);
        } else {
            direct_t.push(timed_call(&http1, args.max_tokens)? * 1e3);
            swarm_t.push(timed_call(&proxy, args.max_tokens)? * 1e3);
        }
    }
    let (sp50, sp99) = (percentile(&swarm_t, 0.5), percentile(&swarm_t, 0.99));
    let (dp50, dp99) = (percentile(&direct_t, 0.5), percentile(&direct_t, 0.99));
    println!(
        "through the swarm (client proxy → QUIC → server): p50 {sp50:.2} ms  p99 {sp99:.2} ms"
    );
    println!(
        "direct HTTP to the same server:                   p50 {dp50:.2} ms  p99 {dp99:.2} ms"
    );
    let overhead = sp50 - dp50;
    println!(
        "overhead p50 {overhead:.2} ms per call (goal < 5 ms: {})",
        if overhead < 5.0 { "MET" } else { "NOT MET" }
    );

    // 2. Episode submission.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&model).join("config.json"))
            .context("the model's config.json (--model takes an HF directory)")?,
    )?;
    let vocab = config["vocab_size"]
        .as_u64()
        .context("vocab_size in config.json")?;
    let sub = rt.block_on(submission(&args, vocab, &boot, id1))?;

    // 3. Fail-over.
    let a2 = strs(&server_args(Some(&boot)));
    let mut s2 = Peer::start(
        "server2",
        dir.path(),
        &a2.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
    );
    let http2 = s2.http_url(WAIT);
    wait_until(
        "the client finds the second server",
        Duration::from_secs(60),
        providers(2.0),
    );
    let fo = failover(&args, &proxy, [&http1, &http2], [&mut s1, &mut s2])?;

    println!();
    println!(
        "RESULT swarm latency_p50_ms ours={sp50:.3} peer={dp50:.3} ratio={:.3}",
        dp50 / sp50
    );
    println!(
        "RESULT swarm latency_p99_ms ours={sp99:.3} peer={dp99:.3} ratio={:.3}",
        dp99 / sp99
    );
    println!("RESULT swarm overhead_p50_ms ours={overhead:.3}");
    println!(
        "RESULT swarm submit_bytes_{}_turns ours={} peer={} ratio={:.2}",
        args.turns,
        sub.ours_bytes,
        sub.naive_bytes,
        sub.naive_bytes as f64 / sub.ours_bytes as f64
    );
    println!("RESULT swarm submit_wire_mb_s ours={:.2}", sub.wire_mb_s);
    println!(
        "RESULT swarm submit_naive_equivalent_mb_s ours={:.2}",
        sub.effective_mb_s
    );
    println!("RESULT swarm failover_s ours={:.3}", fo.worst);
    println!("RESULT swarm new_call_after_kill_s ours={:.3}", fo.new_call);
    Ok(())
}

struct Submission {
    ours_bytes: usize,
    naive_bytes: usize,
    wire_mb_s: f64,
    effective_mb_s: f64,
}

async fn submission(args: &Args, vocab: u64, boot: &str, server: PeerId) -> Result<Submission> {
    println!();
    println!(
        "== episode submission: a group of {} episodes x {} turns (prompt {} tokens, +{} env and {} sampled per turn) ==",
        args.group_size, args.turns, args.prompt, args.env, args.gen
    );
    let mut cfg = SwarmConfig::new(Role::Client, Keypair::generate_ed25519());
    cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse()?];
    cfg.bootstrap = vec![boot.parse()?];
    let h = spawn_node(cfg).await?;
    let t0 = Instant::now();
    while !h.providers(MODEL).await?.contains(&server) {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("the server is not in the bench node's DHT view");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Random ids below the model's vocabulary (specials 0..16 avoided), like timeline::synth.
    let mut rng = Rng::seeded(11);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| 16 + (rng.next_u64() % (vocab - 16)) as u32)
            .collect()
    };
    let prompt = ids(args.prompt);
    let mut episodes = Vec::new();
    let gen_t = Instant::now();
    for e in 0..args.group_size {
        let mut history = prompt.clone();
        let mut calls = Vec::new();
        for turn in 0..args.turns {
            if turn > 0 {
                history.extend(ids(args.env));
            }
            let c = signed_call(
                &h,
                server,
                history.clone(),
                args.gen as u32,
                (e * 1000 + turn) as u64,
            )
            .await
            .map_err(|e| anyhow!("a call to the server: {e}"))?;
            history.extend_from_slice(&c.completion_ids);
            calls.push(c);
        }
        episodes.push(Episode {
            id: format!("bench-e{e}"),
            task_id: "bench-task".into(),
            group_id: "bench-group".into(),
            calls,
            reward: Some(e as f64 / args.group_size as f64),
            rewards: Default::default(),
            status: EpisodeStatus::Finished,
        });
    }
    println!(
        "generated {} signed calls on the server in {:.2} s",
        args.group_size * args.turns,
        gen_t.elapsed().as_secs_f64()
    );
    let mut naive_bytes = 0;
    let mut ours_bytes = 0;
    let mut ours_fragment_bytes = 0;
    let mut first = (0, 0);
    let mut elapsed = 0.0;
    for (i, e) in episodes.iter().enumerate() {
        let naive: usize = e
            .calls
            .iter()
            .map(|c| postcard::to_allocvec(c).map(|b| b.len()))
            .sum::<Result<usize, _>>()?;
        let (manifest, frags): (_, HashMap<_, _>) =
            prepare(e, MODEL, args.group_size as u32).map_err(|e| anyhow!("preparing: {e}"))?;
        let t = Instant::now();
        let out = submit(&h, server, &manifest, &frags)
            .await
            .map_err(|e| anyhow!("submitting: {e}"))?;
        elapsed += t.elapsed().as_secs_f64();
        match &out.reply {
            SubmitReply::Stored { .. } => {}
            other => bail!("the server did not store episode {}: {other:?}", e.id),
        }
        println!(
            "episode {}: sent {} bytes ({} of fragments), whole calls would be {} bytes",
            e.id, out.bytes_sent, out.fragment_bytes_sent, naive
        );
        if i == 0 {
            first = (out.bytes_sent, naive);
        }
        naive_bytes += naive;
        ours_bytes += out.bytes_sent;
        ours_fragment_bytes += out.fragment_bytes_sent;
    }
    let sub = Submission {
        ours_bytes,
        naive_bytes,
        wire_mb_s: ours_bytes as f64 / elapsed / 1e6,
        effective_mb_s: naive_bytes as f64 / elapsed / 1e6,
    };
    println!(
        "group: dedup sent {} bytes ({} of fragments) vs {} bytes of whole calls: {:.2}x fewer (goal >= 5x: {}); \
         first episode alone {} vs {} bytes: {:.2}x",
        ours_bytes,
        ours_fragment_bytes,
        naive_bytes,
        naive_bytes as f64 / ours_bytes as f64,
        if naive_bytes >= 5 * ours_bytes { "MET" } else { "NOT MET" },
        first.0,
        first.1,
        first.1 as f64 / first.0 as f64
    );
    println!(
        "submission time {:.3} s for {} episodes: {:.2} MB/s on the wire, {:.2} MB/s of whole-call equivalent",
        elapsed,
        episodes.len(),
        sub.wire_mb_s,
        sub.effective_mb_s
    );
    Ok(sub)
}

struct Failover {
    worst: f64,
    new_call: f64,
}

fn failover(
    args: &Args,
    proxy: &str,
    https: [&String; 2],
    servers: [&mut Peer; 2],
) -> Result<Failover> {
    println!();
    println!(
        "== fail-over: {} streaming calls through the client, SIGKILL of the server running them ==",
        args.failover_calls
    );
    let max_tokens = 1500;
    let (tx, rx) = mpsc::channel::<(usize, Instant)>();
    let streams: Vec<_> = (0..args.failover_calls)
        .map(|i| {
            let proxy = proxy.to_string();
            let tx = tx.clone();
            std::thread::spawn(move || -> Result<usize> {
                let s = send_request(
                    &proxy,
                    "POST",
                    "/v1/completions",
                    Some(&completion(max_tokens, 50 + i as u64, true)),
                )?;
                let mut events = 0;
                let mut head = Vec::new();
                for l in BufReader::new(s).lines() {
                    let l = l?;
                    if head.len() < 12 {
                        head.push(l.clone());
                    }
                    if l.contains("\"error\"") {
                        bail!("call {i} failed: {l}");
                    }
                    if l.contains("data: {") {
                        events += 1;
                        let _ = tx.send((i, Instant::now()));
                    }
                    if l.contains("[DONE]") {
                        return Ok(events);
                    }
                }
                bail!("call {i}'s stream ended without [DONE] after {events} events: {head:?}")
            })
        })
        .collect();
    drop(tx);
    let running = |h: &str| metric(h, "agentjet_engine_running{model=\"tiny\"}").unwrap_or(0.0);
    let mut victim = None;
    wait_until("all calls running", Duration::from_secs(60), || {
        if streams.iter().all(|s| s.is_finished()) {
            return true;
        }
        let r = [running(https[0]), running(https[1])];
        victim = Some(if r[0] >= r[1] { 0 } else { 1 });
        r[0] + r[1] >= args.failover_calls as f64
    });
    if streams.iter().all(|s| s.is_finished()) {
        for s in streams {
            s.join()
                .map_err(|_| anyhow!("a stream thread panicked"))??;
        }
        bail!("the streaming calls ended before the kill");
    }
    let v = victim.expect("a victim");
    // Let the streams run a moment, then kill.
    std::thread::sleep(Duration::from_millis(500));
    let in_flight = running(https[v]);
    let [a, b] = servers;
    let killed = Instant::now();
    if v == 0 {
        a.kill9()
    } else {
        b.kill9()
    };
    timed_call(proxy, 4)?;
    let new_call_s = killed.elapsed().as_secs_f64();
    // Every call's token arrival times; a call that was on the killed server stalls (the
    // tokens already on their way still arrive) and resumes on the other server. Its
    // fail-over time runs from the kill to the first token after its longest stall.
    let mut counts = Vec::new();
    for s in streams {
        counts.push(
            s.join()
                .map_err(|_| anyhow!("a stream thread panicked"))??,
        );
    }
    let mut arrivals: HashMap<usize, Vec<Instant>> = HashMap::new();
    for (i, t) in rx.try_iter() {
        arrivals.entry(i).or_default().push(t);
    }
    let stall_min = Duration::from_millis(500);
    let mut times = Vec::new();
    let mut stalls = Vec::new();
    for i in 0..args.failover_calls {
        let ts = arrivals.get(&i).cloned().unwrap_or_default();
        let stall = ts
            .windows(2)
            .filter(|w| w[1] > killed && w[1] - w[0] >= stall_min)
            .max_by_key(|w| w[1] - w[0]);
        match stall {
            Some(w) => {
                times.push((w[1] - killed).as_secs_f64());
                stalls.push((w[1] - w[0]).as_secs_f64());
            }
            None if ts.last().is_some_and(|&t| t > killed) => times.push(0.0),
            None => bail!(
                "call {i} streamed nothing after the kill ({} events)",
                ts.len()
            ),
        }
    }
    println!(
        "{} of {} calls stalled (for {} s) and resumed on the other server",
        stalls.len(),
        args.failover_calls,
        stalls
            .iter()
            .map(|t| format!("{t:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if stalls.is_empty() {
        bail!(
            "no call stalled after the kill: the fail-over was not exercised ({counts:?} events)"
        );
    }
    times.sort_by(f64::total_cmp);
    let worst = *times.last().expect("times");
    println!(
        "killed the server with {in_flight} of the {} calls running; each call's first token after its stall came {} s after the kill; \
         a new call completed {new_call_s:.3} s after it; all {} calls of {max_tokens} tokens streamed to the end",
        args.failover_calls,
        times.iter().map(|t| format!("{t:.3}")).collect::<Vec<_>>().join(", "),
        args.failover_calls
    );
    println!(
        "fail-over time (slowest call) {worst:.3} s (goal < 5 s: {})",
        if worst < 5.0 { "MET" } else { "NOT MET" }
    );
    Ok(Failover {
        worst,
        new_call: new_call_s,
    })
}
