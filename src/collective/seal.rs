//! Sealed frames: AES-256-GCM over a byte stream. Each direction of a link has its own
//! nonce space (a direction byte and a 64-bit counter), so no nonce is ever used twice
//! with the link's key; a frame that was altered, replayed, dropped or reordered fails to
//! open (its nonce is the receiver's next counter), and the link is then dead.
//!
//! Frame: `u32 LE ciphertext length` ‖ ciphertext ‖ 16-byte tag. Frames are at most
//! [`MAX_FRAME`] bytes of plaintext; a length over it is refused before anything is read.
//!
//! Owns: the key, the counters and the frame format. Never decides what the bytes mean.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

/// Largest plaintext of one frame.
pub const MAX_FRAME: usize = 4 << 20;
/// Bytes of the authentication tag.
pub const TAG_LEN: usize = 16;

/// The two directions of a link (part of every nonce).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the peer that dialed the link.
    FromDialer = 0xA0,
    /// From the peer that accepted it.
    FromAcceptor = 0xB0,
}

/// Why a frame could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("a frame of {0} bytes is over the limit of {MAX_FRAME}")]
    Oversize(usize),
    #[error("a frame failed authentication (altered, replayed or out of order)")]
    Forged,
    #[error("the link's nonces are used up")]
    Exhausted,
}

/// One direction's key and counter.
pub struct Sealer {
    key: LessSafeKey,
    dir: Direction,
    counter: u64,
}

fn nonce(dir: Direction, counter: u64) -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    n[0] = dir as u8;
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

impl Sealer {
    /// A sealer (or opener) of direction `dir` under `key`.
    pub fn new(key: &[u8; 32], dir: Direction) -> Sealer {
        let unbound = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte AES-256 key");
        Sealer {
            key: LessSafeKey::new(unbound),
            dir,
            counter: 0,
        }
    }

    fn next(&mut self) -> Result<Nonce, SealError> {
        let n = nonce(self.dir, self.counter);
        self.counter = self.counter.checked_add(1).ok_or(SealError::Exhausted)?;
        Ok(n)
    }

    /// Seals `frame[4..]` (the plaintext, after 4 bytes left for the length) in place
    /// and appends the tag; writes the length. `frame` is then ready to send.
    pub fn seal(&mut self, frame: &mut Vec<u8>) -> Result<(), SealError> {
        let len = frame.len() - 4;
        if len > MAX_FRAME {
            return Err(SealError::Oversize(len));
        }
        let nonce = self.next()?;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::empty(), &mut frame[4..])
            .map_err(|_| SealError::Forged)?;
        frame.extend_from_slice(tag.as_ref());
        let total = (len + TAG_LEN) as u32;
        frame[..4].copy_from_slice(&total.to_le_bytes());
        Ok(())
    }

    /// Seals `plain` into `frame` (resized to header ‖ ciphertext ‖ tag) without touching
    /// `plain`: one pass over the plaintext, no copy first.
    pub fn seal_from(&mut self, plain: &[u8], frame: &mut Vec<u8>) -> Result<(), SealError> {
        let len = plain.len();
        if len > MAX_FRAME {
            return Err(SealError::Oversize(len));
        }
        let need = 4 + len + TAG_LEN;
        if frame.len() >= need {
            frame.truncate(need);
        } else {
            frame.resize(need, 0);
        }
        let nonce = self.next()?;
        self.key
            .seal_in_place_scatter(nonce, Aad::empty(), &mut [], plain, &mut frame[4..])
            .map_err(|_| SealError::Forged)?;
        frame[..4].copy_from_slice(&((len + TAG_LEN) as u32).to_le_bytes());
        Ok(())
    }

    /// The ciphertext length a frame header announces, checked against the limit.
    pub fn frame_len(header: [u8; 4]) -> Result<usize, SealError> {
        let n = u32::from_le_bytes(header) as usize;
        if !(TAG_LEN..=MAX_FRAME + TAG_LEN).contains(&n) {
            return Err(SealError::Oversize(n));
        }
        Ok(n)
    }

    /// Opens a frame body (ciphertext ‖ tag) in place; the plaintext is its first
    /// `len - 16` bytes.
    pub fn open<'a>(&mut self, body: &'a mut [u8]) -> Result<&'a mut [u8], SealError> {
        let nonce = self.next()?;
        self.key
            .open_in_place(nonce, Aad::empty(), body)
            .map_err(|_| SealError::Forged)
    }
}

