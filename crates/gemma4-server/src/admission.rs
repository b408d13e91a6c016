//! Admission limits checked before a request is queued: body size (413) and
//! arrival time (408),
//! prompt and output length against the context (400 naming the limit),
//! the number of choices, and the engine's own refusals (429 with
//! `Retry-After` when the wait queue is full, 503 while draining).

use std::time::Duration;

use axum::body::{Body, Bytes};
use gemma4_engine::{EngineConfig, SubmitError};
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

/// The output length of a request with a `prompt_len`-token prompt: the
/// requested `max_tokens` if prompt and output fit the context, else a 400
/// naming the limit; without a request, `default` bounded by what is left.
pub fn max_tokens_for(
    requested: Option<usize>,
    prompt_len: usize,
    max_model_len: usize,
    default: usize,
    prompt_param: &str,
) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_request("the prompt is empty").with_param(prompt_param));
    }
    if prompt_len >= max_model_len {
        return Err(ApiError::bad_request(format!(
            "the prompt has {prompt_len} tokens but the context length (max_model_len) is {max_model_len}, \
             which leaves no room for output; shorten the prompt or start the server with a larger --max-model-len"
        ))
        .with_param(prompt_param)
        .with_code("context_length_exceeded"));
    }
    let room = max_model_len - prompt_len;
    match requested {
        Some(m) if m > room => Err(ApiError::bad_request(format!(
            "max_tokens is {m} but the prompt has {prompt_len} tokens and the context length (max_model_len) is \
             {max_model_len}; set max_tokens to at most {room} or shorten the prompt"
        ))
        .with_param("max_tokens")
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
        None => Ok(default.clamp(1, room)),
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

    #[test]
    fn prompt_over_the_context_names_the_limit() {
        let e = max_tokens_for(None, 100, 100, 16, "prompt").expect_err("rejected");
        assert!(
            e.message.contains("max_model_len") && e.message.contains("100"),
            "{}",
            e.message
        );
        assert_eq!(e.code, Some("context_length_exceeded"));
    }

    #[test]
    fn max_tokens_must_fit_the_remaining_context() {
        let e = max_tokens_for(Some(50), 60, 100, 16, "prompt").expect_err("rejected");
        assert!(e.message.contains("at most 40"), "{}", e.message);
        assert_eq!(
            max_tokens_for(Some(40), 60, 100, 16, "prompt").ok(),
            Some(40)
        );
    }

    #[test]
    fn default_max_tokens_is_bounded_by_the_remaining_context() {
        assert_eq!(max_tokens_for(None, 10, 100, 256, "prompt").ok(), Some(90));
        assert_eq!(
            max_tokens_for(None, 10, 1000, 256, "prompt").ok(),
            Some(256)
        );
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
