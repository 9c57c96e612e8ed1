//! The CUDA paths against the CPU ones on a tiny random model: logits, the serving engine
//! (continuous batching, n choices, bf16), and training (every layout's logprobs and
//! gradients, one AdamW step); LoRA (a mixed batch of bank adapters, an adapter's
//! gradient). CI has no GPU: there each test prints that it compared
//! nothing and passes; the device checks (a machine with a GPU) run them for real.

mod common;

use agentjet::engine::{spawn_engine, Completed, EngineConfig, GenerateRequest, SamplingParams};
use agentjet::model::llama::{DType, Llama, Logits};
use agentjet::timeline::layout::{pack, Layout, PackedRow};
use agentjet::timeline::synth::{trace, TraceShape};
use agentjet::train::optim::{AdamW, AdamWConfig};
use agentjet::train::target_logprobs;
use common::*;
use tch::{Device, Kind, Tensor};

fn cuda() -> Option<Device> {
    if tch::Cuda::is_available() {
        Some(Device::Cuda(0))
    } else {
        eprintln!("no CUDA device here: nothing to compare (the device checks run this on a GPU)");
        None
    }
}

fn tiny(dir: &std::path::Path, device: Device, dtype: DType) -> Llama {
    Tiny {
        max_pos: 512,
        ..Tiny::default()
    }
    .load(dir, device, dtype)
}

fn logprobs_all(m: &Llama, ids: &[i64]) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, ids.len()).unwrap();
    let x = Tensor::from_slice(ids).view([1, -1]).to_device(m.device());
    m.forward(&x, &mut cache, Logits::All)
        .unwrap()
        .to_kind(Kind::Float)
        .log_softmax(-1, Kind::Float)
        .to_device(Device::Cpu)
        .squeeze_dim(0)
}

fn request(i: usize, max_tokens: usize, greedy: bool) -> GenerateRequest {
    GenerateRequest {
        prompt: (0..(3 + 7 * i))
            .map(|t| ((t * 37 + i * 11) % 290) as u32 + 3)
            .collect(),
        max_tokens,
        sampling: if greedy {
            SamplingParams::greedy()
        } else {
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..Default::default()
            }
        },
        seed: Some(i as u64),
        ..Default::default()
    }
}

