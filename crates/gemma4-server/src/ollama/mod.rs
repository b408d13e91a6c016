//! Ollama's API: `POST /api/chat` and `POST /api/generate` (newline-delimited
//! JSON streams by default, whole with `stream: false`), `GET /api/tags`,
//! `POST /api/show`, `GET /api/ps` and `GET /api/version`. A chat or a
//! templated generation is restated as a chat request's fields and served by
//! the chat path; the reply is [`fold::OllamaFold`] over the turn's events.
//! Errors take Ollama's shape, `{"error": "…"}`.

mod fold;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::{json, Map, Value};

use crate::error::{rename_field, ApiError};
use crate::fields::Fields;
use crate::openai::ChatRequest;
use crate::routes::{check_model_name, submit_chat};
use crate::server::{AppState, ModelContext};
use crate::turn::Turn;
use fold::{OllamaFold, Route};

/// An error in Ollama's shape.
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        (self.0.status, Json(json!({"error": self.0.message}))).into_response()
    }
}

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// `POST /api/chat`.
pub async fn chat(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, OllamaError> {
    turn(state, body, Route::Chat).await
}

/// `POST /api/generate`: the prompt as a user turn (and `system`) through
/// the chat template, as Ollama templates it.
pub async fn generate(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Response, OllamaError> {
    turn(state, body, Route::Generate).await
}

/// An `/api/chat` (or, with `generate`, `/api/generate`) body as the chat
/// request it is served as, for a server of `max_model_len` tokens.
pub fn chat_request(
    body: &[u8],
    generate: bool,
    max_model_len: usize,
) -> Result<ChatRequest, ApiError> {
    let route = if generate {
        Route::Generate
    } else {
        Route::Chat
    };
    ChatRequest::from_fields(&chat_fields(&Fields::parse(body)?, route, max_model_len)?)
        .map_err(|e| e.renamed(|name| ollama_name(name, route)))
}

/// Ollama's name of a chat field (unchanged when it has none): sampling
/// settings live in `options`, a message's images in its `images` (its text
/// is part 0), and `/api/generate`'s one turn is its `prompt` and `images`.
fn ollama_name(name: &str, route: Route) -> String {
    let settings = [
        ("max_tokens", "options.num_predict"),
        ("repetition_penalty", "options.repeat_penalty"),
        ("temperature", "options.temperature"),
        ("top_p", "options.top_p"),
        ("top_k", "options.top_k"),
        ("min_p", "options.min_p"),
        ("seed", "options.seed"),
        ("stop", "options.stop"),
        ("presence_penalty", "options.presence_penalty"),
        ("frequency_penalty", "options.frequency_penalty"),
        ("speculative_decoding", "options.speculative_decoding"),
        ("response_format", "format"),
        ("chat_template_kwargs", "think"),
    ];
    if let Some(renamed) = rename_field(name, &settings) {
        return renamed;
    }
    let Some((message, rest)) = name
        .strip_prefix("messages[")
        .and_then(|r| r.split_once(']'))
    else {
        return match (name, route) {
            ("messages", Route::Generate) => "prompt".into(),
            _ => name.to_string(),
        };
    };
    let image = rest
        .strip_prefix(".content[")
        .and_then(|r| r.split_once(']'))
        .and_then(|(j, _)| j.parse::<usize>().ok())
        .filter(|j| *j > 0);
    match (route, image) {
        (Route::Chat, Some(j)) => format!("messages[{message}].images[{}]", j - 1),
        (Route::Chat, None) => name.to_string(),
        (Route::Generate, Some(j)) => format!("images[{}]", j - 1),
        (Route::Generate, None) => "prompt".into(),
    }
}

async fn turn(state: Arc<AppState>, body: Body, route: Route) -> Result<Response, OllamaError> {
    let admitted = state.admit_body(body).await?;
    let f = Fields::parse(&admitted.bytes)?;
    let model = check_model(&state, &f)?;
    let streamed = f.bool("stream")?.unwrap_or(true);
    let chat = chat_fields(&f, route, admitted.model.max_model_len())?;
    let rename = |e: ApiError| e.renamed(|name| ollama_name(name, route));
    let req = ChatRequest::from_fields(&chat).map_err(rename)?;
    let submitted = submit_chat(&state, &admitted.model, req, admitted.arrival)
        .await
        .map_err(rename)?;
    let fold = OllamaFold::new(route, model, rfc3339(SystemTime::now()), admitted.arrival);
    let turn = Turn::new(fold, submitted.generation, state, admitted.guard);
    if streamed {
        return Ok(turn.ndjson());
    }
    Ok(Json(turn.whole().await?).into_response())
}

/// The request's `model`: required, the served model's name (`:latest` allowed).
fn check_model(state: &AppState, f: &Fields) -> Result<String, ApiError> {
    let Some(name) = f.string("model")?.filter(|m| !m.is_empty()) else {
        return Err(bad("`model` is required", "model"));
    };
    check_model_name(state, Some(name.strip_suffix(":latest").unwrap_or(name)))?;
    Ok(name.to_owned())
}

/// The chat request equivalent to an Ollama chat or generation.
fn chat_fields(f: &Fields, route: Route, max_model_len: usize) -> Result<Fields, ApiError> {
    for field in ["raw", "suffix", "template", "context"] {
        let given = match f.get(field) {
            None | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if given {
            return Err(bad(
                format!("`{field}` is not supported by this server: prompts always go through the model's chat template"),
                field,
            ));
        }
    }
    let mut body = Map::new();
    // The served model or one of its LoRA adapters, as the chat front names it.
    if let Some(name) = f.string("model")?.filter(|m| !m.is_empty()) {
        let name = name.strip_suffix(":latest").unwrap_or(name);
        body.insert("model".into(), json!(name));
    }
    let messages = match route {
        Route::Chat => chat_messages(f)?,
        Route::Generate => generate_messages(f)?,
    };
    body.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = f.array("tools")?.filter(|t| !t.is_empty()) {
        body.insert("tools".into(), Value::Array(tools.clone()));
    }
    match f.get("format") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            body.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some(schema @ Value::Object(_)) => {
            body.insert(
                "response_format".into(),
                json!({"type": "json_schema",
                "json_schema": {"name": "format", "schema": schema}}),
            );
        }
        Some(_) => return Err(bad("`format` must be \"json\" or a JSON schema", "format")),
    }
    match f.get("think") {
        None => {}
        Some(Value::Bool(on)) => {
            body.insert(
                "chat_template_kwargs".into(),
                json!({"enable_thinking": on}),
            );
        }
        Some(Value::String(level)) if ["low", "medium", "high"].contains(&level.as_str()) => {
            body.insert(
                "chat_template_kwargs".into(),
                json!({"enable_thinking": true}),
            );
        }
        Some(_) => {
            return Err(bad(
                "`think` must be true, false, \"low\", \"medium\" or \"high\"",
                "think",
            ))
        }
    }
    if let Some(options) = f.object("options")? {
        sampling_options(options, max_model_len, &mut body)?;
    }
    body.insert("stream".into(), json!(false));
    Ok(Fields::from_object(body))
}

/// `options` as the chat request's sampling fields; options for the
/// hardware (`num_gpu`, `num_thread`, …) are Ollama's to set and are ignored.
fn sampling_options(
    options: &Map<String, Value>,
    max_model_len: usize,
    body: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    let renamed = [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("speculative_decoding", "speculative_decoding"),
    ];
    for (ollama, chat) in renamed {
        if let Some(v) = options.get(ollama).filter(|v| !v.is_null()) {
            body.insert(chat.into(), v.clone());
        }
    }
    // -1: no limit but the context's; -2: fill the context.
    match options.get("num_predict").and_then(Value::as_i64) {
        Some(n) if n > 0 => {
            body.insert("max_tokens".into(), json!(n));
        }
        _ => {}
    }
    if let Some(n) = options.get("num_ctx").and_then(Value::as_u64) {
        if n as usize > max_model_len {
            return Err(bad(
                format!(
                    "`options.num_ctx` is {n}, past this server's context length ({max_model_len}); \
                     start the server with a larger --max-model-len"
                ),
                "options.num_ctx",
            ));
        }
    }
    Ok(())
}

/// `messages` as chat messages: `images` (base64) as image parts, calls
/// with ids of their own (Ollama's have none), a tool's answer tied to the
/// latest call of its `tool_name`.
fn chat_messages(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let Some(messages) = f.array("messages")? else {
        return Err(bad(
            "`messages` is required: a list of {\"role\", \"content\"} objects",
            "messages",
        ));
    };
    let mut out = Vec::with_capacity(messages.len());
    let mut calls: Vec<(String, String)> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(obj) = m.as_object() else {
            return Err(bad(format!("`{at}` must be an object"), &at));
        };
        let mut message = obj.clone();
        for key in ["images", "thinking", "tool_name"] {
            message.remove(key);
        }
        // Ollama's clients may leave a message's content out, or send null.
        if obj.get("content").is_none_or(Value::is_null) {
            message.insert("content".into(), json!(""));
        }
        let text = obj
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if let Some(images) = obj.get("images").and_then(Value::as_array) {
            message.insert("content".into(), with_images(text, images, &at)?);
        }
        if let Some(list) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for (j, call) in list.iter_mut().enumerate() {
                let id = format!("call_{i}_{j}");
                let name = call["function"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                calls.push((name, id.clone()));
                call["id"] = json!(id);
                call["type"] = json!("function");
            }
        }
        if obj.get("role").and_then(Value::as_str) == Some("tool") {
            let name = obj.get("tool_name").and_then(Value::as_str);
            let called = calls
                .iter()
                .rev()
                .find(|(n, _)| name.is_none_or(|name| name == n));
            if let Some((_, id)) = called {
                message.insert("tool_call_id".into(), json!(id));
            }
        }
        out.push(Value::Object(message));
    }
    Ok(out)
}

/// `/api/generate`'s `system` and `prompt` (with its `images`) as chat messages.
fn generate_messages(f: &Fields) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(system) = f.string("system")?.filter(|s| !s.is_empty()) {
        out.push(json!({"role": "system", "content": system}));
    }
    let prompt = f.string("prompt")?.unwrap_or_default();
    let content = match f.array("images")? {
        Some(images) if !images.is_empty() => with_images(prompt, images, "images")?,
        _ => json!(prompt),
    };
    out.push(json!({"role": "user", "content": content}));
    Ok(out)
}

