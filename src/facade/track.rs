//! Token-in-token-out tracking of an episode's chat calls.
//!
//! Each call of an episode (named by the request's bearer token, which the client hands its
//! agent) is remembered with its exact prompt ids and the ids the model sampled. When the
//! next request of that episode repeats the earlier messages and adds the model's answer
//! and new messages, only what is new is tokenised: the prompt is the previous prompt ids,
//! then the previous completion ids exactly as sampled, then the tokens of the new text.
//! So a training sequence holds exactly what the model saw and produced, with no
//! re-tokenisation drift, and calls merge into one timeline.
//!
//! Continuing is only done when it is exact: the earlier messages are equal, the template
//! renders the history as a prefix of the new prompt, and the model's completion text
//! appears verbatim where the answer is rendered. A template that rewrites earlier turns
//! (Qwen3's and Qwen3.5's drop the reasoning of turns before the last user query) is
//! continued from the ids as sampled, reasoning included, when the answer message shows
//! what a choice sampled (its text after the reasoning, its tool calls) and that choice
//! ended its turn; the trained context then differs from what the template would render
//! (docs/ARCHITECTURE.md). Anything else (an agent that edited the answer; a stop string
//! that cut it) is a break: the whole prompt is rendered and tokenised afresh, and the
//! break is counted per model, so the continuity rate of a model and template is visible
//! in `/metrics`. Timelines never merge across a break (see `timeline`).
//!
//! Owns: per-episode prompt state and the recorded calls. Bounded: at most
//! `max_episodes` episodes are tracked (the least recently used is dropped first).

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value as Json;

use super::backend::SignedPart;
use crate::base::lock;
use crate::engine::SamplingParams;
use crate::model::{ModelCard, TemplateError, TokenizerError};
use crate::timeline::{Call, SamplingTransform};

/// The transform a request's tokens are drawn with (`constrained`: a grammar masks the
/// logits), as a call records it and a server signs it.
pub fn transform_of(p: &SamplingParams, constrained: bool) -> SamplingTransform {
    SamplingTransform {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        min_p: p.min_p,
        processed: constrained || p.changes_logits(),
    }
}

/// One finished choice as the tracker records it: the sampled ids, their behaviour
/// logprobs (under the distribution they were drawn from), and the signed calls covering
/// them (none from a local engine).
pub struct ChoiceRecord {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub signed: Vec<SignedPart>,
}

/// How a prompt was built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The episode's first call of this model.
    First,
    /// Extended the previous call's exact ids.
    Continued,
    /// Rendered afresh; the reason the previous ids could not be kept.
    Break(String),
}

/// One earlier call: what was rendered, and every choice's sampled ids.
struct Previous {
    messages: Vec<Json>,
    prompt_text: String,
    prompt_ids: Vec<u32>,
    choices: Vec<Vec<u32>>,
}

#[derive(Default)]
struct EpisodeState {
    previous: HashMap<String, Previous>,
    calls: Vec<Call>,
    last_use: u64,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub first: u64,
    pub continued: u64,
    pub breaks: u64,
}

pub struct Tracker {
    max_episodes: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    episodes: HashMap<String, EpisodeState>,
    counts: HashMap<String, Counts>,
    clock: u64,
}

/// Renders messages with the request's template and tools: `(messages, add_generation_prompt)`.
pub type Render<'a> = dyn Fn(&[Json], bool) -> Result<String, TemplateError> + 'a;

/// Why a tracked prompt could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

