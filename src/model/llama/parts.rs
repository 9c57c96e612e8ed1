//! The parts every forward path shares: matrix products (with the CPU's bf16 kernels),
//! RMSNorm, the embedding, one layer's attention inputs (norm, fused q/k/v, rotary), the
//! layer loop with its output projection and SwiGLU MLP, and the head. A path brings only
//! its attention strategy (see `paths`).

use agentjet_kernels::matmul_bf16;
use tch::{Device, Kind, Tensor};

use super::linear::Recurrent;
use super::lora::Target;
use super::{split_gemm, DecoderLayer, Ffn, Llama, KERNEL_ROWS};
use crate::model::ModelError;

/// One layer's attention inputs, tokens laid out as the path asked (`lead`): q
/// `[lead.., heads, head_dim]`, k and v `[lead.., kv_heads, head_dim]`; q and k rotated.
pub(super) struct Qkv {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

/// A norm's scale: `w`, or `1 + w` where the family stores it centred on 0 (Qwen3.5).
fn scale(centred: bool, w: &Tensor) -> Result<Tensor, ModelError> {
    Ok(if centred {
        w.f_add_scalar(1.0)?
    } else {
        w.shallow_clone()
    })
}

impl Llama {
    /// `x · wᵀ (+ bias)` for activations `x` [.., k] and a weight matrix `w` [n, k].
    pub(super) fn linear(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        if let Some(k) = self
            .compute
            .filter(|&k| k != x.kind() && w.kind() == x.kind())
        {
            let b = bias.map(|b| b.f_to_kind(k)).transpose()?;
            return Ok(x
                .f_to_kind(k)?
                .f_linear(&w.f_to_kind(k)?, b.as_ref())?
                .f_to_kind(x.kind())?);
        }
        if w.kind() == x.kind() {
            if self.pooled && !x.requires_grad() && x.numel() > 0 {
                let y = split_gemm(x, w)?;
                return Ok(match bias {
                    Some(b) => y.f_add(b)?,
                    None => y,
                });
            }
            return Ok(x.f_linear(w, bias)?);
        }
        if x.requires_grad() {
            // Training over a frozen bfloat16 base (a LoRA adapter): LibTorch's own
            // product on this thread, which autograd sees.
            let y = x
                .f_to_kind(w.kind())?
                .f_linear(w, None::<&Tensor>)?
                .f_to_kind(x.kind())?;
            return Ok(match bias {
                Some(b) => y.f_add(b)?,
                None => y,
            });
        }
        // bfloat16 weights, float32 activations (CPU).
        let size = x.size();
        let k = *size.last().unwrap_or(&0);
        let rows = if k > 0 { x.numel() as i64 / k } else { 0 };
        let n = w.size()[0];
        let y = if self.device == Device::Cpu && rows > 0 && rows as usize <= KERNEL_ROWS {
            let x = x.f_contiguous()?;
            let y = Tensor::f_empty([rows, n], (Kind::Float, Device::Cpu))?;
            // SAFETY: all three tensors are contiguous CPU tensors of the kinds and element
            // counts given (x float32 [rows, k], w bfloat16 [n, k], y float32 [rows, n]);
            // they live on this thread for the whole call and y is not aliased.
            let (xs, ws, ys) = unsafe {
                (
                    std::slice::from_raw_parts(x.data_ptr() as *const f32, (rows * k) as usize),
                    std::slice::from_raw_parts(w.data_ptr() as *const u16, (n * k) as usize),
                    std::slice::from_raw_parts_mut(y.data_ptr() as *mut f32, (rows * n) as usize),
                )
            };
            matmul_bf16(xs, rows as usize, k as usize, ws, n as usize, ys)
                .map_err(|e| ModelError::Invalid(e.to_string()))?;
            let mut out_shape = size[..size.len() - 1].to_vec();
            out_shape.push(n);
            y.f_view(out_shape.as_slice())?
        } else if self.device == Device::Cpu && rows > 0 {
            // More rows: a bfloat16 GEMM (AMX/AVX-512 in oneDNN). LibTorch runs one
            // intra-op thread in this mode, so the kernel pool's workers each take a share
            // of W's rows.
            split_gemm(&x.f_to_kind(w.kind())?, w)?.f_to_kind(x.kind())?
        } else {
            x.f_to_kind(w.kind())?
                .f_linear(w, None::<&Tensor>)?
                .f_to_kind(x.kind())?
        };
        Ok(match bias {
            Some(b) => y.f_add(b)?,
            None => y,
        })
    }

