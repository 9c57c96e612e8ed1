//! `POST /v1/chat/completions`: external models forwarded, episodes tracked, the plan run,
//! and the answer whole or as server-sent events ending in `data: [DONE]`.

use super::*;

pub(super) async fn chat_completions(
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

pub(super) async fn chat_inner(
    st: &Arc<AppState>,
    body: Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(&body)?;
    let started = start_chat(st, &req, episode)?;
    let id = format!("chatcmpl-{:x}", st.next_id.fetch_add(1, Ordering::Relaxed));
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(stream_chat(&st.cfg.tasks, id, started, include_usage).into_response());
    }
    let timeline = started.timeline;
    let top_logprobs = started.p.top_logprobs;
    let (p, finished, version) = finish_all(st, started).await?;
    let mut usage_completion = 0;
    let mut choices = Vec::with_capacity(finished.len());
    for (index, f) in finished.into_iter().enumerate() {
        usage_completion += f.state.completion_tokens;
        let calls = !f.tool_calls.is_empty();
        choices.push(ChatChoice {
            index,
            message: ResponseMessage {
                role: "assistant",
                content: (!calls || !f.content.is_empty()).then_some(f.content),
                tool_calls: calls.then_some(f.tool_calls),
            },
            finish_reason: f.finish,
            logprobs: top_logprobs.map(|_| ChoiceLogprobs {
                content: f.state.logprobs.clone(),
            }),
            token_ids: f.state.tokens.clone(),
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

/// Streams a chat completion: a role chunk per choice, content deltas as text becomes
/// final, a last chunk per choice with its finish reason (and the token-id extension),
/// the usage chunk if asked, then `[DONE]`. With tools on, a choice's text is held until
/// it ends so that a tool call is sent as `tool_calls`, not as raw text.
pub(super) fn stream_chat(
    tasks: &TaskTracker,
    id: String,
    s: Started,
    include_usage: bool,
) -> EventStream {
    let Started {
        p,
        rxs,
        tools_on,
        on_done,
        timeline,
    } = s;
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let created = now();
    let want_lp = p.top_logprobs.is_some();
    tasks.spawn(async move {
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
            futures_util::stream::select_all(
                rxs.into_iter()
                    .enumerate()
                    .map(|(i, rx)| rx.map(move |ev| (i, ev))),
            );
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
