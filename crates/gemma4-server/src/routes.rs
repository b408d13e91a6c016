//! The HTTP routes and their handlers.
//!
//! | route | auth | what |
//! |---|---|---|
//! | `POST /v1/chat/completions` | key | chat through the model's template |
//! | `POST /v1/responses` | key | the Responses API, whole or streamed: reasoning, message and function-call items |
//! | `POST /v1/completions` | key | plain-text completion |
//! | `POST /v1/chat/completions/render`, `POST /v1/completions/render` | key | the prompt token ids (and media placeholders) a request would run, without running it |
//! | `GET /v1/models` | key | the served model, then its LoRA adapters |
//! | `GET /v1/models/{id}` | key | the served model's or an adapter's card; 404 for any other id |
//! | `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` | key | with `--allow-runtime-lora`: an adapter loaded or dropped ([`crate::lora_admin`]) |
//! | `POST /tokenize` | key | `{prompt}` or `{messages}` → `{tokens, count, max_model_len}` |
//! | `POST /detokenize` | key | `{tokens}` → `{prompt}` |
//! | `POST /generate` | key | `{"prompt", …}` → `{"response", "token_ids", "usage"}` |
//! | `GET /health` | open | liveness: 200 loading, ready or draining; 503 failed (with the reason) |
//! | `GET /ready` | open | readiness: 200 ready; 503 loading, draining or failed |
//! | `GET /metrics` | open | Prometheus text |
//! | `GET /`, `GET /webui/app.js`, `GET /webui/style.css` | open | the chat page ([`crate::webui`]), unless `--no-webui` |
//! | `GET /webui/info` | key | what the chat page may offer (chat, thinking, attachments) |
//! | `POST/GET/DELETE /mcp` | key | MCP's Streamable HTTP, with `--mcp` ([`crate::mcp`]) |

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::anthropic;
use crate::auth;
use crate::drain::ActiveGuard;
use crate::error::ApiError;
use crate::front::{self, OpenAiJob};
use crate::generation::{fold_to_end, Generation};
use crate::lora_admin;
use crate::ollama;
use crate::openai::fold::{Format, PromptOutput, ReplyFold};
use crate::openai::request::Streaming;
use crate::openai::response::{
    ChatCompletion, GenerateResponse, ModelCard, ModelList, TextCompletion, UsageJson,
    SYSTEM_FINGERPRINT,
};
use crate::openai::{ChatRequest, CompletionRequest, GenerateRequest};
use crate::render;
use crate::responses;
use crate::server::ModelContext;
use crate::server::{Admitted, AppState};
use crate::sse::{self, StreamMeta};
use crate::tokenize;
use crate::webui;

const ROUTES: [&str; 28] = [
    "/v1/chat/completions",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/mcp",
    "/",
    "/webui/app.js",
    "/webui/style.css",
    "/webui/info",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenizer_info",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/responses",
    "/v1/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/generate",
    "/health",
    "/ready",
    "/metrics",
];
const ROUTE_LIST: &str = "POST /v1/chat/completions, POST /v1/responses, POST /v1/completions, POST /v1/messages, POST /v1/messages/count_tokens, POST /v1/chat/completions/render, POST /v1/completions/render, GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /tokenizer_info, POST /generate, Ollama's POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, GET /health, GET /ready, GET /metrics, the chat page at GET / (unless --no-webui), MCP at /mcp when started with --mcp, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter when started with --allow-runtime-lora";

pub fn router(state: Arc<AppState>) -> Router {
    let mut keyed = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions/render", post(render::chat))
        .route("/v1/completions/render", post(render::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_card))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/generate", post(generate))
        .route("/v1/load_lora_adapter", post(lora_admin::load))
        .route("/v1/unload_lora_adapter", post(lora_admin::unload));
    let mut open = Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics));
    if state.config.webui {
        keyed = keyed.route("/webui/info", get(webui::info));
        open = open
            .route("/", get(webui::index))
            .route("/webui/app.js", get(webui::script))
            .route("/webui/style.css", get(webui::style));
    }
    if let Some(hosts) = &state.config.mcp {
        keyed = keyed.nest_service("/mcp", crate::mcp::http_endpoint(state.clone(), hosts));
    }
    let keyed = keyed.route_layer(middleware::from_fn_with_state(
        state.clone(),
        auth::require_key,
    ));
    open.merge(keyed)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// Counts every answered request by route and status.
