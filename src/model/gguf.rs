//! GGUF v2/v3 reader: header, metadata, tensor directory, and dequantization of the
//! ggml block formats to `f32`.
//!
//! Owns: parsing a GGUF file that is memory-mapped, and turning any supported tensor into
//! plain `f32` values. Must never touch LibTorch (the tokenizer and chat template of a GGUF
//! are needed by clients too) and never trust a size it read: every offset and length is
//! checked against the file before it is used, so a truncated or lying file gives an error
//! naming the file and what was wrong, not a panic.
//!
//! Layout (little-endian): magic `GGUF`, version `u32`, tensor count `u64`, metadata count
//! `u64`, the metadata key/values, the tensor infos (name, dims with the fastest-varying
//! first, ggml type, offset into the data section), padding to `general.alignment`
//! (default 32), then the data section.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

/// Everything that can go wrong reading a GGUF file; each message names the file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: cannot open: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic is {magic:02x?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, magic: [u8; 4] },
    #[error("{path}: unsupported GGUF version {version} (supported: 2, 3)")]
    BadVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated file: {what} needs bytes {start}..{end} but the file has {len}")]
    Truncated {
        path: PathBuf,
        what: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("{path}: malformed header: {what}")]
    Malformed { path: PathBuf, what: String },
    #[error("{path}: tensor '{tensor}' has unsupported quantization type {ty}")]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        ty: String,
    },
    #[error("{path}: tensor '{name}' not found")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: metadata key '{key}' {problem}")]
    Metadata {
        path: PathBuf,
        key: String,
        problem: String,
    },
}

