//! An Anthropic Messages request in chat form: `system` first, then each message's content
//! blocks (`text`, `tool_use`, `tool_result`) as chat messages (a `tool_use` becomes a
//! `tool_calls` entry whose arguments are the text the model wrote, when this server wrote
//! it; a `tool_result` becomes a `tool` message); `tools` with `input_schema` and
//! `tool_choice` (auto, any, tool, none) become chat tools. What the facade cannot honour
//! answers a 400 naming it; what does not change the answer (`metadata`, `service_tier`,
//! `cache_control`) is accepted.

use super::*;

/// Fields accepted and ignored: none of them changes what the model generates (where
/// and how fast it runs, caching hints, bookkeeping).
const IGNORED: &[&str] = &[
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
];

/// The fields this endpoint reads.
const READ: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
];

/// A Messages request, validated and in chat form.
pub(super) struct MessagesRequest {
    pub(super) chat: ChatCompletionRequest,
    pub(super) stream: bool,
    /// `tool_choice.disable_parallel_tool_use`: at most one tool call is returned.
    pub(super) one_call: bool,
}

fn text_of_blocks(v: &Json_, at: &str) -> Result<String, ApiError> {
    match v {
        Json_::String(s) => Ok(s.clone()),
        Json_::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Json_::as_str), b.get("text")) {
                    (Some("text"), Some(Json_::String(t))) => out.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::bad(
                            &format!("{at}[{i}]"),
                            format!("expected a text block, got type {kind:?}"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(
            at,
            format!("'{at}' must be a string or text blocks"),
        )),
    }
}

