//! The Llama-family decoder on LibTorch: RMSNorm, rotary embeddings (with linear / Llama 3
//! scaling or GGUF frequency factors), grouped-query attention, SwiGLU MLP, tied or untied
//! LM head, optional q/k/v biases (Qwen2); prefill and incremental decode with a KV cache.
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
//! Must never: sample, schedule, or know where token ids came from. `tch::Tensor` is not
//! `Sync`: a `Llama` lives on one thread (the engine's) and others talk to it by channel.

use agentjet_kernels::{matmul_bf16, MAX_ROWS};

/// Activation rows up to which a bf16 matrix product on the CPU runs agentjet-kernels'
/// matmul; more go to LibTorch's bf16 GEMM (AMX where the CPU has it) split across the
/// kernel pool. Measured on SmolLM2 decode steps (2 AMX cores): the kernel is faster for 1
/// and 2 rows (20 vs 36 ms, 27 vs 33 ms), the GEMM from 4 rows on (34 vs 40 ms; at 16
/// rows 57 vs 124 ms).
const KERNEL_ROWS: usize = if MAX_ROWS < 2 { MAX_ROWS } else { 2 };
use tch::{Device, Kind, Tensor};

use super::config::LlamaConfig;
use super::weights::{load_checked, unpermute_qk, WeightSource};
use super::ModelError;

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
    /// [ (heads + 2 kv_heads) * head_dim, hidden ]
    qkv_proj: Tensor,
    qkv_bias: Option<Tensor>,
    o_proj: Tensor,
    /// [ 2 * intermediate, hidden ]: gate rows then up rows.
    gate_up_proj: Tensor,
    down_proj: Tensor,
}

/// Per-layer key/value tensors of shape [batch, kv_heads, capacity, head_dim]; the first
/// `len` positions are filled.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    capacity: usize,
    batch: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn batch(&self) -> usize {
        self.batch
    }
}

/// Key/value storage for many sequences at once: per layer one tensor
/// [slots, kv_heads, capacity, head_dim]. Running sequences occupy slots `0..n`, so a decode
/// step attends over one view of the first `n` slots with a length mask: one attention call
/// per layer for the whole batch.
pub struct SlotCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    slots: usize,
    capacity: usize,
}

