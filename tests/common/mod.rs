//! Shared test helpers: tiny random Llama-family checkpoints written by the test itself
//! (HF safetensors directories and GGUF files), and access to the real default model.
#![allow(dead_code)]

pub mod netns;
pub mod peer;

/// The e2e tests run in two lanes (`bootstrap/test.sh` gives the binary more threads
/// than lanes): every test holds a lane while it runs, and the tests that load the CPU
/// most (a SmolLM2 server that trains or serves many streams, three or more training
/// servers, Chromium beside a trainer) take [`heavy`], so no two of them run at once and
/// none starves another past its timeouts. A thread waiting here costs nothing, so a
/// heavy test queued behind another no longer idles one of libtest's two threads (with two
/// threads, the run of seven heavy elastic tests left the light ones one thread).
/// A waiting heavy test gets the next free lane before any light one.
pub struct Lane {
    _heavy: Option<std::sync::MutexGuard<'static, ()>>,
}

const LANES: usize = 2;

struct Lanes {
    in_use: usize,
    heavy_waiting: bool,
}

static LANES_STATE: std::sync::Mutex<Lanes> = std::sync::Mutex::new(Lanes {
    in_use: 0,
    heavy_waiting: false,
});
static LANE_FREED: std::sync::Condvar = std::sync::Condvar::new();

fn take_lane(heavy: bool) {
    let mut s = LANES_STATE.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let reserved = usize::from(!heavy && s.heavy_waiting);
        if s.in_use + reserved < LANES {
            break;
        }
        if heavy {
            s.heavy_waiting = true;
        }
        s = LANE_FREED.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    if heavy {
        s.heavy_waiting = false;
    }
    s.in_use += 1;
}

impl Drop for Lane {
    fn drop(&mut self) {
        let mut s = LANES_STATE.lock().unwrap_or_else(|p| p.into_inner());
        s.in_use -= 1;
        LANE_FREED.notify_all();
    }
}

/// A lane for a test that loads the CPU lightly (tiny models, a few processes).
pub fn light() -> Lane {
    take_lane(false);
    Lane { _heavy: None }
}

/// A lane for a test that loads the CPU most; no two such tests run at once.
pub fn heavy() -> Lane {
    static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    take_lane(true);
    Lane {
        _heavy: Some(guard),
    }
}

/// A run key for the servers of a test (`dir/run.key`, made on first use) and the file
/// holding its run id (`dir/run.id`) for the clients: servers started with `--run-key`
/// certify themselves; clients started with `--run` trust only them (see
/// `agentjet::swarm::trust`).
pub fn run_key(dir: &Path) -> (String, String) {
    let key = dir.join("run.key");
    let id = dir.join("run.id");
    if !key.exists() {
        let k = agentjet::swarm::RunKey::generate();
        k.save(&key).unwrap();
        std::fs::write(&id, format!("{}\n", k.id())).unwrap();
    }
    (
        key.to_str().unwrap().to_string(),
        id.to_str().unwrap().to_string(),
    )
}

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;
use tch::{Kind, Tensor};

/// Hyper-parameters of a tiny test model.
#[derive(Debug, Clone)]
pub struct Tiny {
    pub arch: &'static str,
    pub vocab: i64,
    pub hidden: i64,
    pub inter: i64,
    pub layers: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub tied: bool,
    pub bias: bool,
    pub rope_scaling: Option<serde_json::Value>,
    pub max_pos: i64,
    pub seed: i64,
}

impl Default for Tiny {
    fn default() -> Self {
        Tiny {
            arch: "LlamaForCausalLM",
            vocab: 300,
            hidden: 64,
            inter: 96,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            tied: true,
            bias: false,
            rope_scaling: None,
            max_pos: 256,
            seed: 7,
        }
    }
}

impl Tiny {
    pub fn head_dim(&self) -> i64 {
        self.hidden / self.heads
    }

    /// Writes this model to `dir` unless a model is already there, and loads it.
    pub fn load(
        &self,
        dir: &Path,
        device: tch::Device,
        dtype: agentjet::model::llama::DType,
    ) -> agentjet::model::llama::Llama {
        if !dir.join("config.json").exists() {
            self.write_hf_dir(dir);
        }
        agentjet::model::checkpoint::load_model(
            &agentjet::model::ModelSource::HfDir(dir.to_path_buf()),
            device,
            dtype,
        )
        .unwrap()
        .model
    }

