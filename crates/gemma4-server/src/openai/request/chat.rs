//! `POST /v1/chat/completions`: messages (with their media parts), tools
//! and the tool choice, thinking controls, and the shared settings.

use serde_json::{Map, Value};

use super::{refuse_unsupported, Sampling, Streaming, MAX_TOP_LOGPROBS};
use crate::error::ApiError;
use crate::fields::Fields;

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Validated messages, passed to the chat template as given.
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`, e.g. `enable_thinking` (set from
    /// `reasoning_effort` when the kwargs do not say).
    pub template_kwargs: Map<String, Value>,
    pub tool_choice: ToolChoice,
    /// `parallel_tool_calls`: false allows at most one call.
    pub parallel_tool_calls: bool,
    /// `thinking_token_budget`: most tokens of thinking before the answer.
    pub thinking_token_budget: Option<usize>,
    pub sampling: Sampling,
    /// `Some(k)`: return each token's log-probability and `k` alternatives.
    pub logprobs: Option<usize>,
    pub streaming: Streaming,
    /// The `image_url`, `video_url` and `input_audio` parts of the
    /// messages, in the order the template renders them.
    pub media: Vec<MediaPart>,
    /// `mm_processor_kwargs.max_soft_tokens`: this request's soft-token
    /// budget per image (the server's default otherwise).
    pub max_soft_tokens: Option<usize>,
}

/// A media part of a message: what it is, its data, and the request field
/// to blame when it is bad.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaPart {
    pub kind: MediaKind,
    /// An image's or video's URL (a `data:` URI), or an audio clip's base64 data.
    pub data: String,
    pub param: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    /// `input_audio` (WAV, MP3 or FLAC, told apart by their bytes).
    Audio,
    /// `video_url` (an animated GIF, WebP or PNG).
    Video,
}

impl MediaKind {
    /// The word for one item, in errors and `usage`.
    pub fn noun(self) -> &'static str {
        match self {
            Self::Image => "image",
            Self::Audio => "audio",
            Self::Video => "video",
        }
    }
}

/// Whether the model may, must, or must not call tools.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// Calls are forbidden (the call marker can never be sampled).
    None,
    /// At least one call, enforced by a grammar over the tools' schemas.
    Required,
    /// Exactly one call of this function, enforced likewise.
    Named(String),
}

impl ToolChoice {
    /// `tool_choice`, and the names `allowed_tools` keeps (`None`: every tool).
    fn parse(f: &Fields) -> Result<(Self, Option<Vec<String>>), ApiError> {
        let bad = |msg: String| ApiError::bad_request(msg).with_param("tool_choice");
        let mut allowed = None;
        let choice = match f.get("tool_choice") {
            None => Self::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Self::Auto,
                "none" => Self::None,
                "required" => Self::Required,
                other => {
                    return Err(bad(format!(
                        "`tool_choice` is {other:?}; use \"auto\", \"none\", \"required\", {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} or {{\"type\": \"allowed_tools\", ...}}"
                    )))
                }
            },
            Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("allowed_tools") => {
                let (choice, names) = allowed_tools(o.get("allowed_tools"))?;
                allowed = Some(names);
                choice
            }
            Some(Value::Object(o)) => match o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                Some(name) => Self::Named(name.to_owned()),
                None => {
                    return Err(bad(
                        "`tool_choice.function.name` must name one of `tools` (or give `{\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\", \"tools\"}}`)".into(),
                    ))
                }
            },
            Some(_) => return Err(bad("`tool_choice` must be a string or an object".into())),
        };
        if matches!(choice, Self::Required | Self::Named(_))
            && f.array("tools")?.is_none_or(|t| t.is_empty())
        {
            return Err(bad(
                "`tool_choice` asks for a call but `tools` is empty".into()
            ));
        }
        Ok((choice, allowed))
    }
}

