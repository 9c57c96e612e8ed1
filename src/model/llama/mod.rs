//! The Llama-family decoder on LibTorch: RMSNorm, rotary embeddings (with linear / Llama 3
//! scaling or GGUF frequency factors), grouped-query attention, SwiGLU MLP, tied or untied
//! LM head, optional q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3); prefill and
//! incremental decode with a KV cache.
//!
//! Owns: the parameters and the forward pass. Parameters keep HF's layout except that
//! q/k/v and gate/up are fused into one matrix each (fewer, larger matmuls per token);
//! [`Llama::hf_tensors`] splits them back into HF's names for checkpoints.
//!
//! Precision: `DType::F32` computes in float32 with LibTorch. `DType::BF16` on CUDA is
//! plain bfloat16; on the CPU it stores the matrices in bfloat16 (half the bytes to read per
//! decoded token, which is what CPU decode is bound by) but keeps activations, norms and
//! the KV cache in float32, using agentjet-kernels' bf16 matmul for up to 16 rows and a
//! bfloat16 GEMM for prefill. Loading such a model sets LibTorch to one intra-op thread
//! for the process, because the kernel pool takes the cores.
//!
//! Files: this one holds the parameters, caches, loading and HF export; `parts` the
//! pieces every forward path shares (one q/k/v + rotary path, the layer loop, MLP, head);
//! `paths` the four forward paths, which differ only in their attention strategy.
//!
//! Must never: sample, schedule, or know where token ids came from. `tch::Tensor` is not
//! `Sync`: a `Llama` lives on one thread (the engine's) and others talk to it by channel.

use agentjet_kernels::MAX_ROWS;

/// Activation rows up to which a bf16 matrix product on the CPU runs agentjet-kernels'
/// matmul; more go to LibTorch's bf16 GEMM (AMX where the CPU has it) split across the
/// kernel pool. Measured on SmolLM2 decode steps (2 AMX cores): the kernel is faster for 1
/// and 2 rows (20 vs 36 ms, 27 vs 33 ms), the GEMM from 4 rows on (34 vs 40 ms; at 16
/// rows 57 vs 124 ms).
const KERNEL_ROWS: usize = if MAX_ROWS < 2 { MAX_ROWS } else { 2 };
use tch::{Device, Kind, Tensor};

use super::config::LlamaConfig;
use super::weights::{from_interleaved_rotary, load_checked, to_interleaved_rotary, WeightSource};
use super::ModelError;
use crate::base::lock;

/// Numeric type of the weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
}

impl DType {
    pub fn kind(self) -> Kind {
        match self {
            DType::F32 => Kind::Float,
            DType::BF16 => Kind::BFloat16,
        }
    }
    pub fn hf_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "f32" | "float32" | "fp32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            _ => None,
        }
    }
}

struct DecoderLayer {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    /// The token mixer's input projection. Attention: [(heads + 2 kv_heads) * head_dim,
    /// hidden], q rows then k then v (plus, for Qwen3.5, heads * head_dim rows of the
    /// output gate); a linear-attention layer: its fused q, k, v, z, b, a.
    qkv_proj: Tensor,
    qkv_bias: Option<Tensor>,
    /// Qwen3's RMSNorm weights over each head's queries and keys, [head_dim] each, in the
    /// interleaved order of the q/k rows.
    qk_norm: Option<(Tensor, Tensor)>,
    /// The token mixer's output projection.
    o_proj: Tensor,
    /// A linear-attention (Gated DeltaNet) layer's own parameters; `None`: attention.
    linear: Option<linear::LinearAttn>,
    ffn: Ffn,
}

/// A layer's token mixer as loaded (see [`DecoderLayer`]).
struct Mixer {
    qkv_proj: Tensor,
    qkv_bias: Option<Tensor>,
    qk_norm: Option<(Tensor, Tensor)>,
    o_proj: Tensor,
    linear: Option<linear::LinearAttn>,
}

type Place<'a> = &'a dyn Fn(Tensor) -> Result<Tensor, ModelError>;

