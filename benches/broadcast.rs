//! `cargo bench --bench broadcast`: what a training step's new policy costs to send to
//! rollout peers (issue 37's weight broadcast), in two parts.
//!
//! **1. The codec**, in process. SmolLM2 (float32 master weights) takes real GRPO steps
//! (full fine-tuning, AdamW at the server's default lr 1e-5, on a synthetic trace). After
//! each, the serving snapshot (HF layout, in bfloat16 and in float32) is cut into 1 MiB
//! chunks named by blake3 (`collective::broadcast::Manifest`); every chunk that changed is
//! encoded against the previous version's (`collective::broadcast::encode`: raw, zstd,
//! XOR + zstd, or XOR by byte planes + zstd, whichever is smallest) and decoded and
//! checked as a follower would.
//!
//! - `delta_bytes_vs_full_{bf16,f32}`: the bytes of one step's changed chunks as encoded,
//!   against the full snapshot (what sending the whole model costs); ratio = full / ours.
//! - encode and decode throughput (MB of snapshot per second, one core).
//!
//! **2. Followers**, real processes on 127.0.0.1 (see `followers/mod.rs`): one SmolLM2
//! trainer and 1, 3 and 7 `--follow` servers in bfloat16, a client driving steps.
//!
//! - `commit_to_all_serving_s_{N}f`: from the trainer's step to every follower serving it
//!   (median over the measured steps; no peer figure);
//! - `trainer_bytes_vs_star_{N}f`: what the trainer uploaded per version against a star
//!   that sends the full snapshot to each follower; ratio = star / ours;
//! - `delta_bytes_vs_full_swarm`: what a follower received per version against the full
//!   snapshot (all runs).
//!
//! ```text
//! --steps N [3]  --model SPEC [smollm2]  --lr X [1e-5]
//! --followers 1,3,7  --follower-steps N [3]  --only codec|followers
//! ```

#[path = "../tests/common/mod.rs"]
mod common;
mod followers;

use std::time::Instant;

use agentjet::collective::broadcast::{codec, decode, encode, Manifest};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use agentjet::timeline::synth::{trace, TraceShape};
use agentjet::train::groups::{advantages, AdvantageKind, Group, ReadyReport};
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{Trainer, TrainerConfig};
use tch::Kind;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> anyhow::Result<T> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("{name} needs a value")),
    }
}

/// The serving snapshot of `m` in `kind`: its layout (name, dtype, shape, bytes) and the
/// tensors' bytes back to back.
type Layout = Vec<(String, String, Vec<i64>, u64)>;

fn snapshot(m: &Llama, kind: Kind) -> anyhow::Result<(Layout, Vec<u8>)> {
    let tensors = tch::no_grad(|| m.hf_tensors())?;
    let (mut layout, mut bytes) = (Vec::new(), Vec::new());
    for (name, t) in tensors {
        let t = t.to_kind(kind).contiguous().to_device(tch::Device::Cpu);
        let n = t.numel() * t.kind().elt_size_in_bytes();
        let start = bytes.len();
        bytes.resize(start + n, 0);
        t.copy_data_u8(&mut bytes[start..], t.numel());
        layout.push((name, format!("{kind:?}"), t.size(), n as u64));
    }
    Ok((layout, bytes))
}

struct StepBytes {
    changed_chunks: usize,
    chunks: usize,
    changed_elements: f64,
    sent: u64,
    full: u64,
    encode_s: f64,
    decode_s: f64,
    /// Chunks sent raw, zstd, XOR + zstd, XOR by planes + zstd.
    chosen: [usize; 4],
}

/// One version's chunks that differ from `prev`'s, encoded and decoded.
fn delta(
    prev: (&Manifest, &[u8]),
    next: (&Manifest, &[u8]),
    width: u8,
) -> anyhow::Result<StepBytes> {
    let changed = next.0.changed_since(prev.0)?;
    let (mut sent, mut encode_s, mut decode_s) = (0u64, 0.0, 0.0);
    let mut differing = 0usize;
    let mut chosen = [0usize; 4];
    for &i in &changed {
        let r = next.0.chunk_range(i);
        let (old, new) = (&prev.1[r.clone()], &next.1[r.clone()]);
        differing += new
            .chunks(width as usize)
            .zip(old.chunks(width as usize))
            .filter(|(a, b)| a != b)
            .count();
        let t0 = Instant::now();
        let frame = encode(new, Some(old), width);
        encode_s += t0.elapsed().as_secs_f64();
        sent += frame.len() as u64;
        let t0 = Instant::now();
        let back = decode(&frame, Some(old), new.len(), &next.0.chunks[i])?;
        decode_s += t0.elapsed().as_secs_f64();
        anyhow::ensure!(back == new, "chunk {i} did not round-trip");
        if let Some(e) = codec::encoding_of(&frame) {
            chosen[e as usize] += 1;
        }
    }
    Ok(StepBytes {
        changed_chunks: changed.len(),
        chunks: next.0.chunks.len(),
        changed_elements: differing as f64 / (next.1.len() / width as usize) as f64,
        sent,
        full: next.1.len() as u64,
        encode_s,
        decode_s,
        chosen,
    })
}