async fn count_requests(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    let route = ROUTES
        .iter()
        .find(|r| **r == path)
        .copied()
        .unwrap_or("other");
    let response = next.run(request).await;
    state
        .metrics
        .record_request(route, response.status().as_u16());
    response
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "there is no route {method} {}; the routes are {ROUTE_LIST}",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(format!(
        "{} does not accept {method}; the routes are {ROUTE_LIST}",
        uri.path()
    ))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let (status, body) = state.health();
    (status, Json(body)).into_response()
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let (status, body) = state.ready();
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.render_metrics(),
    )
        .into_response()
}

/// The served model's card, then one per LoRA adapter (`parent`: the
/// served model), as vLLM lists them.
fn served_cards(state: &AppState) -> Result<Vec<ModelCard>, ApiError> {
    let Some(model) = state.model() else {
        return Err(ApiError::unavailable(
            "the model is still loading; retry when GET /ready returns 200",
            "model_loading",
        ));
    };
    let served = &state.config.served_model_name;
    let card = |id: &str, parent: Option<&str>| ModelCard {
        id: id.to_string(),
        object: "model",
        created: state.created,
        owned_by: "gemma4",
        parent: parent.map(str::to_string),
        max_model_len: model.max_model_len(),
    };
    let mut cards = vec![card(served, None)];
    for name in &model.engine.adapter_names() {
        cards.push(card(name, Some(served)));
    }
    Ok(cards)
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    Ok(Json(ModelList {
        object: "list",
        data: served_cards(&state)?,
    }))
}

async fn model_card(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let adapter = check_model_name(&state, Some(id.as_str()))?;
    let cards = served_cards(&state)?;
    let wanted = adapter
        .as_deref()
        .unwrap_or(&state.config.served_model_name);
    cards
        .into_iter()
        .find(|c| c.id == wanted)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("the model `{id}` does not exist")))
}

/// What a request's `model` names: the served model (or no name: `None`),
/// one of the LoRA adapters (its name), or nothing served here (404).
pub(crate) fn check_model_name(
    state: &AppState,
    requested: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let served = &state.config.served_model_name;
    let adapters = adapter_names(state);
    match requested {
        None | Some("") => Ok(None),
        Some(name) if name == served => Ok(None),
        Some(name) if adapters.iter().any(|a| a == name) => Ok(Some(name.to_string())),
        Some(name) => {
            let also = match adapters.len() {
                0 => String::new(),
                _ => format!(" and the LoRA adapters `{}`", adapters.join("`, `")),
            };
            Err(ApiError::not_found(format!(
                "the model `{name}` does not exist; this server serves `{served}`{also} (see GET /v1/models)"
            ))
            .with_param("model")
            .with_code("model_not_found"))
        }
    }
}

/// The LoRA adapters requests may name (none while the model loads).
fn adapter_names(state: &AppState) -> Vec<String> {
    state
        .model()
        .map(|m| m.engine.adapter_names())
        .unwrap_or_default()
}

async fn chat(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let admitted = state.admit_body(body).await?;
    let req = ChatRequest::parse(&admitted.bytes)?;
    let submitted = submit_chat(&state, &admitted.model, req, admitted.arrival).await?;
    let Whole {
        id,
        served,
        generation,
        fold,
    } = match answer(&state, submitted, admitted.guard).await? {
        Ran::Streamed(response) => return Ok(response),
        Ran::Collected(whole) => whole,
    };
    let usage = UsageJson::new(generation.prompt_tokens, fold.completion_tokens())
        .with_media(&generation.prompt_media)
        .with_reasoning(generation.reasoning_tokens());
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion",
        created: unix_now(),
        model: served,
        system_fingerprint: SYSTEM_FINGERPRINT,
        choices: fold.chat_choices(),
        usage,
    })
    .into_response())
}

/// Renders and submits a parsed chat request.
pub(crate) async fn submit_chat(
    state: &Arc<AppState>,
    model: &Arc<ModelContext>,
    req: ChatRequest,
    arrival: Instant,
) -> Result<Submitted, ApiError> {
    let job = front::chat_job(state, model, req, arrival).await?;
    submit_openai(state, model, job, Format::Chat).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let admitted = state.admit_body(body).await?;
    let model = &admitted.model;
    let req = CompletionRequest::parse(&admitted.bytes)?;
    let job = front::completion_job(&state, model, req, admitted.arrival).await?;
    let submitted = submit_openai(&state, model, job, Format::Completion).await?;
    let Whole {
        id,
        served,
        generation,
        fold,
    } = match answer(&state, submitted, admitted.guard).await? {
        Ran::Streamed(response) => return Ok(response),
        Ran::Collected(whole) => whole,
    };
    let usage = UsageJson::new(generation.prompt_tokens, fold.completion_tokens());
    Ok(Json(TextCompletion {
        id: &id,
        object: "text_completion",
        created: unix_now(),
        model: &served,
        system_fingerprint: SYSTEM_FINGERPRINT,
        choices: fold.text_choices(),
        usage: Some(usage),
    })
    .into_response())
}

