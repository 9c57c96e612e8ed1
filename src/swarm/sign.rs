//! Signatures with the peer's libp2p key: a server signs every call it serves, so a client
//! cannot forge what the model produced. What is signed is a 32-byte digest the caller
//! computes (for calls: `timeline::digest`); this module only signs, encodes and verifies,
//! and says who signed.
//!
//! Owns: the signature encoding ([`CallSignature`], postcard) and its bound
//! ([`MAX_SIGNATURE_BYTES`]). Never knows what the digest covers.

use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

/// The signature a server attaches to a call (postcard-encoded in `Call::signature`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallSignature {
    /// The signer's public key (protobuf encoding); its peer id is derived from it.
    pub public_key: Vec<u8>,
    pub signature: Vec<u8>,
}

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
    #[error("the signature by {0} does not verify (the call was altered or forged)")]
    Invalid(PeerId),
}

/// Signs a digest; the encoded [`CallSignature`].
pub fn sign(key: &Keypair, digest: &[u8; 32]) -> Vec<u8> {
    let signature = key.sign(digest).expect("ed25519 signing does not fail");
    postcard::to_allocvec(&CallSignature {
        public_key: key.public().encode_protobuf(),
        signature,
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

/// Checks an encoded signature over `digest`; the signer's peer id.
pub fn verify(encoded: &[u8], digest: &[u8; 32]) -> Result<PeerId, SignatureError> {
    if encoded.is_empty() {
        return Err(SignatureError::Missing);
    }
    let (public_key, signature) = split(encoded)?;
    let pk = PublicKey::try_decode_protobuf(&public_key)
        .map_err(|e| SignatureError::MalformedKey(e.to_string()))?;
    if !pk.verify(digest, &signature) {
        return Err(SignatureError::Invalid(pk.to_peer_id()));
    }
    Ok(pk.to_peer_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_any_change_breaks_them() {
        let key = Keypair::generate_ed25519();
        let d = *blake3::hash(b"a call").as_bytes();
        let s = sign(&key, &d);
        assert_eq!(verify(&s, &d).unwrap(), key.public().to_peer_id());
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
