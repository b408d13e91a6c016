//! `POST /v1/completions` and `/generate`: prompts as text or token ids,
//! `echo` and prompt log-probabilities, and the shared settings.

use serde_json::Value;

use super::{refuse_unsupported, Sampling, Streaming, MAX_TOP_LOGPROBS};
use crate::error::ApiError;
use crate::fields::{token_id_list, Fields};

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// One or more prompts; choice `i` of prompt `p` has index `p * n + i`.
    pub prompts: Vec<Prompt>,
    pub sampling: Sampling,
    pub logprobs: Option<usize>,
    /// The reply starts with the prompt (`echo`).
    pub echo: bool,
    /// vLLM's `prompt_logprobs` was asked for (listed per choice).
    pub list_prompt_logprobs: bool,
    pub streaming: Streaming,
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        Self::from_fields(&Fields::parse(body)?)
    }

    /// A completions request from its fields (another front's, restated).
    pub fn from_fields(f: &Fields) -> Result<Self, ApiError> {
        refuse_unsupported(f, "/v1/completions")?;
        f.refuse(
            &[
                "response_format",
                "tools",
                "tool_choice",
                "thinking_token_budget",
            ],
            "/v1/completions",
        )?;
        // `prompt` is required and nullable: null is the empty prompt, the
        // start of a document.
        let empty = Value::String(String::new());
        let prompt = match f.get("prompt") {
            None if f.names("prompt") => Some(&empty),
            given => given,
        };
        let prompts = parse_prompts(prompt)?;
        if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(
                ApiError::bad_request("`suffix` is not supported by this server")
                    .with_param("suffix"),
            );
        }
        let logprobs = match f.get("logprobs") {
            // Some clients send a boolean here; false means none.
            Some(Value::Bool(false)) => None,
            _ => f
                .integer("logprobs", 0, MAX_TOP_LOGPROBS)?
                .map(|k| usize::try_from(k).unwrap_or(0)),
        };
        let echo = f.bool("echo")?.unwrap_or(false);
        let listed = f
            .integer("prompt_logprobs", 0, MAX_TOP_LOGPROBS)?
            .map(|k| usize::try_from(k).unwrap_or(0));
        let mut sampling = Sampling::parse(f, &["max_tokens"])?;
        // Both ask for the same scores; the larger count of alternatives serves both.
        sampling.prompt_logprobs = logprobs.filter(|_| echo).max(listed);
        Ok(Self {
            model: f.string("model")?.map(str::to_owned),
            prompts,
            sampling,
            logprobs,
            echo,
            list_prompt_logprobs: listed.is_some(),
            streaming: Streaming::parse(f)?,
        })
    }
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of those.
fn parse_prompts(v: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "`prompt` must be a string, an array of strings, an array of token ids, or an array of token-id arrays",
        )
        .with_param("prompt")
    };
    let Some(v) = v else {
        return Err(ApiError::bad_request("`prompt` is required").with_param("prompt"));
    };
    let prompts = match v {
        Value::String(s) => vec![Prompt::Text(s.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::bad_request("`prompt` is an empty array").with_param("prompt"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            vec![Prompt::Ids(token_id_list(v).ok_or_else(bad)?)]
        }
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(_) => token_id_list(item).map(Prompt::Ids).ok_or_else(bad),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    Ok(prompts)
}

/// `POST /generate`: one prompt, one answer.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The served model or one of its LoRA adapters.
    pub model: Option<String>,
    pub prompt: Prompt,
    pub sampling: Sampling,
}

impl GenerateRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let f = Fields::parse(body)?;
        refuse_unsupported(&f, "/generate")?;
        f.refuse(&["tools", "tool_choice"], "/generate")?;
        let prompt = match f.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(v @ Value::Array(_)) => Prompt::Ids(token_id_list(v).ok_or_else(|| {
                ApiError::bad_request("`prompt` must be a string or an array of token ids")
                    .with_param("prompt")
            })?),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "`prompt` must be a string or an array of token ids",
                )
                .with_param("prompt"))
            }
            None => return Err(ApiError::bad_request("`prompt` is required").with_param("prompt")),
        };
        if f.bool("stream")?.unwrap_or(false) {
            return Err(ApiError::bad_request(
                "/generate does not stream; use /v1/completions with \"stream\": true",
            )
            .with_param("stream"));
        }
        let sampling = Sampling::parse(&f, &["max_tokens"])?;
        if sampling.n != 1 {
            return Err(ApiError::bad_request(
                "/generate returns one answer; use /v1/completions for n > 1",
            )
            .with_param("n"));
        }
        Ok(Self {
            model: f.string("model")?.map(str::to_owned),
            prompt,
            sampling,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_prompt_forms() {
        let p = |body: &str| CompletionRequest::parse(body.as_bytes()).map(|r| r.prompts);
        assert_eq!(
            p(r#"{"prompt": "a"}"#).ok(),
            Some(vec![Prompt::Text("a".into())])
        );
        assert_eq!(
            p(r#"{"prompt": ["a", "b"]}"#).ok().map(|v| v.len()),
            Some(2)
        );
        assert_eq!(
            p(r#"{"prompt": [2, 5]}"#).ok(),
            Some(vec![Prompt::Ids(vec![2, 5])])
        );
        assert_eq!(
            p(r#"{"prompt": [[2], [3, 4]]}"#).ok().map(|v| v.len()),
            Some(2)
        );
        assert!(p(r#"{"prompt": []}"#).is_err());
        assert!(p(r#"{"prompt": [-1]}"#).is_err());
        assert!(p(r#"{"prompt": {"x": 1}}"#).is_err());
        assert!(p(r#"{}"#).is_err());
        let empty = Some(vec![Prompt::Text(String::new())]);
        assert_eq!(p(r#"{"prompt": null}"#).ok(), empty);
        assert_eq!(p(r#"{"prompt": ""}"#).ok(), empty);
    }

    #[test]
    fn completion_logprobs_is_an_integer() {
        let r = CompletionRequest::parse(br#"{"prompt": "a", "logprobs": 3}"#).expect("valid");
        assert_eq!(r.logprobs, Some(3));
        assert!(CompletionRequest::parse(br#"{"prompt": "a", "logprobs": 99}"#).is_err());
    }

    #[test]
    fn generate_request() {
        let r = GenerateRequest::parse(br#"{"prompt": "hi", "max_tokens": 4, "temperature": 0}"#)
            .expect("valid");
        assert_eq!(r.sampling.max_tokens, Some(4));
        assert!(GenerateRequest::parse(br#"{"prompt": "hi", "stream": true}"#).is_err());
        assert!(GenerateRequest::parse(br#"{"max_tokens": 4}"#).is_err());
    }
}
