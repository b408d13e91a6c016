//! Admission limits checked before a request is queued: body size (413) and
//! arrival time (408), the engine's request limits as a 400 naming the
//! field, the number of choices, and the engine's own refusals (429 with
//! `Retry-After` when the wait queue is full, 503 while draining).

use std::time::Duration;

use axum::body::{Body, Bytes};
use gemma4_engine::{EngineConfig, LimitError, RequestPart, SubmitError};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;
use crate::server::draining;

/// Seconds a client is told to wait after a 429.
pub const RETRY_AFTER_SECS: u64 = 1;

/// Reads the whole body, refusing more than `limit` bytes (413) and a body
/// still incomplete after `timeout` (408).
pub async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let collected = tokio::time::timeout(timeout, Limited::new(body, limit).collect())
        .await
        .map_err(|_| {
            ApiError::body_timeout(format!(
                "the request body did not arrive within {} s (--body-read-timeout); send the whole body at once",
                timeout.as_secs_f64()
            ))
        })?;
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(ApiError::too_large(format!(
            "the request body is larger than {limit} bytes; send a smaller request or start the server with a larger --max-body"
        ))),
        Err(e) => Err(ApiError::bad_request(format!("cannot read the request body: {e}"))),
    }
}

/// A request over one of the engine's limits as a 400 naming the field:
/// the prompt's (`prompt_param`: `prompt`, `messages` or `input`) for the
/// prompt and its media, else the field that set the part.
pub fn limit_error(e: LimitError, prompt_param: &str) -> ApiError {
    let param = match e.part {
        RequestPart::Prompt | RequestPart::Media => prompt_param,
        RequestPart::MaxTokens => "max_tokens",
        RequestPart::StopTokenIds => "stop_token_ids",
        RequestPart::StopStrings => "stop",
        RequestPart::LogitBias => "logit_bias",
    };
    let message = match e.part {
        RequestPart::Prompt | RequestPart::MaxTokens => e.message,
        _ => format!("`{param}`: {}", e.message),
    };
    let error = ApiError::bad_request(message).with_param(param);
    match e.context_length {
        true => error.with_code("context_length_exceeded"),
        false => error,
    }
}

/// Refuses `n` choices that could never all be admitted at once: a request's
/// sequences all enter the engine's queue before any of them runs, so more
/// than `--max-queue` of them would be refused on an idle server too.
pub fn check_choice_count(choices: usize, engine: &EngineConfig) -> Result<(), ApiError> {
    if choices > engine.max_queue {
        return Err(ApiError::bad_request(format!(
            "the request asks for {choices} sequences (n times the number of prompts) but the server queues at most \
             {} at once (--max-queue); lower n",
            engine.max_queue
        ))
        .with_param("n"));
    }
    Ok(())
}

/// The client-facing form of an engine refusal.
pub fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(waiting) => ApiError::rate_limited(
            format!(
                "the server is at capacity ({waiting} requests already waiting); retry after {RETRY_AFTER_SECS} s \
                 (the limit is --max-queue)"
            ),
            RETRY_AFTER_SECS,
        ),
        SubmitError::Draining => draining(),
        SubmitError::Invalid(msg) => ApiError::bad_request(msg),
        SubmitError::Stopped => ApiError::unavailable("the engine has stopped; restart the server", "engine_stopped"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> gemma4_engine::RequestLimits {
        gemma4_engine::RequestLimits {
            max_model_len: 100,
            token_id_limit: 50,
            max_batch_tokens: 64,
            hidden_size: 8,
            bidirectional_vision: false,
            media: Default::default(),
        }
    }

    #[test]
    fn a_limit_names_the_requests_field() {
        let l = limits();
        let e = limit_error(l.max_tokens(None, 100, 16).expect_err("full"), "messages");
        assert!(e.message.contains("max_model_len"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        let e = limit_error(l.max_tokens(Some(50), 60, 16).expect_err("over"), "prompt");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("at most 40"), "{}", e.message);
        let mut r = gemma4_engine::GenerationRequest::new(vec![1], Default::default());
        r.params.logit_bias = vec![(60, 1.0)];
        let e = limit_error(l.check(&r).expect_err("outside"), "prompt");
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
        assert!(
            e.message.starts_with("`logit_bias`: token id 60"),
            "{}",
            e.message
        );
        assert_eq!(e.code, None);
    }

    #[test]
    fn more_choices_than_the_queue_holds_is_a_400() {
        let engine = EngineConfig {
            max_num_seqs: 16,
            max_queue: 64,
            ..EngineConfig::default()
        };
        assert!(check_choice_count(64, &engine).is_ok());
        let e = check_choice_count(65, &engine).expect_err("never admissible");
        assert_eq!(e.status.as_u16(), 400);
        assert_eq!(e.param.as_deref(), Some("n"));
        assert!(e.message.contains("--max-queue"), "{}", e.message);
    }

    #[test]
    fn queue_full_is_429_with_retry_after() {
        let e = submit_error(SubmitError::QueueFull(3));
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.retry_after, Some(RETRY_AFTER_SECS));
        assert_eq!(submit_error(SubmitError::Draining).status.as_u16(), 503);
    }

    #[tokio::test]
    async fn body_limit_is_413() {
        let e = read_body(Body::from(vec![b'x'; 100]), 10, Duration::from_secs(5))
            .await
            .expect_err("rejected");
        assert_eq!(e.status.as_u16(), 413);
        assert!(e.message.contains("--max-body"));
        let ok = read_body(Body::from("{}"), 10, Duration::from_secs(5))
            .await
            .expect("small body");
        assert_eq!(&ok[..], b"{}");
    }
}
