//! LibTorch model code and everything a model ships with.
//!
//! Owns: finding a model (`smollm2`, a GGUF file, or an HF checkpoint directory), its
//! configuration, tokenizer and chat template (the [`ModelCard`], which is LibTorch-free so
//! that clients can use it), and, behind the `torch` feature, the Llama-family decoder,
//! its weight loaders and checkpoint writer.
//!
//! Must never: know about engines, HTTP, the swarm or training loops.

pub mod chat_template;
pub mod config;
pub mod gguf;
pub mod tokenizer;

#[cfg(feature = "torch")]
pub mod checkpoint;
#[cfg(feature = "torch")]
pub mod llama;
#[cfg(feature = "torch")]
pub mod peft;
#[cfg(feature = "torch")]
pub mod weights;

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

pub use chat_template::{ChatRequest, ChatTemplate, TemplateError};
pub use config::{ConfigError, Family, LlamaConfig, RopeScaling};
pub use gguf::{GgufError, GgufFile};
pub use tokenizer::{SpecialToken, StreamDecoder, TokenBytes, Tokenizer, TokenizerError};

/// The file name of the default model inside the cache (see bootstrap/setup.sh).
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Everything that can go wrong finding or loading a model. Each message names the file.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {problem}")]
    Io { path: PathBuf, problem: String },
    #[error("model {spec:?} not found: {hint}")]
    NotFound { spec: String, hint: String },
    #[error("{file}: missing tensor '{name}'")]
    MissingTensor { file: String, name: String },
    #[error("{file}: tensor '{name}' has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        file: String,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error("{file}: tensor '{name}' has dtype {dtype}, which is not supported (F32, F16, BF16)")]
    UnsupportedDtype {
        file: String,
        name: String,
        dtype: String,
    },
    #[error("{file}: malformed or truncated safetensors: {problem}")]
    Safetensors { file: String, problem: String },
    #[error("{file}: {problem}")]
    Json { file: String, problem: String },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("{0}")]
    Invalid(String),
    #[cfg(feature = "torch")]
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// The folder of caches shared with bootstrap/setup.sh: `$AGENTJET_CACHE`, else
/// `$XDG_CACHE_HOME/agentjet`, else `~/.cache/agentjet`.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("AGENTJET_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("agentjet");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("agentjet")
}

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
}

impl ModelSource {
    /// Resolves `smollm2`, a `.gguf` file, or an HF directory (one with `config.json`).
    pub fn resolve(spec: &str) -> Result<ModelSource, ModelError> {
        if spec == "smollm2" || spec == "smollm2-135m-instruct" {
            let path = cache_dir().join("models").join(SMOLLM2_FILE);
            if !path.is_file() {
                return Err(ModelError::NotFound {
                    spec: spec.into(),
                    hint: format!(
                        "{} does not exist; run `bash bootstrap/setup.sh` to fetch it",
                        path.display()
                    ),
                });
            }
            return Ok(ModelSource::Gguf(path));
        }
        let path = PathBuf::from(spec);
        if path.is_dir() {
            if path.join("config.json").is_file() {
                return Ok(ModelSource::HfDir(path));
            }
            return Err(ModelError::NotFound {
                spec: spec.into(),
                hint: format!(
                    "{} has no config.json (an HF model directory needs one)",
                    path.display()
                ),
            });
        }
        if path.is_file() {
            return Ok(ModelSource::Gguf(path));
        }
        Err(ModelError::NotFound {
            spec: spec.into(),
            hint: "give `smollm2`, a GGUF file, or an HF model directory".into(),
        })
    }

    pub fn display_name(&self) -> String {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string()),
        }
    }
}

/// Sampling defaults a model ships (`generation_config.json`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub eos_token_ids: Vec<u32>,
}

/// What a model is, without its weights: config, tokenizer, chat template, stop tokens.
/// LibTorch-free; the swarm ships it to clients as the "model card".
#[derive(Debug, Clone)]
pub struct ModelCard {
    pub name: String,
    pub config: LlamaConfig,
    pub tokenizer: Tokenizer,
    pub chat_template_source: Option<String>,
    pub tool_use_template_source: Option<String>,
    pub generation: GenerationDefaults,
}

