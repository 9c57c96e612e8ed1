//! Constrained decoding: a request can require its output to follow a pattern, and the
//! sampler then only picks tokens whose bytes keep the output on the pattern. Patterns:
//! one JSON object (OpenAI's `response_format: {"type": "json_object"}`), a JSON value of a
//! JSON Schema (`response_format` `json_schema`, and a tool's `parameters`), and a tool call
//! in the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format for one of a
//! set of tools, its arguments following that tool's schema (`tool_choice` "required" or a
//! named function).
//!
//! A pattern is a list of segments: literal bytes, a switch among byte strings (enum
//! values, tool names) that jumps to a segment, a JSON value of a kind (any, object, array,
//! string, number, integer), and an end. A schema's object is written with its properties
//! in the declared order, each once, formatted like Python's `json.dumps`; what the schema
//! language says beyond that subset (`anyOf`, `$ref`, `items`, string lengths, ...) is
//! not enforced: such a value is checked as a JSON value of its type, or any JSON value.
//!
//! The JSON checker is a byte-level pushdown automaton whose whole state is a small `Copy`
//! value (nesting up to 128 levels as a bit stack), so trying a token is a copy and a few
//! byte steps. A step masks the vocabulary: each token's bytes (from the tokenizer, see
//! [`TokenBytes`]) are fed to a copy of the state. The output ends as soon as the pattern
//! is complete (finish reason "stop").
//!
//! Owns: what bytes may come next. Never touches a model or the tokenizer itself.

use serde_json::Value as Json;
use std::sync::Arc;

pub use crate::model::TokenBytes;

/// Why a constraint could not be built or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// A pattern a peer sent is not one this engine could have produced.
    #[error("{0}")]
    BadPattern(String),
    #[error("a forced tool call needs 1 to 64 tools, got {0}")]
    ToolCount(usize),
    /// The output left the pattern (`token`), or no token of the vocabulary continues it.
    #[error("{} continues {describe} (constrained decoding)", match token {
        Some(t) => format!("token {t} does not"),
        None => "no token of the vocabulary".to_string(),
    })]
    OffPattern {
        token: Option<u32>,
        describe: String,
    },
}

/// Consecutive whitespace bytes allowed between JSON tokens (stops a model from padding
/// forever with newlines, a known failure of JSON modes).
const MAX_WHITESPACE: u8 = 32;
/// Nesting depth of JSON objects and arrays.
const MAX_DEPTH: u8 = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Esc {
    No,
    Backslash,
    /// Hex digits still expected after `\u`.
    Hex(u8),
    /// `\uD` or `\ud` so far: the next digit must keep it out of the UTF-16 surrogates
    /// (`\uD800`..`\uDFFF`, which serde_json and most parsers refuse unpaired).
    HexD,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    EDigits,
}

impl Num {
    fn terminal(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::EDigits)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// A value is expected.
    Value,
    /// Just after `[`: a value or `]`.
    ArrayFirst,
    /// Just after `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value inside a container: `,` or the closer.
    After,
    Str {
        key: bool,
        esc: Esc,
        /// UTF-8 continuation bytes still expected.
        utf8: u8,
    },
    Num(Num),
    Lit {
        which: u8,
        pos: u8,
    },
    Done,
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// What a JSON value segment accepts at its top level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ValueKind {
    Any,
    Object,
    Array,
    String,
    Number,
    Integer,
}

/// Where a JSON value is in its bytes so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonState {
    scan: Scan,
    /// Bit i set: level i is an object (else an array).
    stack: u128,
    depth: u8,
    whitespace: u8,
    kind: ValueKind,
    /// Whitespace allowed before the value (JSON mode) or not (inside a schema pattern).
    lead_ws: bool,
    /// Characters a top-level string may have (`maxLength`), and has so far.
    max_chars: u32,
    chars: u32,
}

impl Default for JsonState {
    /// A JSON object, leading whitespace allowed (JSON mode).
    fn default() -> Self {
        JsonState::new(ValueKind::Object, true)
    }
}

