//! Model configuration: the serde mirror of an HF `config.json` for the Llama family
//! (Llama, Mistral, Qwen2, Qwen3, SmolLM) and the validated runtime config the decoder
//! uses. Both transformers 4's fields (`rope_theta`, `rope_scaling`) and 5's
//! (`rope_parameters`) are read; a field that would change the computation and that this
//! decoder does not implement (sliding windows, partial rotary, MLP biases, other rope
//! types, ...) is an error naming it, never a silent default.
//!
//! Owns: reading and validating architecture hyper-parameters from `config.json` or from
//! GGUF metadata, and writing them back as an HF-compatible `config.json`. Never touches
//! LibTorch.

use serde::{Deserialize, Serialize};

use super::gguf::{GgufError, GgufFile};

/// The decoder families this crate runs, all Llama-shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    /// Qwen3 dense: Qwen2 without q/k/v biases, with an RMSNorm over each head's queries
    /// and keys before the rotation (`q_norm`, `k_norm`).
    Qwen3,
    /// Qwen3 MoE: Qwen3's attention; sparse layers route each token to its top-k experts
    /// (softmax over the router's logits, optionally renormalised over the k).
    Qwen3Moe,
    /// Qwen3.5 (text): Gated DeltaNet linear-attention layers between full-attention ones
    /// that gate their output and rotate part of each head; its RMSNorms (all but the
    /// DeltaNet layers' gated one) scale by `1 + w`.
    Qwen35,
}

impl Family {
    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Qwen35 => "Qwen3_5ForCausalLM",
        }
    }
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen35 => "qwen3_5_text",
        }
    }
    /// An RMSNorm over each head's queries and keys before the rotation.
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe | Family::Qwen35)
    }
    /// Qwen3.5: its RMSNorms (all but the DeltaNet layers' gated one) scale by `1 + w`
    /// (their weights are stored centred on 0), and
    /// the full-attention layers' q_proj also yields a sigmoid gate on their output.
    pub fn qwen35(self) -> bool {
        matches!(self, Family::Qwen35)
    }
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// The sparse (mixture-of-experts) layers of a Qwen3-MoE model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub experts: usize,
    /// Experts each token goes to.
    pub top_k: usize,
    /// Each expert's SwiGLU width.
    pub intermediate_size: usize,
    /// The k routing weights renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// Every `sparse_step`-th layer is sparse (counting from 1)...
    pub sparse_step: usize,
    /// ...except these, which keep a dense MLP of `intermediate_size`.
    pub mlp_only_layers: Vec<usize>,
}

/// Qwen3.5's Gated DeltaNet layers (transformers' `linear_*` fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearAttention {
    /// Which layers are linear attention (the others full attention).
    pub layers: Vec<bool>,
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
}

impl LinearAttention {
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }
    /// The causal convolution's channels: q, k and v before it splits them.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The validated runtime configuration of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Qwen2).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Sparse layers (Qwen3-MoE); `None`: every layer is dense.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// Dimensions of each head that rotate (the first ones; `None`: all of `head_dim`).
    #[serde(default)]
    pub rotary_dim: Option<usize>,
    /// Linear-attention layers (Qwen3.5); `None`: every layer is full attention.
    #[serde(default)]
    pub linear: Option<LinearAttention>,
}

impl LlamaConfig {
    /// Whether layer `l` is a linear-attention (Gated DeltaNet) layer.
    pub fn is_linear(&self, l: usize) -> bool {
        self.linear
            .as_ref()
            .is_some_and(|h| h.layers.get(l).copied().unwrap_or(false))
    }

    /// The rotated dimensions of each head.
    pub fn rotary(&self) -> usize {
        self.rotary_dim.unwrap_or(self.head_dim)
    }

    /// Whether layer `l` routes tokens to experts (HF's rule for Qwen3-MoE).
    pub fn is_sparse(&self, l: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            !m.mlp_only_layers.contains(&l) && m.experts > 0 && (l + 1) % m.sparse_step.max(1) == 0
        })
    }
}