/// `tool_choice.allowed_tools`: `mode` `auto` or `required`, and the
/// function tools the turn may call.
fn allowed_tools(v: Option<&Value>) -> Result<(ToolChoice, Vec<String>), ApiError> {
    let at = "tool_choice.allowed_tools";
    let bad = |msg: String, param: &str| ApiError::bad_request(msg).with_param(param);
    let Some(Value::Object(o)) = v else {
        return Err(bad(
            format!("`{at}` must be an object with `mode` and `tools`"),
            at,
        ));
    };
    let choice = match o.get("mode").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("required") => ToolChoice::Required,
        _ => {
            return Err(bad(
                format!("`{at}.mode` must be \"auto\" or \"required\""),
                &format!("{at}.mode"),
            ))
        }
    };
    let Some(Value::Array(tools)) = o.get("tools") else {
        return Err(bad(
            format!("`{at}.tools` must be a list of tools"),
            &format!("{at}.tools"),
        ));
    };
    let names = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| {
                    bad(
                        format!("`{at}.tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                        &format!("{at}.tools[{i}]"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((choice, names))
}

/// `tools`: function tools only, each with a name; with `allowed_tools`,
/// only those it names are declared to the model.
fn parse_tools(f: &Fields, allowed: Option<&[String]>) -> Result<Option<Value>, ApiError> {
    let Some(tools) = f.array("tools")?.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    fn name_of((i, t): (usize, &Value)) -> Result<&str, ApiError> {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_request(format!(
                "`{at}` is not a function tool; this server calls function tools only"
            ))
            .with_param(format!("{at}.type")));
        }
        t.get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .ok_or_else(|| {
                ApiError::bad_request(format!("`{at}.function.name` must be a string"))
                    .with_param(format!("{at}.function.name"))
            })
    }
    let names = tools
        .iter()
        .enumerate()
        .map(name_of)
        .collect::<Result<Vec<_>, _>>()?;
    let Some(allowed) = allowed else {
        return Ok(Some(Value::Array(tools.clone())));
    };
    if let Some((i, missing)) = allowed
        .iter()
        .enumerate()
        .find(|(_, a)| !names.contains(&a.as_str()))
    {
        return Err(ApiError::bad_request(format!(
            "`tool_choice.allowed_tools.tools[{i}]` names `{missing}`, which is not in `tools`"
        ))
        .with_param(format!("tool_choice.allowed_tools.tools[{i}]")));
    }
    let kept = tools
        .iter()
        .zip(&names)
        .filter(|(_, n)| allowed.iter().any(|a| a == *n))
        .map(|(t, _)| t.clone())
        .collect();
    Ok(Some(Value::Array(kept)))
}

/// `reasoning_effort` as the template's `enable_thinking`.
fn thinking_from_effort(f: &Fields) -> Result<Option<bool>, ApiError> {
    match f.string("reasoning_effort")? {
        None => Ok(None),
        Some("none" | "minimal") => Ok(Some(false)),
        Some("low" | "medium" | "high") => Ok(Some(true)),
        Some(other) => Err(ApiError::bad_request(format!(
            "`reasoning_effort` is {other:?}; use \"none\", \"minimal\", \"low\", \"medium\" or \"high\""
        ))
        .with_param("reasoning_effort")),
    }
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        Self::from_fields(&Fields::parse(body)?)
    }

    /// A chat request from its fields.
    pub fn from_fields(f: &Fields) -> Result<Self, ApiError> {
        refuse_unsupported(f, "/v1/chat/completions")?;
        f.refuse(
            &["function_call", "prompt_logprobs"],
            "/v1/chat/completions",
        )?;
        if f.array("modalities")?
            .is_some_and(|m| m.iter().any(|x| x != "text"))
        {
            return Err(ApiError::bad_request(
                "`modalities` other than [\"text\"] are not supported by this server",
            )
            .with_param("modalities"));
        }
        let mut media = Vec::new();
        let messages = check_messages(f.get("messages"), &mut media)?;
        let max_soft_tokens = match f.object("mm_processor_kwargs")? {
            None => None,
            Some(kw) => match kw.get("max_soft_tokens") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().map(|n| n as usize).ok_or_else(|| {
                    ApiError::bad_request(
                        "`mm_processor_kwargs.max_soft_tokens` must be one of 70, 140, 280, 560, 1120",
                    )
                    .with_param("mm_processor_kwargs.max_soft_tokens")
                })?),
            },
        };
        let mut template_kwargs = f
            .object("chat_template_kwargs")?
            .cloned()
            .unwrap_or_default();
        if let Some(thinking) = thinking_from_effort(f)? {
            template_kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(thinking));
        }
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
        let (tool_choice, allowed) = ToolChoice::parse(f)?;
        let tools = parse_tools(f, allowed.as_deref())?;
        Ok(Self {
            model: f.string("model")?.map(str::to_owned),
            messages,
            tools,
            add_generation_prompt: f.bool("add_generation_prompt")?.unwrap_or(true),
            template_kwargs,
            tool_choice,
            parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
            thinking_token_budget: f
                .integer("thinking_token_budget", 0, i64::from(u32::MAX))?
                .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
            sampling: Sampling::parse(f, &["max_completion_tokens", "max_tokens"])?,
            logprobs,
            streaming: Streaming::parse(f)?,
            media,
            max_soft_tokens,
        })
    }
}

