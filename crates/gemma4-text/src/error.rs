//! The error type shared by every part of the crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, tokenizing text or
/// rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A checkpoint directory has no `tokenizer.json`.
    #[error("no tokenizer.json in DIR: {}", dir.display())]
    MissingTokenizerJson {
        /// The directory that was searched.
        dir: PathBuf,
    },

    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (tokenizer_config.json, a fixture, ...) is not valid JSON or
    /// has an unexpected shape.
    #[error("invalid JSON in {}: {message}", path.display())]
    Json {
        /// The file being parsed.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },

    /// The `tokenizers` library rejected a file or an operation.
    #[error("tokenizer error while {context}: {message}")]
    Tokenizer {
        /// What was being done (loading a file, encoding, decoding, ...).
        context: String,
        /// The library's message.
        message: String,
    },

    /// A GGUF file is malformed or truncated.
    #[error("not a readable GGUF file {}: {message}", path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },

    /// A GGUF file is well-formed but describes a tokenizer this crate cannot build.
    #[error("unsupported tokenizer in GGUF file {}: {message}", path.display())]
    UnsupportedGgufTokenizer {
        /// The GGUF file.
        path: PathBuf,
        /// Why it is not supported.
        message: String,
    },

    /// The checkpoint ships no chat template.
    #[error(
        "the checkpoint has no chat template (no chat_template.jinja, no \"chat_template\" in \
         tokenizer_config.json, no tokenizer.chat_template in the GGUF); pass one with \
         --chat-template FILE"
    )]
    NoChatTemplate,

    /// The chat template failed to compile or to render.
    #[error("chat template error: {message}")]
    Template {
        /// The Jinja engine's message, including `raise_exception` messages.
        message: String,
    },

    /// The messages or tools given to a chat template are not of the expected shape.
    #[error("invalid chat template input: {0}")]
    TemplateInput(String),
}

/// Shorthand for results in this crate.
pub type Result<T, E = TextError> = std::result::Result<T, E>;

impl TextError {
    pub(crate) fn tokenizer(context: impl Into<String>, err: impl std::fmt::Display) -> Self {
        TextError::Tokenizer {
            context: context.into(),
            message: err.to_string(),
        }
    }
}