/// Runs `reqs` concurrently on a fresh engine: (tokens, logprobs) of each, all finished.
fn serve(model: Llama, reqs: &[GenerateRequest]) -> Vec<(Vec<u32>, Vec<f64>)> {
    let engine = spawn_engine(
        model,
        EngineConfig {
            max_batch: 8,
            max_queue: 64,
            max_kv_positions: 8 * 512,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let rxs: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    rxs.into_iter()
        .map(|mut rx| {
            let c = Completed::collect(&mut rx).expect("request failed on the engine");
            (c.tokens, c.logprobs)
        })
        .collect()
}

#[test]
fn cuda_inference_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<i64> = (0..40).map(|i| (i * 53 % 290) + 3).collect();
    let cpu_lp = logprobs_all(&tiny(dir.path(), Device::Cpu, DType::F32), &ids);
    let gpu_lp = logprobs_all(&tiny(dir.path(), gpu, DType::F32), &ids);
    let d = max_abs_diff(&cpu_lp, &gpu_lp);
    assert!(d < 1e-3, "f32 logprobs: CUDA vs CPU differ by {d}");
    // bf16 on CUDA (plain bf16 everywhere): close to f32, as on the CPU path.
    let bf_lp = logprobs_all(&tiny(dir.path(), gpu, DType::BF16), &ids);
    let d = max_abs_diff(&cpu_lp, &bf_lp);
    assert!(d < 0.25, "bf16 CUDA logprobs differ from f32 by {d}");

    // The engine: 8 concurrent requests of different prompt lengths; greedy ones give the
    // CPU engine's tokens, every one runs to its max_tokens.
    let reqs: Vec<_> = (0..8).map(|i| request(i, 24, i % 3 != 2)).collect();
    let on_cpu = serve(tiny(dir.path(), Device::Cpu, DType::F32), &reqs);
    let on_gpu = serve(tiny(dir.path(), gpu, DType::F32), &reqs);
    for (i, ((ct, cl), (gt, gl))) in on_cpu.iter().zip(&on_gpu).enumerate() {
        assert_eq!(gt.len(), 24, "request {i}");
        if reqs[i].sampling.temperature == 0.0 {
            assert_eq!(ct, gt, "greedy request {i}: CUDA tokens differ from CPU");
            for (a, b) in cl.iter().zip(gl) {
                assert!((a - b).abs() < 1e-3, "request {i}: logprob {a} vs {b}");
            }
        }
    }
    let bf = serve(tiny(dir.path(), gpu, DType::BF16), &reqs);
    assert!(bf
        .iter()
        .all(|(t, l)| t.len() == 24 && l.iter().all(|x| x.is_finite())));
}

fn loss_and_grads(model: &Llama, rows: &[PackedRow]) -> (Vec<f64>, f64, Vec<Tensor>) {
    let total: usize = rows.iter().map(|r| r.targets.len()).sum();
    let mut loss = Tensor::zeros([], (Kind::Float, model.device()));
    let mut lps = Vec::new();
    for row in rows {
        let lp = target_logprobs(model, row).unwrap();
        let adv = Tensor::from_slice(&row.targets.iter().map(|t| t.advantage).collect::<Vec<_>>())
            .to_device(model.device());
        loss -= (&lp * adv).sum(Kind::Float) / total as f64;
        lps.extend(Vec::<f32>::try_from(&lp.detach().to_device(Device::Cpu)).unwrap());
    }
    let grads = Tensor::run_backward(&[&loss], &model.parameters(), false, false)
        .into_iter()
        .map(|g| g.to_device(Device::Cpu))
        .collect();
    (
        lps.into_iter().map(f64::from).collect(),
        loss.double_value(&[]),
        grads,
    )
}

#[test]
fn cuda_training_matches_cpu() {
    let Some(gpu) = cuda() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cpu = tiny(dir.path(), Device::Cpu, DType::F32);
    let mut gpu_m = tiny(dir.path(), gpu, DType::F32);
    cpu.set_trainable(true);
    gpu_m.set_trainable(true);
    let episodes = trace(&TraceShape {
        groups: 2,
        group_size: 3,
        turns: 4,
        prompt_tokens: 24,
        env_tokens: 6,
        gen_tokens: 5,
        break_p: 0.3,
        vocab: 290,
        seed: 3,
    });
    let batch: Vec<_> = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| (e, if i % 2 == 0 { 1.0f32 } else { -0.5 }))
        .collect();
    let (base_lp, base_loss, base_grads) =
        loss_and_grads(&cpu, &pack("policy", &batch, Layout::PerCall, 64).unwrap());
    for layout in [Layout::PerCall, Layout::Linear, Layout::Tree] {
        let rows = pack("policy", &batch, layout, 64).unwrap();
        let (lp, loss, grads) = loss_and_grads(&gpu_m, &rows);
        assert_eq!(lp.len(), base_lp.len());
        assert!(
            (loss - base_loss).abs() < 1e-4,
            "{layout:?} on CUDA: loss {loss} vs CPU per call {base_loss}"
        );
        for (g, b) in grads.iter().zip(&base_grads) {
            let d = max_abs_diff(g, b);
            let scale = b.abs().max().double_value(&[]).max(1.0);
            assert!(
                d <= 1e-4 * scale,
                "{layout:?} on CUDA: a gradient differs by {d}"
            );
        }
    }
    // Sampled-token logprobs of the per-call layout (same target order as the CPU run).
    let (lp, _, _) = loss_and_grads(
        &gpu_m,
        &pack("policy", &batch, Layout::PerCall, 64).unwrap(),
    );
    for (a, b) in lp.iter().zip(&base_lp) {
        assert!((a - b).abs() < 1e-4, "logprob {a} on CUDA vs {b} on CPU");
    }
    // One AdamW step from the same gradients moves both copies the same way. (A first
    // Adam step is lr * g / (|g| + eps): with a tiny eps a gradient that is ~0 on both
    // sides could flip sign between devices and move a full lr; eps 1e-3 keeps the step a
    // smooth function of the gradient.)
    let rows = pack("policy", &batch, Layout::Tree, 64).unwrap();
    let cfg = AdamWConfig {
        lr: 1e-2,
        eps: 1e-3,
        ..Default::default()
    };
    let mut results = Vec::new();
    for m in [&cpu, &gpu_m] {
        m.parameters().iter().for_each(|p| {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        });
        let total: usize = rows.iter().map(|r| r.targets.len()).sum();
        for row in &rows {
            let lp = target_logprobs(m, row).unwrap();
            let adv =
                Tensor::from_slice(&row.targets.iter().map(|t| t.advantage).collect::<Vec<_>>())
                    .to_device(m.device());
            (-(&lp * adv).sum(Kind::Float) / total as f64).backward();
        }
        let mut opt = AdamW::new(m.parameters(), cfg.clone());
        opt.step();
        results.push(
            m.parameters()
                .iter()
                .map(|p| p.detach().to_device(Device::Cpu))
                .collect::<Vec<_>>(),
        );
    }
    for (a, b) in results[0].iter().zip(&results[1]) {
        let d = max_abs_diff(a, b);
        assert!(d < 1e-4, "after one AdamW step a parameter differs by {d}");
    }
}

