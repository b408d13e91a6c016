//! Gemma 4 text models: `config.json` resolution, weight loading from
//! Hugging Face safetensors checkpoints, and the exact forward pass
//! (per-layer embeddings, KV sharing, k = v attention, mixture of experts),
//! plus reading and checking against reference ("golden") outputs.

pub mod assistant;
mod attend;
pub mod audio;
pub mod audio_unified;
pub mod cache;
pub mod compressed;
pub mod config;
pub mod error;
pub mod gemma4;
pub mod gguf_source;
pub mod golden;
pub mod layers;
pub mod loader;
pub mod lora;
pub mod lora_golden;
pub mod mapped;
pub mod mmproj;
pub mod paged;
pub mod plan;
pub mod safetensors_store;
pub mod source;
pub mod storage;
pub mod vision;
pub mod vision_unified;

pub use assistant::{Assistant, DraftStep, KvRows, StoreLayers, TargetKv};
pub use attend::IN_PLACE_MAX_QUERIES;
pub use audio::{AudioConfig, AudioEncoder, AudioFeatures, AudioTower};
pub use audio_unified::UnifiedAudioEmbedder;
pub use cache::{KvCache, KvStore};
pub use config::{ImageAttention, TextConfig};
pub use error::{ConfigError, ModelError, Result, WeightError};
pub use gemma4::{
    place_soft_tokens, BatchSeq, ForwardTrace, Gemma4, LogitsFor, OutputRows, PlacedSoftTokens,
    SoftTokenSource, SoftTokens,
};
pub use gguf_source::GgufSource;
pub use loader::{LoadPolicy, LoadReport, Progress, Quant, Weights};
pub use lora::{LoraAdapter, Projection};
pub use source::{HfSafetensors, RandomWeights, TowerSource, WeightSource};
pub use storage::{Embedding, Linear};
pub use vision::{read_config, ImageEncoder, MediaTokens, VisionConfig, VisionInput, VisionTower};

use std::path::Path;

/// A loaded model with what the load did.
pub struct Loaded {
    pub model: Gemma4,
    pub report: LoadReport,
    /// Stored tensors the text model never read (vision and audio towers excluded).
    pub unused: Vec<String>,
}

/// Loads a model from a Hugging Face checkpoint directory or a GGUF file
/// (or a directory holding exactly one `.gguf` and no `config.json`).
pub fn load(path: &Path, policy: LoadPolicy) -> Result<Gemma4> {
    load_with(path, policy, None).map(|l| l.model)
}

/// [`load`], reporting progress and returning what the load did.
pub fn load_with(
    path: &Path,
    policy: LoadPolicy,
    progress: Option<Progress<'_>>,
) -> Result<Loaded> {
    let (cfg, src): (TextConfig, Box<dyn WeightSource>) = match gguf_file(path)? {
        Some(file) => {
            let mut src = GgufSource::open(&file)?;
            let cfg = src.config()?;
            src.forget_vocabulary();
            (cfg, Box::new(src))
        }
        None => (
            TextConfig::from_dir(path)?,
            Box::new(HfSafetensors::open(path)?),
        ),
    };
    let mut weights = Weights::new(src.as_ref(), policy);
    if let Some(p) = progress {
        weights = weights.with_progress(p);
    }
    let model = Gemma4::load(cfg, &weights)?;
    let report = weights.report();
    Ok(Loaded {
        model,
        report,
        unused: src.unused(),
    })
}

/// The GGUF file `path` designates, if it designates one.
pub fn gguf_file(path: &Path) -> Result<Option<std::path::PathBuf>> {
    if path.is_file() {
        return Ok(Some(path.to_path_buf()));
    }
    if !path.is_dir() {
        return Err(ModelError::Input(format!(
            "model path {} does not exist",
            path.display()
        )));
    }
    if path.join("config.json").is_file() {
        return Ok(None);
    }
    let ggufs: Vec<_> = std::fs::read_dir(path)
        .map_err(|e| ModelError::Input(format!("cannot list {}: {e}", path.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match ggufs.len() {
        0 => Ok(None),
        1 => Ok(ggufs.into_iter().next()),
        _ => Err(ModelError::Input(format!(
            "{} holds several .gguf files; pass the one to load",
            path.display()
        ))),
    }
}

/// Loads a Hugging Face checkpoint directory (config + safetensors) as stored.
pub fn load_hf_dir(dir: &Path) -> Result<Gemma4> {
    if !dir.is_dir() {
        return Err(ModelError::Input(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    load(dir, LoadPolicy::default())
}
