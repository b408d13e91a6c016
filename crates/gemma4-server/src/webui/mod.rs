//! The chat page at `/` (off with `--no-webui`): one HTML page, its script
//! and style sheet, embedded in the binary. The page calls the keyed
//! `/webui/info` for what the model can do, then `/v1/chat/completions`
//! (streamed); it asks for the API key when the server answers 401 and
//! keeps it in the tab's session storage. A content security policy lets
//! the page run only its own script and talk only to this server.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::server::AppState;

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("style.css");

const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
     img-src 'self' data: blob:; media-src 'self' data: blob:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /`.
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

/// `GET /webui/app.js`.
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /webui/style.css`.
pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

/// `GET /webui/info`: what the page may offer: chat (a template), thinking,
/// image and audio attachments (the model's encoders).
pub async fn info(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let (model, _guard) = state.admit()?;
    let can = model.capabilities();
    Ok(Json(json!({
        "model": state.config.served_model_name,
        "chat": can.chat,
        "thinking": can.thinking,
        "images": can.images,
        "audio": can.audio,
        "max_model_len": model.max_model_len(),
    })))
}
