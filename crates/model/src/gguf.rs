//! GGUF files (llama.cpp's single-file model format, version 2 and 3):
//! parsing the header, metadata and tensor table, and a writer used by tests
//! and tools to produce files of their own.
//!
//! A model file is untrusted input: every length and offset is checked
//! against the bytes actually present before anything is allocated or
//! sliced, so a truncated or hostile file is an error, never a panic or a
//! huge allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::ModelError;
use crate::quant::QuantFormat;

const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the tensor data section when the file does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `u8`
    U8(u8),
    /// `i8`
    I8(i8),
    /// `u16`
    U16(u16),
    /// `i16`
    I16(i16),
    /// `u32`
    U32(u32),
    /// `i32`
    I32(i32),
    /// `u64`
    U64(u64),
    /// `i64`
    I64(i64),
    /// `f32`
    F32(f32),
    /// `f64`
    F64(f64),
    /// `bool`
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values of one type.
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The llama.cpp tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// GGUF dimension order: `dims[0]` is the contiguous (input) axis.
    pub dims: Vec<u64>,
    /// Element encoding.
    pub format: QuantFormat,
    /// Byte range inside the file.
    range: std::ops::Range<usize>,
}

/// A parsed GGUF file, its bytes held in memory.
pub struct GgufFile {
    path: PathBuf,
    metadata: BTreeMap<String, Value>,
    tensors: BTreeMap<String, TensorInfo>,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked little-endian cursor over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn fail<T>(&self, reason: impl Into<String>) -> Result<T, ModelError> {
        Err(ModelError::gguf(
            self.path,
            format!("at byte {}: {}", self.at, reason.into()),
        ))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ModelError> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let slice = &self.bytes[self.at..end];
                self.at = end;
                Ok(slice)
            }
            _ => self.fail(format!("file ends inside a {n}-byte field")),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ModelError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items each at least `min_item_bytes` long: refused when the
    /// rest of the file could not hold them, before anything is allocated.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, ModelError> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_item_bytes as u64) > left {
            return self.fail(format!("count {n} cannot fit in the {left} bytes left"));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, ModelError> {
        let len = self.count(1)?;
        let raw = self.take(len)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => self.fail("string is not UTF-8"),
        }
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<Value, ModelError> {
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.array()?)),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return self.fail(format!("bool byte {other}")),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth > 0 {
                    return self.fail("arrays nested in arrays are not supported");
                }
                let item_type = self.u32()?;
                let n = self.count(1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return self.fail(format!("unknown metadata value type {other}")),
        })
    }
}

impl GgufFile {
    /// Reads and parses `path`.
    pub fn open(path: &Path) -> Result<GgufFile, ModelError> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        Self::parse(path, bytes)
    }

    /// Parses a whole file held in memory; `path` names it in errors.
    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<GgufFile, ModelError> {
        let mut c = Cursor {
            bytes: &bytes,
            at: 0,
            path,
        };
        if c.take(4)? != MAGIC {
            return Err(ModelError::gguf(path, "not a GGUF file (bad magic)"));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::gguf(
                path,
                format!("GGUF version {version} is not supported (2 and 3 are)"),
            ));
        }
        // Smallest tensor entry: empty name (8) + n_dims (4) + type (4) + offset (8).
        let n_tensors = c.count(24)?;
        // Smallest metadata entry: empty key (8) + type (4) + one byte.
        let n_metadata = c.count(13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_metadata {
            let key = c.string()?;
            let type_id = c.u32()?;
            let value = c.value(type_id, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return c.fail(format!("metadata key {key:?} appears twice"));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => return c.fail("general.alignment must be a power of two"),
            },
        };
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if !(1..=4).contains(&n_dims) {
                return c.fail(format!("tensor {name:?} has {n_dims} dimensions"));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let type_id = c.u32()?;
            let offset = c.u64()?;
            infos.push((name, dims, type_id, offset));
        }
        let data_start = (c.at as u64).next_multiple_of(alignment);
        let mut tensors = BTreeMap::new();
        for (name, dims, type_id, offset) in infos {
            let bad = |reason: String| ModelError::gguf(path, format!("tensor {name:?}: {reason}"));
            let format = QuantFormat::from_ggml_type(type_id)
                .ok_or_else(|| bad(format!("ggml type {type_id} is not supported")))?;
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            if dims[0] % format.block_elements() as u64 != 0 {
                return Err(bad(format!(
                    "row length {} is not a multiple of the {format:?} block of {}",
                    dims[0],
                    format.block_elements()
                )));
            }
            let len = (elements / format.block_elements() as u64)
                .checked_mul(format.block_bytes() as u64);
            let start = data_start.checked_add(offset);
            let end = start.zip(len).and_then(|(s, len)| s.checked_add(len));
            let (Some(start), Some(end)) = (start, end) else {
                return Err(bad("offset overflows".into()));
            };
            if offset % alignment != 0 || end > bytes.len() as u64 {
                return Err(bad(format!(
                    "data at {start}..{end} is misaligned or past the end of the {}-byte file",
                    bytes.len()
                )));
            }
            let info = TensorInfo {
                name: name.clone(),
                dims,
                format,
                range: start as usize..end as usize,
            };
            if tensors.insert(name.clone(), info).is_some() {
                return Err(bad("appears twice".into()));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            metadata,
            tensors,
            bytes,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str, what: &str) -> ModelError {
        ModelError::gguf(
            &self.path,
            format!("metadata {key:?} is missing or not {what}"),
        )
    }

    /// A required unsigned integer.
    pub fn u64(&self, key: &str) -> Result<u64, ModelError> {
        self.get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| self.missing(key, "an unsigned integer"))
    }

    /// A required number.
    pub fn f64(&self, key: &str) -> Result<f64, ModelError> {
        self.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| self.missing(key, "a number"))
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, ModelError> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            _ => Err(self.missing(key, "a string")),
        }
    }

    /// A required array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, ModelError> {
        let err = || self.missing(key, "an array of strings");
        let Some(Value::Array(items)) = self.get(key) else {
            return Err(err());
        };
        items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                _ => Err(err()),
            })
            .collect()
    }

    /// A required array of floating-point numbers.
    pub fn floats(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let err = || self.missing(key, "an array of floats");
        let Some(Value::Array(items)) = self.get(key) else {
            return Err(err());
        };
        items
            .iter()
            .map(|v| match *v {
                Value::F32(x) => Ok(x),
                Value::F64(x) => Ok(x as f32),
                _ => Err(err()),
            })
            .collect()
    }

    /// A required array of integers.
    pub fn integers(&self, key: &str) -> Result<Vec<i64>, ModelError> {
        let err = || self.missing(key, "an array of integers");
        let Some(Value::Array(items)) = self.get(key) else {
            return Err(err());
        };
        items
            .iter()
            .map(|v| match *v {
                Value::I32(x) => Ok(i64::from(x)),
                Value::U32(x) => Ok(i64::from(x)),
                Value::I64(x) => Ok(x),
                Value::I8(x) => Ok(i64::from(x)),
                Value::U8(x) => Ok(i64::from(x)),
                _ => Err(err()),
            })
            .collect()
    }

    /// The tensor table, by name.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    /// A tensor's info and raw bytes, checked to have `dims` (GGUF order).
    pub fn tensor(&self, name: &str, dims: &[usize]) -> Result<(&TensorInfo, &[u8]), ModelError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.path.clone(),
                tensor: name.to_string(),
            })?;
        let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if info.dims != expected {
            return Err(ModelError::TensorShape {
                path: self.path.clone(),
                tensor: name.to_string(),
                expected: dims.to_vec(),
                got: info.dims.iter().map(|&d| d as usize).collect(),
            });
        }
        Ok((info, &self.bytes[info.range.clone()]))
    }

    /// Whether the file holds a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Builds a GGUF (version 3) file: metadata, then tensors given as raw
