//! A Responses request in chat form: `instructions` and `input` (a string, or message,
//! `function_call` and `function_call_output` items) become chat messages; function tools
//! and `tool_choice` become chat tools; `text.format` becomes `response_format`. Fields the
//! facade cannot honour answer a 400 naming them; fields that do not change the answer
//! (`store`, `metadata`, `user`, `parallel_tool_calls`, ...) are accepted.

use super::*;

/// Fields accepted and ignored: none of them changes what the model generates.
const IGNORED: &[&str] = &[
    "store",
    "metadata",
    "user",
    "service_tier",
    "parallel_tool_calls",
    "stream_options",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
];

/// The fields this endpoint reads.
const READ: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_logprobs",
    "previous_response_id",
    "stream",
    "include",
    "text",
    "truncation",
    "reasoning",
    "seed",
    "top_k",
];

/// A Responses request, validated.
pub(super) struct ResponsesRequest {
    pub(super) body: serde_json::Map<String, Json_>,
    pub(super) model: String,
    pub(super) stream: bool,
    pub(super) store: bool,
    pub(super) previous_response_id: Option<String>,
    /// The input items (a string input as one user message).
    pub(super) input: Vec<Json_>,
    pub(super) instructions: Option<String>,
}

fn str_field<'a>(
    body: &'a serde_json::Map<String, Json_>,
    name: &str,
) -> Result<Option<&'a str>, ApiError> {
    match body.get(name) {
        None | Some(Json_::Null) => Ok(None),
        Some(Json_::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::bad(name, format!("'{name}' must be a string"))),
    }
}

fn bool_field(
    body: &serde_json::Map<String, Json_>,
    name: &str,
    default: bool,
) -> Result<bool, ApiError> {
    match body.get(name) {
        None | Some(Json_::Null) => Ok(default),
        Some(Json_::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(name, format!("'{name}' must be a boolean"))),
    }
}

/// Parses and checks a body: the fields, their types, the input items' kinds and order.
pub(super) fn parse(body: &Bytes) -> Result<ResponsesRequest, ApiError> {
    let v: Json_ = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("invalid JSON body: {e}")))?;
    let Json_::Object(body) = v else {
        return Err(ApiError::bad("body", "the body must be a JSON object"));
    };
    for (k, v) in &body {
        if READ.contains(&k.as_str()) || IGNORED.contains(&k.as_str()) || v.is_null() {
            continue;
        }
        let why = match k.as_str() {
            "background" if v == &Json_::Bool(false) => continue,
            "background" => "background mode is not supported",
            "conversation" => "conversations are not supported (use previous_response_id)",
            "prompt" => "stored prompt templates are not supported",
            "max_tool_calls" => "max_tool_calls limits built-in tools, which are not supported",
            "context_management" => "context management is not supported",
            _ => "unknown parameter",
        };
        return Err(ApiError::bad(k, format!("'{k}': {why}")));
    }
    let model = str_field(&body, "model")?
        .ok_or_else(|| ApiError::bad("model", "'model' is required"))?
        .to_string();
    let stream = bool_field(&body, "stream", false)?;
    let store = bool_field(&body, "store", true)?;
    let previous_response_id = str_field(&body, "previous_response_id")?.map(str::to_string);
    let instructions = str_field(&body, "instructions")?.map(str::to_string);
    if let Some(t) = str_field(&body, "truncation")? {
        if t != "disabled" {
            return Err(ApiError::bad(
                "truncation",
                format!("truncation '{t}' is not supported (only 'disabled': a prompt over the context is refused)"),
            ));
        }
    }
    match body.get("reasoning") {
        None | Some(Json_::Null) => {}
        Some(Json_::Object(r)) if r.values().all(Json_::is_null) => {}
        Some(_) => {
            return Err(ApiError::bad(
                "reasoning",
                "reasoning options are not supported: the served models do not reason separately",
            ))
        }
    }
    match body.get("include") {
        None | Some(Json_::Null) => {}
        Some(Json_::Array(a)) => {
            for (i, x) in a.iter().enumerate() {
                if x.as_str() != Some("message.output_text.logprobs") {
                    return Err(ApiError::bad(
                        &format!("include[{i}]"),
                        format!(
                            "include {x} is not supported (only \"message.output_text.logprobs\")"
                        ),
                    ));
                }
            }
        }
        Some(_) => return Err(ApiError::bad("include", "'include' must be an array")),
    }
    let input = match body.get("input") {
        None | Some(Json_::Null) if previous_response_id.is_some() => Vec::new(),
        None | Some(Json_::Null) => return Err(ApiError::bad("input", "'input' is required")),
        Some(Json_::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Json_::Array(items)) => items.clone(),
        Some(_) => {
            return Err(ApiError::bad(
                "input",
                "'input' must be a string or an array of input items",
            ))
        }
    };
    Ok(ResponsesRequest {
        body,
        model,
        stream,
        store,
        previous_response_id,
        input,
        instructions,
    })
}

