//! Error types. Every message names the file, field or tensor at fault.

use thiserror::Error;

/// A `config.json` that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    Json { path: String, message: String },
    #[error("config field `{0}` is not known to this loader; remove it or upgrade gemma4")]
    UnknownField(String),
    #[error("config field `{0}` is missing")]
    Missing(String),
    #[error("config field `{field}`: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    pub(crate) fn missing(field: impl Into<String>) -> Self {
        Self::Missing(field.into())
    }
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Weights that cannot be loaded.
#[derive(Debug, Error)]
pub enum WeightError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a usable weights file: {message}")]
    Format { path: String, message: String },
    #[error("no weights in {0}: expected model.safetensors, model.safetensors.index.json or a .gguf file")]
    NoWeights(String),
    #[error("tensor `{name}` is missing from the checkpoint")]
    Missing { name: String },
    #[error("tensor `{name}` has shape {found:?}, but the config implies {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` is stored as {dtype}, which is not supported (bf16, f16, f32)")]
    Dtype { name: String, dtype: String },
}

/// Any failure while building or running a model.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("tensor computation failed: {}", tensor_message(.0))]
    Tensor(#[from] candle_core::Error),
    #[error("{0}")]
    Input(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// candle's message without the backtrace it attaches when `RUST_BACKTRACE` is set.
pub fn tensor_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => tensor_message(inner),
        other => other.to_string(),
    }
}