fn main() {
    if let Err(e) = run() {
        eprintln!("broadcast bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let only: String = arg(&args, "--only", String::new())?;
    if only != "followers" {
        codec_part(&args)?;
    }
    if only != "codec" {
        followers_part(&args)?;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Part 2: real processes (see `followers/mod.rs`).
fn followers_part(args: &[String]) -> anyhow::Result<()> {
    let counts: String = arg(args, "--followers", "1,3,7".to_string())?;
    let steps: usize = arg(args, "--follower-steps", 3)?;
    let spec: String = arg(args, "--model", "smollm2".to_string())?;
    let (mut deltas, mut fulls) = (Vec::new(), Vec::new());
    let mut results = Vec::new();
    for n in counts.split(',') {
        let n: usize = n.trim().parse()?;
        println!("followers: 1 trainer, {n} followers ({spec}, bf16), {steps} steps measured");
        let rows = followers::run(n, steps, &spec)?;
        let secs = median(rows.iter().map(|r| r.seconds).collect());
        let sent = median(rows.iter().map(|r| r.trainer_bytes as f64).collect());
        let star = median(rows.iter().map(|r| r.star_bytes as f64).collect());
        for r in &rows {
            deltas.push(r.delta_bytes as f64);
            fulls.push(r.full_bytes as f64);
        }
        results.push(format!(
            "RESULT broadcast commit_to_all_serving_s_{n}f ours={secs:.3}"
        ));
        results.push(format!(
            "RESULT broadcast trainer_bytes_vs_star_{n}f ours={sent:.0} peer={star:.0} ratio={:.2}",
            star / sent.max(1.0)
        ));
    }
    let (d, f) = (median(deltas), median(fulls));
    results.push(format!(
        "RESULT broadcast delta_bytes_vs_full_swarm ours={d:.0} peer={f:.0} ratio={:.2}",
        f / d.max(1.0)
    ));
    for r in results {
        println!("{r}");
    }
    Ok(())
}

/// Part 1: the codec, in process.
fn codec_part(args: &[String]) -> anyhow::Result<()> {
    let args = args.to_vec();
    let steps: usize = arg(&args, "--steps", 3)?;
    let lr: f64 = arg(&args, "--lr", 1e-5)?;
    let spec: String = arg(&args, "--model", "smollm2".to_string())?;
    let m = load_model(&ModelSource::resolve(&spec)?, tch::Device::Cpu, DType::F32)?.model;
    let shape = TraceShape {
        groups: 1,
        group_size: 4,
        turns: 4,
        prompt_tokens: 200,
        env_tokens: 30,
        gen_tokens: 10,
        break_p: 0.0,
        seed: 1,
        vocab: m.config.vocab_size as u32,
    };
    let episodes = trace(&shape);
    let rewards: Vec<f64> = (0..episodes.len()).map(|i| (i % 2) as f64).collect();
    let groups = vec![Group {
        group_id: "g0".into(),
        advantages: advantages(AdvantageKind::Grpo, &rewards)
            .ok_or_else(|| anyhow::anyhow!("no advantages"))?,
        episodes,
    }];
    let mut t = Trainer::new(
        m,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr,
                ..Default::default()
            },
            max_staleness: None,
            ..TrainerConfig::default()
        },
    )?;
    println!("broadcast bench: {spec}, full fine-tuning at lr {lr}, {steps} steps");
    let kinds = [(Kind::BFloat16, "bf16", 2u8), (Kind::Float, "f32", 4u8)];
    let mut prev: Vec<(Manifest, Vec<u8>)> = Vec::new();
    for (kind, name, _) in kinds {
        let (layout, bytes) = snapshot(&t.model, kind)?;
        prev.push((Manifest::build(&spec, 0, "", &layout, &bytes)?, bytes));
        let _ = name;
    }
    let mut totals = vec![(0u64, 0u64, 0.0f64, 0.0f64); kinds.len()];
    for step in 1..=steps {
        let t0 = Instant::now();
        let s = t.step(&groups, &ReadyReport::default())?;
        anyhow::ensure!(s.trained, "the step trained nothing");
        println!(
            "step {step}: trained in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        for (k, (kind, name, width)) in kinds.iter().enumerate() {
            let t0 = Instant::now();
            let (layout, bytes) = snapshot(&t.model, *kind)?;
            let m = Manifest::build(&spec, step as u64, "", &layout, &bytes)?;
            let hash_s = t0.elapsed().as_secs_f64();
            let d = delta((&prev[k].0, &prev[k].1), (&m, &bytes), *width)?;
            println!(
                "  {name}: {} of {} chunks changed, {:.2}% of the values; sent {} bytes of {} \
                 ({:.4} of the snapshot); snapshot + hashes {hash_s:.2} s, encode {:.2} s \
                 ({:.0} MB/s), decode {:.2} s ({:.0} MB/s); chunks raw / zstd / xor / xor-planes \
                 {:?}",
                d.changed_chunks,
                d.chunks,
                100.0 * d.changed_elements,
                d.sent,
                d.full,
                d.sent as f64 / d.full as f64,
                d.encode_s,
                d.full as f64 / 1e6 / d.encode_s.max(1e-9),
                d.decode_s,
                d.full as f64 / 1e6 / d.decode_s.max(1e-9),
                d.chosen,
            );
            let tot = &mut totals[k];
            tot.0 += d.sent;
            tot.1 += d.full;
            tot.2 += d.encode_s;
            tot.3 += d.decode_s;
            prev[k] = (m, bytes);
        }
    }
    for (k, (_, name, _)) in kinds.iter().enumerate() {
        let (sent, full, enc, dec) = totals[k];
        let n = steps.max(1) as u64;
        println!(
            "{name}: per step {} bytes sent of {} ({:.1}x fewer); encode {:.0} MB/s, decode {:.0} MB/s",
            sent / n,
            full / n,
            full as f64 / sent.max(1) as f64,
            full as f64 / 1e6 / enc.max(1e-9),
            full as f64 / 1e6 / dec.max(1e-9)
        );
        println!(
            "RESULT broadcast delta_bytes_vs_full_{name} ours={} peer={} ratio={:.2}",
            sent / n,
            full / n,
            full as f64 / sent.max(1) as f64
        );
    }
    Ok(())
}
