//! The HTTP server of the facade (axum): routes, validation, and the two ways of
//! answering (a whole JSON response, or server-sent events ending in `data: [DONE]`).

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
use tokio::sync::mpsc::UnboundedReceiver;

use super::external::{forward, model_entry, ExternalLog, ExternalModel};
use super::text::{parse_tool_calls, StopMatcher};
use super::track::{Outcome, Tracker};
use super::types::*;
use super::Backend;
use crate::engine::{
    Constraint, EngineError, EngineEvent, FinishReason, GenerateRequest, SamplingParams,
    TokenBytes, ToolSpec,
};
use crate::model::chat_template::ChatTemplate;
use crate::model::{ChatRequest, ModelCard, StreamDecoder};

/// Limits of the facade.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// `max_tokens` when a request gives none (capped by the context left).
    pub default_max_tokens: usize,
    /// Largest `n`.
    pub max_n: usize,
    /// Largest `top_logprobs`.
    pub max_top_logprobs: usize,
    /// Largest request body in bytes (larger ones get 413 in OpenAI's error shape).
    pub max_body_bytes: usize,
    /// Track chat calls per episode (the bearer token names the episode): token-in-token-out
    /// prompts and recorded calls (see `openai::track`).
    pub track_episodes: bool,
    /// Episodes tracked at most (the least recently used is dropped first).
    pub max_tracked_episodes: usize,
    /// Models forwarded to other OpenAI-compatible endpoints (recorded, never trained).
    pub external: Vec<Arc<ExternalModel>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            default_max_tokens: 1024,
            max_n: 16,
            max_top_logprobs: 20,
            max_body_bytes: 8 << 20,
            track_episodes: false,
            max_tracked_episodes: 4096,
            external: Vec::new(),
        }
    }
}

struct AppState {
    backend: Arc<dyn Backend>,
    cfg: ServerConfig,
    next_id: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
    tracker: Option<Arc<Tracker>>,
    /// Rewards agents posted to `/v1/agentjet/reward`, by episode (when tracking).
    rewards: Arc<Rewards>,
    /// Calls of external models, by episode.
    external: Arc<ExternalLog>,
    /// Each model's token bytes, built on the first constrained request.
    token_bytes: std::sync::Mutex<std::collections::HashMap<String, Arc<TokenBytes>>>,
}

/// Rewards posted by agents, by episode: `{"reward": r}` or `{"rewards": {model: r}}`.
#[derive(Default)]
pub struct Rewards {
    map: std::sync::Mutex<std::collections::HashMap<String, PostedReward>>,
}

/// A reward an agent posted for its episode.
#[derive(Debug, Clone, PartialEq)]
pub enum PostedReward {
    One(f64),
    PerModel(std::collections::BTreeMap<String, f64>),
}

impl Rewards {
    /// The reward posted for `episode`, removing it.
    pub fn take(&self, episode: &str) -> Option<PostedReward> {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(episode)
    }

    fn put(&self, episode: &str, r: PostedReward) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded like the tracker: a client forgets rewards nobody collects.
        if m.len() >= 65536 && !m.contains_key(episode) {
            m.clear();
        }
        m.insert(episode.to_string(), r);
    }
}

/// Parses `{"reward": r}` or `{"rewards": {"model": r, ...}}` (finite numbers only).
pub fn parse_reward(v: &serde_json::Value) -> Result<PostedReward, String> {
    let num = |x: &serde_json::Value, what: &str| -> Result<f64, String> {
        x.as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| format!("{what} must be a finite number, got {x}"))
    };
    if let Some(r) = v.get("reward") {
        return Ok(PostedReward::One(num(r, "reward")?));
    }
    if let Some(rs) = v.get("rewards") {
        let obj = rs
            .as_object()
            .ok_or("rewards must be an object of model name to number")?;
        if obj.is_empty() {
            return Err("rewards is empty".into());
        }
        let mut out = std::collections::BTreeMap::new();
        for (k, x) in obj {
            out.insert(k.clone(), num(x, &format!("rewards.{k}"))?);
        }
        return Ok(PostedReward::PerModel(out));
    }
    Err("expected {\"reward\": number} or {\"rewards\": {model: number}}".into())
}

/// What a tracking facade shares with its owner (the client's episode runner).
#[derive(Clone)]
pub struct Tracking {
    pub tracker: Arc<Tracker>,
    pub rewards: Arc<Rewards>,
    /// Calls of external models (`ServerConfig::external`), by episode.
    pub external: Arc<ExternalLog>,
}

/// The router with every route of the facade.
pub fn router(backend: Arc<dyn Backend>, cfg: ServerConfig) -> Router {
    router_tracked(backend, cfg).0
}

/// The router, and (when `cfg.track_episodes`) the tracker and posted rewards behind it.
pub fn router_tracked(backend: Arc<dyn Backend>, cfg: ServerConfig) -> (Router, Option<Tracking>) {
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
    });
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
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
        let r = parse_reward(&v).map_err(bad)?;
        st.rewards.put(&episode, r);
        Ok(Json(json!({"ok": true, "episode": episode})).into_response())
    })();
    answer(&st, result)
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }
    fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Overloaded(n) => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is overloaded ({n} requests waiting); retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded"),
        },
        EngineError::Stopped => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model's engine has stopped".into(),
            kind: "server_error",
            param: None,
            code: Some("engine_stopped"),
        },
    }
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad("body", format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad(&path, format!("invalid value for '{path}': {inner}"))
        }
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "stop",
    }
}