/// A configuration that cannot be run, with the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{source_name}: unknown architecture {arch:?} (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration (its language model); GGUF: llama, qwen2, qwen3, qwen3moe)")]
    UnknownArchitecture { source_name: String, arch: String },
    #[error("{source_name}: {problem}")]
    Invalid {
        source_name: String,
        problem: String,
    },
    #[error("{source_name}: cannot parse: {problem}")]
    Parse {
        source_name: String,
        problem: String,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// One-or-many integer field (`eos_token_id` is either in HF configs).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            OneOrMany::One(v) => vec![*v],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> usize {
    2048
}

/// The fields of an HF `config.json` that the Llama family uses.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers 5: `{"rope_theta": .., "rope_type": .., its scaling fields}`.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// Qwen3-MoE (transformers 4 writes `num_experts`, 5 `num_local_experts`).
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// Qwen3.5's linear attention.
    #[serde(default)]
    pub linear_conv_kernel_dim: Option<usize>,
    #[serde(default)]
    pub full_attention_interval: Option<usize>,
    /// Qwen3.5's attention output gate (always on in its checkpoints).
    #[serde(default)]
    pub attn_output_gate: Option<bool>,
    #[serde(default)]
    pub linear_key_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_value_head_dim: Option<usize>,
    #[serde(default)]
    pub linear_num_key_heads: Option<usize>,
    #[serde(default)]
    pub linear_num_value_heads: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<OneOrMany>,
}