impl Tracker {
    pub fn new(max_episodes: usize) -> Tracker {
        Tracker {
            max_episodes: max_episodes.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// The prompt ids for `messages` in `episode` (see the module docs), how they were
    /// built, and the rendered text (to pass back to [`Tracker::record`]).
    pub fn prompt(
        &self,
        episode: &str,
        model: &str,
        card: &ModelCard,
        messages: &[Json],
        render: &Render<'_>,
    ) -> Result<(Vec<u32>, Outcome, String), TrackError> {
        let text = render(messages, true)?;
        let fresh = |text: &str| card.tokenizer.encode(text);
        let outcome = {
            let inner = self.lock();
            match inner
                .episodes
                .get(episode)
                .and_then(|e| e.previous.get(model))
            {
                None => Err(Outcome::First),
                Some(prev) => continue_ids(prev, card, messages, &text, render),
            }
        };
        let (ids, outcome) = match outcome {
            Ok(ids) => (ids, Outcome::Continued),
            Err(o) => (fresh(&text)?, o),
        };
        let mut inner = self.lock();
        let c = inner.counts.entry(model.to_string()).or_default();
        match &outcome {
            Outcome::First => c.first += 1,
            Outcome::Continued => c.continued += 1,
            Outcome::Break(reason) => {
                c.breaks += 1;
                tracing::info!(episode, model, reason, "timeline break");
            }
        }
        Ok((ids, outcome, text))
    }

    /// Records a finished call: its messages and rendering (for the next call), and one
    /// [`Call`] per choice with `(ids, logprobs)` drawn with `sampling` (for the episode's
    /// timeline).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        episode: &str,
        model: &str,
        messages: &[Json],
        prompt_text: String,
        prompt_ids: &[u32],
        choices: Vec<ChoiceRecord>,
        policy_version: u64,
        sampling: SamplingTransform,
    ) {
        let mut inner = self.lock();
        inner.clock += 1;
        let clock = inner.clock;
        if !inner.episodes.contains_key(episode) && inner.episodes.len() >= self.max_episodes {
            if let Some(oldest) = inner
                .episodes
                .iter()
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| k.clone())
            {
                tracing::warn!(
                    episode = oldest,
                    "tracker full: dropping the least recently used episode"
                );
                inner.episodes.remove(&oldest);
            }
        }
        let e = inner.episodes.entry(episode.to_string()).or_default();
        e.last_use = clock;
        for c in &choices {
            if c.signed.is_empty() {
                // A local engine: the call as sampled, unsigned.
                e.calls.push(
                    Call::new(
                        model,
                        prompt_ids.to_vec(),
                        c.tokens.clone(),
                        c.logprobs.clone(),
                        policy_version,
                    )
                    .with_sampling(sampling),
                );
                continue;
            }
            // A remote server signed the tokens as one call, or (after a fail-over) as
            // consecutive calls, each extending the previous one. Tokens no signature
            // covers are left out (only the tail can be).
            for p in &c.signed {
                let upto = p.upto.min(c.tokens.len());
                if p.start >= upto {
                    continue;
                }
                let mut prompt = prompt_ids.to_vec();
                prompt.extend_from_slice(&c.tokens[..p.start]);
                let mut call = Call::new(
                    model,
                    prompt,
                    c.tokens[p.start..upto].to_vec(),
                    c.logprobs[p.start..upto].to_vec(),
                    p.policy_version,
                )
                .with_sampling(sampling);
                call.signature = p.signature.clone();
                e.calls.push(call);
            }
        }
        e.previous.insert(
            model.to_string(),
            Previous {
                messages: messages.to_vec(),
                prompt_text,
                prompt_ids: prompt_ids.to_vec(),
                choices: choices.into_iter().map(|c| c.tokens).collect(),
            },
        );
    }

    /// The calls recorded so far for `episode` (kept).
    pub fn peek(&self, episode: &str) -> Option<Vec<Call>> {
        self.lock().episodes.get(episode).map(|e| e.calls.clone())
    }

    /// The calls recorded for `episode`, removing it.
    pub fn take(&self, episode: &str) -> Option<Vec<Call>> {
        self.lock().episodes.remove(episode).map(|e| e.calls)
    }

