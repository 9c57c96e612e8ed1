//! The decoder on tiny random models the tests write themselves: loading, KV-cache
//! consistency, every architecture variant, checkpoints, and GGUF vs safetensors.

use crate::common;

use agentjet::model::checkpoint::{load_model, save_checkpoint};
use agentjet::model::llama::{DType, Llama, Logits};
use agentjet::model::{ModelError, ModelSource};
use common::*;
use serde_json::json;
use tch::{Device, Kind, Tensor};

const IDS: [i64; 12] = [5, 17, 200, 3, 99, 42, 42, 7, 250, 1, 64, 128];

fn ids(v: &[i64]) -> Tensor {
    Tensor::from_slice(v).view([1, -1])
}

fn load(dir: &std::path::Path, dtype: DType) -> agentjet::model::checkpoint::LoadedModel {
    load_model(&ModelSource::HfDir(dir.to_path_buf()), Device::Cpu, dtype).unwrap()
}

fn full_logits(m: &Llama, v: &[i64]) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, v.len()).unwrap();
    m.forward(&ids(v), &mut cache, Logits::All)
        .unwrap()
        .squeeze_dim(0)
}

/// Logits of each position computed one token at a time through the cache.
fn stepwise_logits(m: &Llama, v: &[i64]) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, v.len()).unwrap();
    let rows: Vec<Tensor> = v
        .iter()
        .map(|&t| {
            m.forward(&ids(&[t]), &mut cache, Logits::Last)
                .unwrap()
                .squeeze_dim(0)
        })
        .collect();
    Tensor::stack(&rows, 0)
}

/// Logits with a prefill of 5 tokens, then a chunk of 4 (the masked path), then singles.
fn chunked_logits(m: &Llama, v: &[i64]) -> Tensor {
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, v.len()).unwrap();
    let a = m
        .forward(&ids(&v[..5]), &mut cache, Logits::All)
        .unwrap()
        .squeeze_dim(0);
    let b = m
        .forward(&ids(&v[5..9]), &mut cache, Logits::All)
        .unwrap()
        .squeeze_dim(0);
    let mut rows = vec![a, b];
    for &t in &v[9..] {
        rows.push(
            m.forward(&ids(&[t]), &mut cache, Logits::All)
                .unwrap()
                .squeeze_dim(0),
        );
    }
    Tensor::cat(&rows, 0)
}

fn check_cache_consistency(tiny: Tiny) {
    let dir = tempfile::tempdir().unwrap();
    tiny.write_hf_dir(dir.path());
    let m = load(dir.path(), DType::F32).model;
    let full = full_logits(&m, &IDS);
    assert_eq!(full.size(), vec![IDS.len() as i64, tiny.vocab]);
    assert!(
        full.std(true).double_value(&[]) > 1e-3,
        "logits are not flat"
    );
    let step = stepwise_logits(&m, &IDS);
    let chunk = chunked_logits(&m, &IDS);
    let d1 = max_abs_diff(&full, &step);
    let d2 = max_abs_diff(&full, &chunk);
    assert!(
        d1 <= 1e-4,
        "{}: prefill vs step-by-step differ by {d1}",
        tiny.arch
    );
    assert!(
        d2 <= 1e-4,
        "{}: prefill vs chunked differ by {d2}",
        tiny.arch
    );
}

#[test]
fn prefill_equals_stepwise_decode_llama_gqa_tied() {
    check_cache_consistency(Tiny::default());
}

#[test]
fn prefill_equals_stepwise_decode_untied_mha() {
    check_cache_consistency(Tiny {
        tied: false,
        kv_heads: 4,
        ..Tiny::default()
    });
}

#[test]
fn prefill_equals_stepwise_decode_qwen2_biases() {
    check_cache_consistency(Tiny {
        arch: "Qwen2ForCausalLM",
        bias: true,
        kv_heads: 1,
        ..Tiny::default()
    });
}

#[test]
fn prefill_equals_stepwise_decode_llama3_and_linear_rope() {
    check_cache_consistency(Tiny {
        rope_scaling: Some(
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        ),
        ..Tiny::default()
    });
    check_cache_consistency(Tiny {
        rope_scaling: Some(json!({"type": "linear", "factor": 2.0})),
        arch: "MistralForCausalLM",
        ..Tiny::default()
    });
}