/// encoded bytes.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, QuantFormat, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor; `dims` in GGUF order, `data` already encoded as `format`.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        format: QuantFormat,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), format, data));
        self
    }

    fn put_string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn put_value(out: &mut Vec<u8>, value: &Value) {
        match value {
            Value::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Bool(v) => out.push(u8::from(*v)),
            Value::String(s) => Self::put_string(out, s),
            Value::Array(items) => {
                let item_type = items.first().map_or(4, Value::type_id);
                out.extend_from_slice(&item_type.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    Self::put_value(out, item);
                }
            }
        }
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            Self::put_string(&mut out, key);
            out.extend_from_slice(&value.type_id().to_le_bytes());
            Self::put_value(&mut out, value);
        }
        let mut offset = 0u64;
        for (name, dims, format, data) in &self.tensors {
            Self::put_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&format.ggml_type().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + data.len() as u64).next_multiple_of(DEFAULT_ALIGNMENT);
        }
        for (_, _, _, data) in &self.tensors {
            out.resize(out.len().next_multiple_of(DEFAULT_ALIGNMENT as usize), 0);
            out.extend_from_slice(data);
        }
        out
    }

    /// Writes the file.
    pub fn write(&self, path: &Path) -> Result<(), ModelError> {
        std::fs::write(path, self.to_bytes()).map_err(|e| ModelError::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("llama.block_count", Value::U32(2))
            .metadata(
                "list",
                Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]),
            )
            .tensor("t", &[32, 2], QuantFormat::F32, vec![0; 256])
            .tensor("u", &[32], QuantFormat::Q8_0, vec![0; 34]);
        w.to_bytes()
    }

    #[test]
    fn written_files_parse_back() {
        let file = GgufFile::parse(Path::new("x.gguf"), sample()).unwrap();
        assert_eq!(file.str("general.architecture").unwrap(), "llama");
        assert_eq!(file.u64("llama.block_count").unwrap(), 2);
        assert_eq!(file.strings("list").unwrap(), ["a", "bc"]);
        let (info, data) = file.tensor("u", &[32]).unwrap();
        assert_eq!((info.format, data.len()), (QuantFormat::Q8_0, 34));
        assert!(matches!(
            file.tensor("t", &[2, 32]),
            Err(ModelError::TensorShape { .. })
        ));
        assert!(matches!(
            file.tensor("v", &[1]),
            Err(ModelError::MissingTensor { .. })
        ));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for len in 0..bytes.len() {
            assert!(
                GgufFile::parse(Path::new("x.gguf"), bytes[..len].to_vec()).is_err(),
                "a file cut at {len} bytes parsed"
            );
        }
    }

    #[test]
    fn absurd_counts_are_refused_before_allocating() {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        let err = GgufFile::parse(Path::new("x.gguf"), bytes).unwrap_err();
        assert!(err.to_string().contains("cannot fit"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn corrupted_files_never_panic(at in 0usize..400, byte in proptest::prelude::any::<u8>()) {
            let mut bytes = sample();
            let at = at % bytes.len();
            bytes[at] = byte;
            let _ = GgufFile::parse(Path::new("x.gguf"), bytes);
        }
    }
}