pub(crate) fn read_json(path: &Path) -> Result<Json, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        problem: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Json {
        file: path.display().to_string(),
        problem: format!("invalid JSON: {e}"),
    })
}

impl ModelCard {
    /// Writes the card as the non-weight files of an HF model directory (config.json,
    /// tokenizer.json, tokenizer_config.json with the chat template,
    /// generation_config.json): what checkpoints hold besides the weights, and what the
    /// swarm ships to clients as the model card ([`ModelCard::from_hf_dir`] reads it back).
    pub fn write_card_files(&self, dir: &Path, torch_dtype: &str) -> Result<(), ModelError> {
        use serde_json::json;
        let write_json = |path: &Path, v: &Json| -> Result<(), ModelError> {
            let text = serde_json::to_string_pretty(v).expect("json");
            std::fs::write(path, text + "\n").map_err(|e| ModelError::Io {
                path: path.to_path_buf(),
                problem: e.to_string(),
            })
        };
        write_json(
            &dir.join("config.json"),
            &self.config.to_hf_json(torch_dtype),
        )?;
        self.tokenizer.save(&dir.join("tokenizer.json"))?;
        let mut tok_cfg = self.tokenizer.hf_config_fields();
        tok_cfg.insert(
            "model_max_length".into(),
            json!(self.config.max_position_embeddings),
        );
        match (&self.chat_template_source, &self.tool_use_template_source) {
            (Some(c), Some(t)) => {
                tok_cfg.insert(
                "chat_template".into(),
                json!([{"name": "default", "template": c}, {"name": "tool_use", "template": t}]),
            );
            }
            (Some(c), None) => {
                tok_cfg.insert("chat_template".into(), json!(c));
            }
            _ => {}
        }
        write_json(&dir.join("tokenizer_config.json"), &Json::Object(tok_cfg))?;
        let mut gen = serde_json::Map::new();
        if let Some(b) = self.config.bos_token_id {
            gen.insert("bos_token_id".into(), json!(b));
        }
        gen.insert("eos_token_id".into(), json!(self.generation.eos_token_ids));
        if let Some(t) = self.generation.temperature {
            gen.insert("temperature".into(), json!(t));
        }
        if let Some(p) = self.generation.top_p {
            gen.insert("top_p".into(), json!(p));
        }
        if let Some(k) = self.generation.top_k {
            gen.insert("top_k".into(), json!(k));
        }
        write_json(&dir.join("generation_config.json"), &Json::Object(gen))?;
        Ok(())
    }

    pub fn load(source: &ModelSource) -> Result<ModelCard, ModelError> {
        match source {
            ModelSource::Gguf(path) => ModelCard::from_gguf(&GgufFile::open(path)?),
            ModelSource::HfDir(dir) => ModelCard::from_hf_dir(dir),
        }
    }

