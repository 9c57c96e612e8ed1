//! One RL optimizer step over trainable groups.
//!
//! 1. The groups' episodes are packed into rows under a token budget (micro-batches) in the
//!    configured layout (tree by default: each group's shared prefix computed once).
//! 2. Staleness: sampled tokens of calls more than `max_staleness` policy versions behind
//!    the current one are not trained on (their tokens stay as context); the dropped calls
//!    are counted, and every call's staleness goes into a histogram.
//! 3. Each row: the model's final hidden states at the target positions, then token
//!    log-probabilities and entropies through the chunked kernel
//!    ([`agentjet_kernels::logprobs`]), never a [tokens x vocabulary] log-softmax at once;
//!    the loss ([`super::loss`]) on those `[T]` vectors gives ∂L/∂lp and ∂L/∂H; the kernel's
//!    backward turns them into ∂L/∂h and ∂L/∂W_out, and one backward pass carries ∂L/∂h
//!    through the model. Gradients accumulate over the rows (normalised by the whole
//!    batch's counts, so the sum is the batch gradient).
//!    Each token is scored under the distribution it was sampled from (its call's
//!    [`SamplingTransform`]: logits / T and the
//!    truncation), and its behaviour
//!    log-probability is of that same distribution, so the importance weights compare two
//!    policies of one kind.
//! 4. AdamW at the scheduled learning rate (linear warmup, then constant or cosine); the
//!    policy version goes up by one.
//!
//! PPO epochs (`ppo_epochs` E, `mini_batches` M; [`Trainer::step`] only): the groups are
//! split into M mini-batches, every token's log-probability under the policy the step
//! starts from is computed once ("old"), then E passes over the M mini-batches take one
//! AdamW update each, so from the second update on the ratio `exp(lp - old)` moves and
//! the clip binds. The policy version still goes up by one per step: the engine serves
//! the weights after the last update.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::groups::{Group, ReadyReport};
use super::loss::{policy_loss, BatchCounts, LossConfig, LossInputs, LossSums, Normalization};
use super::optim::{AdamW, AdamWConfig};
use super::TrainError;
use crate::base::cores::{cores, Busy};
use crate::model::llama::Llama;
use crate::timeline::layout::{pack, Layout, PackedRow};
use crate::timeline::{Episode, SamplingTransform};
use agentjet_kernels::logprobs::{Transform, Truncation};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Schedule {
    Constant,
    /// Cosine from the base rate down to `min_ratio` x base over `total_steps`.
    Cosine {
        total_steps: u64,
        min_ratio: f64,
    },
}

/// The learning rate of step `step` (0-based): linear warmup over `warmup` steps from
/// base / warmup, then the schedule.
pub fn learning_rate(base: f64, warmup: u64, schedule: Schedule, step: u64) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    match schedule {
        Schedule::Constant => base,
        Schedule::Cosine {
            total_steps,
            min_ratio,
        } => {
            let span = total_steps.saturating_sub(warmup).max(1) as f64;
            let t = ((step - warmup) as f64 / span).min(1.0);
            let cos = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
            base * (min_ratio + (1.0 - min_ratio) * cos)
        }
    }
}

#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// The model name whose calls are trained (an episode may call several).
    pub model_name: String,
    pub loss: LossConfig,
    pub optim: AdamWConfig,
    pub warmup_steps: u64,
    pub schedule: Schedule,
    pub layout: Layout,
    /// Set by the trainer when the model cannot take `layout` (then linear).
    pub layout_fallback: bool,
    /// Tokens per packed row (micro-batch); gradients accumulate over the rows.
    pub micro_batch_tokens: usize,
    /// Rows of logits the log-probability kernel holds at once.
    pub logprob_chunk: i64,
    /// Calls more than this many versions behind are not trained on (none: no bound).
    pub max_staleness: Option<u64>,
    /// Mixed precision: matrix products in bfloat16 over float32 master weights (the
    /// optimizer, norms, attention softmax and the token logprobs stay float32).
    pub bf16: bool,
    /// Passes over each step's batch (PPO epochs); 1: one update per batch.
    pub ppo_epochs: usize,
    /// Mini-batches (of whole groups) per pass, one update each.
    pub mini_batches: usize,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        TrainerConfig {
            model_name: "policy".into(),
            loss: LossConfig::default(),
            optim: AdamWConfig::default(),
            warmup_steps: 0,
            schedule: Schedule::Constant,
            layout: Layout::Tree,
            layout_fallback: false,
            micro_batch_tokens: 4096,
            logprob_chunk: 512,
            max_staleness: Some(4),
            bf16: false,
            ppo_epochs: 1,
            mini_batches: 1,
        }
    }
}

