//! Qwen3.5's Gated DeltaNet layers (linear attention), as HF transformers computes them
//! in its torch fallback (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
//! `causal_conv1d_*`):
//!
//! - one input projection gives q, k, v (which then pass a causal depthwise convolution
//!   of `conv_kernel` taps and SiLU), z (the output gate), b (beta = sigmoid(b)) and a
//!   (the decay, g = -exp(A_log) * softplus(a + dt_bias));
//! - q and k are L2-normalised, q scaled by 1/sqrt(key_head_dim), and each key head serves
//!   `value_heads / key_heads` value heads;
//! - the gated delta rule runs in its chunked form (chunks of 64) over several tokens of
//!   a sequence and in its recurrent form for one token;
//! - the output is RMS-normalised per value head, scaled, gated by SiLU(z) and projected.
//!
//! A sequence's state between calls is the convolution's last `conv_kernel - 1` inputs
//! and the recurrent state `[value_heads, key_head_dim, value_head_dim]` (float32): a
//! forward pass reads and replaces them through [`Recurrent`]. This file holds the
//! layer's parameters, the states and the two forms of the rule; `mixing.rs` runs a layer.

use tch::{Kind, Tensor};

use super::super::config::LinearAttention;
use crate::model::ModelError;

/// The chunk length of the chunked form (HF's).
const CHUNK: i64 = 64;

/// One linear-attention layer's own parameters (its input projection, fused
/// `[q, k, v, z, b, a]`, and its output projection are the layer's `qkv_proj` and `o_proj`).
pub(super) struct LinearAttn {
    /// Depthwise convolution taps, [channels, kernel].
    pub conv: Tensor,
    /// [value_heads]
    pub dt_bias: Tensor,
    /// [value_heads]
    pub a_log: Tensor,
    /// The output norm's weight, [value_head_dim].
    pub norm: Tensor,
}

impl LinearAttn {
    pub(super) fn shallow_clone(&self) -> LinearAttn {
        LinearAttn {
            conv: self.conv.shallow_clone(),
            dt_bias: self.dt_bias.shallow_clone(),
            a_log: self.a_log.shallow_clone(),
            norm: self.norm.shallow_clone(),
        }
    }

    pub(super) fn tensors(&self) -> Vec<Tensor> {
        vec![
            self.conv.shallow_clone(),
            self.dt_bias.shallow_clone(),
            self.a_log.shallow_clone(),
            self.norm.shallow_clone(),
        ]
    }
}

/// The sequences of a forward pass as the linear layers see them, and their states.
pub struct Recurrent {
    /// Each sequence's tokens in the pass: (first row, count), in the order of the states.
    pub(super) pieces: Vec<(i64, i64)>,
    /// Per linear layer: each sequence's last convolution inputs, [sequences, channels,
    /// kernel - 1]; read as the state before the pass, replaced by the state after it.
    pub(super) conv: Vec<Tensor>,
    /// Per linear layer: [sequences, value_heads, key_head_dim, value_head_dim], float32.
    pub(super) rec: Vec<Tensor>,
}

/// One sequence's state shapes in a linear layer: convolution [channels, kernel - 1],
/// recurrent [value_heads, key_head_dim, value_head_dim].
pub(super) fn state_shapes(h: &LinearAttention) -> ([i64; 2], [i64; 3]) {
    (
        [h.conv_channels() as i64, h.conv_kernel as i64 - 1],
        [
            h.value_heads as i64,
            h.key_head_dim as i64,
            h.value_head_dim as i64,
        ],
    )
}

/// `x / sqrt(sum(x²) + 1e-6)` over the last dimension (HF's `l2norm`).
fn l2norm(x: &Tensor) -> Result<Tensor, ModelError> {
    Ok(x.f_mul(
        &x.f_mul(x)?
            .f_sum_dim_intlist(-1, true, None)?
            .f_add_scalar(1e-6)?
            .f_rsqrt()?,
    )?)
}

/// q and k per value head (each key head serves consecutive value heads), L2-normed in
/// float32, q scaled by 1/sqrt(key_head_dim).
fn prepare_qk(q: &Tensor, k: &Tensor, vh: i64) -> Result<(Tensor, Tensor), ModelError> {
    let kh = q.size()[1];
    let dk = q.size()[2];
    let rep = |t: &Tensor| -> Result<Tensor, ModelError> {
        let t = t.f_to_kind(Kind::Float)?;
        Ok(if kh == vh {
            t
        } else {
            t.f_repeat_interleave_self_int(vh / kh, 1, None)?
        })
    };
    let q = l2norm(&rep(q)?)?.f_mul_scalar((dk as f64).powf(-0.5))?;
    let k = l2norm(&rep(k)?)?;
    Ok((q, k))
}

