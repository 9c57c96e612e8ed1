//! Loading a model from any source, and saving it as an HF-compatible checkpoint
//! (`model.safetensors` + `config.json` + tokenizer files + `generation_config.json`) that
//! transformers loads and that our own loader loads back.
//!
//! Owns: the directory layout of checkpoints. A checkpoint is written into a temporary
//! sibling directory and renamed into place, so a crash never leaves a half-written one
//! under the final name.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, View};
use tch::{Device, Tensor};

use super::config::{wrapped_language_model, WRAPPED_PREFIX};
use super::llama::{DType, Llama};
use super::weights::{GgufSource, SafetensorsSource, WeightSource};
use super::{GgufFile, ModelCard, ModelError, ModelSource};

/// A model ready to run: its card and its decoder.
pub struct LoadedModel {
    pub source: ModelSource,
    pub card: ModelCard,
    pub model: Llama,
}

/// Where and in what precision to run a model, from `--device` (`auto`: CUDA when
/// LibTorch sees a GPU; `cpu`; `cuda`; `cuda:N`) and `--dtype` (`f32` or `bf16`; default
/// f32 on the CPU, bf16 on CUDA).
pub fn parse_placement(device: &str, dtype: Option<&str>) -> Result<(Device, DType), ModelError> {
    let invalid = |m: String| Err(ModelError::Invalid(m));
    let device = match device {
        "auto" => Device::cuda_if_available(),
        "cpu" => Device::Cpu,
        "cuda" => {
            if !tch::Cuda::is_available() {
                return invalid("--device cuda: no CUDA device is available to LibTorch".into());
            }
            Device::Cuda(0)
        }
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => {
                if (n as i64) >= tch::Cuda::device_count() {
                    return invalid(format!(
                        "--device {other}: only {} CUDA devices",
                        tch::Cuda::device_count()
                    ));
                }
                Device::Cuda(n)
            }
            _ => {
                return invalid(format!(
                    "--device {other:?}: expected auto, cpu, cuda or cuda:N"
                ))
            }
        },
    };
    let dtype = match dtype {
        Some(d) => match DType::parse(d) {
            Some(t) => t,
            None => return invalid(format!("--dtype {d:?}: expected f32 or bf16")),
        },
        None if device.is_cuda() => DType::BF16,
        None => DType::F32,
    };
    Ok((device, dtype))
}

/// Loads card and weights from `source` onto `device` in `dtype`.
pub fn load_model(
    source: &ModelSource,
    device: Device,
    dtype: DType,
) -> Result<LoadedModel, ModelError> {
    let (card, model) = match source {
        ModelSource::Gguf(path) => {
            let gguf = GgufFile::open(path)?;
            let card = ModelCard::from_gguf(&gguf)?;
            let mut src = GgufSource::new(gguf, &card.config);
            let model = Llama::load(card.config.clone(), &mut src, device, dtype)?;
            (card, model)
        }
        ModelSource::HfDir(dir) => {
            let card = ModelCard::from_hf_dir(dir)?;
            let mut src = SafetensorsSource::open_dir(dir)?;
            let model = if wraps_language_model(dir) {
                tracing::warn!(
                    "{}: a multimodal checkpoint (qwen3_5): its language model is loaded; \
                     the vision tower and the multi-token-prediction head are ignored",
                    dir.display()
                );
                let mut src = WrappedSource(&mut src);
                Llama::load(card.config.clone(), &mut src, device, dtype)?
            } else {
                Llama::load(card.config.clone(), &mut src, device, dtype)?
            };
            (card, model)
        }
    };
    Ok(LoadedModel {
        source: source.clone(),
        card,
        model,
    })
}

/// Whether `dir`'s config is a multimodal wrapper whose language model this decoder runs.
fn wraps_language_model(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| wrapped_language_model(&v).is_some())
}

/// A wrapper's language-model weights under the decoder's names (`model.layers.0...` is
/// `model.language_model.layers.0...`; the head keeps its name).
struct WrappedSource<'a>(&'a mut dyn WeightSource);

impl WrappedSource<'_> {
    fn name(hf_name: &str) -> String {
        match hf_name.strip_prefix("model.") {
            Some(rest) => format!("{WRAPPED_PREFIX}{rest}"),
            None => hf_name.to_string(),
        }
    }
}

impl WeightSource for WrappedSource<'_> {
    fn load(&mut self, hf_name: &str) -> Result<Option<Tensor>, ModelError> {
        self.0.load(&Self::name(hf_name))
    }
    fn file_of(&self, hf_name: &str) -> String {
        self.0.file_of(&Self::name(hf_name))
    }
}

struct OwnedView {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &OwnedView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn to_view(t: &Tensor, dtype: DType) -> Result<OwnedView, ModelError> {
    let t = t
        .f_to_device(Device::Cpu)?
        .f_to_kind(dtype.kind())?
        .f_contiguous()?;
    let numel = t.numel();
    let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut data, numel)?;
    Ok(OwnedView {
        dtype: match dtype {
            DType::F32 => Dtype::F32,
            DType::BF16 => Dtype::BF16,
        },
        shape: t.size().iter().map(|&d| d as usize).collect(),
        data,
    })
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        problem: e.to_string(),
    }
}

/// Writes `model` and `card` to `dir` as an HF checkpoint in `dtype`. `dir` must not exist
/// yet (or be empty).
pub fn save_checkpoint(
    dir: &Path,
    card: &ModelCard,
    model: &Llama,
    dtype: DType,
) -> Result<PathBuf, ModelError> {
    if dir.exists()
        && std::fs::read_dir(dir)
            .map_err(|e| io_err(dir, e))?
            .next()
            .is_some()
    {
        return Err(io_err(
            dir,
            "already exists and is not empty; choose a new directory",
        ));
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
    let name = dir
        .file_name()
        .ok_or_else(|| io_err(dir, "is not a directory name"))?
        .to_string_lossy();
    let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    let result = write_into(&tmp, card, model, dtype);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        std::fs::remove_dir(dir).map_err(|e| io_err(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| io_err(dir, e))?;
    Ok(dir.to_path_buf())
}

fn write_into(dir: &Path, card: &ModelCard, model: &Llama, dtype: DType) -> Result<(), ModelError> {
    let tensors = tch::no_grad(|| model.hf_tensors())?;
    let views: Vec<(String, OwnedView)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), to_view(t, dtype)?)))
        .collect::<Result<_, ModelError>>()?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let st_path = dir.join("model.safetensors");
    safetensors::tensor::serialize_to_file(
        views.iter().map(|(n, v)| (n.as_str(), v)),
        Some(meta),
        &st_path,
    )
    .map_err(|e| io_err(&st_path, e))?;

    card.write_card_files(dir, dtype.hf_name())
}
