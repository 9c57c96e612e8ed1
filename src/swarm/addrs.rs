//! Addresses as facts about the network: which of a peer's addresses another host can use,
//! in which order a peer offers them, DNS names resolved to addresses, and a taken port
//! said as such.
//!
//! - A **local** address (loopback, link-local, unspecified) reaches this host only. It is
//!   never offered to other peers, and one a peer offers is not used unless that peer is
//!   on this host (the connection to it is local), except in a swarm that is all local: a
//!   peer whose every listen address is loopback can only ever meet peers of its own host.
//! - A **relayed** address (`/p2p-circuit`) reaches a peer behind NAT through a relay.
//! - **Offered** addresses, in order: those other hosts confirmed or the user gave
//!   (`--external-addr`, AutoNAT, UPnP), then the interface addresses the peer listens
//!   on, then relayed ones; the first is the one to give another host.
//!
//! Owns: those rules. Never dials or listens.

use std::net::IpAddr;

use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;

/// Whether `a` reaches this host only (loopback, link-local or unspecified IP).
pub fn is_local(a: &Multiaddr) -> bool {
    a.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_loopback() || ip.is_link_local() || ip.is_unspecified(),
        Protocol::Ip6(ip) => {
            ip.is_loopback() || ip.is_unspecified() || (ip.segments()[0] & 0xffc0) == 0xfe80
        }
        _ => false,
    })
}

/// Whether `a` goes through a relay (`/p2p-circuit`).
pub fn is_relayed(a: &Multiaddr) -> bool {
    a.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

/// The IP address `a` names, if any (a DNS name names none until resolved).
pub fn ip_of(a: &Multiaddr) -> Option<IpAddr> {
    a.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

/// `a` without a trailing `/p2p/<id>` (addresses kept per peer carry none).
pub fn without_peer(a: &Multiaddr) -> Multiaddr {
    let mut a = a.clone();
    if matches!(a.iter().last(), Some(Protocol::P2p(_))) {
        a.pop();
    }
    a
}

/// Whether every address among `listen` is loopback: a swarm of this host alone.
pub fn all_loopback(listen: &[Multiaddr]) -> bool {
    !listen.is_empty()
        && listen.iter().all(|a| {
            ip_of(a).is_some_and(|ip| ip.is_loopback())
                || matches!(a.iter().next(), Some(Protocol::Memory(_)))
        })
}

/// The addresses a peer offers to others (its gossip, the order it prints them in):
/// `external` (confirmed or given) first, then its non-local `listen` addresses, relayed
/// ones last; local addresses only when it listens on loopback alone (see the module
/// docs). Each once, at most `max`.
pub fn offered(external: &[Multiaddr], listen: &[Multiaddr], max: usize) -> Vec<Multiaddr> {
    let local_only = all_loopback(listen);
    let keep = |a: &&Multiaddr| local_only || !is_local(a);
    let mut direct: Vec<Multiaddr> = Vec::new();
    for a in external
        .iter()
        .chain(listen)
        .filter(|a| !is_relayed(a))
        .filter(keep)
    {
        if !direct.contains(a) {
            direct.push(a.clone());
        }
    }
    let mut relayed: Vec<Multiaddr> = Vec::new();
    for a in listen.iter().chain(external).filter(|a| is_relayed(a)) {
        if !relayed.contains(a) {
            relayed.push(a.clone());
        }
    }
    // The relayed ones are kept whatever the number of interfaces (a host behind NAT
    // with many has no other address another host can use), up to half of `max`.
    relayed.truncate(max / 2);
    direct.truncate(max - relayed.len());
    direct.extend(relayed);
    direct
}

/// The addresses of a peer worth keeping, from what it (or another peer) said of it:
/// its local addresses only when `local` (our connection to it is local, or this swarm is
/// all local). At most 16.
pub fn usable(addrs: impl IntoIterator<Item = Multiaddr>, local: bool) -> Vec<Multiaddr> {
    let mut out: Vec<Multiaddr> = Vec::new();
    for a in addrs {
        let a = without_peer(&a);
        if (local || !is_local(&a)) && !out.contains(&a) {
            out.push(a);
        }
        if out.len() == 16 {
            break;
        }
    }
    out
}

/// Why a DNS address could not be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    #[error("{addr}: the name {name:?} resolves to no {family} address")]
    Nothing {
        addr: Multiaddr,
        name: String,
        family: &'static str,
    },
    #[error("{addr}: resolving {name:?}: {why}")]
    Lookup {
        addr: Multiaddr,
        name: String,
        why: String,
    },
}

/// `a` with its DNS name (`/dns`, `/dns4`, `/dns6`) replaced by each address the name
/// resolves to (the system's resolver: `/etc/hosts`, then DNS), in the resolver's order;
/// `a` itself when it names no host. `/dns4` takes IPv4 answers only, `/dns6` IPv6 only.
pub async fn resolve(a: &Multiaddr) -> Result<Vec<Multiaddr>, ResolveError> {
    let Some((i, name, want)) = a.iter().enumerate().find_map(|(i, p)| match p {
        Protocol::Dns(n) => Some((i, n.to_string(), 0u8)),
        Protocol::Dns4(n) => Some((i, n.to_string(), 4)),
        Protocol::Dns6(n) => Some((i, n.to_string(), 6)),
        _ => None,
    }) else {
        return Ok(vec![a.clone()]);
    };
    let ips: Vec<IpAddr> = tokio::net::lookup_host((name.as_str(), 0))
        .await
        .map_err(|e| ResolveError::Lookup {
            addr: a.clone(),
            name: name.clone(),
            why: e.to_string(),
        })?
        .map(|s| s.ip())
        .filter(|ip| match want {
            4 => ip.is_ipv4(),
            6 => ip.is_ipv6(),
            _ => true,
        })
        .collect();
    let mut out: Vec<Multiaddr> = Vec::new();
    for ip in ips {
        let p = match ip {
            IpAddr::V4(v4) => Protocol::Ip4(v4),
            IpAddr::V6(v6) => Protocol::Ip6(v6),
        };
        let r: Multiaddr = a
            .iter()
            .enumerate()
            .map(|(j, q)| if j == i { p.clone() } else { q })
            .collect();
        if !out.contains(&r) {
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err(ResolveError::Nothing {
            addr: a.clone(),
            name,
            family: match want {
                4 => "IPv4",
                6 => "IPv6",
                _ => "IP",
            },
        });
    }
    Ok(out)
}

/// A listen address whose port another process holds.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "{proto} port {port} is taken ({addr}: another process listens there, perhaps another \
     agentjet-peer on this machine): give this peer other ports, e.g. --listen \
     /ip4/0.0.0.0/udp/{other}/quic-v1 --listen /ip4/0.0.0.0/tcp/{other}, or port 0 for any \
     free one",
    other = port.saturating_add(1)
)]
pub struct PortTaken {
    pub addr: Multiaddr,
    pub proto: &'static str,
    pub port: u16,
}