/// One token of each of `n` sequences: q, k [n, key_heads, dk], v [n, value_heads, dv],
/// g and beta [n, value_heads], state [n, value_heads, dk, dv]. Returns the output
/// [n, value_heads, dv] (float32) and the new state.
pub(super) fn recurrent_step(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor), ModelError> {
    let (n, vh, dv) = (v.size()[0], v.size()[1], v.size()[2]);
    let (q, k) = prepare_qk(q, k, vh)?;
    let dk = q.size()[2];
    let v = v.f_to_kind(Kind::Float)?;
    let beta = beta.f_to_kind(Kind::Float)?;
    // As batched products over (sequence, head): [dk] x [dk, dv] reads of the state and
    // one rank-1 update, rather than broadcast products each over the whole state.
    let s = state
        .f_mul(&g.f_exp()?.f_unsqueeze(-1)?.f_unsqueeze(-1)?)?
        .f_reshape([n * vh, dk, dv])?;
    let k3 = k.f_reshape([n * vh, 1, dk])?;
    let kv_mem = k3.f_bmm(&s)?.f_reshape([n, vh, dv])?;
    let delta = v.f_sub(&kv_mem)?.f_mul(&beta.f_unsqueeze(-1)?)?;
    let s = s.f_baddbmm(
        &k3.f_transpose(1, 2)?,
        &delta.f_reshape([n * vh, 1, dv])?,
        1.0,
        1.0,
    )?;
    let o = q
        .f_reshape([n * vh, 1, dk])?
        .f_bmm(&s)?
        .f_reshape([n, vh, dv])?;
    Ok((o, s.f_reshape([n, vh, dk, dv])?))
}

/// The chunked gated delta rule over one sequence's `len` tokens: q, k [len, key_heads,
/// dk], v [len, value_heads, dv], g and beta [len, value_heads], the state before them
/// [value_heads, dk, dv]. Returns the output [len, value_heads, dv] (float32) and the
/// state after them. Differentiable.
pub(super) fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor), ModelError> {
    let len = v.size()[0];
    let vh = v.size()[1];
    let dv = v.size()[2];
    let (q, k) = prepare_qk(q, k, vh)?;
    // [heads, len, d]
    let heads_first =
        |t: Tensor| -> Result<Tensor, ModelError> { Ok(t.f_transpose(0, 1)?.f_contiguous()?) };
    let (q, k) = (heads_first(q)?, heads_first(k)?);
    let v = heads_first(v.f_to_kind(Kind::Float)?)?;
    let beta = heads_first(beta.f_to_kind(Kind::Float)?)?;
    let g = heads_first(g.f_to_kind(Kind::Float)?)?;
    let pad = (CHUNK - len % CHUNK) % CHUNK;
    let padded = |t: &Tensor| -> Result<Tensor, ModelError> {
        Ok(if pad == 0 {
            t.shallow_clone()
        } else {
            t.f_constant_pad_nd([0, 0, 0, pad])?
        })
    };
    let (q, k, v) = (padded(&q)?, padded(&k)?, padded(&v)?);
    let pad1 = |t: &Tensor| -> Result<Tensor, ModelError> {
        Ok(if pad == 0 {
            t.shallow_clone()
        } else {
            t.f_constant_pad_nd([0, pad])?
        })
    };
    let (beta, g) = (pad1(&beta)?, pad1(&g)?);
    let chunks = (len + pad) / CHUNK;
    let dk = q.size()[2];
    let v_beta = v.f_mul(&beta.f_unsqueeze(-1)?)?;
    let k_beta = k.f_mul(&beta.f_unsqueeze(-1)?)?;
    let in_chunks = |t: &Tensor, d: i64| -> Result<Tensor, ModelError> {
        Ok(t.f_reshape([vh, chunks, CHUNK, d])?)
    };
    let q = in_chunks(&q, dk)?;
    let k = in_chunks(&k, dk)?;
    let k_beta = in_chunks(&k_beta, dk)?;
    let v_beta = in_chunks(&v_beta, dv)?;
    let g = g.f_reshape([vh, chunks, CHUNK])?;
    let dev = q.device();
    let upper = Tensor::f_ones([CHUNK, CHUNK], (Kind::Bool, dev))?.f_triu(1)?;
    let cum = g.f_cumsum(-1, Kind::Float)?;
    let pairwise = cum
        .f_unsqueeze(-1)?
        .f_sub(&cum.f_unsqueeze(-2)?)?
        .f_masked_fill(&upper, f64::NEG_INFINITY)?
        .f_exp()?;
    let kt = k.f_transpose(-1, -2)?;
    let ut = k_beta.f_matmul(&kt)?.f_mul(&pairwise)?;
    let intra = q.f_matmul(&kt)?.f_mul(&pairwise)?;
    let decayed_k_beta = k_beta.f_mul(&cum.f_exp()?.f_unsqueeze(-1)?)?;
    let new_values = ut.f_linalg_solve_triangular(&v_beta, false, true, true)?;
    let k_cumdecay = ut.f_linalg_solve_triangular(&decayed_k_beta, false, true, true)?;
    let q = q.f_mul(&cum.f_exp()?.f_unsqueeze(-1)?)?;
    let last = cum.f_narrow(-1, CHUNK - 1, 1)?;
    let k = k.f_mul(&last.f_sub(&cum)?.f_exp()?.f_unsqueeze(-1)?)?;
    let chunk_decay = last.f_exp()?.f_unsqueeze(-1)?; // [vh, chunks, 1, 1]
    let mut s = state.f_to_kind(Kind::Float)?;
    let mut outs = Vec::with_capacity(chunks as usize);
    for i in 0..chunks {
        let at = |t: &Tensor| t.f_select(1, i);
        let v_new = at(&new_values)?.f_sub(&at(&k_cumdecay)?.f_matmul(&s)?)?;
        let inter = at(&q)?.f_matmul(&s)?;
        outs.push(inter.f_add(&at(&intra)?.f_matmul(&v_new)?)?);
        s = s
            .f_mul(&at(&chunk_decay)?)?
            .f_add(&at(&k)?.f_transpose(-1, -2)?.f_matmul(&v_new)?)?;
    }
    let out = Tensor::f_cat(&outs, 1)?
        .f_narrow(1, 0, len)?
        .f_transpose(0, 1)?;
    Ok((out, s))
}