impl JsonState {
    pub fn new(kind: ValueKind, lead_ws: bool) -> JsonState {
        JsonState {
            scan: Scan::Value,
            stack: 0,
            depth: 0,
            whitespace: 0,
            kind,
            lead_ws,
            max_chars: u32::MAX,
            chars: 0,
        }
    }

    /// A top-level number that could end here (the next byte may belong to what follows).
    fn number_may_end(&self) -> bool {
        self.depth == 0 && matches!(self.scan, Scan::Num(n) if n.terminal())
    }

    fn top_is_object(&self) -> bool {
        self.depth > 0 && (self.stack >> (self.depth - 1)) & 1 == 1
    }

    fn push(&mut self, object: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        if object {
            self.stack |= 1 << self.depth;
        } else {
            self.stack &= !(1 << self.depth);
        }
        self.depth += 1;
        self.scan = if object {
            Scan::ObjectFirst
        } else {
            Scan::ArrayFirst
        };
        true
    }

    fn close(&mut self) {
        self.depth -= 1;
        self.value_done();
    }

    fn value_done(&mut self) {
        self.scan = if self.depth == 0 {
            Scan::Done
        } else {
            Scan::After
        };
    }

    /// The value is complete (a top-level number never is: it could go on).
    pub fn is_complete(&self) -> bool {
        self.scan == Scan::Done
    }