/// An attention layer's projections under `prefix` (q and k rows reordered so each
/// rotary pair is adjacent; Qwen3.5's output gate split off q_proj and put last).
fn load_attention(
    c: &LlamaConfig,
    src: &mut dyn WeightSource,
    prefix: &str,
    place: Place,
    place_act: Place,
) -> Result<Mixer, ModelError> {
    let (h, hd, rd) = (c.hidden_size as i64, c.head_dim as i64, c.rotary() as i64);
    let (nh, nkv) = (c.num_attention_heads as i64, c.num_key_value_heads as i64);
    let mut get = |n: &str, shape: &[i64]| load_checked(src, &format!("{prefix}{n}"), shape);
    let rot = |t: &Tensor, heads: i64| to_interleaved_rotary(t, heads, hd, rd);
    let gated = c.family.qwen35();
    let (q, gate) = if gated {
        // Per head: head_dim query rows, then head_dim gate rows.
        let qg = get("self_attn.q_proj.weight", &[nh * 2 * hd, h])?.f_reshape([nh, 2, hd, h])?;
        (
            qg.f_select(1, 0)?.f_reshape([nh * hd, h])?,
            Some(qg.f_select(1, 1)?.f_reshape([nh * hd, h])?),
        )
    } else {
        (get("self_attn.q_proj.weight", &[nh * hd, h])?, None)
    };
    let q = rot(&q, nh)?;
    let k = rot(&get("self_attn.k_proj.weight", &[nkv * hd, h])?, nkv)?;
    let v = get("self_attn.v_proj.weight", &[nkv * hd, h])?;
    let qkv_bias = if c.attention_bias {
        if gated {
            return Err(ModelError::Invalid(
                "qwen3_5 with attention_bias is not supported by this decoder".into(),
            ));
        }
        let qb = rot(&get("self_attn.q_proj.bias", &[nh * hd])?, nh)?;
        let kb = rot(&get("self_attn.k_proj.bias", &[nkv * hd])?, nkv)?;
        let vb = get("self_attn.v_proj.bias", &[nkv * hd])?;
        Some(place(Tensor::f_cat(
            &[
                qb.to_kind(Kind::Float),
                kb.to_kind(Kind::Float),
                vb.to_kind(Kind::Float),
            ],
            0,
        )?)?)
    } else {
        None
    };
    let qk_norm = if c.family.qk_norm() {
        let mut norm = |n: &str| -> Result<Tensor, ModelError> {
            place_act(to_interleaved_rotary(&get(n, &[hd])?, 1, hd, rd)?)
        };
        Some((
            norm("self_attn.q_norm.weight")?,
            norm("self_attn.k_norm.weight")?,
        ))
    } else {
        None
    };
    let mut rows = vec![
        q.to_kind(Kind::Float),
        k.to_kind(Kind::Float),
        v.to_kind(Kind::Float),
    ];
    rows.extend(gate.map(|g| g.to_kind(Kind::Float)));
    Ok(Mixer {
        qkv_proj: place(Tensor::f_cat(&rows, 0)?)?,
        qkv_bias,
        qk_norm,
        o_proj: place(get("self_attn.o_proj.weight", &[h, nh * hd])?)?,
        linear: None,
    })
}

/// A Gated DeltaNet layer's parameters under `prefix` (HF's `linear_attn.*`); its four
/// input projections fused into one matrix.
fn load_linear(
    c: &LlamaConfig,
    src: &mut dyn WeightSource,
    prefix: &str,
    place: Place,
    place_act: Place,
) -> Result<Mixer, ModelError> {
    let la = c
        .linear
        .as_ref()
        .ok_or_else(|| ModelError::Invalid("a linear layer in a model without them".into()))?;
    let h = c.hidden_size as i64;
    let (vh, ch, vd) = (
        la.value_heads as i64,
        la.conv_channels() as i64,
        la.value_dim() as i64,
    );
    let mut get =
        |n: &str, shape: &[i64]| load_checked(src, &format!("{prefix}linear_attn.{n}"), shape);
    let parts = [
        get("in_proj_qkv.weight", &[ch, h])?,
        get("in_proj_z.weight", &[vd, h])?,
        get("in_proj_b.weight", &[vh, h])?,
        get("in_proj_a.weight", &[vh, h])?,
    ]
    .map(|t| t.to_kind(Kind::Float));
    let conv = get("conv1d.weight", &[ch, 1, la.conv_kernel as i64])?.f_squeeze_dim(1)?;
    Ok(Mixer {
        qkv_proj: place(Tensor::f_cat(&parts, 0)?)?,
        qkv_bias: None,
        qk_norm: None,
        o_proj: place(get("out_proj.weight", &[h, vd])?)?,
        linear: Some(linear::LinearAttn {
            conv: place_act(conv)?,
            dt_bias: place_act(get("dt_bias", &[vh])?)?,
            a_log: place_act(get("A_log", &[vh])?)?,
            norm: place_act(get("norm.weight", &[la.value_head_dim as i64])?)?,
        }),
    })
}

