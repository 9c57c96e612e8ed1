//! The crash harness: a training server is killed with SIGKILL at random moments while a
//! client submits episodes and the server trains and checkpoints after every step, and is
//! restarted after each kill. What a user would notice if durability were wrong:
//!
//! - an acknowledged episode missing from the server's disk after the kill (lost);
//! - an episode id twice in the run's `consumed.log` (trained twice into the weights);
//! - a checkpoint that does not load (the restart fails or does not resume);
//! - an acknowledged episode never trained once the server runs on;
//! - after the restarts, an episode acknowledged in the first run submitted again is
//!   acknowledged but not trained twice, and its signed call in another episode is refused
//!   (the replay ledger is rebuilt from the disk).
//!
//! SIGKILL leaves the kernel's page cache alone, so this shows the order of writes,
//! acknowledgements and ledger lines, not the fsyncs (only a power cut or a crashed
//! machine would).
//!
//! `AGENTJET_CRASH_ROUNDS` sets the number of kills (default 6 here; the 50 is
//! `AGENTJET_CRASH_ROUNDS=50 cargo test --release --test e2e crash`).

use crate::common;

use common::peer::Peer;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentjet::client::submit::{prepare, submit};
use agentjet::rpc::SubmitReply;
use agentjet::server::{read_stored_episodes, ServedModel, ServerEvent};
use agentjet::swarm::{PeerId, SwarmHandle};
use agentjet::timeline::Episode;

/// A free UDP port on loopback (the server listens on it in every run, so the client's
/// address for it stays right across restarts).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn tiny_model(dir: &Path) -> String {
    common::Tiny {
        max_pos: 4096,
        ..Default::default()
    }
    .write_hf_dir(&dir.join("tiny-model"))
    .to_str()
    .unwrap()
    .to_string()
}

/// Submits groups of two episodes (rewards 1 and 0) until a call or a submission fails;
/// every id the server acknowledged goes into `acked` (with its group), and the first
/// acknowledged episode into `first`.
async fn submit_until_error(
    h: SwarmHandle,
    server: PeerId,
    round: usize,
    acked: Arc<Mutex<Vec<(String, String)>>>,
    first: Arc<Mutex<Option<Episode>>>,
) {
    for k in 0.. {
        let group = format!("g{round}-{k}");
        for (j, reward) in [(0u32, 1.0), (1, 0.0)] {
            // A call of its own per episode: a prompt no other episode of the run has.
            let prompt = vec![
                5,
                6,
                10 + round as u32 % 200,
                10 + k % 200,
                10 + k / 200 % 200,
                10 + j,
            ];
            let Ok(call) = common::peer::signed_call(&h, server, prompt, 4, k as u64).await else {
                return;
            };
            let id = format!("{group}-{j}");
            let ep = Episode::single_call(id.clone(), "task".into(), group.clone(), call, reward);
            let (m, frags) = prepare(&ep, "tiny", 2).unwrap();
            match submit(&h, server, &m, &frags).await {
                Ok(o) => match o.reply {
                    SubmitReply::Stored { .. } => {
                        first.lock().unwrap().get_or_insert(ep.clone());
                        acked.lock().unwrap().push((id, group.clone()))
                    }
                    other => panic!("episode {id}: {other:?}"),
                },
                Err(_) => return,
            }
        }
    }
}

