//! How a chunk travels: raw, zstd, or as a delta against the receiver's copy of the
//! previous version's chunk (XOR, so unchanged bits are zero bytes, then zstd), with the
//! XOR's bytes optionally regrouped by their place in an element first (all the low bytes
//! of the bf16 values, then all the high bytes: sign and exponent rarely change, so the
//! high plane is nearly all zero). The sender picks the smallest; the receiver rebuilds
//! the chunk, bounded by its known length, and accepts it only if its blake3 hash is the
//! manifest's.

/// Zstd's level: fast to encode (a trainer encodes every changed chunk once per step).
const LEVEL: i32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Encoding {
    Raw = 0,
    Zstd = 1,
    XorZstd = 2,
    /// XOR, byte planes of an element width, zstd.
    XorPlanesZstd = 3,
}

impl Encoding {
    fn from_tag(t: u8) -> Option<Encoding> {
        Some(match t {
            0 => Encoding::Raw,
            1 => Encoding::Zstd,
            2 => Encoding::XorZstd,
            3 => Encoding::XorPlanesZstd,
            _ => return None,
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("chunk frame: {0}")]
    Malformed(String),
    #[error("a delta chunk needs the previous version's chunk, which this peer does not hold")]
    NoBase,
    #[error("the chunk's hash is not the manifest's: the sender's bytes are wrong")]
    HashMismatch,
}

/// `new` (a chunk of `width`-byte elements) encoded against `base` (the previous
/// version's chunk at the same place, if the receiver holds it): the smallest of raw and,
/// with a base, the two XOR deltas, without one zstd. (On SmolLM2's steps a delta was
/// always smaller than the chunk's own zstd, so that is not tried when a delta is
/// possible: a third of the encoding time.) The frame is a tag byte, the plane width,
/// then the payload.
pub fn encode(new: &[u8], base: Option<&[u8]>, width: u8) -> Vec<u8> {
    let frame = |e: Encoding, payload: &[u8]| {
        let mut f = Vec::with_capacity(payload.len() + 2);
        f.push(e as u8);
        f.push(width);
        f.extend_from_slice(payload);
        f
    };
    let mut best = frame(Encoding::Raw, new);
    let mut consider = |e: Encoding, payload: Option<Vec<u8>>| {
        if let Some(p) = payload.filter(|p| p.len() + 2 < best.len()) {
            best = frame(e, &p);
        }
    };
    let Some(base) = base.filter(|b| b.len() == new.len()) else {
        consider(Encoding::Zstd, compress(new).ok());
        return best;
    };
    {
        let x = xor(new, base);
        consider(Encoding::XorZstd, compress(&x).ok());
        if width > 1 && new.len() % width as usize == 0 {
            let planes = to_planes(&x, width as usize);
            consider(Encoding::XorPlanesZstd, compress(&planes).ok());
        }
    }
    best
}

thread_local! {
    /// Each thread's zstd contexts, made once (a context costs more to make than a small
    /// chunk costs to code, and a follower codes hundreds of chunks per version).
    static CONTEXTS: std::cell::RefCell<Option<(zstd::bulk::Compressor<'static>, zstd::bulk::Decompressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's zstd contexts.
fn with_contexts<T>(
    f: impl FnOnce(
        &mut zstd::bulk::Compressor<'static>,
        &mut zstd::bulk::Decompressor<'static>,
    ) -> std::io::Result<T>,
) -> std::io::Result<T> {
    CONTEXTS.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some((
                zstd::bulk::Compressor::new(LEVEL)?,
                zstd::bulk::Decompressor::new()?,
            ));
        }
        match c.as_mut() {
            Some((z, d)) => f(z, d),
            None => Err(std::io::Error::other("no zstd context")),
        }
    })
}

fn compress(data: &[u8]) -> std::io::Result<Vec<u8>> {
    with_contexts(|z, _| z.compress(data))
}

thread_local! {
    /// Each thread's buffer for a delta's byte planes, decoded there and then into the
    /// chunk's place (no allocation per chunk: a hundred netsim followers on two cores
    /// were bound by memory traffic).
    static PLANES: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The largest chunk decoded through [`PLANES`] (a bigger one gets a buffer of its own:
/// a thread keeps its buffer).
const PLANES_MAX: usize = 1 << 20;

/// Runs `f` with a buffer of `len` bytes (their values are left over from earlier use).
fn with_planes<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    if len > PLANES_MAX {
        return f(&mut vec![0u8; len]);
    }
    PLANES.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < len {
            p.resize(len, 0);
        }
        f(&mut p[..len])
    })
}

