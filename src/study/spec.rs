//! The study file (TOML): the base configuration every arm shares, the arms (a list or a
//! search space), the budget, the policy that decides, and what the driver watches for.
//! Every mistake is refused before anything runs, with the field named
//! (`budget.steps: ...`, `space.lr: ...`).
//!
//! ```toml
//! name = "addition"
//! seed = 7
//! policy = "asha"            # grid | asha | pbt | researcher
//! metric = "reward_mean"     # a field of the arm's metrics.jsonl
//! goal = "max"               # or "min"
//! window = 3                 # an arm's score: the metric's mean over its last 3 steps
//!
//! [base]
//! model = "smollm2"          # the servers' --model
//! server = ["--groups-per-step", "4", "--checkpoint-every", "2"]
//! client = ["--agent", "python3 examples/math_agent/plain_agent.py",
//!           "--tasks", "examples/math_agent/tasks.jsonl", "--num-repeat", "8"]
//! env = { AGENT_MAX_TOKENS = "32" }   # the agent's environment
//!
//! [budget]
//! steps = 12                 # training steps per arm, at most
//! at_once = 1                # arms running at once
//! minutes = 30               # wall clock for the whole study
//!
//! [space.lr]
//! server = "--learning-rate" # or client = "--flag", or env = "VAR"
//! values = [5e-6, 2e-5]      # or min = 1e-6, max = 1e-4, log = true (with asha.samples)
//!
//! [asha]
//! min_steps = 3              # the first rung; each next one eta times more steps
//! eta = 2                    # the best 1/eta of a rung go on
//!
//! # policy = "pbt": every `interval` steps the worst `quantile` of the population take a
//! # better arm's checkpoint and its settings, `explore`d (perturbed or resampled).
//! # [pbt]
//! # interval = 4
//! # quantile = 0.25
//! # explore = ["lr"]         # parameters that change (not --lora-*: the checkpoint fixes them)
//! # perturb = 0.2            # a number times 1 - 0.2 or 1 + 0.2 (a list: a neighbour)
//! # resample = 0.25          # or, with this chance, drawn again from the space
//! # samples = 8              # arms drawn from the space (default: its grid)
//!
//! # policy = "researcher": an LLM behind an OpenAI-compatible endpoint runs the study
//! # through tools (list, read, start, continue and stop runs, notes, finish).
//! # [researcher]
//! # endpoint = "http://127.0.0.1:8080/v1"   # e.g. a client's proxy of the swarm
//! # model = "smollm2"
//! # max_actions = 20         # tool calls in all
//! # max_arms = 8             # runs in all (at most 63)
//! # steps = [3, 6, 12]       # the step counts it may ask a run for
//! # temperature = 0.0        # the model's sampling
//! # max_tokens = 400         # per call (at least 320)
//! # calls_per_turn = 4       # a turn ends at the first call that changes the study
//! # timeout_seconds = 120    # per call
//!
//! # Arms on other machines: study workers of a swarm (`agentjet-peer study worker`,
//! # started with --allow-driver <this driver's peer id>: `agentjet-peer id --data-dir
//! # <the study's directory>`). Not part of the study's hash: add or drop it any time.
//! # [workers]
//! # swarm_key = "study.key"  # the workers' swarm key (relative to this file)
//! # bootstrap = ["/ip4/10.0.0.5/udp/4100/quic-v1"]
//! # local = 0                # arms at once on the driver's machine (default budget.at_once)
//! # listen = "/ip4/0.0.0.0/udp/0/quic-v1"   # the driver's own address
//! # wait_seconds = 30        # looking for workers before arms go to the driver's machine
//! # allow = ["12D3KooW..."]  # the workers it may use (default: any holder of the key)
//!
//! [watch]
//! flat_steps = 0             # stop an arm whose reward stayed the same this many steps
//! min_entropy = 0.0          # stop an arm whose entropy fell below this
//! stall_seconds = 600        # restart an arm that took no step for this long
//! restarts = 2               # restarts of a crashed or stalled arm per rung before it fails
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use super::error::StudyError;

/// How the study decides which arms go on.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyKind {
    /// Every arm runs the whole budget of steps.
    Grid,
    /// Successive halving: every arm runs to the first rung, the best 1/eta of a rung go
    /// on to the next (eta times more steps), up to the budget's steps. A rung is decided
    /// once every arm of it got there (or failed), so the decisions depend on the arms'
    /// figures alone, not on which finished first.
    Halving { min_steps: u64, eta: u64 },
    /// Population-based training (Jaderberg et al. 2017), in synchronous generations:
    /// every `interval` steps, once the whole population got there, the worst
    /// `quantile` stop and as many new arms start from the best arms' checkpoints with
    /// their settings explored.
    Pbt(Pbt),
    /// An LLM decides, through tools (see `study::researcher`).
    Researcher(Researcher),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pbt {
    pub interval: u64,
    pub quantile: f64,
    /// The parameters a new arm explores (the others are its parent's).
    pub explore: Vec<String>,
    pub perturb: f64,
    pub resample: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Researcher {
    /// The endpoint's base URL (`http://host:port/v1`).
    pub endpoint: String,
    pub model: String,
    pub max_actions: u32,
    pub max_arms: usize,
    /// The step counts a run may be asked for, ascending; the study's explicit arms
    /// start with the first.
    pub steps: Vec<u64>,
    pub temperature: f64,
    pub max_tokens: u32,
    /// Calls of one turn (a turn ends at the first action that changes the study).
    pub calls_per_turn: u32,
    pub timeout_seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    Max,
    Min,
}

/// Where an arm's value of a parameter goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// A flag of the arm's servers (`--learning-rate 2e-5`).
    Server(String),
    /// A flag of the arm's client.
    Client(String),
    /// A variable of the agent's environment (the client passes its own on).
    Env(String),
}

