//! What the three chat-shaped APIs share once a request is in chat form: validation into a
//! plan, rendering (tracked per episode: token-in-token-out, so an episode may mix the
//! APIs), submission to the backend, the finished choices (text, tool calls, finish
//! reason), and one driver for single-choice streams. `chat`, `responses` and `messages`
//! each translate their request into a [`ChatCompletionRequest`] and encode the answer in
//! their own shape; nothing here knows those shapes.

use super::*;
use crate::facade::track::transform_of;

/// Called once a tracked call is complete: (prompt ids, each choice's ids and logprobs,
/// policy version).
pub(super) type OnDone = Box<dyn FnOnce(&[u32], Vec<ChoiceRecord>, u64) + Send>;

/// A request validated, rendered and submitted: its choices are on their way.
pub(super) struct Started {
    pub(super) p: Plan,
    pub(super) rxs: Vec<ChoiceStream>,
    /// Tool calls are parsed from the output.
    pub(super) tools_on: bool,
    /// Records the finished call in the episode's timeline (tracking only).
    pub(super) on_done: Option<OnDone>,
    /// How the prompt was built, when tracked ("first", "continued", "break").
    pub(super) timeline: Option<&'static str>,
}

/// Validates `req`, renders its prompt (continuing the episode's ids where exact) and
/// submits it.
pub(super) fn start_chat(
    st: &Arc<AppState>,
    req: &ChatCompletionRequest,
    episode: Option<String>,
) -> Result<Started, ApiError> {
    let (card, ctx) = resolve_model(st, &req.model)?;
    let extra = extra_sampling(
        &card,
        req.min_p,
        req.presence_penalty,
        req.frequency_penalty,
        req.repetition_penalty,
        req.logit_bias.as_ref(),
    )?;
    let (tools_on, forced) = tool_plan(req)?;
    let json_mode = json_mode(req)?;
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
    let renderer = ChatRenderer::new(&card, &req.model, req)?;
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
    let sampling = transform_of(&p.sampling, p.constraint.is_some());
    let on_done = tracked.map(|(ep, _, text)| {
        let st = st.clone();
        let model = req.model.clone();
        let messages = req.messages.clone();
        Box::new(
            move |prompt: &[u32], choices: Vec<ChoiceRecord>, version: u64| {
                if let Some(t) = &st.tracker {
                    t.record(
                        &ep, &model, &messages, text, prompt, choices, version, sampling,
                    );
                }
            },
        ) as OnDone
    });
    let route = Route { episode };
    let rxs = submit(st, &p, &route)?;
    Ok(Started {
        p,
        rxs,
        tools_on,
        on_done,
        timeline,
    })
}

/// One finished choice: its text outside tool calls, the calls, and why it ended.
pub(super) struct Finished {
    pub(super) state: ChoiceState,
    pub(super) content: String,
    pub(super) tool_calls: Vec<ToolCall>,
    /// "stop", "length" or "tool_calls".
    pub(super) finish: &'static str,
}

impl Finished {
    /// `id_seed` numbers the tool calls' ids.
    pub(super) fn of(state: ChoiceState, tools_on: bool, id_seed: u64) -> Finished {
        let text = state.stop.text().to_string();
        let finish = state.finish.unwrap_or("stop");
        if tools_on {
            if let Some((content, tool_calls)) = parse_tool_calls(&text, id_seed) {
                return Finished {
                    state,
                    content,
                    tool_calls,
                    finish: "tool_calls",
                };
            }
        }
        Finished {
            state,
            content: text,
            tool_calls: Vec::new(),
            finish,
        }
    }
}

/// Runs every choice to its end (whole answers) and records the call; returns the plan,
/// the choices and the policy version that sampled them.
pub(super) async fn finish_all(
    st: &AppState,
    s: Started,
) -> Result<(Plan, Vec<Finished>, u64), ApiError> {
    let want_lp = s.p.top_logprobs.is_some();
    let states = futures_util::future::join_all(s.rxs.into_iter().map(|rx| {
        run_choice(
            rx,
            ChoiceState::new(s.p.card.clone(), s.p.stops.clone(), want_lp),
        )
    }))
    .await;
    let states: Vec<ChoiceState> = states.into_iter().collect::<Result<_, _>>()?;
    let version = states.first().map_or(0, |c| c.policy_version);
    if let Some(f) = s.on_done {
        f(
            &s.p.prompt,
            states.iter().map(ChoiceState::record).collect(),
            version,
        );
    }
    let finished = states
        .into_iter()
        .map(|c| Finished::of(c, s.tools_on, st.next_id.fetch_add(1, Ordering::Relaxed)))
        .collect();
    Ok((s.p, finished, version))
}

/// How a single-choice API writes its stream (Responses, Messages).
pub(super) trait OneStream: Send + 'static {
    /// The events before any text.
    fn start(&mut self, p: &Plan) -> Vec<Event>;
    /// Newly visible text (only while tool calls are not parsed: with tools the text is
    /// held until the end, so that a call is never sent as raw text).
    fn delta(&mut self, p: &Plan, text: &str) -> Vec<Event>;
    /// The events after the last token.
    fn finish(&mut self, p: &Plan, f: &Finished, version: u64) -> Vec<Event>;
    /// The event that ends a failed stream.
    fn error(&mut self, e: &ApiError) -> Event;
}

pub(super) type EventStream =
    Sse<tokio_stream::wrappers::ReceiverStream<Result<Event, Infallible>>>;

/// Streams the one choice of `s` through `enc`, then records the call. A client that goes
/// away cancels the generation (the receiver is dropped).
pub(super) fn stream_one<E: OneStream>(
    tasks: &TaskTracker,
    s: Started,
    mut enc: E,
    id_seed: u64,
) -> EventStream {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    tasks.spawn(async move {
        let Started {
            p,
            rxs,
            tools_on,
            on_done,
            ..
        } = s;
        let send_all = |events: Vec<Event>| {
            let tx = tx.clone();
            async move {
                for e in events {
                    if tx.send(Ok(e)).await.is_err() {
                        return false;
                    }
                }
                true
            }
        };
        if !send_all(enc.start(&p)).await {
            return;
        }
        let Some(mut rx) = rxs.into_iter().next() else {
            let _ = tx
                .send(Ok(enc.error(&ApiError::server("no choice was started"))))
                .await;
            return;
        };
        let mut state = ChoiceState::new(p.card.clone(), p.stops.clone(), p.top_logprobs.is_some());
        while state.finish.is_none() {
            let Some(ev) = rx.next().await else {
                let e = ApiError::server("the engine dropped the request");
                let _ = tx.send(Ok(enc.error(&e))).await;
                return;
            };
            match state.on_event(ev) {
                Ok((text, _)) if !tools_on && !text.is_empty() => {
                    if !send_all(enc.delta(&p, &text)).await {
                        return; // the client went away: dropping rx cancels
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.send(Ok(enc.error(&e))).await;
                    return;
                }
            }
        }
        drop(rx);
        let version = state.policy_version;
        if let Some(f) = on_done {
            f(&p.prompt, vec![state.record()], version);
        }
        let f = Finished::of(state, tools_on, id_seed);
        send_all(enc.finish(&p, &f, version)).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out))
}
