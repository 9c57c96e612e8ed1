//! Golden tests of each model family against HF transformers 5.x, on tiny random models that
//! transformers itself builds and saves (`tests/fixtures/hf_family.py`): greedy ids from
//! our engine equal HF's on token-id prompts, with log-probabilities within 1e-4 in
//! float32; the logits of a sequence within 1e-4; and one training loss's gradient for
//! every parameter (under HF's names) within 1e-4 of torch autograd's.

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
fn reference(family: &str, dir: &std::path::Path) -> (Llama, Value) {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_family.py");
    let out = std::process::Command::new(python())
        .arg(script)
        .arg(family)
        .arg(dir)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers failed on {family}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let model_dir = dir.join("model");
    write_byte_level_tokenizer(&model_dir, v["vocab"].as_i64().unwrap());
    let m = load_model(&ModelSource::HfDir(model_dir), Device::Cpu, DType::F32)
        .unwrap_or_else(|e| panic!("{family}: {e}"))
        .model;
    (m, v)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// Logits of `IDS` through the KV-cache path, and through the training path.
fn check_logits(family: &str, m: &Llama, v: &Value) {
    let _g = tch::no_grad_guard();
    let vocab = v["vocab"].as_i64().unwrap();
    let want = Tensor::from_slice(&floats(&v["logits"])).view([IDS.len() as i64, vocab]);
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
    let prompts: Vec<Vec<u32>> = vec![vec![3, 9, 27, 81], vec![100, 50, 25, 12, 6, 3], vec![7]];
    let engine = spawn_engine(m, EngineConfig::default()).unwrap();
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest {
                    prompt: p.clone(),
                    max_tokens: 8,
                    sampling: SamplingParams::greedy(),
                    seed: None,
                    stop_token_ids: vec![],
                    top_logprobs: 0,
                    constraint: None,
                    adapter: None,
                })
                .unwrap()
        })
        .collect();
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let (mut ids, mut lps) = (Vec::new(), Vec::new());
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                EngineEvent::Token { id, logprob, .. } => {
                    ids.push(id as u64);
                    lps.push(logprob);
                }
                _ => break,
            }
        }
        let want = &v["gen"][i];
        let want_ids: Vec<u64> = want["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(
            ids, want_ids,
            "{family}, prompt {i}: greedy ids differ from HF's"
        );
        for (a, b) in lps.iter().zip(floats(&want["lps"])) {
            assert!(
                (a - b as f64).abs() < 1e-4,
                "{family}, prompt {i}: logprob {a} vs HF's {b}"
            );
        }
    }
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
    assert_eq!(
        ours.len(),
        theirs.len(),
        "{family}: {} gradients against HF's {}",
        ours.len(),
        theirs.len()
    );
    for (name, want) in &theirs {
        let got = &ours
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{family}: no gradient for {name}"))
            .1;
        let d = max_abs_diff(got, want);
        assert!(
            d < 1e-4,
            "{family}: the gradient of {name} is {d} from autograd's"
        );
    }
}

fn golden(family: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (m, v) = reference(family, dir.path());
    check_logits(family, &m, &v);
    check_gradient(family, reference(family, dir.path()).0, &v, dir.path());
    check_greedy(family, m, &v);
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