    pub fn from_gguf(g: &GgufFile) -> Result<ModelCard, ModelError> {
        let config = LlamaConfig::from_gguf(g)?;
        let tokenizer = Tokenizer::from_gguf(g)?;
        let name = g
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| ModelSource::Gguf(g.path().into()).display_name());
        let mut eos = config.eos_token_ids.clone();
        // Chat models end turns with the template's end marker; llama.cpp's EOT id.
        if let Some(eot) = g
            .get("tokenizer.ggml.eot_token_id")
            .and_then(|v| v.as_i64())
        {
            eos.push(eot as u32);
        }
        let card = ModelCard {
            name,
            config,
            tokenizer,
            chat_template_source: g
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            tool_use_template_source: g
                .get("tokenizer.chat_template.tool_use")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            generation: GenerationDefaults {
                eos_token_ids: eos,
                ..Default::default()
            },
        };
        card.validate(&g.path().display().to_string())
    }

    pub fn from_hf_dir(dir: &Path) -> Result<ModelCard, ModelError> {
        let cfg_path = dir.join("config.json");
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::Io {
            path: cfg_path.clone(),
            problem: e.to_string(),
        })?;
        let config = config::parse_hf_config(&cfg_text, &cfg_path.display().to_string())?;
        let tok_cfg_path = dir.join("tokenizer_config.json");
        let tok_cfg = if tok_cfg_path.is_file() {
            read_json(&tok_cfg_path)?
        } else {
            Json::Null
        };
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ModelError::Io {
                path: tok_path,
                problem: "missing (an HF model directory needs tokenizer.json)".into(),
            });
        }
        let tokenizer = Tokenizer::from_hf_files(&tok_path, &tok_cfg)?;
        let (mut chat, mut tool_use) = match ChatTemplate::sources_from_hf_config(&tok_cfg) {
            Some((c, t)) => (Some(c), t),
            None => (None, None),
        };
        // Newer checkpoints keep the template in its own file.
        let jinja = dir.join("chat_template.jinja");
        if chat.is_none() && jinja.is_file() {
            chat = Some(std::fs::read_to_string(&jinja).map_err(|e| ModelError::Io {
                path: jinja.clone(),
                problem: e.to_string(),
            })?);
            tool_use = None;
        }
        let mut generation = GenerationDefaults {
            eos_token_ids: config.eos_token_ids.clone(),
            ..Default::default()
        };
        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            let g = read_json(&gen_path)?;
            generation.temperature = g.get("temperature").and_then(|v| v.as_f64());
            generation.top_p = g.get("top_p").and_then(|v| v.as_f64());
            generation.top_k = g.get("top_k").and_then(|v| v.as_i64());
            if let Some(e) = g.get("eos_token_id") {
                let ids: Vec<u32> = match e {
                    Json::Number(n) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
                    Json::Array(a) => a
                        .iter()
                        .filter_map(|v| v.as_u64())
                        .map(|v| v as u32)
                        .collect(),
                    _ => vec![],
                };
                generation.eos_token_ids.extend(ids);
            }
        }
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let card = ModelCard {
            name,
            config,
            tokenizer,
            chat_template_source: chat,
            tool_use_template_source: tool_use,
            generation,
        };
        card.validate(&dir.display().to_string())
    }

    fn validate(mut self, source_name: &str) -> Result<ModelCard, ModelError> {
        if let Some(eos) = &self.tokenizer.eos {
            self.generation.eos_token_ids.push(eos.id);
        }
        self.generation.eos_token_ids.sort_unstable();
        self.generation.eos_token_ids.dedup();
        if self.tokenizer.vocab_size() > self.config.vocab_size {
            return Err(ModelError::Invalid(format!(
                "{source_name}: tokenizer has {} tokens but the model's vocabulary is {}",
                self.tokenizer.vocab_size(),
                self.config.vocab_size
            )));
        }
        // Compile once here so a broken template is reported at load, not at first use.
        if self.chat_template_source.is_some() {
            self.chat_template(source_name)?;
        }
        Ok(self)
    }

    /// The compiled chat template, with the special-token strings HF passes to it.
    pub fn chat_template(&self, source_name: &str) -> Result<ChatTemplate, ModelError> {
        let src = self
            .chat_template_source
            .clone()
            .ok_or_else(|| TemplateError::Missing {
                source_name: source_name.to_string(),
            })?;
        let mut specials = Vec::new();
        for (k, t) in [
            ("bos_token", &self.tokenizer.bos),
            ("eos_token", &self.tokenizer.eos),
            ("pad_token", &self.tokenizer.pad),
            ("unk_token", &self.tokenizer.unk),
        ] {
            if let Some(t) = t {
                specials.push((k.to_string(), t.content.clone()));
            }
        }
        Ok(ChatTemplate::new(
            src,
            self.tool_use_template_source.clone(),
            specials,
            source_name,
        )?)
    }

    /// Is `id` one that ends generation?
    pub fn is_stop_token(&self, id: u32) -> bool {
        self.generation.eos_token_ids.contains(&id)
    }
}
