//! `cargo bench --bench lora [-- FLAGS]`: a LoRA adapter (rank 16 on every linear layer of
//! SmolLM2-135M-Instruct) against full fine-tuning, and against HF PEFT, on this machine in
//! one run:
//!
//! - `step_time_vs_full`, `peak_memory_vs_full`: one GRPO step of the trainer
//!   (`Trainer::step`, tree layout) on the actor_update trace, each variant in a child
//!   process of its own so its peak resident memory (VmHWM) is its own. Both float32 bases.
//! - `fwd_bwd_vs_peft`: the same rows (linear layout, one episode per row) through our
//!   forward + backward with the adapter, and through HF PEFT's (transformers + peft,
//!   float32, `logits_to_keep` = the scored positions, the same thread count).
//! - `allreduce_bytes_vs_full`: the bytes one member sends in a synchronous step's
//!   all-reduce (a real two-member loopback ring, float32 wire): the adapter's gradient
//!   against the whole model's.
//! - `decode_unmerged_vs_merged`: decode tokens/s at 1 and 32 streams serving base +
//!   adapter unmerged (the engine's stacked low-rank products) against the adapter merged
//!   into the weights (which decodes at the base's speed and needs the base kept aside to
//!   re-merge after each step); also the per-target unmerged path for reference.
//!
//! - `multi_adapter_decode_{1,4,16}`: decode tokens/s at 32 streams with 1, 4 and 16
//!   distinct adapters in every batch (the engine's bank, gathered per adapter), against the
//!   base alone.
//!
//! ```text
//! --rank N [16]  --rounds N [3]  (timed steps per variant; the median is reported)
//! --groups N [1]  --group-size N [4]  --turns N [12]  --prompt N [600]  --env N [30]
//! --gen N [10]  (the trace, as actor_update's)
//! --skip-peft  (no Python)  --decode-tokens N [32]
//! --only-multi-adapter  (only multi_adapter_decode)  --only-decode  (only the merged /
//! unmerged decode figures)  --model SPEC [smollm2]
//! ```

#[allow(dead_code)] // only its reference_python
mod peer;

mod flags;
use flags::{flag, parse};

use std::process::Command;
use std::time::Instant;

