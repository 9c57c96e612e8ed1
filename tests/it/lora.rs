//! LoRA adapters on tiny random models: a new adapter changes nothing, a trained one is
//! applied on every forward path and merges into the weights; training moves only the
//! adapter (over a float32 or a bfloat16 base), its KL reference is the base, checkpoints
//! hold it in PEFT's format and resume exactly; and HF PEFT loads our adapters and we load
//! PEFT's, with the same logits.

use crate::common;

use agentjet::model::checkpoint::{load_model, save_checkpoint};
use agentjet::model::llama::lora::{LoraConfig, Target};
use agentjet::model::llama::{DType, Llama, Logits};
use agentjet::model::peft::{load_adapter, write_adapter};
use agentjet::model::ModelSource;
use agentjet::timeline::synth::{trace, TraceShape};
use agentjet::train::checkpoint::RunDir;
use agentjet::train::groups::{advantages, AdvantageKind, Group, ReadyReport};
use agentjet::train::loss::LossConfig;
use agentjet::train::optim::AdamWConfig;
use agentjet::train::trainer::{Trainer, TrainerConfig};
use common::*;
use tch::{Device, Kind, Tensor};

const IDS: [i64; 10] = [5, 17, 200, 3, 99, 42, 42, 7, 250, 1];

fn tiny() -> Tiny {
    Tiny {
        tied: false,
        max_pos: 128,
        seed: 21,
        ..Tiny::default()
    }
}

fn load(dir: &std::path::Path, dtype: DType) -> Llama {
    tiny().load(dir, Device::Cpu, dtype)
}

fn logits(m: &Llama) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, IDS.len()).unwrap();
    m.forward(
        &Tensor::from_slice(&IDS).view([1, -1]),
        &mut cache,
        Logits::All,
    )
    .unwrap()
    .squeeze_dim(0)
}

/// One token at a time through the KV cache (the decode path).
fn stepwise(m: &Llama) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, IDS.len()).unwrap();
    let rows: Vec<Tensor> = IDS
        .iter()
        .map(|&t| {
            m.forward(
                &Tensor::from_slice(&[t]).view([1, 1]),
                &mut cache,
                Logits::Last,
            )
            .unwrap()
            .squeeze_dim(0)
        })
        .collect();
    Tensor::stack(&rows, 0)
}

/// Gives every B of `m`'s adapter random values (a new adapter's B is zero).
fn randomize_b(m: &Llama, seed: u64) {
    randomize_lora_b(m.parameters(), seed, 0.2);
}