/// A decoder layer's feed-forward part.
enum Ffn {
    /// SwiGLU. `gate_up_proj`: [2 * intermediate, hidden], gate rows then up rows;
    /// `down_proj`: [hidden, intermediate].
    Dense {
        gate_up_proj: Tensor,
        down_proj: Tensor,
    },
    /// Qwen3-MoE: each token to its top-k experts (see [`moe`]).
    Sparse(moe::Experts),
}

impl Ffn {
    fn shallow_clone(&self) -> Ffn {
        match self {
            Ffn::Dense {
                gate_up_proj,
                down_proj,
            } => Ffn::Dense {
                gate_up_proj: gate_up_proj.shallow_clone(),
                down_proj: down_proj.shallow_clone(),
            },
            Ffn::Sparse(e) => Ffn::Sparse(e.shallow_clone()),
        }
    }
}

pub use kv::{KvBlock, KvCache, SlotCache};

/// Which positions to compute logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of each row: [batch, vocab].
    Last,
    /// Every position: [batch, seq, vocab].
    All,
}

pub struct Llama {
    pub config: LlamaConfig,
    device: Device,
    dtype: DType,
    /// Activations, norms, biases and the KV cache: float32, except bfloat16 on CUDA.
    act: Kind,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Tensor>,
    /// Rotations `exp(i * position * inv_freq)`, [max_positions, head_dim / 2], complex64.
    rope: Tensor,
    /// Mixed precision for training: matrix products run in this kind over the float32
    /// weights (cast on the fly, so gradients reach the float32 master weights).
    compute: Option<Kind>,
    /// Matrix products split across the kernel pool (this thread and the pool's workers
    /// run one OpenMP thread each); see [`Llama::serve_on_kernel_pool`].
    pooled: bool,
    /// A LoRA adapter over the frozen base (see [`lora`]).
    adapter: Option<lora::Adapter>,
    /// Adapters served besides it, by index (see [`bank`]).
    bank: bank::Bank,
    /// The current forward pass's adapter per row (see [`Llama::with_adapter_rows`]).
    route: std::cell::RefCell<Option<bank::Route>>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.config)
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .finish()
    }
}

mod adapted;
pub mod bank;
mod experts;
mod kv;
mod linear;
pub mod lora;
mod mixing;
mod moe;
mod parts;
mod paths;
mod served;