impl Sealer {
    /// Opens a frame body (ciphertext ‖ tag) into `out` (its plaintext length) without
    /// touching the body. On an error `out` holds garbage.
    pub fn open_into(&mut self, body: &[u8], out: &mut [u8]) -> Result<(), SealError> {
        let nonce = self.next()?;
        if body.len() != out.len() + TAG_LEN {
            return Err(SealError::Forged);
        }
        let (ct, tag) = body.split_at(out.len());
        self.key
            .open_separate_gather(nonce, Aad::empty(), ct, tag, out)
            .map_err(|_| SealError::Forged)
    }
}

/// A fresh random 32-byte secret (a link key or token).
pub fn random_secret() -> [u8; 32] {
    use aws_lc_rs::rand::SecureRandom;
    let mut b = [0u8; 32];
    aws_lc_rs::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random generator");
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 4];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn frames_open_in_order_and_any_change_or_replay_fails() {
        let key = random_secret();
        let mut tx = Sealer::new(&key, Direction::FromDialer);
        let mut rx = Sealer::new(&key, Direction::FromDialer);
        let mut a = frame(b"first");
        let mut b = frame(b"second");
        tx.seal(&mut a).unwrap();
        tx.seal(&mut b).unwrap();
        let len = Sealer::frame_len(a[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, 5 + TAG_LEN);
        let mut body = a[4..].to_vec();
        assert_eq!(rx.open(&mut body).unwrap(), b"first");
        // Replaying the first frame, or flipping a bit of the second, fails.
        let mut again = a[4..].to_vec();
        assert_eq!(rx.clone_counter_open(&mut again), Err(SealError::Forged));
        let mut bad = b[4..].to_vec();
        bad[0] ^= 1;
        assert_eq!(rx.open(&mut bad), Err(SealError::Forged));
        // The other direction's opener cannot open it either (its own nonces).
        let mut other = Sealer::new(&key, Direction::FromAcceptor);
        let mut body = b[4..].to_vec();
        assert_eq!(other.open(&mut body), Err(SealError::Forged));
        // A wrong key fails; a header over the limit is refused unread.
        let mut wrong = Sealer::new(&random_secret(), Direction::FromDialer);
        let mut body = a[4..].to_vec();
        assert_eq!(wrong.open(&mut body), Err(SealError::Forged));
        // Sealing from a separate buffer gives the same frame as sealing in place.
        let mut tx2 = Sealer::new(&key, Direction::FromAcceptor);
        let mut rx2 = Sealer::new(&key, Direction::FromAcceptor);
        let mut f = Vec::new();
        tx2.seal_from(b"scattered", &mut f).unwrap();
        let mut body = f[4..].to_vec();
        assert_eq!(rx2.open(&mut body).unwrap(), b"scattered");
        let huge = ((MAX_FRAME + TAG_LEN + 1) as u32).to_le_bytes();
        assert!(matches!(
            Sealer::frame_len(huge),
            Err(SealError::Oversize(_))
        ));
        assert!(matches!(
            Sealer::frame_len(3u32.to_le_bytes()),
            Err(SealError::Oversize(3))
        ));
    }

    impl Sealer {
        /// Opens with the current counter without consuming it (a replay check).
        fn clone_counter_open(&mut self, body: &mut [u8]) -> Result<(), SealError> {
            let saved = self.counter;
            let r = self.open(body).map(|_| ());
            self.counter = saved;
            r
        }
    }
}
