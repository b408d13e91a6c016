//! Gemma 4 text models: `config.json` resolution, weight loading from
//! Hugging Face safetensors checkpoints, and the exact forward pass
//! (per-layer embeddings, KV sharing, k = v attention, mixture of experts),
//! plus reading and checking against reference ("golden") outputs.

pub mod cache;
pub mod config;
pub mod error;
pub mod gemma4;
pub mod golden;
pub mod layers;
pub mod safetensors_store;
pub mod source;

pub use cache::KvCache;
pub use config::TextConfig;
pub use error::{ConfigError, ModelError, Result, WeightError};
pub use gemma4::{ForwardTrace, Gemma4, LogitsFor};
pub use source::{HfSafetensors, WeightSource};

use std::path::Path;

/// Loads a Hugging Face checkpoint directory (config + safetensors).
pub fn load_hf_dir(dir: &Path) -> Result<Gemma4> {
    if !dir.is_dir() {
        return Err(ModelError::Input(format!("model directory {} does not exist", dir.display())));
    }
    let cfg = TextConfig::from_dir(dir)?;
    let src = HfSafetensors::open(dir)?;
    Gemma4::load(cfg, &src)
}
