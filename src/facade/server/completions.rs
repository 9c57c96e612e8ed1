//! `POST /v1/completions`: text or token-id prompts, `echo`, logprobs, whole or streamed.

use super::*;

pub(super) async fn completions(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let result = match body_or_error(body, st.cfg.max_body_bytes) {
        Ok(body) => {
            let episode = episode_of(&st, &headers);
            match external_of(&st, &body) {
                Some(m) => forward_external(&st, &m, "completions", &body, episode).await,
                None => completions_inner(&st, body, episode).await,
            }
        }
        Err(e) => Err(e),
    };
    answer(&st, result)
}

pub(super) async fn completions_inner(
    st: &Arc<AppState>,
    body: Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
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
    let rxs = submit(st, &p, &Route { episode })?;
    let id = format!("cmpl-{:x}", st.next_id.fetch_add(1, Ordering::Relaxed));
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let echo = req.echo.then_some(prompt_text);
        return Ok(
            stream_completion(&st.cfg.tasks, id, p, rxs, echo, include_usage).into_response(),
        );
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
pub(super) fn completion_logprobs(lps: &[TokenLogprob], mut offset: usize) -> Json_ {
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
pub(super) fn stream_completion(
    tasks: &TaskTracker,
    id: String,
    p: Plan,
    rxs: Vec<ChoiceStream>,
    echo: Option<String>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let created = now();
    let want_lp = p.top_logprobs.is_some();
    tasks.spawn(async move {
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
            futures_util::stream::select_all(
                rxs.into_iter()
                    .enumerate()
                    .map(|(i, rx)| rx.map(move |ev| (i, ev))),
            );
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
