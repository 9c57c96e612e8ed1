//! Text-side helpers of a completion: stop strings and tool-call parsing.

use serde_json::Value as Json;

use super::types::{ToolCall, ToolCallFunction};

/// Finds stop strings in streamed text, holding back any tail that could still become one.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
    /// The stop string that ended the text.
    matched: Option<String>,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds text; returns what can be shown now (never part of a stop string).
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.text.push_str(piece);
        // The earliest complete stop string ends the text.
        // Held-back tails guarantee no stop string starts before `emitted`.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| Some((self.text[self.emitted..].find(s.as_str())?, s)))
            .min_by_key(|(p, _)| *p)
            .map(|(p, s)| (p + self.emitted, s.clone()));
        if let Some((pos, s)) = hit {
            self.stopped = true;
            self.matched = Some(s);
            let out = self.text[self.emitted..pos].to_string();
            self.text.truncate(pos);
            self.emitted = pos;
            return out;
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for l in (1..s.len()).rev() {
                if l <= self.text.len() - self.emitted
                    && self.text.is_char_boundary(self.text.len() - l)
                    && s.is_char_boundary(l)
                    && self.text.ends_with(&s[..l])
                {
                    hold = hold.max(l);
                    break;
                }
            }
        }
        let end = self.text.len() - hold;
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// The rest of the text once generation ended without a stop string.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    /// All text kept so far (stop string excluded).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }
}

/// Extracts `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks (the format of
/// Hermes, Qwen2, Qwen3 and most open tool-calling templates), and the XML form of
/// Qwen3.5's and Qwen3-Coder's templates (`<tool_call><function=NAME><parameter=P>VALUE
/// </parameter>..</function></tool_call>`, see `xml_call`). Returns the text outside the
/// blocks and the calls; `None` if there is no well-formed block. Reasoning (the text up
/// to the last `</think>`, kept in the content) is not searched: a model thinking about a
/// call may write the tag there.
pub fn parse_tool_calls(text: &str, id_seed: u64) -> Option<(String, Vec<ToolCall>)> {
    let (thought, text) = match text.rfind("</think>") {
        Some(i) => text.split_at(i + "</think>".len()),
        None => ("", text),
    };
    let mut rest = text;
    let mut content = thought.to_string();
    let mut calls = Vec::new();
    while let Some(start) = rest.find("<tool_call>") {
        content.push_str(&rest[..start]);
        let after = &rest[start + "<tool_call>".len()..];
        // The block ends at the first closing tag after which the body is JSON (a string
        // argument may itself hold "</tool_call>"), else at the first closing tag.
        let ends: Vec<usize> = after
            .match_indices("</tool_call>")
            .map(|(i, _)| i)
            .collect();
        // (The XML form's block ends at the first closing tag right after `</function>`.)
        let xml = after.trim_start().starts_with("<function=");
        let end = ends
            .iter()
            .copied()
            .find(|&e| match xml {
                true => after[..e].trim_end().ends_with("</function>"),
                false => serde_json::from_str::<serde::de::IgnoredAny>(after[..e].trim()).is_ok(),
            })
            .or(ends.first().copied());
        let (body, next) = match end {
            Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
            None => (after, ""),
        };
        let id = format!(
            "call_{:016x}",
            id_seed
                .wrapping_add(calls.len() as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        );
        if body.trim_start().starts_with("<function=") {
            let (name, arguments) = xml_call(body)?;
            calls.push(ToolCall {
                id,
                kind: "function",
                function: ToolCallFunction { name, arguments },
            });
            rest = next;
            continue;
        }
        // The arguments are kept as the model wrote them (so that rendering the call back
        // gives the same text), unless the model wrote them as a JSON string.
        #[derive(serde::Deserialize)]
        struct Call<'a> {
            name: String,
            #[serde(borrow, default)]
            arguments: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            parameters: Option<&'a serde_json::value::RawValue>,
        }
        let call: Call = serde_json::from_str(body.trim()).ok()?;
        let name = call.name;
        let arguments = match call.arguments.or(call.parameters) {
            Some(raw) => match serde_json::from_str::<Json>(raw.get()).ok()? {
                Json::String(s) => s,
                _ => raw.get().to_string(),
            },
            None => "{}".to_string(),
        };
        calls.push(ToolCall {
            id,
            kind: "function",
            function: ToolCallFunction { name, arguments },
        });
        rest = next;
    }
    if calls.is_empty() {
        return None;
    }
    content.push_str(rest);
    Some((content.trim().to_string(), calls))
}