use agentjet::collective::{Ring, Wire};
use agentjet::engine::{generate_batch, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::lora::{Adapter, LoraConfig};
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use agentjet::timeline::layout::{pack, Layout};
use agentjet::timeline::synth::{trace, TraceShape};
use agentjet::timeline::Episode;
use agentjet::train::groups::{advantages, AdvantageKind, Group, ReadyReport};
use agentjet::train::optim::AdamWConfig;
use agentjet::train::target_logprobs;
use agentjet::train::trainer::{Trainer, TrainerConfig};
use tch::{Kind, Tensor};

fn main() {
    if let Err(e) = run() {
        eprintln!("lora bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn shape(args: &[String]) -> anyhow::Result<TraceShape> {
    Ok(TraceShape {
        groups: parse(args, "--groups", 1)?,
        group_size: parse(args, "--group-size", 4)?,
        turns: parse(args, "--turns", 12)?,
        prompt_tokens: parse(args, "--prompt", 600)?,
        env_tokens: parse(args, "--env", 30)?,
        gen_tokens: parse(args, "--gen", 10)?,
        break_p: 0.0,
        seed: 1,
        vocab: 49152,
    })
}

/// The model every part runs on (`--model SPEC`, default SmolLM2).
static SPEC: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn model(lora: Option<usize>, dtype: DType) -> anyhow::Result<Llama> {
    let source = ModelSource::resolve(SPEC.get().map_or("smollm2", String::as_str))?;
    let mut m = load_model(&source, tch::Device::cuda_if_available(), dtype)?.model;
    if let Some(r) = lora {
        m.attach_adapter(LoraConfig::new(r), 0)?;
    }
    Ok(m)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The child: one variant's GRPO steps; prints `STEP <median s>`, `PEAK <bytes>`, `MEM`.
fn child(args: &[String], variant: &str) -> anyhow::Result<()> {
    let rank: usize = parse(args, "--rank", 16)?;
    let rounds: usize = parse(args, "--rounds", 3)?;
    let lora = (variant == "lora").then_some(rank);
    // Blocks of 1 MiB and more are mapped on their own and unmapped when freed, so the
    // resident size follows the live tensors (glibc's defaults keep freed blocks under
    // 32 MiB in the heap, where fragmentation holds them: peaks then differ by the order
    // of allocations, not by what a variant needs). Both variants alike.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's malloc parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
    let m = model(lora, DType::F32)?;
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "  {variant}: after loading, RSS {:.0} MiB (peak {:.0} MiB)",
        mib(status_bytes("VmRSS:")),
        mib(peak_rss_bytes())
    );
    let episodes = trace(&shape(args)?);
    let gs = shape(args)?.group_size;
    let groups: Vec<Group> = episodes
        .chunks(gs)
        .enumerate()
        .map(|(g, eps)| {
            let rewards: Vec<f64> = (0..eps.len()).map(|i| (i % 2) as f64).collect();
            Ok(Group {
                group_id: format!("g{g}"),
                episodes: eps.to_vec(),
                advantages: advantages(AdvantageKind::Grpo, &rewards)
                    .ok_or_else(|| anyhow::anyhow!("no advantages"))?,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let mut t = Trainer::new(
        m,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr: 1e-7,
                ..Default::default()
            },
            max_staleness: None,
            ..TrainerConfig::default()
        },
    )?;
    let mut times = Vec::new();
    for i in 0..=rounds {
        let t0 = Instant::now();
        let s = t.step(&groups, &ReadyReport::default())?;
        anyhow::ensure!(s.trained, "the step trained nothing");
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "  {variant} step {i}: {secs:.2} s ({} tokens), RSS {:.0} MiB, peak {:.0} MiB",
            s.tokens_computed,
            mib(status_bytes("VmRSS:")),
            mib(peak_rss_bytes())
        );
        if i > 0 {
            times.push(secs); // the first step allocates the optimizer's moments
        }
    }
    println!("MEM {}", t.memory());
    println!("VALUES {}", t.gradient_len());
    println!("STEP {}", median(times));
    println!("PEAK {}", peak_rss_bytes());
    Ok(())
}

struct ChildOut {
    step: f64,
    peak: u64,
    values: usize,
    mem: String,
}

fn run_child(args: &[String], variant: &str) -> anyhow::Result<ChildOut> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--child", variant]);
    for f in [
        "--rank",
        "--rounds",
        "--groups",
        "--group-size",
        "--turns",
        "--prompt",
        "--env",
        "--gen",
        "--model",
    ] {
        if let Some(v) = flag(args, f) {
            cmd.args([f, &v]);
        }
    }
    let out = cmd.output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    anyhow::ensure!(
        out.status.success(),
        "the {variant} child failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!(
        "{}",
        text.lines()
            .filter(|l| l.starts_with("  "))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    );
    let get = |k: &str| -> anyhow::Result<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .ok_or_else(|| anyhow::anyhow!("the {variant} child printed no {k}"))
    };
    Ok(ChildOut {
        step: get("STEP ")?.parse()?,
        peak: get("PEAK ")?.parse()?,
        values: get("VALUES ")?.parse()?,
        mem: get("MEM ")?,
    })
}

/// Bytes member 0 sends in one all-reduce of `values` float32 values over a 2-member
/// loopback ring.
fn allreduce_bytes(values: usize) -> anyhow::Result<u64> {
    let rings = Ring::loopback(2)?;
    let sent: Vec<anyhow::Result<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(r, mut ring)| {
                s.spawn(move || -> anyhow::Result<u64> {
                    let mut data = vec![r as f32 * 1e-3; values];
                    Ok(ring.all_reduce(&mut data, Wire::F32)?.bytes_sent)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a member panicked")))
            })
            .collect()
    });
    sent.into_iter()
        .next()
        .unwrap_or_else(|| Err(anyhow::anyhow!("no member")))
}

/// Our forward + backward over `rows` with the adapter (median seconds over `rounds`).
fn ours_fwd_bwd(
    m: &Llama,
    rows: &[agentjet::timeline::layout::PackedRow],
    rounds: usize,
) -> anyhow::Result<f64> {
    let total: usize = rows.iter().map(|r| r.targets.len()).sum();
    let mut times = Vec::new();
    for _ in 0..=rounds {
        let t0 = Instant::now();
        for row in rows {
            let adv =
                Tensor::from_slice(&row.targets.iter().map(|t| t.advantage).collect::<Vec<_>>())
                    .to_device(m.device());
            let lp = target_logprobs(m, row)?;
            let loss = -(&lp * adv).sum(Kind::Float) / total as f64;
            loss.backward();
        }
        times.push(t0.elapsed().as_secs_f64());
        tch::no_grad(|| {
            for p in m.parameters() {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        });
    }
    times.remove(0);
    Ok(median(times))
}

/// HF PEFT's forward + backward over the same rows (median seconds over `rounds`).
fn peft_fwd_bwd(
    rows: &[agentjet::timeline::layout::PackedRow],
    rank: usize,
    rounds: usize,
) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let hf = dir.path().join("smollm2-hf");
    let source = ModelSource::resolve(SPEC.get().map_or("smollm2", String::as_str))?;
    let loaded = load_model(&source, tch::Device::Cpu, DType::F32)?;
    agentjet::model::checkpoint::save_checkpoint(&hf, &loaded.card, &loaded.model, DType::F32)?;
    drop(loaded);
    let rows_json: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "ids": r.tokens,
                "from": r.targets.iter().map(|t| t.from).collect::<Vec<_>>(),
                "tok": r.targets.iter().map(|t| t.token).collect::<Vec<_>>(),
                "adv": r.targets.iter().map(|t| t.advantage).collect::<Vec<_>>(),
            })
        })
        .collect();
    let rows_path = dir.path().join("rows.json");
    std::fs::write(&rows_path, serde_json::to_vec(&rows_json)?)?;
    let out = Command::new(peer::reference_python(false)?)
        .arg("benches/peft_fwd_bwd.py")
        .arg(&hf)
        .arg(&rows_path)
        .args([
            rank.to_string(),
            rounds.to_string(),
            tch::get_num_threads().to_string(),
        ])
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    anyhow::ensure!(
        out.status.success(),
        "peft failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    text.lines()
        .find_map(|l| l.strip_prefix("PEFT_FWD_BWD "))
        .ok_or_else(|| anyhow::anyhow!("peft printed no time"))?
        .trim()
        .parse()
        .map_err(Into::into)
}