impl SlotCache {
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Bytes held (allocated once, up front).
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(self.v.iter())
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }
    /// Copies the first `len` positions of slot `from` into slot `to` (compaction, and
    /// forking one prefilled prompt into several sequences).
    pub fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), ModelError> {
        if from == to || len == 0 {
            return Ok(());
        }
        for t in self.k.iter().chain(self.v.iter()) {
            let src = t.f_narrow(0, from as i64, 1)?.f_narrow(2, 0, len as i64)?;
            t.f_narrow(0, to as i64, 1)?
                .f_narrow(2, 0, len as i64)?
                .f_copy_(&src)?;
        }
        Ok(())
    }
}

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
        let (h, i, hd) = (
            c.hidden_size as i64,
            c.intermediate_size as i64,
            c.head_dim as i64,
        );
        let (nh, nkv, v) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
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
            let q = to_interleaved(&get(src, "self_attn.q_proj.weight", &[nh * hd, h])?, nh)?;
            let k = to_interleaved(&get(src, "self_attn.k_proj.weight", &[nkv * hd, h])?, nkv)?;
            let vv = get(src, "self_attn.v_proj.weight", &[nkv * hd, h])?;
            let qkv_bias = if c.attention_bias {
                let qb = to_interleaved(&get(src, "self_attn.q_proj.bias", &[nh * hd])?, nh)?;
                let kb = to_interleaved(&get(src, "self_attn.k_proj.bias", &[nkv * hd])?, nkv)?;
                let vb = get(src, "self_attn.v_proj.bias", &[nkv * hd])?;
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
            let gate = get(src, "mlp.gate_proj.weight", &[i, h])?;
            let up = get(src, "mlp.up_proj.weight", &[i, h])?;
            layers.push(DecoderLayer {
                input_layernorm: place_act(get(src, "input_layernorm.weight", &[h])?)?,
                post_attention_layernorm: place_act(get(
                    src,
                    "post_attention_layernorm.weight",
                    &[h],
                )?)?,
                qkv_proj: place(Tensor::f_cat(
                    &[
                        q.to_kind(Kind::Float),
                        k.to_kind(Kind::Float),
                        vv.to_kind(Kind::Float),
                    ],
                    0,
                )?)?,
                qkv_bias,
                o_proj: place(get(src, "self_attn.o_proj.weight", &[h, nh * hd])?)?,
                gate_up_proj: place(Tensor::f_cat(
                    &[gate.to_kind(Kind::Float), up.to_kind(Kind::Float)],
                    0,
                )?)?,
                down_proj: place(get(src, "mlp.down_proj.weight", &[h, i])?)?,
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

    pub fn device(&self) -> Device {
        self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The largest number of positions a sequence may have.
    pub fn max_positions(&self) -> usize {
        self.rope.size()[0] as usize
    }

    /// Zeroed per-layer key and value tensors [rows, kv_heads, capacity, head_dim], the
    /// capacity capped at the model's context.
    fn zeroed_kv(
        &self,
        rows: usize,
        capacity: usize,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>, usize), ModelError> {
        let capacity = capacity.min(self.max_positions());
        let shape = [
            rows as i64,
            self.config.num_key_value_heads as i64,
            capacity as i64,
            self.config.head_dim as i64,
        ];
        let opts = (self.act, self.device);
        let mut k = Vec::with_capacity(self.layers.len());
        let mut v = Vec::with_capacity(self.layers.len());
        for _ in 0..self.layers.len() {
            k.push(Tensor::f_zeros(shape, opts)?);
            v.push(Tensor::f_zeros(shape, opts)?);
        }
        Ok((k, v, capacity))
    }

    /// An empty cache for `batch` rows of up to `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache, ModelError> {
        let (k, v, capacity) = self.zeroed_kv(batch, capacity)?;
        Ok(KvCache {
            k,
            v,
            len: 0,
            capacity,
            batch,
        })
    }

    /// `x · wᵀ (+ bias)` for activations `x` [.., k] and a weight matrix `w` [n, k].
    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor, ModelError> {
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
            return Ok(x.f_linear(w, bias)?);
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
            split_bf16_gemm(&x.f_to_kind(w.kind())?, w)?.f_to_kind(x.kind())?
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

    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
        let eps = self.config.rms_norm_eps;
        let h = self.config.hidden_size as i64;
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

    /// Runs `ids` ([batch, seq], int64) through the decoder, appending their keys and
    /// values to `cache` (whose filled length is their starting position), and returns
    /// float32 logits.
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        which: Logits,
    ) -> Result<Tensor, ModelError> {
        let size = ids.size();
        let [b, t] = size[..] else {
            return Err(ModelError::Invalid(format!(
                "forward wants ids of shape [batch, seq], got {size:?}"
            )));
        };
        if b as usize != cache.batch {
            return Err(ModelError::Invalid(format!(
                "batch of {b} rows does not match a cache of {}",
                cache.batch
            )));
        }
        let start = cache.len as i64;
        let end = start + t;
        if t == 0 || end as usize > cache.capacity {
            return Err(ModelError::Invalid(format!(
                "{t} new positions after {start} exceed the cache capacity of {} (model limit {})",
                cache.capacity,
                self.max_positions()
            )));
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let rope = self.rope.f_narrow(0, start, t)?.f_unsqueeze(1)?;
        // Queries attend to every cached position and causally among themselves.
        let mask = if t > 1 && start > 0 {
            let q_pos =
                Tensor::f_arange_start(start, end, (Kind::Int64, self.device))?.f_unsqueeze(1)?;
            let k_pos = Tensor::f_arange(end, (Kind::Int64, self.device))?.f_unsqueeze(0)?;
            Some(k_pos.f_le_tensor(&q_pos)?)
        } else {
            None
        };
        let is_causal = t > 1 && start == 0;
        let h = c.hidden_size as i64;
        // The residual stream as [tokens, hidden].
        let mut x =
            Tensor::f_embedding(&self.embed_tokens, &ids.f_reshape([-1])?, -1, false, false)?
                .f_to_kind(self.act)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let hn = self.rms_norm(&x, &layer.input_layernorm)?;
            let qkv = self.linear(&hn, &layer.qkv_proj, layer.qkv_bias.as_ref())?;
            // q and k rotate together: their rows are stored with rotary pairs adjacent,
            // so the rotation is one complex multiply.
            let qk = qkv
                .f_narrow(-1, 0, (nh + nkv) * hd)?
                .f_view([b, t, nh + nkv, hd / 2, 2])?;
            let qk = apply_rope(&qk, &rope)?.f_view([b, t, nh + nkv, hd])?;
            let q = qk.f_narrow(2, 0, nh)?.f_transpose(1, 2)?;
            let k = qk.f_narrow(2, nh, nkv)?.f_transpose(1, 2)?;
            let v = qkv
                .f_narrow(-1, (nh + nkv) * hd, nkv * hd)?
                .f_view([b, t, nkv, hd])?
                .f_transpose(1, 2)?;
            cache.k[l].f_narrow(2, start, t)?.f_copy_(&k)?;
            cache.v[l].f_narrow(2, start, t)?.f_copy_(&v)?;
            let (kk, vv) = if start == 0 {
                (k, v)
            } else {
                (
                    cache.k[l].f_narrow(2, 0, end)?,
                    cache.v[l].f_narrow(2, 0, end)?,
                )
            };
            let attn = Tensor::f_scaled_dot_product_attention(
                &q,
                &kk,
                &vv,
                mask.as_ref(),
                0.0,
                is_causal,
                None,
                nkv != nh,
            )?;
            let attn = attn.f_transpose(1, 2)?.f_reshape([b * t, nh * hd])?;
            x = self.finish_layer(layer, &x, &attn)?;
        }
        let x = x.f_view([b, t, h])?;
        cache.len = end as usize;
        let x = match which {
            Logits::Last => x.f_select(1, t - 1)?,
            Logits::All => x,
        };
        self.head(&x)
    }

    /// Every parameter tensor (fused as stored: qkv and gate/up are one matrix each; a
    /// tied head is not repeated), for training.
    pub fn parameters(&self) -> Vec<Tensor> {
        let mut p = vec![self.embed_tokens.shallow_clone()];
        for l in &self.layers {
            p.push(l.input_layernorm.shallow_clone());
            p.push(l.post_attention_layernorm.shallow_clone());
            p.push(l.qkv_proj.shallow_clone());
            if let Some(b) = &l.qkv_bias {
                p.push(b.shallow_clone());
            }
            p.push(l.o_proj.shallow_clone());
            p.push(l.gate_up_proj.shallow_clone());
            p.push(l.down_proj.shallow_clone());
        }
        p.push(self.norm.shallow_clone());
        if let Some(h) = &self.lm_head {
            p.push(h.shallow_clone());
        }
        p
    }

    /// Makes every parameter require gradients (or not).
    pub fn set_trainable(&mut self, on: bool) {
        for mut t in self.parameters() {
            let _ = t.requires_grad_(on);
        }
    }

    /// The training forward of one packed row (see `timeline::layout`): `ids` and
    /// `positions` are [n] int64; `parent[i]` is the row index of token i's predecessor in
    /// its sequence (-1 for a first token). Sequences packed side by side, or sharing
    /// prefixes as a tree, each see only their own tokens, at their own positions.
    ///
    /// Attention runs per segment (a maximal run of tokens each following the one before
    /// it): a segment's queries attend to its ancestors' tokens and causally within
    /// itself, so the cost is that of the sequences, not of the row squared. (A segment
    /// with ancestors recomputes its ancestors' attention rows to stay on the causal
    /// kernel; their projections and MLPs are not recomputed.) No KV cache;
    /// differentiable. Returns float32 logits of the row indices in `rows` ([m], int64;
    /// repeats allowed), or of every token: [m or n, vocab].
    pub fn forward_row(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
        rows: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let h = self.forward_row_hidden(ids, positions, parent, rows)?;
        Ok(self
            .linear(&h, self.output_weight(), None)?
            .f_to_kind(Kind::Float)?)
    }

    /// [`Llama::forward_row`] up to the output layer: the final-normed hidden states (the
    /// head's input, [rows or n, hidden], float32 on CPU) at `rows`, for a chunked
    /// log-probability kernel that never forms [tokens x vocabulary] logits at once.
    pub fn forward_row_hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
        rows: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let x = self.row_states(ids, positions, parent)?;
        let x = match rows {
            Some(r) => x.f_index_select(0, r)?,
            None => x,
        };
        self.rms_norm(&x, &self.norm)
    }

    /// The output layer's weight, [vocab, hidden] (the token embedding when tied).
    pub fn output_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    fn row_states(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        parent: &[i32],
    ) -> Result<Tensor, ModelError> {
        let n = ids.size().first().copied().unwrap_or(0);
        if ids.dim() != 1 || positions.size() != [n] || parent.len() as i64 != n || n == 0 {
            return Err(ModelError::Invalid(format!(
                "forward_row wants ids [n], positions [n] and n parents; got {:?}, {:?}, {}",
                ids.size(),
                positions.size(),
                parent.len()
            )));
        }
        let segments = row_segments(parent, self.device, self.act)?;
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let rope = self.rope.f_index_select(0, positions)?.f_unsqueeze(1)?;
        let mut x =
            Tensor::f_embedding(&self.embed_tokens, ids, -1, false, false)?.f_to_kind(self.act)?;
        let mut parts = Vec::with_capacity(segments.len());
        for layer in &self.layers {
            let hn = self.rms_norm(&x, &layer.input_layernorm)?;
            let qkv = self.linear(&hn, &layer.qkv_proj, layer.qkv_bias.as_ref())?;
            let qk = qkv
                .f_narrow(-1, 0, (nh + nkv) * hd)?
                .f_view([n, nh + nkv, hd / 2, 2])?;
            let qk = apply_rope(&qk, &rope)?.f_view([n, nh + nkv, hd])?;
            let q = qk.f_narrow(1, 0, nh)?;
            let k = qk.f_narrow(1, nh, nkv)?;
            let v = qkv
                .f_narrow(-1, (nh + nkv) * hd, nkv * hd)?
                .f_view([n, nkv, hd])?;
            parts.clear();
            for seg in &segments {
                let heads_first = |t: Tensor| -> Result<Tensor, ModelError> {
                    Ok(t.f_transpose(0, 1)?.f_unsqueeze(0)?)
                };
                // A segment with ancestors: its queries against its ancestors' keys and
                // its own, causal (bottom-right aligned) through an additive mask; alone:
                // the causal kernel. (Measured fwd+bwd for 480 queries over 600 ancestors,
                // 9 heads: 31 ms with the mask vs 61 ms rerunning the ancestors causally.)
                let qs = heads_first(q.f_narrow(0, seg.start, seg.len)?)?;
                let (ks, vs) = match &seg.keys {
                    None => (
                        heads_first(k.f_narrow(0, seg.start, seg.len)?)?,
                        heads_first(v.f_narrow(0, seg.start, seg.len)?)?,
                    ),
                    Some((idx, _)) => (
                        heads_first(k.f_index_select(0, idx)?)?,
                        heads_first(v.f_index_select(0, idx)?)?,
                    ),
                };
                let attn = Tensor::f_scaled_dot_product_attention(
                    &qs,
                    &ks,
                    &vs,
                    seg.keys.as_ref().map(|(_, mask)| mask),
                    0.0,
                    seg.keys.is_none() && seg.len > 1,
                    None,
                    nkv != nh,
                )?;
                parts.push(
                    attn.f_squeeze_dim(0)?
                        .f_transpose(0, 1)?
                        .f_reshape([seg.len, nh * hd])?,
                );
            }
            let attn = if parts.len() == 1 {
                parts[0].shallow_clone()
            } else {
                Tensor::f_cat(&parts, 0)?
            };
            x = self.finish_layer(layer, &x, &attn)?;
        }
        Ok(x)
    }

    /// Storage for `slots` sequences of up to `capacity` positions each (zeroed).
    pub fn new_slot_cache(&self, slots: usize, capacity: usize) -> Result<SlotCache, ModelError> {
        let (k, v, capacity) = self.zeroed_kv(slots, capacity)?;
        Ok(SlotCache {
            k,
            v,
            slots,
            capacity,
        })
    }

    /// Prefills several prompts at once, each into its own slot from position 0: the
    /// prompts are packed into one row of tokens so every matrix runs once for all of them,
    /// while attention stays causal within each prompt. Returns float32 logits of each
    /// prompt's last position, [prompts, vocab], in the order given.
    pub fn prefill_slots(
        &self,
        seqs: &[(usize, &[u32])],
        cache: &SlotCache,
    ) -> Result<Tensor, ModelError> {
        if seqs.is_empty() {
            return Err(ModelError::Invalid("prefill_slots: no prompts".into()));
        }
        let vocab = self.config.vocab_size as u32;
        let mut used = vec![false; cache.slots];
        let mut tok: Vec<i64> = Vec::new();
        let mut pos: Vec<i64> = Vec::new();
        let mut last: Vec<i64> = Vec::with_capacity(seqs.len());
        for (i, &(slot, ids)) in seqs.iter().enumerate() {
            if slot >= cache.slots || std::mem::replace(&mut used[slot], true) {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: slot {slot} is out of range or used twice ({} slots)",
                    cache.slots
                )));
            }
            if ids.is_empty() || ids.len() > cache.capacity {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: {} tokens do not fit a slot of {} positions",
                    ids.len(),
                    cache.capacity
                )));
            }
            if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ModelError::Invalid(format!(
                    "prompt {i}: token id {bad} is outside the vocabulary of {vocab}"
                )));
            }
            tok.extend(ids.iter().map(|&t| t as i64));
            pos.extend(0..ids.len() as i64);
            last.push(tok.len() as i64 - 1);
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let dev = self.device;
        let total = tok.len() as i64;
        let tok = Tensor::f_from_slice(&tok)?.f_to_device(dev)?;
        let pos_t = Tensor::f_from_slice(&pos)?.f_to_device(dev)?;
        let rope = self.rope.f_index_select(0, &pos_t)?.f_unsqueeze(1)?;
        let mut x =
            Tensor::f_embedding(&self.embed_tokens, &tok, -1, false, false)?.f_to_kind(self.act)?;
        let mut parts = Vec::with_capacity(seqs.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let hn = self.rms_norm(&x, &layer.input_layernorm)?;
            let qkv = self.linear(&hn, &layer.qkv_proj, layer.qkv_bias.as_ref())?;
            let qk = qkv
                .f_narrow(-1, 0, (nh + nkv) * hd)?
                .f_view([total, nh + nkv, hd / 2, 2])?;
            let qk = apply_rope(&qk, &rope)?.f_view([total, nh + nkv, hd])?;
            let v = qkv
                .f_narrow(-1, (nh + nkv) * hd, nkv * hd)?
                .f_view([total, nkv, hd])?;
            parts.clear();
            let mut off = 0i64;
            for &(slot, ids) in seqs {
                let t = ids.len() as i64;
                // [1, heads, t, hd]
                let head_major =
                    |x: &Tensor, from: i64, heads: i64| -> Result<Tensor, ModelError> {
                        Ok(x.f_narrow(0, off, t)?
                            .f_narrow(1, from, heads)?
                            .f_transpose(0, 1)?
                            .f_unsqueeze(0)?)
                    };
                let q = head_major(&qk, 0, nh)?;
                let k = head_major(&qk, nh, nkv)?;
                let vv = head_major(&v, 0, nkv)?;
                cache.k[l]
                    .f_narrow(0, slot as i64, 1)?
                    .f_narrow(2, 0, t)?
                    .f_copy_(&k)?;
                cache.v[l]
                    .f_narrow(0, slot as i64, 1)?
                    .f_narrow(2, 0, t)?
                    .f_copy_(&vv)?;
                let attn = Tensor::f_scaled_dot_product_attention(
                    &q,
                    &k,
                    &vv,
                    None::<&Tensor>,
                    0.0,
                    t > 1,
                    None,
                    nkv != nh,
                )?;
                parts.push(
                    attn.f_squeeze_dim(0)?
                        .f_transpose(0, 1)?
                        .f_reshape([t, nh * hd])?,
                );
                off += t;
            }
            let attn = Tensor::f_cat(&parts, 0)?;
            x = self.finish_layer(layer, &x, &attn)?;
        }
        let last = Tensor::f_from_slice(&last)?.f_to_device(dev)?;
        self.head(&x.f_index_select(0, &last)?)
    }

    /// One decode step for the sequences in slots `0..ids.len()` of `cache`: row `i`
    /// appends `ids[i]` at position `lens[i]` (then `lens[i]` grows by one) and gets that
    /// sequence's next-token logits, float32 [rows, vocab]. Matrices and attention each
    /// run once for the whole batch (attention over the longest row, masked per row).
    pub fn decode_slots(
        &self,
        ids: &[u32],
        lens: &mut [usize],
        cache: &SlotCache,
    ) -> Result<Tensor, ModelError> {
        let b = ids.len();
        if b == 0 || lens.len() != b || b > cache.slots {
            return Err(ModelError::Invalid(format!(
                "decode_slots: {b} tokens, {} lengths, {} slots",
                lens.len(),
                cache.slots
            )));
        }
        if let Some(i) = lens.iter().position(|&l| l >= cache.capacity) {
            return Err(ModelError::Invalid(format!(
                "row {i}: slot is full ({} positions)",
                cache.capacity
            )));
        }
        let vocab = self.config.vocab_size as u32;
        if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
            return Err(ModelError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let c = &self.config;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let bi = b as i64;
        let dev = self.device;
        let tok: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let pos: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
        let max_len = pos.iter().copied().max().unwrap_or(0) + 1;
        let tok = Tensor::f_from_slice(&tok)?.f_to_device(dev)?;
        let pos_t = Tensor::f_from_slice(&pos)?.f_to_device(dev)?;
        let rows_t = Tensor::f_arange(bi, (Kind::Int64, dev))?;
        let rope = self.rope.f_index_select(0, &pos_t)?.f_unsqueeze(1)?;
        // not_mask[i, 0, 0, j] = j > pos[i]: positions row i must not see.
        let not_mask = Tensor::f_arange(max_len, (Kind::Int64, dev))?
            .f_unsqueeze(0)?
            .f_gt_tensor(&pos_t.f_unsqueeze(1)?)?
            .f_view([bi, 1, 1, max_len])?;
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut x =
            Tensor::f_embedding(&self.embed_tokens, &tok, -1, false, false)?.f_to_kind(self.act)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let hn = self.rms_norm(&x, &layer.input_layernorm)?;
            let qkv = self.linear(&hn, &layer.qkv_proj, layer.qkv_bias.as_ref())?;
            let qk = qkv
                .f_narrow(-1, 0, (nh + nkv) * hd)?
                .f_view([bi, nh + nkv, hd / 2, 2])?;
            let qk = apply_rope(&qk, &rope)?.f_view([bi, nh + nkv, hd])?;
            let q = qk.f_narrow(1, 0, nh)?.f_unsqueeze(2)?;
            let k = qk.f_narrow(1, nh, nkv)?;
            let v = qkv
                .f_narrow(-1, (nh + nkv) * hd, nkv * hd)?
                .f_view([bi, nkv, hd])?;
            let idx = [
                Some(rows_t.shallow_clone()),
                None,
                Some(pos_t.shallow_clone()),
            ];
            let mut kc = cache.k[l].shallow_clone();
            let mut vc = cache.v[l].shallow_clone();
            let _ = kc.f_index_put_(&idx, &k, false)?;
            let _ = vc.f_index_put_(&idx, &v, false)?;
            let kk = cache.k[l].f_narrow(0, 0, bi)?.f_narrow(2, 0, max_len)?;
            let vv = cache.v[l].f_narrow(0, 0, bi)?.f_narrow(2, 0, max_len)?;
            // Grouped-query attention as two batched matmuls: the `group` query heads of a
            // KV head are the rows of one small GEMM, so each key and value is read once
            // per KV head (not once per query head, as sdpa's decode path does).
            // The cache views merge (slot, head) without a copy: [b * nkv, len, hd] with
            // each slot's positions contiguous, so bmm reads them in place.
            let qg = q.f_reshape([bi * nkv, group, hd])?;
            let k3 = kk.f_view([bi * nkv, max_len, hd])?;
            let v3 = vv.f_view([bi * nkv, max_len, hd])?;
            let scores = qg
                .f_bmm(&k3.f_transpose(1, 2)?)?
                .f_view([bi, nkv, group, max_len])?
                .f_to_kind(Kind::Float)?
                .f_mul_scalar(scale)?
                .f_masked_fill(&not_mask, f64::NEG_INFINITY)?;
            let probs = scores
                .f_softmax(-1, Kind::Float)?
                .f_to_kind(v3.kind())?
                .f_view([bi * nkv, group, max_len])?;
            let attn = probs.f_bmm(&v3)?.f_reshape([bi, nh * hd])?;
            x = self.finish_layer(layer, &x, &attn)?;
        }
        for l in lens.iter_mut() {
            *l += 1;
        }
        self.head(&x)
    }

    /// The rest of a decoder layer once attention is done: output projection and residual,
    /// then the SwiGLU MLP and residual. `x` and `attn` are [rows, ..] alike.
    fn finish_layer(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        attn: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let inter = self.config.intermediate_size as i64;
        let x = x.f_add(&self.linear(attn, &layer.o_proj, None)?)?;
        let hn = self.rms_norm(&x, &layer.post_attention_layernorm)?;
        let gu = self.linear(&hn, &layer.gate_up_proj, None)?;
        let act = gu
            .f_narrow(-1, 0, inter)?
            .f_silu()?
            .f_mul(&gu.f_narrow(-1, inter, inter)?)?;
        Ok(x.f_add(&self.linear(&act, &layer.down_proj, None)?)?)
    }

    /// Final norm and LM head: float32 logits.
    fn head(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let x = self.rms_norm(x, &self.norm)?;
        Ok(self
            .linear(&x, self.output_weight(), None)?
            .f_to_kind(Kind::Float)?)
    }

    /// The parameters under HF's names and shapes (fused matrices split back), on the
    /// model's device and dtype. Tied heads are not repeated.
    pub fn hf_tensors(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let c = &self.config;
        let (nh, nkv, hd, inter) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
            c.intermediate_size as i64,
        );
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.shallow_clone(),
        )];
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}.");
            let split3 = |t: &Tensor| -> Result<[Tensor; 3], ModelError> {
                Ok([
                    unpermute_qk(&t.f_narrow(0, 0, nh * hd)?, nh)?,
                    unpermute_qk(&t.f_narrow(0, nh * hd, nkv * hd)?, nkv)?,
                    t.f_narrow(0, (nh + nkv) * hd, nkv * hd)?,
                ])
            };
            let [q, k, v] = split3(&layer.qkv_proj)?;
            out.push((format!("{p}self_attn.q_proj.weight"), q));
            out.push((format!("{p}self_attn.k_proj.weight"), k));
            out.push((format!("{p}self_attn.v_proj.weight"), v));
            if let Some(bias) = &layer.qkv_bias {
                let [q, k, v] = split3(bias)?;
                out.push((format!("{p}self_attn.q_proj.bias"), q));
                out.push((format!("{p}self_attn.k_proj.bias"), k));
                out.push((format!("{p}self_attn.v_proj.bias"), v));
            }
            out.push((
                format!("{p}self_attn.o_proj.weight"),
                layer.o_proj.shallow_clone(),
            ));
            out.push((
                format!("{p}mlp.gate_proj.weight"),
                layer.gate_up_proj.f_narrow(0, 0, inter)?,
            ));
            out.push((
                format!("{p}mlp.up_proj.weight"),
                layer.gate_up_proj.f_narrow(0, inter, inter)?,
            ));
            out.push((
                format!("{p}mlp.down_proj.weight"),
                layer.down_proj.shallow_clone(),
            ));
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
        Ok(out)
    }
}

