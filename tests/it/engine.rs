//! The engine thread with continuous batching, on a tiny random model: concurrent
//! requests get exactly what one-at-a-time generation gives, requesters that go away are
//! cancelled without disturbing the others, KV memory returns to idle, and a full queue
//! answers "overloaded".

use crate::common;

use agentjet::engine::{
    generate, spawn_engine, Constraint, EngineConfig, EngineError, EngineEvent, FinishReason,
    GenerateRequest, SamplingParams, TokenBytes, ToolSpec,
};
use agentjet::model::llama::{DType, Llama};
use common::*;
use std::sync::atomic::Ordering;
use tch::Device;

fn tiny_model(dir: &std::path::Path) -> Llama {
    Tiny {
        max_pos: 512,
        ..Tiny::default()
    }
    .load(dir, Device::Cpu, DType::F32)
}

fn request(i: usize, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: (0..(2 + 3 * i))
            .map(|t| ((t * 31 + i * 7) % 290) as u32 + 3)
            .collect(),
        max_tokens,
        sampling: if i % 4 == 3 {
            SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                top_k: 0,
                ..Default::default()
            }
        } else {
            SamplingParams::greedy()
        },
        seed: Some(i as u64),
        stop_token_ids: vec![],
        top_logprobs: 0,
        constraint: None,
        adapter: None,
    }
}

/// Collects a request's events: (tokens, logprobs, finish).
fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
) -> (Vec<u32>, Vec<f64>, EngineEvent) {
    let (mut toks, mut lps) = (Vec::new(), Vec::new());
    loop {
        match rx
            .blocking_recv()
            .expect("engine ended the stream without Finished")
        {
            EngineEvent::Token { id, logprob, .. } => {
                toks.push(id);
                lps.push(logprob);
            }
            end => return (toks, lps, end),
        }
    }
}

