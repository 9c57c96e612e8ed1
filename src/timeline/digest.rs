//! What a call's signature covers: the call's digest, blake3 over the model name, the
//! policy version, the sampling transform (so a client cannot claim another temperature
//! than the one the server drew at), the prompt ids, and the completion ids with their
//! behaviour logprobs (as f32 bits). A server builds it token by token while it streams ([`CallHasher`]);
//! a server receiving an episode rebuilds every sampled call from the timeline
//! ([`rebuilt_calls`]: a call's prompt is its branch's tokens before its sampled segment)
//! and computes the same digest, which the swarm's key then verifies.
//!
//! Owns: the digest's byte layout (`agentjet-call-2`). Never signs or verifies (that is
//! the swarm's, with the peer's key).

use super::{SamplingTransform, Timeline};

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
    pub fn new(
        model: &str,
        version: u64,
        sampling: &SamplingTransform,
        prompt: &[u32],
    ) -> CallHasher {
        let mut h = blake3::Hasher::new();
        h.update(b"agentjet-call-2");
        h.update(&(model.len() as u64).to_le_bytes());
        h.update(model.as_bytes());
        h.update(&version.to_le_bytes());
        sampling.digest_into(&mut h);
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
    sampling: &SamplingTransform,
) -> [u8; 32] {
    let mut h = CallHasher::new(model, version, sampling, prompt);
    for (t, l) in completion.iter().zip(logprobs) {
        h.push(*t, *l);
    }
    if completion.len() != logprobs.len() {
        // Not a call a server could have signed; make sure no signature matches.
        h.push(u32::MAX, f32::NAN);
    }
    h.digest()
}

/// A call as rebuilt from a timeline: its index, prompt, completion, logprobs, version
/// and sampling transform.
#[derive(Debug, Clone, PartialEq)]
pub struct RebuiltCall {
    pub call: u32,
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub version: u64,
    pub sampling: SamplingTransform,
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
                        sampling: s.sampling,
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
    fn every_part_of_a_call_changes_its_digest_and_prefixes_match_whole_calls() {
        let t = SamplingTransform {
            temperature: 0.7,
            top_p: 0.9,
            ..SamplingTransform::RAW
        };
        let d = call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 7, &t);
        let with = |f: fn(&mut SamplingTransform)| {
            let mut o = t;
            f(&mut o);
            o
        };
        for other in [
            call_digest("n", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 7, &t),
            call_digest("m", &[1, 2, 3, 4], &[5], &[-1.0], 7, &t),
            call_digest("m", &[1, 2, 3], &[4], &[-0.5], 7, &t),
            call_digest("m", &[1, 2, 3], &[4, 6], &[-0.5, -1.0], 7, &t),
            call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.5], 7, &t),
            call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5, -1.0], 8, &t),
            call_digest("m", &[1, 2, 3], &[4, 5], &[-0.5], 7, &t),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &SamplingTransform::RAW,
            ),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &with(|o| o.temperature = 1.0),
            ),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &with(|o| o.top_p = 0.95),
            ),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &with(|o| o.top_k = 5),
            ),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &with(|o| o.min_p = 0.1),
            ),
            call_digest(
                "m",
                &[1, 2, 3],
                &[4, 5],
                &[-0.5, -1.0],
                7,
                &with(|o| o.processed = true),
            ),
        ] {
            assert_ne!(other, d);
        }
        // Built token by token, the prefix digests are the whole-call digests.
        let mut h = CallHasher::new("m", 7, &t, &[1, 2, 3]);
        h.push(4, -0.5);
        assert_eq!(
            h.digest(),
            call_digest("m", &[1, 2, 3], &[4], &[-0.5], 7, &t)
        );
        h.push(5, -1.0);
        assert_eq!(h.digest(), d);
        assert_eq!(h.version(), 7);
    }
}