/// Text and base64 images as chat content parts.
fn with_images(text: &str, images: &[Value], at: &str) -> Result<Value, ApiError> {
    let mut parts = vec![json!({"type": "text", "text": text})];
    for (j, image) in images.iter().enumerate() {
        let Some(data) = image.as_str() else {
            return Err(bad(
                format!("`{at}.images[{j}]` must be base64 image data"),
                &format!("{at}.images[{j}]"),
            ));
        };
        let mime = base64::engine::general_purpose::STANDARD
            .decode(data.get(..64.min(data.len()) / 4 * 4).unwrap_or_default())
            .map(|head| image_type(&head))
            .unwrap_or("image/png");
        parts.push(json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{data}")}}));
    }
    Ok(Value::Array(parts))
}

/// The media type an image's first bytes announce (PNG when unknown: the
/// decoder reads the bytes, not the type).
fn image_type(head: &[u8]) -> &'static str {
    match head {
        [0xff, 0xd8, ..] => "image/jpeg",
        [b'G', b'I', b'F', ..] => "image/gif",
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => "image/webp",
        [b'B', b'M', ..] => "image/bmp",
        _ => "image/png",
    }
}

/// The served model as Ollama's listings describe it.
fn model_entry(state: &AppState, model: &ModelContext) -> Value {
    named_entry(&state.config.served_model_name, None, model)
}

