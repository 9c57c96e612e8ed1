//! Several adapters served at once on one base: one engine batch mixes requests of three
//! adapters (of different ranks, targets and scalings) and of the base, and each request
//! gets what it gets alone; a bank adapter computes what the same adapter attached to the
//! model computes; the prefix cache never gives one adapter's keys to another; and a
//! weight update of one adapter changes only that adapter's requests and version.

use crate::common;

use agentjet::engine::{
    generate, spawn_engine, Completed, EngineConfig, EngineHandle, GenerateRequest, SamplingParams,
};
use agentjet::model::llama::lora::{Adapter, LoraConfig, Target};
use agentjet::model::llama::{DType, Llama};
use common::*;
use tch::{Device, Tensor};

fn tiny() -> Tiny {
    Tiny {
        tied: false,
        max_pos: 128,
        seed: 23,
        ..Tiny::default()
    }
}

/// The three adapters: (config, seed).
fn configs() -> Vec<(LoraConfig, u64)> {
    let mut qv = LoraConfig::new(8);
    qv.targets = vec![Target::Q, Target::V];
    let mut mlp = LoraConfig::new(2);
    mlp.targets = vec![Target::Gate, Target::Up, Target::Down];
    mlp.rslora = true;
    vec![(LoraConfig::new(4), 11), (qv, 12), (mlp, 13)]
}

/// Random values for every B (a new adapter's B is zero), from `seed`.
fn randomize_b(tensors: Vec<Tensor>, seed: u64) {
    randomize_lora_b(tensors, seed, 0.4);
}

/// The base with the three adapters in its bank.
fn banked(dir: &std::path::Path) -> Llama {
    let mut m = tiny().load(dir, Device::Cpu, DType::F32);
    for (cfg, seed) in configs() {
        let a = Adapter::new(&m.config, cfg, seed, Device::Cpu).unwrap();
        randomize_b(a.tensors(), seed);
        a.changed();
        m.add_served_adapter(a).unwrap();
    }
    m
}

/// Eight requests: two per source (base, adapters 0, 1, 2). Requests 0, 2, 4 and 6 share
/// one prompt of 40 tokens (a prefix the cache would hand across adapters if it were not
/// keyed by adapter); request 5 samples with a seed.
fn requests() -> Vec<GenerateRequest> {
    let shared: Vec<u32> = (0..40).map(|t| ((t * 13 + 5) % 290) as u32 + 3).collect();
    (0..8)
        .map(|i| GenerateRequest {
            prompt: if i % 2 == 0 {
                shared.clone()
            } else {
                (0..(4 + 3 * i))
                    .map(|t| ((t * 31 + i * 7) % 290) as u32 + 3)
                    .collect()
            },
            max_tokens: 6 + i,
            sampling: if i == 5 {
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
            adapter: [None, Some(0), Some(1), Some(2)][i / 2],
            ..Default::default()
        })
        .collect()
}

fn run(engine: &EngineHandle, reqs: &[GenerateRequest]) -> Vec<Completed> {
    let mut rxs: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    rxs.iter_mut()
        .map(|rx| Completed::collect(rx).unwrap())
        .collect()
}

fn engine(model: Llama) -> EngineHandle {
    spawn_engine(
        model,
        EngineConfig {
            max_batch: 16,
            ..Default::default()
        },
    )
    .unwrap()
}

fn same(a: &Completed, b: &Completed, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.reason, b.reason, "{what}: finish");
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() <= 1e-5, "{what}: logprob {x} vs {y}");
    }
}