/// What every generation request shares after validation.
struct Plan {
    model: String,
    card: Arc<ModelCard>,
    prompt: Vec<u32>,
    max_tokens: usize,
    n: usize,
    sampling: SamplingParams,
    seed: Option<u64>,
    stops: Vec<String>,
    top_logprobs: Option<usize>,
    constraint: Option<Constraint>,
}

struct Common<'a> {
    model: &'a str,
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    n: Option<i64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    /// Penalties, biases and min_p (validated by the caller).
    extra: SamplingParams,
}

fn resolve_model(st: &AppState, model: &str) -> Result<(Arc<ModelCard>, usize), ApiError> {
    if !st.backend.ready() {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is starting; the model is not ready yet".into(),
            kind: "server_error",
            param: None,
            code: Some("not_ready"),
        });
    }
    match (st.backend.card(model), st.backend.max_context(model)) {
        (Some(c), Some(ctx)) => Ok((c, ctx)),
        _ => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model '{model}' does not exist (served: {})",
                st.backend.model_ids().join(", ")
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }),
    }
}

fn plan(
    st: &AppState,
    c: Common<'_>,
    card: Arc<ModelCard>,
    ctx: usize,
    prompt: Vec<u32>,
    top_logprobs: Option<usize>,
) -> Result<Plan, ApiError> {
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k must be positive (or -1 to disable), got {k}"),
            ))
        }
    };
    let n = c.n.unwrap_or(1);
    if n < 1 || n as usize > st.cfg.max_n {
        return Err(ApiError::bad(
            "n",
            format!("n must be between 1 and {}, got {n}", st.cfg.max_n),
        ));
    }
    let stops = c.stop.map(Stop::into_vec).unwrap_or_default();
    if stops.len() > 4 {
        return Err(ApiError::bad(
            "stop",
            format!("at most 4 stop sequences, got {}", stops.len()),
        ));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    let vocab = card.config.vocab_size as u32;
    if let Some(bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::bad(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let room = ctx.saturating_sub(prompt.len());
    let max_tokens = match c.max_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!("max_tokens must be at least 1, got {m}"),
            ))
        }
        Some(m) => m as usize,
        None => st.cfg.default_max_tokens.min(room),
    };
    if max_tokens == 0 || prompt.len() + max_tokens > ctx {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({} in the prompt, {max_tokens} for the completion). Please reduce the prompt or the completion length.",
                prompt.len() + max_tokens.max(1),
                prompt.len()
            ),
            kind: "invalid_request_error",
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        });
    }
    Ok(Plan {
        model: c.model.to_string(),
        card,
        prompt,
        max_tokens,
        n: n as usize,
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            ..c.extra
        },
        seed: c.seed.map(|s| s as u64),
        stops,
        top_logprobs,
        constraint: None,
    })
}

/// Submits the plan's `n` generations as one request (one shared prefill; choice `i`
/// samples with seed `seed + i`).
fn submit(st: &AppState, p: &Plan) -> Result<Vec<UnboundedReceiver<EngineEvent>>, ApiError> {
    st.backend
        .submit(
            &p.model,
            GenerateRequest {
                prompt: p.prompt.clone(),
                max_tokens: p.max_tokens,
                sampling: p.sampling.clone(),
                seed: p.seed,
                stop_token_ids: p.card.generation.eos_token_ids.clone(),
                top_logprobs: p.top_logprobs.unwrap_or(0),
                constraint: p.constraint.clone(),
            },
            p.n,
        )
        .map_err(engine_error)
}

/// One choice being decoded: text, stop strings, ids, logprobs.
struct ChoiceState {
    card: Arc<ModelCard>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    tokens: Vec<u32>,
    /// The engine's logprob of every token (kept for the tracker whether asked or not).
    raw_logprobs: Vec<f32>,
    logprobs: Vec<TokenLogprob>,
    want_logprobs: bool,
    finish: Option<&'static str>,
    policy_version: u64,
    completion_tokens: usize,
    /// Signed calls covering the tokens (remote servers): `(start, upto, version, sig)`.
    signed: Vec<SignedPart>,
    /// A signature that covers the token about to arrive.
    pending_sig: Option<SignedPart>,
}

/// Tokens `start..upto` of a choice as one call a server signed.
#[derive(Debug, Clone)]
pub struct SignedPart {
    pub start: usize,
    pub upto: usize,
    pub policy_version: u64,
    pub signature: Vec<u8>,
}

/// One finished choice as the tracker records it.
pub struct ChoiceRecord {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub signed: Vec<SignedPart>,
}

