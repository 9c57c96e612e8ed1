//! `cargo bench --bench actor_update [-- FLAGS]`: the actor-update time of one batch of
//! multi-turn episodes under the three training layouts (see `timeline::layout`):
//! per call (every call's prompt + completion on its own, what training without merging
//! costs), linear (AgentJet's merge: the calls of an episode that extend each other form
//! one sequence) and tree (the episodes of a group also share their common prefix, so
//! the group prompt is computed once).
//!
//! Each layout runs the real default model (SmolLM2-135M-Instruct, float32, on the CPU
//! here): forward over every packed row, the token-level policy-gradient surrogate
//! `-Σ advantage * logprob / sampled tokens`, backward, then one AdamW step. The trace is
//! synthetic and AppWorld-shaped (`timeline::synth`); flags (defaults in brackets):
//!
//! ```text
//! --groups N [1]  --group-size N [4]  --turns N [12]  --prompt N [600]
//! --env N [30]  --gen N [10]  --break-p P [0]  --row-tokens N [4096]  --seed N [1]
//! --model SPEC [smollm2]  (a GGUF file or HF directory of another Llama-family model)
//! --layouts LIST [per-call,linear,tree]  (e.g. `linear,tree` skips the slow per-call run)
//! --rounds N [3]  (linear and tree run N times, interleaved; each time is the median)
//! --bf16  (matrix products in bfloat16 over the float32 weights: the trainer's bf16 option)
//! --allreduce-peers LIST  (e.g. `2,3`: also all-reduce the model's whole gradient over
//!     a sealed loopback ring of that many members, f32 and bf16 wire, against the step)
//! --diloco-every H [500]  (with --allreduce-peers: a member's bytes over H synchronous
//!     steps against one DiLoCo outer step, from the rounds' byte counts)
//! ```
//!
//! The defaults (a group of 4 episodes of 12 turns on a 600-token prompt) finish in about
//! six minutes on a 2-core CPU (per call about four of them); AppWorld's own shape is about
//! `--turns 20 --prompt 300 --env 60 --gen 20 --group-size 8` (per call alone is then
//! ~180k tokens: hours here, minutes on a GPU).
//!
//! Prints each layout's token count and time, the ratios, and `RESULT` lines, where the
//! "peer" is the layout being improved on (per call for linear, linear for tree).

mod flags;
use flags::{flag, parse};

use std::time::Instant;

use agentjet::collective::{Ring, Wire};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use agentjet::timeline::layout::{pack, Layout, PackedRow};
use agentjet::timeline::synth::{trace, TraceShape};
use agentjet::train::optim::{AdamW, AdamWConfig};
use agentjet::train::target_logprobs;
use tch::{Kind, Tensor};

fn main() {
    if let Err(e) = run() {
        eprintln!("actor_update bench failed: {e:#}");
        std::process::exit(1);
    }
}