/// Checks `messages` and brings them into the shape chat templates expect:
/// a non-empty array of objects with a known role; content a string (an array
/// of text parts is joined into one, as templates that take strings need);
/// assistant `tool_calls` with `function.arguments` as an object (OpenAI
/// clients send a JSON string, which templates would print verbatim).
fn check_messages(v: Option<&Value>, media: &mut Vec<MediaPart>) -> Result<Value, ApiError> {
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
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(bad(
                format!("`{at}` must be an object with \"role\" and \"content\""),
                &at,
            ));
        };
        let mut obj = obj.clone();
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.clone(),
            _ => {
                return Err(bad(
                    format!("`{at}.role` must be a string, one of {}", ROLES.join(", ")),
                    &format!("{at}.role"),
                ))
            }
        };
        if !ROLES.contains(&role.as_str()) {
            return Err(bad(
                format!("`{at}.role` is {role:?}; use one of {}", ROLES.join(", ")),
                &format!("{at}.role"),
            ));
        }
        let content = match obj.get("content") {
            Some(Value::String(_)) => None,
            None | Some(Value::Null) if role == "assistant" => None,
            Some(Value::Array(parts)) => Some(content_parts(parts, &format!("{at}.content"), media)?),
            _ => {
                return Err(bad(
                    format!("`{at}.content` must be a string or an array of {{\"type\": \"text\", \"text\": ...}} parts"),
                    &format!("{at}.content"),
                ))
            }
        };
        if let Some(content) = content {
            obj.insert("content".into(), content);
        }
        if let Some(calls) = obj.get_mut("tool_calls").filter(|c| !c.is_null()) {
            check_tool_calls(calls, &format!("{at}.tool_calls"))?;
        }
        out.push(Value::Object(obj));
    }
    Ok(Value::Array(out))
}

/// A content array as the template takes it: text parts only are joined
/// into one string (templates that take strings need it); with media, the
/// parts stay a list, each `image_url` part becoming `{"type": "image"}`,
/// each `video_url` part `{"type": "video"}` and each `input_audio` part
/// `{"type": "audio"}` (as the reference processor hands them to the
/// template), their data recorded in order.
fn content_parts(parts: &[Value], at: &str, media: &mut Vec<MediaPart>) -> Result<Value, ApiError> {
    let kind = |p: &Value| p.get("type").and_then(Value::as_str).map(str::to_owned);
    if !parts.iter().any(|p| {
        matches!(
            kind(p).as_deref(),
            Some("image_url" | "video_url" | "input_audio")
        )
    }) {
        return join_text_parts(parts, at).map(Value::String);
    }
    let bad = |msg: String, param: String| Err(ApiError::bad_request(msg).with_param(param));
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match kind(part).as_deref() {
            Some(field @ ("image_url" | "video_url")) => {
                let url = match part.get(field) {
                    Some(Value::String(u)) => u.clone(),
                    Some(Value::Object(o)) => match o.get("url") {
                        Some(Value::String(u)) => u.clone(),
                        _ => {
                            return bad(
                                format!("`{here}.{field}.url` must be a string (a data: URI)"),
                                format!("{here}.{field}.url"),
                            )
                        }
                    },
                    _ => {
                        return bad(
                            format!("`{here}.{field}` must be an object with a \"url\""),
                            format!("{here}.{field}"),
                        )
                    }
                };
                let kind = if field == "image_url" {
                    MediaKind::Image
                } else {
                    MediaKind::Video
                };
                media.push(MediaPart {
                    kind,
                    data: url,
                    param: format!("{here}.{field}.url"),
                });
                out.push(serde_json::json!({"type": kind.noun()}));
            }
            Some("input_audio") => {
                let audio = part.get("input_audio");
                let data = audio.and_then(|a| a.get("data")).and_then(Value::as_str);
                let format = audio.and_then(|a| a.get("format")).and_then(Value::as_str);
                let Some(data) = data else {
                    return bad(
                        format!("`{here}.input_audio.data` must be a string (base64 audio)"),
                        format!("{here}.input_audio.data"),
                    );
                };
                if format.is_some_and(|f| !["wav", "mp3", "flac"].contains(&f)) {
                    return bad(
                        format!(
                            "`{here}.input_audio.format` is {:?}; this server decodes \"wav\", \"mp3\" and \"flac\"",
                            format.unwrap_or_default()
                        ),
                        format!("{here}.input_audio.format"),
                    );
                }
                media.push(MediaPart {
                    kind: MediaKind::Audio,
                    data: data.to_owned(),
                    param: format!("{here}.input_audio.data"),
                });
                out.push(serde_json::json!({"type": "audio"}));
            }
            _ => out.push(serde_json::json!({"type": "text", "text": text_part(part, &here)?})),
        }
    }
    Ok(Value::Array(out))
}