impl ChoiceState {
    fn new(card: Arc<ModelCard>, stops: Vec<String>, want_logprobs: bool) -> ChoiceState {
        ChoiceState {
            card,
            decoder: StreamDecoder::new(),
            stop: StopMatcher::new(stops),
            tokens: Vec::new(),
            raw_logprobs: Vec::new(),
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
    fn record(&self) -> ChoiceRecord {
        ChoiceRecord {
            tokens: self.tokens.clone(),
            logprobs: self.raw_logprobs.clone(),
            signed: self.signed.clone(),
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.card.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Handles one engine event; returns the newly visible text and the new logprob
    /// entries. Sets `finish` when the choice is done.
    fn on_event(&mut self, ev: EngineEvent) -> Result<(String, Vec<TokenLogprob>), ApiError> {
        match ev {
            EngineEvent::Signed {
                start,
                upto,
                policy_version,
                signature,
            } => {
                if self.finish.is_none() {
                    self.pending_sig = Some(SignedPart {
                        start,
                        upto,
                        policy_version,
                        signature,
                    });
                }
                Ok((String::new(), vec![]))
            }
            EngineEvent::Token { id, logprob, top } => {
                if self.finish.is_some() {
                    return Ok((String::new(), vec![]));
                }
                self.tokens.push(id);
                self.raw_logprobs.push(logprob as f32);
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
            EngineEvent::Finished {
                reason,
                completion_tokens,
                policy_version,
                ..
            } => {
                self.policy_version = policy_version;
                self.completion_tokens = completion_tokens;
                let rest = self.stop.flush();
                self.finish = Some(finish_str(reason));
                Ok((rest, vec![]))
            }
            EngineEvent::Failed(msg) => Err(ApiError::server(format!("generation failed: {msg}"))),
        }
    }
}

/// Drives one choice to its end (non-streaming).
async fn run_choice(
    mut rx: UnboundedReceiver<EngineEvent>,
    mut st: ChoiceState,
) -> Result<ChoiceState, ApiError> {
    while st.finish.is_none() {
        match rx.recv().await {
            Some(ev) => {
                st.on_event(ev)?;
            }
            None => return Err(ApiError::server("the engine dropped the request")),
        }
    }
    Ok(st) // dropping rx cancels the engine request if a stop string ended it early
}

/// Penalties, biases and min_p of a request, validated (400 naming the field).
fn extra_sampling(
    card: &ModelCard,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    bias: Option<&std::collections::HashMap<String, f64>>,
) -> Result<SamplingParams, ApiError> {
    let vocab = card.config.vocab_size as u32;
    let mut logit_bias = Vec::new();
    for (k, v) in bias.into_iter().flatten() {
        let id: u32 = k.parse().ok().filter(|&id| id < vocab).ok_or_else(|| {
            ApiError::bad(
                "logit_bias",
                format!("logit_bias key {k:?} is not a token id below {vocab}"),
            )
        })?;
        if !(-100.0..=100.0).contains(v) {
            return Err(ApiError::bad(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {v}"),
            ));
        }
        logit_bias.push((id, *v as f32));
    }
    let extra = SamplingParams {
        min_p: min_p.unwrap_or(0.0),
        presence_penalty: presence_penalty.unwrap_or(0.0),
        frequency_penalty: frequency_penalty.unwrap_or(0.0),
        repetition_penalty: repetition_penalty.unwrap_or(1.0),
        logit_bias,
        ..Default::default()
    };
    if let Err(e) = extra.validate() {
        let field = e.split_whitespace().next().unwrap_or("body").to_string();
        return Err(ApiError::bad(&field, e));
    }
    Ok(extra)
}

/// The model's token bytes (built once per model).
fn token_bytes(st: &AppState, p: &Plan) -> Arc<TokenBytes> {
    let mut cache = st.token_bytes.lock().unwrap_or_else(|e| e.into_inner());
    cache
        .entry(p.model.clone())
        .or_insert_with(|| Arc::new(p.card.tokenizer.token_bytes(p.card.config.vocab_size)))
        .clone()
}

/// What `response_format` asks for.
enum JsonMode {
    Text,
    Object,
    Schema(Json_),
}

fn json_mode(req: &ChatCompletionRequest) -> Result<JsonMode, ApiError> {
    let Some(rf) = &req.response_format else {
        return Ok(JsonMode::Text);
    };
    match rf.get("type").and_then(|t| t.as_str()) {
        Some("text") => Ok(JsonMode::Text),
        Some("json_object") => Ok(JsonMode::Object),
        Some("json_schema") => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .filter(|s| s.get("type").and_then(|t| t.as_str()) == Some("object"))
                .ok_or_else(|| {
                    ApiError::bad(
                        "response_format.json_schema.schema",
                        "response_format json_schema needs json_schema.schema with \"type\": \"object\" at its root",
                    )
                })?;
            Ok(JsonMode::Schema(schema.clone()))
        }
        _ => Err(ApiError::bad(
            "response_format",
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
        )),
    }
}

/// Whether tool calls are parsed from the output (tools given and `tool_choice` is not
/// "none"; the tools are shown to the model either way, as OpenAI does), and the function
/// names a call is forced among (`tool_choice` "required": any tool; a named function:
/// that one).
fn tool_plan(req: &ChatCompletionRequest) -> Result<(bool, Vec<ToolSpec>), ApiError> {
    let tools = req.tools.as_deref().unwrap_or(&[]);
    let mut names = Vec::with_capacity(tools.len());
    let mut specs = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                ApiError::bad(
                    &format!("tools[{i}].function.name"),
                    format!("tools[{i}] needs {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                )
            })?;
        names.push(name.to_string());
        specs.push(ToolSpec {
            name: name.to_string(),
            parameters: t.get("function").and_then(|f| f.get("parameters")).cloned(),
        });
    }
    let choice = req.tool_choice.as_ref();
    let forced = match choice {
        None => vec![],
        Some(Json_::String(c)) => match c.as_str() {
            "none" => return Ok((false, vec![])),
            "auto" => vec![],
            "required" if names.is_empty() => {
                return Err(ApiError::bad(
                    "tool_choice",
                    "tool_choice 'required' needs tools",
                ))
            }
            "required" => specs,
            other => {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!(
                    "tool_choice must be 'none', 'auto', 'required' or a function, got '{other}'"
                ),
                ))
            }
        },
        Some(obj) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(|n| n.as_str())
                .ok_or_else(|| {
                    ApiError::bad(
                        "tool_choice",
                        "tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let Some(i) = names.iter().position(|n| n == name) else {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("tool_choice names '{name}', which is not among the tools"),
                ));
            };
            vec![specs.swap_remove(i)]
        }
    };
    Ok((!names.is_empty(), forced))
}

