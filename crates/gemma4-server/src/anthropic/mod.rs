//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`. A request is restated as a chat
//! request's fields and served by the chat path (one front, one detokenizer,
//! one parser); the reply is [`fold::MessageFold`] over the turn's events.
//! Errors take Anthropic's shape, `{"type": "error", "error": {"type",
//! "message"}}`, and name the fields the client sent.

mod fold;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::error::{rename_field, ApiError};
use crate::fields::Fields;
use crate::front;
use crate::openai::ChatRequest;
use crate::routes::submit_chat;
use crate::server::AppState;
use crate::turn::Turn;
use fold::MessageFold;

/// Messages fields this server does not implement.
const UNSUPPORTED: [&str; 3] = ["container", "mcp_servers", "context_management"];

/// Thinking budgets for `output_config.effort` (`max`: none).
const EFFORT_BUDGETS: [(&str, Option<u64>); 4] = [
    ("low", Some(1024)),
    ("medium", Some(4096)),
    ("high", Some(16384)),
    ("max", None),
];

/// An error in Anthropic's shape.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// The error object, as a reply body and as a stream's `error` event.
pub(crate) fn error_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}})
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let mut response = (self.0.status, Json(error_body(&self.0))).into_response();
        if let Some(secs) = self.0.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// A Messages request body as the chat request it is served as; errors
/// name the Messages fields.
pub fn chat_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    Ok(chat_request_of(&Fields::parse(body)?)?.0)
}

/// The chat request, and the renaming its later errors need.
fn chat_request_of(f: &Fields) -> Result<(ChatRequest, Renamer), ApiError> {
    let (chat, origins) = chat_fields(f)?;
    let renamer = Renamer(origins);
    let req = ChatRequest::from_fields(&chat).map_err(|e| renamer.rename(e))?;
    Ok((req, renamer))
}

/// Names the chat path's errors by the Messages fields they came from.
struct Renamer(Vec<Option<usize>>);

