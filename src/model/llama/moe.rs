//! Qwen3-MoE's sparse layers, as HF computes them: the router's logits over the experts,
//! a float32 softmax, each token's top-k experts (renormalised over the k when the config
//! says `norm_topk_prob`), then every chosen expert (a SwiGLU of its own) on its tokens
//! only, its output scaled by the token's routing weight and summed into the token's row.
//!
//! The experts are stored stacked, gate/up `[experts, 2 * width, hidden]` (gate rows then
//! up rows) and down `[experts, hidden, width]`, so the optimizer, all-reduce and hashes
//! see three tensors per layer; checkpoints split them back into HF's per-expert names.
//! The routing is differentiable (the weights' gradient reaches the router); the choice of
//! experts is not, as in HF.

use tch::{Kind, Tensor};

use super::super::config::LlamaConfig;
use super::super::weights::{load_checked, WeightSource};
use super::Llama;
use crate::model::ModelError;

/// One sparse layer's router and experts.
pub(super) struct Experts {
    /// [experts, hidden]
    router: Tensor,
    /// [experts, 2 * width, hidden]
    gate_up: Tensor,
    /// [experts, hidden, width]
    down: Tensor,
    top_k: i64,
    norm_topk: bool,
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

impl Llama {
    /// A sparse layer's MLP over `x` ([.., hidden], normed): every token through its top-k
    /// experts, weighted by the routing weights.
    pub(super) fn experts(&self, e: &Experts, x: &Tensor) -> Result<Tensor, ModelError> {
        let shape = x.size();
        let h = *shape.last().unwrap_or(&0);
        let x = x.f_reshape([-1, h])?;
        let rows = x.size()[0];
        let probs = self
            .linear(&x, &e.router, None)?
            .f_to_kind(Kind::Float)?
            .f_softmax(-1, Kind::Float)?;
        let (mut weights, chosen) = probs.f_topk(e.top_k, -1, true, true)?;
        if e.norm_topk {
            weights = weights.f_div(&weights.f_sum_dim_intlist(-1, true, Kind::Float)?)?;
        }
        let weights = weights.f_to_kind(x.kind())?;
        // Each expert's (token, slot) pairs, on the host: one transfer per layer.
        let chosen: Vec<i64> =
            Vec::<i64>::try_from(chosen.f_flatten(0, -1)?.f_to_device(tch::Device::Cpu)?)
                .map_err(|e| ModelError::Invalid(format!("routing indices: {e}")))?;
        let experts = e.gate_up.size()[0] as usize;
        let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); experts];
        let mut slots: Vec<Vec<i64>> = vec![Vec::new(); experts];
        for (i, &ex) in chosen.iter().enumerate() {
            let ex = usize::try_from(ex)
                .ok()
                .filter(|&x| x < experts)
                .ok_or_else(|| ModelError::Invalid(format!("router chose expert {ex}")))?;
            tokens[ex].push(i as i64 / e.top_k);
            slots[ex].push(i as i64 % e.top_k);
        }
        let width = e.down.size()[2];
        let device = x.device();
        let mut out = Tensor::f_zeros([rows, h], (x.kind(), device))?;
        for ex in 0..experts {
            if tokens[ex].is_empty() {
                continue;
            }
            let tok = Tensor::f_from_slice(&tokens[ex])?.f_to_device(device)?;
            let slot = Tensor::f_from_slice(&slots[ex])?.f_to_device(device)?;
            let xs = x.f_index_select(0, &tok)?;
            let gu = self.linear(&xs, &e.gate_up.f_get(ex as i64)?, None)?;
            let act = gu
                .f_narrow(-1, 0, width)?
                .f_silu()?
                .f_mul(&gu.f_narrow(-1, width, width)?)?;
            let y = self.linear(&act, &e.down.f_get(ex as i64)?, None)?;
            let w = weights.f_index(&[Some(&tok), Some(&slot)])?;
            out = out.f_index_add(0, &tok, &y.f_mul(&w.f_unsqueeze(-1)?)?)?;
        }
        Ok(out.f_reshape(shape.as_slice())?)
    }
}
