//! The engine's prefix cache on a tiny random model: multi-turn continuations and
//! siblings that share a task prompt reuse cached keys and values and still get exactly
//! what a cold engine (and one-at-a-time generation) gives; a tiny budget evicts and stays
//! correct; a weight update invalidates the cache; KV memory goes back to the budget when
//! many concurrent sessions end; Qwen3.5's multi-turn sessions resume from cached
//! linear-attention states.

use crate::common;

use agentjet::engine::{
    generate, spawn_engine, EngineConfig, EngineEvent, EngineHandle, GenerateRequest,
    SamplingParams,
};
use agentjet::model::llama::{DType, Llama};
use common::*;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tch::Device;

/// Keys and values of one position of the tiny model: 2 layers x (k, v) x 2 heads x 16 x 4 B.
const BYTES_PER_POSITION: usize = 512;

fn model(dir: &std::path::Path, seed: i64) -> Llama {
    Tiny {
        max_pos: 512,
        seed,
        ..Tiny::default()
    }
    .load(dir, Device::Cpu, DType::F32)
}

fn engine(
    model: Llama,
    prefix_cache_bytes: usize,
    max_batch: usize,
    positions: usize,
) -> EngineHandle {
    spawn_engine(
        model,
        EngineConfig {
            max_batch,
            max_queue: 256,
            max_kv_positions: positions,
            prefix_cache_bytes,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams::greedy(),
        seed: Some(1),
        ..Default::default()
    }
}

/// (tokens, logprobs, policy version) of one request.
fn run(engine: &EngineHandle, req: GenerateRequest) -> (Vec<u32>, Vec<f64>, u64) {
    let mut rx = engine.submit(req).unwrap();
    let (mut toks, mut lps) = (Vec::new(), Vec::new());
    loop {
        match rx.blocking_recv().expect("stream ended without Finished") {
            EngineEvent::Token { id, logprob, .. } => {
                toks.push(id);
                lps.push(logprob);
            }
            EngineEvent::Finished { policy_version, .. } => return (toks, lps, policy_version),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

fn tokens(seed: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|t| ((t * 37 + seed * 11) % 290) as u32 + 3)
        .collect()
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-4, "{what}: logprob {x} vs {y}");
    }
}

fn stat(e: &EngineHandle, f: impl Fn(&agentjet::engine::EngineStats) -> u64) -> u64 {
    f(&e.stats)
}

#[test]
fn multi_turn_continuations_reuse_the_cache_and_match_a_cold_engine() {
    let dir = tempfile::tempdir().unwrap();
    let cached = engine(model(dir.path(), 7), 1 << 20, 8, 8 * 512);
    let cold = engine(model(dir.path(), 7), 0, 8, 8 * 512);
    let reference = model(dir.path(), 7);
    let system = tokens(1, 40);
    // Three sessions of five turns, run side by side: each turn's prompt is the previous
    // prompt, the model's answer, and 6 tokens of "environment".
    let sessions: Vec<_> = (0..3)
        .map(|s| {
            let (cached, cold) = (cached.clone(), cold.clone());
            let mut prompt = system.clone();
            prompt.extend(tokens(10 + s, 10));
            std::thread::spawn(move || {
                let mut turns = Vec::new();
                for turn in 0..5 {
                    let a = run(&cached, greedy(prompt.clone(), 8));
                    let b = run(&cold, greedy(prompt.clone(), 8));
                    assert_eq!(a.0, b.0, "session {s} turn {turn}: tokens");
                    assert_close(&a.1, &b.1, &format!("session {s} turn {turn}"));
                    turns.push((prompt.clone(), a.0.clone(), a.1));
                    prompt.extend(&a.0);
                    prompt.extend(tokens(100 + 7 * s + turn, 6));
                }
                turns
            })
        })
        .collect();
    let mut expected_reuse = 0u64;
    for h in sessions {
        let turns = h.join().unwrap();
        for (i, (prompt, toks, lps)) in turns.iter().enumerate() {
            let single = generate(&reference, &greedy(prompt.clone(), 8), |_, _| true).unwrap();
            assert_eq!(toks, &single.tokens);
            assert_close(lps, &single.logprobs, "against generate");
            if i > 0 {
                // The previous prompt and all but the last answer token (never fed back).
                expected_reuse += (turns[i - 1].0.len() + 7) as u64;
            }
        }
    }
    let reused = stat(&cached, |s| s.prefix_reused_tokens.load(Relaxed));
    let prefilled = stat(&cached, |s| s.prefill_tokens.load(Relaxed));
    let cold_prefilled = stat(&cold, |s| s.prefill_tokens.load(Relaxed));
    // Every token is either reused or prefilled, and at least every continuation's
    // earlier turns (the system prompt shared across sessions may add more) are reused.
    assert_eq!(reused + prefilled, cold_prefilled);
    assert!(reused >= expected_reuse, "{reused} < {expected_reuse}");
    assert_eq!(stat(&cold, |s| s.prefix_reused_tokens.load(Relaxed)), 0);
    assert_eq!(stat(&cached, |s| s.prefix_lookups.load(Relaxed)), 15);
    assert!(stat(&cached, |s| s.prefix_hits.load(Relaxed)) >= 12);
}

#[test]
fn siblings_with_one_task_prompt_prefill_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(model(dir.path(), 7), 1 << 20, 8, 8 * 512);
    let reference = model(dir.path(), 7);
    let task = tokens(3, 60);
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            let mut p = task.clone();
            p.extend(tokens(50 + i, 5));
            p
        })
        .collect();
    // All eight at once, as a group of episodes starts.
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| e.submit(greedy(p.clone(), 6)).unwrap())
        .collect();
    for (rx, p) in rxs.into_iter().zip(&prompts) {
        let mut rx = rx;
        let mut toks = Vec::new();
        while let Some(EngineEvent::Token { id, .. }) = rx.blocking_recv() {
            toks.push(id);
        }
        let single = generate(&reference, &greedy(p.clone(), 6), |_, _| true).unwrap();
        assert_eq!(toks, single.tokens);
    }
    // The task prompt once, then only each sibling's own 5 tokens.
    assert_eq!(e.stats.prefill_tokens.load(Relaxed), 65 + 7 * 5);
    assert_eq!(e.stats.prefix_reused_tokens.load(Relaxed), 7 * 60);
}

