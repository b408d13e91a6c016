//! Optional API key: with `--api-key`, the model routes need
//! `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`), compared
//! in constant time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::server::AppState;

/// Whether the headers carry `key` as a bearer token or an `x-api-key`.
pub fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    if x_api_key.is_some_and(|k| bool::from(k.trim().as_bytes().ct_eq(key.as_bytes()))) {
        return true;
    }
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && bool::from(token.trim().as_bytes().ct_eq(key.as_bytes()))
}

/// Middleware for the routes that need the key.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        if !authorized(request.headers(), key) {
            let e = ApiError::unauthorized(
                "missing or wrong API key: send the header `Authorization: Bearer KEY` (or `x-api-key: KEY`) with \
                 the key the server was started with (--api-key or GEMMA4_API_KEY)",
            );
            if request.uri().path().starts_with("/v1/messages") {
                return crate::anthropic::AnthropicError(e).into_response();
            }
            return e.into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("ascii"),
        );
        h
    }

    #[test]
    fn bearer_token_must_match_exactly() {
        assert!(authorized(&headers("Bearer s3cret"), "s3cret"));
        assert!(authorized(&headers("bearer s3cret"), "s3cret"));
        assert!(!authorized(&headers("Bearer s3cre"), "s3cret"));
        assert!(!authorized(&headers("Bearer s3cretX"), "s3cret"));
        assert!(!authorized(&headers("Basic s3cret"), "s3cret"));
        assert!(!authorized(&headers("s3cret"), "s3cret"));
        assert!(!authorized(&HeaderMap::new(), "s3cret"));
        let mut anthropic = HeaderMap::new();
        anthropic.insert("x-api-key", HeaderValue::from_static("s3cret"));
        assert!(authorized(&anthropic, "s3cret"));
        anthropic.insert("x-api-key", HeaderValue::from_static("s3cre"));
        assert!(!authorized(&anthropic, "s3cret"));
    }
}
