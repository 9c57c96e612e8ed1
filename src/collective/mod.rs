//! The collective: what the servers of one model do together. The data plane (sealed
//! point-to-point links set up through the swarm), the ring all-reduce over them, the
//! training group ([`group`]: masterless membership epochs, heartbeats, step rounds with
//! a commit), and the member loop that drives any [`member::Learner`] through the group's
//! rounds ([`member`]: the server's trainer and netsim's stand-in run the same loop).
//!
//! The data plane is a TCP connection per link carrying AES-256-GCM frames ([`seal`]) (or
//! a byte stream of another [`LinkNet`]: netsim's simulated internet),
//! not the swarm's QUIC streams: bulk tensors need throughput that a user-space QUIC
//! stack on the CPU does not give (measured in `cargo bench --bench allreduce`). Security
//! does not move: a link's key and one-use token are handed over the swarm's
//! authenticated, encrypted stream (`/agentjet/collective/1`), to the peer the swarm
//! authenticated, after the swarm key's admission; every frame is authenticated, and a
//! frame that was altered, replayed or reordered kills the link ([`link`]).
//!
//! Owns: moving and reducing values between members, who is in a group (epochs), and the
//! order of a member's rounds. Never touches LibTorch (learners hand it `f32` slices),
//! never decides what a step computes (the learner does).

#[cfg(feature = "broadcast")]
pub mod broadcast;
pub mod group;
pub mod link;
pub mod member;
pub mod pace;
pub mod rendezvous;
pub mod ring;
pub mod seal;

pub use link::{
    Conn, LinkError, LinkListener, LinkNet, LinkOffer, LinkPort, LinkRead, LinkRx, LinkTx,
    LinkWrite, TcpLinks,
};
pub use pace::BeatPacer;
pub use rendezvous::{ask_link, serve_links, LinkAsk, OfferBook, COLLECTIVE};
pub use ring::{Ring, RingError, RoundStats, Wire};

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    pub(crate) fn local_rings(n: usize) -> Vec<Ring> {
        Ring::loopback(n).unwrap()
    }

    fn run(rings: Vec<Ring>, inputs: Vec<Vec<f32>>, wire: Wire) -> Vec<Vec<f32>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = rings
                .into_iter()
                .zip(inputs)
                .map(|(mut ring, mut data)| {
                    s.spawn(move || {
                        ring.all_reduce(&mut data, wire).unwrap();
                        data
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_member_ends_with_the_same_sum_at_interesting_sizes() {
        for n in 1usize..=4 {
            for len in [0usize, 1, n.saturating_sub(1), n, 1000, 4 * 256 * 1024 + 3] {
                let inputs: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        (0..len)
                            .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.25 - 3.0)
                            .collect()
                    })
                    .collect();
                let want: Vec<f32> = (0..len)
                    .map(|i| inputs.iter().map(|v| v[i]).sum())
                    .collect();
                let mut rings = local_rings(n);
                for r in &mut rings {
                    r.chunk = 1000; // several frames per segment
                }
                let out = run(rings, inputs, Wire::F32);
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o, &out[0], "member {r} of {n} differs (len {len})");
                    // Small integers times 0.25: every partial sum is exact in f32.
                    assert_eq!(o, &want, "n {n} len {len}");
                }
            }
        }
    }

    #[test]
    fn a_bf16_wire_agrees_bit_for_bit_and_stays_close() {
        let n = 3;
        let len = 10_001;
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..len)
                    .map(|i| ((i as f32) * 0.37 + r as f32).sin())
                    .collect()
            })
            .collect();
        let want: Vec<f32> = (0..len)
            .map(|i| inputs.iter().map(|v| v[i]).sum())
            .collect();
        let out = run(local_rings(n), inputs, Wire::Bf16);
        for o in &out {
            assert_eq!(
                o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                out[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        let worst = out[0]
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // Three terms in [-1, 1], two bf16 roundings per hop: well under 0.05.
        assert!(worst < 0.05, "{worst}");
    }

    #[test]
    fn a_stalled_member_fails_the_round_within_the_timeout() {
        let mut rings = local_rings(3);
        let stalled = rings.pop().unwrap();
        for r in &rings {
            r.set_timeout(Duration::from_millis(300)).unwrap();
        }
        let t0 = std::time::Instant::now();
        let errs: Vec<RingError> = std::thread::scope(|s| {
            let hs: Vec<_> = rings
                .into_iter()
                .map(|mut ring| {
                    s.spawn(move || ring.all_reduce(&mut vec![1.0; 1 << 20], Wire::F32))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap_err())
                .collect()
        });
        drop(stalled);
        assert_eq!(errs.len(), 2);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