impl Renamer {
    fn rename(&self, e: ApiError) -> ApiError {
        e.renamed(|name| anthropic_name(name, &self.0))
    }
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Response, AnthropicError> {
    let admitted = state.admit_body(body).await?;
    let f = Fields::parse(&admitted.bytes)?;
    if f.integer("max_tokens", 1, i64::MAX)?.is_none() {
        return Err(bad(
            "`max_tokens` is required: the most tokens to generate",
            "max_tokens",
        )
        .into());
    }
    let (req, renamer) = chat_request_of(&f)?;
    let streamed = req.streaming.stream;
    let submitted = submit_chat(&state, &admitted.model, req, admitted.arrival)
        .await
        .map_err(|e| renamer.rename(e))?;
    let fold = MessageFold::new(state.response_id("msg"), submitted.served);
    let turn = Turn::new(fold, submitted.generation, state, admitted.guard);
    if streamed {
        return Ok(turn.stream());
    }
    Ok(Json(turn.whole().await?).into_response())
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as the same
/// request would run it.
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<Value>, AnthropicError> {
    let admitted = state.admit_body(body).await?;
    let f = Fields::parse(&admitted.bytes)?;
    let (req, renamer) = chat_request_of(&f)?;
    let job = front::chat_job(&state, &admitted.model, req, admitted.arrival)
        .await
        .map_err(|e| renamer.rename(e))?;
    let tokens = job.prompts.first().map_or(0, Vec::len);
    Ok(Json(json!({ "input_tokens": tokens })))
}

/// The chat request equivalent to a Messages request, and for each chat
/// message the Messages message it came from (`None`: `system`).
fn chat_fields(f: &Fields) -> Result<(Fields, Vec<Option<usize>>), ApiError> {
    f.refuse(&UNSUPPORTED, "/v1/messages")?;
    if f.get("thread").is_some() {
        return Err(bad(
            "`thread` (conversations kept by the server) is not supported: send the whole conversation \
             in `messages` (the SDK's tool runner does with `thread=False`)",
            "thread",
        ));
    }
    let mut body = Map::new();
    let (messages, origins) = chat_messages(f)?;
    body.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = f.array("tools")?.filter(|t| !t.is_empty()) {
        body.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = f.object("tool_choice")? {
        let (choice, parallel) = chat_tool_choice(choice)?;
        body.insert("tool_choice".into(), choice);
        if !parallel {
            body.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    let (thinking, budget) = thinking(f)?;
    if let Some(on) = thinking {
        body.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": on}),
        );
    }
    if let Some(budget) = budget {
        body.insert("thinking_token_budget".into(), json!(budget));
    }
    if let Some(format) = f.object("output_config")?.and_then(|o| o.get("format")) {
        body.insert("response_format".into(), output_format(format)?);
    }
    if let Some(stops) = f.get("stop_sequences") {
        body.insert("stop".into(), stops.clone());
    }
    for key in [
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "speculative_decoding",
    ] {
        if let Some(v) = f.get(key) {
            body.insert(key.into(), v.clone());
        }
    }
    Ok((Fields::from_object(body), origins))
}

/// `system` and `messages` as chat messages.
fn chat_messages(f: &Fields) -> Result<(Vec<Value>, Vec<Option<usize>>), ApiError> {
    let mut out = Vec::new();
    let mut origins = Vec::new();
    if let Some(system) = f.get("system") {
        let text = match system {
            Value::String(s) => s.clone(),
            Value::Array(blocks) => text_of(blocks, "system")?,
            _ => return Err(bad("`system` must be a string or text blocks", "system")),
        };
        out.push(json!({"role": "system", "content": text}));
        origins.push(None);
    }
    let messages = match f.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(bad(
                "`messages` is empty; send at least one message",
                "messages",
            ))
        }
        _ => {
            return Err(bad(
                "`messages` is required: a list of {\"role\", \"content\"} objects",
                "messages",
            ))
        }
    };
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(bad(
                    format!("`{at}.role` must be \"user\" or \"assistant\""),
                    &format!("{at}.role"),
                ))
            }
        };
        let turn = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"role": role, "content": s})],
            Some(Value::Array(blocks)) => blocks_as_chat(role, blocks, &at)?,
            _ => {
                return Err(bad(
                    format!("`{at}.content` must be a string or a list of content blocks"),
                    &format!("{at}.content"),
                ))
            }
        };
        origins.extend(std::iter::repeat_n(Some(i), turn.len()));
        out.extend(turn);
    }
    Ok((out, origins))
}

/// The text of text blocks (`system`, a tool result's content), joined.
fn text_of(blocks: &[Value], at: &str) -> Result<String, ApiError> {
    let texts = blocks
        .iter()
        .enumerate()
        .map(
            |(j, b)| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                _ => Err(bad(
                    format!(
                        "`{at}[{j}]` must be a text block {{\"type\": \"text\", \"text\": ...}}"
                    ),
                    &format!("{at}[{j}]"),
                )),
            },
        )
        .collect::<Result<Vec<_>, _>>()?;
    Ok(texts.join("\n"))
}

/// One message's content blocks as chat messages: a `tool` message per
/// `tool_result` (they answer the calls before them, so they come first),
/// then the message itself with its text and image parts and, for the
/// assistant, its `tool_use` blocks as tool calls. Earlier thinking is
/// dropped, as the chat template drops it.
fn blocks_as_chat(role: &str, blocks: &[Value], at: &str) -> Result<Vec<Value>, ApiError> {
    let (mut parts, mut calls, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let here = format!("{at}.content[{j}]");
        let string = |key: &str| match b.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(bad(
                format!("`{here}.{key}` must be a string"),
                &format!("{here}.{key}"),
            )),
        };
        match (b.get("type").and_then(Value::as_str), role) {
            (Some("text"), _) => parts.push(json!({"type": "text", "text": string("text")?})),
            (Some("image"), "user") => {
                let url = image_url(b.get("source"), &format!("{here}.source"))?;
                parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
            }
            (Some("tool_use"), "assistant") => {
                let input = match b.get("input") {
                    None | Some(Value::Null) => json!({}),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => {
                        return Err(bad(
                            format!("`{here}.input` must be an object"),
                            &format!("{here}.input"),
                        ))
                    }
                };
                calls.push(json!({"id": string("id")?, "type": "function",
                    "function": {"name": string("name")?, "arguments": input}}));
            }
            (Some("tool_result"), "user") => {
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(inner)) => text_of(inner, &format!("{here}.content"))?,
                    Some(_) => {
                        return Err(bad(
                            format!("`{here}.content` must be a string or text blocks"),
                            &format!("{here}.content"),
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": string("tool_use_id")?, "content": content}));
            }
            (Some("thinking" | "redacted_thinking"), "assistant") => {}
            (Some(other), _) => {
                return Err(bad(
                    format!(
                        "`{here}` is a {other:?} block in a {role} message; this server reads text, image (user), \
                         tool_use (assistant), tool_result (user) and thinking (assistant) blocks"
                    ),
                    &here,
                ))
            }
            (None, _) => return Err(bad(format!("`{here}` needs a \"type\""), &here)),
        }
    }
    if !parts.is_empty() || !calls.is_empty() || out.is_empty() {
        let content = if parts.is_empty() {
            Value::Null
        } else {
            Value::Array(parts)
        };
        let mut message = json!({"role": role, "content": content});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        } else if message["content"].is_null() {
            message["content"] = json!("");
        }
        out.push(message);
    }
    Ok(out)
}

