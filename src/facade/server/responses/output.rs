//! A finished answer as a Responses `response` object (output items: a `message` with
//! `output_text`, then one `function_call` per tool call), and the streamed event sequence:
//! `response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta` ..., `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`, per call
//! `response.function_call_arguments.delta` / `.done`, then `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut the answer). Every event carries its
//! `sequence_number`.

use super::*;

/// What the response object repeats of its request, and its identity.
pub(super) struct ResponseMeta {
    pub(super) id: String,
    pub(super) created_at: u64,
    pub(super) model: String,
    pub(super) request: serde_json::Map<String, Json_>,
    pub(super) timeline: Option<&'static str>,
}

impl ResponseMeta {
    fn req(&self, k: &str, default: Json_) -> Json_ {
        self.request
            .get(k)
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or(default)
    }

    fn message_id(&self) -> String {
        format!("msg_{}", &self.id["resp_".len()..])
    }

    fn call_id(&self, k: usize) -> String {
        format!("fc_{}_{k}", &self.id["resp_".len()..])
    }

    /// The response object: `output` and `status` as given, the request's settings echoed.
    fn object(&self, status: &str, output: Vec<Json_>, usage: Json_, extra: Json_) -> Json_ {
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": Json_::Null,
            "incomplete_details": incomplete,
            "instructions": self.req("instructions", Json_::Null),
            "max_output_tokens": self.req("max_output_tokens", Json_::Null),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.req("parallel_tool_calls", json!(true)),
            "previous_response_id": self.req("previous_response_id", Json_::Null),
            "reasoning": {"effort": Json_::Null, "summary": Json_::Null},
            "store": self.req("store", json!(true)),
            "temperature": self.req("temperature", json!(1.0)),
            "text": self.req("text", json!({"format": {"type": "text"}})),
            "tool_choice": self.req("tool_choice", json!("auto")),
            "tools": self.req("tools", json!([])),
            "top_p": self.req("top_p", json!(1.0)),
            "truncation": "disabled",
            "usage": usage,
            "user": self.req("user", Json_::Null),
            "metadata": self.req("metadata", json!({})),
            "agentjet": extra,
        })
    }

    fn text_part(&self, f: &Finished) -> Json_ {
        json!({"type": "output_text", "text": f.content, "annotations": [], "logprobs": f.state.logprobs})
    }

    /// Whether the answer has a message item (text, or no call at all).
    fn has_message(f: &Finished) -> bool {
        !f.content.is_empty() || f.tool_calls.is_empty()
    }

    fn message_item(&self, f: &Finished) -> Json_ {
        json!({"type": "message", "id": self.message_id(), "status": "completed",
            "role": "assistant", "content": [self.text_part(f)]})
    }

    fn call_item(&self, k: usize, c: &ToolCall, status: &str, args: &str) -> Json_ {
        json!({"type": "function_call", "id": self.call_id(k), "call_id": c.id,
            "name": c.function.name, "arguments": args, "status": status})
    }

    fn output(&self, f: &Finished) -> Vec<Json_> {
        let mut out = Vec::new();
        if Self::has_message(f) {
            out.push(self.message_item(f));
        }
        for (k, c) in f.tool_calls.iter().enumerate() {
            out.push(self.call_item(k, c, "completed", &c.function.arguments));
        }
        out
    }
}

fn status_of(f: &Finished) -> &'static str {
    if f.finish == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

fn usage_of(p: &Plan, f: &Finished) -> Json_ {
    let out = f.state.completion_tokens;
    json!({"input_tokens": p.prompt.len(), "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": p.prompt.len() + out})
}

fn extension(meta: &ResponseMeta, p: &Plan, f: &Finished, version: u64) -> Json_ {
    let mut e = json!({"prompt_token_ids": p.prompt, "token_ids": f.state.tokens,
        "policy_version": version});
    if let Some(t) = meta.timeline {
        e["timeline"] = json!(t);
    }
    e
}

/// The whole answer.
pub(super) fn response_json(meta: &ResponseMeta, p: &Plan, f: &Finished, version: u64) -> Json_ {
    meta.object(
        status_of(f),
        meta.output(f),
        usage_of(p, f),
        extension(meta, p, f, version),
    )
}

/// Stores the finished answer (for `previous_response_id`).
pub(super) type Keep = Box<dyn FnOnce(&Finished) + Send>;

/// The streamed answer's events.
pub(super) struct ResponsesStream {
    meta: ResponseMeta,
    seq: u64,
    /// The message item was announced (text is streaming).
    opened: bool,
    keep: Option<Keep>,
}

impl ResponsesStream {
    pub(super) fn new(meta: ResponseMeta, keep: Option<Keep>) -> ResponsesStream {
        ResponsesStream {
            meta,
            seq: 0,
            opened: false,
            keep,
        }
    }

    fn event(&mut self, kind: &str, mut body: Json_) -> Event {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default().event(kind).data(body.to_string())
    }

    fn open_message(&mut self) -> Vec<Event> {
        self.opened = true;
        let item = json!({"type": "message", "id": self.meta.message_id(), "status": "in_progress",
            "role": "assistant", "content": []});
        let id = self.meta.message_id();
        vec![
            self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ),
            self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": 0, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            ),
        ]
    }

    fn text_delta(&mut self, text: &str) -> Event {
        let id = self.meta.message_id();
        self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}),
        )
    }
}

impl OneStream for ResponsesStream {
    fn start(&mut self, _p: &Plan) -> Vec<Event> {
        let skeleton = self
            .meta
            .object("in_progress", vec![], Json_::Null, Json_::Null);
        vec![
            self.event("response.created", json!({"response": skeleton.clone()})),
            self.event("response.in_progress", json!({"response": skeleton})),
        ]
    }

    fn delta(&mut self, _p: &Plan, text: &str) -> Vec<Event> {
        let mut out = if self.opened {
            vec![]
        } else {
            self.open_message()
        };
        out.push(self.text_delta(text));
        out
    }

    fn finish(&mut self, p: &Plan, f: &Finished, version: u64) -> Vec<Event> {
        let mut out = Vec::new();
        let mut index = 0;
        if ResponseMeta::has_message(f) {
            if !self.opened {
                out.extend(self.open_message());
                if !f.content.is_empty() {
                    out.push(self.text_delta(&f.content));
                }
            }
            let id = self.meta.message_id();
            let part = self.meta.text_part(f);
            let item = self.meta.message_item(f);
            out.push(self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "text": f.content,
                    "logprobs": f.state.logprobs}),
            ));
            out.push(self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "part": part}),
            ));
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ));
            index = 1;
        }
        for (k, c) in f.tool_calls.iter().enumerate() {
            let at = index + k;
            let id = self.meta.call_id(k);
            let open = self.meta.call_item(k, c, "in_progress", "");
            let done = self
                .meta
                .call_item(k, c, "completed", &c.function.arguments);
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": at, "item": open}),
            ));
            out.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": at, "delta": c.function.arguments}),
            ));
            out.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": at, "name": c.function.name,
                    "arguments": c.function.arguments}),
            ));
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": at, "item": done}),
            ));
        }
        let status = status_of(f);
        let whole = response_json(&self.meta, p, f, version);
        let kind = if status == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        out.push(self.event(kind, json!({"response": whole})));
        if let Some(k) = self.keep.take() {
            k(f);
        }
        out
    }

    fn error(&mut self, e: &ApiError) -> Event {
        let body = json!({"code": e.code, "message": e.message, "param": e.param});
        self.event("error", body)
    }
}
