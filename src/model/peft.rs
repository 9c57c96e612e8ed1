//! LoRA adapters on disk in HF PEFT's format, both ways: a directory with
//! `adapter_config.json` and `adapter_model.safetensors`, which
//! `peft.PeftModel.from_pretrained(base, dir)` loads and `save_pretrained` writes.
//!
//! Owns: the adapter directory's files. A config field that changes what the adapter
//! computes and is not supported here (DoRA, biases, per-layer ranks, ...) is an error that
//! names it, never ignored.

use std::path::Path;

use serde_json::{json, Value as Json};
use tch::{Device, Tensor};

use super::config::LlamaConfig;
use super::llama::lora::{Adapter, LoraConfig, Target};
use super::llama::Llama;
use super::ModelError;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

fn io_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        problem: e.to_string(),
    }
}

/// Writes `model`'s adapter to `dir` (created; files replaced atomically). `base` is
/// recorded as `base_model_name_or_path`.
pub fn write_adapter(dir: &Path, model: &Llama, base: &str) -> Result<(), ModelError> {
    let a = model
        .adapter()
        .ok_or_else(|| ModelError::Invalid("the model has no adapter to write".into()))?;
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let cfg = &a.cfg;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "use_rslora": cfg.rslora,
        "target_modules": cfg.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": true,
        "inference_mode": true,
    });
    let tensors = tch::no_grad(|| a.peft_tensors(&model.config))?;
    let st = dir.join(WEIGHTS_FILE);
    let tmp = dir.join(format!(".{WEIGHTS_FILE}.partial"));
    Tensor::write_safetensors(&tensors, &tmp).map_err(|e| io_err(&tmp, e))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .and_then(|_| std::fs::rename(&tmp, &st))
        .map_err(|e| io_err(&st, e))?;
    let cp = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&config).map_err(|e| io_err(&cp, e))? + "\n";
    crate::base::files::write_atomic(&cp, text.as_bytes()).map_err(|e| io_err(&cp, e))?;
    crate::base::files::sync_dir(dir).map_err(|e| io_err(dir, e))
}

/// The adapter's shape from `dir/adapter_config.json`.
pub fn read_config(dir: &Path) -> Result<LoraConfig, ModelError> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
    let v: Json = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        file: path.display().to_string(),
        problem: e.to_string(),
    })?;
    parse_config(&v).map_err(|problem| ModelError::Json {
        file: path.display().to_string(),
        problem,
    })
}

