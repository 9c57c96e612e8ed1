//! Bad HF model directories give one clear error naming the file and the problem.

use crate::common;

use std::path::Path;

use common::*;
use tch::Tensor;

fn cli_error(model: &Path) -> String {
    generate_error(model)
}

#[test]
fn missing_tensor_names_tensor_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny::default();
    tiny.write_hf_dir(dir.path());
    let w: Vec<(String, Tensor)> = tiny
        .weights()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.self_attn.k_proj.weight")
        .collect();
    Tensor::write_safetensors(&w, dir.path().join("model.safetensors")).unwrap();
    let e = cli_error(dir.path());
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(
        e.contains("missing tensor 'model.layers.1.self_attn.k_proj.weight'"),
        "{e}"
    );
}

#[test]
fn shape_mismatch_gives_both_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny::default();
    tiny.write_hf_dir(dir.path());
    let w: Vec<(String, Tensor)> = tiny
        .weights()
        .into_iter()
        .map(|(n, t)| {
            if n == "model.layers.0.mlp.down_proj.weight" {
                (
                    n,
                    Tensor::zeros([64, 95], (tch::Kind::Float, tch::Device::Cpu)),
                )
            } else {
                (n, t)
            }
        })
        .collect();
    Tensor::write_safetensors(&w, dir.path().join("model.safetensors")).unwrap();
    let e = cli_error(dir.path());
    assert!(e.contains("model.layers.0.mlp.down_proj.weight"), "{e}");
    assert!(e.contains("[64, 95]") && e.contains("[64, 96]"), "{e}");
}

#[test]
fn truncated_safetensors_is_named() {
    let dir = tempfile::tempdir().unwrap();
    Tiny::default().write_hf_dir(dir.path());
    let p = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let e = cli_error(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn unknown_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny {
        arch: "GPT2LMHeadModel",
        ..Tiny::default()
    };
    tiny.write_hf_dir(dir.path());
    let e = cli_error(dir.path());
    assert!(
        e.contains("config.json") && e.contains("unknown architecture \"GPT2LMHeadModel\""),
        "{e}"
    );
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Tiny::default();
    tiny.write_hf_dir(&dir.path().join("one"));
    let sharded = dir.path().join("sharded");
    tiny.write_hf_dir(&sharded);
    std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
    let w = tiny.weights();
    let (a, b) = w.split_at(w.len() / 2);
    let mut map = serde_json::Map::new();
    for (name, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        Tensor::write_safetensors(part, sharded.join(name)).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), serde_json::json!(name));
        }
    }
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let run = |d: &Path| {
        generate_ok(
            d,
            &["--prompt", "hello", "--max-tokens", "6", "--show-tokens"],
        )
    };
    assert_eq!(run(&dir.path().join("one")), run(&sharded));
}
