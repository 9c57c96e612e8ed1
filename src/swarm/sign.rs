//! Signed calls: a server signs every call it serves with its libp2p key, so a client
//! cannot forge what the model produced. The signature covers the call's digest: blake3
//! over the model name, prompt ids, completion ids, the behaviour logprobs (as f32 bits)
//! and the policy version. A server receiving an episode rebuilds each call from the
//! fragments (a call's prompt is its branch's tokens before its sampled segment) and checks
//! that every sampled segment is signed by a server of that model.

use libp2p::identity::{Keypair, PublicKey};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use crate::timeline::Timeline;

/// The signature a server attaches to a call (postcard-encoded in `Call::signature`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallSignature {
    /// The signer's public key (protobuf encoding); its peer id is derived from it.
    pub public_key: Vec<u8>,
    pub signature: Vec<u8>,
}

/// Bytes a signature may take at most on the wire.
pub const MAX_SIGNATURE_BYTES: usize = 256;

/// The digest a call's signature covers, built token by token: a server signs the prefix
/// after every token it streams, so whatever prefix a client keeps (a stop string cut the
/// output; the server died mid-call) is signed exactly.
#[derive(Clone)]
pub struct CallHasher {
    h: blake3::Hasher,
    n: u64,
    version: u64,
}

impl CallHasher {
    pub fn new(model: &str, version: u64, prompt: &[u32]) -> CallHasher {
        let mut h = blake3::Hasher::new();
        h.update(b"agentjet-call-1");
        h.update(&(model.len() as u64).to_le_bytes());
        h.update(model.as_bytes());
        h.update(&version.to_le_bytes());
        h.update(&(prompt.len() as u64).to_le_bytes());
        for t in prompt {
            h.update(&t.to_le_bytes());
        }
        CallHasher { h, n: 0, version }
    }

    /// The policy version the digest names.
    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn push(&mut self, token: u32, logprob: f32) {
        self.h.update(&token.to_le_bytes());
        self.h.update(&logprob.to_bits().to_le_bytes());
        self.n += 1;
    }

    /// The digest of the call with the tokens pushed so far as its completion.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = self.h.clone();
        h.update(&self.n.to_le_bytes());
        *h.finalize().as_bytes()
    }
}

/// The digest of a whole call.
pub fn call_digest(
    model: &str,
    prompt: &[u32],
    completion: &[u32],
    logprobs: &[f32],
    version: u64,
) -> [u8; 32] {
    let mut h = CallHasher::new(model, version, prompt);
    for (t, l) in completion.iter().zip(logprobs) {
        h.push(*t, *l);
    }
    if completion.len() != logprobs.len() {
        // Not a call a server could have signed; make sure no signature matches.
        h.push(u32::MAX, f32::NAN);
    }
    h.digest()
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
pub fn split(encoded: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    if encoded.len() > MAX_SIGNATURE_BYTES {
        return Err(format!(
            "signature of {} bytes (at most {MAX_SIGNATURE_BYTES})",
            encoded.len()
        ));
    }
    let s: CallSignature =
        postcard::from_bytes(encoded).map_err(|e| format!("malformed signature: {e}"))?;
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
pub fn verify(encoded: &[u8], digest: &[u8; 32]) -> Result<PeerId, String> {
    if encoded.is_empty() {
        return Err("the call is not signed".into());
    }
    let (public_key, signature) = split(encoded)?;
    let pk = PublicKey::try_decode_protobuf(&public_key)
        .map_err(|e| format!("malformed signer key: {e}"))?;
    if !pk.verify(digest, &signature) {
        return Err(format!(
            "the signature by {} does not verify (the call was altered or forged)",
            pk.to_peer_id()
        ));
    }
    Ok(pk.to_peer_id())
}

/// A call as rebuilt from a timeline: its index, prompt, completion, logprobs, version.
#[derive(Debug, Clone, PartialEq)]
pub struct RebuiltCall {
    pub call: u32,
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub version: u64,
}

/// Every call of `t` that sampled tokens, rebuilt from its branch.
pub fn rebuilt_calls(t: &Timeline) -> Vec<RebuiltCall> {
    let mut out: Vec<RebuiltCall> = Vec::new();
    for b in &t.branches {
        let mut context: Vec<u32> = Vec::new();
        for s in &b.segments {
            if s.sampled {
                match out.last_mut() {
                    // A completion cut across fragments of one segment joins again.
                    Some(last)
                        if last.call == s.call
                            && last.prompt.len() + last.completion.len() == context.len() =>
                    {
                        last.completion.extend_from_slice(&s.tokens);
                        last.logprobs.extend_from_slice(&s.logprobs);
                    }
                    _ => out.push(RebuiltCall {
                        call: s.call,
                        prompt: context.clone(),
                        completion: s.tokens.clone(),
                        logprobs: s.logprobs.clone(),
                        version: s.version,
                    }),
                }
            }
            context.extend_from_slice(&s.tokens);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_verify_and_any_change_breaks_them() {
        let key = Keypair::generate_ed25519();
        let d = call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 7);
        let s = sign(&key, &d);
        assert_eq!(verify(&s, &d).unwrap(), key.public().to_peer_id());
        for other in [
            call_digest("n", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 7),
            call_digest("m", &[1, 2, 3, 4], &[5], &[-1.0], 7),
            call_digest("m", &[1, 2, 3], &[4], &[-0.5], 7),
            call_digest("m", &[1, 2, 3], &[4, 6], &[-0.5, -1.0], 7),
            call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.5], 7),
            call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 8),
        ] {
            assert!(verify(&s, &other).unwrap_err().contains("does not verify"));
        }
        assert!(verify(&[], &d).unwrap_err().contains("not signed"));
        // Built token by token, the prefix digests are the whole-call digests.
        let mut h = CallHasher::new("m", 7, &[1, 2, 3]);
        h.push(4, -0.5);
        assert_eq!(h.digest(), call_digest("m", &[1, 2, 3], &[4], &[-0.5], 7));
        h.push(5, -1.0);
        assert_eq!(h.digest(), d);
        assert!(verify(&[1, 2, 3], &d).unwrap_err().contains("malformed"));
    }
}
