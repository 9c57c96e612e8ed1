//! LoRA on the 2026 families against HF PEFT, on the tiny models transformers built
//! (`tests/fixtures/hf_family.py`): Qwen3, Qwen3-MoE (attention targets: its experts are
//! not adapted) and Qwen3.5 (q/k/v/o on the gated full-attention layers, whose q_proj
//! holds query and gate rows; the MLP on every layer; the Gated DeltaNet projections have
//! none of PEFT's names), and the `qwen3_5` wrapper (PEFT's adapter made over
//! `Qwen3_5ForConditionalGeneration`, whose layers are `model.language_model.layers`).
//! PEFT computes our adapter's logits, one loss's gradient for every adapter tensor equals
//! autograd's through PEFT within 1e-4, we compute a PEFT-made adapter's logits, and our
//! engine gives PEFT's greedy ids, with the adapter unmerged and merged.

use crate::common::*;
use crate::families::reference;

use agentjet::engine::{spawn_engine, EngineConfig};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::lora::{LoraConfig, Target};
use agentjet::model::llama::{DType, Llama};
use agentjet::model::peft::{load_adapter, write_adapter};
use agentjet::model::ModelSource;
use tch::{Device, Tensor};

const IDS: [i64; 12] = [1, 17, 33, 5, 90, 61, 2, 44, 101, 7, 18, 3];
const PROMPTS: [&[u32]; 3] = [&[3, 9, 27, 81], &[100, 50, 25, 12, 6, 3], &[7]];

fn logits(m: &Llama) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, IDS.len()).unwrap();
    let ids = Tensor::from_slice(&IDS).view([1, -1]);
    m.forward(&ids, &mut cache, agentjet::model::llama::Logits::All)
        .unwrap()
        .squeeze_dim(0)
}

const SCRIPT: &str = r#"
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from peft import PeftModel, LoraConfig, get_peft_model
from safetensors.torch import save_file
base_dir, ours_dir, theirs_dir, targets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ids = torch.tensor([json.loads(sys.argv[5])])
prompts = json.loads(sys.argv[6])
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
m = PeftModel.from_pretrained(base, ours_dir, is_trainable=True).eval()
ours = m(ids).logits[0]
# The summed NLL of ids[1:]: its gradient for each of our adapter's tensors, PEFT-named.
lp = torch.log_softmax(ours[:-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1)
loss = -lp.sum()
loss.backward()
save_file({n.replace(".default", ""): p.grad.contiguous() for n, p in m.named_parameters()
           if "lora_" in n}, f"{theirs_dir}.grads.safetensors")
ours = ours.detach()
# PEFT's own adapter over the class a user would load: for a multimodal wrapper, the
# wrapper itself (its layers named `model.language_model.layers`).
wrapped = sys.argv[7] == "wrapped"
cls = AutoModelForImageTextToText if wrapped else AutoModelForCausalLM
base = cls.from_pretrained(base_dir, dtype=torch.float32).eval()
torch.manual_seed(0)
cfg = LoraConfig(r=2, lora_alpha=6, target_modules=targets.split(","), use_rslora=True,
                 init_lora_weights=False, lora_dropout=0.0)
p = get_peft_model(base, cfg).eval()
with torch.no_grad():
    theirs = p(ids).logits[0]
p.save_pretrained(theirs_dir)
gen = []
for prompt in prompts:
    with torch.no_grad():
        out = p.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=None)
    new = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(out.scores, new)]
    gen.append({"ids": new, "lps": lps})
print(json.dumps({"ours": ours.flatten().tolist(), "theirs": theirs.flatten().tolist(),
                  "gen": gen, "loss": loss.item()}))
"#;

