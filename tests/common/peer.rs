//! Real `agentjet-peer` processes for multi-peer tests: start one with its stdout lines
//! collected and its stderr in a log file; wait for a server's or a client's typed events
//! (`--events`: [`Peer::wait_event`], [`Peer::wait_client_event`]) or, for a relay peer,
//! a line; talk HTTP to its proxy or API.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use agentjet::client::ClientEvent;
use agentjet::server::ServerEvent;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// A running `agentjet-peer` whose stdout lines are collected.
pub struct Peer {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
    log: PathBuf,
    /// A server's or a client's events file (`--events`).
    events: Option<(PathBuf, Role)>,
}

/// The role of a peer whose events are watched.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Role {
    Server,
    Client,
}

impl Peer {
    pub fn start(name: &str, dir: &Path, args: &[&str]) -> Peer {
        Peer::start_env(name, dir, args, &[])
    }

    /// [`Peer::start`] with extra environment variables.
    pub fn start_env(name: &str, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Peer {
        Peer::start_bin(
            Path::new(env!("CARGO_BIN_EXE_agentjet-peer")),
            name,
            dir,
            args,
            env,
        )
    }

    /// [`Peer::start_env`] with another `agentjet-peer` binary (the client-only build).
    pub fn start_bin(
        bin: &Path,
        name: &str,
        dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Peer {
        Peer::spawn(bin, None, name, dir, args, env)
    }

    /// A peer on a host of a test network (`ip netns exec NS`), with its default listen
    /// addresses (servers and plain peers on port 4001, clients on a free port, all
    /// interfaces), as a user would start it there.
    pub fn start_on(ns: &str, name: &str, dir: &Path, args: &[&str]) -> Peer {
        Peer::spawn(
            Path::new(env!("CARGO_BIN_EXE_agentjet-peer")),
            Some(ns),
            name,
            dir,
            args,
            &[],
        )
    }

    fn spawn(
        bin: &Path,
        ns: Option<&str>,
        name: &str,
        dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Peer {
        let log = dir.join(format!("{name}.log"));
        let role = args.windows(2).find_map(|w| match w {
            ["--role", "server"] => Some(Role::Server),
            ["--role", "client"] => Some(Role::Client),
            _ => None,
        });
        let events = role.map(|r| (dir.join(format!("{name}.events.jsonl")), r));
        // A restart under the same name: the last run's events must not answer a wait
        // before the new process truncates the file.
        if let Some((path, _)) = &events {
            let _ = std::fs::remove_file(path);
        }
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let listen: &[&str] = match ns {
            Some(_) => &[],
            None => &["--listen", "/ip4/127.0.0.1/udp/0/quic-v1"],
        };
        let mut child = cmd
            .args(args)
            .args(
                events
                    .iter()
                    .flat_map(|(e, _)| [std::ffi::OsStr::new("--events"), e.as_os_str()]),
            )
            .arg("--data-dir")
            .arg(dir.join(name))
            .args(listen)
            .args(["--provider-ttl", "4", "--status-interval", "0.5"])
            // `AGENTJET_TEST_LOG` (a tracing filter) to see more of the peers in a failure.
            .arg("--log")
            .arg(std::env::var("AGENTJET_TEST_LOG").unwrap_or_else(|_| "agentjet=info".into()))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Peer {
            child,
            lines: rx,
            seen: Vec::new(),
            log,
            events,
        }
    }

    /// The events so far of a peer of `role`.
    fn read_events<E: DeserializeOwned>(&self, role: Role) -> Vec<E> {
        let path = match &self.events {
            Some((p, r)) if *r == role => p,
            _ => panic!("this peer is not a {role:?} whose events are watched"),
        };
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            // The last line may be half-written.
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The first event of a peer of `role` that `f` accepts (the ones so far included).
    fn wait_for<E: DeserializeOwned + Clone + std::fmt::Debug>(
        &mut self,
        role: Role,
        what: &str,
        timeout: Duration,
        f: &dyn Fn(&E) -> bool,
    ) -> E {
        let deadline = Instant::now() + timeout;
        loop {
            let all: Vec<E> = self.read_events(role);
            if let Some(e) = all.iter().find(|e| f(e)) {
                return e.clone();
            }
            if Instant::now() > deadline {
                panic!(
                    "no event {what} within {timeout:?}; events {all:#?}; stdout {:?}; log:\n{}",
                    self.stdout_so_far(),
                    self.log_text()
                );
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                // Its last events were written before it exited.
                let all: Vec<E> = self.read_events(role);
                if let Some(e) = all.iter().find(|e| f(e)) {
                    return e.clone();
                }
                panic!(
                    "the {role:?} exited ({st}) before {what}; events {all:#?}; log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A server's events so far.
    pub fn events(&self) -> Vec<ServerEvent> {
        self.read_events(Role::Server)
    }

    /// The first of a server's events that `f` accepts (the ones so far included).
    pub fn wait_event(
        &mut self,
        what: &str,
        timeout: Duration,
        f: impl Fn(&ServerEvent) -> bool,
    ) -> ServerEvent {
        self.wait_for(Role::Server, what, timeout, &f)
    }

    /// Its network events so far (a server's or a client's): reachability, connections,
    /// reservations, hole punches.
    pub fn net_events(&self) -> Vec<agentjet::swarm::NetEvent> {
        if self.is_client() {
            return self
                .client_events()
                .into_iter()
                .filter_map(|e| match e {
                    ClientEvent::Network(n) => Some(n),
                    _ => None,
                })
                .collect();
        }
        self.events()
            .into_iter()
            .filter_map(|e| match e {
                ServerEvent::Network(n) => Some(n),
                _ => None,
            })
            .collect()
    }

    /// Its connections to `peer` now, by kind (from its network events: each opened,
    /// closed, or turned hole-punched).
    pub fn links_to(&self, peer: &str) -> std::collections::BTreeMap<&'static str, usize> {
        use agentjet::swarm::{LinkKind, NetEvent};
        let mut live: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for e in self.net_events() {
            match e {
                NetEvent::Connected { peer: q, kind, .. } if q == peer => {
                    *live.entry(kind.as_str()).or_default() += 1;
                }
                NetEvent::Closed { peer: q, kind } if q == peer => {
                    let n = live.entry(kind.as_str()).or_default();
                    *n = n.saturating_sub(1);
                }
                NetEvent::HolePunch {
                    peer: q, ok: true, ..
                } if q == peer => {
                    // The direct connection the punch made is hole-punched.
                    let n = live.entry(LinkKind::Direct.as_str()).or_default();
                    *n = n.saturating_sub(1);
                    *live.entry(LinkKind::HolePunched.as_str()).or_default() += 1;
                }
                _ => {}
            }
        }
        live.retain(|_, n| *n > 0);
        live
    }

    /// The reachability it said last.
    pub fn reachability(&self) -> Option<agentjet::swarm::Reachability> {
        self.net_events().into_iter().rev().find_map(|e| match e {
            agentjet::swarm::NetEvent::Reachability { status, .. } => Some(status),
            _ => None,
        })
    }

    /// Whether this peer is a client whose events are watched.
    pub fn is_client(&self) -> bool {
        matches!(self.events, Some((_, Role::Client)))
    }

    /// A client's events so far.
    pub fn client_events(&self) -> Vec<ClientEvent> {
        self.read_events(Role::Client)
    }

    /// The first of a client's events that `f` accepts (the ones so far included).
    pub fn wait_client_event(
        &mut self,
        what: &str,
        timeout: Duration,
        f: impl Fn(&ClientEvent) -> bool,
    ) -> ClientEvent {
        self.wait_for(Role::Client, what, timeout, &f)
    }

    /// A client's proxy base URL (`http://127.0.0.1:PORT/v1`, from its event).
    pub fn proxy_url(&mut self, timeout: Duration) -> String {
        match self.wait_client_event("the proxy", timeout, |e| {
            matches!(e, ClientEvent::Proxy { .. })
        }) {
            ClientEvent::Proxy { url, .. } => url,
            e => unreachable!("{e:?}"),
        }
    }

    /// The peer id and first listen address of a server or client (from its event).
    fn started(&mut self, role: Role) -> (String, String) {
        match role {
            Role::Server => match self.wait_event("the start", Duration::from_secs(120), |e| {
                matches!(e, ServerEvent::Started { .. })
            }) {
                ServerEvent::Started { peer_id, listen } => (peer_id, listen[0].clone()),
                e => unreachable!("{e:?}"),
            },
            Role::Client => {
                match self.wait_client_event("the start", Duration::from_secs(120), |e| {
                    matches!(e, ClientEvent::Started { .. })
                }) {
                    ClientEvent::Started { peer_id, listen } => (peer_id, listen[0].clone()),
                    e => unreachable!("{e:?}"),
                }
            }
        }
    }

    /// A server's training-group epoch of `members` members (its event).
    pub fn wait_epoch(&mut self, members: usize, timeout: Duration) -> ServerEvent {
        self.wait_event(
            &format!("an epoch of {members}"),
            timeout,
            |e| matches!(e, ServerEvent::Formed { members: m, .. } if *m == members),
        )
    }

    /// A server's model is served (its event).
    pub fn wait_serving(&mut self, timeout: Duration) {
        self.wait_event("serving", timeout, |e| {
            matches!(e, ServerEvent::Serving { .. })
        });
    }

    /// A server's HTTP API base URL (`http://ADDR/v1`, from its event).
    pub fn http_url(&mut self, timeout: Duration) -> String {
        match self.wait_event("the HTTP API", timeout, |e| {
            matches!(e, ServerEvent::Http { .. })
        }) {
            ServerEvent::Http { addr } => format!("http://{addr}/v1"),
            _ => unreachable!(),
        }
    }

    /// The first stdout line starting with `prefix` (the rest of it).
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.starts_with(prefix)) {
            return l[prefix.len()..].trim().to_string();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    let hit = l
                        .starts_with(prefix)
                        .then(|| l[prefix.len()..].trim().to_string());
                    self.seen.push(l);
                    if let Some(h) = hit {
                        return h;
                    }
                }
                Err(_) => panic!(
                    "no line {prefix:?} within {timeout:?}; stdout {:?}; log:\n{}",
                    self.seen,
                    self.log_text()
                ),
            }
        }
    }

    /// Every stdout line so far, without waiting.
    pub fn stdout_so_far(&mut self) -> Vec<String> {
        while let Ok(l) = self.lines.try_recv() {
            self.seen.push(l);
        }
        self.seen.clone()
    }

    /// The first stdout line containing `needle` (the whole line).
    pub fn wait_line_containing(&mut self, needle: &str, timeout: Duration) -> String {
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {timeout:?}; stdout {:?}; log:\n{}",
                    self.seen,
                    self.log_text()
                ),
            }
        }
    }