/// Decode tokens/s of `m` at `streams` greedy streams of `tokens` new tokens each; with
/// `adapters` > 0, stream `i` uses bank adapter `i % adapters`.
fn decode_rate(m: &Llama, streams: usize, tokens: usize, adapters: usize) -> anyhow::Result<f64> {
    let reqs: Vec<GenerateRequest> = (0..streams)
        .map(|i| GenerateRequest {
            prompt: (0..24)
                .map(|j| 100 + ((i * 31 + j * 7) % 5000) as u32)
                .collect(),
            max_tokens: tokens,
            sampling: SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            seed: Some(i as u64),
            stop_token_ids: Vec::new(),
            top_logprobs: 0,
            constraint: None,
            adapter: (adapters > 0).then_some(i % adapters.max(1)),
        })
        .collect();
    let _ = generate_batch(m, &reqs[..1])?; // warm-up
    let mut rates = Vec::new();
    for _ in 0..3 {
        let gens = generate_batch(m, &reqs)?;
        let n: usize = gens.iter().map(|g| g.tokens.len()).sum();
        let secs = gens
            .iter()
            .map(|g| g.decode_time.as_secs_f64())
            .fold(0.0, f64::max);
        rates.push(n as f64 / secs.max(1e-9));
    }
    Ok(median(rates))
}

