//! Memory-efficient token log-probabilities (and entropies) of an output layer, forward and
//! backward, never holding more than `chunk` rows of `[tokens x vocabulary]` logits.
//!
//! For hidden states `h` [T, d], output weights `w` [V, d] and target ids `y` `[T]`, with
//! `z = h wᵀ` and `lse = logsumexp(z)` per row:
//!
//! - log-probability `lp_t = log_softmax(z_t)_{y_t}`
//! - entropy `H_t = -Σ_j p_j log p_j`, `p = softmax(z_t)`
//!
//! Backward, given `g_lp = ∂L/∂lp` and `g_H = ∂L/∂H` `[T]`:
//!
//! - `∂lp_t/∂z_t = onehot(y_t) - p`
//! - `∂H_t/∂z_tj = -p_j (log p_j + H_t)`
//! - `∂L/∂h = dz w`, `∂L/∂w = dzᵀ h`, with `dz = g_lp (onehot - p) + g_H ∂H/∂z`
//!
//! The full way (`z`, its log-softmax and their gradients at once) holds several
//! [T, V] float32 tensors: 4096 tokens of a 49k vocabulary are 805 MB each. Here each
//! chunk's logits are made, used and dropped. Per row the arithmetic is the full way's
//! (the same matrix product and log_softmax), so the values agree with it to rounding.
//!
//! A tch implementation (runs on whatever device the tensors are on); a fused CUDA kernel
//! can replace the chunk body later behind a feature.

use tch::{Kind, Tensor};

use crate::KernelError;

fn shape(problem: String) -> KernelError {
    KernelError::Shape {
        kernel: "token_logprobs",
        problem,
    }
}

/// The values of one pass: log-probabilities, and entropies when asked for, `[T]` float32.
pub struct TokenLogprobs {
    pub logprobs: Tensor,
    pub entropy: Option<Tensor>,
}

fn check(h: &Tensor, w: &Tensor, targets: &Tensor, chunk: i64) -> Result<(i64, i64), KernelError> {
    let (hs, ws, ts) = (h.size(), w.size(), targets.size());
    if hs.len() != 2 || ws.len() != 2 || ts.len() != 1 || hs[1] != ws[1] || ts[0] != hs[0] {
        return Err(shape(format!(
            "token logprobs want h [T, d], w [V, d], targets [T]; got {hs:?}, {ws:?}, {ts:?}"
        )));
    }
    if chunk < 1 {
        return Err(shape(format!("chunk must be at least 1 row, got {chunk}")));
    }
    Ok((hs[0], ws[0]))
}

/// Forward, without gradients: log-probability of each target (and entropy of each row
/// when `entropy`), `chunk` rows at a time.
pub fn token_logprobs(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: i64,
    entropy: bool,
) -> Result<TokenLogprobs, KernelError> {
    let (t, _) = check(h, w, targets, chunk)?;
    let _guard = tch::no_grad_guard();
    let mut lps = Vec::new();
    let mut ents = Vec::new();
    let mut start = 0;
    while start < t {
        let len = chunk.min(t - start);
        let z = h.narrow(0, start, len).matmul(&w.tr()).to_kind(Kind::Float);
        let y = targets.narrow(0, start, len).unsqueeze(1);
        // The chunk's log-softmax: per row the same arithmetic as a full log_softmax.
        let ls = z.log_softmax(-1, Kind::Float);
        lps.push(ls.gather(1, &y, false).squeeze_dim(1));
        if entropy {
            ents.push(-(ls.exp() * &ls).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float));
        }
        start += len;
    }
    let cat = |v: Vec<Tensor>| {
        if v.is_empty() {
            Tensor::zeros([0], (Kind::Float, h.device()))
        } else {
            Tensor::cat(&v, 0)
        }
    };
    Ok(TokenLogprobs {
        logprobs: cat(lps),
        entropy: if entropy { Some(cat(ents)) } else { None },
    })
}

