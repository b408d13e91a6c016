//! The MCP tools: their declarations (input and output schemas) and each
//! call's arguments restated as the chat or completions request it runs.
//! Arguments are checked here, so a malformed one is a tool error that names
//! it, never a protocol error.

use std::sync::Arc;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use serde_json::{json, Map, Value};

use crate::error::{rename_field, ApiError};
use crate::fields::Fields;
use crate::openai::{ChatRequest, CompletionRequest};

/// The tools, in the order `tools/list` shows them.
pub const NAMES: [&str; 5] = [
    "chat",
    "complete",
    "count_tokens",
    "list_models",
    "server_status",
];

fn object(v: Value) -> Arc<JsonObject> {
    match v {
        Value::Object(map) => Arc::new(map),
        _ => Arc::new(JsonObject::new()),
    }
}

fn messages_schema() -> Value {
    json!({
        "type": "array",
        "minItems": 1,
        "description": "The conversation so far, oldest first; the last message is usually the user's.",
        "items": {
            "type": "object",
            "properties": {
                "role": {"type": "string", "enum": ["user", "assistant"]},
                "content": {"type": "string"}
            },
            "required": ["role", "content"]
        }
    })
}

fn usage_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "input_tokens": {"type": "integer"},
            "output_tokens": {"type": "integer"},
            "reasoning_tokens": {"type": "integer"}
        },
        "required": ["input_tokens", "output_tokens"]
    })
}

fn reply_schema(chat: bool) -> Value {
    let mut properties = json!({
        "text": {"type": "string", "description": "The reply (without its reasoning)."},
        "finish_reason": {"type": "string", "enum": ["stop", "length", "tool_calls"]},
        "model": {"type": "string"},
        "usage": usage_schema()
    });
    if chat {
        properties["reasoning"] =
            json!({"type": "string", "description": "The model's thinking, when it thought."});
        properties["tool_calls"] = json!({"type": "array", "items": {"type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}});
    }
    json!({"type": "object", "properties": properties,
        "required": ["text", "finish_reason", "model", "usage"]})
}

/// The tools this server offers, with JSON schemas for their input and output.
pub fn declarations() -> Vec<Tool> {
    let read_only = ToolAnnotations::new()
        .read_only(true)
        .destructive(false)
        .open_world(false);
    let chat = Tool::new(
        "chat",
        "Ask the local Gemma model: it answers the conversation in `messages`. Progress notifications carry the reply as it is written.",
        object(json!({
            "type": "object",
            "properties": {
                "messages": messages_schema(),
                "system": {"type": "string", "description": "Instructions placed before the conversation."},
                "max_tokens": {"type": "integer", "minimum": 1, "description": "Most tokens to generate (thinking included)."},
                "temperature": {"type": "number", "minimum": 0, "maximum": 2, "description": "0 for the most likely reply (the default is 1)."},
                "thinking": {"type": "boolean", "description": "Let the model think before it answers."},
                "json_schema": {"type": "object", "description": "A JSON Schema the reply must match: the reply is then JSON."},
                "model": {"type": "string", "description": "The model's name (see list_models); may be left out."}
            },
            "required": ["messages"]
        })),
    )
    .with_raw_output_schema(object(reply_schema(true)))
    .with_annotations(read_only.clone());
    let complete = Tool::new(
        "complete",
        "Continue a text with the local model (no chat template).",
        object(json!({
            "type": "object",
            "properties": {
                "prompt": {"type": "string", "description": "The text to continue."},
                "max_tokens": {"type": "integer", "minimum": 1},
                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                "stop": {"type": ["string", "array"], "items": {"type": "string"}, "maxItems": 4,
                    "description": "Strings that end the text (not included)."},
                "model": {"type": "string"}
            },
            "required": ["prompt"]
        })),
    )
    .with_raw_output_schema(object(reply_schema(false)))
    .with_annotations(read_only.clone());
    let count = Tool::new(
        "count_tokens",
        "Count the tokens of a conversation (as `chat` would run it) or of a text.",
        object(json!({
            "type": "object",
            "properties": {
                "messages": messages_schema(),
                "system": {"type": "string"},
                "text": {"type": "string", "description": "A plain text, instead of `messages`."}
            }
        })),
    )
    .with_raw_output_schema(object(json!({
        "type": "object",
        "properties": {"tokens": {"type": "integer"}, "max_model_len": {"type": "integer"}},
        "required": ["tokens", "max_model_len"]
    })))
    .with_annotations(read_only.clone());
    let models = Tool::new(
        "list_models",
        "The model this server runs (its name, family, file format, size and context length), then its LoRA adapters (with the model as `parent`), each a name a request may give as `model`.",
        object(json!({"type": "object", "properties": {}})),
    )
    .with_annotations(read_only.clone());
    let status = Tool::new(
        "server_status",
        "How busy the server is: requests running and queued, KV-cache use, tokens generated and decode speed.",
        object(json!({"type": "object", "properties": {}})),
    )
    .with_annotations(read_only);
    vec![chat, complete, count, models, status]
}

/// Checks that no argument outside `known` was sent (a misspelt one would
/// otherwise be ignored silently).
fn only(args: &Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match args.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::bad_request(format!(
            "`{k}` is not an argument of this tool; it takes {}",
            known.join(", ")
        ))
        .with_param(k.clone())),
        None => Ok(()),
    }
}

/// The bounds the tools' schemas declare for `max_tokens` and `temperature`.
fn sampling_bounds(f: &Fields) -> Result<(), ApiError> {
    f.integer("max_tokens", 1, i64::MAX)?;
    f.number("temperature", 0.0, 2.0)?;
    Ok(())
}

/// A tool without arguments takes none.
pub fn no_arguments(args: &Map<String, Value>) -> Result<(), ApiError> {
    only(args, &[])
}

/// `system` and `messages` as chat messages; the offset of the first
/// message (1 with a system message).
fn chat_messages(f: &Fields) -> Result<(Vec<Value>, usize), ApiError> {
    let mut out = Vec::new();
    if let Some(system) = f.string("system")? {
        out.push(json!({"role": "system", "content": system}));
    }
    let offset = out.len();
    let Some(messages) = f.array("messages")? else {
        return Err(ApiError::bad_request(
            "`messages` is required: a list of {\"role\": \"user\" or \"assistant\", \"content\": text}",
        )
        .with_param("messages"));
    };
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").and_then(Value::as_str);
        match (role, content) {
            (Some(role @ ("user" | "assistant")), Some(content)) => {
                out.push(json!({"role": role, "content": content}))
            }
            (Some("user" | "assistant"), _) => {
                return Err(ApiError::bad_request(format!(
                    "`messages[{i}].content` must be a string"
                ))
                .with_param(format!("messages[{i}].content")))
            }
            _ => {
                return Err(ApiError::bad_request(format!(
                    "`messages[{i}].role` must be \"user\" or \"assistant\" (put instructions in `system`)"
                ))
                .with_param(format!("messages[{i}].role")))
            }
        }
    }
    Ok((out, offset))
}

