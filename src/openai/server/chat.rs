//! `POST /v1/chat/completions`: external models forwarded, episodes tracked, the plan run,
//! and the answer whole or as server-sent events ending in `data: [DONE]`.

use super::*;
use crate::openai::track::transform_of;

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

/// The external model a request names, if any.
pub(super) fn external_of(st: &AppState, body: &Bytes) -> Option<Arc<ExternalModel>> {
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

pub(super) async fn forward_external(
    st: &AppState,
    m: &ExternalModel,
    path: &str,
    body: &Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    forward(m, path, body, episode, st.external.clone(), &st.cfg.tasks)
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

pub(super) async fn chat_inner(
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
                .map_err(|e| ApiError::bad("messages", e.to_string()))?;
            (ids, Some((ep.clone(), outcome, text)))
        }
        _ => {
            let text = render(&req.messages, true)
                .map_err(|e| ApiError::bad("messages", e.to_string()))?;
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
                .map_err(|e| ApiError::bad("tool_choice", e.to_string()))?,
        );
    }
    // Records the finished call in the episode's timeline.
    let sampling = transform_of(&p.sampling, p.constraint.is_some());
    let on_done = tracked.map(|(ep, _, text)| {
        let st = st.clone();
        let model = req.model.clone();
        let messages = req.messages.clone();
        move |prompt: &[u32], choices: Vec<ChoiceRecord>, version: u64| {
            if let Some(t) = &st.tracker {
                t.record(
                    &ep, &model, &messages, text, prompt, choices, version, sampling,
                );
            }
        }
    });
    let route = Route {
        episode: episode.clone(),
    };
    let rxs = submit(st, &p, &route)?;
    let id = format!("chatcmpl-{:x}", st.next_id.fetch_add(1, Ordering::Relaxed));
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let on_done = on_done.map(|f| Box::new(f) as OnDone);
        return Ok(stream_chat(
            &st.cfg.tasks,
            id,
            p,
            rxs,
            include_usage,
            tools_on,
            on_done,
            timeline,
        )
        .into_response());
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

/// Called once a tracked call is complete: (prompt ids, each choice's ids and logprobs,
/// policy version).
pub(super) type OnDone = Box<dyn FnOnce(&[u32], Vec<ChoiceRecord>, u64) + Send>;

/// Streams a chat completion: a role chunk per choice, content deltas as text becomes
/// final, a last chunk per choice with its finish reason (and the token-id extension),
/// the usage chunk if asked, then `[DONE]`. With tools on, a choice's text is held until
/// it ends so that a tool call is sent as `tool_calls`, not as raw text.
#[allow(clippy::too_many_arguments)]
pub(super) fn stream_chat(
    tasks: &TaskTracker,
    id: String,
    p: Plan,
    rxs: Vec<ChoiceStream>,
    include_usage: bool,
    tools_on: bool,
    on_done: Option<OnDone>,
    timeline: Option<&'static str>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
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