/// `multi_adapter_decode`: 32 streams over the base with 1, 4 and 16 distinct bank
/// adapters in each batch (stream `i` uses adapter `i % n`), against the base alone, on
/// one model (the same weights in every run).
fn multi_adapter(args: &[String], rank: usize, dtype: DType) -> anyhow::Result<()> {
    let n_tok: usize = parse(args, "--decode-tokens", 32)?;
    let mut m = model(None, dtype)?;
    let base = decode_rate(&m, 32, n_tok, 0)?;
    println!("decode, 32 streams, base alone ({dtype:?}): {base:.1} tok/s");
    let mut out = Vec::new();
    for n in [1usize, 4, 16] {
        while m.served_adapters() < n {
            let seed = m.served_adapters() as u64;
            let a = Adapter::new(&m.config, LoraConfig::new(rank), seed, m.device())?;
            // A trained adapter: B not zero.
            tch::no_grad(|| {
                for (i, mut p) in a.tensors().into_iter().enumerate() {
                    if i % 2 == 1 {
                        p.copy_(&(p.randn_like() * 0.01));
                    }
                }
            });
            m.add_served_adapter(a)?;
        }
        let rate = decode_rate(&m, 32, n_tok, n)?;
        println!("decode, 32 streams, {n:>2} distinct adapters r{rank}: {rate:.1} tok/s ({:.2}x the base)", rate / base);
        out.push((n, rate));
    }
    for (n, rate) in out {
        println!(
            "RESULT lora multi_adapter_decode_{n} ours={rate:.1} peer={base:.1} ratio={:.2}",
            rate / base
        );
    }
    Ok(())
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let _ = SPEC.set(flag(&args, "--model").unwrap_or_else(|| "smollm2".into()));
    if let Some(v) = flag(&args, "--child") {
        return child(&args, &v);
    }
    let rank: usize = parse(&args, "--rank", 16)?;
    let decode_dtype = if tch::Cuda::is_available() {
        DType::BF16
    } else {
        DType::F32
    };
    if args.iter().any(|a| a == "--only-multi-adapter") {
        return multi_adapter(&args, rank, decode_dtype);
    }
    if args.iter().any(|a| a == "--only-decode") {
        decode_results(&decode_variants(&args, rank)?);
        return Ok(());
    }
    let rounds: usize = parse(&args, "--rounds", 3)?;
    println!(
        "lora bench: rank {rank} on every linear layer, {:?}",
        shape(&args)?
    );

    // 1. A GRPO step, each variant in its own process.
    let full = run_child(&args, "full")?;
    let lora = run_child(&args, "lora")?;
    println!(
        "full fine-tuning: step {:.2} s, peak RSS {:.0} MiB; trainer {}",
        full.step,
        full.peak as f64 / 1048576.0,
        full.mem
    );
    println!(
        "LoRA r{rank}:        step {:.2} s, peak RSS {:.0} MiB; trainer {}",
        lora.step,
        lora.peak as f64 / 1048576.0,
        lora.mem
    );

    // 2. The all-reduce of one synchronous step.
    let (b_full, b_lora) = (allreduce_bytes(full.values)?, allreduce_bytes(lora.values)?);
    println!(
        "all-reduce per member per step (2 members, f32 wire): full {} values {:.1} MB, LoRA {} values {:.2} MB",
        full.values,
        b_full as f64 / 1e6,
        lora.values,
        b_lora as f64 / 1e6
    );

    // 3. Forward + backward against HF PEFT, the same rows.
    let episodes: Vec<Episode> = trace(&shape(&args)?);
    let batch: Vec<_> = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| (e, if i % 2 == 0 { 1.0f32 } else { -1.0 }))
        .collect();
    let rows = pack("policy", &batch, Layout::Linear, 1)?;
    let tokens: usize = rows.iter().map(|r| r.len()).sum();
    let m = model(Some(rank), DType::F32)?;
    m.parameters().into_iter().for_each(|mut p| {
        let _ = p.requires_grad_(true);
    });
    let ours = ours_fwd_bwd(&m, &rows, rounds)?;
    drop(m);
    println!(
        "forward + backward, {} rows, {tokens} tokens: ours {ours:.2} s",
        rows.len()
    );
    let peft = if args.iter().any(|a| a == "--skip-peft") {
        None
    } else {
        Some(peft_fwd_bwd(&rows, rank, rounds)?)
    };

    // 4. Decode: unmerged (stacked, as the engine serves) against merged.
    let rates = decode_variants(&args, rank)?;
    multi_adapter(&args, rank, decode_dtype)?;

    println!(
        "RESULT lora step_time_vs_full ours={:.3} peer={:.3} ratio={:.2}",
        lora.step,
        full.step,
        full.step / lora.step
    );
    println!(
        "RESULT lora peak_memory_vs_full ours={} peer={} ratio={:.2}",
        lora.peak,
        full.peak,
        full.peak as f64 / lora.peak as f64
    );
    if let Some(p) = peft {
        println!(
            "RESULT lora fwd_bwd_vs_peft ours={ours:.3} peer={p:.3} ratio={:.2}",
            p / ours
        );
    }
    println!(
        "RESULT lora allreduce_bytes_vs_full ours={b_lora} peer={b_full} ratio={:.1}",
        b_full as f64 / b_lora as f64
    );
    decode_results(&rates);
    Ok(())
}