impl Llama {
    /// Builds the decoder from HF-named weights, checking every name and shape.
    pub fn load(
        config: LlamaConfig,
        src: &mut dyn WeightSource,
        device: Device,
        dtype: DType,
    ) -> Result<Llama, ModelError> {
        let _guard = tch::no_grad_guard();
        let c = &config;
        let (h, i, v) = (
            c.hidden_size as i64,
            c.intermediate_size as i64,
            c.vocab_size as i64,
        );
        let kind = dtype.kind();
        // On the CPU a bfloat16 model keeps bfloat16 matrices (half the bytes to read per
        // token) but computes in float32: decode runs agentjet-kernels' bf16 matmul.
        let act = if dtype == DType::BF16 && device.is_cuda() {
            Kind::BFloat16
        } else {
            Kind::Float
        };
        let place = |t: Tensor| -> Result<Tensor, ModelError> {
            Ok(t.f_to_device(device)?.f_to_kind(kind)?.f_contiguous()?)
        };
        if dtype == DType::BF16 && device == Device::Cpu && tch::get_num_threads() != 1 {
            // agentjet-kernels' pool takes the cores for bf16 decode; OpenMP workers
            // spinning beside it would halve its speed (measured: 110 ms vs 23 ms a token).
            tracing::info!(
                "bf16 on CPU: LibTorch intra-op threads {} -> 1, kernel pool {} workers",
                tch::get_num_threads(),
                agentjet_kernels::pool().workers()
            );
            tch::set_num_threads(1);
        }
        if dtype == DType::BF16 && device == Device::Cpu {
            one_torch_thread_per_worker();
        }
        let place_act = |t: Tensor| -> Result<Tensor, ModelError> {
            Ok(t.f_to_device(device)?.f_to_kind(act)?.f_contiguous()?)
        };
        let embed_tokens = place(load_checked(src, "model.embed_tokens.weight", &[v, h])?)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}.");
            let get = |src: &mut dyn WeightSource, n: &str, shape: &[i64]| {
                load_checked(src, &format!("{p}{n}"), shape)
            };
            let mixer = if c.is_linear(l) {
                load_linear(c, src, &p, &place, &place_act)?
            } else {
                load_attention(c, src, &p, &place, &place_act)?
            };
            let ffn = if c.is_sparse(l) {
                Ffn::Sparse(moe::Experts::load(c, src, &p, &place)?)
            } else {
                let gate = get(src, "mlp.gate_proj.weight", &[i, h])?;
                let up = get(src, "mlp.up_proj.weight", &[i, h])?;
                Ffn::Dense {
                    gate_up_proj: place(Tensor::f_cat(
                        &[gate.to_kind(Kind::Float), up.to_kind(Kind::Float)],
                        0,
                    )?)?,
                    down_proj: place(get(src, "mlp.down_proj.weight", &[h, i])?)?,
                }
            };
            layers.push(DecoderLayer {
                input_layernorm: place_act(get(src, "input_layernorm.weight", &[h])?)?,
                post_attention_layernorm: place_act(get(
                    src,
                    "post_attention_layernorm.weight",
                    &[h],
                )?)?,
                qkv_proj: mixer.qkv_proj,
                qkv_bias: mixer.qkv_bias,
                qk_norm: mixer.qk_norm,
                o_proj: mixer.o_proj,
                linear: mixer.linear,
                ffn,
            });
        }
        let norm = place_act(load_checked(src, "model.norm.weight", &[h])?)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(place(load_checked(src, "lm_head.weight", &[v, h])?)?)
        };
        let factors = src.rope_freq_factors()?;
        let rope = rope_table(c, factors.as_deref(), device)?;
        Ok(Llama {
            config,
            device,
            dtype,
            act,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            compute: None,
            pooled: false,
            adapter: None,
            bank: Default::default(),
            route: Default::default(),
        })
    }

    /// Runs the matrix products of a float32 model in `kind` (bfloat16: about twice the
    /// speed on CPUs with AMX and on GPUs), casting the float32 weights on the fly so that
    /// gradients and the optimizer stay in float32; `None`: float32 throughout.
    pub fn set_compute_kind(&mut self, kind: Option<Kind>) -> Result<(), ModelError> {
        if kind.is_some() && self.dtype != DType::F32 {
            return Err(ModelError::Invalid(
                "mixed-precision compute needs a float32 model (its weights are the master copy)"
                    .into(),
            ));
        }
        self.compute = kind;
        Ok(())
    }

    /// Call on a thread that will run this model, before it does. For bf16 on the CPU this
    /// gives that thread (and the kernel pool's workers) one OpenMP thread: OpenMP's setting
    /// is per thread, and a new thread starts with one per core, whose spinning beside the
    /// pool made a 32-row decode step 4.8x slower (measured: 320 ms vs 67 ms).
    pub fn prepare_thread(&self) {
        if self.device == Device::Cpu && self.dtype == DType::BF16 {
            one_torch_thread_per_worker();
        }
    }

    /// Sizes this thread's compute to `n` cores (the count `base::cores` gives it now):
    /// the kernel pool's workers where the model runs on them (pooled, or bfloat16
    /// decode), LibTorch's intra-op threads on this thread otherwise. Call it between
    /// steps; it costs nothing when `n` did not change.
    pub fn fit_threads(&self, n: usize) {
        if self.device != Device::Cpu {
            return;
        }
        let n = n.max(1);
        agentjet_kernels::pool().set_active(n);
        if !self.pooled && self.dtype == DType::F32 {
            thread_local! {
                static SET: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
            }
            if SET.with(|c| c.replace(n)) != n {
                tch::set_num_threads(n as i32);
            }
        }
    }

    /// For a thread that serves this model for the life of the process (the engine's): on
    /// the CPU, every matrix product is split across the kernel pool (whose workers spin
    /// between jobs) and this thread runs one OpenMP thread. OpenMP's own workers spin
    /// only while no other thread of the process has an OpenMP team (libgomp throttles
    /// spinning to ~100 iterations once its threads outnumber the cores), so in a process
    /// where the loader or the trainer also ran LibTorch, each of a decode step's ~120
    /// products paid a futex wake-up: one engine stream decoded SmolLM2 f32 at 20.6
    /// tok/s where `generate` on the main thread did 32.8. Returns whether it applies.
    pub fn serve_on_kernel_pool(&mut self) -> bool {
        if self.device != Device::Cpu || agentjet_kernels::pool().workers() < 2 {
            return false;
        }
        let before = tch::get_num_threads();
        one_torch_thread_per_worker();
        if self.dtype == DType::F32 {
            // Setting a thread's count also sets the default that threads started later
            // take (the trainer's): put that back, from a thread that runs nothing else.
            let _ = std::thread::spawn(move || tch::set_num_threads(before)).join();
        }
        self.pooled = true;
        true
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether some layers are linear attention (Qwen3.5), whose sequences carry states
    /// beside their keys and values.
    pub fn has_linear_layers(&self) -> bool {
        self.config.linear.is_some()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The largest number of positions a sequence may have.
    pub fn max_positions(&self) -> usize {
        self.rope.size()[0] as usize
    }

    /// The trained parameters: the adapter's tensors when one is attached (the base is
    /// then frozen), otherwise [`Llama::base_parameters`]. The optimizer, all-reduces,
    /// DiLoCo, checkpoints' moments and weight updates to an engine all work on these.
    pub fn parameters(&self) -> Vec<Tensor> {
        match &self.adapter {
            Some(a) => a.tensors(),
            None => self.base_parameters(),
        }
    }

    /// Every tensor of the base (fused as stored: qkv and gate/up are one matrix each; a
    /// tied head is not repeated).
    pub fn base_parameters(&self) -> Vec<Tensor> {
        let mut p = vec![self.embed_tokens.shallow_clone()];
        for l in &self.layers {
            p.push(l.input_layernorm.shallow_clone());
            p.push(l.post_attention_layernorm.shallow_clone());
            p.push(l.qkv_proj.shallow_clone());
            if let Some(b) = &l.qkv_bias {
                p.push(b.shallow_clone());
            }
            if let Some((q, k)) = &l.qk_norm {
                p.push(q.shallow_clone());
                p.push(k.shallow_clone());
            }
            p.push(l.o_proj.shallow_clone());
            if let Some(la) = &l.linear {
                p.extend(la.tensors());
            }
            match &l.ffn {
                Ffn::Dense {
                    gate_up_proj,
                    down_proj,
                } => {
                    p.push(gate_up_proj.shallow_clone());
                    p.push(down_proj.shallow_clone());
                }
                Ffn::Sparse(e) => p.extend(e.tensors()),
            }
        }
        p.push(self.norm.shallow_clone());
        if let Some(h) = &self.lm_head {
            p.push(h.shallow_clone());
        }
        p
    }

    /// Makes every trained parameter ([`Llama::parameters`]) require gradients (or not).
    pub fn set_trainable(&mut self, on: bool) {
        if on {
            // A trained adapter adds its own terms (autograd must see them).
            self.unmerge_adapter();
        }
        for mut t in self.parameters() {
            let _ = t.requires_grad_(on);
        }
    }

    /// The output layer's weight, [vocab, hidden] (the token embedding when tied).
    pub fn output_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// An attention layer's tensors under HF's names (`p`: `model.layers.L.`).
    fn attention_hf_tensors(
        &self,
        p: &str,
        layer: &DecoderLayer,
    ) -> Result<Vec<(String, Tensor)>, ModelError> {
        let c = &self.config;
        let (nh, nkv, hd, rd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
            c.rotary() as i64,
        );
        let split3 = |t: &Tensor| -> Result<[Tensor; 3], ModelError> {
            Ok([
                from_interleaved_rotary(&t.f_narrow(0, 0, nh * hd)?, nh, hd, rd)?,
                from_interleaved_rotary(&t.f_narrow(0, nh * hd, nkv * hd)?, nkv, hd, rd)?,
                t.f_narrow(0, (nh + nkv) * hd, nkv * hd)?,
            ])
        };
        let mut out = Vec::new();
        let [q, k, v] = split3(&layer.qkv_proj)?;
        let q = if c.family.qwen35() {
            // Back to HF's per-head [query; gate] rows.
            let gate = layer.qkv_proj.f_narrow(0, (nh + 2 * nkv) * hd, nh * hd)?;
            let h = q.size()[1];
            Tensor::f_stack(
                &[q.f_reshape([nh, hd, h])?, gate.f_reshape([nh, hd, h])?],
                1,
            )?
            .f_reshape([nh * 2 * hd, h])?
        } else {
            q
        };
        out.push((format!("{p}self_attn.q_proj.weight"), q));
        out.push((format!("{p}self_attn.k_proj.weight"), k));
        out.push((format!("{p}self_attn.v_proj.weight"), v));
        if let Some(bias) = &layer.qkv_bias {
            let [q, k, v] = split3(bias)?;
            out.push((format!("{p}self_attn.q_proj.bias"), q));
            out.push((format!("{p}self_attn.k_proj.bias"), k));
            out.push((format!("{p}self_attn.v_proj.bias"), v));
        }
        if let Some((q, k)) = &layer.qk_norm {
            let back = |t: &Tensor| from_interleaved_rotary(t, 1, hd, rd);
            out.push((format!("{p}self_attn.q_norm.weight"), back(q)?));
            out.push((format!("{p}self_attn.k_norm.weight"), back(k)?));
        }
        out.push((
            format!("{p}self_attn.o_proj.weight"),
            layer.o_proj.shallow_clone(),
        ));
        Ok(out)
    }

    /// A linear-attention layer's tensors under HF's names.
    fn linear_hf_tensors(
        &self,
        p: &str,
        in_proj: &Tensor,
        la: &linear::LinearAttn,
        out_proj: &Tensor,
    ) -> Result<Vec<(String, Tensor)>, ModelError> {
        let h = self.linear_config()?;
        let (vh, ch, vd) = (
            h.value_heads as i64,
            h.conv_channels() as i64,
            h.value_dim() as i64,
        );
        let p = format!("{p}linear_attn.");
        Ok(vec![
            (
                format!("{p}in_proj_qkv.weight"),
                in_proj.f_narrow(0, 0, ch)?,
            ),
            (format!("{p}in_proj_z.weight"), in_proj.f_narrow(0, ch, vd)?),
            (
                format!("{p}in_proj_b.weight"),
                in_proj.f_narrow(0, ch + vd, vh)?,
            ),
            (
                format!("{p}in_proj_a.weight"),
                in_proj.f_narrow(0, ch + vd + vh, vh)?,
            ),
            (format!("{p}conv1d.weight"), la.conv.f_unsqueeze(1)?),
            (format!("{p}dt_bias"), la.dt_bias.shallow_clone()),
            (format!("{p}A_log"), la.a_log.shallow_clone()),
            (format!("{p}norm.weight"), la.norm.shallow_clone()),
            (format!("{p}out_proj.weight"), out_proj.shallow_clone()),
        ])
    }

    /// The parameters under HF's names and shapes (fused matrices split back), on the
    /// model's device and dtype. Tied heads are not repeated. With an adapter (switched
    /// on), each targeted weight is merged: `W + s·B·A`.
    pub fn hf_tensors(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let c = &self.config;
        let inter = c.intermediate_size as i64;
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.shallow_clone(),
        )];
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            if let Some(la) = &layer.linear {
                out.extend(self.linear_hf_tensors(&p, &layer.qkv_proj, la, &layer.o_proj)?);
            } else {
                out.extend(self.attention_hf_tensors(&p, layer)?);
            }
            match &layer.ffn {
                Ffn::Dense {
                    gate_up_proj,
                    down_proj,
                } => {
                    out.push((
                        format!("{p}mlp.gate_proj.weight"),
                        gate_up_proj.f_narrow(0, 0, inter)?,
                    ));
                    out.push((
                        format!("{p}mlp.up_proj.weight"),
                        gate_up_proj.f_narrow(0, inter, inter)?,
                    ));
                    out.push((
                        format!("{p}mlp.down_proj.weight"),
                        down_proj.shallow_clone(),
                    ));
                }
                Ffn::Sparse(e) => out.extend(e.hf_tensors(&p)?),
            }
            out.push((
                format!("{p}input_layernorm.weight"),
                layer.input_layernorm.shallow_clone(),
            ));
            out.push((
                format!("{p}post_attention_layernorm.weight"),
                layer.post_attention_layernorm.shallow_clone(),
            ));
        }
        out.push(("model.norm.weight".to_string(), self.norm.shallow_clone()));
        if let Some(head) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), head.shallow_clone()));
        }
        // (A model serving its adapter merged already holds W + s·B·A.)
        if let Some(a) = self
            .adapter
            .as_ref()
            .filter(|a| a.enabled() && !a.is_merged())
        {
            // Merged: each targeted weight becomes W + s·B·A (computed in float32).
            for (name, w) in out.iter_mut() {
                let Some((l, t)) = lora::Target::ALL.iter().find_map(|&t| {
                    let rest = name.strip_prefix("model.layers.")?;
                    let (l, tail) = rest.split_once('.')?;
                    (tail == format!("{}.weight", t.module())).then(|| (l.parse().ok(), t))
                }) else {
                    continue;
                };
                let Some(l) = l else { continue };
                if let Some(d) = a.delta_weight(l, t, c)? {
                    *w = w
                        .f_to_kind(Kind::Float)?
                        .f_add(&d.f_to_device(w.device())?)?
                        .f_to_kind(w.kind())?;
                }
            }
        }
        Ok(out)
    }
}