/// The frame's encoding (for counting what was sent).
pub fn encoding_of(frame: &[u8]) -> Option<Encoding> {
    frame.first().and_then(|&t| Encoding::from_tag(t))
}

/// The chunk a frame carries: `len` bytes, rebuilt against `base` for a delta, accepted
/// only if its blake3 hash is `want`. Never allocates more than `len` bytes for the
/// chunk, whatever the frame claims.
pub fn decode(
    frame: &[u8],
    base: Option<&[u8]>,
    len: usize,
    want: &[u8; 32],
) -> Result<Vec<u8>, CodecError> {
    let mut chunk = vec![0u8; len];
    decode_into(frame, base, &mut chunk, want)?;
    Ok(chunk)
}

/// [`decode`] into `out` (the chunk's place in the snapshot a follower builds: no
/// allocation per chunk). On an error `out` holds whatever the frame made of it.
pub fn decode_into(
    frame: &[u8],
    base: Option<&[u8]>,
    out: &mut [u8],
    want: &[u8; 32],
) -> Result<(), CodecError> {
    let len = out.len();
    let bad = |m: String| Err(CodecError::Malformed(m));
    let (&tag, rest) = match frame.split_first() {
        Some(x) => x,
        None => return bad("empty".into()),
    };
    let Some(e) = Encoding::from_tag(tag) else {
        return bad(format!("unknown encoding {tag}"));
    };
    let (&width, payload) = match rest.split_first() {
        Some(x) => x,
        None => return bad("no plane width".into()),
    };
    // Exactly `len` bytes into `to` (zstd stops at its end, whatever the frame claims).
    let unzstd = |p: &[u8], to: &mut [u8]| -> Result<(), CodecError> {
        let n = with_contexts(|_, d| d.decompress_to_buffer(p, to))
            .map_err(|e| CodecError::Malformed(format!("zstd: {e}")))?;
        if n != len {
            return Err(CodecError::Malformed(format!(
                "{n} bytes, the chunk has {len}"
            )));
        }
        Ok(())
    };
    match e {
        Encoding::Raw if payload.len() == len => out.copy_from_slice(payload),
        Encoding::Raw => return bad(format!("{} raw bytes, the chunk has {len}", payload.len())),
        Encoding::Zstd => unzstd(payload, out)?,
        Encoding::XorZstd | Encoding::XorPlanesZstd => {
            let base = base.filter(|b| b.len() == len).ok_or(CodecError::NoBase)?;
            if e == Encoding::XorPlanesZstd {
                if width < 2 || len % width as usize != 0 {
                    return bad(format!("plane width {width} for {len} bytes"));
                }
                with_planes(len, |planes| {
                    unzstd(payload, planes)?;
                    from_planes_xor(planes, width as usize, base, out);
                    Ok::<(), CodecError>(())
                })?
            } else {
                unzstd(payload, out)?;
                out.iter_mut().zip(base).for_each(|(a, b)| *a ^= b);
            }
        }
    }
    if blake3::hash(out).as_bytes() != want {
        return Err(CodecError::HashMismatch);
    }
    Ok(())
}

fn xor(a: &[u8], b: &[u8]) -> Vec<u8> {
    a.iter().zip(b).map(|(x, y)| x ^ y).collect()
}

/// Byte `k` of every element together, for k = 0..width (`x.len()` a multiple of
/// `width`). Widths 2 and 4 (bf16, f32) without index arithmetic: a follower turns
/// every chunk it takes through [`from_planes_xor`].
fn to_planes(x: &[u8], width: usize) -> Vec<u8> {
    let mut out = vec![0u8; x.len()];
    if x.is_empty() || width == 0 {
        return out;
    }
    let n = x.len() / width;
    match width {
        2 => {
            let (a, b) = out.split_at_mut(n);
            for ((e, p), q) in x.chunks_exact(2).zip(a).zip(b) {
                (*p, *q) = (e[0], e[1]);
            }
        }
        4 => {
            let (a, rest) = out.split_at_mut(n);
            let (b, rest) = rest.split_at_mut(n);
            let (c, d) = rest.split_at_mut(n);
            for ((((e, p), q), r), t) in x.chunks_exact(4).zip(a).zip(b).zip(c).zip(d) {
                (*p, *q, *r, *t) = (e[0], e[1], e[2], e[3]);
            }
        }
        _ => {
            for (i, e) in x.chunks_exact(width).enumerate() {
                for (k, &v) in e.iter().enumerate() {
                    out[k * n + i] = v;
                }
            }
        }
    }
    out
}