/// One actor update over `rows`: forward, loss, backward per row (gradients accumulate),
/// then the optimizer step. Returns (seconds, of which the optimizer step, loss).
fn update(model: &Llama, opt: &mut AdamW, rows: &[PackedRow]) -> anyhow::Result<(f64, f64, f64)> {
    let t0 = Instant::now();
    let total: usize = rows.iter().map(|r| r.targets.len()).sum();
    let mut loss_sum = 0.0;
    for row in rows {
        let adv = Tensor::from_slice(&row.targets.iter().map(|t| t.advantage).collect::<Vec<_>>())
            .to_device(model.device());
        let lp = target_logprobs(model, row)?;
        let loss = -(&lp * adv).sum(Kind::Float) / total as f64;
        loss.backward();
        loss_sum += loss.double_value(&[]);
    }
    let t_opt = Instant::now();
    opt.step();
    if let tch::Device::Cuda(i) = model.device() {
        tch::Cuda::synchronize(i as i64);
    }
    let opt_secs = t_opt.elapsed().as_secs_f64();
    Ok((t0.elapsed().as_secs_f64(), opt_secs, loss_sum))
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = TraceShape {
        groups: parse(&args, "--groups", 1)?,
        group_size: parse(&args, "--group-size", 4)?,
        turns: parse(&args, "--turns", 12)?,
        prompt_tokens: parse(&args, "--prompt", 600)?,
        env_tokens: parse(&args, "--env", 30)?,
        gen_tokens: parse(&args, "--gen", 10)?,
        break_p: parse(&args, "--break-p", 0.0)?,
        seed: parse(&args, "--seed", 1)?,
        vocab: 49152,
    };
    let row_tokens: usize = parse(&args, "--row-tokens", 4096)?;
    println!("actor_update bench: {shape:?}, rows of at most {row_tokens} tokens");
    let episodes = trace(&shape);
    let batch: Vec<_> = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| (e, if i % 2 == 0 { 1.0f32 } else { -1.0 }))
        .collect();
    let source = ModelSource::resolve(&flag(&args, "--model").unwrap_or_else(|| "smollm2".into()))?;
    let mut model = load_model(&source, tch::Device::cuda_if_available(), DType::F32)?.model;
    model.set_trainable(true);
    let bf16 = args.iter().any(|a| a == "--bf16");
    if bf16 {
        model.set_compute_kind(Some(Kind::BFloat16))?;
    }
    println!(
        "{} on {:?}{}",
        source.display_name(),
        model.device(),
        if bf16 { ", bf16 matrix products" } else { "" }
    );
    let mut opt = AdamW::new(
        model.parameters(),
        AdamWConfig {
            lr: 1e-7,
            ..Default::default()
        },
    );
    // Warm-up (first-use allocations and kernel selection), untimed: one update on the
    // first episode's first call.
    let first = agentjet::timeline::Episode {
        calls: episodes[0].calls[..1].to_vec(),
        ..episodes[0].clone()
    };
    update(
        &model,
        &mut opt,
        &pack("policy", &[(&first, 1.0)], Layout::Linear, row_tokens)?,
    )?;
    let wanted = flag(&args, "--layouts").unwrap_or_else(|| "per-call,linear,tree".into());
    let layouts: Vec<Layout> = wanted
        .split(',')
        .map(|w| {
            [Layout::PerCall, Layout::Linear, Layout::Tree]
                .into_iter()
                .find(|l| l.name() == w.trim())
                .ok_or_else(|| {
                    anyhow::anyhow!("--layouts: unknown layout {w:?} (per-call, linear, tree)")
                })
        })
        .collect::<anyhow::Result<_>>()?;
    // Rounds: every layout once per round, in order, so a slow spell of this (shared)
    // machine hits all of them; each layout's time is its median over the rounds. The
    // per-call layout is slow and far from the others, so it runs in the first round only.
    let rounds: usize = parse(&args, "--rounds", 3)?;
    anyhow::ensure!(rounds >= 1, "--rounds must be at least 1");
    let packed: Vec<(Layout, Vec<PackedRow>)> = layouts
        .iter()
        .map(|&l| Ok((l, pack("policy", &batch, l, row_tokens)?)))
        .collect::<anyhow::Result<_>>()?;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); packed.len()];
    for round in 0..rounds {
        for (i, (layout, rows)) in packed.iter().enumerate() {
            if round > 0 && *layout == Layout::PerCall {
                continue;
            }
            let tokens: usize = rows.iter().map(PackedRow::len).sum();
            let targets: usize = rows.iter().map(|r| r.targets.len()).sum();
            let (secs, opt_secs, loss) = update(&model, &mut opt, rows)?;
            println!(
                "  round {}: {:>8}: {} rows, {tokens} tokens, {targets} sampled, {secs:.2} s (optimizer step {opt_secs:.2} s; loss {loss:.4})",
                round + 1,
                layout.name(),
                rows.len()
            );
            times[i].push(secs);
        }
    }
    let results: Vec<(Layout, usize, f64)> = packed
        .iter()
        .zip(&times)
        .map(|((l, rows), t)| {
            let mut t = t.clone();
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            let tokens = rows.iter().map(PackedRow::len).sum();
            println!(
                "{:>8}: {tokens} tokens, median {median:.2} s of {:?}",
                l.name(),
                t.iter()
                    .map(|x| (x * 100.0).round() / 100.0)
                    .collect::<Vec<_>>()
            );
            (*l, tokens, median)
        })
        .collect();
    let find = |l: Layout| results.iter().find(|r| r.0 == l).map(|r| (r.1, r.2));
    println!("goals: linear >= 6.25x per call and within 85% of the token ratio; tree >= 1.5x linear on groups");
    if let (Some((tok_call, t_call)), Some((tok_lin, t_lin))) =
        (find(Layout::PerCall), find(Layout::Linear))
    {
        let token_ratio = tok_call as f64 / tok_lin as f64;
        let speedup = t_call / t_lin;
        println!(
            "linear vs per call: {token_ratio:.2}x fewer tokens, {speedup:.2}x faster ({:.0}% of the token ratio)",
            100.0 * speedup / token_ratio
        );
        println!("RESULT actor_update time_s_linear_vs_per_call ours={t_lin:.3} peer={t_call:.3} ratio={speedup:.2}");
        println!("RESULT actor_update tokens_linear_vs_per_call ours={tok_lin} peer={tok_call} ratio={token_ratio:.2}");
        println!(
            "RESULT actor_update speedup_share_of_token_ratio ours={:.3}",
            speedup / token_ratio
        );
    }
    if let (Some((tok_lin, t_lin)), Some((tok_tree, t_tree))) =
        (find(Layout::Linear), find(Layout::Tree))
    {
        let token_ratio = tok_lin as f64 / tok_tree as f64;
        println!(
            "tree vs linear: {token_ratio:.2}x fewer tokens, {:.2}x faster",
            t_lin / t_tree
        );
        println!(
            "RESULT actor_update time_s_tree_vs_linear ours={t_tree:.3} peer={t_lin:.3} ratio={:.2}",
            t_lin / t_tree
        );
        println!("RESULT actor_update tokens_tree_vs_linear ours={tok_tree} peer={tok_lin} ratio={token_ratio:.2}");
    }
    if let Some(list) = flag(&args, "--allreduce-peers") {
        let peers: Vec<usize> = list
            .split(',')
            .map(|p| p.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--allreduce-peers {list:?}: {e}"))?;
        let (_, step) = find(Layout::Tree)
            .or(find(Layout::Linear))
            .or(find(Layout::PerCall))
            .ok_or_else(|| anyhow::anyhow!("no layout ran"))?;
        let values: usize = model.parameters().iter().map(Tensor::numel).sum();
        drop(opt);
        drop(model);
        communication(&peers, values, step, parse(&args, "--diloco-every", 500)?)?;
    }
    Ok(())
}