    /// Feeds one byte; false if it cannot continue the value (the state is then
    /// unspecified).
    pub fn feed(&mut self, b: u8) -> bool {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        if ws && self.depth == 0 && self.scan == Scan::Value && !self.lead_ws {
            return false;
        }
        match self.scan {
            Scan::Value
            | Scan::ArrayFirst
            | Scan::ObjectFirst
            | Scan::Key
            | Scan::Colon
            | Scan::After
                if ws =>
            {
                self.whitespace += 1;
                return self.whitespace <= MAX_WHITESPACE;
            }
            _ => self.whitespace = 0,
        }
        match self.scan {
            Scan::Value | Scan::ArrayFirst => {
                if self.scan == Scan::ArrayFirst && b == b']' {
                    self.close();
                    return true;
                }
                if self.depth == 0 {
                    let ok = match self.kind {
                        ValueKind::Any => true,
                        ValueKind::Object => b == b'{',
                        ValueKind::Array => b == b'[',
                        ValueKind::String => b == b'"',
                        ValueKind::Number | ValueKind::Integer => b == b'-' || b.is_ascii_digit(),
                    };
                    if !ok {
                        return false;
                    }
                }
                self.start_value(b)
            }
            Scan::ObjectFirst | Scan::Key => match b {
                b'}' if self.scan == Scan::ObjectFirst => {
                    self.close();
                    true
                }
                b'"' => {
                    self.scan = Scan::Str {
                        key: true,
                        esc: Esc::No,
                        utf8: 0,
                    };
                    true
                }
                _ => false,
            },
            Scan::Colon => {
                if b == b':' {
                    self.scan = Scan::Value;
                    true
                } else {
                    false
                }
            }
            Scan::After => match b {
                b',' => {
                    self.scan = if self.top_is_object() {
                        Scan::Key
                    } else {
                        Scan::Value
                    };
                    true
                }
                b'}' if self.top_is_object() => {
                    self.close();
                    true
                }
                b']' if !self.top_is_object() => {
                    self.close();
                    true
                }
                _ => false,
            },
            Scan::Str { key, esc, utf8 } => self.string_byte(key, esc, utf8, b),
            Scan::Num(n) => {
                if self.depth == 0
                    && self.kind == ValueKind::Integer
                    && matches!(b, b'.' | b'e' | b'E')
                {
                    return false;
                }
                let next = match (n, b) {
                    (Num::Minus, b'0') => Some(Num::Zero),
                    (Num::Minus, b'1'..=b'9') => Some(Num::Int),
                    (Num::Int, b'0'..=b'9') => Some(Num::Int),
                    (Num::Zero | Num::Int, b'.') => Some(Num::Dot),
                    (Num::Dot | Num::Frac, b'0'..=b'9') => Some(Num::Frac),
                    (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Some(Num::E),
                    (Num::E, b'+' | b'-') => Some(Num::ESign),
                    (Num::E | Num::ESign | Num::EDigits, b'0'..=b'9') => Some(Num::EDigits),
                    _ => None,
                };
                match next {
                    Some(n) => {
                        self.scan = Scan::Num(n);
                        true
                    }
                    // The number ended: the byte belongs to what follows it.
                    None if n.terminal() => {
                        self.value_done();
                        self.feed(b)
                    }
                    None => false,
                }
            }
            Scan::Lit { which, pos } => {
                let lit = LITERALS[which as usize];
                if lit[pos as usize] != b {
                    return false;
                }
                if pos as usize + 1 == lit.len() {
                    self.value_done();
                } else {
                    self.scan = Scan::Lit {
                        which,
                        pos: pos + 1,
                    };
                }
                true
            }
            Scan::Done => false,
        }
    }

    fn start_value(&mut self, b: u8) -> bool {
        self.scan = match b {
            b'{' => return self.push(true),
            b'[' => return self.push(false),
            b'"' => Scan::Str {
                key: false,
                esc: Esc::No,
                utf8: 0,
            },
            b'-' => Scan::Num(Num::Minus),
            b'0' => Scan::Num(Num::Zero),
            b'1'..=b'9' => Scan::Num(Num::Int),
            b't' => Scan::Lit { which: 0, pos: 1 },
            b'f' => Scan::Lit { which: 1, pos: 1 },
            b'n' => Scan::Lit { which: 2, pos: 1 },
            _ => return false,
        };
        true
    }

    fn string_byte(&mut self, key: bool, esc: Esc, utf8: u8, b: u8) -> bool {
        let (esc, utf8) = match (esc, utf8) {
            (_, 1..) => {
                if !(0x80..=0xbf).contains(&b) {
                    return false;
                }
                (esc, utf8 - 1)
            }
            (Esc::Backslash, _) => match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => (Esc::No, 0),
                b'u' => (Esc::Hex(4), 0),
                _ => return false,
            },
            (Esc::Hex(4), _) if b == b'd' || b == b'D' => (Esc::HexD, 0),
            (Esc::Hex(n), _) => {
                if !b.is_ascii_hexdigit() {
                    return false;
                }
                (if n > 1 { Esc::Hex(n - 1) } else { Esc::No }, 0)
            }
            (Esc::HexD, _) => match b {
                b'0'..=b'7' => (Esc::Hex(2), 0),
                _ => return false,
            },
            (Esc::No, _)
                if b != b'"' && self.depth == 0 && {
                    self.chars += 1;
                    self.chars > self.max_chars
                } =>
            {
                return false
            }
            (Esc::No, _) => match b {
                b'"' => {
                    if key {
                        self.scan = Scan::Colon;
                    } else {
                        self.value_done();
                    }
                    return true;
                }
                b'\\' => (Esc::Backslash, 0),
                0..=0x1f => return false,
                0x20..=0x7f => (Esc::No, 0),
                0xc2..=0xdf => (Esc::No, 1),
                0xe0..=0xef => (Esc::No, 2),
                0xf0..=0xf4 => (Esc::No, 3),
                _ => return false,
            },
        };
        self.scan = Scan::Str { key, esc, utf8 };
        true
    }
}

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Segment {
    Literal(Vec<u8>),
    /// One of these byte strings (prefix-free), each then going on at its segment.
    Switch(Vec<(Vec<u8>, usize)>),
    /// A JSON value; a top-level string of at most this many characters.
    Value(ValueKind, u32),
    /// The pattern is complete.
    End,
}

/// Nesting of schema objects written out as literals; deeper values are checked as JSON of
/// their type only.
const MAX_SCHEMA_DEPTH: usize = 16;

/// Builds segment lists, merging adjacent literals.
#[derive(Default)]
struct Builder {
    segs: Vec<Segment>,
}

impl Builder {
    fn literal(&mut self, bytes: &[u8]) {
        if let Some(Segment::Literal(prev)) = self.segs.last_mut() {
            prev.extend_from_slice(bytes);
        } else if !bytes.is_empty() {
            self.segs.push(Segment::Literal(bytes.to_vec()));
        }
    }

    fn push(&mut self, s: Segment) {
        self.segs.push(s);
    }