/// The summed NLL of `IDS[1..]` through the training path: its gradient for every tensor
/// of `m`'s adapter, under PEFT's names and in HF's row order, within 1e-4 (of the
/// gradient's largest entry, at least 1) of autograd's through PEFT (`file`).
fn check_adapter_gradient(
    family: &str,
    m: &mut Llama,
    v: &serde_json::Value,
    file: &std::path::Path,
) {
    m.set_trainable(true);
    let n = IDS.len();
    let positions = Tensor::arange(n as i64, (tch::Kind::Int64, Device::Cpu));
    let parent: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
    let logits = m
        .forward_row(&Tensor::from_slice(&IDS), &positions, &parent, None)
        .unwrap();
    let targets = Tensor::from_slice(&IDS[1..]).view([-1, 1]);
    let loss = -logits
        .narrow(0, 0, n as i64 - 1)
        .log_softmax(-1, tch::Kind::Float)
        .gather(1, &targets, false)
        .sum(tch::Kind::Float);
    let (got, want) = (loss.double_value(&[]), v["loss"].as_f64().unwrap());
    assert!(
        (got - want).abs() < 1e-4 * want.abs().max(1.0),
        "{family}: loss {got} vs {want}"
    );
    loss.backward();
    // Each gradient in its tensor's place, then the adapter's PEFT names and row order.
    let saved: Vec<Tensor> = m.parameters().iter().map(|p| p.detach().copy()).collect();
    tch::no_grad(|| {
        for mut p in m.parameters() {
            let g = p.grad();
            p.copy_(&g);
        }
    });
    // Copies: on the CPU the PEFT-named tensors may share the parameters' storage.
    let ours: Vec<(String, Tensor)> = m
        .adapter()
        .unwrap()
        .peft_tensors(&m.config)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    tch::no_grad(|| {
        for (mut p, s) in m.parameters().into_iter().zip(&saved) {
            p.copy_(s);
            p.zero_grad();
        }
    });
    m.set_trainable(false);
    let theirs = Tensor::read_safetensors(file).unwrap();
    assert_gradients_match(family, &ours, &theirs, str::to_string);
}

#[test]
fn lora_on_qwen3_qwen3_moe_and_qwen3_5_matches_peft_both_ways() {
    for (family, targets) in [
        ("qwen3", Target::ALL.to_vec()),
        (
            "qwen3_moe",
            vec![Target::Q, Target::K, Target::V, Target::O],
        ),
        ("qwen3_5", Target::ALL.to_vec()),
        ("qwen3_5_wrapped", Target::ALL.to_vec()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (mut m, v) = reference(family, dir.path());
        let vocab = v["vocab"].as_i64().unwrap();
        let names: Vec<&str> = targets.iter().map(|t| t.name()).collect();
        m.attach_adapter(
            LoraConfig {
                rank: 4,
                alpha: 8.0,
                targets: targets.clone(),
                rslora: false,
            },
            0,
        )
        .unwrap();
        randomize_lora_b(m.parameters(), 8, 0.2);
        let ours = dir.path().join("ours");
        write_adapter(&ours, &m, family).unwrap();
        let theirs = dir.path().join("theirs");
        let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
        let out = std::process::Command::new(python())
            .arg("-c")
            .arg(SCRIPT)
            .arg(dir.path().join("model"))
            .arg(&ours)
            .arg(&theirs)
            .arg(names.join(","))
            .arg(serde_json::to_string(&IDS).unwrap())
            .arg(serde_json::to_string(&prompts).unwrap())
            .arg(if family.ends_with("wrapped") {
                "wrapped"
            } else {
                "text"
            })
            .env("TRANSFORMERS_VERBOSITY", "error")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{family}: peft failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let t = |k: &str| Tensor::from_slice(&json_floats(&v[k])).view([IDS.len() as i64, vocab]);
        // The adapter changes the model (so the comparison is not of the base alone).
        let base = load_model(
            &ModelSource::HfDir(dir.path().join("model")),
            Device::Cpu,
            DType::F32,
        )
        .unwrap()
        .model;
        let moved = max_abs_diff(&logits(&base), &logits(&m));
        assert!(
            moved > 1e-2,
            "{family}: the adapter moves the logits by {moved}"
        );
        let d = max_abs_diff(&logits(&m), &t("ours"));
        assert!(
            d < 1e-4,
            "{family}: PEFT computes our adapter's logits {d} apart"
        );
        check_adapter_gradient(
            family,
            &mut m,
            &v,
            &dir.path().join("theirs.grads.safetensors"),
        );
        let mut p = base;
        load_adapter(&theirs, &mut p).unwrap();
        assert_eq!(p.adapter().unwrap().cfg.targets, targets, "{family}");
        let d = max_abs_diff(&logits(&p), &t("theirs"));
        assert!(
            d < 1e-4,
            "{family}: we compute PEFT's adapter's logits {d} apart"
        );
        let engine = spawn_engine(p, EngineConfig::default()).unwrap();
        assert_greedy_matches(&engine, &PROMPTS, &v["gen"], family);
        // Served merged into the weights (`--lora-serve`'s float32 default): the same.
        let mut merged = load_model(
            &ModelSource::HfDir(dir.path().join("model")),
            Device::Cpu,
            DType::F32,
        )
        .unwrap()
        .model;
        load_adapter(&theirs, &mut merged).unwrap();
        merged.serve_merged_adapter().unwrap();
        let engine = spawn_engine(merged, EngineConfig::default()).unwrap();
        assert_greedy_matches(&engine, &PROMPTS, &v["gen"], &format!("{family} merged"));
    }
}
