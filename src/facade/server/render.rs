//! Rendering chat messages with the model's own template (token-in-token-out starts
//! here), and the Hermes-format rewrite for templates that know nothing of tools.

use super::*;

/// The Hermes-style tool instructions (what Qwen2.5's template writes) for a model whose
/// template knows nothing of tools.
pub(super) fn tool_system_text(tools: &[Json_]) -> String {
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
pub(super) fn messages_without_tool_support(
    messages: &[Json_],
    tools: Option<&[Json_]>,
) -> Vec<Json_> {
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
pub(super) struct ChatRenderer {
    pub(super) tmpl: ChatTemplate,
    pub(super) tools: Option<Vec<Json_>>,
    pub(super) rewrite: bool,
    /// The request's `chat_template_kwargs`.
    pub(super) kwargs: Option<serde_json::Map<String, Json_>>,
}

impl ChatRenderer {
    pub(super) fn new(
        card: &ModelCard,
        model: &str,
        req: &ChatCompletionRequest,
    ) -> Result<Self, ApiError> {
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
            kwargs: req.chat_template_kwargs.clone(),
        })
    }

    pub(super) fn render(
        &self,
        messages: &[Json_],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let rewritten;
        let (messages, tools) = if self.rewrite {
            rewritten = messages_without_tool_support(messages, self.tools.as_deref());
            (&rewritten[..], None)
        } else {
            (messages, self.tools.as_deref())
        };
        self.tmpl.render(&ChatRequest {
            messages,
            tools,
            add_generation_prompt,
            extra: self.kwargs.as_ref(),
        })
    }
}