    /// Per-model counts of first calls, continued calls and breaks.
    pub fn counts(&self) -> Vec<(String, Counts)> {
        let mut v: Vec<_> = self
            .lock()
            .counts
            .iter()
            .map(|(k, c)| (k.clone(), c.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    pub fn episodes(&self) -> usize {
        self.lock().episodes.len()
    }
}

/// The previous ids extended by the new text, or why they cannot be.
fn continue_ids(
    prev: &Previous,
    card: &ModelCard,
    messages: &[Json],
    text: &str,
    render: &Render<'_>,
) -> Result<Vec<u32>, Outcome> {
    let brk = |why: &str| Outcome::Break(why.to_string());
    let n = prev.messages.len();
    if messages.len() <= n || messages[..n] != prev.messages[..] {
        return Err(brk("the earlier messages changed"));
    }
    if messages[n].get("role").and_then(|r| r.as_str()) != Some("assistant") {
        return Err(brk("the model's answer is not the next message"));
    }
    let history = render(&messages[..=n], false).map_err(|e| Outcome::Break(e.to_string()))?;
    if !history.starts_with(&prev.prompt_text) || !text.starts_with(&history) {
        // A template that rewrites earlier turns (Qwen3's and Qwen3.5's drop the reasoning
        // of turns before the last user query): continue from the ids as sampled.
        return continue_rewritten(prev, card, &messages[n], text, &history).map_err(|why| {
            brk(&format!(
                "the template renders the history differently ({why})"
            ))
        });
    }
    let answer = &history[prev.prompt_text.len()..];
    for ids in &prev.choices {
        let sampled = card
            .tokenizer
            .decode(ids, false)
            .map_err(|e| Outcome::Break(e.to_string()))?;
        if let Some(trailer) = answer.strip_prefix(sampled.as_str()) {
            let suffix = format!("{trailer}{}", &text[history.len()..]);
            let tail = card
                .tokenizer
                .encode(&suffix)
                .map_err(|e| Outcome::Break(e.to_string()))?;
            let mut out = prev.prompt_ids.clone();
            out.extend_from_slice(ids);
            out.extend(tail);
            return Ok(out);
        }
    }
    // Not verbatim (tool calls rendered from JSON, whitespace the template trims): the
    // sampled ids still stand when the answer shows what a choice sampled.
    continue_rewritten(prev, card, &messages[n], text, &history).map_err(|why| {
        brk(&format!(
            "the answer in the messages is not the text the model sampled ({why})"
        ))
    })
}

/// The text an answer shows once its reasoning is set aside: what follows the last
/// `</think>`, trimmed.
fn visible(text: &str) -> &str {
    text.rsplit("</think>").next().unwrap_or(text).trim()
}

/// Continues a conversation whose template renders the earlier turns otherwise than the
/// previous prompt had them (dropped reasoning): the previous prompt ids, a choice's ids
/// exactly as sampled (its reasoning included), then the tokens of what the new rendering
/// adds after the answer's turn. The trained context thus keeps what the model saw and
/// sampled, where the template alone would show later calls the turn without its
/// reasoning (docs/ARCHITECTURE.md, "Templates that rewrite history").
///
/// The choice is the one whose visible answer (and tool calls) equal the answer message;
/// it must have ended with its end-of-turn token. Where the answer's turn ends in the new
/// rendering is found by counting that token's text: the previous prompt holds `k - 1`,
/// the answer adds one, and no rewrite of reasoning adds or removes any.
fn continue_rewritten(
    prev: &Previous,
    card: &ModelCard,
    answer: &Json,
    text: &str,
    history: &str,
) -> Result<Vec<u32>, String> {
    let content = match answer.get("content") {
        Some(Json::String(s)) => s.as_str(),
        None | Some(Json::Null) => "",
        Some(_) => return Err("the answer's content is not text".into()),
    };
    // What the model sent with the answer: reasoning_content is the reasoning, not shown.
    let want_calls: Vec<(String, Json)> = answer
        .get("tool_calls")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let f = c.get("function")?;
            let args = match f.get("arguments")? {
                Json::String(s) => serde_json::from_str(s).ok()?,
                other => other.clone(),
            };
            Some((f.get("name")?.as_str()?.to_string(), args))
        })
        .collect();
    let decode =
        |ids: &[u32], skip: bool| card.tokenizer.decode(ids, skip).map_err(|e| e.to_string());
    for ids in &prev.choices {
        let Some((&last, _)) = ids.split_last() else {
            continue;
        };
        // A special token (no text once specials are skipped) ends the turn; else the
        // choice was cut by a length limit or a stop string.
        let eot = decode(&[last], false)?;
        if eot.is_empty() || !decode(&[last], true)?.is_empty() {
            continue;
        }
        let sampled = decode(ids, true)?;
        let (shown, calls) = match crate::facade::text::parse_tool_calls(&sampled, 0) {
            Some((rest, calls)) => (
                rest,
                calls
                    .into_iter()
                    .map(|c| {
                        let args = serde_json::from_str(&c.function.arguments)
                            .unwrap_or(Json::String(c.function.arguments));
                        (c.function.name, args)
                    })
                    .collect(),
            ),
            None => (sampled.clone(), Vec::new()),
        };
        if visible(&shown) != visible(content) || calls != want_calls {
            continue;
        }
        let k = prev.prompt_text.matches(eot.as_str()).count() + 1;
        if history.matches(eot.as_str()).count() != k {
            return Err(format!("the answer's turn does not end with one {eot:?}"));
        }
        let Some((cut, _)) = text.match_indices(eot.as_str()).nth(k - 1) else {
            return Err(format!("the new prompt has fewer than {k} {eot:?}"));
        };
        let tail = card
            .tokenizer
            .encode(&text[cut + eot.len()..])
            .map_err(|e| e.to_string())?;
        let mut out = prev.prompt_ids.clone();
        out.extend_from_slice(ids);
        out.extend(tail);
        return Ok(out);
    }
    Err("no sampled choice shows the answer in the messages".into())
}
