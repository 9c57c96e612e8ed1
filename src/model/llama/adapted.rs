//! The decoder's side of LoRA (see [`super::lora`]): attaching an adapter (which freezes
//! the base and makes the adapter the trained parameters), switching it off for a KL
//! reference, and the engine's serving mode.

use tch::{Kind, Tensor};

use super::lora::{Adapter, LoraConfig, MergedBases, PRODUCTS};
use super::{DecoderLayer, Ffn, Llama};
use crate::model::ModelError;

/// The weight of fused product `p` (an index of [`PRODUCTS`]) of `layer`; `None` for the
/// MLP of a sparse (mixture-of-experts) layer.
fn product_weight(layer: &mut DecoderLayer, p: usize) -> Option<&mut Tensor> {
    match (p, &mut layer.ffn) {
        (0, _) => Some(&mut layer.qkv_proj),
        (1, _) => Some(&mut layer.o_proj),
        (2, Ffn::Dense { gate_up_proj, .. }) => Some(gate_up_proj),
        (3, Ffn::Dense { down_proj, .. }) => Some(down_proj),
        _ => None,
    }
}

impl Llama {
    /// Attaches a new adapter (see [`super::lora::Adapter::new`]); from now on the model's
    /// [`Llama::parameters`] are the adapter's and the base is frozen.
    pub fn attach_adapter(&mut self, cfg: LoraConfig, seed: u64) -> Result<(), ModelError> {
        if self.adapter.is_some() {
            return Err(ModelError::Invalid(
                "this model already has an adapter".into(),
            ));
        }
        let a = Adapter::new(&self.config, cfg, seed, self.device)?;
        for mut t in self.base_parameters() {
            let _ = t.requires_grad_(false);
        }
        self.adapter = Some(a);
        Ok(())
    }

    /// A second model over this one's base, sharing every base tensor (no copy), without
    /// an adapter: for a trainer beside an engine when both only read the base (the
    /// trainer then attaches its own adapter; the engine has its own, or a bank of
    /// served ones). Fails if this model's base is trained (it would be written under the
    /// other's reads).
    pub fn frozen_twin(&self) -> Result<Llama, ModelError> {
        if self.adapter.as_ref().is_some_and(Adapter::is_merged) {
            return Err(ModelError::Invalid(
                "a model serving its adapter merged holds merged weights, not the base: make \
                 the twin before merging"
                    .into(),
            ));
        }
        if self.base_parameters().iter().any(Tensor::requires_grad) {
            return Err(ModelError::Invalid(
                "only a model with a frozen base (an adapter attached or served) shares its \
                 base"
                    .into(),
            ));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| super::DecoderLayer {
                input_layernorm: l.input_layernorm.shallow_clone(),
                post_attention_layernorm: l.post_attention_layernorm.shallow_clone(),
                qkv_proj: l.qkv_proj.shallow_clone(),
                qkv_bias: l.qkv_bias.as_ref().map(Tensor::shallow_clone),
                qk_norm: l
                    .qk_norm
                    .as_ref()
                    .map(|(q, k)| (q.shallow_clone(), k.shallow_clone())),
                o_proj: l.o_proj.shallow_clone(),
                linear: l.linear.as_ref().map(|la| la.shallow_clone()),
                ffn: l.ffn.shallow_clone(),
            })
            .collect();
        Ok(Llama {
            config: self.config.clone(),
            device: self.device,
            dtype: self.dtype,
            act: self.act,
            embed_tokens: self.embed_tokens.shallow_clone(),
            layers,
            norm: self.norm.shallow_clone(),
            lm_head: self.lm_head.as_ref().map(Tensor::shallow_clone),
            rope: self.rope.shallow_clone(),
            compute: None,
            pooled: false,
            adapter: None,
            bank: Default::default(),
            route: Default::default(),
        })
    }

    pub fn adapter(&self) -> Option<&Adapter> {
        self.adapter.as_ref()
    }