    /// A switch among `alts` that continues right after it.
    fn one_of(&mut self, alts: Vec<Vec<u8>>) {
        let next = self.segs.len() + 1;
        self.segs.push(Segment::Switch(
            alts.into_iter().map(|a| (a, next)).collect(),
        ));
    }

    /// The segments of one value of `schema`.
    fn schema(&mut self, schema: &Json, depth: usize) {
        let kind_of = |t: &str| match t {
            "object" => Some(ValueKind::Object),
            "array" => Some(ValueKind::Array),
            "string" => Some(ValueKind::String),
            "number" => Some(ValueKind::Number),
            "integer" => Some(ValueKind::Integer),
            _ => None,
        };
        if let Some(c) = schema.get("const") {
            self.literal(c.to_string().as_bytes());
            return;
        }
        if let Some(Json::Array(values)) = schema.get("enum") {
            // Strings (quoted) are prefix-free; other values may not be.
            if !values.is_empty() && values.len() <= 64 && values.iter().all(|v| v.is_string()) {
                self.one_of(values.iter().map(|v| v.to_string().into_bytes()).collect());
                return;
            }
            self.push(Segment::Value(ValueKind::Any, u32::MAX));
            return;
        }
        let t = schema.get("type").and_then(|t| t.as_str());
        match t {
            Some("boolean") => self.one_of(vec![b"true".to_vec(), b"false".to_vec()]),
            Some("null") => self.literal(b"null"),
            Some("object") if depth < MAX_SCHEMA_DEPTH => {
                match schema.get("properties").and_then(|p| p.as_object()) {
                    Some(props) if !props.is_empty() => {
                        self.literal(b"{");
                        for (i, (key, sub)) in props.iter().enumerate() {
                            let key = Json::String(key.clone()).to_string();
                            let sep = if i == 0 { "" } else { ", " };
                            self.literal(format!("{sep}{key}: ").as_bytes());
                            self.schema(sub, depth + 1);
                        }
                        self.literal(b"}");
                    }
                    _ => self.push(Segment::Value(ValueKind::Object, u32::MAX)),
                }
            }
            Some(t) => {
                let max = schema
                    .get("maxLength")
                    .and_then(|m| m.as_u64())
                    .filter(|_| t == "string")
                    .map_or(u32::MAX, |m| m.min(u32::MAX as u64 - 1) as u32);
                self.push(Segment::Value(kind_of(t).unwrap_or(ValueKind::Any), max))
            }
            None => self.push(Segment::Value(ValueKind::Any, u32::MAX)),
        }
    }
}

/// What a request's output must be (see the module docs). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Constraint {
    segments: Arc<[Segment]>,
    vocab: Arc<TokenBytes>,
    /// Shown in errors and logs.
    pub describe: String,
}

/// Where an output is in its [`Constraint`]'s pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConstraintState {
    seg: usize,
    pos: usize,
    /// Of a `Switch`: which alternatives still match.
    alive: u64,
    json: JsonState,
}

/// A tool a call can be forced to: its name and its `parameters` schema.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Option<Json>,
}

/// A constraint's pattern without the vocabulary: what crosses the wire (the serving peer
/// pairs it with its own tokenizer's bytes). Built only by [`Constraint::pattern`]; one
/// received from a peer is checked by [`Constraint::from_pattern`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConstraintPattern {
    segments: Vec<Segment>,
    pub describe: String,
}

/// Segments a received pattern may have at most.
const MAX_PATTERN_SEGMENTS: usize = 4096;

impl Constraint {
    pub fn pattern(&self) -> ConstraintPattern {
        ConstraintPattern {
            segments: self.segments.to_vec(),
            describe: self.describe.clone(),
        }
    }