/// Decode tok/s at 1 and 32 streams of the base, the adapter merged (as `--lora-serve
/// merged` serves it), unmerged (the stacked low-rank products) and unmerged per target.
fn decode_variants(args: &[String], rank: usize) -> anyhow::Result<Vec<(&'static str, f64, f64)>> {
    let n_tok: usize = parse(args, "--decode-tokens", 32)?;
    let dtype = if tch::Cuda::is_available() {
        DType::BF16
    } else {
        DType::F32
    };
    let mut rates = Vec::new();
    for variant in ["base", "merged", "unmerged", "unmerged-per-target"] {
        let m = match variant {
            "base" => model(None, dtype)?,
            _ => {
                let m = model(Some(rank), dtype)?;
                // A trained adapter: B not zero.
                tch::no_grad(|| {
                    for (i, mut p) in m.parameters().into_iter().enumerate() {
                        if i % 2 == 1 {
                            p.copy_(&(p.randn_like() * 0.01));
                        }
                    }
                });
                m
            }
        };
        let mut m = m;
        let m = match variant {
            // As `--lora-serve merged` serves: the adapter in the engine's own copy of
            // the targeted weights.
            "merged" => {
                m.serve_merged_adapter()?;
                m
            }
            "unmerged" => {
                m.serve_stacked_adapter();
                m
            }
            _ => m,
        };
        let one = decode_rate(&m, 1, n_tok * 2, 0)?;
        let many = decode_rate(&m, 32, n_tok, 0)?;
        println!(
            "decode {variant:>19} ({dtype:?}): 1 stream {one:.1} tok/s, 32 streams {many:.1} tok/s"
        );
        rates.push((variant, one, many));
    }
    let merge_secs = {
        let mut m = model(Some(rank), dtype)?;
        m.serve_merged_adapter()?;
        let t0 = Instant::now();
        m.parameters_changed()?;
        t0.elapsed().as_secs_f64()
    };
    println!("merging the adapter again after a weight update (merged serving, each step): {merge_secs:.3} s");
    Ok(rates)
}

/// The decode RESULT lines of [`decode_variants`]' rates.
fn decode_results(rates: &[(&'static str, f64, f64)]) {
    let get = |v: &str| rates.iter().find(|r| r.0 == v).copied().expect("measured");
    let (_, m1, m32) = get("merged");
    let (_, u1, u32_) = get("unmerged");
    let (_, b1, b32) = get("base");
    println!(
        "RESULT lora decode_unmerged_vs_merged_1_stream ours={u1:.1} peer={m1:.1} ratio={:.2}",
        u1 / m1
    );
    println!(
        "RESULT lora decode_unmerged_vs_merged_32_streams ours={u32_:.1} peer={m32:.1} ratio={:.2}",
        u32_ / m32
    );
    println!(
        "RESULT lora decode_unmerged_vs_base_32_streams ours={u32_:.1} peer={b32:.1} ratio={:.2}",
        u32_ / b32
    );
    println!(
        "RESULT lora decode_unmerged_vs_base_1_stream ours={u1:.1} peer={b1:.1} ratio={:.2}",
        u1 / b1
    );
}
