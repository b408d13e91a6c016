//! vLLM's routes for LoRA adapters at run time: `POST /v1/load_lora_adapter`
//! (`{"lora_name", "lora_path"}`: a PEFT folder or a GGUF LoRA file on the server's machine)
//! and `POST /v1/unload_lora_adapter` (`{"lora_name"}`), answered as vLLM
//! answers them (plain text on success). Served only when the server was
//! started with `--allow-runtime-lora`, since they read files the server
//! can reach; an adapter in use is not unloaded (409).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use gemma4_engine::AdapterError;

use crate::error::ApiError;
use crate::fields::Fields;
use crate::generation::blocking;
use crate::server::AppState;

/// `POST /v1/load_lora_adapter`.
pub async fn load(State(state): State<Arc<AppState>>, body: Body) -> Result<String, ApiError> {
    let f = admitted_fields(&state, body).await?;
    let name = required(&f, "lora_name")?;
    let path = required(&f, "lora_path")?;
    if name == state.config.served_model_name {
        return Err(ApiError::bad_request(format!(
            "`{name}` is the served model's name; name the adapter otherwise"
        ))
        .with_param("lora_name"));
    }
    let model = loaded(&state)?;
    let shown = name.clone();
    blocking(move || {
        model
            .engine
            .load_adapter(&name, std::path::Path::new(&path))
            .map_err(refused)
    })
    .await?;
    tracing::info!(adapter = %shown, "LoRA adapter loaded at run time");
    Ok(format!(
        "Success: LoRA adapter '{shown}' added successfully."
    ))
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload(State(state): State<Arc<AppState>>, body: Body) -> Result<String, ApiError> {
    let f = admitted_fields(&state, body).await?;
    let name = required(&f, "lora_name")?;
    let model = loaded(&state)?;
    let shown = name.clone();
    blocking(move || model.engine.unload_adapter(&name).map_err(refused)).await?;
    tracing::info!(adapter = %shown, "LoRA adapter unloaded");
    Ok(format!(
        "Success: LoRA adapter '{shown}' removed successfully."
    ))
}

/// The request's fields, once runtime loading is allowed.
async fn admitted_fields(state: &AppState, body: Body) -> Result<Fields, ApiError> {
    if !state.config.runtime_lora {
        return Err(ApiError::not_found(
            "loading LoRA adapters at run time is off; start the server with --allow-runtime-lora",
        )
        .with_code("runtime_lora_disabled"));
    }
    let bytes = state.read_body(body).await?;
    Fields::parse(&bytes)
}

fn required(f: &Fields, field: &str) -> Result<String, ApiError> {
    match f.string(field)? {
        Some(v) if !v.is_empty() => Ok(v.to_string()),
        _ => Err(ApiError::bad_request(format!("`{field}` is required")).with_param(field)),
    }
}

fn loaded(state: &AppState) -> Result<Arc<crate::server::ModelContext>, ApiError> {
    state.model().cloned().ok_or_else(|| {
        ApiError::unavailable(
            "the model is still loading; retry when GET /ready returns 200",
            "model_loading",
        )
    })
}

/// An engine's refusal in the API's shape.
fn refused(e: AdapterError) -> ApiError {
    let message = e.to_string();
    match e {
        AdapterError::NotFound(_) => ApiError::not_found(message).with_param("lora_name"),
        AdapterError::InUse { .. } => ApiError::conflict(message).with_code("lora_in_use"),
        AdapterError::Stopped => ApiError::unavailable(message, "engine_stopped"),
        AdapterError::Exists(_) => ApiError::bad_request(message).with_param("lora_name"),
        AdapterError::Full { .. } | AdapterError::RankTooHigh { .. } | AdapterError::Load(_) => {
            ApiError::bad_request(message).with_param("lora_path")
        }
    }
}