impl HfConfig {
    /// Validates and converts to the runtime config. `source_name` names the file in errors.
    pub fn into_runtime(self, source_name: &str) -> Result<LlamaConfig, ConfigError> {
        let arch = self
            .architectures
            .first()
            .cloned()
            .or_else(|| self.model_type.clone())
            .unwrap_or_default();
        let family = match arch.as_str() {
            "LlamaForCausalLM" | "llama" => Family::Llama,
            "MistralForCausalLM" | "mistral" => Family::Mistral,
            "Qwen2ForCausalLM" | "qwen2" => Family::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Family::Qwen3,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Family::Qwen3Moe,
            "Qwen3_5ForCausalLM" | "qwen3_5_text" => Family::Qwen35,
            _ => {
                return Err(ConfigError::UnknownArchitecture {
                    source_name: source_name.to_string(),
                    arch,
                })
            }
        };
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(invalid(
                    source_name,
                    format!("hidden_act {act:?} is not supported (only \"silu\")"),
                ));
            }
        }
        self.refuse_unimplemented(family, source_name)?;
        // transformers 5 keeps theta and the scaling in `rope_parameters`; a config that
        // has it is read from it (the top-level fields are transformers 4's).
        let params = self.rope_parameters.as_ref().filter(|v| !v.is_null());
        let rope_theta = match params {
            Some(p) => match p.get("rope_theta") {
                Some(t) => t.as_f64().ok_or_else(|| {
                    invalid(
                        source_name,
                        format!("rope_parameters.rope_theta is {t}, not a number"),
                    )
                })?,
                None => self.rope_theta.unwrap_or_else(default_theta),
            },
            None => self.rope_theta.unwrap_or_else(default_theta),
        };
        let rope_scaling = match params.or(self.rope_scaling.as_ref()) {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => parse_rope_scaling(v, source_name)?,
        };
        let cfg = LlamaConfig {
            family,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: self.max_position_embeddings,
            // HF's default for Llama is untied; Qwen2 small models set it explicitly.
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            attention_bias: self
                .attention_bias
                .unwrap_or(matches!(family, Family::Qwen2)),
            bos_token_id: self.bos_token_id,
            eos_token_ids: self
                .eos_token_id
                .clone()
                .map(|e| e.to_vec())
                .unwrap_or_default(),
            moe: self.moe(family, source_name)?,
            rotary_dim: match self.partial_rotary() {
                Some(f) if f != 1.0 => {
                    let hd = self
                        .head_dim
                        .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
                    Some((hd as f64 * f) as usize)
                }
                _ => None,
            },
            linear: self.linear_attention(family, source_name)?,
        };
        cfg.validate(source_name)?;
        Ok(cfg)
    }

    /// The sparse layers' settings of a Qwen3-MoE config (an error naming a missing one).
    fn moe(&self, family: Family, source_name: &str) -> Result<Option<MoeConfig>, ConfigError> {
        if family != Family::Qwen3Moe {
            if let Some(n) = self.num_experts.filter(|&n| n > 0) {
                return Err(invalid(
                    source_name,
                    format!(
                        "num_experts = {n} in a {} config: experts are supported in qwen3_moe",
                        family.model_type()
                    ),
                ));
            }
            return Ok(None);
        }
        if let Some(n) = self.shared_expert_intermediate_size.filter(|&n| n > 0) {
            return Err(invalid(
                source_name,
                format!("shared_expert_intermediate_size = {n}: a shared expert is not supported by this decoder"),
            ));
        }
        let need = |v: Option<usize>, field: &str| {
            v.ok_or_else(|| invalid(source_name, format!("qwen3_moe config lacks {field}")))
        };
        let m = MoeConfig {
            experts: need(self.num_experts, "num_experts")?,
            top_k: need(self.num_experts_per_tok, "num_experts_per_tok")?,
            intermediate_size: need(self.moe_intermediate_size, "moe_intermediate_size")?,
            // transformers' default for Qwen3-MoE.
            norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
            sparse_step: self.decoder_sparse_step.unwrap_or(1),
            mlp_only_layers: self.mlp_only_layers.clone().unwrap_or_default(),
        };
        if m.experts == 0
            || m.top_k == 0
            || m.top_k > m.experts
            || m.intermediate_size == 0
            || m.sparse_step == 0
        {
            return Err(invalid(
                source_name,
                format!(
                    "qwen3_moe: {} experts, {} per token, width {}, sparse step {}: each must be positive and the per-token count at most the experts",
                    m.experts, m.top_k, m.intermediate_size, m.sparse_step
                ),
            ));
        }
        Ok(Some(m))
    }

    /// `partial_rotary_factor`, at the top level (transformers 4) or in `rope_parameters`.
    fn partial_rotary(&self) -> Option<f64> {
        self.partial_rotary_factor.or_else(|| {
            self.rope_parameters
                .as_ref()
                .and_then(|p| p.get("partial_rotary_factor"))
                .and_then(|v| v.as_f64())
        })
    }

    /// Qwen3.5's linear-attention layers (an error naming a missing field).
    fn linear_attention(
        &self,
        family: Family,
        source_name: &str,
    ) -> Result<Option<LinearAttention>, ConfigError> {
        if family != Family::Qwen35 {
            return Ok(None);
        }
        let need = |v: Option<usize>, field: &str| {
            v.filter(|&v| v > 0).ok_or_else(|| {
                invalid(
                    source_name,
                    format!("qwen3_5 config lacks a positive {field}"),
                )
            })
        };
        if self.attn_output_gate == Some(false) {
            return Err(invalid(
                source_name,
                "attn_output_gate = false: Qwen3.5's attention without its output gate is not \
                 supported by this decoder"
                    .into(),
            ));
        }
        // transformers' default: every `full_attention_interval`-th layer (4) is full
        // attention.
        let every = self.full_attention_interval.unwrap_or(4).max(1);
        let layers = match &self.layer_types {
            Some(t) => t.iter().map(|t| t == "linear_attention").collect(),
            None => (0..self.num_hidden_layers)
                .map(|i| (i + 1) % every != 0)
                .collect(),
        };
        let h = LinearAttention {
            layers,
            conv_kernel: need(self.linear_conv_kernel_dim, "linear_conv_kernel_dim")?,
            key_heads: need(self.linear_num_key_heads, "linear_num_key_heads")?,
            value_heads: need(self.linear_num_value_heads, "linear_num_value_heads")?,
            key_head_dim: need(self.linear_key_head_dim, "linear_key_head_dim")?,
            value_head_dim: need(self.linear_value_head_dim, "linear_value_head_dim")?,
        };
        if h.layers.len() != self.num_hidden_layers || h.value_heads % h.key_heads != 0 {
            return Err(invalid(
                source_name,
                format!(
                    "qwen3_5: {} layer_types for {} layers, {} value heads over {} key heads (must divide)",
                    h.layers.len(),
                    self.num_hidden_layers,
                    h.value_heads,
                    h.key_heads
                ),
            ));
        }
        Ok(Some(h))
    }

    /// Fields whose value would change the computation in a way this decoder does not
    /// implement: an error naming the field and its value.
    fn refuse_unimplemented(&self, family: Family, source_name: &str) -> Result<(), ConfigError> {
        let refuse = |field: &str, value: String, why: &str| {
            Err(invalid(
                source_name,
                format!("{field} = {value}: {why} is not supported by this decoder"),
            ))
        };
        if self.use_sliding_window == Some(true) {
            return refuse(
                "use_sliding_window",
                "true".into(),
                "sliding-window attention",
            );
        }
        let known: &[&str] = match family {
            Family::Qwen35 => &["full_attention", "linear_attention"],
            _ => &["full_attention"],
        };
        if let Some(t) = self
            .layer_types
            .iter()
            .flatten()
            .find(|t| !known.contains(&t.as_str()))
        {
            return refuse("layer_types", format!("[.., {t:?}, ..]"), "this layer type");
        }
        if self.mlp_bias == Some(true) {
            return refuse("mlp_bias", "true".into(), "an MLP with biases");
        }
        if let Some(f) = self.partial_rotary().filter(|&f| f != 1.0) {
            let hd = self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
            let rd = hd as f64 * f;
            if family != Family::Qwen35 {
                return refuse("partial_rotary_factor", f.to_string(), "a partial rotation");
            }
            if !(f > 0.0 && f < 1.0) || rd.fract() != 0.0 || rd as usize % 2 != 0 {
                return refuse(
                    "partial_rotary_factor",
                    f.to_string(),
                    "a rotation of other than an even number of dimensions",
                );
            }
        }
        Ok(())
    }
}