/// An entry of Ollama's listings: the served model, or one of its LoRA
/// adapters with the served model as `parent_model`.
fn named_entry(name: &str, parent: Option<&str>, model: &ModelContext) -> Value {
    let info = &model.info;
    let details = json!({
        "parent_model": parent.unwrap_or_default(),
        "format": info.format,
        "family": info.family,
        "families": [info.family],
    });
    json!({
        "name": name,
        "model": name,
        "modified_at": rfc3339(info.modified),
        "size": info.size_bytes,
        "digest": format!("{:016x}", fnv1a(&format!("{name}/{}", info.size_bytes))),
        "details": details,
    })
}

fn loaded(state: &AppState) -> Result<Arc<ModelContext>, ApiError> {
    state.model().cloned().ok_or_else(|| {
        ApiError::unavailable(
            "the model is still loading; retry when GET /ready returns 200",
            "model_loading",
        )
    })
}

/// `GET /api/tags`: the served model and its LoRA adapters.
pub async fn tags(State(state): State<Arc<AppState>>) -> Result<Json<Value>, OllamaError> {
    let model = loaded(&state)?;
    let served = &state.config.served_model_name;
    let mut models = vec![model_entry(&state, &model)];
    for name in &model.engine.adapter_names() {
        models.push(named_entry(name, Some(served), &model));
    }
    Ok(Json(json!({"models": models})))
}