    /// Runs `f` on the base alone (the adapter switched off), e.g. for a KL reference. Not
    /// for a model serving its adapter merged ([`Llama::serve_merged_adapter`]), whose
    /// weights hold it: such a model only serves (training it unmerges it first).
    pub fn without_adapter<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some(a) = &self.adapter else {
            return f();
        };
        let was = a.set_enabled(false);
        let r = f();
        a.set_enabled(was);
        r
    }

    /// For a model that only serves (the engine's): the adapter's low-rank terms run as
    /// two products per fused layer from stacked copies of its values, which
    /// [`Llama::parameters_changed`] must be told to rebuild after every in-place change.
    /// The per-target path (always current) is kept for every other model.
    pub fn serve_stacked_adapter(&self) {
        if let Some(a) = self.adapter.as_ref().filter(|a| !a.is_merged()) {
            // A trained adapter is written in place by its optimizer: it keeps the
            // per-target path, which is always current and which autograd sees.
            if !a.tensors().iter().any(Tensor::requires_grad) {
                a.set_serving();
            }
        }
    }

    /// Merged serving, for a model that only serves its own adapter (an engine's, with no
    /// bank): each product the adapter targets gets its own copy of the base weight
    /// holding `W + s·B·A`, so a forward pass runs the base's products alone and no
    /// low-rank term. The base tensors (which a trainer's [`Llama::frozen_twin`] shares)
    /// are kept as they were, so this costs one more copy of the targeted weights; after
    /// the adapter's values change, [`Llama::parameters_changed`] merges again. In
    /// bfloat16 the merged weight is rounded to bfloat16, a small update with it.
    pub fn serve_merged_adapter(&mut self) -> Result<(), ModelError> {
        let bad = |m: &str| Err(ModelError::Invalid(m.into()));
        let Some(a) = &self.adapter else {
            return bad("merged serving needs an adapter");
        };
        if a.tensors().iter().any(Tensor::requires_grad) {
            return bad("a trained adapter is written in place by its optimizer: it cannot be served merged");
        }
        if self.served_adapters() > 0 {
            return bad(
                "merged serving takes the model's own adapter alone, not served adapters beside it",
            );
        }
        if a.is_merged() {
            return Ok(());
        }
        let _g = tch::no_grad_guard();
        let mut bases: Vec<MergedBases> = Vec::with_capacity(self.layers.len());
        for l in 0..self.layers.len() {
            let mut per: MergedBases = Default::default();
            for (p, base) in per.iter_mut().enumerate().take(PRODUCTS.len()) {
                if a.stacked_product(l, p, Kind::Float, &self.config)?
                    .is_none()
                {
                    continue;
                }
                let Some(w) = product_weight(&mut self.layers[l], p) else {
                    continue;
                };
                let own = w.f_empty_like()?;
                *base = Some(std::mem::replace(w, own));
            }
            bases.push(per);
        }
        a.set_merged(bases);
        self.merge_adapter()
    }

    /// Puts the base weights back in place of the merged copies (the adapter then adds
    /// its low-rank terms again); nothing if the adapter is not merged.
    pub(super) fn unmerge_adapter(&mut self) {
        let Some(bases) = self.adapter.as_ref().and_then(Adapter::take_merged) else {
            return;
        };
        for (l, per) in bases.into_iter().enumerate() {
            for (p, base) in per.into_iter().enumerate() {
                if let (Some(base), Some(w)) = (base, product_weight(&mut self.layers[l], p)) {
                    *w = base;
                }
            }
        }
    }

    /// Writes `W + s·B·A` (in float32, then the weight's kind) into every merged product.
    fn merge_adapter(&mut self) -> Result<(), ModelError> {
        let Some(a) = &self.adapter else {
            return Ok(());
        };
        let bases = a.merged_bases();
        let Some(bases) = bases.as_ref() else {
            return Ok(());
        };
        let _g = tch::no_grad_guard();
        for (l, per) in bases.iter().enumerate() {
            for (p, base) in per.iter().enumerate() {
                let Some(base) = base else { continue };
                let Some((am, bm)) = a.stacked_product(l, p, Kind::Float, &self.config)? else {
                    continue;
                };
                let merged = base.f_to_kind(Kind::Float)?.f_add(&bm.f_matmul(&am)?)?;
                if let Some(w) = product_weight(&mut self.layers[l], p) {
                    w.f_copy_(&merged)?;
                }
            }
        }
        Ok(())
    }

    /// Call after changing the trained parameters in place (see
    /// [`super::lora::Adapter::changed`]); a merged adapter is merged again.
    pub fn parameters_changed(&mut self) -> Result<(), ModelError> {
        if let Some(a) = &self.adapter {
            a.changed();
        }
        self.merge_adapter()
    }
}
