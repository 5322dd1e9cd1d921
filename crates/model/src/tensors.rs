//! [`TensorMap`]: named f32 tensors, read from and written to safetensors
//! files (single or sharded with an index), f32/f16/bf16 on disk.
//!
//! Every tensor remembers the file it came from, so a shape or presence
//! error names both the file and the tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::error::ModelError;

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements, row-major.
    pub data: Vec<f32>,
}

/// Element type used when writing safetensors files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskDtype {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
}

/// Named tensors with the file each came from.
#[derive(Debug, Default, Clone)]
pub struct TensorMap {
    tensors: BTreeMap<String, Tensor>,
    origin: HashMap<String, PathBuf>,
    /// What to name in errors for a tensor that is absent.
    source: PathBuf,
}

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl TensorMap {
    /// An empty map whose absent-tensor errors name `source`.
    pub fn new(source: impl Into<PathBuf>) -> Self {
        TensorMap {
            source: source.into(),
            ..TensorMap::default()
        }
    }

    /// Adds (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// Removes a tensor, returning it.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.tensors.remove(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the map holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, whatever its shape.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The tensor `name`, checked to have `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&Tensor, ModelError> {
        let tensor = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.source.clone(),
                tensor: name.to_string(),
            })?;
        if tensor.shape != shape {
            return Err(ModelError::TensorShape {
                path: self.origin_of(name),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                got: tensor.shape.clone(),
            });
        }
        Ok(tensor)
    }

    fn origin_of(&self, name: &str) -> PathBuf {
        self.origin
            .get(name)
            .cloned()
            .unwrap_or_else(|| self.source.clone())
    }

    /// Loads every tensor of a model directory: `model.safetensors`, or the
    /// shards listed by `model.safetensors.index.json`.
    pub fn load_dir(dir: &Path) -> Result<TensorMap, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let mut map = TensorMap::new(dir);
        if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let index: ShardIndex = serde_json::from_str(&text).map_err(|e| {
                ModelError::config(&index_path, format!("invalid shard index: {e}"))
            })?;
            let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (tensor, file) in &index.weight_map {
                by_file.entry(file).or_default().push(tensor);
            }
            for (file, names) in by_file {
                let path = dir.join(file);
                map.load_file(&path)?;
                if let Some(missing) = names.iter().find(|n| !map.contains(n)) {
                    return Err(ModelError::MissingTensor {
                        path,
                        tensor: missing.to_string(),
                    });
                }
            }
            map.source = index_path;
        } else if single.exists() {
            map.load_file(&single)?;
            map.source = single;
        } else {
            return Err(ModelError::config(
                dir,
                format!("no {SINGLE_FILE} or {INDEX_FILE} in the model directory"),
            ));
        }
        Ok(map)
    }

    /// Adds every tensor of one safetensors file, converted to f32.
    pub fn load_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            path: path.into(),
            reason: e.to_string(),
        })?;
        for (name, view) in file.tensors() {
            let data =
                to_f32(view.dtype(), view.data()).ok_or_else(|| ModelError::UnsupportedDtype {
                    path: path.into(),
                    tensor: name.clone(),
                    dtype: format!("{:?}", view.dtype()),
                })?;
            self.origin.insert(name.clone(), path.into());
            self.tensors.insert(
                name,
                Tensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(())
    }

    /// Writes the tensors into `dir` as `model.safetensors` (one shard) or as
    /// `shards` files plus `model.safetensors.index.json`.
    pub fn save_dir(&self, dir: &Path, shards: usize, dtype: DiskDtype) -> Result<(), ModelError> {
        let shards = shards.clamp(1, self.tensors.len().max(1));
        let names: Vec<&String> = self.tensors.keys().collect();
        let per_shard = names.len().div_ceil(shards);
        let mut weight_map = BTreeMap::new();
        for (i, chunk) in names.chunks(per_shard.max(1)).enumerate() {
            let file = if shards == 1 {
                SINGLE_FILE.to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
            };
            let encoded: Vec<(&str, Vec<usize>, Vec<u8>)> = chunk
                .iter()
                .map(|name| {
                    let t = &self.tensors[*name];
                    (name.as_str(), t.shape.clone(), from_f32(dtype, &t.data))
                })
                .collect();
            let views = encoded
                .iter()
                .map(|(name, shape, bytes)| {
                    safetensors::tensor::TensorView::new(disk_dtype(dtype), shape.clone(), bytes)
                        .map(|view| (*name, view))
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ModelError::Safetensors {
                    path: dir.join(&file),
                    reason: e.to_string(),
                })?;
            let path = dir.join(&file);
            let bytes =
                safetensors::serialize(views, None).map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            std::fs::write(&path, bytes).map_err(|e| ModelError::io(&path, e))?;
            for name in chunk {
                weight_map.insert(name.to_string(), file.clone());
            }
        }
        if shards > 1 {
            let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
            let path = dir.join(INDEX_FILE);
            let text =
                serde_json::to_string_pretty(&index).expect("a JSON value always serialises");
            std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
        }
        Ok(())
    }
}

fn disk_dtype(dtype: DiskDtype) -> Dtype {
    match dtype {
        DiskDtype::F32 => Dtype::F32,
        DiskDtype::F16 => Dtype::F16,
        DiskDtype::BF16 => Dtype::BF16,
    }
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let halves = || {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => halves().map(|h| half::f16::from_bits(h).to_f32()).collect(),
        Dtype::BF16 => halves()
            .map(|h| half::bf16::from_bits(h).to_f32())
            .collect(),
        _ => return None,
    })
}

fn from_f32(dtype: DiskDtype, data: &[f32]) -> Vec<u8> {
    match dtype {
        DiskDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DiskDtype::F16 => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        DiskDtype::BF16 => data
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
    }
}
