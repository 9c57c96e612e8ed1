//! The tokenizer: HF `tokenizers` loaded from `tokenizer.json`, or built from a GGUF
//! vocabulary (byte-level BPE with merges, with the pre-tokenizer llama.cpp names in
//! `tokenizer.ggml.pre`), plus the special tokens a model needs (BOS, EOS, PAD).
//!
//! Owns: text <-> token ids, incremental detokenization for streaming. Never touches
//! LibTorch. Encoding never adds special tokens on its own: chat templates carry their
//! own BOS, and `encode_with_bos` is the explicit way for raw prompts.

use std::path::Path;

use serde_json::{json, Value as Json};

use super::gguf::{GgufError, GgufFile};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{source_name}: cannot load tokenizer: {problem}")]
    Load {
        source_name: String,
        problem: String,
    },
    #[error("{source_name}: tokenizer model {model:?} is not supported (supported: gpt2 byte-level BPE; for other vocabularies load the HF model directory)")]
    UnsupportedModel { source_name: String, model: String },
    #[error("{source_name}: pre-tokenizer {pre:?} is not supported (supported: default, gpt2, gpt-2, smollm, llama-bpe, llama3, qwen2, starcoder)")]
    UnsupportedPre { source_name: String, pre: String },
    #[error("tokenizer: {0}")]
    Encode(String),
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// A special token: its id and its text.
/// Every token's output bytes (see [`Tokenizer::token_bytes`]); `None` for special
/// tokens. Constrained decoding reads it to know which tokens keep an output on its
/// pattern.
#[derive(Clone)]
pub struct TokenBytes(pub Vec<Option<Box<[u8]>>>);

impl std::fmt::Debug for TokenBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenBytes({} tokens)", self.0.len())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub id: u32,
    pub content: String,
}

/// Text <-> ids for one model.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    pub pad: Option<SpecialToken>,
    pub unk: Option<SpecialToken>,
    /// Whether raw (non-chat) prompts start with BOS for this model.
    pub add_bos_token: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// The HF pre-tokenizer that matches llama.cpp's `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(pre: &str) -> Option<Json> {
    Some(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // SmolLM and StarCoder split every digit on its own, then GPT-2's regex.
        "smollm" | "starcoder" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama-bpe" | "llama3" | "llama-v3" => split_then_bytes(LLAMA3_REGEX),
        "qwen2" => split_then_bytes(QWEN2_REGEX),
        _ => return None,
    })
}