fn parse_config(v: &Json) -> Result<LoraConfig, String> {
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    match field("peft_type").and_then(Json::as_str) {
        Some("LORA") | None => {}
        Some(other) => return Err(format!("peft_type {other:?}: only LORA adapters load")),
    }
    let rank = field("r")
        .and_then(Json::as_u64)
        .ok_or("\"r\" (the rank) is missing or not a whole number")? as usize;
    let alpha = match field("lora_alpha") {
        None => 8.0, // PEFT's default
        Some(a) => a.as_f64().ok_or("\"lora_alpha\" is not a number")?,
    };
    let rslora = match field("use_rslora") {
        None => false,
        Some(b) => b.as_bool().ok_or("\"use_rslora\" is not true or false")?,
    };
    let targets = match field("target_modules") {
        Some(Json::Array(list)) => {
            let mut out = Vec::new();
            for m in list {
                let name = m.as_str().ok_or("\"target_modules\" holds a non-string")?;
                let t = Target::parse(name).ok_or_else(|| {
                    format!(
                        "\"target_modules\" names {name:?}: only q_proj, k_proj, v_proj, o_proj, \
                         gate_proj, up_proj and down_proj are supported"
                    )
                })?;
                if !out.contains(&t) {
                    out.push(t);
                }
            }
            out.sort();
            out
        }
        Some(Json::String(s)) if s == "all-linear" => Target::ALL.to_vec(),
        Some(Json::String(s)) => {
            return Err(format!(
                "\"target_modules\" is the pattern {s:?}: give the modules as a list"
            ))
        }
        _ => return Err("\"target_modules\" is missing".into()),
    };
    // Every other field: metadata, or something that changes the computation and is
    // refused unless at its neutral value. A field this loader does not know is refused
    // unless it is null, false or empty, so one a later PEFT adds cannot pass unread.
    let is_false = |x: &Json| x == &Json::Bool(false);
    let is_empty = |x: &Json| match x {
        Json::Object(m) => m.is_empty(),
        Json::Array(a) => a.is_empty(),
        Json::Bool(b) => !b,
        _ => false,
    };
    const METADATA: [&str; 16] = [
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "lora_dropout",
        "peft_version",
        "megatron_config",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
    ];
    if let Json::Object(map) = v {
        for (k, x) in map {
            if x.is_null() || METADATA.contains(&k.as_str()) {
                continue;
            }
            let neutral = match k.as_str() {
                "bias" => x.as_str() == Some("none"),
                // How a new adapter was drawn: the saved values replace it, unless the
                // method also changed the base (PiSSA, OLoRA, CorDA, LoftQ).
                "init_lora_weights" => {
                    matches!(x, Json::Bool(_))
                        || matches!(x.as_str(), Some("gaussian" | "eva" | "orthogonal"))
                }
                "eva_config" | "corda_config" => true,
                "use_dora" | "fan_in_fan_out" | "use_qalora" | "lora_bias" => is_false(x),
                "modules_to_save"
                | "layers_to_transform"
                | "layers_pattern"
                | "rank_pattern"
                | "alpha_pattern"
                | "trainable_token_indices"
                | "exclude_modules"
                | "layer_replication"
                | "target_parameters"
                | "alora_invocation_tokens"
                | "loftq_config"
                | "arrow_config"
                | "ensure_weight_tying" => is_empty(x),
                _ => {
                    if is_empty(x) {
                        continue;
                    }
                    return Err(format!(
                        "{k:?} is {x}: a field this loader does not know (it may change what \
                         the adapter computes)"
                    ));
                }
            };
            if !neutral {
                return Err(format!(
                    "{k:?} is {x}: not supported (it changes what the adapter computes)"
                ));
            }
        }
    }
    let cfg = LoraConfig {
        rank,
        alpha,
        targets,
        rslora,
    };
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// Attaches the adapter in `dir` to `model` (which must have none yet).
pub fn load_adapter(dir: &Path, model: &mut Llama) -> Result<(), ModelError> {
    let cfg = read_config(dir)?;
    model.attach_adapter(cfg, 0)?;
    read_weights(dir, model)
}

/// Sets `model`'s adapter (of the same shape) to the values in `dir`.
pub fn read_weights(dir: &Path, model: &Llama) -> Result<(), ModelError> {
    let a = model
        .adapter()
        .ok_or_else(|| ModelError::Invalid("the model has no adapter to load into".into()))?;
    fill(dir, a, &model.config)
}

/// The adapter in `dir`, for a model of config `c`, on `device`, on its own.
pub fn read_adapter(dir: &Path, c: &LlamaConfig, device: Device) -> Result<Adapter, ModelError> {
    let a = Adapter::new(c, read_config(dir)?, 0, device)?;
    fill(dir, &a, c)?;
    Ok(a)
}

fn fill(dir: &Path, a: &Adapter, c: &LlamaConfig) -> Result<(), ModelError> {
    let path = dir.join(WEIGHTS_FILE);
    if !path.is_file() && dir.join("adapter_model.bin").is_file() {
        return Err(io_err(
            dir,
            "holds adapter_model.bin (a pickle): save the adapter with safetensors \
             (save_pretrained's default)",
        ));
    }
    let named = Tensor::read_safetensors(&path).map_err(|e| io_err(&path, e))?;
    let mut by_name: std::collections::HashMap<String, Tensor> = named
        .into_iter()
        .map(|(k, t)| {
            // PEFT may keep the adapter's name in the keys ("...lora_A.default.weight").
            let k = k
                .replace(".lora_A.default.", ".lora_A.")
                .replace(".lora_B.default.", ".lora_B.");
            (k, t)
        })
        .collect();
    let file = path.display().to_string();
    a.load_peft(c, |name| by_name.remove(name), &file)?;
    if let Some(extra) = by_name.keys().next() {
        return Err(ModelError::Safetensors {
            file,
            problem: format!(
                "tensor {extra:?} is not part of an adapter of this shape ({} tensors left over)",
                by_name.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_that_change_the_computation_are_refused_by_name() {
        let base = json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"]});
        let c = parse_config(&base).unwrap();
        assert_eq!(
            (c.rank, c.alpha, c.targets.clone()),
            (8, 16.0, vec![Target::Q, Target::V])
        );
        for (k, v) in [
            ("use_dora", json!(true)),
            ("bias", json!("all")),
            ("rank_pattern", json!({"q_proj": 4})),
            ("modules_to_save", json!(["lm_head"])),
        ] {
            let mut bad = base.clone();
            bad[k] = v;
            let e = parse_config(&bad).unwrap_err();
            assert!(e.contains(k), "{e}");
        }
        for (k, v) in [
            ("init_lora_weights", json!("pissa")),
            ("exclude_modules", json!(["down_proj"])),
            ("a_future_field", json!(3)),
        ] {
            let mut bad = base.clone();
            bad[k] = v;
            let e = parse_config(&bad).unwrap_err();
            assert!(e.contains(k), "{e}");
        }
        let mut ok = base.clone();
        ok["init_lora_weights"] = json!("gaussian");
        ok["a_future_flag"] = json!(false);
        ok["lora_dropout"] = json!(0.05);
        parse_config(&ok).unwrap();
        let mut bad = base.clone();
        bad["target_modules"] = json!(["q_proj", "embed_tokens"]);
        assert!(parse_config(&bad).unwrap_err().contains("embed_tokens"));
        let mut bad = base;
        bad["peft_type"] = json!("IA3");
        assert!(parse_config(&bad).unwrap_err().contains("IA3"));
    }
}