type Result<T> = std::result::Result<T, GgufError>;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer value as `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v as i64,
            Value::I8(v) => v as i64,
            Value::U16(v) => v as i64,
            Value::I16(v) => v as i64,
            Value::U32(v) => v as i64,
            Value::I32(v) => v as i64,
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(v) => v as i64,
            _ => return None,
        })
    }
    /// Any numeric value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => self.as_i64().map(|v| v != 0),
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor element/block types (the numbering of ggml.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// A type this reader knows the name of but cannot dequantize.
    Unsupported(u32),
}

impl GgmlType {
    pub fn from_u32(v: u32) -> GgmlType {
        match v {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            other => GgmlType::Unsupported(other),
        }
    }

    /// (elements per block, bytes per block); None for unsupported types.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Unsupported(_) => return None,
        })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
            GgmlType::Unsupported(v) => {
                let known = match v {
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    20 => "IQ4_NL",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    23 => "IQ4_XS",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => return write!(f, "#{v} (unknown)"),
                };
                return write!(f, "{known} (#{v})");
            }
        };
        f.write_str(name)
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: fastest-varying dimension first (the reverse of torch's shape).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the first byte inside the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The shape as torch writes it (slowest-varying first).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

/// An open, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Upper bounds that keep a lying header from making us allocate the world.
const MAX_STRING: u64 = 64 << 20;
const MAX_DIMS: u32 = 8;

struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let start = self.pos as u64;
        let end = start.saturating_add(n);
        if end > self.buf.len() as u64 {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what.to_string(),
                start,
                end,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(GgufError::Malformed {
                path: self.path.to_path_buf(),
                what: format!("{what}: string length {len} exceeds {MAX_STRING}"),
            });
        }
        let bytes = self.take(len, what)?;
        // Some converters wrote invalid UTF-8 into vocabularies; keep the bytes readable.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
    fn value(&mut self, ty: u32, what: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => Value::Bool(self.u8(what)? != 0),
            8 => Value::String(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(self.malformed(format!("{what}: arrays nested too deep")));
                }
                let elem_ty = self.u32(what)?;
                let len = self.u64(what)?;
                // Every element takes at least one byte: a length beyond the rest of the
                // file is a lie, caught before allocating.
                let remaining = (self.buf.len() - self.pos) as u64;
                if len > remaining {
                    return Err(GgufError::Truncated {
                        path: self.path.to_path_buf(),
                        what: format!("{what}: array of {len} elements"),
                        start: self.pos as u64,
                        end: self.pos as u64 + len,
                        len: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            other => return Err(self.malformed(format!("{what}: unknown value type {other}"))),
        })
    }
    fn malformed(&self, what: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            what,
        }
    }
}

impl GgufFile {
    /// Opens and parses the header of `path`; tensor data is read lazily from the map.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; a file changed underneath us would give wrong
        // values, not unsafety in this process beyond what any reader of a file sees.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut r = Reader {
            path: &path,
            buf: &mmap,
            pos: 0,
        };
        let magic: [u8; 4] = r.take(4, "magic")?.try_into().expect("4 bytes");
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { path, magic });
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::BadVersion { path, version });
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        let file_len = mmap.len() as u64;
        if n_tensors > file_len / 8 || n_kv > file_len / 8 {
            return Err(r.malformed(format!(
                "truncated or corrupt: {n_tensors} tensors and {n_kv} metadata entries cannot fit in {file_len} bytes"
            )));
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of metadata '{key}'"))?;
            let value = r.value(ty, &format!("metadata '{key}'"), 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("name of tensor #{i}"))?;
            let n_dims = r.u32(&format!("dims of tensor '{name}'"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.malformed(format!("tensor '{name}' has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("dims of tensor '{name}'"))?);
            }
            let ty = GgmlType::from_u32(r.u32(&format!("type of tensor '{name}'"))?);
            let offset = r.u64(&format!("offset of tensor '{name}'"))?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
                _ => return Err(r.malformed(format!("general.alignment is {v:?}"))),
            },
        };
        let pos = r.pos as u64;
        let data_start = pos.div_ceil(alignment) * alignment;
        let gguf = GgufFile {
            path,
            mmap,
            version,
            metadata,
            tensors,
            data_start,
        };
        // Check every tensor's extent now, so that a truncated file fails at open with the
        // name of the first tensor that does not fit.
        for t in &gguf.tensors {
            gguf.tensor_bytes(t)?;
        }
        Ok(gguf)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn meta_err(&self, key: &str, problem: impl Into<String>) -> GgufError {
        GgufError::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            problem: problem.into(),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_str()
            .ok_or_else(|| self.meta_err(key, "is not a string"))
    }
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_i64()
            .ok_or_else(|| self.meta_err(key, "is not an integer"))
    }
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_f64()
            .ok_or_else(|| self.meta_err(key, "is not a number"))
    }
    pub fn get_opt_i64(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.meta_err(key, "is not an integer")),
        }
    }
    pub fn get_opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.meta_err(key, "is not a number")),
        }
    }
    pub fn get_string_array(&self, key: &str) -> Result<Vec<String>> {
        let arr = self
            .get(key)
            .ok_or_else(|| self.meta_err(key, "is missing"))?
            .as_array()
            .ok_or_else(|| self.meta_err(key, "is not an array"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.meta_err(key, "holds a non-string"))
            })
            .collect()
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// The raw bytes of one tensor, after checking its type and extent.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> Result<&[u8]> {
        let Some((block, block_bytes)) = t.ty.block_layout() else {
            // Unsupported types are reported when the tensor is used, not at open: a file
            // may carry tensors we never need.
            return Ok(&[]);
        };
        let n = t.n_elements();
        if t.dims[0] % block as u64 != 0 {
            return Err(GgufError::Malformed {
                path: self.path.clone(),
                what: format!(
                    "tensor '{}' of type {} has a row of {} elements, not a multiple of its block of {block}",
                    t.name, t.ty, t.dims[0]
                ),
            });
        }
        let size = (n / block as u64)
            .checked_mul(block_bytes as u64)
            .ok_or_else(|| GgufError::Malformed {
                path: self.path.clone(),
                what: format!("tensor '{}' is too large", t.name),
            })?;
        let start = self.data_start.saturating_add(t.offset);
        let end = start.saturating_add(size);
        if end > self.mmap.len() as u64 {
            return Err(GgufError::Truncated {
                path: self.path.clone(),
                what: format!("tensor '{}' ({} {:?})", t.name, t.ty, t.dims),
                start,
                end,
                len: self.mmap.len() as u64,
            });
        }
        Ok(&self.mmap[start as usize..end as usize])
    }

    /// Dequantizes a tensor to `f32`, in ggml order (which is also torch's row-major order
    /// of `TensorInfo::shape`).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        if t.ty.block_layout().is_none() {
            return Err(GgufError::UnsupportedType {
                path: self.path.clone(),
                tensor: t.name.clone(),
                ty: t.ty.to_string(),
            });
        }
        let bytes = self.tensor_bytes(t)?;
        Ok(dequantize(t.ty, bytes, t.n_elements() as usize))
    }
}

/// Dequantizes `n` elements of type `ty` from `bytes`, which must hold exactly
/// `n / block * block_bytes` bytes (as `GgufFile::tensor_bytes` guarantees).
///
/// # Panics
/// On an unsupported type or a byte count that does not match; callers check both.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let (block, block_bytes) = ty.block_layout().expect("supported type");
    assert_eq!(bytes.len(), n / block * block_bytes, "byte count of {ty}");
    let mut out = vec![0f32; n];
    let blocks = bytes
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, y) in blocks {
                y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| dequant_q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| dequant_q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| dequant_q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| dequant_q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| dequant_q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| dequant_q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| dequant_q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| dequant_q6_k(b, y)),
        GgmlType::Unsupported(_) => unreachable!("checked above"),
    }
    out
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

// Block layouts follow ggml-common.h; the loops follow ggml-quants.c's dequantize_row_*.

fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] & 0x0f) as u32 | xh0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as u32 | xh1) as i32 - 16) as f32 * d;
    }
}

fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] & 0x0f) as u32 | xh0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | xh1) as f32 * d + m;
    }
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block.
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let is = chunk * 2;
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0f) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let ql = &b[48..176];
    for (chunk, (q, y)) in ql.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let is = chunk * 2;
        let u1 = 1u8 << (2 * chunk);
        let u2 = 2u8 << (2 * chunk);
        let (sc1, m1) = scale_min_k4(is, scales);
        let (sc2, m2) = scale_min_k4(is + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
            y[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let sc = &b[192..208];
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &ql[n * 64..];
        let qh = &qh[n * 32..];
        let sc = &sc[n * 8..];
        let y = &mut y[n * 128..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block_by_hand() {
        // d = 0.5 (f16 0x3800), values -3..28
        let mut b = vec![0x00, 0x38];
        for i in 0..32i8 {
            b.push((i - 3) as u8);
        }
        let y = dequantize(GgmlType::Q8_0, &b, 32);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, (i as f32 - 3.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_block_by_hand() {
        // d = 1.0 (0x3c00), m = -2.0 (0xc000); nibble j low = j%16, high = 15 - j%16
        let mut b = vec![0x00, 0x3c, 0x00, 0xc0];
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let y = dequantize(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 2.0);
            assert_eq!(y[j + 16], (15 - j) as f32 - 2.0);
        }
    }
}