#[test]
fn a_tiny_budget_evicts_and_stays_correct() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 40 * BYTES_PER_POSITION;
    let e = engine(model(dir.path(), 7), cap, 4, 4 * 512);
    let reference = model(dir.path(), 7);
    for round in 0..2 {
        // The second round goes backwards: the most recent prompt is still cached.
        let order: Vec<usize> = if round == 0 {
            (0..6).collect()
        } else {
            (0..6).rev().collect()
        };
        for i in order {
            let mut p = tokens(20 + i, 30);
            if round == 1 {
                p.extend(tokens(90 + i, 4));
            }
            let (toks, lps, _) = run(&e, greedy(p.clone(), 5));
            let single = generate(&reference, &greedy(p, 5), |_, _| true).unwrap();
            assert_eq!(toks, single.tokens, "round {round} prompt {i}");
            assert_close(&lps, &single.logprobs, "tiny budget");
            assert!(e.stats.prefix_bytes.load(Relaxed) <= cap);
        }
    }
    assert!(e.stats.prefix_evictions.load(Relaxed) > 0);
    // The newest prompt's continuation still found its prefix.
    assert!(e.stats.prefix_hits.load(Relaxed) > 0);
}

#[test]
fn a_weight_update_invalidates_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let e = engine(model(dir.path(), 7), 1 << 20, 4, 4 * 512);
    let new_weights = model(other.path(), 8);
    let p = tokens(5, 40);
    let (first, _, v0) = run(&e, greedy(p.clone(), 6));
    assert_eq!(v0, 0);
    assert!(e.stats.prefix_bytes.load(Relaxed) > 0);
    e.update_weights(&new_weights.parameters(), 1).unwrap();
    assert_eq!(e.stats.prefix_bytes.load(Relaxed), 0);
    assert!(e.stats.prefix_invalidated_positions.load(Relaxed) >= 40);
    // A continuation admitted after the update recomputes everything with the new weights.
    let mut next = p.clone();
    next.extend(&first);
    next.extend(tokens(6, 4));
    let before = e.stats.prefix_reused_tokens.load(Relaxed);
    let (toks, lps, v1) = run(&e, greedy(next.clone(), 6));
    assert_eq!(e.stats.prefix_reused_tokens.load(Relaxed), before);
    assert_eq!(v1, 1);
    let single = generate(&new_weights, &greedy(next.clone(), 6), |_, _| true).unwrap();
    assert_eq!(toks, single.tokens);
    assert_close(&lps, &single.logprobs, "after the update");
    // What the new weights computed is cached and reused again.
    let (again, _, _) = run(&e, greedy(next, 6));
    assert_eq!(again, single.tokens);
    assert!(e.stats.prefix_reused_tokens.load(Relaxed) > before);
}