    pub(super) fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
        let eps = self.config.rms_norm_eps;
        let h = self.config.hidden_size as i64;
        let w = &scale(self.config.family.qwen35(), w)?;
        Ok(match self.act {
            Kind::Float => x.f_rms_norm([h], Some(w), eps)?,
            // HF: normalise in f32, cast back, then scale.
            _ => x
                .f_to_kind(Kind::Float)?
                .f_rms_norm([h], None::<&Tensor>, eps)?
                .f_to_kind(self.act)?
                .f_mul(w)?,
        })
    }

    /// The token embeddings of `ids` (any shape, int64), flattened: [tokens, hidden] in the
    /// activation kind: the residual stream every path starts from.
    pub(super) fn embed(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        Ok(
            Tensor::f_embedding(&self.embed_tokens, &ids.f_reshape([-1])?, -1, false, false)?
                .f_to_kind(self.act)?,
        )
    }

    /// A layer's attention inputs for the residual stream `x` ([tokens, hidden], tokens
    /// laid out as `lead`, e.g. `[batch, seq]` or `[n]`): the input norm, the fused q/k/v
    /// projection, and the rotation of q and k by `rope` (broadcastable to
    /// `[lead.., 1, head_dim / 2]` complex). The same for every path.
    fn attention_inputs(
        &self,
        l: usize,
        layer: &DecoderLayer,
        hn: &Tensor,
        rope: &Tensor,
        lead: &[i64],
    ) -> Result<(Qkv, Option<Tensor>), ModelError> {
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let shape = |tail: &[i64]| -> Vec<i64> { lead.iter().chain(tail).copied().collect() };
        let mut qkv = self.linear(hn, &layer.qkv_proj, layer.qkv_bias.as_ref())?;
        if let Some(d) = self.lora(l, &[Target::Q, Target::K, Target::V], hn)? {
            qkv = qkv.f_add(&d)?;
        }
        let mut qk = qkv.f_narrow(-1, 0, (nh + nkv) * hd)?;
        if let Some((qn, kn)) = &layer.qk_norm {
            // Qwen3: each head's query and key RMS-normalised over head_dim (as HF: in
            // float32, cast back, then scaled), before the rotation.
            let centred = c.family.qwen35();
            let w = Tensor::f_cat(
                &[
                    scale(centred, qn)?
                        .f_unsqueeze(0)?
                        .f_expand([nh, hd], false)?,
                    scale(centred, kn)?
                        .f_unsqueeze(0)?
                        .f_expand([nkv, hd], false)?,
                ],
                0,
            )?;
            let heads = qk.f_view(shape(&[nh + nkv, hd]).as_slice())?;
            let normed = match self.act {
                Kind::Float => heads.f_rms_norm([hd], None::<&Tensor>, c.rms_norm_eps)?,
                _ => heads
                    .f_to_kind(Kind::Float)?
                    .f_rms_norm([hd], None::<&Tensor>, c.rms_norm_eps)?
                    .f_to_kind(self.act)?,
            };
            qk = normed.f_mul(&w)?;
        }
        // q and k rotate together: their rows are stored with rotary pairs adjacent, so the
        // rotation is one complex multiply.
        let qk = qk.f_view(shape(&[nh + nkv, hd / 2, 2]).as_slice())?;
        let qk = apply_rope(&qk, rope)?.f_view(shape(&[nh + nkv, hd]).as_slice())?;
        let at = lead.len() as i64;
        let gate = c
            .family
            .qwen35()
            .then(|| qkv.f_narrow(-1, (nh + 2 * nkv) * hd, nh * hd))
            .transpose()?;
        Ok((
            Qkv {
                q: qk.f_narrow(at, 0, nh)?,
                k: qk.f_narrow(at, nh, nkv)?,
                v: qkv
                    .f_narrow(-1, (nh + nkv) * hd, nkv * hd)?
                    .f_view(shape(&[nkv, hd]).as_slice())?,
            },
            gate,
        ))
    }