/// The Hermes-style tool instructions (what Qwen2.5's template writes) for a model whose
/// template knows nothing of tools.
fn tool_system_text(tools: &[Json_]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// Messages a template without tool support can render: the tool instructions join the
/// system message; an assistant's `tool_calls` become the `<tool_call>` text the model
/// wrote (arguments verbatim); a `tool` message becomes a user turn in
/// `<tool_response>` tags; a null content becomes "".
fn messages_without_tool_support(messages: &[Json_], tools: Option<&[Json_]>) -> Vec<Json_> {
    let mut out: Vec<Json_> = Vec::with_capacity(messages.len() + 1);
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let text = tool_system_text(tools);
        match messages.first() {
            Some(m) if m.get("role").and_then(|r| r.as_str()) == Some("system") => {
                let sys = m.get("content").and_then(|c| c.as_str()).unwrap_or("");
                out.push(json!({"role": "system", "content": format!("{sys}\n\n{text}")}));
            }
            _ => out.push(json!({"role": "system", "content": text})),
        }
    }
    for (i, m) in messages.iter().enumerate() {
        if i == 0 && out.len() == 1 && m.get("role").and_then(|r| r.as_str()) == Some("system") {
            continue;
        }
        let role = m.get("role").and_then(|r| r.as_str()).unwrap_or("");
        let content = match m.get("content") {
            Some(Json_::String(s)) => s.clone(),
            Some(Json_::Null) | None => String::new(),
            // Content parts: their text, joined.
            Some(Json_::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect::<Vec<_>>()
                .join(""),
            Some(other) => other.to_string(),
        };
        match role {
            "assistant" => {
                let mut text = content;
                for call in m
                    .get("tool_calls")
                    .and_then(|c| c.as_array())
                    .into_iter()
                    .flatten()
                {
                    let f = call.get("function");
                    let name = f
                        .and_then(|f| f.get("name"))
                        .cloned()
                        .unwrap_or(Json_::Null);
                    let args = f
                        .and_then(|f| f.get("arguments"))
                        .map(|a| match a {
                            Json_::String(s) => s.clone(),
                            other => other.to_string(),
                        })
                        .unwrap_or_else(|| "{}".into());
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!(
                        "<tool_call>\n{{\"name\": {name}, \"arguments\": {args}}}\n</tool_call>"
                    ));
                }
                out.push(json!({"role": "assistant", "content": text}));
            }
            "tool" => out.push(json!({
                "role": "user",
                "content": format!("<tool_response>\n{content}\n</tool_response>"),
            })),
            _ => out.push(json!({"role": role, "content": content})),
        }
    }
    out
}

/// How a request's messages are rendered: the model's template, the tools, and whether
/// messages are rewritten for a template without tool support (decided once per request,
/// so that every rendering of one request agrees).
struct ChatRenderer {
    tmpl: ChatTemplate,
    tools: Option<Vec<Json_>>,
    rewrite: bool,
}