#[test]
fn an_adapter_starts_neutral_applies_on_every_path_and_merges() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("base");
    let mut m = load(&src, DType::F32);
    let base = logits(&m);
    let base_params = m.parameters().len();
    m.attach_adapter(LoraConfig::new(4), 3).unwrap();
    assert_eq!(
        max_abs_diff(&logits(&m), &base),
        0.0,
        "a new adapter changed the logits"
    );
    // 2 layers x 7 targets x (A, B).
    assert_eq!(m.parameters().len(), 28);
    assert_eq!(m.base_parameters().len(), base_params);
    randomize_b(&m, 5);
    let with = logits(&m);
    assert!(
        max_abs_diff(&with, &base) > 1e-3,
        "the adapter changed nothing"
    );
    // The decode path (KV cache, one token at a time) applies it too.
    assert!(max_abs_diff(&stepwise(&m), &with) < 1e-4);
    // Switched off: the base exactly.
    assert_eq!(max_abs_diff(&m.without_adapter(|| logits(&m)), &base), 0.0);

    // Merged into an HF checkpoint: the same logits from plain weights.
    let merged = dir.path().join("merged");
    save_checkpoint(&merged, &tiny_card(&src), &m, DType::F32).unwrap();
    let mm = load_model(&ModelSource::HfDir(merged), Device::Cpu, DType::F32)
        .unwrap()
        .model;
    assert!(mm.adapter().is_none());
    let d = max_abs_diff(&logits(&mm), &with);
    assert!(d < 1e-4, "merged model differs by {d}");

    // PEFT's format, written and read back: bit-identical.
    let ad = dir.path().join("adapter");
    write_adapter(&ad, &m, "tiny").unwrap();
    let mut fresh = load(&src, DType::F32);
    load_adapter(&ad, &mut fresh).unwrap();
    assert_eq!(max_abs_diff(&logits(&fresh), &with), 0.0);

    // The engine's serving path (stacked A, block-diagonal B: two products per fused
    // layer) computes the same, and follows in-place updates once told.
    m.serve_stacked_adapter();
    assert!(max_abs_diff(&logits(&m), &with) < 1e-5);
    assert!(max_abs_diff(&stepwise(&m), &with) < 1e-4);
    randomize_b(&m, 6);
    m.parameters_changed().unwrap();
    let ad2 = dir.path().join("adapter2");
    write_adapter(&ad2, &m, "tiny").unwrap();
    let mut fresh2 = load(&src, DType::F32);
    load_adapter(&ad2, &mut fresh2).unwrap();
    let want = logits(&fresh2);
    assert!(max_abs_diff(&want, &with) > 1e-3);
    assert!(max_abs_diff(&logits(&m), &want) < 1e-5);

    // A twin over the same base (the trainer's beside the engine's): no tensor copied,
    // and its own adapter. A model whose base is trained has no twin.
    let mut twin = m.frozen_twin().unwrap();
    for (a, b) in twin.base_parameters().iter().zip(m.base_parameters()) {
        assert_eq!(a.data_ptr(), b.data_ptr(), "the twin copied the base");
    }
    assert_eq!(max_abs_diff(&logits(&twin), &base), 0.0);
    twin.attach_adapter(LoraConfig::new(4), 3).unwrap();
    assert_eq!(max_abs_diff(&logits(&twin), &base), 0.0);
    let mut trained = load(&src, DType::F32);
    trained.set_trainable(true);
    let e = trained.frozen_twin().unwrap_err();
    assert!(e.to_string().contains("frozen base"), "{e}");

    // Only some targets, rsLoRA: still neutral at start, and a wrong shape is refused.
    let mut q_only = load(&src, DType::F32);
    q_only
        .attach_adapter(
            LoraConfig {
                rank: 2,
                alpha: 4.0,
                targets: vec![Target::Q, Target::Down],
                rslora: true,
            },
            1,
        )
        .unwrap();
    assert_eq!(max_abs_diff(&logits(&q_only), &base), 0.0);
    assert_eq!(q_only.parameters().len(), 8);
    let e = agentjet::model::peft::read_weights(&ad, &q_only).unwrap_err();
    assert!(e.to_string().contains("shape"), "{e}");
}

fn tiny_card(dir: &std::path::Path) -> agentjet::model::ModelCard {
    load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        Device::Cpu,
        DType::F32,
    )
    .unwrap()
    .card
}

fn toy_groups() -> Vec<Group> {
    let episodes = trace(&TraceShape {
        groups: 2,
        group_size: 4,
        turns: 2,
        prompt_tokens: 12,
        env_tokens: 4,
        gen_tokens: 4,
        break_p: 0.0,
        vocab: 290,
        seed: 4,
    });
    episodes
        .chunks(4)
        .enumerate()
        .map(|(g, eps)| Group {
            group_id: format!("g{g}"),
            episodes: eps.to_vec(),
            advantages: advantages(AdvantageKind::Grpo, &[1.0, 0.0, 0.5, 0.0]).unwrap(),
        })
        .collect()
}

fn lora_trainer(model: Llama, kl: f64, ppo_epochs: usize, mini_batches: usize) -> Trainer {
    Trainer::new(
        model,
        None,
        TrainerConfig {
            optim: AdamWConfig {
                lr: 1e-2,
                weight_decay: 0.0,
                ..Default::default()
            },
            ppo_epochs,
            mini_batches,
            loss: LossConfig {
                kl_coef: kl,
                ..LossConfig::default()
            },
            max_staleness: None,
            ..TrainerConfig::default()
        },
    )
    .unwrap()
}

fn copies(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.detach().copy()).collect()
}

