//! `cargo bench --bench logprobs [-- --tokens N --chunk N]`: token log-probabilities and
//! entropies of the default model's output layer (SmolLM2-135M-Instruct, vocabulary 49,152,
//! float32 on the CPU), forward and backward, two ways in the same run:
//!
//! - ours: `agentjet_kernels::logprobs` (chunks of `--chunk` rows; what the trainer runs);
//! - peer: the full way, LibTorch's (= PyTorch's) `log_softmax` over all [tokens x vocab]
//!   logits with autograd, what a trainer without the kernel does.
//!
//! The hidden states are the model's own (a forward of `--tokens` random tokens). Prints
//! the largest differences (log-probabilities and entropies must agree within 1e-5, or the
//! bench fails), wall time, and each way's peak resident memory above the memory in use
//! before it (Linux: VmHWM after resetting it through /proc/self/clear_refs).

use std::time::Instant;

use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::ModelSource;
use agentjet_kernels::logprobs::{token_logprobs, token_logprobs_backward};
use tch::{Kind, Tensor};

fn flag(args: &[String], name: &str, default: i64) -> anyhow::Result<i64> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("{name} wants a number")),
    }
}

fn status_kb(key: &str) -> anyhow::Result<f64> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no {key} in /proc/self/status"))
}

/// Runs `f` and returns (its result, peak RSS above the RSS before it, in MiB).
fn peak<T>(f: impl FnOnce() -> T) -> anyhow::Result<(T, f64)> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    let before = status_kb("VmRSS:")?;
    let out = f();
    let hwm = status_kb("VmHWM:")?;
    Ok((out, (hwm - before).max(0.0) / 1024.0))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("logprobs bench failed: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let t = flag(&args, "--tokens", 4096)?;
    let chunk = flag(&args, "--chunk", 512)?;
    let model = load_model(
        &ModelSource::resolve("smollm2")?,
        tch::Device::Cpu,
        DType::F32,
    )?
    .model;
    let vocab = model.output_weight().size()[0];
    println!("logprobs bench: SmolLM2-135M-Instruct output layer, {t} tokens x {vocab} vocabulary, chunks of {chunk}");
    tch::manual_seed(1);
    let ids = Tensor::randint(vocab, [t], (Kind::Int64, tch::Device::Cpu));
    let pos = Tensor::arange(t, (Kind::Int64, tch::Device::Cpu));
    let parent: Vec<i32> = (0..t as i32).map(|i| i - 1).collect();
    let h = tch::no_grad(|| model.forward_row_hidden(&ids, &pos, &parent, None))?;
    let w = model.output_weight().detach();
    let y = Tensor::randint(vocab, [t], (Kind::Int64, tch::Device::Cpu));
    let g_lp = Tensor::randn([t], (Kind::Float, tch::Device::Cpu));
    let g_h = Tensor::randn([t], (Kind::Float, tch::Device::Cpu)) * 0.1;

    let t0 = Instant::now();
    let (ours, ours_mb) = peak(|| -> anyhow::Result<_> {
        let out = token_logprobs(&h, &w, &y, chunk, true, None).map_err(anyhow::Error::msg)?;
        let (gh, gw) = token_logprobs_backward(&h, &w, &y, &g_lp, Some(&g_h), chunk, None)
            .map_err(anyhow::Error::msg)?;
        Ok((out.logprobs, out.entropy.expect("asked"), gh, gw))
    })?;
    let ours_s = t0.elapsed().as_secs_f64();
    let (lp, ent, gh, gw) = ours?;

    let t0 = Instant::now();
    let (full, full_mb) = peak(|| {
        let hr = h.detach().set_requires_grad(true);
        let wr = w.detach().set_requires_grad(true);
        let ls = hr.matmul(&wr.tr()).log_softmax(-1, Kind::Float);
        let lp = ls.gather(1, &y.unsqueeze(1), false).squeeze_dim(1);
        let ent = -(ls.exp() * &ls).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float);
        let loss = (&lp * &g_lp).sum(Kind::Float) + (&ent * &g_h).sum(Kind::Float);
        let g = Tensor::run_backward(&[&loss], &[&hr, &wr], false, false);
        (
            lp.detach(),
            ent.detach(),
            g[0].shallow_clone(),
            g[1].shallow_clone(),
        )
    })?;
    let full_s = t0.elapsed().as_secs_f64();
    let d = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    let rel = |a: &Tensor, b: &Tensor| d(a, b) / b.abs().max().double_value(&[]).max(1e-12);
    let (d_lp, d_ent) = (d(&lp, &full.0), d(&ent, &full.1));
    let (r_gh, r_gw) = (rel(&gh, &full.2), rel(&gw, &full.3));
    println!("largest difference: logprobs {d_lp:.2e}, entropies {d_ent:.2e}; gradients (relative to their largest entry) h {r_gh:.2e}, W {r_gw:.2e}");
    println!("| way | peak memory above start (MiB) | forward + backward (s) |");
    println!("|-----|-------------------------------|------------------------|");
    println!("| chunked kernel (ours) | {ours_mb:.1} | {ours_s:.2} |");
    println!("| full log-softmax (LibTorch autograd) | {full_mb:.1} | {full_s:.2} |");
    anyhow::ensure!(
        d_lp <= 1e-5 && d_ent <= 1e-5,
        "chunked values differ from the full log-softmax by more than 1e-5"
    );
    anyhow::ensure!(r_gh <= 1e-4 && r_gw <= 1e-4, "chunked gradients differ");
    println!(
        "RESULT logprobs peak_mib ours={ours_mb:.1} peer={full_mb:.1} ratio={:.2}",
        full_mb / ours_mb.max(1e-9)
    );
    println!(
        "RESULT logprobs time_s ours={ours_s:.3} peer={full_s:.3} ratio={:.2}",
        full_s / ours_s.max(1e-9)
    );
    Ok(())
}
