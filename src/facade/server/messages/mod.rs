//! `POST /v1/messages` (Anthropic's Messages API): `system`, content blocks (`text`,
//! `tool_use`, `tool_result`), `tools` with `input_schema`, `tool_choice` (auto, any, tool,
//! none), `max_tokens`, `stop_sequences`, `temperature` / `top_p` / `top_k`, streaming with
//! Anthropic's event sequence, Anthropic-shaped errors
//! (`{"type": "error", "error": {"type", "message"}}`), and `x-api-key` (or a bearer token)
//! as the episode key.
//!
//! The request is translated into chat form (`input`) and runs through the same plan,
//! tracker and engine as chat completions (`session`); the answer is encoded by `output`.
//! A `tool_use` block comes back from the agent with its `input` parsed, so the arguments
//! text the model wrote is remembered by tool-use id (`AppState::tool_args`) and rendered
//! again verbatim: the next call continues the episode's ids exactly.

mod input;
mod output;

use super::*;
use input::parse;
use output::{message_json, tool_use_id, MessagesStream};

/// An error in Anthropic's shape, with the same HTTP status.
fn anthropic_error(e: ApiError) -> Response {
    let kind = match e.status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    (
        e.status,
        Json(json!({"type": "error", "error": {"type": kind, "message": e.message}})),
    )
        .into_response()
}

pub(super) async fn messages(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let episode = episode_of(&st, &headers);
    let result = match body_or_error(body, st.cfg.max_body_bytes) {
        Ok(body) => messages_inner(&st, body, episode).await,
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|e| {
        st.errors.fetch_add(1, Ordering::Relaxed);
        anthropic_error(e)
    })
}

async fn messages_inner(
    st: &Arc<AppState>,
    body: Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    if let Some(m) = external_of(st, &body) {
        return Err(ApiError::bad(
            "model",
            format!(
                "the external model '{}' is reached through /v1/chat/completions only",
                m.name
            ),
        ));
    }
    let raw_args = |id: &str| st.tool_args.get(id);
    let r = parse(&body, &raw_args)?;
    let started = start_chat(st, &r.chat, episode)?;
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("msg_{n:016x}");
    let remember = {
        let st = st.clone();
        move |f: &Finished| {
            for c in &f.tool_calls {
                st.tool_args
                    .put(tool_use_id(c), c.function.arguments.clone());
            }
        }
    };
    if r.stream {
        let enc = MessagesStream::new(id, started.timeline, r.one_call, Box::new(remember));
        return Ok(stream_one(&st.cfg.tasks, started, enc, n).into_response());
    }
    let timeline = started.timeline;
    let (p, mut finished, version) = finish_all(st, started).await?;
    let f = finished
        .first_mut()
        .ok_or_else(|| ApiError::server("no choice finished"))?;
    if r.one_call {
        f.tool_calls.truncate(1);
    }
    remember(f);
    Ok(Json(message_json(&id, &p, f, version, timeline)).into_response())
}
