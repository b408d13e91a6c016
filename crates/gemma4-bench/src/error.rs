//! The errors of this crate.

use std::path::PathBuf;

/// Everything that can stop a benchmark step. Failed requests during a sweep are
/// not errors of this kind: they are recorded in the report.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("invalid URL '{url}': {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("dataset {path}, line {line}: {message}")]
    Dataset {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("the report schema is not usable: {0}")]
    Schema(String),
    #[error("the report does not match its schema: {}", .0.join("; "))]
    Invalid(Vec<String>),
    #[error("HTTP client: {0}")]
    Http(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result` with [`BenchError`].
pub type Result<T> = std::result::Result<T, BenchError>;
