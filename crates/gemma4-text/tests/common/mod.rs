//! Helpers shared by the integration tests: fixture paths, JSON access and the
//! real Gemma 4 tokenizer built once per test binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use gemma4_text::Tokenizer;
use serde_json::Value;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A fallible fixture helper's result.
pub type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

/// `tests/fixtures/text` at the repository root.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("..")
        .join("tests")
        .join("fixtures")
        .join("text")
}

/// The copy of one tiny oracle variant's tokenizer, template and cases.
pub fn oracle_dir(variant: &str) -> PathBuf {
    fixture_dir().join("oracle").join(variant)
}

/// The vocabulary-only GGUF of the real Gemma 4 tokenizer.
pub fn gemma4_vocab_gguf() -> PathBuf {
    fixture_dir().join("ggml-vocab-gemma-4.gguf")
}

pub fn read_json(path: &Path) -> Fallible<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read fixture {}: {e}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

pub fn read_text(path: &Path) -> Fallible<String> {
    Ok(std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read fixture {}: {e}", path.display()))?)
}

/// `value[key]` as an array, or an error naming the key.
pub fn array<'a>(value: &'a Value, key: &str) -> Result<&'a Vec<Value>, String> {
    value
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("fixture field {key:?} is missing or not an array"))
}

/// `value[key]` as a string, or an error naming the key.
pub fn string<'a>(value: &'a Value, key: &str) -> Result<&'a str, String> {
    value
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("fixture field {key:?} is missing or not a string"))
}

/// `value[key]` as a list of token ids.
pub fn ids(value: &Value, key: &str) -> Result<Vec<u32>, String> {
    array(value, key)?
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| format!("fixture field {key:?} holds a non-id"))
        })
        .collect()
}

/// The real Gemma 4 tokenizer, rebuilt from the vocabulary GGUF once per binary.
pub fn gemma4_tokenizer() -> Result<&'static Tokenizer, String> {
    static TOKENIZER: OnceLock<Result<Tokenizer, String>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| Tokenizer::from_gguf(&gemma4_vocab_gguf()).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The first position where two id lists differ, for readable failures.
pub fn first_difference(a: &[u32], b: &[u32]) -> String {
    let at = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    format!(
        "lengths {} vs {}, first difference at {at}: {:?} vs {:?}",
        a.len(),
        b.len(),
        &a[at.min(a.len())..(at + 5).min(a.len())],
        &b[at.min(b.len())..(at + 5).min(b.len())]
    )
}