#[test]
fn rope_scaling_changes_the_output() {
    // A scaled model must not silently ignore its scaling.
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    Tiny::default().write_hf_dir(dir_a.path());
    Tiny {
        rope_scaling: Some(json!({"type": "linear", "factor": 4.0})),
        ..Tiny::default()
    }
    .write_hf_dir(dir_b.path());
    let a = full_logits(&load(dir_a.path(), DType::F32).model, &IDS);
    let b = full_logits(&load(dir_b.path(), DType::F32).model, &IDS);
    // Position 0 has no rotation, later positions differ.
    assert!(max_abs_diff(&a.get(0), &b.get(0)) < 1e-5);
    assert!(max_abs_diff(&a, &b) > 1e-3);
}

#[test]
fn checkpoint_round_trip_gives_identical_logits() {
    for tiny in [
        Tiny::default(),
        Tiny {
            arch: "Qwen2ForCausalLM",
            bias: true,
            tied: false,
            ..Tiny::default()
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        tiny.write_hf_dir(&dir.path().join("src"));
        let a = load(&dir.path().join("src"), DType::F32);
        let out = dir.path().join("ckpt");
        save_checkpoint(&out, &a.card, &a.model, DType::F32).unwrap();
        for f in [
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(out.join(f).is_file(), "{f} missing from checkpoint");
        }
        let b = load(&out, DType::F32);
        assert_eq!(a.card.config, b.card.config);
        let la = full_logits(&a.model, &IDS);
        let lb = full_logits(&b.model, &IDS);
        assert_eq!(max_abs_diff(&la, &lb), 0.0, "reloaded checkpoint differs");
        assert_eq!(
            a.card.tokenizer.encode("hello world").unwrap(),
            b.card.tokenizer.encode("hello world").unwrap()
        );
        assert_eq!(a.card.chat_template_source, b.card.chat_template_source);
        // A second save to the same place is refused rather than mixing two checkpoints.
        let e = save_checkpoint(&out, &a.card, &a.model, DType::F32).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
    }
}

#[test]
fn gguf_of_the_same_weights_gives_the_same_logits() {
    // llama.cpp permutes Q/K rows for Llama; our loader must undo it (and not for Qwen2).
    for tiny in [
        Tiny::default(),
        Tiny {
            arch: "Qwen2ForCausalLM",
            bias: true,
            ..Tiny::default()
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        tiny.write_hf_dir(dir.path());
        let (meta, tensors) = tiny_gguf(&tiny);
        let gguf_path = dir.path().join("tiny.gguf");
        write_file(&gguf_path, &gguf_bytes(&meta, &tensors));
        let hf = load(dir.path(), DType::F32);
        let gg = load_model(&ModelSource::Gguf(gguf_path), Device::Cpu, DType::F32).unwrap();
        assert_eq!(
            hf.card.config.num_key_value_heads,
            gg.card.config.num_key_value_heads
        );
        let d = max_abs_diff(&full_logits(&hf.model, &IDS), &full_logits(&gg.model, &IDS));
        assert!(
            d < 1e-5,
            "{}: GGUF and safetensors differ by {d}",
            tiny.arch
        );
        // The GGUF's vocabulary tokenizes like the tokenizer.json of the same vocabulary.
        let text = "hello world, the <|im_start|>user\nhi<|im_end|>";
        assert_eq!(
            hf.card.tokenizer.encode(text).unwrap(),
            gg.card.tokenizer.encode(text).unwrap()
        );
    }
}

#[test]
fn bf16_runs_and_stays_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    Tiny::default().write_hf_dir(dir.path());
    let a = full_logits(&load(dir.path(), DType::F32).model, &IDS);
    let m = load(dir.path(), DType::BF16).model;
    let b = full_logits(&m, &IDS);
    assert_eq!(b.kind(), Kind::Float);
    let d = max_abs_diff(&a, &b);
    assert!(d < 0.1, "bf16 drifted by {d}");
    let s = stepwise_logits(&m, &IDS);
    assert!(max_abs_diff(&b, &s) < 0.05);
}

#[test]
fn cache_overflow_and_bad_input_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    Tiny::default().write_hf_dir(dir.path());
    let m = load(dir.path(), DType::F32).model;
    let _g = tch::no_grad_guard();
    let mut cache = m.new_cache(1, 4).unwrap();
    let e = m
        .forward(&ids(&IDS[..5]), &mut cache, Logits::Last)
        .unwrap_err();
    assert!(matches!(e, ModelError::Invalid(_)), "{e}");
    assert!(e.to_string().contains("capacity"), "{e}");
    let e = m
        .forward(&Tensor::from_slice(&[1i64, 2]), &mut cache, Logits::Last)
        .unwrap_err();
    assert!(e.to_string().contains("[batch, seq]"), "{e}");
}

