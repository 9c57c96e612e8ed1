//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against what HF transformers
//! produces for it (tests/fixtures/smollm2_reference.json, made by
//! tests/fixtures/make_smollm2_reference.py): chat template text, tokenization, greedy
//! tokens and per-token logprobs.

use crate::common;

use agentjet::engine::{generate, GenerateRequest, SamplingParams};
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::DType;
use agentjet::model::{ChatRequest, ModelCard, ModelSource};
use serde_json::Value;
use tch::Device;

fn fixture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/smollm2_reference.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn card() -> ModelCard {
    ModelCard::load(&ModelSource::Gguf(common::smollm2_path())).unwrap()
}

#[test]
fn chat_template_renders_like_hf_apply_chat_template() {
    let card = card();
    let tmpl = card.chat_template("smollm2").unwrap();
    let cases = fixture()["chat_template"].as_array().unwrap().clone();
    assert!(cases.len() >= 8);
    for case in cases {
        let messages = case["messages"].as_array().unwrap().clone();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let ours = tmpl
            .render(&ChatRequest {
                messages: &messages,
                add_generation_prompt: agp,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(
            ours,
            case["text"].as_str().unwrap(),
            "messages {messages:?}, add_generation_prompt={agp}"
        );
    }
}

#[test]
fn gguf_tokenizer_matches_smollm2_tokenization() {
    let card = card();
    for case in fixture()["tokenization"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ours = card.tokenizer.encode(text).unwrap();
        assert_eq!(ours, ids_of(&case["ids"]), "text {text:?}");
        // and back
        assert_eq!(card.tokenizer.decode(&ours, false).unwrap(), text);
    }
    assert_eq!(card.tokenizer.bos.as_ref().unwrap().content, "<|im_start|>");
    assert_eq!(card.tokenizer.eos.as_ref().unwrap().content, "<|im_end|>");
    assert!(!card.tokenizer.add_bos_token);
}

#[test]
fn greedy_tokens_and_logprobs_match_transformers() {
    let loaded = load_model(
        &ModelSource::Gguf(common::smollm2_path()),
        Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let card = &loaded.card;
    let tmpl = card.chat_template("smollm2").unwrap();
    let cases = fixture()["greedy"].as_array().unwrap().clone();
    assert!(cases.len() >= 3);
    let mut worst = 0f64;
    for case in cases {
        let messages = case["messages"].as_array().unwrap().clone();
        let text = tmpl
            .render(&ChatRequest {
                messages: &messages,
                add_generation_prompt: true,
                ..Default::default()
            })
            .unwrap();
        let prompt = card.tokenizer.encode(&text).unwrap();
        assert_eq!(
            prompt,
            ids_of(&case["prompt_ids"]),
            "prompt ids of {messages:?}"
        );
        let expected = ids_of(&case["completion_ids"]);
        let gen = generate(
            &loaded.model,
            &GenerateRequest {
                prompt,
                max_tokens: expected.len(),
                sampling: SamplingParams::greedy(),
                seed: None,
                stop_token_ids: card.generation.eos_token_ids.clone(),
                top_logprobs: 0,
                constraint: None,
                adapter: None,
            },
            |_, _| true,
        )
        .unwrap();
        assert_eq!(gen.tokens, expected, "greedy tokens for {messages:?}");
        let ref_lp: Vec<f64> = case["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (i, (a, b)) in gen.logprobs.iter().zip(&ref_lp).enumerate() {
            worst = worst.max((a - b).abs());
            assert!(
                (a - b).abs() <= 1e-3,
                "token {i} of {messages:?}: logprob {a} vs transformers {b}"
            );
        }
        assert_eq!(
            card.tokenizer.decode(&gen.tokens, true).unwrap(),
            case["text"].as_str().unwrap()
        );
    }
    eprintln!("largest logprob difference to transformers: {worst:.2e}");
}

#[test]
fn other_templates_render_like_hf_with_tools_errors_and_whitespace_control() {
    // Templates in the style of Qwen2.5 (tools, tojson, `{%-`), Mistral (raise_exception),
    // indented block tags (trim_blocks/lstrip_blocks) and Python string methods, rendered
    // by HF with SmolLM2's special tokens.
    let card = card();
    let specials: Vec<(String, String)> = [
        ("bos_token", &card.tokenizer.bos),
        ("eos_token", &card.tokenizer.eos),
        ("pad_token", &card.tokenizer.pad),
        ("unk_token", &card.tokenizer.unk),
    ]
    .into_iter()
    .filter_map(|(k, t)| t.as_ref().map(|t| (k.to_string(), t.content.clone())))
    .collect();
    let cases = fixture()["templates"].as_array().unwrap().clone();
    assert!(cases.len() >= 11);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let tmpl = agentjet::model::ChatTemplate::new(
            case["template"].as_str().unwrap().to_string(),
            None,
            specials.clone(),
            name,
        )
        .unwrap();
        let messages = case["messages"].as_array().unwrap().clone();
        let tools = case["tools"].as_array().cloned();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let result = tmpl.render(&ChatRequest {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt: agp,
            extra: None,
        });
        match case.get("error").and_then(|e| e.as_str()) {
            Some(msg) => {
                let e = result.unwrap_err().to_string();
                assert!(e.contains(msg), "{name}: want {msg:?} in {e}");
            }
            None => assert_eq!(
                result.unwrap(),
                case["text"].as_str().unwrap(),
                "{name}, add_generation_prompt={agp}"
            ),
        }
    }
}

#[test]
fn bf16_weights_on_cpu_stay_close_to_float32_transformers() {
    // bfloat16 matrices with float32 activations (agentjet-kernels' matmul for decode, a
    // bf16 GEMM for prefill). Teacher-forced on transformers' float32 completions, the
    // per-token logprobs stay close; greedy text may part ways at a near-tie, so it is the
    // logprobs that are checked.
    use agentjet::model::llama::Logits;
    let loaded = load_model(
        &ModelSource::Gguf(common::smollm2_path()),
        Device::Cpu,
        DType::BF16,
    )
    .unwrap();
    let model = &loaded.model;
    let _g = tch::no_grad_guard();
    let mut worst = 0f64;
    for case in fixture()["greedy"].as_array().unwrap() {
        let prompt = ids_of(&case["prompt_ids"]);
        let completion = ids_of(&case["completion_ids"]);
        let reference: Vec<f64> = case["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let mut cache = model.new_cache(1, prompt.len() + completion.len()).unwrap();
        let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
        let mut logits = model
            .forward(
                &tch::Tensor::from_slice(&ids).view([1, -1]),
                &mut cache,
                Logits::Last,
            )
            .unwrap();
        for (i, &tok) in completion.iter().enumerate() {
            let lp = logits
                .log_softmax(-1, tch::Kind::Double)
                .double_value(&[0, tok as i64]);
            worst = worst.max((lp - reference[i]).abs());
            logits = model
                .forward(
                    &tch::Tensor::from_slice(&[tok as i64]).view([1, 1]),
                    &mut cache,
                    Logits::Last,
                )
                .unwrap();
        }
    }
    eprintln!(
        "bf16: largest teacher-forced logprob difference to float32 transformers: {worst:.2e}"
    );
    // Measured here: 0.11 at worst over the fixture (bfloat16 keeps 8 bits of mantissa).
    assert!(worst < 0.25, "bf16 logprobs drifted by {worst}");
}

#[test]
fn batched_greedy_decode_gives_transformers_tokens() {
    // All fixture prompts decode together in one batch (continuous batching's building
    // block); every sequence still gets exactly transformers' greedy tokens.
    use agentjet::engine::generate_batch;
    let loaded = load_model(
        &ModelSource::Gguf(common::smollm2_path()),
        Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let cases = fixture()["greedy"].as_array().unwrap().clone();
    let reqs: Vec<GenerateRequest> = cases
        .iter()
        .map(|case| GenerateRequest {
            prompt: ids_of(&case["prompt_ids"]),
            max_tokens: ids_of(&case["completion_ids"]).len(),
            sampling: SamplingParams::greedy(),
            seed: None,
            stop_token_ids: loaded.card.generation.eos_token_ids.clone(),
            top_logprobs: 0,
            constraint: None,
            adapter: None,
        })
        .collect();
    let out = generate_batch(&loaded.model, &reqs).unwrap();
    for (case, g) in cases.iter().zip(&out) {
        assert_eq!(g.tokens, ids_of(&case["completion_ids"]));
        for (a, b) in g.logprobs.iter().zip(case["logprobs"].as_array().unwrap()) {
            assert!((a - b.as_f64().unwrap()).abs() <= 1e-3);
        }
    }
}
