//! Qwen3-MoE's sparse layers, as HF computes them: the router's logits over the experts,
//! a float32 softmax, each token's top-k experts (renormalised over the k when the config
//! says `norm_topk_prob`), then every chosen expert (a SwiGLU of its own) on its tokens
//! only, its output scaled by the token's routing weight and summed into the token's row.
//!
//! The experts are stored stacked, gate/up `[experts, 2 * width, hidden]` (gate rows then
//! up rows) and down `[experts, hidden, width]`, so the optimizer, all-reduce and hashes
//! see three tensors per layer; checkpoints split them back into HF's per-expert names.
//! The routing is differentiable (the weights' gradient reaches the router); the choice of
//! experts is not, as in HF. Running them is `experts.rs`.

use tch::{Kind, Tensor};

use super::super::config::LlamaConfig;
use super::super::weights::{load_checked, WeightSource};
use crate::model::ModelError;

/// One sparse layer's router and experts.
pub(super) struct Experts {
    /// [experts, hidden]
    pub(super) router: Tensor,
    /// [experts, 2 * width, hidden]
    pub(super) gate_up: Tensor,
    /// [experts, hidden, width]
    pub(super) down: Tensor,
    pub(super) top_k: i64,
    pub(super) norm_topk: bool,
}

impl Experts {
    /// Loads layer `prefix`'s router and experts (HF's names: `mlp.gate.weight`,
    /// `mlp.experts.E.{gate,up,down}_proj.weight`), `place`d as the model's matrices.
    pub(super) fn load(
        c: &LlamaConfig,
        src: &mut dyn WeightSource,
        prefix: &str,
        place: &dyn Fn(Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Experts, ModelError> {
        let m = c.moe.as_ref().ok_or_else(|| {
            ModelError::Invalid("a sparse layer in a model without experts".into())
        })?;
        let (h, w, n) = (
            c.hidden_size as i64,
            m.intermediate_size as i64,
            m.experts as i64,
        );
        let router = place(load_checked(
            src,
            &format!("{prefix}mlp.gate.weight"),
            &[n, h],
        )?)?;
        let mut gate_up = Vec::with_capacity(m.experts);
        let mut down = Vec::with_capacity(m.experts);
        for e in 0..m.experts {
            let name = |proj: &str| format!("{prefix}mlp.experts.{e}.{proj}.weight");
            let g = load_checked(src, &name("gate_proj"), &[w, h])?.f_to_kind(Kind::Float)?;
            let u = load_checked(src, &name("up_proj"), &[w, h])?.f_to_kind(Kind::Float)?;
            gate_up.push(Tensor::f_cat(&[g, u], 0)?);
            down.push(load_checked(src, &name("down_proj"), &[h, w])?.f_to_kind(Kind::Float)?);
        }
        Ok(Experts {
            router,
            gate_up: place(Tensor::f_stack(&gate_up, 0)?)?,
            down: place(Tensor::f_stack(&down, 0)?)?,
            top_k: m.top_k as i64,
            norm_topk: m.norm_topk_prob,
        })
    }

    pub(super) fn shallow_clone(&self) -> Experts {
        Experts {
            router: self.router.shallow_clone(),
            gate_up: self.gate_up.shallow_clone(),
            down: self.down.shallow_clone(),
            top_k: self.top_k,
            norm_topk: self.norm_topk,
        }
    }

    /// The layer's parameters: router, stacked gate/up, stacked down.
    pub(super) fn tensors(&self) -> Vec<Tensor> {
        vec![
            self.router.shallow_clone(),
            self.gate_up.shallow_clone(),
            self.down.shallow_clone(),
        ]
    }

    /// The layer's tensors under HF's per-expert names (`prefix` is `model.layers.L.`).
    pub(super) fn hf_tensors(&self, prefix: &str) -> Result<Vec<(String, Tensor)>, ModelError> {
        let n = self.gate_up.size()[0];
        let w = self.down.size()[2];
        let mut out = vec![(
            format!("{prefix}mlp.gate.weight"),
            self.router.shallow_clone(),
        )];
        for e in 0..n {
            let gu = self.gate_up.f_get(e)?;
            let name = |proj: &str| format!("{prefix}mlp.experts.{e}.{proj}.weight");
            out.push((name("gate_proj"), gu.f_narrow(0, 0, w)?));
            out.push((name("up_proj"), gu.f_narrow(0, w, w)?));
            out.push((name("down_proj"), self.down.f_get(e)?));
        }
        Ok(out)
    }
}
