//! The `--lora` flags the commands share: PEFT adapter folders read for
//! the loaded model.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use gemma4_model::{LoraAdapter, TextConfig};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct LoraArgs {
    /// A LoRA adapter: a PEFT folder (`adapter_config.json` and
    /// `adapter_model.safetensors`) or a llama.cpp GGUF LoRA file, as
    /// `NAME=PATH` or a bare `PATH` (named after its folder, or its file
    /// without `.gguf`). Repeatable; requests choose one by its name as
    /// their `model`.
    #[arg(long = "lora", value_name = "[NAME=]PATH")]
    pub lora: Vec<String>,
}

impl LoraArgs {
    /// `(name, folder)` of each `--lora`.
    fn entries(&self) -> Result<Vec<(String, PathBuf)>> {
        self.lora
            .iter()
            .map(|spec| {
                let (name, path) = match spec.split_once('=') {
                    Some((name, path)) => (name.to_string(), PathBuf::from(path)),
                    None => {
                        let path = PathBuf::from(spec);
                        // A folder's name, or a GGUF file's without `.gguf`.
                        let name = if path.is_file() {
                            path.file_stem()
                        } else {
                            path.file_name()
                        };
                        let name = name
                            .and_then(|n| n.to_str())
                            .map(str::to_string)
                            .with_context(|| {
                                format!("--lora {spec}: name it, as --lora NAME={spec}")
                            })?;
                        (name, path)
                    }
                };
                if name.is_empty() || name.chars().any(char::is_whitespace) {
                    bail!("--lora {spec}: the name must be non-empty, without spaces");
                }
                Ok((name, path))
            })
            .collect()
    }

    /// Every adapter, read and checked against the model `cfg` describes;
    /// the first that does not fit is an error naming it.
    pub fn load(&self, cfg: &TextConfig, served_model: Option<&str>) -> Result<Vec<LoraAdapter>> {
        let mut adapters: Vec<LoraAdapter> = Vec::new();
        for (name, path) in self.entries()? {
            if served_model == Some(name.as_str()) {
                bail!("--lora {name}: the served model has that name; name the adapter otherwise");
            }
            if adapters.iter().any(|a| a.name() == name) {
                bail!("--lora {name} is given twice");
            }
            let adapter = LoraAdapter::load(&name, &path, cfg).with_context(|| {
                format!("cannot load the LoRA adapter `{name}` ({})", path.display())
            })?;
            tracing::info!(
                adapter = %name,
                path = %path.display(),
                rank = adapter.max_rank(),
                modules = adapter.modules().count(),
                bytes = adapter.bytes(),
                "LoRA adapter loaded"
            );
            adapters.push(adapter);
        }
        Ok(adapters)
    }
}