    /// Every stdout line so far (waits up to 2 s for the rest once the process exited).
    pub fn stdout(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) => self.seen.push(l),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() > deadline => break,
                Err(_) => {}
            }
        }
        self.seen.join("\n")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its peer id (a server's or client's from its event; a relay peer's from its line).
    pub fn peer_id(&mut self) -> String {
        match self.events.as_ref().map(|(_, r)| *r) {
            Some(role) => self.started(role).0,
            None => self.wait_line("peer id:", Duration::from_secs(60)),
        }
    }

    /// Its bootstrap address (a server's or client's from its event; a relay peer's from
    /// its line).
    pub fn addr(&mut self) -> String {
        match self.events.as_ref().map(|(_, r)| *r) {
            Some(role) => self.started(role).1,
            None => self.wait_line("listening on", Duration::from_secs(60)),
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking HTTP/1.1 request (Connection: close): (status, body).
pub fn http(base: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let hostport = base
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap();
    let mut s = TcpStream::connect(hostport).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let b = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nAuthorization: Bearer test-episode\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

pub fn metric(base: &str, name: &str) -> Option<f64> {
    let (_, body) = http(base, "GET", "/metrics", None);
    body.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t0.elapsed()
}

/// One signed call of model `tiny` made directly over `/agentjet/infer/2`: `max_tokens`
/// sampled at temperature 1 with the end-of-sequence token (2) banned, so exactly that
/// many; the server's signature kept with the call.
pub async fn signed_call(
    h: &agentjet::swarm::SwarmHandle,
    server: agentjet::swarm::PeerId,
    prompt: Vec<u32>,
    max_tokens: u32,
    seed: u64,
) -> Result<agentjet::timeline::Call, String> {
    let mut prefixes = signed_call_prefixes(h, server, prompt, max_tokens, seed).await?;
    prefixes
        .pop()
        .ok_or_else(|| "the server streamed no token".to_string())
}

/// Every prefix of one signed call as the server streamed it (the call up to each token,
/// with the signature that came with that token).
pub async fn signed_call_prefixes(
    h: &agentjet::swarm::SwarmHandle,
    server: agentjet::swarm::PeerId,
    prompt: Vec<u32>,
    max_tokens: u32,
    seed: u64,
) -> Result<Vec<agentjet::timeline::Call>, String> {
    use agentjet::rpc::{InferFrame, InferRequest, INFER};
    use agentjet::swarm::frame::{read_frame, write_frame};
    let mut s = h.open(server, INFER).await.map_err(|e| e.to_string())?;
    let limit = h.cfg.max_frame_bytes;
    let req = InferRequest {
        model: "tiny".into(),
        prompt: prompt.clone(),
        max_tokens,
        sampling: agentjet::engine::SamplingParams {
            temperature: 1.0,
            logit_bias: vec![(2, -100.0)],
            ..Default::default()
        },
        seed: Some(seed),
        stop_token_ids: vec![],
        top_logprobs: 0,
        constraint: None,
        n: 1,
    };
    write_frame(&mut s, &req, limit)
        .await
        .map_err(|e| e.to_string())?;
    // The call as the server signs it: the transform it drew with, behaviour logprobs.
    let sampling = agentjet::facade::track::transform_of(&req.sampling, false);
    let mut c =
        agentjet::timeline::Call::new("tiny", prompt, vec![], vec![], 0).with_sampling(sampling);
    let mut prefixes = Vec::new();
    loop {
        match read_frame::<_, InferFrame>(&mut s, limit)
            .await
            .map_err(|e| e.to_string())?
        {
            InferFrame::Token {
                id,
                behaviour,
                policy_version,
                signature,
                ..
            } => {
                c.completion_ids.push(id);
                c.logprobs.push(behaviour as f32);
                c.policy_version = policy_version;
                c.signature = signature;
                prefixes.push(c.clone());
            }
            InferFrame::Finished { .. } => return Ok(prefixes),
            other => return Err(format!("the server answered {other:?}")),
        }
    }
}
