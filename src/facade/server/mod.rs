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
mod state;

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
use responses::responses;
use session::{finish_all, start_chat, stream_one, EventStream, Finished, OneStream, Started};
pub use state::FacadeConfig;
use state::{
    answer, body_or_error, caller_of, episode_of, now, sse_json, AppState, Body, StoredResponse,
};

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
async fn post_reward(
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

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<Json_> = st
        .backend
        .model_ids()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "agentjet"}))
        .chain(st.cfg.external.iter().map(|m| model_entry(m)))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
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

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
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
