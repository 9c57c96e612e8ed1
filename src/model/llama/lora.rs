//! LoRA adapters on a frozen base: `W x + s · B (A x)` on any of the seven linear layers of
//! a decoder layer (q, k, v, o, gate, up, down), rank r, scale `s = alpha / r` (rsLoRA:
//! `alpha / √r`). A is [r, in], B is [out, r], both float32 whatever the base's dtype (the
//! base may stay in its serving dtype). A starts as PEFT's (Kaiming-uniform, bound
//! `1/√in`), B at zero, so a new adapter leaves every output unchanged.
//!
//! Owns: the adapter's tensors, their HF/PEFT names and layouts, and the low-rank terms
//! added after the base's fused products. Paths without an adapter run no extra work.
//! The q and k rows of B are kept in the decoder's rotary-pair order (as the fused q/k/v
//! matrix is) and converted at the PEFT boundary.

use std::cell::{Cell, RefCell};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::base::rng::Rng;
use crate::model::config::LlamaConfig;
use crate::model::weights::{from_interleaved_rotary, to_interleaved_rotary};
use crate::model::ModelError;

/// A linear layer an adapter may target, in the order of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Target {
    #[serde(rename = "q_proj")]
    Q,
    #[serde(rename = "k_proj")]
    K,
    #[serde(rename = "v_proj")]
    V,
    #[serde(rename = "o_proj")]
    O,
    #[serde(rename = "gate_proj")]
    Gate,
    #[serde(rename = "up_proj")]
    Up,
    #[serde(rename = "down_proj")]
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// HF's module name (PEFT's `target_modules`).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer.
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// `q`, `q_proj` or `self_attn.q_proj` (and so on).
    pub fn parse(s: &str) -> Option<Target> {
        let s = s.trim();
        Target::ALL
            .into_iter()
            .find(|t| s == t.name() || s == t.module() || Some(s) == t.name().strip_suffix("_proj"))
    }

    /// A comma-separated list (`all` for every target); duplicates are merged.
    pub fn parse_list(s: &str) -> Result<Vec<Target>, String> {
        if s.trim() == "all" {
            return Ok(Target::ALL.to_vec());
        }
        let mut out = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let t = Target::parse(part).ok_or_else(|| {
                format!(
                    "unknown LoRA target {part:?}: expected some of q, k, v, o, gate, up, down \
                     (or all)"
                )
            })?;
            if !out.contains(&t) {
                out.push(t);
            }
        }
        if out.is_empty() {
            return Err("no LoRA target given".into());
        }
        out.sort();
        Ok(out)
    }

    fn index(self) -> usize {
        self as usize
    }

    /// `(in, out)` features of this layer in `c` (Qwen3.5's gated q_proj: query and gate
    /// rows, twice the heads' width).
    pub fn dims(self, c: &LlamaConfig) -> (i64, i64) {
        let (h, i, hd) = (
            c.hidden_size as i64,
            c.intermediate_size as i64,
            c.head_dim as i64,
        );
        let (nh, nkv) = (c.num_attention_heads as i64, c.num_key_value_heads as i64);
        match self {
            Target::Q if c.family.qwen35() => (h, 2 * nh * hd),
            Target::Q => (h, nh * hd),
            Target::K | Target::V => (h, nkv * hd),
            Target::O => (nh * hd, h),
            Target::Gate | Target::Up => (h, i),
            Target::Down => (i, h),
        }
    }

    /// Whether layer `l` of `c` has this module: Qwen3.5's linear-attention layers have
    /// no q/k/v/o (their projections are `linear_attn.*`, which PEFT's names do not
    /// reach), as PEFT skips a layer without the named module.
    pub fn in_layer(self, l: usize, c: &LlamaConfig) -> bool {
        !(c.is_linear(l) && matches!(self, Target::Q | Target::K | Target::V | Target::O))
    }

    /// Where this target's output rows (in the decoder's order, see [`decoder_rows`]) land
    /// in the output of the fused product holding it: `(from, to, rows)` runs. One run at
    /// the target's offset, except Qwen3.5's gated q_proj, whose gate rows come after v.
    fn runs(self, c: &LlamaConfig) -> Vec<(i64, i64, i64)> {
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let product = PRODUCTS
            .iter()
            .find(|p| p.contains(&self))
            .expect("every target is in a product");
        let at: i64 = product
            .iter()
            .take_while(|&&t| t != self)
            .map(|&t| if t == Target::Q { nh * hd } else { t.dims(c).1 })
            .sum();
        if self == Target::Q && c.family.qwen35() {
            return vec![(0, 0, nh * hd), (nh * hd, (nh + 2 * nkv) * hd, nh * hd)];
        }
        vec![(0, at, self.dims(c).1)]
    }
}