async fn generate(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let Admitted {
        bytes,
        model,
        guard,
        arrival,
    } = state.admit_body(body).await?;
    let req = GenerateRequest::parse(&bytes)?;
    // One plain completion, through the same front.
    let req = CompletionRequest {
        model: req.model,
        prompts: vec![req.prompt],
        sampling: req.sampling,
        logprobs: None,
        echo: false,
        list_prompt_logprobs: false,
        streaming: Streaming::default(),
    };
    let job = front::completion_job(&state, &model, req, arrival).await?;
    let (requests, job) = front::engine_requests(&state, &model, job).await?;
    let mut generation = Generation::submit(&state, &model, requests, &job.prompts, arrival)?;
    let fold = ReplyFold::new(Format::Completion, false, vec![PromptOutput::default()]);
    let mut fold = fold_to_end(&mut generation, fold, &state).await?;
    drop(guard);
    let prompt_tokens = generation.prompt_tokens;
    let out = fold
        .choices
        .pop()
        .ok_or_else(|| ApiError::internal("the engine returned no output"))?;
    Ok(Json(GenerateResponse {
        usage: UsageJson::new(prompt_tokens, out.completion_tokens),
        response: out.text,
        token_ids: out.token_ids,
        finish_reason: out.finish_reason.unwrap_or("stop"),
    })
    .into_response())
}

/// A generation either answered as a stream, or collected for a JSON response.
pub(crate) enum Ran {
    Streamed(Response),
    Collected(Whole),
}

/// A generation answered whole: run to its end, and what its JSON response names.
pub(crate) struct Whole {
    id: String,
    served: String,
    generation: Generation,
    fold: ReplyFold,
}

/// A submitted chat or completion job.
pub(crate) struct Submitted {
    pub generation: Generation,
    /// The response id (`chatcmpl-…`, `cmpl-…`).
    pub id: String,
    pub served: String,
    /// The reply's fold, for the stream and the whole reply alike.
    fold: ReplyFold,
    streaming: Streaming,
}

/// Builds a chat or completion job's engine requests and submits them.
async fn submit_openai(
    state: &Arc<AppState>,
    model: &Arc<ModelContext>,
    job: OpenAiJob,
    format: Format,
) -> Result<Submitted, ApiError> {
    let (requests, job) = front::engine_requests(state, model, job).await?;
    let mut generation = Generation::submit(state, model, requests, &job.prompts, job.arrival)?;
    generation.prompt_media = job.prompt_media;
    let id = state.response_id(match format {
        Format::Chat => "chatcmpl",
        Format::Completion => "cmpl",
    });
    // Choices come `n` per prompt, in prompt order.
    let outputs = job
        .prompt_outputs
        .iter()
        .flat_map(|o| std::iter::repeat_n(o.clone(), job.sampling.n))
        .collect();
    let fold = ReplyFold::new(format, job.logprobs.is_some(), outputs);
    Ok(Submitted {
        generation,
        id,
        // The name the request chose: an adapter's, or the served model's.
        served: job
            .adapter
            .clone()
            .unwrap_or_else(|| state.config.served_model_name.clone()),
        fold,
        streaming: job.streaming,
    })
}

/// Streams a submitted job, or runs it to its end to be answered whole.
async fn answer(
    state: &Arc<AppState>,
    submitted: Submitted,
    guard: ActiveGuard,
) -> Result<Ran, ApiError> {
    let Submitted {
        generation,
        id,
        served,
        fold,
        streaming,
    } = submitted;
    if streaming.stream {
        let meta = StreamMeta {
            id,
            created: unix_now(),
            model: served,
            include_usage: streaming.include_usage,
        };
        return Ok(Ran::Streamed(sse::respond(
            generation,
            fold,
            meta,
            state.clone(),
            guard,
        )));
    }
    let mut generation = generation;
    let fold = fold_to_end(&mut generation, fold, state).await?;
    drop(guard);
    Ok(Ran::Collected(Whole {
        id,
        served,
        generation,
        fold,
    }))
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