    /// Every decoder layer over the residual stream `x` ([tokens, hidden]): the shared
    /// attention inputs ([`Llama::attention_inputs`]), then the path's attention strategy
    /// `attend(layer index, q/k/v)` which returns [tokens, heads * head_dim], then the
    /// output projection, residual and MLP. The four forward paths differ only in `attend`
    /// (and in how they lay out tokens and rotations).
    ///
    /// `attend` gets the attention layer's index among the attention layers (its KV
    /// cache's index). Qwen3.5's linear-attention layers instead run over the sequences
    /// of `recurrent` and advance their states (a model with such layers needs it).
    pub(super) fn run_layers(
        &self,
        mut x: Tensor,
        rope: &Tensor,
        lead: &[i64],
        mut recurrent: Option<&mut Recurrent>,
        mut attend: impl FnMut(usize, Qkv) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let (mut ai, mut li) = (0, 0);
        for (l, layer) in self.layers.iter().enumerate() {
            let hn = self.rms_norm(&x, &layer.input_layernorm)?;
            let mixed = if let Some(la) = &layer.linear {
                let r = recurrent.as_deref_mut().ok_or_else(|| {
                    ModelError::Invalid(
                        "a linear-attention layer needs its sequences' states (this path has none)"
                            .into(),
                    )
                })?;
                let flat = hn.f_reshape([-1, c.hidden_size as i64])?;
                let y = self.linear_mix(li, &layer.qkv_proj, la, &flat, r)?;
                li += 1;
                y.f_reshape(
                    hn.size()[..hn.dim() - 1]
                        .iter()
                        .copied()
                        .chain([y.size()[1]])
                        .collect::<Vec<_>>()
                        .as_slice(),
                )?
            } else {
                let (qkv, gate) = self.attention_inputs(l, layer, &hn, rope, lead)?;
                let mut attn = attend(ai, qkv)?;
                ai += 1;
                if let Some(gate) = gate {
                    // Qwen3.5's output gate: sigmoid of q_proj's gate rows.
                    attn = attn.f_mul(&gate.f_reshape(attn.size().as_slice())?.f_sigmoid()?)?;
                }
                attn
            };
            x = self.finish_layer(l, layer, &x, &mixed)?;
        }
        Ok(x)
    }

    /// The rest of a decoder layer once attention is done: output projection and residual,
    /// then the SwiGLU MLP (or the experts of a sparse layer) and residual. `x` and `attn` are [rows, ..] alike.
    fn finish_layer(
        &self,
        l: usize,
        layer: &DecoderLayer,
        x: &Tensor,
        attn: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let inter = self.config.intermediate_size as i64;
        let with_lora =
            |y: Tensor, targets: &[Target], input: &Tensor| match self.lora(l, targets, input)? {
                Some(d) => Ok::<_, ModelError>(y.f_add(&d)?),
                None => Ok(y),
            };
        let o = with_lora(self.linear(attn, &layer.o_proj, None)?, &[Target::O], attn)?;
        let x = x.f_add(&o)?;
        let hn = self.rms_norm(&x, &layer.post_attention_layernorm)?;
        let (gate_up_proj, down_proj) = match &layer.ffn {
            Ffn::Dense {
                gate_up_proj,
                down_proj,
            } => (gate_up_proj, down_proj),
            Ffn::Sparse(experts) => return Ok(x.f_add(&self.experts(experts, &hn)?)?),
        };
        let gu = with_lora(
            self.linear(&hn, gate_up_proj, None)?,
            &[Target::Gate, Target::Up],
            &hn,
        )?;
        let act = gu
            .f_narrow(-1, 0, inter)?
            .f_silu()?
            .f_mul(&gu.f_narrow(-1, inter, inter)?)?;
        let down = with_lora(self.linear(&act, down_proj, None)?, &[Target::Down], &act)?;
        Ok(x.f_add(&down)?)
    }

    /// Final norm and LM head: float32 logits.
    pub(super) fn head(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let x = self.rms_norm(x, &self.norm)?;
        Ok(self
            .linear(&x, self.output_weight(), None)?
            .f_to_kind(Kind::Float)?)
    }
}

/// Rotates adjacent pairs of `x` ([lead.., heads, head_dim / 2, 2]) by `rope` (complex,
/// broadcastable to [lead.., 1, head_dim / 2]), in float32, returning x's dtype.
fn apply_rope(x: &Tensor, rope: &Tensor) -> Result<Tensor, ModelError> {
    let kind = x.kind();
    let xf = if kind == Kind::Float {
        x.shallow_clone()
    } else {
        x.f_to_kind(Kind::Float)?
    };
    let rotated = xf.f_view_as_complex()?.f_mul(rope)?.f_view_as_real()?;
    Ok(if kind == Kind::Float {
        rotated
    } else {
        rotated.f_to_kind(kind)?
    })
}