impl ChatRenderer {
    fn new(card: &ModelCard, model: &str, req: &ChatCompletionRequest) -> Result<Self, ApiError> {
        if req.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages must not be empty"));
        }
        for (i, m) in req.messages.iter().enumerate() {
            if m.get("role").and_then(|r| r.as_str()).is_none() {
                return Err(ApiError::bad(
                    &format!("messages[{i}].role"),
                    format!("messages[{i}] has no string 'role'"),
                ));
            }
        }
        let tmpl = card.chat_template(model).map_err(|e| {
            ApiError::bad(
                "messages",
                format!("{e}; use /v1/completions for raw prompts"),
            )
        })?;
        let tools = req.tools.as_deref().filter(|t| !t.is_empty());
        let source = match (tools, &card.tool_use_template_source) {
            (Some(_), Some(t)) => Some(t.as_str()),
            _ => card.chat_template_source.as_deref(),
        };
        let knows_tools = source.is_some_and(|s| s.contains("tool_calls"));
        let needs_rewrite = tools.is_some()
            || req.messages.iter().any(|m| {
                m.get("tool_calls").is_some()
                    || m.get("role").and_then(|r| r.as_str()) == Some("tool")
                    || !m.get("content").is_some_and(|c| c.is_string())
            });
        Ok(ChatRenderer {
            tmpl,
            tools: tools.map(<[Json_]>::to_vec),
            rewrite: !knows_tools && needs_rewrite,
        })
    }

    fn render(&self, messages: &[Json_], add_generation_prompt: bool) -> Result<String, String> {
        let rewritten;
        let (messages, tools) = if self.rewrite {
            rewritten = messages_without_tool_support(messages, self.tools.as_deref());
            (&rewritten[..], None)
        } else {
            (messages, self.tools.as_deref())
        };
        self.tmpl
            .render(&ChatRequest {
                messages,
                tools,
                add_generation_prompt,
                extra: None,
            })
            .map_err(|e| e.to_string())
    }
}

/// The episode a request belongs to, when tracking: its bearer token.
fn episode_of(st: &AppState, headers: &axum::http::HeaderMap) -> Option<String> {
    st.tracker.as_ref()?;
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let token = auth.strip_prefix("Bearer ").unwrap_or(auth).trim();
    (!token.is_empty()).then(|| token.to_string())
}

/// The body, or the reason it could not be read (too large: 413) in OpenAI's shape.
fn body_or_error(body: Body, limit: usize) -> Result<Bytes, ApiError> {
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
fn answer(st: &AppState, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        st.errors.fetch_add(1, Ordering::Relaxed);
        e.into_response()
    })
}

type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let episode = episode_of(&st, &headers);
    let result = match body_or_error(body, st.cfg.max_body_bytes) {
        Ok(body) => match external_of(&st, &body) {
            Some(m) => forward_external(&st, &m, "chat/completions", &body, episode).await,
            None => chat_inner(&st, body, episode).await,
        },
        Err(e) => Err(e),
    };
    answer(&st, result)
}