fn consumed(run_dir: &Path) -> Vec<String> {
    std::fs::read_to_string(run_dir.join("consumed.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once('\t').map(|(_, id)| id.to_string()))
        .collect()
}

#[test]
fn a_server_killed_at_random_moments_loses_no_acknowledged_episode_and_trains_none_twice() {
    let _lane = common::light();
    let rounds: usize = std::env::var("AGENTJET_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let port = free_udp_port();
    let listen = format!("/ip4/127.0.0.1/udp/{port}/quic-v1");
    let args: Vec<&str> = vec![
        "--role",
        "server",
        "--model",
        &model,
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--listen",
        &listen,
        "--num-repeat",
        "2",
        "--groups-per-step",
        "1",
        "--checkpoint-every",
        "1",
        "--learning-rate",
        "1e-3",
    ];
    let data = dir.path().join("server");
    let (episodes_dir, run_dir) = (data.join("episodes/tiny"), data.join("runs/tiny"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let acked: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let first: Arc<Mutex<Option<Episode>>> = Arc::default();
    let mut rng = agentjet::base::Rng::seeded(33);
    let (mut client, mut server_id) = (None::<SwarmHandle>, None::<PeerId>);
    let (mut steps_seen, mut resumed) = (Vec::new(), 0);
    for round in 0..=rounds {
        let mut server = Peer::start("server", dir.path(), &args);
        server.wait_serving(Duration::from_secs(120));
        let training = server.wait_event("training", Duration::from_secs(60), |e| {
            matches!(e, ServerEvent::Training { .. })
        });
        if let ServerEvent::Training {
            step, resumed: r, ..
        } = training
        {
            // Every restart after the first checkpoint resumes from one that loads.
            if round > 0
                && (run_dir.join("checkpoint/state.json").is_file()
                    || run_dir.join("checkpoint.old/state.json").is_file())
            {
                assert!(
                    r,
                    "round {round}: a checkpoint exists but the restart did not resume"
                );
            }
            resumed += r as usize;
            steps_seen.push(step);
        }
        let id: PeerId = server.peer_id().parse().unwrap();
        assert!(
            server_id.is_none_or(|s| s == id),
            "the server's identity changed"
        );
        server_id = Some(id);
        let h = client.get_or_insert_with(|| {
            let boot = format!("{listen}/p2p/{id}");
            rt.block_on(super::swarm::library::node(&boot, None))
        });
        if round == rounds {
            // The last run: complete every group the server holds one episode of (counted
            // on its disk: an episode stored just before a kill is there unacknowledged),
            // then let it train all.
            let mut by_group: HashMap<String, usize> = HashMap::new();
            for e in read_stored_episodes(&episodes_dir).unwrap() {
                *by_group.entry(e.manifest.group_id.clone()).or_default() += 1;
            }
            let lone = by_group.into_iter().filter(|(_, n)| *n == 1);
            for (i, (g, _)) in lone.enumerate() {
                let prompt = vec![5, 6, 7, 10 + i as u32 % 200, 10 + i as u32 / 200 % 200];
                let call = rt
                    .block_on(common::peer::signed_call(h, id, prompt, 4, 1))
                    .unwrap();
                let ep =
                    Episode::single_call(format!("{g}-late"), "task".into(), g.clone(), call, 0.5);
                let (m, frags) = prepare(&ep, "tiny", 2).unwrap();
                let r = rt.block_on(submit(h, id, &m, &frags)).unwrap();
                assert!(
                    matches!(r.reply, SubmitReply::Stored { .. }),
                    "{:?}",
                    r.reply
                );
                acked.lock().unwrap().push((format!("{g}-late"), g));
            }
            // The first acknowledged episode, from the first run: submitted again, it is
            // acknowledged (and, checked below, not trained twice); its signed call in
            // another episode is refused as a replay.
            let ep = first
                .lock()
                .unwrap()
                .clone()
                .expect("an episode was acknowledged");
            let (m, frags) = prepare(&ep, "tiny", 2).unwrap();
            let r = rt.block_on(submit(h, id, &m, &frags)).unwrap();
            // (The restarted server's fragment cache is empty: storing it again would have
            // asked for its fragments.)
            assert!(
                matches!(&r.reply, SubmitReply::Stored { episode_id, fragments_received: 0, .. }
                    if *episode_id == ep.id),
                "{:?}",
                r.reply
            );
            let mut replay = ep.clone();
            replay.id = format!("{}-replayed", ep.id);
            let (m, frags) = prepare(&replay, "tiny", 2).unwrap();
            let r = rt.block_on(submit(h, id, &m, &frags)).unwrap();
            assert!(
                matches!(&r.reply, SubmitReply::Rejected(why)
                    if why.contains(&format!("already submitted in episode {:?}", ep.id))),
                "{:?}",
                r.reply
            );
            let want: Vec<String> = acked
                .lock()
                .unwrap()
                .iter()
                .map(|(i, _)| i.clone())
                .collect();
            let t0 = Instant::now();
            loop {
                let got = consumed(&run_dir);
                let missing: Vec<_> = want.iter().filter(|i| !got.contains(i)).collect();
                if missing.is_empty() {
                    break;
                }
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "{} acknowledged episodes never trained: {:?}\n{}",
                    missing.len(),
                    &missing[..missing.len().min(10)],
                    server.log_text()
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            server.kill9();
            break;
        }
        // Submissions run while the server trains and checkpoints; the kill falls at a
        // random moment among them.
        let task = rt.spawn(submit_until_error(
            h.clone(),
            id,
            round,
            acked.clone(),
            first.clone(),
        ));
        let wait = 0.3 + 2.7 * rng.next_f64();
        std::thread::sleep(Duration::from_secs_f64(wait));
        server.kill9();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .expect("the submitter did not notice the kill")
                .unwrap()
        });
        // Every acknowledged episode is on disk, whole, the moment the server is dead.
        let stored: Vec<String> = read_stored_episodes(&episodes_dir)
            .unwrap()
            .into_iter()
            .map(|e| e.manifest.episode_id)
            .collect();
        for (id, _) in acked.lock().unwrap().iter() {
            assert!(
                stored.contains(id)
                    && episodes_dir
                        .join(ServedModel::episode_file_name(id))
                        .is_file(),
                "round {round}: acknowledged episode {id} is lost"
            );
        }
        let log = server.log_text();
        assert!(!log.contains("panicked"), "round {round}:\n{log}");
    }
    // No id twice in the ledger: a step lost with a kill was cut from it before its
    // episodes were trained again.
    let ids = consumed(&run_dir);
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for i in &ids {
        *count.entry(i).or_default() += 1;
    }
    let twice: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "trained twice: {twice:?}");
    let n = acked.lock().unwrap().len();
    println!(
        "crash harness: {rounds} kills, {n} acknowledged episodes, 0 lost, {} consumed once each, 0 twice; \
         {resumed} restarts resumed from a checkpoint; steps at each start: {steps_seen:?}",
        ids.len()
    );
    assert!(n > 0, "no episode was acknowledged");
}