/// A tensor handed to the kernel pool's workers for read-only use.
struct SharedTensor(Tensor);
// SAFETY: the workers only read it (narrow, matmul) while `split_gemm` waits for
// them; LibTorch's reference counts are atomic.
unsafe impl Sync for SharedTensor {}

/// `x · wᵀ` on the CPU with the rows of `w` split across the kernel pool, each share a
/// single-threaded LibTorch GEMM (any kind); the shares are concatenated along the last
/// dimension.
fn split_gemm(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    let pool = agentjet_kernels::pool();
    let workers = pool.active() as i64;
    let n = w.size()[0];
    if workers <= 1 || n < 64 {
        return Ok(x.f_linear(w, None::<&Tensor>)?);
    }
    let per = (n + workers - 1) / workers;
    let xs: Vec<SharedTensor> = (0..workers)
        .map(|_| SharedTensor(x.shallow_clone()))
        .collect();
    let ws: Vec<SharedTensor> = (0..workers)
        .map(|_| SharedTensor(w.shallow_clone()))
        .collect();
    let parts: std::sync::Mutex<Vec<Option<Result<Tensor, tch::TchError>>>> =
        std::sync::Mutex::new((0..workers).map(|_| None).collect());
    pool.run_on(workers as usize, &|wi| {
        let wi = wi as i64;
        let j0 = (wi * per).min(n);
        let len = per.min(n - j0);
        if len == 0 {
            return;
        }
        let part = ws[wi as usize]
            .0
            .f_narrow(0, j0, len)
            .and_then(|wpart| xs[wi as usize].0.f_linear(&wpart, None::<&Tensor>));
        lock(&parts)[wi as usize] = Some(part);
    });
    let parts = parts.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut outs = Vec::new();
    for p in parts.into_iter().flatten() {
        outs.push(p?);
    }
    Ok(Tensor::f_cat(&outs, -1)?)
}

