//! `POST /v1/responses` (OpenAI's Responses API), whole or streamed: the
//! request is translated into a chat request (its fields, never its text)
//! and served by the same path, errors naming the Responses fields,
//! and the turn comes back as output items: `reasoning` (the thought
//! channel), `message` (the answer) and one `function_call` per tool call.

mod assemble;
mod names;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::fields::Fields;
use crate::openai::ChatRequest;
use crate::routes::{submit_chat, unix_now};
use crate::server::AppState;
use crate::turn::Turn;
use assemble::Assembler;
use names::{restate, Origin};

/// Responses fields this server does not implement.
const UNSUPPORTED: [&str; 3] = ["previous_response_id", "conversation", "prompt"];

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// A content value as chat content: a string, or `input_text` / `output_text`
/// parts joined into one; with `input_image` or `input_audio` parts, chat
/// content parts (`text`, `image_url`, `input_audio`), which the chat path
/// checks and encodes.
fn content_value(content: &Value, at: &str) -> Result<Value, ApiError> {
    match content {
        Value::String(s) => Ok(Value::String(s.clone())),
        Value::Array(parts) => {
            let mut out = Vec::new();
            let mut media = false;
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        let text = part
                            .get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad(format!("`{at}[{j}].text` must be a string"), at))?;
                        out.push(json!({"type": "text", "text": text}));
                    }
                    Some("input_image") => {
                        let url = match part.get("image_url") {
                            Some(Value::String(u)) => u.clone(),
                            _ => {
                                return Err(bad(
                                    format!("`{at}[{j}].image_url` must be a string (a data: URI, or an http(s) URL where the server fetches them)"),
                                    at,
                                ))
                            }
                        };
                        media = true;
                        out.push(json!({"type": "image_url", "image_url": {"url": url}}));
                    }
                    Some("input_audio") => {
                        // The chat part's shape; the chat path checks its fields.
                        media = true;
                        out.push(json!({"type": "input_audio", "input_audio": part.get("input_audio").cloned().unwrap_or(Value::Null)}));
                    }
                    // An assistant's refusal fed back: what it said.
                    Some("refusal") => {
                        let text = part.get("refusal").and_then(Value::as_str).ok_or_else(|| {
                            bad(format!("`{at}[{j}].refusal` must be a string"), at)
                        })?;
                        out.push(json!({"type": "text", "text": text}));
                    }
                    Some(other) => {
                        return Err(bad(
                            format!(
                                "`{at}[{j}]` is a {other:?} part; this server accepts input_text, output_text, refusal, input_image and input_audio parts"
                            ),
                            at,
                        ))
                    }
                    None => {
                        return Err(bad(
                            format!("`{at}[{j}]` needs a \"type\" (\"input_text\", \"input_image\" or \"input_audio\")"),
                            at,
                        ))
                    }
                }
            }
            if media {
                return Ok(Value::Array(out));
            }
            let texts: Vec<&str> = out.iter().filter_map(|p| p["text"].as_str()).collect();
            Ok(Value::String(texts.join("\n")))
        }
        _ => Err(bad(format!("`{at}` must be a string or text parts"), at)),
    }
}

/// A `function_call` item as a chat assistant's tool call.
fn chat_tool_call(item: &Value, at: &str) -> Result<Value, ApiError> {
    for (field, ok) in [
        ("name", item.get("name").is_some_and(Value::is_string)),
        ("call_id", item.get("call_id").is_some_and(Value::is_string)),
        (
            "arguments",
            item.get("arguments")
                .is_none_or(|a| a.is_string() || a.is_object()),
        ),
    ] {
        if !ok {
            return Err(bad(
                format!("`{at}.{field}` must be a string"),
                &format!("{at}.{field}"),
            ));
        }
    }
    Ok(json!({
        "id": item.get("call_id").cloned().unwrap_or(Value::Null),
        "type": "function",
        "function": {
            "name": item.get("name").cloned().unwrap_or(Value::Null),
            "arguments": item.get("arguments").cloned().unwrap_or(json!("{}")),
        },
    }))
}

