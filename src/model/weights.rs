//! Weight sources: tensors by their HF name, read from safetensors (single file or
//! sharded with an index) or from a GGUF file (llama.cpp's names mapped to HF's, blocks
//! dequantized, and llama.cpp's Q/K row permutation undone).
//!
//! Owns: bytes on disk -> CPU tensors with HF names and HF layouts. Never keeps a tensor
//! beyond handing it out; the decoder decides dtype and device.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

use super::config::{Family, LlamaConfig};
use super::gguf::{GgmlType, GgufFile};
use super::{read_json, ModelError};

/// Tensors by HF name.
pub trait WeightSource {
    /// Loads one tensor (on the CPU, in its stored or dequantized dtype); `None` if absent.
    fn load(&mut self, hf_name: &str) -> Result<Option<Tensor>, ModelError>;
    /// The file that holds (or would hold) `hf_name`, for error messages.
    fn file_of(&self, hf_name: &str) -> String;
    /// Extra per-frequency rotary divisors (GGUF `rope_freqs.weight`, Llama 3 style).
    fn rope_freq_factors(&mut self) -> Result<Option<Vec<f32>>, ModelError> {
        Ok(None)
    }
}

/// Loads `name`, checking that it exists and has `shape`.
pub fn load_checked(
    src: &mut dyn WeightSource,
    name: &str,
    shape: &[i64],
) -> Result<Tensor, ModelError> {
    let t = src.load(name)?.ok_or_else(|| ModelError::MissingTensor {
        file: src.file_of(name),
        name: name.to_string(),
    })?;
    if t.size() != shape {
        return Err(ModelError::ShapeMismatch {
            file: src.file_of(name),
            name: name.to_string(),
            expected: shape.to_vec(),
            found: t.size(),
        });
    }
    Ok(t)
}

struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
}

/// An HF checkpoint directory: `model.safetensors` or shards listed in
/// `model.safetensors.index.json`.
pub struct SafetensorsSource {
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    index: BTreeMap<String, usize>,
}

fn st_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Safetensors {
        file: path.display().to_string(),
        problem: e.to_string(),
    }
}

impl SafetensorsSource {
    pub fn open_dir(dir: &Path) -> Result<SafetensorsSource, ModelError> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if single.is_file() {
            vec!["model.safetensors".into()]
        } else if index_path.is_file() {
            let index = read_json(&index_path)?;
            let map = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Json {
                    file: index_path.display().to_string(),
                    problem: "has no \"weight_map\" object".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            shards
        } else {
            return Err(ModelError::Io {
                path: single,
                problem: "missing (and no model.safetensors.index.json beside it)".into(),
            });
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for shard in shard_names {
            if shard.contains('/') || shard.contains("..") {
                return Err(ModelError::Json {
                    file: index_path.display().to_string(),
                    problem: format!("shard name {shard:?} leaves the model directory"),
                });
            }
            let path = dir.join(&shard);
            let file = File::open(&path).map_err(|e| ModelError::Io {
                path: path.clone(),
                problem: e.to_string(),
            })?;
            // SAFETY: read-only map of a file we do not write.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::Io {
                path: path.clone(),
                problem: e.to_string(),
            })?;
            let names: Vec<String> = {
                let st = SafeTensors::deserialize(&mmap).map_err(|e| st_err(&path, e))?;
                st.names().into_iter().map(|s| s.to_string()).collect()
            };
            for n in names {
                index.insert(n, files.len());
            }
            files.push(SafetensorsFile { path, mmap });
        }
        Ok(SafetensorsSource { files, index })
    }
}