    /// A constraint from a pattern a peer sent, refused if it is not one that
    /// [`Constraint::pattern`] could have produced (so that running it cannot fail).
    pub fn from_pattern(
        p: ConstraintPattern,
        vocab: Arc<TokenBytes>,
    ) -> Result<Constraint, ConstraintError> {
        let bad = |m: String| Err(ConstraintError::BadPattern(m));
        let n = p.segments.len();
        if n == 0 || n > MAX_PATTERN_SEGMENTS {
            return bad(format!(
                "a constraint pattern needs 1 to {MAX_PATTERN_SEGMENTS} segments, got {n}"
            ));
        }
        for (i, s) in p.segments.iter().enumerate() {
            match s {
                Segment::Literal(l) if l.is_empty() => {
                    return bad(format!("constraint segment {i}: empty literal"))
                }
                Segment::Switch(alts) => {
                    if alts.is_empty() || alts.len() > 64 {
                        return bad(format!(
                            "constraint segment {i}: a switch needs 1 to 64 alternatives, got {}",
                            alts.len()
                        ));
                    }
                    for (a, next) in alts {
                        if a.is_empty() || *next > n || *next <= i {
                            return bad(format!(
                                "constraint segment {i}: an alternative is empty or goes to \
                                 segment {next} (must be after {i}, at most {n})"
                            ));
                        }
                    }
                    for (x, (a, _)) in alts.iter().enumerate() {
                        if alts
                            .iter()
                            .enumerate()
                            .any(|(y, (b, _))| x != y && b.starts_with(a))
                        {
                            return bad(format!(
                                "constraint segment {i}: alternatives are not prefix-free"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(Constraint {
            segments: p.segments.into(),
            vocab,
            describe: p.describe.chars().take(200).collect(),
        })
    }

    /// Exactly one JSON object (leading whitespace allowed).
    pub fn json_object(vocab: Arc<TokenBytes>) -> Constraint {
        Constraint {
            segments: vec![Segment::Value(ValueKind::Object, u32::MAX), Segment::End].into(),
            vocab,
            describe: "a JSON object".into(),
        }
    }

    /// One JSON value of `schema` (see the module docs for what is enforced).
    pub fn json_schema(schema: &Json, vocab: Arc<TokenBytes>) -> Constraint {
        let mut b = Builder::default();
        b.schema(schema, 0);
        b.push(Segment::End);
        Constraint {
            segments: b.segs.into(),
            vocab,
            describe: "a JSON value of the given schema".into(),
        }
    }

    /// One `<tool_call>\n{"name": "<tool>", "arguments": {...}}\n</tool_call>` block (the
    /// Hermes/Qwen format that `facade::text::parse_tool_calls` reads), the
    /// arguments following the chosen tool's `parameters` schema.
    pub fn tool_call(
        tools: &[ToolSpec],
        vocab: Arc<TokenBytes>,
    ) -> Result<Constraint, ConstraintError> {
        if tools.is_empty() || tools.len() > 64 {
            return Err(ConstraintError::ToolCount(tools.len()));
        }
        let mut b = Builder::default();
        b.literal(b"<tool_call>\n{\"name\": ");
        let switch_at = b.segs.len();
        b.push(Segment::Switch(Vec::new()));
        let mut alts = Vec::with_capacity(tools.len());
        for t in tools {
            // A quoted JSON string: prefix-free among names.
            alts.push((
                Json::String(t.name.clone()).to_string().into_bytes(),
                b.segs.len(),
            ));
            b.literal(b", \"arguments\": ");
            match &t.parameters {
                Some(p) if p.get("type").and_then(|t| t.as_str()) == Some("object") => {
                    b.schema(p, 0)
                }
                _ => b.push(Segment::Value(ValueKind::Object, u32::MAX)),
            }
            b.literal(b"}\n</tool_call>");
            b.push(Segment::End);
        }
        b.segs[switch_at] = Segment::Switch(alts);
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        Ok(Constraint {
            segments: b.segs.into(),
            vocab,
            describe: format!("a call of one of the tools {names:?}"),
        })
    }

    pub fn start(&self) -> ConstraintState {
        let mut st = ConstraintState {
            seg: 0,
            pos: 0,
            alive: 0,
            json: JsonState::default(),
        };
        self.enter(&mut st, 0);
        st
    }

    fn enter(&self, st: &mut ConstraintState, seg: usize) {
        st.seg = seg;
        st.pos = 0;
        match self.segments.get(seg) {
            Some(Segment::Switch(alts)) => st.alive = u64::MAX >> (64 - alts.len().clamp(1, 64)),
            // JSON mode alone allows whitespace before its object.
            Some(Segment::Value(kind, max)) => {
                st.json = JsonState::new(*kind, seg == 0);
                st.json.max_chars = *max;
            }
            _ => {}
        }
    }

    pub fn is_complete(&self, st: &ConstraintState) -> bool {
        matches!(self.segments.get(st.seg), Some(Segment::End) | None)
    }

    /// Feeds one output byte; false if it leaves the pattern.
    pub fn feed(&self, st: &mut ConstraintState, b: u8) -> bool {
        let Some(seg) = self.segments.get(st.seg) else {
            return false;
        };
        match seg {
            Segment::Literal(lit) => {
                if lit[st.pos] != b {
                    return false;
                }
                st.pos += 1;
                if st.pos == lit.len() {
                    self.enter(st, st.seg + 1);
                }
                true
            }
            Segment::Switch(alts) => {
                let mut alive = 0u64;
                let mut ended = None;
                for (i, (a, next)) in alts.iter().enumerate() {
                    if st.alive >> i & 1 == 1 && a.get(st.pos) == Some(&b) {
                        alive |= 1 << i;
                        if a.len() == st.pos + 1 {
                            ended = Some(*next);
                        }
                    }
                }
                if alive == 0 {
                    return false;
                }
                st.alive = alive;
                st.pos += 1;
                if let Some(next) = ended {
                    self.enter(st, next);
                }
                true
            }
            Segment::Value(..) => {
                let mut json = st.json;
                if json.feed(b) {
                    st.json = json;
                    if json.is_complete() {
                        self.enter(st, st.seg + 1);
                    }
                    return true;
                }
                // A number ends where something else begins.
                if st.json.number_may_end() {
                    self.enter(st, st.seg + 1);
                    return self.feed(st, b);
                }
                false
            }
            Segment::End => false,
        }
    }

    /// Whether token `id` can come next (stop tokens are never part of a pattern: the
    /// output ends when the pattern completes).
    pub fn allows(&self, st: &ConstraintState, id: u32) -> bool {
        let Some(Some(bytes)) = self.vocab.0.get(id as usize) else {
            return false;
        };
        if bytes.is_empty() {
            return false;
        }
        let mut s = *st;
        bytes.iter().all(|&b| self.feed(&mut s, b))
    }

    /// `allowed[i]` for every token of a vocabulary of `n`; returns how many are allowed.
    pub fn mask(&self, st: &ConstraintState, n: usize, allowed: &mut Vec<bool>) -> usize {
        allowed.clear();
        allowed.resize(n, false);
        // Most tokens fail on their first byte: try each first byte once.
        let mut first = [false; 256];
        for (b, ok) in first.iter_mut().enumerate() {
            let mut s = *st;
            *ok = self.feed(&mut s, b as u8);
        }
        let mut count = 0;
        for (id, slot) in allowed.iter_mut().enumerate() {
            let Some(Some(bytes)) = self.vocab.0.get(id) else {
                continue;
            };
            let Some(&b0) = bytes.first() else {
                continue;
            };
            if first[b0 as usize] && self.allows(st, id as u32) {
                *slot = true;
                count += 1;
            }
        }
        count
    }

    /// Advances past token `id`; an error if the token leaves the pattern.
    pub fn advance(&self, st: &mut ConstraintState, id: u32) -> Result<(), ConstraintError> {
        if !self.allows(st, id) {
            return Err(ConstraintError::OffPattern {
                token: Some(id),
                describe: self.describe.clone(),
            });
        }
        if let Some(Some(bytes)) = self.vocab.0.get(id as usize) {
            for &b in bytes.iter() {
                self.feed(st, b);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts_object(text: &str) -> bool {
        let mut s = JsonState::default();
        text.bytes().all(|b| s.feed(b)) && s.is_complete()
    }

    fn prefix_ok(text: &str) -> bool {
        let mut s = JsonState::default();
        text.bytes().all(|b| s.feed(b))
    }

    #[test]
    fn json_objects_are_accepted_and_everything_serde_rejects_is_not() {
        let good = [
            "{}",
            " {\"a\": 1}",
            "{\"a\": [1, -2.5e+3, 0, 0.25, true, false, null, \"x\\n\\u00e9\"], \"b\": {}}",
            "{\"é ü\": \"日本\", \"n\": {\"m\": [[], [{}]]}}",
            "{\n  \"k\": \"v\"\n}",
        ];
        for g in good {
            assert!(accepts_object(g), "{g}");
            assert!(serde_json::from_str::<serde_json::Value>(g)
                .unwrap()
                .is_object());
        }
        let bad = [
            "[1]",
            "1",
            "\"s\"",
            "{\"a\" 1}",
            "{\"a\": 01}",
            "{\"a\": 1,}",
            "{,}",
            "{\"a\": tru}",
            "{\"a\": \"\\x\"}",
            "{\"a\": \"\u{1}\"}",
            "{\"a\": 1]",
            "{\"a\": [1}",
            "{\"a\": -}",
            "{\"a\": 1.}",
            "{} {}",
        ];
        for b in bad {
            assert!(!accepts_object(b), "{b:?} accepted");
            assert!(
                serde_json::from_str::<serde_json::Value>(b).map_or(true, |v| !v.is_object()),
                "{b:?}"
            );
        }
        // Prefixes of valid objects stay open; the object is complete only at the end.
        let text = "{\"a\": [1, {\"b\": null}]}";
        for i in 1..text.len() {
            assert!(prefix_ok(&text[..i]));
            let mut s = JsonState::default();
            text[..i].bytes().for_each(|b| assert!(s.feed(b)));
            assert!(!s.is_complete(), "{}", &text[..i]);
        }
        // Whitespace runs are bounded; nesting is bounded.
        assert!(!prefix_ok(&format!("{{{}", " ".repeat(40))));
        assert!(!prefix_ok(&format!("{{\"a\":{}", "[".repeat(200))));
        // Invalid UTF-8 inside a string is refused.
        let mut s = JsonState::default();
        assert!(b"{\"a\": \"".iter().all(|&b| s.feed(b)));
        assert!(!s.clone().feed(0xff));
        assert!(!{
            let mut t = s;
            t.feed(0xc3) && t.feed(b'a')
        });
    }

    fn vocab(tokens: &[&str]) -> Arc<TokenBytes> {
        let mut v: Vec<Option<Box<[u8]>>> = tokens
            .iter()
            .map(|t| Some(t.as_bytes().to_vec().into_boxed_slice()))
            .collect();
        v.push(None); // a special token
        Arc::new(TokenBytes(v))
    }

    #[test]
    fn masks_allow_exactly_the_tokens_that_continue_the_pattern() {
        let toks = [
            "{",
            "}",
            "\"",
            "a",
            "\":",
            " 1",
            "{\"",
            "x",
            "\n",
            "1}",
            "<tool_call>\n{\"name\": \"",
            "get",
            "_weather\"",
            "\"",
            ", \"arguments\": ",
            "}\n</tool_call>",
            "get\"",
        ];
        let c = Constraint::json_object(vocab(&toks));
        let mut st = c.start();
        let mut allowed = Vec::new();
        let n = c.mask(&st, toks.len() + 1, &mut allowed);
        let names: Vec<&str> = (0..toks.len())
            .filter(|&i| allowed[i])
            .map(|i| toks[i])
            .collect();
        assert_eq!(names, vec!["{", "{\"", "\n"]);
        assert_eq!(n, 3);
        assert!(!allowed[toks.len()], "special tokens are never allowed");
        for id in [6u32, 3, 4, 9] {
            c.advance(&mut st, id).unwrap();
        }
        assert!(c.is_complete(&st));
        assert!(c.advance(&mut st, 1).is_err());

        let spec = |n: &str| ToolSpec {
            name: n.into(),
            parameters: None,
        };
        let tc = Constraint::tool_call(&[spec("get"), spec("get_weather")], vocab(&toks)).unwrap();
        let mut st = tc.start();
        for id in [10u32, 11] {
            tc.advance(&mut st, id).unwrap();
        }
        // After `get`: either the closing quote (name "get") or `_weather"`.
        tc.mask(&st, toks.len() + 1, &mut allowed);
        let names: Vec<&str> = (0..toks.len())
            .filter(|&i| allowed[i])
            .map(|i| toks[i])
            .collect();
        assert_eq!(names, vec!["\"", "_weather\"", "\""]);
        for id in [12u32, 14, 0, 1, 15] {
            tc.advance(&mut st, id).unwrap();
        }
        assert!(tc.is_complete(&st));
        assert!(Constraint::tool_call(&[], vocab(&toks)).is_err());
    }

    fn accepts(c: &Constraint, text: &str) -> bool {
        let mut st = c.start();
        text.bytes().all(|b| c.feed(&mut st, b)) && c.is_complete(&st)
    }

    #[test]
    fn schemas_fix_keys_order_and_value_types() {
        let schema = serde_json::json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
            "unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
            "extra": {"type": "object"}, "any": {}, "nothing": {"type": "null"},
            "inner": {"type": "object", "properties": {"k": {"const": 1}}}}});
        let c = Constraint::json_schema(&schema, vocab(&[]));
        let good = r#"{"city": "Paris", "days": 3, "temp": -2.5e1, "unit": "f", "ok": true, "tags": [1, "x"], "extra": {"a": null}, "any": 7, "nothing": null, "inner": {"k": 1}}"#;
        assert!(accepts(&c, good));
        let v: serde_json::Value = serde_json::from_str(good).unwrap();
        assert_eq!(v["inner"]["k"], 1);
        for bad in [
            good.replace("\"days\": 3", "\"days\": 3.5"),
            good.replace("\"unit\": \"f\"", "\"unit\": \"x\""),
            good.replace("\"ok\": true", "\"ok\": 1"),
            good.replace("\"city\": \"Paris\"", "\"city\": 5"),
            good.replace("\"city\": \"Paris\", ", ""),
            good.replace("\"tags\": [1, \"x\"]", "\"tags\": {}"),
            good.replace("{\"city", "{ \"city"),
        ] {
            assert!(!accepts(&c, &bad), "{bad}");
        }
        // maxLength counts characters (an escape or a multi-byte character is one).
        let short = serde_json::json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}});
        let c = Constraint::json_schema(&short, vocab(&[]));
        assert!(accepts(&c, r#"{"s": "abc"}"#));
        assert!(accepts(&c, r#"{"s": "é\nx"}"#));
        assert!(accepts(&c, r#"{"s": ""}"#));
        assert!(!accepts(&c, r#"{"s": "abcd"}"#));
        // Escapes: what serde_json parses. A UTF-16 surrogate escape is refused (unpaired,
        // serde_json refuses it; a model writes the character itself instead).
        let any = Constraint::json_object(vocab(&[]));
        for ok in [
            r#"{"s": "\u00e9\u0041\uD7FF\uE000"}"#,
            r#"{"s": "\n\t\"\/"}"#,
        ] {
            assert!(accepts(&any, ok), "{ok}");
            serde_json::from_str::<serde_json::Value>(ok).unwrap();
        }
        for bad in [
            r#"{"s": "\ud83d"}"#,
            r#"{"s": "\uDC00"}"#,
            r#"{"s": "\ud83d\ude00"}"#,
        ] {
            assert!(!accepts(&any, bad), "{bad}");
        }
        assert!(serde_json::from_str::<serde_json::Value>(r#"{"s": "\ud83d"}"#).is_err());
        // A tool call with a schema: the arguments follow the chosen tool's parameters.
        let tools = [
            ToolSpec {
                name: "get_weather".into(),
                parameters: Some(
                    serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
                ),
            },
            ToolSpec {
                name: "get_time".into(),
                parameters: None,
            },
        ];
        let t = Constraint::tool_call(&tools, vocab(&[])).unwrap();
        assert!(accepts(&t, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));
        assert!(!accepts(&t, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Oslo\"}}\n</tool_call>"));
        assert!(accepts(&t, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"town\": \"Oslo\"}}\n</tool_call>"));
        assert!(!accepts(
            &t,
            "<tool_call>\n{\"name\": \"get_date\", \"arguments\": {}}\n</tool_call>"
        ));
    }
}
