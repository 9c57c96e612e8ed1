//! Golden tests of each model family against HF transformers 5.x, on tiny random models that
//! transformers itself builds and saves (`tests/fixtures/hf_family.py`): greedy ids from
//! our engine equal HF's on token-id prompts, with log-probabilities within 1e-4 in
//! float32; the logits of a sequence within 1e-4; and one training loss's gradient for
//! every parameter (under HF's names) within 1e-4 of torch autograd's (relative to the
//! gradient's largest entry where that is above 1).

use crate::common::*;

use agentjet::engine::{spawn_engine, EngineConfig, EngineEvent, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama, Logits};
use agentjet::model::ModelSource;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

const IDS: [i64; 12] = [1, 17, 33, 5, 90, 61, 2, 44, 101, 7, 18, 3];

/// The model transformers built for `family` (in `dir/model`, with a tokenizer of ours
/// beside it) and what HF computed on it.
pub(crate) fn reference(family: &str, dir: &std::path::Path) -> (Llama, Value) {
    let (model_dir, v) = hf_family_model(family, dir);
    let m = load_model(&ModelSource::HfDir(model_dir), Device::Cpu, DType::F32)
        .unwrap_or_else(|e| panic!("{family}: {e}"))
        .model;
    (m, v)
}

/// Logits of `IDS` through the KV-cache path, and through the training path.
fn check_logits(family: &str, m: &Llama, v: &Value) {
    let _g = tch::no_grad_guard();
    let vocab = v["vocab"].as_i64().unwrap();
    let want = Tensor::from_slice(&json_floats(&v["logits"])).view([IDS.len() as i64, vocab]);
    let mut cache = m.new_cache(1, IDS.len()).unwrap();
    let ids = Tensor::from_slice(&IDS).view([1, -1]);
    let got = m
        .forward(&ids, &mut cache, Logits::All)
        .unwrap()
        .squeeze_dim(0);
    let d = max_abs_diff(&got, &want);
    assert!(d < 1e-4, "{family}: cached-path logits {d} from HF's");
    let (positions, parent) = linear_row(IDS.len());
    let got = m
        .forward_row(&Tensor::from_slice(&IDS), &positions, &parent, None)
        .unwrap();
    let d = max_abs_diff(&got, &want);
    assert!(d < 1e-4, "{family}: training-path logits {d} from HF's");
}

/// One sequence as a training row: positions 0..n, each token's parent the one before.
fn linear_row(n: usize) -> (Tensor, Vec<i32>) {
    let positions = Tensor::arange(n as i64, (Kind::Int64, Device::Cpu));
    let parent = (0..n as i32).map(|i| i - 1).collect();
    (positions, parent)
}

/// Greedy ids and log-probabilities from our engine (all prompts in one batch).
fn check_greedy(family: &str, m: Llama, v: &Value) {
    let prompts: [&[u32]; 3] = [&[3, 9, 27, 81], &[100, 50, 25, 12, 6, 3], &[7]];
    let engine = spawn_engine(m, EngineConfig::default()).unwrap();
    assert_greedy_matches(&engine, &prompts, &v["gen"], family);
}

/// The summed negative log-likelihood of `IDS[1..]` through the training path, its
/// gradient for every parameter under HF's names, against autograd's in transformers.
fn check_gradient(family: &str, mut m: Llama, v: &Value, dir: &std::path::Path) {
    m.set_trainable(true);
    let (positions, parent) = linear_row(IDS.len());
    let logits = m
        .forward_row(&Tensor::from_slice(&IDS), &positions, &parent, None)
        .unwrap();
    let n = IDS.len() as i64;
    let targets = Tensor::from_slice(&IDS[1..]).view([-1, 1]);
    let loss = -logits
        .narrow(0, 0, n - 1)
        .log_softmax(-1, Kind::Float)
        .gather(1, &targets, false)
        .sum(Kind::Float);
    let want_loss = v["loss"].as_f64().unwrap();
    let got_loss = loss.double_value(&[]);
    assert!(
        (got_loss - want_loss).abs() < 1e-4 * want_loss.abs().max(1.0),
        "{family}: loss {got_loss} vs HF's {want_loss}"
    );
    loss.backward();
    // Each parameter's gradient in its place, then HF's names and layout as a checkpoint
    // would have them (fused q/k/v and gate/up split, rotary rows back in HF's order).
    tch::no_grad(|| {
        for mut p in m.parameters() {
            let g = p.grad();
            p.copy_(&g);
        }
    });
    let ours = m.hf_tensors().unwrap();
    let theirs = Tensor::read_safetensors(dir.join("grads.safetensors")).unwrap();
    // A multimodal wrapper's language model is ours under the decoder's names.
    assert_gradients_match(family, &ours, &theirs, |n| {
        n.replace("model.language_model.", "model.")
    });
}

