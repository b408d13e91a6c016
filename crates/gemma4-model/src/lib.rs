//! Gemma 4 text models: `config.json` resolution, weight loading from
//! Hugging Face safetensors checkpoints, and the exact forward pass
//! (per-layer embeddings, KV sharing, k = v attention, mixture of experts),
//! plus reading and checking against reference ("golden") outputs.

pub mod cache;
pub mod config;
pub mod error;
pub mod gemma4;
pub mod gguf_source;
pub mod golden;
pub mod layers;
pub mod paged;
pub mod plan;
pub mod q8;
pub mod safetensors_store;
pub mod source;

pub use cache::{KvCache, KvStore};
pub use config::TextConfig;
pub use error::{ConfigError, ModelError, Result, WeightError};
pub use gemma4::{BatchSeq, ForwardTrace, Gemma4, LogitsFor};
pub use gguf_source::{GgufMode, GgufSource};
pub use source::{HfSafetensors, WeightSource};

use std::path::Path;

/// Loads a model from a Hugging Face checkpoint directory or a GGUF file
/// (or a directory holding exactly one `.gguf` and no `config.json`).
pub fn load(path: &Path, gguf_mode: GgufMode) -> Result<Gemma4> {
    load_reporting_unused(path, gguf_mode).map(|(m, _)| m)
}

/// [`load`], also returning the stored tensors the text model never read
/// (vision and audio towers excluded).
pub fn load_reporting_unused(path: &Path, gguf_mode: GgufMode) -> Result<(Gemma4, Vec<String>)> {
    match gguf_file(path)? {
        Some(file) => {
            let src = GgufSource::open(&file, gguf_mode)?;
            let model = Gemma4::load(src.config()?, &src)?;
            Ok((model, src.unused()))
        }
        None => {
            let cfg = TextConfig::from_dir(path)?;
            let src = HfSafetensors::open(path)?;
            let model = Gemma4::load(cfg, &src)?;
            Ok((model, src.unused()))
        }
    }
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

/// Loads a Hugging Face checkpoint directory (config + safetensors).
pub fn load_hf_dir(dir: &Path) -> Result<Gemma4> {
    if !dir.is_dir() {
        return Err(ModelError::Input(format!(
            "model directory {} does not exist",
            dir.display()
        )));
    }
    let cfg = TextConfig::from_dir(dir)?;
    let src = HfSafetensors::open(dir)?;
    Gemma4::load(cfg, &src)
}
