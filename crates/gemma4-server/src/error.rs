//! Errors: [`ApiError`] is what a client sees (OpenAI's error JSON with a
//! status code); [`ServerError`] is what the embedding program sees.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or asks for something impossible.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
            .with_code("invalid_api_key")
    }

    /// 404: an unknown model or route.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    /// 409: the request conflicts with what the server is doing (an
    /// adapter unloaded while requests use it).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "invalid_request_error", message)
    }

    /// 405: a known route called with the wrong method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            message,
        )
    }

    /// 413: the body is larger than `--max-body`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            message,
        )
        .with_code("request_too_large")
    }

    /// 408: the body did not arrive within `--body-read-timeout`.
    pub fn body_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        )
        .with_code("body_timeout")
    }

    /// 429: the wait queue is full.
    pub fn rate_limited(message: impl Into<String>, retry_after: u64) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
            .with_code("rate_limit_exceeded");
        e.retry_after = Some(retry_after);
        e
    }

    /// 503: loading, draining, or the engine has stopped.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable_error",
            message,
        )
        .with_code(code)
    }

    /// 504: the request did not finish before its deadline.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", message)
            .with_code("request_timeout")
    }

    /// 500: the engine failed on this request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The error with every field it names (its `param`, and each name
    /// between backticks in its message) renamed: a request served as
    /// another API's request names the fields the client sent.
    pub fn renamed(mut self, rename: impl Fn(&str) -> String) -> Self {
        self.param = self.param.map(|p| rename(&p));
        let mut message = String::with_capacity(self.message.len());
        let mut parts = self.message.split('`');
        if let Some(first) = parts.next() {
            message.push_str(first);
        }
        // Odd pieces sit between backticks.
        for (i, part) in parts.enumerate() {
            message.push('`');
            if i % 2 == 0 {
                message.push_str(&rename(part));
            } else {
                message.push_str(part);
            }
        }
        self.message = message;
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// `name` with the first of `fields`' chat names that starts it (the whole
/// name, or a name followed by `.` or `[`) replaced by the other API's
/// name for that field; `None` when none starts it.
pub fn rename_field(name: &str, fields: &[(&str, &str)]) -> Option<String> {
    fields.iter().find_map(|(chat, theirs)| {
        let rest = name.strip_prefix(chat)?;
        (rest.is_empty() || rest.starts_with(['.', '['])).then(|| format!("{theirs}{rest}"))
    })
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Failures of the server as a whole (binding, serving).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("HTTP server failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("HTTP server task failed: {0}")]
    Task(String),
    #[error("{0}")]
    EngineFailed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_has_openai_shape() {
        let e = ApiError::bad_request("`temperature` must be a number").with_param("temperature");
        let body = e.body();
        assert_eq!(body["error"]["message"], "`temperature` must be a number");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "temperature");
        assert!(body["error"]["code"].is_null());
    }

    #[test]
    fn rate_limit_sets_retry_after() {
        let r = ApiError::rate_limited("queue full", 2).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            r.headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()),
            Some("2")
        );
    }
}