/// One LibTorch (OpenMP) thread on the calling thread and on every kernel-pool worker.
fn one_torch_thread_per_worker() {
    agentjet_kernels::pool().run(&|_| tch::set_num_threads(1));
}

/// Rotations as HF computes their angles: float32 `position * inv_freq`, then
/// `cos + i sin`, [max_positions, head_dim / 2] complex64 (1 for unrotated pairs).
fn rope_table(
    c: &LlamaConfig,
    factors: Option<&[f32]>,
    device: Device,
) -> Result<Tensor, ModelError> {
    let mut inv: Vec<f32> = c.inv_freq().iter().map(|&f| f as f32).collect();
    if let Some(f) = factors {
        if f.len() != inv.len() {
            return Err(ModelError::Invalid(format!(
                "rope_freqs has {} factors, expected {}",
                f.len(),
                inv.len()
            )));
        }
        for (i, d) in inv.iter_mut().zip(f) {
            *i /= d;
        }
    }
    // Dimensions past the rotated ones (Qwen3.5's partial rotary) pass unchanged: angle 0.
    inv.resize(c.head_dim / 2, 0.0);
    let max = c.max_position_embeddings.max(1) as i64;
    let pos = Tensor::f_arange(max, (Kind::Float, Device::Cpu))?;
    let inv = Tensor::f_from_slice(&inv)?;
    let angles = pos.f_outer(&inv)?;
    let table = Tensor::f_stack(&[angles.f_cos()?, angles.f_sin()?], -1)?
        .f_view_as_complex()?
        .f_to_device(device)?;
    Ok(table)
}
