//! A finished answer as an Anthropic `message` (a `text` block, then one `tool_use` block
//! per call, `stop_reason`, `stop_sequence`, `usage`), and the streamed event sequence:
//! `message_start`, per block `content_block_start`, `content_block_delta` (`text_delta` or
//! `input_json_delta`), `content_block_stop`, then `message_delta` (stop reason, output
//! tokens) and `message_stop`.

use super::*;

/// The `tool_use` id of a call (its chat id with Anthropic's prefix).
pub(super) fn tool_use_id(c: &ToolCall) -> String {
    format!(
        "toolu_{}",
        c.id.strip_prefix("call_").unwrap_or(c.id.as_str())
    )
}

/// A call's `input`: its arguments parsed (an object; anything else is wrapped as
/// `{"value": ...}` since Anthropic's input is always an object).
fn input_of(c: &ToolCall) -> Json_ {
    match serde_json::from_str::<Json_>(&c.function.arguments) {
        Ok(v @ Json_::Object(_)) => v,
        Ok(other) => json!({ "value": other }),
        Err(_) => json!({}),
    }
}

fn stop_reason(f: &Finished, calls: usize) -> (&'static str, Json_) {
    if calls > 0 {
        return ("tool_use", Json_::Null);
    }
    if f.finish == "length" {
        return ("max_tokens", Json_::Null);
    }
    match f.state.stop.matched() {
        Some(s) => ("stop_sequence", json!(s)),
        None => ("end_turn", Json_::Null),
    }
}

fn extension(p: &Plan, f: &Finished, version: u64, timeline: Option<&'static str>) -> Json_ {
    let mut e = json!({"prompt_token_ids": p.prompt, "token_ids": f.state.tokens,
        "policy_version": version});
    if let Some(t) = timeline {
        e["timeline"] = json!(t);
    }
    e
}

/// The whole answer.
pub(super) fn message_json(
    id: &str,
    p: &Plan,
    f: &Finished,
    version: u64,
    timeline: Option<&'static str>,
) -> Json_ {
    let mut content = Vec::new();
    if !f.content.is_empty() {
        content.push(json!({"type": "text", "text": f.content}));
    }
    for c in &f.tool_calls {
        content.push(
            json!({"type": "tool_use", "id": tool_use_id(c), "name": c.function.name,
            "input": input_of(c)}),
        );
    }
    let (reason, seq) = stop_reason(f, f.tool_calls.len());
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": p.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {"input_tokens": p.prompt.len(), "output_tokens": f.state.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        "agentjet": extension(p, f, version, timeline),
    })
}

/// Remembers the calls' arguments text once the answer is complete.
pub(super) type Remember = Box<dyn FnOnce(&Finished) + Send>;

/// The streamed answer's events.
pub(super) struct MessagesStream {
    id: String,
    timeline: Option<&'static str>,
    one_call: bool,
    /// The text block is open (text is streaming).
    opened: bool,
    remember: Option<Remember>,
}

fn event(kind: &str, mut body: Json_) -> Event {
    body["type"] = json!(kind);
    Event::default().event(kind).data(body.to_string())
}

impl MessagesStream {
    pub(super) fn new(
        id: String,
        timeline: Option<&'static str>,
        one_call: bool,
        remember: Remember,
    ) -> MessagesStream {
        MessagesStream {
            id,
            timeline,
            one_call,
            opened: false,
            remember: Some(remember),
        }
    }

    fn open_text(&mut self) -> Event {
        self.opened = true;
        event(
            "content_block_start",
            json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
        )
    }
}

fn text_delta(text: &str) -> Event {
    event(
        "content_block_delta",
        json!({"index": 0, "delta": {"type": "text_delta", "text": text}}),
    )
}

impl OneStream for MessagesStream {
    fn start(&mut self, p: &Plan) -> Vec<Event> {
        vec![event(
            "message_start",
            json!({"message": {"id": self.id, "type": "message", "role": "assistant",
                "model": p.model, "content": [], "stop_reason": Json_::Null,
                "stop_sequence": Json_::Null,
                "usage": {"input_tokens": p.prompt.len(), "output_tokens": 0}}}),
        )]
    }

    fn delta(&mut self, _p: &Plan, text: &str) -> Vec<Event> {
        let mut out = Vec::new();
        if !self.opened {
            out.push(self.open_text());
        }
        out.push(text_delta(text));
        out
    }

    fn finish(&mut self, p: &Plan, f: &Finished, version: u64) -> Vec<Event> {
        let mut out = Vec::new();
        let mut index = 0;
        if self.opened || !f.content.is_empty() {
            if !self.opened {
                out.push(self.open_text());
                out.push(text_delta(&f.content));
            }
            out.push(event("content_block_stop", json!({"index": 0})));
            index = 1;
        }
        let calls = if self.one_call {
            &f.tool_calls[..f.tool_calls.len().min(1)]
        } else {
            &f.tool_calls[..]
        };
        for (k, c) in calls.iter().enumerate() {
            let at = index + k;
            out.push(event(
                "content_block_start",
                json!({"index": at, "content_block": {"type": "tool_use", "id": tool_use_id(c),
                    "name": c.function.name, "input": {}}}),
            ));
            out.push(event(
                "content_block_delta",
                json!({"index": at, "delta": {"type": "input_json_delta",
                    "partial_json": c.function.arguments}}),
            ));
            out.push(event("content_block_stop", json!({"index": at})));
        }
        let (reason, seq) = stop_reason(f, calls.len());
        out.push(event(
            "message_delta",
            json!({"delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": {"output_tokens": f.state.completion_tokens},
                "agentjet": extension(p, f, version, self.timeline)}),
        ));
        out.push(event("message_stop", json!({})));
        if let Some(r) = self.remember.take() {
            r(f);
        }
        out
    }

    fn error(&mut self, e: &ApiError) -> Event {
        let kind = if e.status.is_client_error() {
            "invalid_request_error"
        } else {
            "api_error"
        };
        event(
            "error",
            json!({"error": {"type": kind, "message": e.message}}),
        )
    }
}