#[test]
fn memory_returns_to_the_budget_after_64_concurrent_sessions_end() {
    let dir = tempfile::tempdir().unwrap();
    let positions = 16 * 256;
    let cap = 300 * BYTES_PER_POSITION;
    let e = engine(model(dir.path(), 7), cap, 16, positions);
    assert_eq!(
        e.stats.kv_allocated_bytes.load(Relaxed),
        0,
        "nothing held at start"
    );
    let budget = positions * BYTES_PER_POSITION;
    let system = tokens(2, 24);
    let sessions: Vec<_> = (0..64)
        .map(|s| {
            let e = e.clone();
            let mut prompt = system.clone();
            prompt.extend(tokens(200 + s, 8));
            std::thread::spawn(move || {
                for turn in 0..3 {
                    let (toks, _, _) = run(&e, greedy(prompt.clone(), 6));
                    prompt.extend(&toks);
                    prompt.extend(tokens(s + turn, 5));
                }
            })
        })
        .collect();
    let mut peak = 0;
    while !sessions.iter().all(|h| h.is_finished()) {
        peak = peak.max(e.stats.kv_allocated_bytes.load(Relaxed));
        std::thread::sleep(Duration::from_millis(2));
    }
    for h in sessions {
        h.join().unwrap();
    }
    assert!(peak > 0 && peak <= budget, "peak {peak} of {budget}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats.running.load(Relaxed) != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The slots are given back; only the prefix cache (within its cap) stays.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(e.stats.kv_bytes.load(Relaxed), 0);
    let held = e.stats.kv_allocated_bytes.load(Relaxed);
    assert_eq!(held, e.stats.prefix_bytes.load(Relaxed));
    assert!(held <= cap, "{held} > {cap}");
    assert!(e.stats.prefix_reused_tokens.load(Relaxed) > 0);
}

/// Resident memory of a process, from /proc (Linux).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn an_idle_smollm2_server_holds_no_kv_slots_and_stays_under_2_gb() {
    common::smollm2_path();
    let dir = tempfile::tempdir().unwrap();
    let mut s = common::peer::Peer::start(
        "server",
        dir.path(),
        &[
            "--role",
            "server",
            "--model",
            "smollm2",
            "--http",
            "127.0.0.1:0",
        ],
    );
    let http = s.http_url(Duration::from_secs(180));
    s.wait_serving(Duration::from_secs(60));
    let kv = |name: &str| common::peer::metric(&http, &format!("{name}{{model=\"smollm2\"}}"));
    assert_eq!(kv("agentjet_engine_kv_allocated_bytes"), Some(0.0));
    let idle = rss_bytes(s.child.id());
    println!("idle server: {:.2} GB resident", idle as f64 / 1e9);
    assert!(idle < 2_000_000_000, "idle server holds {idle} bytes");
    // A request takes KV memory and gives the slots back when it ends (the prefix cache
    // keeps what it computed).
    let (st, body) = common::peer::http(
        &http,
        "POST",
        "/v1/completions",
        Some(
            &serde_json::json!({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8}),
        ),
    );
    assert_eq!(st, 200, "{body}");
    common::peer::wait_until("slots given back", Duration::from_secs(10), || {
        kv("agentjet_engine_kv_allocated_bytes") == kv("agentjet_prefix_cache_bytes")
    });
}

/// Qwen3.5 (the HF-built tiny model): a multi-turn session's earlier turns come from the
/// prefix cache, keys and values of the attention layer and the linear-attention layers'
/// states where the cached turn ended, and each turn gets what a cold engine and
/// one-at-a-time generation give. Two sessions share a system prompt, so the cache splits a
/// block where they part (no state there: nobody resumes mid-block).
#[test]
fn qwen3_5_sessions_resume_from_cached_linear_states_and_match_a_cold_engine() {
    let dir = tempfile::tempdir().unwrap();
    let load = || crate::families::reference("qwen3_5", dir.path()).0;
    let cached = engine(load(), 1 << 22, 4, 16 * 256);
    let cold = engine(load(), 0, 4, 16 * 256);
    let reference = load();
    let vocab = 272;
    let toks = |seed: usize, n: usize| -> Vec<u32> {
        (0..n)
            .map(|t| ((t * 37 + seed * 11) % (vocab - 3)) as u32 + 3)
            .collect()
    };
    let system = toks(1, 20);
    let mut expected_reuse = 0u64;
    let mut turns_run = 0u64;
    for s in 0..2 {
        let mut prompt = system.clone();
        prompt.extend(toks(10 + s, 10));
        let mut previous: Option<usize> = None;
        for turn in 0..4 {
            let a = run(&cached, greedy(prompt.clone(), 8));
            let b = run(&cold, greedy(prompt.clone(), 8));
            assert_eq!(a.0, b.0, "session {s} turn {turn}: tokens");
            assert_close(&a.1, &b.1, &format!("session {s} turn {turn}"));
            let single = generate(&reference, &greedy(prompt.clone(), 8), |_, _| true).unwrap();
            assert_eq!(
                a.0, single.tokens,
                "session {s} turn {turn}: against generate"
            );
            assert_close(&a.1, &single.logprobs, "against generate");
            if let Some(len) = previous {
                // The previous prompt and all but the last answer token (never fed back).
                expected_reuse += (len + 7) as u64;
            }
            previous = Some(prompt.len());
            turns_run += 1;
            prompt.extend(&a.0);
            prompt.extend(toks(100 + 7 * s + turn, 6));
        }
    }
    let reused = stat(&cached, |s| s.prefix_reused_tokens.load(Relaxed));
    let prefilled = stat(&cached, |s| s.prefill_tokens.load(Relaxed));
    let cold_prefilled = stat(&cold, |s| s.prefill_tokens.load(Relaxed));
    assert_eq!(reused + prefilled, cold_prefilled);
    assert_eq!(reused, expected_reuse, "reused positions");
    assert_eq!(stat(&cached, |s| s.prefix_lookups.load(Relaxed)), turns_run);
}