/// A sampled parameter's range.
#[derive(Debug, Clone, PartialEq)]
pub struct Range {
    pub min: f64,
    pub max: f64,
    pub log: bool,
    pub integer: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub target: Target,
    pub values: Option<Vec<Value>>,
    pub range: Option<Range>,
}

/// What every arm shares.
#[derive(Debug, Clone, PartialEq)]
pub struct Base {
    pub model: String,
    pub server: Vec<String>,
    pub client: Vec<String>,
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub steps: u64,
    pub at_once: usize,
    pub minutes: Option<f64>,
}

/// The study workers of a swarm that run arms (see `study::remote`).
#[derive(Debug, Clone, PartialEq)]
pub struct Workers {
    pub swarm_key: PathBuf,
    pub bootstrap: Vec<String>,
    /// The driver's own listen address.
    pub listen: String,
    /// Arms at once on the driver's own machine (the budget's `at_once` bounds all).
    pub local: usize,
    /// How long the driver looks for workers before it puts an arm on its own machine.
    pub wait_seconds: f64,
    /// The workers it may use (peer ids); empty: any worker of the swarm (any holder
    /// of its key).
    pub allow: Vec<crate::swarm::PeerId>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Watch {
    pub nonfinite: bool,
    pub flat_steps: usize,
    pub min_entropy: f64,
    pub stall_seconds: f64,
    pub restarts: u32,
}

/// An arm the study file names itself: its name and a value of every parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ArmSpec {
    pub name: Option<String>,
    pub values: BTreeMap<String, Value>,
}

/// A checked study file.
#[derive(Debug, Clone, PartialEq)]
pub struct Study {
    pub file: PathBuf,
    pub name: String,
    pub seed: u64,
    pub policy: PolicyKind,
    pub metric: String,
    pub goal: Goal,
    pub window: usize,
    pub base: Base,
    pub budget: Budget,
    /// By name.
    pub space: Vec<Param>,
    pub arms: Vec<ArmSpec>,
    /// Arms drawn from the space (instead of its grid).
    pub samples: Option<usize>,
    pub watch: Watch,
    /// Study workers to run arms on (none: every arm runs on the driver's machine).
    pub workers: Option<Workers>,
    /// blake3 of the study as parsed (comments and layout do not count): a journal
    /// belongs to one study.
    pub hash: String,
}

/// The metrics an arm can be scored by (fields of a step's line in `metrics.jsonl`).
pub const METRICS: &[&str] = &[
    "reward_mean",
    "accuracy",
    "loss",
    "entropy",
    "kl",
    "clip_frac",
    "grad_norm",
    "tokens_per_s",
];

/// Flags the driver sets on every arm's processes itself.
const DRIVER_FLAGS: &[&str] = &[
    "--role",
    "--model",
    "--data-dir",
    "--events",
    "--swarm-key",
    "--bootstrap",
    "--run-dir",
];

/// The most arms a study may have.
pub const MAX_ARMS: usize = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    name: String,
    #[serde(default)]
    seed: u64,
    policy: String,
    #[serde(default = "default_metric")]
    metric: String,
    #[serde(default)]
    goal: Option<String>,
    #[serde(default = "default_window")]
    window: usize,
    base: RawBase,
    budget: RawBudget,
    #[serde(default)]
    space: BTreeMap<String, RawParam>,
    #[serde(default)]
    arms: Vec<BTreeMap<String, Value>>,
    #[serde(default)]
    asha: Option<RawAsha>,
    #[serde(default)]
    pbt: Option<RawPbt>,
    #[serde(default)]
    researcher: Option<RawResearcher>,
    #[serde(default)]
    watch: RawWatch,
    #[serde(default)]
    workers: Option<RawWorkers>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkers {
    swarm_key: PathBuf,
    bootstrap: Vec<String>,
    #[serde(default)]
    local: Option<usize>,
    #[serde(default = "listen_any")]
    listen: String,
    #[serde(default = "thirty")]
    wait_seconds: f64,
    #[serde(default)]
    allow: Vec<String>,
}

fn listen_any() -> String {
    "/ip4/0.0.0.0/udp/0/quic-v1".into()
}