/// An adapter's shape and scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    pub targets: Vec<Target>,
    /// rsLoRA: scale `alpha / √rank` instead of `alpha / rank`.
    pub rslora: bool,
}

impl LoraConfig {
    /// Rank `rank` on every target, alpha 2 x rank.
    pub fn new(rank: usize) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            targets: Target::ALL.to_vec(),
            rslora: false,
        }
    }

    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Invalid(m));
        if self.rank == 0 || self.rank > 4096 {
            return bad(format!("LoRA rank {} is not in 1..=4096", self.rank));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad(format!(
                "LoRA alpha {} is not a positive number",
                self.alpha
            ));
        }
        if self.targets.is_empty() {
            return bad("a LoRA adapter needs at least one target".into());
        }
        Ok(())
    }
}

/// One layer's adapter: `(A, B)` per target, by [`Target::index`].
pub(super) struct LayerAdapter {
    parts: [Option<(Tensor, Tensor)>; 7],
}

/// The fused products of which a decoder layer runs four: q/k/v, o, gate/up and down.
pub(super) const PRODUCTS: [&[Target]; 4] = [
    &[Target::Q, Target::K, Target::V],
    &[Target::O],
    &[Target::Gate, Target::Up],
    &[Target::Down],
];

/// One fused product's adapter for serving: the targets' A stacked `[n·r, in]` and their
/// B as one block-diagonal matrix `[out, n·r]` with the scale folded in, so the low-rank
/// term is two matrix products whatever the number of targets.
struct Stacked {
    a: Tensor,
    b: Tensor,
}

/// A LoRA adapter over every decoder layer of one model.
pub struct Adapter {
    pub cfg: LoraConfig,
    scale: f64,
    layers: Vec<LayerAdapter>,
    /// Off: the base alone (the KL reference), without a second model.
    enabled: Cell<bool>,
    /// Serving mode ([`super::Llama::serve_stacked_adapter`]): the low-rank terms come from
    /// [`Stacked`] copies, built per layer and product at the first forward after the
    /// values last changed ([`Adapter::changed`]), in the activations' kind.
    serving: Cell<bool>,
    stacked: RefCell<Option<(Kind, Vec<LayerStacked>)>>,
    /// Counts [`Adapter::changed`] calls: copies made elsewhere (a bank's) compare it.
    generation: Cell<u64>,
    /// Merged serving ([`super::Llama::serve_merged_adapter`]): the base tensor of each
    /// product whose weight now holds `W + s·B·A`, by layer and [`PRODUCTS`] index. The
    /// adapter then adds no low-rank term of its own.
    merged: RefCell<Option<Vec<MergedBases>>>,
}

/// One layer's base weights under a merged adapter, by [`PRODUCTS`] index.
pub(super) type MergedBases = [Option<Tensor>; 4];

/// One layer's [`Stacked`] products, by [`PRODUCTS`] index.
type LayerStacked = [Option<Stacked>; 4];

/// A mixture-of-experts model's MLP targets are its experts, which adapters do not reach.
pub(crate) fn refuse_expert_targets(c: &LlamaConfig, targets: &[Target]) -> Result<(), ModelError> {
    let mlp = targets
        .iter()
        .filter(|t| matches!(t, Target::Gate | Target::Up | Target::Down))
        .map(|t| t.module())
        .collect::<Vec<_>>();
    if c.moe.is_some() && !mlp.is_empty() {
        return Err(ModelError::Invalid(format!(
            "LoRA on {} of a mixture-of-experts model is not supported (its experts are not \
             adapted): target the attention only (--lora-targets q,k,v,o)",
            mlp.join(", ")
        )));
    }
    Ok(())
}

