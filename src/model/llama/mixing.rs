//! Running a Gated DeltaNet layer (its parameters, states and the rule's two forms are
//! `linear.rs`): the fused input projection, the causal convolution from each sequence's
//! state, the chunked rule per sequence (or the recurrent one for a token of each), and
//! the gated per-head norm.

use tch::{Kind, Tensor};

use super::linear::{chunked, recurrent_step, state_shapes, LinearAttn, Recurrent};
use super::Llama;
use crate::model::config::LinearAttention;
use crate::model::ModelError;

impl Llama {
    /// Fresh (zero) states for the sequences `pieces` of a forward pass.
    pub(super) fn fresh_states(&self, pieces: Vec<(i64, i64)>) -> Result<Recurrent, ModelError> {
        let h = self.linear_config()?;
        let n = pieces.len() as i64;
        let layers = h.layers.iter().filter(|&&l| l).count();
        let (conv_shape, rec_shape) = state_shapes(h);
        let mut conv = Vec::with_capacity(layers);
        let mut rec = Vec::with_capacity(layers);
        for _ in 0..layers {
            let c: Vec<i64> = [n].iter().chain(&conv_shape).copied().collect();
            let r: Vec<i64> = [n].iter().chain(&rec_shape).copied().collect();
            conv.push(Tensor::f_zeros(c.as_slice(), (self.act, self.device))?);
            rec.push(Tensor::f_zeros(r.as_slice(), (Kind::Float, self.device))?);
        }
        Ok(Recurrent { pieces, conv, rec })
    }

    pub(super) fn linear_config(&self) -> Result<&LinearAttention, ModelError> {
        self.config
            .linear
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this model has no linear-attention layers".into()))
    }

    /// Linear layer `li` (counting linear layers only) over the normed residual `hn`
    /// ([tokens, hidden]) of the sequences in `r`, whose states it advances: the layer's
    /// output before its output projection, [tokens, value_dim].
    pub(super) fn linear_mix(
        &self,
        li: usize,
        in_proj: &Tensor,
        la: &LinearAttn,
        hn: &Tensor,
        r: &mut Recurrent,
    ) -> Result<Tensor, ModelError> {
        let h = self.linear_config()?;
        let (kh, vh) = (h.key_heads as i64, h.value_heads as i64);
        let (dk, dv) = (h.key_head_dim as i64, h.value_head_dim as i64);
        let (kd, vd, ch) = (kh * dk, vh * dv, h.conv_channels() as i64);
        let taps = h.conv_kernel as i64;
        let proj = self.linear(hn, in_proj, None)?;
        let mixed = proj.f_narrow(-1, 0, ch)?;
        let z = proj.f_narrow(-1, ch, vd)?;
        let beta = proj.f_narrow(-1, ch + vd, vh)?.f_sigmoid()?;
        let a = proj.f_narrow(-1, ch + vd + vh, vh)?;
        // g = -exp(A_log) * softplus(a + dt_bias), in float32.
        let g = a
            .f_to_kind(Kind::Float)?
            .f_add(&la.dt_bias.f_to_kind(Kind::Float)?)?
            .f_softplus()?
            .f_mul(&la.a_log.f_to_kind(Kind::Float)?.f_exp()?.f_neg()?)?;
        let split = |y: &Tensor, lead: i64| -> Result<[Tensor; 3], ModelError> {
            Ok([
                y.f_narrow(-1, 0, kd)?.f_reshape([lead, kh, dk])?,
                y.f_narrow(-1, kd, kd)?.f_reshape([lead, kh, dk])?,
                y.f_narrow(-1, 2 * kd, vd)?.f_reshape([lead, vh, dv])?,
            ])
        };
        let conv_w = la.conv.f_to_kind(mixed.kind())?;
        let n = mixed.size()[0];
        let decode = r
            .pieces
            .iter()
            .enumerate()
            .all(|(i, &(s, l))| s == i as i64 && l == 1)
            && r.pieces.len() as i64 == n;
        let out = if decode {
            // One token per sequence: the recurrent form, every sequence at once.
            let win = Tensor::f_cat(&[r.conv[li].shallow_clone(), mixed.f_unsqueeze(-1)?], -1)?;
            let y = win
                .f_mul(&conv_w.f_unsqueeze(0)?)?
                .f_sum_dim_intlist(-1, false, None)?
                .f_silu()?;
            r.conv[li] = win.f_narrow(-1, 1, taps - 1)?;
            let [q, k, v] = split(&y, n)?;
            let (o, state) = recurrent_step(&q, &k, &v, &g, &beta, &r.rec[li])?;
            r.rec[li] = state;
            o
        } else {
            let mut outs = Vec::with_capacity(r.pieces.len());
            let mut convs = Vec::with_capacity(r.pieces.len());
            let mut recs = Vec::with_capacity(r.pieces.len());
            for (p, &(s, len)) in r.pieces.iter().enumerate() {
                let p = p as i64;
                let x = mixed.f_narrow(0, s, len)?.f_transpose(0, 1)?;
                let win = Tensor::f_cat(&[r.conv[li].f_get(p)?, x], -1)?;
                let y = win
                    .f_unsqueeze(0)?
                    .f_conv1d(&conv_w.f_unsqueeze(1)?, None::<&Tensor>, [1], [0], [1], ch)?
                    .f_squeeze_dim(0)?
                    .f_transpose(0, 1)?
                    .f_silu()?;
                convs.push(win.f_narrow(-1, len, taps - 1)?);
                let [q, k, v] = split(&y, len)?;
                let (o, state) = chunked(
                    &q,
                    &k,
                    &v,
                    &g.f_narrow(0, s, len)?,
                    &beta.f_narrow(0, s, len)?,
                    &r.rec[li].f_get(p)?,
                )?;
                outs.push(o);
                recs.push(state);
            }
            r.conv[li] = Tensor::f_stack(&convs, 0)?;
            r.rec[li] = Tensor::f_stack(&recs, 0)?;
            Tensor::f_cat(&outs, 0)?
        };
        // Per value head: RMS norm (float32), scaled, gated by SiLU(z).
        let normed = out
            .f_rms_norm([dv], None::<&Tensor>, self.config.rms_norm_eps)?
            .f_mul(&la.norm.f_to_kind(Kind::Float)?)?
            .f_mul(&z.f_reshape([n, vh, dv])?.f_to_kind(Kind::Float)?.f_silu()?)?;
        Ok(normed.f_reshape([n, vd])?.f_to_kind(hn.kind())?)
    }
}