fn thirty() -> f64 {
    30.0
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPbt {
    interval: u64,
    #[serde(default = "quarter")]
    quantile: f64,
    explore: Vec<String>,
    #[serde(default = "fifth")]
    perturb: f64,
    #[serde(default = "quarter")]
    resample: f64,
    #[serde(default)]
    samples: Option<usize>,
}

fn quarter() -> f64 {
    0.25
}

fn fifth() -> f64 {
    0.2
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResearcher {
    endpoint: String,
    #[serde(default = "smollm2")]
    model: String,
    #[serde(default = "twenty")]
    max_actions: u32,
    #[serde(default = "eight")]
    max_arms: usize,
    #[serde(default)]
    steps: Option<Vec<u64>>,
    #[serde(default)]
    temperature: f64,
    #[serde(default = "tokens")]
    max_tokens: u32,
    #[serde(default = "four")]
    calls_per_turn: u32,
    #[serde(default = "call_timeout")]
    timeout_seconds: f64,
}

fn smollm2() -> String {
    "smollm2".into()
}

fn twenty() -> u32 {
    20
}

fn eight() -> usize {
    8
}

fn tokens() -> u32 {
    400
}

/// The fewest `researcher.max_tokens`: a call with a reason of the longest is about 250
/// tokens, and a call cut short is no call.
const MIN_TOKENS: u32 = 320;

/// The most runs a researcher's study may have: the engine constrains enums of up to 64
/// values (a run's number is one; `finish_study`'s winner adds "none").
const MAX_RESEARCHER_ARMS: usize = 63;

fn four() -> u32 {
    4
}

fn call_timeout() -> f64 {
    120.0
}

/// Server flags a checkpoint fixes: a new PBT arm resumes its parent's checkpoint, so
/// these cannot be explored.
const FIXED_BY_CHECKPOINT: &[&str] = &["--lora-rank", "--lora-alpha", "--lora-targets", "--rslora"];

fn default_metric() -> String {
    "reward_mean".into()
}

fn default_window() -> usize {
    3
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBase {
    model: String,
    #[serde(default)]
    server: Vec<String>,
    #[serde(default)]
    client: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudget {
    steps: u64,
    #[serde(default = "one")]
    at_once: usize,
    #[serde(default)]
    minutes: Option<f64>,
}

fn one() -> usize {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawParam {
    #[serde(default)]
    server: Option<String>,
    #[serde(default)]
    client: Option<String>,
    #[serde(default)]
    env: Option<String>,
    #[serde(default)]
    values: Option<Vec<Value>>,
    #[serde(default)]
    min: Option<f64>,
    #[serde(default)]
    max: Option<f64>,
    #[serde(default)]
    log: bool,
    #[serde(default)]
    integer: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAsha {
    min_steps: u64,
    #[serde(default = "two")]
    eta: u64,
    #[serde(default)]
    samples: Option<usize>,
}

fn two() -> u64 {
    2
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWatch {
    #[serde(default = "yes")]
    nonfinite: bool,
    #[serde(default)]
    flat_steps: usize,
    #[serde(default)]
    min_entropy: f64,
    #[serde(default = "stall")]
    stall_seconds: f64,
    #[serde(default = "restarts")]
    restarts: u32,
}

impl Default for RawWatch {
    fn default() -> Self {
        RawWatch {
            nonfinite: true,
            flat_steps: 0,
            min_entropy: 0.0,
            stall_seconds: stall(),
            restarts: restarts(),
        }
    }
}

fn yes() -> bool {
    true
}

fn stall() -> f64 {
    600.0
}

fn restarts() -> u32 {
    2
}

impl Study {
    /// Reads and checks a study file.
    pub fn load(file: &Path) -> Result<Study, StudyError> {
        let text = std::fs::read_to_string(file).map_err(|e| StudyError::io(file, e))?;
        Study::parse(file, &text)
    }

    /// Checks the text of a study file (`file` names it in errors).
    pub fn parse(file: &Path, text: &str) -> Result<Study, StudyError> {
        let table: toml::Table = toml::from_str(text).map_err(|e| StudyError::Syntax {
            file: file.to_path_buf(),
            msg: e.to_string().trim_end().to_string(),
        })?;
        let json = serde_json::to_value(&table).map_err(|e| StudyError::Syntax {
            file: file.to_path_buf(),
            msg: e.to_string(),
        })?;
        // Where arms run is not what the study is: a journal goes on with workers added.
        let mut what = json.clone();
        if let Some(t) = what.as_object_mut() {
            t.remove("workers");
        }
        let hash = blake3::hash(what.to_string().as_bytes())
            .to_hex()
            .to_string();
        let raw: Raw = serde_path_to_error::deserialize(json).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                "(top level)".into()
            } else {
                path
            };
            StudyError::field(file, field, e.inner().to_string())
        })?;
        check(file, raw, hash)
    }
}

fn check(file: &Path, raw: Raw, hash: String) -> Result<Study, StudyError> {
    let bad = |field: &str, msg: String| StudyError::field(file, field, msg);
    if raw.name.is_empty()
        || !raw
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        || raw.name.starts_with('.')
    {
        return Err(bad(
            "name",
            format!(
                "{:?}: use letters, digits, '-', '_' and '.' (it names the study's directory)",
                raw.name
            ),
        ));
    }
    if !METRICS.contains(&raw.metric.as_str()) {
        return Err(bad(
            "metric",
            format!("{:?} is not one of {}", raw.metric, METRICS.join(", ")),
        ));
    }
    let goal = match raw.goal.as_deref() {
        None if raw.metric == "loss" || raw.metric == "kl" => Goal::Min,
        None | Some("max") => Goal::Max,
        Some("min") => Goal::Min,
        Some(g) => return Err(bad("goal", format!("{g:?}: use \"max\" or \"min\""))),
    };
    if raw.window == 0 {
        return Err(bad("window", "must be at least 1 step".into()));
    }
    let base = check_base(file, raw.base)?;
    let b = raw.budget;
    if b.steps == 0 {
        return Err(bad("budget.steps", "must be at least 1".into()));
    }
    if b.at_once == 0 {
        return Err(bad("budget.at_once", "must be at least 1".into()));
    }
    if let Some(m) = b.minutes {
        if !(m.is_finite() && m > 0.0 && m <= 1e8) {
            return Err(bad(
                "budget.minutes",
                format!("{m}: must be above 0 (and at most 1e8)"),
            ));
        }
    }
    let budget = Budget {
        steps: b.steps,
        at_once: b.at_once,
        minutes: b.minutes,
    };
    let space = raw
        .space
        .into_iter()
        .map(|(name, p)| check_param(file, name, p))
        .collect::<Result<Vec<_>, _>>()?;
    if !["grid", "asha", "pbt", "researcher"].contains(&raw.policy.as_str()) {
        return Err(bad(
            "policy",
            format!(
                "{:?}: use \"grid\", \"asha\", \"pbt\" or \"researcher\"",
                raw.policy
            ),
        ));
    }
    for (given, table) in [
        (raw.asha.is_some(), "asha"),
        (raw.pbt.is_some(), "pbt"),
        (raw.researcher.is_some(), "researcher"),
    ] {
        if given && raw.policy != table {
            return Err(bad(
                table,
                format!(
                    "given, but policy is {:?} (use policy = \"{table}\", or drop [{table}])",
                    raw.policy
                ),
            ));
        }
    }
    let (policy, samples) = match (raw.policy.as_str(), raw.asha) {
        ("grid", None) => (PolicyKind::Grid, None),
        ("asha", None) => {
            return Err(bad(
                "asha",
                "policy \"asha\" needs an [asha] table with min_steps (and eta)".into(),
            ))
        }
        ("asha", Some(a)) => {
            if a.min_steps == 0 || a.min_steps >= budget.steps {
                return Err(bad(
                    "asha.min_steps",
                    format!(
                        "{}: must be at least 1 and below budget.steps ({})",
                        a.min_steps, budget.steps
                    ),
                ));
            }
            if a.eta < 2 {
                return Err(bad("asha.eta", format!("{}: must be at least 2", a.eta)));
            }
            if a.samples == Some(0) {
                return Err(bad("asha.samples", "must be at least 1".into()));
            }
            (
                PolicyKind::Halving {
                    min_steps: a.min_steps,
                    eta: a.eta,
                },
                a.samples,
            )
        }
        ("pbt", _) => {
            let Some(p) = raw.pbt else {
                return Err(bad(
                    "pbt",
                    "policy \"pbt\" needs a [pbt] table with interval and explore".into(),
                ));
            };
            check_pbt(file, p, &space, budget.steps)?
        }
        ("researcher", _) => {
            let Some(r) = raw.researcher else {
                return Err(bad(
                    "researcher",
                    "policy \"researcher\" needs a [researcher] table with endpoint".into(),
                ));
            };
            (check_researcher(file, r, &space, budget.steps)?, None)
        }
        (p, _) => {
            return Err(bad(
                "policy",
                format!("{p:?}: use \"grid\", \"asha\", \"pbt\" or \"researcher\""),
            ))
        }
    };
    let arms = check_arms(file, raw.arms, &space)?;
    let researcher = matches!(policy, PolicyKind::Researcher(_));
    if let PolicyKind::Pbt(_) = &policy {
        let n = if arms.is_empty() {
            samples.unwrap_or_else(|| {
                space
                    .iter()
                    .map(|p| p.values.as_ref().map_or(1, Vec::len))
                    .product()
            })
        } else {
            arms.len()
        };
        if n < 2 {
            return Err(bad(
                "pbt",
                format!(
                    "a population of {n} arm(s): pbt needs at least 2 (one to exploit another)"
                ),
            ));
        }
    }
    if let PolicyKind::Researcher(r) = &policy {
        if arms.len() > r.max_arms {
            return Err(bad(
                "arms",
                format!(
                    "{} arms, more than researcher.max_arms ({})",
                    arms.len(),
                    r.max_arms
                ),
            ));
        }
    }
    if arms.is_empty() && !researcher {
        if space.is_empty() {
            return Err(bad(
                "space",
                "no arms: give [space.NAME] parameters or an [[arms]] list".into(),
            ));
        }
        match samples {
            None => {
                if let Some(p) = space.iter().find(|p| p.values.is_none()) {
                    return Err(bad(
                        &format!("space.{}", p.name),
                        "a range (min/max) needs asha.samples or pbt.samples (arms drawn from the space); a grid needs values".into(),
                    ));
                }
                let n = space.iter().try_fold(1usize, |n, p| {
                    n.checked_mul(p.values.as_ref().map_or(1, Vec::len))
                });
                match n {
                    Some(n) if n <= MAX_ARMS => {}
                    _ => {
                        return Err(bad(
                            "space",
                            format!("the grid has more than {MAX_ARMS} arms"),
                        ))
                    }
                }
            }
            Some(n) if n > MAX_ARMS => {
                return Err(bad(
                    samples_field(&policy),
                    format!("{n}: at most {MAX_ARMS} arms"),
                ))
            }
            Some(_) => {}
        }
    } else if samples.is_some() {
        return Err(bad(
            samples_field(&policy),
            "given with an [[arms]] list: the arms are the list".into(),
        ));
    }
    let workers = raw
        .workers
        .map(|w| check_workers(file, w, budget.at_once))
        .transpose()?;
    let w = raw.watch;
    if !(w.stall_seconds.is_finite() && w.stall_seconds > 0.0 && w.stall_seconds <= 1e9) {
        return Err(bad(
            "watch.stall_seconds",
            format!("{}: must be above 0 (and at most 1e9)", w.stall_seconds),
        ));
    }
    if !(w.min_entropy.is_finite() && w.min_entropy >= 0.0) {
        return Err(bad(
            "watch.min_entropy",
            format!("{}: must be 0 (off) or above", w.min_entropy),
        ));
    }
    if w.flat_steps == 1 {
        return Err(bad(
            "watch.flat_steps",
            "1 step cannot be flat: 0 (off) or at least 2".into(),
        ));
    }
    Ok(Study {
        file: file.to_path_buf(),
        name: raw.name,
        seed: raw.seed,
        policy,
        metric: raw.metric,
        goal,
        window: raw.window,
        base,
        budget,
        space,
        arms,
        samples,
        watch: Watch {
            nonfinite: w.nonfinite,
            flat_steps: w.flat_steps,
            min_entropy: w.min_entropy,
            stall_seconds: w.stall_seconds,
            restarts: w.restarts,
        },
        workers,
        hash,
    })
}

fn check_workers(file: &Path, w: RawWorkers, at_once: usize) -> Result<Workers, StudyError> {
    let bad = |field: &str, msg: String| StudyError::field(file, field, msg);
    if w.bootstrap.is_empty() {
        return Err(bad(
            "workers.bootstrap",
            "empty: give at least one address of the workers' swarm".into(),
        ));
    }
    for (i, a) in w.bootstrap.iter().enumerate() {
        crate::swarm::parse_addr(a)
            .map_err(|e| bad(&format!("workers.bootstrap[{i}]"), e.to_string()))?;
    }
    crate::swarm::parse_addr(&w.listen).map_err(|e| bad("workers.listen", e.to_string()))?;
    let local = w.local.unwrap_or(at_once);
    if local > at_once {
        return Err(bad(
            "workers.local",
            format!("{local}: more than budget.at_once ({at_once})"),
        ));
    }
    if !(w.wait_seconds.is_finite() && w.wait_seconds >= 0.0) {
        return Err(bad(
            "workers.wait_seconds",
            format!("{}: must be 0 or above", w.wait_seconds),
        ));
    }
    let allow = w
        .allow
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.parse::<crate::swarm::PeerId>().map_err(|e| {
                bad(
                    &format!("workers.allow[{i}]"),
                    format!("{p:?} is not a peer id: {e}"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let swarm_key = if w.swarm_key.is_absolute() {
        w.swarm_key
    } else {
        file.parent().unwrap_or(Path::new(".")).join(&w.swarm_key)
    };
    Ok(Workers {
        swarm_key,
        bootstrap: w.bootstrap,
        listen: w.listen,
        local,
        wait_seconds: w.wait_seconds,
        allow,
    })
}

fn samples_field(p: &PolicyKind) -> &'static str {
    match p {
        PolicyKind::Pbt(_) => "pbt.samples",
        _ => "asha.samples",
    }
}

fn check_pbt(
    file: &Path,
    p: RawPbt,
    space: &[Param],
    steps: u64,
) -> Result<(PolicyKind, Option<usize>), StudyError> {
    let bad = |field: &str, msg: String| StudyError::field(file, field, msg);
    if p.interval == 0 || p.interval >= steps {
        return Err(bad(
            "pbt.interval",
            format!(
                "{}: must be at least 1 and below budget.steps ({steps})",
                p.interval
            ),
        ));
    }
    if !(p.quantile > 0.0 && p.quantile <= 0.5) {
        return Err(bad(
            "pbt.quantile",
            format!(
                "{}: must be above 0 and at most 0.5 (the worst part of the population)",
                p.quantile
            ),
        ));
    }
    if !(p.perturb > 0.0 && p.perturb < 1.0) {
        return Err(bad(
            "pbt.perturb",
            format!("{}: must be above 0 and below 1", p.perturb),
        ));
    }
    if !(0.0..=1.0).contains(&p.resample) {
        return Err(bad(
            "pbt.resample",
            format!("{}: must be from 0 to 1", p.resample),
        ));
    }
    if p.explore.is_empty() {
        return Err(bad(
            "pbt.explore",
            "name at least one parameter of [space] to explore".into(),
        ));
    }
    for (i, name) in p.explore.iter().enumerate() {
        let Some(q) = space.iter().find(|q| &q.name == name) else {
            return Err(bad(
                &format!("pbt.explore[{i}]"),
                format!("{name:?} is not a parameter of [space]"),
            ));
        };
        if let Target::Server(f) = &q.target {
            if FIXED_BY_CHECKPOINT.contains(&f.as_str()) {
                return Err(bad(
                    &format!("pbt.explore[{i}]"),
                    format!(
                        "{name:?} sets {f}, which a checkpoint fixes: a new arm resumes its \
                         parent's checkpoint, so it cannot change"
                    ),
                ));
            }
        }
    }
    if p.samples == Some(0) {
        return Err(bad("pbt.samples", "must be at least 1".into()));
    }
    Ok((
        PolicyKind::Pbt(Pbt {
            interval: p.interval,
            quantile: p.quantile,
            explore: p.explore,
            perturb: p.perturb,
            resample: p.resample,
        }),
        p.samples,
    ))
}

fn check_researcher(
    file: &Path,
    r: RawResearcher,
    space: &[Param],
    steps: u64,
) -> Result<PolicyKind, StudyError> {
    let bad = |field: &str, msg: String| StudyError::field(file, field, msg);
    let url = r.endpoint.trim_end_matches('/');
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(bad(
            "researcher.endpoint",
            format!(
                "{:?}: an OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1",
                r.endpoint
            ),
        ));
    }
    if r.model.is_empty() || r.model.contains(['#', '=']) {
        return Err(bad(
            "researcher.model",
            format!("{:?}: a model name (no '#' or '=')", r.model),
        ));
    }
    if url.contains('#') {
        return Err(bad(
            "researcher.endpoint",
            format!("{:?}: a URL without '#'", r.endpoint),
        ));
    }
    crate::facade::external::ExternalModel::parse(&format!("researcher={url}#{}", r.model), |_| {
        None
    })
    .map_err(|e| bad("researcher.endpoint", e.to_string()))?;
    if r.max_actions == 0 || r.max_actions > 10_000 {
        return Err(bad(
            "researcher.max_actions",
            format!("{}: must be from 1 to 10000", r.max_actions),
        ));
    }
    if r.max_arms == 0 || r.max_arms > MAX_RESEARCHER_ARMS {
        return Err(bad(
            "researcher.max_arms",
            format!("{}: must be from 1 to {MAX_RESEARCHER_ARMS}", r.max_arms),
        ));
    }
    let mut choices = r.steps.unwrap_or_else(|| vec![steps / 4, steps / 2, steps]);
    if let Some(s) = choices.iter().find(|&&s| s > steps) {
        return Err(bad(
            "researcher.steps",
            format!("{s}: above budget.steps ({steps})"),
        ));
    }
    choices.retain(|&s| s > 0);
    choices.sort_unstable();
    choices.dedup();
    if choices.is_empty() || choices.len() > 32 {
        return Err(bad(
            "researcher.steps",
            "give 1 to 32 step counts above 0".into(),
        ));
    }
    if !(0.0..=2.0).contains(&r.temperature) {
        return Err(bad(
            "researcher.temperature",
            format!("{}: must be from 0 to 2", r.temperature),
        ));
    }
    if !(MIN_TOKENS..=4096).contains(&r.max_tokens) {
        return Err(bad(
            "researcher.max_tokens",
            format!("{}: must be from {MIN_TOKENS} to 4096", r.max_tokens),
        ));
    }
    if r.calls_per_turn == 0 || r.calls_per_turn > 64 {
        return Err(bad(
            "researcher.calls_per_turn",
            format!("{}: must be from 1 to 64", r.calls_per_turn),
        ));
    }
    if !(r.timeout_seconds > 0.0 && r.timeout_seconds <= 3600.0) {
        return Err(bad(
            "researcher.timeout_seconds",
            format!("{}: must be above 0 and at most 3600", r.timeout_seconds),
        ));
    }
    if space.is_empty() {
        return Err(bad(
            "space",
            "a researcher chooses among the values of [space.NAME] parameters: give at least one"
                .into(),
        ));
    }
    for p in space {
        if p.name == "steps" || p.name == "reason" {
            return Err(bad(
                &format!("space.{}", p.name),
                "a researcher's start_run has its own argument of this name: rename the parameter"
                    .into(),
            ));
        }
        match &p.values {
            Some(v) if v.len() <= 64 => {}
            Some(_) => {
                return Err(bad(
                    &format!("space.{}.values", p.name),
                    "a researcher chooses among at most 64 values".into(),
                ))
            }
            None => {
                return Err(bad(
                    &format!("space.{}", p.name),
                    "a researcher chooses among values: give values, not a range".into(),
                ))
            }
        }
    }
    Ok(PolicyKind::Researcher(Researcher {
        endpoint: url.to_string(),
        model: r.model,
        max_actions: r.max_actions,
        max_arms: r.max_arms,
        steps: choices,
        temperature: r.temperature,
        max_tokens: r.max_tokens,
        calls_per_turn: r.calls_per_turn,
        timeout_seconds: r.timeout_seconds,
    }))
}

/// Whether `args` set `flag` (`--flag value` or `--flag=value`).
pub fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// The flag an argument list sets, if it is one the driver sets itself.
fn driver_flag(args: &[String]) -> Option<&str> {
    args.iter().find_map(|a| {
        let flag = a.split('=').next().unwrap_or(a);
        DRIVER_FLAGS.iter().copied().find(|d| *d == flag)
    })
}

fn check_base(file: &Path, b: RawBase) -> Result<Base, StudyError> {
    let bad = |field: &str, msg: String| StudyError::field(file, field, msg);
    if b.model.trim().is_empty() {
        return Err(bad("base.model", "must name a model".into()));
    }
    for (field, args) in [("base.server", &b.server), ("base.client", &b.client)] {
        if let Some(f) = driver_flag(args) {
            return Err(bad(field, format!("{f} is set by the driver for each arm")));
        }
    }
    let has = |flag: &str| has_flag(&b.client, flag);
    if !has("--agent") || !has("--tasks") {
        return Err(bad(
            "base.client",
            "needs --agent COMMAND and --tasks FILE (what each arm's client runs)".into(),
        ));
    }
    if let Some(k) = b.env.keys().find(|k| !valid_env(k)) {
        return Err(bad(
            &format!("base.env.{k}"),
            "not a variable name (letters, digits and '_')".into(),
        ));
    }
    Ok(Base {
        model: b.model,
        server: b.server,
        client: b.client,
        env: b.env,
    })
}

fn valid_env(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_param(file: &Path, name: String, p: RawParam) -> Result<Param, StudyError> {
    let field = format!("space.{name}");
    let bad = |msg: String| StudyError::field(file, field.clone(), msg);
    if name == "name" {
        return Err(bad(
            "\"name\" is taken (an explicit arm's name); call the parameter otherwise".into(),
        ));
    }
    let target = match (p.server, p.client, p.env) {
        (Some(f), None, None) => Target::Server(f),
        (None, Some(f), None) => Target::Client(f),
        (None, None, Some(v)) => Target::Env(v),
        _ => {
            return Err(bad(
                "give exactly one of server = \"--flag\", client = \"--flag\" or env = \"VAR\""
                    .into(),
            ))
        }
    };
    match &target {
        Target::Server(f) | Target::Client(f) => {
            if !f.starts_with("--") || f.len() < 3 || f.contains(char::is_whitespace) {
                return Err(bad(format!("{f:?} is not a flag (--name)")));
            }
            if let Some(d) = DRIVER_FLAGS.iter().find(|d| *d == f) {
                return Err(bad(format!("{d} is set by the driver for each arm")));
            }
        }
        Target::Env(v) => {
            if !valid_env(v) {
                return Err(bad(format!("{v:?} is not a variable name")));
            }
        }
    }
    if let Some(vs) = &p.values {
        if vs.is_empty() {
            return Err(bad("values is empty".into()));
        }
        if let Some(v) = vs.iter().find(|v| !scalar(v)) {
            return Err(bad(format!(
                "{v}: a value is a number, a string or a boolean"
            )));
        }
    }
    let range = match (p.min, p.max) {
        (None, None) => None,
        (Some(min), Some(max)) => {
            if p.values.is_some() {
                return Err(bad("give values or min/max, not both".into()));
            }
            if !(min.is_finite() && max.is_finite() && min < max) {
                return Err(bad(format!("min {min} must be below max {max}")));
            }
            if p.log && min <= 0.0 {
                return Err(bad(format!("log = true needs min above 0, got {min}")));
            }
            Some(Range {
                min,
                max,
                log: p.log,
                integer: p.integer,
            })
        }
        _ => return Err(bad("a range needs both min and max".into())),
    };
    if p.values.is_none() && range.is_none() {
        return Err(bad("give values = [...] or min and max".into()));
    }
    Ok(Param {
        name,
        target,
        values: p.values,
        range,
    })
}

fn scalar(v: &Value) -> bool {
    matches!(v, Value::Number(_) | Value::String(_) | Value::Bool(_))
}

fn check_arms(
    file: &Path,
    arms: Vec<BTreeMap<String, Value>>,
    space: &[Param],
) -> Result<Vec<ArmSpec>, StudyError> {
    let mut names = std::collections::BTreeSet::new();
    arms.into_iter()
        .enumerate()
        .map(|(i, mut a)| {
            let bad = |field: String, msg: String| StudyError::field(file, field, msg);
            let name = match a.remove("name") {
                None => None,
                Some(Value::String(s)) if !s.trim().is_empty() => Some(s),
                Some(v) => {
                    return Err(bad(
                        format!("arms[{i}].name"),
                        format!("{v}: a name is a non-empty string"),
                    ))
                }
            };
            if let Some(k) = a.keys().find(|k| !space.iter().any(|p| &p.name == *k)) {
                return Err(bad(
                    format!("arms[{i}].{k}"),
                    "no such parameter: declare it as [space.NAME] (where its value goes)".into(),
                ));
            }
            if let Some(p) = space.iter().find(|p| !a.contains_key(&p.name)) {
                return Err(bad(
                    format!("arms[{i}]"),
                    format!("no value for parameter {:?}", p.name),
                ));
            }
            if let Some((k, v)) = a.iter().find(|(_, v)| !scalar(v)) {
                return Err(bad(
                    format!("arms[{i}].{k}"),
                    format!("{v}: a value is a number, a string or a boolean"),
                ));
            }
            if let Some(n) = &name {
                if !names.insert(n.clone()) {
                    return Err(bad(
                        format!("arms[{i}].name"),
                        format!("{n:?} names two arms"),
                    ));
                }
            }
            Ok(ArmSpec { name, values: a })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
seed = 3
policy = "asha"
[base]
model = "m"
client = ["--agent", "sh a.sh", "--tasks", "t.jsonl"]
[budget]
steps = 8
at_once = 2
[space.lr]
server = "--learning-rate"
values = [1e-5, 2e-5]
[space.temp]
env = "AGENT_TEMPERATURE"
values = [0.7, 1.0]
[asha]
min_steps = 2
"#;

    /// GOOD with policy pbt and a [pbt] table of `table`.
    fn pbt(table: &str) -> String {
        GOOD.replace("policy = \"asha\"", "policy = \"pbt\"")
            .replace("[asha]\nmin_steps = 2\n", &format!("[pbt]\n{table}\n"))
    }

    fn researcher(table: &str) -> String {
        GOOD.replace("policy = \"asha\"", "policy = \"researcher\"")
            .replace(
                "[asha]\nmin_steps = 2\n",
                &format!("[researcher]\n{table}\n"),
            )
    }

    fn err(text: &str) -> String {
        Study::parse(Path::new("s.toml"), text)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn the_example_studies_parse() {
        for f in ["addition.toml", "researcher.toml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("examples/study")
                .join(f);
            let s = Study::load(&path).unwrap_or_else(|e| panic!("{e}"));
            assert!(!s.space.is_empty(), "{f}");
        }
    }

    #[test]
    fn pbt_and_researcher_files_parse_with_their_defaults() {
        let s = Study::parse(
            Path::new("s.toml"),
            &pbt("interval = 2\nexplore = [\"lr\"]"),
        )
        .unwrap();
        assert_eq!(
            s.policy,
            PolicyKind::Pbt(Pbt {
                interval: 2,
                quantile: 0.25,
                explore: vec!["lr".into()],
                perturb: 0.2,
                resample: 0.25,
            })
        );
        let text = researcher("endpoint = \"http://127.0.0.1:8080/v1/\"");
        let s = Study::parse(Path::new("s.toml"), &text).unwrap();
        let PolicyKind::Researcher(r) = &s.policy else {
            panic!("{:?}", s.policy)
        };
        assert_eq!(r.endpoint, "http://127.0.0.1:8080/v1");
        assert_eq!(r.steps, vec![2, 4, 8]);
        assert_eq!(
            (r.model.as_str(), r.max_actions, r.max_arms),
            ("smollm2", 20, 8)
        );
        assert!(
            s.arms.is_empty(),
            "a researcher starts with no arm of its own"
        );
    }

    #[test]
    fn a_good_file_parses_and_its_hash_ignores_comments() {
        let s = Study::parse(Path::new("s.toml"), GOOD).unwrap();
        assert_eq!(
            s.policy,
            PolicyKind::Halving {
                min_steps: 2,
                eta: 2
            }
        );
        assert_eq!(s.space.len(), 2);
        assert_eq!(s.space[0].name, "lr");
        assert_eq!(s.goal, Goal::Max);
        let commented = format!("# a comment\n{GOOD}");
        let t = Study::parse(Path::new("s.toml"), &commented).unwrap();
        assert_eq!(s.hash, t.hash);
        let changed = GOOD.replace("seed = 3", "seed = 4");
        assert_ne!(
            s.hash,
            Study::parse(Path::new("s.toml"), &changed).unwrap().hash
        );
        // Where the arms run is not part of what the study is.
        let on_workers =
            format!("{GOOD}\n[workers]\nswarm_key = \"k.key\"\nbootstrap = [\"{W}\"]\nlocal = 0\n");
        let w = Study::parse(Path::new("d/s.toml"), &on_workers).unwrap();
        assert_eq!(s.hash, w.hash);
        let workers = w.workers.unwrap();
        assert_eq!(workers.swarm_key, Path::new("d/k.key"));
        assert_eq!((workers.local, workers.wait_seconds), (0, 30.0));
        assert_eq!(s.workers, None);
    }

    const W: &str = "/ip4/127.0.0.1/udp/4100/quic-v1";

    #[test]
    fn bad_files_name_the_field() {
        let cases = [
            (GOOD.replace("steps = 8", "steps = \"8\""), "budget.steps"),
            (GOOD.replace("steps = 8", "steps = 0"), "budget.steps"),
            (
                GOOD.replace("min_steps = 2", "min_steps = 8"),
                "asha.min_steps",
            ),
            (
                GOOD.replace("policy = \"asha\"", "policy = \"pbt\""),
                "asha",
            ),
            (
                GOOD.replace("policy = \"asha\"", "policy = \"pbt\"")
                    .replace("[asha]\nmin_steps = 2\n", ""),
                "pbt",
            ),
            (pbt("interval = 8\nexplore = [\"lr\"]"), "pbt.interval"),
            (
                pbt("interval = 2\nexplore = [\"lr\"]")
                    .replace("server = \"--learning-rate\"", "server = \"--lora-rank\""),
                "pbt.explore[0]",
            ),
            (
                pbt("interval = 2\nexplore = [\"lr\"]")
                    .replace("values = [1e-5, 2e-5]", "values = [1e-5]")
                    .replace("values = [0.7, 1.0]", "values = [0.7]"),
                "pbt",
            ),
            (
                pbt("interval = 2\nexplore = [\"lr\", \"x\"]"),
                "pbt.explore[1]",
            ),
            (pbt("interval = 2\nexplore = []"), "pbt.explore"),
            (
                pbt("interval = 2\nexplore = [\"lr\"]\nquantile = 0.9"),
                "pbt.quantile",
            ),
            (
                researcher("endpoint = \"localhost:8080\""),
                "researcher.endpoint",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"\nsteps = [4, 9]"),
                "researcher.steps",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"")
                    .replace("values = [0.7, 1.0]", "min = 0.5\nmax = 1.0"),
                "space.temp",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"\nmax_actions = 0"),
                "researcher.max_actions",
            ),
            (
                researcher("endpoint = \"http://:8080/v1\""),
                "researcher.endpoint",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"\ntimeout_seconds = 1e20"),
                "researcher.timeout_seconds",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"\nmax_tokens = 200"),
                "researcher.max_tokens",
            ),
            (
                researcher("endpoint = \"http://127.0.0.1:1/v1\"")
                    .replace("[space.temp]", "[space.steps]"),
                "space.steps",
            ),
            (
                GOOD.replace("policy = \"asha\"", "policy = \"bogus\""),
                "policy",
            ),
            (
                GOOD.replace("server = \"--learning-rate\"", "server = \"lr\""),
                "space.lr",
            ),
            (
                GOOD.replace(
                    "env = \"AGENT_TEMPERATURE\"",
                    "env = \"A\"\nclient = \"--x\"",
                ),
                "space.temp",
            ),
            (
                GOOD.replace("values = [0.7, 1.0]", "values = []"),
                "space.temp",
            ),
            (
                GOOD.replace("at_once = 2", "at_once = 2\nbogus = 1"),
                "budget",
            ),
            (
                GOOD.replace("\"--tasks\", \"t.jsonl\"", "\"--data-dir\", \"x\""),
                "base.client",
            ),
            (GOOD.replace("model = \"m\"", ""), "base"),
            (
                format!("{GOOD}\n[watch]\nflat_steps = 1\n"),
                "watch.flat_steps",
            ),
            (format!("{GOOD}\n[[arms]]\nlr = 1e-5\n"), "arms[0]"),
            (
                format!("{GOOD}\n[[arms]]\nlr = 1e-5\ntemp = 1.0\nx = 2\n"),
                "arms[0].x",
            ),
            (GOOD.replace("name = \"t\"", "name = \"../t\""), "name"),
            (
                GOOD.replace("seed = 3", "seed = 3\nmetric = \"speed\""),
                "metric",
            ),
            (
                format!("{GOOD}\n[workers]\nswarm_key = \"k\"\nbootstrap = []\n"),
                "workers.bootstrap",
            ),
            (
                format!("{GOOD}\n[workers]\nswarm_key = \"k\"\nbootstrap = [\"x\"]\n"),
                "workers.bootstrap[0]",
            ),
            (
                format!("{GOOD}\n[workers]\nswarm_key = \"k\"\nbootstrap = [\"{W}\"]\nlocal = 3\n"),
                "workers.local",
            ),
            (
                format!(
                    "{GOOD}\n[workers]\nswarm_key = \"k\"\nbootstrap = [\"{W}\"]\nlisten = \"y\"\n"
                ),
                "workers.listen",
            ),
            (
                format!("{GOOD}\n[workers]\nbootstrap = [\"{W}\"]\n"),
                "workers",
            ),
            (
                format!("{GOOD}\n[workers]\nswarm_key = \"k\"\nbootstrap = [\"{W}\"]\nallow = [\"x\"]\n"),
                "workers.allow[0]",
            ),
        ];
        for (text, field) in cases {
            let e = err(&text);
            assert!(
                e.starts_with(&format!("s.toml: {field}")),
                "{field}: got {e}"
            );
        }
        let e = err("name = ");
        assert!(e.starts_with("s.toml: ") && e.contains("line 1"), "{e}");
    }

    #[test]
    fn a_range_needs_samples_and_samples_bound_the_arms() {
        let ranged = GOOD.replace(
            "values = [1e-5, 2e-5]",
            "min = 1e-6\nmax = 1e-4\nlog = true",
        );
        assert!(err(&ranged).starts_with("s.toml: space.lr"));
        let sampled = ranged.replace("min_steps = 2", "min_steps = 2\nsamples = 5");
        let s = Study::parse(Path::new("s.toml"), &sampled).unwrap();
        assert_eq!(s.samples, Some(5));
        let too_many = ranged.replace("min_steps = 2", "min_steps = 2\nsamples = 5000");
        assert!(err(&too_many).starts_with("s.toml: asha.samples"));
    }
}
