//! `/agentjet/infer/2` on the server: a request is checked against the served model and
//! the bounds, run on the engine, and streamed back token by token; every token carries
//! the server's signature over the call so far (the digest of `timeline::digest`: the
//! sampling transform and the behaviour logprobs included), so
//! whatever prefix the client keeps is signed exactly. A caller that goes away cancels
//! its generation (dropping the engine's receivers).
//!
//! Owns: the server side of one call. Never keeps per-episode state (any provider can
//! serve any call).

use futures::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::served::ServedModel;
use crate::engine::{
    Constraint, ConstraintError, EngineError, EngineEvent, GenerateRequest, SamplingError,
};
use crate::facade::track::transform_of;
use crate::rpc::{InferFrame, InferRequest};
use crate::swarm::frame::{write_frame, FrameError};
use crate::swarm::sign::{new_nonce, Nonce};
use crate::swarm::Stream;
use crate::timeline::digest::CallHasher;

/// A call no provider would take (the caller is told why).
#[derive(Debug, thiserror::Error)]
pub enum BadCall {
    #[error("this server serves {served:?}, not {asked:?}")]
    WrongModel { served: String, asked: String },
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary ({vocab})")]
    OutOfVocab { id: u32, vocab: usize },
    #[error(
        "context_length_exceeded: {prompt} prompt + {max_tokens} max tokens > {limit} positions"
    )]
    Context {
        prompt: usize,
        max_tokens: u32,
        limit: usize,
    },
    #[error("n must be 1..={max}, got {n}")]
    N { n: u32, max: u32 },
    #[error("top_logprobs must be <= {0}")]
    TopLogprobs(u32),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
}

/// Why a call was not served.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// The request is wrong (the caller was told, and no provider would take it).
    #[error("rejected a request: {0}")]
    Rejected(BadCall),
    #[error("caller gone mid-call ({0}); generation cancelled")]
    CallerGone(FrameError),
    #[error(transparent)]
    Frame(#[from] FrameError),
}

impl ServedModel {
    /// Checks a request; the engine request and `n`, or why not (told to the caller).
    fn engine_request(&self, r: InferRequest) -> Result<(GenerateRequest, usize), BadCall> {
        if r.model != self.name {
            return Err(BadCall::WrongModel {
                served: self.name.clone(),
                asked: r.model,
            });
        }
        if r.prompt.is_empty() {
            return Err(BadCall::EmptyPrompt);
        }
        let vocab = self.card.config.vocab_size;
        if let Some(&id) = r
            .prompt
            .iter()
            .chain(&r.stop_token_ids)
            .find(|t| **t as usize >= vocab)
        {
            return Err(BadCall::OutOfVocab { id, vocab });
        }
        if r.prompt.len() + r.max_tokens as usize > self.max_context {
            return Err(BadCall::Context {
                prompt: r.prompt.len(),
                max_tokens: r.max_tokens,
                limit: self.max_context,
            });
        }
        if r.n == 0 || r.n > self.limits.max_n {
            return Err(BadCall::N {
                n: r.n,
                max: self.limits.max_n,
            });
        }
        if r.top_logprobs > self.limits.max_top_logprobs {
            return Err(BadCall::TopLogprobs(self.limits.max_top_logprobs));
        }
        r.sampling.validate()?;
        let constraint = match r.constraint {
            Some(p) => Some(Constraint::from_pattern(p, self.vocab.clone())?),
            None => None,
        };
        Ok((
            GenerateRequest {
                prompt: r.prompt,
                max_tokens: r.max_tokens as usize,
                sampling: r.sampling,
                seed: r.seed,
                stop_token_ids: r.stop_token_ids,
                top_logprobs: r.top_logprobs as usize,
                constraint,
                adapter: self.adapter,
            },
            r.n as usize,
        ))
    }

    pub(super) async fn infer(&self, r: InferRequest, mut s: Stream) -> Result<(), InferError> {
        let limit = self.limit();
        let reject = |message: String, retry: bool| InferFrame::Rejected { message, retry };
        if self.stopping() {
            // Another provider takes it (this one is draining).
            let frame = reject("the server is stopping".into(), true);
            let _ = write_frame(&mut s, &frame, limit).await;
            return Ok(());
        }
        let (req, n) = match self.engine_request(r) {
            Ok(x) => x,
            Err(e) => {
                let _ = write_frame(&mut s, &reject(e.to_string(), false), limit).await;
                return Err(InferError::Rejected(e));
            }
        };
        let prompt = req.prompt.clone();
        let sampling = transform_of(&req.sampling, req.constraint.is_some());
        let rxs = match self.engine.submit_n(req, n) {
            Ok(r) => r,
            Err(e) => {
                let retry = matches!(e, EngineError::Overloaded(_) | EngineError::Stopped);
                let _ = write_frame(&mut s, &reject(e.to_string(), retry), limit).await;
                return Ok(());
            }
        };
        // One hasher per choice, started on the first token's policy version, and one
        // nonce per choice: every prefix's signature is of the same call.
        let mut hashers: Vec<Option<CallHasher>> = vec![None; n];
        let nonces: Vec<Nonce> = (0..n).map(|_| new_nonce()).collect();
        let version_now = || self.policy_version();
        let mut events = futures::stream::select_all(
            rxs.into_iter()
                .enumerate()
                .map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |e| (i, e))),
        );
        while let Some((i, ev)) = events.next().await {
            let frame = match ev {
                EngineEvent::Token {
                    id,
                    logprob,
                    behaviour,
                    top,
                } => {
                    let h = hashers[i].get_or_insert_with(|| {
                        CallHasher::new(&self.name, version_now(), &sampling, &prompt)
                    });
                    h.push(id, behaviour as f32);
                    InferFrame::Token {
                        choice: i as u32,
                        id,
                        logprob,
                        behaviour,
                        top,
                        policy_version: h.version(),
                        signature: self.swarm.sign(&h.digest(), &nonces[i]),
                    }
                }
                EngineEvent::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    policy_version,
                } => {
                    // The version signed is the one the hasher started with: the engine's
                    // version when the first token came (the request's start version
                    // unless weights changed during its prefill).
                    InferFrame::Finished {
                        choice: i as u32,
                        reason,
                        prompt_tokens: prompt_tokens as u32,
                        completion_tokens: completion_tokens as u32,
                        policy_version: hashers[i].as_ref().map_or(policy_version, |h| h.version()),
                    }
                }
                EngineEvent::Failed(message) => InferFrame::Failed {
                    choice: i as u32,
                    message,
                },
            };
            if let Err(e) = write_frame(&mut s, &frame, limit).await {
                // The caller went away: dropping the receivers cancels the generation.
                return Err(InferError::CallerGone(e));
            }
        }
        let _ = futures::io::AsyncWriteExt::close(&mut s).await;
        Ok(())
    }
}
