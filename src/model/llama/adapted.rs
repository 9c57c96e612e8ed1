//! The decoder's side of LoRA (see [`super::lora`]): attaching an adapter (which freezes
//! the base and makes the adapter the trained parameters), switching it off for a KL
//! reference, and the engine's serving mode.

use tch::Tensor;

use super::lora::{Adapter, LoraConfig};
use super::Llama;
use crate::model::ModelError;

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

    /// Runs `f` on the base alone (the adapter switched off), e.g. for a KL reference.
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
        if let Some(a) = &self.adapter {
            // A trained adapter is written in place by its optimizer: it keeps the
            // per-target path, which is always current and which autograd sees.
            if !a.tensors().iter().any(Tensor::requires_grad) {
                a.set_serving();
            }
        }
    }

    /// Call after changing the trained parameters in place (see [`super::lora::Adapter::changed`]).
    pub fn parameters_changed(&self) {
        if let Some(a) = &self.adapter {
            a.changed();
        }
    }
}
