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
//! With a [`Transform`] the distribution is the one a token was sampled from: each row's
//! logits divided by its temperature (`z' = z / T`), and, where the row truncates, only
//! a kept set `S` of tokens (min_p, then top_k, then top_p, as the engine samples; the
//! target is always kept, so a token the current policy would no longer have drawn
//! still has a finite log-probability). Then `p = softmax(z')` over `S` (0 elsewhere),
//! `lp_t = log p_{y_t}`, `H_t = -Σ_{j in S} p_j log p_j`, and the gradients above are taken
//! with respect to `z'` and multiplied by `1 / T`. `S` is a function of the logits'
//! order and is held fixed under differentiation.
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

/// Per row (`[T]` each, on the tensors' device): how its logits become the distribution
/// its target is scored under.
pub struct Transform {
    /// 1 / temperature, float32.
    pub inv_temperature: Tensor,
    /// Truncation, when any row truncates: keep at most `top_k` tokens (int64; 0: no
    /// limit), the smallest nucleus reaching `top_p` (float32; 1: all), tokens at least
    /// `min_p` times as likely as the most likely (float32; 0: all).
    pub truncation: Option<Truncation>,
}

pub struct Truncation {
    pub top_k: Tensor,
    pub top_p: Tensor,
    pub min_p: Tensor,
}

impl Transform {
    fn check(&self, t: i64) -> Result<(), KernelError> {
        let mut sizes = vec![self.inv_temperature.size()];
        if let Some(tr) = &self.truncation {
            sizes.extend([tr.top_k.size(), tr.top_p.size(), tr.min_p.size()]);
        }
        if sizes.iter().any(|s| s.as_slice() != [t]) {
            return Err(shape(format!(
                "a transform wants [{t}] per row; got {sizes:?}"
            )));
        }
        Ok(())
    }

    /// Rows `start..start + len`: the scaled logits and the kept set (None: all kept).
    fn apply(&self, z: Tensor, y: &Tensor, start: i64, len: i64) -> (Tensor, Option<Tensor>) {
        let inv_t = self.inv_temperature.narrow(0, start, len).unsqueeze(1);
        let z = z * inv_t;
        let Some(tr) = &self.truncation else {
            return (z, None);
        };
        let v = z.size()[1];
        let top_k = tr.top_k.narrow(0, start, len);
        let top_p = tr.top_p.narrow(0, start, len).unsqueeze(1);
        let min_p = tr.min_p.narrow(0, start, len).unsqueeze(1);
        // min_p: z'_j >= max z' + ln(min_p) (ln 0 = -inf keeps every token).
        let floor = z.amax([-1i64].as_slice(), true) + min_p.log();
        let mut keep = z.ge_tensor(&floor);
        // top_k over what min_p kept, ties by id (a stable descending sort).
        let masked = z.masked_fill(&keep.logical_not(), f64::NEG_INFINITY);
        let (sorted, order) = masked.sort_stable(true, -1, true);
        let rank = Tensor::arange(v, (tch::Kind::Int64, z.device())).unsqueeze(0);
        let k = top_k.where_scalarother(&top_k.gt(0), v).unsqueeze(1);
        let mut keep_sorted = rank.lt_tensor(&k).logical_and(&sorted.isfinite());
        // top_p over what is left: a token stays while the mass ranked before it < top_p.
        let probs = sorted
            .masked_fill(&keep_sorted.logical_not(), f64::NEG_INFINITY)
            .softmax(-1, Kind::Float);
        let before = probs.cumsum(-1, Kind::Float) - &probs;
        let nucleus = before.lt_tensor(&top_p).logical_or(&top_p.ge(1.0));
        keep_sorted = keep_sorted.logical_and(&nucleus);
        keep = keep
            .zeros_like()
            .scatter(1, &order, &keep_sorted)
            .scatter_value(1, y, 1);
        (z, Some(keep))
    }
}