    /// Random weights under HF names (float32, uniform with std 0.08 so logits are not
    /// flat). Drawn from our own seeded generator, not LibTorch's global one, so tests
    /// running in parallel threads always get the same weights for the same `seed`.
    pub fn weights(&self) -> Vec<(String, Tensor)> {
        let rng = std::cell::RefCell::new(agentjet::base::Rng::seeded(self.seed as u64));
        let (h, i, hd) = (self.hidden, self.inter, self.head_dim());
        let r = |shape: &[i64]| {
            let n: i64 = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| ((rng.borrow_mut().next_f64() * 2.0 - 1.0) * 0.1386) as f32)
                .collect();
            Tensor::from_slice(&v).reshape(shape)
        };
        let norm = |n: i64| Tensor::ones([n], (Kind::Float, tch::Device::Cpu)) + r(&[n]);
        let mut w = vec![("model.embed_tokens.weight".to_string(), r(&[self.vocab, h]))];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            w.push((
                format!("{p}self_attn.q_proj.weight"),
                r(&[self.heads * hd, h]),
            ));
            w.push((
                format!("{p}self_attn.k_proj.weight"),
                r(&[self.kv_heads * hd, h]),
            ));
            w.push((
                format!("{p}self_attn.v_proj.weight"),
                r(&[self.kv_heads * hd, h]),
            ));
            if self.bias {
                w.push((format!("{p}self_attn.q_proj.bias"), r(&[self.heads * hd])));
                w.push((
                    format!("{p}self_attn.k_proj.bias"),
                    r(&[self.kv_heads * hd]),
                ));
                w.push((
                    format!("{p}self_attn.v_proj.bias"),
                    r(&[self.kv_heads * hd]),
                ));
            }
            w.push((
                format!("{p}self_attn.o_proj.weight"),
                r(&[h, self.heads * hd]),
            ));
            w.push((format!("{p}mlp.gate_proj.weight"), r(&[i, h])));
            w.push((format!("{p}mlp.up_proj.weight"), r(&[i, h])));
            w.push((format!("{p}mlp.down_proj.weight"), r(&[h, i])));
            w.push((format!("{p}input_layernorm.weight"), norm(h)));
            w.push((format!("{p}post_attention_layernorm.weight"), norm(h)));
        }
        w.push(("model.norm.weight".to_string(), norm(h)));
        if !self.tied {
            w.push(("lm_head.weight".to_string(), r(&[self.vocab, h])));
        }
        w
    }

    pub fn config_json(&self) -> serde_json::Value {
        json!({
            "architectures": [self.arch],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_pos,
            "tie_word_embeddings": self.tied,
            "hidden_act": "silu",
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    /// Writes an HF model directory: config.json, model.safetensors, tokenizer files.
    pub fn write_hf_dir(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&self.config_json()).unwrap(),
        )
        .unwrap();
        let w = self.weights();
        Tensor::write_safetensors(&w, dir.join("model.safetensors")).unwrap();
        write_byte_level_tokenizer(dir, self.vocab);
        dir.to_path_buf()
    }
}

/// GPT-2's byte-to-unicode table: the 256 visible characters byte-level BPE uses.
pub fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// Special tokens of the tiny tokenizer, then the 256 byte tokens, then a few merges.
pub const SPECIALS: [&str; 3] = ["<unk>", "<|im_start|>", "<|im_end|>"];