/// Packed tree-layout rows of a small synthetic trace, with advantages.
fn rows_for_training() -> Vec<PackedRow> {
    let episodes = trace(&TraceShape {
        groups: 1,
        group_size: 3,
        turns: 3,
        prompt_tokens: 20,
        env_tokens: 6,
        gen_tokens: 5,
        break_p: 0.0,
        vocab: 290,
        seed: 5,
    });
    let batch: Vec<_> = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| (e, if i % 2 == 0 { 1.0f32 } else { -0.5 }))
        .collect();
    pack("policy", &batch, Layout::Tree, 64).unwrap()
}

/// `model` with three bank adapters (rank 4 on every target, random B from fixed seeds),
/// made on the CPU and moved to the model's device.
fn with_bank(mut model: Llama) -> Llama {
    use agentjet::model::llama::lora::{Adapter, LoraConfig};
    for seed in 0..3u64 {
        let a = Adapter::new(&model.config, LoraConfig::new(4), seed, model.device()).unwrap();
        randomize_lora_b(a.tensors(), seed, 0.4);
        a.changed();
        model.add_served_adapter(a).unwrap();
    }
    model
}

/// LoRA on CUDA: the engine's mixed batch of three bank adapters and the base gives the
/// CPU engine's greedy tokens; an adapter's training gradient matches the CPU's.
#[test]
fn cuda_lora_matches_cpu() {
    use agentjet::model::llama::lora::LoraConfig;
    let Some(gpu) = cuda() else { return };
    let dir = tempfile::tempdir().unwrap();
    let reqs: Vec<_> = (0..8)
        .map(|i| GenerateRequest {
            adapter: [None, Some(0), Some(1), Some(2)][i % 4],
            ..request(i, 16, true)
        })
        .collect();
    let on_cpu = serve(with_bank(tiny(dir.path(), Device::Cpu, DType::F32)), &reqs);
    let on_gpu = serve(with_bank(tiny(dir.path(), gpu, DType::F32)), &reqs);
    for (i, ((ct, cl), (gt, gl))) in on_cpu.iter().zip(&on_gpu).enumerate() {
        assert_eq!(ct, gt, "request {i} (adapter {:?})", reqs[i].adapter);
        for (a, b) in cl.iter().zip(gl) {
            assert!((a - b).abs() < 1e-3, "request {i}: logprob {a} vs {b}");
        }
    }
    let bf = serve(with_bank(tiny(dir.path(), gpu, DType::BF16)), &reqs);
    assert!(bf
        .iter()
        .all(|(t, l)| t.len() == 16 && l.iter().all(|x| x.is_finite())));
    // Training an adapter over a frozen base: the same gradient on both devices.
    let rows = rows_for_training();
    let grads = |device: Device| {
        let mut m = tiny(dir.path(), device, DType::F32);
        m.attach_adapter(LoraConfig::new(4), 7).unwrap();
        m.parameters().into_iter().for_each(|mut p| {
            let _ = p.requires_grad_(true);
        });
        loss_and_grads(&m, &rows).2
    };
    let (c, g) = (grads(Device::Cpu), grads(gpu));
    assert_eq!(c.len(), g.len());
    for (i, (a, b)) in c.iter().zip(&g).enumerate() {
        let d = max_abs_diff(a, &b.to_device(Device::Cpu));
        assert!(d < 1e-3, "adapter gradient {i}: CUDA vs CPU differ by {d}");
    }
}