/// One XML-form call's body, `<function=NAME>` then `<parameter=P>\nVALUE\n</parameter>`
/// for each argument and `</function>`: the name and the arguments as a JSON object in
/// the model's order. An object or array value (the template writes them with `tojson`)
/// is that JSON; a number, boolean or null is typed when its text is exactly how JSON
/// writes it (so rendering the call back gives the same text: `5` is 5, `0.10` stays the
/// string "0.10"); anything else is a string, without the newline the template puts on
/// each side. The tool's schema is not consulted: a string parameter whose value is `42`
/// comes back as the number 42. `None` if the body is not of that form.
fn xml_call(body: &str) -> Option<(String, String)> {
    let body = body.trim().strip_prefix("<function=")?;
    let (name, mut rest) = body.split_once('>')?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    let mut args = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after
                .trim()
                .is_empty()
                .then(|| (name.to_string(), Json::Object(args).to_string()));
        }
        let (param, after) = rest.strip_prefix("<parameter=")?.split_once('>')?;
        let end = after.find("</parameter>")?;
        let raw = &after[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = match serde_json::from_str::<Json>(raw) {
            Ok(v @ (Json::Object(_) | Json::Array(_))) => v,
            Ok(v) if !v.is_string() && serde_json::to_string(&v).is_ok_and(|t| t == raw) => v,
            _ => Json::String(raw.to_string()),
        };
        args.insert(param.trim().to_string(), value);
        rest = &after[end + "</parameter>".len()..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_mentioned_in_the_reasoning_is_not_a_call() {
        let text = "<think>\nI will write <tool_call> next.\n</think>\n\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, 1).unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "calc");
        assert_eq!(calls[0].function.arguments, "{\"x\": 1}");
        assert!(
            content.starts_with("<think>") && content.ends_with("</think>"),
            "{content}"
        );
        // Reasoning alone, with a mention and no call after it: no call.
        assert!(parse_tool_calls("<think>use <tool_call>?</think>The answer is 2.", 1).is_none());
    }

    #[test]
    fn qwen3_5_xml_calls_are_parsed_with_typed_arguments_in_order() {
        let text = "<think>\nuse the tools\n</think>\n\nLet me look.\n\n<tool_call>\n<function=search>\n<parameter=query>\nrust\nborrow checker\n</parameter>\n<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{\"lang\": \"en\"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, 1).unwrap();
        assert_eq!(content, "<think>\nuse the tools\n</think>\n\nLet me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "search");
        assert_eq!(
            calls[0].function.arguments,
            "{\"query\":\"rust\\nborrow checker\",\"limit\":5,\"filters\":{\"lang\":\"en\"}}"
        );
        assert_eq!(calls[1].function.name, "now");
        assert_eq!(calls[1].function.arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
        // A value that JSON would write otherwise stays text; a closing tag inside a
        // value does not end the block.
        let text = "<tool_call>\n<function=f>\n<parameter=x>\n0.10\n</parameter>\n<parameter=y>\nsay </tool_call>\n</parameter>\n</function>\n</tool_call>";
        let (_, calls) = parse_tool_calls(text, 1).unwrap();
        assert_eq!(
            calls[0].function.arguments,
            "{\"x\":\"0.10\",\"y\":\"say </tool_call>\"}"
        );
        // Not of the form: no call, the text stays content.
        assert!(parse_tool_calls(
            "<tool_call>\n<function=x>\n<parameter=a>\n1\n</function>\n</tool_call>",
            1
        )
        .is_none());
        assert!(parse_tool_calls("<tool_call><function=>\n</function></tool_call>", 1).is_none());
    }

    #[test]
    fn a_closing_tag_inside_a_string_argument_does_not_end_the_call() {
        let text = "<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"1</tool_call> 2\"}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, 1).unwrap();
        assert_eq!(content, "");
        assert_eq!(calls[0].function.name, "calc");
        assert_eq!(
            calls[0].function.arguments,
            "{\"expression\": \"1</tool_call> 2\"}"
        );
    }

    #[test]
    fn stop_string_split_across_pieces_is_cut_and_never_shown() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        let mut shown = String::new();
        for piece in ["Hello E", "N", "D world"] {
            shown.push_str(&m.push(piece));
        }
        assert!(m.stopped());
        assert_eq!(shown, "Hello ");
        assert_eq!(m.text(), "Hello ");
    }

    #[test]
    fn held_back_prefix_is_released_when_it_does_not_complete() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "###".into()]);
        let mut shown = m.push("a\n");
        shown.push_str(&m.push("b#"));
        shown.push_str(&m.push("#c"));
        shown.push_str(&m.flush());
        assert!(!m.stopped());
        assert_eq!(shown, "a\nb##c");
    }

    #[test]
    fn tool_calls_are_parsed_with_string_arguments() {
        let text = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*7\"}}\n</tool_call>";
        let (content, calls) = parse_tool_calls(text, 1).unwrap();
        assert_eq!(content, "Let me compute.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "calculator");
        assert_eq!(calls[0].function.arguments, "{\"expression\": \"12*7\"}");
        assert!(parse_tool_calls("no calls here", 1).is_none());
        assert!(parse_tool_calls("<tool_call>not json</tool_call>", 1).is_none());
    }
}