/// Backward: the gradients of a loss with respect to `h` and `w`, given the loss's
/// gradients `g_lp` with respect to each log-probability and `g_entropy` with respect to
/// each entropy (both `[T]`). Recomputes each chunk's logits; returns (∂L/∂h [T, d] in h's
/// kind, ∂L/∂w [V, d] in w's kind).
pub fn token_logprobs_backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    g_lp: &Tensor,
    g_entropy: Option<&Tensor>,
    chunk: i64,
) -> Result<(Tensor, Tensor), KernelError> {
    let (t, v) = check(h, w, targets, chunk)?;
    if g_lp.size() != [t] || g_entropy.is_some_and(|g| g.size() != [t]) {
        return Err(shape(format!(
            "gradients must be [{t}]; got {:?} and {:?}",
            g_lp.size(),
            g_entropy.map(|g| g.size())
        )));
    }
    let _guard = tch::no_grad_guard();
    let mut grad_h = Vec::new();
    let mut grad_w = Tensor::zeros([v, w.size()[1]], (Kind::Float, w.device()));
    let mut start = 0;
    while start < t {
        let len = chunk.min(t - start);
        let hc = h.narrow(0, start, len);
        let z = hc.matmul(&w.tr()).to_kind(Kind::Float);
        let y = targets.narrow(0, start, len).unsqueeze(1);
        let mut ls = z.log_softmax(-1, Kind::Float);
        drop(z);
        let p = ls.exp();
        let glp = g_lp.narrow(0, start, len).to_kind(Kind::Float).unsqueeze(1);
        // dz = g_lp * (onehot - p) [- g_H * p * (log p + H)], in place: at most three
        // [chunk, vocab] tensors live (log p, p, dz).
        let mut dz = &p * &(-&glp);
        let _ = dz.scatter_add_(1, &y, &glp);
        if let Some(ge) = g_entropy {
            let ge = ge.narrow(0, start, len).to_kind(Kind::Float).unsqueeze(1);
            let ent = -(&p * &ls).sum_dim_intlist([-1i64].as_slice(), true, Kind::Float);
            let _ = ls.g_add_(&ent);
            let _ = ls.g_mul_(&p);
            let _ = ls.g_mul_(&ge);
            let _ = dz.g_sub_(&ls);
        }
        let hk = hc.to_kind(Kind::Float);
        grad_h.push(dz.matmul(&w.to_kind(Kind::Float)).to_kind(h.kind()));
        let _ = grad_w.addmm_(&dz.tr(), &hk);
        start += len;
    }
    let grad_h = if grad_h.is_empty() {
        h.zeros_like()
    } else {
        Tensor::cat(&grad_h, 0)
    };
    Ok((grad_h, grad_w.to_kind(w.kind())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn chunked_equals_full_log_softmax_and_autograd() {
        tch::manual_seed(3);
        let (t, d, v) = (37, 16, 101);
        let h = Tensor::randn([t, d], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let w =
            (Tensor::randn([v, d], (Kind::Float, tch::Device::Cpu)) * 0.5).set_requires_grad(true);
        let y = Tensor::randint(v, [t], (Kind::Int64, tch::Device::Cpu));
        let g_lp = Tensor::randn([t], (Kind::Float, tch::Device::Cpu));
        let g_h = Tensor::randn([t], (Kind::Float, tch::Device::Cpu));
        // The full way, with autograd.
        let z = h.matmul(&w.tr());
        let ls = z.log_softmax(-1, Kind::Float);
        let lp = ls.gather(1, &y.unsqueeze(1), false).squeeze_dim(1);
        let ent = -(ls.exp() * &ls).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float);
        let loss = (&lp * &g_lp).sum(Kind::Float) + (&ent * &g_h).sum(Kind::Float);
        let grads = Tensor::run_backward(&[&loss], &[&h, &w], false, false);
        for chunk in [1, 5, 37, 100] {
            let out = token_logprobs(&h.detach(), &w.detach(), &y, chunk, true).unwrap();
            assert!(max_diff(&out.logprobs, &lp) < 1e-5, "chunk {chunk}");
            assert!(max_diff(out.entropy.as_ref().unwrap(), &ent) < 1e-5);
            let (gh, gw) =
                token_logprobs_backward(&h.detach(), &w.detach(), &y, &g_lp, Some(&g_h), chunk)
                    .unwrap();
            assert!(max_diff(&gh, &grads[0]) < 1e-4, "chunk {chunk}: dh");
            assert!(max_diff(&gw, &grads[1]) < 1e-4, "chunk {chunk}: dw");
        }
        assert!(token_logprobs(&h, &w, &y.narrow(0, 0, 3), 4, false).is_err());
        assert!(token_logprobs(&h, &w, &y, 0, false).is_err());
    }
}
