//! Fetching a policy version from several peers at once, as a follower does: only the
//! chunks that changed since the version it holds (all of them when it holds none or the
//! layout changed), each asked as a delta against the follower's copy, from the sources
//! in turn with bounded parallelism. Every chunk is checked against the manifest's hash
//! before it is kept; a source that sends a wrong or malformed chunk is backed off for
//! the rest of the fetch and named in the report, one that fails twice in a row (gone,
//! timing out) is backed off too, and the chunk is asked again elsewhere. Memory is the
//! target snapshot plus one frame per worker, whatever the sources send.
//!
//! The transport is a [`ChunkSource`]: the swarm's chunk protocol implements it for a
//! peer (not built yet); the tests use sources in memory.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::codec::{decode, CodecError};
use super::manifest::Manifest;

/// A peer that serves chunks of the versions it holds.
pub trait ChunkSource: Send + Sync {
    /// The peer's name (its id), for reports and back-off.
    fn name(&self) -> String;
    /// The frame ([`super::codec::encode`]) of chunk `index` of `version`, encoded as a
    /// delta against the same chunk of version `base` when given (the fetcher holds it).
    fn fetch(&self, version: u64, index: usize, base: Option<u64>) -> Result<Vec<u8>, String>;
}

#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// Chunks in flight at once.
    pub parallel: usize,
    /// Tries per chunk (over all sources) before the fetch fails.
    pub attempts: usize,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            parallel: 4,
            attempts: 8,
        }
    }
}

/// What a fetch moved and whom it backed off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FetchReport {
    /// Chunks fetched (the others were kept from the held version).
    pub chunks: usize,
    /// Frame bytes received and kept, per source.
    pub bytes_by_source: BTreeMap<String, u64>,
    /// Sources backed off, and why (a wrong chunk names its sender here).
    pub backed_off: Vec<(String, String)>,
}

impl FetchReport {
    pub fn bytes(&self) -> u64 {
        self.bytes_by_source.values().sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("chunk {chunk} of version {version} could not be fetched: {why}")]
    Unavailable {
        version: u64,
        chunk: usize,
        why: String,
    },
}

/// One source's standing during a fetch.
struct Standing {
    failures_in_a_row: AtomicUsize,
    backed_off: Mutex<Option<String>>,
}

