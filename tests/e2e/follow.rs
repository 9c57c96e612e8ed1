//! Rollout peers with real processes on 127.0.0.1: servers started with `--follow` serve
//! their training group's latest policy version without training. Each version reaches
//! them through the weight broadcast (a manifest from a member, the changed chunks from
//! every holder), the calls they sign are trained on by the group, a follower goes on
//! when a trainer dies and one that starts late catches up, and a tampered chunk is
//! rejected with its sender named.

use crate::common;
use crate::elastic::{client, consumed, server, tiny_model, two_servers};

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use agentjet::server::ServerEvent;
use common::peer::{metric, wait_until, Peer};

/// Chunks of 16 KiB: the tiny model's ~330 KB are some 20 chunks, spread over the sources.
const CHUNKS: [&str; 2] = ["--weights-chunk-kib", "16"];

fn follower(dir: &Path, model: &Path, name: &str, boot: &str, extra: &[&str]) -> Peer {
    let mut args = vec!["--follow"];
    args.extend(CHUNKS);
    args.extend(extra);
    server(dir, model, name, Some(boot), &args)
}

/// A server's dashboard base URL (from its event).
fn dashboard(p: &mut Peer) -> String {
    match p.wait_event("the dashboard", Duration::from_secs(60), |e| {
        matches!(e, ServerEvent::Dashboard { .. })
    }) {
        ServerEvent::Dashboard { addr } => format!("http://{addr}"),
        e => unreachable!("{e:?}"),
    }
}

/// Each version a follower served of model `tiny`: version -> (param hash, bytes by source).
fn followed(p: &Peer) -> BTreeMap<u64, (String, BTreeMap<String, u64>)> {
    followed_of(p, "tiny")
}

/// Each version a follower served of `model`.
fn followed_of(p: &Peer, model: &str) -> BTreeMap<u64, (String, BTreeMap<String, u64>)> {
    p.events()
        .into_iter()
        .filter_map(|e| match e {
            ServerEvent::Followed {
                model: m,
                version,
                param_hash,
                bytes_by_source,
                ..
            } if m == model => Some((version, (param_hash, bytes_by_source))),
            _ => None,
        })
        .collect()
}

/// The group's parameter hash (hex8) after each step of a trainer of model `tiny`:
/// version -> hash.
fn trained(p: &Peer) -> BTreeMap<u64, String> {
    trained_of(p, "tiny")
}

/// The same for `model`.
fn trained_of(p: &Peer, model: &str) -> BTreeMap<u64, String> {
    p.events()
        .into_iter()
        .filter_map(|e| match e {
            ServerEvent::TrainStep {
                model: m,
                version,
                params: Some(h),
                ..
            } if m == model => Some((version, h[..16].to_string())),
            _ => None,
        })
        .collect()
}

/// Waits until `f` serves `version` (its event).
fn wait_version(f: &mut Peer, version: u64, timeout: Duration) {
    f.wait_event(
        &format!("version {version} followed"),
        timeout,
        |e| matches!(e, ServerEvent::Followed { version: v, .. } if *v >= version),
    );
}

/// Waits until trainer `a` (data directory `d/a`) trained every episode it stored.
fn wait_all_trained(a: &Peer, d: &Path) {
    wait_all_trained_of(a, d, "tiny")
}

/// The same for `model` (its ledger is `d/a/runs/MODEL/consumed.log`).
fn wait_all_trained_of(a: &Peer, d: &Path, model: &str) {
    let ledger = d.join("a/runs").join(model).join("consumed.log");
    wait_until(
        &format!("every stored episode of {model} trained"),
        Duration::from_secs(60),
        || {
            let stored = a
                .events()
                .iter()
                .filter(|e| matches!(e, ServerEvent::EpisodeStored { model: m, .. } if m == model))
                .count();
            let used = std::fs::read_to_string(&ledger)
                .unwrap_or_default()
                .lines()
                .count();
            stored > 0 && used >= stored
        },
    );
}

/// Every version each follower served has the group's parameter hash of that version.
fn assert_hashes_match(group: &BTreeMap<u64, String>, followers: &[(&str, &Peer)]) {
    for (name, f) in followers {
        for (v, (h, _)) in followed(f) {
            if let Some(want) = group.get(&v) {
                assert_eq!(
                    &h, want,
                    "follower {name} serves version {v} with parameters {h}, the group's are {want}"
                );
            }
        }
    }
}