/// Vocabulary and merges of the tiny byte-level BPE: ids 0-2 special, 3-258 bytes, then
/// merged tokens up to `vocab`.
pub fn tiny_vocab(vocab: i64) -> (Vec<String>, Vec<String>) {
    let table = bytes_to_unicode();
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend(table.iter().map(|c| c.to_string()));
    let mut merges = Vec::new();
    // A few merges of common letter pairs, while ids remain.
    let pairs = [
        ("h", "e"),
        ("l", "l"),
        ("o", "Ġ"),
        ("Ġ", "w"),
        ("he", "ll"),
        ("t", "h"),
    ];
    for (a, b) in pairs {
        if (tokens.len() as i64) < vocab {
            tokens.push(format!("{a}{b}"));
            merges.push(format!("{a} {b}"));
        }
    }
    (tokens, merges)
}

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub fn write_byte_level_tokenizer(dir: &Path, vocab: i64) {
    let (tokens, merges) = tiny_vocab(vocab);
    let vocab_map: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                             "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab_map, "merges": merges},
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let cfg = json!({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "add_bos_token": false, "chat_template": CHATML,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

// ---------------------------------------------------------------------------------------
// A minimal GGUF writer (v3), enough for tiny models and for malformed files.

pub enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
}

pub struct GgufTensor {
    pub name: String,
    /// ggml order (fastest first).
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

pub fn gguf_bytes(meta: &BTreeMap<String, Meta>, tensors: &[GgufTensor]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut out, k);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Bool(x) => {
                out.extend(7u32.to_le_bytes());
                out.push(*x as u8);
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::StrArray(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for s in a {
                    put_str(&mut out, s);
                }
            }
            Meta::I32Array(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (t.data.len() as u64).div_ceil(32) * 32;
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    for t in tensors {
        out.extend(&t.data);
        while out.len() % 32 != 0 {
            out.push(0);
        }
    }
    out
}

pub fn f32_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_kind(Kind::Float).contiguous();
    let n = t.numel();
    let mut v = vec![0f32; n];
    t.copy_data(&mut v, n);
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// llama.cpp's `permute` of Q/K rows (what convert_hf_to_gguf.py applies).
pub fn permute_qk(t: &Tensor, n_head: i64) -> Tensor {
    let shape = t.size();
    let mut split = vec![n_head, 2, shape[0] / n_head / 2];
    split.extend_from_slice(&shape[1..]);
    t.reshape(&split).transpose(1, 2).reshape(&shape)
}

/// The tiny byte-level tokenizer (padded to `vocab` tokens) and ChatML template as GGUF
/// metadata (`tokenizer.*`).
pub fn tokenizer_meta(meta: &mut BTreeMap<String, Meta>, vocab: i64) {
    let (mut tokens, merges) = tiny_vocab(vocab);
    while (tokens.len() as i64) < vocab {
        tokens.push(format!("<pad{}>", tokens.len()));
    }
    let types: Vec<i32> = (0..tokens.len())
        .map(|i| if i < SPECIALS.len() { 3 } else { 1 })
        .collect();
    meta.insert("tokenizer.ggml.model".into(), Meta::Str("gpt2".into()));
    meta.insert("tokenizer.ggml.pre".into(), Meta::Str("default".into()));
    meta.insert("tokenizer.ggml.tokens".into(), Meta::StrArray(tokens));
    meta.insert("tokenizer.ggml.token_type".into(), Meta::I32Array(types));
    meta.insert("tokenizer.ggml.merges".into(), Meta::StrArray(merges));
    meta.insert("tokenizer.ggml.bos_token_id".into(), Meta::U32(1));
    meta.insert("tokenizer.ggml.eos_token_id".into(), Meta::U32(2));
    meta.insert("tokenizer.ggml.add_bos_token".into(), Meta::Bool(false));
    meta.insert("tokenizer.chat_template".into(), Meta::Str(CHATML.into()));
}

/// The tiny model as llama.cpp would convert it: GGUF names, Q/K permuted, F32 tensors,
/// gpt2 byte-level vocabulary.
pub fn tiny_gguf(tiny: &Tiny) -> (BTreeMap<String, Meta>, Vec<GgufTensor>) {
    let mut meta = BTreeMap::new();
    let arch = if tiny.arch == "Qwen2ForCausalLM" {
        "qwen2"
    } else {
        "llama"
    };
    let k = |s: &str| format!("{arch}.{s}");
    meta.insert("general.architecture".into(), Meta::Str(arch.into()));
    meta.insert("general.name".into(), Meta::Str("tiny".into()));
    meta.insert(k("context_length"), Meta::U32(tiny.max_pos as u32));
    meta.insert(k("embedding_length"), Meta::U32(tiny.hidden as u32));
    meta.insert(k("feed_forward_length"), Meta::U32(tiny.inter as u32));
    meta.insert(k("block_count"), Meta::U32(tiny.layers as u32));
    meta.insert(k("attention.head_count"), Meta::U32(tiny.heads as u32));
    meta.insert(
        k("attention.head_count_kv"),
        Meta::U32(tiny.kv_heads as u32),
    );
    meta.insert(k("rope.freq_base"), Meta::F32(10000.0));
    meta.insert(k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-5));
    meta.insert(k("vocab_size"), Meta::U32(tiny.vocab as u32));
    tokenizer_meta(&mut meta, tiny.vocab);
    let mut tensors = Vec::new();
    for (name, t) in tiny.weights() {
        let gname = agentjet::model::weights::GgufSource::gguf_name(&name).unwrap();
        let t = if arch == "llama" && (gname.contains("attn_q.")) {
            permute_qk(&t, tiny.heads)
        } else if arch == "llama" && gname.contains("attn_k.") {
            permute_qk(&t, tiny.kv_heads)
        } else {
            t
        };
        tensors.push(GgufTensor {
            name: gname,
            dims: t.size().iter().rev().map(|&d| d as u64).collect(),
            ty: 0,
            data: f32_bytes(&t),
        });
    }
    (meta, tensors)
}

pub fn write_file(path: &Path, bytes: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(bytes).unwrap();
}

/// The real default model, fetched by bootstrap/setup.sh. Tests that need it fail (not
/// skip) without it: the README's test command runs the setup first.
pub fn smollm2_path() -> PathBuf {
    let p = agentjet::model::cache_dir()
        .join("models")
        .join(agentjet::model::SMOLLM2_FILE);
    assert!(
        p.is_file(),
        "{} is missing: run `bash bootstrap/setup.sh` (the README's test command does)",
        p.display()
    );
    p
}

/// Python of the cached venv (set in .cargo/config.toml by bootstrap/setup.sh).
pub fn python() -> PathBuf {
    let p = std::env::var_os("AGENTJET_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            agentjet::model::cache_dir()
                .join("venv-torch-2.11.0")
                .join("bin")
                .join("python")
        });
    assert!(
        p.is_file(),
        "{} is missing: run `bash bootstrap/setup.sh --reference`",
        p.display()
    );
    p
}

/// Sets every LoRA B of `tensors` (an adapter's A, B, A, B, .. as `Adapter::tensors` and
/// `Llama::parameters` of an adapted model give them) to uniform values in
/// `[-scale / 2, scale / 2)` drawn from `seed`: a trained adapter (B starts at zero).
pub fn randomize_lora_b(tensors: Vec<tch::Tensor>, seed: u64, scale: f32) {
    let mut rng = agentjet::base::Rng::seeded(seed);
    tch::no_grad(|| {
        for (i, mut t) in tensors.into_iter().enumerate() {
            if i % 2 == 1 {
                let v: Vec<f32> = (0..t.numel())
                    .map(|_| (rng.next_f64() as f32 - 0.5) * scale)
                    .collect();
                t.copy_(&tch::Tensor::from_slice(&v).view(t.size().as_slice()));
            }
        }
    });
}

/// A tiny random model of `family` built and saved by HF transformers 5.x
/// (`tests/fixtures/hf_family.py`), with our byte-level tokenizer and ChatML template
/// beside it: its directory (`dir/model`) and what HF computed on it (the script's JSON).
pub fn hf_family_model(family: &str, dir: &Path) -> (PathBuf, serde_json::Value) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_family.py");
    let out = std::process::Command::new(python())
        .arg(script)
        .arg(family)
        .arg(dir)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers failed on {family}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let model_dir = dir.join("model");
    write_byte_level_tokenizer(&model_dir, v["vocab"].as_i64().unwrap());
    (model_dir, v)
}

/// A tiny `family` model (`hf_family_model`) taught by transformers to reason before it
/// answers (`tests/fixtures/train_thinker.py`: every chat turn gets
/// `<think>\nI add them.\n</think>\n\nIt is 4.`), with the family's real chat template
/// (`tests/fixtures/<template>`, Qwen3's or Qwen3.5's) in its tokenizer_config.json.
pub fn thinker_model(family: &str, template: &str, dir: &Path) -> PathBuf {
    let (model, _) = hf_family_model(family, dir);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let cfg_path = model.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = std::fs::read_to_string(fixtures.join(template))
        .unwrap()
        .into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let out = std::process::Command::new(python())
        .arg(fixtures.join("train_thinker.py"))
        .arg(&model)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let loss = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["loss"].as_f64());
    assert!(
        out.status.success() && loss.is_some_and(|l| l < 0.05),
        "teaching {family} to reason failed ({loss:?}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    model
}

/// Runs `prompts` in one batch on `engine`, greedy for 8 tokens each: for each prompt
/// `{"ids": [..], "lps": [..]}`, the tokens and their log-probabilities.
pub fn greedy_of(engine: &agentjet::engine::EngineHandle, prompts: &[&[u32]]) -> serde_json::Value {
    use agentjet::engine::{EngineEvent, GenerateRequest, SamplingParams};
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest {
                    prompt: p.to_vec(),
                    max_tokens: 8,
                    sampling: SamplingParams::greedy(),
                    ..Default::default()
                })
                .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for mut rx in rxs {
        let (mut ids, mut lps) = (Vec::new(), Vec::new());
        while let Some(EngineEvent::Token { id, logprob, .. }) = rx.blocking_recv() {
            ids.push(id as u64);
            lps.push(logprob);
        }
        out.push(json!({"ids": ids, "lps": lps}));
    }
    serde_json::Value::Array(out)
}

