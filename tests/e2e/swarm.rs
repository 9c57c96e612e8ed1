//! The swarm with real processes on 127.0.0.1: a plain peer everyone bootstraps from, two
//! servers of a tiny model, two clients (local OpenAI proxies); discovery through the DHT,
//! fail-over when a server is killed with SIGKILL, provider records expiring, the swarm
//! key, signed calls and episode submission, malformed messages.

use crate::common;

use common::peer::{http, metric, wait_until, Peer};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The provider TTL every `common::peer::Peer` runs with.
const TTL: f64 = 4.0;

/// A completion of `max_tokens` tokens (end of sequence banned) through a proxy.
fn long_call(proxy: &str, max_tokens: usize, seed: u64) -> (u16, Value) {
    let (status, body) = http(
        proxy,
        "POST",
        "/v1/completions",
        Some(&json!({
            "model": "tiny", "prompt": "hello swarm", "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, "logit_bias": {"2": -100},
        })),
    );
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn tiny_model(dir: &Path) -> PathBuf {
    let t = common::Tiny {
        max_pos: 4096,
        ..Default::default()
    };
    t.write_hf_dir(&dir.join("tiny-model"))
}

fn server_args<'a>(model: &'a str, boot: &'a str) -> Vec<&'a str> {
    vec![
        "--role",
        "server",
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--bootstrap",
        boot,
        "--http",
        "127.0.0.1:0",
    ]
}

#[test]
fn clients_find_servers_through_the_dht_and_survive_a_killed_server() {
    let _lane = common::light();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let model = model.to_str().unwrap();
    let mut plain = Peer::start("plain", dir.path(), &["--role", "peer"]);
    let boot = plain.addr();
    // Both servers certified by one run (see `swarm::trust`), the clients trusting it.
    let (key, run) = common::run_key(dir.path());
    let mut args = server_args(model, &boot);
    args.extend(["--run-key", &key]);
    let mut s1 = Peer::start("server1", dir.path(), &args);
    let mut s2 = Peer::start("server2", dir.path(), &args);
    let (id1, id2) = (s1.peer_id(), s2.peer_id());
    let http1 = s1.http_url(Duration::from_secs(120));
    let http2 = s2.http_url(Duration::from_secs(120));
    let client_args = [
        "--role",
        "client",
        "--model",
        "tiny",
        "--bootstrap",
        &boot,
        "--run",
        &run,
    ];
    let mut c1 = Peer::start("client1", dir.path(), &client_args);
    let mut c2 = Peer::start("client2", dir.path(), &client_args);
    let p1 = c1.proxy_url(Duration::from_secs(120));
    let p2 = c2.proxy_url(Duration::from_secs(120));
    // Every peer knew only the plain peer; each client finds both servers (in the DHT and
    // in its view of the swarm).
    for (c, p) in [(&c1, &p1), (&c2, &p2)] {
        wait_until("two providers", Duration::from_secs(60), || {
            metric(p, "agentjet_swarm_providers{model=\"tiny\"}") == Some(2.0)
        });
        let log = c.log_text();
        assert!(log.contains(&id1) && log.contains(&id2), "{log}");
    }
    // The DHT itself lists both: a lookup from another node that knows only the plain peer.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listed: Vec<String> = rt.block_on(async {
        let n = library::node(&boot, None).await;
        let t0 = std::time::Instant::now();
        loop {
            let found: Vec<String> = n
                .lookup_providers("tiny", false)
                .await
                .map(|l| l.providers.iter().map(ToString::to_string).collect())
                .unwrap_or_default();
            if found.contains(&id1) && found.contains(&id2) || t0.elapsed().as_secs() > 60 {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    assert!(
        listed.contains(&id1) && listed.contains(&id2),
        "the DHT lists {listed:?}"
    );
    drop(rt);
    // Calls work through both clients.
    for p in [&p1, &p2] {
        let (st, v) = long_call(p, 8, 1);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    }

    // Long calls in flight from both clients, then SIGKILL the server running some.
    let max_tokens = 1500;
    let calls: Vec<_> = (0..6)
        .map(|i| {
            let p = if i % 2 == 0 { p1.clone() } else { p2.clone() };
            std::thread::spawn(move || long_call(&p, max_tokens, 100 + i))
        })
        .collect();
    let running = |h: &str| metric(h, "agentjet_engine_running{model=\"tiny\"}").unwrap_or(0.0);
    let mut victim = None;
    wait_until("calls running on a server", Duration::from_secs(60), || {
        let (r1, r2) = (running(&http1), running(&http2));
        victim = if r1 > 0.0 {
            Some(1)
        } else if r2 > 0.0 {
            Some(2)
        } else {
            None
        };
        victim.is_some()
    });
    let (dead, live_http) = match victim.unwrap() {
        1 => (&mut s1, http2.clone()),
        _ => (&mut s2, http1.clone()),
    };
    let dead_id = dead.peer_id();
    let in_flight = running(if victim == Some(1) { &http1 } else { &http2 });
    let killed = Instant::now();
    dead.kill9();
    // A new call right after the kill completes on the other server.
    let (st, v) = long_call(&p1, 4, 7);
    let new_call = killed.elapsed();
    assert_eq!(st, 200, "{v}");
    for c in calls {
        let (st, v) = c.join().unwrap();
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
    }
    let in_flight_done = killed.elapsed();
    // The gauge is published after the engine has cached the finished sequences.
    wait_until("the live server idle", Duration::from_secs(5), || {
        running(&live_http) == 0.0
    });
    // The dead server's provider record is gone within two TTLs.
    wait_until(
        "the dead server's provider record gone",
        Duration::from_secs_f64(TTL * 2.0 + 3.0),
        || {
            metric(&p1, "agentjet_swarm_providers{model=\"tiny\"}") == Some(1.0)
                && metric(&p2, "agentjet_swarm_providers{model=\"tiny\"}") == Some(1.0)
        },
    );
    let gone = killed.elapsed();
    let log = c1.log_text() + &c2.log_text();
    assert!(log.contains("re-issuing"), "no fail-over logged:\n{log}");
    println!(
        "fail-over: killed {dead_id} with {in_flight} calls running; a new call completed {:.2} s after the kill; \
         the 6 in-flight calls ({max_tokens} tokens each) all completed {:.2} s after it; \
         provider record gone from both clients' DHT view {:.2} s after it (TTL {TTL} s)",
        new_call.as_secs_f64(),
        in_flight_done.as_secs_f64(),
        gone.as_secs_f64()
    );
}

pub(crate) mod library {
    use super::*;
    use agentjet::client::submit::{prepare, submit};
    use agentjet::rpc::{InferFrame, SubmitReply, INFER};
    use agentjet::swarm::frame::{read_frame, write_raw};
    use agentjet::swarm::{spawn_node, Keypair, PeerId, Role, SwarmConfig, SwarmHandle, SwarmKey};
    use agentjet::timeline::{Call, Episode};
    use futures::io::AsyncWriteExt;

    pub async fn node(boot: &str, key: Option<SwarmKey>) -> SwarmHandle {
        let mut cfg = SwarmConfig::new(Role::Client, Keypair::generate_ed25519());
        cfg.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
        cfg.bootstrap = vec![boot.parse().unwrap()];
        cfg.swarm_key = key;
        cfg.provider_ttl = Duration::from_secs_f64(TTL);
        spawn_node(cfg).await.unwrap()
    }

    /// One signed call of 6 tokens made directly over `/agentjet/infer/2`.
    pub async fn call(h: &SwarmHandle, server: PeerId, prompt: Vec<u32>) -> Call {
        common::peer::signed_call(h, server, prompt, 6, 1)
            .await
            .unwrap()
    }

    pub fn episode(id: &str, c: Call) -> Episode {
        Episode::single_call(id.into(), "task".into(), "group".into(), c, 1.0)
    }

    pub async fn submit_episode(
        h: &SwarmHandle,
        server: PeerId,
        e: &Episode,
        tamper: bool,
    ) -> SubmitReply {
        let (m, mut frags) = prepare(e, "tiny", 0).unwrap();
        if tamper {
            for b in frags.values_mut() {
                let n = b.len();
                b[n - 2] ^= 1;
            }
        }
        submit(h, server, &m, &frags).await.unwrap().reply
    }

    pub async fn raw_infer(h: &SwarmHandle, server: PeerId, body: &[u8], header_only: Option<u32>) {
        let mut s = h.open(server, INFER).await.unwrap();
        match header_only {
            Some(n) => {
                s.write_all(&n.to_le_bytes()).await.unwrap();
                s.flush().await.unwrap();
            }
            None => write_raw(&mut s, body, 1 << 20).await.unwrap(),
        }
        // The server closes the stream without an answer.
        assert!(read_frame::<_, InferFrame>(&mut s, 1 << 20).await.is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_swarm_key_signed_calls_and_bad_messages() {
    let _lane = tokio::task::block_in_place(common::light);
    use agentjet::rpc::{SubmitReply, INFER};
    use agentjet::swarm::SwarmKey;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let model = model.to_str().unwrap().to_string();
    let key_path = dir.path().join("swarm.key");
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args(["swarm-key", "--out"])
        .arg(&key_path)
        .output()
        .unwrap();
    assert!(out.status.success());
    let key = SwarmKey::load(&key_path).unwrap();
    let kp = key_path.to_str().unwrap().to_string();
    let mut plain = Peer::start("plain", dir.path(), &["--role", "peer", "--swarm-key", &kp]);
    let boot = plain.addr();
    let mut args = server_args(&model, &boot);
    args.extend(["--swarm-key", kp.as_str()]);
    let mut server = Peer::start("server", dir.path(), &args);
    let server_id: agentjet::swarm::PeerId = server.peer_id().parse().unwrap();
    server.wait_serving(Duration::from_secs(120));

    // A client without the key: no provider ever answers it.
    let mut intruder = Peer::start(
        "intruder",
        dir.path(),
        &[
            "--role",
            "client",
            "--model",
            "tiny",
            "--bootstrap",
            &boot,
            "--wait",
            "6",
        ],
    );
    let intruder_id = intruder.peer_id();
    let status = intruder.child.wait().unwrap();
    assert_eq!(status.code(), Some(1));
    let log = intruder.log_text();
    assert!(log.contains("no provider of model \"tiny\""), "{log}");

    // A member's view: the server, never the intruder.
    let out = Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .args([
            "status",
            "--bootstrap",
            &boot,
            "--swarm-key",
            &kp,
            "--wait",
            "3",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        table.contains(&server_id.to_string()) && table.contains("tiny (v0)"),
        "{table}"
    );
    assert!(!table.contains(&intruder_id), "{table}");

    // In-process: without the key, the server refuses; with it, calls are signed.
    let outsider = library::node(&boot, None).await;
    let member = library::node(&boot, Some(key.clone())).await;
    let t0 = Instant::now();
    while !member.providers("tiny").await.unwrap().contains(&server_id) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server not found in the DHT"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = outsider.open(server_id, INFER).await;
    let e = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("swarm key") || e.contains("unreachable") || e.contains("refused"),
        "{e}"
    );

    let c1 = library::call(&member, server_id, vec![5, 6, 7, 8]).await;
    assert_eq!(c1.completion_ids.len(), 6);
    let ep = library::episode("ep-1", c1.clone());
    match library::submit_episode(&member, server_id, &ep, false).await {
        SubmitReply::Stored {
            fragments_received, ..
        } => assert!(fragments_received >= 2),
        other => panic!("{other:?}"),
    }
    // The same call submitted in another episode: a replay, refused. The same episode
    // again (its acknowledgement lost): acknowledged, not stored twice.
    let replay = library::episode("ep-2", c1.clone());
    let reply = library::submit_episode(&member, server_id, &replay, false).await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r)
            if r.contains("call 0 was already submitted in episode \"ep-1\"")),
        "{reply:?}"
    );
    match library::submit_episode(&member, server_id, &ep, false).await {
        SubmitReply::Stored { episode_id, .. } => assert_eq!(episode_id, "ep-1"),
        other => panic!("{other:?}"),
    }
    let t0 = Instant::now();
    while !server.log_text().contains("acknowledged again") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The same id with other content (another reward): refused, not trained twice.
    let mut richer = ep.clone();
    richer.reward = Some(5.0);
    let reply = library::submit_episode(&member, server_id, &richer, false).await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("already stored with other content")),
        "{reply:?}"
    );
    // The same prompt called again gives an equal call (greedy) with its own signature:
    // stored, and its fragments are not re-sent.
    let c1b = library::call(&member, server_id, vec![5, 6, 7, 8]).await;
    assert_eq!(c1b.completion_ids, c1.completion_ids);
    assert_ne!(c1b.signature, c1.signature);
    let again = library::episode("ep-2", c1b);
    match library::submit_episode(&member, server_id, &again, false).await {
        SubmitReply::Stored {
            fragments_received,
            fragments_known,
            ..
        } => {
            assert_eq!(fragments_received, 0);
            assert!(fragments_known >= 2);
        }
        other => panic!("{other:?}"),
    }
    let stored = std::fs::read_dir(dir.path().join("server/episodes/tiny"))
        .unwrap()
        .count();
    assert_eq!(stored, 2);
    // Tampered fragments, altered or unsigned calls, a call signed by a non-server.
    let c2 = library::call(&member, server_id, vec![9, 10, 11]).await;
    let reply = library::submit_episode(
        &member,
        server_id,
        &library::episode("ep-3", c2.clone()),
        true,
    )
    .await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("tampered")),
        "{reply:?}"
    );
    let mut forged = c2.clone();
    forged.completion_ids[0] = (forged.completion_ids[0] + 1) % 300;
    let reply =
        library::submit_episode(&member, server_id, &library::episode("ep-4", forged), false).await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("does not verify")),
        "{reply:?}"
    );
    // The signature covers the sampling transform: a client that claims another
    // temperature (to make its tokens look likelier to the trainer) is refused.
    let mut cooler = c2.clone();
    assert_eq!(cooler.sampling.temperature, 1.0);
    cooler.sampling.temperature = 0.5;
    let reply = library::submit_episode(
        &member,
        server_id,
        &library::episode("ep-4t", cooler),
        false,
    )
    .await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("does not verify")),
        "{reply:?}"
    );
    let mut unsigned = c2.clone();
    unsigned.signature.clear();
    let reply = library::submit_episode(
        &member,
        server_id,
        &library::episode("ep-5", unsigned),
        false,
    )
    .await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("not signed")),
        "{reply:?}"
    );
    let mut self_signed = c2.clone();
    self_signed.signature = member.sign(
        &agentjet::timeline::digest::call_digest(
            "tiny",
            &c2.prompt_ids,
            &c2.completion_ids,
            &c2.logprobs,
            c2.policy_version,
            &c2.sampling,
        ),
        &agentjet::swarm::sign::new_nonce(),
    );
    let reply = library::submit_episode(
        &member,
        server_id,
        &library::episode("ep-6", self_signed),
        false,
    )
    .await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("does not trust to serve")),
        "{reply:?}"
    );
    // An id with a newline would forge a line of consumed.log (another episode marked as
    // trained): refused before it is stored.
    let reply = library::submit_episode(
        &member,
        server_id,
        &library::episode("ep-7\n1\tep-1", c2.clone()),
        false,
    )
    .await;
    assert!(
        matches!(&reply, SubmitReply::Rejected(r) if r.contains("control character")),
        "{reply:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path().join("server/episodes/tiny"))
            .unwrap()
            .count(),
        2
    );

    // Malformed and oversize messages are refused and logged; the server keeps serving.
    library::raw_infer(&member, server_id, &[0xff; 40], None).await;
    library::raw_infer(&member, server_id, &[], Some(1 << 30)).await;
    let c3 = library::call(&member, server_id, vec![5, 6, 7, 8]).await;
    assert_eq!(c3.completion_ids, c1.completion_ids);
    let log = server.log_text();
    assert!(log.contains("malformed InferRequest frame"), "{log}");
    assert!(log.contains("over the limit"), "{log}");
    assert!(
        log.contains("rejected episode") && log.contains("tampered"),
        "{log}"
    );
    let plain_log = plain.log_text();
    assert!(
        plain_log.contains(&intruder_id),
        "the plain peer did not log the intruder:\n{plain_log}"
    );
}
