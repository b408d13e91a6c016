//! Request bodies of the OpenAI-compatible routes (and `/generate`), read
//! field by field so that every mistake is a 400 naming its field.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::fields::{token_id_list, Fields};

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
}

impl Sampling {
    /// Reads the sampling fields; `max_token_fields` are the names accepted
    /// for the output length, the first present one wins.
    fn parse(f: &Fields, max_token_fields: &[&str]) -> Result<Self, ApiError> {
        let mut max_tokens = None;
        for name in max_token_fields {
            if let Some(m) = f.integer(name, 1, i64::MAX)? {
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
                Some(p) if p <= 0.0 => {
                    return Err(ApiError::bad_request(
                        "`top_p` must be greater than 0 and at most 1",
                    )
                    .with_param("top_p"))
                }
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

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Validated messages, passed to the chat template as given.
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`, e.g. `enable_thinking`.
    pub template_kwargs: Map<String, Value>,
    pub sampling: Sampling,
    /// `Some(k)`: return each token's log-probability and `k` alternatives.
    pub logprobs: Option<usize>,
    pub streaming: Streaming,
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let f = Fields::parse(body)?;
        let messages = check_messages(f.get("messages"))?;
        let logprobs = match (
            f.bool("logprobs")?.unwrap_or(false),
            f.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)?,
        ) {
            (true, k) => Some(usize::try_from(k.unwrap_or(0)).unwrap_or(0)),
            (false, Some(k)) if k > 0 => {
                return Err(
                    ApiError::bad_request("`top_logprobs` needs `logprobs: true`")
                        .with_param("top_logprobs"),
                )
            }
            (false, _) => None,
        };
        check_response_format(&f)?;
        let tools = f
            .array("tools")?
            .filter(|t| !t.is_empty())
            .map(|t| Value::Array(t.clone()));
        Ok(Self {
            model: f.string("model")?.map(str::to_owned),
            messages,
            tools,
            add_generation_prompt: f.bool("add_generation_prompt")?.unwrap_or(true),
            template_kwargs: f
                .object("chat_template_kwargs")?
                .cloned()
                .unwrap_or_default(),
            sampling: Sampling::parse(&f, &["max_completion_tokens", "max_tokens"])?,
            logprobs,
            streaming: Streaming::parse(&f)?,
        })
    }
}

/// Checks the shape of `messages`: a non-empty array of objects with a known
/// role and text content (a string, or an array of `{"type": "text"}` parts).
fn check_messages(v: Option<&Value>) -> Result<Value, ApiError> {
    let bad = |msg: String, param: &str| ApiError::bad_request(msg).with_param(param);
    let Some(v) = v else {
        return Err(bad(
            "`messages` is required: a list of {\"role\", \"content\"} objects".into(),
            "messages",
        ));
    };
    let Some(list) = v.as_array() else {
        return Err(bad(
            "`messages` must be an array of {\"role\", \"content\"} objects".into(),
            "messages",
        ));
    };
    if list.is_empty() {
        return Err(bad(
            "`messages` is empty; send at least one message".into(),
            "messages",
        ));
    }
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(bad(
                format!("`{at}` must be an object with \"role\" and \"content\""),
                &at,
            ));
        };
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => {
                return Err(bad(
                    format!("`{at}.role` must be a string, one of {}", ROLES.join(", ")),
                    &format!("{at}.role"),
                ))
            }
        };
        if !ROLES.contains(&role) {
            return Err(bad(
                format!("`{at}.role` is {role:?}; use one of {}", ROLES.join(", ")),
                &format!("{at}.role"),
            ));
        }
        match obj.get("content") {
            Some(Value::String(_)) => {}
            None | Some(Value::Null) if role == "assistant" => {}
            Some(Value::Array(parts)) => check_parts(parts, &format!("{at}.content"))?,
            _ => {
                return Err(bad(
                    format!("`{at}.content` must be a string or an array of {{\"type\": \"text\", \"text\": ...}} parts"),
                    &format!("{at}.content"),
                ))
            }
        }
    }
    Ok(v.clone())
}

fn check_parts(parts: &[Value], at: &str) -> Result<(), ApiError> {
    for (j, part) in parts.iter().enumerate() {
        let here = format!("{at}[{j}]");
        let kind = part.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => {
                if !part.get("text").is_some_and(Value::is_string) {
                    return Err(
                        ApiError::bad_request(format!("`{here}.text` must be a string"))
                            .with_param(here),
                    );
                }
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "`{here}` is a {other:?} part; this server accepts text parts only"
                ))
                .with_param(here))
            }
            None => {
                return Err(
                    ApiError::bad_request(format!("`{here}` needs a \"type\" (\"text\")"))
                        .with_param(here),
                )
            }
        }
    }
    Ok(())
}

/// Structured output is not enforced yet: refuse rather than ignore it.
fn check_response_format(f: &Fields) -> Result<(), ApiError> {
    let Some(rf) = f.object("response_format")? else {
        return Ok(());
    };
    match rf.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(()),
        Some(other) => Err(ApiError::bad_request(format!(
            "`response_format` {other:?} is not supported by this server; remove it or use {{\"type\": \"text\"}}"
        ))
        .with_param("response_format")),
    }
}

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
    pub streaming: Streaming,
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let f = Fields::parse(body)?;
        let prompts = parse_prompts(f.get("prompt"))?;
        if f.bool("echo")?.unwrap_or(false) {
            return Err(ApiError::bad_request(
                "`echo` is not supported by this server; send it as false",
            )
            .with_param("echo"));
        }
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
        Ok(Self {
            model: f.string("model")?.map(str::to_owned),
            prompts,
            sampling: Sampling::parse(&f, &["max_tokens"])?,
            logprobs,
            streaming: Streaming::parse(&f)?,
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
    pub prompt: Prompt,
    pub sampling: Sampling,
}

impl GenerateRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let f = Fields::parse(body)?;
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
        Ok(Self { prompt, sampling })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(body.as_bytes())
    }

    #[test]
    fn chat_defaults_follow_openai() {
        let r = chat(r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#)
            .expect("valid");
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_eq!(r.sampling.n, 1);
        assert_eq!(r.sampling.max_tokens, None);
        assert!(!r.streaming.stream);
        assert!(r.add_generation_prompt);
    }

    #[test]
    fn chat_reads_every_field() {
        let r = chat(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 7, "max_tokens": 9, "temperature": 0, "top_p": 0.5,
                "top_k": 40, "min_p": 0.1, "seed": -1, "stop": "END", "n": 3,
                "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                "logprobs": true, "top_logprobs": 2, "stream": true,
                "stream_options": {"include_usage": true}, "user": "u",
                "chat_template_kwargs": {"enable_thinking": true}, "unknown_extra": [1]}"#,
        )
        .expect("valid");
        let s = &r.sampling;
        assert_eq!(s.max_tokens, Some(7));
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p),
            (0.0, 0.5, 40, 0.1)
        );
        assert_eq!(s.seed, Some(u64::MAX));
        assert_eq!(s.stop, vec!["END".to_string()]);
        assert_eq!(s.n, 3);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(
            r.streaming,
            Streaming {
                stream: true,
                include_usage: true
            }
        );
        assert_eq!(
            r.template_kwargs.get("enable_thinking"),
            Some(&Value::Bool(true))
        );
    }

    #[test]
    fn bad_messages_are_named() {
        let cases = [
            (r#"{}"#, "`messages` is required"),
            (r#"{"messages": []}"#, "`messages` is empty"),
            (r#"{"messages": "hi"}"#, "`messages` must be an array"),
            (
                r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
                "`messages[0].role` is \"wizard\"",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "`messages[0].content` must be a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
                "text parts only",
            ),
        ];
        for (body, expected) in cases {
            let e = chat(body)
                .err()
                .unwrap_or_else(|| panic!("{body} must be rejected"));
            assert!(e.message.contains(expected), "{body}: {}", e.message);
            assert_eq!(e.status.as_u16(), 400);
        }
    }

    #[test]
    fn top_logprobs_needs_logprobs() {
        let e = chat(r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}"#)
            .expect_err("rejected");
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn structured_output_is_refused_not_ignored() {
        let e = chat(r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}"#)
            .expect_err("rejected");
        assert_eq!(e.param.as_deref(), Some("response_format"));
    }

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