/// The inverse of [`to_planes`] into `out`, each byte XORed with `base`'s at its place
/// (a delta's chunk in one pass: `base` and `out` are as long as `p`; else `out` is
/// left as it is). Widths 2 and 4 a whole element at a time.
fn from_planes_xor(p: &[u8], width: usize, base: &[u8], out: &mut [u8]) {
    if p.is_empty() || width == 0 || base.len() != p.len() || out.len() != p.len() {
        return;
    }
    let n = p.len() / width;
    match width {
        // Plain index loops over slices cut to their lengths first. Width 2 (bf16) then
        // vectorises (SSE2 in the release build's disassembly; the iterator chain of
        // `chunks_exact` before made a call per element in this crate); width 4 keeps its
        // bounds checks and stays scalar (not measured: float32 snapshots are rarer).
        2 => {
            let (a, b) = (&p[..n], &p[n..2 * n]);
            let (out, base) = (&mut out[..2 * n], &base[..2 * n]);
            for k in 0..n {
                out[2 * k] = a[k] ^ base[2 * k];
                out[2 * k + 1] = b[k] ^ base[2 * k + 1];
            }
        }
        4 => {
            let (a, b, c, d) = (&p[..n], &p[n..2 * n], &p[2 * n..3 * n], &p[3 * n..4 * n]);
            let (out, base) = (&mut out[..4 * n], &base[..4 * n]);
            for k in 0..n {
                out[4 * k] = a[k] ^ base[4 * k];
                out[4 * k + 1] = b[k] ^ base[4 * k + 1];
                out[4 * k + 2] = c[k] ^ base[4 * k + 2];
                out[4 * k + 3] = d[k] ^ base[4 * k + 3];
            }
        }
        _ => {
            for (k, plane) in p.chunks_exact(n).enumerate() {
                for (i, &v) in plane.iter().enumerate() {
                    out[i * width + k] = v ^ base[i * width + k];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planes_xor(p: &[u8], width: usize, base: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; p.len()];
        from_planes_xor(p, width, base, &mut out);
        out
    }

    #[test]
    fn planes_go_there_and_back_at_every_width() {
        let x: Vec<u8> = (0..48u8).collect();
        for width in [1, 2, 3, 4, 8] {
            let p = to_planes(&x, width);
            // Byte k of element i sits at k * n + i.
            let n = x.len() / width;
            for (i, e) in x.chunks_exact(width).enumerate() {
                for (k, &v) in e.iter().enumerate() {
                    assert_eq!(p[k * n + i], v, "width {width}");
                }
            }
            assert_eq!(planes_xor(&p, width, &[0; 48]), x, "width {width}");
            // Against a base: each byte XORed with the base's at its place.
            let base: Vec<u8> = (0..48u8).map(|b| b.wrapping_mul(37) ^ 0xa5).collect();
            let want: Vec<u8> = x.iter().zip(&base).map(|(a, b)| a ^ b).collect();
            assert_eq!(planes_xor(&p, width, &base), want, "width {width}");
        }
        assert!(planes_xor(&[], 2, &[]).is_empty());
    }

    /// bf16 values of a smooth pseudo-random walk, and the same after a small update of
    /// a few percent of them (what an optimizer step does to a chunk).
    fn bf16_pair(n: usize) -> (Vec<u8>, Vec<u8>) {
        let mut rng = crate::base::Rng::seeded(5);
        let mut old = Vec::with_capacity(2 * n);
        let mut new = Vec::with_capacity(2 * n);
        for _ in 0..n {
            let v = (rng.next_f64() as f32 - 0.5) * 0.1;
            let u = if rng.next_f64() < 0.03 { v * 1.01 } else { v };
            old.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
            new.extend_from_slice(&((u.to_bits() >> 16) as u16).to_le_bytes());
        }
        (old, new)
    }

    #[test]
    fn a_frame_decodes_into_a_used_buffer_and_a_short_or_baseless_one_is_refused() {
        let (old, new) = bf16_pair(1 << 14);
        let want = *blake3::hash(&new).as_bytes();
        // Into a buffer that held other bytes (a fetch's slot, a failed decode before).
        for f in [encode(&new, Some(&old), 2), encode(&new, None, 2)] {
            let mut out = vec![0xa5u8; new.len()];
            decode_into(&f, Some(&old), &mut out, &want).unwrap();
            assert_eq!(out, new, "{:?}", encoding_of(&f));
        }
        // A zstd payload of fewer bytes than the chunk.
        let mut short = vec![Encoding::Zstd as u8, 2];
        short.extend(zstd::bulk::compress(&new[..new.len() / 2], 3).unwrap());
        let mut out = vec![0u8; new.len()];
        assert!(matches!(
            decode_into(&short, None, &mut out, &want),
            Err(CodecError::Malformed(_))
        ));
        // A delta against a base of another length.
        let delta = encode(&new, Some(&old), 2);
        assert_eq!(
            decode_into(&delta, Some(&old[1..]), &mut out, &want),
            Err(CodecError::NoBase)
        );
    }

    #[test]
    fn a_small_update_goes_as_a_small_delta_and_decodes_exactly() {
        let (old, new) = bf16_pair(1 << 19);
        let want = *blake3::hash(&new).as_bytes();
        let f = encode(&new, Some(&old), 2);
        assert!(
            matches!(
                encoding_of(&f),
                Some(Encoding::XorZstd | Encoding::XorPlanesZstd)
            ),
            "{:?}",
            encoding_of(&f)
        );
        assert!(
            f.len() * 5 < new.len(),
            "{} bytes for {}",
            f.len(),
            new.len()
        );
        assert_eq!(decode(&f, Some(&old), new.len(), &want).unwrap(), new);
        // Without the base a delta cannot be rebuilt; a full frame needs none.
        assert_eq!(decode(&f, None, new.len(), &want), Err(CodecError::NoBase));
        let full = encode(&new, None, 2);
        assert!(matches!(
            encoding_of(&full),
            Some(Encoding::Raw | Encoding::Zstd)
        ));
        assert_eq!(decode(&full, None, new.len(), &want).unwrap(), new);
        // Random bytes do not compress: raw.
        let noise: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let f = encode(&noise, None, 1);
        let h = *blake3::hash(&noise).as_bytes();
        assert_eq!(decode(&f, None, noise.len(), &h).unwrap(), noise);
    }

    #[test]
    fn a_tampered_or_oversized_frame_is_refused() {
        let (old, new) = bf16_pair(4096);
        let want = *blake3::hash(&new).as_bytes();
        for base in [None, Some(old.as_slice())] {
            let f = encode(&new, base, 2);
            let mut t = f.clone();
            let last = t.len() - 1;
            t[last] ^= 1;
            let e = decode(&t, base, new.len(), &want).unwrap_err();
            assert!(
                matches!(e, CodecError::HashMismatch | CodecError::Malformed(_)),
                "{e:?}"
            );
        }
        // Raw bytes that are not the chunk: the hash says so.
        let mut raw = vec![0u8, 2];
        raw.extend_from_slice(&old);
        assert_eq!(
            decode(&raw, None, new.len(), &want),
            Err(CodecError::HashMismatch)
        );
        // A zstd frame that inflates past the chunk's length stops at it.
        let big = vec![0u8; 1 << 20];
        let mut bomb = vec![Encoding::Zstd as u8, 1];
        bomb.extend(zstd::bulk::compress(&big, 3).unwrap());
        assert!(matches!(
            decode(&bomb, None, 4096, &want),
            Err(CodecError::Malformed(_))
        ));
        for junk in [&[][..], &[9, 1][..], &[0][..]] {
            assert!(matches!(
                decode(junk, None, 4, &want),
                Err(CodecError::Malformed(_))
            ));
        }
    }

    #[test]
    fn planes_round_trip() {
        let x: Vec<u8> = (0..24u8).collect();
        for w in [2, 4] {
            assert_eq!(planes_xor(&to_planes(&x, w), w, &[0; 24]), x);
        }
    }
}