fn golden(family: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (m, v) = reference(family, dir.path());
    check_logits(family, &m, &v);
    check_gradient(family, reference(family, dir.path()).0, &v, dir.path());
    check_greedy(family, m, &v);
    check_forked(family, reference(family, dir.path()).0, &v);
}

/// `n` greedy choices of one prompt share its prefill, forked into their own slots (a
/// linear-attention layer's state forked with the keys and values): each equals HF's.
fn check_forked(family: &str, m: Llama, v: &Value) {
    let engine = spawn_engine(m, EngineConfig::default()).unwrap();
    let rxs = engine
        .submit_n(
            GenerateRequest {
                prompt: vec![100, 50, 25, 12, 6, 3],
                max_tokens: 8,
                sampling: SamplingParams::greedy(),
                ..Default::default()
            },
            3,
        )
        .unwrap();
    let want: Vec<u64> = v["gen"][1]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let mut ids = Vec::new();
        while let Some(EngineEvent::Token { id, .. }) = rx.blocking_recv() {
            ids.push(id as u64);
        }
        assert_eq!(ids, want, "{family}, choice {i} of 3");
    }
}

/// Qwen2 as transformers 5 saves it: theta in `rope_parameters` (1e6), not `rope_theta`.
#[test]
fn qwen2_saved_by_transformers_5_matches_hf() {
    golden("qwen2");
}

/// Qwen3 dense: q/k RMSNorm per head, heads x head_dim wider than hidden, tied head.
#[test]
fn qwen3_matches_hf() {
    golden("qwen3");
}

/// Qwen3.5 (text): three Gated DeltaNet layers (chunked prefill, recurrent decode through
/// the engine's slots) and a gated full-attention layer with partial rotary and centred
/// norms.
#[test]
fn qwen3_5_matches_hf() {
    golden("qwen3_5");
}

/// The `qwen3_5` multimodal wrapper (as released): its language model loads (the vision
/// tower is ignored) and matches HF's wrapper on text.
#[test]
fn qwen3_5_wrapper_loads_its_language_model_and_matches_hf() {
    golden("qwen3_5_wrapped");
}

/// Qwen3-MoE: 8 experts, top-2 renormalised, one dense layer (`mlp_only_layers`); the
/// gradient reaches the router and every chosen expert.
#[test]
fn qwen3_moe_matches_hf() {
    golden("qwen3_moe");
}

/// The HF model of `dir/model` as llama.cpp's converter writes it (F32 tensors, its names,
/// NeoX rotary so no Q/K permutation, a sparse layer's experts stacked per projection).
fn gguf_of(arch: &str, dir: &std::path::Path, v: &Value) -> std::path::PathBuf {
    use std::collections::BTreeMap;
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model/config.json")).unwrap())
            .unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap() as u32;
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta = BTreeMap::new();
    meta.insert("general.architecture".into(), Meta::Str(arch.into()));
    meta.insert(k("context_length"), Meta::U32(n("max_position_embeddings")));
    meta.insert(k("embedding_length"), Meta::U32(n("hidden_size")));
    meta.insert(k("feed_forward_length"), Meta::U32(n("intermediate_size")));
    meta.insert(k("block_count"), Meta::U32(n("num_hidden_layers")));
    meta.insert(
        k("attention.head_count"),
        Meta::U32(n("num_attention_heads")),
    );
    meta.insert(
        k("attention.head_count_kv"),
        Meta::U32(n("num_key_value_heads")),
    );
    meta.insert(k("attention.key_length"), Meta::U32(n("head_dim")));
    let theta = cfg["rope_parameters"]["rope_theta"].as_f64().unwrap();
    meta.insert(k("rope.freq_base"), Meta::F32(theta as f32));
    let eps = cfg["rms_norm_eps"].as_f64().unwrap();
    meta.insert(k("attention.layer_norm_rms_epsilon"), Meta::F32(eps as f32));
    let vocab = v["vocab"].as_i64().unwrap();
    meta.insert(k("vocab_size"), Meta::U32(vocab as u32));
    if arch == "qwen3moe" {
        meta.insert(k("expert_count"), Meta::U32(n("num_local_experts")));
        meta.insert(k("expert_used_count"), Meta::U32(n("num_experts_per_tok")));
        meta.insert(
            k("expert_feed_forward_length"),
            Meta::U32(n("moe_intermediate_size")),
        );
    }
    tokenizer_meta(&mut meta, vocab);
    let weights = Tensor::read_safetensors(dir.join("model/model.safetensors")).unwrap();
    let mut tensors = Vec::new();
    let mut put = |name: String, t: &Tensor| {
        tensors.push(GgufTensor {
            name,
            dims: t.size().iter().rev().map(|&d| d as u64).collect(),
            ty: 0,
            data: f32_bytes(t),
        })
    };
    let mut stacks: BTreeMap<String, Vec<(i64, Tensor)>> = BTreeMap::new();
    for (name, t) in &weights {
        if let Some((layer, rest)) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once(".mlp.experts."))
        {
            let (e, proj) = rest.split_once('.').unwrap();
            let leaf = proj.trim_end_matches("_proj.weight");
            let stacked = format!("blk.{layer}.ffn_{leaf}_exps.weight");
            stacks
                .entry(stacked)
                .or_default()
                .push((e.parse().unwrap(), t.shallow_clone()));
        } else {
            let g = agentjet::model::weights::GgufSource::gguf_name(name)
                .unwrap_or_else(|| panic!("no GGUF name for {name}"));
            put(g, t);
        }
    }
    for (name, mut experts) in stacks {
        experts.sort_by_key(|(e, _)| *e);
        let ts: Vec<Tensor> = experts.into_iter().map(|(_, t)| t).collect();
        put(name, &Tensor::stack(&ts, 0));
    }
    let path = dir.join("model.gguf");
    write_file(&path, &gguf_bytes(&meta, &tensors));
    path
}

