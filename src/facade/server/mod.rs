//! The HTTP server of the facade (axum), split the way TGI's router is: routes and shared
//! state here; validation into a plan (`plan`); chat rendering (`render`); one choice's
//! decoding (`choice`); what the chat-shaped APIs share once a request is in chat form
//! (`session`: tracked rendering, submission, finished choices, single-choice streams);
//! one file per API, each translating its request and encoding its answer (`chat`,
//! `completions`, `responses`, `messages`); forwarding to external models (`forward`); the
//! error shape and its mapping (`error`);
//! bounded memories (`recent`).

mod chat;
mod choice;
mod completions;
mod error;
mod forward;
mod messages;
mod plan;
mod recent;
mod render;
mod responses;
mod session;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Value as Json_};

use super::backend::{Backend, ChoiceEvent, ChoiceStream, Route, SignedPart};
use super::external::{forward, model_entry, ExternalLog, ExternalModel};
use super::reward::{parse_reward, Rewards};
use super::text::{parse_tool_calls, StopMatcher};
use super::track::{ChoiceRecord, Outcome, Tracker};
use super::types::*;
use crate::base::lock;
use crate::base::prom::Prom;
use crate::base::stop::TaskTracker;
use crate::engine::{
    Constraint, EngineError, EngineEvent, FinishReason, GenerateRequest, SamplingParams,
    TokenBytes, ToolSpec,
};
use crate::model::chat_template::ChatTemplate;
use crate::model::{ChatRequest, ModelCard, StreamDecoder, TemplateError};

use chat::chat_completions;
use choice::{run_choice, ChoiceState};
use completions::completions;
pub use error::ApiError;
use error::{engine_error, parse_body};
use forward::{external_of, forward_external};
use messages::messages;
use plan::{extra_sampling, json_mode, plan, resolve_model, submit, token_bytes, tool_plan};
use plan::{Common, JsonMode, Plan};
use recent::Recent;
use render::ChatRenderer;
use responses::{responses, StoredResponse};
use session::{finish_all, start_chat, stream_one, EventStream, Finished, OneStream, Started};

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
    responses: Recent<StoredResponse>,
    /// The arguments text of recent tool calls answered as Anthropic `tool_use` blocks.
    tool_args: Recent<String>,
}

/// What a tracking facade shares with its owner (the client's episode runner).
#[derive(Clone)]
pub struct Tracking {
    pub tracker: Arc<Tracker>,
    pub rewards: Arc<Rewards>,
    /// Calls of external models (`FacadeConfig::external`), by episode.
    pub external: Arc<ExternalLog>,
}

/// The router with every route of the facade.
pub fn router(backend: Arc<dyn Backend>, cfg: FacadeConfig) -> Router {
    router_tracked(backend, cfg).0
}

/// The router, and (when `cfg.track_episodes`) the tracker and posted rewards behind it.
pub fn router_tracked(backend: Arc<dyn Backend>, cfg: FacadeConfig) -> (Router, Option<Tracking>) {
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let body_limit = cfg.max_body_bytes;
    let tracker = cfg
        .track_episodes
        .then(|| Arc::new(Tracker::new(cfg.max_tracked_episodes)));
    let rewards = Arc::new(Rewards::default());
    let external = Arc::new(ExternalLog::default());
    let tracking = tracker.as_ref().map(|t| Tracking {
        tracker: t.clone(),
        rewards: rewards.clone(),
        external: external.clone(),
    });
    let stored = cfg.max_stored_responses;
    let state = Arc::new(AppState {
        tracker,
        rewards,
        external,
        backend,
        cfg,
        next_id: AtomicU64::new(seed),
        requests: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        token_bytes: Default::default(),
        responses: Recent::new(stored),
        tool_args: Recent::new(stored),
    });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/agentjet/reward", post(post_reward))
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(state);
    (router, tracking)
}

/// `POST /v1/agentjet/reward` (tracking only): the episode named by the bearer token
/// reports its reward.
pub(super) async fn post_reward(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let result = (|| {
        let bad = |m: String| ApiError {
            status: StatusCode::BAD_REQUEST,
            message: m,
            kind: "invalid_request_error",
            param: Some("reward".into()),
            code: None,
        };
        if st.tracker.is_none() {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: "this endpoint does not track episodes (rewards go to a client's proxy)"
                    .into(),
                kind: "invalid_request_error",
                param: None,
                code: None,
            });
        }
        let episode = episode_of(&st, &headers)
            .ok_or_else(|| bad("the bearer token (OPENAI_API_KEY) must name the episode".into()))?;
        let body = body_or_error(body, st.cfg.max_body_bytes)?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
        let r = parse_reward(&v).map_err(|e| bad(e.to_string()))?;
        st.rewards.put(&episode, r);
        Ok(Json(json!({"ok": true, "episode": episode})).into_response())
    })();
    answer(&st, result)
}

/// The episode a request belongs to, when tracking: its bearer token (OpenAI SDKs), else
/// its `x-api-key` (Anthropic SDKs).
pub(super) fn episode_of(st: &AppState, headers: &axum::http::HeaderMap) -> Option<String> {
    st.tracker.as_ref()?;
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
        .map(str::to_string)
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

pub(super) async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<Json_> = st
        .backend
        .model_ids()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "agentjet"}))
        .chain(st.cfg.external.iter().map(|m| model_entry(m)))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.backend.ready() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "starting"})),
        )
            .into_response()
    }
}

pub(super) async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let mut p = Prom::new();
    p.counter(
        "agentjet_http_requests_total",
        "Requests to this API.",
        &[],
        st.requests.load(Ordering::Relaxed) as f64,
    );
    p.counter(
        "agentjet_http_errors_total",
        "Requests to this API answered with an error.",
        &[],
        st.errors.load(Ordering::Relaxed) as f64,
    );
    st.backend.metrics(&mut p);
    if let Some(t) = &st.tracker {
        tracking_metrics(t, &mut p);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        p.render(),
    )
        .into_response()
}

/// The tracker's figures: calls by how they joined their episode's timeline, and the
/// episodes tracked now.
pub fn tracking_metrics(t: &Tracker, p: &mut Prom) {
    for (model, c) in t.counts() {
        for (outcome, n) in [
            ("first", c.first),
            ("continued", c.continued),
            ("break", c.breaks),
        ] {
            p.counter(
                "agentjet_timeline_calls_total",
                "Tracked calls: an episode's first, one that continued its timeline, or a break.",
                &[("model", model.as_str()), ("outcome", outcome)],
                n as f64,
            );
        }
    }
    p.gauge(
        "agentjet_tracked_episodes",
        "Episodes the proxy tracks now.",
        &[],
        t.episodes() as f64,
    );
}
