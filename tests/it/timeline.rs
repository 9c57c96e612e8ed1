//! Timelines and training layouts over random multi-turn episodes (turn counts, lengths,
//! history rewrites that break the merge, groups that share their prompt and sometimes
//! their first sampled tokens):
//! - every layout (per call, linear, tree) trains on every sampled token exactly once;
//! - on a tiny float32 model, each sampled token's logprob is the same under the three
//!   layouts (within 1e-4), and so are the loss and its gradient for every parameter;
//! - fragments round-trip, deduplicate within an episode and across a group (bytes counted),
//!   and a tampered or oversize fragment is refused naming its hash.

use crate::common;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use agentjet::base::Rng;
use agentjet::model::checkpoint::load_model;
use agentjet::model::llama::{DType, Llama};
use agentjet::model::ModelSource;
use agentjet::timeline::fragment::{
    fragment_timeline, Fragment, FragmentError, FragmentHash, MAX_FRAGMENT_BYTES,
    MAX_FRAGMENT_TOKENS,
};
use agentjet::timeline::layout::{pack, Layout, PackedRow, SampleKey};
use agentjet::timeline::{Call, Episode, EpisodeStatus};
use agentjet::train::target_logprobs;
use common::*;
use tch::{Device, Kind, Tensor};

const MODEL: &str = "m";

/// Shape of a random trace.
struct Shape {
    groups: usize,
    group_size: usize,
    max_turns: usize,
    prefix: usize,
    max_env: usize,
    max_gen: usize,
    /// Chance that a call's prompt rewrites history (drops earlier completions).
    break_p: f64,
}

fn uniform(rng: &mut Rng, lo: usize, hi: usize) -> usize {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize
}

fn tokens(rng: &mut Rng, n: usize, alphabet: u32) -> Vec<u32> {
    (0..n)
        .map(|_| 3 + (rng.next_u64() % alphabet as u64) as u32)
        .collect()
}

/// Random episodes: each group shares its prompt; generated tokens come from a small
/// alphabet so siblings sometimes sample the same first tokens.
fn random_batch(rng: &mut Rng, s: &Shape) -> Vec<Episode> {
    let mut out = Vec::new();
    for g in 0..s.groups {
        let prefix = tokens(rng, s.prefix, 200);
        for e in 0..s.group_size {
            let turns = uniform(rng, 1, s.max_turns);
            let mut history = prefix.clone(); // what the template renders, exactly
            let mut env_only = prefix.clone(); // history without completions
            let mut calls = Vec::new();
            for turn in 0..turns {
                // The first call's prompt is the group's prompt; later calls add the
                // environment's answer to the previous call.
                let env = if turn == 0 {
                    vec![]
                } else {
                    {
                        let n = uniform(rng, 1, s.max_env);
                        tokens(rng, n, 200)
                    }
                };
                history.extend_from_slice(&env);
                env_only.extend_from_slice(&env);
                if rng.next_f64() < s.break_p {
                    history = env_only.clone();
                }
                let n = uniform(rng, 1, s.max_gen);
                let gen = tokens(rng, n, 3);
                let logprobs = gen.iter().map(|_| -(rng.next_f64() as f32) * 3.0).collect();
                calls.push(Call {
                    model: MODEL.into(),
                    prompt_ids: history.clone(),
                    completion_ids: gen.clone(),
                    logprobs,
                    policy_version: 4,
                    signature: vec![],
                    // Agents change temperature and nucleus between calls: fragments
                    // and timelines carry each call's own.
                    sampling: agentjet::timeline::SamplingTransform {
                        temperature: [0.7, 1.0, 0.0][uniform(rng, 0, 2)],
                        top_p: [1.0, 0.9][uniform(rng, 0, 1)],
                        ..Default::default()
                    },
                });
                history.extend_from_slice(&gen);
            }
            out.push(Episode {
                id: format!("g{g}e{e}"),
                task_id: format!("task{g}"),
                group_id: format!("g{g}"),
                calls,
                reward: Some(rng.next_f64()),
                rewards: BTreeMap::new(),
                status: EpisodeStatus::Finished,
            });
        }
    }
    out
}

/// Every sampled token of the batch, named.
fn all_keys(batch: &[Episode]) -> BTreeSet<SampleKey> {
    let mut keys = BTreeSet::new();
    for (e, ep) in batch.iter().enumerate() {
        for (c, call) in ep.calls_of(MODEL).enumerate() {
            for i in 0..call.completion_ids.len() {
                keys.insert(SampleKey {
                    episode: e as u32,
                    call: c as u32,
                    index: i as u32,
                });
            }
        }
    }
    keys
}