fn invalid(source_name: &str, problem: String) -> ConfigError {
    ConfigError::Invalid {
        source_name: source_name.to_string(),
        problem,
    }
}

fn parse_rope_scaling(
    v: &serde_json::Value,
    source_name: &str,
) -> Result<Option<RopeScaling>, ConfigError> {
    let ty = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str| -> Result<f64, ConfigError> {
        v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
            invalid(
                source_name,
                format!("rope_scaling of type {ty:?} lacks number {k:?}"),
            )
        })
    };
    Ok(match ty {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
        }),
        other => {
            return Err(invalid(
                source_name,
                format!("rope_scaling type {other:?} is not supported (supported: linear, llama3)"),
            ))
        }
    })
}

impl LlamaConfig {
    /// Checks the invariants the decoder relies on.
    pub fn validate(&self, source_name: &str) -> Result<(), ConfigError> {
        let err = |p: String| Err(invalid(source_name, p));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return err("vocab_size, hidden_size and num_hidden_layers must be positive".into());
        }
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return err("head counts must be positive".into());
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return err(format!(
                "head_dim {} must be positive and even",
                self.head_dim
            ));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.rope_theta) || !positive(self.rms_norm_eps) {
            return err("rope_theta and rms_norm_eps must be positive".into());
        }
        Ok(())
    }

    /// Reads the architecture from GGUF metadata (`<arch>.*` keys, llama.cpp's names).
    pub fn from_gguf(g: &GgufFile) -> Result<LlamaConfig, ConfigError> {
        let source_name = g.path().display().to_string();
        let arch = g.get_str("general.architecture")?.to_string();
        let family = match arch.as_str() {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "qwen3moe" => Family::Qwen3Moe,
            _ => return Err(ConfigError::UnknownArchitecture { source_name, arch }),
        };
        let k = |s: &str| format!("{arch}.{s}");
        let usize_of = |key: &str| -> Result<usize, ConfigError> {
            let v = g.get_i64(key)?;
            usize::try_from(v).map_err(|_| invalid(&source_name, format!("{key} is {v}")))
        };
        let hidden_size = usize_of(&k("embedding_length"))?;
        let heads = usize_of(&k("attention.head_count"))?;
        let kv_heads = match g.get_opt_i64(&k("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => heads,
        };
        let vocab_size = match g.get_opt_i64(&k("vocab_size"))? {
            Some(v) => v as usize,
            None => g.get_string_array("tokenizer.ggml.tokens")?.len(),
        };
        let head_dim = match g.get_opt_i64(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None => hidden_size / heads.max(1),
        };
        let rope_scaling = match g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: g.get_f64(&k("rope.scaling.factor"))?,
            }),
            Some(other) => {
                return Err(invalid(
                    &source_name,
                    format!("rope scaling type {other:?} is not supported (supported: linear; llama3 comes as rope_freqs.weight)"),
                ))
            }
        };
        // llama.cpp's qwen3moe: every layer sparse, the k weights renormalised unless
        // the file says otherwise.
        let moe = match family {
            Family::Qwen3Moe => Some(MoeConfig {
                experts: usize_of(&k("expert_count"))?,
                top_k: usize_of(&k("expert_used_count"))?,
                intermediate_size: usize_of(&k("expert_feed_forward_length"))?,
                norm_topk_prob: g
                    .get(&k("expert_weights_norm"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true),
                sparse_step: 1,
                mlp_only_layers: Vec::new(),
            }),
            _ => None,
        };
        let intermediate_size = match (g.get_opt_i64(&k("feed_forward_length"))?, &moe) {
            (Some(v), _) => v as usize,
            (None, Some(m)) => m.intermediate_size,
            (None, None) => usize_of(&k("feed_forward_length"))?,
        };
        let tied = g.tensors.iter().all(|t| t.name != "output.weight");
        let attention_bias = g.tensors.iter().any(|t| t.name == "blk.0.attn_q.bias");
        let cfg = LlamaConfig {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers: usize_of(&k("block_count"))?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_theta: g.get_opt_f64(&k("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: g
                .get_opt_i64(&k("context_length"))?
                .map(|v| v as usize)
                .unwrap_or(2048),
            tie_word_embeddings: tied,
            attention_bias,
            bos_token_id: g
                .get_opt_i64("tokenizer.ggml.bos_token_id")?
                .map(|v| v as u32),
            eos_token_ids: g
                .get_opt_i64("tokenizer.ggml.eos_token_id")?
                .map(|v| vec![v as u32])
                .unwrap_or_default(),
            moe,
            rotary_dim: None,
            linear: None,
        };
        cfg.validate(&source_name)?;
        Ok(cfg)
    }

    /// An HF-compatible `config.json` for this model.
    pub fn to_hf_json(&self, torch_dtype: &str) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.family.hf_architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "dtype": torch_dtype,
            "use_cache": true,
        });
        let obj = v.as_object_mut().expect("object");
        if self.family != Family::Qwen2 {
            obj.insert("attention_bias".into(), self.attention_bias.into());
        }
        if !matches!(self.family, Family::Qwen2 | Family::Qwen3) {
            obj.insert("mlp_bias".into(), false.into());
        }
        if let Some(b) = self.bos_token_id {
            obj.insert("bos_token_id".into(), b.into());
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                obj.insert("eos_token_id".into(), (*one).into());
            }
            many => {
                obj.insert("eos_token_id".into(), many.to_vec().into());
            }
        }
        let scaling = match &self.rope_scaling {
            None => serde_json::Value::Null,
            Some(RopeScaling::Linear { factor }) => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => serde_json::json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        obj.insert("rope_scaling".into(), scaling);
        if let Some(h) = &self.linear {
            let types: Vec<&str> = h
                .layers
                .iter()
                .map(|&l| {
                    if l {
                        "linear_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            obj.insert("layer_types".into(), types.into());
            obj.insert("linear_conv_kernel_dim".into(), h.conv_kernel.into());
            obj.insert("linear_num_key_heads".into(), h.key_heads.into());
            obj.insert("linear_num_value_heads".into(), h.value_heads.into());
            obj.insert("linear_key_head_dim".into(), h.key_head_dim.into());
            obj.insert("linear_value_head_dim".into(), h.value_head_dim.into());
        }
        if let Some(rd) = self.rotary_dim {
            obj.insert(
                "partial_rotary_factor".into(),
                (rd as f64 / self.head_dim as f64).into(),
            );
        }
        if let Some(m) = &self.moe {
            obj.insert("num_experts".into(), m.experts.into());
            obj.insert("num_experts_per_tok".into(), m.top_k.into());
            obj.insert("moe_intermediate_size".into(), m.intermediate_size.into());
            obj.insert("norm_topk_prob".into(), m.norm_topk_prob.into());
            obj.insert("decoder_sparse_step".into(), m.sparse_step.into());
            obj.insert("mlp_only_layers".into(), m.mlp_only_layers.clone().into());
        }
        v
    }

    /// Inverse rotary frequencies, one per pair of a head's dimensions, after scaling.
    /// (Only the rotated dimensions: `rotary() / 2` of them.)
    pub fn inv_freq(&self) -> Vec<f64> {
        let dim = self.rotary() as f64;
        let base: Vec<f64> = (0..self.rotary() / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / dim))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Parses a `config.json` text.
pub fn parse_hf_config(text: &str, source_name: &str) -> Result<LlamaConfig, ConfigError> {
    let parse = |v: serde_json::Value| -> Result<HfConfig, ConfigError> {
        serde_json::from_value(v).map_err(|e| ConfigError::Parse {
            source_name: source_name.to_string(),
            problem: e.to_string(),
        })
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Parse {
        source_name: source_name.to_string(),
        problem: e.to_string(),
    })?;
    if let Some(text_config) = wrapped_language_model(&v) {
        return parse(text_config)?.into_runtime(source_name);
    }
    parse(v)?.into_runtime(source_name)
}

/// The weights of a model wrapped by a multimodal one (`qwen3_5`) live under this prefix
/// (`model.language_model.layers.0...` for `model.layers.0...`).
pub const WRAPPED_PREFIX: &str = "model.language_model.";

/// The language model's config of a multimodal wrapper this decoder runs the text part of
/// (`qwen3_5`, `Qwen3_5ForConditionalGeneration`): its `text_config`, with the wrapper's
/// `tie_word_embeddings` (the head is the wrapper's). `None`: not such a wrapper.
pub fn wrapped_language_model(v: &serde_json::Value) -> Option<serde_json::Value> {
    let arch = v["architectures"][0].as_str().unwrap_or_default();
    let ty = v["model_type"].as_str().unwrap_or_default();
    if arch != "Qwen3_5ForConditionalGeneration" && ty != "qwen3_5" {
        return None;
    }
    let mut text = v.get("text_config")?.clone();
    let obj = text.as_object_mut()?;
    obj.insert("model_type".into(), "qwen3_5_text".into());
    obj.remove("architectures");
    if let Some(t) = v.get("tie_word_embeddings") {
        obj.insert("tie_word_embeddings".into(), t.clone());
    }
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut cfg = parse_hf_config(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":64,
                "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,
                "rope_theta":500000.0,
                "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
                "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
            "test",
        )
        .unwrap();
        let scaled = cfg.inv_freq();
        cfg.rope_scaling = None;
        let plain = cfg.inv_freq();
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15);
    }

    const QWEN: &str = r#""vocab_size":10,"hidden_size":8,"intermediate_size":8,
        "num_hidden_layers":1,"num_attention_heads":1"#;

    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let c = parse_hf_config(
            &format!(
                r#"{{"model_type":"qwen2",{QWEN},
                "rope_parameters":{{"rope_type":"default","rope_theta":1000000.0}}}}"#
            ),
            "test",
        )
        .unwrap();
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.rope_scaling, None);
        let c = parse_hf_config(
            &format!(
                r#"{{"model_type":"llama",{QWEN},"rope_parameters":{{"rope_type":"linear",
                "rope_theta":5e5,"factor":4.0}}}}"#
            ),
            "test",
        )
        .unwrap();
        assert_eq!(c.rope_theta, 5e5);
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
    }

    #[test]
    fn fields_that_change_the_computation_are_refused_by_name() {
        for (extra, field) in [
            (r#""use_sliding_window":true"#, "use_sliding_window"),
            (r#""layer_types":["sliding_attention"]"#, "layer_types"),
            (r#""mlp_bias":true"#, "mlp_bias"),
            (r#""partial_rotary_factor":0.5"#, "partial_rotary_factor"),
            (
                r#""rope_parameters":{"rope_type":"yarn","rope_theta":1e6,"factor":4.0}"#,
                "yarn",
            ),
        ] {
            let e = parse_hf_config(&format!(r#"{{"model_type":"qwen3",{QWEN},{extra}}}"#), "c")
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        // Their neutral values load.
        parse_hf_config(
            &format!(
                r#"{{"model_type":"qwen3",{QWEN},"use_sliding_window":false,
                "layer_types":["full_attention"],"mlp_bias":false}}"#
            ),
            "c",
        )
        .unwrap();
    }

    #[test]
    fn unknown_architecture_is_named() {
        let e = parse_hf_config(
            r#"{"architectures":["GPTNeoXForCausalLM"],"vocab_size":10,"hidden_size":8,
                "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1}"#,
            "dir/config.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("dir/config.json") && e.contains("GPTNeoXForCausalLM"),
            "{e}"
        );
    }
}