/// What one step did (one line of `metrics.jsonl`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StepMetrics {
    pub step: u64,
    /// The policy version after the step.
    pub version: u64,
    /// Over every finished episode the step saw (groups trained and groups skipped).
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub reward_mean: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub reward_std: f64,
    /// Task accuracy, where the task reports one (set by the caller).
    pub accuracy: Option<f64>,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub loss: f64,
    /// Mean k3 KL to the reference (when there is one).
    pub kl: Option<f64>,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub entropy: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub clip_frac: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub is_weight_mean: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub is_capped_frac: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub grad_norm: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub lr: f64,
    /// Sampled tokens trained on.
    pub tokens_trained: usize,
    /// Row tokens run through the model.
    pub tokens_computed: usize,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "crate::base::json::f64_or_nan")]
    pub seconds: f64,
    pub groups: usize,
    pub episodes: usize,
    pub skipped_groups: usize,
    pub dropped_short_groups: usize,
    pub aborted_episodes: usize,
    pub dropped_stale_calls: usize,
    /// Calls by staleness (versions behind at training time).
    pub staleness: BTreeMap<u64, usize>,
    /// False when nothing was trainable (no optimizer step, version unchanged).
    pub trained: bool,
    /// Training-group members whose gradients the step summed (0: a trainer alone).
    #[serde(default)]
    pub members: usize,
    /// The gradient all-reduce's seconds.
    #[serde(default, deserialize_with = "crate::base::json::f64_or_nan")]
    pub allreduce_seconds: f64,
    /// blake3 of the parameters after the step, hex (set by a group member: every member
    /// of a group writes the same).
    #[serde(default)]
    pub param_hash: Option<String>,
    /// Optimizer updates the step took (PPO epochs x mini-batches that had tokens).
    #[serde(default)]
    pub updates: usize,
    /// Updates refused for a non-finite loss or gradient (NaN or infinite): nothing of
    /// them reached the weights or the optimizer's moments.
    #[serde(default)]
    pub nonfinite_updates: usize,
    /// Why the step packed rows otherwise than configured (Qwen3.5's linear-attention
    /// layers take the linear layout, not the tree).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout_fallback: Option<String>,
}

/// What a step's metrics say when Qwen3.5's layers made the trainer leave the tree layout.
const LINEAR_FALLBACK: &str = "linear layout: the tree layout's shared prefixes would need \
     the linear-attention layers' states at each branch point, which are not forked yet";

impl StepMetrics {
    /// One compact progress line.
    pub fn line(&self) -> String {
        let acc = self
            .accuracy
            .map(|a| format!(" acc {:.3}", a))
            .unwrap_or_default();
        let kl = self.kl.map(|k| format!(" kl {k:.4}")).unwrap_or_default();
        let refused = match self.nonfinite_updates {
            0 => String::new(),
            n => format!(" REFUSED {n} non-finite update(s)"),
        };
        format!(
            "step {:>4} v{} reward {:.3}±{:.3}{acc} loss {:+.4}{kl} ent {:.3} clip {:.3} gnorm {:.3} lr {:.2e} tok {} ({:.0}/s) groups {} skip {} stale {} {:.1}s{refused}",
            self.step,
            self.version,
            self.reward_mean,
            self.reward_std,
            self.loss,
            self.entropy,
            self.clip_frac,
            self.grad_norm,
            self.lr,
            self.tokens_trained,
            self.tokens_per_s,
            self.groups,
            self.skipped_groups,
            self.dropped_stale_calls,
            self.seconds
        )
    }
}

/// What [`Trainer::prepare`] made of a step's groups: the rows this trainer computes.
pub struct Prepared {
    m: StepMetrics,
    rows: Vec<PackedRow>,
    seq_of: BTreeMap<u32, i64>,
    seq_len: HashMap<u32, usize>,
    rewards: Vec<f64>,
    t0: Instant,
}

/// One trainer's share of a step: its unnormalised flat gradient (parameters in
/// [`Llama::parameters`] order) and its [`Stat`] sums. Both are summed across a group.
#[derive(Debug, Clone)]
pub struct LocalGradient {
    pub grad: Vec<f32>,
    pub stats: Vec<f32>,
}

/// The sums a step's members add up besides the gradient (indices into
/// [`LocalGradient::stats`]); they give the group's loss normaliser and its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    Tokens,
    Seqs,
    Loss,
    Entropy,
    Kl,
    Clipped,
    IsWeight,
    IsCapped,
    RewardSum,
    RewardSq,
    Rewards,
    TokensComputed,
    Groups,
    Episodes,
    Skipped,
    Stale,
}

impl Stat {
    pub const COUNT: usize = 16;
}

/// The trainer's tensors by role (gradients come on top: as many bytes as the trained
/// parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainerMemory {
    pub base_bytes: usize,
    /// Whether the base is what is trained (no adapter).
    pub base_trained: bool,
    pub trained_values: usize,
    pub trained_bytes: usize,
    pub moment_bytes: usize,
}