impl Adapter {
    /// A new adapter for a model of config `c` on `device`: A drawn as PEFT does from
    /// `seed` (the same seed gives the same adapter everywhere), B zero.
    pub fn new(
        c: &LlamaConfig,
        cfg: LoraConfig,
        seed: u64,
        device: Device,
    ) -> Result<Adapter, ModelError> {
        cfg.validate()?;
        refuse_expert_targets(c, &cfg.targets)?;
        let r = cfg.rank as i64;
        let mut rng = Rng::seeded(seed ^ 0x4c6f_5241);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            let mut parts: [Option<(Tensor, Tensor)>; 7] = Default::default();
            for &t in cfg.targets.iter().filter(|t| t.in_layer(layers.len(), c)) {
                let (fan_in, out) = t.dims(c);
                let bound = 1.0 / (fan_in as f64).sqrt();
                let a: Vec<f32> = (0..r * fan_in)
                    .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
                    .collect();
                let a = Tensor::f_from_slice(&a)?
                    .f_view([r, fan_in])?
                    .f_to_device(device)?;
                let b = Tensor::f_zeros([out, r], (Kind::Float, device))?;
                parts[t.index()] = Some((a, b));
            }
            layers.push(LayerAdapter { parts });
        }
        Ok(Adapter {
            scale: cfg.scale(),
            cfg,
            layers,
            enabled: Cell::new(true),
            serving: Cell::new(false),
            stacked: RefCell::new(None),
            generation: Cell::new(0),
            merged: RefCell::new(None),
        })
    }

    /// The trainable tensors, layer by layer, target by target, A then B.
    pub fn tensors(&self) -> Vec<Tensor> {
        let mut out = Vec::new();
        for l in &self.layers {
            for (a, b) in l.parts.iter().flatten() {
                out.push(a.shallow_clone());
                out.push(b.shallow_clone());
            }
        }
        out
    }

    /// The number of trainable values.
    pub fn numel(&self) -> usize {
        self.tensors().iter().map(Tensor::numel).sum()
    }

    /// The tensors under PEFT's names (`base_model.model.model.layers.L.<module>.lora_A.weight`)
    /// in HF's row order, on the CPU.
    pub fn peft_tensors(&self, c: &LlamaConfig) -> Result<Vec<(String, Tensor)>, ModelError> {
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            for t in Target::ALL {
                let Some((a, b)) = &layer.parts[t.index()] else {
                    continue;
                };
                let b = hf_rows(t, b, c)?;
                let p = format!("base_model.model.model.layers.{l}.{}", t.module());
                out.push((
                    format!("{p}.lora_A.weight"),
                    a.f_detach()?.f_to_device(Device::Cpu)?,
                ));
                out.push((
                    format!("{p}.lora_B.weight"),
                    b.f_detach()?.f_to_device(Device::Cpu)?,
                ));
            }
        }
        Ok(out)
    }

    /// Sets this adapter's values from PEFT-named tensors (HF row order), checking that
    /// every tensor it has is there with its shape and nothing else is.
    pub fn load_peft(
        &self,
        c: &LlamaConfig,
        mut get: impl FnMut(&str) -> Option<Tensor>,
        file: &str,
    ) -> Result<(), ModelError> {
        if self.is_merged() {
            return Err(ModelError::Invalid(
                "this adapter is merged into its model's weights for serving: update it \
                 through the engine (`EngineHandle::update_weights`), which merges again"
                    .into(),
            ));
        }
        let _g = tch::no_grad_guard();
        for (l, layer) in self.layers.iter().enumerate() {
            for t in Target::ALL {
                let Some((a, b)) = &layer.parts[t.index()] else {
                    continue;
                };
                let p = format!("base_model.model.model.layers.{l}.{}", t.module());
                for (which, dst) in [("lora_A", a), ("lora_B", b)] {
                    let name = format!("{p}.{which}.weight");
                    // PEFT over a multimodal wrapper (`Qwen3_5ForConditionalGeneration`)
                    // names the language model's layers `model.language_model.layers`.
                    let wrapped =
                        name.replacen(".model.layers.", ".model.language_model.layers.", 1);
                    let src = get(&name).or_else(|| get(&wrapped));
                    let src = src.ok_or_else(|| ModelError::MissingTensor {
                        file: file.to_string(),
                        name: name.clone(),
                    })?;
                    if src.size() != dst.size() {
                        return Err(ModelError::ShapeMismatch {
                            file: file.to_string(),
                            name,
                            expected: dst.size(),
                            found: src.size(),
                        });
                    }
                    let src = src.f_to_kind(Kind::Float)?;
                    let src = if which == "lora_B" {
                        decoder_rows(t, &src, c)?
                    } else {
                        src
                    };
                    dst.shallow_clone().f_copy_(&src)?;
                }
            }
        }
        self.changed();
        Ok(())
    }

    /// `s · B A` of target `t` in layer `l` ([out, in], float32, HF row order), if it has one.
    pub(super) fn delta_weight(
        &self,
        l: usize,
        t: Target,
        c: &LlamaConfig,
    ) -> Result<Option<Tensor>, ModelError> {
        let Some((a, b)) = &self.layers[l].parts[t.index()] else {
            return Ok(None);
        };
        let d = b.f_matmul(a)?.f_mul_scalar(self.scale)?;
        Ok(Some(hf_rows(t, &d, c)?))
    }

    pub fn enabled(&self) -> bool {
        self.enabled.get()
    }

    /// Switches the adapter on or off; returns what it was.
    pub(super) fn set_enabled(&self, on: bool) -> bool {
        self.enabled.replace(on)
    }

    /// Serving mode: see [`super::Llama::serve_stacked_adapter`].
    pub(super) fn set_serving(&self) {
        self.serving.set(true);
        self.changed();
    }

    /// Call after the adapter's values were changed in place (a weight update): the
    /// serving path's stacked copies are rebuilt at the next forward.
    pub fn changed(&self) {
        self.stacked.replace(None);
        self.generation.set(self.generation.get() + 1);
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.get()
    }

    /// Whether this adapter is merged into its model's weights for serving.
    pub fn is_merged(&self) -> bool {
        self.merged.borrow().is_some()
    }

    pub(super) fn set_merged(&self, bases: Vec<MergedBases>) {
        self.merged.replace(Some(bases));
    }

    /// Ends merged serving: the base weights the merge replaced.
    pub(super) fn take_merged(&self) -> Option<Vec<MergedBases>> {
        self.merged.take()
    }

    /// The base weights a merge replaced (see [`Adapter::is_merged`]).
    pub(super) fn merged_bases(&self) -> std::cell::Ref<'_, Option<Vec<MergedBases>>> {
        self.merged.borrow()
    }

    /// Layer `l`'s stacked A `[n·r, in]` and block-diagonal scaled B `[out, n·r]` of
    /// product `p` (an index of [`PRODUCTS`]) in `kind`, or `None` if it has no target
    /// there.
    pub(super) fn stacked_product(
        &self,
        l: usize,
        p: usize,
        kind: Kind,
        c: &LlamaConfig,
    ) -> Result<Option<(Tensor, Tensor)>, ModelError> {
        let mut st = self.stacked.borrow_mut();
        if st.as_ref().is_none_or(|(k, _)| *k != kind) {
            *st = Some((kind, self.stack(kind, c)?));
        }
        Ok(st
            .as_ref()
            .and_then(|(_, v)| v[l][p].as_ref())
            .map(|s| (s.a.shallow_clone(), s.b.shallow_clone())))
    }

    /// Builds [`Stacked`] for every layer and product, in `kind`.
    fn stack(&self, kind: Kind, c: &LlamaConfig) -> Result<Vec<LayerStacked>, ModelError> {
        let _g = tch::no_grad_guard();
        let r = self.cfg.rank as i64;
        let mut out = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut per: LayerStacked = Default::default();
            for (p, targets) in PRODUCTS.iter().enumerate() {
                let present: Vec<(Target, &(Tensor, Tensor))> = targets
                    .iter()
                    .filter_map(|&t| layer.parts[t.index()].as_ref().map(|ab| (t, ab)))
                    .collect();
                if present.is_empty() {
                    continue;
                }
                let rows: i64 = targets.iter().map(|t| t.dims(c).1).sum();
                let n = present.len() as i64;
                let a = Tensor::f_cat(&present.iter().map(|(_, (a, _))| a).collect::<Vec<_>>(), 0)?;
                let dev = a.device();
                let b = Tensor::f_zeros([rows, n * r], (Kind::Float, dev))?;
                for (col, (t, (_, bt))) in present.iter().enumerate() {
                    let bt = bt.f_mul_scalar(self.scale)?;
                    for (from, to, len) in t.runs(c) {
                        b.f_narrow(0, to, len)?
                            .f_narrow(1, col as i64 * r, r)?
                            .f_copy_(&bt.f_narrow(0, from, len)?)?;
                    }
                }
                per[p] = Some(Stacked {
                    a: a.f_to_kind(kind)?.f_contiguous()?,
                    b: b.f_to_kind(kind)?.f_contiguous()?,
                });
            }
            out.push(per);
        }
        Ok(out)
    }

    /// The low-rank term of `targets` (whose outputs are concatenated in this order, as in
    /// a fused product) for input `x` [.., in], or `None` when no target has one (or the
    /// adapter is switched off).
    pub(super) fn delta(
        &self,
        l: usize,
        targets: &[Target],
        x: &Tensor,
        c: &LlamaConfig,
    ) -> Result<Option<Tensor>, ModelError> {
        if !self.enabled.get() || self.is_merged() {
            return Ok(None);
        }
        let parts = &self.layers[l].parts;
        if targets.iter().all(|t| parts[t.index()].is_none()) {
            return Ok(None);
        }
        let kind = x.kind();
        let serving = self.serving.get();
        if let (true, Some(p)) = (serving, PRODUCTS.iter().position(|&t| t == targets)) {
            // Serving: two products per fused layer from the stacked copies.
            let mut st = self.stacked.borrow_mut();
            if st.as_ref().is_none_or(|(k, _)| *k != kind) {
                *st = Some((kind, self.stack(kind, c)?));
            }
            let s = st.as_ref().and_then(|(_, v)| v[l][p].as_ref());
            let s = s.expect("a stacked product for a present target");
            return Ok(Some(
                x.f_linear(&s.a, None::<&Tensor>)?
                    .f_linear(&s.b, None::<&Tensor>)?,
            ));
        }
        let mut lead = x.size();
        lead.pop();
        // Each target's output, cut into its runs and put in the fused product's order.
        let mut runs: Vec<(i64, Tensor)> = Vec::with_capacity(targets.len() + 1);
        for &t in targets {
            let y = match &parts[t.index()] {
                Some((a, b)) => {
                    let (a, b) = if kind == Kind::Float {
                        (a.shallow_clone(), b.shallow_clone())
                    } else {
                        (a.f_to_kind(kind)?, b.f_to_kind(kind)?)
                    };
                    x.f_linear(&a, None::<&Tensor>)?
                        .f_linear(&b, None::<&Tensor>)?
                }
                None => {
                    let mut shape = lead.clone();
                    shape.push(t.dims(c).1);
                    Tensor::f_zeros(shape.as_slice(), (kind, x.device()))?
                }
            };
            for (from, to, len) in t.runs(c) {
                runs.push((to, y.f_narrow(-1, from, len)?));
            }
        }
        runs.sort_by_key(|(to, _)| *to);
        let mut outs: Vec<Tensor> = runs.into_iter().map(|(_, y)| y).collect();
        let d = if outs.len() == 1 {
            outs.pop().expect("one part")
        } else {
            Tensor::f_cat(&outs, -1)?
        };
        Ok(Some(d.f_mul_scalar(self.scale)?))
    }
}