/// The first listen address whose port is taken (another process listens there), found
/// before the node tries to listen. Ports 0 (any free one), addresses that are not TCP or
/// UDP, and IPv6 ones (a probe socket there would be dual-stack where libp2p's is not)
/// are never reported.
pub fn taken_port(listen: &[Multiaddr]) -> Option<PortTaken> {
    for a in listen {
        let Some(ip @ IpAddr::V4(_)) = ip_of(a) else {
            continue;
        };
        let (udp, port) = match a.iter().find_map(|p| match p {
            Protocol::Tcp(port) => Some((false, port)),
            Protocol::Udp(port) => Some((true, port)),
            _ => None,
        }) {
            Some(x) => x,
            None => continue,
        };
        if port == 0 {
            continue;
        }
        let at = std::net::SocketAddr::new(ip, port);
        let bound = if udp {
            std::net::UdpSocket::bind(at).map(drop)
        } else {
            std::net::TcpListener::bind(at).map(drop)
        };
        if let Err(e) = bound {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                return Some(PortTaken {
                    addr: a.clone(),
                    proto: if udp { "UDP" } else { "TCP" },
                    port,
                });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> Multiaddr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_is_offered_only_by_a_peer_that_listens_on_loopback_alone() {
        let listen = [
            m("/ip4/127.0.0.1/udp/4001/quic-v1"),
            m("/ip4/198.51.100.7/udp/4001/quic-v1"),
            m("/ip4/169.254.3.1/tcp/4001"),
            m("/ip6/fe80::1/tcp/4001"),
            m("/ip4/198.51.100.7/tcp/4001"),
        ];
        let ext = [m("/ip4/203.0.113.9/tcp/4001")];
        assert_eq!(
            offered(&ext, &listen, 16),
            vec![
                m("/ip4/203.0.113.9/tcp/4001"),
                m("/ip4/198.51.100.7/udp/4001/quic-v1"),
                m("/ip4/198.51.100.7/tcp/4001"),
            ]
        );
        let lo = [m("/ip4/127.0.0.1/udp/5000/quic-v1")];
        assert_eq!(offered(&[], &lo, 16), lo.to_vec());
        // A relayed address comes after the direct ones.
        let circuit = m("/ip4/198.51.100.2/udp/4001/quic-v1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit");
        let got = offered(std::slice::from_ref(&circuit), &listen[1..2], 16);
        assert_eq!(got, vec![listen[1].clone(), circuit]);
        // What another peer says is kept without its local addresses unless local.
        let said = vec![listen[0].clone(), listen[1].clone()];
        assert_eq!(usable(said.clone(), false), vec![listen[1].clone()]);
        assert_eq!(usable(said, true).len(), 2);
    }

    #[tokio::test]
    async fn a_dns_address_resolves_through_the_hosts_file_and_an_unknown_name_says_so() {
        let a =
            m("/dns4/localhost/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN");
        let got = resolve(&a).await.unwrap();
        assert!(got.contains(&m(
            "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
        )));
        let plain = m("/ip4/127.0.0.1/tcp/1");
        assert_eq!(resolve(&plain).await.unwrap(), vec![plain]);
        let bad = m("/dns4/no-such-host.invalid/tcp/4001");
        let e = resolve(&bad).await.unwrap_err().to_string();
        assert!(e.contains("no-such-host.invalid"), "{e}");
    }

    #[test]
    fn a_taken_port_is_named_with_what_to_pass_instead() {
        let held = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let a = m(&format!("/ip4/127.0.0.1/udp/{port}/quic-v1"));
        let why = taken_port(&[m("/ip4/127.0.0.1/udp/0/quic-v1"), a])
            .unwrap()
            .to_string();
        assert!(why.contains(&format!("UDP port {port} is taken")), "{why}");
        assert!(why.contains("--listen"), "{why}");
        drop(held);
        assert!(taken_port(&[m("/ip4/127.0.0.1/udp/0/quic-v1")]).is_none());
    }
}
