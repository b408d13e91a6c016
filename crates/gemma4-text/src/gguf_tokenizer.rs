//! Rebuilding a Gemma tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.
//!
//! Two vocabulary kinds occur in Gemma GGUFs:
//!
//! * `llama`: a SentencePiece vocabulary (Gemma 1–3): tokens, scores and token
//!   types, but no merges. The merges are recovered from the vocabulary: every
//!   token that can be cut into two other tokens yields a merge, and merges are
//!   ranked by the position of the merged token in the file (the file order is the
//!   merge order; Gemma's scores do not always follow it). Tokens made only of
//!   spaces are stored with real spaces and are respelled with `▁`, the character
//!   the normalizer produces.
//! * `gemma4`: a BPE vocabulary with its merges stored in `tokenizer.ggml.merges`.
//!
//! Both become a `tokenizers` BPE model with byte fallback, the normalizer
//! `' ' → '▁'`, the decoder `'▁' → ' '` + byte fallback + fuse, and the control
//! (type 3) and user-defined (type 4) tokens as added tokens so that they are
//! matched whole in the input. Control tokens are special (skipped when decoding
//! with `skip_special_tokens`); user-defined ones are not. No prefix space is added.

use std::path::Path;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{AddedToken, DecoderWrapper, SplitDelimiterBehavior};

use crate::error::{Result, TextError};
use crate::gguf::{GgufMetadata, GgufValue};
use crate::special::template_post_processor;

/// The vocabulary kinds `build` understands, for error messages.
const SUPPORTED_MODELS: &str = "supported: \"llama\" for Gemma 1-3, \"gemma4\"";