fn with_advantages(batch: &[Episode]) -> Vec<(&Episode, f32)> {
    batch
        .iter()
        .enumerate()
        .map(|(i, e)| (e, (i as f32 * 0.37).sin()))
        .collect()
}

fn layouts(batch: &[Episode], budget: usize) -> Vec<(Layout, Vec<PackedRow>)> {
    let b = with_advantages(batch);
    [Layout::PerCall, Layout::Linear, Layout::Tree]
        .into_iter()
        .map(|l| (l, pack(MODEL, &b, l, budget).unwrap()))
        .collect()
}

#[test]
fn every_layout_trains_on_every_sampled_token_exactly_once() {
    let mut rng = Rng::seeded(11);
    for case in 0..200 {
        let shape = Shape {
            groups: uniform(&mut rng, 1, 3),
            group_size: uniform(&mut rng, 1, 5),
            max_turns: uniform(&mut rng, 1, 8),
            prefix: uniform(&mut rng, 1, 30),
            max_env: uniform(&mut rng, 1, 12),
            max_gen: uniform(&mut rng, 1, 10),
            break_p: [0.0, 0.2, 0.6][case % 3],
        };
        let batch = random_batch(&mut rng, &shape);
        let want = all_keys(&batch);
        let budget = uniform(&mut rng, 8, 400);
        let mut sizes = Vec::new();
        for (layout, rows) in layouts(&batch, budget) {
            let mut seen = BTreeSet::new();
            for row in &rows {
                assert_eq!(row.parent.len(), row.len());
                for t in &row.targets {
                    assert!(
                        seen.insert(t.key),
                        "case {case} {layout:?}: {:?} twice",
                        t.key
                    );
                    // the target's context is real: its parent chain is in the row
                    assert!((t.from as usize) < row.len());
                }
                // a row over budget holds one sequence only (a root count of 1)
                if row.len() > budget {
                    assert_eq!(row.parent.iter().filter(|&&p| p < 0).count(), 1);
                }
            }
            assert_eq!(seen, want, "case {case} {layout:?}");
            sizes.push(rows.iter().map(PackedRow::len).sum::<usize>());
        }
        // Merging never costs more tokens, nor does sharing prefixes (within a row).
        assert!(sizes[1] <= sizes[0], "case {case}: {sizes:?}");
        if budget >= 400 {
            assert!(sizes[2] <= sizes[1], "case {case}: {sizes:?}");
        }
        // Breaks are counted and no branch spans one: each branch's calls extend it.
        for ep in &batch {
            let t = ep.timeline(MODEL).unwrap();
            assert_eq!(t.branches.len(), t.breaks + 1);
        }
    }
}

fn tiny_model(dir: &std::path::Path) -> Llama {
    Tiny {
        vocab: 300,
        max_pos: 512,
        ..Tiny::default()
    }
    .write_hf_dir(dir);
    let mut m = load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        Device::Cpu,
        DType::F32,
    )
    .unwrap()
    .model;
    m.set_trainable(true);
    m
}

/// Each target's logprob, and the loss -Σ advantage * logprob / targets over all rows.
fn evaluate(model: &Llama, rows: &[PackedRow]) -> (HashMap<SampleKey, f64>, Tensor) {
    let mut lps = HashMap::new();
    let mut loss = Tensor::from(0f64);
    let total: usize = rows.iter().map(|r| r.targets.len()).sum();
    for row in rows {
        let lp = target_logprobs(model, row).unwrap().to_kind(Kind::Double);
        let adv = Tensor::from_slice(
            &row.targets
                .iter()
                .map(|t| t.advantage as f64)
                .collect::<Vec<_>>(),
        );
        loss -= (&lp * adv).sum(Kind::Double) / total as f64;
        let values: Vec<f64> = Vec::<f64>::try_from(&lp.detach()).unwrap();
        for (t, v) in row.targets.iter().zip(values) {
            lps.insert(t.key, v);
        }
    }
    (lps, loss)
}