#[test]
fn followers_serve_every_step_of_their_group_and_the_calls_they_sign_are_trained() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // The trainer runs 2 calls at once: with more, its gossiped load sends new groups to
    // the followers.
    let mut a = server(
        d,
        &model,
        "a",
        None,
        &[&CHUNKS[..], &["--groups-per-step", "1", "--max-batch", "2"]].concat(),
    );
    let boot = a.addr();
    a.wait_serving(Duration::from_secs(120));
    let mut f1 = follower(d, &model, "f1", &boot, &[]);
    let mut f2 = follower(d, &model, "f2", &boot, &[]);
    for f in [&mut f1, &mut f2] {
        f.wait_serving(Duration::from_secs(120));
        // The trainer's version at its start (0), before any step.
        wait_version(f, 0, Duration::from_secs(60));
    }
    // Enough groups to outlast the client's first provider lookups (it routes to the
    // followers once its refreshed list names them).
    let mut c = client(d, &boot, 24, "run");
    c.wait_client_event("the end", Duration::from_secs(300), |e| {
        matches!(e, agentjet::client::ClientEvent::Finished { .. })
    });
    // Every step the trainer took is served by both followers, with its parameters.
    wait_all_trained(&a, d);
    let group = trained(&a);
    let newest = *group.keys().max().expect("the trainer took steps");
    assert!(newest >= 2, "the trainer took {newest} steps");
    for f in [&mut f1, &mut f2] {
        wait_version(f, newest, Duration::from_secs(60));
    }
    assert_hashes_match(&group, &[("f1", &f1), ("f2", &f2)]);
    // Their dashboards' /metrics say the version, the lag and the bytes moved; the
    // trainer's, what it served.
    for f in [&mut f1, &mut f2] {
        let dash = dashboard(f);
        wait_until("the follower's metrics", Duration::from_secs(30), || {
            metric(&dash, "agentjet_weights_version") == Some(newest as f64)
                && metric(&dash, "agentjet_weights_lag") == Some(0.0)
                && metric(&dash, "agentjet_weights_fetched_bytes_total").is_some_and(|b| b > 0.0)
        });
    }
    let served = metric(&dashboard(&mut a), "agentjet_weights_served_bytes_total");
    assert!(served.is_some_and(|b| b > 0.0), "{served:?}");
    let published: Vec<String> = a
        .log_text()
        .lines()
        .filter(|l| l.contains("published policy version") || l.contains("weights source"))
        .map(String::from)
        .collect();
    for (name, f) in [("f1", &mut f1), ("f2", &mut f2)] {
        let seen = followed(f);
        assert!(
            seen.keys().filter(|v| group.contains_key(v)).count() >= 2,
            "follower {name} served versions {:?} of the group's {:?}; its stdout:\n{}\n\
             its log:\n{}\nthe trainer's versions:\n{}",
            seen.keys().collect::<Vec<_>>(),
            group.keys().collect::<Vec<_>>(),
            f.stdout_so_far().join("\n"),
            f.log_text(),
            published.join("\n")
        );
        assert_eq!(seen.keys().max(), Some(&newest), "follower {name}");
    }
    // A second run, now that the followers serve a fetched version (the first run's
    // calls may all have reached them before their first fetch, when the load sent the
    // client there early).
    let mut c2 = client(d, &boot, 8, "run2");
    c2.wait_client_event("the end", Duration::from_secs(300), |e| {
        matches!(e, agentjet::client::ClientEvent::Finished { .. })
    });
    wait_all_trained(&a, d);
    // The calls the followers signed were stored and trained, with their versions.
    let ids: HashSet<String> = [f1.peer_id(), f2.peer_id()].into_iter().collect();
    let taken: HashSet<String> = consumed(d, "a").into_values().flatten().collect();
    let mut on_followers = 0;
    let mut versions = HashSet::new();
    for e in a.events() {
        if let ServerEvent::EpisodeStored { episode, calls, .. } = e {
            for (signer, v) in calls {
                if ids.contains(&signer) {
                    assert!(
                        taken.contains(&episode),
                        "episode {episode} was not trained"
                    );
                    on_followers += 1;
                    versions.insert(v);
                }
            }
        }
    }
    assert!(
        on_followers > 0,
        "no call the trainer stored was signed by a follower; trainer log:\n{}",
        a.log_text()
    );
    eprintln!("{on_followers} calls sampled on followers, at versions {versions:?}");
    // Some at a version the followers fetched (not only the one they started from).
    assert!(
        versions.iter().any(|&v| v >= 1),
        "the followers' calls were all at versions {versions:?}"
    );
    c.kill9();
    c2.kill9();
}