/// The text of a message's content: a string, or text parts (`input_text`,
/// `output_text`, `text`) joined.
fn content_text(content: Option<&Json_>, at: &str) -> Result<String, ApiError> {
    match content {
        Some(Json_::String(s)) => Ok(s.clone()),
        Some(Json_::Array(parts)) => {
            let mut out = String::new();
            for (k, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Json_::as_str).unwrap_or("");
                match kind {
                    "input_text" | "output_text" | "text" => match part.get("text") {
                        Some(Json_::String(t)) => out.push_str(t),
                        _ => {
                            return Err(ApiError::bad(
                                &format!("{at}.content[{k}].text"),
                                "a text part needs a string 'text'",
                            ))
                        }
                    },
                    other => {
                        return Err(ApiError::bad(
                            &format!("{at}.content[{k}].type"),
                            format!("content part type '{other}' is not supported (text only)"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(
            &format!("{at}.content"),
            "a message needs 'content': a string or an array of text parts",
        )),
    }
}

/// Input items as chat messages, after `history` (a previous response's conversation).
/// Consecutive assistant text and `function_call` items make one assistant message with
/// `tool_calls` (as a chat answer has them); a `function_call_output` must answer a call
/// made earlier (in `history` or the items).
pub(super) fn items_to_messages(
    items: &[Json_],
    history: &[Json_],
) -> Result<Vec<Json_>, ApiError> {
    let mut out: Vec<Json_> = Vec::with_capacity(items.len());
    let mut calls_seen: Vec<String> = history
        .iter()
        .filter_map(|m| m.get("tool_calls")?.as_array())
        .flatten()
        .filter_map(|c| Some(c.get("id")?.as_str()?.to_string()))
        .collect();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Json_::Object(obj) = item else {
            return Err(ApiError::bad(&at, "an input item must be an object"));
        };
        let kind = obj.get("type").and_then(Json_::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = obj.get("role").and_then(Json_::as_str).ok_or_else(|| {
                    ApiError::bad(&format!("{at}.role"), "a message needs a string 'role'")
                })?;
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => {
                        return Err(ApiError::bad(
                            &format!("{at}.role"),
                            format!("role '{other}' must be user, assistant, system or developer"),
                        ))
                    }
                };
                let text = content_text(obj.get("content"), &at)?;
                out.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                let field = |name: &str| {
                    obj.get(name).and_then(Json_::as_str).ok_or_else(|| {
                        ApiError::bad(
                            &format!("{at}.{name}"),
                            format!("a function_call item needs a string '{name}'"),
                        )
                    })
                };
                let (call_id, name, args) = (field("call_id")?, field("name")?, field("arguments")?);
                calls_seen.push(call_id.to_string());
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}});
                // Joins the assistant message just before it (its text, or earlier calls).
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" => {
                        if m.get("tool_calls").is_none() {
                            if m["content"] == "" {
                                m["content"] = Json_::Null;
                            }
                            m["tool_calls"] = json!([]);
                        }
                        if let Some(a) = m["tool_calls"].as_array_mut() {
                            a.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": Json_::Null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = obj.get("call_id").and_then(Json_::as_str).ok_or_else(|| {
                    ApiError::bad(
                        &format!("{at}.call_id"),
                        "a function_call_output item needs a string 'call_id'",
                    )
                })?;
                if !calls_seen.iter().any(|c| c == call_id) {
                    return Err(ApiError::bad(
                        &format!("{at}.call_id"),
                        format!("function_call_output for call_id '{call_id}' comes before (or without) its function_call item"),
                    ));
                }
                let output = match obj.get("output") {
                    Some(Json_::String(s)) => s.clone(),
                    Some(parts @ Json_::Array(_)) => content_text(Some(parts), &at)?,
                    _ => {
                        return Err(ApiError::bad(
                            &format!("{at}.output"),
                            "a function_call_output item needs 'output': a string or text parts",
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            "reasoning" | "item_reference" => {
                return Err(ApiError::bad(
                    &format!("{at}.type"),
                    format!("input items of type '{kind}' are not supported (this server keeps no items by id and produces no reasoning items)"),
                ))
            }
            other => {
                return Err(ApiError::bad(
                    &format!("{at}.type"),
                    format!("input item type '{other}' is not supported (message, function_call, function_call_output)"),
                ))
            }
        }
    }
    Ok(out)
}

/// Responses function tools as chat tools (other tool types: 400 naming them).
fn chat_tools(tools: &Json_) -> Result<Vec<Json_>, ApiError> {
    let Json_::Array(tools) = tools else {
        return Err(ApiError::bad("tools", "'tools' must be an array"));
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let kind = t.get("type").and_then(Json_::as_str).unwrap_or("");
        if kind != "function" {
            return Err(ApiError::bad(
                &format!("tools[{i}].type"),
                format!("tool type '{kind}' is not supported: only function tools (built-in tools such as web search, file search or computer use are not)"),
            ));
        }
        let name = t
            .get("name")
            .and_then(Json_::as_str)
            .filter(|n| !n.is_empty());
        let Some(name) = name else {
            return Err(ApiError::bad(
                &format!("tools[{i}].name"),
                "a function tool needs a non-empty string 'name'",
            ));
        };
        let mut f = json!({"name": name});
        for k in ["description", "parameters"] {
            if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                f[k] = v.clone();
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(out)
}

/// `tool_choice` in chat form.
fn chat_tool_choice(c: &Json_) -> Result<Json_, ApiError> {
    match c {
        Json_::String(_) => Ok(c.clone()),
        Json_::Object(o) => match o.get("type").and_then(Json_::as_str) {
            Some("function") => {
                let name = o.get("name").and_then(Json_::as_str).ok_or_else(|| {
                    ApiError::bad("tool_choice.name", "tool_choice of type 'function' needs 'name'")
                })?;
                Ok(json!({"type": "function", "function": {"name": name}}))
            }
            other => Err(ApiError::bad(
                "tool_choice.type",
                format!("tool_choice type {other:?} is not supported (none, auto, required, or a function)"),
            )),
        },
        _ => Err(ApiError::bad("tool_choice", "'tool_choice' must be a string or an object")),
    }
}

/// `text.format` as a chat `response_format`.
fn chat_format(text: &Json_) -> Result<Option<Json_>, ApiError> {
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    if let Some(v) = text.get("verbosity").filter(|v| !v.is_null()) {
        if v != "medium" {
            return Err(ApiError::bad(
                "text.verbosity",
                "text.verbosity is not supported (the served models have no such control)",
            ));
        }
    }
    match f.get("type").and_then(Json_::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => Ok(Some(json!({"type": "json_schema", "json_schema": {
            "name": f.get("name").cloned().unwrap_or(Json_::Null),
            "schema": f.get("schema").cloned().unwrap_or(Json_::Null),
        }}))),
        other => Err(ApiError::bad(
            "text.format.type",
            format!("text.format type {other:?} must be text, json_object or json_schema"),
        )),
    }
}

fn num(body: &serde_json::Map<String, Json_>, name: &str) -> Result<Option<f64>, ApiError> {
    match body.get(name) {
        None | Some(Json_::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(name, format!("'{name}' must be a number"))),
    }
}

fn int(body: &serde_json::Map<String, Json_>, name: &str) -> Result<Option<i64>, ApiError> {
    match body.get(name) {
        None | Some(Json_::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(name, format!("'{name}' must be an integer"))),
    }
}

/// The chat request: `messages` (instructions first, then the history, then the input).
pub(super) fn to_chat(
    r: &ResponsesRequest,
    messages: Vec<Json_>,
) -> Result<ChatCompletionRequest, ApiError> {
    let b = &r.body;
    let tools = match b.get("tools") {
        None | Some(Json_::Null) => None,
        Some(t) => Some(chat_tools(t)).transpose()?.filter(|t| !t.is_empty()),
    };
    let tool_choice = match b.get("tool_choice") {
        None | Some(Json_::Null) => None,
        Some(c) => Some(chat_tool_choice(c)?),
    };
    let response_format = match b.get("text") {
        None | Some(Json_::Null) => None,
        Some(t) => chat_format(t)?,
    };
    let top_logprobs = int(b, "top_logprobs")?;
    let logprobs = top_logprobs.is_some()
        || b.get("include")
            .and_then(Json_::as_array)
            .is_some_and(|a| !a.is_empty());
    Ok(ChatCompletionRequest {
        model: r.model.clone(),
        messages,
        max_tokens: int(b, "max_output_tokens")?,
        temperature: num(b, "temperature")?,
        top_p: num(b, "top_p")?,
        top_k: int(b, "top_k")?,
        seed: int(b, "seed")?,
        logprobs,
        top_logprobs,
        tools,
        tool_choice,
        response_format,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assistant_text_and_calls_make_one_chat_message_and_outputs_must_follow_their_call() {
        let items = vec![
            json!({"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}),
            json!({"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]}),
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "w",
                "arguments": "{\"city\": \"Paris\"}", "status": "completed"}),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "sunny"}),
        ];
        let m = items_to_messages(&items, &[]).unwrap();
        assert_eq!(
            m,
            vec![
                json!({"role": "user", "content": "Weather?"}),
                json!({"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
            ]
        );
        // A call alone makes an assistant message with no text.
        let m = items_to_messages(&items[2..], &[]).unwrap();
        assert_eq!(m[0]["content"], Json_::Null);
        // An output before (or without) its call is refused, naming the item.
        let e = items_to_messages(&items[3..], &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].call_id"));
        // ... unless the call is in the previous response's conversation.
        let history = items_to_messages(&items[..3], &[]).unwrap();
        assert!(items_to_messages(&items[3..], &history).is_ok());
    }
}