#[test]
fn three_layouts_give_the_same_logprobs_loss_and_gradients() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let params = model.parameters();
    let mut rng = Rng::seeded(5);
    for case in 0..6 {
        let shape = Shape {
            groups: 2,
            group_size: 3,
            max_turns: 4,
            prefix: 12,
            max_env: 6,
            max_gen: 5,
            break_p: if case % 2 == 0 { 0.0 } else { 0.3 },
        };
        let batch = random_batch(&mut rng, &shape);
        let mut results = Vec::new();
        for (layout, rows) in layouts(&batch, [64, 100_000][case % 2]) {
            let (lps, loss) = evaluate(&model, &rows);
            let grads = Tensor::run_backward(&[&loss], &params, false, false);
            results.push((layout, lps, loss.double_value(&[]), grads));
        }
        let (_, base_lps, base_loss, base_grads) = &results[0];
        for (layout, lps, loss, grads) in &results[1..] {
            assert_eq!(lps.len(), base_lps.len());
            for (k, v) in base_lps {
                let d = (lps[k] - v).abs();
                assert!(d < 1e-4, "case {case} {layout:?} {k:?}: {} vs {v}", lps[k]);
            }
            assert!(
                (loss - base_loss).abs() < 1e-4,
                "case {case} {layout:?}: loss {loss} vs {base_loss}"
            );
            for (i, (g, b)) in grads.iter().zip(base_grads).enumerate() {
                let d = max_abs_diff(g, b);
                let scale = b.abs().max().double_value(&[]).max(1e-3);
                assert!(
                    d <= 1e-4 * scale.max(1.0),
                    "case {case} {layout:?} param {i}: grad differs by {d} (max {scale})"
                );
            }
        }
    }
}

#[test]
fn fragments_round_trip_dedup_and_refuse_tampering() {
    let mut rng = Rng::seeded(3);
    let shape = Shape {
        groups: 1,
        group_size: 8,
        max_turns: 12,
        prefix: 300,
        max_env: 60,
        max_gen: 20,
        break_p: 0.1,
    };
    let batch = random_batch(&mut rng, &shape);
    let mut group_store: HashMap<FragmentHash, Vec<u8>> = HashMap::new();
    let (mut per_call_bytes, mut episode_bytes) = (0usize, 0usize);
    for ep in &batch {
        let t = ep.timeline(MODEL).unwrap();
        let (manifest, store) = fragment_timeline(&t);
        // round trip through bytes, verified
        let mut received = HashMap::new();
        for (h, f) in &store {
            let bytes = f.encode();
            assert!(bytes.len() <= MAX_FRAGMENT_BYTES);
            received.insert(*h, Fragment::decode(h, &bytes).unwrap());
            episode_bytes += bytes.len();
            group_store.insert(*h, bytes);
        }
        assert_eq!(manifest.timeline(&received).unwrap(), t);
        // what shipping every call whole would cost
        per_call_bytes += ep
            .calls
            .iter()
            .map(|c| postcard::to_allocvec(c).unwrap().len())
            .sum::<usize>();
    }
    let group_bytes: usize = group_store.values().map(Vec::len).sum();
    println!(
        "8 episodes: calls shipped whole {per_call_bytes} B, fragments per episode {episode_bytes} B, fragments across the group {group_bytes} B"
    );
    assert!(episode_bytes * 2 < per_call_bytes, "dedup within episodes");
    assert!(
        group_bytes < episode_bytes,
        "siblings share their prompt fragments"
    );
    // The shared prompt is one fragment the whole group names.
    let first: BTreeSet<FragmentHash> = batch
        .iter()
        .map(|e| fragment_timeline(&e.timeline(MODEL).unwrap()).0.branches[0][0].hash)
        .collect();
    assert_eq!(first.len(), 1);

    // Tampering: a flipped byte is refused, naming the fragment.
    let (h, bytes) = group_store.iter().next().unwrap();
    let mut bad = bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    match Fragment::decode(h, &bad) {
        Err(e @ FragmentError::HashMismatch { .. }) => {
            assert!(e.to_string().contains(&h.to_string()))
        }
        other => panic!("tampered fragment: {other:?}"),
    }
    // Oversize: refused before hashing.
    let huge = vec![0u8; MAX_FRAGMENT_BYTES + 1];
    assert!(matches!(
        Fragment::decode(h, &huge),
        Err(FragmentError::Oversize { .. })
    ));
    // A fragment that hashes right but breaks the rules (too many tokens) is refused too.
    let too_long = Fragment {
        tokens: vec![1; MAX_FRAGMENT_TOKENS + 1],
        sampled: false,
        logprobs: vec![],
        version: 0,
        sampling: Default::default(),
    };
    let bytes = too_long.encode();
    let err = Fragment::decode(&too_long.hash(), &bytes).unwrap_err();
    assert!(
        matches!(
            err,
            FragmentError::Invalid { .. } | FragmentError::Oversize { .. }
        ),
        "{err:?}"
    );
    // A missing fragment is named when rebuilding.
    let t = batch[0].timeline(MODEL).unwrap();
    let (manifest, mut store) = fragment_timeline(&t);
    let gone = manifest.branches[0][0].hash;
    store.remove(&gone);
    assert_eq!(
        manifest.timeline(&store).unwrap_err(),
        FragmentError::Missing(gone)
    );
}