/// [`greedy_of`] `prompts` on `engine`, checked against `want[i]` (a reference's greedy
/// tokens and their log-probabilities, as `greedy_of` gives them): ids equal, logprobs
/// within 1e-4. `who` names the reference.
pub fn assert_greedy_matches(
    engine: &agentjet::engine::EngineHandle,
    prompts: &[&[u32]],
    want: &serde_json::Value,
    who: &str,
) {
    let got = greedy_of(engine, prompts);
    for (i, g) in got.as_array().unwrap().iter().enumerate() {
        let ids: Vec<u64> = g["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let want_ids: Vec<u64> = want[i]["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(ids, want_ids, "{who}, prompt {i}: greedy ids differ");
        for (a, b) in g["lps"]
            .as_array()
            .unwrap()
            .iter()
            .zip(want[i]["lps"].as_array().unwrap())
        {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!(
                (a - b).abs() < 1e-4,
                "{who}, prompt {i}: logprob {a} vs {b}"
            );
        }
    }
}

/// Each of `theirs` (autograd's gradients, by name) against ours of the same name (after
/// `rename`, e.g. a wrapper's prefix), within 1e-4 of the gradient's own scale (its
/// largest entry, at least 1): float32 sums in another order differ by about 1e-6 of it.
pub fn assert_gradients_match(
    who: &str,
    ours: &[(String, Tensor)],
    theirs: &[(String, Tensor)],
    rename: impl Fn(&str) -> String,
) {
    assert_eq!(
        ours.len(),
        theirs.len(),
        "{who}: {} gradients against {}",
        ours.len(),
        theirs.len()
    );
    for (name, want) in theirs {
        let name = &rename(name);
        let got = &ours
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{who}: no gradient for {name}"))
            .1;
        let d = max_abs_diff(got, want);
        let scale = want.abs().max().double_value(&[]).max(1.0);
        assert!(
            d < 1e-4 * scale,
            "{who}: the gradient of {name} is {d} from autograd's (its largest entry {scale})"
        );
    }
}

/// A JSON array of numbers (a reference script's output) as float32s.
pub fn json_floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Runs `agentjet-peer generate --model MODEL ARGS...`.
pub fn generate_cli(model: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_agentjet-peer"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(args)
        .output()
        .unwrap()
}

/// Like [`generate_cli`], asserting success; returns stdout.
pub fn generate_ok(model: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> String {
    let out = generate_cli(model, args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs generate on a bad model and checks for one clear line: "error: ...", no panic,
/// exit code 1. Returns that line.
pub fn generate_error(model: &Path) -> String {
    let out = generate_cli(model, &["--prompt", "hi", "--max-tokens", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "want one error line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}