#[test]
fn training_moves_only_the_adapter_against_the_base_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny().write_hf_dir(&dir.path().join("base"));
    let groups = toy_groups();
    let card = tiny_card(&src);
    let new_trainer = |seed: u64| {
        let mut m = load(&src, DType::F32);
        m.attach_adapter(LoraConfig::new(4), seed).unwrap();
        // PPO epochs and mini-batches: four updates a step.
        lora_trainer(m, 0.05, 2, 2)
    };
    // One update from a new adapter (B = 0) is scored against the base exactly: KL 0.
    let mut first = load(&src, DType::F32);
    first.attach_adapter(LoraConfig::new(4), 0).unwrap();
    let mut first = lora_trainer(first, 0.05, 1, 1);
    let m0 = first.step(&groups, &ReadyReport::default()).unwrap();
    assert_eq!(m0.kl, Some(0.0));
    let m0b = first.step(&groups, &ReadyReport::default()).unwrap();
    assert!(m0b.kl.unwrap() > 0.0, "the KL to the base did not move");
    let mut t = new_trainer(0);
    let base = copies(&t.model.base_parameters());
    let mem = t.memory();
    assert!(!mem.base_trained);
    assert_eq!(mem.trained_values, t.model.adapter().unwrap().numel());
    eprintln!("trainer memory: {mem}");
    let m1 = t.step(&groups, &ReadyReport::default()).unwrap();
    assert!(m1.trained && m1.tokens_trained > 0 && m1.updates == 4);
    // AdamW's moments are the adapter's size, not the model's.
    let mem = t.memory();
    let (m, v) = t.opt.moments();
    let held: usize = m.iter().chain(&v).map(|x| x.numel() * 4).sum();
    assert_eq!(held, mem.moment_bytes);
    assert_eq!(held, 2 * mem.trained_bytes);
    assert!(mem.trained_bytes * 10 < mem.base_bytes);
    let run = RunDir::open(&dir.path().join("run")).unwrap();
    run.save(&t, &card, serde_json::json!({})).unwrap();
    let ck = run.checkpoint_path();
    assert!(ck.join("adapter/adapter_config.json").is_file());
    assert!(ck.join("adapter/adapter_model.safetensors").is_file());
    assert!(
        !ck.join("model").exists(),
        "the frozen base was checkpointed"
    );
    let m2 = t.step(&groups, &ReadyReport::default()).unwrap();
    for (a, b) in t.model.base_parameters().iter().zip(&base) {
        assert_eq!(max_abs_diff(a, b), 0.0, "the frozen base moved");
    }
    assert!(t.model.parameters().iter().all(|p| p.kind() == Kind::Float));

    // Resumed in a new trainer (another initial adapter): step 2 again, bit for bit.
    let mut r = new_trainer(99);
    let state = run.resume(&mut r).unwrap().unwrap();
    assert_eq!((state.step, r.steps()), (1, 1));
    let r2 = r.step(&groups, &ReadyReport::default()).unwrap();
    assert_eq!(
        (r2.loss, r2.grad_norm, r2.kl),
        (m2.loss, m2.grad_norm, m2.kl)
    );
    for (a, b) in r.model.parameters().iter().zip(t.model.parameters()) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "resumed adapter differs");
    }

    // A checkpoint of the other kind is refused with what to do.
    let mut full = Trainer::new(load(&src, DType::F32), None, TrainerConfig::default()).unwrap();
    let e = run.resume(&mut full).unwrap_err().to_string();
    assert!(
        e.contains("LoRA adapter") && e.contains("--lora-rank"),
        "{e}"
    );
    let mut other = load(&src, DType::F32);
    other.attach_adapter(LoraConfig::new(2), 0).unwrap();
    let mut other = lora_trainer(other, 0.0, 1, 1);
    let e = run.resume(&mut other).unwrap_err().to_string();
    assert!(e.contains("rank: 4") && e.contains("rank: 2"), "{e}");
}

#[test]
fn an_adapter_trains_over_a_bfloat16_base_close_to_the_float32_base() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("base");
    let groups = toy_groups();
    let mut out = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let mut m = load(&src, dtype);
        m.attach_adapter(LoraConfig::new(4), 0).unwrap();
        let mut t = lora_trainer(m, 0.0, 1, 1);
        let base = copies(&t.model.base_parameters());
        let mem = t.memory();
        let m1 = t.step(&groups, &ReadyReport::default()).unwrap();
        assert!(m1.trained && m1.grad_norm > 0.0 && m1.loss.is_finite());
        for (a, b) in t.model.base_parameters().iter().zip(&base) {
            assert_eq!(max_abs_diff(a, b), 0.0, "the frozen base moved");
        }
        eprintln!("{dtype:?} base: {mem}; grad norm {}", m1.grad_norm);
        out.push((m1, mem));
    }
    let ((a, ma), (b, mb)) = (&out[0], &out[1]);
    // About half the base's bytes (the norms stay float32), the same adapter; the
    // gradient within bfloat16 rounding.
    assert!(mb.base_bytes * 100 < ma.base_bytes * 55, "{mb} vs {ma}");
    assert_eq!(ma.trained_bytes, mb.trained_bytes);
    assert_ne!(a.grad_norm, b.grad_norm);
    assert!(
        (a.grad_norm - b.grad_norm).abs() < 0.05 * a.grad_norm,
        "grad norm {} vs {}",
        a.grad_norm,
        b.grad_norm
    );
}