/// An image block's `source` as a URL: base64 data as a `data:` URI, or a URL.
fn image_url(source: Option<&Value>, at: &str) -> Result<String, ApiError> {
    let field = |key: &str| source.and_then(|s| s.get(key)).and_then(Value::as_str);
    match field("type") {
        Some("base64") => match (field("media_type"), field("data")) {
            (Some(media), Some(data)) => Ok(format!("data:{media};base64,{data}")),
            _ => Err(bad(
                format!("`{at}` needs `media_type` and `data` (base64)"),
                at,
            )),
        },
        Some("url") => field("url")
            .map(str::to_owned)
            .ok_or_else(|| bad(format!("`{at}.url` must be a string"), at)),
        _ => Err(bad(
            format!("`{at}` must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or {{\"type\": \"url\", \"url\"}}"),
            at,
        )),
    }
}

/// Client tools (`name`, `description`, `input_schema`) as chat function tools.
fn chat_tools(tools: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        if let Some(kind) = tool
            .get("type")
            .and_then(Value::as_str)
            .filter(|k| *k != "custom")
        {
            return Err(bad(
                format!("`{at}` is a {kind:?} tool; this server calls client tools (`name`, `input_schema`)"),
                &format!("{at}.type"),
            ));
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(bad(
                format!("`{at}.name` must be a string"),
                &format!("{at}.name"),
            ));
        };
        let Some(schema) = tool.get("input_schema").filter(|s| s.is_object()) else {
            return Err(bad(
                format!("`{at}.input_schema` must be a JSON Schema object"),
                &format!("{at}.input_schema"),
            ));
        };
        let mut function = json!({"name": name, "parameters": schema});
        if let Some(description) = tool.get("description") {
            function["description"] = description.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` in chat's spelling, and whether parallel calls are allowed.
fn chat_tool_choice(choice: &Map<String, Value>) -> Result<(Value, bool), ApiError> {
    let parallel = choice.get("disable_parallel_tool_use") != Some(&Value::Bool(true));
    let chat = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match choice.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                return Err(bad(
                    "`tool_choice.name` must name a tool",
                    "tool_choice.name",
                ))
            }
        },
        _ => {
            return Err(bad(
                "`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\"",
                "tool_choice.type",
            ))
        }
    };
    Ok((chat, parallel))
}

/// `thinking` and `output_config.effort`: whether the template lets the
/// model think, and its thinking budget.
fn thinking(f: &Fields) -> Result<(Option<bool>, Option<u64>), ApiError> {
    let (mut on, mut budget) = match f.object("thinking")? {
        None => (None, None),
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => match t.get("budget_tokens").and_then(Value::as_u64) {
                Some(b) if b >= 1 => (Some(true), Some(b)),
                _ => {
                    return Err(bad(
                        "`thinking.budget_tokens` must be a whole number of at least 1",
                        "thinking.budget_tokens",
                    ))
                }
            },
            Some("adaptive") => (Some(true), None),
            Some("disabled") => (Some(false), None),
            _ => {
                return Err(bad(
                    "`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\"",
                    "thinking.type",
                ))
            }
        },
    };
    let effort = f.object("output_config")?.and_then(|o| o.get("effort"));
    if let Some(effort) = effort {
        let Some((_, effort_budget)) = EFFORT_BUDGETS
            .iter()
            .find(|(e, _)| effort.as_str() == Some(*e))
        else {
            return Err(bad(
                "`output_config.effort` must be \"low\", \"medium\", \"high\" or \"max\"",
                "output_config.effort",
            ));
        };
        if on != Some(false) {
            on = Some(true);
            budget = budget.or(*effort_budget);
        }
    }
    Ok((on, budget))
}

