//! Where weights come from. The model asks for tensors by their Hugging Face
//! names relative to the text model (`layers.3.self_attn.q_proj.weight`);
//! each source maps those names onto its own layout.

use std::path::Path;

use candle_core::{Device, Tensor};

use gemma4_kernels::q4::Q4Matrix;

use crate::compressed;
use crate::error::{Result, WeightError};
use crate::safetensors_store::SafetensorsStore;
use crate::storage::StoredTensor;

/// A provider of the text model's tensors, as stored.
pub trait WeightSource {
    /// A tensor of the given shape in its stored encoding (usually a view
    /// of a mapped file; nothing is converted).
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor>;
    /// Whether the tensor exists (as stored, or packed by the checkpoint's
    /// quantization format).
    fn contains(&self, name: &str) -> bool;
    /// The weight `[rows, cols]` of a linear layer when the checkpoint
    /// stores it packed as int4 (compressed-tensors); `None` when it is a
    /// plain tensor.
    fn packed_linear(&self, _name: &str, _rows: usize, _cols: usize) -> Option<Result<Q4Matrix>> {
        None
    }
    /// A tensor of the given shape widened to f32 (norm weights, scalars).
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.stored(name, shape)?;
        Ok(Tensor::from_vec(t.to_f32()?, shape, &Device::Cpu)?)
    }
    /// Whether norm weights already include Gemma 3's `+1` (llama.cpp's GGUF export does).
    fn norms_include_gemma3_offset(&self) -> bool {
        false
    }
    /// Tensors present but never requested (tower weights excluded), for `doctor`.
    fn unused(&self) -> Vec<String> {
        Vec::new()
    }
    /// Bytes of tensor data the source holds (for load progress).
    fn total_bytes(&self) -> u64 {
        0
    }
}

/// Prefixes under which Hugging Face checkpoints keep the text decoder,
/// most specific first.
const PREFIXES: &[&str] = &[
    "model.language_model.",
    "language_model.model.",
    "model.",
    "",
];

/// Tensors that belong to the vision and audio towers; a text model ignores them.
const TOWER_PREFIXES: &[&str] = &[
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "model.vision_embedder.",
    "vision_tower.",
    "audio_tower.",
    "multi_modal_projector.",
];

/// A Hugging Face safetensors checkpoint directory.
pub struct HfSafetensors {
    store: SafetensorsStore,
    prefix: &'static str,
}

impl HfSafetensors {
    pub fn open(dir: &Path) -> Result<Self> {
        let store = SafetensorsStore::open_dir(dir)?;
        let prefix = PREFIXES
            .iter()
            .copied()
            .find(|p| store.contains(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| WeightError::Missing {
                name: "model.language_model.embed_tokens.weight (or model.embed_tokens.weight)"
                    .into(),
            })?;
        Ok(Self { store, prefix })
    }

    /// The key prefix of the text decoder in this checkpoint.
    pub fn prefix(&self) -> &str {
        self.prefix
    }

    pub fn store(&self) -> &SafetensorsStore {
        &self.store
    }

    /// The same checkpoint seen from the multimodal model's root, where the
    /// towers and their projections live (`vision_tower.…`, `embed_vision.…`).
    pub fn towers(&self) -> TowerSource<'_> {
        let prefix = ["model.", ""]
            .into_iter()
            .find(|p| {
                self.store
                    .names()
                    .iter()
                    .any(|n| n.starts_with(&format!("{p}vision_tower.")))
            })
            .unwrap_or("model.");
        TowerSource {
            store: &self.store,
            prefix,
        }
    }
}

/// A checkpoint's tower tensors, by name below the multimodal model's root.
pub struct TowerSource<'a> {
    store: &'a SafetensorsStore,
    prefix: &'static str,
}

impl WeightSource for TowerSource<'_> {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        Ok(self
            .store
            .stored(&format!("{}{name}", self.prefix), shape)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.store.contains(&format!("{}{name}", self.prefix))
    }
}

impl WeightSource for HfSafetensors {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        Ok(self
            .store
            .stored(&format!("{}{name}", self.prefix), shape)?)
    }

    fn total_bytes(&self) -> u64 {
        self.store.total_bytes()
    }

    fn contains(&self, name: &str) -> bool {
        let full = format!("{}{name}", self.prefix);
        self.store.contains(&full)
            || full
                .strip_suffix(".weight")
                .is_some_and(|base| compressed::is_packed(&self.store, base))
    }

    fn packed_linear(&self, name: &str, rows: usize, cols: usize) -> Option<Result<Q4Matrix>> {
        let base = format!("{}{}", self.prefix, name.strip_suffix(".weight")?);
        compressed::is_packed(&self.store, &base)
            .then(|| compressed::int4_matrix(&self.store, &base, rows, cols))
    }

    fn unused(&self) -> Vec<String> {
        self.store
            .unused()
            .into_iter()
            .filter(|n| !TOWER_PREFIXES.iter().any(|p| n.starts_with(p)))
            // Tied head: an explicit copy of the embedding is redundant.
            .filter(|n| n != "lm_head.weight")
            .collect()
    }
}

/// Deterministic random weights (f32) for whatever the model asks for, for
/// benchmarks of model shapes no checkpoint exists for: norms, scales and
/// layer scalars are ones, matrices uniform with a `1/√fan_in` scale.
pub struct RandomWeights;

impl WeightSource for RandomWeights {
    fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> =
            if name.ends_with("layer_scalar") || name.contains("norm") || name.ends_with("scale") {
                vec![1.0; n]
            } else {
                let fan_in = *shape.last().unwrap_or(&1) as f32;
                let mut state = name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |h, b| {
                    h.rotate_left(5) ^ u64::from(b)
                });
                (0..n)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 / fan_in.sqrt()
                    })
                    .collect()
            };
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(StoredTensor::new(
            name.to_string(),
            crate::storage::StoredDtype::Float(gemma4_kernels::float::FloatType::F32),
            shape.to_vec(),
            gemma4_kernels::Bytes::from_vec(bytes),
        ))
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}
