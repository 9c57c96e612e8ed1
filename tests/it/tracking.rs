//! Token-in-token-out tracking: an episode's next chat call extends the exact ids of the
//! previous one; a template that strips earlier reasoning (a toy one, Qwen3's and
//! Qwen3.5's own) is continued from the ids as sampled, reasoning included, and every
//! later call of a thinking agent counts as continued; an edited answer or changed history
//! is a break, counted, and no training sequence spans it.

use crate::common;

use agentjet::facade::track::{Outcome, Tracker};
use agentjet::model::{ChatRequest, ModelCard, ModelSource};
use agentjet::timeline::{Episode, EpisodeStatus};
use common::*;
use serde_json::{json, Value as Json};

/// Strips `<think>...</think>` from every assistant turn but the last, as reasoning
/// models' templates (DeepSeek-R1, Qwen3) do.
const STRIP_THINK: &str = "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn card(dir: &std::path::Path, template: &str) -> ModelCard {
    Tiny::default().write_hf_dir(dir);
    let cfg_path = dir.join("tokenizer_config.json");
    let mut cfg: Json = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = json!(template);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    ModelCard::load(&ModelSource::HfDir(dir.to_path_buf())).unwrap()
}

struct Conversation<'a> {
    card: &'a ModelCard,
    tracker: Tracker,
    /// The requests' `chat_template_kwargs`.
    kwargs: Option<serde_json::Map<String, Json>>,
}

impl Conversation<'_> {
    /// One call: returns the prompt ids, the outcome, and the "sampled" completion ids of
    /// `answer` (followed by the end-of-turn token, as the engine includes it).
    fn call(&self, messages: &[Json], answer: &str) -> Made {
        let tmpl = self.card.chat_template("tiny").unwrap();
        let render = |m: &[Json], g: bool| {
            tmpl.render(&ChatRequest {
                messages: m,
                tools: None,
                add_generation_prompt: g,
                extra: self.kwargs.as_ref(),
            })
        };
        let (ids, outcome, text) = self
            .tracker
            .prompt("ep-1", "tiny", self.card, messages, &render)
            .unwrap();
        let completion = self
            .card
            .tokenizer
            .encode(&format!("{answer}<|im_end|>"))
            .unwrap();
        let lps = vec![-0.25; completion.len()];
        self.tracker.record(
            "ep-1",
            "tiny",
            messages,
            text,
            &ids,
            vec![agentjet::facade::track::ChoiceRecord {
                tokens: completion.clone(),
                logprobs: lps,
                signed: Vec::new(),
            }],
            7,
            agentjet::timeline::SamplingTransform::RAW,
        );
        (ids, outcome, completion)
    }
}

fn turn(role: &str, content: &str) -> Json {
    json!({"role": role, "content": content})
}

/// (prompt ids, outcome, completion ids) of one call.
type Made = (Vec<u32>, Outcome, Vec<u32>);

fn run(template: &str) -> (Vec<Made>, Tracker) {
    let dir = tempfile::tempdir().unwrap();
    let card = card(dir.path(), template);
    let conv = Conversation {
        card: &card,
        tracker: Tracker::new(8),
        kwargs: None,
    };
    let a1 = "<think>two and two</think>It is 4.";
    let a2 = "<think>three and three</think>It is 6.";
    let m1 = vec![turn("user", "What is 2+2?")];
    let mut m2 = m1.clone();
    m2.extend([turn("assistant", a1), turn("user", "And 3+3?")]);
    let mut m3 = m2.clone();
    m3.extend([turn("assistant", a2), turn("user", "Thanks!")]);
    let out = vec![
        conv.call(&m1, a1),
        conv.call(&m2, a2),
        conv.call(&m3, "You are welcome."),
    ];
    (out, conv.tracker)
}

fn episode(tracker: &Tracker) -> Episode {
    Episode {
        id: "ep-1".into(),
        task_id: "t".into(),
        group_id: "g".into(),
        calls: tracker.take("ep-1").unwrap(),
        reward: Some(1.0),
        rewards: Default::default(),
        status: EpisodeStatus::Finished,
    }
}

#[test]
fn calls_that_keep_history_extend_the_exact_ids() {
    let (calls, tracker) = run(CHATML);
    assert_eq!(calls[0].1, Outcome::First);
    for k in 1..3 {
        assert_eq!(calls[k].1, Outcome::Continued, "call {k}");
        let (prev_prompt, _, prev_completion) = &calls[k - 1];
        let mut prefix = prev_prompt.clone();
        prefix.extend_from_slice(prev_completion);
        assert!(
            calls[k].0.starts_with(&prefix),
            "call {k} keeps the sampled ids"
        );
    }
    let counts = tracker.counts();
    assert_eq!(counts[0].1.continued, 2);
    assert_eq!(counts[0].1.breaks, 0);
    let t = episode(&tracker).timeline("tiny").unwrap();
    assert_eq!((t.branches.len(), t.breaks), (1, 0));
}

#[test]
fn a_template_that_strips_reasoning_continues_from_the_sampled_ids() {
    let (calls, tracker) = run(STRIP_THINK);
    assert_eq!(calls[0].1, Outcome::First);
    // The second prompt's template drops the first answer's reasoning; the prompt keeps
    // the ids the model sampled, reasoning included.
    for k in 1..3 {
        assert_eq!(calls[k].1, Outcome::Continued, "call {k}");
        let mut prefix = calls[k - 1].0.clone();
        prefix.extend_from_slice(&calls[k - 1].2);
        assert!(
            calls[k].0.starts_with(&prefix),
            "call {k} keeps the sampled ids"
        );
    }
    let counts = tracker.counts();
    assert_eq!(
        (counts[0].1.first, counts[0].1.continued, counts[0].1.breaks),
        (1, 2, 0)
    );
    // One timeline: the last call's sequence holds every earlier call's reasoning.
    let ep = episode(&tracker);
    let t = ep.timeline("tiny").unwrap();
    assert_eq!((t.branches.len(), t.breaks), (1, 0));
}