impl std::fmt::Display for TrainerMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |b: usize| b as f64 / (1 << 20) as f64;
        let total = self.moment_bytes
            + 2 * self.trained_bytes
            + if self.base_trained {
                0
            } else {
                self.base_bytes
            };
        write!(
            f,
            "{:.1} MiB: base {:.1} MiB ({}), trained {} values ({:.2} MiB, the same again for \
             gradients), AdamW moments {:.2} MiB",
            mb(total),
            mb(self.base_bytes),
            if self.base_trained {
                "trained"
            } else {
                "frozen"
            },
            self.trained_values,
            mb(self.trained_bytes),
            mb(self.moment_bytes)
        )
    }
}

pub struct Trainer {
    pub model: Llama,
    /// The frozen reference for the KL term (needed when `loss.kl_coef` is not 0, unless
    /// the model has a LoRA adapter: then its base, the adapter switched off, is the
    /// reference, with no second model).
    pub reference: Option<Llama>,
    pub opt: AdamW,
    pub cfg: TrainerConfig,
    version: u64,
    step: u64,
}

impl Trainer {
    /// Trains `model` (made trainable here); `reference` is needed for a KL term.
    pub fn new(
        mut model: Llama,
        reference: Option<Llama>,
        cfg: TrainerConfig,
    ) -> Result<Trainer, TrainError> {
        if cfg.loss.kl_coef != 0.0 && reference.is_none() && model.adapter().is_none() {
            return Err(TrainError::Invalid(
                "kl_coef is set: a reference model is needed (or a LoRA adapter, whose base \
                 is the reference)"
                    .into(),
            ));
        }
        model.set_trainable(true);
        if cfg.bf16 {
            model.set_compute_kind(Some(Kind::BFloat16))?;
        }
        let mut cfg = cfg;
        if model.has_linear_layers() && cfg.layout == Layout::Tree {
            tracing::warn!("{LINEAR_FALLBACK}");
            cfg.layout = Layout::Linear;
            cfg.layout_fallback = true;
        }
        let opt = AdamW::new(model.parameters(), cfg.optim.clone());
        Ok(Trainer {
            model,
            reference,
            opt,
            cfg,
            version: 0,
            step: 0,
        })
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// What the trainer holds: the base, the trained parameters, and AdamW's moments.
    pub fn memory(&self) -> TrainerMemory {
        let bytes = |ts: &[Tensor]| -> usize {
            ts.iter()
                .map(|t| t.numel() * t.kind().elt_size_in_bytes())
                .sum()
        };
        let trained = self.model.parameters();
        let values: usize = trained.iter().map(Tensor::numel).sum();
        TrainerMemory {
            base_bytes: bytes(&self.model.base_parameters()),
            base_trained: self.model.adapter().is_none(),
            trained_values: values,
            trained_bytes: bytes(&trained),
            // AdamW's two float32 moments per value (allocated at the first update; not
            // asked of the optimizer, which would allocate them to answer).
            moment_bytes: 2 * 4 * values,
        }
    }

    /// Whether steps score a KL reference: a reference model, or a LoRA adapter's base
    /// when the KL term is on.
    fn has_reference(&self) -> bool {
        self.reference.is_some() || (self.model.adapter().is_some() && self.cfg.loss.kl_coef != 0.0)
    }

    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Restores counters (from a checkpoint).
    pub fn set_counters(&mut self, step: u64, version: u64) {
        self.step = step;
        self.version = version;
    }

    /// Optimizer updates per step.
    pub fn updates_per_step(&self) -> usize {
        self.cfg.ppo_epochs.max(1) * self.cfg.mini_batches.max(1)
    }

    /// One training step over `groups` (from [`super::groups::GroupBuffer::take_ready`],
    /// whose report is folded into the metrics): with one update per step,
    /// [`Trainer::prepare`], [`Trainer::gradient`] and [`Trainer::apply`] with nobody
    /// else's sums; otherwise the PPO epochs (see the module docs).
    pub fn step(
        &mut self,
        groups: &[Group],
        report: &ReadyReport,
    ) -> Result<StepMetrics, TrainError> {
        if self.updates_per_step() > 1 {
            return self.ppo_step(groups, report);
        }
        let p = self.prepare(groups, report)?;
        let stats = self.local_backward(&p, None)?;
        // The parameters' own gradients are the sum: no flat copy.
        let mut grads: Vec<Tensor> = self.model.parameters().iter().map(|t| t.grad()).collect();
        let m = self.finish(p, &mut grads, &stats);
        tch::no_grad(|| {
            for g in &mut grads {
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        });
        m
    }

    /// The number of values in a flat gradient ([`LocalGradient::grad`]).
    pub fn gradient_len(&self) -> usize {
        self.model.parameters().iter().map(Tensor::numel).sum()
    }

    /// A step's first part: packs `groups` into rows, drops stale calls, and counts what
    /// this trainer will contribute. Runs no model.
    pub fn prepare(&self, groups: &[Group], report: &ReadyReport) -> Result<Prepared, TrainError> {
        let t0 = Instant::now();
        let mut m = StepMetrics {
            step: self.step,
            groups: groups.len(),
            episodes: groups.iter().map(|g| g.episodes.len()).sum(),
            skipped_groups: report.skipped_equal,
            dropped_short_groups: report.dropped_short,
            aborted_episodes: report.aborted,
            layout_fallback: self
                .cfg
                .layout_fallback
                .then(|| LINEAR_FALLBACK.to_string()),
            ..Default::default()
        };
        let rewards: Vec<f64> = groups
            .iter()
            .flat_map(|g| {
                g.episodes
                    .iter()
                    .filter_map(|e| e.reward_for(&self.cfg.model_name))
            })
            .chain(report.skipped_rewards.iter().copied())
            .collect();
        let batch: Vec<(&Episode, f32)> = groups
            .iter()
            .flat_map(|g| {
                g.episodes
                    .iter()
                    .zip(&g.advantages)
                    .map(|(e, &a)| (e, a as f32))
            })
            .collect();
        let mut rows = if batch.is_empty() {
            Vec::new()
        } else {
            pack(
                &self.cfg.model_name,
                &batch,
                self.cfg.layout,
                self.cfg.micro_batch_tokens,
            )?
        };
        // Staleness: per call (episode, call index), versions behind now.
        let mut calls: HashMap<(u32, u32), u64> = HashMap::new();
        for r in &rows {
            for t in &r.targets {
                calls.insert((t.key.episode, t.key.call), t.version);
            }
        }
        let now = self.version;
        for v in calls.values() {
            *m.staleness.entry(now.saturating_sub(*v)).or_default() += 1;
        }
        if let Some(max) = self.cfg.max_staleness {
            m.dropped_stale_calls = calls
                .values()
                .filter(|&&v| now.saturating_sub(v) > max)
                .count();
            for r in &mut rows {
                r.targets.retain(|t| now.saturating_sub(t.version) <= max);
            }
            rows.retain(|r| !r.targets.is_empty());
        }
        // Sequences (episodes) and their target counts over this trainer's rows.
        let mut seq_of: BTreeMap<u32, i64> = BTreeMap::new();
        let mut seq_len: HashMap<u32, usize> = HashMap::new();
        for r in &rows {
            for t in &r.targets {
                let next = seq_of.len() as i64;
                seq_of.entry(t.key.episode).or_insert(next);
                *seq_len.entry(t.key.episode).or_default() += 1;
            }
        }
        m.tokens_computed = rows.iter().map(PackedRow::len).sum();
        Ok(Prepared {
            m,
            rows,
            seq_of,
            seq_len,
            rewards,
            t0,
        })
    }

    /// A step's second part: this trainer's gradient of the UNNORMALISED loss (the sum
    /// over its tokens, or over its sequences' token means) as one flat vector, and its
    /// [`Stat`] sums. The parameters' own gradients are left zeroed. Members of a group add
    /// these up (any order of machines, the same bytes everywhere) before
    /// [`Trainer::apply`]; the loss is linear in its normaliser, so dividing the sum by
    /// the group's count is the gradient of one trainer on the union of the batches.
    pub fn gradient(&self, p: &Prepared) -> Result<LocalGradient, TrainError> {
        if self.updates_per_step() > 1 {
            return Err(TrainError::Invalid(format!(
                "a step of {} updates (PPO epochs x mini-batches) is not one gradient to sum",
                self.updates_per_step()
            )));
        }
        let stats = self.local_backward(p, None)?;
        let params = self.model.parameters();
        let mut grad = vec![0f32; params.iter().map(Tensor::numel).sum()];
        let mut at = 0;
        tch::no_grad(|| -> Result<(), TrainError> {
            for t in &params {
                let n = t.numel();
                let mut g = t.grad();
                if g.defined() {
                    let flat = g
                        .to_kind(Kind::Float)
                        .to_device(tch::Device::Cpu)
                        .contiguous();
                    flat.f_copy_data(&mut grad[at..at + n], n)?;
                    let _ = g.zero_();
                }
                at += n;
            }
            Ok(())
        })?;
        Ok(LocalGradient { grad, stats })
    }

    /// Backward over `p`'s rows (gradients accumulate, unnormalised, in the
    /// parameters) and this trainer's [`Stat`] sums; `old`: each row's log-probabilities
    /// under the policy the update started from (none: the current one).
    fn local_backward(&self, p: &Prepared, old: Option<&[Tensor]>) -> Result<Vec<f32>, TrainError> {
        let mut stats = vec![0f32; Stat::COUNT];
        let sums = self.backward_rows(p, old, &mut stats)?;
        let rewards = &p.rewards;
        let m = &p.m;
        for (k, v) in [
            (Stat::Tokens, sums.tokens),
            (Stat::Seqs, p.seq_of.len() as f64),
            (Stat::Entropy, sums.entropy),
            (Stat::Kl, sums.kl),
            (Stat::Clipped, sums.clipped),
            (Stat::IsWeight, sums.is_weight),
            (Stat::IsCapped, sums.is_capped),
            (Stat::RewardSum, rewards.iter().sum()),
            (Stat::RewardSq, rewards.iter().map(|r| r * r).sum()),
            (Stat::Rewards, rewards.len() as f64),
            (Stat::TokensComputed, m.tokens_computed as f64),
            (Stat::Groups, m.groups as f64),
            (Stat::Episodes, m.episodes as f64),
            (Stat::Skipped, m.skipped_groups as f64),
            (Stat::Stale, m.dropped_stale_calls as f64),
        ] {
            stats[k as usize] += v as f32;
        }
        Ok(stats)
    }

    /// A step's last part: AdamW on `grad` (the group's sum of [`LocalGradient::grad`])
    /// divided by the group's count from `stats` (the sum of the stats). Every member that
    /// applies the same bytes gets the same parameters. With no token trained anywhere
    /// the step still counts (the schedule moves on) and the weights and version stay.
    pub fn apply(
        &mut self,
        p: Prepared,
        grad: &[f32],
        stats: &[f32],
    ) -> Result<StepMetrics, TrainError> {
        let params = self.model.parameters();
        let total: usize = params.iter().map(Tensor::numel).sum();
        if grad.len() != total {
            return Err(TrainError::Invalid(format!(
                "a summed gradient of {} values for {total} parameter values",
                grad.len()
            )));
        }
        let mut grads = Vec::with_capacity(params.len());
        let mut at = 0;
        for t in &params {
            let n = t.numel();
            grads.push(
                Tensor::from_slice(&grad[at..at + n])
                    .view(t.size().as_slice())
                    .to_device(t.device()),
            );
            at += n;
        }
        self.finish(p, &mut grads, stats)
    }

    /// AdamW on `grads` (sums, divided here by the normaliser from `stats`), the counters
    /// and the metrics.
    fn finish(
        &mut self,
        p: Prepared,
        grads: &mut [Tensor],
        stats: &[f32],
    ) -> Result<StepMetrics, TrainError> {
        let mut m = p.m;
        let st = |k: Stat| stats.get(k as usize).copied().unwrap_or(0.0) as f64;
        m.lr = learning_rate(
            self.cfg.optim.lr,
            self.cfg.warmup_steps,
            self.cfg.schedule,
            self.step,
        );
        let rewards = st(Stat::Rewards);
        if rewards > 0.0 {
            m.reward_mean = st(Stat::RewardSum) / rewards;
            m.reward_std = (st(Stat::RewardSq) / rewards - m.reward_mean.powi(2))
                .max(0.0)
                .sqrt();
        }
        m.groups = st(Stat::Groups) as usize;
        m.episodes = st(Stat::Episodes) as usize;
        m.skipped_groups = st(Stat::Skipped) as usize;
        m.dropped_stale_calls = st(Stat::Stale) as usize;
        m.tokens_computed = st(Stat::TokensComputed) as usize;
        let tokens = st(Stat::Tokens);
        m.tokens_trained = tokens as usize;
        if tokens == 0.0 {
            self.step += 1;
            m.step = self.step;
            m.version = self.version;
            m.seconds = p.t0.elapsed().as_secs_f64();
            return Ok(m);
        }
        let norm = match self.cfg.loss.normalization {
            Normalization::Token => tokens,
            Normalization::Sequence => st(Stat::Seqs),
        }
        .max(1.0);
        self.opt.cfg.lr = m.lr;
        m.loss = st(Stat::Loss) / norm;
        // A non-finite loss or gradient (from any member: `grad` is the group's sum) is
        // refused: the weights, moments and version stay, the schedule moves on, and
        // every member of a group decides the same from the same sum.
        m.grad_norm = if m.loss.is_finite() {
            self.update(grads, norm)
        } else {
            f64::NAN
        };
        if !m.grad_norm.is_finite() {
            self.step += 1;
            m.step = self.step;
            m.version = self.version;
            m.nonfinite_updates = 1;
            m.seconds = p.t0.elapsed().as_secs_f64();
            tracing::warn!(
                step = m.step,
                loss = m.loss,
                grad_norm = m.grad_norm,
                "a non-finite loss or gradient: the update is refused, the weights stay"
            );
            return Ok(m);
        }
        self.step += 1;
        self.version += 1;
        if let tch::Device::Cuda(i) = self.model.device() {
            tch::Cuda::synchronize(i as i64);
        }
        m.trained = true;
        m.updates = 1;
        m.step = self.step;
        m.version = self.version;
        m.entropy = st(Stat::Entropy) / tokens;
        m.kl = self.has_reference().then(|| st(Stat::Kl) / tokens);
        m.clip_frac = st(Stat::Clipped) / tokens;
        m.is_weight_mean = st(Stat::IsWeight) / tokens;
        m.is_capped_frac = st(Stat::IsCapped) / tokens;
        m.seconds = p.t0.elapsed().as_secs_f64();
        m.tokens_per_s = m.tokens_computed as f64 / m.seconds.max(1e-9);
        Ok(m)
    }

    /// One AdamW update on `grads` (sums) divided by `norm`; the gradient norm.
    fn update(&mut self, grads: &mut [Tensor], norm: f64) -> f64 {
        tch::no_grad(|| {
            for g in grads.iter_mut() {
                if g.defined() {
                    let _ = g.g_div_scalar_(norm);
                }
            }
        });
        self.opt.step_with(grads)
    }

    /// Each target's log-probability under the current policy and its transform (in
    /// `row.targets` order, float32 `[targets]`), without gradients: the "old"
    /// log-probabilities of a PPO step, and what importance weights compare with the
    /// behaviour log-probabilities.
    pub fn score_row(&self, row: &PackedRow) -> Result<Tensor, TrainError> {
        let _share = compute_share();
        let _g = tch::no_grad_guard();
        let dev = self.model.device();
        let long = |v: Vec<i64>| Tensor::from_slice(&v).to_device(dev);
        let ids = long(row.tokens.iter().map(|&t| t as i64).collect());
        let pos = long(row.positions.iter().map(|&p| p as i64).collect());
        let from = long(row.targets.iter().map(|t| t.from as i64).collect());
        let tok = long(row.targets.iter().map(|t| t.token as i64).collect());
        let h = self
            .model
            .forward_row_hidden(&ids, &pos, &row.parent, Some(&from))?;
        let tr = row_transform(row, dev);
        Ok(agentjet_kernels::logprobs::token_logprobs(
            &h,
            &head_weight(&self.model, &h)?,
            &tok,
            self.cfg.logprob_chunk,
            false,
            tr.as_ref(),
        )?
        .logprobs)
    }

    /// A step of E passes over M mini-batches (see the module docs).
    fn ppo_step(
        &mut self,
        groups: &[Group],
        report: &ReadyReport,
    ) -> Result<StepMetrics, TrainError> {
        let t0 = Instant::now();
        let parts_n = self.cfg.mini_batches.max(1).min(groups.len().max(1));
        let mut parts: Vec<Vec<Group>> = vec![Vec::new(); parts_n];
        for (i, g) in groups.iter().enumerate() {
            parts[i % parts_n].push(g.clone());
        }
        // The report's counts once (on an empty part), the parts' own rows.
        let mut m = self.prepare(&[], report)?.m;
        // Every rollout's reward: the skipped groups' and the parts'.
        let mut all_rewards: Vec<f64> = report.skipped_rewards.clone();
        let mut prepared = Vec::with_capacity(parts_n);
        for part in &parts {
            let p = self.prepare(part, &ReadyReport::default())?;
            let old = p
                .rows
                .iter()
                .map(|r| self.score_row(r))
                .collect::<Result<Vec<_>, _>>()?;
            m.groups += p.m.groups;
            m.episodes += p.m.episodes;
            m.dropped_stale_calls += p.m.dropped_stale_calls;
            m.tokens_computed += p.m.tokens_computed;
            for (k, v) in &p.m.staleness {
                *m.staleness.entry(*k).or_default() += v;
            }
            all_rewards.extend_from_slice(&p.rewards);
            prepared.push((p, old));
        }
        let n = all_rewards.len().max(1) as f64;
        if !all_rewards.is_empty() {
            m.reward_mean = all_rewards.iter().sum::<f64>() / n;
            m.reward_std = (all_rewards.iter().map(|r| r * r).sum::<f64>() / n
                - m.reward_mean.powi(2))
            .max(0.0)
            .sqrt();
        }
        m.lr = learning_rate(
            self.cfg.optim.lr,
            self.cfg.warmup_steps,
            self.cfg.schedule,
            self.step,
        );
        self.opt.cfg.lr = m.lr;
        let mut sums = LossSums::default();
        let (mut loss, mut gnorm) = (0.0, 0.0);
        for _epoch in 0..self.cfg.ppo_epochs.max(1) {
            for (p, old) in &prepared {
                if p.rows.is_empty() {
                    continue;
                }
                let mut stats = vec![0f32; Stat::COUNT];
                let s = self.backward_rows(p, Some(old), &mut stats)?;
                let norm = match self.cfg.loss.normalization {
                    Normalization::Token => s.tokens,
                    Normalization::Sequence => p.seq_of.len() as f64,
                }
                .max(1.0);
                let mut grads: Vec<Tensor> =
                    self.model.parameters().iter().map(|t| t.grad()).collect();
                let l = stats[Stat::Loss as usize] as f64 / norm;
                let g = if l.is_finite() {
                    self.update(&mut grads, norm)
                } else {
                    f64::NAN
                };
                tch::no_grad(|| {
                    for g in &mut grads {
                        if g.defined() {
                            let _ = g.zero_();
                        }
                    }
                });
                if !g.is_finite() {
                    // Refused (see `finish`); the next mini-batch starts from the same
                    // weights.
                    m.nonfinite_updates += 1;
                    tracing::warn!(
                        step = self.step + 1,
                        loss = l,
                        grad_norm = g,
                        "a non-finite loss or gradient: the update is refused, the weights stay"
                    );
                    continue;
                }
                gnorm += g;
                loss += l;
                sums.add(&s);
                m.updates += 1;
            }
        }
        self.step += 1;
        m.step = self.step;
        if m.updates > 0 {
            self.version += 1;
            if let tch::Device::Cuda(i) = self.model.device() {
                tch::Cuda::synchronize(i as i64);
            }
            let (u, tokens) = (m.updates as f64, sums.tokens.max(1.0));
            m.trained = true;
            m.loss = loss / u;
            m.grad_norm = gnorm / u;
            m.entropy = sums.entropy / tokens;
            m.kl = self.has_reference().then(|| sums.kl / tokens);
            m.clip_frac = sums.clipped / tokens;
            m.is_weight_mean = sums.is_weight / tokens;
            m.is_capped_frac = sums.is_capped / tokens;
            m.tokens_trained = (sums.tokens / self.cfg.ppo_epochs.max(1) as f64).round() as usize;
        }
        m.version = self.version;
        m.seconds = t0.elapsed().as_secs_f64();
        m.tokens_per_s =
            m.tokens_computed as f64 * self.cfg.ppo_epochs.max(1) as f64 / m.seconds.max(1e-9);
        Ok(m)
    }

    /// Forward and backward of every row of `p` (gradients accumulate in the parameters);
    /// the loss sum goes into `stats`.
    fn backward_rows(
        &self,
        p: &Prepared,
        old: Option<&[Tensor]>,
        stats: &mut [f32],
    ) -> Result<LossSums, TrainError> {
        // Unnormalised: the count is applied to the group's sum in `apply`.
        let counts = BatchCounts {
            tokens: 1.0,
            seqs: 1.0,
        };
        let mut sums = LossSums::default();
        let mut loss_total = 0.0;
        for (i, row) in p.rows.iter().enumerate() {
            let old_row = old.and_then(|o| o.get(i));
            let (loss, s) = self.row_backward(row, old_row, &p.seq_of, &p.seq_len, counts)?;
            loss_total += loss;
            sums.add(&s);
        }
        stats[Stat::Loss as usize] += loss_total as f32;
        Ok(sums)
    }

    /// Forward, loss and backward of one row; returns its share of the loss and its sums.
    fn row_backward(
        &self,
        row: &PackedRow,
        old: Option<&Tensor>,
        seq_of: &BTreeMap<u32, i64>,
        seq_len: &HashMap<u32, usize>,
        counts: BatchCounts,
    ) -> Result<(f64, LossSums), TrainError> {
        let _share = compute_share();
        let dev = self.model.device();
        let long = |v: Vec<i64>| Tensor::from_slice(&v).to_device(dev);
        let float = |v: Vec<f32>| Tensor::from_slice(&v).to_device(dev);
        let ids = long(row.tokens.iter().map(|&t| t as i64).collect());
        let pos = long(row.positions.iter().map(|&p| p as i64).collect());
        let from = long(row.targets.iter().map(|t| t.from as i64).collect());
        let tok = long(row.targets.iter().map(|t| t.token as i64).collect());
        let seq = long(row.targets.iter().map(|t| seq_of[&t.key.episode]).collect());
        let lens = float(
            row.targets
                .iter()
                .map(|t| seq_len[&t.key.episode] as f32)
                .collect(),
        );
        let beh = float(row.targets.iter().map(|t| t.behaviour_logprob).collect());
        let adv = float(row.targets.iter().map(|t| t.advantage).collect());
        let h = self
            .model
            .forward_row_hidden(&ids, &pos, &row.parent, Some(&from))?;
        let w = head_weight(&self.model, &h)?;
        let hd = h.detach();
        let wd = w.detach();
        let chunk = self.cfg.logprob_chunk;
        let tr = row_transform(row, dev);
        let out =
            agentjet_kernels::logprobs::token_logprobs(&hd, &wd, &tok, chunk, true, tr.as_ref())?;
        let reference = match (&self.reference, self.has_reference()) {
            (_, false) => None,
            (r, true) => {
                let _g = tch::no_grad_guard();
                // A separate reference model, or this model's base (adapter off).
                let r = r.as_ref().unwrap_or(&self.model);
                let rh = r.without_adapter(|| {
                    r.forward_row_hidden(&ids, &pos, &row.parent, Some(&from))
                })?;
                Some(
                    agentjet_kernels::logprobs::token_logprobs(
                        &rh,
                        &head_weight(r, &rh)?,
                        &tok,
                        chunk,
                        false,
                        tr.as_ref(),
                    )?
                    .logprobs,
                )
            }
        };
        let lp_leaf = out.logprobs.detach().set_requires_grad(true);
        let ent_leaf = out
            .entropy
            .as_ref()
            .map(|e| e.detach().set_requires_grad(true));
        let (loss, sums) = policy_loss(
            &self.cfg.loss,
            &LossInputs {
                logprobs: &lp_leaf,
                old_logprobs: old,
                behaviour_logprobs: &beh,
                advantages: &adv,
                seq: &seq,
                seq_count: seq_of.len() as i64,
                seq_len: &lens,
                reference_logprobs: reference.as_ref(),
                entropy: ent_leaf.as_ref(),
            },
            counts,
        )?;
        let mut leaves = vec![&lp_leaf];
        if let (Some(e), true) = (&ent_leaf, self.cfg.loss.entropy_coef != 0.0) {
            leaves.push(e);
        }
        let grads = Tensor::run_backward(&[&loss], &leaves, false, false);
        let g_ent = if grads.len() > 1 && grads[1].defined() {
            Some(&grads[1])
        } else {
            None
        };
        let g_lp = if grads[0].defined() {
            grads[0].shallow_clone()
        } else {
            lp_leaf.zeros_like()
        };
        // One backward through the model: ∂L/∂h into the layers, ∂L/∂W_out into the head
        // (the embedding too when tied), unless the head is frozen (a LoRA adapter's
        // base): then no [vocabulary x hidden] gradient is computed at all.
        let lp = agentjet_kernels::logprobs::token_logprobs_backward_h;
        let (gh, gw) = if w.requires_grad() {
            let (gh, gw) = agentjet_kernels::logprobs::token_logprobs_backward(
                &hd,
                &wd,
                &tok,
                &g_lp,
                g_ent,
                chunk,
                tr.as_ref(),
            )?;
            (gh, Some(gw))
        } else {
            (lp(&hd, &wd, &tok, &g_lp, g_ent, chunk, tr.as_ref())?, None)
        };
        let mut surrogate = (&h * gh).sum(Kind::Float);
        if let Some(gw) = gw {
            surrogate += (&w * gw).sum(Kind::Float);
        }
        surrogate.backward();
        Ok((loss.double_value(&[]), sums))
    }
}

/// The output layer's weight in the kind of the hidden states `h`: a frozen bfloat16
/// base under a LoRA adapter computes its hidden states in float32.
fn head_weight(model: &Llama, h: &Tensor) -> Result<Tensor, TrainError> {
    let w = model.output_weight();
    Ok(if w.kind() == h.kind() {
        w.shallow_clone()
    } else {
        w.f_to_kind(h.kind())?
    })
}

/// The transform of `row`'s targets for the log-probability kernel: none when every
/// target is scored under the raw softmax (T = 1, untruncated).
fn row_transform(row: &PackedRow, dev: tch::Device) -> Option<Transform> {
    let ts = &row.targets;
    let truncates = ts.iter().any(|t| t.sampling.truncates());
    if !truncates && ts.iter().all(|t| t.sampling.scoring_temperature() == 1.0) {
        return None;
    }
    let f32s = |v: Vec<f32>| Tensor::from_slice(&v).to_device(dev);
    let inv_temperature = f32s(
        ts.iter()
            .map(|t| (1.0 / t.sampling.scoring_temperature()) as f32)
            .collect(),
    );
    let truncation = truncates.then(|| {
        // A target that does not truncate keeps every token (RAW's top_k 0, top_p 1, min_p 0).
        let cut: Vec<SamplingTransform> = ts
            .iter()
            .map(|t| {
                if t.sampling.truncates() {
                    t.sampling
                } else {
                    SamplingTransform::RAW
                }
            })
            .collect();
        Truncation {
            top_k: Tensor::from_slice(&cut.iter().map(|c| c.top_k as i64).collect::<Vec<_>>())
                .to_device(dev),
            top_p: f32s(cut.iter().map(|c| c.top_p as f32).collect()),
            min_p: f32s(cut.iter().map(|c| c.min_p as f32).collect()),
        }
    });
    Some(Transform {
        inv_temperature,
        truncation,
    })
}

/// This thread's LibTorch threads for one pass of a row: the trainer's share of the free
/// cores ([`crate::base::cores`]); the engine sees a trainer step while the guard lives.
fn compute_share() -> Busy<'static> {
    thread_local! {
        static SET: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }
    let c = cores();
    let busy = c.training();
    let n = c.for_trainer();
    if SET.with(|s| s.replace(n)) != n {
        tch::set_num_threads(n as i32);
    }
    busy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let cos = Schedule::Cosine {
            total_steps: 12,
            min_ratio: 0.1,
        };
        assert!((learning_rate(1.0, 2, cos, 0) - 0.5).abs() < 1e-12);
        assert!((learning_rate(1.0, 2, cos, 1) - 1.0).abs() < 1e-12);
        assert!((learning_rate(1.0, 2, cos, 2) - 1.0).abs() < 1e-12);
        // Halfway through the 10 cosine steps: 0.1 + 0.9 * 0.5.
        assert!((learning_rate(1.0, 2, cos, 7) - 0.55).abs() < 1e-12);
        assert!((learning_rate(1.0, 2, cos, 12) - 0.1).abs() < 1e-12);
        assert!((learning_rate(1.0, 2, cos, 50) - 0.1).abs() < 1e-12);
        assert_eq!(learning_rate(3e-4, 0, Schedule::Constant, 9), 3e-4);
    }
}