impl WeightSource for SafetensorsSource {
    fn load(&mut self, hf_name: &str) -> Result<Option<Tensor>, ModelError> {
        let Some(&i) = self.index.get(hf_name) else {
            return Ok(None);
        };
        let f = &self.files[i];
        let st = SafeTensors::deserialize(&f.mmap).map_err(|e| st_err(&f.path, e))?;
        let view = st.tensor(hf_name).map_err(|e| st_err(&f.path, e))?;
        let kind = match view.dtype() {
            Dtype::F32 => Kind::Float,
            Dtype::F16 => Kind::Half,
            Dtype::BF16 => Kind::BFloat16,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    file: f.path.display().to_string(),
                    name: hf_name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        Ok(Some(Tensor::f_from_data_size(view.data(), &shape, kind)?))
    }

    fn file_of(&self, hf_name: &str) -> String {
        match self.index.get(hf_name) {
            Some(&i) => self.files[i].path.display().to_string(),
            None => self
                .files
                .iter()
                .map(|f| f.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// A GGUF file seen through HF names.
pub struct GgufSource {
    gguf: GgufFile,
    family: Family,
    heads: i64,
    kv_heads: i64,
    /// The stacked expert tensors of the layer being read (`blk.N.ffn_*_exps.weight`,
    /// [experts, ..]; gate, up and down): each is read once while the loader asks for its
    /// experts one after another, interleaved.
    stacked: Vec<(String, Tensor)>,
}

/// llama.cpp's stacked tensor and the expert index for an HF per-expert name
/// (`model.layers.L.mlp.experts.E.gate_proj.weight` -> `blk.L.ffn_gate_exps.weight`, E).
fn expert_name(hf_name: &str) -> Option<(String, i64)> {
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once(".mlp.experts.")?;
    let (expert, proj) = rest.split_once('.')?;
    let leaf = match proj {
        "gate_proj.weight" => "ffn_gate_exps.weight",
        "up_proj.weight" => "ffn_up_exps.weight",
        "down_proj.weight" => "ffn_down_exps.weight",
        _ => return None,
    };
    Some((format!("blk.{layer}.{leaf}"), expert.parse().ok()?))
}

impl GgufSource {
    pub fn new(gguf: GgufFile, config: &LlamaConfig) -> GgufSource {
        GgufSource {
            gguf,
            family: config.family,
            heads: config.num_attention_heads as i64,
            kv_heads: config.num_key_value_heads as i64,
            stacked: Vec::new(),
        }
    }

    /// llama.cpp's name for an HF tensor name.
    pub fn gguf_name(hf_name: &str) -> Option<String> {
        Some(match hf_name {
            "model.embed_tokens.weight" => "token_embd.weight".into(),
            "model.norm.weight" => "output_norm.weight".into(),
            "lm_head.weight" => "output.weight".into(),
            _ => {
                let rest = hf_name.strip_prefix("model.layers.")?;
                let (layer, leaf) = rest.split_once('.')?;
                let leaf = match leaf {
                    "input_layernorm.weight" => "attn_norm.weight",
                    "post_attention_layernorm.weight" => "ffn_norm.weight",
                    "self_attn.q_proj.weight" => "attn_q.weight",
                    "self_attn.k_proj.weight" => "attn_k.weight",
                    "self_attn.v_proj.weight" => "attn_v.weight",
                    "self_attn.o_proj.weight" => "attn_output.weight",
                    "self_attn.q_proj.bias" => "attn_q.bias",
                    "self_attn.k_proj.bias" => "attn_k.bias",
                    "self_attn.v_proj.bias" => "attn_v.bias",
                    "self_attn.q_norm.weight" => "attn_q_norm.weight",
                    "self_attn.k_norm.weight" => "attn_k_norm.weight",
                    "mlp.gate.weight" => "ffn_gate_inp.weight",
                    "mlp.gate_proj.weight" => "ffn_gate.weight",
                    "mlp.up_proj.weight" => "ffn_up.weight",
                    "mlp.down_proj.weight" => "ffn_down.weight",
                    _ => return None,
                };
                format!("blk.{layer}.{leaf}")
            }
        })
    }

    fn tensor_by_gguf_name(&self, name: &str) -> Result<Option<Tensor>, ModelError> {
        let Some(info) = self.gguf.tensors.iter().find(|t| t.name == name) else {
            return Ok(None);
        };
        let shape = info.shape();
        let t = match info.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let kind = match info.ty {
                    GgmlType::F32 => Kind::Float,
                    GgmlType::F16 => Kind::Half,
                    _ => Kind::BFloat16,
                };
                Tensor::f_from_data_size(self.gguf.tensor_bytes(info)?, &shape, kind)?
            }
            _ => {
                let values = self.gguf.dequantize(info)?;
                Tensor::f_from_slice(&values)?.f_reshape(&shape)?
            }
        };
        Ok(Some(t))
    }
}

/// Undoes llama.cpp's interleaving of rotary halves in Q/K rows (`convert_hf_to_gguf.py`'s
/// `permute`), restoring HF's rotate-half layout. Works for weights [out, in] and biases `[out]`.
pub fn unpermute_qk(t: &Tensor, n_head: i64) -> Result<Tensor, ModelError> {
    let shape = t.size();
    let out = shape[0];
    if n_head <= 0 || out % (2 * n_head) != 0 {
        return Err(ModelError::Invalid(format!(
            "cannot undo the Q/K permutation of a tensor of shape {shape:?} for {n_head} heads"
        )));
    }
    let half = out / n_head / 2;
    let mut split = vec![n_head, half, 2];
    split.extend_from_slice(&shape[1..]);
    Ok(t.f_reshape(&split)?.f_transpose(1, 2)?.f_reshape(&shape)?)
}

/// llama.cpp's Q/K row order, where the two halves HF rotates together are adjacent:
/// row (head, half, i) moves to (head, i, half).
pub fn to_interleaved(t: &Tensor, n_head: i64) -> Result<Tensor, ModelError> {
    let shape = t.size();
    let half = shape[0] / n_head / 2;
    let mut split = vec![n_head, 2, half];
    split.extend_from_slice(&shape[1..]);
    Ok(t.f_reshape(&split)?.f_transpose(1, 2)?.f_reshape(&shape)?)
}

/// [`to_interleaved`] for heads that rotate only their first `rotary` of `head_dim`
/// dimensions (Qwen3.5's partial rotary): those are interleaved, the rest stay in order.
pub fn to_interleaved_rotary(
    t: &Tensor,
    n_head: i64,
    head_dim: i64,
    rotary: i64,
) -> Result<Tensor, ModelError> {
    rotary_rows(t, n_head, head_dim, rotary, true)
}

/// The inverse of [`to_interleaved_rotary`].
pub fn from_interleaved_rotary(
    t: &Tensor,
    n_head: i64,
    head_dim: i64,
    rotary: i64,
) -> Result<Tensor, ModelError> {
    rotary_rows(t, n_head, head_dim, rotary, false)
}

fn rotary_rows(
    t: &Tensor,
    n_head: i64,
    head_dim: i64,
    rotary: i64,
    forward: bool,
) -> Result<Tensor, ModelError> {
    let shape = t.size();
    if rotary == head_dim {
        return if forward {
            to_interleaved(t, n_head)
        } else {
            unpermute_qk(t, n_head)
        };
    }
    if shape[0] != n_head * head_dim || rotary % 2 != 0 || rotary > head_dim {
        return Err(ModelError::Invalid(format!(
            "cannot reorder a tensor of shape {shape:?} as {n_head} heads of {head_dim} with {rotary} rotated"
        )));
    }
    let mut heads = vec![n_head, head_dim];
    heads.extend_from_slice(&shape[1..]);
    let t = t.f_reshape(&heads)?;
    let rot = t.f_narrow(1, 0, rotary)?;
    let pass = t.f_narrow(1, rotary, head_dim - rotary)?;
    let mut split = vec![n_head, 2, rotary / 2];
    split.extend_from_slice(&shape[1..]);
    let rot = if forward {
        rot.f_reshape(&split)?.f_transpose(1, 2)?
    } else {
        split.swap(1, 2);
        rot.f_reshape(&split)?.f_transpose(1, 2)?
    };
    let mut flat = vec![n_head, rotary];
    flat.extend_from_slice(&shape[1..]);
    Ok(Tensor::f_cat(&[rot.f_reshape(&flat)?, pass], 1)?.f_reshape(&shape)?)
}

impl WeightSource for GgufSource {
    fn load(&mut self, hf_name: &str) -> Result<Option<Tensor>, ModelError> {
        if let Some((name, e)) = expert_name(hf_name) {
            if !self.stacked.iter().any(|(n, _)| *n == name) {
                let Some(t) = self.tensor_by_gguf_name(&name)? else {
                    return Ok(None);
                };
                // Another layer's tensors are done with.
                let layer = |n: &str| n.split('.').nth(1).map(str::to_string);
                self.stacked.retain(|(n, _)| layer(n) == layer(&name));
                self.stacked.push((name.clone(), t));
            }
            let Some((_, t)) = self.stacked.iter().find(|(n, _)| *n == name) else {
                return Ok(None);
            };
            return Ok((e < t.size()[0]).then(|| t.get(e)));
        }
        let Some(name) = GgufSource::gguf_name(hf_name) else {
            return Ok(None);
        };
        let Some(t) = self.tensor_by_gguf_name(&name)? else {
            return Ok(None);
        };
        // llama.cpp permutes Q/K rows for the Llama architecture only (Qwen2 and Qwen3 use
        // NeoX rotary in llama.cpp and are stored as HF has them).
        if matches!(self.family, Family::Llama | Family::Mistral) {
            if name.ends_with("attn_q.weight") || name.ends_with("attn_q.bias") {
                return Ok(Some(unpermute_qk(&t, self.heads)?));
            }
            if name.ends_with("attn_k.weight") || name.ends_with("attn_k.bias") {
                return Ok(Some(unpermute_qk(&t, self.kv_heads)?));
            }
        }
        Ok(Some(t))
    }

    fn file_of(&self, hf_name: &str) -> String {
        if let Some((g, e)) = expert_name(hf_name) {
            return format!(
                "{} (GGUF tensor '{g}', expert {e})",
                self.gguf.path().display()
            );
        }
        match GgufSource::gguf_name(hf_name) {
            Some(g) => format!("{} (GGUF tensor '{g}')", self.gguf.path().display()),
            None => self.gguf.path().display().to_string(),
        }
    }

    fn rope_freq_factors(&mut self) -> Result<Option<Vec<f32>>, ModelError> {
        match self
            .gguf
            .tensors
            .iter()
            .find(|t| t.name == "rope_freqs.weight")
        {
            None => Ok(None),
            Some(info) => Ok(Some(self.gguf.dequantize(info)?)),
        }
    }
}