/// One message's content blocks as chat messages.
fn message_to_chat(
    m: &Json_,
    at: &str,
    raw_args: &dyn Fn(&str) -> Option<String>,
    out: &mut Vec<Json_>,
) -> Result<(), ApiError> {
    let role = m.get("role").and_then(Json_::as_str);
    let role = match role {
        Some(r @ ("user" | "assistant")) => r,
        other => {
            return Err(ApiError::bad(
                &format!("{at}.role"),
                format!("role must be 'user' or 'assistant', got {other:?}"),
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Json_::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Json_::Array(b)) => b,
        _ => {
            return Err(ApiError::bad(
                &format!("{at}.content"),
                "'content' must be a string or an array of content blocks",
            ))
        }
    };
    let mut text = String::new();
    let mut calls: Vec<Json_> = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{i}]");
        let kind = b.get("type").and_then(Json_::as_str).unwrap_or("");
        match (role, kind) {
            (_, "text") => match b.get("text") {
                Some(Json_::String(t)) => text.push_str(t),
                _ => return Err(ApiError::bad(&bat, "a text block needs a string 'text'")),
            },
            ("assistant", "tool_use") => {
                let id = b.get("id").and_then(Json_::as_str);
                let name = b.get("name").and_then(Json_::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(ApiError::bad(&bat, "a tool_use block needs string 'id' and 'name'"));
                };
                let input = b.get("input").cloned().unwrap_or(json!({}));
                if !input.is_object() {
                    return Err(ApiError::bad(
                        &format!("{bat}.input"),
                        "a tool_use block's 'input' must be an object",
                    ));
                }
                // The model's own text when this server wrote the call and the agent did
                // not change it; else the input as compact JSON.
                let args = raw_args(id)
                    .filter(|raw| serde_json::from_str::<Json_>(raw).ok().as_ref() == Some(&input))
                    .unwrap_or_else(|| input.to_string());
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}}));
            }
            ("user", "tool_result") => {
                if !text.is_empty() {
                    out.push(json!({"role": "user", "content": std::mem::take(&mut text)}));
                }
                let id = b.get("tool_use_id").and_then(Json_::as_str).ok_or_else(|| {
                    ApiError::bad(&bat, "a tool_result block needs a string 'tool_use_id'")
                })?;
                let answered = out.iter().rev().any(|m| {
                    m.get("tool_calls")
                        .and_then(Json_::as_array)
                        .is_some_and(|c| c.iter().any(|c| c["id"] == id))
                });
                if !answered {
                    return Err(ApiError::bad(
                        &format!("{bat}.tool_use_id"),
                        format!("tool_result for '{id}' does not follow a tool_use block with that id"),
                    ));
                }
                let content = match b.get("content") {
                    None | Some(Json_::Null) => String::new(),
                    Some(c) => text_of_blocks(c, &format!("{bat}.content"))?,
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            (_, other) => {
                return Err(ApiError::bad(
                    &format!("{bat}.type"),
                    format!("content block type '{other}' is not supported in a {role} message (text, tool_use in assistant messages, tool_result in user messages)"),
                ))
            }
        }
    }
    if role == "assistant" {
        if calls.is_empty() {
            out.push(json!({"role": "assistant", "content": text}));
        } else {
            let content = if text.is_empty() {
                Json_::Null
            } else {
                json!(text)
            };
            out.push(json!({"role": "assistant", "content": content, "tool_calls": calls}));
        }
    } else if !text.is_empty() || blocks.is_empty() {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

fn chat_tools(tools: &Json_) -> Result<Vec<Json_>, ApiError> {
    let Json_::Array(tools) = tools else {
        return Err(ApiError::bad("tools", "'tools' must be an array"));
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        match t.get("type").and_then(Json_::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(ApiError::bad(
                    &format!("tools[{i}].type"),
                    format!("tool type '{other}' is not supported: only client tools with an input_schema (no server or built-in tools)"),
                ))
            }
        }
        let Some(name) = t
            .get("name")
            .and_then(Json_::as_str)
            .filter(|n| !n.is_empty())
        else {
            return Err(ApiError::bad(
                &format!("tools[{i}].name"),
                "a tool needs a non-empty string 'name'",
            ));
        };
        let Some(schema) = t.get("input_schema").filter(|s| s.is_object()) else {
            return Err(ApiError::bad(
                &format!("tools[{i}].input_schema"),
                "a tool needs an object 'input_schema'",
            ));
        };
        let mut f = json!({"name": name, "parameters": schema});
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            f["description"] = d.clone();
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(out)
}

/// `tool_choice` in chat form, and whether parallel calls are off.
fn chat_tool_choice(c: &Json_) -> Result<(Json_, bool), ApiError> {
    let one = c
        .get("disable_parallel_tool_use")
        .and_then(Json_::as_bool)
        .unwrap_or(false);
    let choice = match c.get("type").and_then(Json_::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = c.get("name").and_then(Json_::as_str).ok_or_else(|| {
                ApiError::bad(
                    "tool_choice.name",
                    "tool_choice of type 'tool' needs 'name'",
                )
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        other => {
            return Err(ApiError::bad(
                "tool_choice.type",
                format!("tool_choice type {other:?} must be auto, any, tool or none"),
            ))
        }
    };
    Ok((choice, one))
}

/// `output_config` as a chat `response_format` (its JSON schema); `effort` cannot be
/// honoured.
fn output_format(c: &Json_) -> Result<Option<Json_>, ApiError> {
    if c.get("effort").is_some_and(|e| !e.is_null()) {
        return Err(ApiError::bad(
            "output_config.effort",
            "output_config.effort is not supported: the served models have no effort control",
        ));
    }
    match c.get("format").filter(|f| !f.is_null()) {
        None => Ok(None),
        Some(f) if f.get("type").and_then(Json_::as_str) == Some("json_schema") => Ok(Some(
            json!({"type": "json_schema", "json_schema": {"name": "output", "schema": f.get("schema").cloned().unwrap_or(Json_::Null)}}),
        )),
        Some(f) => Err(ApiError::bad(
            "output_config.format.type",
            format!(
                "output_config.format type {:?} must be json_schema",
                f.get("type")
            ),
        )),
    }
}

/// Parses and checks a body; `raw_args` gives the text of a tool call this server wrote.
pub(super) fn parse(
    body: &Bytes,
    raw_args: &dyn Fn(&str) -> Option<String>,
) -> Result<MessagesRequest, ApiError> {
    let v: Json_ = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("invalid JSON body: {e}")))?;
    let Json_::Object(b) = v else {
        return Err(ApiError::bad("body", "the body must be a JSON object"));
    };
    for (k, v) in &b {
        if READ.contains(&k.as_str()) || IGNORED.contains(&k.as_str()) || v.is_null() {
            continue;
        }
        return Err(ApiError::bad(k, format!("'{k}': unsupported parameter")));
    }
    if let Some(t) = b.get("thinking").filter(|t| !t.is_null()) {
        if t.get("type").and_then(Json_::as_str) != Some("disabled") {
            return Err(ApiError::bad(
                "thinking",
                "extended thinking is not supported: the served models do not think separately",
            ));
        }
    }
    let model = b
        .get("model")
        .and_then(Json_::as_str)
        .ok_or_else(|| ApiError::bad("model", "'model' is required (a string)"))?
        .to_string();
    let max_tokens = b
        .get("max_tokens")
        .and_then(Json_::as_i64)
        .ok_or_else(|| ApiError::bad("max_tokens", "'max_tokens' is required (an integer)"))?;
    let stream = match b.get("stream") {
        None | Some(Json_::Null) => false,
        Some(Json_::Bool(s)) => *s,
        Some(_) => return Err(ApiError::bad("stream", "'stream' must be a boolean")),
    };
    let num = |k: &str| -> Result<Option<f64>, ApiError> {
        match b.get(k) {
            None | Some(Json_::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::bad(k, format!("'{k}' must be a number"))),
        }
    };
    let temperature = num("temperature")?;
    if let Some(t) = temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::bad(
            "temperature",
            format!("temperature must be between 0 and 1, got {t}"),
        ));
    }
    let top_k = match b.get("top_k") {
        None | Some(Json_::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| ApiError::bad("top_k", "'top_k' must be an integer"))?,
        ),
    };
    let stop = match b.get("stop_sequences") {
        None | Some(Json_::Null) => None,
        Some(Json_::Array(a)) => Some(Stop::Many(
            a.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::bad("stop_sequences", "'stop_sequences' must be strings")
                })?,
        )),
        Some(_) => {
            return Err(ApiError::bad(
                "stop_sequences",
                "'stop_sequences' must be an array of strings",
            ))
        }
    };
    let mut messages = Vec::new();
    if let Some(sys) = b.get("system").filter(|s| !s.is_null()) {
        messages.push(json!({"role": "system", "content": text_of_blocks(sys, "system")?}));
    }
    let Some(Json_::Array(list)) = b.get("messages") else {
        return Err(ApiError::bad(
            "messages",
            "'messages' is required (an array)",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad("messages", "'messages' must not be empty"));
    }
    for (i, m) in list.iter().enumerate() {
        message_to_chat(m, &format!("messages[{i}]"), raw_args, &mut messages)?;
    }
    if list
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Json_::as_str)
        == Some("assistant")
    {
        return Err(ApiError::bad(
            "messages",
            "the last message must be the user's: continuing a prefilled assistant turn is not supported",
        ));
    }
    let tools = match b.get("tools") {
        None | Some(Json_::Null) => None,
        Some(t) => Some(chat_tools(t)?).filter(|t| !t.is_empty()),
    };
    let (tool_choice, one_call) = match b.get("tool_choice") {
        None | Some(Json_::Null) => (None, false),
        Some(c) => {
            let (c, one) = chat_tool_choice(c)?;
            (Some(c), one)
        }
    };
    let response_format = match b.get("output_config") {
        None | Some(Json_::Null) => None,
        Some(c) => output_format(c)?,
    };
    Ok(MessagesRequest {
        chat: ChatCompletionRequest {
            response_format,
            model,
            messages,
            max_tokens: Some(max_tokens),
            temperature,
            top_p: num("top_p")?,
            top_k,
            stop,
            tools,
            tool_choice,
            ..Default::default()
        },
        stream,
        one_call,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Json_) -> Bytes {
        Bytes::from(v.to_string())
    }

    #[test]
    fn tool_use_renders_the_arguments_the_model_wrote_unless_the_agent_changed_them() {
        let raw = "{\"city\":  \"Paris\"}"; // as sampled, with its odd spacing
        let known = |id: &str| (id == "toolu_1").then(|| raw.to_string());
        let req = |input: Json_| {
            body(
                json!({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "S"}],
                "messages": [
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "w", "input": input}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {"type": "text", "text": "Thanks"}]}]}),
            )
        };
        let r = parse(&req(json!({"city": "Paris"})), &known).unwrap();
        let m = &r.chat.messages;
        assert_eq!(m[0], json!({"role": "system", "content": "S"}));
        assert_eq!(m[2]["content"], Json_::Null);
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], raw);
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "Thanks"}));
        // Changed by the agent: its input, as compact JSON.
        let r = parse(&req(json!({"city": "Rome"})), &known).unwrap();
        assert_eq!(
            r.chat.messages[2]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Rome\"}"
        );
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_naming_it() {
        let none = |_: &str| None;
        for (v, param) in [
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0].type",
            ),
            (
                json!({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}),
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!({"model": "m", "max_tokens": 8, "temperature": 1.5,
                "messages": [{"role": "user", "content": "x"}]}),
                "temperature",
            ),
            (
                json!({"model": "m", "max_tokens": 8, "container": "c",
                "messages": [{"role": "user", "content": "x"}]}),
                "container",
            ),
            (
                json!({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
                "messages",
            ),
        ] {
            let e = parse(&body(v.clone()), &none)
                .err()
                .unwrap_or_else(|| panic!("{v}"));
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
        }
    }
}