/// A tensor handed to the kernel pool's workers for read-only use.
struct SharedTensor(Tensor);
// SAFETY: the workers only read it (narrow, matmul) while `split_bf16_gemm` waits for
// them; LibTorch's reference counts are atomic.
unsafe impl Sync for SharedTensor {}

/// `x · wᵀ` on the CPU with the rows of `w` split across the kernel pool, each share a
/// single-threaded LibTorch GEMM; the shares are concatenated along the last dimension.
fn split_bf16_gemm(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    let pool = agentjet_kernels::pool();
    let workers = pool.workers() as i64;
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
    pool.run(&|wi| {
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
        parts.lock().unwrap_or_else(|p| p.into_inner())[wi as usize] = Some(part);
    });
    let parts = parts.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut outs = Vec::new();
    for p in parts.into_iter().flatten() {
        outs.push(p?);
    }
    Ok(Tensor::f_cat(&outs, -1)?)
}

/// A run of row tokens `start..start + len`, each following the one before it, and what
/// its queries attend to.
struct RowSegment {
    start: i64,
    len: i64,
    /// When the segment has ancestors: the row indices of the ancestors by depth, then of
    /// the segment, and the additive attention mask [len, ancestors + len] that lets query
    /// i see keys 0..=ancestors + i. `None`: the segment alone.
    keys: Option<(Tensor, Tensor)>,
}