/// `input` (and `instructions`) as chat messages, and where each came from.
fn messages(f: &Fields) -> Result<(Vec<Value>, Vec<Origin>), ApiError> {
    let mut out = Vec::new();
    let mut origins = Vec::new();
    if let Some(instructions) = f.string("instructions")? {
        out.push(json!({"role": "system", "content": instructions}));
        origins.push(Origin::Instructions);
    }
    let items = match f.get("input") {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            origins.push(Origin::Input);
            return Ok((out, origins));
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
                if !["user", "assistant", "system", "developer"].contains(&role) {
                    return Err(bad(
                        format!("`{at}.role` is {role:?}; use user, assistant, system or developer"),
                        &format!("{at}.role"),
                    ));
                }
                let content = content_value(item.get("content").unwrap_or(&Value::Null), &at)?;
                out.push(json!({"role": role, "content": content}));
                origins.push(Origin::Item(i));
            }
            Some("function_call") => {
                let call = chat_tool_call(item, &at)?;
                // Consecutive calls belong to one assistant turn.
                match (out.last_mut(), origins.last_mut()) {
                    (Some(last), Some(Origin::Calls(items))) => {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                            items.push(i);
                        }
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
                        origins.push(Origin::Calls(vec![i]));
                    }
                }
            }
            Some("function_call_output") if !item.get("call_id").is_some_and(Value::is_string) => {
                return Err(bad(
                    format!("`{at}.call_id` must be a string"),
                    &format!("{at}.call_id"),
                ))
            }
            Some("function_call_output") => {
                origins.push(Origin::Item(i));
                out.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "content": match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                },
                }))
            }
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
    if out.is_empty() {
        return Err(bad(
            "`input` holds no message, call or call output to answer (reasoning items alone are not a turn)",
            "input",
        ));
    }
    Ok((out, origins))
}

/// The chat request equivalent to a Responses request, and where each of
/// its messages came from.
fn chat_body(f: &Fields) -> Result<(Fields, Vec<Origin>), ApiError> {
    f.refuse(&UNSUPPORTED, "/v1/responses")?;
    f.refuse_unless("background", "/v1/responses", |b| b == &Value::Bool(false))?;
    f.refuse_unless("include", "/v1/responses", |i| {
        i.as_array().is_some_and(Vec::is_empty)
    })?;
    // Checked here, where the request's own names are known.
    if f.get("input")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
    {
        return Err(bad(
            "`input` is an empty list; send at least one item",
            "input",
        ));
    }
    if let Some(max) = f.get("max_output_tokens") {
        if max.as_u64().is_none_or(|n| n < 1) {
            return Err(bad(
                format!("`max_output_tokens` must be a whole number of at least 1; got {max}"),
                "max_output_tokens",
            ));
        }
    }
    let mut body = Map::new();
    if let Some(parallel) = f.get("parallel_tool_calls") {
        body.insert("parallel_tool_calls".into(), parallel.clone());
    }
    let (messages, origins) = messages(f)?;
    body.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = f.array("tools")? {
        body.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = f.get("tool_choice") {
        body.insert("tool_choice".into(), chat_tool_choice(choice));
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
    Ok((Fields::from_object(body), origins))
}

/// Responses function tools (`{"type": "function", "name", "parameters", …}`)
/// as chat tools (the same under `function`).
fn chat_tools(tools: &[Value]) -> Result<Value, ApiError> {
    let mut chat_tools = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                format!("`tools[{i}]` must be a function tool"),
                &format!("tools[{i}]"),
            ));
        }
        if tool
            .get("parameters")
            .is_some_and(|p| !p.is_object() && !p.is_null())
        {
            return Err(bad(
                format!("`tools[{i}].parameters` must be a JSON Schema object"),
                &format!("tools[{i}].parameters"),
            ));
        }
        let mut function = tool.clone();
        if let Some(obj) = function.as_object_mut() {
            obj.remove("type");
            obj.remove("strict");
        }
        chat_tools.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(chat_tools))
}

