//! `POST /v1/responses` (OpenAI's Responses API), answered whole: the request is
//! translated into a chat request and served by the same path, and the turn
//! comes back as output items: `reasoning` (the thought channel), `message`
//! (the answer) and one `function_call` per tool call.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Map, Value};

use crate::admission::read_body;
use crate::error::ApiError;
use crate::fields::Fields;
use crate::openai::response::SYSTEM_FINGERPRINT;
use crate::openai::ChatRequest;
use crate::routes::{run_chat, Ran};
use crate::server::AppState;

/// Responses fields this server does not implement.
const UNSUPPORTED: [&str; 5] = [
    "previous_response_id",
    "conversation",
    "background",
    "include",
    "prompt",
];

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// Text of a content value: a string, or `input_text` / `output_text` parts.
fn content_text(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => texts.push(
                        part.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad(format!("`{at}[{j}].text` must be a string"), at))?
                            .to_owned(),
                    ),
                    other => {
                        return Err(bad(
                            format!(
                                "`{at}[{j}]` is a {other:?} part; this server accepts text only"
                            ),
                            at,
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(bad(format!("`{at}` must be a string or text parts"), at)),
    }
}

/// `input` (and `instructions`) as chat messages.
fn messages(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(instructions) = f.string("instructions")? {
        out.push(json!({"role": "system", "content": instructions}));
    }
    let items = match f.get("input") {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Some(Value::Array(items)) => items,
        _ => {
            return Err(bad(
                "`input` is required: a string or a list of items",
                "input",
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = content_text(item.get("content").unwrap_or(&Value::Null), &at)?;
                out.push(json!({"role": role, "content": content}));
            }
            Some("function_call") => {
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": item.get("arguments").cloned().unwrap_or(json!("{}")),
                    },
                });
                // Consecutive calls belong to one assistant turn.
                match out.last_mut() {
                    Some(last)
                        if last["role"] == "assistant" && last.get("tool_calls").is_some() =>
                    {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => out.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "content": match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                },
            })),
            // Earlier reasoning is not shown to the model again (the template drops it).
            Some("reasoning") => {}
            Some(other) => {
                return Err(bad(
                    format!("`{at}` is a {other:?} item; this server accepts message, function_call, function_call_output and reasoning items"),
                    &at,
                ))
            }
        }
    }
    Ok(out)
}

/// The chat request body equivalent to a Responses request.
fn chat_body(f: &Fields) -> Result<Value, ApiError> {
    f.refuse(&UNSUPPORTED, "/v1/responses")?;
    if f.bool("stream")? == Some(true) {
        return Err(bad(
            "/v1/responses does not stream on this server yet; use /v1/chat/completions for streams",
            "stream",
        ));
    }
    let mut body = Map::new();
    body.insert("messages".into(), Value::Array(messages(f)?));
    if let Some(tools) = f.array("tools")? {
        let mut chat_tools = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    format!("`tools[{i}]` must be a function tool"),
                    &format!("tools[{i}]"),
                ));
            }
            let mut function = tool.clone();
            if let Some(obj) = function.as_object_mut() {
                obj.remove("type");
                obj.remove("strict");
            }
            chat_tools.push(json!({"type": "function", "function": function}));
        }
        body.insert("tools".into(), Value::Array(chat_tools));
    }
    match f.get("tool_choice") {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            body.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": o.get("name").cloned().unwrap_or(Value::Null)}}),
            );
        }
        Some(other) => {
            body.insert("tool_choice".into(), other.clone());
        }
        None => {}
    }
    if let Some(effort) = f.object("reasoning")?.and_then(|r| r.get("effort")) {
        body.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(format) = f.object("text")?.and_then(|t| t.get("format")) {
        let format = match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => json!({"type": "json_schema", "json_schema": {
                "name": format.get("name").cloned().unwrap_or(Value::Null),
                "schema": format.get("schema").cloned().unwrap_or(Value::Null),
            }}),
            _ => format.clone(),
        };
        body.insert("response_format".into(), format);
    }
    if let Some(max) = f.get("max_output_tokens") {
        body.insert("max_tokens".into(), max.clone());
    }
    for key in [
        "model",
        "temperature",
        "top_p",
        "seed",
        "chat_template_kwargs",
        "thinking_token_budget",
        "logit_bias",
    ] {
        if let Some(v) = f.get(key) {
            body.insert(key.into(), v.clone());
        }
    }
    Ok(Value::Object(body))
}

/// `POST /v1/responses`.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let arrival = Instant::now();
    let (model, guard) = state.admit()?;
    let bytes = read_body(
        body,
        state.config.max_body_bytes,
        state.config.body_read_timeout,
    )
    .await?;
    let f = Fields::parse(&bytes)?;
    let chat = chat_body(&f)?;
    let bytes = serde_json::to_vec(&chat)
        .map_err(|e| ApiError::internal(format!("cannot restate the request: {e}")))?;
    let req = ChatRequest::parse(&bytes)?;
    let Ran::Collected {
        served,
        prompt_tokens,
        collected,
        guard,
        ..
    } = run_chat(&state, &model, req, guard, arrival).await?
    else {
        return Err(ApiError::internal("a whole response was asked for"));
    };
    drop(guard);
    let id = state.response_id("resp");
    let choice = collected.choices.into_iter().next().unwrap_or_default();
    let turn = choice.message;
    let mut output = Vec::new();
    if !turn.reasoning.is_empty() {
        output.push(json!({
            "type": "reasoning",
            "id": format!("rs_{id}"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": turn.reasoning}],
        }));
    }
    if !turn.content.is_empty() || turn.tool_calls.is_empty() {
        output.push(json!({
            "type": "message",
            "id": format!("msg_{id}"),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": turn.content, "annotations": []}],
        }));
    }
    for call in turn.tool_calls {
        output.push(json!({
            "type": "function_call",
            "id": format!("fc_{}", call.id),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": if call.complete { "completed" } else { "incomplete" },
        }));
    }
    let incomplete = choice.finish_reason == "length";
    Ok(Json(json!({
        "id": id,
        "object": "response",
        "created_at": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        "model": served,
        "status": if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "output": output,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": choice.completion_tokens,
            "total_tokens": prompt_tokens + choice.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": collected.reasoning_tokens},
        },
    })))
}