/// Qwen3 and Qwen3-MoE from GGUF files (llama.cpp's `qwen3` / `qwen3moe` names and
/// metadata): HF's logits within 1e-4.
#[test]
fn qwen3_and_qwen3_moe_gguf_match_hf() {
    for (family, arch) in [("qwen3", "qwen3"), ("qwen3_moe_all_sparse", "qwen3moe")] {
        let dir = tempfile::tempdir().unwrap();
        let (_, v) = reference(family, dir.path());
        let path = gguf_of(arch, dir.path(), &v);
        let m = load_model(&ModelSource::Gguf(path), Device::Cpu, DType::F32)
            .unwrap_or_else(|e| panic!("{family}: {e}"))
            .model;
        check_logits(&format!("{family} (GGUF)"), &m, &v);
    }
}

/// A Qwen3.5 model trains: its trainer takes the linear layout (the tree's shared prefixes
/// would need forked linear-attention states), says so in the step's metrics, and the
/// step moves the weights.
#[test]
fn qwen3_5_trains_in_the_linear_layout_and_says_so() {
    use agentjet::timeline::synth::{trace, TraceShape};
    use agentjet::train::groups::{advantages, AdvantageKind, Group, ReadyReport};
    use agentjet::train::trainer::{Trainer, TrainerConfig};
    let dir = tempfile::tempdir().unwrap();
    let (m, v) = reference("qwen3_5", dir.path());
    let vocab = v["vocab"].as_u64().unwrap() as u32;
    let episodes = trace(&TraceShape {
        groups: 1,
        group_size: 4,
        turns: 2,
        prompt_tokens: 12,
        env_tokens: 4,
        gen_tokens: 4,
        break_p: 0.0,
        vocab,
        seed: 4,
    });
    let groups = vec![Group {
        group_id: "g0".into(),
        episodes,
        advantages: advantages(AdvantageKind::Grpo, &[1.0, 0.0, 0.5, 0.0]).unwrap(),
    }];
    let before: Vec<Tensor> = m.parameters().iter().map(|t| t.copy()).collect();
    let mut t = Trainer::new(m, None, TrainerConfig::default()).unwrap();
    let metrics = t.step(&groups, &ReadyReport::default()).unwrap();
    assert!(metrics.trained && metrics.tokens_trained > 0, "{metrics:?}");
    assert!(
        metrics.loss.is_finite() && metrics.grad_norm > 0.0,
        "{metrics:?}"
    );
    let why = metrics.layout_fallback.clone().unwrap_or_default();
    assert!(why.contains("linear layout"), "{metrics:?}");
    let moved = t
        .model
        .parameters()
        .iter()
        .zip(&before)
        .filter(|(a, b)| max_abs_diff(a, b) > 0.0)
        .count();
    assert!(moved > 0, "no parameter moved");
}