/// `b` (rows of target `t`'s output) from the decoder's order to HF's. The decoder keeps
/// q and k rows with rotary pairs adjacent (only the rotated part of a head, for partial
/// rotary), and Qwen3.5's gated q_proj as all query rows then all gate rows, where HF
/// has each head's query rows followed by its gate rows.
fn hf_rows(t: Target, b: &Tensor, c: &LlamaConfig) -> Result<Tensor, ModelError> {
    let (nh, hd, rd) = (
        c.num_attention_heads as i64,
        c.head_dim as i64,
        c.rotary() as i64,
    );
    match t {
        Target::Q if c.family.qwen35() => {
            let q = from_interleaved_rotary(&b.f_narrow(0, 0, nh * hd)?, nh, hd, rd)?;
            let gate = b.f_narrow(0, nh * hd, nh * hd)?;
            let cols = b.size()[1];
            Ok(Tensor::f_stack(
                &[q.f_view([nh, hd, cols])?, gate.f_view([nh, hd, cols])?],
                1,
            )?
            .f_reshape([2 * nh * hd, cols])?)
        }
        Target::Q => from_interleaved_rotary(b, nh, hd, rd),
        Target::K => from_interleaved_rotary(b, c.num_key_value_heads as i64, hd, rd),
        _ => Ok(b.shallow_clone()),
    }
}

/// `b` from HF's row order to the decoder's (the inverse of [`hf_rows`]).
fn decoder_rows(t: Target, b: &Tensor, c: &LlamaConfig) -> Result<Tensor, ModelError> {
    let (nh, hd, rd) = (
        c.num_attention_heads as i64,
        c.head_dim as i64,
        c.rotary() as i64,
    );
    match t {
        Target::Q if c.family.qwen35() => {
            let cols = b.size()[1];
            let qg = b.f_reshape([nh, 2, hd, cols])?;
            let q = qg.f_select(1, 0)?.f_reshape([nh * hd, cols])?;
            let gate = qg.f_select(1, 1)?.f_reshape([nh * hd, cols])?;
            Ok(Tensor::f_cat(
                &[to_interleaved_rotary(&q, nh, hd, rd)?, gate],
                0,
            )?)
        }
        Target::Q => to_interleaved_rotary(b, nh, hd, rd),
        Target::K => to_interleaved_rotary(b, c.num_key_value_heads as i64, hd, rd),
        _ => Ok(b.shallow_clone()),
    }
}
