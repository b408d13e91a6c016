//! `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` in vLLM's
//! shapes: a prompt (or chat messages rendered by the template, exactly as
//! chat completions render them) to token ids, token ids back to text, and
//! the tokenizer's special tokens and chat template, which evaluation
//! harnesses (lm-evaluation-harness's remote tokenizer) read to tokenize
//! through the server.

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

#[derive(Debug, Serialize)]
pub struct TokenizerInfo {
    pub tokenizer_class: &'static str,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Gemma's `<pad>`, where the vocabulary has it.
    pub pad_token: Option<String>,
    pub add_bos_token: bool,
    /// The template chat requests are rendered with (none where chat is not served).
    pub chat_template: Option<String>,
    pub model_max_length: usize,
    pub vocab_size: usize,
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

/// `GET /tokenizer_info`: the special tokens, the chat template and the lengths.
pub async fn tokenizer_info(
    State(state): State<Arc<AppState>>,
) -> Result<Json<TokenizerInfo>, ApiError> {
    let model = ready(&state)?;
    let tokenizer = model.engine.tokenizer();
    Ok(Json(TokenizerInfo {
        tokenizer_class: "GemmaTokenizer",
        bos_token: tokenizer.bos_token().map(str::to_owned),
        eos_token: tokenizer.eos_token().map(str::to_owned),
        pad_token: tokenizer.token_to_id("<pad>").map(|_| "<pad>".to_owned()),
        add_bos_token: tokenizer.add_bos_token(),
        chat_template: model
            .chat_template
            .as_ref()
            .ok()
            .map(|t| t.source().to_owned()),
        model_max_length: model.max_model_len(),
        vocab_size: tokenizer.vocab_size(),
    }))
}
