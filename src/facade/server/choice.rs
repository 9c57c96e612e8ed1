//! One choice as it is decoded: detokenised text, stop strings, logprobs, tool-call
//! holding, and the signatures that attest its tokens. Both the whole and the streamed
//! answers are built from it.

use super::*;

pub(super) fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "stop",
    }
}

/// One choice being decoded: text, stop strings, ids, logprobs.
pub(super) struct ChoiceState {
    pub(super) card: Arc<ModelCard>,
    pub(super) decoder: StreamDecoder,
    pub(super) stop: StopMatcher,
    pub(super) tokens: Vec<u32>,
    /// The engine's logprob of every token (kept for the tracker whether asked or not).
    /// Behaviour logprobs (under the distribution each token was drawn from).
    pub(super) drawn_logprobs: Vec<f32>,
    pub(super) logprobs: Vec<TokenLogprob>,
    pub(super) want_logprobs: bool,
    pub(super) finish: Option<&'static str>,
    pub(super) policy_version: u64,
    pub(super) completion_tokens: usize,
    /// Signed calls covering the tokens (remote servers): `(start, upto, version, sig)`.
    pub(super) signed: Vec<SignedPart>,
    /// A signature that covers the token about to arrive.
    pub(super) pending_sig: Option<SignedPart>,
}

impl ChoiceState {
    pub(super) fn new(
        card: Arc<ModelCard>,
        stops: Vec<String>,
        want_logprobs: bool,
    ) -> ChoiceState {
        ChoiceState {
            card,
            decoder: StreamDecoder::new(),
            stop: StopMatcher::new(stops),
            tokens: Vec::new(),
            drawn_logprobs: Vec::new(),
            logprobs: Vec::new(),
            want_logprobs,
            finish: None,
            policy_version: 0,
            completion_tokens: 0,
            signed: Vec::new(),
            pending_sig: None,
        }
    }

    /// What the tracker records: the tokens and the signed calls covering them.
    pub(super) fn record(&self) -> ChoiceRecord {
        ChoiceRecord {
            tokens: self.tokens.clone(),
            logprobs: self.drawn_logprobs.clone(),
            signed: self.signed.clone(),
        }
    }

    pub(super) fn token_text(&self, id: u32) -> String {
        self.card.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Handles one engine event; returns the newly visible text and the new logprob
    /// entries. Sets `finish` when the choice is done.
    pub(super) fn on_event(
        &mut self,
        ev: ChoiceEvent,
    ) -> Result<(String, Vec<TokenLogprob>), ApiError> {
        match ev {
            ChoiceEvent::Signed(part) => {
                if self.finish.is_none() {
                    self.pending_sig = Some(part);
                }
                Ok((String::new(), vec![]))
            }
            ChoiceEvent::Engine(EngineEvent::Token {
                id,
                logprob,
                behaviour,
                top,
            }) => {
                if self.finish.is_some() {
                    return Ok((String::new(), vec![]));
                }
                self.tokens.push(id);
                self.drawn_logprobs.push(behaviour as f32);
                if let Some(p) = self.pending_sig.take() {
                    if p.upto == self.tokens.len() && p.start < p.upto {
                        match self.signed.last_mut() {
                            Some(last) if last.start == p.start => *last = p,
                            _ => self.signed.push(p),
                        }
                    }
                }
                let mut new_lps = Vec::new();
                if self.want_logprobs {
                    let tok = self.token_text(id);
                    let entry = TokenLogprob {
                        bytes: tok.as_bytes().to_vec(),
                        token: tok,
                        logprob,
                        top_logprobs: top
                            .iter()
                            .map(|&(t, lp)| {
                                let s = self.token_text(t);
                                TopLogprob {
                                    bytes: s.as_bytes().to_vec(),
                                    token: s,
                                    logprob: lp,
                                }
                            })
                            .collect(),
                    };
                    self.logprobs.push(entry.clone());
                    new_lps.push(entry);
                }
                if self.card.is_stop_token(id) {
                    return Ok((String::new(), new_lps));
                }
                let piece = self
                    .decoder
                    .push(&self.card.tokenizer, id)
                    .map_err(|e| ApiError::server(e.to_string()))?
                    .unwrap_or_default();
                let text = self.stop.push(&piece);
                if self.stop.stopped() {
                    self.finish = Some("stop");
                    self.completion_tokens = self.tokens.len();
                }
                Ok((text, new_lps))
            }
            ChoiceEvent::Engine(EngineEvent::Finished {
                reason,
                completion_tokens,
                policy_version,
                ..
            }) => {
                self.policy_version = policy_version;
                self.completion_tokens = completion_tokens;
                let rest = self.stop.flush();
                self.finish = Some(finish_str(reason));
                Ok((rest, vec![]))
            }
            ChoiceEvent::Engine(EngineEvent::Failed(msg)) => {
                Err(ApiError::server(format!("generation failed: {msg}")))
            }
        }
    }
}

/// Drives one choice to its end (non-streaming).
pub(super) async fn run_choice(
    mut rx: ChoiceStream,
    mut st: ChoiceState,
) -> Result<ChoiceState, ApiError> {
    while st.finish.is_none() {
        match rx.next().await {
            Some(ev) => {
                st.on_event(ev)?;
            }
            None => return Err(ApiError::server("the engine dropped the request")),
        }
    }
    Ok(st) // dropping rx cancels the engine request if a stop string ended it early
}
