//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes: a prompt (or chat
//! messages rendered by the template, exactly as chat completions render them)
//! to token ids, and token ids back to text.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;
use crate::fields::Fields;
use crate::generation::{blocking, chat_prompt};
use crate::openai::ChatRequest;
use crate::routes::check_model_name;
use crate::server::{AppState, ModelContext};

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

fn ready(state: &AppState) -> Result<Arc<ModelContext>, ApiError> {
    state.model().cloned().ok_or_else(|| {
        ApiError::unavailable(
            "the model is still loading; retry when GET /ready returns 200",
            "model_loading",
        )
    })
}

/// `{prompt, add_special_tokens?}` or `{messages, add_generation_prompt?, tools?,
/// chat_template_kwargs?}` → `{tokens, count, max_model_len}`.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let model = ready(&state)?;
    let bytes = state.read_body(body).await?;
    let f = Fields::parse(&bytes)?;
    check_model_name(&state, f.string("model")?)?;
    let tokens = if f.get("messages").is_some() {
        let req = ChatRequest::parse(&bytes)?;
        let model = model.clone();
        blocking(move || chat_prompt(&model, &req)).await?.ids
    } else {
        let prompt = f
            .string("prompt")?
            .ok_or_else(|| {
                ApiError::bad_request("send `prompt` (text) or `messages` (a chat)")
                    .with_param("prompt")
            })?
            .to_owned();
        let add_special = f.bool("add_special_tokens")?.unwrap_or(true);
        let model = model.clone();
        blocking(move || {
            model
                .engine
                .tokenizer()
                .encode(&prompt, add_special)
                .map_err(|e| {
                    ApiError::bad_request(format!("cannot tokenize the prompt: {e}"))
                        .with_param("prompt")
                })
        })
        .await?
    };
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: model.max_model_len(),
    }))
}

/// `{tokens}` → `{prompt}` (special tokens included, as vLLM decodes).
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Body,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let model = ready(&state)?;
    let bytes = state.read_body(body).await?;
    let f = Fields::parse(&bytes)?;
    check_model_name(&state, f.string("model")?)?;
    let ids = f.token_ids("tokens")?.ok_or_else(|| {
        ApiError::bad_request("`tokens` is required: an array of token ids").with_param("tokens")
    })?;
    let tokenizer = model.engine.tokenizer();
    let vocab = tokenizer.vocab_size();
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_request(format!(
            "`tokens` has {bad}, outside the vocabulary (size {vocab})"
        ))
        .with_param("tokens"));
    }
    let prompt = tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::internal(format!("cannot decode the tokens: {e}")))?;
    Ok(Json(DetokenizeResponse { prompt }))
}
