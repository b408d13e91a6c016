//! Request bodies of the OpenAI-compatible routes (and `/generate`), read
//! field by field so that every mistake is a 400 naming its field: the
//! settings every generating route shares here, chat in [`chat`],
//! completions and `/generate` in [`completion`].

mod chat;
mod completion;

pub use chat::{ChatRequest, MediaKind, MediaPart, ToolChoice};
pub use completion::{CompletionRequest, GenerateRequest, Prompt};

use serde_json::Value;

use crate::error::ApiError;
use crate::fields::Fields;
use crate::grammar::GrammarSpec;

/// Most alternatives per token that `top_logprobs` / `logprobs` may ask for.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices (`n`) per request.
pub const MAX_N: i64 = 128;

/// Sampling and length settings shared by every generating route.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// OpenAI's default is 1.0; 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means no cut (`-1` is accepted as vLLM spells it).
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// `None`: the server's default, bounded by the remaining context.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// Extra stop token ids (vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    pub n: usize,
    /// `logit_bias`: `(token id, bias)`.
    pub logit_bias: Vec<(u32, f32)>,
    /// Enforced output shape, and the field that asked for it.
    pub grammar: Option<(GrammarSpec, &'static str)>,
    /// Score the prompt: each token's log-probability given those before it,
    /// with this many alternatives (completions' `echo` with `logprobs`, or
    /// vLLM's `prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// `speculative_decoding: false`: one token a step even where the
    /// server drafts (`--speculative`); the output is the same either way.
    pub plain_decoding: bool,
}

/// `response_format` (`json_object`, `json_schema`) or one of vLLM's
/// `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; at most one.
fn parse_grammar(f: &Fields) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let mut found: Vec<(GrammarSpec, &'static str)> = Vec::new();
    if let Some(rf) = f.object("response_format")? {
        match rf.get("type").and_then(Value::as_str) {
            None | Some("text") => {}
            Some("json_object") => found.push((
                GrammarSpec::JsonSchema(serde_json::json!({"type": "object"})),
                "response_format",
            )),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .filter(|s| s.is_object() || s.is_boolean())
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            "`response_format.json_schema.schema` must be a JSON schema object",
                        )
                        .with_param("response_format")
                    })?;
                found.push((GrammarSpec::JsonSchema(schema.clone()), "response_format"));
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "`response_format` {other:?} is not a format; use \"text\", \"json_object\" or \"json_schema\""
                ))
                .with_param("response_format"))
            }
        }
    }
    match f.get("guided_json") {
        None => {}
        Some(Value::String(text)) => {
            let schema = serde_json::from_str(text).map_err(|e| {
                ApiError::bad_request(format!("`guided_json` is not valid JSON ({e})"))
                    .with_param("guided_json")
            })?;
            found.push((GrammarSpec::JsonSchema(schema), "guided_json"));
        }
        Some(schema @ Value::Object(_)) => {
            found.push((GrammarSpec::JsonSchema(schema.clone()), "guided_json"))
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "`guided_json` must be a JSON schema (an object or its text)",
            )
            .with_param("guided_json"))
        }
    }
    if let Some(rx) = f.string("guided_regex")? {
        found.push((GrammarSpec::Regex(rx.to_owned()), "guided_regex"));
    }
    if let Some(choices) = f.array("guided_choice")? {
        let options: Option<Vec<String>> = choices
            .iter()
            .map(|c| c.as_str().map(str::to_owned))
            .collect();
        match options {
            Some(options) if !options.is_empty() => {
                found.push((GrammarSpec::Choice(options), "guided_choice"))
            }
            _ => {
                return Err(ApiError::bad_request(
                    "`guided_choice` must be a non-empty array of strings",
                )
                .with_param("guided_choice"))
            }
        }
    }
    if let Some(lark) = f.string("guided_grammar")? {
        found.push((GrammarSpec::Lark(lark.to_owned()), "guided_grammar"));
    }
    if found.len() > 1 {
        return Err(ApiError::bad_request(format!(
            "`{}` and `{}` both constrain the output; send one",
            found[0].1, found[1].1
        ))
        .with_param(found[1].1));
    }
    Ok(found.pop())
}

/// Fields every generating route refuses: features this server does not have.
/// (`best_of: 1`, which asks for nothing more, is accepted.)
const UNSUPPORTED: [&str; 7] = [
    "guided_decoding_backend",
    "structured_outputs",
    "use_beam_search",
    "prediction",
    "web_search_options",
    "audio",
    "functions",
];

/// Refuses [`UNSUPPORTED`] fields, and `best_of` other than 1.
fn refuse_unsupported(f: &Fields, route: &str) -> Result<(), ApiError> {
    f.refuse(&UNSUPPORTED, route)?;
    f.refuse_unless("best_of", route, |b| b.as_u64() == Some(1))
}

impl Sampling {
    /// Reads the sampling fields; `max_token_fields` are the names accepted
    /// for the output length, the first present one wins.
    fn parse(f: &Fields, max_token_fields: &[&str]) -> Result<Self, ApiError> {
        let mut max_tokens = None;
        for name in max_token_fields {
            // 0 runs the prompt alone (to score it, with `echo` and `logprobs`).
            if let Some(m) = f.integer(name, 0, i64::MAX)? {
                max_tokens.get_or_insert(usize::try_from(m).unwrap_or(usize::MAX));
            }
        }
        let stop: Vec<String> = f
            .strings("stop")?
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_request(format!(
                "`stop` has {} strings; at most {MAX_STOP_STRINGS} are allowed",
                stop.len()
            ))
            .with_param("stop"));
        }
        let top_k = f.integer("top_k", -1, i64::from(u32::MAX))?.unwrap_or(0);
        Ok(Self {
            temperature: f.number("temperature", 0.0, 100.0)?.unwrap_or(1.0),
            top_p: match f.number("top_p", 0.0, 1.0)? {
                // 0 keeps only the most likely token (the nucleus never holds fewer).
                Some(p) if p <= 0.0 => 1e-9,
                p => p.unwrap_or(1.0),
            },
            top_k: usize::try_from(top_k.max(0)).unwrap_or(0),
            min_p: f.number("min_p", 0.0, 1.0)?.unwrap_or(0.0),
            presence_penalty: f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
            repetition_penalty: match f.number("repetition_penalty", 0.0, 100.0)? {
                Some(r) if r <= 0.0 => {
                    return Err(ApiError::bad_request(
                        "`repetition_penalty` must be greater than 0 (1.0 means none)",
                    )
                    .with_param("repetition_penalty"))
                }
                r => r.unwrap_or(1.0),
            },
            seed: f.seed("seed")?,
            max_tokens,
            stop,
            stop_token_ids: f.token_ids("stop_token_ids")?.unwrap_or_default(),
            ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
            n: usize::try_from(f.integer("n", 1, MAX_N)?.unwrap_or(1)).unwrap_or(1),
            logit_bias: f.logit_bias("logit_bias")?,
            grammar: parse_grammar(f)?,
            prompt_logprobs: None,
            plain_decoding: !f.bool("speculative_decoding")?.unwrap_or(true),
        })
    }
}

/// Streaming options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streaming {
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the token counts.
    pub include_usage: bool,
}

impl Streaming {
    fn parse(f: &Fields) -> Result<Self, ApiError> {
        let stream = f.bool("stream")?.unwrap_or(false);
        let include_usage = match f.object("stream_options")? {
            Some(o) => match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "`stream_options.include_usage` must be true or false",
                    )
                    .with_param("stream_options.include_usage"))
                }
            },
            None => false,
        };
        Ok(Self {
            stream,
            include_usage,
        })
    }
}
