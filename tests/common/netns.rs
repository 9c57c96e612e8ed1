//! Hosts in network namespaces, for tests of what crosses a network: a switch standing
//! for the internet, public hosts on it, and home hosts each behind a NAT router of its
//! own. Every address is a documentation address (RFC 5737) that exists only inside the
//! namespaces made here: the internet is 198.51.100.0/24 (TEST-NET-2), home networks are
//! /28s of 203.0.113.0/24 (TEST-NET-3). No namespace has a route to the machine's own
//! interfaces. Everything is removed when the [`Net`] is dropped (and namespaces that a
//! killed test process left behind are removed by the next one).
//!
//! A router's NAT:
//! - [`Nat::Cone`]: `MASQUERADE`, which keeps a connection's source port where it can, so
//!   one inner address and port map to one outer port whoever they talk to (endpoint-
//!   independent mapping, as most home routers);
//! - [`Nat::Symmetric`]: `MASQUERADE --random-fully`, a new random outer port for every
//!   connection (as AWS's and Azure's NAT gateways);
//!
//! and in both, nothing unsolicited comes in: the router drops inbound packets that are
//! not replies to a connection from inside (no port is forwarded).
//!
//! Needs root (CAP_NET_ADMIN), `ip` (iproute2) and `iptables`, which README command 2
//! installs when missing. Without them a test fails with what to install or run as; it is
//! never counted as passed.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A NAT router's kind (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    Cone,
    Symmetric,
}

/// A host: a network namespace with one address.
#[derive(Debug, Clone)]
pub struct Host {
    /// The namespace's name (`ip netns exec NAME ...`).
    pub ns: String,
    /// Its address: on the internet for a public host, on its home network behind NAT.
    pub ip: Ipv4Addr,
    /// The address the internet sees it from: its own for a public host, its router's
    /// for a home host.
    pub public_ip: Ipv4Addr,
}

/// A network of hosts in namespaces (see the module docs).
pub struct Net {
    prefix: String,
    /// Every namespace made, the internet's first.
    namespaces: Vec<String>,
    /// Every host (home hosts and public ones), for the hosts files.
    hosts: Vec<Host>,
    /// Names given with [`Net::name`].
    names: Vec<(String, Ipv4Addr)>,
    next_public: u8,
    next_home: u8,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e} (install iproute2 and iptables)", args[0]))?;
    if !out.status.success() {
        return Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

fn must(args: &[&str]) {
    if let Err(e) = run(args) {
        panic!("building the test network: {e}");
    }
}

/// Prefix of every namespace this harness makes (`<prefix><pid>-<n>-<host>`).
const PREFIX: &str = "ajt";

/// Removes the namespaces (and hosts files) that test processes no longer running left.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: Option<u32> = rest.split('-').next().and_then(|p| p.parse().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = run(&["ip", "netns", "del", name]);
                let _ = std::fs::remove_dir_all(netns_etc(name));
            }
        }
    }
}

fn netns_etc(ns: &str) -> PathBuf {
    Path::new("/etc/netns").join(ns)
}

