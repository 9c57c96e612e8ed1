//! Chat templates: a model's own Jinja template rendered with minijinja the way HF
//! `apply_chat_template` renders it (jinja2 with `trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string methods, `raise_exception`, `strftime_now`, and HF's `tojson`
//! that writes `json.dumps` output with `ensure_ascii=False`).
//!
//! Owns: turning a conversation (OpenAI-shaped JSON messages, optional tools) into prompt
//! text. Never tokenizes and never touches LibTorch.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template of {source_name}: cannot compile: {problem}")]
    Compile {
        source_name: String,
        problem: String,
    },
    #[error("chat template: {0}")]
    Render(String),
    #[error("{source_name}: has no chat template")]
    Missing { source_name: String },
}

/// A compiled chat template and the special-token strings it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template source, as shipped with the model.
    pub source: String,
    /// A second template for requests with tools, where the model ships one.
    pub tool_use_source: Option<String>,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("len", &self.source.len())
            .finish()
    }
}

/// What to render.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest<'a> {
    /// OpenAI-shaped messages: `{"role": .., "content": .., ...}`.
    pub messages: &'a [Json],
    /// OpenAI-shaped tool definitions, if any.
    pub tools: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    /// Extra template variables (HF passes `**kwargs` through, e.g. `enable_thinking`).
    pub extra: Option<&'a serde_json::Map<String, Json>>,
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps` layout (", " and ": " separators, `indent` with "," and ": ").
fn py_json(v: &Json, indent: Option<usize>, level: usize, sort_keys: bool, out: &mut String) {
    let nl = |out: &mut String, lvl: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * lvl));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, it) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                nl(out, level + 1);
                py_json(it, indent, level + 1, sort_keys, out);
            }
            nl(out, level);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, it)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                nl(out, level + 1);
                out.push_str(&serde_json::to_string(k).expect("string"));
                out.push_str(": ");
                py_json(it, indent, level + 1, sort_keys, out);
            }
            nl(out, level);
            out.push('}');
        }
        Json::Number(n) if n.is_f64() => {
            let f = n.as_f64().expect("f64");
            if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&serde_json::to_string(other).expect("json")),
    }
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    py_json(&json, indent, 0, sort_keys.unwrap_or(false), &mut out);
    Ok(Value::from_safe_string(out))
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's civil_from_days.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// `strftime_now(fmt)` as HF provides it (UTC; %Y %m %d %b %B %H %M %S %p %I %j %A %a %%).
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (rem / 3600, (rem / 60) % 60, rem % 60);
    let yday = days - {
        // days from epoch to Jan 1 of year y
        let mut lo = days - 366;
        while civil_from_days(lo).0 < y {
            lo += 1;
        }
        lo
    } + 1;
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    /// Compiles `source` (and a tool-use variant, if the model ships one).
    /// `special_tokens` are the (name, text) pairs HF passes in, e.g. `("bos_token", "<s>")`.
    pub fn new(
        source: String,
        tool_use_source: Option<String>,
        special_tokens: Vec<(String, String)>,
        source_name: &str,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let compile = |e: Error| TemplateError::Compile {
            source_name: source_name.to_string(),
            problem: format!("{e:#}"),
        };
        env.add_template_owned("default", source.clone())
            .map_err(compile)?;
        if let Some(t) = &tool_use_source {
            env.add_template_owned("tool_use", t.clone())
                .map_err(compile)?;
        }
        Ok(ChatTemplate {
            env,
            source,
            tool_use_source,
            special_tokens,
        })
    }

    /// Renders a conversation to prompt text.
    pub fn render(&self, req: &ChatRequest<'_>) -> Result<String, TemplateError> {
        let name = if req.tools.is_some() && self.tool_use_source.is_some() {
            "tool_use"
        } else {
            "default"
        };
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        let mut ctx: std::collections::BTreeMap<String, Value> = Default::default();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.clone()));
        }
        if let Some(extra) = req.extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), Value::from_serialize(v));
            }
        }
        ctx.insert("messages".into(), Value::from_serialize(req.messages));
        ctx.insert(
            "tools".into(),
            match req.tools {
                Some(t) => Value::from_serialize(t),
                None => Value::from(()),
            },
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(req.add_generation_prompt),
        );
        tmpl.render(ctx)
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }

    /// Reads `chat_template` from an HF `tokenizer_config.json` value (a string, or a list
    /// of `{name, template}`), returning (default, tool_use).
    pub fn sources_from_hf_config(config: &Json) -> Option<(String, Option<String>)> {
        match config.get("chat_template")? {
            Json::String(s) => Some((s.clone(), None)),
            Json::Array(list) => {
                let find = |n: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(|x| x.as_str()) == Some(n))
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                        .map(str::to_string)
                };
                let default = find("default").or_else(|| {
                    list.first()
                        .and_then(|t| t.get("template"))
                        .and_then(|t| t.as_str())
                        .map(str::to_string)
                })?;
                Some((default, find("tool_use")))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v = json!({"a": 1, "b": [1.0, "x\"y"], "c": {}, "d": "é"});
        let mut out = String::new();
        py_json(&v, None, 0, false, &mut out);
        assert_eq!(out, r#"{"a": 1, "b": [1.0, "x\"y"], "c": {}, "d": "é"}"#);
        let mut out = String::new();
        py_json(&json!({"a": [1, 2]}), Some(2), 0, false, &mut out);
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn strftime_known_date() {
        // 2024-07-23 13:05:09 UTC, a Tuesday, day 205 of a leap year
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %A %j", 1_721_739_909),
            "23 Jul 2024 13:05:09 Tuesday 205"
        );
    }

    #[test]
    fn raise_exception_surfaces_message() {
        let t = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}".into(),
            None,
            vec![],
            "t",
        )
        .unwrap();
        let e = t
            .render(&ChatRequest {
                messages: &[],
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn python_methods_and_loop_controls() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{{ m.content.strip().upper() }}|{% endfor %}".into(),
            None,
            vec![],
            "t",
        )
        .unwrap();
        let msgs = vec![
            json!({"role": "user", "content": "  hi "}),
            json!({"role": "skip", "content": "no"}),
            json!({"role": "user", "content": "yo"}),
        ];
        let out = t
            .render(&ChatRequest {
                messages: &msgs,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(out, "HI|YO|");
    }
}