/// The external model a request names, if any.
fn external_of(st: &AppState, body: &Bytes) -> Option<Arc<ExternalModel>> {
    if st.cfg.external.is_empty() {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    let name = serde_json::from_slice::<ModelOnly>(body).ok()?.model?;
    st.cfg.external.iter().find(|m| m.name == name).cloned()
}

async fn forward_external(
    st: &AppState,
    m: &ExternalModel,
    path: &str,
    body: &Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    forward(m, path, body, episode, st.external.clone())
        .await
        .map_err(|(status, message)| ApiError {
            status,
            message,
            kind: if status == StatusCode::BAD_REQUEST {
                "invalid_request_error"
            } else {
                "api_error"
            },
            param: None,
            code: (status == StatusCode::BAD_GATEWAY).then_some("external_model_unreachable"),
        })
}

async fn chat_inner(
    st: &Arc<AppState>,
    body: Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(&body)?;
    let (card, ctx) = resolve_model(st, &req.model)?;
    let extra = extra_sampling(
        &card,
        req.min_p,
        req.presence_penalty,
        req.frequency_penalty,
        req.repetition_penalty,
        req.logit_bias.as_ref(),
    )?;
    let (tools_on, forced) = tool_plan(&req)?;
    let json_mode = json_mode(&req)?;
    if !matches!(json_mode, JsonMode::Text) && !forced.is_empty() {
        return Err(ApiError::bad(
            "response_format",
            "a JSON response_format cannot be combined with a forced tool call (tool_choice)",
        ));
    }
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(k)) if k < 0 || k as usize > st.cfg.max_top_logprobs => {
            return Err(ApiError::bad(
                "top_logprobs",
                format!(
                    "top_logprobs must be between 0 and {}, got {k}",
                    st.cfg.max_top_logprobs
                ),
            ))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, _) => None,
    };
    let renderer = ChatRenderer::new(&card, &req.model, &req)?;
    let render = |m: &[Json_], g: bool| renderer.render(m, g);
    let (prompt, tracked) = match (&st.tracker, &episode) {
        (Some(t), Some(ep)) => {
            let (ids, outcome, text) = t
                .prompt(ep, &req.model, &card, &req.messages, &render)
                .map_err(|e| ApiError::bad("messages", e))?;
            (ids, Some((ep.clone(), outcome, text)))
        }
        _ => {
            let text = render(&req.messages, true).map_err(|e| ApiError::bad("messages", e))?;
            let ids = card
                .tokenizer
                .encode(&text)
                .map_err(|e| ApiError::server(e.to_string()))?;
            (ids, None)
        }
    };
    let timeline = tracked.as_ref().map(|t| match &t.1 {
        Outcome::First => "first",
        Outcome::Continued => "continued",
        Outcome::Break(_) => "break",
    });
    // Records the finished call in the episode's timeline.
    let on_done = tracked.map(|(ep, _, text)| {
        let st = st.clone();
        let model = req.model.clone();
        let messages = req.messages.clone();
        move |prompt: &[u32], choices: Vec<ChoiceRecord>, version: u64| {
            if let Some(t) = &st.tracker {
                t.record(&ep, &model, &messages, text, prompt, choices, version);
            }
        }
    });
    let mut p = plan(
        st,
        Common {
            model: &req.model,
            max_tokens: req.max_completion_tokens.or(req.max_tokens),
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            n: req.n,
            seed: req.seed,
            stop: req.stop.clone(),
            extra,
        },
        card,
        ctx,
        prompt,
        top_logprobs,
    )?;
    match &json_mode {
        JsonMode::Text => {}
        JsonMode::Object => p.constraint = Some(Constraint::json_object(token_bytes(st, &p))),
        JsonMode::Schema(schema) => {
            p.constraint = Some(Constraint::json_schema(schema, token_bytes(st, &p)))
        }
    }
    if !forced.is_empty() {
        p.constraint = Some(
            Constraint::tool_call(&forced, token_bytes(st, &p))
                .map_err(|e| ApiError::bad("tool_choice", e))?,
        );
    }
    let rxs = submit(st, &p)?;
    let id = format!("chatcmpl-{:x}", st.next_id.fetch_add(1, Ordering::Relaxed));
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let on_done = on_done.map(|f| Box::new(f) as OnDone);
        return Ok(
            stream_chat(id, p, rxs, include_usage, tools_on, on_done, timeline).into_response(),
        );
    }
    let mut choices = Vec::with_capacity(p.n);
    let mut usage_completion = 0;
    let mut version = 0;
    let states = futures_util::future::join_all(rxs.into_iter().map(|rx| {
        run_choice(
            rx,
            ChoiceState::new(p.card.clone(), p.stops.clone(), top_logprobs.is_some()),
        )
    }))
    .await;
    let states: Vec<ChoiceState> = states.into_iter().collect::<Result<_, _>>()?;
    if let Some(f) = on_done {
        let version = states.first().map_or(0, |s| s.policy_version);
        f(
            &p.prompt,
            states.iter().map(ChoiceState::record).collect(),
            version,
        );
    }
    for (index, s) in states.into_iter().enumerate() {
        usage_completion += s.completion_tokens;
        version = s.policy_version;
        let text = s.stop.text().to_string();
        let mut finish = s.finish.unwrap_or("stop");
        let mut message = ResponseMessage {
            role: "assistant",
            content: Some(text.clone()),
            tool_calls: None,
        };
        if tools_on {
            if let Some((content, calls)) =
                parse_tool_calls(&text, st.next_id.fetch_add(1, Ordering::Relaxed))
            {
                message.content = (!content.is_empty()).then_some(content);
                message.tool_calls = Some(calls);
                finish = "tool_calls";
            }
        }
        choices.push(ChatChoice {
            index,
            message,
            finish_reason: finish,
            logprobs: top_logprobs.map(|_| ChoiceLogprobs {
                content: s.logprobs.clone(),
            }),
            token_ids: s.tokens.clone(),
        });
    }
    let resp = ChatCompletionResponse {
        id,
        object: "chat.completion",
        created: now(),
        model: p.model.clone(),
        choices,
        usage: Usage {
            prompt_tokens: p.prompt.len(),
            completion_tokens: usage_completion,
            total_tokens: p.prompt.len() + usage_completion,
        },
        agentjet: AgentjetExtension {
            prompt_token_ids: p.prompt.clone(),
            policy_version: version,
            timeline: timeline.map(str::to_string),
        },
    };
    Ok(Json(resp).into_response())
}

fn sse_json(v: &Json_) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Streams a chat completion: a role chunk per choice, content deltas as text becomes
/// final, a last chunk per choice with its finish reason (and the token-id extension),
/// the usage chunk if asked, then `[DONE]`. With tools on, a choice's text is held until
/// it ends so that a tool call is sent as `tool_calls`, not as raw text.
/// Called once a tracked call is complete: (prompt ids, each choice's ids and logprobs,
/// policy version).
type OnDone = Box<dyn FnOnce(&[u32], Vec<ChoiceRecord>, u64) + Send>;