/// A greedy answer's tokens and logprobs from a server's HTTP API (model `tiny`).
fn greedy(p: &mut Peer) -> Vec<(String, f64)> {
    greedy_of(p, "tiny")
}

/// The same for `model`.
fn greedy_of(p: &mut Peer, model: &str) -> Vec<(String, f64)> {
    let base = p.http_url(Duration::from_secs(60));
    let req = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": true,
    });
    let (status, body) = common::peer::http(&base, "POST", "/v1/chat/completions", Some(&req));
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs: {body}"))
        .iter()
        .map(|t| {
            (
                t["token"].as_str().unwrap().to_string(),
                t["logprob"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_follower_of_an_adapter_group_fetches_only_the_adapter_and_answers_as_the_trainer() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let lora = ["--lora-rank", "4"];
    let mut a = server(
        d,
        &model,
        "a",
        None,
        &[
            &CHUNKS[..],
            &lora,
            &["--groups-per-step", "1", "--max-batch", "2"],
        ]
        .concat(),
    );
    let boot = a.addr();
    a.wait_serving(Duration::from_secs(120));
    let mut f = follower(d, &model, "f", &boot, &lora);
    // A follower whose adapter has another rank than the group's refuses its versions
    // before fetching them, and says why.
    let mut other = follower(d, &model, "other", &boot, &["--lora-rank", "8"]);
    f.wait_serving(Duration::from_secs(120));
    wait_version(&mut f, 0, Duration::from_secs(60));
    wait_until("the refusal", Duration::from_secs(120), || {
        other.log_text().contains("version 0 not served")
    });
    let log = other.log_text();
    assert!(
        log.contains("tensor 0 is [4, 64] there and [8, 64] here") && log.contains("--lora-rank"),
        "{log}"
    );
    let mut c = client(d, &boot, 12, "run");
    c.wait_client_event("the end", Duration::from_secs(300), |e| {
        matches!(e, agentjet::client::ClientEvent::Finished { .. })
    });
    wait_all_trained(&a, d);
    let group = trained(&a);
    let newest = *group.keys().max().expect("the trainer took steps");
    assert!(newest >= 2, "the trainer took {newest} steps");
    wait_version(&mut f, newest, Duration::from_secs(60));
    assert_hashes_match(&group, &[("f", &f)]);
    // Only the adapter travelled: rank 4 on q, k, v, o, gate, up and down of the tiny
    // model's 2 layers, in float32 (the whole model is some 324 KB).
    let t = common::Tiny::default();
    let (h, q, kv, i) = (t.hidden, t.hidden, t.kv_heads * t.head_dim(), t.inter);
    let per_layer = (h + q) * 2 + (h + kv) * 2 + (h + i) * 3;
    let adapter_bytes = (4 * per_layer * t.layers * 4) as u64;
    let sizes: Vec<u64> = f
        .events()
        .into_iter()
        .filter_map(|e| match e {
            ServerEvent::Followed { full_bytes, .. } => Some(full_bytes),
            _ => None,
        })
        .collect();
    assert!(
        !sizes.is_empty() && sizes.iter().all(|&b| b == adapter_bytes),
        "versions of {sizes:?} bytes, the adapter has {adapter_bytes}"
    );
    // The follower answers as the trainer does (both at the newest version), and the
    // adapter moved the answer away from the base's (which the other follower serves).
    let (ours, theirs, base) = (greedy(&mut f), greedy(&mut a), greedy(&mut other));
    let tokens = |x: &[(String, f64)]| x.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&ours), tokens(&theirs));
    let gap = |x: &[(String, f64)], y: &[(String, f64)]| {
        x.iter()
            .zip(y)
            .map(|(a, b)| (a.1 - b.1).abs())
            .fold(0.0f64, f64::max)
    };
    assert!(
        gap(&ours, &theirs) < 1e-5,
        "{ours:?} vs the trainer's {theirs:?}"
    );
    eprintln!(
        "follower vs trainer: {:e}; trainer vs base: {:e}",
        gap(&ours, &theirs),
        gap(&theirs, &base)
    );
    assert!(
        tokens(&theirs) != tokens(&base) || gap(&theirs, &base) > 1e-4,
        "the trained adapter answers as the base: {theirs:?} vs {base:?}"
    );
    assert!(
        followed(&other).is_empty(),
        "the other rank's follower served a version"
    );
    c.kill9();
}

/// A server training several adapters on one base (`--adapter`) and a follower of the same
/// adapters: each adapter is a model of its own with its own training group, and the
/// follower follows each group, serving every adapter as its trainer does. (A swarm key:
/// a run's certificate names one model.)
#[test]
fn a_follower_of_several_adapters_follows_each_adapters_group() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let key = d.join("swarm.key");
    std::fs::write(&key, agentjet::swarm::SwarmKey::generate().to_file_text()).unwrap();
    let key = key.to_str().unwrap();
    let bank = [
        "--lora-rank",
        "4",
        "--adapter",
        "tiny-a",
        "--adapter",
        "tiny-b",
        "--swarm-key",
        key,
    ];
    let mut a = server(
        d,
        &model,
        "a",
        None,
        &[
            &CHUNKS[..],
            &bank,
            &["--groups-per-step", "1", "--max-batch", "2"],
        ]
        .concat(),
    );
    let boot = a.addr();
    a.wait_serving(Duration::from_secs(120));
    let mut f = follower(d, &model, "f", &boot, &bank);
    f.wait_serving(Duration::from_secs(120));
    let models = ["tiny-a", "tiny-b"];
    wait_until("both adapters' version 0", Duration::from_secs(60), || {
        models.iter().all(|m| !followed_of(&f, m).is_empty())
    });
    // A client whose agent calls both adapters and rewards each.
    let agent = d.join("agent-duo.sh");
    std::fs::write(&agent, crate::client::TWO_MODEL_AGENT).unwrap();
    let tasks = d.join("tasks-duo.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| format!("{{\"id\": \"t{i}\", \"data\": {{\"i\": {i}}}}}"))
        .collect();
    std::fs::write(&tasks, lines.join("\n") + "\n").unwrap();
    let (agent_cmd, run_dir) = (format!("sh {}", agent.display()), d.join("duo"));
    let mut c = Peer::start(
        "duo",
        d,
        &[
            "--role",
            "client",
            "--bootstrap",
            &boot,
            "--model",
            "tiny-a",
            "--model",
            "tiny-b",
            "--agent",
            &agent_cmd,
            "--tasks",
            tasks.to_str().unwrap(),
            "--num-repeat",
            "4",
            "--concurrency",
            "4",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--swarm-key",
            key,
        ],
    );
    assert!(c.child.wait().unwrap().success(), "{}", c.log_text());
    for m in models {
        wait_all_trained_of(&a, d, m);
    }
    // Each adapter trained, and the follower serves each one's newest version with the
    // trainer's parameters (and every version it served had them).
    wait_until(
        "the follower at each adapter's newest version",
        Duration::from_secs(120),
        || {
            models.iter().all(|m| {
                let group = trained_of(&a, m);
                let seen = followed_of(&f, m);
                group
                    .keys()
                    .max()
                    .is_some_and(|v| *v >= 1 && seen.get(v).map(|x| &x.0) == group.get(v))
            })
        },
    );
    for m in models {
        let group = trained_of(&a, m);
        eprintln!(
            "{m}: trained versions {:?}, followed {:?}",
            group.keys().collect::<Vec<_>>(),
            followed_of(&f, m).keys().collect::<Vec<_>>()
        );
        for (v, (h, _)) in followed_of(&f, m) {
            if let Some(want) = group.get(&v) {
                assert_eq!(&h, want, "{m}: version {v}");
            }
        }
        // Both serve the adapter alike (the trainer's engine swaps its versions in too).
        let (ours, theirs) = (greedy_of(&mut f, m), greedy_of(&mut a, m));
        let tokens = |x: &[(String, f64)]| x.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        assert_eq!(tokens(&ours), tokens(&theirs), "{m}");
    }
    // The two adapters trained apart: their newest parameters differ.
    let newest = |m: &str| trained_of(&a, m).into_iter().next_back().map(|x| x.1);
    assert_ne!(newest("tiny-a"), newest("tiny-b"));
}

#[test]
fn a_follower_goes_on_when_a_trainer_dies_and_a_late_one_catches_up_from_its_peers() {
    let _lane = common::heavy();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // One group per step; a round with a dead member fails within 4 s.
    let extra = [
        &CHUNKS[..],
        &["--groups-per-step", "1", "--collective-timeout", "4"],
    ]
    .concat();
    let (mut a, mut b, boot) = two_servers(d, &model, &extra);
    let mut f1 = follower(d, &model, "f1", &boot, &[]);
    f1.wait_serving(Duration::from_secs(120));
    let mut c = client(d, &boot, 64, "run");
    // A few steps, then a second follower starts: it takes the version from the members
    // and from f1, which holds it.
    b.wait_event(
        "step 2",
        Duration::from_secs(300),
        |e| matches!(e, ServerEvent::TrainStep { version, .. } if *version >= 2),
    );
    let at = trained(&b).keys().max().copied().unwrap_or(0);
    wait_version(&mut f1, at, Duration::from_secs(60));
    let mut f2 = follower(d, &model, "f2", &boot, &[]);
    wait_version(&mut f2, at, Duration::from_secs(120));
    let f1_id = f1.peer_id();
    let first = followed(&f2);
    let (v0, (_, from)) = first.iter().next().expect("f2 followed a version");
    assert!(
        *v0 >= at,
        "f2 started at version {v0}, the group was at {at}"
    );
    assert!(
        from.get(&f1_id).is_some_and(|&n| n > 0),
        "f2 fetched its first version from {from:?}, not from f1 ({f1_id})"
    );
    // The trainer a dies; b trains on, and both followers keep following.
    let a_id = a.peer_id();
    a.kill9();
    let killed_at = trained(&b).keys().max().copied().unwrap_or(0);
    let after = killed_at + 1;
    b.wait_event(
        "a step after the kill",
        Duration::from_secs(300),
        |e| matches!(e, ServerEvent::TrainStep { version, .. } if *version >= after),
    );
    for f in [&mut f1, &mut f2] {
        wait_version(f, after, Duration::from_secs(120));
    }
    let group = trained(&b);
    assert_hashes_match(&group, &[("f1", &f1), ("f2", &f2)]);
    for (name, f) in [("f1", &f1), ("f2", &f2)] {
        for (v, (_, from)) in followed(f).range(killed_at + 1..) {
            assert!(
                !from.contains_key(&a_id),
                "follower {name} fetched version {v} from the dead trainer: {from:?}"
            );
        }
    }
    c.kill9();
}

#[test]
fn a_tampered_chunk_is_rejected_and_its_sender_named() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let mut a = server(d, &model, "a", None, &CHUNKS);
    let boot = a.addr();
    a.wait_serving(Duration::from_secs(120));
    // A follower that serves every chunk with a byte changed; it holds version 0 first.
    let mut liar = follower(d, &model, "liar", &boot, &["--test-tamper-chunks"]);
    wait_version(&mut liar, 0, Duration::from_secs(120));
    let liar_id = liar.peer_id();
    let mut honest = follower(d, &model, "honest", &boot, &[]);
    let backed = honest.wait_event("the liar backed off", Duration::from_secs(120), |e| {
        matches!(e, ServerEvent::SourceBackedOff { .. })
    });
    match backed {
        ServerEvent::SourceBackedOff { peer, reason, .. } => {
            assert_eq!(
                peer, liar_id,
                "the backed-off source is not the liar: {reason}"
            );
            assert!(reason.contains("hash"), "{reason}");
        }
        e => unreachable!("{e:?}"),
    }
    // It still serves version 0, with the parameters the liar itself holds.
    wait_version(&mut honest, 0, Duration::from_secs(60));
    let good = followed(&honest);
    let (hash, from) = &good[&0];
    assert_eq!(hash, &followed(&liar)[&0].0);
    assert!(
        !from.contains_key(&liar_id),
        "a chunk from the liar was kept: {from:?}"
    );
}
