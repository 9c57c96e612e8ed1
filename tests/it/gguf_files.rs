//! GGUF reading: every supported quantization type against llama.cpp's own gguf-py
//! (fixtures made by tests/fixtures/make_quant_fixtures.py), and bad files (wrong magic,
//! truncated, missing tensor, unknown quantization type, lying sizes) giving one clear
//! error that names the file and the problem, through the library and through the CLI.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use agentjet::model::gguf::{GgufError, GgufFile};
use agentjet::model::weights::GgufSource;
use agentjet::model::{ModelCard, ModelSource};
use common::*;

fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn every_quant_type_dequantizes_to_gguf_py_values() {
    let g = GgufFile::open(fixture_path("quant_types.gguf")).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_path("quant_types.json")).unwrap())
            .unwrap();
    let expected = expected.as_object().unwrap();
    let mut seen = Vec::new();
    for (name, want) in expected {
        let info = g.tensor_info(name).unwrap();
        assert_eq!(info.ty.to_string(), want["type"].as_str().unwrap());
        let shape: Vec<i64> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(info.shape(), shape, "{name}");
        let got = g.dequantize(info).unwrap();
        let want: Vec<f64> = want["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let tol = 1e-6 * b.abs().max(1.0);
            assert!(
                (*a as f64 - b).abs() <= tol,
                "{name}[{i}]: ours {a}, gguf-py {b}"
            );
        }
        seen.push(info.ty.to_string());
    }
    seen.sort();
    assert_eq!(
        seen,
        ["BF16", "F16", "F32", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    );
}

/// A valid tiny-model GGUF, for corrupting.
fn tiny_file() -> Vec<u8> {
    let (meta, tensors) = tiny_gguf(&Tiny::default());
    gguf_bytes(&meta, &tensors)
}

fn write_tmp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    write_file(&p, bytes);
    p
}

/// One clear line: "error: ..." naming the file and containing `problem`; no panic.
fn assert_clear_error(model: &Path, problem: &str) {
    let line = generate_error(model);
    let name = model.file_name().unwrap().to_string_lossy();
    assert!(line.contains(name.as_ref()), "file not named: {line}");
    assert!(line.contains(problem), "want {problem:?} in: {line}");
}

#[test]
fn wrong_magic_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = tiny_file();
    bytes[..4].copy_from_slice(b"GGML");
    let p = write_tmp(dir.path(), "magic.gguf", &bytes);
    assert!(matches!(
        GgufFile::open(&p),
        Err(GgufError::BadMagic { .. })
    ));
    assert_clear_error(&p, "not a GGUF file");
    // A random non-model file gets the same clear answer.
    let p = write_tmp(dir.path(), "notes.txt", b"hello");
    assert_clear_error(&p, "not a GGUF file");
}

#[test]
fn truncated_file_is_named_at_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = tiny_file();
    // Cuts inside the header, inside the tensor directory, and inside the data section.
    for cut in [
        0,
        3,
        10,
        30,
        200,
        bytes.len() / 3,
        bytes.len() / 2,
        bytes.len() - 1,
    ] {
        let p = write_tmp(dir.path(), &format!("cut{cut}.gguf"), &bytes[..cut]);
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains(&format!("cut{cut}.gguf")), "{e}");
        assert!(
            e.contains("truncated") || e.contains("not a GGUF"),
            "cut {cut}: {e}"
        );
    }
    let p = write_tmp(dir.path(), "half.gguf", &bytes[..bytes.len() / 2]);
    assert_clear_error(&p, "truncated");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, mut tensors) = tiny_gguf(&Tiny::default());
    tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let p = write_tmp(dir.path(), "missing.gguf", &gguf_bytes(&meta, &tensors));
    assert_clear_error(&p, "missing tensor 'model.layers.1.mlp.up_proj.weight'");
    assert!(generate_error(&p).contains("blk.1.ffn_up.weight"));
}

#[test]
fn unknown_quant_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (meta, mut tensors) = tiny_gguf(&Tiny::default());
    // Q3_K (11), which we do not dequantize; keep the byte size plausible for 256-blocks.
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_v.weight")
        .unwrap();
    t.ty = 11;
    let p = write_tmp(dir.path(), "q3k.gguf", &gguf_bytes(&meta, &tensors));
    assert_clear_error(&p, "unsupported quantization type Q3_K");
    // And a number no ggml version has used.
    let (meta, mut tensors) = tiny_gguf(&Tiny::default());
    tensors[1].ty = 9999;
    let p = write_tmp(dir.path(), "q9999.gguf", &gguf_bytes(&meta, &tensors));
    assert_clear_error(&p, "unsupported quantization type #9999");
}

#[test]
fn lying_counts_and_lengths_do_not_allocate_or_panic() {
    let dir = tempfile::tempdir().unwrap();
    // Header claiming 2^60 tensors.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend((1u64 << 60).to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    let p = write_tmp(dir.path(), "lying_count.gguf", &bytes);
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(
        e.contains("lying_count.gguf") && e.contains("cannot fit"),
        "{e}"
    );
    // A string length of 2^62.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    bytes.extend((1u64 << 62).to_le_bytes());
    bytes.extend([0u8; 16]);
    let p = write_tmp(dir.path(), "lying_string.gguf", &bytes);
    let e = GgufFile::open(&p).unwrap_err().to_string();
    assert!(e.contains("lying_string.gguf"), "{e}");
    // An unsupported version.
    let mut bytes = tiny_file();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let p = write_tmp(dir.path(), "v1.gguf", &bytes);
    assert_clear_error(&p, "unsupported GGUF version 1");
}

#[test]
fn metadata_and_tensor_names_of_real_smollm2() {
    let g = GgufFile::open(smollm2_path()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.tensors.len(), 272);
    // Every HF name the decoder asks for maps to a tensor of the file.
    let card = ModelCard::load(&ModelSource::Gguf(smollm2_path())).unwrap();
    assert_eq!(card.config.num_hidden_layers, 30);
    assert_eq!(card.config.num_key_value_heads, 3);
    assert!(card.config.tie_word_embeddings);
    let names: BTreeMap<&str, ()> = g.tensors.iter().map(|t| (t.name.as_str(), ())).collect();
    for l in 0..30 {
        for leaf in [
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            let hf = match leaf {
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                _ => "mlp.down_proj",
            };
            let mapped = GgufSource::gguf_name(&format!("model.layers.{l}.{hf}.weight")).unwrap();
            assert_eq!(mapped, format!("blk.{l}.{leaf}.weight"));
            assert!(names.contains_key(mapped.as_str()));
        }
    }
}