fn stream_chat(
    id: String,
    p: Plan,
    rxs: Vec<UnboundedReceiver<EngineEvent>>,
    include_usage: bool,
    tools_on: bool,
    on_done: Option<OnDone>,
    timeline: Option<&'static str>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let created = now();
    let want_lp = p.top_logprobs.is_some();
    tokio::spawn(async move {
        let chunk = |index: usize,
                     delta: Json_,
                     logprobs: Json_,
                     finish: Option<&str>,
                     extra: Option<Json_>| {
            let mut c = json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish});
            if let Some(Json_::Object(m)) = extra {
                for (k, v) in m {
                    c[k] = v;
                }
            }
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": p.model, "choices": [c]})
        };
        for i in 0..rxs.len() {
            if tx
                .send(sse_json(&chunk(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Json_::Null,
                    None,
                    None,
                )))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut states: Vec<ChoiceState> = (0..rxs.len())
            .map(|_| ChoiceState::new(p.card.clone(), p.stops.clone(), want_lp))
            .collect();
        let mut merged =
            futures_util::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| (i, ev))
            }));
        let mut done = 0;
        let mut completion = 0;
        let mut version = 0;
        while done < states.len() {
            let Some((i, ev)) = merged.next().await else {
                break;
            };
            let s = &mut states[i];
            if s.finish.is_some() {
                continue;
            }
            let (text, lps) = match s.on_event(ev) {
                Ok(x) => x,
                Err(e) => {
                    let _ = tx
                        .send(sse_json(
                            &json!({"error": {"message": e.message, "type": e.kind}}),
                        ))
                        .await;
                    return;
                }
            };
            let lp_json = if want_lp && !lps.is_empty() {
                json!({"content": lps})
            } else {
                Json_::Null
            };
            if (!text.is_empty() || !lp_json.is_null()) && !tools_on {
                let delta = if text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                if tx
                    .send(sse_json(&chunk(i, delta, lp_json, None, None)))
                    .await
                    .is_err()
                {
                    return; // the client went away: dropping the receivers cancels
                }
            }
            if let Some(mut finish) = s.finish {
                done += 1;
                completion += s.completion_tokens;
                version = s.policy_version;
                let mut delta = json!({});
                if tools_on {
                    let full = s.stop.text().to_string();
                    match parse_tool_calls(&full, created.wrapping_add(i as u64)) {
                        Some((content, calls)) => {
                            let calls: Vec<Json_> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| json!({"index": k, "id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}))
                                .collect();
                            delta = json!({"content": if content.is_empty() { Json_::Null } else { json!(content) }, "tool_calls": calls});
                            finish = "tool_calls";
                        }
                        None => delta = json!({"content": full}),
                    }
                }
                let extra = json!({"token_ids": s.tokens});
                if tx
                    .send(sse_json(&chunk(
                        i,
                        delta,
                        Json_::Null,
                        Some(finish),
                        Some(extra),
                    )))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        if let Some(f) = on_done {
            if done == states.len() {
                f(
                    &p.prompt,
                    states.iter().map(ChoiceState::record).collect(),
                    version,
                );
            }
        }
        if include_usage {
            let mut agentjet = json!({"prompt_token_ids": p.prompt, "policy_version": version});
            if let Some(t) = timeline {
                agentjet["timeline"] = json!(t);
            }
            let usage = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": p.model, "choices": [],
                "usage": {"prompt_tokens": p.prompt.len(), "completion_tokens": completion, "total_tokens": p.prompt.len() + completion},
                "agentjet": agentjet});
            if tx.send(sse_json(&usage)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out))
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let result = match body_or_error(body, st.cfg.max_body_bytes) {
        Ok(body) => match external_of(&st, &body) {
            Some(m) => {
                let episode = episode_of(&st, &headers);
                forward_external(&st, &m, "completions", &body, episode).await
            }
            None => completions_inner(&st, body).await,
        },
        Err(e) => Err(e),
    };
    answer(&st, result)
}

async fn completions_inner(st: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
    let (card, ctx) = resolve_model(st, &req.model)?;
    let top = match req.logprobs {
        None => None,
        Some(k) if k < 0 || k as usize > st.cfg.max_top_logprobs => {
            return Err(ApiError::bad(
                "logprobs",
                format!("logprobs must be between 0 and {}", st.cfg.max_top_logprobs),
            ))
        }
        Some(k) => Some(k as usize),
    };
    if req.echo && top.is_some() {
        return Err(ApiError::bad(
            "echo",
            "echo with logprobs (prompt logprobs) is not supported yet",
        ));
    }
    let (prompt, prompt_text) = match &req.prompt {
        Prompt::Text(t) => (
            card.tokenizer
                .encode_with_bos(t)
                .map_err(|e| ApiError::server(e.to_string()))?,
            t.clone(),
        ),
        Prompt::Tokens(ids) => (
            ids.clone(),
            card.tokenizer.decode(ids, false).unwrap_or_default(),
        ),
    };
    let p = plan(
        st,
        Common {
            model: &req.model,
            max_tokens: req.max_tokens.or(Some(16)),
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            n: req.n,
            seed: req.seed,
            stop: req.stop.clone(),
            extra: extra_sampling(
                &card,
                req.min_p,
                req.presence_penalty,
                req.frequency_penalty,
                req.repetition_penalty,
                req.logit_bias.as_ref(),
            )?,
        },
        card,
        ctx,
        prompt,
        top,
    )?;
    let rxs = submit(st, &p)?;
    let id = format!("cmpl-{:x}", st.next_id.fetch_add(1, Ordering::Relaxed));
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let echo = req.echo.then_some(prompt_text);
        return Ok(stream_completion(id, p, rxs, echo, include_usage).into_response());
    }
    let states = futures_util::future::join_all(rxs.into_iter().map(|rx| {
        run_choice(
            rx,
            ChoiceState::new(p.card.clone(), p.stops.clone(), top.is_some()),
        )
    }))
    .await;
    let mut choices = Vec::new();
    let mut completion = 0;
    let mut version = 0;
    for (index, s) in states.into_iter().enumerate() {
        let s = s?;
        completion += s.completion_tokens;
        version = s.policy_version;
        let mut text = s.stop.text().to_string();
        if req.echo {
            text = format!("{prompt_text}{text}");
        }
        let logprobs = top.map(|_| completion_logprobs(&s.logprobs, 0));
        choices.push(json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": s.finish.unwrap_or("stop"), "token_ids": s.tokens}));
    }
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": now(), "model": p.model, "choices": choices,
        "usage": {"prompt_tokens": p.prompt.len(), "completion_tokens": completion, "total_tokens": p.prompt.len() + completion},
        "agentjet": {"prompt_token_ids": p.prompt, "policy_version": version},
    }))
    .into_response())
}

