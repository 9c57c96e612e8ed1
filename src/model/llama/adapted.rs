//! The decoder's side of LoRA (see [`super::lora`]): attaching an adapter (which freezes
//! the base and makes the adapter the trained parameters), switching it off for a KL
//! reference, and the engine's serving mode.

use tch::Tensor;

use super::lora::{Adapter, LoraConfig, Target};
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
            a.set_serving();
        }
    }

    /// Call after changing the trained parameters in place (see [`super::lora::Adapter::changed`]).
    pub fn parameters_changed(&self) {
        if let Some(a) = &self.adapter {
            a.changed();
        }
    }

    /// The low-rank term of layer `l`'s `targets` for input `x` (see [`super::lora::Adapter::delta`]).
    pub(super) fn lora(
        &self,
        l: usize,
        targets: &[Target],
        x: &Tensor,
    ) -> Result<Option<Tensor>, ModelError> {
        match &self.adapter {
            None => Ok(None),
            Some(a) => a.delta(l, targets, x, &self.config),
        }
    }
}
