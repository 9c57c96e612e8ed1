//! Signatures with the peer's libp2p key: a server signs every call it serves, so a client
//! cannot forge what the model produced. What is signed is a 32-byte digest the caller
//! computes (for calls: `timeline::digest`) and a random nonce drawn once per generation
//! (the signatures of its prefixes share it), so two identical calls carry different
//! signatures and a server can tell a call submitted twice (or a prefix of it submitted
//! again) from two calls that happen to be equal. This module only signs,
//! encodes and verifies, and says who signed and with which nonce.
//!
//! Owns: the signature encoding ([`CallSignature`], postcard), the nonce ([`Nonce`]) and
//! the bound ([`MAX_SIGNATURE_BYTES`]). Never knows what the digest covers.

use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

/// The signature a server attaches to a call (postcard-encoded in `Call::signature`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallSignature {
    /// The signer's public key (protobuf encoding); its peer id is derived from it.
    pub public_key: Vec<u8>,
    /// The signature's [`Nonce`] (16 bytes), then the key's signature over
    /// [`CALL_DOMAIN`], the digest and the nonce.
    pub signature: Vec<u8>,
}

/// What makes one generation's signatures unique: 16 random bytes, drawn once per
/// generation (one choice of one call) and shared by the signatures of its prefixes, so
/// that every prefix of one generation is the same call to a replay ledger.
pub type Nonce = [u8; 16];

/// Bytes of [`Nonce`] at the start of a signature.
pub const NONCE_BYTES: usize = 16;

/// Prefixed to what is signed, so a call signature is never valid as anything else the
/// peer's key signs (or the reverse).
pub const CALL_DOMAIN: &[u8] = b"agentjet-call-2";

/// Bytes a signature may take at most on the wire.
pub const MAX_SIGNATURE_BYTES: usize = 256;

/// Why a signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the call is not signed")]
    Missing,
    #[error("signature of {0} bytes (at most {MAX_SIGNATURE_BYTES})")]
    TooLarge(usize),
    #[error("malformed signature: {0}")]
    Malformed(String),
    #[error("malformed signer key: {0}")]
    MalformedKey(String),
    #[error(
        "signature of {0} bytes has no nonce (signed by a server older than this one: \
         resubmit calls it made after it is updated)"
    )]
    NoNonce(usize),
    #[error("the signature by {0} does not verify (the call was altered or forged)")]
    Invalid(PeerId),
}

/// A fresh nonce (random).
pub fn new_nonce() -> Nonce {
    let mut n = [0u8; NONCE_BYTES];
    getrandom_02::getrandom(&mut n).expect("the OS gives random bytes");
    n
}

/// What the key signs for a digest and a nonce.
fn message(digest: &[u8; 32], nonce: &Nonce) -> Vec<u8> {
    [CALL_DOMAIN, digest.as_slice(), nonce.as_slice()].concat()
}

/// Signs a digest with a nonce (one per generation: [`new_nonce`]); the encoded
/// [`CallSignature`].
pub fn sign(key: &Keypair, digest: &[u8; 32], nonce: &Nonce) -> Vec<u8> {
    let sig = key
        .sign(&message(digest, nonce))
        .expect("ed25519 signing does not fail");
    postcard::to_allocvec(&CallSignature {
        public_key: key.public().encode_protobuf(),
        signature: [nonce.as_slice(), &sig].concat(),
    })
    .expect("a signature encodes")
}

/// An encoded signature's parts: (signer's public key, signature).
pub fn split(encoded: &[u8]) -> Result<(Vec<u8>, Vec<u8>), SignatureError> {
    if encoded.len() > MAX_SIGNATURE_BYTES {
        return Err(SignatureError::TooLarge(encoded.len()));
    }
    let s: CallSignature =
        postcard::from_bytes(encoded).map_err(|e| SignatureError::Malformed(e.to_string()))?;
    Ok((s.public_key, s.signature))
}

/// The encoded signature from its parts (the inverse of [`split`]).
pub fn join(public_key: &[u8], signature: &[u8]) -> Vec<u8> {
    postcard::to_allocvec(&CallSignature {
        public_key: public_key.to_vec(),
        signature: signature.to_vec(),
    })
    .expect("a signature encodes")
}

/// Who signed, and the signature's nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signed {
    pub signer: PeerId,
    pub nonce: Nonce,
}

/// Checks an encoded signature over `digest`: who signed it, with which nonce.
pub fn verify(encoded: &[u8], digest: &[u8; 32]) -> Result<Signed, SignatureError> {
    if encoded.is_empty() {
        return Err(SignatureError::Missing);
    }
    let (public_key, signature) = split(encoded)?;
    let pk = PublicKey::try_decode_protobuf(&public_key)
        .map_err(|e| SignatureError::MalformedKey(e.to_string()))?;
    // An ed25519 signature is 64 bytes: 64 alone is an older server's, without a nonce.
    let ed25519 = pk.clone().try_into_ed25519().is_ok();
    if signature.len() <= NONCE_BYTES || (ed25519 && signature.len() != NONCE_BYTES + 64) {
        return Err(SignatureError::NoNonce(signature.len()));
    }
    let (nonce, sig) = signature.split_at(NONCE_BYTES);
    let nonce: Nonce = nonce.try_into().expect("split at NONCE_BYTES");
    if !pk.verify(&message(digest, &nonce), sig) {
        return Err(SignatureError::Invalid(pk.to_peer_id()));
    }
    Ok(Signed {
        signer: pk.to_peer_id(),
        nonce,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_any_change_breaks_them() {
        let key = Keypair::generate_ed25519();
        let d = *blake3::hash(b"a call").as_bytes();
        let s = sign(&key, &d, &new_nonce());
        assert_eq!(verify(&s, &d).unwrap().signer, key.public().to_peer_id());
        // The same digest signed again: another nonce, another signature, both valid.
        let s2 = sign(&key, &d, &new_nonce());
        assert_ne!(s, s2);
        assert_ne!(
            verify(&s, &d).unwrap().nonce,
            verify(&s2, &d).unwrap().nonce
        );
        // A nonce swapped for another breaks the signature.
        let (pk, mut sig) = split(&s).unwrap();
        sig[..NONCE_BYTES].copy_from_slice(&verify(&s2, &d).unwrap().nonce);
        assert_eq!(
            verify(&join(&pk, &sig), &d).unwrap_err(),
            SignatureError::Invalid(key.public().to_peer_id())
        );
        // A signature without a nonce (an older server's) is named as such.
        let old = join(&pk, &key.sign(&d).unwrap());
        assert_eq!(verify(&old, &d).unwrap_err(), SignatureError::NoNonce(64));
        let old = join(&pk, &sig[..NONCE_BYTES]);
        assert_eq!(verify(&old, &d).unwrap_err(), SignatureError::NoNonce(16));
        let other = *blake3::hash(b"another call").as_bytes();
        assert_eq!(
            verify(&s, &other).unwrap_err(),
            SignatureError::Invalid(key.public().to_peer_id())
        );
        assert_eq!(verify(&[], &d).unwrap_err(), SignatureError::Missing);
        assert!(matches!(
            verify(&[1, 2, 3], &d).unwrap_err(),
            SignatureError::Malformed(_)
        ));
        assert!(matches!(
            verify(&vec![0; MAX_SIGNATURE_BYTES + 1], &d).unwrap_err(),
            SignatureError::TooLarge(_)
        ));
        let (pk, sig) = split(&s).unwrap();
        assert_eq!(join(&pk, &sig), s);
    }
}