/// GGUF token type of control tokens (`<bos>`, `<|turn>`, ...).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF token type of user-defined tokens (`<|tool_call>`, `\n`, ...).
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// What the GGUF says besides the tokenizer itself.
pub(crate) struct GgufTokenizerParts {
    pub tokenizer: tokenizers::Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

fn unsupported(path: &Path, message: impl Into<String>) -> TextError {
    TextError::UnsupportedGgufTokenizer {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn invalid(path: &Path, message: impl Into<String>) -> TextError {
    TextError::Gguf {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn string_array<'a>(meta: &'a GgufMetadata, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(value) = meta.get(key) else {
        return Ok(None);
    };
    let items = value
        .as_array()
        .ok_or_else(|| invalid(meta.path(), format!("{key} is not an array")))?;
    items
        .iter()
        .map(|item| {
            item.as_str()
                .ok_or_else(|| invalid(meta.path(), format!("{key} holds a non-string element")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn int_array(meta: &GgufMetadata, key: &str) -> Result<Option<Vec<i64>>> {
    let Some(value) = meta.get(key) else {
        return Ok(None);
    };
    let items = value
        .as_array()
        .ok_or_else(|| invalid(meta.path(), format!("{key} is not an array")))?;
    items
        .iter()
        .map(|item| {
            item.as_i64()
                .ok_or_else(|| invalid(meta.path(), format!("{key} holds a non-integer element")))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The token with the id stored under `key`, if the key exists and the id is valid.
fn token_by_id_key(meta: &GgufMetadata, tokens: &[String], key: &str) -> Option<String> {
    let id = meta.get(key).and_then(GgufValue::as_u32)?;
    tokens.get(id as usize).cloned()
}

/// The `tokenizer.chat_template` string of a GGUF file, if it has one.
pub(crate) fn chat_template_of(meta: &GgufMetadata) -> Option<String> {
    meta.get_str("tokenizer.chat_template").map(str::to_owned)
}

/// The raw `tokenizer.ggml.add_bos_token` flag, if present.
pub(crate) fn add_bos_flag_of(meta: &GgufMetadata) -> Option<bool> {
    meta.get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
}

/// A token made only of (at least one) ASCII spaces, respelled with `▁`.
fn respell_spaces(token: &str) -> Option<String> {
    if token.contains(' ') && token.trim().is_empty() {
        Some("\u{2581}".repeat(token.chars().count()))
    } else {
        None
    }
}

/// Recovers BPE merges from a SentencePiece vocabulary.
///
/// Every token that splits into two tokens of the vocabulary gives one merge per
/// split. Merges are ordered by the file position of the merged token (earlier
/// first), then longer left part first (so shorter right part).
fn derive_merges(tokens: &[String]) -> Vec<(String, String)> {
    // Like a Python dict built from the list: a repeated token keeps its last id
    // but its first position in iteration order. (A vocabulary of 262,144
    // tokens makes millions of lookups here: a fast hasher, seeded per process.)
    let mut ids: foldhash::HashMap<&str, usize> =
        foldhash::HashMap::with_capacity_and_hasher(tokens.len(), Default::default());
    let mut first_seen: Vec<&str> = Vec::with_capacity(tokens.len());
    for (index, token) in tokens.iter().enumerate() {
        if ids.insert(token.as_str(), index).is_none() {
            first_seen.push(token.as_str());
        }
    }

    // (rank, left, right): the rank of a token is its (last) position, lower
    // is better. Each token's splits go in longest-left-first, so only the
    // ranks can be out of order, and only where a token repeats.
    let mut candidates: Vec<(usize, &str, &str)> = Vec::new();
    for &token in &first_seen {
        let rank = ids.get(token).copied().unwrap_or(usize::MAX);
        for (at, _) in token.char_indices().rev() {
            if at == 0 {
                break;
            }
            let (left, right) = token.split_at(at);
            if ids.contains_key(left) && ids.contains_key(right) {
                candidates.push((rank, left, right));
            }
        }
    }
    if ids.len() < tokens.len() {
        // Stable: a token's splits keep their order.
        candidates.sort_by_key(|&(rank, _, _)| rank);
    }
    candidates
        .into_iter()
        .map(|(_, left, right)| (left.to_owned(), right.to_owned()))
        .collect()
}

fn file_merges(path: &Path, merges: &[&str]) -> Result<Vec<(String, String)>> {
    merges
        .iter()
        .map(|merge| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| invalid(path, format!("merge {merge:?} has no space separator")))
        })
        .collect()
}

/// Builds the tokenizer described by a GGUF file's metadata.
pub(crate) fn build(meta: &GgufMetadata) -> Result<GgufTokenizerParts> {
    let path = meta.path();
    let model_kind = meta
        .get_str("tokenizer.ggml.model")
        .ok_or_else(|| unsupported(path, "the file has no tokenizer.ggml.model"))?;
    let architecture = meta.get_str("general.architecture").unwrap_or("");
    let sentencepiece = match model_kind {
        "gemma4" => false,
        "llama" if architecture.starts_with("gemma") => true,
        "llama" => {
            return Err(unsupported(
                path,
                format!(
                    "a SentencePiece (\"llama\") vocabulary is only supported for Gemma \
                     architectures, not {architecture:?}"
                ),
            ))
        }
        other => {
            let message = format!("tokenizer.ggml.model {other:?} ({SUPPORTED_MODELS})");
            return Err(unsupported(path, message));
        }
    };

    let file_tokens = string_array(meta, "tokenizer.ggml.tokens")?
        .ok_or_else(|| invalid(path, "the file has no tokenizer.ggml.tokens"))?;
    let token_types = int_array(meta, "tokenizer.ggml.token_type")?.unwrap_or_default();
    if !token_types.is_empty() && token_types.len() != file_tokens.len() {
        return Err(invalid(
            path,
            format!(
                "{} token types for {} tokens",
                token_types.len(),
                file_tokens.len()
            ),
        ));
    }

    let tokens: Vec<String> = if sentencepiece {
        file_tokens
            .iter()
            .map(|t| respell_spaces(t).unwrap_or_else(|| (*t).to_owned()))
            .collect()
    } else {
        file_tokens.iter().map(|t| (*t).to_owned()).collect()
    };

    let merges = match string_array(meta, "tokenizer.ggml.merges")? {
        Some(merges) => file_merges(path, &merges)?,
        None if sentencepiece => derive_merges(&tokens),
        None => {
            return Err(invalid(
                path,
                "a gemma4 vocabulary needs tokenizer.ggml.merges",
            ))
        }
    };

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), id as u32))
        .collect();
    let unk_token = token_by_id_key(meta, &tokens, "tokenizer.ggml.unknown_token_id")
        .or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_owned()));

    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .fuse_unk(true)
        .byte_fallback(true);
    if let Some(unk) = &unk_token {
        builder = builder.unk_token(unk.clone());
    }
    let model = builder
        .build()
        .map_err(|e| invalid(path, format!("cannot build the BPE model: {e}")))?;

    let mut tokenizer = tokenizers::Tokenizer::new(model);
    let normalizer = Replace::new(" ", "\u{2581}")
        .map_err(|e| TextError::tokenizer("building the normalizer", e))?;
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| TextError::tokenizer("setting the normalizer", e))?;
    let split = Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false)
        .map_err(|e| TextError::tokenizer("building the pre-tokenizer", e))?;
    tokenizer.with_pre_tokenizer(Some(split));
    let space = Replace::new("\u{2581}", " ")
        .map_err(|e| TextError::tokenizer("building the decoder", e))?;
    let decoder = DecoderSequence::new(vec![
        DecoderWrapper::Replace(space),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ]);
    tokenizer.with_decoder(Some(decoder));

    // Control tokens become special added tokens; user-defined ones plain added
    // tokens. Both are matched on the raw text. A user-defined token whose file
    // spelling is not in the (respelled) vocabulary is left to the model.
    let control: Vec<AddedToken> = file_tokens
        .iter()
        .zip(&token_types)
        .filter(|(_, &kind)| kind == TOKEN_TYPE_CONTROL)
        .map(|(token, _)| AddedToken::from(*token, true).normalized(false))
        .collect();
    tokenizer
        .add_special_tokens(control)
        .map_err(|e| TextError::tokenizer("adding control tokens", e))?;
    let user_defined: Vec<AddedToken> = file_tokens
        .iter()
        .zip(&token_types)
        .filter(|(token, &kind)| {
            kind == TOKEN_TYPE_USER_DEFINED && tokenizer.token_to_id(token).is_some()
        })
        .map(|(token, _)| AddedToken::from(*token, false).normalized(false))
        .collect();
    tokenizer
        .add_tokens(user_defined)
        .map_err(|e| TextError::tokenizer("adding user-defined tokens", e))?;

    let bos_token = token_by_id_key(meta, &tokens, "tokenizer.ggml.bos_token_id");
    let eos_token = token_by_id_key(meta, &tokens, "tokenizer.ggml.eos_token_id");
    // Gemma 4's file says add_bos_token = true, but its chat template writes
    // `<bos>` itself and the reference tokenizer adds none; follow the reference.
    let add_bos = if sentencepiece {
        add_bos_flag_of(meta).unwrap_or(true)
    } else {
        false
    };
    let add_eos = meta
        .get("tokenizer.ggml.add_eos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let bos_pair = bos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t).map(|id| (t, id)));
    let eos_pair = eos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t).map(|id| (t, id)));
    let processor = template_post_processor(
        if add_bos { bos_pair } else { None },
        if add_eos { eos_pair } else { None },
    )?;
    tokenizer.with_post_processor(Some(processor));

    Ok(GgufTokenizerParts {
        tokenizer,
        bos_token,
        eos_token,
        add_bos,
        chat_template: chat_template_of(meta),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(tokens: &[&str]) -> Vec<String> {
        tokens.iter().map(|t| (*t).to_owned()).collect()
    }

    #[test]
    fn merges_follow_file_order_of_the_merged_token() {
        let tokens = owned(&["a", "b", "c", "bc", "ab", "abc"]);
        let merges = derive_merges(&tokens);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        // "bc" (position 3) before "ab" (4); "abc" splits as a|bc and ab|c,
        // longer left part first.
        assert_eq!(
            pairs,
            vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
        );
    }

    /// The order the merges are defined by, written out plainly: every split
    /// of every distinct token into two tokens, sorted by the merged token's
    /// last position, then longer left part, then longer right part.
    fn merges_by_definition(tokens: &[String]) -> Vec<(String, String)> {
        let last = |t: &str| tokens.iter().rposition(|x| x == t);
        let mut seen: Vec<&str> = Vec::new();
        let mut out = Vec::new();
        for t in tokens {
            if seen.contains(&t.as_str()) {
                continue;
            }
            seen.push(t);
            let chars: Vec<char> = t.chars().collect();
            for k in 1..chars.len() {
                let left: String = chars[..k].iter().collect();
                let right: String = chars[k..].iter().collect();
                if last(&left).is_some() && last(&right).is_some() {
                    out.push((last(t), k, chars.len() - k, left, right));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
        out.into_iter().map(|(_, _, _, l, r)| (l, r)).collect()
    }

    #[test]
    fn merges_match_their_definition_with_repeats_and_wide_characters() {
        // "ab" repeats (its last position ranks it), "▁" and "é" are
        // several bytes long, "xyz" has no split into tokens.
        let tokens = owned(&[
            "a", "b", "ab", "▁", "▁a", "é", "éa", "abé", "ab", "▁ab", "b▁", "xyz", "aa", "aaa",
        ]);
        let merges = derive_merges(&tokens);
        assert_eq!(merges, merges_by_definition(&tokens));
        assert!(merges.len() > 8, "{merges:?}");
        let unique: Vec<String> = tokens.iter().skip(1).take(6).cloned().collect();
        assert_eq!(derive_merges(&unique), merges_by_definition(&unique));
    }

    #[test]
    fn space_runs_are_respelled() {
        assert_eq!(respell_spaces("   ").as_deref(), Some("▁▁▁"));
        assert_eq!(respell_spaces(" a"), None);
        assert_eq!(respell_spaces("\n"), None);
    }
}