/// The segments of a packed row given each token's parent (see `Llama::forward_row`).
fn row_segments(parent: &[i32], device: Device, kind: Kind) -> Result<Vec<RowSegment>, ModelError> {
    let n = parent.len();
    let mut out = Vec::new();
    let mut i = 0;
    while i < n {
        let p = parent[i];
        if p >= i as i32 || p < -1 {
            return Err(ModelError::Invalid(format!(
                "token {i} has parent {p}: parents must come before their children"
            )));
        }
        let mut j = i + 1;
        while j < n && parent[j] == j as i32 - 1 {
            j += 1;
        }
        let len = (j - i) as i64;
        let keys = if p < 0 {
            None
        } else {
            let mut anc = Vec::new();
            let mut a = p;
            while a >= 0 {
                anc.push(a as i64);
                a = parent[a as usize];
            }
            anc.reverse();
            let a_len = anc.len() as i64;
            anc.extend(i as i64..j as i64);
            let keys = Tensor::f_from_slice(&anc)?.f_to_device(device)?;
            let q = Tensor::f_arange(len, (Kind::Int64, device))?.f_unsqueeze(1)?;
            let k = Tensor::f_arange(a_len + len, (Kind::Int64, device))?.f_unsqueeze(0)?;
            let hidden = k.f_gt_tensor(&q.f_add_scalar(a_len)?)?;
            let mask = Tensor::f_zeros([len, a_len + len], (kind, device))?
                .f_masked_fill(&hidden, f64::NEG_INFINITY)?;
            Some((keys, mask))
        };
        out.push(RowSegment {
            start: i as i64,
            len,
            keys,
        });
        i = j;
    }
    Ok(out)
}