#[test]
fn a_batch_mixing_three_adapters_and_the_base_gives_each_request_what_it_gets_alone() {
    let dir = tempfile::tempdir().unwrap();
    let reqs = requests();
    // Alone: each request on an engine of its own (nothing else in the batch or cache).
    let alone: Vec<Completed> = reqs
        .iter()
        .map(|r| run(&engine(banked(dir.path())), std::slice::from_ref(r)).remove(0))
        .collect();
    // Together: one engine, all eight admitted into one batch; then all eight again on
    // the same engine, now with their prompts in the prefix cache.
    let shared = engine(banked(dir.path()));
    let together = run(&shared, &reqs);
    let again = run(&shared, &reqs);
    assert!(
        shared
            .stats
            .prefix_hits
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "the second round reused cached prefixes"
    );
    for i in 0..reqs.len() {
        same(
            &together[i],
            &alone[i],
            &format!("request {i} in the mixed batch"),
        );
        same(
            &again[i],
            &alone[i],
            &format!("request {i} from the prefix cache"),
        );
    }
    // The adapters matter: the four sources give four different answers to one prompt.
    for i in [2, 4, 6] {
        assert_ne!(
            alone[i].logprobs, alone[0].logprobs,
            "request {i}'s adapter changes its output"
        );
    }
    assert_ne!(alone[2].logprobs, alone[4].logprobs);
    assert_ne!(alone[4].logprobs, alone[6].logprobs);
    // A bank adapter computes what the same adapter attached to the model computes (the
    // per-target path, which the PEFT tests check), and the base what the plain model does.
    for (i, req) in reqs.iter().enumerate() {
        let mut m = tiny().load(dir.path(), Device::Cpu, DType::F32);
        if let Some(a) = req.adapter {
            let (cfg, seed) = configs().remove(a);
            m.attach_adapter(cfg, seed).unwrap();
            randomize_b(m.parameters(), seed);
        }
        let plain = GenerateRequest {
            adapter: None,
            ..req.clone()
        };
        let g = generate(&m, &plain, |_, _| true).unwrap();
        assert_eq!(
            g.tokens, alone[i].tokens,
            "request {i} against an attached adapter"
        );
        for (x, y) in g.logprobs.iter().zip(&alone[i].logprobs) {
            assert!((x - y).abs() < 1e-4, "request {i}: {x} vs {y}");
        }
    }
}

#[test]
fn a_weight_update_of_one_adapter_changes_only_its_requests_and_version() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(banked(dir.path()));
    let reqs = requests();
    let before = run(&e, &reqs);
    // Adapter 1 gets other values (as a training step would bring).
    let new = Adapter::new(
        &tiny_config(dir.path()),
        configs()[1].0.clone(),
        99,
        Device::Cpu,
    )
    .unwrap();
    randomize_b(new.tensors(), 99);
    e.update_weights_of(Some(1), &new.tensors(), 7).unwrap();
    let after = run(&e, &reqs);
    for i in 0..reqs.len() {
        let want = if reqs[i].adapter == Some(1) { 7 } else { 0 };
        assert_eq!(after[i].policy_version, want, "request {i}'s version");
        if reqs[i].adapter == Some(1) {
            assert_ne!(after[i].logprobs, before[i].logprobs, "request {i} changed");
        } else {
            same(&after[i], &before[i], &format!("request {i} unchanged"));
        }
    }
    // An update of the wrong shape or of an adapter not served is refused.
    let err = e
        .update_weights_of(Some(0), &new.tensors(), 8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tensors") || err.contains("is ["), "{err}");
    let err = e
        .update_weights_of(Some(3), &new.tensors(), 8)
        .unwrap_err()
        .to_string();
    assert!(err.contains("adapter 3 is not served"), "{err}");
    // So is a request for an adapter not served.
    let mut rx = e
        .submit(GenerateRequest {
            adapter: Some(3),
            ..reqs[0].clone()
        })
        .unwrap();
    let err = Completed::collect(&mut rx).unwrap_err().to_string();
    assert!(err.contains("adapter 3 is not served here"), "{err}");
}

fn tiny_config(dir: &std::path::Path) -> agentjet::model::config::LlamaConfig {
    tiny().load(dir, Device::Cpu, DType::F32).config
}

/// The base with an adapter of its own (requests without a bank adapter take it) and the
/// three bank adapters: a mixed batch runs each adapter's rows with its own two products
/// (not the batched path), and each request still gets what it gets alone.
fn own_and_banked(dir: &std::path::Path) -> Llama {
    let mut m = banked(dir);
    m.attach_adapter(LoraConfig::new(3), 5).unwrap();
    randomize_b(m.parameters(), 5);
    m.parameters_changed().unwrap();
    m
}

#[test]
fn a_model_with_its_own_adapter_mixes_it_with_bank_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let reqs = requests();
    let alone: Vec<Completed> = reqs
        .iter()
        .map(|r| run(&engine(own_and_banked(dir.path())), std::slice::from_ref(r)).remove(0))
        .collect();
    let together = run(&engine(own_and_banked(dir.path())), &reqs);
    for i in 0..reqs.len() {
        same(
            &together[i],
            &alone[i],
            &format!("request {i} in the mixed batch"),
        );
    }
    // The own adapter applies to the requests without a bank adapter.
    let plain = run(&engine(banked(dir.path())), &reqs[..2]);
    assert_ne!(plain[0].logprobs, alone[0].logprobs);
}