/// A Responses `tool_choice` in chat's spelling: a function is named at
/// `function.name`, and `allowed_tools` nests its mode and tools.
fn chat_tool_choice(choice: &Value) -> Value {
    let name = |t: &Value| t.get("name").cloned().unwrap_or(Value::Null);
    match choice.get("type").and_then(Value::as_str) {
        Some("function") => json!({"type": "function", "function": {"name": name(choice)}}),
        Some("allowed_tools") => {
            let tools: Vec<Value> = choice
                .get("tools")
                .and_then(Value::as_array)
                .map(|ts| {
                    ts.iter()
                        .map(|t| json!({"type": "function", "function": {"name": name(t)}}))
                        .collect()
                })
                .unwrap_or_default();
            let mode = choice.get("mode").cloned().unwrap_or(Value::Null);
            json!({"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}})
        }
        _ => choice.clone(),
    }
}

/// The request's tools as a Response repeats them: each function tool with
/// every field the API requires (`parameters` and `strict`, `null` when not sent).
fn echoed_tools(f: &Fields) -> Result<Value, ApiError> {
    let tools = f.array("tools")?.cloned().unwrap_or_default();
    Ok(Value::Array(
        tools
            .into_iter()
            .map(|mut tool| {
                if let Some(obj) = tool.as_object_mut() {
                    obj.entry("parameters").or_insert(Value::Null);
                    obj.entry("strict").or_insert(Value::Null);
                }
                tool
            })
            .collect(),
    ))
}

/// The request's settings a Response object repeats, as sent or as the
/// server takes them when left out.
fn echoed_settings(f: &Fields) -> Result<Value, ApiError> {
    let given = |key: &str| f.get(key).cloned();
    Ok(json!({
        "instructions": given("instructions").unwrap_or(Value::Null),
        "tools": echoed_tools(f)?,
        "tool_choice": given("tool_choice").unwrap_or_else(|| json!("auto")),
        "parallel_tool_calls": f.bool("parallel_tool_calls")?.unwrap_or(true),
        "metadata": Value::Object(f.object("metadata")?.cloned().unwrap_or_default()),
        "temperature": given("temperature").unwrap_or(Value::Null),
        "top_p": given("top_p").unwrap_or(Value::Null),
        "max_output_tokens": given("max_output_tokens").unwrap_or(Value::Null),
    }))
}

/// `POST /v1/responses`.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Response, ApiError> {
    let admitted = state.admit_body(body).await?;
    let f = Fields::parse(&admitted.bytes)?;
    let streamed = f.bool("stream")?.unwrap_or(false);
    let (chat, origins) = chat_body(&f)?;
    let settings = echoed_settings(&f)?;
    let req = ChatRequest::from_fields(&chat).map_err(|e| restate(e, &origins))?;
    let submitted = submit_chat(&state, &admitted.model, req, admitted.arrival)
        .await
        .map_err(|e| restate(e, &origins))?;
    let assembler = Assembler::new(
        state.response_id("resp"),
        submitted.served,
        unix_now(),
        settings,
    );
    let turn = Turn::new(assembler, submitted.generation, state, admitted.guard);
    if streamed {
        return Ok(turn.stream());
    }
    turn.whole().await.map(|v| Json(v).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_parts_are_read_or_refused_by_name() {
        let parts = json!([
            {"type": "output_text", "text": "I can't"},
            {"type": "refusal", "refusal": "help with that."}
        ]);
        assert_eq!(
            content_value(&parts, "input[1].content").expect("read"),
            json!("I can't\nhelp with that.")
        );
        for (part, words) in [
            (json!({"type": "input_file"}), "is a \"input_file\" part"),
            (json!({"text": "x"}), "needs a \"type\""),
            (
                json!({"type": "refusal"}),
                "`input[0].content[0].refusal` must be a string",
            ),
        ] {
            let e = content_value(&json!([part]), "input[0].content").expect_err("refused");
            assert!(e.message.contains(words), "{}", e.message);
            assert!(
                !e.message.contains("Some(") && !e.message.contains("None"),
                "{}",
                e.message
            );
        }
    }
}
