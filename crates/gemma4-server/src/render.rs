//! vLLM's render routes: the prompt token ids (and media placeholders) that
//! a chat or completions request would run, and the sampling settings it
//! would run with, from the same request front, without running it. A
//! router that tokenizes through them on the serving pods (as llm-d's does)
//! indexes exactly the prefixes this server caches.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::Json;
use gemma4_engine::{GenerationRequest, SamplingParams};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::front::{self, OpenAiJob};
use crate::openai::{ChatRequest, CompletionRequest};
use crate::server::AppState;

/// `POST /v1/completions/render`: one rendered request per prompt.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let admitted = state.admit_body(body).await?;
    let model = &admitted.model;
    let req = CompletionRequest::parse(&admitted.bytes)?;
    let job = front::completion_job(&state, model, req, admitted.arrival).await?;
    let rendered = render(&state, model, job, "cmpl").await?;
    Ok(Json(Value::Array(rendered)))
}

/// `POST /v1/chat/completions/render`: the rendered conversation.
pub async fn chat(State(state): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let admitted = state.admit_body(body).await?;
    let model = &admitted.model;
    let req = ChatRequest::parse(&admitted.bytes)?;
    let job = front::chat_job(&state, model, req, admitted.arrival).await?;
    let mut rendered = render(&state, model, job, "chatcmpl").await?;
    rendered
        .pop()
        .map(Json)
        .ok_or_else(|| ApiError::internal("the chat request rendered no prompt"))
}

/// Each prompt of a job as vLLM's render routes show it: checked as the
/// request would be, and never submitted.
async fn render(
    state: &Arc<AppState>,
    model: &Arc<crate::server::ModelContext>,
    job: OpenAiJob,
    kind: &str,
) -> Result<Vec<Value>, ApiError> {
    let n = job.sampling.n.max(1);
    let media_kinds: Vec<&'static str> = job.prompt_media.iter().map(|m| m.kind).collect();
    let (requests, _) = front::engine_requests(state, model, job).await?;
    let served = &state.config.served_model_name;
    Ok(requests
        .iter()
        .step_by(n)
        .map(|r| {
            json!({
                "request_id": state.response_id(kind),
                "model": served,
                "token_ids": r.prompt_ids,
                "features": features(r, &media_kinds),
                "sampling_params": sampling_params(&r.params, n),
            })
        })
        .collect())
}

/// Where each media item sits in the prompt, and its content digest (the
/// key the prefix cache and the KV events use), by kind; `null` without media.
fn features(request: &GenerationRequest, kinds: &[&'static str]) -> Value {
    let Some(soft) = request.soft_prompt.as_ref().filter(|s| !s.media.is_empty()) else {
        return Value::Null;
    };
    let (mut hashes, mut placeholders) = (Map::new(), Map::new());
    for (span, kind) in soft.media.iter().zip(kinds) {
        push(&mut hashes, kind, json!(span.identifier));
        push(
            &mut placeholders,
            kind,
            json!({"offset": span.start, "length": span.end - span.start}),
        );
    }
    json!({"mm_hashes": hashes, "mm_placeholders": placeholders})
}

fn push(map: &mut Map<String, Value>, kind: &str, value: Value) {
    if let Value::Array(items) = map
        .entry(kind.to_owned())
        .or_insert_with(|| Value::Array(Vec::new()))
    {
        items.push(value);
    }
}

/// The settings the request would run with, in vLLM's names.
fn sampling_params(p: &SamplingParams, n: usize) -> Value {
    json!({
        "n": n,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "seed": p.seed,
        "max_tokens": p.max_tokens,
        "stop": p.stop_strings,
        "stop_token_ids": p.stop_token_ids,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
    })
}