impl Net {
    /// A new network: the internet's switch alone. Panics (failing the test) with what is
    /// missing when namespaces cannot be made here.
    pub fn new() -> Net {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        remove_stale();
        let prefix = format!(
            "{PREFIX}{}-{}-",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let inet = format!("{prefix}inet");
        if let Err(e) = run(&["ip", "netns", "add", &inet]) {
            panic!(
                "this test needs hosts in network namespaces: root (CAP_NET_ADMIN), iproute2 \
                 and iptables (README command 2 installs them): {e}"
            );
        }
        let net = Net {
            prefix,
            namespaces: vec![inet.clone()],
            hosts: Vec::new(),
            names: Vec::new(),
            next_public: 10,
            next_home: 1,
        };
        must(&["ip", "-n", &inet, "link", "add", "sw", "type", "bridge"]);
        must(&["ip", "-n", &inet, "link", "set", "sw", "up"]);
        net
    }

    fn namespace(&mut self, name: &str) -> String {
        let ns = format!("{}{name}", self.prefix);
        must(&["ip", "netns", "add", &ns]);
        must(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        self.namespaces.push(ns.clone());
        ns
    }

    /// Plugs `ns` into the internet's switch as `dev` with address `ip`.
    fn plug(&mut self, ns: &str, dev: &str, ip: Ipv4Addr) {
        let inet = self.namespaces[0].clone();
        let port = format!("p{}", self.namespaces.len());
        must(&[
            "ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", &port, "netns",
            &inet,
        ]);
        must(&["ip", "-n", &inet, "link", "set", &port, "master", "sw"]);
        must(&["ip", "-n", &inet, "link", "set", &port, "up"]);
        must(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &format!("{ip}/24"),
            "dev",
            dev,
        ]);
        must(&["ip", "-n", ns, "link", "set", dev, "up"]);
    }

    /// A host on the internet with an address of its own.
    pub fn public(&mut self, name: &str) -> Host {
        let ns = self.namespace(name);
        let ip = Ipv4Addr::new(198, 51, 100, self.next_public);
        self.next_public += 1;
        self.plug(&ns, "eth0", ip);
        let h = Host {
            ns,
            ip,
            public_ip: ip,
        };
        self.hosts.push(h.clone());
        self.write_hosts_files();
        h
    }

    /// A host on a home network of its own behind a NAT router of kind `nat`.
    pub fn home(&mut self, name: &str, nat: Nat) -> Host {
        let i = self.next_home;
        self.next_home += 1;
        assert!(i < 16, "at most 15 home networks");
        let router = self.namespace(&format!("{name}-gw"));
        let wan = Ipv4Addr::new(198, 51, 100, 100 + i);
        self.plug(&router, "wan", wan);
        let ns = self.namespace(name);
        let (gw, ip) = (
            Ipv4Addr::new(203, 0, 113, 16 * i + 1),
            Ipv4Addr::new(203, 0, 113, 16 * i + 2),
        );
        must(&[
            "ip", "link", "add", "lan", "netns", &router, "type", "veth", "peer", "name", "eth0",
            "netns", &ns,
        ]);
        must(&[
            "ip",
            "-n",
            &router,
            "addr",
            "add",
            &format!("{gw}/28"),
            "dev",
            "lan",
        ]);
        must(&["ip", "-n", &router, "link", "set", "lan", "up"]);
        must(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{ip}/28"),
            "dev",
            "eth0",
        ]);
        must(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        must(&[
            "ip",
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &gw.to_string(),
        ]);
        let x = |args: &[&str]| {
            let mut all = vec!["ip", "netns", "exec", &router];
            all.extend_from_slice(args);
            must(&all);
        };
        x(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let mut masq = vec![
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "wan",
            "-j",
        ];
        masq.push("MASQUERADE");
        if nat == Nat::Symmetric {
            masq.push("--random-fully");
        }
        x(&masq);
        // Out: anything. In: replies only (to the home host and to the router itself).
        x(&[
            "iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "ACCEPT",
        ]);
        x(&[
            "iptables",
            "-A",
            "FORWARD",
            "-i",
            "wan",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        ]);
        x(&["iptables", "-P", "FORWARD", "DROP"]);
        x(&[
            "iptables",
            "-A",
            "INPUT",
            "-i",
            "wan",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        ]);
        x(&["iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP"]);
        let h = Host {
            ns,
            ip,
            public_ip: wan,
        };
        self.hosts.push(h.clone());
        self.write_hosts_files();
        h
    }

    /// Gives `ip` the DNS name `name` on every host (its `/etc/hosts`, which `ip netns
    /// exec` puts in place of the machine's: `/etc/netns/NS/hosts`).
    pub fn name(&mut self, name: &str, ip: Ipv4Addr) {
        self.names.push((name.to_string(), ip));
        self.write_hosts_files();
    }

    fn write_hosts_files(&self) {
        let mut text = String::from("127.0.0.1 localhost\n");
        for (n, ip) in &self.names {
            text.push_str(&format!("{ip} {n}\n"));
        }
        for h in &self.hosts {
            let dir = netns_etc(&h.ns);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("hosts"), &text).unwrap();
        }
    }

    /// Runs `args` on `host` and returns its stdout (panics on a failure).
    pub fn exec(&self, host: &Host, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &host.ns])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?} on {}: {}",
            host.ns,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            let _ = run(&["ip", "netns", "del", ns]);
            let _ = std::fs::remove_dir_all(netns_etc(ns));
        }
    }
}