/// The snapshot of `target`, starting from `have` (a held version and its snapshot) when
/// its layout is the same: the changed chunks fetched from `sources`, checked.
pub fn fetch_version(
    target: &Manifest,
    have: Option<(&Manifest, &[u8])>,
    sources: &[Arc<dyn ChunkSource>],
    cfg: &FetchConfig,
) -> Result<(Vec<u8>, FetchReport), FetchError> {
    let held = have.filter(|(m, b)| b.len() as u64 == m.total_bytes());
    let (needed, base, mut out) = match held.map(|(m, b)| (target.changed_since(m), m, b)) {
        Some((Ok(changed), m, b)) => (changed, Some((m.version, b)), b.to_vec()),
        _ => (
            (0..target.chunks.len()).collect(),
            None,
            vec![0u8; target.total_bytes() as usize],
        ),
    };
    let report = Mutex::new(FetchReport {
        chunks: needed.len(),
        ..Default::default()
    });
    let standing: Vec<Standing> = sources
        .iter()
        .map(|_| Standing {
            failures_in_a_row: AtomicUsize::new(0),
            backed_off: Mutex::new(None),
        })
        .collect();
    let chunk = target.chunk_bytes as usize;
    let slots: Vec<Mutex<&mut [u8]>> = out.chunks_mut(chunk).map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<FetchError>> = Mutex::new(None);
    let workers = cfg.parallel.clamp(1, needed.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                if lock(&failed).is_some() {
                    return;
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = needed.get(k) else { return };
                let range = target.chunk_range(i);
                let base_chunk = base.map(|(v, b)| (v, &b[range.clone()]));
                match fetch_chunk(target, i, base_chunk, sources, &standing, cfg, &report) {
                    Ok(bytes) => lock(&slots[i]).copy_from_slice(&bytes),
                    Err(e) => {
                        lock(&failed).get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    drop(slots);
    if let Some(e) = lock(&failed).take() {
        return Err(e);
    }
    let report = report.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok((out, report))
}

/// Chunk `i` from the sources in turn (starting at `i` modulo their number, so the
/// chunks spread over them), checked; backs off sources that lie or keep failing.
fn fetch_chunk(
    target: &Manifest,
    i: usize,
    base: Option<(u64, &[u8])>,
    sources: &[Arc<dyn ChunkSource>],
    standing: &[Standing],
    cfg: &FetchConfig,
    report: &Mutex<FetchReport>,
) -> Result<Vec<u8>, FetchError> {
    let len = target.chunk_range(i).len();
    let mut why = String::from("no source");
    let n = sources.len();
    let mut tries = 0;
    for k in 0..n * cfg.attempts.max(1) {
        if tries >= cfg.attempts.max(1) {
            break;
        }
        let j = (i + k) % n;
        if lock(&standing[j].backed_off).is_some() {
            continue;
        }
        tries += 1;
        let src = &sources[j];
        let frame = match src.fetch(target.version, i, base.map(|(v, _)| v)) {
            Ok(f) => f,
            Err(e) => {
                why = format!("{}: {e}", src.name());
                if standing[j]
                    .failures_in_a_row
                    .fetch_add(1, Ordering::Relaxed)
                    + 1
                    >= 2
                {
                    back_off(
                        &standing[j],
                        src.name(),
                        format!("failed twice in a row: {e}"),
                        report,
                    );
                }
                continue;
            }
        };
        standing[j].failures_in_a_row.store(0, Ordering::Relaxed);
        // A frame is at most the chunk plus its two header bytes.
        let checked = if frame.len() > len + 2 {
            Err(CodecError::Malformed(format!(
                "a frame of {} bytes for a chunk of {len}",
                frame.len()
            )))
        } else {
            decode(&frame, base.map(|(_, b)| b), len, &target.chunks[i])
        };
        match checked {
            Ok(bytes) => {
                *lock(report).bytes_by_source.entry(src.name()).or_default() += frame.len() as u64;
                return Ok(bytes);
            }
            Err(e) => {
                why = format!("{}: {e}", src.name());
                back_off(
                    &standing[j],
                    src.name(),
                    format!("sent chunk {i} of version {}: {e}", target.version),
                    report,
                );
            }
        }
    }
    Err(FetchError::Unavailable {
        version: target.version,
        chunk: i,
        why,
    })
}

fn back_off(s: &Standing, name: String, why: String, report: &Mutex<FetchReport>) {
    let mut b = lock(&s.backed_off);
    if b.is_none() {
        *b = Some(why.clone());
        lock(report).backed_off.push((name, why));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::super::codec::encode;
    use super::super::manifest::CHUNK_BYTES;
    use super::*;
    use std::collections::HashMap;

    /// A peer holding some versions' snapshots.
    struct Peer {
        name: String,
        versions: HashMap<u64, Vec<u8>>,
        /// Flip a byte of every frame it sends.
        tamper: bool,
        /// Answers with an error (a peer that went away).
        gone: bool,
        served: AtomicUsize,
    }

    impl ChunkSource for Peer {
        fn name(&self) -> String {
            self.name.clone()
        }
        fn fetch(&self, version: u64, index: usize, base: Option<u64>) -> Result<Vec<u8>, String> {
            if self.gone {
                return Err("connection reset".into());
            }
            let c = CHUNK_BYTES as usize;
            let snap = self.versions.get(&version).ok_or("no such version")?;
            let r = index * c..((index + 1) * c).min(snap.len());
            let b = base
                .and_then(|v| self.versions.get(&v))
                .map(|b| &b[r.clone()]);
            let mut f = encode(&snap[r], b, 2);
            if self.tamper {
                let last = f.len() - 1;
                f[last] ^= 0x40;
            }
            self.served.fetch_add(1, Ordering::Relaxed);
            Ok(f)
        }
    }

    fn peer(name: &str, versions: &[(u64, &Vec<u8>)], tamper: bool, gone: bool) -> Arc<Peer> {
        Arc::new(Peer {
            name: name.into(),
            versions: versions.iter().map(|(v, b)| (*v, (*b).clone())).collect(),
            tamper,
            gone,
            served: AtomicUsize::new(0),
        })
    }

    /// Two versions of a 5.5-chunk bf16 snapshot; the second changes chunks 1 and 4.
    fn versions() -> (Manifest, Vec<u8>, Manifest, Vec<u8>) {
        let c = CHUNK_BYTES as u64;
        let n = 5 * c + c / 2;
        let layout = vec![("w".to_string(), "bf16".to_string(), vec![n as i64 / 2], n)];
        let a: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(7)).collect();
        let mut b = a.clone();
        for k in (c as usize + 10..c as usize + 5000).step_by(97) {
            b[k] ^= 1;
        }
        b[4 * c as usize + 3] ^= 2;
        let ma = Manifest::build("m", 1, "h1", &layout, &a).unwrap();
        let mb = Manifest::build("m", 2, "h2", &layout, &b).unwrap();
        (ma, a, mb, b)
    }

    fn sources(ps: &[&Arc<Peer>]) -> Vec<Arc<dyn ChunkSource>> {
        ps.iter()
            .map(|p| Arc::clone(p) as Arc<dyn ChunkSource>)
            .collect()
    }

    #[test]
    fn a_follower_fetches_only_changed_chunks_as_deltas_from_several_peers() {
        let (ma, a, mb, b) = versions();
        let t = peer("trainer", &[(1, &a), (2, &b)], false, false);
        let f = peer("follower", &[(1, &a), (2, &b)], false, false);
        let (got, r) = fetch_version(
            &mb,
            Some((&ma, &a)),
            &sources(&[&t, &f]),
            &FetchConfig::default(),
        )
        .unwrap();
        assert!(got == b, "the fetched snapshot differs");
        assert_eq!(r.chunks, 2);
        assert!(
            r.bytes() < 2 * CHUNK_BYTES as u64 / 10,
            "{} bytes",
            r.bytes()
        );
        // Chunk 1 from one peer, chunk 4 from the other.
        assert_eq!(r.bytes_by_source.len(), 2, "{r:?}");
        assert!(r.backed_off.is_empty());
        // Holding nothing: every chunk, in full.
        let (got, r) = fetch_version(&mb, None, &sources(&[&t]), &FetchConfig::default()).unwrap();
        assert!(got == b);
        assert_eq!(r.chunks, 6);
    }

    #[test]
    fn a_lying_or_vanished_peer_is_backed_off_and_named_and_the_fetch_goes_on() {
        let (ma, a, mb, b) = versions();
        let liar = peer("liar", &[(1, &a), (2, &b)], true, false);
        let gone = peer("gone", &[], false, true);
        let honest = peer("honest", &[(1, &a), (2, &b)], false, false);
        let (got, r) = fetch_version(
            &mb,
            Some((&ma, &a)),
            // Chunk 1 is asked of the liar first (the sources in turn from its index).
            &sources(&[&gone, &liar, &honest]),
            &FetchConfig::default(),
        )
        .unwrap();
        assert!(got == b);
        let named: Vec<&str> = r.backed_off.iter().map(|(n, _)| n.as_str()).collect();
        assert!(named.contains(&"liar"), "{r:?}");
        assert!(
            r.backed_off
                .iter()
                .any(|(n, why)| n == "liar" && why.contains("sent chunk")),
            "{r:?}"
        );
        assert!(!r.bytes_by_source.contains_key("liar"));
        assert_eq!(r.bytes_by_source.keys().collect::<Vec<_>>(), vec!["honest"]);
        // Nobody honest: a clear error naming the chunk, no panic, no hang.
        let e = fetch_version(
            &mb,
            Some((&ma, &a)),
            &sources(&[&liar, &gone]),
            &FetchConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("could not be fetched"), "{e}");
        let e = fetch_version(&mb, None, &[], &FetchConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no source"), "{e}");
    }
}