#[test]
fn checkpoint_loads_in_transformers_with_the_same_logits() {
    // The peer check: HF transformers reads our checkpoint and computes the same logits.
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny {
        tied: false,
        ..Tiny::default()
    };
    tiny.write_hf_dir(&dir.path().join("src"));
    let a = load(&dir.path().join("src"), DType::F32);
    let out = dir.path().join("ckpt");
    save_checkpoint(&out, &a.card, &a.model, DType::F32).unwrap();
    let ours = full_logits(&a.model, &IDS);
    let script = format!(
        r#"
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = m(torch.tensor([{ids:?}])).logits[0]
print(json.dumps({{"logits": logits.flatten().tolist(),
                  "ids": tok("hello world", add_special_tokens=False).input_ids}}))
"#,
        ids = IDS.to_vec()
    );
    let output = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(&out)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "transformers failed to load our checkpoint:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let theirs: Vec<f32> = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let theirs = Tensor::from_slice(&theirs).view([IDS.len() as i64, tiny.vocab]);
    let d = max_abs_diff(&ours, &theirs);
    assert!(d < 1e-4, "transformers and we differ by {d}");
    let their_ids: Vec<u32> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(their_ids, a.card.tokenizer.encode("hello world").unwrap());
}

#[test]
fn batched_decode_gives_the_same_tokens_and_logprobs_as_one_at_a_time() {
    use agentjet::engine::{generate, generate_batch, GenerateRequest, SamplingParams};
    for tiny in [
        Tiny::default(),
        Tiny {
            arch: "Qwen2ForCausalLM",
            bias: true,
            kv_heads: 1,
            ..Tiny::default()
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        tiny.write_hf_dir(dir.path());
        let m = load(dir.path(), DType::F32).model;
        // Different prompt lengths, budgets and stop tokens; one sampled with a seed.
        let reqs: Vec<GenerateRequest> = (0..7)
            .map(|i| GenerateRequest {
                prompt: (0..(3 + 5 * i))
                    .map(|t| ((t * 37 + i * 11) % 290) as u32 + 3)
                    .collect(),
                max_tokens: 5 + 3 * i as usize,
                sampling: if i == 3 {
                    SamplingParams {
                        temperature: 0.8,
                        top_p: 0.9,
                        top_k: 0,
                        ..Default::default()
                    }
                } else {
                    SamplingParams::greedy()
                },
                seed: Some(100 + i as u64),
                stop_token_ids: if i == 5 { vec![7, 9, 11, 13] } else { vec![] },
                top_logprobs: 0,
                constraint: None,
                adapter: None,
            })
            .collect();
        let batched = generate_batch(&m, &reqs).unwrap();
        for (req, b) in reqs.iter().zip(&batched) {
            let single = generate(&m, req, |_, _| true).unwrap();
            assert_eq!(
                b.tokens,
                single.tokens,
                "{}: prompt of {}",
                tiny.arch,
                req.prompt.len()
            );
            assert_eq!(b.finish_reason, single.finish_reason);
            for (x, y) in b.logprobs.iter().zip(&single.logprobs) {
                assert!((x - y).abs() < 1e-4, "{x} vs {y}");
            }
        }
    }
}
