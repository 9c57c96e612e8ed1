//! `POST /v1/responses` (OpenAI's Responses API): input as a string or items (messages,
//! `function_call`, `function_call_output`), `instructions`, function tools with
//! `tool_choice`, `max_output_tokens`, `temperature` / `top_p`, `text.format`,
//! `previous_response_id` (recent responses are kept, per episode), streaming with the
//! documented event sequence, `usage`, and the `agentjet` token-id extension.
//!
//! The request is translated into chat form (`input`) and runs through the same plan,
//! tracker and engine as chat completions (`session`), so an episode may mix the APIs and
//! its calls continue token-exactly. The answer is encoded by `output`.

mod input;
mod output;

use super::*;
use input::{items_to_messages, parse, to_chat};
use output::{response_json, Keep, ResponseMeta, ResponsesStream};

/// The assistant message a finished answer adds to the conversation (what a chat answer
/// holds, so that the next call's history renders as the model wrote it).
pub(super) fn assistant_message(f: &Finished) -> Json_ {
    if f.tool_calls.is_empty() {
        return json!({"role": "assistant", "content": f.content});
    }
    let calls: Vec<Json_> = f
        .tool_calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}))
        .collect();
    let content = if f.content.is_empty() {
        Json_::Null
    } else {
        json!(f.content)
    };
    json!({"role": "assistant", "content": content, "tool_calls": calls})
}

pub(super) async fn responses(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let episode = episode_of(&st, &headers);
    let caller = caller_of(&headers);
    let result = match body_or_error(body, st.cfg.max_body_bytes) {
        Ok(body) => match external_of(&st, &body) {
            Some(m) => forward_external(&st, &m, "responses", &body, episode).await,
            None => responses_inner(&st, body, episode, caller).await,
        },
        Err(e) => Err(e),
    };
    answer(&st, result)
}

async fn responses_inner(
    st: &Arc<AppState>,
    body: Bytes,
    episode: Option<String>,
    caller: Option<[u8; 32]>,
) -> Result<Response, ApiError> {
    let r = parse(&body)?;
    // The conversation so far: a previous response's, then this input.
    let mut history = match &r.previous_response_id {
        Some(prev) => st
            .responses
            .get(prev)
            .filter(|s| s.episode == episode && s.caller == caller)
            .map(|s| s.messages)
            .ok_or_else(|| {
            ApiError::bad(
                "previous_response_id",
                format!("previous response '{prev}' is not found (not stored, forgotten, or of another episode or caller)"),
            )
        })?,
        None => Vec::new(),
    };
    let new = items_to_messages(&r.input, &history)?;
    history.extend(new);
    if history.is_empty() {
        return Err(ApiError::bad("input", "'input' must not be empty"));
    }
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(ins) = &r.instructions {
        messages.push(json!({"role": "system", "content": ins}));
    }
    messages.extend(history.iter().cloned());
    let req = to_chat(&r, messages)?;
    let started = start_chat(st, &req, episode.clone())?;
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        // 128 random bits: a stored response cannot be found by guessing its id.
        id: format!("resp_{}", unguessable_id()),
        created_at: now(),
        model: r.model.clone(),
        request: r.body.clone(),
        timeline: started.timeline,
    };
    // Keeps the answer for a later previous_response_id (when asked to store it).
    let keep = r.store.then(|| {
        let st = st.clone();
        let id = meta.id.clone();
        move |f: &Finished| {
            let mut messages = history;
            messages.push(assistant_message(f));
            st.responses.put(
                id,
                StoredResponse {
                    episode,
                    caller,
                    messages,
                },
            )
        }
    });
    if r.stream {
        let enc = ResponsesStream::new(meta, keep.map(|k| Box::new(k) as Keep));
        return Ok(stream_one(&st.cfg.tasks, started, enc, n).into_response());
    }
    let (p, finished, version) = finish_all(st, started).await?;
    let f = finished
        .first()
        .ok_or_else(|| ApiError::server("no choice finished"))?;
    if let Some(k) = keep {
        k(f);
    }
    Ok(Json(response_json(&meta, &p, f, version)).into_response())
}

/// 32 hex digits from the system's random generator.
fn unguessable_id() -> String {
    use aws_lc_rs::rand::SecureRandom;
    let mut b = [0u8; 16];
    aws_lc_rs::rand::SystemRandom::new()
        .fill(&mut b)
        .expect("the system's random generator");
    b.iter().map(|x| format!("{x:02x}")).collect()
}