/// `output_config.format` as chat's `response_format`.
fn output_format(format: &Value) -> Result<Value, ApiError> {
    match (
        format.get("type").and_then(Value::as_str),
        format.get("schema"),
    ) {
        (Some("json_schema"), Some(schema)) => Ok(json!({"type": "json_schema",
            "json_schema": {"name": "output", "schema": schema}})),
        _ => Err(bad(
            "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": ...}",
            "output_config.format",
        )),
    }
}

/// The Messages name of a chat field (unchanged when it has none).
fn anthropic_name(name: &str, origins: &[Option<usize>]) -> String {
    if let Some(rest) = name.strip_prefix("messages[") {
        if let Some((index, rest)) = rest.split_once(']') {
            match index.parse::<usize>().ok().and_then(|i| origins.get(i)) {
                Some(Some(k)) => {
                    let rest = rest.replace(".image_url.url", ".source");
                    return format!("messages[{k}]{rest}");
                }
                Some(None) => return "system".into(),
                None => {}
            }
        }
    }
    if let Some(rest) = name.strip_prefix("tools[") {
        if let Some((i, rest)) = rest.split_once(']') {
            let rest = rest.replace(".function.parameters", ".input_schema");
            return format!(
                "tools[{i}]{}",
                rest.strip_prefix(".function").unwrap_or(&rest)
            );
        }
    }
    let settings = [
        ("stop", "stop_sequences"),
        ("response_format", "output_config.format"),
        ("thinking_token_budget", "thinking.budget_tokens"),
        ("tool_choice.function.name", "tool_choice.name"),
    ];
    rename_field(name, &settings).unwrap_or_else(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: Value) -> Fields {
        Fields::from_object(v.as_object().cloned().expect("object"))
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_messages() {
        let f = fields(json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 256},
            "stop_sequences": ["END"]
        }));
        let (chat, origins) = chat_fields(&f).expect("valid");
        let messages = chat.get("messages").expect("messages");
        assert_eq!(
            messages[0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            messages[2]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(
            messages[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "21 C"})
        );
        assert_eq!(messages[4]["content"][0]["text"], "And tomorrow?");
        assert_eq!(origins, [None, Some(0), Some(1), Some(2), Some(2)]);
        assert_eq!(chat.get("tool_choice"), Some(&json!("required")));
        assert_eq!(chat.get("parallel_tool_calls"), Some(&json!(false)));
        assert_eq!(chat.get("thinking_token_budget"), Some(&json!(256)));
        assert_eq!(chat.get("stop"), Some(&json!(["END"])));
        assert_eq!(
            chat.get("tools").expect("tools")[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        ChatRequest::from_fields(&chat).expect("a valid chat request");
    }

    #[test]
    fn errors_name_the_messages_fields() {
        let origins = [None, Some(0), Some(1), Some(1)];
        assert_eq!(
            anthropic_name("messages[3].content", &origins),
            "messages[1].content"
        );
        assert_eq!(anthropic_name("messages[0].content", &origins), "system");
        assert_eq!(
            anthropic_name("tools[2].function.parameters", &origins),
            "tools[2].input_schema"
        );
        assert_eq!(anthropic_name("stop", &origins), "stop_sequences");
        assert_eq!(anthropic_name("stream", &origins), "stream");
        for (body, param) in [
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]}),
                "tools[0].type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}),
                "thinking.budget_tokens",
            ),
        ] {
            let e = chat_fields(&fields(body.clone())).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(error_body(&e)["error"]["type"], "invalid_request_error");
        }
    }
}