/// The peer check: HF PEFT loads the adapter we write onto the base in transformers and
/// computes our logits; and an adapter PEFT made and saved loads here with PEFT's logits.
#[test]
fn peft_loads_our_adapter_and_we_load_peft_adapters_with_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("base");
    let mut m = load(&src, DType::F32);
    m.attach_adapter(
        LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: Target::ALL.to_vec(),
            rslora: false,
        },
        0,
    )
    .unwrap();
    randomize_b(&m, 8);
    let ours = dir.path().join("ours");
    write_adapter(&ours, &m, "tiny").unwrap();
    // The base as transformers reads it (with its model_type).
    let hf = dir.path().join("hf");
    save_checkpoint(&hf, &tiny_card(&src), &load(&src, DType::F32), DType::F32).unwrap();
    let theirs_dir = dir.path().join("theirs");
    let script = format!(
        r#"
import json, sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel, LoraConfig, get_peft_model
ids = torch.tensor([{ids:?}])
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
m = PeftModel.from_pretrained(base, sys.argv[2]).eval()
with torch.no_grad():
    ours = m(ids).logits[0]
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
torch.manual_seed(0)
cfg = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "up_proj"],
                 use_rslora=True, init_lora_weights=False, lora_dropout=0.0)
p = get_peft_model(base, cfg).eval()
with torch.no_grad():
    theirs = p(ids).logits[0]
p.save_pretrained(sys.argv[3])
# Greedy ids and their log-probabilities from PEFT's model, for prompts of token ids.
gen = []
for prompt in {prompts:?}:
    with torch.no_grad():
        out = p.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=None)
    new = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(out.scores, new)]
    gen.append({{"ids": new, "lps": lps}})
print(json.dumps({{"ours": ours.flatten().tolist(), "theirs": theirs.flatten().tolist(),
                  "gen": gen}}))
"#,
        ids = IDS.to_vec(),
        prompts = PROMPTS
            .iter()
            .map(|p| p.iter().map(|&t| t as i64).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    let output = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(&hf)
        .arg(&ours)
        .arg(&theirs_dir)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "peft failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let t =
        |k: &str| Tensor::from_slice(&json_floats(&v[k])).view([IDS.len() as i64, tiny().vocab]);
    let d = max_abs_diff(&logits(&m), &t("ours"));
    assert!(d < 1e-4, "PEFT computes our adapter's logits {d} apart");
    let mut p = load(&src, DType::F32);
    load_adapter(&theirs_dir, &mut p).unwrap();
    let a = p.adapter().unwrap();
    assert_eq!(a.cfg.targets, vec![Target::Q, Target::K, Target::Up]);
    assert!(a.cfg.rslora);
    let d = max_abs_diff(&logits(&p), &t("theirs"));
    assert!(d < 1e-4, "we compute PEFT's adapter's logits {d} apart");

    // Served by our engine (the stacked serving path, several requests in one batch):
    // PEFT's greedy ids, and log-probabilities within 1e-4.
    let engine =
        agentjet::engine::spawn_engine(p, agentjet::engine::EngineConfig::default()).unwrap();
    assert_greedy_matches(&engine, &PROMPTS, &v["gen"], "PEFT");
}

/// Token-id prompts for the greedy comparison.
const PROMPTS: [&[u32]; 3] = [&[5, 17, 200, 3], &[99, 42, 42, 7, 250, 1, 64], &[128, 9]];

/// An adapter trains the same in the linear layout as in the tree layout (the default):
/// the same loss, gradient norm and adapter after a step, within float error.
#[test]
fn an_adapter_trains_alike_in_the_linear_and_tree_layouts() {
    use agentjet::timeline::layout::Layout;
    let dir = tempfile::tempdir().unwrap();
    let src = tiny().write_hf_dir(&dir.path().join("base"));
    let groups = toy_groups();
    let step = |layout: Layout| {
        let mut m = load(&src, DType::F32);
        m.attach_adapter(LoraConfig::new(4), 1).unwrap();
        randomize_b(&m, 8);
        let mut t = Trainer::new(
            m,
            None,
            TrainerConfig {
                layout,
                // Small: Adam's first step is about lr x the gradient's sign, which float
                // error may flip where a gradient is near zero.
                optim: AdamWConfig {
                    lr: 1e-6,
                    weight_decay: 0.0,
                    ..Default::default()
                },
                max_staleness: None,
                ..TrainerConfig::default()
            },
        )
        .unwrap();
        let m = t.step(&groups, &ReadyReport::default()).unwrap();
        assert!(m.trained && m.tokens_trained > 0, "{layout:?}");
        (m, copies(&t.model.parameters()))
    };
    let (tree, tree_after) = step(Layout::Tree);
    let (linear, linear_after) = step(Layout::Linear);
    assert!(
        (tree.loss - linear.loss).abs() < 1e-5,
        "{} vs {}",
        tree.loss,
        linear.loss
    );
    assert!(
        (tree.grad_norm - linear.grad_norm).abs() < 1e-4 * tree.grad_norm.max(1.0),
        "{} vs {}",
        tree.grad_norm,
        linear.grad_norm
    );
    for (a, b) in tree_after.iter().zip(&linear_after) {
        assert!(
            max_abs_diff(a, b) < 1e-5,
            "the adapters differ after a step"
        );
    }
}

