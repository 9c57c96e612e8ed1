//! The swarm across networks: real `agentjet-peer` processes on hosts in network
//! namespaces this test makes (`common::netns`): public hosts on a switch standing for
//! the internet, home hosts behind cone or symmetric NAT routers, documentation addresses
//! only, a DNS name in the hosts' own hosts files. Every peer runs with its default listen
//! addresses and the README's keys (a run key for servers, its id for clients), as a user
//! would start it on those hosts. Each test says which kind of connection (direct,
//! hole-punched, relayed) each pair of peers ended with.

use crate::common;
use crate::elastic::{
    client_on, hashes, metrics_lines, server_on, tiny_model, wait_all_consumed, AGENT,
};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use agentjet::server::ServerEvent;
use agentjet::swarm::LinkKind;
use common::netns::{Host, Nat, Net};
use common::peer::{wait_until, Peer};

/// Waits until `p` has a connection of `kind` to `peer`.
fn wait_link(p: &Peer, peer: &str, kind: LinkKind, within: Duration) {
    let t0 = std::time::Instant::now();
    while !p.links_to(peer).contains_key(kind.as_str()) {
        assert!(
            t0.elapsed() < within,
            "no {} connection to {peer} within {within:?}: {:?}; events {:#?}\nlog:\n{}",
            kind.as_str(),
            p.links_to(peer),
            p.net_events(),
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn wait_reach(p: &Peer, want: agentjet::swarm::Reachability, within: Duration) {
    let t0 = std::time::Instant::now();
    while p.reachability() != Some(want) {
        assert!(
            t0.elapsed() < within,
            "reachability {:?}, not {want:?}, after {within:?}; log:\n{}",
            p.reachability(),
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A server of the tiny model on `host`.
fn server(
    host: &Host,
    d: &Path,
    model: &Path,
    name: &str,
    boot: Option<&str>,
    extra: &[&str],
) -> Peer {
    server_on(Some(&host.ns), d, model, name, boot, extra)
}

/// A client on `host` running [`AGENT`] on `groups` groups.
fn client(host: &Host, d: &Path, boot: &str, groups: usize, run: &str) -> Peer {
    client_on(Some(&host.ns), d, boot, groups, run, AGENT)
}

/// Every step both members took has one parameter hash at both; at least `min` steps,
/// each with `members` members.
fn assert_one_group(d: &Path, names: &[&str], members: u64, min: usize) {
    let per: Vec<BTreeMap<u64, String>> =
        names.iter().map(|n| hashes(&metrics_lines(d, n))).collect();
    assert!(
        per[0].len() >= min,
        "{} took {} steps: {:?}",
        names[0],
        per[0].len(),
        per[0]
    );
    for (n, h) in names.iter().zip(&per).skip(1) {
        assert_eq!(&per[0], h, "{} and {n} differ", names[0]);
    }
    for n in names {
        for l in metrics_lines(d, n).iter().filter(|l| l["trained"] == true) {
            assert_eq!(l["members"], members, "{n}: {l}");
        }
    }
}

/// The bytes of a drained server's checkpointed optimizer state and its step.
fn optimizer_state(d: &Path, name: &str) -> (Vec<u8>, serde_json::Value) {
    let ck = d.join(name).join("runs/tiny/checkpoint");
    let opt = std::fs::read(ck.join("optimizer.safetensors"))
        .unwrap_or_else(|e| panic!("{name}'s checkpoint: {e}"));
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("state.json")).unwrap()).unwrap();
    (opt, state["step"].clone())
}

fn drain(peers: &mut [&mut Peer]) {
    for p in peers.iter() {
        unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
    }
    for p in peers.iter_mut() {
        let st = p.child.wait().unwrap();
        assert!(st.success(), "{st}: {}", p.log_text());
    }
}

/// Two servers on two public hosts, the second joining through the first by DNS name, and
/// a client on a third: one group, the same parameters after every step and the same
/// optimizer state at the end, every connection direct. The second host's firewall lets
/// in only the swarm's port: the ring link to it runs over the swarm's connection.
#[test]
fn two_public_servers_train_as_one_group_joined_by_dns_name() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let (ha, hb, hc) = (net.public("a"), net.public("b"), net.public("c"));
    net.name("boot.agentjet.test", ha.ip);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // b's host lets in only the swarm's ports (a cloud firewall): a's ring link to b
    // cannot be a direct TCP connection to b's link port and runs over the swarm's
    // connection instead (at once while b is not known to be public, after one failed
    // attempt once it is); b's to a may be direct.
    net.exec(
        &hb,
        &[
            "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "!", "--dport", "4001", "-j", "DROP",
        ],
    );
    let extra = ["--groups-per-step", "1"];
    let mut a = server(&ha, d, &model, "a", None, &extra);
    let (id_a, addr_a) = (a.peer_id(), a.addr());
    // The first address a peer gives is the one another host should use.
    assert!(
        addr_a.starts_with(&format!("/ip4/{}/", ha.ip)),
        "{addr_a} is not on the host's public address"
    );
    let boot = format!("/dns4/boot.agentjet.test/udp/4001/quic-v1/p2p/{id_a}");
    let mut b = server(&hb, d, &model, "b", Some(&boot), &extra);
    let id_b = b.peer_id();
    for s in [&mut a, &mut b] {
        s.wait_epoch(2, Duration::from_secs(90));
    }
    let mut cl = client(&hc, d, &boot, 12, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["a", "b"], &[&a, &b]);
    assert_one_group(d, &["a", "b"], 2, 3);
    println!(
        "steps {:?}; a to b {:?}, b to a {:?}",
        hashes(&metrics_lines(d, "a")).keys().collect::<Vec<_>>(),
        a.links_to(&id_b),
        b.links_to(&id_a)
    );
    // Direct connections between every pair; both servers public.
    wait_link(&a, &id_b, LinkKind::Direct, Duration::from_secs(5));
    wait_link(&b, &id_a, LinkKind::Direct, Duration::from_secs(5));
    for p in [&a, &b] {
        assert_eq!(
            p.reachability(),
            Some(agentjet::swarm::Reachability::Public)
        );
    }
    drain(&mut [&mut a, &mut b]);
    let (oa, sa) = optimizer_state(d, "a");
    let (ob, sb) = optimizer_state(d, "b");
    assert_eq!(sa, sb, "checkpoints at different steps");
    assert!(oa == ob, "the optimizer states differ at step {sa}");
}

/// Three servers on public hosts, two of which cannot reach each other (a firewall
/// between their hosts, no relay): the group leaves one of the two out within the link
/// bound, says why, and the other two step; no membership is tried forever.
#[test]
fn a_member_that_cannot_be_linked_is_left_out_and_the_others_step() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let (ha, hb, hx, hc) = (
        net.public("a"),
        net.public("b"),
        net.public("x"),
        net.public("c"),
    );
    // b and x cannot reach each other at all.
    for (h, other) in [(&hx, &hb), (&hb, &hx)] {
        let o = other.ip.to_string();
        net.exec(h, &["iptables", "-A", "INPUT", "-s", &o, "-j", "DROP"]);
        net.exec(h, &["iptables", "-A", "OUTPUT", "-d", &o, "-j", "DROP"]);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    // No relay service anywhere: a cut stays cut.
    let extra = ["--groups-per-step", "1", "--no-relay"];
    let mut a = server(&ha, d, &model, "a", None, &extra);
    let boot = a.addr();
    let mut b = server(&hb, d, &model, "b", Some(&boot), &extra);
    b.wait_epoch(2, Duration::from_secs(90));
    let n_formed = |p: &Peer| {
        p.events()
            .iter()
            .filter(|e| matches!(e, ServerEvent::Formed { members: 2, .. }))
            .count()
    };
    let before = n_formed(&a);
    let t0 = std::time::Instant::now();
    let mut x = server(&hx, d, &model, "x", Some(&boot), &extra);
    x.peer_id();
    // x is seen, taken in, and one of b and x cannot reach the other: the next epoch
    // that forms leaves one of them out (a re-forms an epoch of two).
    wait_until(
        "an epoch of two after x came",
        Duration::from_secs(120),
        || n_formed(&a) > before,
    );
    println!("an epoch of two again {:?} after x started", t0.elapsed());
    // Two of the three step together; which two depends on who accused whom. Episodes
    // come in rounds while the group settles: a round that came while the members still
    // tried the third one (a ballot's prepare waits out its control timeout) is taken in
    // one step, not the two this asks for.
    let names = ["a", "b", "x"];
    let t0 = std::time::Instant::now();
    let (mut rounds, mut last) = (0, t0);
    let pair: Vec<&str> = loop {
        if rounds == 0 || (rounds < 4 && last.elapsed() > Duration::from_secs(20)) {
            rounds += 1;
            last = std::time::Instant::now();
            let mut cl = client(&hc, d, &boot, 24, &format!("run{rounds}"));
            assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
        }
        let stepped: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| {
                metrics_lines(d, n)
                    .iter()
                    .filter(|l| l["trained"] == true && l["members"] == 2)
                    .count()
                    >= 2
            })
            .collect();
        if stepped.len() >= 2 {
            break stepped;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "no two members took 2 steps together in {rounds} rounds of episodes; logs:\n{}\n----\n{}\n----\n{}",
            a.log_text(),
            b.log_text(),
            x.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(pair.len(), 2, "{pair:?}");
    assert!(
        pair.contains(&"a"),
        "a reaches both: it is in the pair {pair:?}"
    );
    // No step ever had three members, and the one left out was left out with a reason.
    for n in names {
        for l in metrics_lines(d, n).iter().filter(|l| l["trained"] == true) {
            assert!(l["members"].as_u64().unwrap() <= 2, "{n}: {l}");
        }
    }
    let logs = [a.log_text(), b.log_text(), x.log_text()].join("\n");
    assert!(
        logs.contains("could not link with") || logs.contains("no answer to the prepare"),
        "nobody said why the third member was left out:\n{logs}"
    );
    let peers: Vec<&Peer> = pair
        .iter()
        .map(|n| match *n {
            "a" => &a,
            "b" => &b,
            _ => &x,
        })
        .collect();
    wait_all_consumed(d, &pair, &peers);
    // The pair's steps of two: the same parameters at both.
    let of_two = |n: &str| -> BTreeMap<u64, String> {
        metrics_lines(d, n)
            .iter()
            .filter(|l| l["trained"] == true && l["members"] == 2)
            .map(|l| {
                (
                    l["step"].as_u64().unwrap(),
                    l["param_hash"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (h0, h1) = (of_two(pair[0]), of_two(pair[1]));
    assert_eq!(h0, h1, "the pair's steps differ");
    x.kill9();
    b.kill9();
}

/// A public `--role peer` bootstrap (given by DNS name) and two servers behind two
/// different cone NATs: they meet through the bootstrap's relay, punch a hole (DCUtR),
/// and train as one group over the direct connection.
#[test]
fn two_servers_behind_cone_nats_train_over_a_hole_punched_connection() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let (hp, hc) = (net.public("boot"), net.public("c"));
    let (h1, h2) = (net.home("s1", Nat::Cone), net.home("s2", Nat::Cone));
    net.name("boot.agentjet.test", hp.ip);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let mut boot_peer = Peer::start_on(&hp.ns, "boot", d, &["--role", "peer"]);
    let boot_id = boot_peer.peer_id();
    let boot = format!("/dns4/boot.agentjet.test/udp/4001/quic-v1/p2p/{boot_id}");
    let extra = ["--groups-per-step", "1"];
    let mut s1 = server(&h1, d, &model, "s1", Some(&boot), &extra);
    let mut s2 = server(&h2, d, &model, "s2", Some(&boot), &extra);
    let (id1, id2) = (s1.peer_id(), s2.peer_id());
    for s in [&s1, &s2] {
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_reach(
                s,
                agentjet::swarm::Reachability::Relayed,
                Duration::from_secs(90),
            )
        })) {
            panic!(
                "{e:?}\nthe bootstrap peer's output:\n{}\nlog:\n{}",
                boot_peer.stdout_so_far().join("\n"),
                boot_peer.log_text()
            );
        }
    }
    // The bootstrap peer learnt from the servers that it is public (and relays).
    boot_peer.wait_line("reachability: public", Duration::from_secs(5));
    for s in [&mut s1, &mut s2] {
        s.wait_epoch(2, Duration::from_secs(120));
    }
    wait_link(&s1, &id2, LinkKind::HolePunched, Duration::from_secs(60));
    let mut cl = client(&hc, d, &boot, 8, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["s1", "s2"], &[&s1, &s2]);
    assert_one_group(d, &["s1", "s2"], 2, 2);
    // The two servers end with the hole-punched connection and no relayed one (closed 5 s
    // after the direct one stood, so bulk streams cannot land on it).
    wait_until(
        "the relayed connection closed",
        Duration::from_secs(20),
        || {
            let l = s1.links_to(&id2);
            l.contains_key("hole_punched") && !l.contains_key("relayed")
        },
    );
    let l = s2.links_to(&id1);
    assert!(l.contains_key("hole_punched"), "s2 to s1: {l:?}");
}

/// A public server, a server behind a cone NAT, a server behind a symmetric NAT, and a
/// client behind a symmetric NAT: one group of three (the symmetric server trains through
/// the public peer's relay: no hole can be punched to a symmetric NAT), and the client
/// finishes episodes on every server.
#[test]
fn servers_behind_cone_and_symmetric_nats_train_with_a_public_one_through_its_relay() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let hp = net.public("p");
    let (hc, hs, hcl) = (
        net.home("cone", Nat::Cone),
        net.home("sym", Nat::Symmetric),
        net.home("cl", Nat::Symmetric),
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let extra = ["--groups-per-step", "1"];
    let mut p = server(&hp, d, &model, "p", None, &extra);
    let boot = p.addr();
    let mut c = server(&hc, d, &model, "cone", Some(&boot), &extra);
    let mut s = server(&hs, d, &model, "sym", Some(&boot), &extra);
    let (id_p, id_c, id_s) = (p.peer_id(), c.peer_id(), s.peer_id());
    for x in [&mut p, &mut c, &mut s] {
        x.wait_epoch(3, Duration::from_secs(180));
    }
    let mut cl = client(&hcl, d, &boot, 16, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    wait_all_consumed(d, &["p", "cone", "sym"], &[&p, &c, &s]);
    assert_one_group(d, &["p", "cone", "sym"], 3, 2);
    // Episodes finished on each server (each stored some).
    for (name, x) in [("p", &p), ("cone", &c), ("sym", &s)] {
        let stored = x
            .events()
            .iter()
            .filter(|e| matches!(e, ServerEvent::EpisodeStored { .. }))
            .count();
        assert!(stored > 0, "no episode stored on {name}");
    }
    // Direct to the public server; between the NATs, relayed (symmetric: no hole).
    wait_link(&c, &id_p, LinkKind::Direct, Duration::from_secs(5));
    wait_link(&s, &id_p, LinkKind::Direct, Duration::from_secs(5));
    let l = s.links_to(&id_c);
    assert!(l.contains_key("relayed"), "sym to cone: {l:?}");
    assert_eq!(
        p.reachability(),
        Some(agentjet::swarm::Reachability::Public)
    );
    for x in [&c, &s] {
        assert_eq!(
            x.reachability(),
            Some(agentjet::swarm::Reachability::Relayed)
        );
    }
    // What the relay carried between the two servers behind NAT exceeds a default
    // circuit's 128 KiB: each step's gradient ring passes 2(n-1)/n of the model's float32
    // values over every link, the relayed one included.
    let values: u64 = std::fs::read_dir(&model)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len() / 4)
        .sum();
    let steps = hashes(&metrics_lines(d, "sym")).len() as u64;
    let relayed = steps * values * 4 * 4 / 3;
    println!("{steps} steps of 3: about {relayed} bytes over the relayed link");
    assert!(relayed > 128 << 10, "{relayed} bytes");
    // The client behind its symmetric NAT: direct to the public server, relayed to the
    // others.
    let seen = |to: &str| -> Vec<LinkKind> {
        cl.net_events()
            .into_iter()
            .filter_map(|e| match e {
                agentjet::swarm::NetEvent::Connected { peer, kind, .. } if peer == to => Some(kind),
                _ => None,
            })
            .collect()
    };
    assert!(seen(&id_p).contains(&LinkKind::Direct), "{:?}", seen(&id_p));
    for id in [&id_c, &id_s] {
        assert!(seen(id).contains(&LinkKind::Relayed), "{:?}", seen(id));
    }
}

/// A public trainer and two followers behind two cone NATs: each keeps up with the
/// trainer's versions (serves the newest, and every version it serves has the trainer's
/// parameters), and chunks travel between the followers. Not every version: a follower
/// skips one that a newer version superseded while it was fetched (it serves the newest),
/// and this trainer's versions come about 0.1 s apart.
#[test]
fn followers_behind_nats_follow_the_trainers_versions_and_share_chunks() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let (ha, hc) = (net.public("a"), net.public("c"));
    let (h1, h2) = (net.home("f1", Nat::Cone), net.home("f2", Nat::Cone));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = tiny_model(d);
    let chunks = ["--weights-chunk-kib", "16"];
    let mut a = server(
        &ha,
        d,
        &model,
        "a",
        None,
        &[&chunks[..], &["--groups-per-step", "1", "--max-batch", "2"]].concat(),
    );
    let boot = a.addr();
    a.wait_serving(Duration::from_secs(120));
    let follow = [&chunks[..], &["--follow"]].concat();
    let mut f1 = server(&h1, d, &model, "f1", Some(&boot), &follow);
    let mut f2 = server(&h2, d, &model, "f2", Some(&boot), &follow);
    let (id1, id2) = (f1.peer_id(), f2.peer_id());
    // Both serve the trainer's version 0 (through their NATs) before any step, and hold
    // a relay reservation: each can be reached by the other.
    for f in [&mut f1, &mut f2] {
        f.wait_event("version 0 followed", Duration::from_secs(120), |e| {
            matches!(e, ServerEvent::Followed { .. })
        });
        wait_reach(
            f,
            agentjet::swarm::Reachability::Relayed,
            Duration::from_secs(90),
        );
    }
    let mut cl = client(&hc, d, &boot, 12, "run1");
    assert!(cl.child.wait().unwrap().success(), "{}", cl.log_text());
    // The trainer's versions (a step whose batch moved nothing, every reward of its
    // groups equal, keeps the version: versions are not steps).
    let group: BTreeMap<u64, String> = metrics_lines(d, "a")
        .iter()
        .filter(|l| l["trained"] == true)
        .map(|l| {
            (
                l["version"].as_u64().unwrap(),
                l["param_hash"].as_str().unwrap()[..16].to_string(),
            )
        })
        .collect();
    let newest = *group.keys().max().expect("the trainer took steps");
    assert!(newest >= 2, "version {newest}");
    let followed = |f: &Peer| -> BTreeMap<u64, (String, BTreeMap<String, u64>)> {
        f.events()
            .into_iter()
            .filter_map(|e| match e {
                ServerEvent::Followed {
                    version,
                    param_hash,
                    bytes_by_source,
                    ..
                } => Some((version, (param_hash, bytes_by_source))),
                _ => None,
            })
            .collect()
    };
    for f in [&f1, &f2] {
        let t0 = std::time::Instant::now();
        while !followed(f).contains_key(&newest) {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "version {newest} not followed within 120 s (followed {:?}); log:\n{}\n---- the trainer's log:\n{}\n---- the other follower's log:\n{}",
                followed(f).keys().collect::<Vec<_>>(),
                f.log_text(),
                a.log_text(),
                if std::ptr::eq(f, &f1) { f2.log_text() } else { f1.log_text() }
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let mut shared = 0;
    for (f, other) in [(&f1, &id2), (&f2, &id1)] {
        let got = followed(f);
        for (v, (h, by)) in &got {
            if let Some(want) = group.get(v) {
                assert_eq!(h, want, "version {v}");
            }
            shared += by.get(other.as_str()).copied().unwrap_or(0);
        }
        // It kept up: the newest version, and another before it (one that a newer
        // version superseded while it was being fetched is skipped: followers serve the
        // newest; a fast trainer's versions come 0.1 s apart here).
        assert!(
            got.contains_key(&newest),
            "the newest not followed: {got:?}"
        );
        let kept = group.keys().filter(|v| got.contains_key(v)).count();
        assert!(
            kept >= 2,
            "followed {kept} of the trainer's {} versions: {got:?}; log:\n{}",
            group.len(),
            f.log_text()
        );
    }
    println!(
        "trainer versions {:?}; f1 followed {:?}; f2 followed {:?}; {shared} bytes between the followers",
        group.keys().collect::<Vec<_>>(),
        followed(&f1).keys().collect::<Vec<_>>(),
        followed(&f2).keys().collect::<Vec<_>>()
    );
    assert!(shared > 0, "no chunk travelled between the followers");
    let l = f1.links_to(&id2);
    assert!(!l.is_empty(), "the followers never connected");
    println!("f1 to f2: {l:?}");
}

/// A study's driver on a public host and its worker behind a cone NAT, both joined
/// through a public bootstrap peer given by DNS name (a closed swarm): the driver finds
/// the worker, every arm runs there, and the driver reads them as its own to the study's
/// end.
#[test]
fn a_study_worker_behind_nat_runs_the_drivers_arms() {
    let _heavy = common::heavy();
    let mut net = Net::new();
    let (hb, hd) = (net.public("boot"), net.public("drv"));
    let hw = net.home("w", Nat::Cone);
    net.name("boot.agentjet.test", hb.ip);
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let key = crate::study_workers::swarm_key(r);
    let key = key.to_str().unwrap();
    let dir = r.join("s");
    let me = crate::study_workers::driver_id(&dir);
    let mut boot = Peer::start_on(&hb.ns, "boot", r, &["--role", "peer", "--swarm-key", key]);
    let boot_addr = format!(
        "/dns4/boot.agentjet.test/udp/4001/quic-v1/p2p/{}",
        boot.peer_id()
    );
    let mut worker = Peer::start_on(
        &hw.ns,
        "worker",
        r,
        &[
            "study",
            "worker",
            "--swarm-key",
            key,
            "--allow-driver",
            &me,
            "--slots",
            "2",
            "--bootstrap",
            &boot_addr,
        ],
    );
    let worker_id = worker.peer_id();
    let file = crate::study::write_study(
        r,
        "grid",
        &format!(
            "[budget]\nsteps = 2\nat_once = 2\n\n[space.bias]\nenv = \"BIAS\"\nvalues = [0, 3]\n\n\
             [workers]\nswarm_key = \"{key}\"\nbootstrap = [\"{boot_addr}\"]\nlocal = 0\nwait_seconds = 120\n"
        ),
    );
    let log = std::fs::File::create(dir.with_extension("run.out")).unwrap();
    let driver = crate::study::Driver(
        std::process::Command::new("ip")
            .args(["netns", "exec", &hd.ns, env!("CARGO_BIN_EXE_agentjet-peer")])
            .args(["study", "run"])
            .arg(&file)
            .arg("--dir")
            .arg(&dir)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    crate::study::finish(driver, &dir, "run", Duration::from_secs(400));
    let j = crate::study::journal(&dir);
    let launches: Vec<&serde_json::Value> = j
        .iter()
        .filter(|l| crate::study::kind(l) == "launch")
        .collect();
    assert_eq!(launches.len(), 2, "{launches:#?}");
    for l in &launches {
        assert_eq!(l["host"].as_str(), Some(worker_id.as_str()), "{l}");
    }
    // Each arm's steps, mirrored from the worker to the driver's own files.
    for arm in 0..2 {
        let mirror = dir.join(format!("arms/{arm:03}/server/runs/tiny/metrics.jsonl"));
        let steps = crate::client::metrics_lines(&mirror).len();
        assert!(
            steps >= 2,
            "arm {arm}: {steps} steps in {}",
            mirror.display()
        );
    }
    println!(
        "worker reachability: {}",
        worker
            .stdout()
            .lines()
            .filter(|l| l.starts_with("reachability") || l.starts_with("hole punched"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let _ = boot.stdout_so_far();
}
