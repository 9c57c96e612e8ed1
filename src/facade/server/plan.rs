//! Validation: a request's fields checked against the model and the facade's limits
//! (400 naming the field) and turned into one [`Plan`]: prompt ids, sampling, `n`, stops,
//! logprobs, constraint (JSON modes, forced tool calls). Then the plan goes to the backend.

use super::*;

/// What every generation request shares after validation.
pub(super) struct Plan {
    pub(super) model: String,
    pub(super) card: Arc<ModelCard>,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) n: usize,
    pub(super) sampling: SamplingParams,
    pub(super) seed: Option<u64>,
    pub(super) stops: Vec<String>,
    pub(super) top_logprobs: Option<usize>,
    pub(super) constraint: Option<Constraint>,
}

pub(super) struct Common<'a> {
    pub(super) model: &'a str,
    pub(super) max_tokens: Option<i64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) top_k: Option<i64>,
    pub(super) n: Option<i64>,
    pub(super) seed: Option<i64>,
    pub(super) stop: Option<Stop>,
    /// Penalties, biases and min_p (validated by the caller).
    pub(super) extra: SamplingParams,
}

pub(super) fn resolve_model(
    st: &AppState,
    model: &str,
) -> Result<(Arc<ModelCard>, usize), ApiError> {
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

pub(super) fn plan(
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
pub(super) fn submit(
    st: &AppState,
    p: &Plan,
    route: &Route,
) -> Result<Vec<ChoiceStream>, ApiError> {
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
                adapter: None,
            },
            p.n,
            route,
        )
        .map_err(engine_error)
}

/// Penalties, biases and min_p of a request, validated (400 naming the field).
pub(super) fn extra_sampling(
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
        return Err(ApiError::bad(e.field, e.to_string()));
    }
    Ok(extra)
}

/// The model's token bytes (built once per model).
pub(super) fn token_bytes(st: &AppState, p: &Plan) -> Arc<TokenBytes> {
    let mut cache = lock(&st.token_bytes);
    cache
        .entry(p.model.clone())
        .or_insert_with(|| Arc::new(p.card.tokenizer.token_bytes(p.card.config.vocab_size)))
        .clone()
}

/// What `response_format` asks for.
pub(super) enum JsonMode {
    Text,
    Object,
    Schema(Json_),
}

pub(super) fn json_mode(req: &ChatCompletionRequest) -> Result<JsonMode, ApiError> {
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
pub(super) fn tool_plan(req: &ChatCompletionRequest) -> Result<(bool, Vec<ToolSpec>), ApiError> {
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
