//! What every API of the facade shares: its limits ([`FacadeConfig`]), the router's state
//! ([`AppState`]), and the helpers each endpoint calls on a request and its answer (the
//! episode it belongs to, its body, the error count, server-sent events).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use serde_json::Value as Json_;

use super::error::ApiError;
use super::recent::Recent;
use crate::base::stop::TaskTracker;
use crate::engine::TokenBytes;
use crate::facade::backend::Backend;
use crate::facade::external::{ExternalLog, ExternalModel};
use crate::facade::reward::Rewards;
use crate::facade::track::Tracker;

/// Limits of the facade.
#[derive(Debug, Clone)]
pub struct FacadeConfig {
    /// `max_tokens` when a request gives none (capped by the context left).
    pub default_max_tokens: usize,
    /// Largest `n`.
    pub max_n: usize,
    /// Largest `top_logprobs`.
    pub max_top_logprobs: usize,
    /// Largest request body in bytes (larger ones get 413 in OpenAI's error shape).
    pub max_body_bytes: usize,
    /// Track chat calls per episode (the bearer token names the episode): token-in-token-out
    /// prompts and recorded calls (see `facade::track`).
    pub track_episodes: bool,
    /// Episodes tracked at most (the least recently used is dropped first).
    pub max_tracked_episodes: usize,
    /// Responses kept for `previous_response_id` (and tool calls' arguments kept for
    /// Anthropic `tool_use` blocks), at most; the oldest are forgotten first.
    pub max_stored_responses: usize,
    /// Models forwarded to other OpenAI-compatible endpoints (recorded, never trained).
    pub external: Vec<Arc<ExternalModel>>,
    /// Where the facade's own tasks (streamed answers, external connections) are tracked,
    /// so that the owner's stop waits for them.
    pub tasks: TaskTracker,
}

impl Default for FacadeConfig {
    fn default() -> Self {
        FacadeConfig {
            default_max_tokens: 1024,
            max_n: 16,
            max_top_logprobs: 20,
            max_body_bytes: 8 << 20,
            track_episodes: false,
            max_tracked_episodes: 4096,
            max_stored_responses: 4096,
            external: Vec::new(),
            tasks: TaskTracker::new(),
        }
    }
}

pub(super) struct AppState {
    pub(super) backend: Arc<dyn Backend>,
    pub(super) cfg: FacadeConfig,
    pub(super) next_id: AtomicU64,
    pub(super) requests: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) tracker: Option<Arc<Tracker>>,
    /// Rewards agents posted to `/v1/agentjet/reward`, by episode (when tracking).
    pub(super) rewards: Arc<Rewards>,
    /// Calls of external models, by episode.
    pub(super) external: Arc<ExternalLog>,
    /// Each model's token bytes, built on the first constrained request.
    pub(super) token_bytes: std::sync::Mutex<std::collections::HashMap<String, Arc<TokenBytes>>>,
    /// Recent Responses answers, for `previous_response_id`.
    pub(super) responses: Recent<StoredResponse>,
    /// The arguments text of recent tool calls answered as Anthropic `tool_use` blocks.
    pub(super) tool_args: Recent<String>,
}

/// One stored response: the conversation up to and including its answer (chat form,
/// without the request's `instructions`, which a later call does not inherit), and the
/// episode it belongs to (another episode's call does not find it).
#[derive(Clone)]
pub(super) struct StoredResponse {
    pub(super) episode: Option<String>,
    /// Who stored it (see [`caller_of`]): only the same caller finds it again.
    pub(super) caller: Option<[u8; 32]>,
    pub(super) messages: Vec<Json_>,
}

/// The caller of a request, tracking or not: a hash of its credential (the bearer token,
/// else `x-api-key`), None without one. Stored responses are found only by their caller.
pub(super) fn caller_of(headers: &axum::http::HeaderMap) -> Option<[u8; 32]> {
    credential(headers).map(|t| *blake3::hash(t.as_bytes()).as_bytes())
}

/// The episode a request belongs to, when tracking: its bearer token (OpenAI SDKs), else
/// its `x-api-key` (Anthropic SDKs).
pub(super) fn episode_of(st: &AppState, headers: &axum::http::HeaderMap) -> Option<String> {
    st.tracker.as_ref()?;
    credential(headers).map(str::to_string)
}

/// A request's credential: its bearer token (OpenAI SDKs), else its `x-api-key`
/// (Anthropic SDKs); None when it has neither (or an empty one).
fn credential(headers: &axum::http::HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|a| a.strip_prefix("Bearer ").unwrap_or(a).trim());
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    bearer
        .filter(|t| !t.is_empty())
        .or(key.filter(|t| !t.is_empty()))
}

/// The body, or the reason it could not be read (too large: 413) in OpenAI's shape.
pub(super) fn body_or_error(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!("request body exceeds the server's limit of {limit} bytes")
        } else {
            format!("cannot read the request body: {e}")
        };
        ApiError {
            status,
            message,
            kind: "invalid_request_error",
            param: Some("body".into()),
            code: (status == StatusCode::PAYLOAD_TOO_LARGE).then_some("request_too_large"),
        }
    })
}

/// Counts the request, and turns an error into its response (counting it too).
pub(super) fn answer(st: &AppState, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        st.errors.fetch_add(1, Ordering::Relaxed);
        e.into_response()
    })
}

pub(super) type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn sse_json(v: &Json_) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

#[cfg(test)]
mod caller_tests {
    use super::caller_of;
    use axum::http::HeaderMap;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_stored_response_belongs_to_the_credential_that_stored_it() {
        let a = caller_of(&headers(&[("authorization", "Bearer key-a")]));
        let b = caller_of(&headers(&[("authorization", "Bearer key-b")]));
        assert!(a.is_some() && a != b);
        // The same credential through Anthropic's header is the same caller.
        assert_eq!(caller_of(&headers(&[("x-api-key", "key-a")])), a);
        // No credential: no caller (such responses are found only without one).
        assert_eq!(caller_of(&headers(&[])), None);
        assert_eq!(caller_of(&headers(&[("authorization", "Bearer ")])), None);
    }
}
