//! Finding and opening a model: a checkpoint directory, a GGUF file, or the
//! demo model when no `--model` is given.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use gemma4_model::{Gemma4, GgufMode};
use gemma4_text::{ChatTemplate, Tokenizer};

use crate::demo;

/// Model options shared by every command that runs a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json + safetensors) or GGUF file.
    /// Defaults to the demo model (see `gemma4 fetch-demo`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// GGUF only: dequantize every weight to f32 for exact arithmetic
    /// (slower, more memory) instead of running the quantized kernels.
    #[arg(long)]
    pub exact: bool,
    /// Jinja chat template to use instead of (or in the absence of) the checkpoint's own.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
}

/// A model with its tokenizer.
pub struct Loaded {
    pub path: PathBuf,
    pub model: Gemma4,
    pub tokenizer: Tokenizer,
}

impl ModelArgs {
    /// The model path: `--model`, or the installed demo model.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => demo::installed_path(),
        }
    }

    pub fn load(&self) -> Result<Loaded> {
        let path = self.path()?;
        let mode = if self.exact {
            GgufMode::Dequantized
        } else {
            GgufMode::Quantized
        };
        let model = gemma4_model::load(&path, mode)
            .with_context(|| format!("cannot load model from {}", path.display()))?;
        let tokenizer = load_tokenizer(&path)?;
        Ok(Loaded {
            path,
            model,
            tokenizer,
        })
    }

    /// The chat template: `--chat-template FILE`, else the checkpoint's own.
    /// A checkpoint without one is an error that names the fix.
    pub fn template(&self, tokenizer: &Tokenizer) -> Result<ChatTemplate> {
        let override_source = match &self.chat_template {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read chat template {}", p.display()))?,
            ),
            None => None,
        };
        Ok(ChatTemplate::for_tokenizer(
            tokenizer,
            override_source.as_deref(),
        )?)
    }
}

/// The tokenizer of a checkpoint directory or GGUF file.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let gguf = gemma4_model::gguf_file(path)?;
    let tok = match &gguf {
        Some(file) => Tokenizer::from_gguf(file),
        None => Tokenizer::from_dir(path),
    };
    tok.with_context(|| format!("cannot load the tokenizer of {}", path.display()))
}