/// Text parts joined with newlines.
fn join_text_parts(parts: &[Value], at: &str) -> Result<String, ApiError> {
    let texts = parts
        .iter()
        .enumerate()
        .map(|(j, part)| text_part(part, &format!("{at}[{j}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(texts.join("\n"))
}

/// The text of a `{"type": "text"}` part; other kinds are refused, naming them.
fn text_part<'a>(part: &'a Value, here: &str) -> Result<&'a str, ApiError> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") => match part.get("text") {
            Some(Value::String(t)) => Ok(t.as_str()),
            _ => Err(
                ApiError::bad_request(format!("`{here}.text` must be a string")).with_param(here),
            ),
        },
        Some(other) => Err(ApiError::bad_request(format!(
            "`{here}` is a {other:?} part; this server accepts text, image_url, video_url and input_audio parts"
        ))
        .with_param(here)),
        None => Err(ApiError::bad_request(format!(
            "`{here}` needs a \"type\" (\"text\" or \"image_url\")"
        ))
        .with_param(here)),
    }
}

/// Each call needs `function.name`; `function.arguments` given as JSON text is
/// parsed into the object the template renders.
fn check_tool_calls(calls: &mut Value, at: &str) -> Result<(), ApiError> {
    let Some(list) = calls.as_array_mut() else {
        return Err(ApiError::bad_request(format!("`{at}` must be an array")).with_param(at));
    };
    for (j, call) in list.iter_mut().enumerate() {
        let here = format!("{at}[{j}].function");
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else {
            return Err(ApiError::bad_request(format!(
                "`{here}` must be an object with \"name\" and \"arguments\""
            ))
            .with_param(here));
        };
        if !function.get("name").is_some_and(Value::is_string) {
            return Err(
                ApiError::bad_request(format!("`{here}.name` must be a string"))
                    .with_param(format!("{here}.name")),
            );
        }
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(text)) if text.trim().is_empty() => Value::Object(Map::new()),
            Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| {
                ApiError::bad_request(format!(
                    "`{here}.arguments` is not valid JSON ({e}); send a JSON object or its text"
                ))
                .with_param(format!("{here}.arguments"))
            })?,
            Some(other) => other.clone(),
        };
        if !arguments.is_object() {
            return Err(
                ApiError::bad_request(format!("`{here}.arguments` must be a JSON object"))
                    .with_param(format!("{here}.arguments")),
            );
        }
        function.insert("arguments".into(), arguments);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::GrammarSpec;
    use crate::openai::CompletionRequest;

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
                "`messages[0].content[0].image_url.url` must be a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}"#,
                "`messages[0].content[0].input_audio.data` must be a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "ogg"}}]}]}"#,
                "decodes \"wav\", \"mp3\" and \"flac\"",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]}"#,
                "`messages[0].content[0].video_url.url` must be a string",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                   "mm_processor_kwargs": {"max_soft_tokens": "many"}}"#,
                "`mm_processor_kwargs.max_soft_tokens` must be one of",
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
    fn image_parts_stay_a_list_for_the_template_and_are_recorded_in_order() {
        let r = chat(
            r#"{"messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "image_url", "image_url": "data:image/png;base64,BBBB"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        )
        .expect("parses");
        assert_eq!(
            r.messages[0]["content"],
            serde_json::json!([{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}])
        );
        assert_eq!(r.messages[1]["content"], "a\nb");
        let urls: Vec<&str> = r.media.iter().map(|i| i.data.as_str()).collect();
        assert_eq!(
            urls,
            ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]
        );
        assert_eq!(r.media[1].param, "messages[0].content[2].image_url.url");
    }

    #[test]
    fn top_logprobs_needs_logprobs() {
        let e = chat(r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}"#)
            .expect_err("rejected");
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn text_parts_are_joined_and_string_arguments_become_objects() {
        let r = chat(
            r#"{"messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}]}"#,
        )
        .expect("valid");
        assert_eq!(r.messages[0]["content"], "a\nb");
        assert_eq!(
            r.messages[1]["tool_calls"][0]["function"]["arguments"],
            serde_json::json!({"city": "Paris"})
        );
        let e = chat(
            r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}"#,
        )
        .expect_err("rejected");
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].tool_calls[0].function.arguments")
        );
    }

    #[test]
    fn tool_round_trip_renders_through_the_checkpoint_template() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/text/templates/google-gemma-4-31B-it.jinja"
        );
        let template = gemma4_text::ChatTemplate::from_file(std::path::Path::new(path))
            .expect("the 31B template compiles")
            .with_special_tokens(Some("<bos>".into()), Some("<eos>".into()));
        let r = chat(
            r#"{"messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}],
                "tools": [{"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#,
        )
        .expect("valid");
        let text = template
            .render(
                &r.messages,
                r.tools.as_ref(),
                r.add_generation_prompt,
                &r.template_kwargs,
            )
            .expect("renders");
        assert!(
            text.contains("<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"),
            "{text}"
        );
        assert!(
            text.contains("<|tool_response>response:get_weather{"),
            "{text}"
        );
    }

    #[test]
    fn reasoning_effort_sets_enable_thinking_unless_given() {
        let r =
            chat(r#"{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"}"#)
                .expect("valid");
        assert_eq!(r.template_kwargs["enable_thinking"], true);
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none",
                "chat_template_kwargs": {"enable_thinking": true}}"#,
        )
        .expect("valid");
        assert_eq!(r.template_kwargs["enable_thinking"], true);
        assert!(chat(
            r#"{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}"#
        )
        .is_err());
    }

    #[test]
    fn tool_choice_and_unsupported_fields() {
        let base = r#""messages": [{"role": "user", "content": "x"}]"#;
        let r = chat(&format!(
            r#"{{{base}, "tool_choice": "none", "thinking_token_budget": 12,
            "logit_bias": {{"5": -100, "7": 2.5}}}}"#
        ))
        .expect("valid");
        assert_eq!(r.tool_choice, ToolChoice::None);
        assert_eq!(r.thinking_token_budget, Some(12));
        assert_eq!(r.sampling.logit_bias, vec![(5, -100.0), (7, 2.5)]);
        for (field, value) in [
            ("tool_choice", r#""required""#),
            (
                "tool_choice",
                r#"{"type": "function", "function": {"name": "f"}}"#,
            ),
            ("guided_json", "5"),
            ("guided_choice", "[]"),
            ("guided_decoding_backend", r#""xgrammar""#),
            ("logit_bias", r#"{"x": 1}"#),
            ("logit_bias", r#"{"1": 500}"#),
        ] {
            let e = chat(&format!(r#"{{{base}, "{field}": {value}}}"#)).expect_err("rejected");
            assert_eq!(e.param.as_deref(), Some(field), "{field}: {}", e.message);
        }
        for (field, value) in [("tools", "[]"), ("structured_outputs", "{}")] {
            let e = CompletionRequest::parse(
                format!(r#"{{"prompt": "a", "{field}": {value}}}"#).as_bytes(),
            )
            .expect_err("rejected");
            assert_eq!(e.param.as_deref(), Some(field));
        }
    }

    #[test]
    fn structured_output_fields() {
        let base = r#""messages": [{"role": "user", "content": "x"}]"#;
        let grammar =
            |extra: &str| chat(&format!("{{{base}, {extra}}}")).map(|r| r.sampling.grammar);
        assert_eq!(
            grammar(r#""response_format": {"type": "json_object"}"#)
                .ok()
                .flatten(),
            Some((
                GrammarSpec::JsonSchema(serde_json::json!({"type": "object"})),
                "response_format"
            ))
        );
        assert_eq!(
            grammar(r#""response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": {"type": "integer"}}}"#)
                .ok()
                .flatten(),
            Some((GrammarSpec::JsonSchema(serde_json::json!({"type": "integer"})), "response_format"))
        );
        assert_eq!(
            grammar(r#""guided_choice": ["a", "b"]"#)
                .ok()
                .flatten()
                .map(|g| g.1),
            Some("guided_choice")
        );
        assert_eq!(
            grammar(r#""guided_json": "{\"type\": \"object\"}""#)
                .ok()
                .flatten()
                .map(|g| g.1),
            Some("guided_json")
        );
        assert!(grammar(r#""guided_regex": "a+", "guided_grammar": "start: \"a\"""#).is_err());
        assert!(grammar(r#""response_format": {"type": "json_schema"}"#).is_err());
        assert!(grammar(r#""response_format": {"type": "yaml"}"#).is_err());
        let r = CompletionRequest::parse(br#"{"prompt": "a", "guided_regex": "[0-9]+"}"#)
            .expect("completions enforce grammars too");
        assert_eq!(
            r.sampling.grammar,
            Some((GrammarSpec::Regex("[0-9]+".into()), "guided_regex"))
        );
    }
}