/// One LibTorch (OpenMP) thread on the calling thread and on every kernel-pool worker.
fn one_torch_thread_per_worker() {
    agentjet_kernels::pool().run(&|_| tch::set_num_threads(1));
}

/// Rotates adjacent pairs of `x` ([b, t, heads, head_dim / 2, 2]) by `rope`
/// ([t, 1, head_dim / 2] complex), in float32, returning x's dtype.
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

/// llama.cpp's Q/K row order, where the two halves HF rotates together are adjacent:
/// row (head, half, i) moves to (head, i, half).
fn to_interleaved(t: &Tensor, n_head: i64) -> Result<Tensor, ModelError> {
    let shape = t.size();
    let half = shape[0] / n_head / 2;
    let mut split = vec![n_head, 2, half];
    split.extend_from_slice(&shape[1..]);
    Ok(t.f_reshape(&split)?.f_transpose(1, 2)?.f_reshape(&shape)?)
}

/// Rotations as HF computes their angles: float32 `position * inv_freq`, then
/// `cos + i sin`, [max_positions, head_dim / 2] complex64.
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
    let max = c.max_position_embeddings.max(1) as i64;
    let pos = Tensor::f_arange(max, (Kind::Float, Device::Cpu))?;
    let inv = Tensor::f_from_slice(&inv)?;
    let angles = pos.f_outer(&inv)?;
    let table = Tensor::f_stack(&[angles.f_cos()?, angles.f_sin()?], -1)?
        .f_view_as_complex()?
        .f_to_device(device)?;
    Ok(table)
}
