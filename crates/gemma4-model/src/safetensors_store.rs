//! Memory-mapped safetensors checkpoints, single-file or sharded.
//!
//! Files are mapped, never read whole; the model reads tensors in place
//! ([`SafetensorsStore::stored`]) or converted to f32 on request. Every
//! lookup is recorded so that unused tensors can be reported.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use gemma4_kernels::float::FloatType;
use safetensors::tensor::{Dtype, SafeTensors};

use crate::error::{tensor_message, WeightError};
use crate::mapped::MappedFile;
use crate::storage::{StoredDtype, StoredTensor};

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range inside the mapped file.
    start: usize,
    end: usize,
}

/// All tensors of a checkpoint, by name.
pub struct SafetensorsStore {
    maps: Vec<Arc<MappedFile>>,
    paths: Vec<PathBuf>,
    entries: HashMap<String, Entry>,
    used: Mutex<BTreeSet<String>>,
}

impl SafetensorsStore {
    /// Opens `model.safetensors`, or every shard listed by `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self, WeightError> {
        let index = dir.join("model.safetensors.index.json");
        let files = if index.is_file() {
            shard_files(&index)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(WeightError::NoWeights(dir.display().to_string()));
            }
            vec![single]
        };
        Self::open_files(&files)
    }

    /// Maps the given files and indexes their tensors.
    pub fn open_files(files: &[PathBuf]) -> Result<Self, WeightError> {
        let mut store = SafetensorsStore {
            maps: Vec::new(),
            paths: Vec::new(),
            entries: HashMap::new(),
            used: Mutex::new(BTreeSet::new()),
        };
        for path in files {
            let shown = path.display().to_string();
            let map = MappedFile::open(path)?;
            let (header_len, meta) =
                SafeTensors::read_metadata((*map).as_ref()).map_err(|e| WeightError::Format {
                    path: shown.clone(),
                    message: format!("{e} (is the file truncated or not safetensors?)"),
                })?;
            let base = 8 + header_len;
            let idx = store.maps.len();
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if base + e > map.len() {
                    return Err(WeightError::Format {
                        path: shown,
                        message: format!(
                            "tensor `{name}` ends at byte {} but the file has {} bytes (truncated?)",
                            base + e,
                            map.len()
                        ),
                    });
                }
                store.entries.insert(
                    name.clone(),
                    Entry {
                        file: idx,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                        end: base + e,
                    },
                );
            }
            store.maps.push(map);
            store.paths.push(path.clone());
        }
        Ok(store)
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The stored shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.entries.keys().cloned().collect();
        v.sort();
        v
    }

    /// Names never requested so far.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.lock().map(|u| u.clone()).unwrap_or_default();
        self.names()
            .into_iter()
            .filter(|n| !used.contains(n))
            .collect()
    }

    /// Total bytes of tensor data in the checkpoint's files.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| (e.end - e.start) as u64)
            .sum()
    }

    /// A floating-point tensor as stored (a view of the mapping), checking its shape.
    pub fn stored(&self, name: &str, expected: &[usize]) -> Result<StoredTensor, WeightError> {
        let e = self.entry(name, expected)?;
        let ty = match e.dtype {
            Dtype::BF16 => FloatType::Bf16,
            Dtype::F16 => FloatType::F16,
            Dtype::F32 => FloatType::F32,
            other => {
                return Err(WeightError::Dtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        StoredTensor::mapped(
            name.to_string(),
            StoredDtype::Float(ty),
            e.shape.clone(),
            &self.maps[e.file],
            e.start..e.end,
        )
    }

    fn entry(&self, name: &str, expected: &[usize]) -> Result<&Entry, WeightError> {
        let e = self.entries.get(name).ok_or_else(|| WeightError::Missing {
            name: name.to_string(),
        })?;
        if e.shape != expected {
            return Err(WeightError::Shape {
                name: name.into(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        if let Ok(mut used) = self.used.lock() {
            used.insert(name.to_string());
        }
        Ok(e)
    }

    /// The bytes of a tensor stored as `dtype` (little-endian, as in the
    /// file), checking its shape.
    pub fn raw_bytes(
        &self,
        name: &str,
        expected: &[usize],
        dtype: Dtype,
    ) -> Result<&[u8], WeightError> {
        let e = self.entry(name, expected)?;
        if e.dtype != dtype {
            return Err(WeightError::Dtype {
                name: name.into(),
                dtype: format!("{:?} (expected {dtype:?})", e.dtype),
            });
        }
        Ok(&(*self.maps[e.file]).as_ref()[e.start..e.end])
    }

    /// Loads a floating-point tensor as f32 on the CPU, checking its shape.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<Tensor, WeightError> {
        let t = self.get_raw(name, expected)?;
        if !t.dtype().is_float() {
            return Err(WeightError::Dtype {
                name: name.into(),
                dtype: format!("{:?}", t.dtype()),
            });
        }
        t.to_dtype(DType::F32)
            .map_err(|err| self.format_error(name, err))
    }

    /// Loads a tensor in its stored dtype (bf16, f16, f32, i64), checking its shape.
    pub fn get_raw(&self, name: &str, expected: &[usize]) -> Result<Tensor, WeightError> {
        let e = self.entry(name, expected)?;
        let bytes = &(*self.maps[e.file]).as_ref()[e.start..e.end];
        let dtype = match e.dtype {
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
            Dtype::I64 => DType::I64,
            other => {
                return Err(WeightError::Dtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Tensor::from_raw_buffer(bytes, dtype, &e.shape, &Device::Cpu)
            .map_err(|err| self.format_error(name, err))
    }

    fn format_error(&self, name: &str, err: candle_core::Error) -> WeightError {
        let path = self
            .entries
            .get(name)
            .and_then(|e| self.paths.get(e.file))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        WeightError::Format {
            path,
            message: format!("tensor `{name}`: {}", tensor_message(&err)),
        }
    }
}

fn shard_files(index: &Path) -> Result<Vec<String>, WeightError> {
    let shown = index.display().to_string();
    let text = std::fs::read_to_string(index).map_err(|source| WeightError::Io {
        path: shown.clone(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| WeightError::Format {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| WeightError::Format {
            path: shown.clone(),
            message: "no `weight_map` object".into(),
        })?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let f = file.as_str().ok_or_else(|| WeightError::Format {
            path: shown.clone(),
            message: format!("weight_map entry `{name}` is not a file name"),
        })?;
        if f.contains('/') || f.contains("..") {
            return Err(WeightError::Format {
                path: shown,
                message: format!("shard name `{f}` must be a plain file name"),
            });
        }
        files.insert(f.to_string());
    }
    Ok(files.into_iter().collect())
}