fn token_content(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    fn from_inner(
        inner: tokenizers::Tokenizer,
        bos: Option<SpecialToken>,
        eos: Option<SpecialToken>,
        pad: Option<SpecialToken>,
        unk: Option<SpecialToken>,
        add_bos_token: bool,
    ) -> Tokenizer {
        Tokenizer {
            inner,
            bos,
            eos,
            pad,
            unk,
            add_bos_token,
        }
    }

    /// Loads `tokenizer.json` (and, if present beside it, `tokenizer_config.json` for the
    /// special tokens). `config` is the parsed tokenizer_config.json, or `Json::Null`.
    pub fn from_hf_files(
        tokenizer_json: &Path,
        config: &Json,
    ) -> Result<Tokenizer, TokenizerError> {
        let source_name = tokenizer_json.display().to_string();
        let inner =
            tokenizers::Tokenizer::from_file(tokenizer_json).map_err(|e| TokenizerError::Load {
                source_name: source_name.clone(),
                problem: e.to_string(),
            })?;
        let special = |key: &str| -> Option<SpecialToken> {
            let content = token_content(config.get(key)?)?;
            let id = inner.token_to_id(&content)?;
            Some(SpecialToken { id, content })
        };
        let (bos, eos, pad, unk) = (
            special("bos_token"),
            special("eos_token"),
            special("pad_token"),
            special("unk_token"),
        );
        let add_bos_token = config
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Tokenizer::from_inner(
            inner,
            bos,
            eos,
            pad,
            unk,
            add_bos_token,
        ))
    }

    /// Builds the tokenizer from a GGUF vocabulary.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let source_name = g.path().display().to_string();
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                source_name,
                model: model.to_string(),
            });
        }
        let pre_name = g
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let pre = pre_tokenizer_for(pre_name).ok_or_else(|| TokenizerError::UnsupportedPre {
            source_name: source_name.clone(),
            pre: pre_name.to_string(),
        })?;
        let tokens = g.get_string_array("tokenizer.ggml.tokens")?;
        let merges = g.get_string_array("tokenizer.ggml.merges")?;
        let types: Vec<i64> = match g
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
        {
            Some(arr) => arr.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let mut vocab = serde_json::Map::new();
        for (i, t) in tokens.iter().enumerate() {
            // Duplicate strings exist in some vocabularies; the first id wins, as in HF.
            vocab.entry(t.clone()).or_insert(json!(i));
        }
        // llama.cpp's token types: 3 = control, 4 = user-defined; both are atomic.
        let added: Vec<Json> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
            .map(|(i, t)| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": types[i] == 3})
            })
            .collect();
        let merges: Vec<Json> = merges.iter().map(|m| json!(m)).collect();
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        let bytes = serde_json::to_vec(&spec).expect("json");
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Load {
                source_name: source_name.clone(),
                problem: e.to_string(),
            })?;
        let special = |key: &str| -> Result<Option<SpecialToken>, TokenizerError> {
            Ok(match g.get_opt_i64(key)? {
                Some(id) if id >= 0 && (id as usize) < tokens.len() => Some(SpecialToken {
                    id: id as u32,
                    content: tokens[id as usize].clone(),
                }),
                _ => None,
            })
        };
        let add_bos_token = g
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Tokenizer::from_inner(
            inner,
            special("tokenizer.ggml.bos_token_id")?,
            special("tokenizer.ggml.eos_token_id")?,
            special("tokenizer.ggml.padding_token_id")?,
            special("tokenizer.ggml.unknown_token_id")?,
            add_bos_token,
        ))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`, special-token text (e.g. `<|im_start|>`) recognised as such,
    /// nothing added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Like `encode`, with BOS first when the model asks for it (`add_bos_token`).
    pub fn encode_with_bos(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos_token {
            if let Some(b) = &self.bos {
                ids.push(b.id);
            }
        }
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Every token's output bytes, for constrained decoding: byte-level BPE tokens through
    /// GPT-2's byte <-> character table, SentencePiece-style tokens with `▁` as a space and
    /// `<0xNN>` as one byte. Special tokens are `None`, as are ids past the tokenizer's
    /// vocabulary up to `n` (a model's embedding can be padded).
    pub fn token_bytes(&self, n: usize) -> TokenBytes {
        let byte_level = self
            .inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|s| s.contains("ByteLevel"));
        let mut unicode_to_byte = std::collections::HashMap::new();
        for (b, c) in gpt2_byte_chars().into_iter().enumerate() {
            unicode_to_byte.insert(c, b as u8);
        }
        let added = self.inner.get_added_tokens_decoder();
        let bytes = (0..n as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    return (!a.special).then(|| a.content.as_bytes().into());
                }
                let tok = self.inner.id_to_token(id)?;
                if byte_level {
                    tok.chars()
                        .map(|c| unicode_to_byte.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .map(Vec::into_boxed_slice)
                } else if let Some(hex) = tok.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
                {
                    u8::from_str_radix(hex, 16).ok().map(|b| vec![b].into())
                } else {
                    Some(tok.replace('\u{2581}', " ").into_bytes().into())
                }
            })
            .collect();
        TokenBytes(bytes)
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), TokenizerError> {
        self.inner
            .save(path, false)
            .map_err(|e| TokenizerError::Load {
                source_name: path.display().to_string(),
                problem: format!("cannot save: {e}"),
            })
    }

    /// The special-token fields of a `tokenizer_config.json` for this tokenizer.
    pub fn hf_config_fields(&self) -> serde_json::Map<String, Json> {
        let mut m = serde_json::Map::new();
        let put = |m: &mut serde_json::Map<String, Json>, k: &str, t: &Option<SpecialToken>| {
            m.insert(
                k.to_string(),
                t.as_ref().map(|t| json!(t.content)).unwrap_or(Json::Null),
            );
        };
        put(&mut m, "bos_token", &self.bos);
        put(&mut m, "eos_token", &self.eos);
        put(&mut m, "pad_token", &self.pad);
        put(&mut m, "unk_token", &self.unk);
        m.insert("add_bos_token".into(), json!(self.add_bos_token));
        m.insert("add_eos_token".into(), json!(false));
        m.insert("clean_up_tokenization_spaces".into(), json!(false));
        m.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        m
    }
}

/// Turns a growing list of ids into text pieces, holding back bytes that do not yet form
/// complete UTF-8 characters (so a multi-byte character split across tokens streams as
/// one piece).
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the ids whose text is re-decoded each step (a few tokens of context keep
    /// byte-level merges and leading spaces right).
    prefix: usize,
    /// Where the not-yet-emitted text begins.
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one id; returns the new text, if any became complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let prefix_text = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let full_text = tok.decode(&self.ids[self.prefix..], true)?;
        if full_text.len() > prefix_text.len() && !full_text.ends_with('\u{fffd}') {
            let new = full_text
                .get(prefix_text.len()..)
                .map(str::to_string)
                .unwrap_or_default();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }
}

/// GPT-2's table from bytes to the printable characters byte-level BPE stores them as.
fn gpt2_byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                let c = char::from_u32(next).unwrap_or('?');
                next += 1;
                c
            }
        })
        .collect()
}