/// Rounds over `n` in-process members of one sealed loopback ring (as a group's ring
/// lives across steps): for each job (values, wire), a sum of that many floats; returns
/// (seconds at member 0, bytes member 0 sent) per job.
fn rounds(n: usize, jobs: &[(usize, Wire)]) -> anyhow::Result<Vec<(f64, u64)>> {
    let rings = Ring::loopback(n)?;
    let most = jobs.iter().map(|j| j.0).max().unwrap_or(0);
    let out: Vec<anyhow::Result<Vec<(f64, u64)>>> = std::thread::scope(|s| {
        let hs: Vec<_> = rings
            .into_iter()
            .enumerate()
            .map(|(r, mut ring)| {
                s.spawn(move || -> anyhow::Result<Vec<(f64, u64)>> {
                    let mut data = vec![0f32; most];
                    let mut got = Vec::new();
                    for &(values, wire) in jobs {
                        data[..values].fill(r as f32 * 1e-3);
                        let st = ring.all_reduce(&mut data[..values], wire)?;
                        got.push((st.seconds, st.bytes_sent));
                    }
                    Ok(got)
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
    let mut first = None;
    for o in out {
        let o = o?;
        first.get_or_insert(o);
    }
    first.ok_or_else(|| anyhow::anyhow!("no member"))
}

/// The gradient all-reduce against the step (`step` seconds), and DiLoCo's traffic
/// against synchronous training over `h` steps.
fn communication(peers: &[usize], values: usize, step: f64, h: u64) -> anyhow::Result<()> {
    println!(
        "all-reduce of the model's whole gradient: {values} float32 values ({:.1} MB), step {step:.2} s",
        values as f64 * 4.0 / 1e6
    );
    println!("goal: communication under one third of the step");
    let mut bytes = None;
    for &n in peers {
        anyhow::ensure!(n >= 2, "--allreduce-peers: rings of at least 2 members");
        // Warm-up rounds first (first-touch allocations of the ring's buffers), then the
        // timed ones, and the small rounds of a step for their byte counts.
        let r = rounds(
            n,
            &[
                (values, Wire::F32),
                (values, Wire::Bf16),
                (values, Wire::F32),
                (values, Wire::Bf16),
                (16, Wire::F32),
                (1, Wire::F32),
            ],
        )?;
        let (f32_s, bf16_s) = (r[2].0, r[3].0);
        println!(
            "  {n} members: f32 wire {:.0} ms ({:.1}% of the step), bf16 wire {:.0} ms ({:.1}%)",
            f32_s * 1e3,
            100.0 * f32_s / step,
            bf16_s * 1e3,
            100.0 * bf16_s / step
        );
        println!(
            "RESULT actor_update allreduce_share_of_step_f32_{n}peers ours={:.4}",
            f32_s / step
        );
        println!(
            "RESULT actor_update allreduce_share_of_step_bf16_{n}peers ours={:.4}",
            bf16_s / step
        );
        bytes.get_or_insert((n, r[4].1, r[5].1, r[2].1, r[3].1));
    }
    // What a member sends: a synchronous step is a stats round (16 values), the gradient
    // round (f32) and a commit round (1 value); a DiLoCo outer step is a weight round (1),
    // the delta round (bf16 or f32) and a commit round. Heartbeats are the same in both
    // (one per half second) and left out.
    let (n, stats, one, grad, delta16) =
        bytes.ok_or_else(|| anyhow::anyhow!("--allreduce-peers: no ring"))?;
    let sync = h * (stats + grad + one);
    let outer16 = one + delta16 + one;
    let outer32 = one + grad + one;
    println!(
        "DiLoCo, {n} members, H = {h}: a member sends {:.1} GB over {h} synchronous steps, \
         {:.1} MB per outer step with a bf16 wire ({:.0}x less), {:.1} MB with f32 ({:.0}x less)",
        sync as f64 / 1e9,
        outer16 as f64 / 1e6,
        sync as f64 / outer16 as f64,
        outer32 as f64 / 1e6,
        sync as f64 / outer32 as f64
    );
    println!(
        "RESULT actor_update diloco_bytes_per_member_h{h}_bf16 ours={outer16} peer={sync} ratio={:.1}",
        sync as f64 / outer16 as f64
    );
    println!(
        "RESULT actor_update diloco_bytes_per_member_h{h}_f32 ours={outer32} peer={sync} ratio={:.1}",
        sync as f64 / outer32 as f64
    );
    Ok(())
}