/// The legacy completions `logprobs` object of some tokens whose text starts at `offset`.
fn completion_logprobs(lps: &[TokenLogprob], mut offset: usize) -> Json_ {
    let mut offsets = Vec::with_capacity(lps.len());
    for l in lps {
        offsets.push(offset);
        offset += l.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| &l.token).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top_logprobs.iter().map(|t| (t.token.clone(), json!(t.logprob))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// Streams a text completion: the echoed prompt first (if asked), text chunks as they
/// become final (with their logprobs if asked), a last chunk per choice with its finish
/// reason and token ids, the usage chunk if asked, then `[DONE]`.
fn stream_completion(
    id: String,
    p: Plan,
    rxs: Vec<UnboundedReceiver<EngineEvent>>,
    echo: Option<String>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let created = now();
    let want_lp = p.top_logprobs.is_some();
    tokio::spawn(async move {
        let chunk = |index: usize, text: &str, logprobs: Json_, finish: Option<&str>| {
            json!({"id": id, "object": "text_completion", "created": created, "model": p.model,
                   "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]})
        };
        let n = rxs.len();
        let mut offsets = vec![0usize; n];
        if let Some(echo) = &echo {
            for (i, offset) in offsets.iter_mut().enumerate() {
                *offset = echo.len();
                if tx
                    .send(sse_json(&chunk(i, echo, Json_::Null, None)))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
        let mut states: Vec<ChoiceState> = (0..n)
            .map(|_| ChoiceState::new(p.card.clone(), p.stops.clone(), want_lp))
            .collect();
        let mut merged =
            futures_util::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
                tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(move |ev| (i, ev))
            }));
        let (mut done, mut completion, mut version) = (0, 0, 0);
        while done < n {
            let Some((i, ev)) = merged.next().await else {
                break;
            };
            let s = &mut states[i];
            if s.finish.is_some() {
                continue;
            }
            let (text, lps) = match s.on_event(ev) {
                Ok(x) => x,
                Err(e) => {
                    let _ = tx
                        .send(sse_json(
                            &json!({"error": {"message": e.message, "type": e.kind}}),
                        ))
                        .await;
                    return;
                }
            };
            let lp_json = if want_lp && !lps.is_empty() {
                completion_logprobs(&lps, offsets[i])
            } else {
                Json_::Null
            };
            if !text.is_empty() || !lp_json.is_null() {
                offsets[i] += text.len();
                if tx
                    .send(sse_json(&chunk(i, &text, lp_json, None)))
                    .await
                    .is_err()
                {
                    return; // the client went away: dropping the receivers cancels
                }
            }
            if let Some(finish) = s.finish {
                done += 1;
                completion += s.completion_tokens;
                version = s.policy_version;
                let mut last = chunk(i, "", Json_::Null, Some(finish));
                last["choices"][0]["token_ids"] = json!(s.tokens);
                if tx.send(sse_json(&last)).await.is_err() {
                    return;
                }
            }
        }
        if include_usage {
            let usage = json!({"id": id, "object": "text_completion", "created": created, "model": p.model, "choices": [],
                "usage": {"prompt_tokens": p.prompt.len(), "completion_tokens": completion, "total_tokens": p.prompt.len() + completion},
                "agentjet": {"prompt_token_ids": p.prompt, "policy_version": version}});
            if tx.send(sse_json(&usage)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out))
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
    let text = format!(
        "# TYPE agentjet_http_requests_total counter\nagentjet_http_requests_total {}\n# TYPE agentjet_http_errors_total counter\nagentjet_http_errors_total {}\n{}",
        st.requests.load(Ordering::Relaxed),
        st.errors.load(Ordering::Relaxed),
        st.backend.metrics()
    );
    let mut text = text;
    if let Some(t) = &st.tracker {
        text.push_str("# TYPE agentjet_timeline_calls_total counter\n");
        for (model, c) in t.counts() {
            for (outcome, n) in [
                ("first", c.first),
                ("continued", c.continued),
                ("break", c.breaks),
            ] {
                text.push_str(&format!(
                    "agentjet_timeline_calls_total{{model=\"{model}\",outcome=\"{outcome}\"}} {n}\n"
                ));
            }
        }
        text.push_str(&format!(
            "# TYPE agentjet_tracked_episodes gauge\nagentjet_tracked_episodes {}\n",
            t.episodes()
        ));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}
