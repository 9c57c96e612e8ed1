//! Token-in-token-out tracking: an episode's next chat call extends the exact ids of the
//! previous one; a template that strips earlier reasoning breaks the timeline, the break is
//! detected and counted, and no training sequence spans it.

use crate::common;

use agentjet::facade::track::{Outcome, Tracker};
use agentjet::model::{ChatRequest, ModelCard, ModelSource};
use agentjet::timeline::layout::{pack, Layout};
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
                extra: None,
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
fn a_template_that_strips_reasoning_breaks_the_timeline_and_nothing_spans_it() {
    let (calls, tracker) = run(STRIP_THINK);
    assert_eq!(calls[0].1, Outcome::First);
    // The second prompt renders the first answer without its reasoning: a break.
    assert!(
        matches!(&calls[1].1, Outcome::Break(why) if why.contains("renders")),
        "{:?}",
        calls[1].1
    );
    assert!(matches!(calls[2].1, Outcome::Break(_)));
    let mut first = calls[0].0.clone();
    first.extend_from_slice(&calls[0].2);
    assert!(!calls[1].0.starts_with(&first));
    let counts = tracker.counts();
    assert_eq!((counts[0].1.first, counts[0].1.breaks), (1, 2));
    // Three branches, and each training sequence is exactly one call's prompt + completion
    // (none spans a break).
    let ep = episode(&tracker);
    let t = ep.timeline("tiny").unwrap();
    assert_eq!((t.branches.len(), t.breaks), (3, 2));
    let rows = pack("tiny", &[(&ep, 1.0)], Layout::Linear, 1 << 20).unwrap();
    let row = &rows[0];
    let roots = row.parent.iter().filter(|&&p| p < 0).count();
    assert_eq!(roots, 3);
    for (k, (prompt, _, completion)) in calls.iter().enumerate() {
        let mut want = prompt.clone();
        want.extend_from_slice(completion);
        assert_eq!(t.branches[k].tokens(), want, "branch {k}");
    }
}

#[test]
fn an_edited_answer_or_changed_history_is_a_break() {
    let dir = tempfile::tempdir().unwrap();
    let card = card(dir.path(), CHATML);
    let conv = Conversation {
        card: &card,
        tracker: Tracker::new(8),
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