/// Log-softmax of `z` over `keep` (-inf elsewhere), and the same with 0 outside `keep`
/// (for `p log p` sums).
fn log_softmax_kept(z: &Tensor, keep: Option<&Tensor>) -> (Tensor, Option<Tensor>) {
    match keep {
        None => (z.log_softmax(-1, Kind::Float), None),
        Some(k) => {
            let out = k.logical_not();
            let ls = z
                .masked_fill(&out, f64::NEG_INFINITY)
                .log_softmax(-1, Kind::Float);
            let finite = ls.masked_fill(&out, 0.0);
            (ls, Some(finite))
        }
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
/// when `entropy`), `chunk` rows at a time, under `transform` (none: the raw softmax).
pub fn token_logprobs(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: i64,
    entropy: bool,
    transform: Option<&Transform>,
) -> Result<TokenLogprobs, KernelError> {
    let (t, _) = check(h, w, targets, chunk)?;
    if let Some(tr) = transform {
        tr.check(t)?;
    }
    let _guard = tch::no_grad_guard();
    let mut lps = Vec::new();
    let mut ents = Vec::new();
    let mut start = 0;
    while start < t {
        let len = chunk.min(t - start);
        let z = h.narrow(0, start, len).matmul(&w.tr()).to_kind(Kind::Float);
        let y = targets.narrow(0, start, len).unsqueeze(1);
        let (z, keep) = match transform {
            Some(tr) => tr.apply(z, &y, start, len),
            None => (z, None),
        };
        // The chunk's log-softmax: per row the same arithmetic as a full log_softmax.
        let (ls, finite) = log_softmax_kept(&z, keep.as_ref());
        lps.push(ls.gather(1, &y, false).squeeze_dim(1));
        if entropy {
            let lf = finite.as_ref().unwrap_or(&ls);
            ents.push(-(ls.exp() * lf).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float));
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
/// each entropy (both `[T]`), under the same `transform` as the forward. Recomputes each
/// chunk's logits; returns (∂L/∂h [T, d] in h's kind, ∂L/∂w [V, d] in w's kind).
pub fn token_logprobs_backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    g_lp: &Tensor,
    g_entropy: Option<&Tensor>,
    chunk: i64,
    transform: Option<&Transform>,
) -> Result<(Tensor, Tensor), KernelError> {
    let (gh, gw) = backward(h, w, targets, g_lp, g_entropy, chunk, transform, true)?;
    Ok((gh, gw.unwrap_or_else(|| w.zeros_like())))
}

/// [`token_logprobs_backward`] for a frozen `w` (a LoRA adapter's base): only ∂L/∂h, with
/// no [V, d] gradient allocated or computed.
pub fn token_logprobs_backward_h(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    g_lp: &Tensor,
    g_entropy: Option<&Tensor>,
    chunk: i64,
    transform: Option<&Transform>,
) -> Result<Tensor, KernelError> {
    Ok(backward(h, w, targets, g_lp, g_entropy, chunk, transform, false)?.0)
}

#[allow(clippy::too_many_arguments)]
fn backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    g_lp: &Tensor,
    g_entropy: Option<&Tensor>,
    chunk: i64,
    transform: Option<&Transform>,
    want_w: bool,
) -> Result<(Tensor, Option<Tensor>), KernelError> {
    let (t, v) = check(h, w, targets, chunk)?;
    if let Some(tr) = transform {
        tr.check(t)?;
    }
    if g_lp.size() != [t] || g_entropy.is_some_and(|g| g.size() != [t]) {
        return Err(shape(format!(
            "gradients must be [{t}]; got {:?} and {:?}",
            g_lp.size(),
            g_entropy.map(|g| g.size())
        )));
    }
    let _guard = tch::no_grad_guard();
    let mut grad_h = Vec::new();
    let mut grad_w = want_w.then(|| Tensor::zeros([v, w.size()[1]], (Kind::Float, w.device())));
    // The weight in float32 once (not per chunk): a bfloat16 weight is cast here.
    let wf = w.to_kind(Kind::Float);
    let mut start = 0;
    while start < t {
        let len = chunk.min(t - start);
        let hc = h.narrow(0, start, len);
        let z = hc.matmul(&w.tr()).to_kind(Kind::Float);
        let y = targets.narrow(0, start, len).unsqueeze(1);
        let (z, keep) = match transform {
            Some(tr) => tr.apply(z, &y, start, len),
            None => (z, None),
        };
        let (ls, finite) = log_softmax_kept(&z, keep.as_ref());
        drop(z);
        let p = ls.exp();
        // log p with 0 outside the kept set (p = 0 there), so p (log p + H) is 0 there too.
        let mut ls = finite.unwrap_or(ls);
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
        if let Some(tr) = transform {
            // ∂z'/∂z = 1 / T.
            let _ = dz.g_mul_(&tr.inv_temperature.narrow(0, start, len).unsqueeze(1));
        }
        grad_h.push(dz.matmul(&wf).to_kind(h.kind()));
        if let Some(gw) = grad_w.as_mut() {
            let _ = gw.addmm_(&dz.tr(), &hc.to_kind(Kind::Float));
        }
        start += len;
    }
    let grad_h = if grad_h.is_empty() {
        h.zeros_like()
    } else {
        Tensor::cat(&grad_h, 0)
    };
    Ok((grad_h, grad_w.map(|g| g.to_kind(w.kind()))))
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
            let out = token_logprobs(&h.detach(), &w.detach(), &y, chunk, true, None).unwrap();
            assert!(max_diff(&out.logprobs, &lp) < 1e-5, "chunk {chunk}");
            assert!(max_diff(out.entropy.as_ref().unwrap(), &ent) < 1e-5);
            let (gh, gw) = token_logprobs_backward(
                &h.detach(),
                &w.detach(),
                &y,
                &g_lp,
                Some(&g_h),
                chunk,
                None,
            )
            .unwrap();
            assert!(max_diff(&gh, &grads[0]) < 1e-4, "chunk {chunk}: dh");
            assert!(max_diff(&gw, &grads[1]) < 1e-4, "chunk {chunk}: dw");
        }
        assert!(token_logprobs(&h, &w, &y.narrow(0, 0, 3), 4, false, None).is_err());
        assert!(token_logprobs(&h, &w, &y, 0, false, None).is_err());
    }

    /// The kept set of one row as the engine draws (min_p, top_k with ties by id, top_p),
    /// in f64 over plain numbers.
    fn kept_by_hand(z: &[f64], top_k: usize, top_p: f64, min_p: f64) -> Vec<bool> {
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut cand: Vec<usize> = (0..z.len())
            .filter(|&j| min_p == 0.0 || z[j] >= max + min_p.ln())
            .collect();
        cand.sort_by(|&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
        if top_k > 0 {
            cand.truncate(top_k);
        }
        let m = z[cand[0]];
        let total: f64 = cand.iter().map(|&j| (z[j] - m).exp()).sum();
        let mut acc = 0.0;
        let mut keep = vec![false; z.len()];
        for &j in &cand {
            if acc >= top_p && top_p < 1.0 {
                break;
            }
            keep[j] = true;
            acc += (z[j] - m).exp() / total;
        }
        keep
    }

    /// A tiny vocabulary by hand: logits [2, 1, 0.5, 0, -1], T = 0.5, top_p = 0.9.
    /// z / T = [4, 2, 1, 0, -2]; softmax ≈ [0.8390, 0.1135, 0.0418, 0.0154, 0.0021]; the
    /// nucleus is tokens 0 and 1 (0.8390 < 0.9, then 0.9525 ≥ 0.9), so the token 1
    /// sampled there has log q = 2 - log(e^4 + e^2) under the transform, while the
    /// raw model gives it 1 - logsumexp(logits). Token 3, outside the nucleus, is scored
    /// over {0, 1, 3}.
    #[test]
    fn temperature_and_top_p_by_hand_on_a_tiny_vocabulary() {
        let w = Tensor::eye(5, (Kind::Float, tch::Device::Cpu));
        let h = Tensor::from_slice(&[2.0f32, 1.0, 0.5, 0.0, -1.0])
            .view([1, 5])
            .repeat([2, 1]);
        let y = Tensor::from_slice(&[1i64, 3]);
        let tr = Transform {
            inv_temperature: Tensor::from_slice(&[2.0f32, 2.0]),
            truncation: Some(Truncation {
                top_k: Tensor::from_slice(&[0i64, 0]),
                top_p: Tensor::from_slice(&[0.9f32, 0.9]),
                min_p: Tensor::from_slice(&[0.0f32, 0.0]),
            }),
        };
        let out = token_logprobs(&h, &w, &y, 4, true, Some(&tr)).unwrap();
        let lse01 = (4f64.exp() + 2f64.exp()).ln();
        let want1 = 2.0 - lse01;
        let want3 = 0.0 - (4f64.exp() + 2f64.exp() + 1.0).ln();
        assert!((out.logprobs.double_value(&[0]) - want1).abs() < 1e-5);
        assert!((out.logprobs.double_value(&[1]) - want3).abs() < 1e-5);
        let q0 = (4.0 - lse01).exp();
        let h0 = -(q0 * q0.ln() + (1.0 - q0) * (1.0 - q0).ln());
        assert!((out.entropy.unwrap().double_value(&[0]) - h0).abs() < 1e-5);
        // Untransformed: the raw model's.
        let raw = token_logprobs(&h, &w, &y, 4, false, None).unwrap();
        let lse: f64 = [2.0f64, 1.0, 0.5, 0.0, -1.0]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert!((raw.logprobs.double_value(&[0]) - (1.0 - lse)).abs() < 1e-5);
    }

    /// Random rows with random temperatures and truncations: values and gradients equal
    /// autograd through (z / T) masked to the kept set the engine's rule gives.
    #[test]
    fn transformed_rows_equal_autograd_over_the_engines_kept_set() {
        tch::manual_seed(5);
        let (t, d, v) = (24, 8, 40);
        let cpu = (Kind::Float, tch::Device::Cpu);
        let h = Tensor::randn([t, d], cpu).set_requires_grad(true);
        let w = (Tensor::randn([v, d], cpu) * 0.8).set_requires_grad(true);
        let y = Tensor::randint(v, [t], (Kind::Int64, tch::Device::Cpu));
        let g_lp = Tensor::randn([t], cpu);
        let g_h = Tensor::randn([t], cpu);
        let temps: Vec<f32> = (0..t)
            .map(|i| [0.5, 0.7, 1.0, 1.3][i as usize % 4])
            .collect();
        let ks: Vec<i64> = (0..t).map(|i| [0, 5, 0, 12, 1][i as usize % 5]).collect();
        let ps: Vec<f32> = (0..t)
            .map(|i| [1.0, 0.9, 0.5, 0.95][i as usize % 4])
            .collect();
        let mins: Vec<f32> = (0..t).map(|i| [0.0, 0.0, 0.05][i as usize % 3]).collect();
        let inv: Vec<f32> = temps.iter().map(|x| 1.0 / x).collect();
        let tr = Transform {
            inv_temperature: Tensor::from_slice(&inv),
            truncation: Some(Truncation {
                top_k: Tensor::from_slice(&ks),
                top_p: Tensor::from_slice(&ps),
                min_p: Tensor::from_slice(&mins),
            }),
        };
        // By hand: the kept set per row from the scaled logits, the target added.
        let zs = (h.matmul(&w.tr()) * Tensor::from_slice(&inv).unsqueeze(1)).detach();
        let mut mask = vec![false; (t * v) as usize];
        for r in 0..t as usize {
            let row: Vec<f64> = (0..v).map(|j| zs.double_value(&[r as i64, j])).collect();
            let keep = kept_by_hand(&row, ks[r] as usize, ps[r] as f64, mins[r] as f64);
            for j in 0..v as usize {
                mask[r * v as usize + j] = keep[j];
            }
            mask[r * v as usize + y.int64_value(&[r as i64]) as usize] = true;
        }
        let keep = Tensor::from_slice(&mask).view([t, v]);
        let z = h.matmul(&w.tr()) * Tensor::from_slice(&inv).unsqueeze(1);
        let ls = z
            .masked_fill(&keep.logical_not(), f64::NEG_INFINITY)
            .log_softmax(-1, Kind::Float);
        let lp = ls.gather(1, &y.unsqueeze(1), false).squeeze_dim(1);
        let lf = ls.masked_fill(&keep.logical_not(), 0.0);
        let ent = -(ls.exp() * lf).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float);
        let loss = (&lp * &g_lp).sum(Kind::Float) + (&ent * &g_h).sum(Kind::Float);
        let grads = Tensor::run_backward(&[&loss], &[&h, &w], false, false);
        for chunk in [1, 7, 24] {
            let out = token_logprobs(&h.detach(), &w.detach(), &y, chunk, true, Some(&tr)).unwrap();
            assert!(max_diff(&out.logprobs, &lp) < 1e-5, "chunk {chunk}");
            assert!(max_diff(out.entropy.as_ref().unwrap(), &ent) < 1e-5);
            let (gh, gw) = token_logprobs_backward(
                &h.detach(),
                &w.detach(),
                &y,
                &g_lp,
                Some(&g_h),
                chunk,
                Some(&tr),
            )
            .unwrap();
            assert!(max_diff(&gh, &grads[0]) < 1e-4, "chunk {chunk}: dh");
            assert!(max_diff(&gw, &grads[1]) < 1e-4, "chunk {chunk}: dw");
        }
        let bad = Transform {
            inv_temperature: Tensor::from_slice(&inv[..3]),
            truncation: None,
        };
        assert!(token_logprobs(&h, &w, &y, 4, false, Some(&bad)).is_err());
    }
}
