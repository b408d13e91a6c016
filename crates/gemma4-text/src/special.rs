//! Special tokens of the Gemma families, by spelling.
//!
//! Ids differ between vocabularies and are never assumed: every token here is
//! looked up by its string in the loaded vocabulary.

use tokenizers::processors::template::TemplateProcessing;

use crate::error::{Result, TextError};

/// Tokens that end generation when present in the vocabulary: `<eos>`,
/// Gemma 4's end of turn `<turn|>` and `<|tool_response>` (the model emits it after
/// its tool calls and waits for the result), and Gemma 3's `<end_of_turn>`.
pub const STOP_TOKENS: [&str; 4] = ["<eos>", "<turn|>", "<|tool_response>", "<end_of_turn>"];

/// Gemma 4 tokens that carry the structure of tool calls and thinking. They
/// must stay visible in generated text so that tool-call and reasoning parsers
/// can see them, even where other special tokens are skipped.
pub const MARKUP_TOKENS: [&str; 9] = [
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    "<|\"|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
];

/// A post-processor that optionally puts `bos` before and `eos` after a sequence
/// (pairs get the same around each part).
pub(crate) fn template_post_processor(
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
) -> Result<TemplateProcessing> {
    let wrap = |seq: &str, type_id: u32| {
        let mut parts = Vec::new();
        if let Some((token, _)) = bos {
            parts.push(format!("{token}:{type_id}"));
        }
        parts.push(format!("{seq}:{type_id}"));
        if let Some((token, _)) = eos {
            parts.push(format!("{token}:{type_id}"));
        }
        parts.join(" ")
    };
    let single = wrap("$A", 0);
    let pair = format!("{} {}", wrap("$A", 0), wrap("$B", 1));
    let mut special: Vec<(String, u32)> = Vec::new();
    for (token, id) in bos.into_iter().chain(eos) {
        if !special.iter().any(|(t, _)| t == token) {
            special.push((token.to_owned(), id));
        }
    }
    let err = |e: String| TextError::tokenizer("building the post-processor", e);
    TemplateProcessing::builder()
        .try_single(single.as_str())
        .map_err(err)?
        .try_pair(pair.as_str())
        .map_err(err)?
        .special_tokens(special)
        .build()
        .map_err(|e| TextError::tokenizer("building the post-processor", e))
}