/// A chat request's error named by the tool's arguments (`offset`: where
/// the tool's `messages` start among the chat messages).
pub fn chat_error(e: ApiError, offset: usize) -> ApiError {
    e.renamed(|n| tool_name(n, offset))
}

fn tool_name(name: &str, offset: usize) -> String {
    if let Some(rest) = name.strip_prefix("messages[") {
        if let Some((index, rest)) = rest.split_once(']') {
            match index.parse::<usize>() {
                Ok(i) if i < offset => return "system".into(),
                Ok(i) => return format!("messages[{}]{rest}", i - offset),
                Err(_) => {}
            }
        }
    }
    let renames = [
        ("response_format.json_schema.schema", "json_schema"),
        ("response_format", "json_schema"),
        ("chat_template_kwargs", "thinking"),
    ];
    rename_field(name, &renames).unwrap_or_else(|| name.to_string())
}

/// The `chat` tool's arguments as a chat request, and the offset its later
/// errors are named with ([`chat_error`]).
pub fn chat_request(args: &Map<String, Value>) -> Result<(ChatRequest, usize), ApiError> {
    let f = Fields::from_object(args.clone());
    only(
        args,
        &[
            "messages",
            "system",
            "max_tokens",
            "temperature",
            "thinking",
            "json_schema",
            "model",
        ],
    )?;
    sampling_bounds(&f)?;
    let (messages, offset) = chat_messages(&f)?;
    let mut body = Map::new();
    body.insert("messages".into(), Value::Array(messages));
    if let Some(on) = f.bool("thinking")? {
        body.insert(
            "chat_template_kwargs".into(),
            json!({ "enable_thinking": on }),
        );
    }
    if let Some(schema) = f.object("json_schema")? {
        body.insert(
            "response_format".into(),
            json!({"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}),
        );
    }
    for key in ["max_tokens", "temperature", "model"] {
        if let Some(v) = f.get(key) {
            body.insert(key.into(), v.clone());
        }
    }
    let req =
        ChatRequest::from_fields(&Fields::from_object(body)).map_err(|e| chat_error(e, offset))?;
    Ok((req, offset))
}

/// The `complete` tool's arguments as a completions request.
pub fn completion_request(args: &Map<String, Value>) -> Result<CompletionRequest, ApiError> {
    let f = Fields::from_object(args.clone());
    only(
        args,
        &["prompt", "max_tokens", "temperature", "stop", "model"],
    )?;
    sampling_bounds(&f)?;
    if f.strings("stop")?.len() > 4 {
        return Err(ApiError::bad_request("`stop` takes at most 4 strings").with_param("stop"));
    }
    if f.string("prompt")?.is_none() {
        return Err(
            ApiError::bad_request("`prompt` is required: the text to continue")
                .with_param("prompt"),
        );
    }
    CompletionRequest::from_fields(&f)
}

/// What `count_tokens` counts.
pub enum Counted {
    Chat(Box<ChatRequest>),
    Text(String),
}

/// The `count_tokens` tool's arguments.
pub fn counted(args: &Map<String, Value>) -> Result<Counted, ApiError> {
    let f = Fields::from_object(args.clone());
    only(args, &["messages", "system", "text"])?;
    match (f.string("text")?, f.get("messages")) {
        (Some(text), None) if f.get("system").is_none() => Ok(Counted::Text(text.to_owned())),
        (None, Some(_)) => {
            let (messages, offset) = chat_messages(&f)?;
            let body = Fields::from_object(Map::from_iter([(
                "messages".to_owned(),
                Value::Array(messages),
            )]));
            let req =
                ChatRequest::from_fields(&body).map_err(|e| e.renamed(|n| tool_name(n, offset)))?;
            Ok(Counted::Chat(Box::new(req)))
        }
        _ => Err(ApiError::bad_request(
            "send either `messages` (with an optional `system`) or `text`",
        )
        .with_param("messages")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn chat_arguments_become_a_chat_request() {
        let (req, offset) = chat_request(&args(json!({
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 12, "temperature": 0, "thinking": false,
            "json_schema": {"type": "object", "properties": {"city": {"type": "string"}}}
        })))
        .expect("valid");
        assert_eq!(req.messages.as_array().map(Vec::len), Some(2));
        assert_eq!(offset, 1);
        let e =
            ApiError::bad_request("`messages[1].content` is bad").with_param("messages[1].content");
        assert_eq!(
            chat_error(e, offset).param.as_deref(),
            Some("messages[0].content")
        );
        let e = ApiError::bad_request("`response_format.json_schema.schema` is bad");
        assert_eq!(chat_error(e, offset).message, "`json_schema` is bad");
        assert_eq!(req.sampling.max_tokens, Some(12));
        assert!(req.sampling.grammar.is_some());
        assert_eq!(
            req.template_kwargs.get("enable_thinking"),
            Some(&json!(false))
        );
    }

    #[test]
    fn bad_arguments_name_themselves() {
        for (body, param) in [
            (json!({}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (
                json!({"messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"system": "s", "messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": 5}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "thinking": "yes"}),
                "thinking",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "json_schema": []}),
                "json_schema",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_token": 5}),
                "max_token",
            ),
        ] {
            let e = chat_request(&args(body.clone())).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = completion_request(&args(json!({"max_tokens": 3}))).expect_err("no prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        for (body, param) in [
            (
                json!({"prompt": "a", "stop": ["x", "x", "x", "x", "x"]}),
                "stop",
            ),
            (json!({"prompt": "a", "temperature": 5}), "temperature"),
        ] {
            let e = completion_request(&args(body.clone())).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        completion_request(&args(json!({"prompt": "a", "stop": "b"})))
            .expect("a single stop string");
        let e = no_arguments(&args(json!({"x": 1}))).expect_err("refused");
        assert_eq!(e.param.as_deref(), Some("x"));
        assert!(counted(&args(json!({"text": "a", "messages": []}))).is_err());
    }

    #[test]
    fn every_tool_is_declared_with_an_object_schema() {
        let tools = declarations();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, NAMES);
        for t in &tools {
            assert_eq!(t.input_schema.get("type"), Some(&json!("object")));
        }
    }
}