#[test]
fn concurrent_requests_match_one_at_a_time_and_cancellation_frees_memory() {
    let dir = tempfile::tempdir().unwrap();
    // The same checkpoint twice: one copy for the engine, one for the reference.
    let reference_model = tiny_model(dir.path());
    let engine = spawn_engine(
        tiny_model(dir.path()),
        EngineConfig {
            max_batch: 8,
            max_queue: 64,
            max_kv_positions: 4096,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    // 24 requests from 24 threads; every third requester walks away after 3 tokens.
    let handles: Vec<_> = (0..24)
        .map(|i| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                let mut rx = engine.submit(request(i, 20 + i)).unwrap();
                if i % 3 == 2 {
                    for _ in 0..3 {
                        rx.blocking_recv().unwrap();
                    }
                    drop(rx);
                    return None;
                }
                Some((i, collect(rx)))
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .collect();
    assert_eq!(results.len(), 16);
    for (i, (toks, lps, end)) in results {
        let single = generate(&reference_model, &request(i, 20 + i), |_, _| true).unwrap();
        assert_eq!(toks, single.tokens, "request {i}");
        for (a, b) in lps.iter().zip(&single.logprobs) {
            assert!((a - b).abs() < 1e-4);
        }
        match end {
            EngineEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!(prompt_tokens, 2 + 3 * i);
                assert_eq!(completion_tokens, 20 + i);
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
    // The cancelled ones are gone and the KV memory is back to idle.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while engine.stats.running.load(Ordering::Relaxed) != 0 && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(engine.stats.running.load(Ordering::Relaxed), 0);
    assert_eq!(engine.stats.kv_bytes.load(Ordering::Relaxed), 0);
    assert_eq!(engine.stats.completed.load(Ordering::Relaxed), 16);
    assert_eq!(engine.stats.cancelled.load(Ordering::Relaxed), 8);
    // And it still serves.
    let (toks, _, _) = collect(engine.submit(request(1, 5)).unwrap());
    assert_eq!(toks.len(), 5);
}

#[test]
fn full_queue_is_overloaded_and_bad_requests_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let engine = spawn_engine(
        tiny_model(dir.path()),
        EngineConfig {
            max_batch: 1,
            max_queue: 2,
            max_kv_positions: 300,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    // Occupy the one batch slot, and wait until it runs.
    let mut long = engine.submit(request(0, 250)).unwrap();
    long.blocking_recv().unwrap();
    let queued: Vec<_> = (0..2)
        .map(|i| engine.submit(request(i, 3)).unwrap())
        .collect();
    assert_eq!(
        engine.submit(request(5, 3)).unwrap_err(),
        EngineError::Overloaded(2)
    );
    drop(long); // cancel: the queued ones run
    for rx in queued {
        let (toks, _, end) = collect(rx);
        assert_eq!(toks.len(), 3);
        assert!(matches!(end, EngineEvent::Finished { .. }));
    }
    // Requests that cannot run fail with a reason; the engine keeps going.
    let (_, _, end) = collect(engine.submit(request(1, 1000)).unwrap());
    assert!(
        matches!(&end, EngineEvent::Failed(m) if m.contains("budget")),
        "{end:?}"
    );
    let mut bad = request(1, 3);
    bad.prompt.push(99_999);
    let (_, _, end) = collect(engine.submit(bad).unwrap());
    assert!(
        matches!(&end, EngineEvent::Failed(m) if m.contains("vocabulary")),
        "{end:?}"
    );
    let (toks, _, _) = collect(engine.submit(request(2, 4)).unwrap());
    assert_eq!(toks.len(), 4);
}

#[test]
fn n_choices_share_one_prefill_and_match_separate_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let reference_model = tiny_model(dir.path());
    let engine = spawn_engine(
        tiny_model(dir.path()),
        EngineConfig {
            max_batch: 4,
            max_queue: 8,
            max_kv_positions: 2048,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let req = |seed: u64| GenerateRequest {
        seed: Some(seed),
        ..request(3, 12) // sampled at temperature 0.9
    };
    let prompt_len = req(0).prompt.len() as u64;
    // Three choices fit the batch: one prefill of the prompt.
    let rxs = engine.submit_n(req(40), 3).unwrap();
    let outs: Vec<_> = rxs.into_iter().map(collect).collect();
    assert_eq!(
        engine.stats.prefill_tokens.load(Ordering::Relaxed),
        prompt_len
    );
    for (i, (toks, lps, end)) in outs.iter().enumerate() {
        let single = generate(&reference_model, &req(40 + i as u64), |_, _| true).unwrap();
        assert_eq!(toks, &single.tokens, "choice {i}");
        for (a, b) in lps.iter().zip(&single.logprobs) {
            assert!((a - b).abs() < 1e-4, "choice {i}: {a} vs {b}");
        }
        assert!(matches!(
            end,
            EngineEvent::Finished {
                completion_tokens: 12,
                ..
            }
        ));
    }
    // Different seeds sample different continuations.
    assert!(outs[0].0 != outs[1].0 || outs[1].0 != outs[2].0);
    // Six choices on a batch of four: two groups, two prefills; all still correct.
    let rxs = engine.submit_n(req(50), 6).unwrap();
    for (i, rx) in rxs.into_iter().enumerate() {
        let (toks, _, _) = collect(rx);
        let single = generate(&reference_model, &req(50 + i as u64), |_, _| true).unwrap();
        assert_eq!(toks, single.tokens, "choice {i} of 6");
    }
    assert_eq!(
        engine.stats.prefill_tokens.load(Ordering::Relaxed),
        3 * prompt_len
    );
}

/// A vocabulary of `n` tokens where a few ids spell pattern pieces and every other id is
/// text that can never start a pattern (so a random model picks junk unless masked).
fn pattern_vocab(n: usize, pieces: &[&str]) -> std::sync::Arc<TokenBytes> {
    let mut v: Vec<Option<Box<[u8]>>> = (0..n)
        .map(|i| Some(format!("junk{i}").into_bytes().into_boxed_slice()))
        .collect();
    v[0] = None; // a special token
    for (k, p) in pieces.iter().enumerate() {
        v[10 + k] = Some(p.as_bytes().to_vec().into_boxed_slice());
    }
    std::sync::Arc::new(TokenBytes(v))
}

fn specs(names: &[String]) -> Vec<ToolSpec> {
    names
        .iter()
        .map(|n| ToolSpec {
            name: n.clone(),
            parameters: None,
        })
        .collect()
}

#[test]
fn constrained_requests_follow_their_pattern_and_stop_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let vocab_size = model.config.vocab_size;
    let engine = spawn_engine(model, EngineConfig::default()).unwrap();
    let pieces = [
        "<tool_call>\n{\"name\": \"",
        "get",
        "_weather\"",
        "_time\"",
        ", \"arguments\": ",
        "{",
        "}",
        "}\n</tool_call>",
        "\n</tool_call>",
    ];
    let vocab = pattern_vocab(vocab_size, &pieces);
    let text = |toks: &[u32]| -> String {
        toks.iter()
            .map(|&t| String::from_utf8(vocab.0[t as usize].clone().unwrap().into()).unwrap())
            .collect()
    };
    // A forced tool call among two names, sampled: every choice is a well-formed call of
    // one of them, ended as soon as it is complete.
    let names = vec!["get_time".to_string(), "get_weather".to_string()];
    let req = GenerateRequest {
        constraint: Some(Constraint::tool_call(&specs(&names), vocab.clone()).unwrap()),
        ..request(3, 64)
    };
    for (i, rx) in engine.submit_n(req, 4).unwrap().into_iter().enumerate() {
        let (toks, _, end) = collect(rx);
        let out = text(&toks);
        assert!(
            matches!(
                end,
                EngineEvent::Finished {
                    reason: FinishReason::Stop,
                    ..
                }
            ),
            "choice {i}: {end:?} after {out:?}"
        );
        let (_, calls) = agentjet::facade::text::parse_tool_calls(&out, 1).unwrap();
        assert!(names.contains(&calls[0].function.name), "{out:?}");
        assert_eq!(calls[0].function.arguments, "{}");
    }
    // JSON mode with only braces in the vocabulary: only `{}` is possible.
    let braces = pattern_vocab(vocab_size, &["{", "}"]);
    let req = GenerateRequest {
        constraint: Some(Constraint::json_object(braces.clone())),
        ..request(5, 64)
    };
    let (toks, _, end) = collect(engine.submit(req).unwrap());
    assert_eq!(toks, vec![10, 11]);
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Stop,
            completion_tokens: 2,
            ..
        }
    ));
    // A pattern the vocabulary cannot spell fails that request with a reason, alone.
    let req = GenerateRequest {
        constraint: Some(
            Constraint::tool_call(&specs(&["other".to_string()]), vocab.clone()).unwrap(),
        ),
        ..request(1, 64)
    };
    let (_, _, end) = collect(engine.submit(req).unwrap());
    assert!(
        matches!(&end, EngineEvent::Failed(m) if m.contains("no token")),
        "{end:?}"
    );
    let (toks, _, _) = collect(engine.submit(request(2, 4)).unwrap());
    assert_eq!(toks.len(), 4);
}