/// A thinking agent's turns (`<think>` reasoning, then the answer; one turn a tool call
/// and its result) as the OpenAI API gives them back: the content with its reasoning.
fn thinking_turns(opened_by_template: bool) -> Vec<(Vec<Json>, String)> {
    // Qwen3.5's generation prompt opens `<think>` itself: the sampled text starts inside.
    let open = if opened_by_template { "" } else { "<think>\n" };
    let a1 = format!("{open}two and two\n</think>\n\nIt is 4.");
    let a2 = format!("{open}I should check with the calculator.\n</think>\n\n");
    let a3 = format!("{open}the tool says 6\n</think>\n\nIt is 6.");
    let call = json!({"id": "c1", "type": "function",
        "function": {"name": "calc", "arguments": "{\"expr\": \"3+3\"}"}});
    let m1 = vec![turn("user", "What is 2+2?")];
    let mut m2 = m1.clone();
    m2.extend([
        json!({"role": "assistant", "content": a1}),
        turn("user", "And 3+3?"),
    ]);
    let mut m3 = m2.clone();
    m3.extend([
        json!({"role": "assistant", "content": a2, "tool_calls": [call]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "6"}),
    ]);
    let mut m4 = m3.clone();
    m4.extend([
        json!({"role": "assistant", "content": a3}),
        turn("user", "Thanks!"),
    ]);
    // Qwen3's templates write a call as JSON, Qwen3.5's in its XML form.
    let sampled_call = if opened_by_template {
        format!("{a2}<tool_call>\n<function=calc>\n<parameter=expr>\n3+3\n</parameter>\n</function>\n</tool_call>")
    } else {
        format!(
            "{a2}<tool_call>\n{{\"name\": \"calc\", \"arguments\": {{\"expr\": \"3+3\"}}}}\n</tool_call>"
        )
    };
    vec![
        (m1, a1),
        (m2, sampled_call),
        (m3, a3),
        (m4, format!("{open}polite\n</think>\n\nYou are welcome.")),
    ]
}

/// A multi-turn thinking-mode agent (reasoning on through `chat_template_kwargs`, a tool
/// call among its turns) on the real Qwen3 and Qwen3.5 chat templates: every later call
/// is continued from the exact sampled ids (100%), the episode is one timeline, and its
/// training sequence holds every turn's reasoning, which the templates alone would drop.
#[test]
fn a_thinking_agent_on_qwen3_and_qwen3_5_templates_keeps_every_call_continued() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (name, opened) in [
        ("qwen3_chat_template.jinja", false),
        ("qwen3_5_chat_template.jinja", true),
    ] {
        let template = std::fs::read_to_string(root.join(name)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let card = card(dir.path(), &template);
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), json!(true));
        let conv = Conversation {
            card: &card,
            tracker: Tracker::new(8),
            kwargs: Some(kwargs),
        };
        let turns = thinking_turns(opened);
        let calls: Vec<Made> = turns.iter().map(|(m, a)| conv.call(m, a)).collect();
        assert_eq!(calls[0].1, Outcome::First, "{name}");
        for k in 1..calls.len() {
            assert_eq!(calls[k].1, Outcome::Continued, "{name}: call {k}");
            let mut prefix = calls[k - 1].0.clone();
            prefix.extend_from_slice(&calls[k - 1].2);
            assert!(
                calls[k].0.starts_with(&prefix),
                "{name}: call {k} keeps the sampled ids"
            );
        }
        let counts = conv.tracker.counts();
        assert_eq!(
            (counts[0].1.first, counts[0].1.continued, counts[0].1.breaks),
            (1, 3, 0),
            "{name}"
        );
        // The template itself drops the first turn's reasoning by the last call; the
        // trained context keeps it.
        let tmpl = card.chat_template("tiny").unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), json!(true));
        let rendered = tmpl
            .render(&ChatRequest {
                messages: &turns[3].0,
                tools: None,
                add_generation_prompt: true,
                extra: Some(&kw),
            })
            .unwrap();
        assert!(!rendered.contains("two and two"), "{name}: {rendered}");
        let trained = card.tokenizer.decode(&calls[3].0, false).unwrap();
        assert!(trained.contains("two and two"), "{name}: {trained}");
        let t = episode(&conv.tracker).timeline("tiny").unwrap();
        assert_eq!((t.branches.len(), t.breaks), (1, 0), "{name}");
    }
}

#[test]
fn an_edited_answer_or_changed_history_is_a_break() {
    let dir = tempfile::tempdir().unwrap();
    let card = card(dir.path(), CHATML);
    let conv = Conversation {
        card: &card,
        tracker: Tracker::new(8),
        kwargs: None,
    };
    let m1 = vec![turn("user", "Hi")];
    conv.call(&m1, "Hello there.");
    let mut m2 = m1.clone();
    m2.extend([turn("assistant", "Hello!"), turn("user", "How are you?")]);
    let (_, o, _) = conv.call(&m2, "Fine.");
    assert!(
        matches!(&o, Outcome::Break(why) if why.contains("sampled")),
        "{o:?}"
    );
    let mut m3 = vec![turn("user", "Hey")];
    m3.extend([turn("assistant", "Fine."), turn("user", "Ok")]);
    let (_, o, _) = conv.call(&m3, "Ok.");
    assert!(
        matches!(&o, Outcome::Break(why) if why.contains("earlier messages")),
        "{o:?}"
    );
}