/// Merged serving (`--lora-serve merged`): the engine's model holds `W + s·B·A` in its own
/// copy of the targeted weights. It serves what the unmerged adapter serves (greedy ids
/// equal, logprobs within 1e-4), merges again after a weight update, and leaves the base
/// a trainer's twin shares untouched. It refuses a trained adapter and bank adapters.
#[test]
fn merged_serving_matches_unmerged_follows_updates_and_leaves_the_shared_base_alone() {
    use agentjet::engine::{spawn_engine, EngineConfig};
    let dir = tempfile::tempdir().unwrap();
    let src = tiny().write_hf_dir(&dir.path().join("base"));
    let adapted = |seed: u64| {
        let mut m = load(&src, DType::F32);
        m.attach_adapter(LoraConfig::new(4), 3).unwrap();
        randomize_b(&m, seed);
        m
    };
    let base = logits(&load(&src, DType::F32));
    let mut m = adapted(7);
    let with = logits(&m);
    // The trainer's twin, made before the merge as the server does: its own new adapter
    // (B zero) over the shared base.
    let mut twin = m.frozen_twin().unwrap();
    twin.attach_adapter(LoraConfig::new(4), 3).unwrap();
    m.serve_merged_adapter().unwrap();
    assert!(m.adapter().unwrap().is_merged());
    assert!(max_abs_diff(&logits(&m), &with) < 1e-5);
    assert!(max_abs_diff(&stepwise(&m), &with) < 1e-4);
    assert_eq!(
        max_abs_diff(&logits(&twin), &base),
        0.0,
        "the shared base moved"
    );
    // A merged model: no twin of its merged weights; its export merges once; making it
    // trainable takes the adapter back out of the weights (autograd sees its terms).
    assert!(m.frozen_twin().is_err());
    let exported = m.hf_tensors().unwrap();
    for ((n, a), (_, b)) in exported.iter().zip(adapted(7).hf_tensors().unwrap()) {
        assert!(
            max_abs_diff(a, &b) < 1e-5,
            "{n} exported differently merged"
        );
    }
    let mut trained = adapted(7);
    trained.serve_merged_adapter().unwrap();
    trained.set_trainable(true);
    assert!(!trained.adapter().unwrap().is_merged());
    assert!(max_abs_diff(&logits(&trained), &with) < 1e-5);

    let prompts: [&[u32]; 3] = [&[5, 17, 200, 3], &[99, 42, 42, 7, 250, 1, 64], &[128, 9]];
    let unmerged = spawn_engine(adapted(7), EngineConfig::default()).unwrap();
    let merged = spawn_engine(m, EngineConfig::default()).unwrap();
    let want = greedy_of(&unmerged, &prompts);
    assert_greedy_matches(&merged, &prompts, &want, "unmerged");
    // A trained step's values reach both engines: the merged one merges again.
    let stepped = adapted(11);
    let values = stepped.parameters();
    unmerged.update_weights(&values, 1).unwrap();
    merged.update_weights(&values, 1).unwrap();
    let after = greedy_of(&unmerged, &prompts);
    assert_ne!(after, want, "the update changed nothing");
    assert_greedy_matches(&merged, &prompts, &after, "unmerged after an update");
    assert_eq!(
        max_abs_diff(&logits(&twin), &base),
        0.0,
        "the shared base moved"
    );

    // Refused: a trained adapter (its optimizer writes it in place), bank adapters.
    let mut trained = adapted(7);
    trained.set_trainable(true);
    let e = trained.serve_merged_adapter().unwrap_err().to_string();
    assert!(e.contains("trained adapter"), "{e}");
    let mut banked = adapted(7);
    let extra = agentjet::model::llama::lora::Adapter::new(
        &banked.config,
        LoraConfig::new(4),
        1,
        Device::Cpu,
    )
    .unwrap();
    banked.add_served_adapter(extra).unwrap();
    let e = banked.serve_merged_adapter().unwrap_err().to_string();
    assert!(e.contains("alone"), "{e}");
}