/// `GET /api/ps`: the served model, loaded for as long as the server runs.
pub async fn ps(State(state): State<Arc<AppState>>) -> Result<Json<Value>, OllamaError> {
    let model = loaded(&state)?;
    let mut entry = model_entry(&state, &model);
    entry["expires_at"] = json!("9999-12-31T23:59:59Z");
    entry["size_vram"] = json!(0);
    entry["context_length"] = json!(model.max_model_len());
    Ok(Json(json!({"models": [entry]})))
}

/// `POST /api/show`: the served model's details, template and capabilities.
pub async fn show(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<Value>, OllamaError> {
    let model = loaded(&state)?;
    let bytes = state.read_body(body).await?;
    let f = Fields::parse(&bytes)?;
    check_model(&state, &f)?;
    let entry = model_entry(&state, &model);
    let template = model
        .chat_template
        .as_ref()
        .ok()
        .map(|t| t.source().to_owned());
    let can = model.capabilities();
    let mut capabilities = vec!["completion"];
    for (has, name) in [
        (can.tools, "tools"),
        (can.thinking, "thinking"),
        (can.images, "vision"),
    ] {
        if has {
            capabilities.push(name);
        }
    }
    let family = &model.info.family;
    Ok(Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": template.unwrap_or_default(),
        "details": entry["details"],
        "model_info": {
            "general.architecture": family,
            format!("{family}.context_length"): model.max_model_len(),
        },
        "capabilities": capabilities,
        "modified_at": entry["modified_at"],
    })))
}

/// `GET /api/version`.
pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// A time as RFC 3339 in UTC, as Ollama writes `created_at`.
fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (days, secs) = (d.as_secs() / 86_400, d.as_secs() % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60,
        d.subsec_nanos()
    )
}

/// A stable 64-bit digest of a string (FNV-1a).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + std::time::Duration::from_secs(951_782_400 + 3661);
        assert_eq!(rfc3339(t), "2000-02-29T01:01:01.000000000Z");
        let t = UNIX_EPOCH + std::time::Duration::from_secs(1_796_515_200);
        assert_eq!(rfc3339(t), "2026-12-06T00:00:00.000000000Z");
    }

    #[test]
    fn a_chat_becomes_chat_fields() {
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n0000");
        let f = Fields::from_object(
            json!({
                "model": "m",
                "messages": [
                    {"role": "user", "content": "Look", "images": [png]},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
                    {"role": "tool", "content": "ok", "tool_name": "f"}],
                "format": "json",
                "think": true,
                "options": {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.1, "num_gpu": 99}
            })
            .as_object()
            .cloned()
            .expect("object"),
        );
        let chat = chat_fields(&f, Route::Chat, 512).expect("valid");
        let messages = chat.get("messages").expect("messages");
        assert_eq!(
            messages[0]["content"][1]["image_url"]["url"]
                .as_str()
                .map(|u| u.starts_with("data:image/png;base64,")),
            Some(true)
        );
        assert_eq!(messages[1]["tool_calls"][0]["id"], "call_1_0");
        assert_eq!(messages[2]["tool_call_id"], "call_1_0");
        assert_eq!(chat.get("max_tokens"), Some(&json!(8)));
        assert_eq!(chat.get("repetition_penalty"), Some(&json!(1.1)));
        assert_eq!(
            chat.get("response_format"),
            Some(&json!({"type": "json_object"}))
        );
        ChatRequest::from_fields(&chat).expect("a valid chat request");
        let too_long = Fields::from_object(
            json!({"messages": [], "options": {"num_ctx": 4096}})
                .as_object()
                .cloned()
                .expect("object"),
        );
        let e = chat_fields(&too_long, Route::Chat, 512).expect_err("past the context");
        assert_eq!(e.param.as_deref(), Some("options.num_ctx"));
        // The chat path's names become Ollama's.
        let hot = br#"{"messages": [{"role": "user", "content": null}], "options": {"temperature": "hot"}}"#;
        let e = chat_request(hot, false, 512).expect_err("a string temperature");
        assert_eq!(e.param.as_deref(), Some("options.temperature"));
        assert!(e.message.contains("`options.temperature`"), "{}", e.message);
        assert_eq!(
            ollama_name("messages[2].content[1].image_url.url", Route::Chat),
            "messages[2].images[0]"
        );
        assert_eq!(
            ollama_name("messages[1].content[2].image_url.url", Route::Generate),
            "images[1]"
        );
        assert_eq!(ollama_name("messages", Route::Generate), "prompt");
    }
}
